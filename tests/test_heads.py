"""Head views (``muon_fn.heads``): row blocks (fused QKV, per head) and column blocks (the heads
feeding an output projection) of each matrix, each block a matrix of its own.

The properties: a leaf's update under a head view is its blocks' updates, each computed as a 2-D
leaf alone, assembled (f(stack) = stack(f), bit for bit in fp32 and in the bf16 iteration); each
block's singular values sit in the method's band times its own shape scale; a head view given
for one parameter leaves every other parameter exactly as it was.
"""

from __future__ import annotations

import copy
import pickle
import warnings

import expecttest
import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import muon_fn as mf
from muon_fn.core import views as _views

BANDS_5 = {"quintic": (0.6, 1.2), "polar_express": (0.8, 1.2)}  # tests/test_orthogonalize.py


@st.composite
def blocks(draw, max_blocks=3, max_size=7):
    """``(spec, sizes)``: None (uncut), n equal blocks, or explicit sizes."""
    kind = draw(st.sampled_from(["none", "equal", "sizes"]))
    if kind == "none":
        size = draw(st.integers(1, 2 * max_size))
        return None, [size]
    if kind == "equal":
        n, size = draw(st.integers(1, max_blocks)), draw(st.integers(1, max_size))
        return n, [size] * n
    sizes = draw(st.lists(st.integers(1, max_size), min_size=1, max_size=max_blocks))
    return tuple(sizes), sizes


@st.composite
def head_cases(draw):
    """A leaf and a head view that fits it: a 2-D weight, or an expert stack with ``experts=True``."""
    (rows, row_sizes), (cols, col_sizes) = draw(blocks()), draw(blocks())
    if rows is None and cols is None:
        rows, row_sizes = 2, row_sizes * 2
    experts = draw(st.booleans())
    shape = (sum(row_sizes), sum(col_sizes))
    if experts:
        shape = (draw(st.integers(1, 3)),) + shape
    seed = draw(st.integers(0, 2**16))
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return x, mf.heads(rows=rows, cols=cols, experts=experts)


def run(tx, leaf, steps=1, param=None):
    """``tx`` on the single-leaf tree ``[leaf]`` for ``steps`` steps: the last update and state."""
    p = (leaf if param is None else param).clone()
    state = tx.init([p])
    for _ in range(steps):
        (u,), state = tx.update([leaf.clone()], state, [p])
    return u, state


def per_block(tx, leaf, view, steps=1, param=None):
    """``tx`` on every block of ``leaf`` alone (a 2-D leaf), joined back into ``leaf``'s shape."""
    params = _views.split(leaf if param is None else param, view)
    outs = [run(tx, b, steps, p)[0] for b, p in zip(_views.split(leaf, view), params)]
    return _views.join(outs, leaf, view)


# ------------------------------------------------------------------------------ the view
def test_units_of_a_fused_qkv_and_an_output_projection():
    qkv = torch.arange(12 * 4.0).reshape(12, 4)
    view = mf.heads(rows=(6, 3, 3))
    q, k, v = _views.split(qkv, view)
    assert torch.equal(q, qkv[:6]) and torch.equal(v, qkv[9:])
    out = torch.arange(4 * 6.0).reshape(4, 6)
    cols = _views.split(out, mf.heads(cols=3))
    assert [tuple(c.shape) for c in cols] == [(4, 2)] * 3 and torch.equal(cols[1], out[:, 2:4])
    assert torch.equal(_views.join(cols, out, mf.heads(cols=3)), out)
    stack = torch.arange(2 * 4 * 3.0).reshape(2, 4, 3)
    assert _views.unit_shapes(stack.shape, mf.heads(rows=2, experts=True)) == [(2, 3)] * 4
    assert _views.unit_shapes((6, 6), mf.heads(rows=2, cols=3)) == [(3, 2)] * 6  # a grid


@settings(deadline=None)
@given(case=head_cases())
def test_split_and_join_are_inverse(case):
    x, view = case
    assert torch.equal(_views.join(_views.split(x, view), x, view), x)


