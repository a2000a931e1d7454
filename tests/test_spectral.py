"""muon_fn.spectral: power iteration, spectral norm, retraction and the SSO λ solver.

References are independent of the code under test: ``torch.linalg.matrix_norm(ord=2)`` / the SVD
for σ and singular vectors, and an SVD-based exact msign (``U Vᵀ``) for h(λ).

Tolerances (measured on torch 2.13 CPU, then given a margin):
- power_iteration with a spectral gap σ₂/σ₁ ≤ 0.8 and 80 steps: σ to 1e-5 relative (error decays
  like (σ₂/σ₁)^(4k); measured ≤ 3e-7).
- compute_spectral_norm on any matrix (no gap assumed): 2e-5 relative (measured ≤ 6e-7); it
  squares the Gram matrix 14 times, so even σ₂/σ₁ = 0.997 converges.
- retraction with an accurate σ: ‖(R/σ)W‖₂ = R to 1e-5 relative (fp32 rounding, measured 2e-7).
"""

from __future__ import annotations

import math

import expecttest
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from muon_fn import spectral
from muon_fn._newton_schulz import coefficient_schedule, newton_schulz, norm_scale


def _with_spectrum(m: int, n: int, s: torch.Tensor, seed: int) -> torch.Tensor:
    """A random m×n matrix with singular values ``s`` (length min(m, n)), in fp64."""
    g = torch.Generator().manual_seed(seed)
    k = min(m, n)
    U, _ = torch.linalg.qr(torch.randn(m, k, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(n, k, generator=g, dtype=torch.float64))
    return U @ torch.diag(s.double()) @ V.T


def _exact_msign(x: torch.Tensor) -> torch.Tensor:
    U, _, Vh = torch.linalg.svd(x.double(), full_matrices=False)
    return U @ Vh


def _msign8(x: torch.Tensor) -> torch.Tensor:
    return newton_schulz(x, "polar_express", 8, dtype=torch.float32)


shapes = st.tuples(st.integers(2, 40), st.integers(2, 40))


# ------------------------------------------------------------------------------ power iteration
@given(shape=shapes, gap=st.floats(0.05, 0.8), cond=st.floats(1.0, 1e4), scale=st.floats(1e-3, 1e3),
       seed=st.integers(0, 2**16))
def test_power_iteration_matches_matrix_norm(shape, gap, cond, scale, seed):
    m, n = shape
    k = min(m, n)
    # σ₁ = scale, σ₂ = gap·scale, the rest geometric down to scale/cond (conditioning varies).
    tail = torch.logspace(0, -math.log10(cond), max(k - 1, 1), dtype=torch.float64)[: k - 1]
    s = torch.cat([torch.ones(1, dtype=torch.float64), gap * tail]) * scale
    W = _with_spectrum(m, n, s, seed)
    expected = torch.linalg.matrix_norm(W, ord=2)
    sigma, u, v = spectral.power_iteration(W.float(), 80)
    assert sigma.dtype == torch.float32
    torch.testing.assert_close(sigma.double(), expected, rtol=1e-5, atol=0)
    # W v = σ u with unit vectors, aligned with the SVD's top pair (up to sign).
    U, _, Vh = torch.linalg.svd(W)
    assert abs(float(u.double() @ U[:, 0])) == pytest.approx(1.0, abs=1e-4)
    assert abs(float(v.double() @ Vh[0])) == pytest.approx(1.0, abs=1e-4)
    torch.testing.assert_close((W.float() @ v), sigma * u, rtol=0, atol=2e-5 * float(sigma))


@given(shape=shapes, scale=st.floats(1e-3, 1e3), seed=st.integers(0, 2**16))
def test_compute_spectral_norm_matches_matrix_norm_without_gap(shape, scale, seed):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(*shape, generator=g) * scale  # Gaussian: σ₂/σ₁ can be close to 1
    expected = torch.linalg.matrix_norm(W.double(), ord=2)
    torch.testing.assert_close(spectral.compute_spectral_norm(W).double(), expected, rtol=2e-5, atol=0)


def test_spectral_norm_near_degenerate_top_and_batched():
    # σ₂/σ₁ = 0.999: plain power iteration is still 1e-3 off after 100 steps.
    s = torch.tensor([1.0, 0.999] + [0.5] * 30, dtype=torch.float64)
    W = _with_spectrum(32, 48, s, 0).float()
    assert float(spectral.compute_spectral_norm(W)) == pytest.approx(1.0, rel=2e-5)
    batch = torch.stack([W, 3 * W, torch.randn(32, 48, generator=torch.Generator().manual_seed(1))])
    got = spectral.compute_spectral_norm(batch)
    want = torch.stack([spectral.compute_spectral_norm(b) for b in batch])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    sigma, u, v = spectral.top_singular(W)
    torch.testing.assert_close(W @ v, sigma * u, rtol=0, atol=1e-5)


def test_power_iteration_batched_equals_loop_and_zero_matrix():
    g = torch.Generator().manual_seed(1)
    W = torch.randn(3, 7, 5, generator=g)
    v0 = torch.randn(3, 5, generator=g)
    sb, ub, vb = spectral.power_iteration(W, 6, v0)
    for i in range(3):
        s, u, v = spectral.power_iteration(W[i], 6, v0[i])
        torch.testing.assert_close(sb[i], s, rtol=1e-6, atol=0)
        torch.testing.assert_close(vb[i], v, rtol=0, atol=1e-6)
    s, u, v = spectral.power_iteration(torch.zeros(4, 6), 3)
    assert float(s) == 0.0 and torch.isfinite(u).all() and torch.isfinite(v).all()
    # A zero start vector falls back to the cold start instead of staying at zero.
    s0, _, _ = spectral.power_iteration(W[0], 50, torch.zeros(5))
    torch.testing.assert_close(s0, torch.linalg.matrix_norm(W[0], ord=2), rtol=1e-4, atol=0)


def test_default_start_is_not_fooled_by_zero_row_sums():
    # All-ones (the reference code's start) is in the null space of a matrix whose rows sum to 0.
    W = torch.randn(20, 20, generator=torch.Generator().manual_seed(2))
    W = W - W.mean(dim=1, keepdim=True)
    assert float((W @ torch.ones(20)).abs().max()) < 1e-5
    sigma, _, _ = spectral.power_iteration(W, 300)
    torch.testing.assert_close(sigma, torch.linalg.matrix_norm(W, ord=2), rtol=1e-4, atol=0)


def _steps_to(W, v0, rel, cap=2000):
    target = torch.linalg.matrix_norm(W.double(), ord=2)
    for k in range(cap):
        sigma, _, _ = spectral.power_iteration(W, k, v0)
        if abs(float(sigma) / float(target) - 1) <= rel:
            return k
    return cap


def test_warm_start_converges_in_fewer_steps_than_cold():
    # An nn.Linear-like weight (σ₂/σ₁ ≈ 0.98) and the same weight after a small random step.
    # Measured steps to 1e-5 relative: cold 28–29; warm 6 (ε = 0.02), 0 (ε = 0.005).
    g = torch.Generator().manual_seed(3)
    W = torch.randn(64, 96, generator=g) / math.sqrt(96)
    N = torch.randn(64, 96, generator=g) / math.sqrt(96)
    _, _, v_prev = spectral.top_singular(W)
    for eps, warm_max in ((0.02, 8), (0.005, 1)):
        cold = _steps_to(W + eps * N, None, 1e-5)
        warm = _steps_to(W + eps * N, v_prev, 1e-5)
        assert warm <= warm_max and cold >= 3 * max(warm, 5), (eps, cold, warm)


def _flat_top(shape, top, seed, scale=1.0):
    """W with σ₁ = 1 falling linearly to σ₉ = ``top``, then to 0.05·top; and a warm block (3 power
    steps on a perturbed W, like last step's block in SSO)."""
    m, n = shape
    s = torch.cat([torch.linspace(1.0, top, 9)[:-1], top * torch.linspace(1.0, 0.05, min(m, n) - 8)])
    W = (_with_spectrum(m, n, s, seed) * scale).float()
    g = torch.Generator().manual_seed(seed)
    near = W + 0.01 * scale * torch.randn(m, n, generator=g) / math.sqrt(n)
    return W, spectral.subspace_iteration(near, 3, block=4, method="power")[3]


@given(shape=st.sampled_from([(48, 48), (40, 96), (96, 40)]), top=st.floats(0.9, 0.99),
       seed=st.integers(0, 2**16), scale=st.floats(1e-2, 1e2))
def test_chebyshev_block_iteration_beats_power_on_a_flat_top(shape, top, seed, scale):
    """A flat top is where plain power steps stall; the Chebyshev filter damps everything below
    the block's smallest Ritz value and separates the top faster. Both give Ritz lower bounds."""
    W, V0 = _flat_top(shape, top, seed, scale)
    errs = {}
    for method in ("power", "chebyshev"):
        sigma, u, v, V = spectral.subspace_iteration(W, 4, V0, method=method)
        errs[method] = 1 - float(sigma) / scale
        assert -1e-5 <= errs[method]  # a lower bound (up to fp32 rounding)
        torch.testing.assert_close(V.mT @ V, torch.eye(4), rtol=0, atol=1e-5)  # orthonormal block
        torch.testing.assert_close(W @ v, sigma * u, rtol=0, atol=1e-4 * scale)
    assert errs["chebyshev"] <= errs["power"] + 1e-6


def test_chebyshev_block_iteration_example():
    W, V0 = _flat_top((48, 48), 0.9, 0)
    power, cheb = (1 - float(spectral.subspace_iteration(W, 4, V0, method=m)[0]) for m in ("power", "chebyshev"))
    assert cheb <= 0.25 * power  # measured 4.1e-3 vs 2.5e-2


def test_block_iteration_handles_zero_and_low_rank_matrices():
    for method in spectral.SUBSPACE_METHODS:
        sigma, u, v, V = spectral.subspace_iteration(torch.zeros(2, 6, 5), 5, block=3, method=method)
        assert torch.equal(sigma, torch.zeros(2)) and bool(torch.isfinite(V).all())
        x = torch.outer(torch.arange(1.0, 7.0), torch.ones(5))  # rank one, σ = √(91·5)
        sigma = spectral.subspace_iteration(x, 5, block=3, method=method)[0]
        assert float(sigma) == pytest.approx(math.sqrt(91 * 5), rel=1e-6)


# ------------------------------------------------------------------------------ retraction
@given(shape=shapes, c=st.floats(0.1, 4.0), scale=st.floats(1e-2, 1e2), seed=st.integers(0, 2**16))
def test_retraction_lands_on_the_sphere(shape, c, scale, seed):
    W = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale
    R = spectral.target_radius(W.shape, c)
    assert R == pytest.approx(c * math.sqrt(shape[0] / shape[1]))
    sigma, _, _ = spectral.top_singular(W)
    Wr = spectral.retract(W, sigma, R)
    assert float(torch.linalg.matrix_norm(Wr.double(), ord=2)) == pytest.approx(R, rel=1e-5)


def test_target_radius_flattens_conv_kernels_and_retract_keeps_zero():
    assert spectral.target_radius((64, 16, 3, 3), 2.0) == pytest.approx(2.0 * math.sqrt(64 / 144))
    Z = torch.zeros(3, 4)
    assert torch.equal(spectral.retract(Z, torch.tensor(0.0), 1.0), Z)


# ------------------------------------------------------------------------------ λ solver
def _problem(m, n, seed, scale_theta=0.0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(m, n, generator=g) / math.sqrt(n)
    sigma, u, v = spectral.top_singular(W)
    M = torch.randn(m, n, generator=g) + scale_theta * torch.outer(u, v) * math.sqrt(m * n)
    return M / torch.linalg.matrix_norm(M), u, v


def _h_exact(m_hat, u, v, lam):
    return float(u.double() @ _exact_msign(m_hat.double() + lam * torch.outer(u, v).double()) @ v.double())


_FIT8 = spectral.spectral_function_fit(coefficient_schedule("polar_express", 8))


def _model(m_hat, u, v):
    """The λ model for ``_msign8`` (Polar Express normalizer 1.01·‖X‖_F + 1e-7)."""
    return spectral.lambda_model(m_hat, u, v, _FIT8, norm_scale=norm_scale("polar_express"), eps=1e-7)


@pytest.mark.parametrize("method", ["bisection", "illinois", "model"])
@given(shape=st.tuples(st.integers(4, 24), st.integers(4, 24)), seed=st.integers(0, 2**16),
       pull=st.floats(-0.3, 0.3))
def test_solver_tangency_when_converged(method, shape, seed, pull):
    m_hat, u, v = _problem(*shape, seed, scale_theta=pull)
    tol = 1e-4
    model = _model(m_hat[None], u[None], v[None]) if method == "model" else None
    lam, phi, stats = spectral.solve_lambda(m_hat, u, v, _msign8, tol=tol, method="illinois" if model else method,
                                            max_expansions=16, model=model)
    if bool(stats.converged):
        assert float(stats.residual) <= tol
        # The returned Φ is msign at the returned λ, and h there is small by an independent msign.
        h_phi = float(u @ phi @ v)
        assert abs(h_phi) <= tol
        # Against the exact polar factor where 8 Polar Express steps converge (σ_min/σ_max ≥ 1e-2;
        # below that the msign itself is approximate and so is the tangency it certifies).
        x = m_hat + lam * torch.outer(u, v)
        s = torch.linalg.svdvals(x.double())
        if float(s[-1] / s[0]) >= 1e-2:
            assert abs(_h_exact(m_hat, u, v, float(lam))) <= 10 * tol
            torch.testing.assert_close(phi.double(), _exact_msign(x), atol=1e-4, rtol=0)
    else:
        assert bool(stats.fallback) or int(stats.iterations) >= 20


def test_bisection_and_illinois_find_the_same_root_and_illinois_is_cheaper():
    m_hat, u, v = _problem(24, 40, 7, scale_theta=0.2)
    lb, _, sb = spectral.solve_lambda(m_hat, u, v, _msign8, tol=1e-5, method="bisection", max_iterations=40)
    li, _, si = spectral.solve_lambda(m_hat, u, v, _msign8, tol=1e-5, method="illinois", max_iterations=40)
    assert bool(sb.converged) and bool(si.converged)
    assert float(lb) == pytest.approx(float(li), abs=2e-5)
    assert int(si.iterations) < int(sb.iterations)


def test_bracket_expansion_reaches_a_far_root():
    # M̂ ∝ −0.9·Θ + noise: the root is near λ ≈ 0.9/‖·‖, ~10 doublings of 1e-3 away from 0.
    g = torch.Generator().manual_seed(4)
    m, n = 16, 24
    W = torch.randn(m, n, generator=g)
    _, u, v = spectral.top_singular(W)
    noise = torch.randn(m, n, generator=g)
    noise = noise - (u @ noise @ v) * torch.outer(u, v)
    M = -0.9 * torch.outer(u, v) + 0.1 * noise / torch.linalg.matrix_norm(noise)
    m_hat = M / torch.linalg.matrix_norm(M)
    lam, _, stats = spectral.solve_lambda(m_hat, u, v, _msign8, tol=1e-4)
    assert bool(stats.converged) and not bool(stats.fallback)
    assert 0.5 < float(lam) < 1.023
    assert int(stats.iterations) >= 10  # 1 + ≥ 9 expansions + bracketed steps
    assert abs(_h_exact(m_hat, u, v, float(lam))) <= 1e-3


def test_no_bracket_falls_back_to_lambda_zero():
    g = torch.Generator().manual_seed(5)
    m, n = 16, 24
    W = torch.randn(m, n, generator=g)
    _, u, v = spectral.top_singular(W)
    m_hat = -torch.outer(u, v) * 0.99 + 0.01 * torch.randn(m, n, generator=g)
    m_hat = m_hat / torch.linalg.matrix_norm(m_hat)
    # Two expansions reach only λ = 3e-3; h stays ≈ −1 there.
    lam, phi, stats = spectral.solve_lambda(m_hat, u, v, _msign8, tol=1e-4, max_expansions=2)
    assert bool(stats.fallback) and not bool(stats.converged)
    assert float(lam) == 0.0
    torch.testing.assert_close(phi, _msign8(m_hat), rtol=0, atol=0)
    assert float(stats.residual) == pytest.approx(abs(float(u @ _msign8(m_hat) @ v)), abs=1e-6)
    assert int(stats.iterations) == 1 + 2 + 1  # λ0, two expansions, the λ = 0 fallback msign


def test_batched_solver_mixes_fallback_and_convergence_and_matches_fixed_iterations():
    a = _problem(12, 20, 8)
    g = torch.Generator().manual_seed(9)
    _, u, v = spectral.top_singular(torch.randn(12, 20, generator=g))
    far = -0.99 * torch.outer(u, v) + 0.01 * torch.randn(12, 20, generator=g)
    b = (far / torch.linalg.matrix_norm(far), u, v)
    m_hat, U, V = (torch.stack([x, y]) for x, y in zip(a, b))
    kw = dict(tol=1e-4, max_expansions=8)  # reaches ±0.255: row a (λ* ≈ −0.14) yes, row b (≈ +1) no
    lam, phi, st = spectral.solve_lambda(m_hat, U, V, _msign8, **kw)
    assert st.converged.tolist() == [True, False] and st.fallback.tolist() == [False, True]
    lam_f, phi_f, st_f = spectral.solve_lambda(m_hat, U, V, _msign8, early_exit=False, **kw)
    torch.testing.assert_close(lam_f, lam, rtol=0, atol=1e-7)
    torch.testing.assert_close(phi_f, phi, rtol=0, atol=1e-6)
    assert torch.equal(st_f.iterations, st.iterations) and torch.equal(st_f.fallback, st.fallback)


def test_solver_traces_as_one_graph():
    m_hat, u, v = _problem(8, 12, 10)
    batch = (m_hat[None], u[None], v[None])
    fn = torch.compile(
        lambda m, u, v: spectral.solve_lambda(m, u, v, _msign8, max_expansions=3, max_iterations=3),
        backend="eager", fullgraph=True)
    lam_c, phi_c, st_c = fn(*batch)
    lam_e, phi_e, st_e = spectral.solve_lambda(*batch, _msign8, max_expansions=3, max_iterations=3)
    torch.testing.assert_close(lam_c, lam_e)
    torch.testing.assert_close(phi_c, phi_e)


@pytest.mark.parametrize("use_model", [False, True], ids=["no_model", "model"])
def test_zero_momentum_gives_lambda_zero_and_zero_direction(use_model):
    _, u, v = _problem(6, 9, 11)
    z = torch.zeros(6, 9)
    model = _model(z[None], u[None], v[None]) if use_model else None
    lam, phi, stats = spectral.solve_lambda(z, u, v, _msign8, model=model)
    assert float(lam) == 0.0 and bool(stats.converged) and float(phi.abs().max()) == 0.0
    assert int(stats.iterations) == 1


# ------------------------------------------------------------------------------ the λ model
def test_spectral_function_fit_matches_the_polynomial_composition():
    # g(s) = p_8 ∘ … ∘ p_1 (s) in float64, on a grid finer than (and extending below) the fit's.
    s = torch.logspace(-9, 0, 3001, dtype=torch.float64)
    g = s.clone()
    for a, b, c in coefficient_schedule("polar_express", 8):
        g2 = g * g
        g = g * (a + g2 * (b + c * g2))
    w, tau = _FIT8
    fitted = s * (w / (s[:, None] ** 2 + tau)).sum(-1)
    assert float((fitted - g).abs().max()) <= 5e-5  # measured 2.2e-5


@pytest.mark.parametrize("precision", ["mixed", "fp64", "fp32"])
@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (16, 16), (4, 30), (33, 33)])
def test_lambda_model_matches_the_msign_residual(shape, precision):
    # Square shapes put σ_min/N near Polar Express's corner (~1e-4), the hardest case.
    worst = 0.0
    for seed in range(8):
        for pull in (0.0, 0.2, -0.3):
            m_hat, u, v = _problem(*shape, seed, scale_theta=pull)
            model = spectral.lambda_model(m_hat[None], u[None], v[None], _FIT8, norm_scale=norm_scale("polar_express"),
                                          eps=1e-7, precision=precision)
            lams = torch.tensor([-0.1, -0.01, 0.0, 0.003, 0.05])
            for lam in lams:
                h, _ = spectral.tangent_residual(m_hat, u, v, lam, _msign8)
                h_model = spectral.model_residual(model, lam.reshape(1))[0]
                worst = max(worst, abs(float(h_model) - float(h)))
    assert worst <= 1e-4  # measured ≤ 4.3e-5 (fp32 msign vs the model of its exact-arithmetic map)


