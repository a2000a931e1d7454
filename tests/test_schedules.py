"""The "aol", "aol9" and "gram" orthogonalization schedules: equal to the standard iteration where
they should be, bands and quality (on the benchmark's real gradients), and the batched operator.

The device lane (``device`` fixture, tests/conftest.py) runs the tests that take ``device`` on the
CPU and, where a GPU is present, on CUDA: inputs drawn on the CPU and moved, float64 references on
the CPU, results compared after ``.cpu()``. The float64 checks keep their bounds on every device
(measured on the CPU at 4e-14 or less against bounds of 1e-12 to 1e-9: GPU fp64 GEMMs round alike,
only in another order), and so do the bands (bf16 is compared by singular-value bands only).
``TOL`` holds the two transpose checks, which are bitwise on the CPU: a GPU's fp32 GEMMs and fp32
Frobenius norm reduce in another order for a transposed layout (TF32 stays off, torch's default),
and the first iterations amplify that rounding near σ = 0 (slope ≈ 3.4 per quintic step). A one-ulp
change of the fp32 norm moves the results by up to 1.7e-6 (aol, fp32) and 6e-7 (aol9, float64
compute; measured on the CPU), so 5x the CPU bound. The real-gradient quality comparisons of two
bf16 schedules stay CPU-only: their margins, measured on the CPU (a max σ of 1.184 against 1.2, a
signed-RMS ratio of 0.999 against 1), are no bands another device's bf16 rounding must respect.
"""

from __future__ import annotations

import pytest
import torch
from conftest import lane_examples
from hypothesis import given, settings
from hypothesis import strategies as st

from muon_fn.core import newton_schulz as O
from muon_fn.tools import bench

TOL = {  # max-abs of the transpose checks (module docstring)
    "cpu": {"aol_transpose": 1e-5, "aol9_transpose64": 1e-6},
    "cuda": {"aol_transpose": 5e-5, "aol9_transpose64": 5e-6},
}


def _svals(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.svdvals(x.double().cpu())


def _scalar(s: torch.Tensor, schedule) -> torch.Tensor:
    """Each row (c0, ..., cd) maps σ to σ·Σ cᵢσ²ⁱ (written out term by term, not Horner)."""
    for row in schedule:
        s = sum(c * s ** (2 * i + 1) for i, c in enumerate(row))
    return s


# ----------------------------------------------------------------------------- Gram Newton–Schulz
@pytest.mark.parametrize("shape", [(24, 80), (80, 24), (3, 16, 50), (30, 30)])
@pytest.mark.parametrize("steps", [1, 3, 5, 7])
def test_gram_equals_standard_iteration_in_float64(device, shape, steps):
    x = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(steps)).to(
        device
    )
    ref = O.newton_schulz(x, "polar_express", steps)
    torch.testing.assert_close(O.newton_schulz(x, "gram", steps), ref, atol=1e-10, rtol=0)


def test_gram_float32_close_to_standard(device):
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)).to(device)
    out = O.newton_schulz(x, "gram", 5, dtype=torch.float32)
    torch.testing.assert_close(
        out, O.newton_schulz(x, "polar_express", 5, dtype=torch.float32), atol=2e-3, rtol=0
    )


def test_gram_rejects_bfloat16_with_a_clear_error():
    with pytest.raises(ValueError, match=r"method 'gram'.*bfloat16"):
        O.newton_schulz(torch.randn(8, 16), "gram", 5, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    "method,dtype",
    [
        ("gram", torch.float32),
        ("aol", torch.bfloat16),
        ("aol", torch.float32),
        ("aol9", torch.bfloat16),
        ("aol9", torch.float32),
    ],
)
def test_zero_maps_to_zero(device, method, dtype):
    out = O.newton_schulz(torch.zeros(2, 12, 40, device=device), method, None, dtype=dtype)
    assert out.shape == (2, 12, 40) and torch.isfinite(out).all() and not out.any()