def test_a_head_view_is_hashable_picklable_and_shows_itself():
    view = mf.heads(rows=[8, 4, 4])
    assert view == mf.heads(rows=(8, 4, 4)) and hash(view) == hash(mf.heads(rows=(8, 4, 4)))
    assert pickle.loads(pickle.dumps(view)) == view and copy.deepcopy(view) == view
    assert repr(view) == "heads(rows=(8, 4, 4))"
    assert repr(mf.heads(cols=4, experts=True)) == "heads(cols=4, experts=True)"
    assert "view=heads(cols=4)" in repr(mf.muon(view=mf.heads(cols=4)))


# ------------------------------------------------------------------------------ transforms
@settings(deadline=None)
@given(
    case=head_cases(),
    method=st.sampled_from(["polar_express", "quintic", "you", "cubic"]),
    bf16=st.booleans(),
)
def test_orthogonalize_is_each_block_alone(case, method, bf16):
    x, view = case
    dtype = torch.bfloat16 if bf16 else torch.float32
    out, _ = run(mf.orthogonalize(method, dtype=dtype, view=view), x)
    assert torch.equal(out, per_block(mf.orthogonalize(method, dtype=dtype), x, view))


@settings(deadline=None)
@given(
    case=head_cases(),
    rule=st.sampled_from(["keller", "match_rms_adamw", "spectral", "legacy", "none"]),
)
def test_scale_by_shape_scales_each_block_by_its_own_shape(case, rule):
    x, view = case
    out, _ = run(mf.scale_by_shape(rule, view=view), x)
    assert torch.equal(out, per_block(mf.scale_by_shape(rule), x, view))
    for block, b_in, (m, n) in zip(
        _views.split(out, view), _views.split(x, view), _views.unit_shapes(x.shape, view)
    ):
        assert torch.equal(block, b_in * mf.shape_scale(rule, (m, n)))


@settings(deadline=None, max_examples=25)
@given(
    case=head_cases(),
    beta2=st.sampled_from([None, 0.95]),
    rule=st.sampled_from(["keller", "spectral"]),
    bf16=st.booleans(),
)
def test_muon_is_each_block_alone(case, beta2, rule, bf16):
    """The whole recipe (momentum, orthogonalize, NorMuon rows, shape scale, decay, lr), three
    steps: every block moves exactly as it would as a weight of its own."""
    x, view = case
    kw = dict(
        lr=0.02,
        adjust_lr_fn=rule,
        weight_decay=0.1,
        beta2=beta2,
        ns_dtype=torch.bfloat16 if bf16 else torch.float32,
    )
    params = x.flip(-1)
    u, state = run(mf.muon(view=view, **kw), x, steps=3, param=params)
    assert torch.equal(u, per_block(mf.muon(**kw), x, view, steps=3, param=params))
    if beta2 is not None:  # one second moment per row of each block: (rows, column blocks)
        (nu,) = state[2].nu
        cols = len(_views.block_sizes(x.shape, view)[1])
        assert nu.shape == (x.shape[:-1] + (cols,) if x.ndim == 3 else (x.shape[0], cols))


