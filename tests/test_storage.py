"""Low-bit state as a wrapper (``muon_fn.core.storage.stored``): over momentum and Adam it gives the
codes of a hand-written decode → fp32 step → encode, bit for bit; over a custom transform it stores
the fields its layout names, keeps a leaf without a gradient, traces as one graph and keeps its
inner transform's info."""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest
import torch
import torch._dynamo.testing
from hypothesis import given, settings
from hypothesis import strategies as st

import muon_fn as mf
from muon_fn.core import base as _base
from muon_fn.core import quantize as Q
from muon_fn.core import tree as _tree
from muon_fn.core.storage import Layout, stored
from muon_fn.core.transforms import ADAM_STORAGE, MOMENTUM_STORAGE


def params_of(rows: int, n: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(rows, n, generator=gen),
        "conv": torch.randn(rows, 2, 3, 3, generator=gen),
        "b": torch.randn(rows, generator=gen),
    }


def grads_of(params: dict[str, torch.Tensor], t: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + t)
    return {k: torch.randn(v.shape, generator=gen) * 10.0 ** (t % 3 - 1) for k, v in params.items()}


def value(storage: Q.Storage, x: torch.Tensor) -> torch.Tensor:
    """``x`` stored and read back, as the wrapper does between two steps."""
    if not storage.quantizes(x.shape):
        return x.to(storage.plain_dtype(x.dtype, x.ndim)).float()
    codes, scales = Q.encode(x, storage)
    return Q.decode(codes, scales, tuple(x.shape), storage)