# ----------------------------------------------------------------------------- AOL
def _aol64(x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    wide = x.mT if x.size(-2) > x.size(-1) else x
    wide = wide / (torch.linalg.vector_norm(wide) + 1e-7)
    s = ((wide @ wide.mT).abs().sum(-1) + 1e-7).rsqrt()  # the same eps as the library
    return wide * s[:, None]


def test_aol_is_the_standard_iteration_after_row_scaling_float64(device):
    x = torch.randn(40, 100, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    sched = O.coefficient_schedule("aol", 4)
    torch.testing.assert_close(
        O.newton_schulz(x.to(device), "aol", 4).cpu(),
        O.iterate(_aol64(x), sched),
        atol=1e-10,
        rtol=0,
    )


def test_aol_singular_values_follow_the_scalar_polynomial(device):
    x = torch.randn(50, 120, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    sched = O.coefficient_schedule("aol", 4)
    expect = _scalar(_svals(_aol64(x)), sched).sort().values
    torch.testing.assert_close(
        _svals(O.newton_schulz(x.to(device), "aol", 4)).sort().values, expect, atol=1e-9, rtol=0
    )


def test_aol_bound_holds_and_scaling_lifts_sigma():
    x = torch.randn(64, 200, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    s_aol, s_frob = _svals(_aol64(x)), _svals(x / torch.linalg.vector_norm(x))
    assert s_aol.max() <= 1 + 1e-12
    assert s_aol.min() > 2 * s_frob.min()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(128, 512), (512, 128)])
def test_aol_four_steps_band_on_rectangular_gaussian(device, dtype, shape):
    # Issue 6 criterion: every σ in [0.6, 1.2]; torch's 5-step quintic gives about [0.68, 1.14].
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(4)).to(device)
    sv = _svals(O.newton_schulz(x, "aol", 4, dtype=dtype))
    assert 0.6 <= sv.min() and sv.max() <= 1.2, (sv.min(), sv.max())


def test_aol_rank_one_direction_is_not_flipped(device):
    # AOL scales a rank-1 matrix to σ = 1 exactly: the schedule must map 1 near 1, not to -1.
    g = torch.Generator().manual_seed(5)
    u, v = torch.randn(64, 1, generator=g), torch.randn(1, 160, generator=g)
    x = u @ v + 1e-4 * torch.randn(64, 160, generator=g)
    out = O.newton_schulz(x.to(device), "aol", 4, dtype=torch.bfloat16).double().cpu()
    proj = (u.double().T @ out @ v.double().T).item() / (u.norm() * v.norm()).item()
    assert 0.75 < proj < 1.25


def test_published_aol_triples_would_flip_sigma_one():
    eo_aol = [
        (4.0098, -7.0585, 2.4635),
        (3.4585, -5.5479, 2.5959),
        (2.7573, -3.2939, 1.4254),
        (2.7215, -3.0494, 1.3169),
    ]
    assert _scalar(torch.tensor(1.0, dtype=torch.float64), eo_aol) < 0
    assert (
        0.75
        < _scalar(torch.tensor(1.0, dtype=torch.float64), O.coefficient_schedule("aol", 4))
        < 1.2
    )


def test_aol_scalar_band_and_more_steps_converge():
    s = torch.logspace(-2.5, 0, 2000, dtype=torch.float64) * 1.02
    s = s[s >= 3e-3]
    four = _scalar(s, O.coefficient_schedule("aol", 4))
    assert four.min() >= 0.75 and four.max() <= 1.19
    five = _scalar(s, O.coefficient_schedule("aol", 5))
    assert (five - 1).abs().max() < 0.03
    eight = _scalar(s, O.coefficient_schedule("aol", 8))
    assert (eight - 1).abs().max() < 1e-6


def test_aol_transpose_equivariance(device):
    x = torch.randn(3, 30, 70, generator=torch.Generator().manual_seed(6)).to(device)
    torch.testing.assert_close(
        O.newton_schulz(x.mT, "aol", 4).mT,
        O.newton_schulz(x, "aol", 4),
        atol=TOL[device.type]["aol_transpose"],
        rtol=0,
    )


def test_aol_quality_matches_torch_quintic_on_real_gradient():
    params, grads, names = bench.real_gradients("tiny")
    g = grads[names.index("h1.fc")]
    ref = bench.orthogonality(g, bench.orthogonalizer(bench.TORCH_ORTHO)(g))
    ours = bench.orthogonality(g, O.newton_schulz(g, "aol", 4, dtype=torch.bfloat16))
    assert ours["rms"] <= 1.1 * ref["rms"] and ours["max"] <= 1.2


# ----------------------------------------------------------------------------- degree-7/9 rows, "aol9"
@pytest.mark.parametrize(
    "row",
    [
        (1.5, -0.5),
        (3.0, -3.2, 1.2, 0.0),
        (2.0, -1.5, 0.8, -0.2),
        (3.4, -6.3, 5.8, -2.3, 0.33),
        (1.0, 0.5, -0.25, 0.125, -0.0625),
        (2.0, -1.0, 0.3, 0.0, 0.05),
    ],
)
def test_any_degree_row_applies_its_scalar_polynomial_float64(device, row):
    x = torch.randn(30, 70, dtype=torch.float64, generator=torch.Generator().manual_seed(len(row)))
    x = x / torch.linalg.vector_norm(x)
    out = O.iterate(x.to(device), [row, (1.875, -1.25, 0.375)])
    torch.testing.assert_close(
        _svals(out).sort().values,
        _scalar(_svals(x), [row, (1.875, -1.25, 0.375)]).abs().sort().values,
        atol=1e-12,
        rtol=0,
    )


def test_degree_nine_rows_in_gram_form_and_damped_equal_the_standard_form(device):
    x = torch.randn(2, 20, 90, dtype=torch.float64, generator=torch.Generator().manual_seed(7)).to(
        device
    )
    x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    rows = O.coefficient_schedule("aol9", 6)
    torch.testing.assert_close(O.iterate_gram(x, rows), O.iterate(x, rows), atol=1e-10, rtol=0)
    damped = O.coefficient_schedule("aol9", 4, stepsize=0.5)
    plain = O.coefficient_schedule("aol9", 4)
    for d, r in zip(damped, plain):
        assert len(d) == len(r) and d[0] == pytest.approx(0.5 + 0.5 * r[0])
        assert list(d[1:]) == pytest.approx([0.5 * c for c in r[1:]])


def test_rows_above_degree_nine_are_rejected():
    with pytest.raises(ValueError, match="at most degree 9"):
        O.iterate(torch.randn(4, 8), [(1.0, 0.1, 0.1, 0.1, 0.1, 0.1)])


def test_aol9_singular_values_follow_the_scalar_polynomial(device):
    x = torch.randn(50, 120, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    sched = O.coefficient_schedule("aol9", None)
    assert len(sched) == 4 and sched.precondition == "aol" and len(sched[3]) == 5
    expect = _scalar(_svals(_aol64(x)), sched).sort().values
    torch.testing.assert_close(
        _svals(O.newton_schulz(x.to(device), "aol9", None)).sort().values, expect, atol=1e-9, rtol=0
    )


def test_aol9_scalar_band_and_more_steps_converge():
    s = torch.logspace(-2.5, 0, 2000, dtype=torch.float64) * 1.02
    s = s[s >= 3e-3]
    four = _scalar(s, O.coefficient_schedule("aol9", 4))
    assert four.min() >= 0.85 and four.max() <= 1.15, (four.min(), four.max())
    # Past the top of its input interval (where bf16 rounding can push σ) the last step stays bounded.
    sched = O.coefficient_schedule("aol9", 4)
    top = _scalar(s, sched[:3]).max() * 1.005
    past = _scalar(torch.linspace(1.0, 1.07, 200, dtype=torch.float64) * top, sched[3:])
    assert past.min() >= 0.6 and past.max() <= 1.15 + 1e-9
    assert (
        0.9
        < _scalar(torch.tensor(1.0, dtype=torch.float64), O.coefficient_schedule("aol9", 4))
        < 1.15
    )
    eight = _scalar(s, O.coefficient_schedule("aol9", 8))
    assert (eight - 1).abs().max() < 1e-6
    # Slope at 0 (what lifts the tiny singular values of low-rank gradients): above torch's 3.4445**5.
    assert torch.tensor([r[0] for r in O.coefficient_schedule("aol9", 4)]).prod() > 3.4445**5 * 0.65


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(128, 512), (512, 128), (96, 96)])
def test_aol9_band_on_gaussian(device, dtype, shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(4)).to(device)
    sv = _svals(O.newton_schulz(x, "aol9", None, dtype=dtype))
    assert sv.max() <= 1.2, sv.max()
    if shape[0] != shape[1]:  # square Gaussians have σ near 0 that no 4-5 step schedule lifts
        assert 0.6 <= sv.min(), sv.min()


