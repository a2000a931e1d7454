"""Properties of the Newton–Schulz family (muon_fn.core.newton_schulz), checked against independent
references: the SVD, the scalar polynomial each iteration applies to every singular value, and a
plain float64 re-implementation of the iteration written from docs/algorithms.md §2 (coefficients
typed in from the notes, not imported from the package).

Tolerances (all measured on torch 2.13 CPU, then given a ~2-4x margin):
- float32 compute vs the float64 reference: 2e-5 max-abs (output is rounded to float32; the
  Frobenius norm is taken in float32 and its ~1e-7 relative error is amplified by the slope of the
  composed polynomial, measured up to ~5e-6 in total).
- transpose / batching: 2e-5 max-abs in float32 (different GEMM layouts round differently).
- scale invariance: exact identity ``f(cX, eps) = f(X, eps/c)`` to 5e-5 (measured 5.5e-6); with the
  default eps, ``f(cX) ≈ f(X)`` to 5e-3 for c in [1e-3, 1e3] and ‖X‖_F ≥ 1, because the eps shifts
  the normalization by eps/‖cX‖_F ≤ 1e-4 and Polar Express's composed polynomial amplifies that by up
  to ~12x (measured 1.2e-3).
- 5-step bands (notes §4, measured on well-conditioned input, normalized σ ≥ 0.0183):
  quintic σ ∈ [0.6, 1.2] (measured 0.682–1.134), polar_express [0.8, 1.2] (0.870–1.124),
  you [0.95, 1.05] (0.978–1.032), cubic [0.3, 1.0] when normalized σ ≥ 0.0424 (0.313–0.974).
- exact mode (polar_express ≥ 8 steps, cubic ≥ 20 steps): ‖OOᵀ−I‖_F/√m < 1e-3 in fp32
  (notes: 1.4e-6 / 1e-7 level); < 0.02 in bf16 (notes: 0.008 for PE×8 on 50×100).
- bf16 vs fp32 compute, 5 steps, min(m, n) ≥ 16: ‖O_bf16 − O_fp32‖_F / ‖O_fp32‖_F below
  polar_express 0.08, quintic 0.06, you 0.03, cubic 0.012 (measured over 300 random inputs:
  0.032 / 0.031 / 0.007 / 0.004).
  Polar Express in bf16 is much worse on matrices with few rows (measured 0.15 for m = 2, up to
  0.1 for m = 8): its first quintic (8.2, −23.0, 16.5) cancels catastrophically when the normalized
  σ is near 1, which only happens when m is small. That case is not part of the documented
  tolerance.

The device lane (``device`` fixture, tests/conftest.py): the tests that take ``device`` run their
body on the CPU and, where a GPU is present, on CUDA. Inputs are drawn on the CPU and moved, so
every device sees the same values; references stay on the CPU in float64 and results are compared
after ``.cpu()``. On the CPU every tolerance above holds as written. ``TOL`` lists those that differ
on CUDA, where fp32 GEMMs and the fp32 Frobenius norm reduce in another order (TF32 stays off,
torch's default for matmul) and the first iterations amplify that rounding near σ = 0 (slope ≈ 3.4
per quintic step, ≈ 8 for Polar Express's first): 5x the CPU bound. The CPU bounds have a margin of
only 1.5-4x over the CPU's own maxima (measured: transpose 1.6e-6, batched 8e-6, scale 1.2e-5,
float64 compute 5e-6, scalar polynomial 1e-5), and a one-ulp change of the fp32 norm alone moves
the results by up to 1.2e-5 (fp32 compute) and 1.4e-5 (scalar polynomial). Float64 inputs, the
bands (σ, exact mode, bf16 against fp32 in norm), the bitwise checks between two calls on one
device and exact zeros are the same on every device: bf16 is checked by bands only, never
elementwise (two faithful bf16 implementations differ by 2-4e-3).
"""

from __future__ import annotations

import contextlib
import math

import expecttest
import pytest
import torch
from conftest import lane_examples
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import muon_fn
from muon_fn.core import newton_schulz as orth
from muon_fn.core.newton_schulz import coefficient_schedule, newton_schulz

METHODS4 = ("polar_express", "quintic", "you", "cubic")

# Max-abs tolerances that differ by device (module docstring). "fp32": one matrix iterated in fp32
# along two layouts (transposed, batched); "fp64_of_fp32": an fp32 input iterated in float64 (its
# fp32 norm's rounding, amplified) against the float64 reference, "transpose64" of both layouts;
# "scale": f(cX, eps) against f(X, eps/c) in fp32.
TOL = {
    "cpu": {"fp32": 2e-5, "fp64_of_fp32": 2e-5, "transpose64": 1e-5, "scale": 5e-5},
    "cuda": {"fp32": 1e-4, "fp64_of_fp32": 1e-4, "transpose64": 5e-5, "scale": 2.5e-4},
}


# --------------------------------------------------------------------------------------------
# Independent reference: coefficients typed in from docs/algorithms.md §2 and the papers it cites.

_KELLER = [(3.4445, -4.7750, 2.0315)]
_YOU = [
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
]
_PE_RAW = [
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
]
# Safety factor 1.01: p(x/1.01) for every polynomial except the last; norm X/(1.01‖X‖_F + eps).
_PE = [(a / 1.01, b / 1.01**3, c / 1.01**5) for a, b, c in _PE_RAW[:-1]] + [_PE_RAW[-1]]
_CUBIC = [(1.5, -0.5, 0.0)]

