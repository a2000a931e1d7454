"""The distributed executor: the owner-computes step on DTensors (routes, phases, plan, exchange,
rows, overlap) and its planner. Imports :mod:`muon_fn.engine`'s interface and :mod:`muon_fn.core`.

Each weight matrix is orthogonalized whole on one owner rank (planned by :func:`make_plan`,
exchanged bucket by bucket) and the elementwise parts run on each rank's rows; the results equal
the single-device optimizer's bit for bit. Every optimizer of :mod:`muon_fn.optimizers` holding
DTensors runs its step through this executor: the package registers :func:`distribute` with the
engine when it is imported. :func:`plan_model` predicts the plan's per-rank cost for real model
shapes (:mod:`muon_fn.distributed.specs`) at any world size without a process group, at a GEMM
rate and link bandwidth (default :data:`DEFAULT_GEMM_TFLOPS`, :data:`DEFAULT_LINK_GBPS`);
:func:`format_plan` lays its reports out as the table ``muon-fn plan`` prints.
"""

from typing import Any

from .. import engine
from . import specs
from ._plan import Plan, chunk_rows, make_plan
from ._plan_table import format_plan
from ._predict import DEFAULT_GEMM_TFLOPS, DEFAULT_LINK_GBPS, Mesh, PlanReport, parse_mesh, plan_model
from .specs import SPECS

# The executor's module is imported on first use: it loads torch.distributed.tensor (about a
# second, sympy included), which the planner (``muon-fn plan``) does not need.
_LAZY = ("STRATEGIES", "check_model")

__all__ = ["STRATEGIES", "check_model", "distribute", "Plan", "chunk_rows", "make_plan", "plan_model", "PlanReport",
           "Mesh", "parse_mesh", "format_plan", "DEFAULT_GEMM_TFLOPS", "DEFAULT_LINK_GBPS", "SPECS", "specs"]


def distribute(optimizer: Any, previous: Any = None, copied: Any = None) -> None:
    """Run ``optimizer``, a :mod:`muon_fn.optimizers` optimizer holding DTensor parameters, on the
    distributed (owner-computes) executor from now on (collective: every rank calls it). The
    optimizers call it themselves, through :func:`muon_fn.engine.distribute`, with which this
    package registers it: at construction, after a swap (``previous``: the parameters held
    before it, per group and position) and for a copy (``copied``)."""
    from ._adopt import adopt

    adopt(optimizer, previous, copied)


engine.register_distributed(distribute)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from . import _executor

        return getattr(_executor, name)
    raise AttributeError(f"module 'muon_fn.distributed' has no attribute {name!r}")
