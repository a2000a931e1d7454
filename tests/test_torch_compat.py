"""MuonOptimizer as a drop-in for torch.optim.Muon: torch's keywords with torch's meaning, and
checkpoints both ways (``muon_fn.optim.from_torch_state_dict`` / ``to_torch_state_dict``).

Tolerances:
  * fp32 (``fp32_torch_muon``: torch.optim.Muon's own code with its Newton–Schulz function run in
    fp32): atol 1e-5 on parameters and 1e-6 on momentum buffers. Both sides run the same
    formulas — the same quintic, the same normalization ``X / max(‖X‖_F, eps)`` — in a different
    order (muon_fn: fp32 0-d tensor scalars and one fused ``p + u``; torch: Python doubles,
    ``mul_`` then ``add_``), i.e. a few ulps per step.
  * bf16 (torch.optim.Muon as shipped against ``ns_dtype=torch.bfloat16``): 4e-3 max-abs after 5
    steps (measured 3.2e-3; 1.8e-3 after one step, while an element moves up to 0.017 per step).
    Both iterate in bf16 but round at different points: torch casts the momentum to bf16
    before taking its norm (computed in bf16) and divides in place in bf16, muon_fn takes the norm
    in fp32 and casts the normalized matrix once. Each product then rounds to bf16 (relative
    2^-8 ≈ 4e-3) on slightly different inputs, and on matrices 24 wide the rounding does not average out.
  * Round trips (muon_fn → torch → muon_fn and torch → muon_fn → torch) move only state, so the
    continued runs equal the uninterrupted ones bit for bit (torch.equal), on every device.

Every test taking ``device`` runs on each device of the lane (tests/conftest.py): models and state
on the device, data drawn on the CPU from seeded generators and moved, checkpoints written on the
device and read on the CPU (``map_location``) before they load into optimizers on the device.
Tolerances per device in ``TOL``: the CPU's are the ones above; on CUDA, fp32 GEMMs reduce in
another order (TF32 stays off, torch's default) and muon_fn's batched GEMMs are other kernels than
torch's 2-D ``addmm``, so the two sides round apart (emulated on the CPU with fp32 GEMMs summed in
permuted orders: parameters 4.5e-7 after 10 steps, momenta 1e-8, one iteration 9e-7); bf16 adds
other bf16 kernels to the rounding the two implementations already differ by (3.4e-3).
"""

from __future__ import annotations

import copy
import inspect
import warnings
from pathlib import Path

import _torch_muon
import expecttest
import pytest
import torch
from conftest import read_on_cpu
from torch import nn

import muon_fn as mf
from muon_fn.optim import from_torch_state_dict, to_torch_state_dict

fp32_torch_muon = pytest.fixture(_torch_muon.fp32_torch_muon)  # torch.optim.Muon's math in fp32

KELLER = (3.4445, -4.775, 2.0315)
TOL = {
    "cpu": {"param": 1e-5, "momentum": 1e-6, "ns": 2e-6, "bf16": 4e-3, "bf16_moved": 15},
    # 2x the CPU's on parameters and momenta after 10 steps, 5x on one iteration (whose 2e-6 the
    # CPU already fills to 0.9e-6); bf16: 1.5x, and the "it moved" margin 10x (0.066 travelled).
    "cuda": {"param": 2e-5, "momentum": 2e-6, "ns": 1e-5, "bf16": 6e-3, "bf16_moved": 10},
}
# torch.optim.Muon's settings spelled out (its defaults, except lr and a weight decay to see).
TORCH_SETTINGS = dict(
    weight_decay=0.1,
    momentum=0.95,
    nesterov=True,
    ns_coefficients=KELLER,
    eps=1e-7,
    ns_steps=5,
    adjust_lr_fn=None,
)


class Net(nn.Module):
    """Matrices of several shapes (wide, tall, square), biases and a norm."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(12, 24)
        self.norm = nn.LayerNorm(24)
        self.fc2 = nn.Linear(24, 24)
        self.fc3 = nn.Linear(24, 5)

    def forward(self, x):
        return self.fc3(torch.tanh(self.fc2(self.norm(torch.tanh(self.fc1(x))))))


def make_net(seed: int = 0, device: torch.device | str = "cpu") -> Net:
    torch.manual_seed(seed)
    return Net().to(device)


def tol(device: torch.device) -> dict:
    return TOL[device.type]


def backward(model: nn.Module, step: int) -> None:
    """The same loss on every device: data drawn on the CPU, then moved."""
    g = torch.Generator().manual_seed(100 + step)
    dev = next(model.parameters()).device
    x, y = torch.randn(16, 12, generator=g).to(dev), torch.randn(16, 5, generator=g).to(dev)
    (model(x) - y).square().mean().backward()


def mats(model):
    return [p for p in model.parameters() if p.ndim == 2]


def vecs(model):
    return [p for p in model.parameters() if p.ndim != 2]


def train(model, opts, steps, start=0):
    for step in range(start, start + steps):
        for o in opts:
            o.zero_grad()
        backward(model, step)
        for o in opts:
            o.step()


def torch_pair(model, lr=0.02, **muon_kw):
    return [
        torch.optim.Muon(mats(model), lr=lr, **{**TORCH_SETTINGS, **muon_kw}),
        torch.optim.AdamW(vecs(model), lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01),
    ]


def muon_fn_auto(model, lr=0.02, **kw):
    """One algorithm="auto" group with the torch pair's settings (AdamW half included)."""
    return mf.MuonOptimizer(
        model.parameters(),
        lr=lr,
        **{
            **TORCH_SETTINGS,
            "ns_dtype": torch.float32,
            "adamw_lr": 3e-3,
            "adamw_betas": (0.9, 0.999),
            "adamw_weight_decay": 0.01,
            **kw,
        },
    )


