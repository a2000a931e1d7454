"""Owner-computes exchange: the only module of muon_fn that calls collectives.

Per bucket of a :class:`~muon_fn.fsdp._plan.Plan`: one ``all_to_all_single`` with exact uneven
split sizes sends every rank's rows of every matrix to its owner (no padding; empty shards are
fine), the owner concatenates them into full matrices and runs ``compute`` on them, and a second
``all_to_all_single`` returns to every rank the rows it holds. All gathers are posted
asynchronously up front (in bucket order, identical on every rank), so the owner computes bucket
``i`` while later buckets are still in flight, and each bucket's return is posted asynchronously as
soon as it is computed. With one rank nothing is communicated. :func:`exchange_replicated` is
the all-gather baseline (every rank computes every matrix).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ._plan import Plan

# compute(matrix indices, full (rows, cols) matrices) -> results of the same shapes, same order.
Compute = Callable[[list[int], list[torch.Tensor]], list[torch.Tensor]]


@dataclass
class ExchangeStats:
    """Figures of one exchange on this rank."""

    bytes_sent: int = 0  # to other ranks, both directions
    bytes_received: int = 0
    comm_wait_s: float = 0.0  # time blocked in wait() on collectives
    compute_s: float = 0.0  # time inside ``compute``


def exchange(
    plan: Plan,
    rank: int,
    held: Sequence[torch.Tensor],
    compute: Compute,
    *,
    group: dist.ProcessGroup | None = None,
    wire_dtype: torch.dtype | None = None,
    result_cols: Sequence[int] | None = None,
) -> tuple[list[torch.Tensor], ExchangeStats]:
    """Run ``compute`` on every matrix at its owner; return this rank's rows of every result.

    Args:
      plan: the plan (identical on every rank).
      rank: this rank's index in ``group``.
      held: per matrix of the plan, the rows this rank holds (its ``receive`` rows) as a 2-D
        ``(rows, cols)`` tensor; the rank contributes the plan's ``contrib`` rows out of them.
        All share one dtype.
      compute: called once per bucket on the matrices this rank owns (possibly none).
      group: the process group (``None``: the default group); ignored when ``world_size == 1``.
      wire_dtype: dtype on the wire (e.g. ``torch.bfloat16``); ``None`` keeps the input dtype.
        Received matrices are cast back to the input dtype before ``compute``.
      result_cols: per matrix, the columns of ``compute``'s result when they differ from the
        plan's (e.g. SSO sends ``[M | W]`` and returns only the update); ``None``: the same.

    Returns:
      Per matrix, the ``(receive rows, result cols)`` block of the result this rank holds, and
      the stats.
    """
    w = plan.world_size
    back_cols = _result_cols(plan, result_cols)
    local_rows = _contributions(plan, rank, held)
    stats = ExchangeStats()
    out: list[torch.Tensor | None] = [None] * len(plan.matrices)
    if w == 1:
        for b in plan.buckets:
            idx = list(b.matrices)
            t0 = time.perf_counter()
            results = compute(idx, [local_rows[j] for j in idx]) if idx else []
            stats.compute_s += time.perf_counter() - t0
            for j, r in zip(idx, results):
                out[j] = r
        return out, stats  # type: ignore[return-value]

    if not local_rows:
        return [], stats
    dtype = local_rows[0].dtype
    device = local_rows[0].device
    wire = wire_dtype or dtype
    item = torch.empty((), dtype=wire).element_size()

    # 1. Post every bucket's gather (forward all-to-all) asynchronously, in bucket order.
    pending = []
    for b in plan.buckets:
        # Send buffer: ordered by destination (owner), then by the bucket's matrix order.
        parts = [
            local_rows[j].reshape(-1)
            for d in range(w)
            for j in b.matrices
            if plan.matrices[j].owner == d
        ]
        send = torch.cat(parts).to(wire) if parts else torch.empty(0, dtype=wire, device=device)
        recv_splits = b.gather_recv(rank)
        recv = torch.empty(sum(recv_splits), dtype=wire, device=device)
        send_splits = b.gather_send(rank)
        work = dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group, async_op=True)
        stats.bytes_sent += item * (sum(send_splits) - send_splits[rank])
        stats.bytes_received += item * (sum(recv_splits) - recv_splits[rank])
        pending.append((b, work, recv, recv_splits, send))

    # 2. Per bucket: wait, assemble full matrices on the owner, compute, post the return.
    returns = []
    for b, work, recv, recv_splits, send in pending:
        t0 = time.perf_counter()
        work.wait()
        stats.comm_wait_s += time.perf_counter() - t0
        del send
        owned = [j for j in b.matrices if plan.matrices[j].owner == rank]
        # recv is ordered by source rank, then by the owned matrices in bucket order.
        pieces: dict[int, list[torch.Tensor]] = {j: [] for j in owned}
        offset = 0
        for s in range(w):
            for j in owned:
                mp = plan.matrices[j]
                k = mp.contrib_numel(s)
                pieces[j].append(recv[offset:offset + k].view(-1, mp.cols))
                offset += k
        full = [torch.cat(pieces[j]).to(dtype) for j in owned]
        t0 = time.perf_counter()
        results = compute(owned, full) if owned else []
        stats.compute_s += time.perf_counter() - t0
        # Return buffer: ordered by destination rank, then by the owned matrices in bucket order.
        for j, r in zip(owned, results):
            if tuple(r.shape) != (plan.matrices[j].rows, back_cols[j]):
                raise ValueError(f"exchange: compute returned shape {tuple(r.shape)} for matrix {j}, "
                                 f"expected {(plan.matrices[j].rows, back_cols[j])}")
        back_parts = []
        for d in range(w):
            for j, r in zip(owned, results):
                start, stop = plan.matrices[j].receive[d]
                back_parts.append(r[start:stop].reshape(-1))
        back = torch.cat(back_parts).to(wire) if back_parts else torch.empty(0, dtype=wire, device=device)
        if result_cols is None:
            back_recv_splits, back_send_splits = b.scatter_recv(rank), b.scatter_send(rank)
        else:
            back_recv_splits = [_returned(plan, b.matrices, s, rank, back_cols) for s in range(w)]
            back_send_splits = [_returned(plan, b.matrices, rank, d, back_cols) for d in range(w)]
        back_recv = torch.empty(sum(back_recv_splits), dtype=wire, device=device)
        work = dist.all_to_all_single(
            back_recv, back, back_recv_splits, back_send_splits, group=group, async_op=True
        )
        stats.bytes_sent += item * (sum(back_send_splits) - back_send_splits[rank])
        stats.bytes_received += item * (sum(back_recv_splits) - back_recv_splits[rank])
        returns.append((b, work, back_recv, back))

    # 3. Collect this rank's rows of every result (ordered by owner, then bucket order).
    for b, work, back_recv, back in returns:
        t0 = time.perf_counter()
        work.wait()
        stats.comm_wait_s += time.perf_counter() - t0
        offset = 0
        for s in range(w):
            for j in b.matrices:
                mp = plan.matrices[j]
                if mp.owner != s:
                    continue
                start, stop = mp.receive[rank]
                k = (stop - start) * back_cols[j]
                out[j] = back_recv[offset:offset + k].view(-1, back_cols[j]).to(dtype)
                offset += k
    return out, stats  # type: ignore[return-value]


def _result_cols(plan: Plan, result_cols: Sequence[int] | None) -> list[int]:
    """Columns of every matrix's result (the plan's ``cols`` unless ``result_cols`` says)."""
    if result_cols is None:
        return [mp.cols for mp in plan.matrices]
    cols = [int(c) for c in result_cols]
    if len(cols) != len(plan.matrices) or any(c < 0 for c in cols):
        raise ValueError(f"exchange: invalid result_cols {list(result_cols)!r} (expected "
                         f"{len(plan.matrices)} non-negative column counts)")
    return cols


def _returned(plan: Plan, matrices: Sequence[int], owner: int, dest: int, cols: Sequence[int]) -> int:
    """Elements ``owner`` returns to ``dest`` for the bucket's ``matrices``."""
    total = 0
    for j in matrices:
        mp = plan.matrices[j]
        if mp.owner == owner:
            start, stop = mp.receive[dest]
            total += (stop - start) * cols[j]
    return total