@settings(max_examples=12, deadline=None)
@given(
    bits=st.sampled_from((16, 8, 4)),
    rows=st.integers(1, 5),
    n=st.integers(1, 600),
    kind=st.sampled_from(("sgd", "ema")),
    nesterov=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_momentum_is_decode_step_encode(bits, rows, n, kind, nesterov, seed):
    """``momentum(state_bits=k)`` is the 32-bit momentum between a decode and an encode: its
    codes, scales and outputs equal those of the steps written out by hand, bit for bit."""
    params = params_of(rows, n, seed)
    tx = mf.momentum(0.9, nesterov=nesterov, kind=kind, state_bits=bits)
    plain = mf.momentum(0.9, nesterov=nesterov, kind=kind)
    storage = Q.Storage(bits, Q.LINEAR)
    state, held = tx.init(params), {k: torch.zeros_like(v) for k, v in params.items()}
    for t in range(4):
        g = grads_of(params, t)
        out, state = tx.update(g, state, params)
        want, new = plain.update(g, mf.MomentumState(held), params)
        held = {k: value(storage, v) for k, v in new.mu.items()}
        for k in params:
            assert torch.equal(out[k], want[k]), k
    for k, v in new.mu.items():
        if storage.quantizes(v.shape):
            codes, scales = Q.encode(v, storage)
            assert torch.equal(state.codes[k], codes) and torch.equal(state.scales[k], scales), k
        else:
            assert torch.equal(state.mu[k], v.to(state.mu[k].dtype)), k


def test_scale_by_adam_is_the_wrapper():
    """``scale_by_adam(state_bits=k)`` and ``stored(scale_by_adam(), k, ADAM_STORAGE)`` hold and
    return the same tensors; the class and keys of the quantized state are the documented ones."""
    params = params_of(4, 300, 0)
    for bits in (16, 8, 4):
        a, b = mf.scale_by_adam(state_bits=bits), stored(mf.scale_by_adam(), bits, ADAM_STORAGE)
        sa, sb = a.init(params), b.init(params)
        for t in range(3):
            g = grads_of(params, t)
            ua, sa = a.update(g, sa, params)
            ub, sb = b.update(g, sb, params)
        assert type(sa) is type(sb) is mf.QuantizedAdamState
        la, lb = _tree.tree_leaves((ua, sa)), _tree.tree_leaves((ub, sb))
        assert all(
            (x is None and y is None) or torch.equal(x, y) for x, y in zip(la, lb, strict=True)
        )
    assert stored(mf.momentum(), 16, MOMENTUM_STORAGE).init(params).mu["w"].dtype == torch.bfloat16


class SquareState(NamedTuple):
    """A custom transform's state: a count (kept as it is) and an EMA of squares (stored)."""

    count: Any
    nu: Any

    state_keys = {"count": "square_count", "nu": "square_avg"}  # noqa: RUF012  NamedTuple: annotated, it would be a field


class QuantizedSquareState(NamedTuple):
    """Its stored twin: ``nu`` followed by its codes and scales."""

    count: Any
    nu: Any
    nu_codes: Any
    nu_scales: Any

    state_keys = {  # noqa: RUF012  NamedTuple: annotated, it would be a field
        "count": "square_count",
        "nu": "square_avg",
        "nu_codes": "square_avg_codes",
        "nu_scales": "square_avg_scales",
    }


SQUARE_STORAGE = Layout(SquareState, QuantizedSquareState, {"nu": Q.UNSIGNED})


def square_ema(beta: float = 0.9) -> mf.GradientTransformation:
    """``v ← βv + (1 − β)g²``, returns ``g / (√v + 1e-8)``; knows nothing of storage."""

    def init(params):
        return SquareState(torch.zeros((), dtype=torch.int64), _tree.zeros_like(params))

    def update(updates, state, params=None, **extra):
        nu = _tree.tree_map(
            lambda g, v: v if g is None else beta * v + (1 - beta) * g * g, updates, state.nu
        )
        out = _tree.tree_map(lambda g, v: None if g is None else g / (v.sqrt() + 1e-8), updates, nu)
        return out, SquareState(state.count + 1, nu)

    return _base.with_info(
        mf.GradientTransformation(init, update), leafwise=True, scope=_base.ELEMENTWISE
    )


@pytest.mark.parametrize("bits", (16, 8, 4))
def test_custom_transform(bits):
    """A transform that knows nothing of storage, wrapped: the count stays as the inner keeps it,
    ``nu`` is held as codes (unsigned) and scales only, a leaf without a gradient keeps its stored
    value, and the outputs equal the inner update on the decoded state."""
    params = params_of(3, 520, 1)
    inner = square_ema()
    tx = stored(inner, bits, SQUARE_STORAGE)
    storage = Q.Storage(bits, Q.UNSIGNED)
    state = tx.init(params)
    assert (
        type(state) is QuantizedSquareState
        and state.nu["w"] is None
        and state.nu["b"].dtype == torch.float32
    )
    assert state.nu_codes["w"].dtype == Q.CODE_DTYPES[bits] and state.nu_codes["b"] is None
    for t in range(3):
        g = grads_of(params, t)
        if t == 2:
            g["w"] = None
        before = state
        decoded = {
            k: None
            if g[k] is None
            else (
                before.nu[k]
                if before.nu[k] is not None
                else Q.decode(
                    before.nu_codes[k], before.nu_scales[k], tuple(params[k].shape), storage
                )
            )
            for k in params
        }
        out, state = tx.update(g, state, params)
        want, new = inner.update(g, SquareState(before.count, decoded), params)
        for k in params:
            assert (out[k] is None and want[k] is None) or torch.equal(out[k], want[k]), k
        assert int(state.count) == t + 1
    assert (
        torch.equal(state.nu_codes["w"], before.nu_codes["w"])
        and state.nu_scales["w"] is before.nu_scales["w"]
    )
    codes, scales = Q.encode(new.nu["conv"], storage)
    assert torch.equal(state.nu_codes["conv"], codes) and torch.equal(
        state.nu_scales["conv"], scales
    )
    assert _base.info(tx) == _base.info(inner) and stored(inner, 32, SQUARE_STORAGE) is inner
    assert repr(tx).startswith("stored(inner=") and f"state_bits={bits}" in repr(tx)


def test_custom_transform_in_an_optimizer_state_dict():
    """The wrapped custom transform's state in a torch state dict: the inner keys with
    ``_codes`` and ``_scales`` where a matrix is quantized, nothing in full precision."""
    w, b = torch.nn.Parameter(torch.randn(6, 40)), torch.nn.Parameter(torch.randn(6))
    opt = mf.Optimizer(
        [w, b],
        lambda group: mf.chain(
            stored(square_ema(), 8, SQUARE_STORAGE), mf.scale_by_learning_rate(0.1)
        ),
        compile=False,
    )
    (w.sum() + b.square().sum()).backward()
    opt.step()
    assert sorted(opt.state[w]) == ["square_avg_codes", "square_avg_scales", "square_count"]
    assert sorted(opt.state[b]) == ["square_avg", "square_count"]
    assert opt.state[w]["square_avg_codes"].dtype == torch.int8


def test_one_graph_no_breaks():
    """Decode, inner update and encode trace as one graph with no graph break."""
    params = params_of(4, 300, 2)
    tx = mf.chain(stored(square_ema(), 8, SQUARE_STORAGE), mf.momentum(state_bits=4))
    state = tx.init(params)
    counter = torch._dynamo.testing.CompileCounterWithBackend("eager")
    update = torch.compile(tx.update, backend=counter, fullgraph=True)
    for t in range(3):
        out, state = update(grads_of(params, t), state, params)
    assert counter.frame_count == 1
    eager_state = tx.init(params)
    for t in range(3):
        want, eager_state = tx.update(grads_of(params, t), eager_state, params)
    assert all(torch.equal(out[k], want[k]) for k in params)


def test_layout_checked():
    """A layout whose quantized class does not hold the stored fields' codes and scales, or that
    names an unknown field or format, is refused at construction."""
    for layout in (
        Layout(SquareState, SquareState, {"nu": Q.UNSIGNED}),
        Layout(SquareState, QuantizedSquareState, {"mu": Q.UNSIGNED}),
        Layout(SquareState, QuantizedSquareState, {"nu": "log"}),
    ):
        with pytest.raises(ValueError, match=r"stored\(\): .* does not store SquareState's fields"):
            stored(square_ema(), 8, layout)
