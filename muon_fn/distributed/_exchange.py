"""Owner-computes exchange: the only module of muon_fn that calls collectives.

Per bucket of a :class:`~muon_fn.distributed._plan.Plan`: one ``all_to_all_single`` with exact uneven
split sizes sends every rank's rows of every matrix to its owner (no padding; empty shards are
fine), the owner concatenates them into full matrices and runs ``compute`` on them, and a second
``all_to_all_single`` returns to every rank the rows it holds. All gathers are posted
asynchronously up front (in bucket order, identical on every rank), so the owner computes bucket
``i`` while later buckets are still in flight, and each bucket's return is posted asynchronously as
soon as it is computed. The plan's local matrices (expert stacks sharded on their expert dim) never
travel: each rank computes its own rows of them while the gathers are in flight. With one rank
nothing is communicated. :func:`exchange_replicated` is
the all-gather baseline (every rank computes every matrix). :func:`all_ranks_finite`,
:func:`share_from_owners`, :func:`check_same`, :func:`any_rank_flag` and :func:`all_ranks_max`
(QK-Clip's logits) are the small collectives around a step. :class:`Posted` is :func:`exchange`
posted bucket by bucket (the FSDP optimizers' ``overlap=True``), on a :func:`dedicated_group`.
The CPU tensors of every collective are released by this thread, never by the backend's worker
thread (:class:`Kept`), and at exit the process waits for gloo's worker threads to let go of
those of any other collective (:func:`~muon_fn.distributed._exit.settle_at_exit`), so that no process aborts at exit.

The steps of one bucket have public names, the interface that :mod:`._stream` (the bounded step,
one or two buckets at a time) drives: :class:`Wire` (an exchange's settings, figures and spare
receive buffer), :func:`post_gather`, :func:`compute_local`, :func:`compute_and_return` and
:func:`collect`, each posted collective an :class:`InFlight`; where the rows lie in the buffers is
:mod:`._pieces`', and :mod:`._rounds` posts a bucket in rounds of one peer through :class:`Wire`.
A matrix whose pieces arrive in row order is computed in its receive buffer (no copy); the
bounded step then sends that buffer back as it is (:func:`compute_and_return`'s ``in_place``);
otherwise an owner's own rows of a result stay on it (never sent to itself).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ._exit import settle_at_exit  # noqa: F401  (importing it registers the wait at exit)
from ._kept import Kept
from ..engine import sole
from ._pieces import (assemble, contribution, contributions, is_sharded, own_rows, owned_by, padded_rows,
                      result_cols_of, returned, returns_in_place, unpad)
from ._plan import BucketPlan, Plan

# compute(matrix indices, full (rows, cols) matrices) -> results of the same shapes, same order.
# The matrices an owner gets from a gather are this module's own buffers (views of the receive
# buffer, or copies): compute may overwrite them, and its results may be them. Local matrices
# (and one rank's, and the replicated baseline's unsharded ones) are the caller's ``held`` rows.
Compute = Callable[[list[int], list[torch.Tensor]], list[torch.Tensor]]


@dataclass
class ExchangeStats:
    """Figures of one exchange on this rank."""

    bytes_sent: int = 0  # to other ranks, both directions
    bytes_received: int = 0
    comm_wait_s: float = 0.0  # time blocked in wait() on collectives
    compute_s: float = 0.0  # time inside ``compute``


def region(buf: torch.Tensor, offset: int, numel: int) -> torch.Tensor:
    """``numel`` elements of the 1-D ``buf`` from ``offset``: a tensor over its memory that is not
    a view (a collective's buffer, :class:`Kept`)."""
    return buf.new_empty(0).set_(buf.untyped_storage(), buf.storage_offset() + offset, (numel,), (1,))


def _own_chunk(rank: int, send_splits: list[int], recv_splits: list[int]) -> tuple[int, int, int] | None:
    """``(offset in send, offset in recv, length)`` of the chunk ``rank`` sends itself in one
    ``all_to_all_single`` with these splits, where it lies at an end of both buffers (always
    between two ranks), so that the other ranks' chunks are one region of each; None where it is
    empty or lies between other ranks' chunks."""
    length = send_splits[rank]
    if length == 0:
        return None
    at, into = sum(send_splits[:rank]), sum(recv_splits[:rank])
    if at not in (0, sum(send_splits) - length) or into not in (0, sum(recv_splits) - length):
        return None
    return at, into, length


def _all_to_all(rank: int, recv: torch.Tensor, send: torch.Tensor, recv_splits: list[int], send_splits: list[int],
                group: Any) -> tuple[Any, Kept]:
    """Post ``all_to_all_single(recv, send, ...)`` asynchronously: its work handle and the tensors
    the backend holds (:class:`Kept`). Where this rank's own chunk lies at an end of both
    buffers (:func:`_own_chunk`), the other ranks' chunks go through the collective and the own
    one is copied while they travel: gloo copies a rank's own chunk itself before it starts the
    transfers (measured between two ranks of a 2-core Zen 5, three runs, 4 MiB each way: 2.8–3.4 ms
    with the own chunk in the collective, 2.5–2.7 ms copied beside it; 9 MiB: 6.4–6.9, 4.5–6.2)."""
    own = _own_chunk(rank, send_splits, recv_splits)
    if own is None:
        kept = Kept(recv, send)
        return dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group, async_op=True), kept
    at, into, length = own
    # the other ranks' chunks: each buffer without the own chunk at one of its ends
    others_recv = region(recv, length if into == 0 else 0, recv.numel() - length)
    others_send = region(send, length if at == 0 else 0, send.numel() - length)
    kept = Kept(others_recv, others_send)
    work = dist.all_to_all_single(others_recv, others_send, _zeroed(recv_splits, rank), _zeroed(send_splits, rank),
                                  group=group, async_op=True)
    recv[into:into + length].copy_(send[at:at + length])
    return work, kept