REF = {
    # method: (triples, extension rule, extra factor on ‖X‖_F)
    "polar_express": (_PE, "repeat_last", 1.01),
    "quintic": (_KELLER, "repeat_last", 1.0),
    "you": (_YOU, "cycle", 1.0),
    "cubic": (_CUBIC, "repeat_last", 1.0),
}


def ref_schedule(triples, rule, steps):
    if rule == "cycle":
        return [triples[i % len(triples)] for i in range(steps)]
    return [triples[min(i, len(triples) - 1)] for i in range(steps)]


def ref_ns(x, triples, *, norm_factor=1.0, eps=1e-7, stepsize=1.0):
    """Textbook iteration in float64 on one matrix: X ← X + η(aX + bAX + cA²X − X), A = XXᵀ."""
    x = x.double()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (norm_factor * torch.linalg.matrix_norm(x)).clamp_min(eps)  # torch.optim.Muon's
    for a, b, c in triples:
        A = x @ x.T
        p = a * x + b * (A @ x) + c * (A @ (A @ x))
        x = x + stepsize * (p - x)
    return x.T if tall else x


def ref_method(x, method, steps, **kw):
    triples, rule, factor = REF[method]
    return ref_ns(x, ref_schedule(triples, rule, steps), norm_factor=factor, **kw)


def scalar_map(s, triples):
    """The composed odd polynomial applied to (already normalized) singular values."""
    for a, b, c in triples:
        s = a * s + b * s**3 + c * s**5
    return s


def svdvals(x):
    return torch.linalg.svdvals(x.double().cpu())


def orth_error(o):
    """‖OOᵀ − I‖_F / √m on the wide orientation, m = min(shape)."""
    o = o.double().cpu()
    if o.shape[-2] > o.shape[-1]:
        o = o.mT
    m = o.shape[-2]
    return (torch.linalg.matrix_norm(o @ o.mT - torch.eye(m, dtype=o.dtype)) / math.sqrt(m)).item()


# --------------------------------------------------------------------------------------------
# Strategies.


def synth(m, n, kappa, seed, dtype=torch.float32):
    """U diag(s) Vᵀ with random orthogonal U, V and s uniform in [1, kappa] (so ‖X‖_F ≥ 1)."""
    g = torch.Generator().manual_seed(seed)
    k = min(m, n)
    u, _ = torch.linalg.qr(torch.randn(m, k, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, k, generator=g, dtype=torch.float64))
    s = 1.0 + (kappa - 1.0) * torch.rand(k, generator=g, dtype=torch.float64)
    return ((u * s) @ v.T).to(dtype)


@st.composite
def well_conditioned(draw, min_dim=1, max_dim=40, max_kappa=6.0):
    """Full-rank matrices with normalized σ_min ≥ 1/(kappa·√min(m,n)) ≥ 0.026 (notes §4 range)."""
    m = draw(st.integers(min_dim, max_dim))
    n = draw(st.integers(min_dim, max_dim))
    kappa = draw(st.floats(1.0, max_kappa))
    seed = draw(st.integers(0, 2**31 - 1))
    return synth(m, n, kappa, seed)


@st.composite
def gaussian(draw, min_dim=1, max_dim=40, batch=()):
    m = draw(st.integers(min_dim, max_dim))
    n = draw(st.integers(min_dim, max_dim))
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.sampled_from([1e-2, 1.0, 30.0]))
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(*batch, m, n, generator=g)


methods = pytest.mark.parametrize("method", METHODS4)


# --------------------------------------------------------------------------------------------
# Shape, dtype, transpose, batching, zero.


@methods
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@lane_examples
@given(x=gaussian())
def test_shape_and_dtype_preserved(device, method, dtype, x):
    x = x.to(device, dtype)
    out = newton_schulz(x, method, 5)
    assert out.shape == x.shape and out.dtype == dtype and out.device == x.device
    assert torch.isfinite(out).all()
    # A lower compute dtype still returns the input's dtype.
    out = newton_schulz(x, method, 5, dtype=torch.bfloat16)
    assert out.shape == x.shape and out.dtype == dtype


def test_float64_input_supported(device):
    # Regression: at 235b064 float64 input raised RuntimeError in linalg.vector_norm(dtype=float32).
    x = synth(6, 9, 3.0, 0, torch.float64)
    out = newton_schulz(x.to(device), "quintic", 5)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out.cpu(), ref_method(x, "quintic", 5), atol=1e-10, rtol=0)


@methods
@lane_examples
@given(x=gaussian())
def test_transpose_equivariance(device, method, x):
    x, tol = x.to(device), TOL[device.type]
    out = newton_schulz(x, method, 5, dtype=torch.float32)
    out_t = newton_schulz(x.mT, method, 5, dtype=torch.float32)
    torch.testing.assert_close(out_t, out.mT, atol=tol["fp32"], rtol=0)
    # Same in float64 compute: only the fp32 Frobenius norm (summed in another order for the
    # transposed layout) differs, amplified by the composed polynomial's slope.
    out = newton_schulz(x, method, 5, dtype=torch.float64)
    out_t = newton_schulz(x.mT.contiguous(), method, 5, dtype=torch.float64)
    torch.testing.assert_close(out_t, out.mT, atol=tol["transpose64"], rtol=0)


