"""Cautious Weight Decay (Chen et al., arXiv:2510.12402, Algorithm 1):

    x ← x − η·(u + λ·𝟙[u ⊙ x ≥ 0] ⊙ x)

with ``u`` the optimizer's step direction before the learning rate. Checked against that formula
written out in float64, for the transform, the Muon and AdamW recipes and the optimizers (both
halves of the hybrid), compiled and eager, under the FSDP adapter, and across old checkpoints.
"""

from __future__ import annotations

import copy

import expecttest
import pytest
import torch
import torch.nn as nn
from hypothesis import given
from hypothesis import strategies as st

import muon_fn as mf
from muon_fn.fsdp import FSDPMuonOptimizer
from muon_fn.optim import to_torch_state_dict


def cautious_decay(u: float, x: float, wd: float) -> float:
    """The paper's decay term for one coordinate: λ·𝟙[u·x ≥ 0]·x."""
    return wd * x if u * x >= 0 else 0.0


# Magnitudes far from underflow (the plain product u·x stays exact in sign), and exact zeros.
value = st.one_of(st.just(0.0), st.floats(1e-6, 1e3), st.floats(-1e3, -1e-6))


@given(
    st.lists(st.tuples(value, value), min_size=1, max_size=24),
    st.floats(0.0, 1.0),
    st.floats(1e-4, 1.0),
)
def test_transform_is_the_formula(pairs, wd, lr):
    u = torch.tensor([a for a, _ in pairs], dtype=torch.float64)
    x = torch.tensor([b for _, b in pairs], dtype=torch.float64)
    tx = mf.chain(mf.add_decoupled_weight_decay(wd, cautious=True), mf.scale_by_learning_rate(lr))
    updates, _ = tx.update((u,), tx.init((x,)), (x,))
    new = mf.apply_updates((x,), updates)[0]
    want = torch.tensor(
        [b - lr * (a + cautious_decay(a, b, wd)) for a, b in pairs], dtype=torch.float64
    )
    torch.testing.assert_close(new, want, rtol=1e-14, atol=0)


def test_mask_counts_zeros_as_agreeing_and_is_exact_for_tiny_values(device):
    # 0·x ≥ 0 and u·0 ≥ 0: those coordinates decay; opposite signs do not, however tiny (a product
    # 1e-30·1e-30 underflows to 0 in fp32, the sign comparison does not).
    u = torch.tensor([0.0, 1.0, -1.0, 1.0, 1e-30, -1e-30], device=device)
    x = torch.tensor([2.0, 0.0, 3.0, 3.0, -1e-30, -1e-30], device=device)
    out, _ = mf.add_decoupled_weight_decay(0.5, cautious=True).update((u,), (), (x,))
    want = u + 0.5 * torch.tensor([2.0, 0.0, 0.0, 3.0, 0.0, -1e-30], device=device)
    assert torch.equal(out[0], want)


def test_plain_decay_is_unchanged_and_missing_updates_stay_missing():
    u, x = torch.tensor([1.0, -1.0]), torch.tensor([2.0, 2.0])
    plain, _ = mf.add_decoupled_weight_decay(0.5).update((u, None), (), (x, x))
    assert torch.equal(plain[0], u + 0.5 * x) and plain[1] is None
    cautious, _ = mf.add_decoupled_weight_decay(0.5, cautious=True, min_ndim=2).update(
        (u,), (), (x,)
    )
    assert torch.equal(cautious[0], u)  # a 1-D leaf below min_ndim does not decay at all


def _muon_step(p, g, *, cwd, wd, lr, **kw):
    tx = mf.muon(lr, weight_decay=wd, cautious_weight_decay=cwd, ns_dtype=torch.float64, **kw)
    updates, _ = tx.update((g,), tx.init((p,)), (p,))
    return mf.apply_updates((p,), updates)[0]