def _zeroed(splits: list[int], rank: int) -> list[int]:
    """``splits`` with ``rank``'s entry 0."""
    return [0 if r == rank else n for r, n in enumerate(splits)]


class Wire:
    """One exchange's settings and figures: every ``all_to_all_single`` goes through :meth:`post`.
    A receive buffer handed back (:meth:`recycle`) is reused by the next post that receives as
    many elements (:meth:`drop_spare` frees it instead)."""

    def __init__(self, rank: int, like: torch.Tensor, wire_dtype: torch.dtype | None, group: Any) -> None:
        self.rank, self.group = rank, group
        self.dtype, self.device = like.dtype, like.device  # what compute sees and returns
        self.wire = wire_dtype or like.dtype
        self.item = torch.empty((), dtype=self.wire).element_size()
        self.stats = ExchangeStats()
        self.spare: torch.Tensor | None = None
        self.reused = 0  # receive buffers taken from a spare (for tests)
        self.sent_in_place = 0  # returns that sent the gather's receive buffer itself (for tests)

    def recycle(self, flight: InFlight) -> None:
        """``flight``'s receive buffer becomes the spare if nothing else holds its memory (no
        view of it is left: e.g. a result staged for an atomic step's commit)."""
        recv, flight.recv = flight.recv, None  # type: ignore[assignment]
        self.spare = recv if recv is not None and recv.numel() and sole(recv) else None

    def drop_spare(self) -> None:
        self.spare = None

    def post(self, parts: list[torch.Tensor], send_splits: list[int], recv_splits: list[int]):
        """Start one ``all_to_all_single`` of ``parts`` (concatenated, in destination order).
        ``parts`` is emptied once copied, so that what only it held is freed before the receive
        buffer is made."""
        send = torch.empty(sum(p.numel() for p in parts), dtype=self.wire, device=self.device)
        offset = 0
        for i in range(len(parts)):  # each part dropped as soon as it is copied
            p, parts[i] = parts[i], None  # type: ignore[call-overload]
            send[offset:offset + p.numel()].copy_(p.reshape(-1))
            offset += p.numel()
            del p
        parts.clear()
        return self.post_buffer(send, send_splits, recv_splits)

    def post_buffer(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                    into: torch.Tensor | None = None):
        """Start one ``all_to_all_single`` of ``send`` itself (not a view), as :meth:`post`;
        ``into``: the receive buffer (not a view: :func:`region`), else one is made."""
        n, spare, self.spare = sum(recv_splits), self.spare, None
        if into is not None:
            recv, self.spare = into, spare
        elif spare is not None and spare.numel() == n:
            recv, self.reused = spare, self.reused + 1
        else:
            del spare  # freed before the new buffer is made
            recv = torch.empty(n, dtype=self.wire, device=self.device)
        work, kept = _all_to_all(self.rank, recv, send, recv_splits, send_splits, self.group)
        self.stats.bytes_sent += self.item * (sum(send_splits) - send_splits[self.rank])
        self.stats.bytes_received += self.item * (sum(recv_splits) - recv_splits[self.rank])
        return work, recv, send, kept

    def wait(self, flight: InFlight) -> None:
        t0 = time.perf_counter()
        flight.complete()
        self.stats.comm_wait_s += time.perf_counter() - t0

    def timed(self, compute: Compute, idx: list[int], mats: list[torch.Tensor]) -> list[torch.Tensor]:
        """``compute(idx, mats)``, its time counted in the stats."""
        t0 = time.perf_counter()
        results = compute(idx, mats) if idx else []
        self.stats.compute_s += time.perf_counter() - t0
        return results


