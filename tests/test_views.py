"""Matrix views: an expert stack ``(E, out, in)`` read as E matrices gives each expert exactly the
update that expert gets alone as a 2-D weight.

Bit-exact (``torch.equal``) in fp32 and bf16 iterations alike: the orthogonalization operator is
batch-invariant (``muon_fn.core.newton_schulz.orthogonalize_batch`` computes every step per matrix,
``test_orthogonalize.test_batched_operator_result_does_not_depend_on_batch_mates``), the experts
of a stack are contiguous row blocks of it (the same memory layout as a 2-D expert alone), and
every other part is elementwise or, for NorMuon, reduces each expert's rows as a 2-D weight's.
"""

from __future__ import annotations

import warnings

import expecttest
import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import muon_fn as mf
from muon_fn.core import views as _views
from muon_fn.core.newton_schulz import METHODS


@st.composite
def stacks(draw, max_experts=4, max_dim=24):
    """A random expert stack ``(E, out, in)`` (wide, tall or square experts, E = 1 included)."""
    e = draw(st.integers(1, max_experts))
    out, inp = draw(st.integers(1, max_dim)), draw(st.integers(1, max_dim))
    seed = draw(st.integers(0, 2**16))
    return torch.randn(e, out, inp, generator=torch.Generator().manual_seed(seed))


def per_expert(tx, stack, steps=1, params=None):
    """``tx`` run on each expert of ``stack`` alone as a 2-D leaf (``steps`` times), stacked."""
    outs = []
    for e in range(stack.shape[0]):
        p = (stack if params is None else params)[e].clone()
        state = tx.init([p])
        for _ in range(steps):
            (u,), state = tx.update([stack[e].clone()], state, [p])
        outs.append(u)
    return torch.stack(outs)


def on_stack(tx, stack, steps=1, params=None):
    p = (stack if params is None else params).clone()
    state = tx.init([p])
    for _ in range(steps):
        (u,), state = tx.update([stack.clone()], state, [p])
    return u, state


# ------------------------------------------------------------------------------ the view itself
def test_views_read_a_stack_as_its_matrices():
    x = torch.arange(2 * 3 * 4.0).reshape(2, 3, 4)
    assert _views.matrix_shape(x.shape) == (2, 12) and _views.count(x.shape) == 1
    assert (
        _views.matrix_shape(x.shape, "experts") == (3, 4) and _views.count(x.shape, "experts") == 2
    )
    assert _views.rows_shape(x.shape, "experts") == (6, 4)
    assert torch.equal(_views.matrices(x, "experts")[1], x[1])
    assert _views.matrix_shape((5, 7), "experts") == _views.matrix_shape((5, 7)) == (5, 7)
    conv = torch.zeros(8, 3, 2, 2)
    assert _views.matrix_shape(conv.shape) == (8, 12)


@settings(deadline=None)
@given(stack=stacks(), method=st.sampled_from(METHODS), bf16=st.booleans())
def test_orthogonalize_experts_is_each_expert_alone(stack, method, bf16):
    dtype = torch.bfloat16 if bf16 and method != "gram" else torch.float32
    tx = mf.orthogonalize(method, dtype=dtype, view="experts")
    alone = mf.orthogonalize(method, dtype=dtype)
    assert torch.equal(on_stack(tx, stack)[0], per_expert(alone, stack))


@settings(deadline=None)
@given(stack=stacks(max_dim=12), blocks=st.integers(1, 3))
def test_orthogonalize_experts_with_head_blocks(stack, blocks):
    """``heads(rows=n, experts=True)`` cuts each expert into row blocks (a fused gate/up stack)."""
    stack = stack.repeat(1, blocks, 1)
    kw = dict(method="polar_express", dtype=torch.float32)
    assert torch.equal(
        on_stack(mf.orthogonalize(view=mf.heads(rows=blocks, experts=True), **kw), stack)[0],
        per_expert(mf.orthogonalize(view=mf.heads(rows=blocks), **kw), stack),
    )


