"""FSDPMuonOptimizer in one process: W = 1 without torch.distributed (no communication), FSDP2 on
a one-rank process group (gloo on the CPU, nccl on CUDA), and the adapter's pieces (phases, wire
format) on their own.

The multi-rank behaviour is in tests/test_fsdp.py (marked distributed); these run everywhere.
Tests taking ``device`` run on each device of the lane (tests/conftest.py): models on the device,
data and gradients drawn on the CPU from seeded generators and moved, comparisons on the CPU.
Against single-device MuonOptimizer / SpectralSphereOptimizer they are bit for bit on the CPU and
within ``PARITY`` on CUDA (see there); a run continued from a checkpoint stays bit for bit.
"""

from __future__ import annotations

import copy
import re
from datetime import timedelta

import expecttest
import pytest
import torch
import torch.nn as nn
from conftest import read_on_cpu
from test_fsdp import full, shard

import muon_fn as mf
from muon_fn.distributed import _phases, _rows
from muon_fn.distributed._exchange import first_difference
from muon_fn.engine._state import Slot
from muon_fn.fsdp import FSDPMuonOptimizer, FSDPSpectralSphereOptimizer

# FSDP against single-device optimizers, per device. The CPU: bit for bit (the project's
# contract: there a matrix's result does not depend on its batch mates, muon_fn.core.execution).
# CUDA: a batched GEMM library may pick its kernel by batch size and layout, so the two agree to
# rounding, not bitwise:
# - fp32 iteration: fp32 GEMMs reduced in another order, amplified by the first Newton–Schulz
#   iterations near σ = 0 (2e-5 after a few lr = 0.02 steps);
# - bf16 iteration (the default on GPUs): a product rounded the other way moves an element by
#   2^-8 relative and the next steps carry it (emulated on the CPU with fp32 accumulation in
#   permuted orders: 4.5e-4 after 4 steps);
# - bf16 parameters or momenta: a value stored one bf16 ulp apart: torch's bf16 rtol and two ulps
#   of a value below 0.5;
# - SSO: its bisection on λ amplifies rounding (1e-4, as the device lane); λ itself is solved to
#   |h| ≤ 2e-4, so a solve that stops one iterate apart moves it by about that.
# Optimizer state: as the parameters.
PARITY = {
    "cpu": None,
    "cuda": {
        "fp32": dict(rtol=0, atol=2e-5),
        "bf16": dict(rtol=0, atol=2e-3),
        "bf16_stored": dict(rtol=1.6e-2, atol=4e-3),
        "sso": dict(rtol=0, atol=1e-4),
        "sso_lambda": dict(rtol=0, atol=1e-3),
    },
}


def parity(device: torch.device, key: str = "bf16") -> dict | None:
    """``None`` (bit for bit) on the CPU; on CUDA ``PARITY``'s tolerance for ``key`` (default: a
    bf16 iteration, the default on GPUs)."""
    return None if PARITY[device.type] is None else PARITY[device.type][key]


def precision(extra=None) -> str:
    """The ``PARITY`` key of a run with fp32 parameters and the options ``extra``."""
    extra = extra or {}
    if extra.get("momentum_dtype") == torch.bfloat16:
        return "bf16_stored"
    return "fp32" if extra.get("ns_dtype") == torch.float32 else "bf16"


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
    dev = next(model.parameters()).device
    for t in range(start, start + steps):
        x, y = (v.to(dev) for v in batch(t))
        opt.zero_grad()
        (model(x.to(dtype)) - y.to(dtype)).float().square().mean().backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()


KW = dict(lr=0.02, momentum=0.95, weight_decay=0.01)


def assert_match(a: torch.Tensor, b: torch.Tensor, tol: dict | None, what: str = "") -> None:
    """``a`` equals ``b`` bit for bit (``tol`` None), or within ``tol``; compared on the CPU, a
    sharded tensor as its full tensor."""
    a, b = full(a).detach().cpu(), full(b).detach().cpu()
    if tol is None:
        assert torch.equal(a, b), (
            f"{what}: max abs error {(a.float() - b.float()).abs().max().item()}"
        )
    else:
        torch.testing.assert_close(a, b, **tol, msg=what)


def assert_same(model, opt, ref, ref_opt, tol=None):
    """Parameters and every state entry of the reference: bit for bit, or within ``tol``."""
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert sorted(opt.state[p]) == sorted(ref_opt.state[q]), name
        assert_match(p, q, tol, name)
        for key, value in ref_opt.state[q].items():
            assert_match(opt.state[p][key], value, tol, f"{name} state {key}")


