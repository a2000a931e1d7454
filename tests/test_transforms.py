"""Elementwise and Muon transforms against formulas written out by hand, torch.optim.AdamW and
newton_schulz; generic properties (empty trees, None leaves, state stability) over one table of
every transform.

The device lane (``device`` fixture, tests/conftest.py) runs the tests that take ``device`` on the
CPU and, where a GPU is present, on CUDA, inputs drawn on the CPU and moved (every device sees the
same values), references compared after ``.cpu()`` where they are computed there. Elementwise
arithmetic rounds correctly on both devices, so its tolerances hold everywhere (only a fused
``addcmul`` against a multiply and an add, or a reduction order, differs: one rounding). ``TOL``
holds what differs: the transforms' Newton–Schulz results against ``newton_schulz`` run leaf by
leaf, whose fp32 GEMMs a GPU reduces in another order for a stacked batch than for one matrix (TF32
stays off, torch's default) and whose first iterations amplify that rounding near σ = 0 (slope
≈ 3.4 per quintic step): 5x the CPU bound, as in test_orthogonalize.py.
"""

from __future__ import annotations

import math

import optree
import pytest
import torch
from conftest import lane_examples
from hypothesis import given
from hypothesis import strategies as st

import muon_fn as mf
from muon_fn.core import tree as _tree
from muon_fn.core.newton_schulz import newton_schulz

TOL = {
    "cpu": {"ns": 2e-5},
    "cuda": {"ns": 1e-4},
}  # max-abs of fp32 Newton–Schulz results (module docstring)


# --------------------------------------------------------------------------------------------
# One table of every transform: (factory, accepts 0-/1-D leaves).

TRANSFORMS_UNDER_TEST = {
    "momentum_sgd": (lambda: mf.momentum(0.9, nesterov=True), True),
    "momentum_ema": (lambda: mf.momentum(0.9, nesterov=False, kind="ema"), True),
    "momentum_bf16_mu": (lambda: mf.momentum(0.9, mu_dtype=torch.float32), True),
    "orthogonalize": (lambda: mf.orthogonalize(dtype=torch.float32), False),
    "orthogonalize_heads": (
        lambda: mf.orthogonalize(
            "you",
            dtype=torch.float32,
            view=lambda x: mf.heads(rows=(2, 2)) if x.shape[0] == 4 else "flatten",
        ),
        False,
    ),
    "scale_by_shape": (lambda: mf.scale_by_shape("spectral"), False),
    "add_decoupled_weight_decay": (lambda: mf.add_decoupled_weight_decay(0.1), True),
    "scale_by_learning_rate": (lambda: mf.scale_by_learning_rate(0.1), True),
    "scale_by_learning_rate_tensor": (lambda: mf.scale_by_learning_rate(torch.tensor(0.1)), True),
    "scale_by_learning_rate_schedule": (
        lambda: mf.scale_by_learning_rate(lambda c: 0.1 / (1 + c)),
        True,
    ),
    "scale_by_adam": (lambda: mf.scale_by_adam(), True),
    "normalize_rows": (lambda: mf.normalize_rows(0.95), False),
    "normalize_layerwise": (lambda: mf.normalize_layerwise(), True),
    "scale_by_adam_nesterov_no_bias_correction": (
        lambda: mf.scale_by_adam(nesterov=True, bias_correction=False),
        True,
    ),
    "identity": (lambda: mf.identity(), True),
    "muon": (lambda: mf.muon(ns_dtype=torch.float32, weight_decay=0.1), False),
    "normuon": (lambda: mf.normuon(ns_dtype=torch.float32), False),
    "adamw": (lambda: mf.adamw(weight_decay=0.1), True),
    "triton_muon": (
        lambda: mf.triton_muon(weight_decay=0.1, nesterov=True, layerwise_norm=True),
        True,
    ),
    "triton_muon_decoupled": (lambda: mf.triton_muon(weight_decay=0.1, decoupled=True), True),
    "hybrid": (lambda: mf.hybrid(ns_dtype=torch.float32), True),
    "chain_empty": (lambda: mf.chain(), True),
}
tx_names = pytest.mark.parametrize("name", list(TRANSFORMS_UNDER_TEST))

