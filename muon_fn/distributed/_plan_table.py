"""The owner-computes plan's predicted costs as a markdown table: :func:`format_plan` of
:func:`~muon_fn.fsdp.plan_model`'s reports, one row each (the table ``muon-fn plan`` prints; the
columns are explained in docs/distributed.md)."""

from __future__ import annotations

from collections.abc import Sequence

from ._predict import PlanReport

COLUMNS = ("model", "mesh", "matrices", "units", "buckets", "NS FLOPs/rank max", "max/mean",
           "lower bound", "efficiency", "idle ranks", "sent/rank mean", "2(W−1)/W²·S", "sent max",
           "received max", "extra peak max", "compute", "comm", "step")
STATE_COLUMN = "state/rank max"  # after "extra peak max", when the reports count the state


def _row(r: PlanReport) -> list[str]:
    w = r.world_size
    compute = max(r.flops) / r.gemm_flops_per_s
    comm = max(max(s, v) for s, v in zip(r.sent, r.received)) / r.link_bytes_per_s
    gb = lambda b: _si(b, "B")  # noqa: E731
    return [r.model, str(r.mesh), str(r.matrices), str(r.units), str(len(r.plan.buckets)),
            _si(max(r.flops), "FLOP"), f"{r.flops_max_mean:.3f}", f"{r.bound_max_mean:.3f}",
            f"{r.efficiency:.0%}", f"{r.idle_ranks}/{w}", gb(r.sent_mean), gb(r.bytes_formula),
            gb(max(r.sent)), gb(max(r.received)), gb(max(r.peak)),
            *([gb(max(r.state))] if r.state else []), _seconds(compute), _seconds(comm),
            _seconds(r.step_s)]


def _si(value: float, unit: str) -> str:
    """``value`` with an SI prefix, 3 significant digits: 1.23 GB, 45.6 TFLOP."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def _seconds(value: float) -> str:
    if value >= 1:
        return f"{value:.3g} s"
    return f"{value * 1e3:.3g} ms" if value >= 1e-3 else f"{value * 1e6:.3g} µs"


def format_plan(reports: Sequence[PlanReport]) -> str:
    """A markdown table of ``reports``, one row each (columns: docs/distributed.md)."""
    columns = list(COLUMNS)
    if reports and all(r.state for r in reports):
        columns.insert(columns.index("extra peak max") + 1, f"{STATE_COLUMN} ({reports[0].state_bits}-bit)")
    rows = [columns] + [_row(r) for r in reports]
    lines = ["| " + " | ".join(row) + " |" for row in rows]
    lines.insert(1, "|" + "---|" * len(columns))
    return "\n".join(lines)
