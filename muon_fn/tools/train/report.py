"""What ``muon-fn train`` reports: per optimizer, the mean and spread of the final validation loss
over seeds, the steps each run needs to reach AdamW's final validation loss, and the table."""

from __future__ import annotations

import itertools
import math
import statistics
from typing import Any


def steps_to_reach(val: list[list[float]], target: float) -> float | None:
    """The first step at which the validation curve ``[[step, loss], ...]`` reaches ``target``,
    interpolated linearly between evaluations; ``None`` if it never does."""
    for (s0, v0), (s1, v1) in itertools.pairwise(val):
        if v1 <= target:
            if v0 <= target:
                return float(s0)
            return s0 + (s1 - s0) * (v0 - target) / (v0 - v1)
    return float(val[0][0]) if val and val[0][1] <= target else None


def add_steps_to_adamw(results: list[dict[str, Any]]) -> None:
    """Give every run ``steps_to_adamw_final``: the steps it needs to reach the final validation
    loss of the AdamW run with the same seed (when one was run)."""
    targets = {r["seed"]: r["final_val_loss"] for r in results if r["optimizer"] == "adamw"}
    for r in results:
        target = targets.get(r["seed"])
        r["steps_to_adamw_final"] = None if target is None else steps_to_reach(r["history"]["val"], target)


def optimizer_share(step_time: list[list[float]]) -> dict[str, Any] | None:
    """The optimizer's share of a training step from ``[[step, optimizer_s, step_s], ...]``: the
    median time in ``optimizer.step`` over the median time of the whole step (medians: a compiling
    first step does not move them); ``None`` without steps."""
    if not step_time:
        return None
    opt, step = (statistics.median(t[i] for t in step_time) for i in (1, 2))
    return {"optimizer_step_s": opt, "step_s": step, "optimizer_share": opt / step if step > 0 else None,
            "steps": len(step_time)}


def summarize(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per label (optimizer spec), over its seeds: mean, sample std, standard error, min and max of
    the final validation loss, the mean of the final training loss, steps to AdamW's final loss
    (mean over the seeds that reached it), CPU time and the optimizer's share of a step."""
    by_label: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        by_label.setdefault(r["label"], []).append(r)
    out = {}
    for label, runs in by_label.items():
        vals = [r["final_val_loss"] for r in runs]
        std = statistics.stdev(vals) if len(vals) > 1 else 0.0
        reached = [r["steps_to_adamw_final"] for r in runs if r.get("steps_to_adamw_final") is not None]
        out[label] = {
            "seeds": [r["seed"] for r in runs], "final_val_loss": vals,
            "mean": statistics.fmean(vals), "std": std, "stderr": std / math.sqrt(len(vals)),
            "min": min(vals), "max": max(vals),
            "train_mean": statistics.fmean(r["final_train_loss"] for r in runs),
            "steps_to_adamw_final": statistics.fmean(reached) if reached else None,
            "reached_adamw_final": f"{len(reached)}/{len(runs)}",
            "cpu_s": statistics.fmean(r["cpu_s"] for r in runs),
            "optimizer_share": _mean_of(runs, "optimizer_share"),
            "step_s": _mean_of(runs, "step_s"),
            "description": runs[0]["description"],
        }
    return out


def _mean_of(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.fmean(values) if values else None


def comparison_table(summary: dict[str, dict[str, Any]], steps: int) -> str:
    """The printed table: one row per optimizer, best mean first, with the gap to the best."""
    head = ["optimizer", "seeds", "val loss mean", "± s.e.", "min", "max", "vs best", "train loss",
            "steps to AdamW's final", "CPU time/run", "optimizer.step share"]
    order = sorted(summary, key=lambda k: summary[k]["mean"])
    best = summary[order[0]]["mean"]
    rows = []
    for label in order:
        s = summary[label]
        reach = ("-" if s["steps_to_adamw_final"] is None
                 else f"{s['steps_to_adamw_final']:.0f} of {steps} ({s['reached_adamw_final']})")
        rows.append([label, str(len(s["seeds"])), f"{s['mean']:.4f}", f"{s['stderr']:.4f}", f"{s['min']:.4f}",
                     f"{s['max']:.4f}", "-" if s["mean"] == best else f"+{s['mean'] - best:.4f}",
                     f"{s['train_mean']:.4f}", reach, f"{s['cpu_s']:.0f} s", _share(s)])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]

    def fmt(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    lines = [fmt(head), fmt(["-" * w for w in widths]), *(fmt(r) for r in rows)]
    if any(summary[k].get("optimizer_share") is not None for k in order):
        lines.append("optimizer.step share: the median time in optimizer.step over the median training step "
                     "(batch, forward, backward, step; device-synchronized)")
    if len(order) > 1:
        lines.append(f"lowest mean validation loss at equal steps: {order[0]}")
    return "\n".join(lines)


def _share(s: dict[str, Any]) -> str:
    if s.get("optimizer_share") is None:
        return "-"
    return f"{100 * s['optimizer_share']:.1f} % of {s['step_s'] * 1e3:.1f} ms"
