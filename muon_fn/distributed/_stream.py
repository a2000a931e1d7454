"""The owner-computes exchange bucket by bucket (:func:`stream`): the plan's buckets are cut
so that an owner's whole matrices of one bucket take at most half of ``inflight_bytes``
(:func:`~muon_fn.distributed._plan.make_plan`'s ``bucket_bytes``), and a step holds two of them at a
time: while the owners compute bucket ``i`` (its gather received), bucket ``i + 1``'s gather
travels and bucket ``i − 1``'s results come back (one bucket at a time where two do not fit:
a bucket is never less than one batch of the single-device optimizer). A bucket's rows are packed (the pre phase) just
before its gather is posted, and its results are applied (the post phase) as soon as they are
back; its buffers are freed then, before the bucket after next is gathered. The collectives and
the calls of ``compute`` are those of :func:`~muon_fn.distributed._exchange.exchange`, bucket for
bucket, so the owners' arithmetic is the same bit for bit; only their order in time changes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import _exchange
from ._plan import BucketPlan, Plan

# pre(bucket) -> {matrix: this rank's rows}; post(bucket, {matrix: this rank's rows of its result})
Pre = Callable[[BucketPlan], dict[int, torch.Tensor]]
Post = Callable[[BucketPlan, dict[int, torch.Tensor]], None]


def stream(plan: Plan, rank: int, pre: Pre, compute: _exchange.Compute, post: Post, *, group: Any = None,
           wire_dtype: torch.dtype | None = None, result_cols: Sequence[int] | None = None,
           inflight_bytes: int | None = None, item_bytes: int = 4) -> _exchange.ExchangeStats:
    """Every bucket of ``plan`` (of two ranks or more) in order: ``pre`` gives this rank's rows of
    its matrices, the owners ``compute`` them, ``post`` takes this rank's rows of the results (as
    :func:`~muon_fn.distributed._exchange.exchange`'s). The next bucket is gathered while one is
    computed only if both buckets' whole matrices (``item_bytes`` an element) fit
    ``inflight_bytes`` on their owners; else one bucket at a time. Returns the stats."""
    back_cols = _exchange._result_cols(plan, result_cols)
    wire: _exchange._Wire | None = None

    def start(b: BucketPlan) -> tuple[Any, dict[int, torch.Tensor]]:
        nonlocal wire
        held = pre(b)
        rows = {j: _exchange._contribution(plan.matrices[j], rank, held[j]) for j in b.matrices}
        del held
        if wire is None:
            wire = _exchange._Wire(rank, rows[b.matrices[0]], wire_dtype, group)
        flight = _exchange._post_gather(plan, b, rows, wire)  # type: ignore[arg-type]
        out: dict[int, torch.Tensor] = {}
        _exchange._compute_local(plan, b, rows, compute, back_cols, wire, out)  # type: ignore[arg-type]
        return flight, out

    def finish(b: BucketPlan, returned: Any, out: dict[int, torch.Tensor]) -> None:
        _exchange._collect(plan, returned, back_cols, wire, out)  # type: ignore[arg-type]
        post(b, out)

    buckets = [b for b in plan.buckets if b.matrices]
    if not buckets:
        return _exchange.ExchangeStats()
    held = [gathered_bytes(plan, b, item_bytes) for b in buckets]
    pending: tuple[Any, dict[int, torch.Tensor]] | None = start(buckets[0])
    previous = None
    for i, b in enumerate(buckets):
        assert pending is not None
        gathered, out = pending
        last = i + 1 == len(buckets)
        # the next bucket travels meanwhile if both fit the budget on every rank (the same
        # decision everywhere: the ranks post their collectives in one order)
        ahead = not last and (inflight_bytes is None or held[i] + held[i + 1] <= inflight_bytes)
        pending = start(buckets[i + 1]) if ahead else None
        returned = _exchange._compute_and_return(plan, gathered, compute, back_cols, wire)  # type: ignore[arg-type]
        del gathered
        if previous is not None:
            finish(*previous)
        previous = (b, returned, out)
        if not ahead and not last:  # this bucket done and freed before the next is gathered
            finish(*previous)
            previous, pending = None, start(buckets[i + 1])
    if previous is not None:
        finish(*previous)
    return wire.stats  # type: ignore[union-attr]


def gathered_bytes(plan: Plan, b: BucketPlan, item_bytes: int) -> int:
    """The most bytes of whole matrices any one owner holds of bucket ``b``."""
    per_owner: dict[int, int] = {}
    for j in b.matrices:
        mp = plan.matrices[j]
        if not mp.local:
            per_owner[mp.owner] = per_owner.get(mp.owner, 0) + mp.rows * mp.cols * item_bytes
    return max(per_owner.values(), default=0)