def pair(extra=None, dtype=torch.float32, device="cpu", **fsdp):
    torch.manual_seed(0)
    ref = Net().to(device, dtype)
    model = copy.deepcopy(ref)
    extra = dict(KW, **(extra or {}))
    return (
        model,
        FSDPMuonOptimizer(model, **extra, **fsdp),
        ref,
        mf.MuonOptimizer(ref.parameters(), **extra),
    )


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"ns_dtype": torch.bfloat16},
        {"momentum_kind": "sgd", "method": "quintic", "adjust_lr_fn": "match_rms_adamw"},
        {"beta2": 0.95, "nesterov": False},
        {"ns_steps": 3, "ns_stepsize": 0.9, "method": "you"},
        {
            "matrix_view": lambda p: mf.heads(rows=2) if p.shape == (10, 10) else "flatten",
            "momentum_dtype": torch.bfloat16,
        },
    ],
    ids=["default", "bf16_iteration", "sgd_quintic", "normuon", "you", "heads_bf16_momentum"],
)
def test_bit_exact_vs_default_muon_optimizer(device, extra):
    model, opt, ref, ref_opt = pair(extra, device=device)
    train(model, opt, 4)
    train(ref, ref_opt, 4)
    assert_same(model, opt, ref, ref_opt, parity(device, precision(extra)))


@pytest.mark.parametrize("beta2", [None, 0.95])
def test_bit_exact_with_bf16_params(device, beta2):
    """bf16 updates travel up-cast to fp32 next to the fp32 NorMuon row state, exactly."""
    model, opt, ref, ref_opt = pair({"beta2": beta2}, dtype=torch.bfloat16, device=device)
    train(model, opt, 3, dtype=torch.bfloat16)
    train(ref, ref_opt, 3, dtype=torch.bfloat16)
    assert_same(model, opt, ref, ref_opt, parity(device, "bf16_stored"))
    assert opt.state[model.fc1.weight]["momentum_buffer"].dtype == torch.bfloat16


@pytest.mark.slow
def test_compiled_phases_match_compiled_muon_optimizer_without_graph_breaks(device):
    from torch._dynamo.utils import counters

    counters.clear()
    model, opt, ref, ref_opt = pair({"beta2": 0.95, "compile": {"backend": "eager"}}, device=device)
    train(model, opt, 2)
    train(ref, ref_opt, 2)
    assert_same(model, opt, ref, ref_opt, parity(device))
    assert not counters["graph_break"], dict(counters["graph_break"])
    routes = {r.label: r for r in opt._executor._routes(0)}
    assert routes["muon"].steps.mid.compiled and routes["muon"].steps.post.compiled
    assert routes["adamw"].steps.whole.compiled and not routes["adamw"].steps.pre.compiled


