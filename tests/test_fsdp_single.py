"""FSDPMuonOptimizer in one process (no torch.distributed): W = 1, no communication, and the
adapter's pieces (phases, wire format) on their own.

The multi-rank behaviour is in tests/test_fsdp.py (marked distributed); these run everywhere.
"""

from __future__ import annotations

import copy
import re

import expecttest
import pytest
import torch
import torch.nn as nn

import muon_fn as mf
from muon_fn.fsdp import FSDPMuonOptimizer
from muon_fn.fsdp import _phases, _rows
from muon_fn.fsdp._exchange import first_difference
from muon_fn.optim._state import Slot


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


def train(model, opt, steps, scheduler=None, start=0, dtype=torch.float32):
    for t in range(start, start + steps):
        x, y = batch(t)
        opt.zero_grad()
        (model(x.to(dtype)) - y.to(dtype)).float().square().mean().backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()


KW = dict(lr=0.02, momentum=0.95, weight_decay=0.01)


def assert_same(model, opt, ref, ref_opt):
    """Parameters and every state entry of the reference, bit for bit."""
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), f"{name}: max abs error {(p - q).abs().max().item()}"
        assert sorted(opt.state[p]) == sorted(ref_opt.state[q]), name
        for key, value in ref_opt.state[q].items():
            assert torch.equal(opt.state[p][key], value), f"{name} state {key}"


def pair(extra=None, dtype=torch.float32, **fsdp):
    torch.manual_seed(0)
    ref = Net().to(dtype)
    model = copy.deepcopy(ref)
    extra = dict(KW, **(extra or {}))
    return model, FSDPMuonOptimizer(model, **extra, **fsdp), ref, mf.MuonOptimizer(ref.parameters(), **extra)


@pytest.mark.parametrize("extra", [
    {},
    {"ns_dtype": torch.bfloat16},
    {"momentum_kind": "sgd", "method": "quintic", "adjust_lr_fn": "match_rms_adamw"},
    {"beta2": 0.95, "nesterov": False},
    {"ns_steps": 3, "ns_stepsize": 0.9, "method": "you"},
    {"matrix_view": lambda p: mf.heads(rows=2) if p.shape == (10, 10) else "flatten",
     "momentum_dtype": torch.bfloat16},
], ids=["default", "bf16_iteration", "sgd_quintic", "normuon", "you", "heads_bf16_momentum"])
def test_bit_exact_vs_default_muon_optimizer(extra):
    model, opt, ref, ref_opt = pair(extra)
    train(model, opt, 4)
    train(ref, ref_opt, 4)
    assert_same(model, opt, ref, ref_opt)


@pytest.mark.parametrize("beta2", [None, 0.95])
def test_bit_exact_with_bf16_params(beta2):
    """bf16 updates travel up-cast to fp32 next to the fp32 NorMuon row state, exactly."""
    model, opt, ref, ref_opt = pair({"beta2": beta2}, dtype=torch.bfloat16)
    train(model, opt, 3, dtype=torch.bfloat16)
    train(ref, ref_opt, 3, dtype=torch.bfloat16)
    assert_same(model, opt, ref, ref_opt)
    assert opt.state[model.fc1.weight]["momentum_buffer"].dtype == torch.bfloat16


def test_compiled_phases_match_compiled_muon_optimizer_without_graph_breaks():
    from torch._dynamo.utils import counters

    counters.clear()
    model, opt, ref, ref_opt = pair({"beta2": 0.95, "compile": {"backend": "eager"}})
    train(model, opt, 2)
    train(ref, ref_opt, 2)
    assert_same(model, opt, ref, ref_opt)
    assert not counters["graph_break"], dict(counters["graph_break"])
    routes = {r.label: r for r in opt._routes(0)}
    assert routes["muon"].steps.mid.compiled and routes["muon"].steps.post.compiled
    assert routes["adamw"].steps.whole.compiled and not routes["adamw"].steps.pre.compiled


