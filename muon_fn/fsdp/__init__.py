"""FSDP2 adapter: owner-computes Muon on ``fully_shard`` models (the public names of
:mod:`muon_fn.distributed` and the FSDP optimizer classes of :mod:`muon_fn.optimizers`).

``FSDPMuonOptimizer`` runs single-device ``muon_fn.MuonOptimizer``'s recipe with each weight
matrix orthogonalized whole on one owner rank (planned by :func:`make_plan`, exchanged bucket by
bucket by :mod:`muon_fn.distributed`) and the elementwise parts on each rank's rows; its results
equal MuonOptimizer's bit for bit. Every optimizer of :mod:`muon_fn.optim` on DTensors runs its
recipe the same way: :class:`FSDPSpectralSphereOptimizer` runs SpectralSphereOptimizer's.
``muon-fn bench fsdp`` measures it against torch.optim.Muon. :func:`plan_model` predicts the
plan's per-rank cost for real model shapes (:mod:`muon_fn.distributed.specs`) at any world size
without a process group, at a GEMM rate and link bandwidth (default :data:`DEFAULT_GEMM_TFLOPS`,
:data:`DEFAULT_LINK_GBPS`); :func:`format_plan` lays its reports out as the table ``muon-fn plan``
prints.
"""

from typing import Any

from .. import distributed, optimizers
from ..distributed import (DEFAULT_GEMM_TFLOPS, DEFAULT_LINK_GBPS, SPECS, Mesh, Plan, PlanReport, chunk_rows,
                           format_plan, make_plan, parse_mesh, plan_model)
from ..distributed import specs  # noqa: F401  muon_fn.fsdp.specs: the model specs, as before

# The optimizers and their strategies are imported on first use: their modules load
# torch.distributed.tensor (about a second, sympy included), which the planner (``muon-fn plan``)
# does not need.
_LAZY = {"FSDPMuonOptimizer": optimizers, "FSDPSpectralSphereOptimizer": optimizers, "STRATEGIES": distributed}

__all__ = ["FSDPMuonOptimizer", "FSDPSpectralSphereOptimizer", "STRATEGIES", "Plan", "chunk_rows", "make_plan",
           "plan_model", "PlanReport", "Mesh", "parse_mesh", "format_plan", "DEFAULT_GEMM_TFLOPS", "DEFAULT_LINK_GBPS",
           "SPECS"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(_LAZY[name], name)
    raise AttributeError(f"module 'muon_fn.fsdp' has no attribute {name!r}")
