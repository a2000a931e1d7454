"""The λ model (``muon_fn.core.sso_lambda_model``) and the λ solver (``muon_fn.core.sso_lambda``) of SSO.

References are independent of the code under test: an SVD-based exact msign (``U Vᵀ``) for h(λ),
a plain bisection on the model for its root.
"""

from __future__ import annotations

import math

import expecttest
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from muon_fn import spectral
from muon_fn.core import sso_lambda as _lambda
from muon_fn.core import sso_lambda_model as _lambda_model
from muon_fn.core.newton_schulz import coefficient_schedule, newton_schulz, norm_scale


def _exact_msign(x: torch.Tensor) -> torch.Tensor:
    U, _, Vh = torch.linalg.svd(x.double(), full_matrices=False)
    return U @ Vh


def _msign8(x: torch.Tensor) -> torch.Tensor:
    return newton_schulz(x, "polar_express", 8, dtype=torch.float32)


# ------------------------------------------------------------------------------ λ solver
def _problem(m, n, seed, scale_theta=0.0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(m, n, generator=g) / math.sqrt(n)
    sigma, u, v = spectral.top_singular(W)
    M = torch.randn(m, n, generator=g) + scale_theta * torch.outer(u, v) * math.sqrt(m * n)
    return M / torch.linalg.matrix_norm(M), u, v


def _h_exact(m_hat, u, v, lam):
    return float(
        u.double() @ _exact_msign(m_hat.double() + lam * torch.outer(u, v).double()) @ v.double()
    )


_FIT8 = _lambda_model.spectral_function_fit(coefficient_schedule("polar_express", 8))


def _model(m_hat, u, v):
    """The λ model for ``_msign8`` (Polar Express normalizer 1.01·‖X‖_F + 1e-7)."""
    return _lambda_model.lambda_model(
        m_hat, u, v, _FIT8, norm_scale=norm_scale("polar_express"), eps=1e-7
    )


@pytest.mark.parametrize("method", ["bisection", "illinois", "model"])
@given(
    shape=st.tuples(st.integers(4, 24), st.integers(4, 24)),
    seed=st.integers(0, 2**16),
    pull=st.floats(-0.3, 0.3),
)
def test_solver_tangency_when_converged(method, shape, seed, pull):
    m_hat, u, v = _problem(*shape, seed, scale_theta=pull)
    tol = 1e-4
    model = _model(m_hat[None], u[None], v[None]) if method == "model" else None
    lam, phi, stats = _lambda.solve_lambda(
        m_hat,
        u,
        v,
        _msign8,
        tol=tol,
        method="illinois" if model else method,
        max_expansions=16,
        model=model,
    )
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
    lb, _, sb = _lambda.solve_lambda(
        m_hat, u, v, _msign8, tol=1e-5, method="bisection", max_iterations=40
    )
    li, _, si = _lambda.solve_lambda(
        m_hat, u, v, _msign8, tol=1e-5, method="illinois", max_iterations=40
    )
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
    lam, _, stats = _lambda.solve_lambda(m_hat, u, v, _msign8, tol=1e-4)
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
    lam, phi, stats = _lambda.solve_lambda(m_hat, u, v, _msign8, tol=1e-4, max_expansions=2)
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
    lam, phi, st = _lambda.solve_lambda(m_hat, U, V, _msign8, **kw)
    assert st.converged.tolist() == [True, False] and st.fallback.tolist() == [False, True]
    lam_f, phi_f, st_f = _lambda.solve_lambda(m_hat, U, V, _msign8, early_exit=False, **kw)
    torch.testing.assert_close(lam_f, lam, rtol=0, atol=1e-7)
    torch.testing.assert_close(phi_f, phi, rtol=0, atol=1e-6)
    assert torch.equal(st_f.iterations, st.iterations) and torch.equal(st_f.fallback, st.fallback)


@pytest.mark.slow
def test_solver_traces_as_one_graph():
    m_hat, u, v = _problem(8, 12, 10)
    batch = (m_hat[None], u[None], v[None])
    fn = torch.compile(
        lambda m, u, v: _lambda.solve_lambda(m, u, v, _msign8, max_expansions=3, max_iterations=3),
        backend="eager",
        fullgraph=True,
    )
    lam_c, phi_c, st_c = fn(*batch)
    lam_e, phi_e, st_e = _lambda.solve_lambda(*batch, _msign8, max_expansions=3, max_iterations=3)
    torch.testing.assert_close(lam_c, lam_e)
    torch.testing.assert_close(phi_c, phi_e)


@pytest.mark.parametrize("use_model", [False, True], ids=["no_model", "model"])
def test_zero_momentum_gives_lambda_zero_and_zero_direction(use_model):
    _, u, v = _problem(6, 9, 11)
    z = torch.zeros(6, 9)
    model = _model(z[None], u[None], v[None]) if use_model else None
    lam, phi, stats = _lambda.solve_lambda(z, u, v, _msign8, model=model)
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
            model = _lambda_model.lambda_model(
                m_hat[None],
                u[None],
                v[None],
                _FIT8,
                norm_scale=norm_scale("polar_express"),
                eps=1e-7,
                precision=precision,
            )
            lams = torch.tensor([-0.1, -0.01, 0.0, 0.003, 0.05])
            for lam in lams:
                h, _ = _lambda.tangent_residual(m_hat, u, v, lam, _msign8)
                h_model = _lambda_model.model_residual(model, lam.reshape(1))[0]
                worst = max(worst, abs(float(h_model) - float(h)))
    assert worst <= 1e-4  # measured ≤ 4.3e-5 (fp32 msign vs the model of its exact-arithmetic map)


def test_model_root_is_the_msign_root_and_costs_one_msign():
    rows = [_problem(24, 40, s, scale_theta=p) for s, p in ((1, 0.0), (2, 0.2), (3, -0.2))]
    m_hat, U, V = (torch.stack(x) for x in zip(*rows))
    lam_c, phi_c, st_c = _lambda.solve_lambda(
        m_hat, U, V, _msign8, tol=1e-5, method="illinois", max_iterations=40
    )
    model = _model(m_hat, U, V)
    lam_m, phi_m, st_m = _lambda.solve_lambda(
        m_hat, U, V, _msign8, tol=1e-5, method="illinois", model=model
    )
    assert bool(st_c.converged.all()) and bool(st_m.converged.all())
    torch.testing.assert_close(lam_m, lam_c, rtol=0, atol=1e-5)
    assert st_m.iterations.tolist() == [1, 1, 1] and bool((st_c.iterations >= 3).all())
    # Φ is the msign at the returned λ (no extra call), and certifies the tangency.
    torch.testing.assert_close(
        phi_m, _lambda.tangent_residual(m_hat, U, V, lam_m, _msign8)[1], rtol=0, atol=0
    )
    assert float((U[:, None, :] @ phi_m @ V[:, :, None]).abs().max()) <= 1e-5


def _bisect_model(model, offset, reach, steps=80):
    """A plain bisection on the model: the reference for model_root."""
    lo = torch.full_like(offset, -reach)
    hi = -lo
    for _ in range(steps):
        mid = 0.5 * (lo + hi)
        up = _lambda_model.model_residual(model, mid) + offset < 0
        lo, hi = torch.where(up, mid, lo), torch.where(up, hi, mid)
    return 0.5 * (lo + hi)


@given(
    shape=st.sampled_from([(8, 8), (16, 16), (12, 30), (30, 12), (33, 33)]),
    seed=st.integers(0, 2**16),
    pull=st.floats(-0.5, 0.5),
    offset=st.floats(-0.3, 0.3),
)
@example(shape=(8, 8), seed=763, pull=0.5, offset=-0.25)
def test_model_root_matches_bisection_in_few_evaluations(shape, seed, pull, offset):
    """Illinois false position with a bisection guard: the bisection's root to fp32 resolution,
    in a handful of model evaluations; rows without a sign change are reported, not solved."""
    rows = [_problem(*shape, seed + k, scale_theta=pull * (k - 1)) for k in range(3)]
    m_hat, U, V = (torch.stack(x) for x in zip(*rows))
    model = _model(m_hat, U, V)
    off = torch.tensor([offset, 0.0, 5.0], dtype=torch.float64)  # |h| ≤ 1: row 2 has no root
    calls = []
    residual = _lambda_model.model_residual
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            _lambda_model, "model_residual", lambda mo, lam: calls.append(1) or residual(mo, lam)
        )
        lam, ok = _lambda_model.model_root(model, off, 1.023)
    ref = _bisect_model(model, off, 1.023)
    assert ok.tolist()[2] is False
    h = residual(model, lam.double()) + off
    # fp32 resolution: |h| ≤ 1e-5, or h changes sign within one fp32 step either side of the
    # root (a steep residual: seed 763 of (8, 8) has h = -1.8e-5 at the root and +4.6e-5 one
    # step up)
    h_up = residual(model, torch.nextafter(lam, torch.full_like(lam, torch.inf)).double()) + off
    h_dn = residual(model, torch.nextafter(lam, torch.full_like(lam, -torch.inf)).double()) + off
    for i in (0, 1):
        if bool(ok[i]):
            assert abs(float(lam[i]) - float(ref[i])) <= 1e-6 * max(1.0, abs(float(ref[i])))
            assert abs(float(h[i])) <= 1e-5 or float(h_up[i]) * float(h_dn[i]) <= 0
    assert (
        len(calls) <= 30
    )  # 2 ends + the steps: measured ≈ 12 on gpt2-small gradients (50 for bisection)


