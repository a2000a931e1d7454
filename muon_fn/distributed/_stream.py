"""The owner-computes exchange bucket by bucket (:func:`stream`) under ``inflight_bytes``.

The plan's buckets are cut (``bucket_bytes`` of :func:`~muon_fn.distributed._plan.make_plan`, half of
``inflight_bytes``) so that each holds at most half the budget on every rank, counted by
:func:`~muon_fn.distributed._budget.held_bytes` (an owner's gathered matrices and their results, every
other rank's rows sent and returned), except that every owner has at least one unit (one batch
of the single-device optimizer) in each bucket, so that the owners compute side by side. A
bucket's rows are packed (the pre phase) just before its gather is posted, and its results are
applied (the post phase) as soon as they are back. Where two consecutive buckets fit the budget
together on every rank, the next one's gather travels while one is computed and its results
come back while the next is computed; otherwise a bucket's buffers are all released before the
next bucket is packed. A matrix received in one piece per rank in row order is computed in its
receive buffer; where all of a bucket's results are so computed, that buffer travels back as it
is (no copy of the results is made; the owner's own rows come back through the collective),
else the owner's own rows stay here and the rest is copied to send. A receive buffer of the
results is reused for the next bucket's of the same size.

It drives :mod:`._exchange`'s bucket interface (:class:`~._exchange.Wire`,
:func:`~._exchange.contribution`, :func:`~._exchange.post_gather`,
:func:`~._exchange.compute_local`, :func:`~._exchange.compute_and_return`,
:func:`~._exchange.collect`): the collectives and the calls of ``compute`` are those of
:func:`~muon_fn.distributed._exchange.exchange`, bucket for bucket, so the owners' arithmetic is the
same bit for bit; only their order in time changes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import _exchange
from ._pieces import contribution, result_cols_of
from ._budget import travels_ahead
from ._plan import BucketPlan, Plan

# pre(bucket) -> {matrix: this rank's rows}; post(bucket, {matrix: this rank's rows of its result})
Pre = Callable[[BucketPlan], dict[int, torch.Tensor]]
Post = Callable[[BucketPlan, dict[int, torch.Tensor]], None]
Started = tuple[_exchange.InFlight, dict[int, torch.Tensor]]  # a gather in flight, the results so far


def stream(plan: Plan, rank: int, pre: Pre, compute: _exchange.Compute, post: Post, *, group: Any = None,
           wire_dtype: torch.dtype | None = None, result_cols: Sequence[int] | None = None,
           inflight_bytes: int | None = None, item_bytes: int = 4) -> _exchange.ExchangeStats:
    """Every bucket of ``plan`` (of two ranks or more) in order: ``pre`` gives this rank's rows of
    its matrices, the owners ``compute`` them, ``post`` takes this rank's rows of the results (as
    :func:`~muon_fn.distributed._exchange.exchange`'s). The next bucket is gathered while one is
    computed only if both buckets fit ``inflight_bytes`` on every rank (``item_bytes`` an
    element, :func:`~muon_fn.distributed._budget.travels_ahead`); else one bucket at a time. Returns the
    stats."""
    buckets = [b for b in plan.buckets if b.matrices]
    if not buckets:
        return _exchange.ExchangeStats()
    run = _Run(plan, rank, pre, compute, post, group, wire_dtype, result_cols_of(plan, result_cols))
    travels = travels_ahead(plan, buckets, item_bytes, inflight_bytes)
    pending: Started | None = run.start(buckets[0])
    back: _exchange.InFlight | None = None  # the previous bucket's results on their way back
    for i in range(len(buckets)):
        assert pending is not None
        gathered = pending
        ahead = travels[i]  # the same on every rank
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
            if i + 1 < len(buckets):
                pending = run.start(buckets[i + 1])
        del returned
    if back is not None:
        run.finish(back)
    run.wire.drop_spare()
    return run.wire.stats


class _Run:
    """One :func:`stream`: its exchange settings, and each bucket's results as they come back."""

    def __init__(self, plan: Plan, rank: int, pre: Pre, compute: _exchange.Compute, post: Post, group: Any,
                 wire_dtype: torch.dtype | None, back_cols: list[int]) -> None:
        self.plan, self.rank, self.pre, self.compute, self.post = plan, rank, pre, compute, post
        self.group, self.wire_dtype, self.back_cols = group, wire_dtype, back_cols
        self.wire: _exchange.Wire = None  # type: ignore[assignment]  # made with the first rows
        self.results: dict[int, dict[int, torch.Tensor]] = {}  # bucket -> this rank's rows so far

    def start(self, b: BucketPlan) -> Started:
        """Pack bucket ``b``'s rows and post its gather; its local matrices are computed now."""
        held = self.pre(b)
        rows = {j: contribution(self.plan.matrices[j], self.rank, held[j]) for j in b.matrices}
        del held
        if self.wire is None:
            self.wire = _exchange.Wire(self.rank, rows[b.matrices[0]], self.wire_dtype, self.group)
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
        self.post(returned.bucket, out)
        del out
        self.wire.recycle(returned)
