"""AdaMuon (Si et al., *AdaMuon: Adaptive Muon Optimizer*, arXiv:2507.11005), per matrix W (m×n):

    M ← momentum of G
    O = msign(Sign(M))                      sign-stabilized orthogonal update (msign(M): no sign)
    V ← β·V + (1 − β)·O ⊙ O                 element-wise second moment, β = the momentum's
    Ô = O ⊘ (√V + ε)
    W ← W − η·(γ·Ô + λ·W),  γ = 0.2·√(mn)/‖Ô‖_F     RMS-aligned: update RMS 0.2·η

Checked against those lines written out in float64 (with Keller's quintic as msign), transform
by transform and as the ``adamuon`` and ``adamuon_nosign`` recipes (their defaults: the authors'
one β, sign on, lr 6e-4, decay 0.1); the optimizers (compiled and eager, FSDP at W = 1,
checkpoints old and new); and Moonlight's RMS-matched shape rule through
``create_hybrid_optimizer``.
"""

from __future__ import annotations

import copy
import math

import expecttest
import optree
import pytest
import torch
import torch.nn as nn
from hypothesis import given
from hypothesis import strategies as st

import muon_fn as mf
from muon_fn.fsdp import FSDPMuonOptimizer
from muon_fn.optim import to_torch_state_dict

KELLER = (3.4445, -4.7750, 2.0315)