def test_model_root_is_the_msign_root_and_costs_one_msign():
    rows = [_problem(24, 40, s, scale_theta=p) for s, p in ((1, 0.0), (2, 0.2), (3, -0.2))]
    m_hat, U, V = (torch.stack(x) for x in zip(*rows))
    lam_c, phi_c, st_c = spectral.solve_lambda(m_hat, U, V, _msign8, tol=1e-5, method="illinois", max_iterations=40)
    model = _model(m_hat, U, V)
    lam_m, phi_m, st_m = spectral.solve_lambda(m_hat, U, V, _msign8, tol=1e-5, method="illinois", model=model)
    assert bool(st_c.converged.all()) and bool(st_m.converged.all())
    torch.testing.assert_close(lam_m, lam_c, rtol=0, atol=1e-5)
    assert st_m.iterations.tolist() == [1, 1, 1] and bool((st_c.iterations >= 3).all())
    # Φ is the msign at the returned λ (no extra call), and certifies the tangency.
    torch.testing.assert_close(phi_m, spectral.tangent_residual(m_hat, U, V, lam_m, _msign8)[1], rtol=0, atol=0)
    assert float((U[:, None, :] @ phi_m @ V[:, :, None]).abs().max()) <= 1e-5


def _bisect_model(model, offset, reach, steps=80):
    """A plain bisection on the model: the reference for model_root."""
    lo = torch.full_like(offset, -reach)
    hi = -lo
    for _ in range(steps):
        mid = 0.5 * (lo + hi)
        up = spectral.model_residual(model, mid) + offset < 0
        lo, hi = torch.where(up, mid, lo), torch.where(up, hi, mid)
    return 0.5 * (lo + hi)