@given(st.integers(2, 6), st.integers(2, 6), st.integers(0, 2**16), st.floats(0.01, 0.5))
def test_muon_decays_where_its_update_agrees(m, n, seed, wd):
    """u is Muon's scaled msign(M): recovered from the step without decay."""
    gen = torch.Generator().manual_seed(seed)
    p, g = (
        torch.randn(m, n, generator=gen, dtype=torch.float64),
        torch.randn(m, n, generator=gen, dtype=torch.float64),
    )
    lr = 0.02
    free = _muon_step(p, g, cwd=False, wd=0.0, lr=lr)
    u = (p - free) / lr
    cautious = _muon_step(p, g, cwd=True, wd=wd, lr=lr)
    mask = (u * p >= 0).to(p.dtype)
    torch.testing.assert_close(cautious, p - lr * (u + wd * mask * p), rtol=1e-12, atol=1e-14)


def adamw_reference(params, grads, *, lr, betas, eps, wd, cautious):
    """AdamW (torch.optim.AdamW's arithmetic) with the paper's cautious mask, written plainly."""
    b1, b2 = betas
    x = params.clone()
    m, v = torch.zeros_like(x), torch.zeros_like(x)
    for t, g in enumerate(grads, start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        u = (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)
        mask = (u * x >= 0).to(x.dtype) if cautious else torch.ones_like(x)
        x = x - lr * (u + wd * mask * x)
    return x


@pytest.mark.parametrize("cautious", [False, True])
def test_adamw_recipe_matches_the_written_out_rule(cautious):
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(5, 3, generator=gen, dtype=torch.float64)
    grads = [torch.randn(5, 3, generator=gen, dtype=torch.float64) for _ in range(6)]
    tx = mf.adamw(1e-2, (0.9, 0.95), 1e-8, 0.1, cautious_weight_decay=cautious)
    params, state = (x0,), tx.init((x0,))
    for g in grads:
        updates, state = tx.update((g,), state, params)
        params = mf.apply_updates(params, updates)
    want = adamw_reference(
        x0, grads, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, wd=0.1, cautious=cautious
    )
    # scale_by_adam counts steps in fp32 (torch.optim.AdamW's step), so 1 − βᵗ rounds to fp32
    torch.testing.assert_close(params[0], want, rtol=1e-7, atol=1e-9)


def test_hybrid_recipe_is_cautious_in_both_halves():
    tx = mf.hybrid(cautious_weight_decay=True, weight_decay=0.1, adamw_weight_decay=0.1)
    decays = [
        line.strip() for line in repr(tx).splitlines() if "add_decoupled_weight_decay" in line
    ]
    assert decays == [
        "add_decoupled_weight_decay(weight_decay=0.1, cautious=True),",
        "add_decoupled_weight_decay(weight_decay=0.1, min_ndim=2, cautious=True),",
    ], decays


# ----------------------------------------------------------------------------- the optimizers
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(12, 6)
        self.fc1 = nn.Linear(6, 10)
        self.fc2 = nn.Linear(10, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 12, bias=False)

    def forward(self, idx):
        h = torch.tanh(self.fc1(self.emb(idx)))
        return self.head(self.norm(torch.tanh(self.fc2(h))))


def loss_of(model, t):
    gen = torch.Generator().manual_seed(t)
    idx = torch.randint(0, 12, (4, 5), generator=gen)
    return nn.functional.cross_entropy(model(idx).flatten(0, 1), torch.roll(idx, 1, 1).flatten())


def train(model, opt, steps, start=0):
    for t in range(start, start + steps):
        opt.zero_grad()
        loss_of(model, t).backward()
        opt.step()


def test_optimizer_step_is_the_formula_in_both_halves():
    """One step of the hybrid with cautious decay against the same step without decay: the
    difference is −lr·wd·𝟙[u ⊙ p ≥ 0] ⊙ p per tensor, with each half's lr and wd (the first step's
    direction does not depend on the decay)."""
    torch.manual_seed(0)
    model = Net().double()
    free, cautious = copy.deepcopy(model), copy.deepcopy(model)
    kw = dict(
        muon_lr=0.02,
        adamw_lr=1e-2,
        muon_weight_decay=0.2,
        adamw_weight_decay=0.3,
        adamw_decay_1d=True,
    )
    o_free = mf.create_hybrid_optimizer(
        free, **dict(kw, muon_weight_decay=0.0, adamw_weight_decay=0.0)
    )
    o_cwd = mf.create_hybrid_optimizer(cautious, cautious_weight_decay=True, **kw)
    train(free, o_free, 1)
    train(cautious, o_cwd, 1)
    halves = {id(p): g for g in o_cwd.param_groups for p in g["params"]}
    for (name, p0), p_free, p_cwd in zip(
        model.named_parameters(), free.parameters(), cautious.parameters()
    ):
        group = halves[id(p_cwd)]
        lr, wd = group["lr"], group["weight_decay"]
        u = (p0 - p_free) / lr
        mask = (u * p0 >= 0).to(p0.dtype)
        torch.testing.assert_close(
            p_cwd, p0 - lr * (u + wd * mask * p0), rtol=1e-12, atol=1e-14, msg=name
        )


def test_cautious_differs_from_plain_decay_and_from_none():
    torch.manual_seed(0)
    model = Net()
    runs = {}
    for label, kw in {
        "none": dict(weight_decay=0.0),
        "plain": dict(weight_decay=0.5),
        "cautious": dict(weight_decay=0.5, cautious_weight_decay=True),
    }.items():
        m = copy.deepcopy(model)
        train(
            m,
            mf.MuonOptimizer(m.parameters(), adamw_weight_decay=0.5, adamw_decay_1d=True, **kw),
            3,
        )
        runs[label] = torch.cat([p.detach().flatten() for p in m.parameters()])
    assert not torch.equal(runs["cautious"], runs["plain"]) and not torch.equal(
        runs["cautious"], runs["none"]
    )


def test_step_never_modifies_grad():
    torch.manual_seed(0)
    model = Net()
    opt = mf.create_hybrid_optimizer(model, cautious_weight_decay=True, adamw_decay_1d=True)
    loss_of(model, 0).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))


