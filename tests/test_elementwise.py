"""Layer-wise gradient normalization and the elementwise TritonMuon / TritonMuonW family.

``normalize_layerwise``: hypothesis properties (norm 1, zero stays zero, scale invariance).
``triton_muon`` and the two classes: against :func:`reference_run`, the rule written out as a
plain fp32 loop, for every option (Nesterov, layer-wise norm, L2 and decoupled decay, several
steps, a group with another lr); torch-worded validation errors; the compiled default;
``.grad`` untouched; no host reads. ``layerwise_norm`` in the Muon recipe and ``MuonOptimizer``.
The torch.optim conventions suite runs both classes too (tests/test_optim_conventions.py).

The device lane (tests/conftest.py): a test taking ``device`` draws parameters and gradients on the
CPU, moves them there, runs the class and the plain loop on that device and compares on the CPU.
Tolerances:

- elementwise (the classes and the recipe against the plain loop): 1e-6 on every device. Both
  sides are IEEE-rounded elementwise kernels on the same device; what differs is an ulp here and
  there (lerp against the written formula, a GPU compiler's fused multiply-adds, the reduction
  order of a layer-wise norm), far below 1e-6 at these magnitudes, and β₂ ≥ 0.9 keeps m/√v
  bounded, so an ulp does not grow.
- Muon (fp32 Newton–Schulz), per device (``TOL``): 1e-6 on the CPU; 2e-5 on CUDA, where fp32 GEMMs reduce in another
  order (TF32 stays off) and the first iterations amplify rounding near σ = 0 (slope ≈ 3.4 per
  quintic step).
"""

from __future__ import annotations

import copy
import inspect

import expecttest
import pytest
import torch
from conftest import roundtrip
from hypothesis import given
from hypothesis import strategies as st
from test_compile import _host_reads
from torch._dynamo.testing import CompileCounterWithBackend

import muon_fn as mf

# Parameters, gradients and states are compared to the plain loop to this tolerance (fp32), on
# every device; Muon's fp32 iteration to ``TOL`` of the device (module docstring).
ATOL = RTOL = 1e-6
TOL = {"cpu": 1e-6, "cuda": 2e-5}
CPU = torch.device("cpu")


# --------------------------------------------------------------------------------------------
# normalize_layerwise


def tensors(dtype=torch.float32, min_norm=1e-3):
    """Nonzero tensors of 0 to 3 dims with norm at least ``min_norm``, times a scale 1e-3..1e3."""

    @st.composite
    def build(draw):
        shape = tuple(draw(st.lists(st.integers(1, 7), min_size=0, max_size=3)))
        seed = draw(st.integers(0, 2**16))
        scale = draw(st.floats(1e-3, 1e3))
        g = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        g = (
            g
            / torch.linalg.vector_norm(g).clamp_min(1e-30)
            * max(min_norm, float(torch.linalg.vector_norm(g)))
        )
        return (g * scale).to(dtype)

    return build()


def normalize(tree, eps=1e-8):
    tx = mf.normalize_layerwise(eps)
    out, state = tx.update(tree, tx.init(tree))
    assert state == mf.EmptyState()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@given(data=st.data())
def test_normalize_layerwise_gives_norm_one(dtype, data):
    g = data.draw(tensors(dtype))
    out = normalize({"g": g})["g"]
    assert out.shape == g.shape and out.dtype == dtype
    torch.testing.assert_close(
        torch.linalg.vector_norm(out.double()).item(), 1.0, atol=1e-6, rtol=0
    )


@given(data=st.data(), c=st.floats(1e-3, 1e3))
def test_normalize_layerwise_is_scale_invariant(data, c):
    g = data.draw(tensors())
    a, b = normalize([g, g * c])
    torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("shape", [(), (5,), (4, 3), (2, 3, 4), (0, 4)], ids=str)
def test_normalize_layerwise_zero_stays_zero(shape):
    out = normalize({"z": torch.zeros(shape), "missing": None})
    assert out["missing"] is None
    assert torch.equal(out["z"], torch.zeros(shape))


