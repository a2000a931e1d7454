"""The in-place path of MuonOptimizer (``foreach=None``, the default) against the functional
transforms (``foreach=False``, the ``muon`` recipe through the adapter): the same math to rounding
for every option it supports, and a fall back to the transforms for the options it does not."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import muon_fn as mf


class Net(nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.qkv = nn.Linear(16, 48)  # tall, split into 3 square blocks
        self.fc = nn.Linear(16, 64)  # tall
        self.proj = nn.Linear(64, 16)  # wide
        self.sq1 = nn.Linear(16, 16, bias=False)
        self.sq2 = nn.Linear(16, 16, bias=False)
        self.norm = nn.LayerNorm(16)
        self.to(dtype)


def set_grads(model, t, *, scale=1.0, skip=()):
    g = torch.Generator().manual_seed(100 + t)
    for name, p in model.named_parameters():
        p.grad = None if name in skip else (torch.randn(p.shape, generator=g) * scale).to(p.dtype)


def pair(dtype=torch.float32, **kw):
    torch.manual_seed(0)
    a = Net(dtype)
    b = copy.deepcopy(a)
    kw = {"weight_decay": 0.01, "ns_dtype": torch.float32, **kw}
    fast = mf.MuonOptimizer(a.parameters(), **kw)
    ref = mf.MuonOptimizer(b.parameters(), foreach=False, **kw)
    return a, fast, b, ref


def inplace_count(opt):
    return sum(len(rt.inplace.indices) for rt in opt._runtimes if rt.inplace is not None)


def assert_same(a, fast, b, ref, atol=1e-6, rtol=1e-6):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")
        assert set(fast.state[p]) == set(ref.state[q]), name
        for key, value in ref.state[q].items():
            torch.testing.assert_close(fast.state[p][key], value, atol=atol, rtol=rtol,
                                       msg=lambda m: f"{name} {key}: {m}")


CASES = {
    "default": {},
    "no-nesterov": {"nesterov": False},
    "sgd": {"momentum_kind": "sgd"},
    "sgd-no-nesterov": {"momentum_kind": "sgd", "nesterov": False},
    "no-wd": {"weight_decay": 0.0},
    "match_rms_adamw": {"adjust_lr_fn": "match_rms_adamw"},
    "spectral": {"adjust_lr_fn": "spectral"},
    "legacy": {"adjust_lr_fn": "legacy"},
    "none": {"adjust_lr_fn": "none"},
    "split": {"split": lambda w: [16, 16, 16] if w.shape[0] == 48 else None},
    "aol4": {"method": "aol", "ns_steps": 4},
    "quintic-stepsize": {"method": "quintic", "ns_stepsize": 0.9, "ns_eps": 1e-6},
    "coefficients": {"ns_coefficients": [(3.4445, -4.7750, 2.0315)], "ns_steps": 3},
    "muon-group": {"algorithm": "muon"},
    "accumulation": {"gradient_accumulation_steps": 2},
    "skip": {"nonfinite": "skip"},
    "no-check": {"nonfinite": None},
    "momentum-tensor-lr": {"lr": torch.tensor(0.01)},
}


@pytest.mark.parametrize("case", list(CASES))
def test_inplace_equals_functional_fp32(case):
    kw = dict(CASES[case])
    a, fast, b, ref = pair(**kw) if case != "muon-group" else _muon_groups()
    assert inplace_count(fast) > 0 and inplace_count(ref) == 0
    for t in range(4):
        for m in (a, b):
            set_grads(m, t, skip=("sq2.weight",) if t == 1 else ())
        fast.step()
        ref.step()
    assert_same(a, fast, b, ref)


def _muon_groups():
    torch.manual_seed(0)
    a = Net()
    b = copy.deepcopy(a)

    def groups(m):
        mats = [p for p in m.parameters() if p.ndim >= 2]
        rest = [p for p in m.parameters() if p.ndim < 2]
        return [{"params": mats, "algorithm": "muon"}, {"params": rest, "algorithm": "adamw", "lr": 1e-3}]

    kw = {"weight_decay": 0.01, "ns_dtype": torch.float32}
    return a, mf.MuonOptimizer(groups(a), **kw), b, mf.MuonOptimizer(groups(b), foreach=False, **kw)


def test_inplace_equals_functional_default_bf16_compute():
    """Default compute dtype (bf16): the same bf16 inputs, so the same iteration; fp32 tail."""
    a, fast, b, ref = pair(ns_dtype=None)
    for t in range(3):
        set_grads(a, t)
        set_grads(b, t)
        fast.step()
        ref.step()
    assert_same(a, fast, b, ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("momentum_dtype", [None, torch.float32])
def test_inplace_bf16_params(momentum_dtype):
    a, fast, b, ref = pair(torch.bfloat16, momentum_dtype=momentum_dtype)
    assert inplace_count(fast) > 0
    for t in range(3):
        set_grads(a, t)
        set_grads(b, t)
        fast.step()
        ref.step()
    # The in-place path rounds once (p + α·O in fp32, then bf16); the transforms round O·s, ·lr
    # and p + u in bf16 each. Both land within a bf16 ulp or two of each other.
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert p.dtype == torch.bfloat16
        torch.testing.assert_close(p.float(), q.float(), atol=2e-2, rtol=1e-2, msg=lambda m: f"{name}: {m}")
        for key, value in ref.state[q].items():
            assert fast.state[p][key].dtype == value.dtype
            torch.testing.assert_close(fast.state[p][key].float(), value.float(), atol=2e-2, rtol=2e-2)


def test_inplace_matches_torch_muon_like_torch():
    """Configured like torch.optim.Muon, the in-place path follows it (fp32 iteration)."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(32, 48))
    w2 = nn.Parameter(w.detach().clone())
    ours = mf.MuonOptimizer([w], lr=0.02, method="quintic", adjust_lr_fn="original", weight_decay=0.1,
                            ns_dtype=torch.float32)
    assert inplace_count(ours) == 1
    theirs = torch.optim.Muon([w2], lr=0.02, weight_decay=0.1, adjust_lr_fn="original")
    from torch.optim import _muon as tm

    original = tm._zeropower_via_newtonschulz
    tm._zeropower_via_newtonschulz = lambda g, c, s, e: mf.newton_schulz(g, "quintic", s, dtype=torch.float32, eps=e)
    try:
        for t in range(5):
            g = torch.Generator().manual_seed(t)
            w.grad = torch.randn(w.shape, generator=g)
            w2.grad = w.grad.clone()
            ours.step()
            theirs.step()
    finally:
        tm._zeropower_via_newtonschulz = original
    torch.testing.assert_close(w, w2, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.state[w]["momentum_buffer"], theirs.state[w2]["momentum_buffer"],
                               atol=1e-6, rtol=0)