def _pair(compile_option):
    torch.manual_seed(0)
    model = Net()
    other = copy.deepcopy(model)
    kw = dict(
        cautious_weight_decay=True, weight_decay=0.1, adamw_weight_decay=0.1, adamw_decay_1d=True
    )
    return (
        model,
        mf.MuonOptimizer(model.parameters(), compile=False, **kw),
        other,
        mf.MuonOptimizer(other.parameters(), compile=compile_option, **kw),
    )


def _assert_close_models(a, b, **tol):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, msg=name, **tol)


@pytest.mark.slow
def test_compiled_equals_eager():
    model, eager, other, compiled = _pair({"backend": "eager"})
    train(model, eager, 3)
    train(other, compiled, 3)
    _assert_close_models(model, other, rtol=0, atol=0)


@pytest.mark.slow
def test_inductor_equals_eager():
    model, eager, other, compiled = _pair({})
    train(model, eager, 2)
    train(other, compiled, 2)
    _assert_close_models(model, other, rtol=1e-5, atol=1e-6)


def test_fsdp_single_process_is_bit_exact_with_muon_optimizer():
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    kw = dict(
        lr=0.02,
        weight_decay=0.1,
        cautious_weight_decay=True,
        adamw_weight_decay=0.1,
        adamw_decay_1d=True,
    )
    opt = FSDPMuonOptimizer(model, **kw)
    ref_opt = mf.MuonOptimizer(ref.parameters(), **kw)
    train(model, opt, 4)
    train(ref, ref_opt, 4)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name
        for key, v in ref_opt.state[q].items():
            assert torch.equal(opt.state[p][key], v), (name, key)


def test_old_checkpoint_keeps_plain_decay():
    """A checkpoint saved before ``cautious_weight_decay`` existed ran plain decay: it loads with
    ``False``, even into an optimizer built with ``True``, and continues as that run would."""
    torch.manual_seed(0)
    model = Net()
    kw = dict(weight_decay=0.2, adamw_weight_decay=0.2, adamw_decay_1d=True)
    opt = mf.MuonOptimizer(model.parameters(), **kw)
    train(model, opt, 2)
    saved = copy.deepcopy(opt.state_dict())
    for group in saved["param_groups"]:
        for key in ("cautious_weight_decay", "adamuon_beta2", "adamuon_eps", "adamuon_sign"):
            del group[key]
    resumed_model = copy.deepcopy(model)
    resumed = mf.MuonOptimizer(resumed_model.parameters(), cautious_weight_decay=True, **kw)
    resumed.load_state_dict(saved)
    assert resumed.param_groups[0]["cautious_weight_decay"] is False
    train(model, opt, 2, start=2)
    train(resumed_model, resumed, 2, start=2)
    _assert_close_models(model, resumed_model, rtol=0, atol=0)


