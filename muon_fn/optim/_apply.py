"""The generic apply, staged: every bucket's update is computed first, touching nothing; then one
commit writes all of them. A step is therefore all or nothing: an error while computing any
bucket (a compiler error, an out-of-memory, a transform that raises) leaves every parameter and
every state buffer as it was before the step.

:func:`compute_bucket` runs ``tx.update`` on one bucket and returns what it would write (a
:class:`Staged`), under the non-finite policy's flag: where the step is skipped the gradients the
transform sees are zeros (no solver or iteration ever sees an inf or nan), the updates are zero
and the new state is the old one, all decided on the device. :func:`commit` then copies every new
state into its buffer and adds every update to its parameter (``torch._foreach_copy_`` and
``torch._foreach_add_``: a few kernels per step, not one per tensor). The cost of staging: the
new state and the updates of the whole step exist at once until the commit (the transient
memory of one more state and one more parameter copy), and the state is written by a copy after
the graphs rather than inside them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from .. import _metrics, _tree
from .._base import GradientTransformation


class Staged(NamedTuple):
    """What one bucket's step writes at the commit."""

    params: tuple  # the bucket's parameters (or local shards): p += u
    updates: tuple  # one per parameter; None: no update
    state: Any  # the state buffers: old ← new (a None buffer is skipped)
    new_state: Any


def masked(tree: Any, finite: torch.Tensor | None) -> Any:
    """``tree`` with every tensor replaced by zeros where ``finite`` (a 0-d bool tensor) is False."""
    if finite is None:
        return tree
    return _tree.tree_map(lambda t: None if t is None else torch.where(finite, t, 0), tree)


def kept(state: Any, new_state: Any, finite: torch.Tensor | None) -> Any:
    """``new_state`` where ``finite`` is True, else ``state``, leaf by leaf (an unchanged leaf is
    returned as it is)."""
    if finite is None:
        return new_state

    def keep(old, new):
        if old is None or new is None or new is old:
            return new
        return torch.where(finite, new, old)

    return _tree.tree_map(keep, state, new_state)


def compute_bucket(tx: GradientTransformation, params: tuple, grads: tuple, state: Any,
                   finite: torch.Tensor | None) -> tuple[tuple, Any]:
    """``tx.update`` on one bucket under the flag ``finite`` (None: no check): ``(updates, new
    state)``, zero and unchanged where the flag is False; the gradients are zeroed first, so the
    transform never sees a non-finite value of a skipped step. Nothing is written."""
    updates, new_state = tx.update(masked(grads, finite), state, params)
    return masked(updates, finite), kept(state, new_state, finite)


def commit(staged: Sequence[Staged]) -> None:
    """Write every staged bucket: each new state into its buffer, then each update into its
    parameter, in place."""
    olds, news, params, updates = [], [], [], []
    for s in staged:
        for old, new in zip(_tree.tree_leaves(s.state), _tree.tree_leaves(s.new_state)):
            if old is not None and new is not None and new is not old:
                olds.append(old)
                news.append(new)
        for p, u in zip(s.params, s.updates):
            if u is not None:
                params.append(p)
                updates.append(u)
    if olds:
        torch._foreach_copy_(olds, news)
    if params:
        torch._foreach_add_(params, updates)


def apply_bucket(tx: GradientTransformation, params: tuple, grads: tuple, state: Any,
                 finite: torch.Tensor | None) -> None:
    """:func:`compute_bucket` and its :func:`commit` at once (one bucket that is a step by itself)."""
    updates, new_state = compute_bucket(tx, params, grads, state, finite)
    commit([Staged(params, updates, state, new_state)])


def write_back(state: Any, new_state: Any, finite: torch.Tensor | None) -> None:
    """Copy every leaf of ``new_state`` into the matching buffer of ``state`` in place (a ``None``
    buffer is skipped); where ``finite`` (a 0-d bool tensor) is False the buffers keep their values."""
    commit([Staged((), (), state, kept(state, new_state, finite))])


def compute_of(tx: GradientTransformation) -> Callable[..., tuple[tuple, Any]]:
    """The bucket computation of ``tx`` (compiled per signature by :class:`muon_fn._compile.PerSignature`)."""

    def compute(params, grads, state, finite):
        return compute_bucket(tx, params, grads, state, finite)

    return compute