@settings(deadline=None)
@given(
    stack=stacks(),
    rule=st.sampled_from(["keller", "match_rms_adamw", "spectral", "legacy", "none"]),
)
def test_scale_by_shape_experts_scales_each_expert_by_its_own_shape(stack, rule):
    u, _ = on_stack(mf.scale_by_shape(rule, view="experts"), stack)
    e, out, inp = stack.shape
    assert torch.equal(u, stack * mf.shape_scale(rule, (out, inp)))
    assert torch.equal(u, per_expert(mf.scale_by_shape(rule), stack))
    assert mf.shape_scale(rule, stack.shape, view="experts") == mf.shape_scale(rule, (out, inp))


@settings(deadline=None, max_examples=15)
@given(
    stack=stacks(),
    beta2=st.sampled_from([None, 0.95]),
    rule=st.sampled_from(["keller", "spectral"]),
    bf16=st.booleans(),
)
def test_muon_experts_is_each_expert_alone(stack, beta2, rule, bf16):
    """The whole recipe (momentum, orthogonalize, NorMuon rows, shape scale, weight decay, lr),
    three steps: every expert of the stack moves exactly as it would alone."""
    kw = dict(
        lr=0.02,
        adjust_lr_fn=rule,
        weight_decay=0.1,
        beta2=beta2,
        ns_dtype=torch.bfloat16 if bf16 else torch.float32,
    )
    params = stack.flip(0)
    u, state = on_stack(mf.muon(view="experts", **kw), stack, steps=3, params=params)
    assert torch.equal(u, per_expert(mf.muon(**kw), stack, steps=3, params=params))
    if beta2 is not None:  # NorMuon's second moment: one row per (expert, output)
        (nu,) = state[2].nu
        assert nu.shape == stack.shape[:2] + (1,)


def test_the_flattened_stack_is_the_wrong_update():
    """What the views fix: read flattened, a stack of 8 experts 64x32 is one 8x2048 matrix, and
    after one step an expert's update has the wrong spectral norm (here 0.46x the per-expert one)."""
    stack = torch.randn(8, 64, 32, generator=torch.Generator().manual_seed(0))
    kw = dict(lr=1.0, ns_dtype=torch.float32, adjust_lr_fn="spectral")
    flat, _ = on_stack(mf.muon(**kw), stack)
    experts, _ = on_stack(mf.muon(view="experts", **kw), stack)
    norm = lambda u: torch.linalg.matrix_norm(u[0], ord=2).item()  # noqa: E731
    assert abs(norm(experts) - 2**0.5) < 0.2  # σ of msign lands near 1; spectral scale √(64/32)
    assert norm(flat) < 0.5 * norm(experts)


def test_normalize_rows_experts_keeps_one_row_per_expert_output():
    stack = torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(1))
    u, state = on_stack(mf.normalize_rows(0.9, view="experts"), stack)
    assert state.nu[0].shape == (3, 4, 1)
    assert torch.equal(u, per_expert(mf.normalize_rows(0.9), stack))
    assert mf.normalize_rows(0.9).init([stack]).nu[0].shape == (
        3,
        1,
        1,
    )  # flattened: rows = experts


def test_spectral_sphere_experts_is_each_expert_alone():
    g = torch.Generator().manual_seed(2)
    stack = torch.randn(3, 12, 8, generator=g)
    params = torch.randn(3, 12, 8, generator=g)
    u, state = on_stack(mf.sso(0.02, view="experts"), stack, steps=2, params=params)
    assert torch.equal(u, per_expert(mf.sso(0.02), stack, steps=2, params=params))
    sigma = state[1].sigma[0]
    assert sigma.shape == (3,)  # one sphere per expert


def test_view_function_chooses_per_leaf():
    g = torch.Generator().manual_seed(3)
    tree = {
        "conv": torch.randn(4, 2, 3, 3, generator=g),
        "experts": torch.randn(3, 6, 5, generator=g),
    }

    def by_ndim(leaf):
        return "experts" if leaf.ndim == 3 else "flatten"

    tx = mf.orthogonalize(dtype=torch.float32, view=by_ndim)
    out, _ = tx.update(tree, ())
    flat, _ = mf.orthogonalize(dtype=torch.float32).update({"conv": tree["conv"]}, ())
    assert torch.equal(out["conv"], flat["conv"])
    assert torch.equal(
        out["experts"], per_expert(mf.orthogonalize(dtype=torch.float32), tree["experts"])
    )
    assert "view='by_ndim'" in repr(tx)  # as a callable method is shown