@given(shape=st.sampled_from([(8, 8), (16, 16), (12, 30), (30, 12), (33, 33)]), seed=st.integers(0, 2**16),
       pull=st.floats(-0.5, 0.5), offset=st.floats(-0.3, 0.3))
def test_model_root_matches_bisection_in_few_evaluations(shape, seed, pull, offset):
    """Illinois false position with a bisection guard: the bisection's root to fp32 resolution,
    in a handful of model evaluations; rows without a sign change are reported, not solved."""
    rows = [_problem(*shape, seed + k, scale_theta=pull * (k - 1)) for k in range(3)]
    m_hat, U, V = (torch.stack(x) for x in zip(*rows))
    model = _model(m_hat, U, V)
    off = torch.tensor([offset, 0.0, 5.0], dtype=torch.float64)  # |h| ≤ 1: row 2 has no root
    calls = []
    residual = spectral.model_residual
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(spectral, "model_residual", lambda mo, lam: calls.append(1) or residual(mo, lam))
        lam, ok = spectral.model_root(model, off, 1.023)
    ref = _bisect_model(model, off, 1.023)
    assert ok.tolist()[2] is False
    h = residual(model, lam.double()) + off
    for i in (0, 1):
        if bool(ok[i]):
            assert abs(float(lam[i]) - float(ref[i])) <= 1e-6 * max(1.0, abs(float(ref[i])))
            assert abs(float(h[i])) <= 1e-5
    assert len(calls) <= 30  # 2 ends + the steps: measured ≈ 12 on gpt2-small gradients (50 for bisection)


