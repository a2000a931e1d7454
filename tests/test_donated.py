"""Donated updates (``update(..., donated=True)``): the orthogonalization then iterates in its
inputs' memory, and its results are bit for bit those of the inputs cast first and iterated in
scratch, for every method, layout (tall, wide, square), batch of 1 and of several, compute dtype
and alignment; only the first part of a chain is given the donation."""

from __future__ import annotations

import pytest
import torch

import muon_fn as mf
from muon_fn.core import newton_schulz as _newton_schulz
from muon_fn.core.newton_schulz import cpu as _cpu

# Across the per-matrix loop (min dim >= 384) and the batched GEMMs, and the blockwise norm of a
# low-precision matrix (more than NORM_BLOCK = 65536 elements).
SHAPES = [(24, 40), (40, 24), (32, 32), (400, 384), (384, 400), (384, 384)]
METHODS = ["quintic", "polar_express", "aol9", "gram", "cubic"]
DTYPES = [torch.bfloat16, torch.float32]


def _msign(xs, method, dtype, *, consume, buffers):
    schedule = _newton_schulz.coefficient_schedule(method, None)
    return _newton_schulz.orthogonalize_batch(
        xs,
        schedule,
        dtype=dtype,
        eps=1e-7,
        norm_scale=_newton_schulz.norm_scale(method),
        buffers=buffers,
        consume=consume,
    )


CASES = [
    (m, d) for m in METHODS for d in DTYPES if not (m == "gram" and d == torch.bfloat16)
]  # gram: fp32/fp16


@pytest.mark.parametrize(("method", "dtype"), CASES, ids=[f"{m}-{str(d)[6:]}" for m, d in CASES])
def test_consumed_equals_cast_first_bit_for_bit(method, dtype):
    g = torch.Generator().manual_seed(0)
    for shape in SHAPES:
        for batch in (1, 3):
            xs = [torch.randn(shape, generator=g) * 0.01 for _ in range(batch)]
            expected = _msign([x.to(dtype) for x in xs], method, dtype, consume=False, buffers={})
            got = _msign([x.clone() for x in xs], method, dtype, consume=True, buffers={})
            assert torch.equal(got, expected), (shape, batch)


@pytest.mark.parametrize("shape", [(384, 400), (400, 384)], ids=["wide", "tall"])
@pytest.mark.parametrize("batch", [1, 2])
def test_a_consumed_matrix_needs_no_scratch_of_its_size(shape, batch):
    xs = [torch.randn(shape) for _ in range(batch)]
    kept, consumed = {}, {}
    _msign(
        [x.to(torch.bfloat16) for x in xs],
        "polar_express",
        torch.bfloat16,
        consume=False,
        buffers=kept,
    )
    _msign(xs, "polar_express", torch.bfloat16, consume=True, buffers=consumed)
    assert {k[0] for k in kept} == {"gram", "poly", "x"}
    assert {k[0] for k in consumed} == {
        "gram",
        "poly",
    }  # the iterate alternates with the input's memory


def test_inputs_that_cannot_hold_the_iterate_are_cast_to_scratch():
    """Not contiguous, narrower than the compute dtype, or off a fresh tensor's alignment (an
    fp32 GEMM's rounding depends on its operands' address): the same result, from scratch."""
    base = torch.randn(2 * 400 * 384 + 1)
    misaligned = base[1:].view(2, 400, 384)[0]
    assert _cpu.own_slot(misaligned, torch.float32) is None
    transposed = torch.randn(384, 400).mT
    assert _cpu.own_slot(transposed, torch.float32) is None
    narrow = torch.randn(400, 384, dtype=torch.bfloat16)
    assert _cpu.own_slot(narrow, torch.float32) is None
    for x, dtype in [
        (misaligned, torch.float32),
        (transposed, torch.float32),
        (narrow, torch.float32),
        (misaligned, torch.bfloat16),
    ]:
        expected = _msign([x.to(dtype)], "polar_express", dtype, consume=False, buffers={})
        got = _msign([x.clone()], "polar_express", dtype, consume=True, buffers={})
        assert torch.equal(got, expected)