@dataclass
class InFlight:
    """One posted ``all_to_all_single`` of a bucket (:meth:`Wire.post`)."""

    bucket: BucketPlan
    work: Any  # the collective's handle (None once complete)
    recv: torch.Tensor
    send: torch.Tensor  # kept alive until the collective completes
    kept: Kept
    mine: dict[int, torch.Tensor] | None = None  # a return: the owner's own rows, never sent

    def complete(self) -> None:
        """Wait for the collective; drop its handle, release its tensors (:class:`Kept`) and
        free the send buffer."""
        self.work.wait()
        self.work = None
        self.kept.release()
        self.send = None  # type: ignore[assignment]


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
        plan's (e.g. the update without the parameter's rows that travelled beside it);
        ``None``: the same.

    Returns:
      Per matrix, the ``(receive rows, result cols)`` block of the result this rank holds, and
      the stats.
    """
    back_cols = result_cols_of(plan, result_cols)
    rows = contributions(plan, rank, held)
    if not rows:
        return [], ExchangeStats()
    if plan.world_size == 1:
        wire = Wire(rank, rows[0], wire_dtype, group)
        return _compute_locally(plan, rows, compute, wire), wire.stats
    posted = Posted(plan, rank, group=group, wire_dtype=wire_dtype)
    for b in plan.buckets:
        posted.post(b.index, {j: held[j] for j in b.matrices})
    return posted.finish(compute, result_cols=back_cols)


class Posted:
    """An :func:`exchange` whose gathers are posted one bucket at a time, in plan order
    (:meth:`post`, e.g. as each bucket's gradients become final during backward), and finished
    by :meth:`finish` (the owners compute, the results come back), or dropped by :meth:`drain`.
    :func:`exchange` is ``post`` of every bucket, then ``finish``: the same collectives and ops.
    Every rank must post the same buckets in the same order (the plan's) before ``finish``.
    """

    def __init__(self, plan: Plan, rank: int, *, group: dist.ProcessGroup | None = None,
                 wire_dtype: torch.dtype | None = None) -> None:
        if plan.world_size == 1:
            raise ValueError("Posted: a plan of one rank has nothing to exchange")
        self.plan, self.rank, self.group, self.wire_dtype = plan, rank, group, wire_dtype
        self.rows: list[torch.Tensor | None] = [None] * len(plan.matrices)
        self.gathers: list[InFlight] = []
        self.wire: Wire | None = None

    @property
    def next_bucket(self) -> int:
        """The bucket :meth:`post` takes next (``len(plan.buckets)``: all are posted)."""
        return len(self.gathers)

    def post(self, bucket: int, held: dict[int, torch.Tensor]) -> None:
        """Start the gather of ``bucket`` (the next in plan order): ``held[j]`` is this rank's
        rows of each of its matrices ``j``, as :func:`exchange`'s ``held``."""
        if bucket != self.next_bucket:
            raise ValueError(f"Posted.post: bucket {bucket} posted out of order (next is {self.next_bucket})")
        b = self.plan.buckets[bucket]
        if sorted(held) != sorted(b.matrices):
            raise ValueError(f"Posted.post: bucket {bucket} holds matrices {sorted(b.matrices)}, got {sorted(held)}")
        for j in b.matrices:
            self.rows[j] = contribution(self.plan.matrices[j], self.rank, held[j])
        if self.wire is None:
            self.wire = Wire(self.rank, self.rows[b.matrices[0]], self.wire_dtype, self.group)
        self.gathers.append(post_gather(self.plan, b, self.rows, self.wire))  # type: ignore[arg-type]

    def finish(self, compute: Compute, *, result_cols: Sequence[int] | None = None
               ) -> tuple[list[torch.Tensor], ExchangeStats]:
        """Every bucket posted: compute the owned (and local) matrices and return the results;
        as :func:`exchange`."""
        plan, wire = self.plan, self.wire
        if self.next_bucket != len(plan.buckets) or wire is None:
            raise ValueError(f"Posted.finish: {self.next_bucket} of {len(plan.buckets)} buckets posted")
        back_cols = result_cols_of(plan, result_cols)
        out: list[torch.Tensor | None] = [None] * len(plan.matrices)
        for b in plan.buckets:
            compute_local(plan, b, self.rows, compute, back_cols, wire, out)  # type: ignore[arg-type]
        returns = [compute_and_return(plan, g, compute, back_cols, wire) for g in self.gathers]
        for r in returns:
            collect(plan, r, back_cols, wire, out)
        self.gathers = []
        return out, wire.stats  # type: ignore[return-value]

    def drain(self) -> float:
        """Wait for every posted gather and drop it (every rank posted the same, so nothing is
        left pending anywhere); returns the seconds waited."""
        waited = 0.0
        for g in self.gathers:
            t0 = time.perf_counter()
            g.complete()
            waited += time.perf_counter() - t0
        self.gathers, self.rows = [], [None] * len(self.plan.matrices)
        return waited


def _compute_locally(plan: Plan, rows: list[torch.Tensor], compute: Compute,
                     wire: Wire) -> list[torch.Tensor]:
    """One rank: every matrix is whole here; ``compute`` runs bucket by bucket."""
    out: list[torch.Tensor | None] = [None] * len(plan.matrices)
    for b in plan.buckets:
        idx = list(b.matrices)
        for j, r in zip(idx, wire.timed(compute, idx, [rows[j] for j in idx])):
            out[j] = r
    return out  # type: ignore[return-value]


def compute_local(plan: Plan, b: BucketPlan, rows: list[torch.Tensor], compute: Compute,
                   back_cols: list[int], wire: Wire, out: list | dict) -> None:
    """A bucket's local matrices: this rank's rows of each, computed here (nothing travels)."""
    here = [j for j in b.matrices if plan.matrices[j].local]
    if not here:
        return
    for j, r in zip(here, wire.timed(compute, here, [rows[j] for j in here])):
        start, stop = plan.matrices[j].receive[wire.rank]
        if tuple(r.shape) != (stop - start, back_cols[j]):
            raise ValueError(f"exchange: compute returned shape {tuple(r.shape)} for local matrix {j}, "
                             f"expected {(stop - start, back_cols[j])}")
        out[j] = r


def post_gather(plan: Plan, b: BucketPlan, rows: list[torch.Tensor], wire: Wire) -> InFlight:
    """Send every matrix's contributed rows to its owner: the send buffer is ordered by owner,
    then by the bucket's matrix order. The entries of ``rows`` (indexed by matrix) that are sent
    become None (freed before the receive buffer is made, if nothing else holds them)."""
    parts = [rows[j] for d in range(plan.world_size) for j in owned_by(plan, b, d)]
    for j in b.matrices:
        if not plan.matrices[j].local:
            rows[j] = None  # type: ignore[call-overload]
    return InFlight(b, *wire.post(parts, b.gather_send(wire.rank), b.gather_recv(wire.rank)))


def compute_and_return(plan: Plan, g: InFlight, compute: Compute, back_cols: list[int], wire: Wire,
                       before_post: Callable[[], None] | None = None, *, in_place: bool = False) -> InFlight:
    """Wait for a bucket's gather, compute the owned matrices and post their rows back to the
    other ranks (ordered by destination rank, then by the owned matrices; the owner's own rows
    stay here, in the returned flight's ``mine``); ``before_post`` runs just before the post.
    ``in_place``: where the results are the gather's receive buffer (:func:`returns_in_place`),
    that buffer is sent back as it is, the owner's own rows with it (no copy is made)."""
    wire.wait(g)
    owned = owned_by(plan, g.bucket, wire.rank)
    box, g.recv = [g.recv], None  # type: ignore[assignment]
    results, recv = compute_owned(plan, owned, box, compute, back_cols, wire, keep=in_place)
    me, w, b = wire.rank, plan.world_size, g.bucket
    if recv is not None and returns_in_place(plan, owned, results, recv, back_cols):
        del results
        recv_splits = [returned(plan, b.matrices, s, me, back_cols) for s in range(w)]
        if before_post is not None:
            before_post()
        wire.sent_in_place += 1
        flight = InFlight(b, *wire.post_buffer(recv, b.gather_recv(me), recv_splits))
        flight.mine = {}
        return flight
    del recv
    mine = {j: own_rows(r, plan.matrices[j].receive[me], wire) for j, r in zip(owned, results)}
    parts = [r[slice(*plan.matrices[j].receive[d])] for d in range(w) if d != me for j, r in zip(owned, results)]
    del results
    send_splits = [0 if d == me else returned(plan, b.matrices, me, d, back_cols) for d in range(w)]
    recv_splits = [0 if s == me else returned(plan, b.matrices, s, me, back_cols) for s in range(w)]
    if before_post is not None:
        before_post()
    flight = InFlight(b, *wire.post(parts, send_splits, recv_splits))
    flight.mine = mine
    return flight


def compute_owned(plan: Plan, owned: list[int], box: list[torch.Tensor], compute: Compute, back_cols: list[int],
                  wire: Wire, *, keep: bool = True) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """The ``owned`` matrices computed, out of the gather's receive buffer, the one entry of
    ``box`` (taken out of it, so that the buffer is freed before the iteration allocates once
    every matrix is copied out of it). Returns the results and, where ``keep`` and every matrix
    is computed in it, the receive buffer (else None)."""
    recv = box.pop()
    mats = assemble(plan, owned, recv, wire)
    if not (keep and mats and all(m._base is recv for m in mats)):
        recv = None  # type: ignore[assignment]
    results = wire.timed(compute, owned, mats)
    del mats
    for j, shape in zip(owned, [tuple(r.shape) for r in results]):  # no loop variable keeps a result
        if shape != (plan.matrices[j].rows, back_cols[j]):
            raise ValueError(f"exchange: compute returned shape {shape} for matrix {j}, "
                             f"expected {(plan.matrices[j].rows, back_cols[j])}")
    return results, recv


def collect(plan: Plan, r: InFlight, back_cols: list[int], wire: Wire, out: list | dict) -> None:
    """This rank's rows of a bucket's results (ordered by owner, then bucket order)."""
    wire.wait(r)
    offset = 0
    for s in range(plan.world_size):
        if s == wire.rank and r.mine:  # kept here, never sent
            for j, rows in r.mine.items():
                out[j] = rows
        else:
            offset = rows_back(plan, r.bucket, s, r.recv, offset, back_cols, wire, out)


def rows_back(plan: Plan, b: BucketPlan, owner: int, recv: torch.Tensor, offset: int, back_cols: list[int],
              wire: Wire, out: list | dict) -> int:
    """This rank's rows of the results of ``b``'s matrices that ``owner`` computed, read from
    ``recv`` at ``offset`` (in bucket order, in the dtype compute returned) into ``out``; returns
    the offset after them."""
    for j in owned_by(plan, b, owner):
        start, stop = plan.matrices[j].receive[wire.rank]
        k = (stop - start) * back_cols[j]
        out[j] = recv[offset:offset + k].view(-1, back_cols[j]).to(wire.dtype)
        offset += k
    return offset


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
    contributions(plan, rank, held)  # shape checks
    back_cols = result_cols_of(plan, result_cols)
    if not held:
        return [], ExchangeStats()
    wire = Wire(rank, held[0], wire_dtype, group)
    pending = [_post_all_gather(plan, b, held, wire) for b in plan.buckets]
    out: list[torch.Tensor | None] = [None] * len(plan.matrices)
    for b, members, flight in pending:
        if flight is not None:
            wire.wait(flight)
        full = unpad(plan, members, flight.recv, wire) if flight is not None else {}
        idx = list(b.matrices)
        results = wire.timed(compute, idx, [full.get(j, held[j]) for j in idx])
        for j, r in zip(idx, results):
            out[j] = r[slice(*plan.matrices[j].receive[rank])] if j in full else r
            if out[j].shape[1] != back_cols[j]:
                raise ValueError(f"exchange: compute returned {r.shape[1]} columns for matrix {j}, "
                                 f"expected {back_cols[j]}")
    return out, wire.stats  # type: ignore[return-value]


def _post_all_gather(plan: Plan, b: BucketPlan, held: Sequence[torch.Tensor], wire: Wire):
    """Start the all-gather of this rank's rows of the bucket's sharded matrices (padded)."""
    members = [j for j in b.matrices if is_sharded(plan, j)] if plan.world_size > 1 else []
    parts = []
    for j in members:
        x = held[j]
        pad = padded_rows(plan, j) - x.shape[0]
        parts.append((torch.cat([x, x.new_zeros(pad, x.shape[1])]) if pad else x).reshape(-1))
    if not parts:
        return b, members, None
    send = torch.cat(parts).to(wire.wire)
    gathered = torch.empty(plan.world_size * send.numel(), dtype=wire.wire, device=wire.device)
    kept = Kept(gathered, send)
    work = _all_gather(gathered, send, group=wire.group, async_op=True)
    copies = wire.item * send.numel() * (plan.world_size - 1)  # as a ring/all-to-all: (W-1) copies
    wire.stats.bytes_sent += copies
    wire.stats.bytes_received += copies
    return b, members, InFlight(b, work, gathered, send, kept)


# torch >= 2.13 names it all_gather_single (all_gather_into_tensor warns); older torch lacks it.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# ----------------------------------------------------------------------------- around a step
def all_ranks_finite(finite: torch.Tensor, group: dist.ProcessGroup | None, world_size: int) -> torch.Tensor:
    """``finite`` (a 0-d bool tensor) AND-ed over the ranks of ``group``: one tiny all-reduce,
    nothing read back to the host (none for W = 1)."""
    if world_size == 1:
        return finite
    flag = finite.reshape(1).to(torch.int32, copy=True)  # not a view: Kept keeps it
    kept = Kept(flag)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    kept.release()
    return flag.reshape(()).bool()


def all_ranks_max(tensors: list[torch.Tensor]) -> None:
    """Every tensor becomes its elementwise max over all ranks of the default group, in place (one
    all-reduce). The default group, not the shard group: HSDP replicas see other batches too."""
    if not tensors or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    kept = Kept(flat)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    kept.release()
    for t, v in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(v.view_as(t))


def any_rank(flags: list[bool], group: dist.ProcessGroup | None, world_size: int) -> list[bool]:
    """Each of the host-side ``flags`` OR-ed over the ranks of ``group`` (one object all-gather)."""
    if world_size == 1:
        return flags
    every: list[Any] = [None] * world_size
    dist.all_gather_object(every, flags, group=group)
    return [any(column) for column in zip(*every)]


def dedicated_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """A new process group of the ranks of ``group`` (``None``: the default group), for an
    exchange posted during backward: its collectives then never interleave with those FSDP2 (or
    the user) posts on ``group`` meanwhile, so ranks cannot match them in different orders, and
    a big gather does not queue ahead of a reduce-scatter. Collective over the default group:
    every rank creates every rank's group (as ``torch.distributed.new_group`` requires)."""
    ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(dist.get_world_size()))
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, ranks)
    mine = None
    for members in dict.fromkeys(tuple(r) for r in every):  # each distinct group once, same order
        made = dist.new_group(list(members))
        if dist.get_rank() in members:
            mine = made
    assert mine is not None
    return mine