@settings(lane_examples, max_examples=25, deadline=None)
@given(
    m=st.integers(1, 40),
    n=st.integers(1, 40),
    batch=st.integers(0, 2),
    seed=st.integers(0, 2**31 - 1),
    scale=st.sampled_from([1e-3, 1.0, 1e3]),
)
def test_aol9_any_shape_is_finite_bounded_and_transpose_equivariant(
    device, m, n, batch, seed, scale
):
    x = scale * torch.randn(
        *([batch] if batch else []), m, n, generator=torch.Generator().manual_seed(seed)
    )
    x = x.to(device)
    # Exact map: σ ≤ 1.142. bf16 rounding on tiny matrices (errors do not average out) reaches
    # 1.27 over 2,700 random 2×2 … 24×24 matrices (torch's quintic: 1.20).
    for dtype, bound in ((torch.float32, 1.15), (torch.bfloat16, 1.3)):
        out = O.newton_schulz(x, "aol9", None, dtype=dtype)
        assert out.shape == x.shape and out.dtype == x.dtype and torch.isfinite(out).all()
        assert torch.linalg.matrix_norm(out.double().cpu(), ord=2).max() <= bound
    if m != n:  # AOL scales rows, so a square input and its transpose are scaled differently
        out = O.newton_schulz(x, "aol9", None, dtype=torch.float64)
        torch.testing.assert_close(
            O.newton_schulz(x.mT, "aol9", None, dtype=torch.float64),
            out.mT,
            atol=TOL[device.type]["aol9_transpose64"],
            rtol=0,
        )


