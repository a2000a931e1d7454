"""The generic apply: one bucket's step as a pure function under the step's flags
(:func:`bucket_step`), and the writes (:func:`commit`).

A step has two flags, both decided on the device. ``finite`` (the non-finite policy's, one check
over every gradient of the step, computed before any bucket runs): where it is False nothing is
written, in any bucket, and a transform of whole matrices sees zeros instead of the gradients (no
solver or iteration ever sees an inf or nan). The **guard** (:func:`guarded`, inside the graph
that writes): an update or a new state that is not finite although the gradients were (a
miscompiled graph, an overflow) is an optimizer fault; the bucket's parameters and state keep
their values and the fault is counted. For a transform of whole matrices the bucket is kept
whole (its update exists in full anyway); for an elementwise one, whose every element depends
on that element alone, each faulty element is, decided in the one pass that writes (a bucket-wide
flag would need the whole update before the first write), unless its state is stored quantized
(a code means nothing without its block's scale: kept whole). So no parameter is ever made
non-finite by the optimizer, and a bad batch changes nothing, without staging.

Two ways to write (``atomic=``):

- in place (``atomic=False``, the default): each bucket's graph writes its parameters and its
  state itself, the transient memory of one bucket's intermediates;
- staged (``atomic=True``): every bucket's graph returns what it would write and one
  :func:`commit` writes the whole step (``torch._foreach_copy_`` and ``torch._foreach_add_``: a
  few kernels per step), so an exception midway (an out-of-memory, a compiler error) leaves the
  optimizer as it was, at the price of the whole step's new state and updates held at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from ..core import metrics as _metrics, tree as _tree
from ..core.base import ELEMENTWISE, GradientTransformation, info


class Staged(NamedTuple):
    """What one bucket's step writes."""

    params: tuple  # the bucket's parameters (or local shards): p += u
    updates: tuple  # one per parameter; None: no update
    state: Any  # the state buffers: old ← new (a None buffer is skipped)
    new_state: Any
    # bool, 0-d or one mask per parameter: where False the parameter keeps every bit (None: no flag)
    ok: torch.Tensor | tuple | None = None


class BucketResult(NamedTuple):
    """What a bucket's step returns (:func:`bucket_step`)."""

    updates: tuple | None  # None where the step wrote them itself
    new_state: Any  # None where the step wrote it itself
    ok: torch.Tensor | tuple | None  # bool, 0-d or per parameter: what is written (None: no policy,
    # or written already)
    fault: torch.Tensor | None  # 0-d bool: finite gradients gave a non-finite update or state
    raw: tuple | None  # the bucket's raw telemetry (:mod:`muon_fn.core.metrics`), if measured


def without_figures(result: BucketResult) -> BucketResult:
    """What a compiled bucket step's check compares (:mod:`muon_fn.core.verify`): all but the
    telemetry, whose solver figures (SSO's λ, |h|, evaluations) may legitimately stop anywhere
    within their tolerance."""
    return result._replace(raw=None)


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


def sound(updates: Any, state: Any, new_state: Any) -> torch.Tensor | None:
    """Whether every update and every changed state tensor is finite (a 0-d bool on the device;
    one sum per tensor, fused by the compiler with the work that produces it; None: there is
    nothing to check). Integer state (quantized codes) is finite by construction."""
    changed = [new for old, new in zip(_tree.tree_leaves(state), _tree.tree_leaves(new_state))
               if new is not None and new is not old and new.is_floating_point()]
    tensors = [u for u in _tree.tree_leaves(updates) if u is not None] + changed
    return finite_flags(tensors).all() if tensors else None


