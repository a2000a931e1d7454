"""FSDP2 adapter: owner-computes Muon on ``fully_shard`` models.

``FSDPMuonOptimizer`` runs single-device ``muon_fn.MuonOptimizer``'s recipe with each weight
matrix orthogonalized whole on one owner rank (planned by :mod:`muon_fn.fsdp._plan`, exchanged by
:mod:`muon_fn.fsdp._exchange`) and the elementwise parts on each rank's rows; its results equal
MuonOptimizer's bit for bit. :class:`muon_fn.fsdp._adapter.FSDPAdapter` runs another optimizer's
recipe the same way: :class:`FSDPSpectralSphereOptimizer` runs SpectralSphereOptimizer's.
``python -m muon_fn.fsdp.bench`` measures it against the replicate baseline.
"""

from ._adapter import STRATEGIES
from ._optimizer import FSDPMuonOptimizer
from ._plan import Plan, chunk_rows, make_plan
from ._sso import FSDPSpectralSphereOptimizer

__all__ = ["FSDPMuonOptimizer", "FSDPSpectralSphereOptimizer", "STRATEGIES", "Plan", "chunk_rows", "make_plan"]