def test_aol9_rank_one_direction_is_not_flipped(device):
    g = torch.Generator().manual_seed(5)
    u, v = torch.randn(64, 1, generator=g), torch.randn(1, 160, generator=g)
    x = u @ v + 1e-4 * torch.randn(64, 160, generator=g)
    out = O.newton_schulz(x.to(device), "aol9", None, dtype=torch.bfloat16).double().cpu()
    proj = (u.double().T @ out @ v.double().T).item() / (u.norm() * v.norm()).item()
    assert 0.85 < proj < 1.15


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_aol9_no_worse_than_torch_quintic_on_every_real_tiny_gradient(dtype):
    _, grads, names = bench.real_gradients("tiny")
    torch_ortho = bench.orthogonalizer(bench.TORCH_ORTHO)  # bf16, as torch.optim.Muon runs it
    if dtype != torch.bfloat16:  # the same quintic in fp32 (bf16 noise lifts zero σ: lower RMS)
        torch_ortho = lambda g: O.newton_schulz(g, "quintic", 5, dtype=dtype)  # noqa: E731
    for name, g in zip(names, grads):
        ref = bench.orthogonality(g, torch_ortho(g))
        ours = bench.orthogonality(g, O.newton_schulz(g, "aol9", None, dtype=dtype))
        assert (
            ours["rms"] <= ref["rms"]
            and ours["signed_rms"] <= ref["signed_rms"]
            and ours["max"] <= 1.2
        ), name


# ----------------------------------------------------------------------------- schedules
def test_default_steps_and_schedule_options():
    assert O.default_steps("aol") == 4 and O.default_steps("polar_express") == 5
    sched = O.coefficient_schedule("aol", None)
    assert len(sched) == 4 and sched.precondition == "aol" and sched.form == "standard"
    damped = O.coefficient_schedule("aol", 6, stepsize=0.5)
    assert len(damped) == 6 and damped.precondition == "aol"
    assert O.coefficient_schedule("gram", 5).form == "gram"
    assert O.coefficient_schedule("quintic", 5).precondition == "frobenius"
    # A plain tuple of triples still runs (Frobenius, standard form).
    x = torch.randn(8, 20, dtype=torch.float64)
    torch.testing.assert_close(
        O.orthogonalize_matrices(
            x, tuple(O.coefficient_schedule("quintic", 5)), dtype=torch.float64, eps=1e-7
        ),
        O.newton_schulz(x, "quintic", 5),
    )


def test_schedule_rejects_unknown_options():
    with pytest.raises(ValueError, match="precondition"):
        O.Schedule([(1.5, -0.5, 0.0)], precondition="spectral")
    with pytest.raises(ValueError, match="form"):
        O.Schedule([(1.5, -0.5, 0.0)], form="fast")


def test_orthogonalize_batch_equals_per_matrix(device):
    # One batch per shape, tall and wide: each result, in its matrix's orientation, is its own.
    g = torch.Generator().manual_seed(7)
    for shape in ((20, 60), (60, 20)):
        xs = [torch.randn(shape, generator=g, dtype=torch.float64).to(device) for _ in range(3)]
        for method in ("polar_express", "aol", "gram"):
            sched, scale = O.coefficient_schedule(method, None), O.norm_scale(method)
            outs = O.orthogonalize_batch(xs, sched, dtype=torch.float64, eps=1e-7, norm_scale=scale)
            assert outs.shape == (3, *shape) and outs.is_contiguous()
            for x, o in zip(xs, outs):
                ref = O.orthogonalize_matrices(
                    x, sched, dtype=torch.float64, eps=1e-7, norm_scale=scale
                )
                torch.testing.assert_close(o, ref, atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="one shape"):
        O.orthogonalize_batch([xs[0], xs[0].mT.contiguous()], sched, dtype=torch.float64, eps=1e-7)