@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (16, 16), (33, 33)])
def test_model_direction_is_the_msign_at_the_model_root(shape):
    worst_phi = worst_h = 0.0
    for seed in range(6):
        m_hat, u, v = _problem(*shape, seed, scale_theta=0.2 if seed % 2 else 0.0)
        # Φ needs the fp64 model (SSO's direction="spectral" uses it): "mixed" leaves the fp32
        # Gram's rounding in the eigenvectors of the larger eigenvalues, which Φ sees directly.
        model = _lambda_model.lambda_model(
            m_hat[None],
            u[None],
            v[None],
            _FIT8,
            norm_scale=norm_scale("polar_express"),
            precision="fp64",
        )
        lam, ok = _lambda_model.model_root(model, torch.zeros(1, dtype=torch.float64), 1.023)
        assert bool(ok)
        phi = _lambda_model.model_direction(model, m_hat[None], u[None], v[None], lam)[0]
        _, phi_ns = _lambda.tangent_residual(m_hat, u, v, lam[0], _msign8)
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
    krylov = _lambda_model.krylov_lambda_model(m_hat, U, V, _FIT8, **kw)
    full = _lambda_model.lambda_model(m_hat, U, V, _FIT8, precision="fp64", **kw)
    assert krylov is not None and krylov.Q is None and krylov.tall == (shape[0] > shape[1])
    assert krylov.eig.shape[-1] < min(shape) // 4  # a small projected problem, not m eigenpairs
    for lam in (-0.05, -0.003, 0.0, 0.002, 0.04):
        at = torch.full((2,), lam, dtype=torch.float64)
        diff = (
            (_lambda_model.model_residual(krylov, at) - _lambda_model.model_residual(full, at))
            .abs()
            .max()
        )
        assert float(diff) <= 1e-5  # measured ≤ 2e-7
    zero = torch.zeros(2, dtype=torch.float64)
    (r_k, ok_k), (r_f, ok_f) = (
        _lambda_model.model_root(krylov, zero, 1.023),
        _lambda_model.model_root(full, zero, 1.023),
    )
    assert bool(ok_k.all() and ok_f.all())
    torch.testing.assert_close(r_k, r_f, rtol=0, atol=1e-6)