def guarded(state: Any, updates: Any, new_state: Any, finite: torch.Tensor | None, *,
            elementwise: bool = False) -> tuple:
    """``(updates, new state, ok, fault)`` of a bucket under the step's flag ``finite`` and the
    guard: written only if the gradients were finite and so is everything the bucket would write
    (the new state is the old one, and :func:`commit` adds no update, where ``ok`` is False);
    ``fault`` says the bucket was kept back for its own result. ``finite`` None
    (``nonfinite=None``): no check at all.

    ``elementwise`` (a transform of :data:`~muon_fn.ELEMENTWISE` scope, whose every element is
    computed from the same element alone): the guard is per element instead (:func:`_per_element`),
    decided in the same pass that writes, so nothing of the bucket's size is held to be checked.
    Not where the bucket's state is stored quantized (integer codes beside per-block scales,
    :mod:`muon_fn.core.quantize`): a code is read against its block's scale, so codes and scales are
    kept or written together, and the bucket is guarded whole, as one of whole matrices."""
    if finite is None:
        return updates, new_state, None, None
    if elementwise and not _holds_codes(state, new_state):
        return _per_element(state, updates, new_state, finite)
    values_ok = sound(updates, state, new_state)
    if values_ok is None:
        return updates, kept(state, new_state, finite), finite, torch.zeros_like(finite)
    ok = finite & values_ok
    return updates, kept(state, new_state, ok), ok, finite & ~values_ok


def _holds_codes(state: Any, new_state: Any) -> bool:
    """Whether a changed state tensor of ``new_state`` holds integer codes (quantized state; a
    0-d integer is a counter)."""
    return any(new is not None and new is not old and not new.is_floating_point() and new.ndim > 0
               for old, new in zip(_tree.tree_leaves(state), _tree.tree_leaves(new_state)))


def _per_element(state: Any, updates: Any, new_state: Any, finite: torch.Tensor) -> tuple:
    """The guard of an elementwise bucket: an element position where any update or changed state
    tensor of that shape is not finite keeps its old value in every parameter and state tensor
    of the bucket (tensors of other shapes by their own elements; an integer counter is kept
    where the step is skipped; integer codes never come here: :func:`guarded`); ``ok`` is one
    mask per parameter. Per position the test is ``s − s == 0`` for the sum ``s``
    of its terms (and a NaN where the step is skipped): 0 exactly when every term is finite (a
    false alarm needs values near the float's largest), a few vector operations in the one loop
    over the elements that also writes them (a bucket-wide flag would need every update before
    the first write: a temporary of the bucket's size, or a second pass)."""
    pairs = [(old, new) for old, new in zip(_tree.tree_leaves(state), _tree.tree_leaves(new_state))
             if old is not None and new is not None and new is not old and new.is_floating_point()]
    outputs = [u for u in _tree.tree_leaves(updates) if u is not None] + [new for _, new in pairs]
    skipped = torch.where(finite, 0.0, float("nan"))
    sums: dict[torch.Size, torch.Tensor] = {}
    for t in outputs:
        sums[t.shape] = t.float() + skipped if t.shape not in sums else sums[t.shape] + t
    zeros = {shape: total - total for shape, total in sums.items()}  # 0, or NaN where not finite
    ok = {shape: z == 0 for shape, z in zeros.items()}
    def keep(old, new):  # leaf by leaf (not by id(): torch 2.10's Dynamo cannot trace id() of a tensor)
        if old is None or new is None or new is old:
            return new
        return torch.where(ok[new.shape] if new.is_floating_point() else finite, new, old)

    new_state = _tree.tree_map(keep, state, new_state)
    flags = tuple(None if u is None else ok[u.shape] for u in updates)
    whole = torch.stack([z.sum() for z in zeros.values()]).sum().isfinite() if zeros else torch.ones_like(finite)
    return updates, new_state, flags, finite & ~whole


def compute_bucket(tx: GradientTransformation, params: tuple, grads: tuple, state: Any,
                   finite: torch.Tensor | None) -> tuple:
    """``tx.update`` on one bucket under the flag ``finite`` and the guard (:func:`guarded`):
    ``(updates, new state, ok, fault)``. The gradients are zeroed first where the step is
    skipped, so the transform never sees a non-finite value of a skipped step. Nothing is written."""
    elementwise = info(tx).scope == ELEMENTWISE
    updates, new_state = tx.update(grads if elementwise else masked(grads, finite), state, params)
    return guarded(state, updates, new_state, finite, elementwise=elementwise)