@methods
@lane_examples
@given(x=well_conditioned(), c=st.floats(1e-3, 1e3), eps=st.sampled_from([1e-7, 1e-4]))
def test_scale_invariance(device, method, x, c, eps):
    x = x.to(device)
    # The exact identity behind scale invariance: (cX)/max(‖cX‖, eps) = X/max(‖X‖, eps/c).
    torch.testing.assert_close(
        newton_schulz(c * x, method, 5, eps=eps, dtype=torch.float32),
        newton_schulz(x, method, 5, eps=eps / c, dtype=torch.float32),
        atol=TOL[device.type]["scale"],
        rtol=0,
    )
    # With the default eps, f(cX) ≈ f(X) for c in [1e-3, 1e3] (‖X‖_F ≥ 1 here).
    torch.testing.assert_close(
        newton_schulz(c * x, method, 5, dtype=torch.float32),
        newton_schulz(x, method, 5, dtype=torch.float32),
        atol=5e-3,
        rtol=0,
    )


@methods
@lane_examples
@given(
    x=st.one_of(gaussian(batch=(3,)), gaussian(batch=(2, 2)), gaussian(batch=(1,))),
    zero_one=st.booleans(),
)
def test_batched_equals_per_matrix(device, method, x, zero_one):
    x = x.to(device)
    if zero_one:  # a zero matrix in the batch must not contaminate its neighbours
        x = x.clone()
        x.view(-1, *x.shape[-2:])[0] = 0
    out = newton_schulz(x, method, 5, dtype=torch.float32)
    assert out.shape == x.shape
    flat_x, flat_out = x.reshape(-1, *x.shape[-2:]), out.reshape(-1, *x.shape[-2:])
    for xi, oi in zip(flat_x, flat_out):
        torch.testing.assert_close(
            oi,
            newton_schulz(xi, method, 5, dtype=torch.float32),
            atol=TOL[device.type]["fp32"],
            rtol=0,
        )
    if zero_one:
        assert torch.equal(flat_out[0], torch.zeros_like(flat_out[0]))


@methods
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@lane_examples
@given(m=st.integers(1, 40), n=st.integers(1, 40), steps=st.integers(1, 12))
def test_zero_maps_to_zero(device, method, dtype, m, n, steps):
    out = newton_schulz(torch.zeros(m, n, dtype=dtype, device=device), method, steps)
    assert torch.equal(out, torch.zeros(m, n, dtype=dtype, device=device))  # also rules out NaN
    out = newton_schulz(torch.zeros(m, n, device=device), method, steps, dtype=dtype)
    assert torch.equal(out, torch.zeros(m, n, device=device))


# --------------------------------------------------------------------------------------------
# Accuracy against the SVD.

BANDS_5 = {  # notes §4, see module docstring
    "quintic": (0.6, 1.2),
    "polar_express": (0.8, 1.2),
    "you": (0.95, 1.05),
    "cubic": (0.3, 1.0 + 1e-5),
}


@methods
@lane_examples
@given(x=well_conditioned())
def test_singular_values_in_band_after_5_steps(device, method, x):
    s_in = svdvals(x)
    normalized = s_in / torch.linalg.vector_norm(s_in)
    if method == "cubic":  # cubic's 5-step band is documented for normalized σ ≥ 0.0424 only
        assume(normalized.min() >= 0.0424)
    s = svdvals(newton_schulz(x.to(device), method, 5, dtype=torch.float32))
    lo, hi = BANDS_5[method]
    assert lo <= s.min() and s.max() <= hi, (s.min().item(), s.max().item())


@methods
@lane_examples
@given(x=well_conditioned(max_kappa=20.0), steps=st.integers(1, 10))
def test_singular_values_follow_the_scalar_polynomial(device, method, x, steps):
    """σ(f(X)) = p_k∘…∘p_1(σ(X)/(s‖X‖_F+eps)) with the notes' coefficients (an SVD reference)."""
    triples, rule, factor = REF[method]
    s_in = svdvals(x)
    expected = scalar_map(
        s_in / (factor * torch.linalg.vector_norm(s_in) + 1e-7), ref_schedule(triples, rule, steps)
    )
    got = svdvals(newton_schulz(x.to(device), method, steps, dtype=torch.float64))
    torch.testing.assert_close(
        got,
        expected.abs().sort(descending=True).values,
        atol=TOL[device.type]["fp64_of_fp32"],
        rtol=0,
    )


@methods
@lane_examples
@given(x=gaussian(), steps=st.integers(1, 12))
def test_matches_float64_reference_iteration(device, method, x, steps):
    expected, xd = ref_method(x, method, steps), x.to(device)
    torch.testing.assert_close(
        newton_schulz(xd, method, steps, dtype=torch.float64).double().cpu(),
        expected,
        atol=TOL[device.type]["fp64_of_fp32"],
        rtol=0,
    )
    if method != "polar_express" or steps > 1:
        # fp32 compute: rounding amplified by the composed polynomial (largest for PE's first step).
        torch.testing.assert_close(
            newton_schulz(xd, method, steps, dtype=torch.float32).double().cpu(),
            expected,
            atol=2e-3,
            rtol=0,
        )


@pytest.mark.parametrize(("method", "min_steps"), [("polar_express", 8), ("cubic", 20)])
@lane_examples
@given(x=well_conditioned(), extra=st.integers(0, 4))
def test_exact_mode_fp32(device, method, min_steps, x, extra):
    out = newton_schulz(x.to(device), method, min_steps + extra, dtype=torch.float32)
    assert orth_error(out) < 1e-3
    # ... and it is the polar factor U Vᵀ of the input.
    u, _, vh = torch.linalg.svd(x.double(), full_matrices=False)
    torch.testing.assert_close(out.double().cpu(), u @ vh, atol=1e-3, rtol=0)


@pytest.mark.parametrize(("method", "steps"), [("polar_express", 8), ("cubic", 20)])
@lane_examples
@given(x=well_conditioned(min_dim=8))
def test_exact_mode_bf16(device, method, steps, x):
    assert orth_error(newton_schulz(x.to(device), method, steps, dtype=torch.bfloat16)) < 0.02


