"""The step of :class:`muon_fn.Optimizer` (a base of it): gradients read and checked, then
every bucket's step (:mod:`._apply`), written in place by its own graph (the default) or staged
and committed at once (``atomic=True``). Everything that can refuse a step — a sparse or
mis-shaped gradient, the accumulation window, a non-finite gradient under ``"skip"`` and
``"error"`` — is decided before the first write, so a refused or skipped step leaves the
parameters, the state, the accumulation window and the step counts as they were; staged, so does
an exception midway (a compiler error, an out-of-memory).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from ..core import compile as _compile, execution as _execution, tree as _tree
from ..core.base import GradientTransformation
from . import _state
from ._apply import BucketResult, SkipNotice, Staged, commit, finite_flags

# The adapters' step runs its own compiled graphs; an outer torch.compile(opt.step) leaves it to them.
step_not_traced = _compile.not_traced(
    "muon_fn optimizers compile their own step (see their compile= argument); "
    "torch.compile(opt.step) leaves the step to those graphs, so use it with fullgraph=False")


def refuse_sparse(g: torch.Tensor | None, name: str) -> None:
    """Raise if ``g``, the gradient of the parameter called ``name``, is sparse."""
    if g is not None and g.is_sparse:
        raise RuntimeError(f"muon_fn does not support sparse gradients (parameter {name})")


def nonfinite_error(bad: list[str]) -> RuntimeError:
    """The error of ``nonfinite="error"`` for the parameters named ``bad`` (none: another rank's)."""
    return RuntimeError(
        f"non-finite gradient (inf or nan) in {', '.join(bad) or 'parameters of another rank'}; parameters and "
        "optimizer state were left unchanged. Pass nonfinite='skip' to skip such steps, or use torch.amp.GradScaler.")


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
    """``step()`` of :class:`muon_fn.Optimizer`: check, then every bucket in place (or staged
    and committed at once)."""

    nonfinite: str | None
    last_step: StepReport | None
    _nonfinite_count: torch.Tensor | None
    _fault_count: torch.Tensor | None

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimization step (or accumulate one micro-batch).

        All or nothing for a bad batch: every check is decided before any parameter or state
        changes (and with ``atomic=True`` every bucket is computed first). Reads nothing back
        from the device unless ``nonfinite="error"``; ``.grad`` is never modified. Already
        compiled: ``torch.compile(opt.step)`` leaves it to these graphs."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._follow_params()  # parameters swapped in since the last step: laid out again first
        self._check_model_holds_params()
        self._executor.step()
        self._post_step()
        return loss

    def _post_step(self) -> None:
        """Hook for subclasses: what changes the parameters after the update (e.g. QK-Clip)."""

    @step_not_traced
    def _local_step(self) -> None:
        """The step of :class:`~._executor.LocalExecutor`."""
        work = self._work()
        applied = [w for w in work if w.last]
        self._refuse_bad_micro_batch([w for w in work if not w.last])
        finite = self._finite(applied)  # "error": raised here, before anything changed
        staged: list[Staged] = []
        fresh: list[tuple[tuple, list[dict]]] = []
        faults: list[tuple[torch.Tensor, tuple]] = []
        measured: list[tuple[Any, tuple]] | None = [] if applied and self._measure_now() else None
        for w in applied:
            staged += self._group_step(w.index, w.grads, finite, fresh, faults, measured)
        # ---- staged (atomic=True): nothing above changed the optimizer
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
                self._count_faults(faults)
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
            refuse_sparse(g, self._name(group, p))
            if g is not None and (g.shape != p.shape or g.device != p.device):
                raise RuntimeError(
                    f"gradient of parameter {self._name(group, p)} has shape {tuple(g.shape)} on {g.device}, but the "
                    f"parameter has shape {tuple(p.shape)} on {p.device}; nothing was changed")
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
    def _group_step(self, index: int, grads: tuple, finite: torch.Tensor | None, fresh: list[tuple[tuple, list[dict]]],
                    faults: list[tuple[torch.Tensor, tuple]], measured: list | None = None) -> list[Staged]:
        """Every bucket of group ``index``: written in place by its graph, or (``atomic=True``)
        returned for the step's commit, new state dicts then in ``fresh``. Each bucket's fault
        flag goes to ``faults`` with its parameters, and with ``measured`` (a list: telemetry)
        its raw figures there."""
        group = self.param_groups[index]
        rt = self._runtime(index)
        atomic = self.__dict__.get("atomic", False)
        staged = []
        for b, bucket in enumerate(rt.buckets):
            bucket_grads = tuple(grads[i] for i in bucket.indices)
            if all(g is None for g in bucket_grads):
                continue
            params = tuple(group["params"][i] for i in bucket.indices)
            variant = rt.variants[bucket.variant]
            state, new_dicts = self._bucket_state(variant.tx, bucket, params)
            new = [] if new_dicts is None else [(params, new_dicts)]
            if self._compile_options is not None and _execution.policy(params[0].device).static_addresses:
                _execution.mark_static(params + tuple(_tree.tree_leaves(state)))
            key = signature(params, bucket_grads, finite)
            step = variant.steps[(not atomic, measured is not None)]
            out: BucketResult = step(key, params, bucket_grads, state, finite,
                                     None if measured is None else bucket.leaves)
            if atomic:
                fresh += new
                staged.append(Staged(params, out.updates, state, out.new_state, out.ok))
            else:
                self._store_states(new)
            if out.fault is not None:
                faults.append((out.fault, params))
            if measured is not None:
                measured.append(((index, b), self._labels(index, bucket.indices, bucket.leaves), out.raw))
        return staged

    def _stage(self, staged: list[Staged], item: Staged) -> None:
        """Hold ``item`` for the step's commit (``atomic=True``), or write it now (the default:
        the transient memory of one bucket instead of the whole step's)."""
        if self.__dict__.get("atomic", False):
            staged.append(item)
            return
        commit([item])

    def _store_states(self, fresh: Sequence[tuple[tuple, list[dict]]]) -> None:
        """Put fresh state dicts ``(params, dicts)`` (:meth:`_bucket_state`) into ``self.state``."""
        for params, dicts in fresh:
            for p, st in zip(params, dicts):
                if st:  # a parameter without state gets no entry (as torch's optimizers)
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
            raise nonfinite_error([n for n, ok in zip(names(), flags.tolist()) if not ok])
        self._skip_notice().watch(flags, names, type(self).__name__)
        return finite

    def _refuse_bad_micro_batch(self, work: list[_Work]) -> None:
        """Under ``"error"``, a micro-batch of an accumulation window (not its last) with a
        non-finite gradient raises now, before it reaches the accumulators: the window goes on
        as if the call had not happened (one read of a flag, as every ``"error"`` step)."""
        if self.nonfinite != "error":
            return
        pairs = [(w.index, i, g) for w in work for i, g in enumerate(w.window or ()) if g is not None]
        if not pairs:
            return
        flags = finite_flags([g for _, _, g in pairs])
        if bool(flags.all()):
            return
        self._count_nonfinite(flags.all())
        bad = [self._name(self.param_groups[gi], self.param_groups[gi]["params"][i])
               for (gi, i, _), ok in zip(pairs, flags.tolist()) if not ok]
        raise RuntimeError(
            f"non-finite gradient (inf or nan) in {', '.join(bad)} in a micro-batch of a gradient accumulation "
            "window; it was not accumulated, and parameters, optimizer state and the window were left "
            "unchanged. Pass nonfinite='skip' to skip windows with such micro-batches instead.")

    def _count_faults(self, faults: list[tuple[torch.Tensor, tuple]]) -> None:
        """Count the buckets that finite gradients gave a non-finite result (on the device) and
        warn once, naming their parameters (no host sync: :class:`SkipNotice`)."""
        if not faults:
            return
        flags = torch.stack([f for f, _ in faults])
        n = flags.sum()
        self._fault_count = n if self.__dict__.get("_fault_count") is None else self._fault_count + n

        def names() -> list[str]:
            where = {id(p): g for g in self.param_groups for p in g["params"]}
            return [", ".join(self._name(where[id(p)], p) for p in params) for _, params in faults]

        notice = self.__dict__.get("_faulted")
        if notice is None:
            notice = self.__dict__["_faulted"] = SkipNotice(fault=True)
        notice.watch(~flags, names, type(self).__name__)

    @property
    def optimizer_faults(self) -> int:
        """How many times a bucket was kept back because finite gradients gave it a non-finite
        update or state (an optimizer fault: a miscompiled graph, an overflow; reading it syncs
        with the device)."""
        count = self.__dict__.get("_fault_count")
        return 0 if count is None else int(count)

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