def test_the_default_compiles(compiled_default, monkeypatch):
    """compile=True (the default) compiles every phase; the suite's MUON_FN_COMPILE=0 turns it off."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)  # record, don't run inductor
    model, opt, _, _ = pair()
    train(model, opt, 1)
    assert opt._compile_options == {"fullgraph": True}
    assert opt._routes(0)[0].steps.pre.compiled


def test_frozen_parameters_are_left_out():
    model = Net()
    model.fc2.weight.requires_grad_(False)
    opt = FSDPMuonOptimizer(model)
    assert all(p is not model.fc2.weight for g in opt.param_groups for p in g["params"])
    assert len(opt.plan.matrices) == 3


def test_lr_scheduler_scales_both_halves_like_muon_optimizer():
    model, opt, ref, ref_opt = pair()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    train(model, opt, 5, sched)
    train(ref, ref_opt, 5, ref_sched)
    assert_same(model, opt, ref, ref_opt)


def test_changing_a_static_hyperparameter_rebuilds_transforms_state_and_plan():
    model, opt, ref, ref_opt = pair()
    train(model, opt, 2)
    train(ref, ref_opt, 2)
    plan = opt.plan
    for o in (opt, ref_opt):
        o.param_groups[0]["beta2"] = 0.9  # NorMuon from here on
    train(model, opt, 2, start=2)
    train(ref, ref_opt, 2, start=2)
    assert_same(model, opt, ref, ref_opt)
    assert opt.plan is not plan and opt.plan.matrices[0].cols == 18 + 1  # row_variance travels


def test_state_is_prepopulated_and_state_dict_round_trips():
    torch.manual_seed(0)
    model = Net()
    opt = FSDPMuonOptimizer(model, **KW)
    assert set(opt.state[model.fc1.weight]) == {"momentum_buffer"}
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
    for p, q in zip(resumed.parameters(), model.parameters()):
        assert torch.equal(p, q)
    assert opt.state[model.fc1.bias]["step"].item() == 6


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
    # The default: Keller's quintic, 5 iterations of 4 s^2 l + 2 s^3 FLOPs (s = min, l = max of
    # (out, in)).
    shapes = [(4, 18), (10, 16), (10, 10), (3, 10)]
    assert stats["ns_flops"] == sum(5 * (4 * min(s) ** 2 * max(s) + 2 * min(s) ** 3) for s in shapes)


def test_missing_grads_leave_params_and_state_alone():
    torch.manual_seed(0)
    model = Net()
    opt = FSDPMuonOptimizer(model, beta2=0.9, **KW)
    before = copy.deepcopy(model.state_dict())
    opt.step()  # no grads at all
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    x, y = batch(0)
    (model(x) - y).square().mean().backward()
    model.fc2.weight.grad = None
    opt.step()
    assert torch.equal(model.fc2.weight, before["fc2.weight"])
    assert not opt.state[model.fc2.weight]["momentum_buffer"].any()
    assert not opt.state[model.fc2.weight]["row_variance"].any()
    assert not torch.equal(model.fc1.weight, before["fc1.weight"])


def test_nonfinite_skip_is_decided_on_the_device_and_error_names_the_parameter():
    torch.manual_seed(0)
    model = Net()
    x, y = batch(0)
    (model(x) - y).square().mean().backward()
    model.fc1.weight.grad[0, 0] = float("inf")
    before = copy.deepcopy(model.state_dict())
    skip = FSDPMuonOptimizer(model, **KW)  # nonfinite="skip" is the default
    skip.step()
    assert skip.nonfinite_steps == 1 and not bool(skip.last_step.finite)
    with pytest.raises(RuntimeError, match=r"non-finite gradient \(inf or nan\) in 'fc1.weight'"):
        FSDPMuonOptimizer(model, nonfinite="error", **KW).step()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_groups_and_describe():
    torch.manual_seed(0)
    model = Net()
    head = [model.head.weight]
    rest = [p for p in model.parameters() if p is not model.head.weight]
    opt = FSDPMuonOptimizer(model, [{"params": rest}, {"params": head, "algorithm": "adamw"}], **KW)
    text = opt.describe()
    assert "muon  fc1.weight (10, 16) owner=0" in text and "adamw head.weight (3, 10)" in text
    assert "adamw fc1.bias (10,)" in text
    assert "exp_avg" in opt.state[model.head.weight]


def test_use_muon_false_is_adamw_at_the_adamw_settings():
    torch.manual_seed(0)
    model = Net()
    opt = FSDPMuonOptimizer(model, [{"params": [model.head.weight], "use_muon": False, "adamw_lr": 1e-3}],
                            adamw_weight_decay=0.1)
    (group,) = opt.param_groups
    assert (group["algorithm"], group["lr"], group["weight_decay"]) == ("adamw", 1e-3, 0.1)
    assert "use_muon" not in group


@pytest.mark.parametrize("kwargs, match", [
    ({"strategy": "gather"}, r"Invalid strategy: 'gather' \(valid: 'owner', 'replicate'\)"),
    ({"lr": -1.0}, r"Invalid learning rate: -1.0"),
    ({"momentum": 1.0}, r"Invalid momentum value: 1.0"),
    ({"ns_steps": 0}, r"Invalid ns_steps value: 0"),
    ({"method": "newton"}, r"Invalid method: 'newton'"),
    ({"adjust_lr_fn": "big"}, r"Invalid adjust_lr_fn: 'big'"),
    ({"wire_dtype": torch.int8}, r"Invalid wire_dtype: torch.int8"),
    ({"num_buckets": 0}, r"Invalid num_buckets: 0"),
    ({"gradient_accumulation_steps": 2}, r"gradient_accumulation_steps=2 needs a model wrapped with "
                                         r"torch.distributed.fsdp.fully_shard \(FSDP2\), but Net"),
    ({"nonfinite": "warn"}, r"Invalid nonfinite: 'warn'"),
])
def test_errors_name_argument_and_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FSDPMuonOptimizer(Net(), **kwargs)


def test_errors_model_groups_and_options():
    model = Net()
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got list"):
        FSDPMuonOptimizer(list(model.parameters()))
    with pytest.raises(TypeError, match="unexpected keyword argument 'foreach'"):
        FSDPMuonOptimizer(model, foreach=False)
    with pytest.raises(ValueError, match=r"parameter 'fc1.bias': orthogonalize only supports matrices"):
        FSDPMuonOptimizer(model, [{"params": [model.fc1.bias], "use_muon": True}])
    opt = FSDPMuonOptimizer(model)
    with pytest.raises(ValueError, match=r"unshard_params\(\) needs a model wrapped with fully_shard"):
        with opt.unshard_params():
            pass
    with pytest.raises(RuntimeError, match="cannot add parameter groups after construction"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2, 2))]})


# ---------------------------------------------------------------------------- the pieces
def test_phases_of_muon_normuon_and_adamw():
    muon = _phases.split(mf.muon(), "muon")
    assert muon.sizes == (1, 2, 2) and not muon.mid_needs_params  # momentum | orth, shape | wd, lr
    assert _phases.split(mf.normuon(), "normuon").sizes == (1, 3, 2)
    adamw = _phases.split(mf.adamw(), "adamw")
    assert adamw.mid is None and adamw.sizes == (3, 0, 0)
    alone = _phases.split(mf.orthogonalize(), "orthogonalize")  # not a chain: one part
    assert alone.sizes == (0, 1, 0)
    inside = mf.chain(mf.orthogonalize(), mf.add_decoupled_weight_decay(0.1), mf.scale_by_shape())
    assert _phases.split(inside, "x").mid_needs_params


def test_phases_refuse_what_cannot_run_on_shards():
    with pytest.raises(ValueError, match="leafwise=False"):
        _phases.split(mf.muon(lr=lambda count: 0.01 * count), "scheduled")
    opaque = mf.stateless(lambda u, p: u)  # no TransformInfo: scope unknown
    with pytest.raises(ValueError, match="scope None"):
        _phases.split(mf.chain(mf.momentum(), opaque), "opaque")


def test_phase_layouts_slice_the_whole_state():
    phases = _phases.split(mf.normuon(), "normuon")
    meta = (torch.empty(6, 4, device="meta"), torch.empty(6, 4, device="meta"))
    full, (pre, mid, post) = _phases.layouts(phases, meta)
    assert [s.key for s in pre.slots] == ["momentum_buffer"] * 2
    assert [s.key for s in mid.slots] == ["row_variance"] * 2 and post.slots == ()
    assert full.slots == pre.slots + mid.slots + post.slots


def test_row_format_round_trip():
    slot = Slot(0, "row_variance", (6, 1), torch.float32)
    fmt = _rows.row_format((6, 2, 2), torch.bfloat16, torch.bfloat16, torch.float32, [(slot, True)])
    assert (fmt.cols, fmt.sent_cols, fmt.returned_cols) == (4, 9, 5)
    assert _rows.common_dtype([fmt]) == torch.float32
    u, p, v = torch.randn(6, 2, 2).bfloat16(), torch.randn(6, 2, 2), torch.rand(6, 1)
    sent = _rows.pack(fmt, u, p, [v], torch.float32)
    u2, p2, states = _rows.unpack_sent(fmt, sent)
    assert torch.equal(u2, u) and torch.equal(p2, p) and torch.equal(states["row_variance"], v)
    back = _rows.pack_result(fmt, u, {"row_variance": v}, torch.float32)
    u3, (v3,) = _rows.unpack_result(fmt, back[2:5], (3, 2, 2))
    assert torch.equal(u3, u[2:5]) and torch.equal(v3, v[2:5])
    assert _rows.pack(fmt, None, p[:0], [v[:0]], torch.float32).shape == (0, 9)  # an empty shard


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(6, 4, bias=False)
        self.w_up = nn.Parameter(torch.randn(4, 8, 6) / 6**0.5)  # 4 experts 8x6, one parameter
        self.conv = nn.Conv1d(2, 3, 3)  # 3-D too, but a conv weight


@pytest.mark.parametrize("extra", [{}, {"beta2": 0.95}], ids=["muon", "normuon"])
def test_expert_stacks_are_read_by_module(extra):
    """The FSDP optimizer has the model: no guess, no warning; bit-exact with MuonOptimizer given
    the same views by name."""
    import warnings

    torch.manual_seed(0)
    ref = MoE()
    model = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = FSDPMuonOptimizer(model, **KW, **extra)
    ref_opt = mf.MuonOptimizer(ref.named_parameters(), matrix_view={"w_up": "experts", "conv.weight": "flatten"},
                               **KW, **extra)
    assert "w_up (4, 8, 6) owner=0 bucket=0 view=experts" in opt.describe()
    assert "conv.weight (3, 2, 3) owner=0 bucket=0 view=flatten" in opt.describe()
    for t in range(3):
        g = torch.Generator().manual_seed(t)
        for p, q in zip(model.parameters(), ref.parameters()):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        opt.step()
        ref_opt.step()
    assert_same(model, opt, ref, ref_opt)
    assert opt.last_step_stats["ns_flops"] > 0


# ---------------------------------------------------------------------------- ranks agree
class TestPlanAgreement(expecttest.TestCase):
    """What ranks compare once at construction (one all-gather of its hash; on a mismatch a
    second names the first difference). The ranks themselves: tests/test_fsdp.py."""

    def test_description_of_the_plan(self):
        torch.manual_seed(0)
        model = Net()
        opt = FSDPMuonOptimizer(model)
        description = [(k, re.sub("^[0-9a-f]{16}$", "<hash>", v)) for k, v in opt._plan_description(opt.plan)]
        self.assertExpectedInline("\n".join(f"{k}: {v}" for k, v in description), """\
