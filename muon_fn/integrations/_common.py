"""What the callbacks share: the muon_fn optimizers behind a framework's wrappers, and a reader
that returns each optimizer's figures once per measured step.

Whether an optimizer measured a new step is a host-side number (the step its kept figures
describe), so the reader costs nothing on an unmeasured step; on a measured one it calls
``optimizer.metrics()``: one read of the device.
"""

from __future__ import annotations

import fnmatch
from typing import Any
from collections.abc import Iterable, Sequence


def unwrap(optimizer: Any) -> Any:
    """The optimizer inside a framework's wrapper (accelerate's ``AcceleratedOptimizer``:
    ``.optimizer``; Lightning's ``LightningOptimizer``: ``._optimizer``)."""
    seen = 0
    while seen < 8:
        inner = getattr(optimizer, "optimizer", None)
        if inner is None:
            inner = getattr(optimizer, "_optimizer", None)
        if inner is None or inner is optimizer:
            return optimizer
        optimizer, seen = inner, seen + 1
    return optimizer


def is_muon_fn(optimizer: Any) -> bool:
    from ..optim import Optimizer

    return isinstance(optimizer, Optimizer)


def measures(optimizer: Any) -> bool:
    """A muon_fn optimizer built with ``metrics=True`` or ``k``."""
    return is_muon_fn(optimizer) and bool(optimizer.metrics_every)


def _check_names(names: str | Sequence[str] | None) -> tuple[str, ...] | None:
    if names is None:
        return None
    patterns = (names,) if isinstance(names, str) else tuple(names)
    if not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise ValueError(f"Invalid names: {names!r} (expected None, a glob pattern such as '*/update_norm', "
                         "or a list of them)")
    return patterns


def _check_prefix(prefix: str) -> str:
    if not isinstance(prefix, str):
        raise ValueError(f"Invalid prefix: {prefix!r} (expected a string, e.g. 'optim/')")
    return prefix


class Reader:
    """Each new measured step's figures of the muon_fn optimizers given, as one flat dict:
    ``prefix + name`` (``prefix + "<i>/" + name`` when several optimizers measure), filtered by
    the glob patterns ``names`` (a pattern, a list of them, or None: every figure; checked here).
    The optimizers' ``"step"`` entries are kept: the optimizer step the figures describe."""

    def __init__(self, prefix: str, names: str | Sequence[str] | None) -> None:
        self.prefix, self.patterns = _check_prefix(prefix), _check_names(names)
        self._last: dict[int, int] = {}

    def fresh(self, optimizers: Iterable[Any]) -> list[tuple[str, Any]]:
        """``(name head, optimizer)`` of each optimizer that measured a step since the last call
        (a host-side check, the same on every rank)."""
        mine = [o for o in (unwrap(o) for o in optimizers) if measures(o)]
        out = []
        for i, opt in enumerate(mine):
            step = opt.measured_step  # host-side: None before the first measured step
            if step is None or self._last.get(id(opt)) == step:
                continue
            self._last[id(opt)] = step
            out.append((self.prefix if len(mine) == 1 else f"{self.prefix}{i}/", opt))
        return out

    def figures(self, fresh: list[tuple[str, Any]]) -> dict[str, float]:
        """The named figures of :meth:`fresh`'s optimizers (one device read each)."""
        out: dict[str, float] = {}
        for head, opt in fresh:
            for name, value in opt.metrics().items():
                if self.patterns is None or name == "step" or any(fnmatch.fnmatchcase(name, p)
                                                                  for p in self.patterns):
                    out[head + name] = value
        return out

    def read(self, optimizers: Iterable[Any]) -> dict[str, float]:
        """The figures of every optimizer that measured a step since the last call ({}: none)."""
        return self.figures(self.fresh(optimizers))


def no_measuring_hint(owner: str, optimizers: Iterable[Any]) -> str | None:
    """The warning for a callback whose optimizers measure nothing (None: one measures)."""
    found = [unwrap(o) for o in optimizers]
    if any(measures(o) for o in found):
        return None
    if any(is_muon_fn(o) for o in found):
        return (f"{owner}: the muon_fn optimizer was built without metrics=, so there is nothing to log: "
                "pass metrics=True (every step) or metrics=k (every k-th step) to it")
    kinds = ", ".join(sorted({type(o).__name__ for o in found})) or "none"
    return f"{owner}: no muon_fn optimizer to log (optimizers: {kinds}); it logs muon_fn optimizers' metrics()"