def _contributions(plan: Plan, rank: int, held: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The rows each matrix's ``contrib`` asks of this rank, cut from the rows it holds."""
    if len(held) != len(plan.matrices):
        raise ValueError(f"exchange: got {len(held)} tensors for a plan of {len(plan.matrices)} matrices")
    out = []
    for mp, x in zip(plan.matrices, held):
        r0, r1 = mp.receive[rank]
        if tuple(x.shape) != (r1 - r0, mp.cols):
            raise ValueError(
                f"exchange: matrix {mp.index} of global shape {mp.shape} has local rows of shape "
                f"{tuple(x.shape)} on rank {rank}, the plan expects {(r1 - r0, mp.cols)}"
            )
        c0, c1 = mp.contrib[rank]
        out.append(x[c0 - r0:c1 - r0] if c1 > c0 else x[:0])
    return out


def exchange_replicated(
    plan: Plan,
    rank: int,
    held: Sequence[torch.Tensor],
    compute: Compute,
    *,
    group: dist.ProcessGroup | None = None,
    wire_dtype: torch.dtype | None = None,
    result_cols: Sequence[int] | None = None,
) -> tuple[list[torch.Tensor], ExchangeStats]:
    """The baseline: every rank all-gathers every sharded matrix and computes all of them.

    Per bucket, one ``all_gather_single`` of every rank's rows padded to ``ceil(m/W)`` (gloo
    needs equal sizes); replicated matrices are already whole and are not sent. Same arguments
    and result as :func:`exchange`; ``compute`` sees every matrix of each bucket.
    """
    w = plan.world_size
    _contributions(plan, rank, held)  # shape checks
    _result_cols(plan, result_cols)  # nothing is returned over the wire: only checked
    stats = ExchangeStats()
    out: list[torch.Tensor | None] = [None] * len(plan.matrices)
    if not held:
        return [], stats
    dtype, device = held[0].dtype, held[0].device
    wire = wire_dtype or dtype
    item = torch.empty((), dtype=wire).element_size()

    def pad_rows(j: int) -> int:
        mp = plan.matrices[j]
        return max(b - a for a, b in mp.receive)

    pending = []
    for b in plan.buckets:
        members = [j for j in b.matrices if _is_sharded(plan, j)] if w > 1 else []
        parts = []
        for j in members:
            x = held[j]
            rows = pad_rows(j)
            if x.shape[0] < rows:
                x = torch.cat([x, x.new_zeros(rows - x.shape[0], x.shape[1])])
            parts.append(x.reshape(-1))
        work = gathered = None
        if parts:
            send = torch.cat(parts).to(wire)
            gathered = torch.empty(w * send.numel(), dtype=wire, device=device)
            work = _all_gather(gathered, send, group=group, async_op=True)
            stats.bytes_sent += item * send.numel() * (w - 1)  # as a ring/all-to-all: (W-1) copies
            stats.bytes_received += item * send.numel() * (w - 1)
        pending.append((b, members, work, gathered))

    for b, members, work, gathered in pending:
        if work is not None:
            t0 = time.perf_counter()
            work.wait()
            stats.comm_wait_s += time.perf_counter() - t0
        full: dict[int, torch.Tensor] = {}
        if members:
            per_rank = gathered.numel() // w
            offset = 0
            for j in members:
                mp = plan.matrices[j]
                rows = pad_rows(j)
                k = rows * mp.cols
                blocks = [
                    gathered[s * per_rank + offset:s * per_rank + offset + k].view(rows, mp.cols)[
                        : mp.receive[s][1] - mp.receive[s][0]
                    ]
                    for s in range(w)
                ]
                full[j] = torch.cat(blocks).to(dtype)
                offset += k
        idx = list(b.matrices)
        mats = [full[j] if j in full else held[j] for j in idx]
        t0 = time.perf_counter()
        results = compute(idx, mats) if idx else []
        stats.compute_s += time.perf_counter() - t0
        for j, r in zip(idx, results):
            r0, r1 = plan.matrices[j].receive[rank]
            out[j] = r[r0:r1] if j in full else r
    return out, stats  # type: ignore[return-value]


def _is_sharded(plan: Plan, j: int) -> bool:
    """True if ranks hold different rows of matrix ``j`` (False for a replicated matrix)."""
    mp = plan.matrices[j]
    return any(r != (0, mp.rows) for r in mp.receive)


# torch >= 2.13 names it all_gather_single (all_gather_into_tensor warns); older torch lacks it.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_ranks_true(flag: bool, group: dist.ProcessGroup | None, world_size: int) -> bool:
    """Whether ``flag`` holds on every rank of ``group`` (one tiny all-reduce; none for W = 1)."""
    if world_size == 1:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t.item())