@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (16, 16), (33, 33)])
def test_model_direction_is_the_msign_at_the_model_root(shape):
    worst_phi = worst_h = 0.0
    for seed in range(6):
        m_hat, u, v = _problem(*shape, seed, scale_theta=0.2 if seed % 2 else 0.0)
        # Φ needs the fp64 model (SSO's direction="spectral" uses it): "mixed" leaves the fp32
        # Gram's rounding in the eigenvectors of the larger eigenvalues, which Φ sees directly.
        model = spectral.lambda_model(m_hat[None], u[None], v[None], _FIT8, norm_scale=norm_scale("polar_express"),
                                      precision="fp64")
        lam, ok = spectral.model_root(model, torch.zeros(1, dtype=torch.float64), 1.023)
        assert bool(ok)
        phi = spectral.model_direction(model, m_hat[None], u[None], v[None], lam)[0]
        _, phi_ns = spectral.tangent_residual(m_hat, u, v, lam[0], _msign8)
        worst_phi = max(worst_phi, float((phi - phi_ns).abs().max()))
        worst_h = max(worst_h, abs(float(u @ phi @ v)))
    assert worst_phi <= 1e-4 and worst_h <= 1e-4  # measured ≤ 3.9e-5 (Φ), ≤ 1.1e-5 (h)


