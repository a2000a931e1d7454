"""The exchange's buffers without a process group (fast tier): W ranks as threads of this process,
``all_to_all_single`` carried out in memory (:class:`_Mailbox`), so that the layouts of
:mod:`muon_fn.distributed._exchange` and :mod:`muon_fn.distributed._rounds` are checked in
milliseconds. For every bucket of plans with uneven and empty shards at W = 2, 3, 4: a bucket
gathered in rounds lands in the receive buffer exactly as the one all-to-all lays it, and both
returns (in rounds, and the one all-to-all; results computed in the receive buffer or not) give
every rank its rows of every result. The spawned gloo jobs (tests/test_fsdp.py) check the same
paths end to end, bit for bit against one device.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from muon_fn.distributed import _exchange, _rounds
from muon_fn.distributed._pieces import assemble, contribution, owned_by, result_cols_of
from muon_fn.distributed._plan import make_plan

# uneven rows, a matrix with fewer rows than ranks (empty shards), square, tall and wide
SHAPES = [(7, 5), (4, 6), (10, 3), (3, 8), (2, 4), (9, 9)]
TIMEOUT_S = 10


class _Mailbox:
    """``all_to_all_single`` among threads: a rank's k-th collective leaves each chunk for its
    destination and waits for the chunk every source left in its k-th (every rank posts the
    same collectives in the same order). Counts the elements each rank sent itself."""

    def __init__(self) -> None:
        self.cond, self.box, self.local = threading.Condition(), {}, threading.local()
        self.to_itself: dict[int, int] = {}

    def start(self, rank: int) -> None:
        self.local.rank, self.local.count = rank, 0

    def all_to_all_single(
        self, output, input, output_split_sizes, input_split_sizes, group=None, async_op=False
    ):
        rank, k = self.local.rank, self.local.count
        self.local.count += 1
        self.to_itself[rank] = self.to_itself.get(rank, 0) + input_split_sizes[rank]
        with self.cond:
            for d, chunk in enumerate(input.split(input_split_sizes)):
                self.box[(k, rank, d)] = chunk.clone()
            self.cond.notify_all()
        mailbox = self

        class Work:
            def wait(self) -> bool:
                for s, place in enumerate(output.split(output_split_sizes)):
                    with mailbox.cond:
                        assert mailbox.cond.wait_for(
                            lambda s=s: (k, s, rank) in mailbox.box, TIMEOUT_S
                        )
                        place.copy_(mailbox.box.pop((k, s, rank)))
                return True

        work = Work()
        return work if async_op else work.wait()


def _on_ranks(w: int, mailbox: _Mailbox, run: Callable[[int], object]) -> list:
    """``run(rank)`` on ``w`` threads at once; each one's result (an error is raised here)."""
    out: list = [None] * w

    def target(rank: int) -> None:
        mailbox.start(rank)
        try:
            out[rank] = run(rank)
        except BaseException as e:  # re-raised on the test's thread
            out[rank] = e

    threads = [threading.Thread(target=target, args=(r,)) for r in range(w)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    for r in out:
        if isinstance(r, BaseException):
            raise r
    return out


def _compute(in_place: bool):
    """A stand-in for the owners' update: ``2·m + j``, written into ``m`` (its receive buffer,
    where it is a view of it) or into a new tensor."""

    def compute(idx, mats):
        return [m.mul_(2).add_(j) if in_place else m * 2 + j for j, m in zip(idx, mats)]

    return compute


@pytest.fixture
def mailbox(monkeypatch):
    box = _Mailbox()
    monkeypatch.setattr(dist, "all_to_all_single", box.all_to_all_single)
    return box


@pytest.mark.parametrize("w", [2, 3, 4])
@pytest.mark.parametrize("in_place", [True, False])
def test_rounds_lay_out_and_return_what_the_one_all_to_all_does(mailbox, w, in_place):
    plan = make_plan(SHAPES, w, num_buckets=2)
    torch.manual_seed(0)
    full = [torch.randn(mp.rows, mp.cols) for mp in plan.matrices]
    cols = result_cols_of(plan, None)
    expected = [m * 2 + j for j, m in enumerate(full)]

    def mine(rank: int) -> dict[int, torch.Tensor]:
        return {j: m[slice(*plan.matrices[j].receive[rank])].clone() for j, m in enumerate(full)}

    def one_all_to_all(rank: int, b) -> tuple[torch.Tensor, dict]:
        wire, held = _exchange.Wire(rank, full[0], None, None), mine(rank)
        rows = [None] * len(plan.matrices)
        for j in b.matrices:
            rows[j] = contribution(plan.matrices[j], rank, held[j])
        gathered = _exchange.post_gather(plan, b, rows, wire)
        wire.wait(gathered)
        recv = gathered.recv.clone()
        gathered.work = _Done()
        back = _exchange.compute_and_return(
            plan, gathered, _compute(in_place), cols, wire, in_place=in_place
        )
        out: dict = {}
        _exchange.collect(plan, back, cols, wire, out)
        return recv, out

    def in_rounds(rank: int, b) -> tuple[torch.Tensor, dict]:
        wire, held = _exchange.Wire(rank, full[0], None, None), mine(rank)
        recv = _rounds.gather_rounds(
            plan, b, lambda owner: {j: held[j] for j in owned_by(plan, b, owner)}, wire
        )
        gathered, owned = recv.clone(), owned_by(plan, b, rank)
        results = _compute(in_place)(owned, assemble(plan, owned, recv, wire))
        out: dict = {}
        _rounds.return_rounds(plan, b, owned, results, recv, cols, wire, out.update)
        return gathered, out

    for b in plan.buckets:
        ones = _on_ranks(w, mailbox, lambda r, b=b: one_all_to_all(r, b))
        rounds = _on_ranks(w, mailbox, lambda r, b=b: in_rounds(r, b))
        for rank, ((recv_one, back_one), (recv_rounds, back_rounds)) in enumerate(
            zip(ones, rounds)
        ):
            assert torch.equal(recv_rounds, recv_one), (b.index, rank)
            for back in (back_one, back_rounds):
                assert sorted(back) == sorted(
                    j for j in b.matrices if not plan.matrices[j].local
                ), (b.index, rank)
                for j, rows in back.items():
                    assert torch.equal(rows, expected[j][slice(*plan.matrices[j].receive[rank])]), (
                        b.index,
                        rank,
                        j,
                    )
    # a rank's own rows never went through a collective: copied beside the one all-to-all
    # (between two ranks, and on the first and last of more), never sent in a round
    ends = {0, w - 1}
    assert all(n == 0 for r, n in mailbox.to_itself.items() if r in ends), mailbox.to_itself


class _Done:
    """A collective's handle already waited for."""

    def wait(self) -> bool:
        return True
