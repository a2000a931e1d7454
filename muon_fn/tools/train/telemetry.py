"""``muon-fn train --metrics``: the optimizer's figures (``optimizer.metrics()``) of each measured
step as a series of the run, ``history["metrics"]`` in metrics.json:

    {"step": [1, 2, ...], "muon/update_norm": [0.035, 0.07, ...], "<param>/update_rms": [...], ...}

one list per figure, aligned with ``"step"`` (the training step the figures describe; ``null``
where a figure was not recorded that step). The figures are float32 values: they are kept to
7 significant digits, and metrics.json writes each list on one line (a run of 300 steps of the
tiny model, every step measured, takes about 1 MB).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

SIGNIFICANT = 7


def _round(value: float) -> float:
    return float(f"{value:.{SIGNIFICANT}g}") if math.isfinite(value) else value


def record(history: dict[str, Any], step: int, figures: dict[str, float]) -> None:
    """Append the figures of training step ``step`` to ``history["metrics"]`` (the optimizer's own
    ``"step"`` entry is left out: after ``--resume`` it counts from the restart)."""
    series = history.setdefault("metrics", {"step": []})
    n = len(series["step"])
    series["step"].append(step)
    for name, value in figures.items():
        if name != "step":
            series.setdefault(name, [None] * n).append(_round(value))
    for column in series.values():
        if len(column) < n + 1:
            column.append(None)


def dumps(doc: dict[str, Any]) -> str:
    """``json.dumps(doc, indent=1)``, but each list of a run's ``history["metrics"]`` on one line."""
    compact: list[str] = []

    def mark(values: list) -> str:
        compact.append(json.dumps(values, separators=(",", ":")))
        return f"\x00series{len(compact) - 1}\x00"

    def thin(run: dict) -> dict:
        series = run.get("history", {}).get("metrics")
        if not isinstance(series, dict):
            return run
        return {**run, "history": {**run["history"], "metrics": {k: mark(v) for k, v in series.items()}}}

    marked = {**doc, "runs": [thin(r) for r in doc.get("runs", [])]}
    text = json.dumps(marked, indent=1, default=str)
    return re.sub(r'"\\u0000series(\d+)\\u0000"', lambda m: compact[int(m.group(1))], text)


def groups(series: dict[str, list]) -> tuple[list[str], list[str]]:
    """The group labels of a series: those whose matrices are orthogonalized (they report an
    orthogonality residual: Muon, NorMuon, SSO) and the others (AdamW)."""
    labels = [k.rpartition("/")[0] for k in series if k.endswith("/update_norm")]
    matrix = [g for g in labels if f"{g}/ortho_residual_max" in series]
    return matrix, [g for g in labels if g not in matrix]