EMPTY_TREES = [{}, (), [None], (None,), [], {"a": (), "b": {"c": []}, "d": None}, {"a": [None, {}]}]


def build(name, device):
    """The table's transform and whether it accepts vectors; a tensor hyperparameter it makes
    (the 0-d learning rate) is created on ``device``."""
    factory, vectors_ok = TRANSFORMS_UNDER_TEST[name]
    with device:
        return factory(), vectors_ok


def structure(tree):
    return _tree.tree_structure(tree)


def describe(tree):
    """Structure plus (shape, dtype, device) of every tensor leaf."""
    return structure(tree), [
        None
        if x is None
        else (tuple(x.shape), x.dtype, x.device)
        if isinstance(x, torch.Tensor)
        else x
        for x in _tree.tree_leaves(tree)
    ]


def sample_tree(seed=0, vectors=True, dtype=torch.float32, device="cpu"):
    """Drawn on the CPU (the same values for every device), then moved to ``device``."""
    g = torch.Generator().manual_seed(seed)
    t = {
        "w": torch.randn(4, 6, generator=g).to(device, dtype),
        "blocks": [
            torch.randn(6, 4, generator=g).to(device, dtype),
            torch.randn(4, 6, generator=g).to(device, dtype),
        ],
        "conv": torch.randn(4, 2, 3, 3, generator=g).to(device, dtype),
    }
    if vectors:
        t["b"] = torch.randn(6, generator=g).to(device, dtype)
    return t


@tx_names
@pytest.mark.parametrize("tree", EMPTY_TREES, ids=repr)
def test_empty_trees(name, tree):
    tx = TRANSFORMS_UNDER_TEST[name][0]()
    state = tx.init(tree)
    updates, new_state = tx.update(tree, state, tree)
    assert structure(updates) == structure(tree)
    assert describe(new_state) == describe(state)
    updates, _ = tx.update(tree, new_state, tree)  # and again from the new state
    assert structure(updates) == structure(tree)


@tx_names
def test_none_gradient_leaves(device, name):
    """A missing gradient gives a None update and leaves that leaf's state untouched."""
    tx, vectors_ok = build(name, device)
    params = sample_tree(vectors=vectors_ok, device=device)
    state = tx.init(params)
    grads = sample_tree(1, vectors=vectors_ok, device=device)
    _, state = tx.update(grads, state, params)  # make the state non-trivial first
    grads = sample_tree(2, vectors=vectors_ok, device=device)
    grads["blocks"][1] = None
    grads["conv"] = None
    updates, new_state = tx.update(grads, state, params)
    assert updates["blocks"][1] is None and updates["conv"] is None
    assert updates["w"] is not None and updates["w"].shape == params["w"].shape
    # The state leaves that belong to the missing gradients are unchanged.
    paths, old_leaves, _ = _tree.tree_flatten_with_path(state)
    _, new_leaves, _ = _tree.tree_flatten_with_path(new_state)
    for path, old, new in zip(paths, old_leaves, new_leaves):
        missing = "conv" in path or any(path[i : i + 2] == ("blocks", 1) for i in range(len(path)))
        if missing and isinstance(old, torch.Tensor):
            assert torch.equal(old, new), path


@tx_names
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_update_and_state_structure_dtype_stable(device, name, dtype):
    tx, vectors_ok = build(name, device)
    params = sample_tree(vectors=vectors_ok, dtype=dtype, device=device)
    state = tx.init(params)
    before = describe(state)
    for step in range(3):
        grads = sample_tree(10 + step, vectors=vectors_ok, dtype=dtype, device=device)
        updates, state = tx.update(grads, state, params)
        if (
            name == "momentum_bf16_mu"
        ):  # an fp32 buffer returns fp32 updates (apply_updates casts back)
            assert structure(updates) == structure(grads)
        else:
            assert describe(updates) == describe(
                grads
            )  # same structure, shapes, dtypes and devices
        assert (
            describe(state) == before
        )  # no drift: no recompiles, no dtype promotion, no device move
        for leaf in _tree.tree_leaves(updates):
            assert torch.isfinite(leaf.float()).all()
        params = mf.apply_updates(params, updates)
    assert describe(params) == describe(sample_tree(vectors=vectors_ok, dtype=dtype, device=device))