def test_new_checkpoint_round_trips_the_option():
    torch.manual_seed(0)
    model = Net()
    opt = mf.MuonOptimizer(model.parameters(), cautious_weight_decay=True, weight_decay=0.1)
    train(model, opt, 1)
    other = mf.MuonOptimizer(copy.deepcopy(model).parameters(), weight_decay=0.1)
    other.load_state_dict(opt.state_dict())
    assert other.param_groups[0]["cautious_weight_decay"] is True


def test_torch_conversion_refuses_cautious_decay():
    model = nn.Linear(4, 4, bias=False)
    opt = mf.MuonOptimizer(model.parameters(), cautious_weight_decay=True, weight_decay=0.1)
    with pytest.raises(
        ValueError, match=r"cautious_weight_decay=True \(torch.optim.Muon's is False\)"
    ):
        to_torch_state_dict(opt)
    adam_only = mf.MuonOptimizer(model.parameters(), algorithm="adamw", cautious_weight_decay=True)
    with pytest.raises(
        ValueError, match=r"cannot be written as torch\.optim\.AdamW: cautious_weight_decay=True"
    ):
        to_torch_state_dict(adam_only)


class TestCautiousExpect(expecttest.TestCase):
    def test_split_names_cautious_decay(self):
        torch.manual_seed(0)
        model = nn.Sequential()
        model.add_module("emb", nn.Embedding(10, 4))
        model.add_module("hidden", nn.Linear(4, 8))
        model.add_module("out", nn.Linear(8, 10, bias=False))
        opt = mf.create_hybrid_optimizer(model, adamw_weight_decay=0.1, cautious_weight_decay=True)
        self.assertExpectedInline(
            str(opt.split),
            """\
NorMuon: 1 tensors, 32 parameters; cautious weight decay 0.01
  hidden.weight                            (8, 4)               hidden matrix
AdamW: 3 tensors, 128 parameters; cautious weight decay 0.1 on ndim >= 2, none on 0-/1-D (adamw_decay_1d=True decays every tensor)
  emb.weight                               (10, 4)              embedding
  hidden.bias                              (8,)                 1-D, no weight decay
  out.weight                               (10, 8)              output head""",  # noqa: E501
        )
        self.assertExpectedInline(
            opt.describe(),
            """\
group 0: 1 params in 1 buckets, chain(
  momentum(momentum=0.95, nesterov=True, kind='ema'),
  orthogonalize(method='quintic', steps=5, dtype=None, eps=1e-07, stepsize=1.0, view='flatten'),
  normalize_rows(beta2=0.95, eps=1e-08, view='flatten'),
  scale_by_shape(rule='original', view='flatten'),
  add_decoupled_weight_decay(weight_decay=0.01, cautious=True),
  scale_by_learning_rate(lr=0.02),
)
group 1: 3 params in 3 buckets, chain(
  scale_by_adam(betas=(0.9, 0.95), eps=1e-08),
  add_decoupled_weight_decay(weight_decay=0.1, min_ndim=2, cautious=True),
  scale_by_learning_rate(lr=0.001),
)""",
        )

    def test_bad_values(self):
        def msg(fn, *args, **kwargs):
            with self.assertRaises((TypeError, ValueError)) as cm:
                fn(*args, **kwargs)
            return str(cm.exception)

        self.assertExpectedInline(
            msg(mf.add_decoupled_weight_decay, 0.1, cautious=1),
            """Invalid cautious: 1 (expected True or False)""",
        )
        self.assertExpectedInline(
            msg(mf.muon, cautious_weight_decay="yes"),
            """Invalid cautious_weight_decay: 'yes' (expected True or False)""",
        )
        self.assertExpectedInline(
            msg(mf.adamw, cautious_weight_decay=None),
            """Invalid cautious_weight_decay: None (expected True or False)""",
        )
        self.assertExpectedInline(
            msg(mf.MuonOptimizer, [torch.zeros(2, 2, requires_grad=True)], cautious_weight_decay=0),
            """Invalid cautious_weight_decay: 0 (expected True or False)""",
        )
