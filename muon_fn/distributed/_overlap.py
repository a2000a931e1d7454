"""``overlap=True`` of the FSDP optimizers: each bucket's gather starts during backward.

FSDP2 reduce-scatters a module's gradients in its post-backward and then calls the sharded
parameters' post-accumulate-grad hooks (``Tensor.register_post_accumulate_grad_hook``), once per
backward that syncs gradients, with the final sharded gradient in ``.grad``. :class:`Overlap`
hooks every sharded matrix parameter; when every parameter of the plan's next bucket has its
gradient (buckets run in reverse parameter order, the order backward finishes them), it runs that
bucket's pre phase (Muon: momentum) on the local rows and posts its gather
(:class:`~muon_fn.distributed._exchange.Posted`), then tries the next bucket. Buckets are posted in plan
order on every rank, on a process group of their own (:func:`~muon_fn.distributed._exchange.dedicated_group`),
so they never interleave with FSDP2's collectives. ``step()`` posts what is left
(:meth:`Overlap.complete`), waits for the gathers still in flight, computes and returns as without
overlap.

What the step does not know during backward is kept out of the pre phase's effects: its new state
is held and written back by ``step()`` under the all-ranks finite flag (``nonfinite="skip"`` and
``"error"`` keep their meaning), so results equal the non-overlapped step bit for bit.

Rules (one round = the gathers posted between two steps):

- Plain (replicated) parameters are never hooked: their gradient is final only after a DDP-style
  all-reduce that no hook sees, so a bucket holding one, and every later bucket, is posted by
  ``step()``. So is a bucket with a parameter that got no gradient in backward.
- ``step()`` checks that every gradient read during backward is still ``.grad`` (the same tensor,
  not modified in place as far as its version counter tells); if not on some rank (all ranks
  agree with one tiny all-reduce), every gather is drained and the step runs without overlap on
  the gradients it finds. Changes the version counter does not see (in-place collectives,
  ``clip_grad_norm_`` on DTensor gradients) are not detected: gradients must not change between
  backward and ``step()`` with ``overlap=True``.
- A backward that starts while a round is in flight (a backward without a step) drains it first,
  and so do ``zero_grad()`` and ``load_state_dict()``: waiting is safe, as every rank posted the
  same gathers.
- The hooks hold the optimizer weakly and are removed when it is garbage-collected or
  ``overlap`` is set to False.
"""

from __future__ import annotations

import time
import weakref
from typing import Any, NamedTuple

import torch

from ..core.compile import not_traced
from . import _exchange


class Ready(NamedTuple):
    """Every bucket posted, handed to the step."""

    posted: _exchange.Posted
    deferred: list[tuple[Any, Any, tuple]]  # (stored pre state, its new value, the params) to write back
    in_backward: int  # buckets posted during backward
    backward_s: float  # time the hooks spent (pre phase and posting)


