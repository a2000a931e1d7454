"""Loss curves of one or more runs as a PNG (matplotlib, from the `examples` extra)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["plot_runs", "ema"]

_COLORS = {"muon": "#1f77b4", "adamw": "#d62728", "normuon": "#2ca02c", "sso": "#9467bd"}


def ema(values: list[float], alpha: float = 0.1) -> list[float]:
    out, m = [], None
    for v in values:
        m = v if m is None else (1 - alpha) * m + alpha * v
        out.append(m)
    return out


def plot_runs(results: list[dict], path: str | Path, *, title: str = "") -> Path | None:
    """Two panels: training loss (raw, faint; EMA-smoothed, bold) and validation loss vs step."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(install matplotlib for the loss plot: pip install 'muon-fn[examples]')")
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax_t, ax_v) = plt.subplots(1, 2, figsize=(12, 4.8), dpi=120)
    for r in results:
        name = r["optimizer"]
        color = _COLORS.get(name)
        steps, losses = zip(*r["history"]["train"]) if r["history"]["train"] else ((), ())
        ax_t.plot(steps, losses, color=color, alpha=0.2, linewidth=0.8)
        ax_t.plot(steps, ema(list(losses)), color=color, linewidth=2, label=name)
        vs, vl = zip(*r["history"]["val"])
        ax_v.plot(vs, vl, color=color, marker="o", markersize=4, linewidth=2,
                  label=f"{name}: final {vl[-1]:.3f}")
    titles = {"training loss": "Training loss (faint: per step; bold: EMA)",
              "validation loss": "Validation loss (fixed held-out windows)"}
    for ax, what in ((ax_t, "training loss"), (ax_v, "validation loss")):
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(f"{what} (nats/byte)")
        ax.set_title(titles[what])
        ax.grid(True, alpha=0.3)
        ax.legend()
    # Zoom in on the interesting range: the first evaluations are all ~ln(256) = 5.5.
    all_val = [v for r in results for _, v in r["history"]["val"][1:]] or [5.6]
    all_train = [v for r in results for v in ema([x for _, x in r["history"]["train"]])[len(r["history"]["train"]) // 10:]]
    if all_train:
        ax_t.set_ylim(min(all_train) - 0.1, max(all_train) + 0.3)
    ax_v.set_ylim(min(all_val) - 0.1, max(all_val) + 0.3)
    if len(all_val) < sum(len(r["history"]["val"]) for r in results):
        ax_v.annotate("step 0: ln 256 ≈ 5.55 (above the axis)", xy=(0.02, 0.03), xycoords="axes fraction",
                      va="bottom", fontsize=8, color="gray")
    fig.suptitle(title or "muon_fn: loss curves", fontsize=11)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