BF16_TOL = {"polar_express": 0.08, "quintic": 0.06, "you": 0.03, "cubic": 0.012}


@methods
@lane_examples
@given(x=well_conditioned(min_dim=16))
def test_bf16_close_to_fp32(device, method, x):
    x = x.to(device)
    o32 = newton_schulz(x, method, 5, dtype=torch.float32)
    o16 = newton_schulz(x, method, 5, dtype=torch.bfloat16)
    rel = (torch.linalg.matrix_norm(o16 - o32) / torch.linalg.matrix_norm(o32)).item()
    assert rel < BF16_TOL[method], rel
    # bf16 output is still in the method's band, widened by bf16's rounding (notes §4: ~5e-3 in σ,
    # here 0.03 because small matrices have fewer singular values to average over).
    lo, hi = BANDS_5[method]
    s = svdvals(o16)
    if method != "cubic":
        assert lo - 0.03 <= s.min() and s.max() <= hi + 0.03


# --------------------------------------------------------------------------------------------
# Schedules and stepsize.


@methods
@lane_examples
@given(x=gaussian(), steps=st.integers(1, 8), eta=st.floats(0.05, 1.0))
def test_stepsize_damping_matches_formula(device, method, x, steps, eta):
    """η damps each iteration: X ← X + η(p(X) − X), checked against the textbook iteration."""
    expected = ref_method(x, method, steps, stepsize=eta)
    got = (
        newton_schulz(x.to(device), method, steps, stepsize=eta, dtype=torch.float64).double().cpu()
    )
    torch.testing.assert_close(got, expected, atol=TOL[device.type]["fp64_of_fp32"], rtol=0)


def test_stepsize_one_is_the_plain_iteration(device):
    x = synth(7, 12, 3.0, 1).to(device)
    assert torch.equal(newton_schulz(x, "quintic", 5, stepsize=1.0), newton_schulz(x, "quintic", 5))
    assert not torch.allclose(
        newton_schulz(x, "quintic", 5, stepsize=0.5), newton_schulz(x, "quintic", 5)
    )


@given(eta=st.floats(0.01, 2.0), steps=st.integers(1, 10))
def test_coefficient_schedule_stepsize_formula(eta, steps):
    for method in METHODS4:
        triples, rule, _ = REF[method]
        want = [
            (1 - eta + eta * a, eta * b, eta * c) for a, b, c in ref_schedule(triples, rule, steps)
        ]
        got = coefficient_schedule(method, steps, stepsize=eta)
        assert len(got) == steps
        torch.testing.assert_close(
            torch.tensor(got, dtype=torch.float64),
            torch.tensor(want, dtype=torch.float64),
            atol=1e-12,
            rtol=1e-12,
        )


@pytest.mark.parametrize("steps", [1, 3, 5, 7, 8, 11, 13])
def test_method_schedules_match_notes(steps):
    """Keller/cubic repeat their triple; You's five cycle; Polar Express repeats its 8th row."""
    for method in METHODS4:
        triples, rule, _ = REF[method]
        got = torch.tensor(coefficient_schedule(method, steps), dtype=torch.float64)
        want = torch.tensor(ref_schedule(triples, rule, steps), dtype=torch.float64)
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    you = coefficient_schedule("you", 7)
    assert you[5] == you[0] and you[6] == you[1]
    pe = coefficient_schedule("polar_express", 11)
    assert pe[7] == pe[8] == pe[10] == (1.875, -1.25, 0.375)


@lane_examples
@given(
    triples=st.lists(
        st.tuples(st.floats(1.0, 4.0), st.floats(-5.0, -0.5), st.floats(0.0, 2.5)),
        min_size=1,
        max_size=4,
    ),
    steps=st.integers(1, 8),
    method=st.sampled_from(METHODS4),
    x=gaussian(max_dim=24),
)
def test_custom_coefficients_repeat_last(device, triples, steps, method, x):
    """A custom schedule overrides the method's, repeats its last triple, and uses plain X/(‖X‖_F+eps)."""
    sched = coefficient_schedule(method, steps, coefficients=triples)
    assert list(sched) == [
        tuple(map(float, triples[min(i, len(triples) - 1)])) for i in range(steps)
    ]
    sched = ref_schedule(triples, "repeat_last", steps)
    expected = ref_ns(x, sched)
    assume(
        torch.isfinite(expected).all() and expected.abs().max() < 1e3
    )  # arbitrary triples may diverge
    # Arbitrary triples can be expansive (|p'(1)| up to ~7 per step), so the fp32 Frobenius norm's
    # relative error (≤ ~1e-6) is amplified: allow what a 1e-6 change of the norm explains.
    sensitivity = (ref_ns(x, sched, norm_factor=1 + 1e-6) - expected).abs().max().item()
    got = (
        newton_schulz(x.to(device), method, steps, coefficients=triples, dtype=torch.float64)
        .double()
        .cpu()
    )
    torch.testing.assert_close(
        got,
        expected,
        atol=1e-5 * max(1.0, expected.abs().max().item()) + 4 * sensitivity,
        rtol=1e-5,
    )


def test_custom_coefficients_accept_lists_and_tensors_rows(device):
    x = synth(5, 9, 2.0, 3).to(device)
    a = newton_schulz(x, coefficients=[[3.4445, -4.7750, 2.0315]], steps=5)
    b = newton_schulz(x, "quintic", 5)
    torch.testing.assert_close(a, b, atol=0, rtol=0)


