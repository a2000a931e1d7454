"""``MuonMetricsCallback`` for PyTorch Lightning: logs ``optimizer.metrics()`` of the muon_fn
optimizers of a ``Trainer`` to its loggers, once per measured step.

    from muon_fn.integrations.lightning import MuonMetricsCallback

    trainer = lightning.pytorch.Trainer(callbacks=[MuonMetricsCallback()], logger=...)

with ``metrics=True`` (or ``k``) given to the optimizer that ``configure_optimizers`` returns.
After each training batch it checks (on the host, without touching the device) whether an
optimizer measured a new step; if so it reads the figures (one device read) and passes them to
``logger.log_metrics`` of every logger of the Trainer, on global rank 0, at the step Lightning
logs that batch's ``self.log`` values at. It logs every measured step, whatever
``log_every_n_steps``: ``metrics=k`` on the optimizer sets the period. Needs the ``lightning``
extra (``pip install 'muon-fn[lightning]'``); ``pytorch_lightning`` works too.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any
from collections.abc import Sequence

from ._common import Reader, no_measuring_hint

_MISSING: ImportError | None = None
if TYPE_CHECKING:  # mypy checks the callback against lightning's base class
    from lightning.pytorch import Callback as _Callback
else:
    try:
        from lightning.pytorch import Callback as _Callback
    except ImportError as first:  # pragma: no cover - depends on the environment
        try:
            from pytorch_lightning import Callback as _Callback
        except ImportError:
            _Callback, _MISSING = object, first

__all__ = ["MuonMetricsCallback"]


class MuonMetricsCallback(_Callback):
    """Logs the figures of every measured step of the Trainer's muon_fn optimizers.

    ``prefix``: put before every name (``"optim/muon/update_norm"``; with several measuring
    optimizers ``"optim/<i>/..."``). ``names``: glob patterns of the figures to log (``None``:
    all of them; ``"*/*_norm"``: the group totals), matched against the names ``metrics()``
    gives; ``"step"`` (the optimizer step the figures describe) is always logged.
    Raises ``ImportError`` naming the extra when Lightning is not installed.

    After each training batch it checks on the host whether an optimizer (built with
    ``metrics=True`` or ``k``) measured a new step and, if so, reads the figures (one device
    read) and calls ``logger.log_metrics(figures, step=...)`` on every logger of the Trainer, on
    global rank 0, at the step of that batch's ``self.log`` values. Every measured step is logged,
    whatever ``log_every_n_steps``: ``metrics=k`` sets the period. Warns when no optimizer
    measures; raises ``ValueError`` at the start of training without a logger. Use:
    ``Trainer(callbacks=[MuonMetricsCallback()], logger=CSVLogger("logs"))``.
    """

    def __init__(self, *, prefix: str = "optim/", names: str | Sequence[str] | None = None) -> None:
        if _MISSING is not None:
            raise ImportError("muon_fn.integrations.lightning.MuonMetricsCallback needs Lightning: "
                              "pip install 'muon-fn[lightning]'") from _MISSING
        super().__init__()
        self._reader = Reader(prefix, names)
        self.prefix, self.names = self._reader.prefix, self._reader.patterns

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.loggers:
            raise ValueError("MuonMetricsCallback needs a logger: the Trainer was built with logger=False "
                             "(pass a logger, e.g. lightning.pytorch.loggers.CSVLogger('logs'))")
        hint = no_measuring_hint("MuonMetricsCallback", trainer.optimizers)
        if hint is not None and trainer.is_global_zero:
            warnings.warn(hint, stacklevel=2)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not trainer.is_global_zero:
            return  # every rank holds the same figures (muon_fn's FSDP optimizers reduce them)
        figures = self._reader.read(trainer.optimizers)
        if not figures:
            return
        step = _logging_step(trainer)
        for logger in trainer.loggers:
            logger.log_metrics(figures, step=step)


def _logging_step(trainer: Any) -> int:
    """The step Lightning logs this batch's ``self.log`` values at (LearningRateMonitor's choice)."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    stepped = getattr(loop, "_batches_that_stepped", None)
    return stepped if isinstance(stepped, int) else trainer.global_step
