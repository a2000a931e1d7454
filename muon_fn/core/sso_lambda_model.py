"""The λ model of SSO: a closed form of ``h(λ) = uᵀ msign(M̂ + λ u vᵀ) v`` without an msign.

The msign is a spectral function: ``msign(X) = φ(XXᵀ)·X`` with ``φ`` fixed by the iteration's
polynomials. With one eigendecomposition ``M̂(I − vvᵀ)M̂ᵀ = Q diag(ℓ) Qᵀ`` (the Gram matrix of the
smaller side, ``m³`` work, no msign), ``X_λXᵀ_λ = Q(diag(ℓ) + w wᵀ)Qᵀ`` with ``w = Qᵀ(M̂v + λu)``
for every λ, and with φ fitted as a sum of resolvents ``Σ_k c_k/(μ + d_k)``
(:func:`spectral_function_fit`), Sherman–Morrison gives

    h(λ) = Σ_k c_k·φ_a,k / (1 + φ_w,k),   φ_a,k = Σ_i a_i w_i/(ℓ_i + d_k),  φ_w,k = Σ_i w_i²/(ℓ_i + d_k)

(``a = Qᵀu``) in ``O(m·K)`` per λ instead of one msign (:func:`model_residual`). Its root
(:func:`model_root`) is where the solver (``muon_fn.core.sso_lambda``) evaluates the real msign first. The
model only chooses where h is evaluated: every accepted λ is certified by a real msign. For
clearly rectangular matrices :func:`krylov_lambda_model` builds the same model from a block
Lanczos projection instead of the ``m³`` eigendecomposition; :func:`model_direction` builds Φ
itself from the model (SSO's ``direction="spectral"``).

**Batch invariance.** Every per-matrix quantity is computed from that matrix alone: vector
products through :func:`muon_fn.spectral.matvec`, the refined subspace of ``"mixed"`` precision
sized per matrix, and :func:`model_root` freezes a matrix once it has converged. The Krylov
model's stopping rule is per batch (it returns a model only when every matrix has converged at
the same checkpoint); SSO calls it one matrix at a time.

**Host reads** (eager only; none while compiling): :func:`model_root` stops when every matrix is
done, :func:`krylov_lambda_model` checks its start, breakdowns and convergence, and ``"mixed"``
precision reads the refined subspaces' sizes.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from . import checks as _checks
from .newton_schulz import gram_matrix
from .spectral import _TINY, matmul, matvec

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
    norm_scale: float  # the msign's normalizer is N = max(norm_scale·‖X‖_F, eps)
    eps: float
    Q: torch.Tensor | None = None  # (B, m, m): eigenvectors of that Gram matrix (for model_direction)
    tall: bool = False  # the inputs were tall and the model is of the transposes
    gram: torch.Tensor | None = None  # (B, m, m) fp32: M̂M̂ᵀ (wide), for the solver's msign calls


def _wide(m_hat: torch.Tensor, u: torch.Tensor, v: torch.Tensor):
    """``(M̂, u, v, M̂v, tall)`` in the wide orientation and fp32: tall inputs are transposed with
    ``u``/``v`` swapped (``h`` is unchanged)."""
    tall = m_hat.shape[-2] > m_hat.shape[-1]
    if tall:
        m_hat, u, v = m_hat.mT, v, u
    m_hat, u, v = m_hat.float(), u.float(), v.float()
    return m_hat, u, v, matvec(m_hat, v), tall


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
      norm_scale, eps: the msign's normalization ``X / max(norm_scale·‖X‖_F, eps)``.
      precision: see above.
    """
    if precision is None:
        precision = "fp64" if torch.compiler.is_compiling() or m_hat.device.type == "meta" else "mixed"
    _checks.one_of("precision", precision, MODEL_PRECISIONS)
    m_hat, u, v, mv, tall = _wide(m_hat, u, v)
    if precision == "fp64":
        mv = matvec(m_hat.double(), v.double())
        full, fro2, gram = _deflated_gram(m_hat.double(), mv)
        eig, Q = torch.linalg.eigh(gram)
    else:
        full, fro2, gram = _deflated_gram(m_hat, mv)
        eig, Q = torch.linalg.eigh(gram.double() if precision == "mixed" else gram)
        limit = _MODEL_REFINE_BELOW * (norm_scale**2) * fro2
        eig, Q = _refine_small(eig.double(), Q.double(), m_hat, mv, limit)
    weights, poles = fit
    dev = eig.device
    return LambdaModel(eig.clamp_min(0.0), matvec(Q.mT, u.double()), matvec(Q.mT, mv.double()), fro2,
                       weights.to(dev), poles.to(dev), float(norm_scale), float(eps), Q, tall, full.float())


