"""FSDP2 adapter: owner-computes Muon on ``fully_shard`` models.

``FSDPMuonOptimizer`` runs single-device ``muon_fn.MuonOptimizer``'s recipe with each weight
matrix orthogonalized whole on one owner rank (planned by :mod:`muon_fn.fsdp._plan`, exchanged by
:mod:`muon_fn.fsdp._exchange`) and the elementwise parts on each rank's rows; its results equal
MuonOptimizer's bit for bit. Every optimizer of :mod:`muon_fn.optim` on DTensors runs its
recipe the same way: :class:`FSDPSpectralSphereOptimizer` runs SpectralSphereOptimizer's.
``muon-fn bench fsdp`` measures it against the replicate baseline. :func:`plan_model` predicts
the plan's per-rank cost for real model shapes (:mod:`muon_fn.fsdp.specs`) at any world size
without a process group, at a GEMM rate and link bandwidth (default :data:`DEFAULT_GEMM_TFLOPS`,
:data:`DEFAULT_LINK_GBPS`); :func:`format_plan` lays its reports out as the table ``muon-fn plan``
prints.
"""

from typing import Any

from ..optim import engine

from ._plan import Plan, chunk_rows, make_plan
from ._plan_table import format_plan
from ._predict import DEFAULT_GEMM_TFLOPS, DEFAULT_LINK_GBPS, Mesh, PlanReport, parse_mesh, plan_model
from .specs import SPECS

# The optimizers and their strategies are imported on first use: their modules load
# torch.distributed.tensor (about a second, sympy included), which the planner (``muon-fn plan``)
# does not need.
_LAZY = {
    "FSDPMuonOptimizer": "muon_fn.fsdp._optimizer",
    "FSDPSpectralSphereOptimizer": "muon_fn.fsdp._sso",
    "STRATEGIES": "muon_fn.fsdp._executor",
}

__all__ = ["FSDPMuonOptimizer", "FSDPSpectralSphereOptimizer", "STRATEGIES", "Plan", "chunk_rows", "make_plan",
           "plan_model", "PlanReport", "Mesh", "parse_mesh", "format_plan", "DEFAULT_GEMM_TFLOPS", "DEFAULT_LINK_GBPS",
           "SPECS"]


def distribute(optimizer: Any, previous: Any = None, copied: Any = None) -> None:
    """Run ``optimizer``, a :mod:`muon_fn.optim` optimizer holding DTensor parameters, on the
    distributed (owner-computes) executor from now on (collective: every rank calls it). The
    optimizers call it themselves, through :func:`muon_fn.optim.engine.distribute`, with which this
    package registers it: at construction, after a swap (``previous``: the parameters held
    before it, per group and position) and for a copy (``copied``)."""
    from ._adopt import adopt

    adopt(optimizer, previous, copied)


engine.register_distributed(distribute)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'muon_fn.fsdp' has no attribute {name!r}")
