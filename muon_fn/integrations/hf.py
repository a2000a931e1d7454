"""The Hugging Face ``Trainer``: :class:`HybridFactory`, muon_fn's hybrid as the Trainer's optimizer,
and ``MuonMetricsCallback``, which adds ``optimizer.metrics()`` of a muon_fn optimizer to the
Trainer's logs, once per measured step.

    from muon_fn.integrations.hf import HybridFactory

    trainer = Trainer(..., optimizer_cls_and_kwargs=(HybridFactory, {"muon_lr": 0.02, "adamw_lr": 3e-4}))

The Trainer calls what ``optimizer_cls_and_kwargs`` names with no argument unless it is a
``torch.optim.Optimizer`` class, then calls the result with the model and the keywords:
:class:`HybridFactory` builds :func:`muon_fn.create_hybrid_optimizer` there, which routes the
embeddings, the output head and 0-/1-D parameters to AdamW. (``MuonOptimizer`` given as the class
receives the Trainer's decay and no-decay groups, in which the embeddings are matrices: Muon.)
Under FSDP2 (accelerate shards the model after the optimizer is built and swaps the DTensors into
its param groups) the optimizer runs the owner-computes step from its first step on.

Metrics:

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
from typing import TYPE_CHECKING, Any
from collections.abc import Sequence

from ._common import Reader, no_measuring_hint

_MISSING: ImportError | None = None
if TYPE_CHECKING:  # mypy checks the callback against the real base class
    from transformers import TrainerCallback as _Callback
else:
    try:
        from transformers import TrainerCallback as _Callback
    except ImportError as e:  # pragma: no cover - depends on the environment
        _Callback, _MISSING = object, e

__all__ = ["HybridFactory", "MuonMetricsCallback"]


class HybridFactory:
    """``Trainer(optimizer_cls_and_kwargs=(HybridFactory, kwargs))``: the Trainer calls
    ``HybridFactory()(model, **kwargs)``, which is :func:`muon_fn.create_hybrid_optimizer`
    ``(model, **kwargs)`` (every keyword of it: ``muon_lr``, ``adamw_lr``, ``adamw_weight_decay``,
    ``adjust_lr_fn``, ``metrics``, ...). The Trainer's ``learning_rate`` and ``weight_decay``
    arguments do not reach it: give the rates here; its scheduler scales each group's."""

    def __call__(self, model: Any, **kwargs: Any) -> Any:
        from ..optim import create_hybrid_optimizer

        return create_hybrid_optimizer(model, **kwargs)

    def __repr__(self) -> str:
        return "HybridFactory()"


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
