"""``MuonMetricsCallback`` for the Hugging Face ``Trainer``: adds ``optimizer.metrics()`` of a
muon_fn optimizer to the Trainer's logs, once per measured step.

    from muon_fn.integrations.hf import MuonMetricsCallback

    trainer = Trainer(..., optimizers=(optimizer, scheduler), callbacks=[MuonMetricsCallback()])

with ``metrics=True`` (or ``k``) given to the optimizer. At the end of each step it checks (on
the host, without touching the device) whether the optimizer (``kwargs["optimizer"]``, behind
accelerate's wrapper) measured a new step; if so it asks the Trainer to log that step, and
``on_log`` adds the figures (one device read) to the logs: to ``trainer.state.log_history`` and to
what the callbacks after it receive. The Trainer runs callbacks in order and puts the
``report_to`` integrations first, so they would not see the figures: give ``report_to="none"``
and list the integration's callback after this one (``callbacks=[MuonMetricsCallback(),
WandbCallback()]``); the callback warns once when ``report_to`` names integrations.
Needs the ``hf`` extra (``pip install 'muon-fn[hf]'``).
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

from ._common import Reader, no_measuring_hint

try:
    from transformers import TrainerCallback as _Callback
    _MISSING: ImportError | None = None
except ImportError as e:  # pragma: no cover - depends on the environment
    _Callback, _MISSING = object, e

__all__ = ["MuonMetricsCallback"]


class MuonMetricsCallback(_Callback):
    """Adds the figures of every measured step of the Trainer's muon_fn optimizer to its logs.

    ``prefix``: put before every name (``"optim/muon/update_norm"``). ``names``: glob patterns
    of the figures to log (``None``: all of them; ``"*/*_norm"``: the group totals);
    ``"step"`` (the optimizer step the figures describe) is always logged. Raises
    ``ImportError`` naming the extra when transformers is not installed.
    """

    def __init__(self, *, prefix: str = "optim/", names: str | Sequence[str] | None = None) -> None:
        if _MISSING is not None:
            raise ImportError("muon_fn.integrations.hf.MuonMetricsCallback needs transformers: "
                              "pip install 'muon-fn[hf]'") from _MISSING
        super().__init__()
        self._reader = Reader(prefix, names)
        self.prefix, self.names = self._reader.prefix, self._reader.patterns
        self._pending: dict[str, float] = {}

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        hint = no_measuring_hint("MuonMetricsCallback", [kwargs.get("optimizer")])
        if hint is not None:
            warnings.warn(hint, stacklevel=2)
        report_to = [args.report_to] if isinstance(args.report_to, str) else list(args.report_to or [])
        reporters = [r for r in report_to if r != "none"]
        if reporters:
            warnings.warn(f"MuonMetricsCallback: the report_to integrations {reporters} run before this callback "
                          "and do not receive the optimizer figures; to send them there, pass report_to='none' "
                          "and list their callbacks after this one (callbacks=[MuonMetricsCallback(), "
                          "WandbCallback()]). trainer.state.log_history holds them either way.", stacklevel=2)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        optimizer = kwargs.get("optimizer")
        fresh = self._reader.fresh([optimizer]) if optimizer is not None else []
        if fresh:
            control.should_log = True  # log this measured step, whatever logging_steps says (every rank:
            if state.is_world_process_zero:  # the Trainer's log gathers the loss)
                self._pending = self._reader.figures(fresh)
        return control

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> Any:
        if not self._pending or logs is None or "loss" not in logs:
            return control  # evaluation logs, the final summary: not the training step's
        figures, self._pending = self._pending, {}
        logs.update(figures)
        last = state.log_history[-1] if state.log_history else None
        if last is not None and last.get("step") == state.global_step and "loss" in last:
            last.update(figures)
        return control
