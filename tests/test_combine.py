"""chain and partition against the same transforms applied by hand; docs/design.md §1's snippet."""

from __future__ import annotations

import pytest
import torch

import muon_fn as mf
from muon_fn.core import tree as _tree
from muon_fn.core.newton_schulz import default_compute_dtype


def rand_tree(seed, shapes):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


MATRICES = {"w1": (8, 12), "w2": (12, 8), "w3": (8, 12)}
MIXED = {"w1": (8, 12), "w2": (12, 8), "b1": (8,), "gain": ()}


def assert_same(a, b):
    la, sa = _tree.tree_flatten(a)
    lb, sb = _tree.tree_flatten(b)
    assert sa == sb
    for x, y in zip(la, lb):
        assert (x is None and y is None) or torch.equal(x, y)


def test_chain_equals_transforms_by_hand():
    parts = [
        mf.momentum(0.9, nesterov=True),
        mf.orthogonalize("quintic", dtype=torch.float32),
        mf.scale_by_shape("keller"),
        mf.add_decoupled_weight_decay(0.05),
        mf.scale_by_learning_rate(0.02),
    ]
    tx = mf.chain(*parts)
    params = rand_tree(0, MATRICES)
    state = tx.init(params)
    assert isinstance(state, tuple) and len(state) == len(parts)
    hand_states = [p.init(params) for p in parts]
    hand_params = params
    for step in range(3):
        grads = rand_tree(10 + step, MATRICES)
        updates, state = tx.update(grads, state, params)
        u = grads
        for i, part in enumerate(parts):
            u, hand_states[i] = part.update(u, hand_states[i], hand_params)
        assert_same(updates, u)
        assert_same(state, tuple(hand_states))
        params = mf.apply_updates(params, updates)
        hand_params = mf.apply_updates(hand_params, u)


def test_muon_recipe_is_the_documented_chain():
    kw = dict(nesterov=True, kind="ema", method="you", ns_steps=4, ns_dtype=torch.float32)
    recipe = mf.muon(0.03, 0.9, adjust_lr_fn="spectral", weight_decay=0.1, **kw)
    by_hand = mf.chain(
        mf.momentum(0.9, nesterov=True, kind="ema"),
        mf.orthogonalize("you", 4, dtype=torch.float32),
        mf.scale_by_shape("spectral"),
        mf.add_decoupled_weight_decay(0.1),
        mf.scale_by_learning_rate(0.03),
    )
    params = rand_tree(0, MATRICES)
    s1, s2 = recipe.init(params), by_hand.init(params)
    for step in range(3):
        grads = rand_tree(step + 1, MATRICES)
        u1, s1 = recipe.update(grads, s1, params)
        u2, s2 = by_hand.update(grads, s2, params)
        assert_same(u1, u2)


def test_empty_chain_is_identity():
    tx = mf.chain()
    g = rand_tree(0, MIXED)
    state = tx.init(g)
    assert state == ()
    out, state = tx.update(g, state)
    assert_same(out, g)


def test_chain_rejects_non_transforms():
    with pytest.raises(TypeError, match="chain\\(\\) argument 1 must be a GradientTransformation"):
        mf.chain(mf.identity(), lambda u: u)


def run(tx, params, steps=3, seed=100, shapes=MIXED, drop=None):
    state = tx.init(params)
    outs = []
    for step in range(steps):
        grads = rand_tree(seed + step, shapes)
        if drop:
            grads[drop] = None
        updates, state = tx.update(grads, state, params)
        outs.append(updates)
        params = mf.apply_updates(params, updates)
    return outs, params, state


def restrict(tree, keys):
    return {k: v for k, v in tree.items() if k in keys}


LABELS = {"w1": "muon", "w2": "muon", "b1": "adamw", "gain": "adamw"}


