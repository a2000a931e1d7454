"""The step of :class:`muon_fn.Optimizer` (a base of it): gradients read and checked, every
bucket's update computed (staged), then one commit (:mod:`._apply`). Nothing changes before the
commit, so a step that raises (a non-finite gradient under ``nonfinite="error"``, a compiler error,
an out-of-memory) leaves the parameters, the state, the accumulation window and the step counts
as they were.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from .. import _compile, _execution, _tree
from .._base import GradientTransformation
from . import _state
from ._apply import SkipNotice, Staged, commit, finite_flags

# The adapters' step runs its own compiled graphs; an outer torch.compile(opt.step) leaves it to them.
step_not_traced = _compile.not_traced(
    "muon_fn optimizers compile their own step (see their compile= argument); "
    "torch.compile(opt.step) leaves the step to those graphs, so use it with fullgraph=False")


class StepReport(NamedTuple):
    """What the last ``step()`` did (reading ``finite`` as a bool syncs with the device)."""

    finite: torch.Tensor  # shape=(), bool: False if the step was skipped for non-finite grads
    applied: bool  # False for an accumulation micro-step that changed no parameter


class _Work(NamedTuple):
    """One group's part of a step."""

    index: int  # the group's position in param_groups
    grads: tuple  # what its transform receives (a window's mean under accumulation)
    window: tuple | None  # accumulation: this micro-batch's gradients (None: no accumulation)
    last: bool  # the window's last micro-batch: the update is applied


def signature(params: tuple, grads: tuple, finite: torch.Tensor | None) -> tuple:
    """What a compiled bucket step is specialized on (a new one compiles once)."""
    return (finite is None,) + tuple(
        (tuple(p.shape), p.stride(), p.dtype, p.device)
        + (None if g is None else (g.dtype, g.stride(), g.device),) for p, g in zip(params, grads))


