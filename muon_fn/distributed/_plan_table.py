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
STEP_PEAK_COLUMN = "step peak/rank max"  # then, when the reports predict the step transient
TOTAL_COLUMN = "state + step peak max"  # then, when they count both


def _row(r: PlanReport, peaks: bool = False) -> list[str]:
    w = r.world_size
    compute = max(r.flops) / r.gemm_flops_per_s
    comm = max(max(s, v) for s, v in zip(r.sent, r.received)) / r.link_bytes_per_s
    gb = lambda b: _si(b, "B")  # noqa: E731
    return [r.model, str(r.mesh), str(r.matrices), str(r.units), str(len(r.plan.buckets)),
            _si(max(r.flops), "FLOP"), f"{r.flops_max_mean:.3f}", f"{r.bound_max_mean:.3f}",
            f"{r.efficiency:.0%}", f"{r.idle_ranks}/{w}", gb(r.sent_mean), gb(r.bytes_formula),
            gb(max(r.sent)), gb(max(r.received)), gb(max(r.peak)),
            *([gb(max(r.state))] if r.state else []), *(_peak_cells(r) if peaks else []),
            _seconds(compute), _seconds(comm), _seconds(r.step_s)]


def _peak_cells(r: PlanReport) -> list[str]:
    """The step peak per rank (max) and, with the state counted, state + step peak (max over
    the ranks of a shard group, each rank its own state and transient)."""
    cells = [_si(max(r.step_peak), "B")]
    if r.state:
        w = len(r.state)
        cells.append(_si(max(r.state[k % w] + p for k, p in enumerate(r.step_peak)), "B"))
    return cells


def inflight_label(inflight_bytes: int | None) -> str:
    """``8 MiB``, ``1.5 GiB``, ``1000 B`` or ``none`` (no bound)."""
    if inflight_bytes is None:
        return "none"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if inflight_bytes >= scale:
            return f"{inflight_bytes / scale:g} {unit}"
    return f"{inflight_bytes} B"


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
    state = bool(reports) and all(r.state for r in reports)
    peaks = bool(reports) and all(r.step_peak for r in reports)
    extra = [f"{STATE_COLUMN} ({reports[0].state_bits}-bit)"] if state else []
    if peaks:
        budgets = ", ".join(dict.fromkeys(inflight_label(r.inflight_bytes) for r in reports))
        extra += [f"{STEP_PEAK_COLUMN} (inflight {budgets})"] + ([TOTAL_COLUMN] if state else [])
    at = columns.index("extra peak max") + 1
    columns[at:at] = extra
    rows = [columns] + [_row(r, peaks) for r in reports]
    lines = ["| " + " | ".join(row) + " |" for row in rows]
    lines.insert(1, "|" + "---|" * len(columns))
    return "\n".join(lines)