def applied_of(tx: GradientTransformation) -> Callable[..., None]:
    """:func:`compute_of` and the bucket's commit in one function (``atomic=False``): compiled,
    one graph that writes the new state and the update in place, with the transient memory of
    the bucket's intermediates only."""

    def apply(params, grads, state, finite):
        apply_bucket(tx, params, grads, state, finite)

    return apply


def measured_of(tx: GradientTransformation) -> Callable[..., tuple[tuple, Any, tuple]]:
    """:func:`compute_of` with telemetry: also the step's raw figures (:mod:`muon_fn._metrics`)
    of the bucket's leaves ``leaves``; the gradients' figure is that of the gradients as they
    came (a skipped step shows its inf or nan there)."""

    def compute(params, grads, state, finite, leaves):
        updates, new_state, raw = _metrics.measured_update(tx, masked(grads, finite), state, params, leaves,
                                                           grads=grads)
        return masked(updates, finite), kept(state, new_state, finite), raw

    return compute


def finite_flags(grads: list[torch.Tensor]) -> torch.Tensor:
    """Per gradient, whether it is finite, as one bool tensor on the first gradient's device: one
    reduction per gradient (a sum is non-finite iff an entry is, or the sum overflows fp32)."""
    low = (torch.float16, torch.bfloat16)
    sums = [g.sum(dtype=torch.float32) if g.dtype in low else g.sum() for g in grads]
    if len({(s.dtype, s.device) for s in sums}) > 1:
        sums = [s.to(device=sums[0].device, dtype=torch.float64) for s in sums]
    return torch.stack(sums).isfinite()


class SkipNotice:
    """Warns once per optimizer, at the first skipped step, naming the parameters whose
    gradients were not finite, without a host sync: a CPU flag is read at once, a GPU flag once
    its copy to the host has arrived (looked at by the next step)."""

    def __init__(self) -> None:
        self.done = False
        self._pending: tuple[torch.Tensor, Any, Callable[[], list[str]], str] | None = None
        self._host: dict[int, torch.Tensor] = {}  # pinned buffers by size, reused

    def watch(self, flags: torch.Tensor, names: Callable[[], list[str]], owner: str,
              everywhere: torch.Tensor | None = None) -> None:
        """``flags``: per gradient, whether it is finite, for the step being taken; ``names()``:
        the gradients' parameter names (called only if one is not finite); ``owner``: the class;
        ``everywhere``: the flag of every rank's gradients (FSDP: a skip caused by another rank's)."""
        self.poll()
        if self.done or self._pending is not None:
            return
        if everywhere is not None:
            flags = torch.cat([flags.to(everywhere.device), everywhere.reshape(1)])
            local = names
            names = lambda: local() + ["a parameter of another rank"]  # noqa: E731
        if flags.device.type == "cpu":
            self._check(flags, names, owner)
            return
        host = self._host.get(flags.numel())
        if host is None:
            host = self._host[flags.numel()] = torch.empty(
                flags.shape, dtype=torch.bool, pin_memory=torch.cuda.is_available())
        host.copy_(flags, non_blocking=True)
        event = torch.cuda.Event() if flags.device.type == "cuda" else None
        if event is not None:
            event.record()
        self._pending = (host, event, names, owner)

    def poll(self) -> None:
        """Look at a pending GPU flag if its copy has arrived."""
        if self._pending is None:
            return
        host, event, names, owner = self._pending
        if event is not None and not event.query():
            return
        self._pending = None
        self._check(host, names, owner)

    def _check(self, flags: torch.Tensor, names: Callable[[], list[str]], owner: str) -> None:
        ok = flags.tolist()
        if all(ok):
            return
        self.done = True
        self._host.clear()
        bad = [n for n, fine in zip(names(), ok) if not fine]
        bad = bad[:-1] if len(bad) > 1 and bad[-1] == "a parameter of another rank" else bad
        from ._views import warn

        warn(f"{owner}: skipped a step: non-finite gradient (inf or nan) in {', '.join(bad)}; parameters "
             "and optimizer state were left unchanged (nonfinite='skip', the default). Later skipped steps "
             "are counted in optimizer.nonfinite_steps without a warning; pass nonfinite='error' to raise "
             "instead, or use torch.amp.GradScaler for fp16 training.")
