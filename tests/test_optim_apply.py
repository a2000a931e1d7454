"""The generic apply behind every optimizer class: ``tx.update`` per same-shape bucket, written
back in place, compiled or eager. For every option of ``MuonOptimizer`` the compiled step (Dynamo
graphs run by the ``eager`` backend: the same ATen ops) equals the eager step bit for bit, on a
model with conv, fused-QKV, tall, wide and square matrices and 1-D parameters."""

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
        self.qkv = nn.Linear(16, 48)  # tall, cut into 3 square blocks by the "heads" case
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
    compiled = mf.MuonOptimizer(a.parameters(), compile={"backend": "eager"}, **kw)
    eager = mf.MuonOptimizer(b.parameters(), compile=False, **kw)
    return a, compiled, b, eager


def assert_bitwise(a, opt_a, b, opt_b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
        assert set(opt_a.state[p]) == set(opt_b.state[q]), name
        for key, value in opt_b.state[q].items():
            assert torch.equal(opt_a.state[p][key], value), (name, key)


CASES = {
    "default": {},
    "sgd-no-nesterov": {"momentum_kind": "sgd", "nesterov": False},
    "heads-spectral": {
        "matrix_view": lambda w: mf.heads(rows=3) if w.shape == (48, 16) else "flatten",
        "adjust_lr_fn": "spectral",
    },
    "coefficients-stepsize": {
        "ns_coefficients": [(3.4445, -4.7750, 2.0315)],
        "ns_steps": 3,
        "ns_stepsize": 0.9,
    },
    "normuon-aol4": {"beta2": 0.95, "method": "aol", "ns_steps": 4},
    "callable-method": {"method": lambda x: x / (torch.linalg.matrix_norm(x, keepdim=True) + 1e-7)},
    "accumulation-tensor-lr": {"gradient_accumulation_steps": 2, "lr": torch.tensor(0.01)},
    "no-check-no-wd": {"nonfinite": None, "weight_decay": 0.0},
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.slow
def test_compiled_equals_eager_bitwise(case):
    a, compiled, b, eager = pair(**CASES[case])
    for t in range(3):
        skip = ("sq2.weight",) if t == 1 else ()  # a parameter without a gradient in one step
        set_grads(a, t, skip=skip)
        set_grads(b, t, skip=skip)
        compiled.step()
        eager.step()
    assert_bitwise(a, compiled, b, eager)


@pytest.mark.slow
def test_matrix_only_group_compiled_equals_eager():
    torch.manual_seed(0)
    a = Net()
    b = copy.deepcopy(a)
    kw = dict(weight_decay=0.01, ns_dtype=torch.float32, algorithm="muon")
    compiled = mf.MuonOptimizer(
        [p for p in a.parameters() if p.ndim >= 2], compile={"backend": "eager"}, **kw
    )
    eager = mf.MuonOptimizer([p for p in b.parameters() if p.ndim >= 2], compile=False, **kw)
    for t in range(2):
        set_grads(a, t)
        set_grads(b, t)
        compiled.step()
        eager.step()
    assert_bitwise(a, compiled, b, eager)


def test_bucket_size_does_not_change_results():
    """Buckets only decide what runs together: every step is per matrix."""
    a, opt_a, b, _ = pair()
    opt_a = mf.MuonOptimizer(
        a.parameters(), compile=False, weight_decay=0.01, ns_dtype=torch.float32, bucket_size=1
    )
    opt_b = mf.MuonOptimizer(
        b.parameters(), compile=False, weight_decay=0.01, ns_dtype=torch.float32, bucket_size=64
    )
    assert len(opt_a._runtimes[0].buckets) > len(opt_b._runtimes[0].buckets)
    for t in range(3):
        set_grads(a, t)
        set_grads(b, t)
        opt_a.step()
        opt_b.step()
    assert_bitwise(a, opt_a, b, opt_b)


@pytest.mark.parametrize("momentum_dtype", [None, torch.float32])
def test_bf16_params(momentum_dtype):
    """bf16 parameters: the update is added in fp32 and rounded once (p.add_ of an fp32 update);
    the momentum buffer keeps momentum_dtype (default: the parameter's)."""
    a, compiled, b, eager = pair(torch.bfloat16, momentum_dtype=momentum_dtype)
    if momentum_dtype is None:  # compiled == eager is checked once, with the fp32 buffer
        compiled = mf.MuonOptimizer(
            a.parameters(), compile=False, weight_decay=0.01, ns_dtype=torch.float32
        )
    for t in range(3):
        set_grads(a, t)
        set_grads(b, t)
        compiled.step()
        eager.step()
    assert_bitwise(a, compiled, b, eager)
    for p in a.parameters():
        assert p.dtype == torch.bfloat16
        if p.ndim >= 2:
            assert compiled.state[p]["momentum_buffer"].dtype == (momentum_dtype or torch.bfloat16)


@pytest.mark.slow
def test_channels_last_conv():
    """A non-contiguous (channels_last) conv weight gets the same update as a contiguous one."""
    a, opt_a, b, opt_b = pair()
    a.conv.to(memory_format=torch.channels_last)
    assert not a.conv.weight.is_contiguous()
    opt_a = mf.MuonOptimizer(
        a.parameters(), compile={"backend": "eager"}, weight_decay=0.01, ns_dtype=torch.float32
    )
    for t in range(3):
        set_grads(a, t)
        set_grads(b, t)
        opt_a.step()
        opt_b.step()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-6)  # fp32 reductions in another order
    assert not a.conv.weight.is_contiguous()


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


@pytest.mark.slow
def test_persistent_state_is_torchs():
    """Muon matrices keep only torch.optim.Muon's momentum_buffer; AdamW params torch.optim.AdamW's."""
    a, opt, _, _ = pair()
    set_grads(a, 0)
    opt.step()
    nbytes = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values())
    mom = sum(p.numel() * 4 for p in a.parameters() if p.ndim >= 2)
    adam = sum(p.numel() * 8 + 4 for p in a.parameters() if p.ndim < 2)
    assert nbytes == mom + adam


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("update_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask", ["kept", "skipped", "per element"])
def test_the_guarded_write_is_where_ok_p_plus_u_else_p_bit_for_bit(dtype, update_dtype, mask):
    # every pair of special values, signed zeros and NaN included: adding the masked -0.0
    # leaves a kept parameter's bits as they are
    from muon_fn.engine._apply import _guarded_add

    values = torch.tensor(
        [0.0, -0.0, 1.0, -1.0, float("inf"), -float("inf"), float("nan"), 1e-30, -3.5]
    )
    p, u = (t.reshape(-1) for t in torch.meshgrid(values, values, indexing="ij"))
    p, u = p.to(dtype), u.to(update_dtype)
    ok = {
        "kept": torch.tensor(True),
        "skipped": torch.tensor(False),
        "per element": torch.arange(p.numel()) % 3 != 0,
    }[mask]
    expected = torch.where(ok, p + u, p).to(dtype)
    # the update alone holds its memory (masked in place), or a view of it is alive
    for sole in (True, False):
        target, update = p.clone(), u.clone()
        view = None if sole else update[:1]
        _guarded_add(target, update, ok)
        bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
        assert torch.equal(target.view(bits), expected.view(bits)), sole
        del view