def test_the_default_compiles(compiled_default, monkeypatch):
    """compile=True (the default) compiles every phase; the suite's MUON_FN_COMPILE=0 turns it off."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)  # record, don't run inductor
    model, opt, _, _ = pair()
    train(model, opt, 1)
    assert opt._compile_options == {"fullgraph": True, "dynamic": False}
    assert opt._executor._routes(0)[0].steps.pre.compiled


def test_frozen_parameters_are_left_out():
    model = Net()
    model.fc2.weight.requires_grad_(False)
    opt = FSDPMuonOptimizer(model)
    assert all(p is not model.fc2.weight for g in opt.param_groups for p in g["params"])
    assert len(opt.plan.matrices) == 3


def test_lr_scheduler_scales_both_halves_like_muon_optimizer(device):
    model, opt, ref, ref_opt = pair(device=device)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    train(model, opt, 5, sched)
    train(ref, ref_opt, 5, ref_sched)
    assert_same(model, opt, ref, ref_opt, parity(device))


def test_changing_a_static_hyperparameter_rebuilds_transforms_state_and_plan(device):
    model, opt, ref, ref_opt = pair(device=device)
    train(model, opt, 2)
    train(ref, ref_opt, 2)
    plan = opt.plan
    for o in (opt, ref_opt):
        o.param_groups[0]["beta2"] = 0.9  # NorMuon from here on
    train(model, opt, 2, start=2)
    train(ref, ref_opt, 2, start=2)
    assert_same(model, opt, ref, ref_opt, parity(device))
    assert opt.plan is not plan and opt.plan.matrices[0].cols == 18 + 1  # row_variance travels


def test_state_is_prepopulated_and_state_dict_round_trips(device, monkeypatch):
    """State exists before the first step; a checkpoint written on the device and read on the CPU
    (map_location) resumes on the device bit for bit."""
    monkeypatch.setattr(
        torch.backends.cudnn, "deterministic", True
    )  # the same conv gradients twice
    torch.manual_seed(0)
    model = Net().to(device)
    opt = FSDPMuonOptimizer(model, **KW)
    assert set(opt.state[model.fc1.weight]) == {"momentum_buffer"}
    assert set(opt.state[model.fc1.bias]) == {"exp_avg", "exp_avg_sq", "step"}
    assert opt.state[model.conv.weight]["momentum_buffer"].shape == model.conv.weight.shape
    train(model, opt, 3)
    saved_model, saved_opt = read_on_cpu(model.state_dict()), read_on_cpu(opt.state_dict())
    train(model, opt, 3, start=3)
    resumed = Net().to(device)
    resumed.load_state_dict(saved_model)
    ropt = FSDPMuonOptimizer(resumed, **KW)
    ropt.load_state_dict(saved_opt)
    assert all(
        v.device == p.device
        for p, st in ropt.state.items()
        for v in st.values()
        if isinstance(v, torch.Tensor)
    )
    train(resumed, ropt, 3, start=3)
    for p, q in zip(resumed.parameters(), model.parameters()):
        assert torch.equal(p, q)
    assert opt.state[model.fc1.bias]["step"].item() == 6


def test_step_never_modifies_grad_and_reports_stats(device):
    torch.manual_seed(0)
    model = Net().to(device)
    opt = FSDPMuonOptimizer(model, **KW)
    x, y = (v.to(device) for v in batch(0))
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
    assert stats["ns_flops"] == sum(
        5 * (4 * min(s) ** 2 * max(s) + 2 * min(s) ** 3) for s in shapes
    )


def test_missing_grads_leave_params_and_state_alone(device):
    torch.manual_seed(0)
    model = Net().to(device)
    opt = FSDPMuonOptimizer(model, beta2=0.9, **KW)
    before = copy.deepcopy(model.state_dict())
    opt.step()  # no grads at all
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    x, y = (v.to(device) for v in batch(0))
    (model(x) - y).square().mean().backward()
    model.fc2.weight.grad = None
    opt.step()
    assert torch.equal(model.fc2.weight, before["fc2.weight"])
    assert not opt.state[model.fc2.weight]["momentum_buffer"].any()
    assert not opt.state[model.fc2.weight]["row_variance"].any()
    assert not torch.equal(model.fc1.weight, before["fc1.weight"])


def test_nonfinite_skip_is_decided_on_the_device_and_error_names_the_parameter(device):
    torch.manual_seed(0)
    model = Net().to(device)
    x, y = (v.to(device) for v in batch(0))
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
    opt = FSDPMuonOptimizer(
        model,
        [{"params": [model.head.weight], "use_muon": False, "adamw_lr": 1e-3}],
        adamw_weight_decay=0.1,
    )
    (group,) = opt.param_groups
    assert (group["algorithm"], group["lr"], group["weight_decay"]) == ("adamw", 1e-3, 0.1)
    assert "use_muon" not in group


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"strategy": "gather"}, r"Invalid strategy: 'gather' \(valid: 'owner', 'replicate'\)"),
        ({"lr": -1.0}, r"Invalid learning rate: -1.0"),
        ({"momentum": 1.0}, r"Invalid momentum value: 1.0"),
        ({"ns_steps": 0}, r"Invalid ns_steps value: 0"),
        ({"method": "newton"}, r"Invalid method: 'newton'"),
        ({"adjust_lr_fn": "big"}, r"Invalid adjust_lr_fn: 'big'"),
        ({"wire_dtype": torch.int8}, r"Invalid wire_dtype: torch.int8"),
        ({"num_buckets": 0}, r"Invalid num_buckets: 0"),
        (
            {"gradient_accumulation_steps": 2},
            r"gradient_accumulation_steps=2 needs a model wrapped with "
            r"torch.distributed.fsdp.fully_shard \(FSDP2\), whose gradient sync "
            r"it pauses, but Net contains no FSDPModule",
        ),
        ({"nonfinite": "warn"}, r"Invalid nonfinite: 'warn'"),
    ],
)
def test_errors_name_argument_and_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FSDPMuonOptimizer(Net(), **kwargs)


def test_errors_model_groups_and_options():
    model = Net()
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module, got list"):
        FSDPMuonOptimizer(list(model.parameters()))
    with pytest.raises(ValueError, match="differentiable=True is not supported"):
        FSDPMuonOptimizer(model, differentiable=True)
    with pytest.raises(
        ValueError, match=r"parameter 'fc1.bias': orthogonalize only supports matrices"
    ):
        FSDPMuonOptimizer(model, [{"params": [model.fc1.bias], "use_muon": True}])
    opt = FSDPMuonOptimizer(model)
    with (
        pytest.raises(
            ValueError, match=r"unshard_params\(\) needs a model wrapped with fully_shard"
        ),
        opt.unshard_params(),
    ):
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
def test_expert_stacks_are_read_by_module(device, extra):
    """The FSDP optimizer has the model: no guess, no warning; bit-exact with MuonOptimizer given
    the same views by name."""
    import warnings

    torch.manual_seed(0)
    ref = MoE().to(device)
    model = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = FSDPMuonOptimizer(model, **KW, **extra)
    ref_opt = mf.MuonOptimizer(
        ref.named_parameters(),
        matrix_view={"w_up": "experts", "conv.weight": "flatten"},
        **KW,
        **extra,
    )
    assert "w_up (4, 8, 6) owner=0 bucket=0 view=experts" in opt.describe()
    assert "conv.weight (3, 2, 3) owner=0 bucket=0 view=flatten" in opt.describe()
    for t in range(3):
        g = torch.Generator().manual_seed(t)
        for p, q in zip(model.parameters(), ref.parameters()):
            p.grad = torch.randn(p.shape, generator=g).to(device)
            q.grad = p.grad.clone()
        opt.step()
        ref_opt.step()
    assert_same(model, opt, ref, ref_opt, parity(device, precision(extra)))
    assert opt.last_step_stats["ns_flops"] > 0


# ---------------------------------------------------------------------------- FSDP2, one rank
@pytest.fixture
def one_rank(device, tmp_path):
    """A one-rank process group in this process (gloo on the CPU, nccl on CUDA; a file store under
    ``tmp_path``, a 60 s timeout) and its 1-D device mesh; destroyed whatever the test does."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    assert not dist.is_initialized(), "a process group is left over from another test"
    kw = {"backend": "gloo"}
    if device.type == "cuda":  # nccl bound to the lane's GPU (eager init: a bad setup fails here)
        index = torch.cuda.current_device() if device.index is None else device.index
        torch.cuda.set_device(index)
        kw = {"backend": "nccl", "device_id": torch.device("cuda", index)}
    dist.init_process_group(
        init_method=(tmp_path / "store").as_uri(),
        world_size=1,
        rank=0,
        timeout=timedelta(seconds=60),
        **kw,
    )
    try:
        yield init_device_mesh(device.type, (1,))
    finally:
        dist.destroy_process_group()