def test_own_slot_is_the_head_of_the_memory_in_the_narrower_dtype():
    x = torch.randn(400, 384)
    slot = _cpu.own_slot(x, torch.bfloat16)
    assert (
        slot.shape == x.shape and slot.dtype == torch.bfloat16 and slot.data_ptr() == x.data_ptr()
    )
    assert (
        _cpu.own_slot(x, torch.float32) is not None
        and _cpu.own_slot(x, torch.float32).data_ptr() == x.data_ptr()
    )


def test_normalize_cast_into_its_own_memory_equals_cast_then_normalize():
    g = torch.Generator().manual_seed(1)
    for shape in [(400, 384), (384, 400), (30, 20), (1, 70000)]:
        x = torch.randn(shape, generator=g)
        expected = torch.empty(shape, dtype=torch.bfloat16)
        _cpu.normalize_into(x.to(torch.bfloat16), expected, 1.01, 1e-7)
        y = x.clone()
        slot = _cpu.own_slot(y, torch.bfloat16)
        _cpu.normalize_cast_into(y, slot, 1.01, 1e-7)
        assert torch.equal(slot, expected), shape


class _Probe:
    """A transform that records the extras it was given."""

    def __init__(self):
        self.seen = []

    def tx(self):
        def update(updates, state, params=None, **extra):
            self.seen.append(mf.core.base.donated(extra))
            return updates, state

        return mf.GradientTransformation(lambda params: (), update)


def test_chain_donates_to_its_first_part_only():
    first, second = _Probe(), _Probe()
    tx = mf.chain(first.tx(), second.tx())
    tx.update([torch.zeros(2, 2)], tx.init([torch.zeros(2, 2)]), donated=True)
    assert first.seen == [True] and second.seen == [False]
    tx.update([torch.zeros(2, 2)], tx.init([torch.zeros(2, 2)]))
    assert first.seen == [True, False]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_orthogonalize_with_donated_updates_gives_the_same_updates(compiled):
    """Donated, the updates' memory is used (its values are gone); not donated, untouched.
    Buckets: tall of 2, wide of 1, square of 2, a small batched one; compiled, equal to eager."""
    torch.manual_seed(0)
    grads = [
        torch.randn(400, 384),
        torch.randn(384, 400),
        torch.randn(400, 384),
        torch.randn(384, 384),
        torch.randn(384, 384),
        torch.randn(24, 40),
    ]
    tx = mf.chain(mf.orthogonalize("polar_express", dtype=torch.bfloat16), mf.scale_by_shape())
    update = torch.compile(tx.update, fullgraph=True, dynamic=False) if compiled else tx.update
    kept = [g.clone() for g in grads]
    expected, _ = update(kept, tx.init(grads))
    assert all(torch.equal(k, g) for k, g in zip(kept, grads))  # not donated: untouched
    donated = [g.clone() for g in grads]
    got, _ = update(donated, tx.init(grads), donated=True)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert not torch.equal(donated[0], grads[0])  # its memory held the iteration
    eager, _ = tx.update([g.clone() for g in grads], tx.init(grads))
    assert all(torch.equal(a, b) for a, b in zip(got, eager))


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
def test_a_consumed_batch_holds_one_matrix_of_scratch_where_it_consumes_each(dtype):
    """Where the CPU iterates a consumed batch one matrix at a time (its loop, or GEMMs on AMX
    tiles, whose batched and one-matrix roundings agree) the Gram scratch is one matrix's, not
    the batch's; elsewhere the batch's."""
    m, n, batch = 384, 400, 3
    buffers = {}
    _msign(
        [torch.randn(m, n) for _ in range(batch)],
        "polar_express",
        dtype,
        consume=True,
        buffers=buffers,
    )
    each = _cpu.CPUProducts().consumes_each(m)
    assert {
        k[0]: v.numel() for k, v in buffers.items() if k[0] in ("gram", "poly")
    } == dict.fromkeys(("gram", "poly"), (1 if each else batch) * m * m)