the options: strategy='owner', wire_dtype=None, num_buckets=4, gradient_accumulation_steps=1, nonfinite='skip', overlap=False, 1 ranks, no device mesh
parameter 0 of group 0: 'conv.weight' of shape (4, 2, 3, 3), a plain (replicated) tensor, muon, view 'flatten'
parameter 1 of group 0: 'conv.bias' of shape (4,), a plain (replicated) tensor, adamw
parameter 2 of group 0: 'fc1.weight' of shape (10, 16), a plain (replicated) tensor, muon
parameter 3 of group 0: 'fc1.bias' of shape (10,), a plain (replicated) tensor, adamw
parameter 4 of group 0: 'fc2.weight' of shape (10, 10), a plain (replicated) tensor, muon
parameter 5 of group 0: 'fc2.bias' of shape (10,), a plain (replicated) tensor, adamw
parameter 6 of group 0: 'head.weight' of shape (3, 10), a plain (replicated) tensor, muon
parameter 7 of group 0: 'head.bias' of shape (3,), a plain (replicated) tensor, adamw
parameter 8 of group 0: 'norm.weight' of shape (10,), a plain (replicated) tensor, adamw
parameter 9 of group 0: 'norm.bias' of shape (10,), a plain (replicated) tensor, adamw
the plan's owners and buckets: <hash>""")

    def test_first_difference(self):
        def describe(model, **kw):
            opt = FSDPMuonOptimizer(model, **kw)
            return opt._plan_description(opt.plan)

        torch.manual_seed(0)
        base = describe(Net())
        renamed = Net()
        renamed.fc3 = renamed.fc2
        del renamed.fc2
        self.assertExpectedInline(first_difference(base, describe(renamed), 1), """\
at parameter 4 of group 0: 'fc2.weight' of shape (10, 10), a plain (replicated) tensor, muon on rank 0, 'head.weight' of shape (3, 10), a plain (replicated) tensor, muon on rank 1""")
        extra = Net()
        extra.more = nn.Linear(3, 3, bias=False)
        self.assertExpectedInline(first_difference(base, describe(extra), 3), """\
at parameter 10 of group 0: none on rank 0, 'more.weight' of shape (3, 3), a plain (replicated) tensor, muon on rank 3""")
        self.assertExpectedInline(first_difference(base, describe(Net(), num_buckets=1), 1), """at the options: strategy='owner', wire_dtype=None, num_buckets=4, gradient_accumulation_steps=1, nonfinite='skip', overlap=False, 1 ranks, no device mesh on rank 0, strategy='owner', wire_dtype=None, num_buckets=1, gradient_accumulation_steps=1, nonfinite='skip', overlap=False, 1 ranks, no device mesh on rank 1""")
        twins = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
        # bucket_size changes only which matrices an owner computes together: the plan's hash
        assert re.fullmatch("at the plan's owners and buckets: [0-9a-f]{16} on rank 0, [0-9a-f]{16} on rank 1",
                            first_difference(describe(twins), describe(twins, bucket_size=1), 1))


def test_fsdp_state_dict_records_the_layout_and_refuses_another():
    torch.manual_seed(0)
    model = Net()
    opt = FSDPMuonOptimizer(model, **KW)
    sd = opt.state_dict()
    assert sd["param_groups"][0]["param_layout"][:2] == [("conv.weight", (4, 2, 3, 3), "flatten"),
                                                          ("conv.bias", (4,), "flatten")]
    renamed = Net()
    renamed.fc3 = renamed.fc2
    del renamed.fc2
    other = FSDPMuonOptimizer(renamed, **KW)
    with pytest.raises(ValueError, match="parameter 4 is 'fc2.weight' of shape \\(10, 10\\) in the state dict "
                                         "but 'head.weight' of shape \\(3, 10\\) in this optimizer"):
        other.load_state_dict(copy.deepcopy(sd))