def test_normalize_layerwise_each_tensor_by_its_own_norm():
    """Per leaf, not per tree; a bf16 gradient is normalized in fp32 and comes back in bf16;
    below eps the division is by eps."""
    a, b = torch.full((3, 4), 2.0), torch.full((5,), 1e-3)
    out = normalize({"a": a, "b": b, "h": a.bfloat16(), "tiny": torch.full((4,), 1e-10)}, eps=1e-8)
    torch.testing.assert_close(out["a"], a / a.norm(), atol=0, rtol=0)
    torch.testing.assert_close(out["b"], b / b.norm(), atol=0, rtol=0)
    assert out["h"].dtype == torch.bfloat16
    torch.testing.assert_close(out["h"].float(), a / a.norm(), atol=1e-3, rtol=0)
    torch.testing.assert_close(out["tiny"], torch.full((4,), 1e-2))


def test_normalize_layerwise_info():
    info = mf.info(mf.normalize_layerwise())
    assert info.leafwise and info.scope == "matrix"  # the norm needs the whole tensor


# --------------------------------------------------------------------------------------------
# The reference: the rule of TritonMuon / TritonMuonW as a plain loop, fp32.


def reference_run(
    params,
    grads_per_step,
    *,
    lr,
    b1=0.9,
    b2=0.999,
    wd=0.0,
    eps=1e-8,
    decoupled=False,
    nesterov=False,
    layerwise=False,
):
    """Every step, per tensor: g ← g + wd·θ (L2); g ← g/(‖g‖ + 1e-8) (layerwise: the original
    TritonMuon kernel normalizes the sum); m ← β₁m + (1−β₁)g; v ← β₂v + (1−β₂)g²;
    θ ← θ − lr·m̃/(√v + ε) − lr·wd·θ (decoupled), m̃ = β₁m + (1−β₁)g with Nesterov. ``lr`` may
    be a list (one per tensor). Returns θ, m, v."""
    theta = [p.clone() for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    lrs = lr if isinstance(lr, list) else [lr] * len(params)
    for grads in grads_per_step:
        for i, g in enumerate(grads):
            if not decoupled:
                g = g + wd * theta[i]
            if layerwise:
                g = g / (torch.linalg.vector_norm(g) + 1e-8)
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            numerator = b1 * m[i] + (1 - b1) * g if nesterov else m[i]
            decay = lrs[i] * wd * theta[i] if decoupled else 0.0
            theta[i] = theta[i] - lrs[i] * numerator / (v[i].sqrt() + eps) - decay
    return theta, m, v


SHAPES = [(8, 6), (8,), (3, 8)]


def make_params(seed=0, shapes=SHAPES, device=CPU):
    """Drawn on the CPU (the same values on every device), then moved to ``device``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(device) for s in shapes]


def grads_for(steps, seed=1, shapes=SHAPES, device=CPU):
    """Gradients of very different scales per tensor and per step (so the layer-wise norm and
    the L2 term both matter); drawn on the CPU, then moved to ``device``."""
    g = torch.Generator().manual_seed(seed)
    return [
        [
            (torch.randn(s, generator=g) * 10.0 ** (i - t % 3)).to(device)
            for i, s in enumerate(shapes)
        ]
        for t in range(steps)
    ]


def assert_close(actual, expected, tol=ATOL):
    for a, b in zip(actual, expected):
        torch.testing.assert_close(a.cpu(), b.cpu(), atol=tol, rtol=tol)


# The classes' options (the decay is L2 for TritonMuon, decoupled for TritonMuonW): every
# combination of nesterov, layerwise_norm and weight decay.
OPTIONS = {
    f"nesterov={n},layerwise={lw},wd={wd}": {"nesterov": n, "layerwise": lw, "wd": wd}
    for n in (False, True)
    for lw in (False, True)
    for wd in (0.0, 0.1)
}
OPTIONS["defaults"] = {}


# β₂ ≥ 0.9: with a short second-moment memory m/√v has no bound (β₂ = 0: m_t/|g_t|), and an ulp of
# difference between lerp and the written formula in m grows past 1e-6 in θ.
@given(
    b1=st.floats(0.0, 0.99),
    b2=st.floats(0.9, 0.9999),
    lr=st.floats(1e-4, 0.1),
    wd=st.floats(0.0, 0.5),
    decoupled=st.booleans(),
    nesterov=st.booleans(),
    layerwise=st.booleans(),
    steps=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_triton_muon_recipe_matches_the_plain_loop(
    b1, b2, lr, wd, decoupled, nesterov, layerwise, steps, seed
):
    """The recipe against the plain loop (torch.optim.Adam's lerp for m against the written
    β₁m + (1 − β₁)g: equal up to rounding)."""
    params, grads = make_params(seed), grads_for(steps, seed + 1)
    tx = mf.triton_muon(
        lr,
        b1,
        b2,
        weight_decay=wd,
        decoupled=decoupled,
        nesterov=nesterov,
        layerwise_norm=layerwise,
    )
    state, theta = tx.init(params), params
    for g in grads:
        updates, state = tx.update(g, state, theta)
        theta = mf.apply_updates(theta, updates)
    expected, m, v = reference_run(
        params,
        grads,
        lr=lr,
        b1=b1,
        b2=b2,
        wd=wd,
        decoupled=decoupled,
        nesterov=nesterov,
        layerwise=layerwise,
    )
    assert_close(theta, expected)
    adam = state[-2]  # chain(..., scale_by_adam, [decay], scale_by_learning_rate)
    adam = adam if isinstance(adam, mf.ScaleByAdamState) else state[-3]
    assert_close(adam.mu, m)
    assert_close(adam.nu, v)


# --------------------------------------------------------------------------------------------
# The classes.


def run_class(cls, steps=5, groups=None, device=CPU, **kwargs):
    """``cls`` on :func:`make_params` (optionally in param groups) for ``steps`` steps of
    :func:`grads_for`, on ``device``; returns the parameters and the optimizer."""
    params = [p.clone().requires_grad_() for p in make_params(device=device)]
    opt = cls(groups(params) if groups else params, **{"compile": False, **kwargs})
    for grads in grads_for(steps, device=device):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
    return params, opt


def f32(x: float) -> float:
    """``x`` as the optimizers hold a per-step hyperparameter (lr, momentum, velocity): a 0-d
    fp32 tensor. 1 − β is then exact for that value (0.999 acts as 0.99900001287)."""
    return float(torch.tensor(x, dtype=torch.float32))


def reference_kwargs(cls, options):
    ref = {
        "decoupled": cls is mf.TritonMuonW,
        "wd": 0.0 if cls is mf.TritonMuon else 1e-2,
        "b1": f32(0.9),
        "b2": f32(0.999),
        **options,
    }
    cls_kwargs = {
        "weight_decay": ref["wd"],
        "nesterov": ref.get("nesterov", False),
        "layerwise_norm": ref.get("layerwise", False),
    }
    return ref, cls_kwargs


@pytest.mark.parametrize("cls", [mf.TritonMuon, mf.TritonMuonW], ids=lambda c: c.__name__)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_classes_match_the_plain_loop(device, cls, option):
    ref, kwargs = reference_kwargs(cls, OPTIONS[option])
    params, opt = run_class(cls, lr=0.01, device=device, **kwargs)
    expected, m, v = reference_run(
        make_params(device=device), grads_for(5, device=device), lr=0.01, **ref
    )
    assert_close(params, expected)
    assert_close([opt.state[p]["exp_avg"] for p in params], m)
    assert_close([opt.state[p]["exp_avg_sq"] for p in params], v)
    assert all(float(opt.state[p]["step"]) == 5 for p in params)


@pytest.mark.parametrize("cls", [mf.TritonMuon, mf.TritonMuonW], ids=lambda c: c.__name__)
def test_param_group_with_its_own_lr_and_hyperparameters(device, cls):
    def groups(ps):
        return [
            {"params": ps[:2]},
            {"params": ps[2:], "lr": 0.003, "momentum": 0.8, "velocity": 0.99},
        ]

    params, _ = run_class(cls, groups=groups, lr=0.01, weight_decay=0.1, device=device)
    decoupled = cls is mf.TritonMuonW
    params0, grads = make_params(device=device), grads_for(5, device=device)
    first, _, _ = reference_run(
        params0, grads, lr=0.01, b1=f32(0.9), b2=f32(0.999), wd=0.1, decoupled=decoupled
    )
    second, _, _ = reference_run(
        params0[2:],
        [g[2:] for g in grads],
        lr=0.003,
        b1=f32(0.8),
        b2=f32(0.99),
        wd=0.1,
        decoupled=decoupled,
    )
    assert_close(params, first[:2] + second)


def test_without_bias_correction_early_steps_are_longer_than_adams(device):
    """The documented step lengths: a constant gradient moves θ by lr·(1 − β₁ᵗ)/√(1 − β₂ᵗ) at
    step t (3.16·lr, 6.57·lr at t = 12, 1.26·lr at t = 1000), where Adam moves it by lr."""
    p = torch.nn.Parameter(torch.zeros(1, device=device))
    opt = mf.TritonMuon([p], lr=1e-3, compile=False, nonfinite=None)
    steps = []
    for _ in range(1000):
        before = p.detach().clone()
        p.grad = torch.ones(1, device=device)
        opt.step()
        steps.append(float(before - p) / 1e-3)
    assert [round(steps[t - 1], 2) for t in (1, 12, 1000)] == [3.16, 6.57, 1.26]


def test_defaults_and_signature_are_the_seeds():
    def seed_part(cls):
        sig = inspect.signature(cls)
        return [
            (n, p.default)
            for n, p in sig.parameters.items()
            if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
        ]

    assert seed_part(mf.TritonMuon) == [
        ("params", inspect.Parameter.empty),
        ("lr", 1e-3),
        ("momentum", 0.9),
        ("velocity", 0.999),
        ("weight_decay", 0.0),
        ("nesterov", False),
        ("layerwise_norm", False),
    ]
    assert seed_part(mf.TritonMuonW) == [
        (n, 1e-2 if n == "weight_decay" else d) for n, d in seed_part(mf.TritonMuon)
    ]
    p = torch.nn.Parameter(torch.zeros(2, 2))
    assert (
        mf.TritonMuon([p]).defaults["eps"] == 1e-8
        and mf.TritonMuonW([p]).defaults["weight_decay"] == 1e-2
    )
    assert mf.optim.TritonMuon is mf.TritonMuon and mf.optim.TritonMuonW is mf.TritonMuonW


def test_seed_positional_call():
    p = torch.nn.Parameter(torch.zeros(2, 2))
    opt = mf.TritonMuonW([p], 0.01, 0.8, 0.99, 0.1, True, True, compile=False)
    assert {
        k: opt.defaults[k]
        for k in ("lr", "momentum", "velocity", "weight_decay", "nesterov", "layerwise_norm")
    } == dict(
        lr=0.01, momentum=0.8, velocity=0.99, weight_decay=0.1, nesterov=True, layerwise_norm=True
    )


@pytest.mark.parametrize("cls", [mf.TritonMuon, mf.TritonMuonW], ids=lambda c: c.__name__)
def test_step_does_not_modify_grads(device, cls):
    params = [p.clone().requires_grad_() for p in make_params(device=device)]
    opt = cls(params, weight_decay=0.1, layerwise_norm=True, nesterov=True, compile=False)
    grads = grads_for(2, device=device)
    for step in range(2):
        for p, g in zip(params, grads[step]):
            p.grad = g.clone()
        opt.step()
        assert all(torch.equal(p.grad, g) for p, g in zip(params, grads[step]))


@pytest.mark.parametrize("compile", [False, {"backend": "eager"}], ids=["eager", "compiled"])
@pytest.mark.parametrize("cls", [mf.TritonMuon, mf.TritonMuonW], ids=lambda c: c.__name__)
@pytest.mark.slow
def test_step_reads_nothing_back_and_schedules_do_not_recompile(device, cls, compile):
    counter = CompileCounterWithBackend("eager")
    params = [p.clone().requires_grad_() for p in make_params(device=device)]
    opt = cls(
        params,
        lr=0.01,
        layerwise_norm=True,
        nesterov=True,
        compile=compile and {"backend": counter},
    )
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=0.05, total_steps=10, cycle_momentum=True, base_momentum=0.85, max_momentum=0.95
    )
    for step, grads in enumerate(grads_for(6, device=device)):
        for p, g in zip(params, grads):
            p.grad = g
        if step == 0:
            opt.step()  # compiles
            graphs = counter.frame_count
        else:
            opt.param_groups[0]["velocity"] = 0.99 + step / 1000  # a velocity schedule
            assert _host_reads(opt.step) == 0, step
        sched.step()
    assert counter.frame_count == graphs == (len(SHAPES) if compile else 0)


@pytest.mark.inductor
@pytest.mark.parametrize("cls", [mf.TritonMuon, mf.TritonMuonW], ids=lambda c: c.__name__)
@pytest.mark.slow
def test_compiled_default_matches_the_plain_loop(device, cls, compiled_default):
    """The real default: ``compile=True`` with inductor (no ``compile=`` given)."""
    shapes = [(8, 6), (8,)]
    params = [p.clone().requires_grad_() for p in make_params(shapes=shapes, device=device)]
    opt = cls(params, lr=0.01, weight_decay=0.1, nesterov=True, layerwise_norm=True)
    grads = grads_for(4, shapes=shapes, device=device)
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g
        opt.step()
    (variant,) = opt._runtimes[0].variants
    in_place = variant.steps[(True, False)]  # the default: written in the graph, no telemetry
    scope = mf.core.base.info(variant.tx).scope  # layerwise_norm makes it a matrix transform
    expected = mf.core.compile.for_scope(
        {"fullgraph": True, "dynamic": False}, scope, params[0].device
    )  # inductor
    assert in_place.options == expected and len(in_place.compiled) == len(shapes)
    expected, _, _ = reference_run(
        make_params(shapes=shapes, device=device),
        grads,
        lr=0.01,
        b1=f32(0.9),
        b2=f32(0.999),
        wd=0.1,
        nesterov=True,
        layerwise=True,
        decoupled=cls is mf.TritonMuonW,
    )
    assert_close(params, expected)


@pytest.mark.parametrize("cls", [mf.TritonMuon, mf.TritonMuonW], ids=lambda c: c.__name__)
def test_state_dict_round_trip_and_keys(device, cls):
    params, opt = run_class(cls, steps=2, lr=0.01, layerwise_norm=True, device=device)
    assert sorted(opt.state[params[0]]) == ["exp_avg", "exp_avg_sq", "step"]
    clone = [p.detach().clone().requires_grad_() for p in params]
    other = cls(clone, lr=0.5, layerwise_norm=True, compile=False)
    other.load_state_dict(roundtrip(opt.state_dict()))
    assert other.param_groups[0]["lr"] == 0.01
    for ps, o in ((params, opt), (clone, other)):
        for p, g in zip(ps, grads_for(3, seed=9, device=device)[2]):
            p.grad = g.clone()
        o.step()
    assert all(torch.equal(p, q) for p, q in zip(params, clone))


class TestValidation(expecttest.TestCase):
    def msg(self, fn, error=ValueError):
        with self.assertRaises(error) as cm:
            fn()
        return str(cm.exception)

    def test_class_messages_use_torchs_wording(self):
        p = [torch.nn.Parameter(torch.zeros(2, 2))]
        for cls in (mf.TritonMuon, mf.TritonMuonW):
            self.assertExpectedInline(
                self.msg(lambda: cls(p, lr=-1.0)),  # noqa: B023  called at once, in this iteration
                """Invalid learning rate: -1.0""",
            )
            self.assertExpectedInline(
                self.msg(lambda: cls(p, momentum=1.0)),  # noqa: B023  called at once, in this iteration
                """Invalid momentum value: 1.0 (expected 0 <= momentum < 1)""",
            )
            self.assertExpectedInline(
                self.msg(lambda: cls(p, velocity=1.0)),  # noqa: B023  called at once, in this iteration
                """Invalid velocity value: 1.0 (expected 0 <= velocity < 1)""",
            )
            self.assertExpectedInline(
                self.msg(lambda: cls(p, velocity=-0.5)),  # noqa: B023  called at once, in this iteration
                """Invalid velocity value: -0.5 (expected 0 <= velocity < 1)""",
            )
            self.assertExpectedInline(
                self.msg(lambda: cls(p, weight_decay=-0.1)),  # noqa: B023  called at once, in this iteration
                """Invalid weight_decay value: -0.1""",
            )
            self.assertExpectedInline(
                self.msg(lambda: cls(p, eps=0.0)),  # noqa: B023  called at once, in this iteration
                """Invalid eps value: 0.0 (expected > 0)""",
            )
        self.assertExpectedInline(
            self.msg(lambda: mf.TritonMuon(p, nesterov=1), TypeError),
            """Invalid nesterov: 1 (expected True or False)""",
        )
        self.assertExpectedInline(
            self.msg(lambda: mf.TritonMuonW(p, layerwise_norm="yes"), TypeError),
            """Invalid layerwise_norm: 'yes' (expected True or False)""",
        )
        self.assertExpectedInline(
            self.msg(lambda: mf.TritonMuon(p, betas=(0.9, 0.99)), TypeError),
            """TritonMuon() got an unexpected keyword argument 'betas': use momentum (beta1) and velocity (beta2)""",
        )
        self.assertExpectedInline(
            self.msg(lambda: mf.TritonMuonW(p, maximize=True)),
            """maximize=True is not supported: muon_fn optimizers minimize; to maximize f, minimize -f""",
        )

    def test_loaded_hyperparameters_are_checked(self):
        p = [torch.nn.Parameter(torch.zeros(2, 2))]
        sd = mf.TritonMuon(p).state_dict()
        sd["param_groups"][0]["velocity"] = 1.5
        self.assertExpectedInline(
            self.msg(lambda: mf.TritonMuon(p).load_state_dict(sd)),
            """Invalid velocity value: 1.5 (expected 0 <= velocity < 1)""",
        )

    def test_transform_messages(self):
        self.assertExpectedInline(
            self.msg(lambda: mf.normalize_layerwise(0.0)),
            """Invalid eps: 0.0 (expected a finite value > 0)""",
        )
        self.assertExpectedInline(
            self.msg(lambda: mf.triton_muon(velocity=1.0)),
            """Invalid velocity: 1.0 (expected 0 <= velocity < 1)""",
        )
        self.assertExpectedInline(
            self.msg(lambda: mf.triton_muon(nesterov=None), TypeError),
            """Invalid nesterov: None (expected True or False)""",
        )
        self.assertExpectedInline(
            self.msg(lambda: mf.scale_by_adam(bias_correction=0), TypeError),
            """Invalid bias_correction: 0 (expected True or False)""",
        )


def test_reprs():
    assert (
        repr(mf.triton_muon(weight_decay=0.1, decoupled=True, nesterov=True, layerwise_norm=True))
        == """\
chain(
  normalize_layerwise(eps=1e-08, add_eps=True),
  scale_by_adam(betas=(0.9, 0.999), eps=1e-08, bias_correction=False, nesterov=True),
  add_decoupled_weight_decay(weight_decay=0.1),
  scale_by_learning_rate(lr=0.001),
)"""
    )
    assert (
        repr(mf.triton_muon(weight_decay=0.1, layerwise_norm=True))
        == """\
chain(
  add_decoupled_weight_decay(weight_decay=0.1),
  normalize_layerwise(eps=1e-08, add_eps=True),
  scale_by_adam(betas=(0.9, 0.999), eps=1e-08, bias_correction=False, nesterov=False),
  scale_by_learning_rate(lr=0.001),
)"""
    )
    assert (
        repr(mf.triton_muon(weight_decay=0.1))
        == """\
chain(
  add_decoupled_weight_decay(weight_decay=0.1),
  scale_by_adam(betas=(0.9, 0.999), eps=1e-08, bias_correction=False, nesterov=False),
  scale_by_learning_rate(lr=0.001),
)"""
    )


# --------------------------------------------------------------------------------------------
# scale_by_adam's new options with bias correction (optax's Nesterov form).


@given(
    b1=st.floats(0.0, 0.99),
    b2=st.floats(0.0, 0.999),
    steps=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_scale_by_adam_nesterov_with_bias_correction(b1, b2, steps, seed):
    g_seq = [
        [torch.randn(4, 3, generator=torch.Generator().manual_seed(seed + t))] for t in range(steps)
    ]
    tx = mf.scale_by_adam((b1, b2), 1e-8, nesterov=True)
    state = tx.init([torch.zeros(4, 3)])
    m, v = torch.zeros(4, 3), torch.zeros(4, 3)
    for t, (g,) in enumerate(g_seq, start=1):
        (u,), state = tx.update([g], state)
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        m_hat = b1 * m / (1 - b1 ** (t + 1)) + (1 - b1) * g / (1 - b1**t)
        torch.testing.assert_close(
            u, m_hat / ((v / (1 - b2**t)).sqrt() + 1e-8), atol=1e-5, rtol=1e-5
        )


# --------------------------------------------------------------------------------------------
# layerwise_norm in the Muon recipe and MuonOptimizer.


def test_muon_layerwise_norm_ignores_each_steps_gradient_scale(device):
    """With layer-wise normalization, gradients scaled by any factor per step and per matrix give
    the same Muon trajectory; without it they do not (the momentum mixes steps by their size)."""
    params = make_params(shapes=[(8, 6), (3, 8)], device=device)
    grads = grads_for(4, shapes=[(8, 6), (3, 8)], device=device)
    scaled = [[g * 10.0 ** (2 * i - t) for i, g in enumerate(gs)] for t, gs in enumerate(grads)]

    def run(seq, layerwise):
        tx = mf.muon(0.02, ns_dtype=torch.float32, layerwise_norm=layerwise)
        state, theta = tx.init(params), params
        for g in seq:
            u, state = tx.update(g, state, theta)
            theta = mf.apply_updates(theta, u)
        return theta

    assert_close(run(scaled, True), run(grads, True), tol=TOL[device.type])
    assert not torch.allclose(run(scaled, False)[0].cpu(), run(grads, False)[0].cpu(), atol=1e-4)


def test_muon_optimizer_layerwise_norm_is_muon_on_normalized_matrix_grads():
    """MuonOptimizer(layerwise_norm=True) equals MuonOptimizer fed each matrix's gradient divided
    by its norm, bit for bit; the AdamW half (the bias) sees the raw gradient. CPU only: bit for
    bit needs the optimizer's norm to be the CPU's ``vector_norm`` kernel the test divides by."""

    def build(layerwise):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3, bias=False)
        )
        return model, mf.MuonOptimizer(
            model.parameters(), layerwise_norm=layerwise, compile=False, ns_dtype=torch.float32
        )

    (model, opt), (ref, ref_opt) = build(True), build(False)
    for t in range(3):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(t)) * 10.0**t
        for m in (model, ref):
            m.zero_grad()
            m(x).square().mean().backward()
        for p in ref.parameters():
            if p.ndim >= 2:
                p.grad = p.grad / torch.linalg.vector_norm(p.grad).clamp_min(1e-8)
        opt.step()
        ref_opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    assert "normalize_layerwise" in opt.describe()


def test_muon_optimizer_checkpoint_without_layerwise_norm_loads():
    model = torch.nn.Linear(4, 3)
    opt = mf.MuonOptimizer(model.parameters(), compile=False)
    model.weight.grad, model.bias.grad = torch.ones(3, 4), torch.ones(3)
    opt.step()
    sd = roundtrip(opt.state_dict())
    for group in sd["param_groups"]:
        del group["layerwise_norm"]  # saved before the option existed
    other = mf.MuonOptimizer(copy.deepcopy(model).parameters(), layerwise_norm=True, compile=False)
    other.load_state_dict(sd)
    assert other.param_groups[0]["layerwise_norm"] is False


def test_layerwise_norm_cannot_be_written_as_torch_muon():
    model = torch.nn.Linear(4, 3, bias=False)
    opt = mf.MuonOptimizer(model.parameters(), layerwise_norm=True, compile=False)
    with pytest.raises(ValueError, match="layerwise_norm=True"):
        mf.optim.to_torch_state_dict(opt)