def set_grads(model, step):
    """Gradients drawn on the CPU from a seeded generator and moved; a sharded parameter gets its
    shard (at W = 1 every row)."""
    from torch.distributed.tensor import DTensor

    g = torch.Generator().manual_seed(step)
    for p in model.parameters():
        grad = torch.randn(tuple(p.shape), generator=g).to(p.device)
        p.grad = (
            DTensor.from_local(
                grad, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
            )
            if isinstance(p, DTensor)
            else grad
        )


def sharded_twins(mesh, device, cls=Net):
    """A model fully_shard-ed on ``mesh`` (each child, then the root) and its plain copy."""
    torch.manual_seed(0)
    ref = cls().to(device)
    return shard(copy.deepcopy(ref), mesh=mesh), ref


def single(cls, ref, **kw):
    """``cls`` (MuonOptimizer, SpectralSphereOptimizer) on ``ref`` with the views the FSDP
    optimizers read from the model."""
    return cls(ref.named_parameters(), matrix_view={"conv.weight": "flatten"}, **kw)


def steps(pairs, n, start=0):
    for t in range(start, start + n):
        for model, opt in pairs:
            set_grads(model, t)
            opt.step()


def test_fsdp2_one_rank_equals_muon_optimizer(device, one_rank):
    """FSDP2 on a one-rank group: FSDPMuonOptimizer (NorMuon, fp32 iteration) on the sharded model
    equals MuonOptimizer on its copy, parameters and state (bit for bit on the CPU, PARITY on CUDA)."""
    from torch.distributed.tensor import DTensor

    extra = dict(KW, ns_dtype=torch.float32, beta2=0.95)
    model, ref = sharded_twins(one_rank, device)
    opt, ref_opt = FSDPMuonOptimizer(model, **extra), single(mf.MuonOptimizer, ref, **extra)
    assert opt.topology.world_size == 1 and isinstance(model.fc1.weight, DTensor)
    assert isinstance(opt.state[model.fc1.weight]["momentum_buffer"], DTensor)
    steps([(model, opt), (ref, ref_opt)], 3)
    assert_same(model, opt, ref, ref_opt, parity(device, precision(extra)))