def well_conditioned_blocks(shapes, seed):
    """A leaf's blocks, each ``U diag(s) Vᵀ`` with ``s`` in [0.5, 1] (a bounded condition number)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for m, n in shapes:
        k = min(m, n)
        u = torch.linalg.qr(torch.randn(m, k, generator=g))[0]
        v = torch.linalg.qr(torch.randn(n, k, generator=g))[0]
        out.append(u @ torch.diag(0.5 + 0.5 * torch.rand(k, generator=g)) @ v.T)
    return out


@settings(deadline=None)
@given(
    case=head_cases(),
    method=st.sampled_from(sorted(BANDS_5)),
    rule=st.sampled_from(["keller", "spectral", "match_rms_adamw"]),
    seed=st.integers(0, 2**16),
)
def test_each_block_lands_in_the_band_times_its_own_scale(case, method, rule, seed):
    x, view = case
    x = _views.join(well_conditioned_blocks(_views.unit_shapes(x.shape, view), seed), x, view)
    tx = mf.muon(
        lr=1.0, momentum=0.0, method=method, ns_dtype=torch.float32, adjust_lr_fn=rule, view=view
    )
    u, _ = run(tx, x)
    lo, hi = BANDS_5[method]
    for block, shape in zip(_views.split(-u, view), _views.unit_shapes(x.shape, view)):
        s = torch.linalg.svdvals(block.double()) / mf.shape_scale(rule, shape)
        assert lo <= s.min() and s.max() <= hi, (shape, s.min().item(), s.max().item())


@pytest.mark.parametrize(
    "view", [mf.heads(rows=(8, 4, 4)), mf.heads(cols=2), mf.heads(rows=2, experts=True)], ids=str
)
def test_spectral_sphere_is_each_block_alone(view):
    """Every block its own sphere. The warm blocks of a leaf's units share one width (the
    smallest side of its blocks, at most ``power_block``): with ``power_block`` no wider than
    that, each block is bit for bit the block alone."""
    g = torch.Generator().manual_seed(5)
    shape = (2, 8, 6) if view.experts else (16, 12)
    x, params = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    u, state = run(mf.sso(0.02, view=view, power_block=4), x, steps=2, param=params)
    assert torch.equal(u, per_block(mf.sso(0.02, power_block=4), x, view, steps=2, param=params))
    sigma = state[1].sigma[0]  # one sphere per block; per expert, then per block, for a stack
    assert sigma.shape == ((2, 2) if view.experts else (len(_views.unit_shapes(shape, view)),))


def test_partition_scopes_a_head_view_to_its_leaves():
    """In the functional core a head view is the view of every leaf of its transform; a
    partition gives it to one parameter and leaves the others (the same shape here) alone."""
    g = torch.Generator().manual_seed(6)
    tree = {"qkv": torch.randn(12, 4, generator=g), "mlp": torch.randn(12, 4, generator=g)}
    kw = dict(lr=0.1, ns_dtype=torch.float32)
    tx = mf.partition(
        {"heads": mf.muon(view=mf.heads(rows=3), **kw), "plain": mf.muon(**kw)},
        {"qkv": "heads", "mlp": "plain"},
    )
    out, _ = tx.update(tree, tx.init(tree), tree)
    assert torch.equal(out["mlp"], run(mf.muon(**kw), tree["mlp"])[0])
    assert torch.equal(out["qkv"], per_block(mf.muon(**kw), tree["qkv"], mf.heads(rows=3)))


# ------------------------------------------------------------------------------ optimizers
D, H = 8, 2  # model width, heads


class Attention(nn.Module):
    """A fused QKV projection, an output projection, and an MLP weight with the QKV's shape (a
    head view must not reach it)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.out = nn.Linear(D, D, bias=False)
        self.mlp = nn.Linear(D, 3 * D, bias=False)


VIEWS = {"qkv.weight": mf.heads(rows=3 * H), "out.weight": mf.heads(cols=H)}


def grads(model, t):
    g = torch.Generator().manual_seed(10 + t)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def trained(views, steps=3, cls=mf.MuonOptimizer, **kw):
    torch.manual_seed(0)
    model = Attention()
    opt = cls(model.named_parameters(), matrix_view=views, compile=False, **kw)
    for t in range(steps):
        grads(model, t)
        opt.step()
    return model, opt


