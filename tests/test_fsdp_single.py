"""FSDPMuonOptimizer in one process (no torch.distributed): W = 1, no communication.

The multi-rank behaviour is in tests/test_fsdp.py (marked distributed); these run everywhere.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import muon_fn as mf
from muon_fn.fsdp import FSDPMuonOptimizer


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3)  # 4-D weight, flattened to 4x18
        self.fc1 = nn.Linear(16, 10)
        self.fc2 = nn.Linear(10, 10)
        self.head = nn.Linear(10, 3)
        self.norm = nn.LayerNorm(10)

    def forward(self, x):
        x = torch.tanh(self.conv(x)).flatten(1)
        x = torch.tanh(self.fc1(x))
        x = self.norm(torch.tanh(self.fc2(x)))
        return self.head(x)


def batch(t: int):
    g = torch.Generator().manual_seed(t)
    return torch.randn(8, 2, 4, 4, generator=g), torch.randn(8, 3, generator=g)


def train(model, opt, steps, scheduler=None, start=0):
    for t in range(start, start + steps):
        x, y = batch(t)
        opt.zero_grad()
        (model(x) - y).square().mean().backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()


KW = dict(lr=0.02, momentum=0.95, weight_decay=0.01, ns_dtype=torch.float32)


def assert_models_equal(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"{name}: max abs error {(p - q).abs().max().item()}"


@pytest.mark.parametrize("extra", [
    {},
    {"momentum_kind": "sgd", "method": "quintic", "adjust_lr_fn": "match_rms_adamw"},
    {"beta2": 0.95, "nesterov": False},
    {"ns_steps": 3, "ns_stepsize": 0.9, "method": "you"},
])
def test_bit_exact_vs_muon_optimizer(extra):
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    opt = FSDPMuonOptimizer(model, **KW, **extra)
    ref_opt = mf.MuonOptimizer(ref.parameters(), foreach=False, **KW, **extra)
    train(model, opt, 6)
    train(ref, ref_opt, 6)
    assert_models_equal(model, ref)
    for p, q in zip(model.parameters(), ref.parameters()):
        for key, value in ref_opt.state[q].items():
            if key != "step":
                assert torch.equal(opt.state[p][key], value), key


def test_default_muon_optimizer_matches_to_rounding():
    """The in-place path of MuonOptimizer (default foreach=None) differs from the functional
    arithmetic the FSDP adapter reproduces only by rounding."""
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    opt = FSDPMuonOptimizer(model, **KW)
    ref_opt = mf.MuonOptimizer(ref.parameters(), **KW)
    train(model, opt, 6)
    train(ref, ref_opt, 6)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-6, msg=name)
        for key, value in ref_opt.state[q].items():
            torch.testing.assert_close(opt.state[p][key], value, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("beta2", [None, 0.95])
def test_bit_exact_with_bf16_params(beta2):
    """bf16 momentum travels up-cast to fp32 next to the fp32 NorMuon row state, exactly."""
    torch.manual_seed(0)
    ref = Net().to(torch.bfloat16)
    model = copy.deepcopy(ref)
    opt = FSDPMuonOptimizer(model, beta2=beta2, **KW)
    ref_opt = mf.MuonOptimizer(ref.parameters(), beta2=beta2, foreach=False, **KW)
    for t in range(4):
        x, y = batch(t)
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            (m(x.bfloat16()) - y.bfloat16()).float().square().mean().backward()
            o.step()
    assert_models_equal(model, ref)
    assert opt.state[model.fc1.weight]["momentum_buffer"].dtype == torch.bfloat16


def test_compiled_owner_update_matches_eager_without_graph_breaks():
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    counters.clear()
    opt = FSDPMuonOptimizer(model, compile={"backend": "eager"}, beta2=0.95, **KW)
    ref_opt = mf.MuonOptimizer(ref.parameters(), beta2=0.95, foreach=False, **KW)
    train(model, opt, 3)
    train(ref, ref_opt, 3)
    assert_models_equal(model, ref)
    assert not counters["graph_break"], dict(counters["graph_break"])
    (mid,) = opt._mid_cache.values()  # one batching pattern, reused every step
    assert "compile_update" in repr(mid.update._muon_fn_repr)


def test_frozen_parameters_are_left_out():
    model = Net()
    model.fc2.weight.requires_grad_(False)
    opt = FSDPMuonOptimizer(model)
    assert all(p is not model.fc2.weight for g in opt.param_groups for p in g["params"])
    assert len(opt.plan.matrices) == 3


def test_lr_scheduler_scales_both_halves_like_muon_optimizer():
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    opt = FSDPMuonOptimizer(model, **KW)
    ref_opt = mf.MuonOptimizer(ref.parameters(), foreach=False, **KW)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    train(model, opt, 5, sched)
    train(ref, ref_opt, 5, ref_sched)
    assert_models_equal(model, ref)


def test_state_is_prepopulated_and_state_dict_round_trips():
    torch.manual_seed(0)
    model = Net()
    opt = FSDPMuonOptimizer(model, **KW)
    assert set(opt.state[model.fc1.weight]) == {"momentum_buffer", "step"}
    assert set(opt.state[model.fc1.bias]) == {"exp_avg", "exp_avg_sq", "step"}
    assert opt.state[model.conv.weight]["momentum_buffer"].shape == model.conv.weight.shape
    train(model, opt, 3)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    train(model, opt, 3, start=3)
    resumed = Net()
    resumed.load_state_dict(saved_model)
    ropt = FSDPMuonOptimizer(resumed, **KW)
    ropt.load_state_dict(saved_opt)
    train(resumed, ropt, 3, start=3)
    assert_models_equal(resumed, model)
    assert opt.state[model.fc1.weight]["step"].item() == 6


def test_step_never_modifies_grad_and_reports_stats():
    torch.manual_seed(0)
    model = Net()
    opt = FSDPMuonOptimizer(model, **KW)
    x, y = batch(0)
    (model(x) - y).square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    stats = opt.last_step_stats
    assert stats["applied"] and stats["bytes_sent"] == 0 and stats["world_size"] == 1
    assert stats["matrices_computed"] == 4
    # The default "aol9": 3 quintic iterations (4 s^2 l + 2 s^3 each, s = min, l = max of (out, in))
    # and one degree-9 iteration (4 s^2 l + 4 s^3: one more s x s product).
    shapes = [(4, 18), (10, 16), (10, 10), (3, 10)]
    assert stats["ns_flops"] == sum(3 * (4 * min(s) ** 2 * max(s) + 2 * min(s) ** 3)
                                    + 4 * min(s) ** 2 * max(s) + 4 * min(s) ** 3 for s in shapes)


def test_missing_grads_leave_params_and_state_alone():
    torch.manual_seed(0)
    model = Net()
    opt = FSDPMuonOptimizer(model, **KW)
    before = copy.deepcopy(model.state_dict())
    opt.step()  # no grads at all
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    x, y = batch(0)
    (model(x) - y).square().mean().backward()
    model.fc2.weight.grad = None
    opt.step()
    assert torch.equal(model.fc2.weight, before["fc2.weight"])
    assert not opt.state[model.fc2.weight]["momentum_buffer"].any()
    assert not torch.equal(model.fc1.weight, before["fc1.weight"])


def test_nonfinite_error_and_skip():
    torch.manual_seed(0)
    model = Net()
    x, y = batch(0)
    (model(x) - y).square().mean().backward()
    model.fc1.weight.grad[0, 0] = float("inf")
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(RuntimeError, match=r"non-finite gradient \(inf or nan\) in 'fc1.weight'"):
        FSDPMuonOptimizer(model, **KW).step()
    skip = FSDPMuonOptimizer(model, nonfinite="skip", **KW)
    skip.step()
    assert skip.nonfinite_steps == 1 and skip.last_step_stats["applied"] is False
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_groups_and_describe():
    torch.manual_seed(0)
    model = Net()
    head = [model.head.weight]
    rest = [p for p in model.parameters() if p is not model.head.weight]
    opt = FSDPMuonOptimizer(model, [{"params": rest}, {"params": head, "use_muon": False}], **KW)
    text = opt.describe()
    assert "muon  fc1.weight (10, 16)" in text and "adamw head.weight (3, 10)" in text
    assert "adamw fc1.bias (10,)" in text
    assert "exp_avg" in opt.state[model.head.weight]


@pytest.mark.parametrize("kwargs, match", [
    ({"strategy": "gather"}, r"Invalid strategy: 'gather' \(valid: 'owner', 'replicate'\)"),
    ({"lr": -1.0}, r"Invalid lr: -1.0"),
    ({"momentum": 1.0}, r"Invalid momentum: 1.0"),
    ({"ns_steps": 0}, r"Invalid ns_steps: 0"),
    ({"method": "newton"}, r"Invalid method: 'newton'"),
    ({"adjust_lr_fn": "big"}, r"Invalid adjust_lr_fn: 'big'"),
    ({"wire_dtype": torch.int8}, r"Invalid wire_dtype: torch.int8"),
    ({"gradient_accumulation_steps": 2}, r"gradient_accumulation_steps=2 needs a model wrapped with "
                                         r"torch.distributed.fsdp.fully_shard \(FSDP2\), but Net"),
    ({"nonfinite": "warn"}, r"Invalid nonfinite: 'warn'"),
])
def test_errors_name_argument_and_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FSDPMuonOptimizer(Net(), **kwargs)


def test_errors_model_and_groups():
    model = Net()
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got list"):
        FSDPMuonOptimizer(list(model.parameters()))
    with pytest.raises(ValueError, match=r"parameter 'fc1.bias' of shape \(10,\) is in a group with use_muon=True"):
        FSDPMuonOptimizer(model, [{"params": [model.fc1.bias], "use_muon": True}])
    opt = FSDPMuonOptimizer(model)
    with pytest.raises(ValueError, match=r"unshard_params\(\) needs a model wrapped with fully_shard"):
        with opt.unshard_params():
            pass
    with pytest.raises(RuntimeError, match="cannot add parameter groups after construction"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2, 2))]})