def _refine_small(eig: torch.Tensor, Q: torch.Tensor, m_hat: torch.Tensor, mv: torch.Tensor,
                  limit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each matrix's eigenpairs with ``ℓ < limit`` recomputed in fp64 from ``Q_sᵀM̂`` (eager: the
    subspace sizes are read back; matrices with equal sizes are refined together)."""
    counts = (eig < limit[:, None]).sum(-1)  # ascending eigenvalues: the first `count` columns
    eig, Q = eig.clone(), Q.clone()
    for c in sorted(set(counts.tolist()) - {0}):
        rows = (counts == c).nonzero().squeeze(-1)
        Qs = Q[rows, :, :c]
        Y = Qs.mT @ m_hat[rows].double()
        y = matvec(Qs.mT, mv[rows].double())
        es, E = torch.linalg.eigh(torch.addcmul(matmul(Y, Y.mT), y.unsqueeze(-1), y.unsqueeze(-2), value=-1.0))
        Q[rows, :, :c] = matmul(Qs, E)
        eig[rows, :c] = es
    return eig, Q


# Krylov model (krylov_lambda_model): block Lanczos on K from [u, M̂v], checked every 8 block steps.
_KRYLOV_CHECKPOINTS = (8, 16, 24, 32)
_KRYLOV_MIN_ASPECT = 2  # n ≥ 2m (wide orientation): K's noise bulk stays away from 0
_KRYLOV_MIN_ROWS = 256  # below this a full eigh costs little, and the basis would near m


def krylov_lambda_model(
    m_hat: torch.Tensor, u: torch.Tensor, v: torch.Tensor, fit: tuple[torch.Tensor, torch.Tensor], *,
    norm_scale: float = 1.0, eps: float = 1e-7, tol: float = 2e-4, reach: float = 1.023,
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
    The stopping rule is the whole batch's (every matrix converged, none broke down): SSO calls
    it one matrix at a time so that a matrix's model does not depend on its batch mates.
    """
    compiling_or_meta = torch.compiler.is_compiling() or m_hat.device.type == "meta"
    if m_hat.ndim != 3 or compiling_or_meta or not krylov_shape(m_hat.shape):
        return None
    m_hat, u, v, mv, tall = _wide(m_hat, u, v)
    gram, fro2, K = _deflated_gram(m_hat, mv)
    start = torch.stack([u, mv], dim=-1)  # (B, m, 2)
    scale = torch.linalg.matrix_norm(K).clamp_min(_TINY)  # (B,)
    Q, R = torch.linalg.qr(start)
    if not bool((R.diagonal(dim1=-2, dim2=-1).abs() > 1e-6).all()):
        return None  # u ∥ M̂v (or M̂v = 0): a 1-D start; the full model handles it
    basis, previous = [Q], None
    zero = torch.zeros(m_hat.shape[0], dtype=torch.float64, device=K.device)
    for steps in range(1, _KRYLOV_CHECKPOINTS[-1] + 1):
        V = torch.cat(basis, dim=-1)  # (B, m, 2·steps), orthonormal
        if steps in _KRYLOV_CHECKPOINTS:
            model = _projected_model(V, K, u, mv, fro2, fit, norm_scale, eps, tall, gram)
            root, ok = model_root(model, zero, reach)
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