def _low_rank_plus_noise(m, n, seed, rank=4, noise=0.3):
    """A momentum-like M̂ (a few strong directions over a noise floor) and W's top pair."""
    g = torch.Generator().manual_seed(seed)
    M = torch.randn(m, rank, generator=g) @ torch.randn(rank, n, generator=g) / math.sqrt(rank)
    M = M + noise * torch.randn(m, n, generator=g)
    W = torch.randn(m, n, generator=g) / math.sqrt(n)
    _, u, v = spectral.top_singular(W)
    return M / torch.linalg.matrix_norm(M), u, v


@pytest.mark.parametrize("shape", [(256, 640), (640, 256)])
def test_krylov_model_matches_the_full_model(shape):
    """On clearly rectangular matrices the Krylov projection gives the full model's h(λ) (and
    root) without an eigendecomposition of the m×m Gram matrix."""
    rows = [_low_rank_plus_noise(*shape, seed) for seed in (1, 2)]
    m_hat, U, V = (torch.stack(x) for x in zip(*rows))
    kw = dict(norm_scale=norm_scale("polar_express"), eps=1e-7)
    krylov = spectral.krylov_lambda_model(m_hat, U, V, _FIT8, **kw)
    full = spectral.lambda_model(m_hat, U, V, _FIT8, precision="fp64", **kw)
    assert krylov is not None and krylov.Q is None and krylov.tall == (shape[0] > shape[1])
    assert krylov.eig.shape[-1] < min(shape) // 4  # a small projected problem, not m eigenpairs
    for lam in (-0.05, -0.003, 0.0, 0.002, 0.04):
        at = torch.full((2,), lam, dtype=torch.float64)
        diff = (spectral.model_residual(krylov, at) - spectral.model_residual(full, at)).abs().max()
        assert float(diff) <= 1e-5  # measured ≤ 2e-7
    zero = torch.zeros(2, dtype=torch.float64)
    (r_k, ok_k), (r_f, ok_f) = spectral.model_root(krylov, zero, 1.023), spectral.model_root(full, zero, 1.023)
    assert bool(ok_k.all() and ok_f.all())
    torch.testing.assert_close(r_k, r_f, rtol=0, atol=1e-6)


