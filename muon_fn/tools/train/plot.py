"""Loss curves of one or more runs as a PNG (matplotlib, from the `examples` extra)."""

from __future__ import annotations

import math
from pathlib import Path

__all__ = ["plot_runs", "ema"]

_COLORS = {"muon": "#1f77b4", "adamw": "#d62728", "normuon": "#2ca02c", "sso": "#9467bd",
           "torch-muon": "#ff7f0e"}


def ema(values: list[float], alpha: float = 0.1) -> list[float]:
    out, m = [], None
    for v in values:
        m = v if m is None else (1 - alpha) * m + alpha * v
        out.append(m)
    return out


def _curves(results: list[dict], key: str) -> dict[str, tuple[list[int], list[list[float]]]]:
    """Per label: the steps of ``history[key]`` and, per step, the values of every seed's run."""
    out: dict[str, tuple[list[int], list[list[float]]]] = {}
    for r in results:
        points = r["history"][key]
        steps = [s for s, _ in points]
        values = ema([v for _, v in points]) if key == "train" else [v for _, v in points]
        if r["label"] not in out:
            out[r["label"]] = (steps, [[v] for v in values])
        else:
            for column, v in zip(out[r["label"]][1], values):
                column.append(v)
    return out


# For specs with options (muon[qk_clip=10]): colors none of _COLORS uses, so such a row never
# looks like its plain optimizer's.
_OTHER_COLORS = ("#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")


def _color(label: str, index: int) -> str:
    name = label.split("[")[0]
    return _COLORS[name] if name == label and name in _COLORS else _OTHER_COLORS[index % len(_OTHER_COLORS)]


