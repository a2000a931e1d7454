"""``metrics=`` of the optimizers: which steps are measured, where their figures are kept, and
``optimizer.metrics()``, the flat ``{name: float}`` dict of the last measured step.

The figures are computed inside each bucket's (compiled) computation (:mod:`muon_fn.core.metrics`)
and kept on the device between steps, in buffers of the optimizer's (not in its state_dict:
telemetry is not state). ``metrics()`` reads them all back at once, when called, and names them:

- per unit: ``"<param>/<figure>"`` (``"<param>[j]/<figure>"`` for unit j of an expert stack or a
  head view; ``<param>`` is the parameter's name, or ``#i``, its position among the optimizer's
  parameters, for one passed without a name): ``grad_rms``, ``momentum_rms``, ``update_rms``,
  ``weight_rms``, ``effective_lr`` (``lr·s(out, in)``), ``decay`` (``lr·wd``), ``ortho_residual``,
  ``row_scale_range`` (NorMuon), ``sso_*`` (SSO's σ, λ, |h|, evaluations, fallback);
- per group (``"<group>/..."``, the group's ``algorithm`` where no other group has it, else
  ``group<i>``: an ``"auto"`` group or two groups of one algorithm): ``grad_norm``,
  ``momentum_norm``, ``update_norm``, ``weight_norm`` (L2 over the group; under gradient
  accumulation the gradient figures are the window's mean gradient's), ``skipped`` (only with
  a non-finite check, ``nonfinite`` not None: 1.0 if the measured step was skipped as
  non-finite, its other figures then describe the zeroed step, and its update figures are 0:
  nothing was applied), and
  for the figures where a worst matrix matters, ``<figure>_max`` and the same value under
  ``<figure>_max@<param>``, naming it;
- QK-Clip, with ``qk_clip=``: ``qk_clip/max_logit`` and ``qk_clip/clipped_heads`` of its last step;
- ``step``: the measured step's number (1 for this optimizer object's first applied step; not
  in the state_dict, so it counts from 1 again in an optimizer that loads one);
- ``optimizer_faults``: how many times so far a bucket was kept back because finite gradients
  gave it a non-finite update or state (:attr:`~muon_fn.Optimizer.optimizer_faults`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..core import metrics as _metrics

WORST = ("grad_rms", "update_rms", "ortho_residual", "row_scale_range", "sso_residual")


def check_metrics(metrics: Any) -> int:
    """``metrics=`` as a measuring period: 0 (off: ``False``), 1 (``True``) or k ≥ 1."""
    if metrics is False or metrics is None:
        return 0
    if metrics is True:
        return 1
    if isinstance(metrics, int) and not isinstance(metrics, bool) and metrics >= 1:
        return metrics
    raise ValueError(f"Invalid metrics: {metrics!r} (expected False, True, or an integer k >= 1: "
                     "measure every k-th step)")


class Telemetry:
    """The optimizers' side of ``metrics=``: a base of :class:`muon_fn.Optimizer`."""

    _metrics_every: int
    _applied_steps: int

    def _measure_now(self) -> bool:
        """Whether the step about to be applied is measured (every k-th, from the first)."""
        every = self.__dict__.get("_metrics_every", 0)
        return bool(every) and self.__dict__.get("_applied_steps", 0) % every == 0

    def _keep_figures(self, measured: list[tuple[Any, tuple, tuple]], finite: torch.Tensor | None) -> None:
        """Copy a measured step's figures into the optimizer's buffers (the graph's outputs
        themselves may be reused by the next call of its graph, e.g. under CUDA graphs).
        ``measured``: ``(key, labels, raw)`` per bucket, ``labels`` a ``(group label, param name,
        Leaf)`` per leaf of ``raw``."""
        store = self.__dict__.setdefault("_figures", {})
        olds, news = [], []
        for key, labels, raw in measured:
            kept = store.get(key)
            if kept is None or [sorted(r or {}) for r in kept[1]] != [sorted(r or {}) for r in raw]:
                store[key] = (labels, tuple(None if r is None else {k: v.clone() for k, v in r.items()} for r in raw))
                continue
            for old, new in zip(kept[1], raw):
                for k in (new or {}):
                    olds.append(old[k])
                    news.append(new[k])
        if olds:
            torch._foreach_copy_(olds, news)
        self.__dict__["_figures_step"] = self.__dict__.get("_applied_steps", 0) + 1  # this step's number
        self.__dict__["_figures_finite"] = None if finite is None else finite.clone()

    def _forget_figures(self, group: int) -> None:
        """Drop group ``group``'s figures (its buckets were rebuilt)."""
        store = self.__dict__.get("_figures", {})
        for key in [k for k in store if k[0] == group]:
            del store[key]

    def _labels(self, index: int, positions: tuple[int, ...], leaves: tuple) -> tuple:
        """``(group label, param name, Leaf)`` of the parameters at ``positions`` of group ``index``;
        an unnamed parameter is ``#<its position in the optimizer>`` (torch's state_dict id)."""
        names = self._param_names(self.param_groups[index])
        label = _group_labels(self.param_groups)[index]
        first = sum(len(g["params"]) for g in self.param_groups[:index])
        return tuple((label, names[i] or f"#{first + i}", leaf) for i, leaf in zip(positions, leaves))

    @property
    def metrics_every(self) -> int:
        """The measuring period: 0 (``metrics=False``), 1 (``True``) or k."""
        return self.__dict__.get("_metrics_every", 0)

    @property
    def measured_step(self) -> int | None:
        """The number of the last measured step (None before the first): a host-side number, so
        asking whether :meth:`metrics` has new figures costs nothing."""
        return self.__dict__.get("_figures_step")

    def metrics(self) -> dict[str, float]:
        """The figures of the last measured step as a flat ``{name: float}`` dict, read from the
        device now, in one transfer; ``{}`` before the first measured step or with
        ``metrics=False``. The names: :class:`muon_fn.Optimizer`, "Telemetry"."""
        entries = list(self._figure_entries())
        tensors = [v for *_, raw in entries for v in raw.values()]
        finite = self.__dict__.get("_figures_finite")
        clip = self._qk_tensors()
        faults = self.__dict__.get("_fault_count")
        host = _read([*tensors, *([finite] if finite is not None else []), *clip,
                      *([faults] if faults is not None else [])])
        out: dict[str, float] = {}
        groups: dict[str, list] = {}
        read = [(label, name, leaf, {k: [next(host) for _ in range(v.numel())] for k, v in raw.items()})
                for label, name, leaf, raw in entries]
        skipped = None if finite is None else 0.0 if next(host) else 1.0
        for label, name, leaf, values in read:
            if skipped:  # nothing was applied: the step's update is zero, whatever it computed
                values = {k: [0.0] * len(v) if k.startswith("update_") else v for k, v in values.items()}
            figs = _metrics.figures(values, leaf)
            out.update(_metrics.flat_names(name, figs))
            groups.setdefault(label, []).append((name, values, figs))
        for label, members in groups.items():
            out.update(_summary(label, members, skipped))
        out.update(self._qk_figures(clip, host))
        if entries:
            out["step"] = float(self.__dict__.get("_figures_step", 0))
            out["optimizer_faults"] = float(next(host)) if faults is not None else 0.0
        return out

    def _figure_entries(self):
        """``(group label, param name, Leaf, raw)`` for every leaf with figures."""
        store = self.__dict__.get("_figures", {})
        for key in sorted(store, key=repr):
            labels, raw = store[key]
            for (label, name, leaf), r in zip(labels, raw):
                if r:
                    yield label, name, leaf, r

    def _qk_tensors(self) -> list[torch.Tensor]:
        clip = getattr(self, "qk_clip", None)
        return list(clip.last_max_logits) if clip is not None and clip.last_max_logits else []

    def _qk_figures(self, tensors: list[torch.Tensor], host) -> dict[str, float]:
        if not tensors:
            return {}
        tau = self.qk_clip.tau
        logits = [next(host) for t in tensors for _ in range(t.numel())]
        return {"qk_clip/max_logit": max(logits), "qk_clip/clipped_heads": float(sum(s > tau for s in logits))}