def partition_reference(steps=3):
    """Each transform run on its own sub-tree, as if the other leaves did not exist."""
    params = rand_tree(0, MIXED)
    muon = mf.muon(0.02, ns_dtype=torch.float32, weight_decay=0.1)
    adamw = mf.adamw(1e-3, weight_decay=0.01)
    mats, vecs = ["w1", "w2"], ["b1", "gain"]
    m_params, v_params = restrict(params, mats), restrict(params, vecs)
    m_state, v_state = muon.init(m_params), adamw.init(v_params)
    outs = []
    for step in range(steps):
        grads = rand_tree(100 + step, MIXED)
        mu, m_state = muon.update(restrict(grads, mats), m_state, m_params)
        vu, v_state = adamw.update(restrict(grads, vecs), v_state, v_params)
        outs.append({**mu, **vu})
        m_params, v_params = mf.apply_updates(m_params, mu), mf.apply_updates(v_params, vu)
    return outs


@pytest.mark.parametrize(
    "labels",
    [
        LABELS,
        lambda params: {k: "muon" if v.ndim >= 2 else "adamw" for k, v in params.items()},
        mf.matrix_labels,
    ],
    ids=["pytree", "lambda", "matrix_labels"],
)
def test_partition_routes_labels(labels):
    tx = mf.partition(
        {
            "muon": mf.muon(0.02, ns_dtype=torch.float32, weight_decay=0.1),
            "adamw": mf.adamw(1e-3, weight_decay=0.01),
        },
        labels,
    )
    outs, _, state = run(tx, rand_tree(0, MIXED))
    for got, want in zip(outs, partition_reference()):
        assert set(got) == set(want)
        for k in want:
            torch.testing.assert_close(got[k], want[k], atol=0, rtol=0)
    # Each inner state keeps the params' structure, the other label's leaves as None.
    assert state.inner_states["muon"][0].mu["b1"] is None
    assert state.inner_states["adamw"][0].mu["w1"] is None
    assert state.inner_states["adamw"][0].mu["b1"].shape == (8,)


@pytest.mark.parametrize("decay_1d", [False, True])
def test_hybrid_is_partition_of_muon_and_adamw(decay_1d):
    params = rand_tree(0, MIXED)
    h = mf.hybrid(
        0.02,
        adamw_lr=1e-3,
        adamw_betas=(0.9, 0.999),
        adamw_weight_decay=0.01,
        adamw_decay_1d=decay_1d,
        ns_dtype=torch.float32,
        weight_decay=0.1,
    )
    p = mf.partition(
        {
            "muon": mf.muon(0.02, ns_dtype=torch.float32, weight_decay=0.1),
            "adamw": mf.adamw(1e-3, (0.9, 0.999), 1e-8, 0.01, decay_1d=decay_1d),
        },
        LABELS,
    )
    for a, b in zip(run(h, params)[0], run(p, params)[0]):
        assert_same(a, b)


def test_partition_with_missing_gradient():
    tx = mf.partition(
        {"muon": mf.muon(0.02, ns_dtype=torch.float32), "adamw": mf.adamw(1e-3)}, LABELS
    )
    outs, _, state = run(tx, rand_tree(0, MIXED), drop="b1")
    assert all(o["b1"] is None for o in outs)
    assert torch.equal(state.inner_states["adamw"][0].mu["b1"], torch.zeros(8))
    assert float(state.inner_states["adamw"][0].count["b1"]) == 0


def test_partition_nested_and_in_chain():
    inner = mf.partition(
        {"a": mf.scale_by_learning_rate(1.0), "b": mf.scale_by_learning_rate(2.0)},
        {"w1": "a", "w2": "b", "b1": "a", "gain": "b"},
    )
    outer = mf.chain(
        mf.stateless(lambda u, p: _tree.tree_map(lambda x: 3 * x, u)),
        mf.partition(
            {"x": inner, "y": mf.identity()}, {"w1": "x", "w2": "x", "b1": "x", "gain": "y"}
        ),
    )
    g = rand_tree(1, MIXED)
    out, _ = outer.update(g, outer.init(g), g)
    torch.testing.assert_close(out["w1"], -3 * g["w1"])
    torch.testing.assert_close(out["w2"], -6 * g["w2"])
    torch.testing.assert_close(out["b1"], -3 * g["b1"])
    torch.testing.assert_close(out["gain"], 3 * g["gain"])


