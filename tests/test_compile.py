"""torch.compile contract (design.md §5): one graph, zero graph breaks, no recompile when the
learning rate changes (a 0-d tensor updated in place), compiled == eager.

Unit tests use ``backend="eager"`` (Dynamo tracing without code generation; fast). One test runs
inductor and is marked ``inductor``.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import muon_fn as mf


def tree(seed=0, with_vectors=False):
    g = torch.Generator().manual_seed(seed)
    t = {
        "attn": {"q": torch.randn(32, 32, generator=g), "k": torch.randn(32, 32, generator=g)},
        "mlp": {"up": torch.randn(64, 32, generator=g), "down": torch.randn(32, 64, generator=g)},
        "conv": torch.randn(8, 4, 3, 3, generator=g),
    }
    if with_vectors:
        t["norm"] = torch.randn(32, generator=g)
        t["bias"] = torch.randn(64, generator=g)
    return t


def grads_like(params, seed):
    g = torch.Generator().manual_seed(seed)
    return {k: grads_like(v, seed + 1) if isinstance(v, dict) else torch.randn(v.shape, generator=g)
            for k, v in params.items()}


def recipe(lr, **kw):
    kw = {"weight_decay": 0.01, "ns_dtype": torch.float32, **kw}
    return mf.muon(lr, 0.95, **kw)


def assert_trees_close(a, b, **tol):
    la, sa = mf._tree.tree_flatten(a)
    lb, sb = mf._tree.tree_flatten(b)
    assert sa == sb
    for x, y in zip(la, lb):
        if x is None or y is None:
            assert x is None and y is None
        else:
            torch.testing.assert_close(x, y, **tol)


def test_explain_zero_graph_breaks_muon_over_dict():
    lr = torch.tensor(0.02)
    tx = recipe(lr)
    params = tree()
    state = tx.init(params)
    explanation = torch._dynamo.explain(tx.update)(grads_like(params, 1), state, params)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_explain_zero_graph_breaks_hybrid_with_none_grad():
    lr, adamw_lr = torch.tensor(0.02), torch.tensor(1e-3)
    tx = mf.hybrid(lr, adamw_lr=adamw_lr, ns_dtype=torch.float32)
    params = tree(with_vectors=True)
    state = tx.init(params)
    grads = grads_like(params, 1)
    grads["bias"] = None  # a missing gradient
    explanation = torch._dynamo.explain(tx.update)(grads, state, params)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.parametrize("via", ["torch.compile", "compile_update"])
def test_one_compile_across_ten_learning_rates(via):
    lr = torch.tensor(0.02)
    tx = recipe(lr)
    counter = CompileCounterWithBackend("eager")
    if via == "compile_update":
        step = mf.compile_update(tx, backend=counter).update
    else:
        step = torch.compile(tx.update, backend=counter, fullgraph=True)
    params = tree()
    state_c = state_e = tx.init(params)
    params_c = params_e = params
    for i, value in enumerate([0.02, 0.01, 0.005, 0.03, 1e-3, 0.1, 0.07, 0.0, 0.2, 0.015]):
        lr.fill_(value)
        grads = grads_like(params, 10 + i)
        upd_c, state_c = step(grads, state_c, params_c)
        upd_e, state_e = tx.update(grads, state_e, params_e)
        # compiled == eager at every step: the lr is read at run time, not baked into the graph.
        assert_trees_close(upd_c, upd_e, atol=1e-6, rtol=1e-6)
        assert_trees_close(state_c, state_e, atol=1e-6, rtol=1e-6)
        params_c, params_e = mf.apply_updates(params_c, upd_c), mf.apply_updates(params_e, upd_e)
        if value == 0.0:  # lr = 0 (with decoupled decay scaled by lr): no movement at all
            assert all(torch.equal(u, torch.zeros_like(u)) for u in mf._tree.tree_leaves(upd_c))
    assert counter.frame_count == 1
    assert_trees_close(params_c, params_e, atol=1e-5, rtol=1e-5)


def test_schedule_lr_does_not_recompile():
    tx = recipe(lambda count: 0.02 * 0.9 ** count.to(torch.float32))
    counter = CompileCounterWithBackend("eager")
    step = mf.compile_update(tx, backend=counter).update
    params = tree()
    state_c = state_e = tx.init(params)
    for i in range(6):
        grads = grads_like(params, i)
        upd_c, state_c = step(grads, state_c, params)
        upd_e, state_e = tx.update(grads, state_e, params)
        assert_trees_close(upd_c, upd_e, atol=1e-6, rtol=1e-6)
    assert counter.frame_count == 1
    assert int(state_c[-1].count) == 6


@pytest.mark.parametrize(
    "make",
    [
        lambda lr: mf.adamw(lr, weight_decay=0.1),
        lambda lr: mf.normuon(lr, ns_dtype=torch.float32),
        lambda lr: mf.muon(lr, kind="ema", method="quintic", ns_dtype=torch.bfloat16),
        lambda lr: mf.muon(lr, method="you", split=[16, 16], ns_dtype=torch.float32),
    ],
    ids=["adamw", "normuon", "muon-ema-quintic-bf16", "muon-you-split"],
)
def test_compiled_equals_eager_other_recipes(make):
    lr = torch.tensor(0.01)
    tx = make(lr)
    counter = CompileCounterWithBackend("eager")
    step = mf.compile_update(tx, backend=counter).update
    params = tree()
    state_c = state_e = tx.init(params)
    for i, value in enumerate([0.01, 0.02, 0.005]):
        lr.fill_(value)
        grads = grads_like(params, i)
        upd_c, state_c = step(grads, state_c, params)
        upd_e, state_e = tx.update(grads, state_e, params)
        assert_trees_close(upd_c, upd_e, atol=1e-6, rtol=1e-5)
        assert_trees_close(state_c, state_e, atol=1e-6, rtol=1e-5)
    assert counter.frame_count == 1


def test_compile_update_keeps_init_and_repr():
    tx = recipe(torch.tensor(0.02))
    ctx = mf.compile_update(tx, backend="eager")
    assert ctx.init is tx.init
    assert repr(ctx) == f"compile_update({tx!r})"


@pytest.mark.inductor
def test_inductor_matches_eager():
    lr = torch.tensor(0.02)
    tx = mf.muon(lr, 0.95, weight_decay=0.01, ns_dtype=torch.float32, ns_steps=3)
    params = {"w": torch.randn(16, 24), "v": torch.randn(24, 16)}
    step = mf.compile_update(tx, backend="inductor").update
    state_c = state_e = tx.init(params)
    for i, value in enumerate([0.02, 0.01]):
        lr.fill_(value)
        grads = grads_like(params, i)
        upd_c, state_c = step(grads, state_c, params)
        upd_e, state_e = tx.update(grads, state_e, params)
        # Inductor fuses and reorders fp32 arithmetic: rounding-level differences, amplified by NS.
        assert_trees_close(upd_c, upd_e, atol=1e-5, rtol=1e-4)
        assert_trees_close(state_c, state_e, atol=1e-6, rtol=1e-5)