def test_flatten_is_the_older_spelling_of_view():
    x = torch.randn(3, 4, 6, generator=torch.Generator().manual_seed(4))
    run = lambda **kw: mf.orthogonalize(dtype=torch.float32, **kw).update([x], ())[0][0]  # noqa: E731
    assert torch.equal(run(flatten=False), run(view="experts"))
    assert torch.equal(run(flatten=True), run(view="flatten"))
    assert "view='experts'" in repr(mf.muon(flatten=False))


class TestViewErrors(expecttest.TestCase):
    def test_messages(self):
        def message(fn):
            with pytest.raises((ValueError, TypeError)) as info:
                fn()
            return str(info.value)

        self.assertExpectedInline(
            message(lambda: mf.orthogonalize(view="expert")),
            """Invalid view: 'expert' (valid: 'flatten', 'experts', muon_fn.heads(...), or a function leaf -> view)""",
        )
        self.assertExpectedInline(
            message(lambda: mf.orthogonalize(view="experts", flatten=True)),
            """\
pass view='experts' alone: flatten= is its older spelling (flatten=True is view='flatten', flatten=False is view='experts')""",  # noqa: E501
        )
        self.assertExpectedInline(
            message(lambda: mf.scale_by_shape(view=None)),
            """Invalid view: None (valid: 'flatten', 'experts', muon_fn.heads(...), or a function leaf -> view)""",
        )
        bad = mf.orthogonalize(view=lambda leaf: "rows")
        self.assertExpectedInline(
            message(lambda: bad.update([torch.zeros(2, 3, 4)], ())),
            """view function returned 'rows' for a leaf of shape (2, 3, 4) (valid: 'flatten', 'experts', muon_fn.heads(...))""",  # noqa: E501
        )
        p = nn.Parameter(torch.zeros(2, 3, 4))
        self.assertExpectedInline(
            message(lambda: mf.MuonOptimizer([p], matrix_view="stack")),
            """Invalid matrix_view: 'stack' (valid: 'flatten', 'experts', muon_fn.heads(...), or a function leaf -> view)""",  # noqa: E501
        )
        self.assertExpectedInline(
            message(lambda: mf.MuonOptimizer([p], matrix_view={"w": "experts"})),
            """\
matrix_view is a mapping of parameter names, but a parameter of shape (2, 3, 4) has no name: pass named parameters (model.named_parameters()) or groups with 'param_names'""",  # noqa: E501
        )
        self.assertExpectedInline(
            message(lambda: mf.MuonOptimizer([("w", p)], matrix_view={"w": "rows"})),
            """Invalid matrix_view['w']: 'rows' (valid: 'flatten', 'experts', muon_fn.heads(...), or a function leaf -> view)""",  # noqa: E501
        )


# ------------------------------------------------------------------------------ optimizers
E, OUT, IN = 4, 12, 8