def commit(staged: Sequence[Staged]) -> None:
    """Write every staged bucket: each new state into its buffer, then each update into its
    parameter, in place (where a bucket's ``ok`` is False its parameters keep every bit)."""
    olds, news, params, updates, flagged = [], [], [], [], []
    for s in staged:
        for old, new in zip(_tree.tree_leaves(s.state), _tree.tree_leaves(s.new_state)):
            if old is not None and new is not None and new is not old:
                olds.append(old)
                news.append(new)
        for k, (p, u) in enumerate(zip(s.params, s.updates)):
            if u is not None and s.ok is not None:
                flagged.append((p, u, s.ok[k] if isinstance(s.ok, tuple) else s.ok))
            elif u is not None:
                params.append(p)
                updates.append(u)
    if olds:
        torch._foreach_copy_(olds, news)
    if params:
        torch._foreach_add_(params, updates)
    if flagged and torch.compiler.is_compiling():  # traced: each p written by one fused kernel
        torch._foreach_copy_([p for p, _, _ in flagged], [torch.where(ok, p + u, p) for p, u, ok in flagged])
    elif flagged:
        for p, u, ok in flagged:
            _guarded_add(p, u, ok)


def _guarded_add(p: torch.Tensor, u: torch.Tensor, ok: torch.Tensor) -> None:
    """``p ← where(ok, p + u, p)``, eagerly, as ``p + where(ok, u, -0.0)``: adding -0.0 leaves
    every value as it is (adding +0.0 would turn a -0.0 into +0.0), so the bits are the same,
    in two passes over the update instead of three. The update is masked in its own memory
    where it alone holds it (:func:`sole`), so a parameter's write holds no copy of it."""
    in_place = sole(u) and u.dtype == p.dtype and u.shape == p.shape
    p.add_(torch.where(ok, u, u.new_full((), -0.0), out=u if in_place else None))


def sole(t: torch.Tensor) -> bool:
    """Whether ``t`` alone holds its memory (no view of it is alive), so it may be overwritten;
    False where torch cannot tell."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return count is not None and not t._is_view() and count(t.untyped_storage()._cdata) <= 2


def bucket_step(tx: GradientTransformation, *, write: bool, measure: bool) -> Callable[..., BucketResult]:
    """One bucket's step of ``tx``, ``(params, grads, state, finite, leaves) -> BucketResult``
    (compiled per signature by :class:`muon_fn.core.compile.PerSignature`): :func:`compute_bucket`,
    with ``measure`` also the raw figures (:mod:`muon_fn.core.metrics`) of the bucket's leaves
    ``leaves`` (the gradients' figure is that of the gradients as they came: a skipped step shows
    its inf or nan there), and with ``write`` its :func:`commit` inside the same function (one
    graph that writes the new state and the parameters in place)."""

    elementwise = info(tx).scope == ELEMENTWISE

    def step(params, grads, state, finite, leaves):
        # an elementwise transform's every output is masked per element: its inputs need not be
        inputs = grads if elementwise else masked(grads, finite)
        if measure:
            updates, new_state, raw = _metrics.measured_update(tx, inputs, state, params, leaves, grads=grads)
        else:
            (updates, new_state), raw = tx.update(inputs, state, params), None
        updates, new_state, ok, fault = guarded(state, updates, new_state, finite, elementwise=elementwise)
        if not write:
            return BucketResult(updates, new_state, ok, fault, raw)
        commit([Staged(params, updates, state, new_state, ok)])
        return BucketResult(None, None, None, fault, raw)  # written: no mask leaves the graph

    return step


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

    def __init__(self, fault: bool = False) -> None:
        self.fault = fault  # the flags are the guard's (an optimizer fault), not the gradients'
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
        from .views import warn

        if self.fault:
            warn(f"{owner}: optimizer fault: finite gradients gave a non-finite update or state for {'; '.join(bad)}; "
                 "those parameters and their optimizer state were left unchanged for this step. The fault is the "
                 "optimizer's (a miscompiled graph or an overflow), not the data's. Later faults are counted in "
                 "optimizer.optimizer_faults and metrics()['optimizer_faults'] without a warning; compile=False "
                 "runs the step eagerly (see docs/faq.md, 'Optimizer faults').")
            return
        warn(f"{owner}: skipped a step: non-finite gradient (inf or nan) in {', '.join(bad)}; parameters "
             "and optimizer state were left unchanged (nonfinite='skip', the default). Later skipped steps "
             "are counted in optimizer.nonfinite_steps without a warning; pass nonfinite='error' to raise "
             "instead, or use torch.amp.GradScaler for fp16 training.")