def quintic_msign(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Keller Jordan's quintic Newton–Schulz iteration, written out (float64 in these tests)."""
    a, b, c = KELLER
    tall = g.shape[0] > g.shape[1]
    x = g.T if tall else g
    x = x / max(float(torch.linalg.norm(x)), eps)
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if tall else x


def adamuon_reference(w0, grads, *, lr, mu, beta2, eps, wd, sign=True):
    """AdaMuon's lines for one matrix over the steps of ``grads`` (SGD-form Nesterov momentum,
    muon_fn's default: msign, the sign and the RMS alignment make its scale irrelevant).
    ``mu`` and ``beta2`` are floats or one value per step."""
    w, b, v = w0.clone(), torch.zeros_like(w0), torch.zeros_like(w0)
    m, n = w0.shape[0], math.prod(w0.shape[1:])
    mus = mu if isinstance(mu, list) else [mu] * len(grads)
    beta2s = beta2 if isinstance(beta2, list) else [beta2] * len(grads)
    for g, mu, beta2 in zip(grads, mus, beta2s):
        b = mu * b + g
        big_m = (g + mu * b).reshape(m, n)
        o = quintic_msign(torch.sign(big_m) if sign else big_m)
        v = beta2 * v + (1 - beta2) * (o * o).reshape(w0.shape)
        o_hat = o.reshape(w0.shape) / (v.sqrt() + eps)
        gamma = 0.2 * math.sqrt(m * n) / torch.linalg.norm(o_hat)
        w = w - lr * (gamma * o_hat + wd * w)
    return w


def run(tx, params, grads_per_step):
    state = tx.init(params)
    for grads in grads_per_step:
        updates, state = tx.update(grads, state, params)
        params = mf.apply_updates(params, updates)
    return params, state


shape = st.sampled_from([(4, 6), (7, 3), (5, 5), (3, 2, 2, 2)])  # wide, tall, square, conv (3x8)


@given(shape, st.integers(0, 2**16), st.sampled_from([None, 0.9, 0.95, 0.999]), st.booleans())
def test_recipe_is_the_papers_update(w_shape, seed, beta2, sign):
    gen = torch.Generator().manual_seed(seed)
    w0 = torch.randn(w_shape, generator=gen, dtype=torch.float64)
    grads = [torch.randn(w_shape, generator=gen, dtype=torch.float64) for _ in range(4)]
    tx = mf.adamuon(
        0.01, 0.9, beta2, weight_decay=0.1, sign=sign, method="quintic", ns_dtype=torch.float64
    )
    (w,), _ = run(tx, (w0,), [(g,) for g in grads])
    want = adamuon_reference(
        w0,
        grads,
        lr=0.01,
        mu=0.9,
        beta2=0.9 if beta2 is None else beta2,
        eps=1e-8,
        wd=0.1,
        sign=sign,
    )
    torch.testing.assert_close(w, want, rtol=1e-10, atol=1e-12)


def test_defaults_are_the_authors():
    """One β for both moments (the momentum's), the sign, no bias correction, lr 6e-4, decay 0.1."""
    assert repr(mf.adamuon()) == repr(
        mf.muon(
            6e-4,
            0.95,
            adjust_lr_fn="match_rms_adamw",
            weight_decay=0.1,
            adamuon_beta2=0.95,
            adamuon_sign=True,
        )
    )
    assert "scale_by_second_moment(beta2=0.9," in repr(mf.adamuon(momentum=0.9))
    assert "scale_by_second_moment(beta2=0.999," in repr(mf.adamuon(momentum=0.9, beta2=0.999))
    assert repr(mf.adamuon_nosign()) == repr(mf.adamuon(sign=False))
    assert repr(mf.adamuon_nosign(0.01, 0.9, 0.99, weight_decay=0.0)) == repr(
        mf.adamuon(0.01, 0.9, 0.99, weight_decay=0.0, sign=False)
    )


def test_second_moment_follows_a_scheduled_momentum():
    """A 0-d tensor momentum is the second moment's β too: a schedule that changes it in place
    moves both, step by step."""
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(5, 7, generator=gen, dtype=torch.float64)
    grads = [torch.randn(5, 7, generator=gen, dtype=torch.float64) for _ in range(3)]
    mu = torch.tensor(0.9, dtype=torch.float64)
    tx = mf.adamuon(0.01, mu, weight_decay=0.1, method="quintic", ns_dtype=torch.float64)
    params, state = (w0,), tx.init((w0,))
    for g, value in zip(grads, (0.9, 0.8, 0.6)):
        mu.fill_(value)
        updates, state = tx.update((g,), state, params)
        params = mf.apply_updates(params, updates)
    want = adamuon_reference(
        w0, grads, lr=0.01, mu=[0.9, 0.8, 0.6], beta2=[0.9, 0.8, 0.6], eps=1e-8, wd=0.1
    )
    torch.testing.assert_close(params[0], want, rtol=1e-10, atol=1e-12)


def test_nosign_is_the_first_versions_formula():
    """``adamuon_nosign``: O = msign(M) of the momentum itself, then AdaMuon's moment (β = μ),
    RMS alignment, decay and lr: two steps written out by hand from the same tensors."""
    gen = torch.Generator().manual_seed(3)
    w0 = torch.randn(6, 4, generator=gen, dtype=torch.float64)
    g1, g2 = (torch.randn(6, 4, generator=gen, dtype=torch.float64) for _ in range(2))
    lr, mu, wd, eps = 0.01, 0.9, 0.1, 1e-8
    tx = mf.adamuon_nosign(lr, mu, weight_decay=wd, method="quintic", ns_dtype=torch.float64)
    (w,), _ = run(tx, (w0,), [(g1,), (g2,)])
    # step 1: b = g1, M = g1 + μ·g1; V = (1 − μ)·O²
    o1 = quintic_msign(g1 + mu * g1)
    v1 = (1 - mu) * o1 * o1
    u1 = o1 / (v1.sqrt() + eps)
    w1 = w0 * (1 - lr * wd) - lr * 0.2 * math.sqrt(24) * u1 / torch.linalg.norm(u1)
    # step 2: b = g2 + μ·g1, M = g2 + μ·b; V = μ·V + (1 − μ)·O²
    b2 = g2 + mu * g1
    o2 = quintic_msign(g2 + mu * b2)
    v2 = mu * v1 + (1 - mu) * o2 * o2
    u2 = o2 / (v2.sqrt() + eps)
    w2 = w1 * (1 - lr * wd) - lr * 0.2 * math.sqrt(24) * u2 / torch.linalg.norm(u2)
    torch.testing.assert_close(w, w2, rtol=1e-10, atol=1e-12)
    # the sign changes the direction: the signed recipe's first step is not this one
    (w_sign,), _ = run(
        mf.adamuon(lr, mu, weight_decay=wd, method="quintic", ns_dtype=torch.float64),
        (w0,),
        [(g1,)],
    )
    assert not torch.allclose(w_sign, w1)


def test_update_rms_is_exactly_0_2_lr():
    gen = torch.Generator().manual_seed(0)
    params = (
        torch.randn(6, 10, generator=gen, dtype=torch.float64),
        torch.randn(12, 4, generator=gen, dtype=torch.float64),
    )
    tx = mf.adamuon(1e-3, weight_decay=0.0, ns_dtype=torch.float64)
    state = tx.init(params)
    for _ in range(3):
        grads = tuple(torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in params)
        updates, state = tx.update(grads, state, params)
        for u in updates:
            torch.testing.assert_close(
                u.square().mean().sqrt(),
                torch.tensor(0.2e-3, dtype=torch.float64),
                rtol=1e-12,
                atol=0,
            )


def test_recipe_is_muon_with_adamuon_beta2():
    a = mf.adamuon(0.02, 0.95, 0.99, weight_decay=0.01)
    b = mf.muon(0.02, 0.95, adjust_lr_fn="match_rms_adamw", weight_decay=0.01, adamuon_beta2=0.99)
    assert repr(a) == repr(b)
    assert "scale_by_sign" not in repr(mf.adamuon(sign=False))


# ----------------------------------------------------------------------------- the transforms
@given(
    st.lists(st.floats(-1e3, 1e3), min_size=1, max_size=12),
    st.integers(1, 4),
    st.floats(0.0, 0.999),
    st.floats(1e-10, 1e-2),
)
def test_second_moment_is_the_formula(values, steps, beta2, eps):
    o = torch.tensor(values, dtype=torch.float64)
    tx = mf.scale_by_second_moment(beta2, eps)
    state = tx.init((o,))
    v = torch.zeros_like(o)
    for k in range(1, steps + 1):
        o_k = o * k  # a different update every step
        (out,), state = tx.update((o_k,), state)
        v = beta2 * v + (1 - beta2) * o_k * o_k
        torch.testing.assert_close(out, o_k / (v.sqrt() + eps), rtol=1e-14, atol=0)
    torch.testing.assert_close(state.nu[0], v, rtol=1e-14, atol=0)


def test_second_moment_state_dtype_and_missing_updates(device):
    params = (
        torch.zeros(3, 4, dtype=torch.bfloat16, device=device),
        torch.zeros(2, 2, device=device),
    )
    tx = mf.scale_by_second_moment()
    state = tx.init(params)
    assert [v.dtype for v in state.nu] == [torch.float32, torch.float32]
    u = torch.ones(3, 4, dtype=torch.bfloat16, device=device)
    (out, missing), new = tx.update((u, None), state)
    assert out.dtype == torch.bfloat16 and missing is None and new.nu[1] is state.nu[1]
    torch.testing.assert_close(new.nu[0], torch.full((3, 4), 1e-3, device=device))


def test_sign_is_elementwise_and_keeps_zeros(device):
    u = torch.tensor([[-2.5, 0.0], [3.0, -0.0]], device=device)
    (out,), _ = mf.scale_by_sign().update((u,), ())
    assert torch.equal(out, torch.tensor([[-1.0, 0.0], [1.0, 0.0]], device=device))


def align_reference(u: torch.Tensor) -> torch.Tensor:
    m, n = u.shape
    return u * math.sqrt(min(m, n)) / torch.linalg.norm(u)


@given(st.integers(1, 7), st.integers(1, 7), st.integers(0, 2**16), st.floats(1e-6, 1e6))
def test_align_rms_gives_the_rms_of_an_orthogonal_matrix(m, n, seed, scale):
    u = (
        torch.randn(m, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        * scale
    )
    (out,), _ = mf.align_rms().update((u,), ())
    torch.testing.assert_close(out, align_reference(u), rtol=1e-13, atol=0)
    torch.testing.assert_close(
        out.square().mean().sqrt(), torch.tensor(1 / math.sqrt(max(m, n)), dtype=torch.float64)
    )


def test_align_rms_per_matrix_of_the_view(device):
    gen = torch.Generator().manual_seed(0)
    stack = torch.randn(3, 4, 6, generator=gen, dtype=torch.float64).to(device)
    stack[1] *= 100.0
    (out,), _ = mf.align_rms(view="experts").update((stack,), ())
    for e in range(3):
        torch.testing.assert_close(out[e], align_reference(stack[e]))
    fused = torch.randn(9, 4, generator=gen, dtype=torch.float64).to(device)
    (out,), _ = mf.align_rms(view=mf.heads(rows=(3, 6))).update((fused,), ())
    torch.testing.assert_close(
        out, torch.cat([align_reference(fused[:3]), align_reference(fused[3:])])
    )
    conv = torch.randn(4, 2, 3, 3, generator=gen, dtype=torch.float64).to(device)
    (out,), _ = mf.align_rms().update((conv,), ())
    torch.testing.assert_close(out, align_reference(conv.reshape(4, 18)).reshape(conv.shape))


def test_zero_in_zero_out(device):
    zeros = torch.zeros(4, 6, device=device)
    tx = mf.adamuon()
    params = (torch.randn(4, 6, device=device),)
    updates, state = tx.update((zeros,), tx.init(params), params)
    assert torch.isfinite(updates[0]).all()
    torch.testing.assert_close(updates[0], -6e-4 * 0.1 * params[0])  # the decay alone
    (aligned,), _ = mf.align_rms().update((zeros,), ())
    assert torch.equal(aligned, zeros)


# ----------------------------------------------------------------------------- the optimizers
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(12, 6)
        self.conv = nn.Conv1d(6, 6, 3, padding=1)
        self.fc1 = nn.Linear(6, 10)
        self.fc2 = nn.Linear(10, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 12, bias=False)

    def forward(self, idx):
        h = self.conv(self.emb(idx).transpose(1, 2)).transpose(1, 2)
        h = torch.tanh(self.fc1(torch.tanh(h)))
        return self.head(self.norm(torch.tanh(self.fc2(h))))


def loss_of(model, t):
    gen = torch.Generator().manual_seed(t)
    idx = torch.randint(0, 12, (4, 5), generator=gen).to(model.emb.weight.device)
    logits = model(idx).float()
    return nn.functional.cross_entropy(logits.flatten(0, 1), torch.roll(idx, 1, 1).flatten())


def train(model, opt, steps, start=0):
    for t in range(start, start + steps):
        opt.zero_grad()
        loss_of(model, t).backward()
        opt.step()


def assert_same(model, opt, ref, ref_opt, **tol):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, msg=name, **(tol or {"rtol": 0, "atol": 0}))
        assert sorted(opt.state[p]) == sorted(ref_opt.state[q]), name
        for key, value in ref_opt.state[q].items():
            torch.testing.assert_close(
                opt.state[p][key], value, msg=f"{name} {key}", **(tol or {"rtol": 0, "atol": 0})
            )


KW = dict(lr=0.02, adamuon_beta2=0.95, weight_decay=0.01, matrix_view="flatten")


def test_optimizer_state_is_fp32_and_named(device):
    torch.manual_seed(0)
    model = Net().to(device=device, dtype=torch.bfloat16)
    opt = mf.MuonOptimizer(model.parameters(), **KW)
    loss_of(model, 0).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))  # .grad untouched
    state = opt.state[model.fc1.weight]
    assert sorted(state) == ["momentum_buffer", "update_exp_avg_sq"]
    assert state["update_exp_avg_sq"].dtype == torch.float32 and state[
        "update_exp_avg_sq"
    ].shape == (10, 6)
    assert sorted(opt.state[model.fc1.bias]) == ["exp_avg", "exp_avg_sq", "step"]


