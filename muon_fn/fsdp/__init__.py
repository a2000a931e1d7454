"""FSDP2 adapter: owner-computes Muon on ``fully_shard`` models.

``FSDPMuonOptimizer`` runs single-device ``muon_fn.MuonOptimizer``'s recipe with each weight
matrix orthogonalized whole on one owner rank (planned by :mod:`muon_fn.fsdp._plan`, exchanged by
:mod:`muon_fn.fsdp._exchange`) and the elementwise parts on each rank's rows; its results equal
MuonOptimizer's bit for bit. :class:`muon_fn.fsdp._adapter.FSDPAdapter` runs another optimizer's
recipe the same way: :class:`FSDPSpectralSphereOptimizer` runs SpectralSphereOptimizer's.
``python -m muon_fn.fsdp.bench`` measures it against the replicate baseline. :func:`plan_model`
predicts the plan's per-rank cost for real model shapes (:mod:`muon_fn.fsdp.specs`) at any world
size without a process group (``muon-fn plan``).
"""

from ._adapter import STRATEGIES
from ._optimizer import FSDPMuonOptimizer
from ._plan import Plan, chunk_rows, make_plan
from ._plan_cli import format_plan
from ._predict import Mesh, PlanReport, parse_mesh, plan_model
from ._sso import FSDPSpectralSphereOptimizer
from .specs import SPECS

__all__ = ["FSDPMuonOptimizer", "FSDPSpectralSphereOptimizer", "STRATEGIES", "Plan", "chunk_rows", "make_plan",
           "plan_model", "PlanReport", "Mesh", "parse_mesh", "format_plan", "SPECS"]