def any_rank_flag(flag: bool, group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """``flag`` OR-ed over the ranks of ``group`` (one tiny all-reduce, read back to the host)."""
    t = torch.tensor([int(flag)], dtype=torch.int32, device=device)
    kept = Kept(t)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    kept.release()
    return bool(t.item())


def share_from_owners(values: list[torch.Tensor | None], like: list[torch.Tensor],
                      group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """Every rank gets each owner's value: ``values[k]`` is the owner's (None elsewhere) and
    ``like[k]`` gives its shape and dtype. One all-reduce (sum) of a flat fp64 buffer in which
    the other ranks put −0.0, the exact identity of IEEE addition (−0 + x = x for every x)."""
    parts = [torch.full((t.numel(),), -0.0, dtype=torch.float64, device=t.device) if v is None
             else v.reshape(-1).to(torch.float64) for v, t in zip(values, like)]
    if not parts:
        return []
    flat = torch.cat(parts)
    kept = Kept(flat)
    dist.all_reduce(flat, group=group)
    kept.release()
    out, offset = [], 0
    for t in like:
        out.append(flat[offset:offset + t.numel()].view(t.shape).to(t.dtype))
        offset += t.numel()
    return out


def check_same(description: Sequence[tuple[str, str]], what: str, group: dist.ProcessGroup | None,
               world_size: int) -> None:
    """Raise on every rank unless every rank of ``group`` has the same ``description`` (a list
    of ``(entry, value)`` pairs). One all-gather of a hash; only when the hashes differ, a second
    gathers the descriptions to name the first entry that differs (:func:`first_difference`)."""
    if world_size == 1:
        return
    digest = hashlib.sha256(repr(list(description)).encode()).hexdigest()
    every: list[Any] = [None] * world_size
    dist.all_gather_object(every, digest, group=group)
    differ = [r for r, d in enumerate(every) if d != every[0]]
    if not differ:
        return
    descriptions: list[Any] = [None] * world_size
    dist.all_gather_object(descriptions, list(description), group=group)
    raise RuntimeError(f"the ranks disagree on {what}: rank {differ[0]} differs from rank 0 "
                       f"{first_difference(descriptions[0], descriptions[differ[0]], differ[0])}; every "
                       "rank must build the optimizer from the same model, parameters (in the same "
                       "order) and options")


def first_difference(first: Sequence[tuple[str, str]], other: Sequence[tuple[str, str]], rank: int) -> str:
    """Where rank ``rank``'s description ``other`` first departs from rank 0's ``first``, in words.
    Entries are matched by name; the last entry of a description (a summary, such as the plan's
    hash) is compared after all the others."""
    a, b = dict(first), dict(other)
    names = [*list(a)[:-1], *(k for k in list(b)[:-1] if k not in a), *list(a)[-1:],
             *(k for k in list(b)[-1:] if k not in a)]
    for name in names:
        if a.get(name) != b.get(name):
            return f"at {name}: {a.get(name, 'none')} on rank 0, {b.get(name, 'none')} on rank {rank}"
    return "in the order of its entries"