# --------------------------------------------------------------------------------------------
# The "shown after you stop" checks and the notes' deterministic cases.


@pytest.mark.parametrize("has_bf16", [True, False])
def test_default_compute_dtype_is_fp32_only_on_cpus_without_bf16_gemms(monkeypatch, has_bf16):
    monkeypatch.setattr(orth.cpu, "CPU_HAS_BF16_GEMM", has_bf16)
    cpu = torch.bfloat16 if has_bf16 else torch.float32
    assert orth.default_compute_dtype() == orth.default_compute_dtype("cpu") == cpu
    assert orth.default_compute_dtype(torch.device("cuda", 0)) == torch.bfloat16
    # The default is what the optimizer's eager step and the transform actually run.
    p = [torch.randn(32, 48, generator=torch.Generator().manual_seed(k)) for k in range(2)]
    g = [torch.randn(32, 48, generator=torch.Generator().manual_seed(10 + k)) for k in range(2)]
    outs = []
    for ns_dtype in (None, cpu):
        q = [x.clone().requires_grad_() for x in p]
        for x, d in zip(q, g):
            x.grad = d.clone()
        muon_fn.MuonOptimizer(q, lr=0.1, ns_dtype=ns_dtype).step()
        tx = muon_fn.orthogonalize(dtype=ns_dtype)
        u, _ = tx.update(list(g), tx.init(g))
        outs.append((q, u))
    for a, b in zip(outs[0][0] + outs[0][1], outs[1][0] + outs[1][1]):
        assert torch.equal(a, b)


def test_cpu_has_bf16_gemm_reads_the_cpu_flags(monkeypatch):
    flags = {"_is_avx512_bf16_supported": False, "_is_amx_tile_supported": False}
    for name in flags:
        monkeypatch.setattr(torch.cpu, name, lambda name=name: flags[name])
    monkeypatch.setattr(orth.cpu.platform, "machine", lambda: "x86_64")
    assert orth.cpu_has_bf16_gemm() is False
    flags["_is_amx_tile_supported"] = True
    assert orth.cpu_has_bf16_gemm() is True


@pytest.mark.parametrize("seed", range(4))
def test_zeropower_via_newtonschulz5_band(device, seed):
    torch.manual_seed(seed)
    out = muon_fn.zeropower_via_newtonschulz5(torch.randn(50, 100).to(device))
    assert out.shape == (50, 100) and out.dtype == torch.float32
    s = svdvals(out)
    assert 0.6 <= s.min() and s.max() <= 1.2, (s.min().item(), s.max().item())


def test_zeropower_is_keller_quintic_in_bf16(device):
    torch.manual_seed(0)
    G = torch.randn(50, 100)
    expected = ref_method(G, "quintic", 5)
    G = G.to(device)
    out = muon_fn.zeropower_via_newtonschulz5(G)
    assert torch.isfinite(out).all()
    assert (
        torch.linalg.matrix_norm(out.double().cpu() - expected) / math.sqrt(50)
    ).item() < 0.02  # bf16 rounding
    torch.testing.assert_close(
        out, newton_schulz(G, "quintic", 5, dtype=torch.bfloat16), atol=0, rtol=0
    )


@pytest.mark.parametrize("shape", [(50, 100), (100, 50)])
def test_polar_express_8_steps_fp32_orthogonal(device, shape):
    torch.manual_seed(0)
    G = torch.randn(*shape).to(device)
    Q = muon_fn.polar_express(G, steps=8)
    assert Q.dtype == torch.float32
    o = Q.double().cpu() if shape[0] <= shape[1] else Q.double().cpu().T
    assert torch.linalg.matrix_norm(o @ o.T - torch.eye(o.shape[0], dtype=torch.float64)) < 0.1
    assert orth_error(Q) < 1e-3


@pytest.mark.parametrize("shape", [(50, 100), (100, 50)])
def test_notes_section_4_five_step_numbers(device, shape):
    """notes §4 (b): 5-step σ bands and RMS distance to UVᵀ on Gaussian 50×100."""
    torch.manual_seed(0)
    G = torch.randn(*shape)
    u, _, vh = torch.linalg.svd(G.double(), full_matrices=False)
    polar = u @ vh
    for method, (lo, hi), rms_max in [
        ("quintic", (0.6, 1.2), 0.25),
        ("polar_express", (0.8, 1.2), 0.11),
        ("you", (0.95, 1.05), 0.03),
    ]:
        Q = newton_schulz(G.to(device), method, 5, dtype=torch.float32)
        s = svdvals(Q)
        assert lo <= s.min() and s.max() <= hi, method
        assert (
            torch.linalg.matrix_norm(Q.double().cpu() - polar) / math.sqrt(50)
        ).item() < rms_max, method
        # And 5 steps are *not* exact (the reason exact mode exists).
        assert orth_error(Q) > 1e-2, method


# --------------------------------------------------------------------------------------------
# Validation messages (exact text).