def test_krylov_model_declines_where_it_would_not_pay_or_converge():
    kw = dict(norm_scale=norm_scale("polar_express"), eps=1e-7)
    for shape in ((300, 300), (256, 500), (128, 1024)):  # square, aspect < 2, too few rows
        m_hat, u, v = _low_rank_plus_noise(*shape, 0)
        assert _lambda_model.krylov_lambda_model(m_hat[None], u[None], v[None], _FIT8, **kw) is None
    # A rank-1 M̂: the Krylov space is invariant after one step (breakdown).
    m_hat, u, v = _low_rank_plus_noise(256, 640, 3, rank=1, noise=0.0)
    assert _lambda_model.krylov_lambda_model(m_hat[None], u[None], v[None], _FIT8, **kw) is None


def test_sso_on_rectangular_matrices_uses_one_msign_with_the_krylov_model():
    """The transform picks the Krylov model for a 256×640 weight (and its transpose); the solver
    still certifies every λ with one msign per matrix and step."""
    import muon_fn

    g = torch.Generator().manual_seed(4)
    params = [torch.randn(256, 640, generator=g) / 25, torch.randn(640, 256, generator=g) / 25]
    tx = muon_fn.spectral_sphere(lr=0.02)
    state = tx.init(params)
    calls = []
    original = _lambda_model.krylov_lambda_model

    def counting(*args, **kwargs):
        model = original(*args, **kwargs)
        calls.append(model is not None)
        return model

    _lambda_model.krylov_lambda_model = counting
    try:
        for _ in range(3):
            grads = [torch.randn(p.shape, generator=g) + 3 * p for p in params]
            updates, state = tx.update(grads, state, params)
            params = muon_fn.apply_updates(params, updates)
            assert [int(i) for i in state.iterations] == [1, 1]
            assert max(float(r) for r in state.residual) <= 2e-4
    finally:
        _lambda_model.krylov_lambda_model = original
    assert calls and all(calls)