def test_krylov_model_declines_where_it_would_not_pay_or_converge():
    kw = dict(norm_scale=norm_scale("polar_express"), eps=1e-7)
    for shape in ((300, 300), (256, 500), (128, 1024)):  # square, aspect < 2, too few rows
        m_hat, u, v = _low_rank_plus_noise(*shape, 0)
        assert spectral.krylov_lambda_model(m_hat[None], u[None], v[None], _FIT8, **kw) is None
    # A rank-1 M̂: the Krylov space is invariant after one step (breakdown).
    m_hat, u, v = _low_rank_plus_noise(256, 640, 3, rank=1, noise=0.0)
    assert spectral.krylov_lambda_model(m_hat[None], u[None], v[None], _FIT8, **kw) is None


def test_sso_on_rectangular_matrices_uses_one_msign_with_the_krylov_model():
    """The transform picks the Krylov model for a 256×640 weight (and its transpose); the solver
    still certifies every λ with one msign per matrix and step."""
    import muon_fn

    g = torch.Generator().manual_seed(4)
    params = [torch.randn(256, 640, generator=g) / 25, torch.randn(640, 256, generator=g) / 25]
    tx = muon_fn.spectral_sphere(lr=0.02)
    state = tx.init(params)
    calls = []
    original = spectral.krylov_lambda_model

    def counting(*args, **kwargs):
        model = original(*args, **kwargs)
        calls.append(model is not None)
        return model

    spectral.krylov_lambda_model = counting
    try:
        for step in range(3):
            grads = [torch.randn(p.shape, generator=g) + 3 * p for p in params]
            updates, state = tx.update(grads, state, params)
            params = muon_fn.apply_updates(params, updates)
            assert [int(i) for i in state.iterations] == [1, 1]
            assert max(float(r) for r in state.residual) <= 2e-4
    finally:
        spectral.krylov_lambda_model = original
    assert calls and all(calls)