def _read(tensors: list[torch.Tensor]):
    """An iterator over every element of ``tensors`` as Python floats: one copy per device."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t.detach().reshape(-1).float())
    values = {d: iter(torch.cat(ts).tolist()) for d, ts in by_device.items()}
    return (next(values[t.device]) for t in tensors for _ in range(t.numel()))


def _group_labels(groups: list[dict[str, Any]]) -> list[str]:
    """Each group's name in the figures: its ``algorithm`` where that names it alone, else ``group<i>``."""
    algos = [g.get("algorithm") for g in groups]
    return [a if a not in (None, "auto") and algos.count(a) == 1 else f"group{i}" for i, a in enumerate(algos)]


def _summary(label: str, members: list, skipped: float | None) -> dict[str, float]:
    """A group's totals and worst units (see the module doc)."""
    out: dict[str, float] = {}
    for key in ("grad", "momentum", "update", "weight"):
        sums = [s for _, values, _ in members for s in values.get(f"{key}_sumsq", [])]
        if sums:
            out[f"{label}/{key}_norm"] = math.sqrt(sum(max(s, 0.0) for s in sums))
    for figure in WORST:
        found = [(v, name if len(figs[figure]) == 1 else f"{name}[{j}]")
                 for name, _, figs in members if figure in figs for j, v in enumerate(figs[figure])]
        found = [(v, n) for v, n in found if not math.isnan(v)]
        if found:
            value, name = max(found, key=lambda vn: vn[0])
            out[f"{label}/{figure}_max"] = value
            out[f"{label}/{figure}_max@{name}"] = value
    if skipped is not None:
        out[f"{label}/skipped"] = skipped
    return out