class TestValidationMessages(expecttest.TestCase):
    def msg(self, fn, *args, **kwargs):
        with self.assertRaises(ValueError) as cm:
            fn(*args, **kwargs)
        return str(cm.exception)

    def ns(self, **kwargs):
        return self.msg(newton_schulz, torch.randn(4, 6), **kwargs)

    def test_steps(self):
        self.assertExpectedInline(
            self.ns(steps=0), """Invalid steps: 0 (expected an integer >= 1)"""
        )
        self.assertExpectedInline(
            self.ns(steps=-3), """Invalid steps: -3 (expected an integer >= 1)"""
        )
        self.assertExpectedInline(
            self.ns(steps=2.5), """Invalid steps: 2.5 (expected an integer >= 1)"""
        )
        self.assertExpectedInline(
            self.ns(steps=True), """Invalid steps: True (expected an integer >= 1)"""
        )

    def test_eps(self):
        self.assertExpectedInline(
            self.ns(eps=0.0), """Invalid eps: 0.0 (expected a finite value > 0)"""
        )
        self.assertExpectedInline(
            self.ns(eps=-1e-7), """Invalid eps: -1e-07 (expected a finite value > 0)"""
        )
        self.assertExpectedInline(
            self.ns(eps=float("nan")), """Invalid eps: nan (expected a finite value > 0)"""
        )

    def test_stepsize(self):
        self.assertExpectedInline(
            self.ns(stepsize=0), """Invalid stepsize: 0 (expected a finite value > 0)"""
        )
        self.assertExpectedInline(
            self.ns(stepsize=-0.5), """Invalid stepsize: -0.5 (expected a finite value > 0)"""
        )
        self.assertExpectedInline(
            self.ns(stepsize=float("inf")),
            """Invalid stepsize: inf (expected a finite value > 0)""",
        )

    def test_method(self):
        # Not an inline snapshot of the whole text: other methods may be added to METHODS later.
        # The message names the argument and the value and lists every valid method.
        m = self.ns(method="newton")
        self.assertTrue(m.startswith("Invalid method: 'newton' (valid: "), m)
        for name in set(METHODS4) | set(orth.METHODS):
            self.assertIn(repr(name), m)
        self.assertTrue(self.ns(method="").startswith("Invalid method: '' (valid: "))

    def test_malformed_coefficients(self):
        self.assertExpectedInline(
            self.ns(coefficients=[]),
            """Invalid coefficients: [] (expected an (a, b, c) triple or a sequence of (a, b, c) triples)""",
        )
        self.assertExpectedInline(
            self.ns(coefficients=[(3.0, -4.0, 2.0), (1.0, 2.0)]),
            """Invalid coefficients: [(3.0, -4.0, 2.0), (1.0, 2.0)] (expected an (a, b, c) triple or a sequence of (a, b, c) triples)""",  # noqa: E501
        )
        self.assertExpectedInline(
            self.ns(coefficients=[(1.0, 2.0, float("nan"))]),
            """Invalid coefficients: [(1.0, 2.0, nan)] (values must be finite)""",
        )
        self.assertExpectedInline(
            self.ns(coefficients=[(1.0, float("inf"), 0.0)]),
            """Invalid coefficients: [(1.0, inf, 0.0)] (values must be finite)""",
        )
        self.assertExpectedInline(
            self.ns(coefficients=5),
            """Invalid coefficients: 5 (expected an (a, b, c) triple or a sequence of (a, b, c) triples)""",
        )

    def test_non_numeric_coefficients_name_the_argument(self):
        # Regression: at 235b064 float()'s own "could not convert string to float" escaped.
        self.assertTrue(
            self.ns(coefficients=[(1.0, 2.0, "x")]).startswith("Invalid coefficients: ")
        )
        self.assertTrue(self.ns(coefficients="abc").startswith("Invalid coefficients: "))

    def test_not_a_matrix(self):
        self.assertExpectedInline(
            self.msg(newton_schulz, torch.randn(5)),
            """newton_schulz expects a matrix or a batch of matrices, got shape (5,)""",
        )
        self.assertExpectedInline(
            self.msg(newton_schulz, torch.tensor(1.0)),
            """newton_schulz expects a matrix or a batch of matrices, got shape ()""",
        )

    def test_coefficient_schedule_validates(self):
        self.assertExpectedInline(
            self.msg(coefficient_schedule, "cubic", 0),
            """Invalid steps: 0 (expected an integer >= 1)""",
        )
        self.assertExpectedInline(
            self.msg(coefficient_schedule, "cubic", 3, stepsize=-1.0),
            """Invalid stepsize: -1.0 (expected a finite value > 0)""",
        )


@pytest.mark.parametrize("method,steps", [("aol9", 4), ("polar_express", 5), ("cubic", 3)])
@pytest.mark.parametrize("shape", [(24, 40), (3, 16, 16)])
def test_reused_buffers_give_bitwise_the_same_iteration(method, steps, shape):
    """The eager in-place step writes every product into buffers it keeps across steps (no fresh
    allocation to page-fault); values must be exactly those of the allocating iteration, also on
    a second call that overwrites the first call's buffers."""
    from muon_fn.core import newton_schulz as O

    schedule = O.coefficient_schedule(method, steps)
    gen = torch.Generator().manual_seed(2)
    buffers: dict = {}
    for _ in range(2):
        x = torch.randn(shape, generator=gen)
        y = (x / (x.norm(dim=(-2, -1), keepdim=True) * 1.01)).to(torch.bfloat16)
        plain = O.run_schedule(y.clone(), schedule, 1e-7, O.CPUProducts())
        reused = O.run_schedule(y.clone(), schedule, 1e-7, O.CPUProducts(buffers=buffers))
        assert torch.equal(reused, plain)
    assert buffers and all(t.dtype == torch.bfloat16 for t in buffers.values())


@contextlib.contextmanager
def _split_symmetric_products(min_block: int):
    """Split symmetric products down to ``min_block`` rows for every dtype (also where bf16 runs
    on AMX and only long Gram products are split), or never with a huge ``min_block``."""
    from muon_fn.core import newton_schulz as O

    old = O.cpu.SYMMETRIC_MIN_BLOCK, O.cpu._amx_dtypes
    O.cpu.SYMMETRIC_MIN_BLOCK, O.cpu._amx_dtypes = min_block, frozenset
    try:
        yield
    finally:
        O.cpu.SYMMETRIC_MIN_BLOCK, O.cpu._amx_dtypes = old