def plot_runs(results: list[dict], path: str | Path, *, title: str = "") -> Path | None:
    """Two panels, training loss (EMA-smoothed) and validation loss vs step: the mean over seeds
    of each optimizer, with a band from the lowest to the highest seed; a third, the largest
    attention logit of each step, when the runs logged it (``--qk-clip``, ``--log-max-logit``);
    and a second row of four, the optimizer's figures (:func:`_plot_telemetry`), when the runs
    recorded them (``--metrics``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(install matplotlib for the loss plot: pip install 'muon-fn[examples]')")
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with_logits = any(r["history"].get("max_logit") for r in results)
    with_figures = any(r["history"].get("metrics") for r in results)
    top = 3 if with_logits else 2
    if with_figures:
        fig = plt.figure(figsize=(20, 9.6), dpi=120)
        grid = fig.add_gridspec(2, 12)
        axes = [fig.add_subplot(grid[0, i * 12 // top:(i + 1) * 12 // top]) for i in range(top)]
        _plot_telemetry([fig.add_subplot(grid[1, 3 * i:3 * i + 3]) for i in range(4)], results)
    else:
        fig, axes = plt.subplots(1, top, figsize=(18 if with_logits else 12, 4.8), dpi=120)
    ax_t, ax_v = axes[0], axes[1]
    if with_logits:
        _plot_max_logit(axes[2], results)
    for ax, key in ((ax_t, "train"), (ax_v, "val")):
        for i, (label, (steps, columns)) in enumerate(_curves(results, key).items()):
            mean = [sum(c) / len(c) for c in columns]
            extra = {"marker": "o", "markersize": 4} if key == "val" else {}
            shown = f"{label}: final {mean[-1]:.3f}" if key == "val" else label
            ax.plot(steps, mean, color=_color(label, i), linewidth=2, label=shown, **extra)
            if len(columns[0]) > 1:
                ax.fill_between(steps, [min(c) for c in columns], [max(c) for c in columns],
                                color=_color(label, i), alpha=0.2, linewidth=0)
    titles = {"training loss": "Training loss (EMA of the per-step loss)",
              "validation loss": "Validation loss (fixed held-out windows)"}
    for ax, what in ((ax_t, "training loss"), (ax_v, "validation loss")):
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(f"{what} (nats/byte)")
        ax.set_title(titles[what])
        ax.grid(True, alpha=0.3)
        ax.legend()
    _zoom(results, ax_t, ax_v)
    fig.suptitle(title or "muon_fn: loss curves", fontsize=11)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _plot_max_logit(ax, results: list[dict]) -> None:
    """The largest attention logit of each step (before that step's clip), mean over seeds, band
    min–max; QK-Clip's τ of the clipped runs as dashed lines."""
    runs = [r for r in results if r["history"].get("max_logit")]
    for i, (label, (steps, columns)) in enumerate(_curves(runs, "max_logit").items()):
        mean = [sum(c) / len(c) for c in columns]
        ax.plot(steps, mean, color=_color(label, i), linewidth=1.5,
                label=f"{label}: peak {max(max(c) for c in columns):.1f}")
        if len(columns[0]) > 1:
            ax.fill_between(steps, [min(c) for c in columns], [max(c) for c in columns],
                            color=_color(label, i), alpha=0.2, linewidth=0)
    for tau in sorted({r["qk_clip"] for r in runs if r.get("qk_clip") is not None}):
        ax.axhline(tau, color="gray", linestyle="--", linewidth=1, label=f"τ = {tau:g}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("max pre-softmax logit q·k/√d")
    ax.set_title("Largest attention logit of each step")
    ax.grid(True, alpha=0.3)
    ax.legend()


# The second row (--metrics): per run (its color) and group (line style: the orthogonalized
# matrices solid, the AdamW parameters dashed), each measured step, on log axes.
_TELEMETRY = (
    ("grad_norm", "Gradient norm (L2 over each group; EMA, raw faint)", "‖g‖"),
    ("weight_norm", "Weight norm (L2 over each group)", "‖W‖"),
    ("update_norm", "Update norm (L2 over each group, lr included)", "‖ΔW‖"),
)


def _plot_telemetry(axes, results: list[dict]) -> None:
    """Group totals of ``optimizer.metrics()`` against steps: gradient, weight and update norms
    per group; and the worst matrix's orthogonality residual (solid) and NorMuon row-scale range
    (dotted). A run without figures (a torch.optim row) draws nothing."""
    from .telemetry import groups

    runs = [r for r in results if r["history"].get("metrics")]
    labels = list(dict.fromkeys(r["label"] for r in results))
    first = min((r["seed"] for r in runs), default=0)
    seeds = f" (seed {first})" if len({r["seed"] for r in results}) > 1 else ""
    for r in runs:
        if r["seed"] != first:
            continue  # one seed: the first
        series, color = r["history"]["metrics"], _color(r["label"], labels.index(r["label"]))
        steps = series["step"]
        matrix, other = groups(series)
        for ax, (key, _, _) in zip(axes, _TELEMETRY):
            for group in matrix + other:
                _line(ax, steps, series.get(f"{group}/{key}"), color, "-" if group in matrix else "--",
                      f"{r['label']}: {group}", smooth=key == "grad_norm")
        for group in matrix:
            _line(axes[3], steps, series.get(f"{group}/ortho_residual_max"), color, "-", f"{r['label']}: orthogonality")
            _line(axes[3], steps, series.get(f"{group}/row_scale_range_max"), color, ":",
                  f"{r['label']}: row-scale range")
    titles = [*_TELEMETRY, (None, "Worst matrix: orthogonality residual (solid),\nNorMuon row-scale range (dotted)",
                            "max over the matrices")]
    for ax, (_, title, ylabel) in zip(axes, titles):
        ax.set_yscale("log")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.set_title(title + seeds, fontsize=10)
        ax.grid(True, alpha=0.3, which="both")
        if ax.lines:
            ax.legend(fontsize=7)


def _line(ax, steps: list, values: list | None, color: str, style: str, label: str, smooth: bool = False) -> None:
    """One series on a log axis (steps without a finite positive value left out); ``smooth``: the
    raw values faint and their EMA, taken over the logarithms, on top."""
    points = [(s, v) for s, v in zip(steps, values or []) if v is not None and 0 < v < math.inf]
    if not points:
        return
    xs, ys = zip(*points)
    if smooth:
        ax.plot(xs, ys, color=color, linestyle=style, linewidth=0.6, alpha=0.25)
        ys = [math.exp(v) for v in ema([math.log(v) for v in ys])]
    ax.plot(xs, ys, color=color, linestyle=style, linewidth=1.4, label=label)


def _zoom(results: list[dict], ax_t, ax_v) -> None:
    """Zoom in on the interesting range: the first evaluations are all ~ln(256) = 5.5."""
    all_val = [v for r in results for _, v in r["history"]["val"][1:]] or [5.6]
    all_train = [v for r in results
                 for v in ema([x for _, x in r["history"]["train"]])[len(r["history"]["train"]) // 10:]]
    if all_train:
        ax_t.set_ylim(min(all_train) - 0.1, max(all_train) + 0.3)
    ax_v.set_ylim(min(all_val) - 0.1, max(all_val) + 0.3)
    if len(all_val) < sum(len(r["history"]["val"]) for r in results):
        ax_v.annotate("step 0: ln 256 ≈ 5.55 (above the axis)", xy=(0.02, 0.03), xycoords="axes fraction",
                      va="bottom", fontsize=8, color="gray")