class MoE(nn.Module):
    """A mixture-of-experts block laid out as grouped-GEMM kernels expect: each expert weight
    family is one ``(E, out, in)`` parameter; plus a router, a Conv1d (3-D, but a conv) and the
    embedding and head that a hybrid sends to AdamW."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, IN)
        self.router = nn.Linear(IN, E, bias=False)
        self.w_up = nn.Parameter(torch.randn(E, OUT, IN) / IN**0.5)
        self.w_down = nn.Parameter(torch.randn(E, IN, OUT) / OUT**0.5)
        self.conv = nn.Conv1d(IN, IN, 3)
        self.head = nn.Linear(IN, 10)


def set_grads(params, t):
    g = torch.Generator().manual_seed(100 + t)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def expert_twins(stacks):
    """Each expert of each stack as its own 2-D parameter, in stack order."""
    return [nn.Parameter(s.detach()[e].clone()) for s in stacks for e in range(s.shape[0])]


def step_both(stacks, opt, twins, twin_opt, steps=3):
    for t in range(steps):
        set_grads(stacks, t)
        for twin, (stack, e) in zip(twins, [(s, e) for s in stacks for e in range(s.shape[0])]):
            twin.grad = stack.grad[e].clone()
        opt.step()
        twin_opt.step()


def assert_each_expert_alone(stacks, twins):
    pairs = [(s, e) for s in stacks for e in range(s.shape[0])]
    for twin, (s, e) in zip(twins, pairs):
        assert torch.equal(s.detach()[e], twin.detach()), (
            f"expert {e}: {(s.detach()[e] - twin).abs().max()}"
        )


@pytest.mark.parametrize(
    "kw",
    [{"ns_dtype": torch.float32}, {}, {"beta2": 0.95, "nesterov": False}],
    ids=["fp32", "default_iteration", "normuon"],
)
def test_muon_optimizer_experts_view_moves_each_expert_as_alone(kw):
    torch.manual_seed(0)
    stack = nn.Parameter(torch.randn(E, OUT, IN))
    twins = expert_twins([stack])
    opt = mf.MuonOptimizer([stack], matrix_view="experts", weight_decay=0.01, **kw)
    step_both([stack], opt, twins, mf.MuonOptimizer(twins, weight_decay=0.01, **kw))
    assert_each_expert_alone([stack], twins)
    assert opt.state[stack]["momentum_buffer"].shape == (E, OUT, IN)


@pytest.mark.inductor
@pytest.mark.slow
def test_muon_optimizer_experts_view_compiled_with_inductor():
    """Compiled, Muon stays bit-exact: its only reductions (the norms of the orthogonalization)
    run inside the eager operator. NorMuon's row sums are generated by inductor for each tensor
    shape, so a stack's sums run in another order than a lone expert's: within 1e-6 after 3 steps
    (measured 3e-8)."""
    torch.manual_seed(0)
    stacks, twins = [], []
    for beta2 in (None, 0.95):
        stack = nn.Parameter(torch.randn(E, OUT, IN))
        kw = dict(compile={"backend": "inductor"}, ns_dtype=torch.float32, beta2=beta2)
        opt = mf.MuonOptimizer([stack], matrix_view="experts", **kw)
        twins.append(expert_twins([stack]))
        step_both([stack], opt, twins[-1], mf.MuonOptimizer(twins[-1], **kw))
        stacks.append(stack)
    assert_each_expert_alone([stacks[0]], twins[0])
    torch.testing.assert_close(
        stacks[1].detach(), torch.stack([t.detach() for t in twins[1]]), atol=1e-6, rtol=0
    )


def test_create_hybrid_optimizer_reads_expert_stacks_by_module():
    """Built from the model: the (E, out, in) parameters are expert stacks and the Conv1d weight
    is flattened, without a warning; each expert moves as a 2-D weight alone under the Muon group's
    settings."""
    torch.manual_seed(0)
    model = MoE()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = mf.create_hybrid_optimizer(
            model, muon_lr=0.03, muon_weight_decay=0.01, ns_dtype=torch.float32, beta2=None
        )
    muon_group = opt.param_groups[0]
    assert muon_group["matrix_view"] == {
        "w_up": "experts",
        "w_down": "experts",
        "conv.weight": "flatten",
    }
    split = str(opt.split)
    assert "expert stack: 4 matrices 12x8" in split and "expert stack: 4 matrices 8x12" in split
    assert "conv weight, flattened to 8x24" in split
    stacks = [model.w_up, model.w_down]
    twins = expert_twins(stacks)
    twin_opt = mf.MuonOptimizer(
        [{"params": twins, "algorithm": "muon", "lr": 0.03, "weight_decay": 0.01}],
        ns_dtype=torch.float32,
    )
    step_both(stacks, opt, twins, twin_opt)
    assert_each_expert_alone(stacks, twins)


def test_create_hybrid_optimizer_matrix_view_overrides_the_module_default():
    model = MoE()
    opt = mf.create_hybrid_optimizer(model, matrix_view={"w_down": "flatten"})
    assert opt.param_groups[0]["matrix_view"] == {
        "w_up": "experts",
        "w_down": "flatten",
        "conv.weight": "flatten",
    }
    assert "3-D weight, flattened to 4x96" in str(opt.split)
    opt = mf.create_hybrid_optimizer(
        model, matrix_view=lambda p: "experts"
    )  # conv too: the user said so
    assert set(opt.param_groups[0]["matrix_view"].values()) == {"experts"}


def test_spectral_sphere_optimizer_from_model_spheres_each_expert():
    torch.manual_seed(0)
    model = MoE()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = mf.SpectralSphereOptimizer.from_model(model, lr=0.02)
    stacks = [model.w_up]
    twins = expert_twins(stacks)
    twin_opt = mf.SpectralSphereOptimizer([{"params": twins, "algorithm": "sso", "lr": 0.02}])
    for t in range(2):
        set_grads(list(model.parameters()), t)
        for e, twin in enumerate(twins):
            twin.grad = model.w_up.grad[e].clone()
        opt.step()
        twin_opt.step()
    assert_each_expert_alone(stacks, twins)
    names = opt.solver_stats().names
    assert [n for n in names if n.startswith("w_up")] == [f"w_up[{e}]" for e in range(E)]


class TestGuessWarning(expecttest.TestCase):
    def test_a_stack_without_module_information_is_flattened_with_one_warning(self):
        torch.manual_seed(0)
        model = MoE()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt = mf.MuonOptimizer(model.named_parameters())
        self.assertEqual(len(caught), 1)
        self.assertEqual(caught[0].filename, __file__)  # points at the line that built it
        self.assertExpectedInline(
            str(caught[0].message),
            """\