def krylov_shape(shape) -> bool:
    """Whether :func:`krylov_lambda_model` applies to matrices of ``shape`` (``(..., m, n)``): at
    least 256 rows and ``n ≥ 2m`` in the wide orientation (a decision by shape alone)."""
    m, n = sorted(int(s) for s in shape[-2:])
    return m >= _KRYLOV_MIN_ROWS and n >= _KRYLOV_MIN_ASPECT * m


def _projected_model(V, K, u, mv, fro2, fit, norm_scale, eps, tall, gram) -> LambdaModel:
    """The model on the Ritz pairs of ``K`` in the orthonormal basis ``V`` (fp64 ``eigh``)."""
    KV = (V.mT @ K).mT  # K V (K is symmetric; this form is the fast one for thin V)
    T = (V.mT @ KV).double()
    theta, Z = torch.linalg.eigh(0.5 * (T + T.mT))
    ritz = V.double() @ Z
    weights, poles = fit
    return LambdaModel(theta.clamp_min(0.0), matvec(ritz.mT, u.double()), matvec(ritz.mT, mv.double()), fro2,
                       weights.to(K.device), poles.to(K.device), float(norm_scale), float(eps), None, tall, gram)


def _resolvent_terms(model: LambdaModel, lam: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """At fp64 ``lam`` ``(B,)``: the fit's weights ``c_k = N·w_k`` ``(B, K)``, ``w = Qᵀ(M̂v + λu)``
    ``(B, m)`` and the resolvents ``1/(ℓ_i + d_k)``, ``d_k = N²τ_k``, ``(B, m, K)``, with ``N`` the
    msign's normalizer of ``M̂ + λuvᵀ``."""
    a, p = model.a, model.p
    # ‖M̂ + λuvᵀ‖_F² = ‖M̂‖² + 2λ uᵀM̂v + λ², and uᵀM̂v = aᵀp (Q is orthogonal).
    fro2 = model.fro2 + 2 * lam * (a * p).sum(-1) + lam * lam
    norm = (model.norm_scale * fro2.clamp_min(0).sqrt()).clamp_min(model.eps)  # (B,)
    c = norm[:, None] * model.weights  # (B, K)
    d = norm[:, None].square() * model.poles  # (B, K)
    w = p + lam[:, None] * a  # (B, m)
    return c, w, 1.0 / (model.eig.unsqueeze(-1) + d.unsqueeze(-2))


def model_residual(model: LambdaModel, lam: torch.Tensor) -> torch.Tensor:
    """The model's ``h(λ)``, ``(B,)`` fp64, for ``lam`` of shape ``(B,)``."""
    c, w, inv = _resolvent_terms(model, lam.double())
    phi_a = matvec(inv.mT, model.a * w)  # (B, K)
    phi_w = matvec(inv.mT, w * w)
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
    beta = c / (1 + matvec(inv.mT, w * w))  # (B, K)
    x = m_hat.double() + lam64[:, None, None] * u.double().unsqueeze(-1) * v.double().unsqueeze(-2)
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
    halves neither the bracket nor the best ``|h|`` is followed by a bisection step. A matrix is
    done (and stays as it is) once ``|h| ≤ 1e-12`` or its bracket is at fp64 resolution; eager mode
    stops when every matrix is done (at most 48 steps; ≈ 9 model evaluations per call on
    gpt2-small gradients, against 50 for a plain bisection), compiled it runs 24 steps (unrolled,
    still at least 12 halvings of the bracket). Returns ``(λ, ok)``, both ``(B,)``; ``ok`` is False
    where the shifted model does not change sign on the interval (then λ is meaningless).
    """
    B, dev = model.eig.shape[0], model.eig.device
    offset = offset.double()
    lo = torch.full((B,), -float(reach), dtype=torch.float64, device=dev)
    hi = -lo
    flo, fhi = model_residual(model, lo) + offset, model_residual(model, hi) + offset
    ok = (flo < 0) & (fhi >= 0)
    # The bracket's true values (flo, fhi) and the ones false position uses (glo, ghi: Illinois
    # halves the value of an end that stays put twice, so the next point moves past the root).
    s = _RootSearch(lo, hi, flo, fhi, flo, fhi, torch.zeros(B, dtype=torch.int8, device=dev),
                    torch.zeros(B, dtype=torch.bool, device=dev))
    eager = not torch.compiler.is_compiling() and dev.type != "meta"
    for _ in range(_MODEL_ROOT_STEPS if eager else _MODEL_ROOT_STEPS_COMPILED):
        done = ~ok | (torch.minimum(s.flo.abs(), s.fhi.abs()) <= _MODEL_ROOT_ATOL)
        done |= s.hi - s.lo <= 4 * torch.finfo(torch.float64).eps * torch.maximum(s.lo.abs(), s.hi.abs())
        if eager and bool(done.all()):  # a host read, eager only
            break
        s = _root_step(model, offset, s, done)
    lam = torch.where(s.fhi <= -s.flo, s.hi, s.lo)
    return lam.float(), ok


class _RootSearch(NamedTuple):
    """:func:`model_root`'s per-matrix state, each ``(B,)``."""

    lo: torch.Tensor  # bracket ends (model h + offset < 0 at lo, >= 0 at hi)
    hi: torch.Tensor
    flo: torch.Tensor  # the shifted model's values there
    fhi: torch.Tensor
    glo: torch.Tensor  # the values false position uses (Illinois-halved)
    ghi: torch.Tensor
    moved: torch.Tensor  # int8: which end moved last (−1 lo, +1 hi)
    bisect: torch.Tensor  # bool: the next step bisects


def _root_step(model: LambdaModel, offset: torch.Tensor, s: _RootSearch, done: torch.Tensor) -> _RootSearch:
    """One false-position (or bisection) step on every matrix that is not ``done``."""
    width, best = s.hi - s.lo, torch.minimum(s.flo.abs(), s.fhi.abs())
    x = (s.lo * s.ghi - s.hi * s.glo) / (s.ghi - s.glo)
    x = torch.where(s.bisect | ~((x > s.lo) & (x < s.hi)), 0.5 * (s.lo + s.hi), x)
    f = model_residual(model, x) + offset
    up, go = f < 0, ~done
    ghi = torch.where(go & up & (s.moved == -1), 0.5 * s.ghi, s.ghi)
    glo = torch.where(go & ~up & (s.moved == 1), 0.5 * s.glo, s.glo)
    low, high = go & up, go & ~up
    lo, flo, glo = torch.where(low, x, s.lo), torch.where(low, f, s.flo), torch.where(low, f, glo)
    hi, fhi, ghi = torch.where(high, x, s.hi), torch.where(high, f, s.fhi), torch.where(high, f, ghi)
    moved = torch.where(go, torch.where(up, -1, 1).to(torch.int8), s.moved)
    # Progress is a bracket or a best |h| at least halved; without it, bisect next.
    bisect = torch.where(go, (hi - lo > 0.5 * width) & (torch.minimum(flo.abs(), fhi.abs()) > 0.5 * best),
                         s.bisect)
    return _RootSearch(lo, hi, flo, fhi, glo, ghi, moved, bisect)


def select_rows(model: LambdaModel, rows: torch.Tensor) -> LambdaModel:
    """The model of the matrices ``rows`` (an index tensor) of ``model``'s batch."""
    return model._replace(eig=model.eig[rows], a=model.a[rows], p=model.p[rows], fro2=model.fro2[rows],
                          Q=None if model.Q is None else model.Q[rows],
                          gram=None if model.gram is None else model.gram[rows])


def cat_models(models: list[LambdaModel]) -> LambdaModel:
    """One model of the concatenated batches (same kind and size: ``eig`` of one width)."""
    first = models[0]
    if len(models) == 1:
        return first

    def cat(field: str):
        parts = [getattr(m, field) for m in models]
        return None if parts[0] is None else torch.cat(parts)

    return first._replace(eig=cat("eig"), a=cat("a"), p=cat("p"), fro2=cat("fro2"), Q=cat("Q"), gram=cat("gram"))
