"""The FSDP2 adapter's step (:class:`AdapterStep`, a base of :class:`~._executor.DistributedExecutor`):
per step, the **pre** phase on every rank's local rows, the rows of every matrix to its owner
and the **mid** phase there on whole matrices (:mod:`._exchange`), the results back, and the
**post** phase on local rows, then ``p += u`` in place; transforms without a matrix part run
whole on local rows. What it runs (routes, phases, the plan, the state layout) is built at
construction by :class:`~._executor.DistributedExecutor`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

from ..core import views as _views
from ..core.muon import group_by
from ..core.newton_schulz import clear_scratch
from .. import engine
from ..engine import Staged, StepReport, commit, finite_flags, guarded, nonfinite_error, refuse_sparse, step_not_traced
from . import _exchange, _overlap, _params, _phases, _rows, _stream
from ._routes import Bucket, Route
from ._telemetry import FSDPTelemetry


class Matrix(NamedTuple):
    """A matrix of the plan: a parameter of a route with a mid phase."""

    group: int
    route: Route
    bucket: Bucket  # the matrices its owner computes together (as single-device MuonOptimizer)
    position: int  # in group["params"]
    param: torch.Tensor
    fmt: _rows.RowFormat
    flops: int  # of its orthogonalization (for last_step_stats)
    view: str | _views.Heads  # its matrix view
    piece: int | None = None  # a one-row piece of an expert stack: the row (expert); None: whole


class AdapterStep(FSDPTelemetry):
    """The step of :class:`~._executor.DistributedExecutor`, which builds everything it reads."""

    @step_not_traced
    def step(self) -> None:
        start = time.perf_counter()
        k = self._accumulation_steps
        if k > 1 and not self._last_micro_batch(k):
            return
        grads = [self._local_grads(group, k) for group in self.opt.param_groups]
        ready = self._overlap_complete(grads)
        try:
            finite = self._finite(grads)
        except BaseException:
            if ready is not None:  # "error": nothing changed, nothing left in flight
                ready.posted.drain()
            raise
        self._writes: list[Staged] = []  # atomic=True: the step's writes, committed at its end
        self._faults: list[tuple[torch.Tensor, tuple]] = []  # each bucket's guard
        stats = self._apply(grads, finite, ready)
        self.opt._applied_steps += 1
        if finite is not None:
            self.opt._count_nonfinite(finite)
            self.opt._count_faults(self._faults)
        self.opt.last_step = StepReport(torch.ones((), dtype=torch.bool) if finite is None else finite, True)
        self.opt.last_step_stats = {**stats, "step_s": time.perf_counter() - start, "applied": True}

    def _last_micro_batch(self, k: int) -> bool:
        """Count a micro-step; sync the next backward only if it is the last of a step."""
        self._micro_step += 1
        final = self._micro_step == k
        if final:
            self._micro_step = 0
        self._set_gradient_sync(self._micro_step == k - 1)
        if not final:
            self.opt.last_step = StepReport(torch.ones((), dtype=torch.bool), False)
            self.opt.last_step_stats = {"applied": False, "micro_step": self._micro_step}
        return final

    def _local_grads(self, group: dict[str, Any], k: int) -> tuple[torch.Tensor | None, ...]:
        return tuple(self._local_grad(group, p, k) for p in group["params"])

    def _local_grad(self, group: dict[str, Any], p: torch.Tensor, k: int) -> torch.Tensor | None:
        g = p.grad
        refuse_sparse(g, self.opt._name(group, p))
        g = None if g is None else _params.local(_params.placed_like(g.detach(), p))
        return g / k if g is not None and k > 1 else g

    def _finite(self, grads: list[tuple]) -> torch.Tensor | None:
        """Whether every rank's gradients are finite (agreed by all ranks, decided on the device)."""
        if self.opt.nonfinite is None:
            return None
        pairs = [(gi, i, g) for gi, gs in enumerate(grads) for i, g in enumerate(gs) if g is not None]
        flags = (finite_flags([g for _, _, g in pairs]) if pairs
                 else torch.ones(0, dtype=torch.bool, device=self._device))
        flag = flags.all() if pairs else torch.ones((), dtype=torch.bool, device=self._device)
        finite = _exchange.all_ranks_finite(flag, self.topology.group, self.topology.world_size)
        if self.opt.nonfinite == "error" and not bool(finite):
            self.opt._count_nonfinite(finite)
            raise nonfinite_error(self.opt._nonfinite_params(list(enumerate(grads))))

        def names() -> list[str]:
            groups = self.opt.param_groups
            return [self.opt._name(groups[gi], groups[gi]["params"][i]) for gi, i, _ in pairs]

        self.opt._skip_notice().watch(flags, names, type(self.opt).__name__, everywhere=finite)
        return finite

    def _apply(self, grads: list[tuple], finite: torch.Tensor | None,
               ready: _overlap.Ready | None = None) -> dict[str, Any]:
        matrices, topo = self._matrices(), self.topology
        figs: dict | None = {} if self.opt._measure_now() else None  # telemetry (._telemetry)
        if figs is not None and ready is not None:  # a measured step runs without overlap
            ready.posted.drain()
            ready = None
        if self._pending_init and ready is None:
            self._init_from_whole(grads)
        new_replicated: dict[int, list[torch.Tensor]] = {}
        compute = functools.partial(self._mid, matrices, new_replicated, finite, figs)
        cols = [m.fmt.returned_cols for m in matrices]
        if ready is None and self.strategy == "owner" and topo.world_size > 1:  # bucket by bucket
            ex = self._stream(matrices, grads, finite, figs, compute, cols, new_replicated)
        else:
            if ready is None:
                held = self._pre(matrices, grads, finite, deferred=[], figs=figs)
                run = _exchange.exchange if self.strategy == "owner" else _exchange.exchange_replicated
                mine, ex = run(self.plan, topo.rank, held, compute, group=topo.group, wire_dtype=self.wire_dtype,
                               result_cols=cols)
            else:  # every gather posted (overlap): the pre phase ran before the flag was known
                for state, new_state, params in ready.deferred:
                    _, new_state, _, fault = guarded(state, (), new_state, finite)
                    self._write(Staged((), (), state, new_state), fault, params)
                mine, ex = ready.posted.finish(compute, result_cols=cols)
            self._post(matrices, grads, mine, self._share(matrices, new_replicated), finite, figs)
        self._elementwise(grads, finite, figs)
        commit(self._writes)  # atomic=False: written already, bucket by bucket
        if figs is not None:
            self._keep_fsdp_figures(figs, finite)
        computed = [j for j, mp in enumerate(self.plan.matrices) if self.strategy == "replicate" or
                    mp.owner == topo.rank or (mp.local and mp.cost_on(topo.rank))]
        flops = sum(matrices[j].flops if self.strategy == "replicate" or not self.plan.matrices[j].local else
                    matrices[j].flops * self.plan.matrices[j].cost_on(topo.rank) // max(self.plan.matrices[j].cost, 1)
                    for j in computed)
        stats = {"strategy": self.strategy, "rank": topo.rank, "world_size": topo.world_size,
                 "bytes_sent": ex.bytes_sent, "bytes_received": ex.bytes_received,
                 "ns_flops": flops, "matrices_computed": len(computed),
                 "comm_wait_s": ex.comm_wait_s, "compute_s": ex.compute_s}
        if self._overlap is not None:
            stats.update(overlapped_buckets=0 if ready is None else ready.in_backward,
                         overlap_backward_s=0.0 if ready is None else ready.backward_s)
        return stats

    def _stream(self, matrices: list[Matrix], grads: list[tuple], finite: torch.Tensor | None, figs: dict | None,
                compute: Any, cols: list[int], new_replicated: dict) -> _exchange.ExchangeStats:
        """The pre phase, the exchange and the post phase bucket by bucket of the plan
        (:mod:`._stream`): a unit's rows are packed just before they travel and its results
        applied as soon as they are back (a bucket's replicated mid state shared once its owners
        computed it, one all-reduce)."""
        shared: dict[int, dict[int, list[torch.Tensor]]] = {}  # bucket -> its shared mid state

        def units(js: Any) -> set[int]:
            return {id(matrices[j].bucket) for j in js}

        def together(b: Any) -> bool:
            """Whether the bucket's pre and post phases run whole, in one order on every rank:
            a parameter with sharded columns is redistributed to rows and back (collectives)."""
            return any(self._layouts[id(matrices[j].param)].row_placements is not None for j in b.matrices)

        def pre(b: Any, js: Any) -> dict[int, torch.Tensor]:
            ran = units(b.matrices if js is None or together(b) else js)
            held = self._pre(matrices, grads, finite, ran, deferred=[], figs=figs)
            return {j: held[j] for j in b.matrices if id(matrices[j].bucket) in ran}

        def share(b: Any) -> None:
            new = {j: new_replicated.pop(j) for j in b.matrices if j in new_replicated}
            shared[b.index] = self._share(matrices, new, b.matrices)

        def post(b: Any, mine: dict[int, torch.Tensor], final: bool) -> None:
            ready = units(mine) - units(j for j in b.matrices if j not in mine)
            if not ready or (together(b) and not final):
                return
            rows: list[Any] = [None] * len(matrices)
            for j in [j for j in mine if id(matrices[j].bucket) in ready]:
                rows[j] = mine.pop(j)
            self._post(matrices, grads, rows, shared[b.index], finite, figs, ready)

        topo = self.topology
        like = torch.empty(0, dtype=self._wire_in, device=self._device)
        return _stream.stream(self.plan, topo.rank, pre, compute, share, post, like=like, group=topo.group,
                              wire_dtype=self.wire_dtype, result_cols=cols, inflight_bytes=self.inflight_bytes)

    def _mid_buckets(self) -> Iterator[tuple[int, Route, Bucket, list[torch.Tensor]]]:
        """(group index, route, bucket, group params) of every route with a mid phase."""
        for gi, group in enumerate(self.opt.param_groups):
            for route in self._routes(gi):
                if route.phases.mid is not None:
                    for bucket in route.buckets:
                        yield gi, route, bucket, group["params"]

    def _pre(self, matrices: list[Matrix], grads: list[tuple], finite: torch.Tensor | None,
             only: set[int] | None = None, *, deferred: list, figs: dict | None = None) -> list[torch.Tensor]:
        """The pre phase on local rows; returns every matrix's rows to send (:mod:`._rows`).
        ``only``: the ids of the buckets to run (default: all). Each bucket's new state is written
        (:meth:`_write`), or, with ``finite`` None and ``nonfinite`` set (overlap: the flag is not
        known yet), goes to ``deferred`` as ``(state, new state, params)``; the step applies the
        flag and the guard to it."""
        held: list[torch.Tensor | None] = [None] * len(matrices)
        for gi, route, bucket, params in self._mid_buckets():
            if only is not None and id(bucket) not in only:
                continue
            local = tuple(_params.local(params[i]) for i in bucket.indices)
            g = tuple(grads[gi][i] for i in bucket.indices)
            state, _, _ = route.phases.states(self._local_state(bucket, params))
            if all(x is None for x in g):
                updates = (None,) * len(g)
            else:
                if finite is None and self.opt.nonfinite is not None:
                    updates, new_state = route.steps.pre_update(_phases.signature(local, g, state), local, g, state)
                    deferred.append((state, new_state, tuple(params[i] for i in bucket.indices)))
                elif figs is not None:
                    leaves = self._local_leaves(gi, bucket, params)
                    args = (local, g, state, finite, leaves)
                    updates, new_state, fault, raw = route.steps.pre_measured(_phases.signature(*args[:4]), *args)
                    self._note(figs, gi, bucket.indices, leaves, raw)
                    self._write(Staged((), (), state, new_state), fault, tuple(params[i] for i in bucket.indices))
                else:
                    args = (local, g, state, finite)
                    updates, new_state, fault = route.steps.pre(_phases.signature(*args), *args)
                    self._write(Staged((), (), state, new_state), fault, tuple(params[i] for i in bucket.indices))
            for i, p, u in zip(bucket.indices, local, updates):
                js = self._index[(gi, i)]
                fmt = matrices[js[0]].fmt
                rows = [_params.local(self.opt.state[params[i]][leaf.key]) for leaf in fmt.row_states]
                packed = _rows.pack(fmt, *self._as_rows(fmt, params[i], u, p), rows, self._wire_in)
                start = self._layouts[id(params[i])].rows[0]
                for j in js:  # a stack cut into pieces: each piece's row, if this rank holds it
                    e = matrices[j].piece
                    held[j] = packed if e is None else packed[e - start:e - start + 1] if (
                        0 <= e - start < packed.shape[0]) else packed[:0]
        return held  # type: ignore[return-value]

    def _as_rows(self, fmt: _rows.RowFormat, param: torch.Tensor, update: torch.Tensor | None,
                 local: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The update and the parameter as this rank's row block of ``param`` (the same tensors
        unless columns are sharded: then every rank takes part, zeros standing in for no update)."""
        layout = self._layouts[id(param)]
        if layout.row_placements is None:
            return update, local
        if update is None:
            update = torch.zeros(local.shape, dtype=fmt.update_dtype, device=local.device)
        carried = _params.to_rows(layout, param, local) if fmt.param_dtype is not None else local
        return _params.to_rows(layout, param, update), carried

    def _from_rows(self, fmt: _rows.RowFormat, param: torch.Tensor, local: torch.Tensor,
                   result: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """This rank's rows of a matrix's result as its update (laid out like ``local``) and
        its new row states (the inverse of :meth:`_as_rows`; every rank takes part)."""
        layout = self._layouts[id(param)]
        if layout.row_placements is None:
            return _rows.unpack_result(fmt, result, local.shape)
        start, stop = layout.rows
        update, rows = _rows.unpack_result(fmt, result, (stop - start,) + tuple(param.shape[1:]))
        return _params.from_rows(layout, param, update), rows

    def _mid(self, matrices: list[Matrix], new_replicated: dict, finite: torch.Tensor | None, figs: dict | None,
             idx: list[int], mats: list[torch.Tensor]) -> list[torch.Tensor]:
        """The owner's mid phase on whole matrices ``mats`` (plan indices ``idx``), one call per
        bucket, as single-device MuonOptimizer batches them (its inputs zeroed where ``finite``
        is False); new replicated state goes to ``new_replicated``."""
        results: dict[int, torch.Tensor] = {}
        for members in group_by([id(matrices[j].bucket) for j in idx]):
            batch, inputs, pieces = self._whole_bucket(matrices, [idx[q] for q in members], [mats[q] for q in members])
            rows = {idx[q]: mats[q].shape[0] for q in members}
            route, bucket = matrices[batch[0]].route, matrices[batch[0]].bucket
            assert [matrices[j].position for j in batch] == list(bucket.indices)  # the plan's units
            sent = [_rows.unpack_sent(matrices[j].fmt, x) for j, x in zip(batch, inputs)]
            for j, (_, _, states) in zip(batch, sent):
                for leaf in matrices[j].fmt.replicated:
                    states[leaf.key] = _params.local(self.opt.state[matrices[j].param][leaf.key])
            layout = bucket.phase_layouts[1]
            state = engine.gather_state(layout, [states for _, _, states in sent])
            updates = tuple(u for u, _, _ in sent)
            params = tuple(p for _, p, _ in sent) if route.phases.mid_needs_params else None
            into = self._gathered(idx)
            if into:
                _phases.masked_in_place(updates, finite)
            args = (params, updates, state, finite, into)
            if figs is None:
                out, new_state = route.steps.mid(_phases.signature(*args), *args)
            else:
                leaves = self._owner_leaves(matrices, batch, pieces)
                out, new_state, raw = route.steps.mid_measured(_phases.signature(*args), *args, leaves)
                self._note(figs, matrices[batch[0]].group, tuple(matrices[j].position for j in batch), leaves, raw)
            for q in members:  # the whole inputs are freed before the results are packed
                mats[q] = None  # type: ignore[call-overload]
            del args, updates, params, sent, inputs
            new = [{} for _ in batch]
            engine.scatter_state(layout, new_state, new)
            for j, u, n, own in zip(batch, out, new, pieces):
                result = _rows.pack_result(matrices[j].fmt, u, n, self._wire_in)
                for k, piece in zip(own, result.split([rows[k] for k in own])) if own is not None else [(j, result)]:
                    results[k] = piece
                    new_replicated[k] = [n[leaf.key] for leaf in matrices[j].fmt.replicated]
        if self.inflight_bytes is not None:  # bounded: the iteration's scratch does not outlive its bucket
            clear_scratch()
        return [results[j] for j in idx]

    def _gathered(self, idx: list[int]) -> bool:
        """Whether the matrices ``idx`` reached the mid phase through the owner-computes gather,
        in its own buffers, which the results may then overwrite (a local matrix's rows, the
        replicated baseline's and one rank's are the pre phase's: :mod:`._exchange`)."""
        return (self.strategy == "owner" and self.topology.world_size > 1
                and not any(self.plan.matrices[j].local for j in idx))

    def _whole_bucket(self, matrices: list[Matrix], batch: list[int],
                      mats: list[torch.Tensor]) -> tuple[list[int], list[torch.Tensor], list]:
        """A bucket's matrices as its mid step takes them, one per parameter: a stack cut into
        pieces as the stack of the pieces given here (in row order; none: 0 rows). Returns a plan
        index per parameter, the inputs, and per parameter its pieces' plan indices (None if whole)."""
        if all(matrices[j].piece is None for j in batch):
            return batch, mats, [None] * len(batch)
        gi = matrices[batch[0]].group
        given = dict(zip(batch, mats))
        by_position: dict[int, list[int]] = {}
        for j in sorted(batch, key=lambda j: matrices[j].piece):
            by_position.setdefault(matrices[j].position, []).append(j)
        out, inputs, pieces = [], [], []
        for position in matrices[batch[0]].bucket.indices:
            own = by_position.get(position, [])
            out.append(self._index[(gi, position)][0])
            like = mats[0]
            inputs.append(torch.cat([given[j] for j in own]) if own else like.new_zeros((0, like.shape[1])))
            pieces.append(own)
        return out, inputs, pieces

    def _share(self, matrices: list[Matrix], new: dict[int, list[torch.Tensor]],
               among: Any = None) -> dict[int, list[torch.Tensor]]:
        """Every rank's copy of the replicated mid state each owner computed (one all-reduce; of
        the plan's matrices ``among``, default all); a local matrix's (counters) each rank
        computed itself."""
        topo = self.topology
        among = range(len(matrices)) if among is None else among
        with_state = [j for j in among if matrices[j].fmt.replicated and not self.plan.matrices[j].local]
        if not with_state or self.strategy == "replicate" or topo.world_size == 1:
            return new
        like = [_params.local(self.opt.state[matrices[j].param][leaf.key]) for j in with_state
                for leaf in matrices[j].fmt.replicated]
        values = [v for j in with_state for v in new.get(j, [None] * len(matrices[j].fmt.replicated))]
        flat = iter(_exchange.share_from_owners(values, like, topo.group))
        shared = {j: [next(flat) for _ in matrices[j].fmt.replicated] for j in with_state}
        return {**{j: v for j, v in new.items() if self.plan.matrices[j].local}, **shared}

    def _post(self, matrices: list[Matrix], grads: list[tuple], mine: list[torch.Tensor],
              shared: dict[int, list[torch.Tensor]], finite: torch.Tensor | None, figs: dict | None = None,
              only: set[int] | None = None) -> None:
        """The post phase on local rows: the updates, the new post state and mid state written
        (``only``: the ids of the buckets to run, default all)."""
        for gi, route, bucket, params in self._mid_buckets():
            if only is not None and id(bucket) not in only:
                continue
            local = tuple(_params.local(params[i]) for i in bucket.indices)
            _, _, state = route.phases.states(self._local_state(bucket, params))
            updates, old_mid, new_mid = [], [], []
            for i, p in zip(bucket.indices, local):
                js = self._index[(gi, i)]
                j, fmt = js[0], matrices[js[0]].fmt
                result = mine[j] if len(js) == 1 else torch.cat([mine[k] for k in js])  # pieces in row order
                u, rows = self._from_rows(fmt, params[i], p, result)
                if grads[gi][i] is None:  # this rank leaves the parameter and its state alone
                    u = old = new = None
                else:
                    old = tuple(_params.local(self.opt.state[params[i]][leaf.key])
                                for leaf in fmt.row_states + fmt.replicated)
                    new = tuple(rows) + tuple(shared.get(j, ()))
                updates.append(u)
                old_mid.append(old)
                new_mid.append(new)
            if any(u is not None for u in updates):
                args = (local, tuple(updates), state, tuple(old_mid), tuple(new_mid), finite)
                if figs is None:
                    final, new_state, kept_mid, ok, fault = route.steps.post(_phases.signature(*args), *args)
                else:
                    leaves = self._local_leaves(gi, bucket, params)
                    final, new_state, kept_mid, ok, fault, raw = route.steps.post_measured(
                        _phases.signature(*args), *args, leaves)
                    self._note(figs, gi, bucket.indices, leaves, raw)
                self._write(Staged(local, final, state, new_state, ok), fault, tuple(params[i] for i in bucket.indices))
                self._write(Staged((), (), tuple(old_mid), kept_mid))

    def _elementwise(self, grads: list[tuple], finite: torch.Tensor | None, figs: dict | None = None) -> None:
        """Transforms without a mid phase (AdamW), whole on local rows."""
        for gi, group in enumerate(self.opt.param_groups):
            for route in self._routes(gi):
                if route.phases.mid is not None:
                    continue
                for bucket in route.buckets:
                    g = tuple(grads[gi][i] for i in bucket.indices)
                    if all(x is None for x in g):
                        continue
                    local = tuple(_params.local(group["params"][i]) for i in bucket.indices)
                    state = self._local_state(bucket, group["params"])
                    args = (local, g, state, finite)
                    if figs is None:
                        updates, new_state, ok, fault = route.steps.whole(_phases.signature(*args), *args)
                    else:
                        leaves = self._local_leaves(gi, bucket, group["params"])
                        updates, new_state, ok, fault, raw = route.steps.whole_measured(
                            _phases.signature(*args), *args, leaves)
                        self._note(figs, gi, bucket.indices, leaves, raw)
                    self._write(Staged(local, updates, state, new_state, ok), fault,
                                tuple(group["params"][i] for i in bucket.indices))

    def _write(self, item: Staged, fault: torch.Tensor | None = None, params: tuple = ()) -> None:
        """Write ``item`` now (or hold it for the step's commit, ``atomic=True``) and note its
        bucket's guard ``fault`` with its parameters."""
        self.opt._stage(self._writes, item)
        if fault is not None:
            self._faults.append((fault, params))