def test_model_steps_then_bracket_when_the_model_is_off():
    # A model of a different matrix is a bad guide: the solver must still converge to the right
    # root (secant steps, then the bracket), with every evaluation counted.
    m_hat, u, v = _problem(16, 24, 12, scale_theta=0.2)
    other, _, _ = _problem(16, 24, 13, scale_theta=-0.2)
    wrong = _model(other[None], u[None], v[None])
    lam_ref, _, st_ref = _lambda.solve_lambda(
        m_hat, u, v, _msign8, tol=1e-5, method="illinois", max_iterations=40
    )
    for steps in (1, 3):
        lam, phi, st = _lambda.solve_lambda(
            m_hat,
            u,
            v,
            _msign8,
            tol=1e-5,
            method="illinois",
            model=wrong,
            model_steps=steps,
            max_iterations=40,
        )
        assert bool(st.converged) and not bool(st.fallback)
        assert float(lam) == pytest.approx(float(lam_ref), abs=1e-5)
        assert abs(float(u @ phi @ v)) <= 1e-5
        assert int(st.iterations) >= 2


@pytest.mark.slow
def test_model_solver_fixed_schedule_matches_early_exit_and_traces():
    a = _problem(12, 20, 8)  # λ* ≈ −0.14: the model finds it in one msign (the bracket from 0: 11)
    g = torch.Generator().manual_seed(9)
    _, u, v = spectral.top_singular(torch.randn(12, 20, generator=g))
    far = -0.99 * torch.outer(u, v) + 0.01 * torch.randn(12, 20, generator=g)
    b = (far / torch.linalg.matrix_norm(far), u, v)
    m_hat, U, V = (torch.stack([x, y]) for x, y in zip(a, b))
    # Short caps keep the traced (unrolled) search small; the bracket reaches ±0.35: row b has no root there.
    kw = dict(
        tol=1e-4,
        bracket_step=0.05,
        max_expansions=3,
        max_iterations=2,
        model_steps=2,
        method="illinois",
    )
    model = _model(m_hat, U, V)
    lam, phi, st = _lambda.solve_lambda(m_hat, U, V, _msign8, model=model, **kw)
    assert st.converged.tolist() == [True, False] and st.fallback.tolist() == [False, True]
    lam_f, phi_f, st_f = _lambda.solve_lambda(
        m_hat, U, V, _msign8, model=model, early_exit=False, **kw
    )
    torch.testing.assert_close(lam_f, lam, rtol=0, atol=1e-7)
    torch.testing.assert_close(phi_f, phi, rtol=0, atol=1e-6)
    assert torch.equal(st_f.iterations, st.iterations) and torch.equal(st_f.fallback, st.fallback)

    def solve(m, u, v):
        model = _lambda_model.lambda_model(
            m, u, v, _FIT8, norm_scale=norm_scale("polar_express"), precision="fp64"
        )
        return _lambda.solve_lambda(m, u, v, _msign8, model=model, **kw)

    compiled = torch.compile(solve, backend="eager", fullgraph=True)
    (lam_c, phi_c, _), gemms_c = _gemms(lambda: compiled(m_hat, U, V))
    torch.testing.assert_close(lam_c, lam, rtol=0, atol=1e-7)
    torch.testing.assert_close(
        phi_c, phi, rtol=0, atol=1e-5
    )  # fp32 rounding: 1.0e-6 seen on a Zen 3
    assert (
        gemms_c > _gemms(lambda: solve(m_hat, U, V))[1]
    )  # row b: the fixed search ran, eager stopped early
    # Compiled, the search after the first evaluation sits behind torch.cond: when every matrix
    # converged there (the λ model's usual case), the step runs exactly the eager step's GEMMs.
    both = tuple(torch.stack([x, x]) for x in a)
    (_, _, st_c), gemms_c = _gemms(lambda: compiled(*both))
    (_, _, st_e), gemms_e = _gemms(lambda: solve(*both))
    assert st_c.iterations.tolist() == st_e.iterations.tolist() == [1, 1] and gemms_c == gemms_e