def test_model_steps_then_bracket_when_the_model_is_off():
    # A model of a different matrix is a bad guide: the solver must still converge to the right
    # root (secant steps, then the bracket), with every evaluation counted.
    m_hat, u, v = _problem(16, 24, 12, scale_theta=0.2)
    other, _, _ = _problem(16, 24, 13, scale_theta=-0.2)
    wrong = _model(other[None], u[None], v[None])
    lam_ref, _, st_ref = spectral.solve_lambda(m_hat, u, v, _msign8, tol=1e-5, method="illinois", max_iterations=40)
    for steps in (1, 3):
        lam, phi, st = spectral.solve_lambda(m_hat, u, v, _msign8, tol=1e-5, method="illinois",
                                             model=wrong, model_steps=steps, max_iterations=40)
        assert bool(st.converged) and not bool(st.fallback)
        assert float(lam) == pytest.approx(float(lam_ref), abs=1e-5)
        assert abs(float(u @ phi @ v)) <= 1e-5
        assert int(st.iterations) >= 2


def test_model_solver_fixed_schedule_matches_early_exit_and_traces():
    a = _problem(12, 20, 8)  # λ* ≈ −0.14: the model finds it in one msign (the bracket from 0: 11)
    g = torch.Generator().manual_seed(9)
    _, u, v = spectral.top_singular(torch.randn(12, 20, generator=g))
    far = -0.99 * torch.outer(u, v) + 0.01 * torch.randn(12, 20, generator=g)
    b = (far / torch.linalg.matrix_norm(far), u, v)
    m_hat, U, V = (torch.stack([x, y]) for x, y in zip(a, b))
    kw = dict(tol=1e-4, max_expansions=8, max_iterations=6, method="illinois")  # row b: no root within ±0.255
    model = _model(m_hat, U, V)
    lam, phi, st = spectral.solve_lambda(m_hat, U, V, _msign8, model=model, **kw)
    assert st.converged.tolist() == [True, False] and st.fallback.tolist() == [False, True]
    lam_f, phi_f, st_f = spectral.solve_lambda(m_hat, U, V, _msign8, model=model, early_exit=False, **kw)
    torch.testing.assert_close(lam_f, lam, rtol=0, atol=1e-7)
    torch.testing.assert_close(phi_f, phi, rtol=0, atol=1e-6)
    assert torch.equal(st_f.iterations, st.iterations) and torch.equal(st_f.fallback, st.fallback)

    def solve(m, u, v):
        return spectral.solve_lambda(m, u, v, _msign8, model=_model(m, u, v), **kw)

    lam_c, phi_c, _ = torch.compile(solve, backend="eager", fullgraph=True)(m_hat, U, V)
    torch.testing.assert_close(lam_c, lam, rtol=0, atol=1e-7)
    torch.testing.assert_close(phi_c, phi, rtol=0, atol=1e-5)  # fp32 rounding: 1.0e-6 seen on a Zen 3