def test_fsdp2_one_rank_hybrid_keeps_frozen_parameters(device, one_rank):
    """The hybrid on a sharded model keeps a frozen matrix (one bucket with a trained one of its
    shape): left as it was while it gets no gradient, trained once unfrozen, the whole run equal
    to the single-device hybrid on the copy (bit for bit on the CPU, PARITY on CUDA)."""
    from test_fsdp import Toy

    torch.manual_seed(0)
    ref = Toy().to(device)
    ref.l6.requires_grad_(False)
    model = shard(copy.deepcopy(ref), mesh=one_rank)
    kw = {
        "compile": False,
        "ns_dtype": torch.float32,
        "muon_weight_decay": 0.1,
        "adamw_weight_decay": 0.1,
        "adamw_decay_1d": True,
    }
    opt, ref_opt = mf.create_hybrid_optimizer(model, **kw), mf.create_hybrid_optimizer(ref, **kw)
    assert opt.split.frozen == {"l6.weight"}
    frozen = full(model.l6.weight).detach().clone()
    for t in range(2):
        for m, o in ((model, opt), (ref, ref_opt)):
            set_grads(m, t)
            m.l6.weight.grad = None
            o.step()
    assert torch.equal(full(model.l6.weight), frozen)
    model.l6.requires_grad_(True)
    ref.l6.requires_grad_(True)
    steps([(model, opt), (ref, ref_opt)], 2, start=2)
    assert not torch.equal(full(model.l6.weight), frozen)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_match(p, q, parity(device, "fp32"), name)


@pytest.mark.parametrize("kind", ["muon", "sso"])
@pytest.mark.slow
def test_fsdp2_one_rank_state_dict_round_trip(device, one_rank, kind):
    """The sharded model's and optimizer's state, gathered to full CPU tensors and through
    torch.save, loads into a fresh sharded model and optimizer on the device, which continue as
    the uninterrupted run, bit for bit (the same steps on the same device); both equal the
    single-device optimizer on the copy. Dtype hyperparameters (``ns_dtype``, SSO's
    ``msign_dtype``) travel by name: a full state dict takes no ``torch.dtype``."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    make, ref_cls, kw, tol = {
        "muon": (FSDPMuonOptimizer, mf.MuonOptimizer, dict(KW, ns_dtype=torch.float32), "fp32"),
        "sso": (FSDPSpectralSphereOptimizer, mf.SpectralSphereOptimizer, dict(lr=0.02), "sso"),
    }[kind]
    model, ref = sharded_twins(one_rank, device)
    opt, ref_opt = make(model, **kw), single(ref_cls, ref, **kw)
    steps([(model, opt), (ref, ref_opt)], 2)
    to_cpu, full_sd = (
        StateDictOptions(full_state_dict=True, cpu_offload=True),
        StateDictOptions(full_state_dict=True),
    )
    saved = read_on_cpu(
        {
            "model": get_model_state_dict(model, options=to_cpu),
            "optim": get_optimizer_state_dict(model, opt, options=to_cpu),
        }
    )
    assert saved["optim"]["state"]["fc1.weight"]["momentum_buffer"].device.type == "cpu"
    torch.manual_seed(1)  # another init: everything comes from the checkpoint
    resumed = shard(Net().to(device), mesh=one_rank)
    ropt = make(resumed, **kw)
    set_model_state_dict(resumed, saved["model"], options=full_sd)
    set_optimizer_state_dict(resumed, ropt, saved["optim"], options=full_sd)
    steps([(model, opt), (resumed, ropt), (ref, ref_opt)], 2, start=2)
    assert_same(resumed, ropt, model, opt)
    assert_same(resumed, ropt, ref, ref_opt, parity(device, tol))


@pytest.mark.slow
def test_fsdp2_one_rank_sso_equals_spectral_sphere_optimizer(device, one_rank):
    """FSDPSpectralSphereOptimizer on the sharded model equals SpectralSphereOptimizer on its copy
    (bit for bit on the CPU, PARITY on CUDA), the λ solver's statistics included."""
    model, ref = sharded_twins(one_rank, device)
    opt = FSDPSpectralSphereOptimizer(model, lr=0.02, weight_decay=0.01)
    ref_opt = single(mf.SpectralSphereOptimizer, ref, lr=0.02, weight_decay=0.01)
    steps([(model, opt), (ref, ref_opt)], 3)
    assert_same(model, opt, ref, ref_opt, parity(device, "sso"))
    assert_match(
        opt.solver_stats().lam, ref_opt.solver_stats().lam, parity(device, "sso_lambda"), "λ"
    )


