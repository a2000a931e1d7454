"""Spectral utilities: top singular pair, spectral norm, the SSO λ solver and the sphere retraction.

Pure tensor functions over a matrix ``(m, n)`` or a batch ``(B, m, n)``; fp32 math. Used by the
Spectral Sphere Optimizer (:func:`muon_fn.spectral_sphere`, notes/algorithms.md §1) and usable on
their own for monitoring (``compute_spectral_norm``).

The λ solver finds the root of ``h(λ) = ⟨Θ, msign(M̂ + λΘ)⟩ = uᵀ msign(M̂ + λ u vᵀ) v``, which is
non-decreasing in λ. It brackets the root by expansion from a start point, then bisects (or uses the
Illinois false-position rule) until ``|h| ≤ tol`` or an iteration cap. If no sign change is found,
λ = 0 (a plain Muon direction) and the fallback is reported.

**The λ model** (:func:`lambda_model`, used by SSO by default). The msign is a spectral function:
``msign(X) = φ(XXᵀ)·X`` with ``φ`` fixed by the iteration's polynomials. With one eigendecomposition
``M̂(I − vvᵀ)M̂ᵀ = Q diag(ℓ) Qᵀ`` (the Gram matrix of the smaller side, ``m³`` work, no msign),
``X_λXᵀ_λ = Q(diag(ℓ) + w wᵀ)Qᵀ`` with ``w = Qᵀ(M̂v + λu)`` for every λ, and with φ fitted as a
sum of resolvents ``Σ_k c_k/(μ + d_k)`` (:func:`spectral_function_fit`), Sherman–Morrison gives

    h(λ) = Σ_k c_k·φ_a,k / (1 + φ_w,k),   φ_a,k = Σ_i a_i w_i/(ℓ_i + d_k),  φ_w,k = Σ_i w_i²/(ℓ_i + d_k)

(``a = Qᵀu``) in ``O(m·K)`` per λ instead of one msign. Its root is where the solver evaluates the
real msign first; if ``|h|`` there is above tol, the next point is the root of the model shifted
by the observed error (a secant step with the model's slope). The model only chooses where h is
evaluated: every accepted λ is certified by a real msign, and Φ is that msign. For clearly
rectangular batches :func:`krylov_lambda_model` builds the same model from a block Lanczos
projection instead of the ``m³`` eigendecomposition.

torch.compile: nothing here calls ``.item()`` on the fixed-iteration path. The solver has two modes:
``early_exit=True`` (the eager default) stops when every matrix of the batch converged and evaluates
only the unconverged ones, which costs one host sync per iteration; ``early_exit=False`` (forced
while compiling) runs the full fixed number of evaluations with ``torch.where`` and no sync, so it
traces as one graph; while compiling, that search is skipped by ``torch.cond`` when every matrix
converged at the first evaluation (the λ model's usual case).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch

from . import _checks
from ._newton_schulz import gram_matrix

__all__ = [
    "LambdaModel",
    "SolverStats",
    "compute_spectral_norm",
    "default_start_block",
    "default_start_vector",
    "krylov_lambda_model",
    "lambda_model",
    "model_direction",
    "model_residual",
    "model_root",
    "power_iteration",
    "retract",
    "solve_lambda",
    "spectral_function_fit",
    "subspace_iteration",
    "tangent_residual",
    "target_radius",
    "top_singular",
]

SOLVER_METHODS = ("bisection", "illinois")
_TINY = 1e-30  # below this a vector norm counts as zero


class SolverStats(NamedTuple):
    """Per-matrix statistics of :func:`solve_lambda` (each of shape ``(B,)``, or ``()`` unbatched)."""

    iterations: torch.Tensor  # int32: h evaluations (= msign calls), the first one included
    residual: torch.Tensor  # fp32: |h(λ)| at the returned λ
    converged: torch.Tensor  # bool: residual <= tol
    fallback: torch.Tensor  # bool: no sign change found, λ set to 0


def target_radius(shape: tuple[int, ...] | torch.Size, radius_scale: float = 1.0) -> float:
    """The spectral-µP radius ``R = c·√(out/in)`` of a weight, ``in`` = product of the other dims."""
    if len(shape) < 2:
        raise ValueError(f"target_radius expects a matrix shape, got {tuple(shape)}")
    out, fan_in = int(shape[0]), math.prod([int(s) for s in shape[1:]])
    return float(radius_scale) * math.sqrt(out / fan_in)


def default_start_vector(n: int, *, device=None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A fixed, dense, unit start vector of length ``n`` (deterministic; traceable by Dynamo).

    All-ones (the reference code's choice) is orthogonal to the top singular vector of any matrix
    whose rows sum to zero; this hash-based vector has no such structure.
    """
    j = torch.arange(n, device=device, dtype=torch.float64)
    x = torch.frac(torch.sin(j * 12.9898 + 78.233) * 43758.5453) - 0.5
    x = x + 1e-3  # never exactly zero
    return (x / torch.linalg.vector_norm(x)).to(dtype)


def _normalize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    return x / norm.clamp_min(_TINY), norm.squeeze(-1)