@given(
    m=st.integers(1, 70),
    k=st.integers(1, 70),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    beta=st.floats(-4.0, 4.0),
    alpha=st.floats(-4.0, 4.0),
    seed=st.integers(0, 2**16),
)
def test_symmetric_products_computed_blockwise(m, k, dtype, beta, alpha, seed):
    """XXᵀ (XᵀX of a tall X) and βA + αA² from the blocks on and above the diagonal (split down
    to 4-row blocks here, several levels deep) equal one GEMM's result to rounding."""
    from muon_fn.core import newton_schulz as O

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    with _split_symmetric_products(4):
        gram = O.gram_matrix(x)
        a = x @ x.mT
        a = 0.5 * (a + a.mT)  # exactly symmetric, as the function requires
        square = O.CPUProducts().product(a, a, None, a, beta=beta, alpha=alpha, symmetric=True)
    ref = torch.addmm(a, a, a, beta=beta, alpha=alpha)
    # Rounding bound: a few units of the dtype's eps times the magnitudes that are summed.
    unit = 8 * torch.finfo(dtype).eps
    xmax, amax = float(x.float().abs().max()), float(a.float().abs().max())
    expected = x.mT @ x if m > k else x @ x.mT  # the min(m, k)-square Gram matrix
    torch.testing.assert_close(gram, expected, rtol=0, atol=unit * max(m, k) * xmax**2 + 1e-30)
    torch.testing.assert_close(
        square, ref, rtol=0, atol=unit * (abs(beta) * amax + abs(alpha) * m * amax**2) + 1e-30
    )


@pytest.mark.parametrize("method,steps", [("aol9", 4), ("polar_express", 5), ("quintic", 5)])
def test_blockwise_symmetric_products_leave_bf16_iterations_bitwise_unchanged(method, steps):
    """On CPU, matrices with ≥ 384 rows compute XXᵀ and A² blockwise (a quarter fewer FLOPs per
    split); in bf16 the whole iteration must be bitwise what one GEMM per product gives, including
    AOL's first step, whose rescaled Gram matrix is not exactly symmetric (its square stays one GEMM)."""
    from muon_fn.core import newton_schulz as O

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(400, 520, generator=gen)
    with _split_symmetric_products(O.SYMMETRIC_MIN_BLOCK):
        split = muon_fn.newton_schulz(x, method, steps, dtype=torch.bfloat16)
    with _split_symmetric_products(10**9):
        whole = muon_fn.newton_schulz(x, method, steps, dtype=torch.bfloat16)
    assert torch.equal(split, whole)


def test_symmetric_products_of_a_batch_are_split_per_matrix():
    from muon_fn.core import newton_schulz as O

    x = torch.randn(3, 20, 30, generator=torch.Generator().manual_seed(8))
    with _split_symmetric_products(4):
        gram = O.gram_matrix(x)
    for i in range(3):
        torch.testing.assert_close(gram[i], x[i] @ x[i].mT, rtol=0, atol=1e-5)


@given(m=st.integers(1, 3000), min_block=st.integers(1, 400))
def test_symmetric_block_plan_tiles_the_matrix_once(m, min_block):
    """Leaves on the diagonal plus each corner and its mirror cover every entry exactly once."""
    from muon_fn.core import newton_schulz as O

    blocks = O.cpu._symmetric_blocks(m, min_block)
    covered = torch.zeros(m, m, dtype=torch.int32)
    for rows, cols, mirrored in blocks:
        covered[rows, cols] += 1
        if mirrored:
            covered[cols, rows] += 1
    assert bool((covered == 1).all())
    leaves = [rows for rows, cols, mirrored in blocks if not mirrored]
    assert all(
        rows == cols for rows, cols, mirrored in blocks if not mirrored
    )  # leaves sit on the diagonal
    assert all(
        r.stop - r.start < 2 * min_block for r in leaves
    )  # a leaf is a block too small to split
    assert (len(blocks) > len(leaves)) == (m >= 2 * min_block)


def test_symmetric_split_policy_follows_the_gemm_hardware(monkeypatch):
    """Where a dtype's GEMMs run on AMX only Gram products with a long inner dimension are split
    (k ≥ AMX_SPLIT_MIN_RATIO·m); elsewhere every symmetric product from 2·SYMMETRIC_MIN_BLOCK rows."""
    from muon_fn.core import newton_schulz as O

    bf16, fp32 = torch.empty(1, dtype=torch.bfloat16), torch.empty(1)
    monkeypatch.setattr(O.cpu, "_amx_dtypes", lambda: frozenset({torch.bfloat16}))
    assert not O.CPUProducts().split_symmetric(768, 768, bf16)  # A², or a square's XXᵀ
    assert O.CPUProducts().split_symmetric(768, 3072, bf16)  # XXᵀ of a 768×3072 matrix
    assert O.CPUProducts().split_symmetric(768, 768, fp32)
    assert not O.CPUProducts().split_symmetric(2 * O.SYMMETRIC_MIN_BLOCK - 1, 10**4, fp32)
    monkeypatch.setattr(O.cpu, "_amx_dtypes", frozenset)
    assert O.CPUProducts().split_symmetric(768, 768, bf16)


