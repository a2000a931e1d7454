"""Where each matrix's rows lie in an exchange's buffers (:mod:`._exchange`): pure functions of
the plan and of tensors, no collectives. A rank's contribution of a matrix (:func:`contribution`),
the owned matrices whole out of a gather's receive buffer (:func:`assemble`), the owner's own rows
of a result (:func:`own_rows`), the element counts of a bucket's return (:func:`returned`), the
all-gather baseline's padding (:func:`padded_rows`, :func:`unpad`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ._plan import BucketPlan, MatrixPlan, Plan

Wire = Any  # :class:`._exchange.Wire` (its ``rank``, ``item``, ``wire`` and ``dtype``)


def owned_by(plan: Plan, b: BucketPlan, owner: int) -> list[int]:
    return [j for j in b.matrices if plan.matrices[j].owner == owner]


def assemble(plan: Plan, owned: list[int], recv: torch.Tensor, wire: Wire) -> list[torch.Tensor]:
    """The owned matrices, whole: ``recv`` is ordered by source rank, then by the owned matrices;
    each matrix's pieces are put in row order (ranks need not hold rows in rank order). A matrix
    whose pieces lie in ``recv`` one after the other in row order, from an offset aligned as a
    fresh tensor is, is a view of ``recv`` (no copy; the iteration reads it as it would a copy)."""
    out = []
    for j, ps in pieces_of(plan, owned).items():
        mp, start = plan.matrices[j], ps[0][1] if ps else 0
        if in_row_order(ps, start, wire.wire == wire.dtype, wire.item):
            out.append(recv[start:start + mp.numel].view(mp.rows, mp.cols))
        else:
            out.append(torch.cat([recv[o:o + k].view(-1, mp.cols) for _, o, k in ps]).to(wire.dtype))
    return out


def pieces_of(plan: Plan, owned: Sequence[int]) -> dict[int, list[tuple[int, int, int]]]:
    """Per owned matrix, its pieces in a gather's receive buffer as ``(first row, offset, numel)``
    in row order (the buffer is ordered by source rank, then by the owned matrices)."""
    pieces: dict[int, list[tuple[int, int, int]]] = {j: [] for j in owned}
    offset = 0
    for s in range(plan.world_size):
        for j in owned:
            k = plan.matrices[j].contrib_numel(s)
            if k:
                pieces[j].append((plan.matrices[j].contrib[s][0], offset, k))
            offset += k
    return {j: sorted(ps) for j, ps in pieces.items()}


def in_row_order(ps: list[tuple[int, int, int]], start: int, same_dtype: bool, item_bytes: int) -> bool:
    """Whether pieces ``ps`` lie one after the other in row order from ``start``, aligned as a
    fresh CPU tensor is (64 B of ``item_bytes`` elements), with the wire in the dtype compute
    takes (``same_dtype``): then the matrix is a view."""
    ends = [start] + [o + k for _, o, k in ps]
    return same_dtype and (start * item_bytes) % 64 == 0 and all(
        o == end for (_, o, _), end in zip(ps, ends))


def returns_in_place(plan: Plan, owned: list[int], results: Sequence[torch.Tensor], recv: torch.Tensor,
                     cols: Sequence[int]) -> bool:
    """Whether a bucket's return can send the gather's receive buffer ``recv`` as it is: every
    owned matrix's result is its view of ``recv`` (computed in it, :func:`assemble`) with the
    plan's columns, and every rank gets back the rows it contributed (``contrib`` is ``receive``),
    so that the buffer ordered by source rank is the return ordered by destination."""
    if not owned or not recv.numel():
        return False
    base, item = recv.data_ptr(), recv.element_size()
    for (j, ps), r in zip(pieces_of(plan, owned).items(), results):
        mp = plan.matrices[j]
        start = ps[0][1] if ps else 0
        if (mp.contrib != mp.receive or cols[j] != mp.cols or tuple(r.shape) != (mp.rows, mp.cols)
                or r.dtype != recv.dtype or not r.is_contiguous() or r.data_ptr() != base + start * item):
            return False
    return True


def own_rows(result: torch.Tensor, rows: tuple[int, int], wire: Wire) -> torch.Tensor:
    """The owner's own rows of a result, kept here instead of sent to itself: rounded as the wire
    rounds them, and a copy (the rest of the result is freed once sent) unless they are all of it."""
    x = result[rows[0]:rows[1]]
    if wire.wire != wire.dtype:
        return x.to(wire.wire).to(wire.dtype)
    return result if rows == (0, result.shape[0]) else x.clone()


def result_cols_of(plan: Plan, result_cols: Sequence[int] | None) -> list[int]:
    """Columns of every matrix's result (the plan's ``cols`` unless ``result_cols`` says)."""
    if result_cols is None:
        return [mp.cols for mp in plan.matrices]
    cols = [int(c) for c in result_cols]
    if len(cols) != len(plan.matrices) or any(c < 0 for c in cols):
        raise ValueError(f"exchange: invalid result_cols {list(result_cols)!r} (expected "
                         f"{len(plan.matrices)} non-negative column counts)")
    return cols


def returned(plan: Plan, matrices: Sequence[int], owner: int, dest: int, cols: Sequence[int]) -> int:
    """Elements ``owner`` returns to ``dest`` for the bucket's ``matrices``."""
    total = 0
    for j in matrices:
        mp = plan.matrices[j]
        if mp.owner == owner:
            start, stop = mp.receive[dest]
            total += (stop - start) * cols[j]
    return total