def power_iteration(
    W: torch.Tensor, steps: int, v0: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top singular triple ``(σ, u, v)`` of ``W`` by ``steps`` rounds of ``v ← normalize(Wᵀ W v)``.

    Args:
      W: a matrix ``(m, n)`` or a batch ``(..., m, n)``; computed in fp32.
      steps: power-iteration rounds (>= 0; 0 only evaluates ``σ = ‖W v0‖``).
      v0: start vector ``(n,)`` or ``(..., n)`` (e.g. the previous step's ``v``: a warm start).
        ``None``, or a zero vector, uses :func:`default_start_vector` (a cold start).

    Returns:
      ``σ`` of shape ``(...)`` (a lower bound on ‖W‖₂ that converges to it), unit ``u`` ``(..., m)``
      and unit ``v`` ``(..., n)`` with ``W v = σ u``. A zero ``W`` gives ``σ = 0``, ``u = 0``.
    """
    if W.ndim < 2:
        raise ValueError(f"power_iteration expects a matrix or a batch of matrices, got shape {tuple(W.shape)}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"Invalid steps: {steps!r} (expected an integer >= 0)")
    W = W.float()
    n = W.shape[-1]
    cold = default_start_vector(n, device=W.device).expand(W.shape[:-2] + (n,))
    if v0 is None:
        v = cold
    else:
        if v0.shape[-1] != n:
            raise ValueError(f"Invalid v0: shape {tuple(v0.shape)} does not match W's {n} columns")
        v, norm = _normalize(v0.float().expand(W.shape[:-2] + (n,)))
        v = torch.where((norm > _TINY).unsqueeze(-1), v, cold)
    Wt = W.mT
    for _ in range(steps):
        v, _ = _normalize((Wt @ (W @ v.unsqueeze(-1))).squeeze(-1))
    u, sigma = _normalize((W @ v.unsqueeze(-1)).squeeze(-1))
    return sigma, u, v


def default_start_block(n: int, k: int, *, device=None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A fixed orthonormal ``(n, k)`` block; its first column is :func:`default_start_vector`."""
    j = torch.arange(n * k, device=device, dtype=torch.float64).reshape(k, n).mT
    x = torch.frac(torch.sin(j * 12.9898 + 78.233 + 3.7 * torch.arange(k, device=device)) * 43758.5453) - 0.5
    x[:, 0] = default_start_vector(n, device=device, dtype=torch.float64)
    return torch.linalg.qr(x)[0].to(dtype)


SUBSPACE_METHODS = ("chebyshev", "power")


def subspace_iteration(
    W: torch.Tensor, steps: int, V0: torch.Tensor | None = None, *, block: int = 8, method: str = "chebyshev"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top singular triple by block iteration on ``k`` vectors with a Rayleigh–Ritz step.

    ``steps`` products with ``WᵀW`` (two thin GEMMs each) on an orthonormal block, then the top
    singular pair of ``W V`` (a ``k × k`` eigenproblem). A warm-started block keeps tracking the top
    when the leading singular values cross — which SSO makes common: tangent steps leave σ₁ alone
    and raise the others, so the top of the spectrum flattens (σ₁₇/σ₁ ≈ 0.95–0.98 after 15 noisy
    steps, measured).

    ``method``:

    - ``"chebyshev"`` (default): the block gets the degree-``steps`` Chebyshev polynomial of
      ``WᵀW`` that is bounded by 1 on ``[0, b]``, ``b`` = the smallest Ritz value of the start
      block (≤ σ_k² by interlacing), so everything below ``b`` is damped and everything above
      grows like ``T_steps``: far more separation than ``(WᵀW)^steps`` on a flat top. The
      three-term recurrence runs on column-normalized blocks and ends with one QR. Warm-started
      inside SSO (15 steps, pure-noise gradients, 768² / 768×3072), max |σ/σ₁ − 1| over steps
      3–15: 5 steps 1.3e-6 / 5.4e-6, 8 steps 2.2e-7 / 5.1e-7, against 1.8e-5 / 5.3e-5 for 8
      power steps.
    - ``"power"``: ``V ← qr(WᵀW V)`` per step, rate ``(σ_{k+1}/σ₁)²``.

    Args:
      W: ``(m, n)`` or ``(..., m, n)``; fp32 math.
      steps: products with ``WᵀW`` (>= 0).
      V0: start block ``(..., n, k)`` (last step's block: a warm start); ``None``: a fixed block of
        ``min(block, m, n)`` columns.
      block: ``k`` when ``V0`` is None.
      method: ``"chebyshev"`` or ``"power"``.

    Returns:
      ``(σ, u, v, V)``: the Ritz estimate of σ₁ (a lower bound), unit ``u``, ``v`` with
      ``W v = σ u``, and the orthonormal block ``V`` ``(..., n, k)`` for the next warm start.
    """
    if W.ndim < 2:
        raise ValueError(f"subspace_iteration expects a matrix or a batch of matrices, got shape {tuple(W.shape)}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"Invalid steps: {steps!r} (expected an integer >= 0)")
    _checks.one_of("method", method, SUBSPACE_METHODS)
    W = W.float()
    m, n = W.shape[-2:]
    if V0 is None:
        _checks.positive_int("block", block)
        V0 = default_start_block(n, min(block, m, n), device=W.device)
    elif V0.shape[-2] != n:
        raise ValueError(f"Invalid V0: shape {tuple(V0.shape)} does not match W's {n} columns")
    V = torch.linalg.qr(V0.float().expand(W.shape[:-2] + V0.shape[-2:]))[0]
    if method == "power":
        for _ in range(steps):
            V = torch.linalg.qr(W.mT @ (W @ V))[0]
    elif steps > 0:
        # Chebyshev on [0, b]: x ↦ (x − c)/half maps it to [−1, 1] (centre c = half-width = b/2);
        # T_{j+1}(t) = 2t·T_j(t) − T_{j−1}(t).
        Y = W @ V
        ritz = torch.linalg.eigvalsh(Y.mT @ Y)  # ascending, (..., k)
        b = torch.maximum(ritz[..., :1], ritz[..., -1:] * 1e-6).clamp_min(_TINY)[..., None]  # (..., 1, 1)
        c = half = 0.5 * b
        prev, cur = V, (W.mT @ Y - c * V) / half
        for _ in range(steps - 1):
            # Unit columns against overflow; the previous block gets the same diagonal scaling,
            # which leaves the polynomial unchanged: p(A)(V D) = p(A)V D.
            d = torch.linalg.vector_norm(cur, dim=-2, keepdim=True).clamp_min(_TINY)  # (..., 1, k)
            prev, cur = cur / d, prev / d
            cur = 2 * (W.mT @ (W @ prev) - c * prev) / half - cur
        V = torch.linalg.qr(cur)[0]
    Y = W @ V
    evals, E = torch.linalg.eigh(Y.mT @ Y)
    e = E[..., -1:]  # top Ritz vector, (..., k, 1)
    sigma = evals[..., -1].clamp_min(0).sqrt()
    v = (V @ e).squeeze(-1)
    u = (Y @ e).squeeze(-1) / sigma.clamp_min(_TINY)[..., None]
    return sigma, u, v, V


def top_singular(W: torch.Tensor, *, squarings: int = 14) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Accurate top singular triple ``(σ, u, v)`` of a matrix or batch, without an SVD.

    Power iteration with exponent ``2^squarings`` on the smaller Gram matrix ``G`` (``WWᵀ`` or
    ``WᵀW``): ``G`` is squared ``squarings`` times (Frobenius-normalized each time), the column of
    largest norm gives the top eigenvector, one polishing step and a Rayleigh quotient give σ.
    Contamination by the second singular direction decays like ``(σ₂/σ₁)^(2^(squarings+1))``, so a
    near-degenerate top (σ₂/σ₁ = 0.997, random 768×3072 weights) still converges, where plain power
    iteration needs thousands of steps. Matmuls only (batches, compiles); costs ``squarings``
    products of size min(m, n)³, so use :func:`power_iteration` with a warm start in hot loops.
    """
    if W.ndim < 2:
        raise ValueError(f"top_singular expects a matrix or a batch of matrices, got shape {tuple(W.shape)}")
    if isinstance(squarings, bool) or not isinstance(squarings, int) or squarings < 0:
        raise ValueError(f"Invalid squarings: {squarings!r} (expected an integer >= 0)")
    W = W.float()
    wide = W.shape[-2] <= W.shape[-1]
    G = W @ W.mT if wide else W.mT @ W
    P = G
    for _ in range(squarings):
        P = P / torch.linalg.matrix_norm(P, keepdim=True).clamp_min(_TINY)
        P = P @ P
    col_norms = torch.linalg.vector_norm(P, dim=-2)  # (..., k)
    idx = col_norms.argmax(dim=-1, keepdim=True)  # (..., 1)
    x = torch.gather(P, -1, idx.unsqueeze(-2).expand(P.shape[:-1] + (1,))).squeeze(-1)
    x, _ = _normalize(x)
    x, _ = _normalize((G @ x.unsqueeze(-1)).squeeze(-1))  # one polishing step
    if wide:  # x is u
        v, sigma = _normalize((W.mT @ x.unsqueeze(-1)).squeeze(-1))
    else:  # x is v
        v = x
    u, sigma = _normalize((W @ v.unsqueeze(-1)).squeeze(-1))
    return sigma, u, v


def compute_spectral_norm(W: torch.Tensor, *, squarings: int = 14) -> torch.Tensor:
    """``‖W‖₂`` of a matrix or batch (fp32, about 1e-6 relative); see :func:`top_singular`."""
    if W.ndim < 2:
        raise ValueError(f"compute_spectral_norm expects a matrix or a batch of matrices, got shape {tuple(W.shape)}")
    return top_singular(W, squarings=squarings)[0]


def retract(W: torch.Tensor, sigma: torch.Tensor, radius: float) -> torch.Tensor:
    """The hard retraction ``(R/σ)·W`` onto the sphere ``‖W‖₂ = R`` (``σ = ‖W‖₂``, batched ok).

    A zero ``W`` stays zero. Returned in ``W``'s dtype.
    """
    factor = radius / sigma.float().clamp_min(_TINY)
    return (W.float() * factor[..., None, None]).to(W.dtype)


Msign = Callable[[torch.Tensor], torch.Tensor]


def _rank_one(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return u.unsqueeze(-1) * v.unsqueeze(-2)


def tangent_residual(
    m_hat: torch.Tensor, u: torch.Tensor, v: torch.Tensor, lam: torch.Tensor, msign: Msign,
    gram: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h(λ), Φ)`` with ``Φ = msign(M̂ + λ u vᵀ)`` and ``h(λ) = uᵀ Φ v`` (batched over ``(B, m, n)``).

    ``gram``: ``M̂M̂ᵀ`` of the wide orientation (``M̂ᵀM̂`` if ``M̂`` is tall), if known; then the
    Gram matrix of ``X = M̂ + λuvᵀ`` is its rank-two update (``a = u``, ``q = M̂v``; ``v, M̂ᵀu``
    if tall; ``‖v‖ = 1``): ``G + λ(aqᵀ + qaᵀ) + λ²aaᵀ``, passed on as ``msign(X, gram=...)``."""
    x = torch.addcmul(m_hat, (lam[..., None] * u).unsqueeze(-1), v.unsqueeze(-2))  # one m×n pass
    if gram is None:
        phi = msign(x)
    else:
        tall = m_hat.shape[-2] > m_hat.shape[-1]
        a = v if tall else u
        q = (u.unsqueeze(-2) @ m_hat if tall else v.unsqueeze(-2) @ m_hat.mT).squeeze(-2)  # thin, row form
        lam2 = lam[..., None, None]
        aq = _rank_one(a, q)
        phi = msign(x, gram=gram + lam2 * (aq + aq.mT) + lam2.square() * _rank_one(a, a))
    h = (u.unsqueeze(-2) @ phi.float() @ v.unsqueeze(-1)).squeeze(-1).squeeze(-1)
    return h, phi


# ------------------------------------------------------------------------------ the λ model
_FIT_POLES = 60  # resolvent terms in the fit of the msign's spectral function
_FIT_SIGMA_MIN = 1e-8  # fit grid: σ/N from 1e-8 to 1 (N = the msign's normalizer ≥ ‖X‖_F ≥ σ_max)
MODEL_PRECISIONS = ("fp64", "mixed", "fp32")
_MODEL_REFINE_BELOW = 1e-5  # refine eigenpairs with ℓ < 1e-5·N² in fp64 (σ/N < 3e-3; PE's corner is ~1e-4)
_MODEL_ROOT_STEPS = 48  # cap on model_root's steps in eager mode, which stops at convergence
_MODEL_ROOT_STEPS_COMPILED = 24  # fixed steps while compiling (unrolled; the bracket halves every ≤ 2)
_MODEL_ROOT_ATOL = 1e-12  # |model h| at which model_root stops (h ∈ [−1, 1]; fp64 evaluation)


def spectral_function_fit(schedule, *, poles: int = _FIT_POLES) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights ``w_k`` and poles ``τ_k`` (fp64, ``(K,)``) with ``g(s)/s ≈ Σ_k w_k/(s² + τ_k)``.

    ``g`` is the scalar map an odd-polynomial iteration applies to each singular value of its
    normalized input (``s = σ/N``): ``g = p_K ∘ … ∘ p_1``, ``p(s) = a s + b s³ + c s⁵ (+ …)`` per row of
    ``schedule`` (exact arithmetic; longer rows are higher odd degrees). With an AOL-preconditioned
    schedule the msign is not a function of σ alone, so the model is approximate there; every λ is
    still certified by a real msign. ``g(s)/s`` is fitted by least squares on a log grid of
    ``s ∈ [1e-8, 1]`` weighted by ``s`` (i.e. the error of ``g`` itself), with poles log-spaced
    on ``[1e-14, 10]``. For 8 Polar Express steps the fitted ``g`` is within 3e-5 of the exact
    composition on the whole grid (tested). Computed once per schedule, outside any compiled region.
    """
    rows = [tuple(float(c) for c in r) for r in schedule]
    if not rows:
        raise ValueError("Invalid schedule: expected at least one (a, b, c) row")
    _checks.positive_int("poles", poles)
    s = torch.logspace(math.log10(_FIT_SIGMA_MIN), 0.0, 4000, dtype=torch.float64)
    g = s.clone()
    for row in rows:  # p(s) = s·Σ cᵢ s²ⁱ (any odd degree), Horner in s²
        g2, acc = g * g, torch.zeros_like(g)
        for c in reversed(row):
            acc = acc * g2 + c
        g = g * acc
    tau = torch.logspace(-14.0, 1.0, poles, dtype=torch.float64)
    basis = 1.0 / (s[:, None] ** 2 + tau[None, :])
    weights = torch.linalg.lstsq(basis * s[:, None], g, driver="gelsd").solution  # error of g itself
    return weights, tau


class LambdaModel(NamedTuple):
    """The closed-form model of ``h(λ)`` for a batch (built by :func:`lambda_model`), fp64."""

    eig: torch.Tensor  # (B, m): eigenvalues ℓ of M̂(I − vvᵀ)M̂ᵀ (wide orientation), clamped ≥ 0
    a: torch.Tensor  # (B, m): Qᵀu
    p: torch.Tensor  # (B, m): Qᵀ M̂ v
    fro2: torch.Tensor  # (B,): ‖M̂‖_F²
    weights: torch.Tensor  # (K,): the fit's w_k
    poles: torch.Tensor  # (K,): the fit's τ_k
    norm_scale: float  # the msign's normalizer is N = norm_scale·‖X‖_F + eps
    eps: float
    Q: torch.Tensor | None = None  # (B, m, m): eigenvectors of that Gram matrix (for model_direction)
    tall: bool = False  # the inputs were tall and the model is of the transposes
    gram: torch.Tensor | None = None  # (B, m, m) fp32: M̂M̂ᵀ (wide), for the solver's msign calls


def _wide(m_hat: torch.Tensor, u: torch.Tensor, v: torch.Tensor):
    """``(M̂, u, v, M̂v, tall)`` in the wide orientation and fp32: tall inputs are transposed with
    ``u``/``v`` swapped (``h`` is unchanged); ``M̂v`` as a row (the fast form of a thin product)."""
    tall = m_hat.shape[-2] > m_hat.shape[-1]
    if tall:
        m_hat, u, v = m_hat.mT, v, u
    m_hat, u, v = m_hat.float(), u.float(), v.float()
    return m_hat, u, v, (v.unsqueeze(-2) @ m_hat.mT).squeeze(-2), tall


def _deflated_gram(m_hat: torch.Tensor, mv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(M̂M̂ᵀ, ‖M̂‖_F², K)`` of a wide batch: ``‖M̂‖_F²`` is the Gram matrix's trace (fp64 sum) and
    ``K = M̂M̂ᵀ − (M̂v)(M̂v)ᵀ = M̂(I − vvᵀ)M̂ᵀ`` (``addcmul``: rank one, 15× faster than ``baddbmm``)."""
    full = gram_matrix(m_hat)
    fro2 = full.diagonal(dim1=-2, dim2=-1).sum(-1, dtype=torch.float64)
    return full, fro2, torch.addcmul(full, mv.unsqueeze(-1), mv.unsqueeze(-2), value=-1.0)


def lambda_model(
    m_hat: torch.Tensor,
    u: torch.Tensor,
    v: torch.Tensor,
    fit: tuple[torch.Tensor, torch.Tensor],
    *,
    norm_scale: float = 1.0,
    eps: float = 1e-7,
    precision: str | None = None,
) -> LambdaModel:
    """Precompute the model of ``h(λ) = uᵀ msign(M̂ + λ u vᵀ) v`` (see the module doc).

    One Gram matrix ``K = M̂(I − vvᵀ)M̂ᵀ`` of the smaller side and its eigendecomposition per
    matrix; no msign. Tall inputs are transposed with ``u``/``v`` swapped (``h`` is unchanged).

    Precision: the model must resolve eigenvalues down to the msign's corner (σ/N ≈ 1e-4, i.e.
    ℓ ≈ 1e-8·N²), below fp32's ``eps·‖K‖``. ``precision`` (measured on gpt2-small gradients, h at
    the model's root, and the cost per 768² / 768×3072 on one thread):

    - ``"fp64"``: fp64 Gram and ``eigh``; |h| ≤ 1e-6; ≈ 0.2 / 0.3 s.
    - ``"mixed"``: fp32 Gram, fp64 ``eigh``, then the eigenpairs with ``ℓ < 1e-5·N²`` (σ/N < 3e-3,
      where the msign's map bends; ≈ 8 % of a 768² gradient's) recomputed in fp64 from ``Q_sᵀM̂``
      (fp32 Gram rounding is ≈ 6e-8·‖M̂‖², 17 % of a corner eigenvalue on 16×16 squares).
    - ``"fp32"``: like ``"mixed"`` with an fp32 ``eigh``: half the cost of ``"fp64"``, but |h| up to
      1.4e-4 (the fp32 eigenvectors of the rest), 70 % of SSO's default tol.
    - ``None``: ``"mixed"`` in eager mode, ``"fp64"`` while compiling or on meta tensors (the
      refined subspace has a data-dependent size).

    Args:
      m_hat: ``(B, m, n)``; u, v: ``(B, m)``, ``(B, n)`` unit vectors.
      fit: ``(weights, poles)`` from :func:`spectral_function_fit` for the msign's schedule.
      norm_scale, eps: the msign's normalization ``X / (norm_scale·‖X‖_F + eps)``.
      precision: see above.
    """
    if precision is None:
        precision = "fp64" if torch.compiler.is_compiling() or m_hat.device.type == "meta" else "mixed"
    _checks.one_of("precision", precision, MODEL_PRECISIONS)
    m_hat, u, v, mv, tall = _wide(m_hat, u, v)
    if precision == "fp64":
        full, fro2, gram = _deflated_gram(m_hat.double(), mv.double())
        eig, Q = torch.linalg.eigh(gram)
    else:
        full, fro2, gram = _deflated_gram(m_hat, mv)
        eig, Q = torch.linalg.eigh(gram.double() if precision == "mixed" else gram)
        eig, Q = eig.double(), Q.double()
        limit = _MODEL_REFINE_BELOW * (norm_scale**2) * fro2
        small = int((eig < limit[:, None]).sum(-1).max())  # ascending: the first `small` columns
        if small > 0:
            Qs = Q[..., :small]
            Y = Qs.mT @ m_hat.double()
            y = Qs.mT @ mv.double().unsqueeze(-1)
            es, E = torch.linalg.eigh(torch.baddbmm(Y @ Y.mT, y, y.mT, alpha=-1.0))
            Q = torch.cat([Qs @ E, Q[..., small:]], dim=-1)
            eig = torch.cat([es, eig[..., small:]], dim=-1)
    a = (u.double().unsqueeze(-2) @ Q).squeeze(-2)  # Qᵀu, as a row (the fast thin form)
    p = (mv.double().unsqueeze(-2) @ Q).squeeze(-2)
    weights, poles = fit
    dev = eig.device
    return LambdaModel(eig.clamp_min(0.0), a, p, fro2, weights.to(dev), poles.to(dev),
                       float(norm_scale), float(eps), Q, tall, full.float())


# Krylov model (krylov_lambda_model): block Lanczos on K from [u, M̂v], checked every 8 block steps.
_KRYLOV_CHECKPOINTS = (8, 16, 24, 32)
_KRYLOV_MIN_ASPECT = 2  # n ≥ 2m (wide orientation): K's noise bulk stays away from 0
_KRYLOV_MIN_ROWS = 256  # below this a full eigh costs little, and the basis would near m


def krylov_lambda_model(
    m_hat: torch.Tensor,
    u: torch.Tensor,
    v: torch.Tensor,
    fit: tuple[torch.Tensor, torch.Tensor],
    *,
    norm_scale: float = 1.0,
    eps: float = 1e-7,
    tol: float = 2e-4,
    reach: float = 1.023,
) -> LambdaModel | None:
    """The model of :func:`lambda_model` from a Krylov projection, for clearly rectangular batches.

    ``h(λ) = uᵀφ(K + wwᵀ)w`` only needs quadratic forms of resolvents of ``K = M̂(I − vvᵀ)M̂ᵀ``
    in ``span{u, M̂v}`` (``w = M̂v + λu`` stays there), so a block Lanczos basis of
    ``K``'s Krylov space from ``[u, M̂v]`` (full reorthogonalization, fp32) and the eigenpairs of
    the projected ``2k × 2k`` matrix (fp64) give the same model form — Gauss quadrature, exact for
    polynomials of degree ``< 2k`` — in ``O(k·m²)`` after one Gram matrix, instead of an ``m³``
    ``eigh``. It converges fast when ``K``'s spectrum stays away from 0, as for ``n ≥ 2m``
    (Marchenko–Pastur: the noise bulk starts near ``(1 − √(m/n))²`` of its scale); on square
    matrices the tail of tiny singular values stalls it (measured: |Δh| 1e-3 after 80 block steps
    on 768² gradients, 6e-8 after 20 on 768×3072). Every 8 block steps the model's root is
    recomputed; it is returned once the previous root solves the new model to ``tol/8``.

    Returns None — use :func:`lambda_model` — while compiling, for batches with fewer than 256
    rows or ``n < 2m`` (wide orientation), on a Lanczos breakdown (``K`` of rank below the basis
    size), or if 32 block steps did not converge. Like every model it only chooses where the real
    msign is evaluated first. ``Q`` is None (:func:`model_direction` needs :func:`lambda_model`).
    """
    if m_hat.ndim != 3 or torch.compiler.is_compiling() or m_hat.device.type == "meta":
        return None
    m, n = sorted(m_hat.shape[-2:])
    if m < _KRYLOV_MIN_ROWS or n < _KRYLOV_MIN_ASPECT * m:
        return None
    m_hat, u, v, mv, tall = _wide(m_hat, u, v)
    gram, fro2, K = _deflated_gram(m_hat, mv)
    B = m_hat.shape[0]
    start = torch.stack([u, mv], dim=-1)  # (B, m, 2)
    scale = torch.linalg.matrix_norm(K).clamp_min(_TINY)  # (B,)
    Q, R = torch.linalg.qr(start)
    if not bool((R.diagonal(dim1=-2, dim2=-1).abs() > 1e-6).all()):
        return None  # u ∥ M̂v (or M̂v = 0): a 1-D start; the full model handles it
    basis, previous = [Q], None
    weights, poles = fit
    for steps in range(1, _KRYLOV_CHECKPOINTS[-1] + 1):
        V = torch.cat(basis, dim=-1)  # (B, m, 2·steps), orthonormal
        if steps in _KRYLOV_CHECKPOINTS:
            KV = (V.mT @ K).mT  # K V (K is symmetric; this form is the fast one for thin V)
            T = (V.mT @ KV).double()
            theta, Z = torch.linalg.eigh(0.5 * (T + T.mT))
            ritz = V.double() @ Z
            a = (u.double().unsqueeze(-2) @ ritz).squeeze(-2)
            p = (mv.double().unsqueeze(-2) @ ritz).squeeze(-2)
            model = LambdaModel(theta.clamp_min(0.0), a, p, fro2, weights.to(K.device), poles.to(K.device),
                                float(norm_scale), float(eps), None, tall, gram)
            root, ok = model_root(model, torch.zeros(B, dtype=torch.float64, device=K.device), reach)
            if previous is not None:
                agree = model_residual(model, previous[0].double()).abs() <= tol / 8
                if bool((ok & previous[1] & agree).all()):
                    return model
            previous = (root, ok)
            if steps == _KRYLOV_CHECKPOINTS[-1]:
                return None
        Z = (basis[-1].mT @ K).mT  # K Q_j
        for _ in range(2):  # full reorthogonalization, twice (classical Gram–Schmidt)
            Z = Z - V @ (V.mT @ Z)
        Q, R = torch.linalg.qr(Z)
        if not bool((R.diagonal(dim1=-2, dim2=-1).abs() > 1e-6 * scale[:, None]).all()):
            return None  # breakdown: K restricted to the basis is (nearly) invariant
        basis.append(Q)
    return None


def _resolvent_terms(model: LambdaModel, lam: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """At fp64 ``lam`` ``(B,)``: the fit's weights ``c_k = N·w_k`` ``(B, K)``, ``w = Qᵀ(M̂v + λu)``
    ``(B, m)`` and the resolvents ``1/(ℓ_i + d_k)``, ``d_k = N²τ_k``, ``(B, m, K)``, with ``N`` the
    msign's normalizer of ``M̂ + λuvᵀ``."""
    a, p = model.a, model.p
    # ‖M̂ + λuvᵀ‖_F² = ‖M̂‖² + 2λ uᵀM̂v + λ², and uᵀM̂v = aᵀp (Q is orthogonal).
    fro2 = model.fro2 + 2 * lam * (a * p).sum(-1) + lam * lam
    norm = model.norm_scale * fro2.clamp_min(0).sqrt() + model.eps  # (B,)
    c = norm[:, None] * model.weights  # (B, K)
    d = norm[:, None].square() * model.poles  # (B, K)
    w = p + lam[:, None] * a  # (B, m)
    return c, w, 1.0 / (model.eig.unsqueeze(-1) + d.unsqueeze(-2))


def model_residual(model: LambdaModel, lam: torch.Tensor) -> torch.Tensor:
    """The model's ``h(λ)``, ``(B,)`` fp64, for ``lam`` of shape ``(B,)``."""
    c, w, inv = _resolvent_terms(model, lam.double())
    phi_a = ((model.a * w).unsqueeze(-2) @ inv).squeeze(-2)  # (B, K)
    phi_w = ((w * w).unsqueeze(-2) @ inv).squeeze(-2)
    return (c * phi_a / (1 + phi_w)).sum(-1)


def model_direction(model: LambdaModel, m_hat: torch.Tensor, u: torch.Tensor, v: torch.Tensor,
                    lam: torch.Tensor) -> torch.Tensor:
    """``Φ = φ(XXᵀ)·X`` for ``X = M̂ + λ u vᵀ`` from the model's eigendecomposition (no iteration).

    The msign's own map in exact arithmetic up to the fit (|Δg| ≤ 2.2e-5 for PE-8): with
    ``XXᵀ = Q(diag(ℓ) + wwᵀ)Qᵀ`` and ``φ(μ) = Σ_k c_k/(μ + d_k)``, Sherman–Morrison gives
    ``φ(XXᵀ) = Q(D − Y diag(β) Yᵀ)Qᵀ`` with ``D = Σ_k c_k/(ℓ + d_k)``, ``Y = [(ℓ + d_k)⁻¹ w]_k``
    (``m × K``), ``β_k = c_k/(1 + wᵀ(ℓ + d_k)⁻¹w)``: two ``m×m×n`` GEMMs (the first in fp64) after
    the model's ``eigh``. Measured against the fp32 PE-8 msign: max |ΔΦ| ≤ 1.1e-5 on gpt2-small
    gradients, ≤ 3.9e-5 on 16×16 and 33×33 squares (σ_min/N near the corner).
    Returns fp32 ``(B, m, n)`` in the input orientation.
    """
    if model.Q is None:
        raise ValueError("model_direction needs a LambdaModel built by lambda_model (it has no Q)")
    if model.tall:
        m_hat, u, v = m_hat.mT, v, u
    lam64 = lam.double()
    c, w, inv = _resolvent_terms(model, lam64)
    diag = (inv * c.unsqueeze(-2)).sum(-1)  # (B, m)
    Y = inv * w.unsqueeze(-1)  # (B, m, K)
    beta = c / (1 + ((w * w).unsqueeze(-2) @ inv).squeeze(-2))  # (B, K)
    x = m_hat.double() + lam64[:, None, None] * _rank_one(u.double(), v.double())
    # fp64 up to φ(·): rows of Qᵀx along tiny σ are tiny and get multiplied by up to slope/N
    # (≈ 6e3 for PE-8), so fp32 rounding there reaches 2e-3 in Φ (measured on 16×16 squares).
    z = model.Q.mT @ x
    z = diag.unsqueeze(-1) * z - Y @ (beta.unsqueeze(-1) * (Y.mT @ z))
    phi = model.Q.float() @ z.float()  # z = φ(Λ-basis)·Qᵀx is O(1): fp32 is enough here
    return phi.mT if model.tall else phi


def model_root(
    model: LambdaModel, offset: torch.Tensor, reach: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Root of ``model_residual(λ) + offset`` in ``[−reach, reach]`` (no msign).

    False position with the Illinois halving on the bracket ``[−reach, reach]``; a step that
    halves neither the bracket nor the best ``|h|`` is followed by a bisection step. Eager mode
    stops once every row has ``|h| ≤ 1e-12`` or a bracket at fp64 resolution (at most 48 steps;
    ≈ 9 model evaluations per call on gpt2-small gradients, against 50 for the plain bisection it
    replaced); compiled, it runs 24 steps (unrolled), still at least 12 halvings of the bracket. Returns ``(λ, ok)``, both ``(B,)``; ``ok`` is False where
    the shifted model does not change sign on the interval (then λ is meaningless).
    """
    B = model.eig.shape[0]
    dev = model.eig.device
    offset = offset.double()
    lo = torch.full((B,), -float(reach), dtype=torch.float64, device=dev)
    hi = -lo
    flo, fhi = model_residual(model, lo) + offset, model_residual(model, hi) + offset
    ok = (flo < 0) & (fhi >= 0)
    # The bracket's true values (flo, fhi) and the ones false position uses (glo, ghi: Illinois
    # halves the value of an end that stays put twice, so the next point moves past the root).
    glo, ghi = flo, fhi
    moved = torch.zeros(B, dtype=torch.int8, device=dev)  # which end moved last: −1 lo, +1 hi
    bisect = torch.zeros(B, dtype=torch.bool, device=dev)
    eager = not torch.compiler.is_compiling() and dev.type != "meta"
    for _ in range(_MODEL_ROOT_STEPS if eager else _MODEL_ROOT_STEPS_COMPILED):
        width, best = hi - lo, torch.minimum(flo.abs(), fhi.abs())
        if eager:
            done = ~ok | (best <= _MODEL_ROOT_ATOL)
            done |= width <= 4 * torch.finfo(torch.float64).eps * torch.maximum(lo.abs(), hi.abs())
            if bool(done.all()):
                break
        x = (lo * ghi - hi * glo) / (ghi - glo)
        x = torch.where(bisect | ~((x > lo) & (x < hi)), 0.5 * (lo + hi), x)
        f = model_residual(model, x) + offset
        up = f < 0
        ghi = torch.where(up & (moved == -1), 0.5 * ghi, ghi)
        glo = torch.where(~up & (moved == 1), 0.5 * glo, glo)
        lo, flo, glo = torch.where(up, x, lo), torch.where(up, f, flo), torch.where(up, f, glo)
        hi, fhi, ghi = torch.where(up, hi, x), torch.where(up, fhi, f), torch.where(up, ghi, f)
        moved = torch.where(up, -1, 1).to(torch.int8)
        # Progress is a bracket or a best |h| at least halved; without it, bisect next.
        bisect = (hi - lo > 0.5 * width) & (torch.minimum(flo.abs(), fhi.abs()) > 0.5 * best)
    lam = torch.where(fhi <= -flo, hi, lo)
    return lam.float(), ok


def _check_solver_args(tol, max_iterations, bracket_step, max_expansions, method, model_steps=1) -> None:
    _checks.positive("tol", tol)
    if isinstance(max_iterations, bool) or not isinstance(max_iterations, int) or max_iterations < 0:
        raise ValueError(f"Invalid max_iterations: {max_iterations!r} (expected an integer >= 0)")
    _checks.positive("bracket_step", bracket_step)
    if isinstance(max_expansions, bool) or not isinstance(max_expansions, int) or max_expansions < 0:
        raise ValueError(f"Invalid max_expansions: {max_expansions!r} (expected an integer >= 0)")
    _checks.one_of("method", method, SOLVER_METHODS)
    _checks.positive_int("model_steps", model_steps)


class _Search(NamedTuple):
    """The solver's per-matrix search state (each ``(B,)``; ``phi_best`` ``(B, m, n)``)."""

    lam_best: torch.Tensor  # the evaluated λ with the smallest |h| so far
    res_best: torch.Tensor  # its |h|
    f_best: torch.Tensor  # its h
    phi_best: torch.Tensor  # its Φ
    done: torch.Tensor  # |h| ≤ tol reached
    iters: torch.Tensor  # msign evaluations so far (int32)
    lo: torch.Tensor  # largest evaluated λ with h < 0 (−inf: none)
    hi: torch.Tensor  # smallest evaluated λ with h ≥ 0 (+inf: none)
    flo: torch.Tensor  # h(lo)
    fhi: torch.Tensor  # h(hi)


def solve_lambda(
    m_hat: torch.Tensor,
    u: torch.Tensor,
    v: torch.Tensor,
    msign: Msign,
    *,
    lambda0: torch.Tensor | None = None,
    tol: float = 2e-4,
    max_iterations: int = 20,
    bracket_step: float = 1e-3,
    max_expansions: int = 10,
    method: str = "bisection",
    model: LambdaModel | None = None,
    model_steps: int = 3,
    early_exit: bool | None = None,
    gram: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, SolverStats]:
    """Root λ* of ``h(λ) = uᵀ msign(M̂ + λ u vᵀ) v`` and the direction ``Φ = msign(M̂ + λ* u vᵀ)``.

    1. Evaluate ``h`` at the start point: the root of ``model`` if one is given and its model
       changes sign within the bracket's reach, else ``λ0``; done if ``|h| ≤ tol``.
    2. With a model, up to ``model_steps − 1`` more points, each the root of the model shifted by
       the last observed error ``h − h_model`` (a secant step with the model's slope).
    3. Bracket: unless the evaluated points already straddle the root, step ``bracket_step·2^j``
       (j < ``max_expansions``) away from the best point towards the root (h is non-decreasing:
       up if ``h < 0``), moving the near end along, until h changes sign. From λ0 = 0 the
       defaults reach ±1.023 (the reference range; ‖M̂‖_F = 1).
    4. No sign change: λ = 0 and ``fallback = True``.
    5. Otherwise up to ``max_iterations`` bracketed steps (``method="bisection"``: midpoint;
       ``"illinois"``: false position with the Illinois halving), stopping at ``|h| ≤ tol``.
       If the cap is hit, the evaluated λ with the smallest ``|h|`` is returned.

    Args:
      m_hat: ``(B, m, n)`` or ``(m, n)``, fp32 (the Frobenius-normalized momentum).
      u, v: unit top singular vectors of W, ``(B, m)`` / ``(B, n)``.
      msign: batched orthogonalization ``(B, m, n) -> (B, m, n)``; every h evaluation calls it once.
      lambda0: start point ``(B,)`` (e.g. last step's λ*); ``None`` = 0. Changes the cost, not the root.
      tol: tolerance on ``|h(λ)|``.
      max_iterations: cap on bracketed (bisection) steps.
      bracket_step: first expansion step.
      max_expansions: cap on expansion steps.
      method: ``"bisection"`` or ``"illinois"``.
      model: a :class:`LambdaModel` of this batch (:func:`lambda_model`), or None.
      model_steps: msign evaluations guided by the model before bracketing (>= 1).
      gram: ``M̂M̂ᵀ`` of the wide orientation, fp32 ``(B, k, k)`` (e.g. :attr:`LambdaModel.gram`):
        each evaluation then calls ``msign(X, gram=XXᵀ)`` with that Gram matrix formed by a
        rank-two update (:func:`tangent_residual`), so ``msign`` must accept the keyword. Eager
        only (ignored while compiling).
      early_exit: stop when the whole batch converged and evaluate only unconverged matrices
        (one host sync per iteration). ``None``: True in eager mode, False while compiling (where
        the fixed search after the first evaluation runs behind ``torch.cond``: only when some
        matrix did not converge there).

    Returns:
      ``(λ, Φ, SolverStats)``; λ ``(B,)`` fp32, Φ like ``msign``'s output.
    """
    _check_solver_args(tol, max_iterations, bracket_step, max_expansions, method, model_steps)
    unbatched = m_hat.ndim == 2
    if unbatched:
        m_hat, u, v = m_hat.unsqueeze(0), u.unsqueeze(0), v.unsqueeze(0)
        lambda0 = None if lambda0 is None else lambda0.reshape(1)
        if model is not None and model.eig.ndim == 1:
            model = model._replace(eig=model.eig[None], a=model.a[None], p=model.p[None], fro2=model.fro2[None],
                                   Q=None if model.Q is None else model.Q[None],
                                   gram=None if model.gram is None else model.gram[None])
        gram = None if gram is None else gram.unsqueeze(0)
    if torch.compiler.is_compiling():
        gram = None  # eager only: lifted into torch.cond next to the model, it aliased an input
    if early_exit is None:
        early_exit = not torch.compiler.is_compiling() and m_hat.device.type != "meta"
    B = m_hat.shape[0]
    dev = m_hat.device
    m_hat, u, v = m_hat.float(), u.float(), v.float()
    lam0 = torch.zeros(B, device=dev) if lambda0 is None else lambda0.float().reshape(B)
    reach = float(bracket_step) * (2.0 ** max_expansions - 1)

    def evaluate(lam: torch.Tensor, active: torch.Tensor):
        """h and Φ at ``lam``; in early-exit mode only the ``active`` rows are computed."""
        if not early_exit or bool(active.all()):  # all rows: no gather of M̂, no scatter of Φ
            return tangent_residual(m_hat, u, v, lam, msign, gram)
        idx = active.nonzero().squeeze(-1)
        h_a, phi_a = tangent_residual(m_hat[idx], u[idx], v[idx], lam[idx], msign,
                                      None if gram is None else gram[idx])
        h = torch.zeros(B, device=dev).index_copy(0, idx, h_a)
        phi = torch.zeros((B,) + phi_a.shape[1:], device=dev, dtype=phi_a.dtype).index_copy(0, idx, phi_a)
        return h, phi

    all_rows = torch.ones(B, dtype=torch.bool, device=dev)
    start, guided = lam0, torch.zeros(B, dtype=torch.bool, device=dev)
    if model is not None:
        guess, guided = model_root(model, torch.zeros(B, device=dev), reach)
        start = torch.where(guided, guess, lam0)
    f0, phi0 = evaluate(start, all_rows)
    inf = torch.full((B,), math.inf, device=dev)
    below = f0 < 0  # known ends: the largest evaluated λ with h < 0 and the smallest with h >= 0
    first = _Search(lam_best=start, res_best=f0.abs(), f_best=f0, phi_best=phi0, done=f0.abs() <= tol,
                    iters=torch.ones(B, dtype=torch.int32, device=dev),
                    lo=torch.where(below, start, -inf), hi=torch.where(below, inf, start),
                    flo=torch.where(below, f0, -inf), fhi=torch.where(below, inf, f0))

    def record(s: _Search, active, lam, f, phi) -> _Search:
        better = active & (f.abs() < s.res_best)
        new_lo = active & (f < 0) & (lam > s.lo)
        new_hi = active & (f >= 0) & (lam < s.hi)
        return _Search(
            lam_best=torch.where(better, lam, s.lam_best), res_best=torch.where(better, f.abs(), s.res_best),
            f_best=torch.where(better, f, s.f_best), phi_best=torch.where(better[:, None, None], phi, s.phi_best),
            done=s.done | (active & (f.abs() <= tol)), iters=s.iters + active.to(torch.int32),
            lo=torch.where(new_lo, lam, s.lo), hi=torch.where(new_hi, lam, s.hi),
            flo=torch.where(new_lo, f, s.flo), fhi=torch.where(new_hi, f, s.fhi))

    def search(*fields):
        """Everything after the first evaluation: model-guided steps, bracket, bracketed search."""
        s = _Search(*fields[:-2])
        guided, f_last = fields[-2:]
        # Model-guided secant steps: the root of the model shifted by the last observed error.
        last = s.lam_best
        for _ in range(model_steps - 1 if model is not None else 0):
            active = guided & ~s.done
            if early_exit and not bool(active.any()):
                break
            shift = f_last.double() - model_residual(model, last)
            nxt, ok = model_root(model, shift, reach)
            inside = (nxt > s.lo) & (nxt < s.hi)
            mid = torch.where(torch.isfinite(s.lo) & torch.isfinite(s.hi), 0.5 * (s.lo + s.hi), last)
            nxt = torch.where(inside, nxt, mid)
            active = active & ok & (inside | torch.isfinite(s.lo) & torch.isfinite(s.hi))
            f, phi = evaluate(nxt, active)
            s = record(s, active, nxt, f, phi)
            last, f_last = torch.where(active, nxt, last), torch.where(active, f, f_last)
            guided = active

        # Bracket by expansion from the best point. `a` is the near end, the root lies beyond it.
        bracketed = torch.isfinite(s.lo) & torch.isfinite(s.hi)
        direction = torch.where(s.f_best < 0, 1.0, -1.0)
        a = s.lam_best
        step = torch.full((B,), float(bracket_step), device=dev)
        for _ in range(max_expansions):
            active = ~s.done & ~bracketed
            if early_exit and not bool(active.any()):
                break
            b = a + direction * step
            fb, phi = evaluate(b, active)
            s = record(s, active, b, fb, phi)
            crossed = active & ~s.done & (fb * direction >= 0)
            bracketed = bracketed | crossed
            moved = active & ~s.done & ~crossed
            a = torch.where(moved, b, a)
            step = torch.where(moved, 2 * step, step)
        bracketed = torch.isfinite(s.lo) & torch.isfinite(s.hi)
        fallback = ~s.done & ~bracketed

        # Bracketed search: invariant f(lo) < 0 <= f(hi) on bracketed, unconverged rows.
        side = torch.zeros(B, dtype=torch.int8, device=dev)  # Illinois: which end moved last (-1 lo, +1 hi)
        lo, hi = torch.where(bracketed, s.lo, 0.0), torch.where(bracketed, s.hi, 0.0)
        flo, fhi = torch.where(bracketed, s.flo, -1.0), torch.where(bracketed, s.fhi, 1.0)
        s = s._replace(lo=lo, hi=hi, flo=flo, fhi=fhi)
        for _ in range(max_iterations):
            active = bracketed & ~s.done
            if early_exit and not bool(active.any()):
                break
            mid = 0.5 * (s.lo + s.hi)
            if method == "illinois":
                denom = s.fhi - s.flo
                fp = (s.lo * s.fhi - s.hi * s.flo) / torch.where(denom > 0, denom, 1.0)
                ok = (denom > 0) & (fp > s.lo) & (fp < s.hi)
                mid = torch.where(ok, fp, mid)
            fm, phi = evaluate(mid, active)
            s = record(s, active, mid, fm, phi)
            go_lo = active & (fm < 0)  # root above mid
            go_hi = active & (fm >= 0)
            if method == "illinois":
                # The end that did not move twice in a row gets its f halved (keeps superlinear speed).
                s = s._replace(fhi=torch.where(go_lo & (side == -1), 0.5 * s.fhi, s.fhi),
                               flo=torch.where(go_hi & (side == 1), 0.5 * s.flo, s.flo))
                side = torch.where(go_lo, -1, torch.where(go_hi, 1, side)).to(torch.int8)

        lam = torch.where(fallback, 0.0, s.lam_best)
        phi_best, residual, iters = s.phi_best, s.res_best, s.iters
        if not early_exit or bool(fallback.any()):
            f_zero, phi_zero = evaluate(torch.zeros(B, device=dev), fallback if early_exit else all_rows)
            phi_best = torch.where(fallback[:, None, None], phi_zero, phi_best)
            residual = torch.where(fallback, f_zero.abs(), residual)
            iters = iters + fallback.to(torch.int32)
        return lam, phi_best, residual, iters, fallback

    def converged_first(*fields):
        """The first evaluation converged everywhere: nothing to search (new tensors: cond's rule)."""
        s = _Search(*fields[:-2])
        return (s.lam_best.clone(), s.phi_best.clone(), s.res_best.clone(), s.iters.clone(),
                torch.zeros(B, dtype=torch.bool, device=dev))

    operands = tuple(first) + (guided, f0)
    if torch.compiler.is_compiling():
        # One graph either way; the fixed worst-case search runs only when a matrix needs it.
        lam, phi_best, residual, iters, fallback = torch.cond(first.done.all(), converged_first, search, operands)
    else:
        lam, phi_best, residual, iters, fallback = search(*operands)
    converged = residual <= tol
    stats = SolverStats(iterations=iters, residual=residual, converged=converged & ~fallback, fallback=fallback)
    if unbatched:
        lam, phi_best = lam[0], phi_best[0]
        stats = SolverStats(*[s[0] for s in stats])
    return lam, phi_best, stats