class StagedStep:
    """``step()`` of :class:`muon_fn.Optimizer`: stage every bucket, then commit."""

    nonfinite: str | None
    last_step: StepReport | None
    _nonfinite_count: torch.Tensor | None

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimization step (or accumulate one micro-batch).

        All or nothing: every bucket's update is computed before any parameter or state
        changes. Reads nothing back from the device unless ``nonfinite="error"``; ``.grad`` is
        never modified. Already compiled: ``torch.compile(opt.step)`` leaves it to these graphs."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step()
        self._post_step()
        return loss

    def _post_step(self) -> None:
        """Hook for subclasses: what changes the parameters after the update (e.g. QK-Clip)."""

    @step_not_traced
    def _step(self) -> None:
        work = self._work()
        applied = [w for w in work if w.last]
        finite = self._finite(applied)  # "error": raised here, before anything changed
        staged: list[Staged] = []
        fresh: list[tuple[tuple, list[dict]]] = []
        measured: list[tuple[Any, tuple]] | None = [] if applied and self._measure_now() else None
        for w in applied:
            staged += self._stage_group(w.index, w.grads, finite, fresh, measured)
        # ---- commit: nothing above changed the optimizer
        self._store_states(fresh)
        commit(staged)
        for w in work:
            self._commit_window(w)
        if measured is not None:
            self._keep_figures(measured, finite)
        if applied:
            self._applied_steps = self.__dict__.get("_applied_steps", 0) + 1
            if finite is not None:
                self._count_nonfinite(finite)
        self.last_step = StepReport(torch.ones((), dtype=torch.bool) if finite is None else finite, bool(applied))

    def _work(self) -> list[_Work]:
        """Every group's gradients (read first: a sparse one raises before anything changes)."""
        read = [(index, self._grads(group)) for index, group in enumerate(self.param_groups)]
        work = []
        for index, grads in read:
            if grads is None:
                continue
            k = self.param_groups[index]["gradient_accumulation_steps"]
            if k == 1:
                work.append(_Work(index, grads, None, True))
                continue
            mean = self._window_mean(index, grads, k)
            work.append(_Work(index, grads if mean is None else mean, grads, mean is not None))
        return work

    def _grads(self, group: dict[str, Any]) -> tuple[torch.Tensor | None, ...] | None:
        grads = []
        for p in group["params"]:
            g = p.grad
            if g is not None and g.is_sparse:
                raise RuntimeError(f"muon_fn does not support sparse gradients (parameter {self._name(group, p)})")
            grads.append(None if g is None else g.detach())
        return None if all(g is None for g in grads) else tuple(grads)

    # ----------------------------------------------------------------------- accumulation
    def _window_mean(self, index: int, grads: tuple, k: int) -> tuple | None:
        """On a window's last micro-batch, the mean of its ``k`` gradients (the accumulators plus
        this one, nothing written); None on the others."""
        group = self.param_groups[index]
        if group.get("micro_step", 0) + 1 < k:
            return None
        out = []
        for p, g in zip(group["params"], grads):
            acc = self.state.get(p, {}).get("grad_accumulator")
            total = g if acc is None else acc if g is None else acc + g
            out.append(None if total is None else total / k)
        return tuple(out)

    def _commit_window(self, w: _Work) -> None:
        """The accumulation window after a committed step: add this micro-batch to the
        accumulators, or (its last) drop them and start a new window."""
        if w.window is None:
            return
        group = self.param_groups[w.index]
        if w.last:
            group["micro_step"] = 0
            for p in group["params"]:
                self.state.get(p, {}).pop("grad_accumulator", None)
            return
        group["micro_step"] = group.get("micro_step", 0) + 1
        for p, g in zip(group["params"], w.window):
            if g is not None:
                st = self.state[p]
                acc = st.get("grad_accumulator")
                st["grad_accumulator"] = g.clone() if acc is None else acc.add_(g)

    # ----------------------------------------------------------------------- buckets
    def _stage_group(self, index: int, grads: tuple, finite: torch.Tensor | None,
                     fresh: list[tuple[tuple, list[dict]]], measured: list | None = None) -> list[Staged]:
        """Every bucket of group ``index`` computed; new state dicts go to ``fresh``, and with
        ``measured`` (a list: telemetry) each bucket's raw figures there."""
        group = self.param_groups[index]
        rt = self._runtime(index)
        params, staged = group["params"], []
        atomic = self.__dict__.get("atomic", True)
        for b, bucket in enumerate(rt.buckets):
            bucket_grads = tuple(grads[i] for i in bucket.indices)
            if all(g is None for g in bucket_grads):
                continue
            bucket_params = tuple(params[i] for i in bucket.indices)
            variant = rt.variants[bucket.variant]
            state, new_dicts = self._bucket_state(variant.tx, bucket, bucket_params)
            new = [] if new_dicts is None else [(bucket_params, new_dicts)]
            if atomic:
                fresh += new
            if self._compile_options is not None and _execution.policy(bucket_params[0].device).static_addresses:
                _execution.mark_static(bucket_params + tuple(_tree.tree_leaves(state)))
            key = signature(bucket_params, bucket_grads, finite)
            if measured is None and not atomic:  # written in the graph
                variant.applied(key, bucket_params, bucket_grads, state, finite)
                self._store_states(new)
                continue
            if measured is None:
                updates, new_state = variant.step(key, bucket_params, bucket_grads, state, finite)
            else:
                updates, new_state, raw = variant.measured(key, bucket_params, bucket_grads, state, finite,
                                                           bucket.leaves)
                measured.append(((index, b), self._labels(index, bucket.indices, bucket.leaves), raw))
            self._stage(staged, Staged(bucket_params, updates, state, new_state), new)
        return staged

    def _stage(self, staged: list[Staged], item: Staged, fresh: Sequence[tuple[tuple, list[dict]]] = ()) -> None:
        """Hold ``item`` for the step's commit (``atomic=True``, the default), or write it now
        (``atomic=False``: the transient memory of one bucket instead of the whole step's),
        with ``fresh`` state dicts stored first (:meth:`_store_states`)."""
        if self.__dict__.get("atomic", True):
            staged.append(item)
            return
        self._store_states(fresh)
        commit([item])

    def _store_states(self, fresh: Sequence[tuple[tuple, list[dict]]]) -> None:
        """Put fresh state dicts ``(params, dicts)`` (:meth:`_bucket_state`) into ``self.state``."""
        for params, dicts in fresh:
            for p, st in zip(params, dicts):
                self.state[p].update(st)

    def _bucket_state(self, tx: GradientTransformation, bucket: Any, params: tuple) -> tuple[Any, list[dict] | None]:
        """The bucket's state pytree; where some of it does not exist yet (a first step, a
        parameter added later), also the parameters' state dicts holding it, fresh from
        ``tx.init`` (loaded state kept), for the commit to store."""
        states = [self.state.get(p, {}) for p in params]
        if _state.complete(bucket.layout, states):
            return _state.gather(bucket.layout, states), None
        states = [dict(st) for st in states]
        _state.scatter(bucket.layout, tx.init(tuple(p.detach() for p in params)), states, overwrite=False)
        return _state.gather(bucket.layout, states), states

    # ----------------------------------------------------------------------- non-finite gradients
    def _finite(self, work: list[_Work]) -> torch.Tensor | None:
        """One check over every gradient of the step, on the device (None: ``nonfinite=None``).
        ``"error"`` raises here, naming the parameters; ``"skip"`` warns at the first skip."""
        if self.nonfinite is None or not work:
            return None
        pairs = [(w.index, i, g) for w in work for i, g in enumerate(w.grads) if g is not None]
        flags = finite_flags([g for _, _, g in pairs])
        finite = flags.all()

        def names() -> list[str]:
            return [self._name(self.param_groups[gi], self.param_groups[gi]["params"][i]) for gi, i, _ in pairs]

        if self.nonfinite == "error" and not bool(finite):
            self._count_nonfinite(finite)
            bad = [n for n, ok in zip(names(), flags.tolist()) if not ok]
            raise RuntimeError(
                f"non-finite gradient (inf or nan) in {', '.join(bad)}; parameters and optimizer state were left "
                "unchanged. Pass nonfinite='skip' to skip such steps, or use torch.amp.GradScaler.")
        self._skip_notice().watch(flags, names, type(self).__name__)
        return finite

    def _skip_notice(self) -> SkipNotice:
        notice = self.__dict__.get("_skipped")
        if notice is None:
            notice = self.__dict__["_skipped"] = SkipNotice()
        return notice

    def _count_nonfinite(self, finite: torch.Tensor) -> None:
        bad = (~finite).long()
        self._nonfinite_count = bad if self._nonfinite_count is None else self._nonfinite_count + bad

    @property
    def nonfinite_steps(self) -> int:
        """How many steps were skipped (or raised) because of non-finite gradients (reading it
        syncs with the device)."""
        return 0 if self._nonfinite_count is None else int(self._nonfinite_count)

    def _nonfinite_params(self, work: list) -> list[str]:
        """The names of the parameters with a non-finite gradient in ``work`` (``(group index,
        grads)`` pairs; one host read per gradient)."""
        bad = []
        for index, grads in work:
            group = self.param_groups[index]
            for p, g in zip(group["params"], grads):
                if g is not None and not bool(torch.isfinite(g).all()):
                    bad.append(self._name(group, p))
        return bad