@pytest.mark.parametrize("method", ["polar_express", "aol9"])
def test_blockwise_products_leave_autograd_working(method):
    """Differentiating through the iteration must keep working for matrices big enough to be
    split (the blocks are written with out=, which autograd does not support): then one GEMM;
    aol9's AOL rescale and degree-9 step, in place on scratch otherwise, then leave the tensors
    backward needs alone (AOL schedules raised here before)."""
    x = torch.randn(400, 520, generator=torch.Generator().manual_seed(9), requires_grad=True)
    y = muon_fn.newton_schulz(x, method, None, dtype=torch.float32)
    y.square().sum().backward()
    assert x.grad is not None and bool(torch.isfinite(x.grad).all())
    with torch.no_grad():
        torch.testing.assert_close(
            muon_fn.newton_schulz(x, method, None, dtype=torch.float32), y, rtol=0, atol=1e-5
        )


@pytest.mark.parametrize("method", ["polar_express", "aol9"])
def test_blockwise_products_leave_torch_func_working(method):
    """vmap and torch.func.grad wrap tensors, and out= has no batching rule: one GEMM there (and
    no in-place accumulation into the Gram matrix)."""
    x = torch.randn(2, 400, 520, generator=torch.Generator().manual_seed(10))

    def f(t):
        return muon_fn.newton_schulz(t, method, None, dtype=torch.float32)

    torch.testing.assert_close(torch.vmap(f)(x), f(x), rtol=0, atol=1e-5)
    g = torch.func.grad(lambda t: f(t).square().sum())(x[0])
    assert bool(torch.isfinite(g).all())


def test_folding_c0_into_the_diagonal_is_the_same_iteration(device):
    """``Schedule.fold_from``: from that iteration on ``X ← (c₀I + P)X`` instead of ``c₀X + PX``
    (no m×n bias pass); the same map, so equal in fp64 to rounding. Only aol9's own schedule
    folds, from its second step (the first one rounds coarser that way, see ``_FOLD_FROM``)."""
    from muon_fn.core import newton_schulz as O

    base = O.coefficient_schedule("aol9", 6)  # three quintics, the degree-9 step, two more quintics
    x = torch.randn(40, 70, dtype=torch.float64, generator=torch.Generator().manual_seed(11)).to(
        device
    )
    unfolded, *folded = (
        O.orthogonalize_matrices(
            x, O.Schedule(base, precondition="aol", fold_from=f), dtype=torch.float64, eps=1e-7
        )
        for f in (None, 0, 1, 5)
    )
    for y in folded:
        torch.testing.assert_close(y, unfolded, rtol=0, atol=1e-12)
    assert not torch.equal(folded[0], unfolded)  # a different sum, not the same code path
    assert {m: O.coefficient_schedule(m, None).fold_from for m in O.METHODS} == {
        m: 1 if m == "aol9" else None for m in O.METHODS
    }
    assert O.coefficient_schedule("aol9", 4, coefficients=[(3.0, -3.2, 1.2)]).fold_from is None
    with pytest.raises(
        ValueError, match=r"Invalid fold_from: -1 \(expected None or an integer >= 0\)"
    ):
        O.Schedule(base, fold_from=-1)


@pytest.mark.parametrize("batch", [(), (3,)])
def test_degree9_step_accumulates_into_its_scratch_gram(batch):
    """The degree-9 polynomial ``c₁A + A²(…)`` is accumulated into ``A`` itself when the caller
    says ``A`` is scratch (no copy of ``c₁A`` into the output first): bitwise the same values.
    Where autograd recorded ``A`` it must not be overwritten (backward needs it)."""
    from muon_fn.core import newton_schulz as O

    row = O.AOL9_COEFFICIENTS[3]
    x = torch.randn(*batch, 30, 50, generator=torch.Generator().manual_seed(12)).to(torch.bfloat16)
    gram = x @ x.mT
    expected = O.poly(gram.clone(), row, O.CPUProducts())
    scratch = gram.clone()
    out = O.poly(scratch, row, O.CPUProducts(), overwrite=True)
    assert out.data_ptr() == scratch.data_ptr() and torch.equal(out, expected)
    recorded = gram.float().requires_grad_()
    out = O.poly(recorded, row, O.CPUProducts(), overwrite=True)
    assert out.data_ptr() != recorded.data_ptr()
    out.sum().backward()
    assert recorded.grad is not None


@settings(max_examples=15, deadline=None)
@given(
    m=st.integers(1, 40),
    n=st.integers(1, 40),
    method=st.sampled_from(orth.METHODS),
    bf16=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_batched_operator_result_does_not_depend_on_batch_mates(m, n, method, bf16, seed):
    """orthogonalize_batch computes every step per matrix: a matrix gives the same bits alone, last
    in a batch or first in one (the FSDP owner batches other matrices than a single device), and at
    any position of a batch, whatever the alignment of its slot (fp32 CPU GEMMs round by address)."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    if method == "gram" and bf16:
        dtype = torch.float16 if torch.cuda.is_available() else torch.float32
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(m, n, generator=g) for _ in range(3)]
    schedule = orth.coefficient_schedule(method, None)
    run = lambda batch: orth.orthogonalize_batch(  # noqa: E731
        batch,
        schedule,
        dtype=dtype,
        eps=1e-7,
        norm_scale=orth.norm_scale(method),
    )
    alone = run([xs[2]])[0]
    assert torch.equal(run(xs)[2], alone)
    assert torch.equal(run([xs[2], xs[0]])[0], alone)
    assert torch.equal(run([xs[0], xs[2]])[1], alone)
    pair = run([xs[0], xs[1], xs[0], xs[2]])
    assert torch.equal(pair[3], alone) and torch.equal(pair[1], run([xs[1]])[0])
