"""Owner-computes exchange: the only module of muon_fn that calls collectives.

Per bucket of a :class:`~muon_fn.fsdp._plan.Plan`: one ``all_to_all_single`` with exact uneven
split sizes sends every rank's rows of every matrix to its owner (no padding; empty shards are
fine), the owner concatenates them into full matrices and runs ``compute`` on them, and a second
``all_to_all_single`` returns to every rank the rows it holds. All gathers are posted
asynchronously up front (in bucket order, identical on every rank), so the owner computes bucket
``i`` while later buckets are still in flight, and each bucket's return is posted asynchronously as
soon as it is computed. With one rank nothing is communicated.
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
    local_rows: Sequence[torch.Tensor],
    compute: Compute,
    *,
    group: dist.ProcessGroup | None = None,
    wire_dtype: torch.dtype | None = None,
) -> tuple[list[torch.Tensor], ExchangeStats]:
    """Run ``compute`` on every matrix at its owner; return this rank's rows of every result.

    Args:
      plan: the plan (identical on every rank).
      rank: this rank's index in ``group``.
      local_rows: per matrix of the plan, the rows this rank contributes as a 2-D
        ``(contrib rows, cols)`` tensor (``(0, cols)`` when it contributes none). All share one dtype.
      compute: called once per bucket on the matrices this rank owns (possibly none).
      group: the process group (``None``: the default group); ignored when ``world_size == 1``.
      wire_dtype: dtype on the wire (e.g. ``torch.bfloat16``); ``None`` keeps the input dtype.
        Received matrices are cast back to the input dtype before ``compute``.

    Returns:
      Per matrix, the ``(receive rows, cols)`` block of the result this rank holds, and the stats.
    """
    w = plan.world_size
    if len(local_rows) != len(plan.matrices):
        raise ValueError(f"exchange: got {len(local_rows)} tensors for a plan of {len(plan.matrices)} matrices")
    for mp, x in zip(plan.matrices, local_rows):
        expected = (mp.contrib[rank][1] - mp.contrib[rank][0], mp.cols)
        if tuple(x.shape) != expected:
            raise ValueError(
                f"exchange: matrix {mp.index} of global shape {mp.shape} has local rows of shape "
                f"{tuple(x.shape)} on rank {rank}, the plan expects {expected}"
            )
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
        back_parts = []
        for d in range(w):
            for j, r in zip(owned, results):
                start, stop = plan.matrices[j].receive[d]
                back_parts.append(r[start:stop].reshape(-1))
        back = torch.cat(back_parts).to(wire) if back_parts else torch.empty(0, dtype=wire, device=device)
        back_recv_splits = b.scatter_recv(rank)
        back_recv = torch.empty(sum(back_recv_splits), dtype=wire, device=device)
        back_send_splits = b.scatter_send(rank)
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
                k = mp.receive_numel(rank)
                out[j] = back_recv[offset:offset + k].view(-1, mp.cols).to(dtype)
                offset += k
    return out, stats  # type: ignore[return-value]
