"""The bytes an exchange bucket holds on each rank, the one count that both the plan's cut of its
buckets (``bucket_bytes`` of :func:`~muon_fn.distributed._plan.make_plan`) and the bounded step's
decision to gather a bucket while another is computed (:mod:`._stream`, ``inflight_bytes``)
use. Pure functions of the plan's integers, as the plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Rows = tuple[int, int]  # [start, stop) rows of a matrix
LOCAL = -1  # the owner of a local matrix: every rank computes its own rows


def held_bytes(owner: int, rows: int, cols: int, contrib: Sequence[Rows], receive: Sequence[Rows],
               item_bytes: int) -> list[tuple[int, int]]:
    """``(rank, bytes)`` one matrix of an exchange bucket holds on each rank while the bucket is
    exchanged: on its owner twice the whole matrix (gathered, and its result), on every other rank
    the rows it sends plus the rows it gets back; a local matrix nothing (it does not travel). The
    plan cuts its buckets by these counts (``make_plan``'s ``bucket_bytes``) and the step decides
    by them whether two buckets fit ``inflight_bytes`` at once (:func:`bucket_held`)."""
    if owner == LOCAL:
        return []
    out = [(owner, 2 * rows * cols * item_bytes)]
    sent, back = _held(contrib), _held(receive)
    for r in sorted(set(sent) | set(back)):
        if r != owner:
            out.append((r, (sent.get(r, 0) + back.get(r, 0)) * cols * item_bytes))
    return out


def bucket_held(plan: Any, b: Any, item_bytes: int) -> list[int]:
    """Per rank, the bytes bucket ``b`` (a :class:`~._plan.BucketPlan`) of ``plan`` (a
    :class:`~._plan.Plan`, which imports this module) holds there (:func:`held_bytes` summed)."""
    total = [0] * plan.world_size
    for j in b.matrices:
        mp = plan.matrices[j]
        for r, n in held_bytes(mp.owner, mp.rows, mp.cols, mp.contrib, mp.receive, item_bytes):
            total[r] += n
    return total


def travels_ahead(plan: Any, buckets: Sequence[Any], item_bytes: int, inflight_bytes: int | None) -> list[bool]:
    """Per bucket of ``buckets``, whether the next one is gathered while it is computed: both fit
    ``inflight_bytes`` (each counted by :func:`bucket_held`, the most on any rank). The same list
    on every rank, so the ranks post their collectives in one order; the stream runs it and the
    planner's step-peak model walks it."""
    held = [max(bucket_held(plan, b, item_bytes)) for b in buckets]
    return [i + 1 < len(buckets) and (inflight_bytes is None or held[i] + held[i + 1] <= inflight_bytes)
            for i in range(len(buckets))]


def in_rounds(travels: Sequence[bool], i: int, world_size: int) -> bool:
    """Whether bucket ``i`` is exchanged in rounds of one peer each way (:mod:`._rounds`), by
    :func:`travels_ahead`'s flags: with nothing else in flight (neither it nor the one before
    travels ahead), among three ranks or more. Between two, the one round would be the one
    all-to-all each way, and a unit's rows made beside the receive buffer would only add to it."""
    return world_size > 2 and not travels[i] and (i == 0 or not travels[i - 1])


def unit_bytes(per_matrix: list[list[tuple[int, int]]]) -> dict[int, int]:
    """A unit's :func:`held_bytes` summed per rank."""
    out: dict[int, int] = {}
    for pairs in per_matrix:
        for r, n in pairs:
            out[r] = out.get(r, 0) + n
    return out


def cut_by_bytes(groups: list[list[int]], weights: list[dict[int, int]], owners: list[set[int]],
                  limit: int, world_size: int) -> list[list[int]]:
    """``groups`` (of units, in exchange order) cut into buckets that hold at most ``limit`` bytes
    on every rank (``weights``: per unit, :func:`held_bytes` per rank), except that each owner
    gets at least one of its units (of ``owners``) in every bucket: the owners then compute side
    by side. A unit that does not fit waits for the next bucket of its group (units keep their
    order otherwise); local units weigh nothing."""
    out: list[list[int]] = []
    for members in groups:
        left = list(members)
        while left:
            bucket, held, rest, misses = [], [0] * world_size, [], 0
            owning: set[int] = set()
            for k, u in enumerate(left):
                w = weights[u]
                if all(held[r] + n <= limit for r, n in w.items()) or not owners[u] & owning:
                    bucket.append(u)
                    owning |= owners[u]
                    for r, n in w.items():
                        held[r] += n
                else:
                    rest.append(u)
                    misses += 1
                    if misses > 4 * world_size:  # the bucket is full: the rest waits, in order
                        rest.extend(left[k + 1:])
                        break
            out.append(bucket)
            left = rest
    return out


def _held(rows: Sequence[Rows]) -> dict[int, int]:
    """``{rank: row count}`` of the ranks holding rows in ``rows``."""
    return {r: stop - start for r, (start, stop) in enumerate(rows) if stop > start}
