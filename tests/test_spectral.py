"""muon_fn.spectral: power and block iteration, spectral norm, radius, retraction, and the
batch-invariant products.

References are independent of the code under test: ``torch.linalg.matrix_norm(ord=2)`` / the SVD
for σ and singular vectors.

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

from muon_fn.core import spectral  # the public muon_fn.spectral's home, its helpers too


def _with_spectrum(m: int, n: int, s: torch.Tensor, seed: int) -> torch.Tensor:
    """A random m×n matrix with singular values ``s`` (length min(m, n)), in fp64."""
    g = torch.Generator().manual_seed(seed)
    k = min(m, n)
    U, _ = torch.linalg.qr(torch.randn(m, k, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(n, k, generator=g, dtype=torch.float64))
    return U @ torch.diag(s.double()) @ V.T


shapes = st.tuples(st.integers(2, 40), st.integers(2, 40))


# ------------------------------------------------------------------------------ power iteration
@given(
    shape=shapes,
    gap=st.floats(0.05, 0.8),
    cond=st.floats(1.0, 1e4),
    scale=st.floats(1e-3, 1e3),
    seed=st.integers(0, 2**16),
)
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
    torch.testing.assert_close(
        spectral.compute_spectral_norm(W).double(), expected, rtol=2e-5, atol=0
    )


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
    s = torch.cat(
        [torch.linspace(1.0, top, 9)[:-1], top * torch.linspace(1.0, 0.05, min(m, n) - 8)]
    )
    W = (_with_spectrum(m, n, s, seed) * scale).float()
    g = torch.Generator().manual_seed(seed)
    near = W + 0.01 * scale * torch.randn(m, n, generator=g) / math.sqrt(n)
    return W, spectral.subspace_iteration(near, 3, block=4, method="power")[3]


@given(
    shape=st.sampled_from([(48, 48), (40, 96), (96, 40)]),
    top=st.floats(0.9, 0.99),
    seed=st.integers(0, 2**16),
    scale=st.floats(1e-2, 1e2),
)
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
    power, cheb = (
        1 - float(spectral.subspace_iteration(W, 4, V0, method=m)[0])
        for m in ("power", "chebyshev")
    )
    assert cheb <= 0.25 * power  # measured 4.1e-3 vs 2.5e-2


def test_block_iteration_handles_zero_and_low_rank_matrices():
    for method in spectral.SUBSPACE_METHODS:
        sigma, u, v, V = spectral.subspace_iteration(
            torch.zeros(2, 6, 5), 5, block=3, method=method
        )
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


def test_empty_matrices():
    assert spectral.default_start_block(5, 0).shape == (5, 0)
    assert spectral.default_start_block(0, 0).shape == (0, 0)
    assert spectral.target_radius((0, 5)) == 0.0 and spectral.target_radius((4, 0, 3)) == 0.0


@pytest.mark.parametrize("shape", [(48, 48), (16, 24), (24, 1), (1, 24)])
def test_products_and_block_iteration_are_batch_invariant(shape):
    """A matrix's result does not depend on its batch: a batch of one runs the same kernels as a
    larger one (a one-matrix batch of ``@`` with one output column would run a GEMV)."""
    g = torch.Generator().manual_seed(sum(shape))
    W = torch.randn(4, *shape, generator=g)
    x, y = torch.randn(4, shape[1], generator=g), torch.randn(4, shape[0], generator=g)
    V0 = torch.randn(4, shape[1], min(3, *shape), generator=g)
    full = (
        spectral.matvec(W, x),
        spectral.bilinear(y, W, x),
        spectral.matmul(W, x[..., None]),
        *spectral.subspace_iteration(W, 3, V0),
    )
    for rows in ([0], [2, 0], [1, 2, 3]):
        part = (
            spectral.matvec(W[rows], x[rows]),
            spectral.bilinear(y[rows], W[rows], x[rows]),
            spectral.matmul(W[rows], x[rows, :, None]),
            *spectral.subspace_iteration(W[rows], 3, V0[rows]),
        )
        for a, b in zip(part, full):
            assert torch.equal(a, b[rows])


# ------------------------------------------------------------------------------ messages
class TestMessages(expecttest.TestCase):
    def _msg(self, fn):
        with self.assertRaises(ValueError) as cm:
            fn()
        return str(cm.exception)

    def test_validation_messages(self):
        W = torch.zeros(3, 4)
        self.assertExpectedInline(
            self._msg(lambda: spectral.power_iteration(W, -1)),
            """Invalid steps: -1 (expected an integer >= 0)""",
        )
        self.assertExpectedInline(
            self._msg(lambda: spectral.subspace_iteration(W, 2, method="lanczos")),
            """Invalid method: 'lanczos' (valid: 'chebyshev', 'power')""",
        )
        self.assertExpectedInline(
            self._msg(lambda: spectral.power_iteration(torch.zeros(3), 2)),
            """power_iteration expects a matrix or a batch of matrices, got shape (3,)""",
        )
        self.assertExpectedInline(
            self._msg(lambda: spectral.power_iteration(W, 2, torch.ones(3))),
            """Invalid v0: shape (3,) does not match W's 4 columns""",
        )
        self.assertExpectedInline(
            self._msg(lambda: spectral.target_radius((5,))),
            """target_radius expects a matrix shape, got (5,)""",
        )


@pytest.mark.parametrize("shape", [(1, 5), (5, 1), (1, 1), (3, 1, 5)])
def test_meta_shapes_of_one_row_or_column_matrices(shape):
    """Construction traces run on meta tensors: there the helpers give the shapes they give on
    real tensors, also for a matrix with one row or one column (a value head's (1, d) weight);
    torch 2.10–2.11's meta ``vector_norm`` kept a reduced dim of size 1."""
    real = torch.randn(shape)
    meta = real.to("meta")
    for fn in (
        lambda w: spectral.top_singular(w, squarings=3),
        lambda w: spectral.subspace_iteration(w, 3, block=min(w.shape[-2:])),
        spectral.compute_spectral_norm,
    ):
        out_real, out_meta = fn(real), fn(meta)
        out_real = out_real if isinstance(out_real, tuple) else (out_real,)
        out_meta = out_meta if isinstance(out_meta, tuple) else (out_meta,)
        assert [t.shape for t in out_meta] == [t.shape for t in out_real]