# ---------------------------------------------------------------------------- ranks agree
class TestPlanAgreement(expecttest.TestCase):
    """What ranks compare once at construction (one all-gather of its hash; on a mismatch a
    second names the first difference). The ranks themselves: tests/test_fsdp.py."""

    def test_description_of_the_plan(self):
        torch.manual_seed(0)
        model = Net()
        opt = FSDPMuonOptimizer(model)
        description = [
            (k, re.sub("^[0-9a-f]{16}$", "<hash>", v))
            for k, v in opt._executor._plan_description(opt.plan)
        ]
        self.assertExpectedInline(
            "\n".join(f"{k}: {v}" for k, v in description),
            """\
the options: strategy='owner', wire_dtype=None, num_buckets=4, inflight_bytes=8388608, gradient_accumulation_steps=1, nonfinite='skip', overlap=False, 1 ranks, no device mesh
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
the plan's owners and buckets: <hash>""",  # noqa: E501
        )

    def test_first_difference(self):
        def describe(model, **kw):
            opt = FSDPMuonOptimizer(model, **kw)
            return opt._executor._plan_description(opt.plan)

        torch.manual_seed(0)
        base = describe(Net())
        renamed = Net()
        renamed.fc3 = renamed.fc2
        del renamed.fc2
        self.assertExpectedInline(
            first_difference(base, describe(renamed), 1),
            """\
at parameter 4 of group 0: 'fc2.weight' of shape (10, 10), a plain (replicated) tensor, muon on rank 0, 'head.weight' of shape (3, 10), a plain (replicated) tensor, muon on rank 1""",  # noqa: E501
        )
        extra = Net()
        extra.more = nn.Linear(3, 3, bias=False)
        self.assertExpectedInline(
            first_difference(base, describe(extra), 3),
            """\
at parameter 10 of group 0: none on rank 0, 'more.weight' of shape (3, 3), a plain (replicated) tensor, muon on rank 3""",  # noqa: E501
        )
        self.assertExpectedInline(
            first_difference(base, describe(Net(), num_buckets=1), 1),
            """at the options: strategy='owner', wire_dtype=None, num_buckets=4, inflight_bytes=8388608, gradient_accumulation_steps=1, nonfinite='skip', overlap=False, 1 ranks, no device mesh on rank 0, strategy='owner', wire_dtype=None, num_buckets=1, inflight_bytes=8388608, gradient_accumulation_steps=1, nonfinite='skip', overlap=False, 1 ranks, no device mesh on rank 1""",  # noqa: E501
        )
        twins = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
        # bucket_size changes only which matrices an owner computes together: the plan's hash
        assert re.fullmatch(
            "at the plan's owners and buckets: [0-9a-f]{16} on rank 0, [0-9a-f]{16} on rank 1",
            first_difference(describe(twins), describe(twins, bucket_size=1), 1),
        )


def test_fsdp_state_dict_records_the_layout_and_refuses_another():
    torch.manual_seed(0)
    model = Net()
    opt = FSDPMuonOptimizer(model, **KW)
    sd = opt.state_dict()
    assert sd["param_groups"][0]["param_layout"][:2] == [
        ("conv.weight", (4, 2, 3, 3), "flatten"),
        ("conv.bias", (4,), "flatten"),
    ]
    renamed = Net()
    renamed.fc3 = renamed.fc2
    del renamed.fc2
    other = FSDPMuonOptimizer(renamed, **KW)
    with pytest.raises(
        ValueError,
        match=r"parameter 4 is 'fc2\.weight' of shape \(10, 10\) in the state dict "
        r"but 'head\.weight' of shape \(3, 10\) in this optimizer",
    ):
        other.load_state_dict(copy.deepcopy(sd))