def contributions(plan: Plan, rank: int, held: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The rows each matrix's ``contrib`` asks of this rank, cut from the rows it holds."""
    if len(held) != len(plan.matrices):
        raise ValueError(f"exchange: got {len(held)} tensors for a plan of {len(plan.matrices)} matrices")
    return [contribution(mp, rank, x) for mp, x in zip(plan.matrices, held)]


def contribution(mp: MatrixPlan, rank: int, x: torch.Tensor) -> torch.Tensor:
    """The rows of one matrix that its ``contrib`` asks of this rank, cut from the rows it holds."""
    r0, r1 = mp.receive[rank]
    if tuple(x.shape) != (r1 - r0, mp.cols):
        raise ValueError(
            f"exchange: matrix {mp.index} of global shape {mp.shape} has local rows of shape "
            f"{tuple(x.shape)} on rank {rank}, the plan expects {(r1 - r0, mp.cols)}"
        )
    c0, c1 = mp.contrib[rank]
    return x[c0 - r0:c1 - r0] if c1 > c0 else x[:0]


def padded_rows(plan: Plan, j: int) -> int:
    return max(b - a for a, b in plan.matrices[j].receive)


def unpad(plan: Plan, members: list[int], gathered: torch.Tensor, wire: Wire) -> dict[int, torch.Tensor]:
    """The gathered matrices, whole, from every rank's padded rows."""
    w = plan.world_size
    per_rank = gathered.numel() // w
    full, offset = {}, 0
    for j in members:
        mp = plan.matrices[j]
        rows = padded_rows(plan, j)
        k = rows * mp.cols
        blocks = {mp.receive[s]: gathered[s * per_rank + offset:s * per_rank + offset + k].view(rows, mp.cols)[
            : mp.receive[s][1] - mp.receive[s][0]] for s in reversed(range(w))}  # one per block (replicas)
        full[j] = torch.cat([blocks[r] for r in sorted(blocks)]).to(wire.dtype)
        offset += k
    return full


def is_sharded(plan: Plan, j: int) -> bool:
    """True if ranks hold different rows of matrix ``j`` (False for a replicated matrix)."""
    mp = plan.matrices[j]
    return any(r != (0, mp.rows) for r in mp.receive)