def _gemms(fn):
    """``fn()`` and the number of GEMM calls it ran (profiler events: they include compiled code)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn()
    return out, sum(
        e.name in ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm") for e in prof.events()
    )


# ------------------------------------------------------------------------------ messages
class TestMessages(expecttest.TestCase):
    def _msg(self, fn):
        with self.assertRaises(ValueError) as cm:
            fn()
        return str(cm.exception)

    def test_validation_messages(self):
        W = torch.zeros(3, 4)
        u, v = torch.zeros(3), torch.zeros(4)
        self.assertExpectedInline(
            self._msg(lambda: _lambda.solve_lambda(W, u, v, _msign8, method="newton")),
            """Invalid method: 'newton' (valid: 'bisection', 'illinois')""",
        )
        self.assertExpectedInline(
            self._msg(lambda: _lambda.solve_lambda(W, u, v, _msign8, tol=0.0)),
            """Invalid tol: 0.0 (expected a finite value > 0)""",
        )
        self.assertExpectedInline(
            self._msg(lambda: _lambda.solve_lambda(W, u, v, _msign8, max_expansions=-2)),
            """Invalid max_expansions: -2 (expected an integer >= 0)""",
        )
        self.assertExpectedInline(
            self._msg(lambda: _lambda.solve_lambda(W, u, v, _msign8, model_steps=0)),
            """Invalid model_steps: 0 (expected an integer >= 1)""",
        )
        self.assertExpectedInline(
            self._msg(
                lambda: _lambda_model.lambda_model(
                    W[None], u[None], v[None], _FIT8, precision="fp16"
                )
            ),
            """Invalid precision: 'fp16' (valid: 'fp64', 'mixed', 'fp32')""",
        )
        self.assertExpectedInline(
            self._msg(lambda: _lambda_model.spectral_function_fit(())),
            """Invalid schedule: expected at least one (a, b, c) row""",
        )


@pytest.mark.parametrize(
    "dtype,uses_eigh_model", [(torch.float32, True), (torch.bfloat16, False)], ids=str
)
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
    original = _lambda_model.lambda_model

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    _lambda_model.lambda_model = counting
    try:
        for _ in range(3):
            grads = [torch.randn(p.shape, generator=g) for p in params]
            updates, state = tx.update(grads, state, params)
            params = muon_fn.apply_updates(params, updates)
            assert float(state.residual[0]) <= tol and not bool(state.fallback[0])
    finally:
        _lambda_model.lambda_model = original
    assert bool(calls) == uses_eigh_model


@pytest.mark.parametrize("shape", [(24, 40), (40, 24)])
def test_msign_with_the_rank_two_gram_equals_the_plain_one(shape):
    """The solver may hand the msign XXᵀ formed from M̂M̂ᵀ by a rank-two update instead of a
    product: the same h and Φ to fp32 rounding, for wide and tall batches and any λ."""
    from muon_fn.core.newton_schulz import coefficient_schedule, orthogonalize_matrices

    schedule = coefficient_schedule("polar_express", 8)

    def msign(x, gram=None):
        return orthogonalize_matrices(
            x, schedule, dtype=torch.float32, eps=1e-7, norm_scale=1.01, gram=gram
        )

    rows = [_problem(*shape, seed, scale_theta=0.2) for seed in (1, 2)]
    m_hat, U, V = (torch.stack(x) for x in zip(*rows))
    wide = m_hat if shape[0] <= shape[1] else m_hat.mT
    gram = wide @ wide.mT
    for lam in (-0.3, 0.0, 0.004, 0.7):
        lam = torch.full((2,), lam)
        h, phi = _lambda.tangent_residual(m_hat, U, V, lam, msign)
        h_g, phi_g = _lambda.tangent_residual(m_hat, U, V, lam, msign, gram)
        torch.testing.assert_close(phi_g, phi, rtol=0, atol=2e-5)  # PE-8 amplifies fp32 rounding
        torch.testing.assert_close(h_g, h, rtol=0, atol=2e-5)
    lam, phi, st = _lambda.solve_lambda(
        m_hat, U, V, msign, tol=1e-5, method="illinois", model=_model(m_hat, U, V), gram=gram
    )
    assert bool(st.converged.all()) and st.iterations.tolist() == [1, 1]
    torch.testing.assert_close(
        phi, _lambda.tangent_residual(m_hat, U, V, lam, msign)[1], rtol=0, atol=2e-5
    )