class Overlap:
    """The hooks and the round in flight of one optimizer's distributed executor (``ex``, held weakly)."""

    def __init__(self, ex: Any) -> None:
        self._ex = weakref.ref(ex)
        self.group = _exchange.dedicated_group(ex.topology.group)
        self.handles: list[Any] = []
        me = weakref.ref(self)
        # FSDP2 calls these hooks after its reduce-scatter: only its parameters' gradients are
        # final then (a plain or a DTensor parameter outside fully_shard is reduced later, if at all).
        managed = {id(p) for module in ex._fsdp_modules for p in module.parameters()}
        hooked = list({id(m.param): m.param for m in ex._matrices()
                       if ex._layouts[id(m.param)].sharded and id(m.param) in managed}.values())
        for p in hooked:
            self.handles.append(p.register_post_accumulate_grad_hook(_hook(me)))
        weakref.finalize(self, _remove, self.handles)
        self.hooked = {id(p) for p in hooked}
        self.expected = set(self.hooked)  # the hooked parameters whose hook fired last round
        self._reset()

    def _reset(self) -> None:
        self.posted: _exchange.Posted | None = None
        self.matrices: list | None = None  # the optimizer's matrix list the round was posted for
        self.ready: set[int] = set()  # ids of parameters whose gradient is final this round
        self.consumed: list[tuple[torch.Tensor, Any, int]] = []  # (param, its .grad, version)
        self.deferred: list[tuple[Any, Any, tuple]] = []
        self.in_backward, self.backward_s = 0, 0.0

    def remove(self) -> None:
        """Remove the hooks (after draining the round)."""
        self.drop()
        _remove(self.handles)

    def drop(self) -> float:
        """Drain the round in flight, if any, and forget it; returns the seconds waited."""
        waited = self.posted.drain() if self.posted is not None else 0.0
        self._reset()
        return waited

    # ------------------------------------------------------------------ during backward
    def on_grad(self, p: torch.Tensor) -> None:
        ex = self._ex()
        if ex is None or not ex._overlap_armed():
            return
        t0 = time.perf_counter()
        if id(p) in self.ready:  # a new backward, and no step since the last one
            self.drop()
        self.ready.add(id(p))
        matrices = ex._matrix_list
        if self.matrices is None:
            self.matrices = matrices
            self.posted = _exchange.Posted(ex.plan, ex.topology.rank, group=self.group,
                                           wire_dtype=ex.wire_dtype)
        elif self.matrices is not matrices:  # the plan was rebuilt: the step reposts
            return
        pending = {id(bucket) for _, _, bucket in ex._pending_init}
        while self.posted.next_bucket < len(ex.plan.buckets) and all(
                self._final(m.param) and id(m.bucket) not in pending for m in _members(ex, self.posted.next_bucket)):
            self._post(ex, None)
            self.in_backward += 1
        self.backward_s += time.perf_counter() - t0

    def _final(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s gradient is final this round: its hook fired, or it is hooked and its
        hook did not fire last round (a parameter without gradient, e.g. unused; if it gets one
        after all, the step sees a changed gradient)."""
        return id(p) in self.ready or (id(p) in self.hooked and id(p) not in self.expected)

    def _post(self, ex: Any, grads: list | None) -> None:
        """Run the pre phase of the next bucket's matrices and post its gather; ``grads``: the
        step's local gradients (None: read them now, recording what was read)."""
        b = self.posted.next_bucket  # type: ignore[union-attr]
        members = _members(ex, b)
        if grads is None:
            grads = [[None] * len(g["params"]) for g in ex.opt.param_groups]
            for m in members:
                group = ex.opt.param_groups[m.group]
                grads[m.group][m.position] = ex._local_grad(group, m.param, ex._accumulation_steps)
                g = m.param.grad
                self.consumed.append((m.param, g, -1 if g is None else g._version))
        units = {id(m.bucket) for m in members}
        held = ex._pre(self.matrices, grads, None, only=units, deferred=self.deferred)
        self.posted.post(b, {j: held[j] for j in ex.plan.buckets[b].matrices})  # type: ignore[union-attr]

    # ------------------------------------------------------------------ in step()
    def complete(self, grads: list[tuple]) -> Ready | None:
        """Post every bucket not posted yet (from the step's gradients ``grads``), in plan order,
        then agree with every rank whether the gradients read during backward are still the
        step's; returns the round, or None (drained) if they are not on some rank."""
        ex = self._ex()
        matrices = ex._matrices()
        if self.matrices is not matrices:  # nothing posted, or for another plan (every rank alike)
            self.drop()
            self.matrices = matrices
            self.posted = _exchange.Posted(ex.plan, ex.topology.rank, group=self.group,
                                           wire_dtype=ex.wire_dtype)
        while self.posted.next_bucket < len(ex.plan.buckets):  # type: ignore[union-attr]
            self._post(ex, grads)
        changed = any(p.grad is not g or (g is not None and g._version != v) for p, g, v in self.consumed)
        if self.ready:
            self.expected = set(self.ready)
        ready = Ready(self.posted, self.deferred, self.in_backward, self.backward_s)  # type: ignore[arg-type]
        if _exchange.any_rank_flag(changed, self.group, ex._device):
            self.drop()
            ex._warn_overlap_stale()
            return None
        self._reset()
        return ready


def _members(ex: Any, b: int) -> list:
    """The matrices (``_Matrix``) of the plan's bucket ``b``."""
    return [ex._matrix_list[j] for j in ex.plan.buckets[b].matrices]


def _hook(me: weakref.ref) -> Any:
    @not_traced("muon_fn's overlap hook posts collectives; it runs eagerly")
    def hook(p: torch.Tensor) -> None:
        overlap = me()
        if overlap is not None:
            overlap.on_grad(p)

    return hook


def _remove(handles: list[Any]) -> None:
    for h in handles:
        h.remove()
    handles.clear()
