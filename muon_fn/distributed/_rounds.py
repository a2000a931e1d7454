"""A bucket's exchange in rounds of one peer each way (:func:`gather_rounds`,
:func:`return_rounds`), for a bucket the bounded step exchanges with nothing else in flight
(:meth:`~muon_fn.distributed._stream._Run.alone`): in round ``t`` of ``W`` a rank sends to rank
``rank + t`` and receives from rank ``rank - t`` (the return the other way round), so that it
holds one round's rows at a time beside the matrices it owns, each made just before it travels
and applied as soon as it is back. Each round is one ``all_to_all_single`` through
:class:`~muon_fn.distributed._exchange.Wire` (which posts every collective of an exchange), with
one peer's split each way; the buffers are laid out as :mod:`._exchange`'s one all-to-all lays
them, so the owners compute the same matrices bit for bit.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from ._exchange import InFlight, Wire, region, rows_back
from ._pieces import contribution, own_rows, owned_by, returned, returns_in_place
from ._plan import BucketPlan, Plan


def _post_round(wire: Wire, b: BucketPlan, w: int, send: torch.Tensor, to: int, into: torch.Tensor | None,
                source: int, numel: int) -> InFlight:
    """One round's ``all_to_all_single`` among ``w`` ranks: ``send`` to rank ``to``, ``numel``
    elements from rank ``source`` (into ``into``, or a buffer made for them)."""
    send_splits, recv_splits = [0] * w, [0] * w
    send_splits[to], recv_splits[source] = send.numel(), numel
    return InFlight(b, *wire.post_buffer(send, send_splits, recv_splits, into))


def _copy_into(parts: list[torch.Tensor], dest: torch.Tensor) -> torch.Tensor:
    """``parts`` flat, one after the other, into the 1-D ``dest`` (in its dtype); returns it."""
    offset = 0
    for p in parts:
        dest[offset:offset + p.numel()].copy_(p.reshape(-1))
        offset += p.numel()
    return dest


def _concat(parts: list[torch.Tensor], wire: Wire) -> torch.Tensor:
    """``parts`` flat, one after the other, in the wire's dtype (a new tensor)."""
    return _copy_into(parts, torch.empty(sum(p.numel() for p in parts), dtype=wire.wire, device=wire.device))


def gather_rounds(plan: Plan, b: BucketPlan, rows_for: Callable[[int], dict[int, torch.Tensor]],
                  wire: Wire) -> torch.Tensor:
    """A bucket's gather in ``W`` rounds, one peer each way per round: in round ``t`` this rank
    sends its rows of the matrices that rank ``rank + t`` owns (``rows_for(owner)``, made just
    before they travel) and receives from rank ``rank - t`` its rows of the matrices it owns,
    into their place in the receive buffer (laid out as
    :func:`~muon_fn.distributed._exchange.post_gather`'s: by source rank, then owned matrix),
    which it returns. Round 0 is this rank's own rows, copied. Each round's
    rows are freed before the next round's are made."""
    me, w = wire.rank, plan.world_size
    sizes = b.gather_recv(me)
    starts = [0, *itertools.accumulate(sizes)]
    recv = torch.empty(sum(sizes), dtype=wire.wire, device=wire.device)
    for t in range(w):
        to, source = (me + t) % w, (me - t) % w
        rows = rows_for(to)
        parts = [contribution(plan.matrices[j], me, rows[j]) for j in owned_by(plan, b, to)]
        del rows
        if t == 0:  # its own rows, copied into their place
            _copy_into(parts, recv[starts[me]:starts[me + 1]])
            del parts
            continue
        send = _concat(parts, wire)
        del parts
        wire.wait(_post_round(wire, b, w, send, to, region(recv, starts[source], sizes[source]), source, sizes[source]))
        del send
    return recv


def return_rounds(plan: Plan, b: BucketPlan, owned: list[int], results: list[torch.Tensor],
                  recv: torch.Tensor | None, back_cols: list[int], wire: Wire,
                  arrived: Callable[[dict[int, torch.Tensor]], None]) -> None:
    """A bucket's return in ``W`` rounds, as :func:`gather_rounds` backwards: in round ``t`` this
    rank sends its results' rows of rank ``rank - t`` and receives from rank ``rank + t`` its rows
    of the matrices that rank owns; ``arrived(rows)`` takes each round's rows as they come (round
    0: this rank's own rows of its results). Where the results are the gather's receive buffer
    ``recv`` (:func:`returns_in_place`), each round sends its part of that buffer as it lies."""
    me, w = wire.rank, plan.world_size
    in_place = recv is not None and returns_in_place(plan, owned, results, recv, back_cols)
    if in_place:
        wire.sent_in_place += 1
        sizes = b.gather_recv(me)
        starts = [0, *itertools.accumulate(sizes)]
    arrived({j: own_rows(r, plan.matrices[j].receive[me], wire) for j, r in zip(owned, results)})
    for t in range(1, w):
        to, source = (me - t) % w, (me + t) % w
        if in_place:
            send = region(recv, starts[to], sizes[to])  # type: ignore[arg-type]
        else:
            send = _concat([r[slice(*plan.matrices[j].receive[to])] for j, r in zip(owned, results)], wire)
        flight = _post_round(wire, b, w, send, to, None, source, returned(plan, b.matrices, source, me, back_cols))
        del send
        wire.wait(flight)
        rows: dict[int, torch.Tensor] = {}
        rows_back(plan, b, source, flight.recv, 0, back_cols, wire, rows)
        arrived(rows)
        del rows
        wire.recycle(flight)