def test_partition_errors():
    with pytest.raises(ValueError, match="at least one transform"):
        mf.partition({}, {})
    with pytest.raises(TypeError, match="label 'a' must be a GradientTransformation"):
        mf.partition({"a": object()}, {})
    tx = mf.partition({"muon": mf.identity()}, {"w1": "muon", "w2": "adamw"})
    with pytest.raises(ValueError, match="labels \\[\"'adamw'\"\\] have no transform"):
        tx.init(rand_tree(0, {"w1": (2, 2), "w2": (2, 2)}))
    # labels whose structure does not match the params
    tx = mf.partition({"muon": mf.identity()}, {"w1": "muon"})
    with pytest.raises(ValueError):
        tx.init(rand_tree(0, {"w1": (2, 2), "w2": (2, 2)}))
    # orthogonalize reached by a vector: routed elsewhere it is fine, here it is an error
    tx = mf.partition({"muon": mf.muon()}, {"w1": "muon", "b1": "muon"})
    p = rand_tree(0, {"w1": (4, 4), "b1": (4,)})
    with pytest.raises(ValueError, match="only supports matrices"):
        tx.update(p, tx.init(p), p)


# --------------------------------------------------------------------------------------------
# docs/design.md §1's chain, on a dict, a list and a nested tree of tensors.


@pytest.mark.parametrize("container", ["dict", "list", "nested"])
def test_design_section_1_snippet(container):
    import muon_fn as mf  # as in the snippet

    g = torch.Generator().manual_seed(0)
    shapes = [(16, 32), (32, 16), (8, 4, 3, 3)]
    tensors = [torch.randn(s, generator=g) for s in shapes]
    if container == "dict":
        params = {f"p{i}": t for i, t in enumerate(tensors)}
    elif container == "list":
        params = list(tensors)
    else:
        params = {"layers": [tensors[0], tensors[1]], "conv": (tensors[2],)}
    grads = _tree.tree_map(lambda t: torch.randn(t.shape, generator=g), params)
    start = params

    tx = mf.chain(
        mf.momentum(0.95, nesterov=True),
        mf.orthogonalize(steps=5),
        mf.scale_by_shape("keller"),
        mf.add_decoupled_weight_decay(0.01),
        mf.scale_by_learning_rate(0.02),
    )
    state = tx.init(params)  # params: any pytree of tensors
    updates, state = tx.update(grads, state, params)
    params = mf.apply_updates(params, updates)

    assert type(params) is type(start)
    assert _tree.tree_structure(params) == _tree.tree_structure(start)
    for p0, u, p1, gr in zip(
        _tree.tree_leaves(start),
        _tree.tree_leaves(updates),
        _tree.tree_leaves(params),
        _tree.tree_leaves(grads),
    ):
        assert p1.shape == p0.shape and p1.dtype == p0.dtype and torch.isfinite(p1).all()
        # first step: momentum buffer = g, Nesterov g + 0.95 g = 1.95 g, msign is scale-free:
        # u = −0.02·(s·msign(g) + 0.01·p), msign the default iteration (Keller's quintic) of g
        # cast to the compute dtype first, as torch.optim.Muon casts.
        out, inn = p0.shape[0], p0[0].numel()
        s = max(1.0, out / inn) ** 0.5
        dtype = default_compute_dtype()  # bf16, or fp32 on a CPU without bf16 GEMMs
        o = mf.newton_schulz(
            (1.95 * gr).reshape(out, inn).to(dtype), "quintic", 5, dtype=dtype
        ).reshape(p0.shape)
        # bf16: the transform rounds g + 0.95·g, the reference 1.95·g; a last-bit difference of the
        # input moves the quintic's result by up to ~1e-2 (its slope near σ = 0 is 3.4445⁵ ≈ 485),
        # 2e-4 of u at lr 0.02. In fp32 (CPUs without bf16 GEMMs) they agree to 1e-6.
        atol = 1e-6 if dtype == torch.float32 else 2e-4
        torch.testing.assert_close(u, -0.02 * (s * o + 0.01 * p0), atol=atol, rtol=0)