@pytest.mark.parametrize(
    "kw", [{"ns_dtype": torch.float32}, {"beta2": 0.95}], ids=["fp32", "normuon"]
)
def test_muon_optimizer_heads_per_parameter(kw):
    """Each head of the mapped parameters moves as a weight of its own; the MLP weight (the same
    shape as the QKV) and every unmapped parameter move exactly as without the mapping."""
    model, _ = trained(VIEWS, **kw)
    plain, _ = trained(None, **kw)
    assert torch.equal(model.mlp.weight, plain.mlp.weight)
    assert not torch.equal(model.qkv.weight, plain.qkv.weight)
    torch.manual_seed(0)
    ref = Attention()
    heads = [
        nn.Parameter(b.detach().clone()) for b in _views.split(ref.qkv.weight, VIEWS["qkv.weight"])
    ]
    heads += [
        nn.Parameter(b.detach().clone()) for b in _views.split(ref.out.weight, VIEWS["out.weight"])
    ]
    opt = mf.MuonOptimizer(heads, compile=False, **kw)
    for t in range(3):
        grads(ref, t)
        parts = _views.split(ref.qkv.weight.grad, VIEWS["qkv.weight"]) + _views.split(
            ref.out.weight.grad, VIEWS["out.weight"]
        )
        for p, g in zip(heads, parts):
            p.grad = g.clone()
        opt.step()
    assert torch.equal(
        model.qkv.weight, _views.join(heads[: 3 * H], model.qkv.weight, VIEWS["qkv.weight"])
    )
    assert torch.equal(
        model.out.weight, _views.join(heads[3 * H :], model.out.weight, VIEWS["out.weight"])
    )


def test_spectral_sphere_optimizer_heads_per_parameter():
    model, opt = trained({"qkv.weight": mf.heads(rows=3)}, steps=2, cls=mf.SpectralSphereOptimizer)
    plain, _ = trained(None, steps=2, cls=mf.SpectralSphereOptimizer)
    assert torch.equal(model.mlp.weight, plain.mlp.weight)
    names = opt.solver_stats().names
    assert [n for n in names if n.startswith("qkv")] == [
        "qkv.weight[0]",
        "qkv.weight[1]",
        "qkv.weight[2]",
    ]


@pytest.mark.slow
def test_compiled_step_equals_eager_with_heads():
    torch.manual_seed(0)
    models = [Attention() for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [
        mf.MuonOptimizer(m.named_parameters(), matrix_view=VIEWS, ns_dtype=torch.float32, compile=c)
        for m, c in zip(models, [{"backend": "eager", "fullgraph": True}, False])
    ]
    for t in range(2):
        for m, o in zip(models, opts):
            grads(m, t)
            o.step()
    for p, q in zip(*(m.parameters() for m in models)):
        assert torch.equal(p, q)


def test_heads_travel_in_the_state_dict_and_copies():
    model, opt = trained(VIEWS, steps=1)
    saved = opt.state_dict()
    assert saved["param_groups"][0]["matrix_view"] == VIEWS
    clone = copy.deepcopy(opt)
    assert clone.param_groups[0]["matrix_view"] == VIEWS
    again = mf.MuonOptimizer(model.named_parameters(), matrix_view=VIEWS, compile=False)
    again.load_state_dict(pickle.loads(pickle.dumps(saved)))
    assert again.param_groups[0]["matrix_view"] == VIEWS


def test_create_hybrid_optimizer_takes_heads_by_name():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, D)
            self.attn = Attention()
            self.head = nn.Linear(D, 10)

    opt = mf.create_hybrid_optimizer(
        Block(),
        matrix_view={"attn.qkv.weight": mf.heads(rows=(8, 8, 8)), "*.out.weight": mf.heads(cols=H)},
    )
    assert opt.param_groups[0]["matrix_view"] == {
        "attn.qkv.weight": mf.heads(rows=(8, 8, 8)),
        "attn.out.weight": mf.heads(cols=H),
    }
    shown = str(opt.split)
    assert "heads(rows=(8, 8, 8)): 3 blocks 8x8" in shown and "heads(cols=2): 2 blocks 8x4" in shown