@tx_names
def test_update_does_not_mutate_inputs(device, name):
    tx, vectors_ok = build(name, device)
    params = sample_tree(vectors=vectors_ok, device=device)
    state = tx.init(params)
    _, state = tx.update(sample_tree(1, vectors=vectors_ok, device=device), state, params)
    grads = sample_tree(2, vectors=vectors_ok, device=device)
    copies = [optree.tree_map(lambda t: t.clone(), x) for x in (grads, state, params)]
    tx.update(grads, state, params)
    for original, copy in zip((grads, state, params), copies):
        for a, b in zip(_tree.tree_leaves(original), _tree.tree_leaves(copy)):
            assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize(
    "name", [n for n, (_, vectors_ok) in TRANSFORMS_UNDER_TEST.items() if not vectors_ok]
)
@pytest.mark.parametrize("shape", [(), (5,)], ids=["0-d", "1-d"])
def test_matrix_transforms_reject_vectors(name, shape):
    tx = TRANSFORMS_UNDER_TEST[name][0]()
    with pytest.raises(ValueError, match=r"ndim >= 2"):
        params = {"w": torch.randn(4, 4), "b": torch.randn(shape)}
        tx.update(params, tx.init(params), params)


# --------------------------------------------------------------------------------------------
# Momentum.


def grads_sequence(seed, steps, shape=(6, 10), device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=torch.float64).to(device) for _ in range(steps)]