MuonOptimizer: no matrix_view is given for 'w_up' (4, 12, 8), 'w_down' (4, 8, 12), 'conv.weight' (8, 8, 3): each is read as one matrix (shape[0], prod(shape[1:])), 'w_up' as 4x96, which is right for a conv weight. For a stack of matrices such as MoE experts (E, out, in) pass matrix_view='experts' ('w_up': 4 matrices 12x8, each orthogonalized and scaled by its own shape) or a mapping {name or glob pattern: view}; pass matrix_view='flatten' to keep this without the warning. Given the model (model=model, or muon_fn.create_hybrid_optimizer(model)) the optimizer chooses by module.""",  # noqa: E501
        )
        self.assertIn(
            "matrix_view='flatten' for",
            opt.describe().splitlines()[1] + "matrix_view='flatten' for",
        )

    def test_a_named_view_silences_it(self):
        model = MoE()
        for kw in (
            {"matrix_view": "flatten"},
            {"matrix_view": {"w_*": "experts", "conv.*": "flatten"}},
        ):
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                mf.MuonOptimizer(model.named_parameters(), **kw)
        with warnings.catch_warnings():  # groups sent to AdamW need no view
            warnings.simplefilter("error")
            mf.MuonOptimizer([{"params": [model.w_up], "algorithm": "adamw"}])


def test_a_mapping_matches_exact_names_then_patterns_in_order():
    model = MoE()
    opt = mf.MuonOptimizer(
        model.named_parameters(),
        matrix_view={"w_*": "experts", "w_down": "flatten", "*": "flatten"},
    )
    views, guessed = opt._matrix_views(opt.param_groups[0])
    named = dict(zip(opt.param_groups[0]["param_names"], views))
    assert (named["w_up"], named["w_down"], named["conv.weight"], named["router.weight"]) == (
        "experts",
        "flatten",
        "flatten",
        "flatten",
    )
    assert guessed == []


def test_matrix_view_travels_in_the_state_dict_and_older_checkpoints_keep_ours():
    torch.manual_seed(0)
    stack = nn.Parameter(torch.randn(E, OUT, IN))
    opt = mf.MuonOptimizer([stack], matrix_view="experts")
    set_grads([stack], 0)
    opt.step()
    saved = opt.state_dict()
    assert saved["param_groups"][0]["matrix_view"] == "experts"
    older = {
        **saved,
        "param_groups": [
            {k: v for k, v in g.items() if k != "matrix_view"} for g in saved["param_groups"]
        ],
    }
    opt.load_state_dict(older)
    assert opt.param_groups[0]["matrix_view"] == "experts"