def test_a_function_may_name_no_view():
    model = Attention()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = mf.MuonOptimizer(
            model.parameters(),
            compile=False,
            matrix_view=lambda p: mf.heads(rows=3) if p is model.qkv.weight else None,
        )
    assert opt._matrix_views(opt.param_groups[0])[0] == [mf.heads(rows=3), "flatten", "flatten"]


class TestHeadErrors(expecttest.TestCase):
    def test_messages(self):
        def message(fn):
            with pytest.raises((ValueError, TypeError)) as info:
                fn()
            return str(info.value)

        model = Attention()
        self.assertExpectedInline(
            message(lambda: mf.heads()),
            """\
heads() needs rows= or cols= (the blocks of each matrix)""",
        )
        self.assertExpectedInline(
            message(lambda: mf.heads(rows=0)),
            """\
Invalid rows: 0 (expected a number of blocks >= 1 or block sizes)""",
        )
        self.assertExpectedInline(
            message(lambda: mf.heads(cols=(4, -1))),
            """\
Invalid cols: (4, -1) (expected a number of blocks >= 1 or positive block sizes)""",
        )
        self.assertExpectedInline(
            message(
                lambda: mf.MuonOptimizer(model.named_parameters(), matrix_view=mf.heads(rows=3))
            ),
            """\
Invalid matrix_view: heads(rows=3) for a whole group: a head view is one parameter's layout; give it per parameter, matrix_view={name or glob pattern: heads(rows=3)} (named parameters) or a function param -> view | None""",  # noqa: E501
        )
        self.assertExpectedInline(
            message(
                lambda: mf.MuonOptimizer(
                    model.named_parameters(), matrix_view={"out.weight": mf.heads(cols=3)}
                )
            ),
            """\
Invalid matrix_view for parameter 'out.weight' of shape (8, 8): heads(cols=3) does not fit a leaf of shape (8, 8): its matrices have 8 columns""",  # noqa: E501
        )
        self.assertExpectedInline(
            message(
                lambda: mf.muon(view=mf.heads(rows=5)).update(
                    [torch.zeros(8, 4)], mf.muon().init([torch.zeros(8, 4)]), [torch.zeros(8, 4)]
                )
            ),
            """\
heads(rows=5) does not fit a leaf of shape (8, 4): its matrices have 8 rows""",
        )
        self.assertExpectedInline(
            message(lambda: mf.MuonOptimizer(model.parameters(), split=[8, 8, 8])),
            """\
MuonOptimizer() got an unexpected keyword argument 'split': removed: row blocks are a head view, given per parameter: matrix_view={name: muon_fn.heads(rows=...)} (cols= for column blocks)""",  # noqa: E501
        )
        self.assertExpectedInline(
            message(lambda: mf.orthogonalize(split=[8, 8, 8])),
            """\
split= was removed: row blocks are a head view now, given per parameter: view=muon_fn.heads(rows=[8, 8, 8]) for one transform's leaves, or matrix_view={name: muon_fn.heads(rows=...)} in an optimizer (cols= cuts columns)""",  # noqa: E501
        )
        self.assertExpectedInline(
            message(
                lambda: mf.spectral_sphere(view=mf.heads(cols=(2, 4))).init([torch.zeros(4, 6)])
            ),
            """\
spectral_sphere: heads(cols=(2, 4)) cuts a leaf of shape (4, 6) into column blocks of different widths; SSO's warm blocks need equal widths""",  # noqa: E501
        )
        opt = mf.MuonOptimizer(model.named_parameters(), compile=False)
        saved = opt.state_dict()
        saved["param_groups"][0]["split"] = [8, 8, 8]
        self.assertExpectedInline(
            message(lambda: opt.load_state_dict(saved)),
            """\
cannot load a param group saved with split=[8, 8, 8]: row blocks are a head view now; build the optimizer with matrix_view={name: muon_fn.heads(rows=...)} and load a state_dict whose groups have no 'split' key""",  # noqa: E501
        )
        saved["param_groups"][0]["split"] = None  # the former default: loads
        opt.load_state_dict(saved)
        assert "split" not in opt.param_groups[0]