def test_step_never_modifies_grad():
    a, fast, _, _ = pair()
    set_grads(a, 0)
    before = {n: p.grad.clone() for n, p in a.named_parameters()}
    fast.step()
    fast.step()
    for n, p in a.named_parameters():
        assert torch.equal(p.grad, before[n]), n


@pytest.mark.parametrize("kw,why", [
    ({"beta2": 0.95}, "NorMuon"),
    ({"method": lambda x: mf.polar_express(x)}, "callable method"),
])
def test_unsupported_options_fall_back(kw, why):
    torch.manual_seed(0)
    m = Net()
    opt = mf.MuonOptimizer(m.parameters(), **kw)
    assert inplace_count(opt) == 0, why
    set_grads(m, 0)
    opt.step()


def test_channels_last_conv_falls_back_per_parameter():
    a, fast, b, ref = pair()
    for m in (a, b):
        m.conv.to(memory_format=torch.channels_last)
    fast = mf.MuonOptimizer(a.parameters(), weight_decay=0.01, ns_dtype=torch.float32)
    ref = mf.MuonOptimizer(b.parameters(), weight_decay=0.01, ns_dtype=torch.float32, foreach=False)
    plan = fast._runtimes[0].inplace
    assert a.conv.weight.ndim == 4 and not a.conv.weight.is_contiguous()
    assert list(a.parameters()).index(a.conv.weight) not in plan.indices
    assert inplace_count(fast) == 5  # qkv, fc, proj, sq1, sq2
    for t in range(3):
        set_grads(a, t)
        set_grads(b, t)
        fast.step()
        ref.step()
    assert_same(a, fast, b, ref)