def test_optimizer_runs_the_recipe():
    """MuonOptimizer(adamuon_beta2=...) is the muon recipe with it, on the matrices."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(6, 10, dtype=torch.float64))
    w_ref = w.detach().clone()
    opt = mf.MuonOptimizer(
        [w],
        lr=0.01,
        adamuon_beta2=0.9,
        weight_decay=0.1,
        adjust_lr_fn="match_rms_adamw",
        momentum_kind="sgd",
        method="quintic",
        ns_dtype=torch.float64,
    )
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(6, 10, generator=gen, dtype=torch.float64) for _ in range(3)]
    for g in grads:
        w.grad = g.clone()
        opt.step()
    want = adamuon_reference(w_ref, grads, lr=0.01, mu=0.95, beta2=0.9, eps=1e-8, wd=0.1)
    torch.testing.assert_close(w.detach(), want, rtol=1e-10, atol=1e-12)


def _pair(compile_option, **extra):
    torch.manual_seed(0)
    model = Net()
    other = copy.deepcopy(model)
    kw = dict(KW, cautious_weight_decay=True, **extra)
    return (
        model,
        mf.MuonOptimizer(model.parameters(), compile=False, **kw),
        other,
        mf.MuonOptimizer(other.parameters(), compile=compile_option, **kw),
    )


@pytest.mark.slow
def test_compiled_equals_eager():
    model, eager, other, compiled = _pair({"backend": "eager"})
    train(model, eager, 3)
    train(other, compiled, 3)
    assert_same(model, eager, other, compiled)


@pytest.mark.slow
def test_inductor_equals_eager():
    model, eager, other, compiled = _pair({}, adjust_lr_fn="match_rms_adamw")
    train(model, eager, 2)
    train(other, compiled, 2)
    assert_same(model, eager, other, compiled, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"adjust_lr_fn": "match_rms_adamw", "cautious_weight_decay": True, "adamuon_sign": False},
        {
            "matrix_view": {"fc1.weight": mf.heads(rows=2), "conv.weight": "flatten"},
            "ns_dtype": torch.bfloat16,
        },
    ],
    ids=["default", "rms_cautious_nosign", "heads_bf16"],
)
def test_fsdp_single_process_is_bit_exact_with_muon_optimizer(extra):
    """AdaMuon runs in the FSDP adapter: its second moment travels with the rows to the owner
    (a row state, like NorMuon's), the RMS alignment runs on the whole matrix there."""
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    kw = dict(KW, **extra)
    opt = FSDPMuonOptimizer(model, **kw)
    ref_opt = mf.MuonOptimizer(ref.named_parameters(), **kw)
    train(model, opt, 4)
    train(ref, ref_opt, 4)
    assert_same(model, opt, ref, ref_opt)
    # fc2.weight (8x10): its update_exp_avg_sq travels next to its update
    assert [(m.rows, m.cols) for m in opt.plan.matrices if tuple(m.shape) == (8, 10)] == [
        (8, 10 + 10)
    ]


def test_old_checkpoint_keeps_plain_muon():
    """A checkpoint saved before AdaMuon existed ran Muon: it loads with ``adamuon_beta2=None``,
    even into an optimizer built with AdaMuon, and continues bit for bit as that run would."""
    torch.manual_seed(0)
    model = Net()
    opt = mf.MuonOptimizer(model.parameters(), lr=0.02, weight_decay=0.01, matrix_view="flatten")
    train(model, opt, 2)
    saved = copy.deepcopy(opt.state_dict())
    for group in saved["param_groups"]:
        for key in ("adamuon_beta2", "adamuon_eps", "adamuon_sign", "cautious_weight_decay"):
            del group[key]
    resumed_model = copy.deepcopy(model)
    resumed = mf.MuonOptimizer(resumed_model.parameters(), **KW)
    resumed.load_state_dict(saved)
    assert resumed.param_groups[0]["adamuon_beta2"] is None
    train(model, opt, 2, start=2)
    train(resumed_model, resumed, 2, start=2)
    assert_same(model, opt, resumed_model, resumed)


def test_checkpoint_round_trip_continues_bit_for_bit():
    torch.manual_seed(0)
    model = Net().bfloat16()
    opt = mf.MuonOptimizer(model.parameters(), **KW)
    train(model, opt, 2)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    resumed = Net().bfloat16()
    resumed.load_state_dict(saved_model)
    ropt = mf.MuonOptimizer(resumed.parameters(), **dict(KW, adamuon_beta2=None))
    ropt.load_state_dict(saved_opt)
    assert ropt.param_groups[0]["adamuon_beta2"] == 0.95
    assert ropt.state[resumed.fc1.weight]["update_exp_avg_sq"].dtype == torch.float32
    train(model, opt, 2, start=2)
    train(resumed, ropt, 2, start=2)
    assert_same(resumed, ropt, model, opt)


def test_torch_conversion_refuses_adamuon():
    opt = mf.MuonOptimizer(nn.Linear(4, 4, bias=False).parameters(), adamuon_beta2=0.95)
    with pytest.raises(ValueError, match=r"adamuon_beta2=0.95 \(torch.optim.Muon's is None\)"):
        to_torch_state_dict(opt)


# ----------------------------------------------------------------------------- RMS-matched scale
def test_create_hybrid_optimizer_takes_moonlights_rms_matched_scale():
    """``adjust_lr_fn="match_rms_adamw"`` (0.2·√max(m, n), arXiv:2502.16982) reaches the Muon
    group: with an exact msign the first step's update has RMS 0.2·lr on every matrix."""
    torch.manual_seed(0)
    model = Net().double()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = mf.create_hybrid_optimizer(
        model,
        muon_lr=1e-3,
        muon_weight_decay=0.0,
        adjust_lr_fn="match_rms_adamw",
        method="cubic",
        ns_steps=60,
        ns_dtype=torch.float64,
    )
    assert "scale_by_shape(rule='match_rms_adamw'" in opt.describe().split("group 1")[0]
    train(model, opt, 1)
    names = opt.param_groups[0]["param_names"]
    assert names == ["conv.weight", "fc1.weight", "fc2.weight"]
    params = dict(model.named_parameters())
    for name in names:
        rms = (params[name].detach() - before[name]).square().mean().sqrt()
        torch.testing.assert_close(
            rms, torch.tensor(0.2e-3, dtype=torch.float64), rtol=1e-6, atol=0, msg=name
        )


def test_create_hybrid_optimizer_runs_adamuon_and_says_so():
    torch.manual_seed(0)
    model = Net()
    opt = mf.create_hybrid_optimizer(model, adamuon_beta2=0.95, adjust_lr_fn="match_rms_adamw")
    assert str(opt.split).startswith("AdaMuon: 3 tensors")
    assert "scale_by_second_moment(beta2=0.95, eps=1e-08)" in opt.describe()
    train(model, opt, 2)
    assert "update_exp_avg_sq" in opt.state[model.fc1.weight]
    assert "update_exp_avg_sq" not in opt.state[model.head.weight]  # the head is AdamW's


def test_nosign_variant_by_name_in_the_hybrid_and_in_train_specs():
    """``adamuon_sign=False`` through ``create_hybrid_optimizer`` and ``muon-fn train``'s spec
    ``muon[adamuon_beta2=0.95,adamuon_sign=false]``: the split names it, no sign transform runs."""
    from muon_fn.tools.train import optimizers

    torch.manual_seed(0)
    opt = mf.create_hybrid_optimizer(
        Net(), adamuon_beta2=0.95, adamuon_sign=False, adjust_lr_fn="match_rms_adamw"
    )
    assert str(opt.split).startswith("AdaMuon (no sign): 3 tensors")
    assert (
        "scale_by_sign" not in opt.describe()
        and "scale_by_second_moment(beta2=0.95" in opt.describe()
    )
    name, options = optimizers.parse_spec(
        "muon[weight_decay=0.01,adamuon_beta2=0.95,adamuon_sign=false,adjust_lr_fn=match_rms_adamw,lr=0.01]"
    )
    options.pop("lr")
    built, desc = optimizers.build_single(name, options, Net(), 0.01, 3e-3, 0.0, False)
    assert desc.endswith(
        "AdaMuon (no sign); weight_decay=0.01, adamw_weight_decay=0.0 on ndim >= 2"
    ), desc
    group = built.param_groups[0]
    assert (group["adamuon_beta2"], group["adamuon_sign"], group["beta2"]) == (0.95, False, None)
    # --fsdp: the same spec builds FSDPMuonOptimizer with AdaMuon and without NorMuon's default
    name, options = optimizers.parse_spec("muon[adamuon_beta2=0.95,adamuon_sign=false]")
    fsdp, _ = optimizers.build_fsdp(name, options, Net(), 0.01, 3e-3, 0.0, 1)
    group = fsdp.param_groups[0]
    assert (group["adamuon_beta2"], group["adamuon_sign"], group["beta2"]) == (0.95, False, None)


class TestAdaMuonExpect(expecttest.TestCase):
    def test_recipe_repr(self):
        self.assertExpectedInline(
            repr(mf.adamuon()),
            """\
chain(
  momentum(momentum=0.95, nesterov=True, kind='sgd'),
  scale_by_sign(),
  orthogonalize(method='quintic', steps=5, dtype=None, eps=1e-07, stepsize=1.0, view='flatten'),
  scale_by_second_moment(beta2=0.95, eps=1e-08),
  align_rms(eps=1e-08, view='flatten'),
  scale_by_shape(rule='match_rms_adamw', view='flatten'),
  add_decoupled_weight_decay(weight_decay=0.1),
  scale_by_learning_rate(lr=0.0006),
)""",
        )

    def test_state_structure(self):
        params = {"w": torch.zeros(8, 4, dtype=torch.bfloat16), "conv": torch.zeros(4, 2, 3, 3)}
        state = mf.adamuon().init(params)
        shown = optree.tree_map(
            lambda t: f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}",
            state,
            namespace="muon_fn",
        )
        self.assertExpectedInline(
            str(shown),
            """(MomentumState(mu={'w': '(8, 4) bfloat16', 'conv': '(4, 2, 3, 3) float32'}), EmptyState(), EmptyState(), ScaleBySecondMomentState(nu={'w': '(8, 4) float32', 'conv': '(4, 2, 3, 3) float32'}), EmptyState(), EmptyState(), EmptyState(), EmptyState())""",  # noqa: E501
        )

    def test_split(self):
        torch.manual_seed(0)
        model = nn.Sequential()
        model.add_module("emb", nn.Embedding(10, 4))
        model.add_module("hidden", nn.Linear(4, 8))
        model.add_module("out", nn.Linear(8, 10, bias=False))
        opt = mf.create_hybrid_optimizer(model, adamuon_beta2=0.95)
        self.assertExpectedInline(
            str(opt.split).splitlines()[0],
            """AdaMuon: 1 tensors, 32 parameters; weight decay 0.01""",
        )

    def test_bad_values(self):
        def msg(fn, *args, **kwargs):
            with self.assertRaises((TypeError, ValueError)) as cm:
                fn(*args, **kwargs)
            return str(cm.exception)

        p = [torch.zeros(2, 2, requires_grad=True)]
        self.assertExpectedInline(
            msg(mf.scale_by_second_moment, 1.0), """Invalid beta2: 1.0 (expected 0 <= beta2 < 1)"""
        )
        self.assertExpectedInline(
            msg(mf.scale_by_second_moment, 0.9, 0.0),
            """Invalid eps: 0.0 (expected a finite value > 0)""",
        )
        self.assertExpectedInline(
            msg(mf.scale_by_second_moment, 0.9, float("nan")),
            """Invalid eps: nan (expected a finite value > 0)""",
        )
        self.assertExpectedInline(
            msg(mf.align_rms, -1e-8), """Invalid eps: -1e-08 (expected a finite value > 0)"""
        )
        self.assertExpectedInline(
            msg(mf.align_rms().update, [torch.zeros(3)], ()),
            """align_rms only supports matrices (ndim >= 2) whereas we found a leaf with size: (3,). Route 0-/1-D parameters (biases, norms) to another transform with muon_fn.partition, e.g. muon_fn.hybrid(...), or use muon_fn.MuonOptimizer / muon_fn.create_hybrid_optimizer, which do this for you.""",  # noqa: E501
        )
        self.assertExpectedInline(
            msg(mf.adamuon, beta2=-0.1), """Invalid beta2: -0.1 (expected 0 <= beta2 < 1)"""
        )
        self.assertExpectedInline(
            msg(mf.adamuon, sign=1), """Invalid sign: 1 (expected True or False)"""
        )
        self.assertExpectedInline(
            msg(mf.adamuon, momentum=1.0), """Invalid momentum: 1.0 (expected 0 <= momentum < 1)"""
        )
        self.assertExpectedInline(
            msg(mf.adamuon_nosign, sign=True),
            """adamuon_nosign() takes no sign= (it is adamuon(sign=False)); use adamuon(sign=...)""",
        )
        self.assertExpectedInline(
            msg(mf.adamuon, adamuon_eps=0.0),
            """Invalid adamuon_eps: 0.0 (expected a finite value > 0)""",
        )
        self.assertExpectedInline(
            msg(mf.muon, adamuon_beta2=1.0),
            """Invalid adamuon_beta2: 1.0 (expected 0 <= adamuon_beta2 < 1)""",
        )
        self.assertExpectedInline(
            msg(mf.muon, beta2=0.95, adamuon_beta2=0.95),
            """beta2=0.95 (NorMuon) and adamuon_beta2=0.95 (AdaMuon) both normalize the orthogonalized update; pass one of them (the other None)""",  # noqa: E501
        )
        self.assertExpectedInline(
            msg(mf.normuon, adamuon_beta2=0.9),
            """beta2=0.95 (NorMuon) and adamuon_beta2=0.9 (AdaMuon) both normalize the orthogonalized update; pass one of them (the other None)""",  # noqa: E501
        )
        self.assertExpectedInline(
            msg(mf.MuonOptimizer, p, adamuon_beta2=1.0),
            """Invalid adamuon_beta2 value: 1.0 (expected 0 <= adamuon_beta2 < 1, or None for Muon)""",
        )
        self.assertExpectedInline(
            msg(mf.MuonOptimizer, p, adamuon_eps=0.0),
            """Invalid adamuon_eps value: 0.0 (expected > 0)""",
        )
        self.assertExpectedInline(
            msg(mf.MuonOptimizer, p, adamuon_sign="no"),
            """Invalid adamuon_sign: 'no' (expected True or False)""",
        )
        self.assertExpectedInline(
            msg(mf.MuonOptimizer, p, beta2=0.95, adamuon_beta2=0.9),
            """beta2=0.95 (NorMuon) and adamuon_beta2=0.9 (AdaMuon) both normalize the orthogonalized update; pass one of them (the other None)""",  # noqa: E501
        )
        self.assertExpectedInline(
            msg(FSDPMuonOptimizer, nn.Linear(2, 2), beta2=0.95, adamuon_beta2=0.9),
            """beta2=0.95 (NorMuon) and adamuon_beta2=0.9 (AdaMuon) both normalize the orthogonalized update; pass one of them (the other None)""",  # noqa: E501
        )
