"""The owner-computes exchange bucket by bucket (:func:`stream`) under ``inflight_bytes``.

The plan's buckets are cut (``bucket_bytes`` of :func:`~muon_fn.distributed._plan.make_plan`, half of
``inflight_bytes``) so that each holds at most half the budget on every rank, counted by
:func:`~muon_fn.distributed._budget.held_bytes` (an owner's gathered matrices and their results, every
other rank's rows sent and returned), except that every owner has at least one unit (one batch
of the single-device optimizer) in each bucket, so that the owners compute side by side. A
bucket's rows are packed (the pre phase) just before its gather is posted, and its results are
applied (the post phase) as soon as they are back. Where two consecutive buckets fit the budget
together on every rank, the next one's gather travels while one is computed and its results
come back while the next is computed, one all-to-all each way; otherwise a bucket is exchanged
alone (among three ranks or more in rounds of one peer each way, :mod:`._rounds`: each unit's
rows made just before they travel, its results applied as soon as they are back), and its
buffers are all released before the next bucket is packed. A matrix received in one piece per
rank in row order is computed in its receive buffer; where all of a bucket's results are so
computed, that buffer travels back as it is (no copy of the results is made), else the owner's
own rows stay here and the rest is copied to send. A receive buffer of the results is reused
for the next bucket's of the same size.

It drives :mod:`._exchange`'s bucket interface (:class:`~._exchange.Wire`,
:func:`~._exchange.contribution`, :func:`~._exchange.post_gather`,
:func:`~._exchange.compute_local`, :func:`~._exchange.compute_and_return`,
:func:`~._exchange.collect`) and :mod:`._rounds`: the owners' calls of ``compute`` are those of
:func:`~muon_fn.distributed._exchange.exchange`, bucket for bucket, on the same matrices laid out
the same way, so their arithmetic is the same bit for bit; only the order in time changes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import _exchange, _rounds
from ._budget import LOCAL, in_rounds, travels_ahead
from ._pieces import contribution, owned_by, result_cols_of
from ._plan import BucketPlan, Plan

# pre(bucket, matrices) -> {matrix: this rank's rows} of the bucket's units that hold those matrices
# (all of the bucket's if None; each unit's pre phase runs once a step); share(bucket): its
# replicated state, once every rank computed the bucket (a collective); post(bucket, rows, final):
# the post phase of the units whose every matrix's rows of the results are in ``rows`` (this
# rank's), popped from it (``final``: the bucket's last call, on every rank at once). A callback
# may run collectives of its own where a bucket asks (a parameter redistributed to rows): pre
# then runs the whole bucket at its first call (the bucket's start, with no matrices), and post
# at its final one.
Pre = Callable[[BucketPlan, Sequence[int] | None], dict[int, torch.Tensor]]
Share = Callable[[BucketPlan], None]
Post = Callable[[BucketPlan, dict[int, torch.Tensor], bool], None]
Started = tuple[_exchange.InFlight, dict[int, torch.Tensor]]  # a gather in flight, the results so far


def stream(plan: Plan, rank: int, pre: Pre, compute: _exchange.Compute, share: Share, post: Post, *,
           like: torch.Tensor, group: Any = None, wire_dtype: torch.dtype | None = None,
           result_cols: Sequence[int] | None = None, inflight_bytes: int | None = None) -> _exchange.ExchangeStats:
    """Every bucket of ``plan`` (of two ranks or more) in order: ``pre`` gives this rank's rows of
    its matrices, the owners ``compute`` them, ``share`` and ``post`` take this rank's rows of the
    results (as :func:`~muon_fn.distributed._exchange.exchange`'s; the rows are ``like``'s dtype
    and device). The next bucket is gathered while one is computed only if both buckets fit
    ``inflight_bytes`` on every rank (:func:`~muon_fn.distributed._budget.travels_ahead`); else
    one bucket at a time, among three ranks or more each in rounds (:meth:`_Run.alone`). Returns
    the stats."""
    buckets = [b for b in plan.buckets if b.matrices]
    if not buckets:
        return _exchange.ExchangeStats()
    wire = _exchange.Wire(rank, like, wire_dtype, group)
    run = _Run(plan, rank, pre, compute, share, post, wire, result_cols_of(plan, result_cols))
    travels = travels_ahead(plan, buckets, like.element_size(), inflight_bytes)  # the same on every rank
    pending: Started | None = None
    back: _exchange.InFlight | None = None  # the previous bucket's results on their way back
    for i in range(len(buckets)):
        if in_rounds(travels, i, plan.world_size):  # nothing else in flight
            run.alone(buckets[i])
            continue
        gathered = pending if pending is not None else run.start(buckets[i])
        ahead = travels[i]
        pending = run.start(buckets[i + 1]) if ahead else None
        run.wire.drop_spare()  # no spare lives through an iteration
        previous, back = back, None

        def before_post(previous: _exchange.InFlight | None = previous) -> None:
            if previous is not None:  # applied first: its receive buffer can serve this bucket's
                run.finish(previous)

        returned = run.compute_and_return(gathered, before_post)
        del gathered, previous
        if ahead:
            back = returned
        else:  # this bucket done and released before the next is packed
            run.finish(returned)
            run.wire.drop_spare()
        del returned
    if back is not None:
        run.finish(back)
    run.wire.drop_spare()
    return run.wire.stats


class _Run:
    """One :func:`stream`: its exchange settings, and each bucket's results as they come back."""

    def __init__(self, plan: Plan, rank: int, pre: Pre, compute: _exchange.Compute, share: Share, post: Post,
                 wire: _exchange.Wire, back_cols: list[int]) -> None:
        self.plan, self.rank, self.pre, self.compute, self.post = plan, rank, pre, compute, post
        self.share, self.wire, self.back_cols = share, wire, back_cols
        self.results: dict[int, dict[int, torch.Tensor]] = {}  # bucket -> this rank's rows so far

    def start(self, b: BucketPlan) -> Started:
        """Pack bucket ``b``'s rows and post its gather; its local matrices are computed now."""
        held = self.pre(b, None)
        rows = {j: contribution(self.plan.matrices[j], self.rank, held[j]) for j in b.matrices}
        del held
        flight = _exchange.post_gather(self.plan, b, rows, self.wire)  # type: ignore[arg-type]
        out: dict[int, torch.Tensor] = {}
        _exchange.compute_local(self.plan, b, rows, self.compute, self.back_cols, self.wire, out)  # type: ignore[arg-type]
        return flight, out

    def compute_and_return(self, gathered: Started, before_post: Callable[[], None]) -> _exchange.InFlight:
        flight, out = gathered
        self.results[flight.bucket.index] = out
        return _exchange.compute_and_return(self.plan, flight, self.compute, self.back_cols, self.wire, before_post,
                                            in_place=True)

    def finish(self, returned: _exchange.InFlight) -> None:
        """Wait for a bucket's results, apply them, and keep the receive buffer as the spare."""
        out = self.results.pop(returned.bucket.index)
        _exchange.collect(self.plan, returned, self.back_cols, self.wire, out)
        returned.mine = None
        self.share(returned.bucket)
        self.post(returned.bucket, out, True)
        assert not out, f"bucket {returned.bucket.index}: results of matrices {sorted(out)} were not applied"
        del out
        self.wire.recycle(returned)

    def alone(self, b: BucketPlan) -> None:
        """Bucket ``b`` with nothing else in flight, in rounds of one peer each way
        (:func:`~._rounds.gather_rounds`, :func:`~._rounds.return_rounds`): each unit's pre
        phase runs just before its rows travel, and its post phase as soon as its rows of the
        results are back, so a rank holds one round's rows beside the matrices it owns."""
        plan, me = self.plan, self.rank
        made = self.pre(b, ())  # rows made and not yet sent: none, or the whole bucket's (above)

        def rows_for(owner: int) -> dict[int, torch.Tensor]:
            js = owned_by(plan, b, owner)
            if any(j not in made for j in js):
                made.update(self.pre(b, [j for j in js if j not in made]))
            return {j: made.pop(j) for j in js}

        local = [j for j in b.matrices if plan.matrices[j].local]
        out: dict[int, torch.Tensor] = {}
        if local:
            held = rows_for(LOCAL)
            rows: list[Any] = [None] * len(plan.matrices)
            for j in local:
                rows[j] = contribution(plan.matrices[j], me, held[j])
            del held
            _exchange.compute_local(plan, b, rows, self.compute, self.back_cols, self.wire, out)
            del rows
        box = [_rounds.gather_rounds(plan, b, rows_for, self.wire)]
        assert not made, f"bucket {b.index}: rows of matrices {sorted(made)} were made and not sent"
        owned = owned_by(plan, b, me)
        results, recv = _exchange.compute_owned(plan, owned, box, self.compute, self.back_cols, self.wire)
        self.share(b)

        def arrived(rows: dict[int, torch.Tensor]) -> None:
            out.update(rows)
            self.post(b, out, False)

        _rounds.return_rounds(plan, b, owned, results, recv, self.back_cols, self.wire, arrived)
        del results, recv
        self.post(b, out, True)
        self.wire.drop_spare()  # released before the next bucket is packed
        assert not out, f"bucket {b.index}: results of matrices {sorted(out)} were not applied"