def test_nonfinite_error_leaves_every_group_unchanged():
    """One check over all groups before any update (group 0 finite, group 1 not)."""
    torch.manual_seed(0)
    m = Net()
    mats = [p for p in m.parameters() if p.ndim >= 2]
    opt = mf.MuonOptimizer([{"params": mats[:3]}, {"params": mats[3:]}])
    set_grads(m, 0)
    opt.step()
    params = [p.detach().clone() for p in m.parameters()]
    state = {p: {k: v.clone() for k, v in opt.state[p].items()} for p in mats}
    set_grads(m, 1)
    mats[-1].grad[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite"):
        opt.step()
    for p, q in zip(m.parameters(), params):
        assert torch.equal(p, q)
    for p in mats:
        for k, v in state[p].items():
            assert torch.equal(opt.state[p][k], v)
    assert opt.nonfinite_steps == 1


def test_resume_is_bit_exact():
    def build(m):
        return mf.MuonOptimizer(m.parameters(), weight_decay=0.01)

    torch.manual_seed(0)
    a = Net()
    b = copy.deepcopy(a)
    opt_a = build(a)
    for t in range(5):
        set_grads(a, t)
        opt_a.step()
    opt_b = build(b)
    for t in range(3):
        set_grads(b, t)
        opt_b.step()
    sd = copy.deepcopy(opt_b.state_dict())
    opt_c = build(b)
    opt_c.load_state_dict(sd)
    for t in range(3, 5):
        set_grads(b, t)
        opt_c.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_workspace_is_not_state():
    a, fast, _, ref = pair()
    set_grads(a, 0)
    fast.step()
    nbytes = sum(v.numel() * v.element_size() for st in fast.state.values() for v in st.values())
    mom = sum(p.numel() * 4 for p in a.parameters() if p.ndim >= 2)
    adam = sum(p.numel() * 8 + 4 for p in a.parameters() if p.ndim < 2)
    assert nbytes == mom + adam
    assert "workspace" not in str(fast.state_dict())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tall_matrix_layout_paths_are_bitwise_the_plain_ones(dtype):
    """Tall matrices run in wide orientation; their scale-and-cast and their final add go through a
    scratch in the matrix's own layout (fast same-dtype transposed copies) instead of strided
    ops. Both must give exactly what the plain strided ops give."""
    from muon_fn._muon import add_update_
    from muon_fn._orthogonalize import is_transposed_view, normalize_into

    gen = torch.Generator().manual_seed(3)
    tall = torch.randn(96, 40, generator=gen) * 1e-3
    assert is_transposed_view(tall.mT) and not is_transposed_view(tall)
    fast = torch.empty(40, 96, dtype=dtype)
    normalize_into(tall.mT, fast, norm_scale=1.01, eps=1e-7, scratch=torch.empty(96, 40, dtype=dtype))
    inv = 1.0 / (1.01 * torch.linalg.vector_norm(tall) + 1e-7)
    plain = torch.mul(tall.mT, inv, out=torch.empty(40, 96, dtype=dtype))
    assert torch.equal(fast, plain)
    p = torch.randn(96, 40, generator=gen)
    q = p.clone()
    add_update_(p, fast, -0.013, torch.empty(96, 40, dtype=dtype))
    q.add_(plain.mT, alpha=-0.013)
    assert torch.equal(p, q)