def assert_models_close(a, b, atol):
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(q.detach().cpu(), p.detach().cpu(), atol=atol, rtol=0, msg=n)


def assert_models_equal(a, b):
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n


def assert_state_on(opt, device):
    """Every state tensor of ``opt`` on ``device`` (a checkpoint read on the CPU was moved)."""
    for p, st in opt.state.items():
        assert all(
            v.device == p.device and v.device.type == device.type
            for v in st.values()
            if isinstance(v, torch.Tensor)
        ), {k: v.device for k, v in st.items()}


# --------------------------------------------------------------------------- keywords
def test_every_torch_muon_keyword_is_accepted_with_its_default():
    """Each keyword of torch.optim.Muon's signature, at torch's default, is taken by MuonOptimizer."""
    sig = inspect.signature(torch.optim.Muon)
    lin = nn.Linear(4, 3, bias=False)
    for name, param in sig.parameters.items():
        if name == "params":
            continue
        opt = mf.MuonOptimizer(lin.parameters(), **{name: param.default})
        assert opt.param_groups[0][name] == param.default, name


def test_positional_arguments_after_lr_are_refused():
    lin = nn.Linear(4, 3)
    with pytest.raises(TypeError, match="positional"):
        mf.MuonOptimizer(lin.parameters(), 1e-3, 0.1)  # torch: weight_decay; never momentum


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr_fn", [None, "original", "match_rms_adamw"])
def test_torch_keywords_reproduce_torch_muon_fp32(device, fp32_torch_muon, nesterov, adjust_lr_fn):
    ref, ours = make_net(device=device), make_net(device=device)
    kw = dict(TORCH_SETTINGS, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    topt = torch.optim.Muon(mats(ref), lr=0.02, **kw)
    opt = mf.MuonOptimizer(mats(ours), lr=0.02, **kw, ns_dtype=torch.float32)
    start = [p.detach().clone() for p in mats(ref)]
    train(ref, [topt], 10)
    train(ours, [opt], 10)
    assert max((p - s).abs().max().item() for p, s in zip(mats(ref), start)) > 0.02  # it moved
    for p, q in zip(mats(ref), mats(ours)):
        torch.testing.assert_close(
            q.detach().cpu(), p.detach().cpu(), atol=tol(device)["param"], rtol=0
        )
        torch.testing.assert_close(
            opt.state[q]["momentum_buffer"].cpu(),
            topt.state[p]["momentum_buffer"].cpu(),
            atol=tol(device)["momentum"],
            rtol=0,
        )


def test_torch_keywords_reproduce_torch_muon_bf16(device):
    """torch.optim.Muon as shipped (bf16) against ns_dtype=torch.bfloat16 (see the module docstring)."""
    ref, ours = make_net(device=device), make_net(device=device)
    topt = torch.optim.Muon(mats(ref), lr=0.02, **TORCH_SETTINGS)
    opt = mf.MuonOptimizer(mats(ours), lr=0.02, **TORCH_SETTINGS, ns_dtype=torch.bfloat16)
    start = [p.detach().clone() for p in mats(ref)]
    train(ref, [topt], 5)
    train(ours, [opt], 5)
    diff = max((p - q).abs().max().item() for p, q in zip(mats(ref), mats(ours)))
    travelled = max((p - s).abs().max().item() for p, s in zip(mats(ref), start))
    assert diff < tol(device)["bf16"], (
        diff
    )  # measured 3.2e-3 (1.8e-3 after one step) on 24-wide matrices
    assert travelled > tol(device)["bf16_moved"] * diff, (
        travelled
    )  # measured 0.066: a wrong formula would show


def test_ns_coefficients_select_exactly_that_iteration(device, fp32_torch_muon):
    """With ns_coefficients the default method's preconditioner is off: the result is torch's
    function's (fp32), a per-iteration list of the same triple is the flat triple, and the
    default method (Keller's quintic, 5 steps) is that iteration, while another method gives
    another matrix."""
    from _torch_muon import ns_fp32_twin

    g = torch.Generator().manual_seed(0)
    x = {"w": torch.randn(24, 40, generator=g).to(device)}
    ref = ns_fp32_twin(x["w"], KELLER, 5, 1e-7).cpu()

    def run(**kw):
        return mf.orthogonalize(dtype=torch.float32, **kw).update(x, None)[0]["w"].cpu()

    atol = tol(device)["ns"]
    torch.testing.assert_close(run(coefficients=KELLER), ref, atol=atol, rtol=0)
    assert torch.equal(run(coefficients=[KELLER] * 5), run(coefficients=KELLER))
    torch.testing.assert_close(run(), ref, atol=atol, rtol=0)  # DEFAULT_METHOD is torch's iteration
    assert (run(method="polar_express", steps=5) - ref).abs().max() > 1e-2
    assert mf.orthogonalize(coefficients=KELLER).update(x, None)[0]["w"].shape == (24, 40)


@pytest.mark.parametrize("scale", [1e-2, 1e-4, 1e-6])
def test_small_momenta_are_normalized_like_torch(device, scale):
    """X / max(‖X‖, eps), torch's normalization: exactly scale-invariant above eps (an added eps
    was 7e-4 off at ‖X‖ = 1e-4 and 6e-2 at 1e-6)."""
    from _torch_muon import ns_fp32_twin

    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    x = (x * scale / x.norm()).to(device)
    ours = mf.orthogonalize(coefficients=KELLER, dtype=torch.float32).update({"w": x}, None)[0]["w"]
    torch.testing.assert_close(
        ours.cpu(), ns_fp32_twin(x, KELLER, 5, 1e-7).cpu(), atol=tol(device)["ns"], rtol=0
    )


def test_adjust_lr_fn_none_is_original(device):
    runs = []
    for rule in (None, "original", "keller"):
        model = make_net(device=device)
        train(
            model,
            [mf.MuonOptimizer(model.parameters(), adjust_lr_fn=rule, ns_dtype=torch.float32)],
            2,
        )
        runs.append(model)
    assert_models_equal(runs[0], runs[1])
    assert_models_equal(runs[0], runs[2])


def test_eps_is_the_newton_schulz_epsilon_and_normuon_eps_is_normuons(device):
    # ‖X‖ ≈ 8e-6: below eps=1e-4 the normalization clamps
    x = (torch.randn(8, 8, generator=torch.Generator().manual_seed(0)) * 1e-6).to(device)
    outs = {}
    for name, kw in {
        "default": {},
        "eps": {"eps": 1e-4},
        "normuon_eps": {"normuon_eps": 1.0},
    }.items():
        p = nn.Parameter(torch.zeros(8, 8, device=device))
        opt = mf.MuonOptimizer([p], ns_dtype=torch.float32, **kw)
        p.grad = x.clone()
        opt.step()
        outs[name] = p.detach().clone()
    assert not torch.equal(outs["eps"], outs["default"])
    assert torch.equal(outs["normuon_eps"], outs["default"])  # plain Muon: no NorMuon


class TestRefusedKeywords(expecttest.TestCase):
    def message(self, exc_type, fn) -> str:
        with self.assertRaises(exc_type) as ctx:
            fn()
        return str(ctx.exception)

    def test_old_ns_eps(self):
        lin = nn.Linear(4, 3)
        self.assertExpectedInline(
            self.message(TypeError, lambda: mf.MuonOptimizer(lin.parameters(), ns_eps=1e-7)),
            """MuonOptimizer() got an unexpected keyword argument 'ns_eps': use eps: it is the Newton-Schulz epsilon, as in torch.optim.Muon (NorMuon's epsilon is normuon_eps)""",  # noqa: E501
        )

    def test_torch_flags(self):
        """torch's implementation keywords: refused only where their meaning does not hold."""
        lin = nn.Linear(4, 3)
        msgs = [
            self.message(ValueError, lambda: mf.MuonOptimizer(lin.parameters(), **{k: v}))  # noqa: B023  called at once, in this iteration
            for k, v in (
                ("capturable", True),
                ("differentiable", True),
                ("maximize", True),
                ("fused", "yes"),
            )
        ]
        self.assertExpectedInline(
            "\n".join(msgs),
            """\
capturable=True is not supported: the step compiles its own graphs and cannot be captured in a user's CUDA graph; compile={'mode': 'reduce-overhead'} runs it as CUDA graphs
differentiable=True is not supported: the step runs under torch.no_grad(); differentiating through it is not supported
maximize=True is not supported: muon_fn optimizers minimize; to maximize f, minimize -f
Invalid fused value: 'yes' (expected True, False or None)""",  # noqa: E501
        )

    def test_ns_eps_in_a_param_group(self):
        lin = nn.Linear(4, 3)
        self.assertExpectedInline(
            self.message(
                ValueError, lambda: mf.MuonOptimizer([{"params": lin.parameters(), "ns_eps": 1e-7}])
            ),
            """Invalid param group key 'ns_eps' (this optimizer does not use it): use eps: it is the Newton-Schulz epsilon, as in torch.optim.Muon (NorMuon's epsilon is normuon_eps)""",  # noqa: E501
        )

    def test_non_bool_nesterov(self):
        lin = nn.Linear(4, 3)
        self.assertExpectedInline(
            self.message(TypeError, lambda: mf.MuonOptimizer(lin.parameters(), nesterov=1)),
            """Invalid nesterov: 1 (expected True or False)""",
        )

    def test_adjust_lr_fn_lists_none(self):
        lin = nn.Linear(4, 3)
        self.assertExpectedInline(
            self.message(
                ValueError, lambda: mf.MuonOptimizer(lin.parameters(), adjust_lr_fn="arbitrary")
            ),
            """Invalid adjust_lr_fn: 'arbitrary' (valid: None, 'keller', 'original', 'match_rms_adamw', 'spectral', 'legacy', 'none')""",  # noqa: E501
        )


# --------------------------------------------------------------------------- checkpoints: torch -> muon_fn
def test_torch_muon_checkpoint_loads_directly(device, fp32_torch_muon):
    """A script written for torch.optim.Muon, with MuonOptimizer substituted, resumes from torch's
    checkpoint (read on the CPU, loaded on the device): hyperparameters and momentum carried over,
    then the same trajectory."""
    ref = make_net(device=device)
    topt = torch.optim.Muon(mats(ref), lr=0.03, **TORCH_SETTINGS)
    train(ref, [topt], 3)
    ours = copy.deepcopy(ref)
    opt = mf.MuonOptimizer(mats(ours), ns_dtype=torch.float32)  # muon_fn's defaults until the load
    opt.load_state_dict(read_on_cpu(topt.state_dict()))
    group = opt.param_groups[0]
    assert {k: group[k] for k in TORCH_SETTINGS} == TORCH_SETTINGS and group["lr"] == 0.03
    assert group["method"] is None and group["momentum_kind"] == "ema"
    for p, q in zip(mats(ref), mats(ours)):
        assert torch.equal(opt.state[q]["momentum_buffer"], topt.state[p]["momentum_buffer"])
    train(ref, [topt], 5, start=3)
    train(ours, [opt], 5, start=3)
    assert_models_close(ref, ours, atol=tol(device)["param"])


@pytest.mark.parametrize("layout", ["auto", "hybrid"])
def test_torch_muon_and_adamw_checkpoint_converts(device, fp32_torch_muon, layout):
    """torch.optim.Muon (matrices) + torch.optim.AdamW (the rest) → one MuonOptimizer "auto" group,
    or the hybrid's "muon" and "adamw" groups (the head is a matrix routed to AdamW there)."""
    ref = make_net(device=device)
    if layout == "hybrid":
        muon_names = ["fc1.weight", "fc2.weight"]
        named = dict(ref.named_parameters())
        topts = [
            torch.optim.Muon([named[n] for n in muon_names], lr=0.02, **TORCH_SETTINGS),
            torch.optim.AdamW(
                [p for n, p in named.items() if n not in muon_names],
                lr=3e-3,
                betas=(0.9, 0.999),
                weight_decay=0.01,
            ),
        ]
    else:
        topts = torch_pair(ref)
    train(ref, topts, 3)
    ours = copy.deepcopy(ref)
    if layout == "hybrid":
        opt = mf.create_hybrid_optimizer(
            ours, adamw_names=["fc3.weight"], ns_dtype=torch.float32
        )  # NorMuon: torch's rule loads
    else:
        opt = mf.MuonOptimizer(ours.parameters(), ns_dtype=torch.float32)
    sd = from_torch_state_dict(
        opt, read_on_cpu(topts[0].state_dict()), read_on_cpu(topts[1].state_dict())
    )
    opt.load_state_dict(sd)
    assert_state_on(
        opt, device
    )  # torch.optim.AdamW's steps are CPU tensors; muon_fn's live with the params
    train(ref, topts, 5, start=3)
    train(ours, [opt], 5, start=3)
    assert_models_close(ref, ours, atol=tol(device)["param"])


def test_round_trip_through_muon_fn_continues_torch_bit_exactly(device):
    """torch → muon_fn → torch: the torch optimizers continue exactly as if never converted."""
    ref = make_net(device=device)
    topts = torch_pair(ref)
    train(ref, topts, 3)
    other = copy.deepcopy(ref)
    opt = mf.MuonOptimizer(other.parameters())
    opt.load_state_dict(from_torch_state_dict(opt, *(read_on_cpu(o.state_dict()) for o in topts)))
    back = to_torch_state_dict(opt)
    again = torch_pair(other)
    for o, sd in zip(again, back):
        o.load_state_dict(read_on_cpu(sd))
    train(ref, topts, 3, start=3)
    train(other, again, 3, start=3)
    assert_models_equal(ref, other)


# --------------------------------------------------------------------------- checkpoints: muon_fn -> torch
def test_muon_fn_checkpoint_converts_for_torch(device, fp32_torch_muon):
    ours = make_net(device=device)
    opt = muon_fn_auto(ours)
    train(ours, [opt], 3)
    ref = copy.deepcopy(ours)
    topts = torch_pair(ref, lr=0.5)  # hyperparameters come from the checkpoint
    for o, sd in zip(topts, to_torch_state_dict(opt)):
        o.load_state_dict(read_on_cpu(sd))
    assert topts[0].param_groups[0]["lr"] == 0.02 and topts[1].param_groups[0][
        "lr"
    ] == pytest.approx(3e-3)
    for p, q in zip(mats(ours), mats(ref)):
        assert torch.equal(topts[0].state[q]["momentum_buffer"], opt.state[p]["momentum_buffer"])
    train(ours, [opt], 5, start=3)
    train(ref, topts, 5, start=3)
    assert_models_close(ref, ours, atol=tol(device)["param"])


def test_hybrid_without_decay_on_1d_converts_to_two_torch_adamw_groups(device, fp32_torch_muon):
    """torch.optim.AdamW decays every parameter of a group, so the hybrid's AdamW group (the head
    fc3.weight decays, the biases and norm do not) becomes two torch groups, and back."""
    ours = make_net(device=device)
    opt = mf.create_hybrid_optimizer(
        ours,
        adamw_names=["fc3.weight"],
        adamw_weight_decay=0.1,
        ns_dtype=torch.float32,
        beta2=None,
        compile=False,
    )
    train(ours, [opt], 3)
    muon_sd, adamw_sd = to_torch_state_dict(opt)
    assert [(g["weight_decay"], len(g["params"])) for g in adamw_sd["param_groups"]] == [
        (0.1, 1),
        (0.0, 5),
    ]
    assert adamw_sd["param_groups"][0]["param_names"] == ["fc3.weight"]
    ref = copy.deepcopy(ours)
    named = dict(ref.named_parameters())
    rest = [p for n, p in named.items() if n not in ("fc1.weight", "fc2.weight", "fc3.weight")]
    topts = [
        torch.optim.Muon([named["fc1.weight"], named["fc2.weight"]], lr=0.5),
        torch.optim.AdamW([{"params": [named["fc3.weight"]]}, {"params": rest}], lr=0.5),
    ]
    for o, sd in zip(topts, (muon_sd, adamw_sd)):
        o.load_state_dict(read_on_cpu(sd))
    again = copy.deepcopy(ours)
    opt2 = mf.create_hybrid_optimizer(
        again,
        adamw_names=["fc3.weight"],
        adamw_weight_decay=0.3,
        adamw_decay_1d=True,
        ns_dtype=torch.float32,
        beta2=None,
        compile=False,
    )
    opt2.load_state_dict(from_torch_state_dict(opt2, *map(read_on_cpu, (muon_sd, adamw_sd))))
    adamw_group = opt2.param_groups[1]
    assert adamw_group["weight_decay"] == 0.1 and adamw_group["adamw_decay_1d"] is False
    train(ours, [opt], 5, start=3)
    train(ref, topts, 5, start=3)
    train(again, [opt2], 5, start=3)
    assert_models_close(ref, ours, atol=tol(device)["param"])
    assert_models_equal(ours, again)


def test_round_trip_through_torch_continues_muon_fn_bit_exactly(device):
    """muon_fn → torch → muon_fn (with a scheduler's initial_lr): exact continuation."""
    straight = make_net(device=device)
    opt = muon_fn_auto(straight)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for step in range(3):
        train(straight, [opt], 1, start=step)
        sched.step()
    other = copy.deepcopy(straight)
    opt2 = muon_fn_auto(other, lr=0.5, weight_decay=0.0)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    opt2.load_state_dict(from_torch_state_dict(opt2, *map(read_on_cpu, to_torch_state_dict(opt))))
    sched2.load_state_dict(sched.state_dict())
    for step in range(3, 6):
        train(straight, [opt], 1, start=step)
        sched.step()
        train(other, [opt2], 1, start=step)
        sched2.step()
    assert_models_equal(straight, other)


def test_muon_optimizer_state_dict_in_torch_without_conversion(device):
    """The documented limit: torch.optim.Muon's load_state_dict checks only group and parameter
    counts, so a muon_fn state_dict with the default method loads and its step() fails;
    torch-compatible settings load directly and step like the converted state_dict."""
    model = make_net(device=device)
    opt = mf.MuonOptimizer(mats(model))
    train(model, [opt], 1)
    topt = torch.optim.Muon(mats(model))
    topt.load_state_dict(opt.state_dict())
    with pytest.raises(TypeError):
        topt.step()
    opt = mf.MuonOptimizer(mats(model), **TORCH_SETTINGS)
    train(model, [opt], 1)
    direct, converted = torch.optim.Muon(mats(model)), torch.optim.Muon(mats(model))
    direct.load_state_dict(opt.state_dict())
    converted.load_state_dict(to_torch_state_dict(opt)[0])
    for key in TORCH_SETTINGS:
        assert direct.param_groups[0][key] == converted.param_groups[0][key], key


def test_old_checkpoint_with_ns_eps_loads(device):
    """Checkpoints from before eps became the Newton–Schulz epsilon: eps → normuon_eps, ns_eps → eps."""
    model = make_net(device=device)
    opt = mf.MuonOptimizer(model.parameters(), beta2=0.9)
    train(model, [opt], 1)
    sd = read_on_cpu(opt.state_dict())
    for g in sd["param_groups"]:
        g["ns_eps"], g["eps"] = 2e-7, 3e-8
        del g["normuon_eps"]
    opt2 = mf.MuonOptimizer(model.parameters(), beta2=0.9)
    opt2.load_state_dict(sd)
    assert_state_on(opt2, device)
    assert opt2.param_groups[0]["eps"] == 2e-7 and opt2.param_groups[0]["normuon_eps"] == 3e-8
    assert "ns_eps" not in opt2.param_groups[0]


def test_a_checkpoint_lacking_keys_muon_fn_adds_keeps_this_optimizers_values():
    """A saved Muon group that has torch.optim.Muon's keys but lacks keys muon_fn adds (``base_lr``,
    which scales the AdamW half with the schedule, ``ns_stepsize``) takes them from the loading
    optimizer's group, with one warning naming them and their values; the saved keys load as
    saved. One lacking a key of torch's (``momentum``) is still refused."""
    import warnings

    model = make_net()
    opt = mf.MuonOptimizer(model.parameters(), lr=0.01, weight_decay=0.1)
    train(model, [opt], 1)
    sd = opt.state_dict()
    for g in sd["param_groups"]:
        del g["base_lr"], g["ns_stepsize"]
    other = mf.MuonOptimizer(model.parameters(), lr=0.03, ns_stepsize=0.9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        other.load_state_dict(sd)
    told = [str(w.message) for w in caught if "lack keys" in str(w.message)]
    assert told == [
        "MuonOptimizer.load_state_dict: the state_dict's param groups lack keys that muon_fn adds "
        "to torch.optim.Muon's; they keep this optimizer's values: group 0: base_lr=0.03; group 0: "
        "ns_stepsize=0.9"
    ], told
    assert caught[[str(w.message) for w in caught].index(told[0])].filename == __file__
    group = other.param_groups[0]
    assert (group["base_lr"], group["ns_stepsize"], group["lr"], group["weight_decay"]) == (
        0.03,
        0.9,
        0.01,
        0.1,
    )
    sd = opt.state_dict()
    del sd["param_groups"][0]["momentum"]
    with pytest.raises(ValueError, match=r"lacks this optimizer's hyperparameters \['momentum'\]"):
        mf.MuonOptimizer(model.parameters()).load_state_dict(sd)


# --------------------------------------------------------------------------- conversion errors
def _state_of(opt):
    return (
        [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        {id(p): {k: v.clone() for k, v in st.items()} for p, st in opt.state.items()},
    )


class TestConversionErrors(expecttest.TestCase):
    def message(self, exc_type, fn) -> str:
        with self.assertRaises(exc_type) as ctx:
            fn()
        return str(ctx.exception)

    def test_other_methods_are_not_torchs(self):
        opt = mf.MuonOptimizer(
            make_net().parameters(), beta2=0.9, momentum_kind="sgd", method="polar_express"
        )
        self.assertExpectedInline(
            self.message(ValueError, lambda: to_torch_state_dict(opt)),
            """param group 0 cannot be written as torch.optim.Muon: method='polar_express' (torch.optim.Muon runs one quintic: pass ns_coefficients=(a, b, c) or method='quintic'); momentum_kind='sgd' (torch.optim.Muon's is 'ema'); beta2=0.9 (torch.optim.Muon's is None)""",  # noqa: E501
        )

    def test_conv_weight(self):
        model = nn.Sequential(nn.Conv2d(2, 4, 3))
        opt = mf.MuonOptimizer(model.named_parameters(), **TORCH_SETTINGS)
        self.assertExpectedInline(
            self.message(ValueError, lambda: to_torch_state_dict(opt)),
            """parameter '0.weight' has shape (4, 2, 3, 3): torch.optim.Muon takes 2-D parameters only""",
        )

    def test_parameter_count_mismatch_changes_nothing(self):
        model = make_net()
        topt = torch.optim.Muon(mats(model)[:2], **TORCH_SETTINGS)
        opt = mf.MuonOptimizer(mats(model))
        train(model, [opt], 1)
        before = _state_of(opt)
        self.assertExpectedInline(
            self.message(ValueError, lambda: opt.load_state_dict(topt.state_dict())),
            """the torch.optim.Muon state_dict has 2 parameters, but this optimizer has 3 Muon parameters (its Muon parameters, in order, are the torch.optim.Muon's)""",  # noqa: E501
        )
        after = _state_of(opt)
        self.assertEqual(before[0], after[0])
        for key, st in before[1].items():
            for k, v in st.items():
                self.assertTrue(torch.equal(after[1][key][k], v))

    def test_amsgrad(self):
        model = make_net()
        muon_sd = torch.optim.Muon(mats(model)).state_dict()
        adamw_sd = torch.optim.AdamW(vecs(model), amsgrad=True).state_dict()
        opt = mf.MuonOptimizer(model.parameters())
        self.assertExpectedInline(
            self.message(ValueError, lambda: from_torch_state_dict(opt, muon_sd, adamw_sd)),
            """the torch.optim.AdamW state_dict's param group 0 has amsgrad=True, which muon_fn's AdamW does not offer""",  # noqa: E501
        )

    def test_adamw_schedule_not_following_muons(self):
        model = make_net()
        muon_sd = torch.optim.Muon(mats(model), lr=0.02).state_dict()
        adamw = torch.optim.AdamW(vecs(model), lr=1e-3)
        adamw.param_groups[0]["initial_lr"] = 2e-3  # halved by a scheduler Muon did not follow
        opt = mf.MuonOptimizer(model.parameters())
        self.assertExpectedInline(
            self.message(
                ValueError, lambda: from_torch_state_dict(opt, muon_sd, adamw.state_dict())
            ),
            """param group 0 (algorithm='auto') runs AdamW at adamw_lr*lr/base_lr = 0.002, but torch.optim.AdamW's lr is 0.001: its schedule did not follow Muon's; use separate 'muon' and 'adamw' groups (muon_fn.create_hybrid_optimizer)""",  # noqa: E501
        )

    def test_not_a_muon_optimizer(self):
        opt = mf.SpectralSphereOptimizer(make_net().parameters())
        self.assertExpectedInline(
            self.message(TypeError, lambda: to_torch_state_dict(opt)),
            """expected a muon_fn.MuonOptimizer (or a hybrid built on it), got SpectralSphereOptimizer""",
        )


# --------------------------------------------------------------------------- DCP checkpoint directories
def _matrices(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 6, bias=False), nn.Linear(6, 4, bias=False))


def _steps(model, opt, steps, start=0):
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _dcp_save(path, model, opt):
    """What Lightning's ModelParallelStrategy and torchtitan write, in one process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming ... a single process"
        dcp.save(
            {"model": model.state_dict(), "optimizer_0": get_optimizer_state_dict(model, opt)},
            checkpoint_id=str(path),
            no_dist=True,
        )


def _dcp_resume(path, model, opt):
    """Lightning's sharded-checkpoint load: DCP fills the optimizer's own state_dict, strictly."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    template = {"model": model.state_dict(), "optimizer_0": get_optimizer_state_dict(model, opt)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*in a single process")
        dcp.load(template, checkpoint_id=str(path), no_dist=True)
    model.load_state_dict(template["model"])
    set_optimizer_state_dict(model, opt, template["optimizer_0"])


def test_torch_muon_dcp_checkpoint_resumes_with_muon_optimizer_after_conversion(tmp_path):
    """A torch.optim.Muon DCP checkpoint fails DCP's strict load into a MuonOptimizer (its groups
    lack muon_fn's keys); from_torch_checkpoint's copy loads, with one warning naming the keys kept
    at this optimizer's values, and continues exactly as the same checkpoint loaded through
    torch.save (from_torch_state_dict's conversion); torch.optim.Muon loads the copy as its own."""
    from muon_fn.optim import from_torch_checkpoint

    model = _matrices()
    topt = torch.optim.Muon(model.parameters(), lr=0.03, **TORCH_SETTINGS)
    _steps(model, topt, 2)
    _dcp_save(tmp_path / "torch", model, topt)
    plain = _matrices(1)
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(
        CheckpointException,
        match=r"Missing key in checkpoint state_dict: optimizer_0\.param_groups",
    ):
        _dcp_resume(tmp_path / "torch", plain, mf.MuonOptimizer(plain.parameters(), compile=False))
    assert from_torch_checkpoint(tmp_path / "torch", tmp_path / "conv") == [
        "optimizer_0.param_groups.0"
    ]

    via_dcp, via_save = _matrices(1), copy.deepcopy(model)
    opt = mf.MuonOptimizer(via_dcp.parameters(), lr=0.5, ns_dtype=torch.float32, compile=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _dcp_resume(tmp_path / "conv", via_dcp, opt)
    told = [str(w.message) for w in caught if "does not save these keys" in str(w.message)]
    assert told == [
        "MuonOptimizer.load_state_dict: a torch.optim.Muon checkpoint does not save these keys; they keep this "
        "optimizer's values: group 0: ns_dtype='torch.float32', normuon_eps=1e-08, adamuon_eps=1e-08, "
        "adamuon_sign=True, momentum_dtype=None, state_bits=32, matrix_view=None, adamw_lr=0.001, "
        "adamw_betas=(0.9, 0.95), adamw_eps=1e-08, adamw_weight_decay=0.01, adamw_decay_1d=False, "
        "algorithm='auto', gradient_accumulation_steps=1"
    ], told  # base_lr, method, ...: set from torch's
    group = opt.param_groups[0]
    assert {k: group[k] for k in TORCH_SETTINGS} == TORCH_SETTINGS and group["lr"] == 0.03
    assert (group["method"], group["momentum_kind"], group["base_lr"]) == (None, "ema", 0.03)
    for p, q in zip(model.parameters(), via_dcp.parameters()):
        assert torch.equal(opt.state[q]["momentum_buffer"], topt.state[p]["momentum_buffer"])
    ref = mf.MuonOptimizer(via_save.parameters(), ns_dtype=torch.float32, compile=False)
    ref.load_state_dict(copy.deepcopy(topt.state_dict()))
    _steps(via_dcp, opt, 2, start=2)
    _steps(via_save, ref, 2, start=2)
    assert_models_equal(via_save, via_dcp)

    theirs = _matrices(1)
    again = torch.optim.Muon(theirs.parameters(), lr=0.5)
    _dcp_resume(tmp_path / "conv", theirs, again)
    _steps(theirs, again, 2, start=2)
    _steps(model, topt, 2, start=2)
    assert_models_equal(model, theirs)


def test_muon_optimizer_dcp_checkpoint_resumes_with_torch_muon_after_conversion(tmp_path):
    """The other way: torch.optim.Muon takes only its own keys from a MuonOptimizer DCP checkpoint,
    and muon_fn writes ns_steps=None there; to_torch_checkpoint's copy has torch's values and
    continues as to_torch_state_dict's conversion does, bit for bit; a MuonOptimizer loads it too."""
    from muon_fn.optim import to_torch_checkpoint

    model = _matrices()
    opt = mf.MuonOptimizer(model.parameters(), lr=0.03, **TORCH_SETTINGS, compile=False)
    opt.param_groups[0]["ns_steps"] = None  # muon_fn's own term for the method's steps
    _steps(model, opt, 2)
    _dcp_save(tmp_path / "muon", model, opt)
    assert to_torch_checkpoint(tmp_path / "muon", tmp_path / "conv") == [
        "optimizer_0.param_groups.0"
    ]
    via_dcp, via_save = _matrices(1), copy.deepcopy(model)
    topt = torch.optim.Muon(via_dcp.parameters(), lr=0.5)
    _dcp_resume(tmp_path / "conv", via_dcp, topt)
    assert topt.param_groups[0]["ns_steps"] == 5 and topt.param_groups[0]["lr"] == 0.03
    ref = torch.optim.Muon(via_save.parameters())
    ref.load_state_dict(to_torch_state_dict(opt)[0])
    _steps(via_dcp, topt, 2, start=2)
    _steps(via_save, ref, 2, start=2)
    assert_models_equal(via_save, via_dcp)
    ours = _matrices(1)
    back = mf.MuonOptimizer(ours.parameters(), compile=False)
    _dcp_resume(tmp_path / "conv", ours, back)
    assert back.param_groups[0]["ns_steps"] == 5 and back.param_groups[0]["algorithm"] == "auto"


class TestCheckpointConversionErrors(expecttest.TestCase):
    def message(self, exc_type, fn) -> str:
        with self.assertRaises(exc_type) as ctx:
            fn()
        return str(ctx.exception).replace(self.root, "TMP")

    def setUp(self):
        import tempfile

        self.root = tempfile.mkdtemp()
        self.tmp = Path(self.root)

    def test_not_a_dcp_directory(self):
        from muon_fn.optim import from_torch_checkpoint

        self.assertExpectedInline(
            self.message(ValueError, lambda: from_torch_checkpoint(self.tmp, self.tmp / "out")),
            """from_torch_checkpoint: 'TMP' is not a torch.distributed.checkpoint directory (it has no .metadata file)""",  # noqa: E501
        )

    def test_no_group_to_convert_and_out_exists(self):
        from muon_fn.optim import from_torch_checkpoint, to_torch_checkpoint

        model = _matrices()
        _dcp_save(self.tmp / "muon", model, mf.MuonOptimizer(model.parameters(), compile=False))
        self.assertExpectedInline(
            self.message(
                ValueError, lambda: from_torch_checkpoint(self.tmp / "muon", self.tmp / "out")
            ),
            """from_torch_checkpoint: 'TMP/muon' holds no torch.optim.Muon param group (a group with lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn and no 'algorithm')""",  # noqa: E501
        )
        self.assertExpectedInline(
            self.message(
                FileExistsError, lambda: to_torch_checkpoint(self.tmp / "muon", self.tmp / "muon")
            ),
            """to_torch_checkpoint: out='TMP/muon' exists; give a new directory""",
        )

    def test_what_torch_cannot_run_is_refused_before_writing(self):
        from muon_fn.optim import to_torch_checkpoint

        model = _matrices()
        for name, kw in (("pe", dict(method="polar_express")), ("q8", dict(state_bits=8))):
            opt = mf.MuonOptimizer(model.parameters(), compile=False, **kw)
            _steps(model, opt, 1)
            _dcp_save(self.tmp / name, model, opt)
        self.assertExpectedInline(
            self.message(
                ValueError, lambda: to_torch_checkpoint(self.tmp / "pe", self.tmp / "out")
            ),
            """param group 0 cannot be written as torch.optim.Muon: method='polar_express' (torch.optim.Muon runs one quintic: pass ns_coefficients=(a, b, c) or method='quintic')""",  # noqa: E501
        )
        self.assertExpectedInline(
            self.message(
                ValueError, lambda: to_torch_checkpoint(self.tmp / "q8", self.tmp / "out")
            ),
            """to_torch_checkpoint: optimizer_0.param_groups.0 has algorithm='auto', state_bits=8: torch.optim.Muon holds Muon parameters with fp32 momentum only (algorithm 'auto' or 'muon', state_bits=32)""",  # noqa: E501
        )
        self.assertFalse((self.tmp / "out").exists())