# ------------------------------------------------------------------------------ messages
class TestMessages(expecttest.TestCase):
    def _msg(self, fn):
        with self.assertRaises(ValueError) as cm:
            fn()
        return str(cm.exception)

    def test_validation_messages(self):
        W = torch.zeros(3, 4)
        u, v = torch.zeros(3), torch.zeros(4)
        self.assertExpectedInline(self._msg(lambda: spectral.power_iteration(W, -1)),
                                  """Invalid steps: -1 (expected an integer >= 0)""")
        self.assertExpectedInline(self._msg(lambda: spectral.subspace_iteration(W, 2, method="lanczos")),
                                  """Invalid method: 'lanczos' (valid: 'chebyshev', 'power')""")
        self.assertExpectedInline(self._msg(lambda: spectral.power_iteration(torch.zeros(3), 2)),
                                  """power_iteration expects a matrix or a batch of matrices, got shape (3,)""")
        self.assertExpectedInline(self._msg(lambda: spectral.power_iteration(W, 2, torch.ones(3))),
                                  """Invalid v0: shape (3,) does not match W's 4 columns""")
        self.assertExpectedInline(self._msg(lambda: spectral.solve_lambda(W, u, v, _msign8, method="newton")),
                                  """Invalid method: 'newton' (valid: 'bisection', 'illinois')""")
        self.assertExpectedInline(self._msg(lambda: spectral.solve_lambda(W, u, v, _msign8, tol=0.0)),
                                  """Invalid tol: 0.0 (expected a finite value > 0)""")
        self.assertExpectedInline(self._msg(lambda: spectral.solve_lambda(W, u, v, _msign8, max_expansions=-2)),
                                  """Invalid max_expansions: -2 (expected an integer >= 0)""")
        self.assertExpectedInline(self._msg(lambda: spectral.solve_lambda(W, u, v, _msign8, model_steps=0)),
                                  """Invalid model_steps: 0 (expected an integer >= 1)""")
        self.assertExpectedInline(
            self._msg(lambda: spectral.lambda_model(W[None], u[None], v[None], _FIT8, precision="fp16")),
            """Invalid precision: 'fp16' (valid: 'fp64', 'mixed', 'fp32')""")
        self.assertExpectedInline(self._msg(lambda: spectral.spectral_function_fit(())),
                                  """Invalid schedule: expected at least one (a, b, c) row""")
        self.assertExpectedInline(self._msg(lambda: spectral.target_radius((5,))),
                                  """target_radius expects a matrix shape, got (5,)""")


@pytest.mark.parametrize("dtype,uses_eigh_model", [(torch.float32, True), (torch.bfloat16, False)], ids=str)
def test_sso_skips_the_eigh_model_with_a_half_precision_msign(dtype, uses_eigh_model):
    """A bf16 msign costs less than the model's fp64 eigh, so non-Krylov batches bracket from
    last step's λ* instead; the certification by the real msign is the same either way."""
    import muon_fn

    g = torch.Generator().manual_seed(6)
    params = [torch.randn(48, 48, generator=g) / 7]
    tol = 2e-4 if dtype == torch.float32 else 5e-3
    tx = muon_fn.spectral_sphere(lr=0.02, msign_dtype=dtype, tol=tol)
    state = tx.init(params)
    calls = []
    original = spectral.lambda_model

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    spectral.lambda_model = counting
    try:
        for _ in range(3):
            grads = [torch.randn(p.shape, generator=g) for p in params]
            updates, state = tx.update(grads, state, params)
            params = muon_fn.apply_updates(params, updates)
            assert float(state.residual[0]) <= tol and not bool(state.fallback[0])
    finally:
        spectral.lambda_model = original
    assert bool(calls) == uses_eigh_model


@pytest.mark.parametrize("shape", [(24, 40), (40, 24)])
def test_msign_with_the_rank_two_gram_equals_the_plain_one(shape):
    """The solver may hand the msign XXᵀ formed from M̂M̂ᵀ by a rank-two update instead of a
    product: the same h and Φ to fp32 rounding, for wide and tall batches and any λ."""
    from muon_fn._newton_schulz import coefficient_schedule, orthogonalize_matrices

    schedule = coefficient_schedule("polar_express", 8)

    def msign(x, gram=None):
        return orthogonalize_matrices(x, schedule, dtype=torch.float32, eps=1e-7, norm_scale=1.01, gram=gram)

    rows = [_problem(*shape, seed, scale_theta=0.2) for seed in (1, 2)]
    m_hat, U, V = (torch.stack(x) for x in zip(*rows))
    wide = m_hat if shape[0] <= shape[1] else m_hat.mT
    gram = wide @ wide.mT
    for lam in (-0.3, 0.0, 0.004, 0.7):
        lam = torch.full((2,), lam)
        h, phi = spectral.tangent_residual(m_hat, U, V, lam, msign)
        h_g, phi_g = spectral.tangent_residual(m_hat, U, V, lam, msign, gram)
        torch.testing.assert_close(phi_g, phi, rtol=0, atol=2e-5)  # PE-8 amplifies fp32 rounding
        torch.testing.assert_close(h_g, h, rtol=0, atol=2e-5)
    lam, phi, st = spectral.solve_lambda(m_hat, U, V, msign, tol=1e-5, method="illinois", model=_model(m_hat, U, V),
                                         gram=gram)
    assert bool(st.converged.all()) and st.iterations.tolist() == [1, 1]
    torch.testing.assert_close(phi, spectral.tangent_residual(m_hat, U, V, lam, msign)[1], rtol=0, atol=2e-5)