@pytest.mark.parametrize("kind", ["sgd", "ema"])
@pytest.mark.parametrize("nesterov", [True, False])
@lane_examples
@given(mu=st.floats(0.0, 0.99), steps=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_momentum_formulas(device, kind, nesterov, mu, steps, seed):
    tx = mf.momentum(mu, nesterov=nesterov, kind=kind)
    gs = grads_sequence(seed, steps, device=device)
    state = tx.init({"w": gs[0]})
    b = torch.zeros_like(gs[0])
    for g in gs:
        (out, state) = tx.update({"w": g}, state)
        if kind == "sgd":  # b = μb + g; Nesterov g + μb
            b = mu * b + g
            want = g + mu * b if nesterov else b
        else:  # b = μb + (1−μ)g; Nesterov (1−μ)g + μb
            b = mu * b + (1 - mu) * g
            want = (1 - mu) * g + mu * b if nesterov else b
        torch.testing.assert_close(out["w"], want, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(state.mu["w"], b, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("nesterov", [True, False])
@lane_examples
@given(
    mu=st.floats(0.0, 0.99),
    steps=st.integers(1, 6),
    seed=st.integers(0, 2**16),
    method=st.sampled_from(["polar_express", "quintic", "you", "cubic"]),
)
def test_momentum_ema_and_sgd_agree_after_orthogonalization(
    device, nesterov, mu, steps, seed, method
):
    """Equal up to (1−μ) before msign (a positive scalar), hence equal after it."""
    gs = [g.float() for g in grads_sequence(seed, steps, device=device)]
    mom = {k: mf.momentum(mu, nesterov=nesterov, kind=k) for k in ("sgd", "ema")}
    orth = mf.orthogonalize(method, dtype=torch.float32)
    states = {k: tx.init({"w": gs[0]}) for k, tx in mom.items()}
    for g in gs:
        pre = {}
        for k, tx in mom.items():
            pre[k], states[k] = tx.update({"w": g}, states[k])
        torch.testing.assert_close(
            pre["ema"]["w"], (1 - mu) * pre["sgd"]["w"], atol=1e-6, rtol=1e-5
        )
        post = {k: orth.update(pre[k], ())[0]["w"] for k in mom}
        torch.testing.assert_close(post["ema"], post["sgd"], atol=TOL[device.type]["ns"], rtol=0)


def test_momentum_ema_and_sgd_differ_under_a_schedule(device):
    """With μ changing in place (a 0-d tensor), the two forms weight the past differently (notes §4)."""
    mu = torch.tensor(0.5, device=device)
    gs = [g.float() for g in grads_sequence(3, 6, device=device)]
    mom = {k: mf.momentum(mu, nesterov=True, kind=k) for k in ("sgd", "ema")}
    orth = mf.orthogonalize("polar_express", dtype=torch.float32)
    states = {k: tx.init({"w": gs[0]}) for k, tx in mom.items()}
    diff = 0.0
    for i, g in enumerate(gs):
        mu.fill_(0.5 + 0.09 * i)
        post = {}
        for k, tx in mom.items():
            u, states[k] = tx.update({"w": g}, states[k])
            post[k] = orth.update(u, ())[0]["w"]
        diff = max(diff, (post["ema"] - post["sgd"]).abs().max().item())
    assert diff > 1e-2


@pytest.mark.parametrize("mu", [0.9, torch.tensor(0.9)])
def test_momentum_off_cpu_takes_a_cpu_scalar(mu):
    """Off CPU the heavy-ball step takes the multiply-and-add form, which accepts a CPU 0-d μ next
    to device tensors (run here on meta tensors: shapes and devices only; no GPU to run it on); on
    CPU the fused form agrees with it to one rounding."""
    from muon_fn.core.transforms import scaled_add

    g, b = torch.randn(4, 6), torch.randn(4, 6)
    meta = scaled_add(g.to("meta"), b.to("meta"), mu)
    assert meta.device.type == "meta" and meta.shape == (4, 6)
    tx = mf.momentum(mu)
    updates, state = tx.update((g.to("meta"),), tx.init((b.to("meta"),)))
    assert updates[0].device.type == "meta" and state.mu[0].device.type == "meta"
    torch.testing.assert_close(scaled_add(g, b, mu), b * mu + g, rtol=1e-6, atol=1e-6)
    # bf16 buffers keep the multiply and add (addcmul would compute with μ rounded to bf16)
    g16, b16 = g.bfloat16(), b.bfloat16()
    assert torch.equal(scaled_add(g16, b16, 0.9), b16 * 0.9 + g16)


def test_momentum_mu_dtype(device):
    tx = mf.momentum(0.9, mu_dtype=torch.float32)
    p = {"w": torch.randn(3, 4, dtype=torch.bfloat16).to(device)}
    state = tx.init(p)
    assert state.mu["w"].dtype == torch.float32 and state.mu["w"].device == p["w"].device
    u, state = tx.update(p, state)
    assert u["w"].dtype == torch.float32 and state.mu["w"].dtype == torch.float32


# --------------------------------------------------------------------------------------------
# scale_by_shape.

SHAPE_CASES = {
    # shape: (out, in) as the rule sees it
    (3072, 768): (3072, 768),
    (768, 3072): (768, 3072),
    (64, 32, 3, 3): (64, 32 * 3 * 3),
}
RULES = {
    "keller": lambda o, i: math.sqrt(max(1.0, o / i)),
    "original": lambda o, i: math.sqrt(max(1.0, o / i)),
    "match_rms_adamw": lambda o, i: 0.2 * math.sqrt(max(o, i)),
    "spectral": lambda o, i: math.sqrt(o / i),
    "legacy": lambda o, i: math.sqrt(max(o, i)),
    "none": lambda o, i: 1.0,
}
# The same values typed from docs/algorithms.md's scale-rule table, as a second independent source.
TABLE = {
    ((3072, 768), "keller"): 2.0,
    ((768, 3072), "keller"): 1.0,
    ((64, 32, 3, 3), "keller"): 1.0,
    ((3072, 768), "match_rms_adamw"): 11.0851,
    ((768, 3072), "match_rms_adamw"): 11.0851,
    ((64, 32, 3, 3), "match_rms_adamw"): 3.3941,
    ((3072, 768), "spectral"): 2.0,
    ((768, 3072), "spectral"): 0.5,
    ((64, 32, 3, 3), "spectral"): 0.4714,
    ((3072, 768), "legacy"): 55.4256,
    ((768, 3072), "legacy"): 55.4256,
    ((64, 32, 3, 3), "legacy"): 16.9706,
}


@pytest.mark.parametrize("shape", list(SHAPE_CASES), ids=str)
@pytest.mark.parametrize("rule", list(RULES))
def test_scale_by_shape_values(device, shape, rule):
    out, inp = SHAPE_CASES[shape]
    want = RULES[rule](out, inp)
    if (shape, rule) in TABLE:
        assert want == pytest.approx(TABLE[(shape, rule)], abs=1e-4)
    assert mf.shape_scale(rule, shape) == pytest.approx(want, rel=1e-12)
    u = torch.randn(shape).to(device)
    scaled, _ = mf.scale_by_shape(rule).update({"w": u}, ())
    assert scaled["w"].shape == u.shape
    torch.testing.assert_close(scaled["w"], u * want, rtol=1e-6, atol=0)


def test_scale_by_shape_heads_scales_each_block(device):
    u = torch.ones(96 + 32, 32, device=device)  # e.g. a fused (q: 96, k: 32) projection
    scaled, _ = mf.scale_by_shape("spectral", view=mf.heads(rows=(96, 32))).update({"w": u}, ())
    torch.testing.assert_close(scaled["w"][:96].cpu(), torch.full((96, 32), math.sqrt(96 / 32)))
    torch.testing.assert_close(scaled["w"][96:].cpu(), torch.full((32, 32), 1.0))
    whole, _ = mf.scale_by_shape("spectral").update({"w": u}, ())
    torch.testing.assert_close(whole["w"].cpu(), torch.full((128, 32), math.sqrt(128 / 32)))


# --------------------------------------------------------------------------------------------
# orthogonalize (the transform around newton_schulz).


def test_orthogonalize_leaves_match_newton_schulz(device):
    g = torch.Generator().manual_seed(0)
    tree = {
        "a": torch.randn(8, 12, generator=g),
        "b": torch.randn(12, 8, generator=g),  # tall: batched with "a" after transposing
        "c": torch.randn(8, 12, generator=g),
        "conv": torch.randn(8, 3, 2, 2, generator=g),
        "d": torch.randn(5, 7, generator=g, dtype=torch.float64).float(),
    }
    tree = {k: x.to(device) for k, x in tree.items()}
    for batch in (True, False):
        out, _ = mf.orthogonalize("you", 5, dtype=torch.float32, batch=batch).update(tree, ())
        for k, x in tree.items():
            want = newton_schulz(x.reshape(x.shape[0], -1), "you", 5, dtype=torch.float32).reshape(
                x.shape
            )
            torch.testing.assert_close(out[k], want, atol=TOL[device.type]["ns"], rtol=0)
            assert out[k].dtype == x.dtype


def test_orthogonalize_flatten_false_treats_leading_dims_as_batch(device):
    x = torch.randn(3, 6, 10).to(device)
    out, _ = mf.orthogonalize("quintic", dtype=torch.float32, flatten=False).update([x], ())
    for i in range(3):
        torch.testing.assert_close(
            out[0][i],
            newton_schulz(x[i], "quintic", dtype=torch.float32),
            atol=TOL[device.type]["ns"],
            rtol=0,
        )


def test_orthogonalize_head_blocks(device):
    x = torch.randn(3 * 16, 16).to(device)  # fused QKV
    out, _ = mf.orthogonalize("polar_express", dtype=torch.float32, view=mf.heads(rows=3)).update(
        {"qkv": x}, ()
    )
    for i in range(3):
        block = x[16 * i : 16 * (i + 1)]
        torch.testing.assert_close(
            out["qkv"][16 * i : 16 * (i + 1)],
            newton_schulz(block, "polar_express", dtype=torch.float32),
            atol=TOL[device.type]["ns"],
            rtol=0,
        )


def test_orthogonalize_callable_method_and_zero(device):
    seen = []

    def msign(x):
        seen.append(tuple(x.shape))
        u, _, vh = torch.linalg.svd(x, full_matrices=False)
        return u @ vh

    tree = {"a": torch.randn(4, 6), "b": torch.randn(4, 6), "z": torch.zeros(3, 5)}
    tree = {k: x.to(device) for k, x in tree.items()}
    out, _ = mf.orthogonalize(msign).update(tree, ())
    assert (2, 4, 6) in seen  # same-shape leaves are stacked into one call
    o = out["a"].double().cpu()
    torch.testing.assert_close(o @ o.T, torch.eye(4, dtype=torch.float64), atol=1e-5, rtol=0)
    out, _ = mf.orthogonalize().update(tree, ())  # default method and bf16 compute
    assert torch.equal(out["z"].cpu(), torch.zeros(3, 5))
    assert out["a"].dtype == torch.float32


# --------------------------------------------------------------------------------------------
# Learning rate, weight decay, apply_updates.


@lane_examples
@given(lr=st.floats(0.0, 1.0), wd=st.floats(0.0, 0.5), seed=st.integers(0, 2**16))
def test_weight_decay_and_lr_formulas(device, lr, wd, seed):
    g = torch.Generator().manual_seed(seed)

    def draw():
        return {
            "w": torch.randn(3, 4, generator=g, dtype=torch.float64).to(device),
            "b": torch.randn(4, generator=g, dtype=torch.float64).to(device),
        }

    p, u = draw(), draw()
    tx = mf.chain(mf.add_decoupled_weight_decay(wd), mf.scale_by_learning_rate(lr))
    out, _ = tx.update(u, tx.init(p), p)
    new = mf.apply_updates(p, out)
    for k in p:
        torch.testing.assert_close(out[k], -lr * (u[k] + wd * p[k]))
        torch.testing.assert_close(new[k], p[k] * (1 - lr * wd) - lr * u[k])


def test_learning_rate_tensor_is_read_at_update_time(device):
    lr = torch.tensor(0.1, device=device)
    tx = mf.scale_by_learning_rate(lr)
    u = {"w": torch.ones(2, 2, device=device)}
    assert torch.equal(tx.update(u, ())[0]["w"].cpu(), torch.full((2, 2), -0.1))
    lr.fill_(0.25)
    assert torch.equal(tx.update(u, ())[0]["w"].cpu(), torch.full((2, 2), -0.25))


def test_learning_rate_schedule_sees_the_step_count(device):
    seen = []

    def schedule(count):
        seen.append(int(count))
        return 0.1 * (count + 1)

    tx = mf.scale_by_learning_rate(schedule)
    u = {"w": torch.ones(2, device=device)}
    state = tx.init(u)
    outs = []
    for _ in range(4):
        out, state = tx.update(u, state)
        outs.append(out["w"][0].item())
    assert seen == [0, 1, 2, 3]
    assert outs == pytest.approx([-0.1, -0.2, -0.3, -0.4])
    assert state.count.dtype == torch.int64 and state.count.shape == ()


def test_weight_decay_needs_params():
    tx = mf.add_decoupled_weight_decay(0.1)
    with pytest.raises(ValueError, match="needs params"):
        tx.update({"w": torch.ones(2)}, ())


def test_weight_decay_tensor(device):
    wd = torch.tensor(0.1, device=device)
    tx = mf.add_decoupled_weight_decay(wd)
    p, u = {"w": torch.ones(2, device=device)}, {"w": torch.zeros(2, device=device)}
    torch.testing.assert_close(tx.update(u, (), p)[0]["w"].cpu(), torch.full((2,), 0.1))
    wd.fill_(0.3)
    torch.testing.assert_close(tx.update(u, (), p)[0]["w"].cpu(), torch.full((2,), 0.3))


def test_weight_decay_min_ndim_skips_smaller_leaves(device):
    """min_ndim=2: matrices and a conv kernel decay, a bias, a gain and a scalar do not."""
    tx = mf.add_decoupled_weight_decay(0.1, min_ndim=2)
    shapes = {"w": (2, 3), "k": (2, 1, 3, 3), "b": (3,), "s": ()}
    p = {k: torch.ones(s, device=device) for k, s in shapes.items()}
    u = {k: torch.zeros_like(v) for k, v in p.items()}
    out = {k: v.cpu() for k, v in tx.update(u, (), p)[0].items()}
    assert torch.equal(out["w"], torch.full((2, 3), 0.1)) and torch.equal(
        out["k"], torch.full((2, 1, 3, 3), 0.1)
    )
    assert torch.equal(out["b"], torch.zeros(3)) and torch.equal(out["s"], torch.zeros(()))
    assert mf.info(tx).leafwise
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="Invalid min_ndim"):
            mf.add_decoupled_weight_decay(0.1, min_ndim=bad)


def test_adamw_decay_1d_false_equals_torch_adamw_with_a_no_decay_group(device):
    """mf.adamw(decay_1d=False) on {matrix, bias} = torch.optim.AdamW with the bias in a wd-0 group."""
    torch.manual_seed(0)
    w, b = torch.randn(4, 3).to(device), torch.randn(3).to(device)
    ref = [w.clone().requires_grad_(), b.clone().requires_grad_()]
    opt = torch.optim.AdamW(
        [{"params": [ref[0]]}, {"params": [ref[1]], "weight_decay": 0.0}], lr=0.1, weight_decay=0.5
    )
    tx = mf.adamw(0.1, weight_decay=0.5, decay_1d=False)
    tree = {"w": w.clone(), "b": b.clone()}
    state = tx.init(tree)
    for _ in range(5):
        g = {"w": torch.randn(4, 3).to(device), "b": torch.randn(3).to(device)}
        ref[0].grad, ref[1].grad = g["w"].clone(), g["b"].clone()
        opt.step()
        updates, state = tx.update(g, state, tree)
        tree = mf.apply_updates(tree, updates)
    # fp32 rounding order only (measured 3.0e-6 after 5 steps of lr 0.1)
    torch.testing.assert_close(tree["w"], ref[0].detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(tree["b"], ref[1].detach(), atol=1e-5, rtol=0)


def test_apply_updates(device):
    p = {
        "a": torch.ones(2, dtype=torch.bfloat16, device=device),
        "b": torch.ones(3, device=device),
        "c": torch.ones(1, device=device),
    }
    u = {"a": torch.full((2,), 0.5, device=device), "b": None, "c": -torch.ones(1, device=device)}
    new = mf.apply_updates(p, u)
    assert new["a"].dtype == torch.bfloat16 and torch.equal(
        new["a"].cpu(), torch.full((2,), 1.5, dtype=torch.bfloat16)
    )
    assert new["b"] is p["b"]
    assert torch.equal(new["c"].cpu(), torch.zeros(1))
    assert torch.equal(p["c"].cpu(), torch.ones(1))  # out of place


# --------------------------------------------------------------------------------------------
# scale_by_adam / adamw against torch.optim.AdamW.


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.8, 0.95)])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("eps", [1e-8, 1e-3])
def test_adamw_matches_torch(device, betas, weight_decay, eps):
    g = torch.Generator().manual_seed(0)
    shapes = {"w": (5, 7), "b": (7,), "s": ()}
    params = {k: torch.randn(s, generator=g).to(device) for k, s in shapes.items()}
    grads = [
        {k: torch.randn(s, generator=g).to(device) for k, s in shapes.items()} for _ in range(8)
    ]
    lr = 0.01

    torch_params = {k: v.clone() for k, v in params.items()}
    opt = torch.optim.AdamW(
        list(torch_params.values()), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay
    )
    tx = mf.adamw(lr, betas, eps, weight_decay)
    by_hand = mf.chain(
        mf.scale_by_adam(betas, eps),
        mf.add_decoupled_weight_decay(weight_decay),
        mf.scale_by_learning_rate(lr),
    )
    ours, state = dict(params), tx.init(params)
    ours2, state2 = dict(params), by_hand.init(params)
    for gr in grads:
        for k, p in torch_params.items():
            p.grad = gr[k].clone()
        opt.step()
        u, state = tx.update(gr, state, ours)
        ours = mf.apply_updates(ours, u)
        u2, state2 = by_hand.update(gr, state2, ours2)
        ours2 = mf.apply_updates(ours2, u2)
    for k, p in torch_params.items():
        torch.testing.assert_close(ours[k], p, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(ours2[k], ours[k], atol=0, rtol=0)
        st_t = opt.state[p]
        adam_state = state[0]
        torch.testing.assert_close(adam_state.mu[k], st_t["exp_avg"], atol=1e-7, rtol=1e-6)
        torch.testing.assert_close(adam_state.nu[k], st_t["exp_avg_sq"], atol=1e-7, rtol=1e-6)
        assert float(adam_state.count[k]) == float(st_t["step"]) == len(grads)


def test_adam_count_is_per_leaf_for_missing_grads(device):
    tx = mf.scale_by_adam()
    p = {k: torch.ones(3, device=device) for k in "ab"}
    ones = torch.ones(3, device=device)
    state = tx.init(p)
    _, state = tx.update({"a": ones, "b": None}, state)
    _, state = tx.update({"a": ones, "b": ones}, state)
    assert float(state.count["a"]) == 2 and float(state.count["b"]) == 1
    # "b" at its first step gets the fully bias-corrected first step: m̂/(√v̂+eps) = g/|g| = 1.
    out, _ = mf.scale_by_adam().update({"b": 2 * ones}, mf.scale_by_adam().init({"b": p["b"]}))
    torch.testing.assert_close(
        out["b"].cpu(), torch.ones(3), atol=2e-5, rtol=0
    )  # fp32 rounding of 1 − β₂


# --------------------------------------------------------------------------------------------
# normalize_rows (NorMuon, notes §2 — microsoft/dion's normalization).


def normuon_reference(us, beta2, eps):
    """notes §2: n0=‖U‖_F; r=mean(U², row); V←lerp(V,r,1−β₂); Û=U/(√V+eps); Û←Û·n0/max(‖Û‖_F,1e-8)."""
    v = torch.zeros(us[0].shape[0], dtype=torch.float64)
    outs = []
    for u in us:
        u = u.double().reshape(u.shape[0], -1)
        n0 = torch.linalg.matrix_norm(u)
        r = (u * u).mean(dim=1)
        v = v + (1 - beta2) * (r - v)
        uh = u / (v.sqrt()[:, None] + eps)
        uh = uh * n0 / torch.clamp(torch.linalg.matrix_norm(uh), min=1e-8)
        outs.append(uh)
    return outs, v


@pytest.mark.parametrize("shape", [(6, 10), (10, 6), (4, 2, 3, 3)], ids=str)
@lane_examples
@given(beta2=st.floats(0.0, 0.99), seed=st.integers(0, 2**16), row_scale=st.floats(0.01, 100.0))
def test_normalize_rows_matches_notes(device, shape, beta2, seed, row_scale):
    g = torch.Generator().manual_seed(seed)
    # rows of very different sizes, which the normalization evens out
    scales = torch.logspace(0, math.log10(row_scale), shape[0]).reshape(-1, *[1] * (len(shape) - 1))
    us = [torch.randn(shape, generator=g) * scales for _ in range(4)]
    tx = mf.normalize_rows(beta2, 1e-8)
    state = tx.init({"w": us[0].to(device)})
    assert state.nu["w"].shape == (shape[0],) + (1,) * (len(shape) - 1)
    want, v = normuon_reference(us, beta2, 1e-8)
    for u, w in zip(us, want):
        out, state = tx.update({"w": u.to(device)}, state)
        o = out["w"].cpu()
        assert o.shape == u.shape
        torch.testing.assert_close(o.double().reshape(w.shape), w, atol=1e-5, rtol=1e-5)
        # Frobenius norm is kept.
        torch.testing.assert_close(
            torch.linalg.vector_norm(o), torch.linalg.vector_norm(u), rtol=1e-5, atol=0
        )
    torch.testing.assert_close(state.nu["w"].double().cpu().reshape(-1), v, rtol=1e-5, atol=1e-12)


def test_normalize_rows_zero_update_is_zero(device):
    tx = mf.normalize_rows()
    zero = torch.zeros(3, 4, device=device)
    out, state = tx.update({"w": zero}, tx.init({"w": zero}))
    assert torch.equal(out["w"].cpu(), torch.zeros(3, 4))


def test_zero_size_matrix_through_muon(device):
    p = {"w": torch.zeros(0, 5, device=device), "v": torch.randn(4, 5).to(device)}
    tx = mf.muon(ns_dtype=torch.float32)
    updates, _ = tx.update(p, tx.init(p), p)
    assert updates["w"].shape == (0, 5)
    assert updates["v"].shape == (4, 5) and bool(torch.isfinite(updates["v"]).all())


@pytest.mark.parametrize("make", [lambda: mf.momentum(nesterov=2), lambda: mf.muon(nesterov="yes")])
def test_a_non_boolean_nesterov_is_refused(make):
    # the functional boundary checks it as MuonOptimizer does (2 or "yes" would run as Nesterov)
    with pytest.raises(TypeError, match=r"^Invalid nesterov: .* \(expected True or False\)$"):
        make()
