"""SSO's per-chunk step: phases 1–6 of :mod:`muon_fn.core.sso` on a batch of equal-shape spheres, as
one operator (``torch.ops.muon_fn.spectral_sphere_step``), and the glue to the λ solver
(:mod:`muon_fn.core.sso_lambda`) and its closed-form model (:mod:`muon_fn.core.sso_lambda_model`).

Under ``torch.compile`` the operator is an opaque call, so inductor compiles only the momentum,
the stacking and the write-back around it, and the math inside runs eagerly either way. Its
static configuration arrives as a JSON key (:func:`sphere`), resolved once per key.
"""

from __future__ import annotations

import functools
import json
from typing import Any, NamedTuple

import torch

from . import sso_lambda as _lambda, sso_lambda_model as _lambda_model, newton_schulz as _newton_schulz, spectral
from .muon import shape_scale

_M_FLOOR = 1e-8  # floor of ‖M‖_F in the normalization (reference code)
_MSIGN_EPS = 1e-7  # the msign's normalization X / max(norm_scale·‖X‖_F, eps) (reference code)


def update_scale(scale_mode: str, shape: tuple[int, ...], radius: float) -> float:
    """The multiplier ``s`` of ``Φ``: ``"radius"`` gives ``s = R`` (the paper), else a shape rule."""
    return radius if scale_mode == "radius" else shape_scale(scale_mode, shape)


class Sphere(NamedTuple):
    """The static configuration of the per-chunk math, resolved once per key (:func:`sphere`)."""

    radius_scale: float
    scale_mode: str
    retract_mode: str
    retract_alpha: float
    power_steps: int
    cold_start: bool
    schedule: Any  # the msign's coefficient schedule
    norm_scale: float
    msign_dtype: torch.dtype
    solver: dict[str, Any]  # solve_lambda's keywords (tol, caps, method, model_steps)
    fit: Any  # the msign's fitted spectral function (None: no λ model)
    eigh_model: bool  # the full (eigh) model pays off against this msign
    reach: float  # the bracket's reach ±bracket_step·(2^max_expansions − 1)
    direction: str
    muon_sphere: bool

    def msign(self, x: torch.Tensor, gram: torch.Tensor | None = None) -> torch.Tensor:
        return _newton_schulz.orthogonalize_matrices(
            x, self.schedule, dtype=self.msign_dtype, eps=_MSIGN_EPS, norm_scale=self.norm_scale, gram=gram
        ).float()


@functools.cache
def sphere(key: str) -> Sphere:
    """The :class:`Sphere` of a JSON key of the per-chunk math's options (the options of
    :func:`spectral_sphere` that phases 1–6 read; the fit is computed here, once per key)."""
    o = json.loads(key)
    schedule = _newton_schulz.coefficient_schedule.build(o["msign_method"], o["msign_steps"])  # checked options
    msign_dtype = getattr(torch, o["msign_dtype"])
    return Sphere(
        radius_scale=o["radius_scale"], scale_mode=o["scale_mode"], retract_mode=o["retract_mode"],
        retract_alpha=o["retract_alpha"], power_steps=o["power_steps"], cold_start=o["cold_start"],
        schedule=schedule, norm_scale=_newton_schulz.norm_scale(o["msign_method"]), msign_dtype=msign_dtype,
        solver=dict(tol=o["tol"], max_iterations=o["max_iterations"], bracket_step=o["bracket_step"],
                    max_expansions=o["max_expansions"], method=o["solver"], model_steps=o["model_steps"]),
        fit=_lambda_model.spectral_function_fit(schedule) if o["lambda_model"] and not o["muon_sphere"] else None,
        # The full model costs an fp64 eigh (78 ms per 768²): worth it against fp32 msigns (173 ms
        # for PE-8), not against half-precision ones (aol9 bf16: 30 ms), where the warm bracket wins.
        eigh_model=msign_dtype in (torch.float32, torch.float64),
        reach=float(o["bracket_step"]) * (2.0 ** o["max_expansions"] - 1),
        direction=o["direction"], muon_sphere=o["muon_sphere"])


STEP_OUTPUTS = ("delta", "v", "lam", "sigma", "residual", "iterations", "fallback")


@torch.library.custom_op("muon_fn::spectral_sphere_step", mutates_args=())
def _sphere_step_op(W: torch.Tensor, M: torch.Tensor, V0: torch.Tensor, lam0: torch.Tensor | None,
                    lr: torch.Tensor, key: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                         torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_sphere_step` as one operator: under ``torch.compile`` it stays one opaque call that
    runs the eager math (the solver's early exit included), so a compiled update traces only the
    momentum, the stacking and the write-back (see ``SpectralSphereOptimizer``'s ``compile``)."""
    return _sphere_step(sphere(key), W, M, V0, lam0, lr)


@_sphere_step_op.register_fake
def _(W, M, V0, lam0, lr, key):
    B = W.shape[0]
    per_matrix = [W.new_empty(B, dtype=torch.float32) for _ in range(3)]
    return (W.new_empty(W.shape, dtype=torch.float32), V0.new_empty(V0.shape, dtype=torch.float32), *per_matrix,
            W.new_empty(B, dtype=torch.int32), W.new_empty(B, dtype=torch.bool))


def _sphere_step(sp: Sphere, W: torch.Tensor, M: torch.Tensor, V0: torch.Tensor, lam0, lr):
    """Phases 1–6 of the module doc on ``W``, ``M`` ``(B, m, n)``: ``(u, V, λ*, σ, |h|, evaluations,
    fallback)``, each matrix's independent of the others in the batch. A matrix whose ``W`` or
    ``M`` holds an inf or nan (only with ``nonfinite=None``: the optimizers' other policies zero
    such a step's gradients first) gets a nan update and no solve (:func:`_nonfinite_rows`)."""
    bad = ~(torch.isfinite(W).flatten(1).all(1) & torch.isfinite(M).flatten(1).all(1))
    if bool(bad.any()):
        return _nonfinite_rows(sp, W, M, V0, lam0, lr, bad)
    return _finite_step(sp, W, M, V0, lam0, lr)


def _nonfinite_rows(sp: Sphere, W, M, V0, lam0, lr, bad: torch.Tensor):
    """:func:`_sphere_step` of a batch with non-finite matrices (``bad``): the finite ones solved
    as usual; the others' update all nan (the nan a plain Muon step would apply: the step is
    applied whole, never half), their warm-start block kept, λ 0, σ and |h| nan, no evaluation,
    counted as a fallback. Nothing raises: under FSDP every rank must finish the step."""
    B = W.shape[0]
    out = [W.new_full(W.shape, float("nan"), dtype=torch.float32), V0.float().clone(),
           W.new_zeros(B, dtype=torch.float32) if lam0 is None else lam0.float().clone(),
           W.new_full((B,), float("nan"), dtype=torch.float32), W.new_full((B,), float("nan"), dtype=torch.float32),
           W.new_zeros(B, dtype=torch.int32), bad.clone()]
    out[2][bad] = 0.0
    good = (~bad).nonzero().squeeze(-1)
    if good.numel():
        solved = _finite_step(sp, W[good], M[good], V0[good], None if lam0 is None else lam0[good], lr)
        for dst, src in zip(out, solved):
            dst.index_copy_(0, good, src.to(dst.dtype))
    return tuple(x.contiguous() for x in out)  # as the operator's fake outputs


def _finite_step(sp: Sphere, W: torch.Tensor, M: torch.Tensor, V0: torch.Tensor, lam0, lr):
    """:func:`_sphere_step` of a batch of finite matrices."""
    rows, n = W.shape[-2:]
    W = W.float()
    m_hat = _normalize(M)
    sigma, u, v, V = _top_singular(sp, W, V0)
    radius = spectral.target_radius((rows, n), sp.radius_scale)
    factor = _retraction_factor(sp, sigma, radius, lr)
    lam, phi, stats = _lambda_and_direction(sp, m_hat, u, v, lam0)
    delta = _assemble_update(phi, W, factor, lr, update_scale(sp.scale_mode, (rows, n), radius))
    # Contiguous, as the operator's fake outputs (Φ of a tall matrix and QR's V are transposed layouts).
    return tuple(x.contiguous() for x in (delta, V, lam, sigma, stats.residual, stats.iterations, stats.fallback))


def _normalize(M: torch.Tensor) -> torch.Tensor:
    """Phase 1: ``M̂ = M/max(‖M‖_F, 1e-8)`` in fp32 (in place on the fp32 copy of a half ``M``)."""
    owned = M.dtype != torch.float32
    M = M.float()
    norm = torch.linalg.matrix_norm(M, keepdim=True).clamp_min(_M_FLOOR)
    return M.div_(norm) if owned else M / norm


def _top_singular(sp: Sphere, W: torch.Tensor, V0: torch.Tensor):
    """Phase 2: ``(σ, u, v, V)`` of ``W`` from the warm block ``V0`` (or a fixed one: cold start)."""
    if sp.cold_start:
        V0 = spectral.default_start_block(W.shape[-1], V0.shape[-1], device=W.device).expand_as(V0)
    return spectral.subspace_iteration(W, sp.power_steps, V0)


def _per_matrix(x: torch.Tensor) -> torch.Tensor:
    """``x`` broadcast against ``(B, m, n)``: a ``(B,)`` tensor gains two dims, a 0-d one stays."""
    return x[:, None, None] if x.ndim == 1 else x


def _retraction_factor(sp: Sphere, sigma: torch.Tensor, radius: float, lr) -> torch.Tensor:
    """Phase 3: ``f`` with ``W ← f·W`` on (``"hard"``) or toward (``"dynamic"``) the sphere, ``(B,)``;
    1 where ``lr`` is 0, so a step at lr = 0 leaves ``W`` as it is (torch.distributed.checkpoint
    initializes an optimizer's state by such a step)."""
    if sp.retract_mode == "hard":
        return torch.where(lr > 0, radius / sigma.clamp_min(spectral._TINY), 1.0)
    # a relative step α·lr toward the sphere: shrink above R, grow otherwise
    return 1 + (sp.retract_alpha * lr) * torch.where(sigma > radius, -1.0, 1.0)


def _assemble_update(phi: torch.Tensor, W: torch.Tensor, factor: torch.Tensor, lr, s: float) -> torch.Tensor:
    """Phase 6: ``u = (f − 1)·W − lr·s·Φ``, in place on Φ (the solver's fresh output): two m×n passes."""
    return phi.mul_(_per_matrix(-(lr * s))).addcmul_(W, (factor - 1)[:, None, None])


def _lambda_and_direction(sp: Sphere, m_hat, u, v, lam0):
    """Phases 4–5: ``(λ*, Φ, SolverStats)`` of a batch; matrices with different kinds of λ model
    are solved in separate groups (a matrix's model is its own: see :func:`_model_groups`)."""
    if sp.muon_sphere:
        lam = m_hat.new_zeros(m_hat.shape[0])
        h, phi = _lambda.tangent_residual(m_hat, u, v, lam, sp.msign)
        return lam, phi, _lambda.SolverStats(
            iterations=torch.ones_like(lam, dtype=torch.int32), residual=h.abs(),
            converged=h.abs() <= sp.solver["tol"], fallback=torch.zeros_like(lam, dtype=torch.bool))
    groups = _model_groups(sp, m_hat, u, v)
    if len(groups) == 1 and groups[0][0] is None:
        return _solve(sp, m_hat, u, v, lam0, groups[0][1])
    solved = []
    for rows, model in groups:
        assert rows is not None  # only a lone group spans the whole batch (rows None)
        solved.append((rows, _solve(sp, m_hat[rows], u[rows], v[rows], None if lam0 is None else lam0[rows], model)))
    return _merge(m_hat.shape[0], solved)


def _model_groups(sp: Sphere, m_hat, u, v) -> list[tuple[torch.Tensor | None, Any]]:
    """``[(rows, model)]``: the λ model of each group of matrices (``rows`` None: all of them).

    Clearly rectangular shapes try the Krylov model one matrix at a time (its stopping rule is
    per batch) and are grouped by its size; the rest get the full (eigh) model when it pays off
    for this msign or ``direction="spectral"`` needs it (fp64 throughout, docs/sso.md), else none."""
    if sp.fit is None:
        return [(None, None)]
    full = sp.eigh_model or sp.direction == "spectral"
    kw = dict(norm_scale=sp.norm_scale, eps=_MSIGN_EPS)

    def full_model(rows):
        if not full:
            return None
        x = (m_hat, u, v) if rows is None else (m_hat[rows], u[rows], v[rows])
        return _unless_failed(_lambda_model.lambda_model, *x, sp.fit,
                              precision="fp64" if sp.direction == "spectral" else None, **kw)

    eager = not torch.compiler.is_compiling() and m_hat.device.type != "meta"
    if not (eager and sp.direction == "msign" and _lambda_model.krylov_shape(m_hat.shape)):
        return [(None, full_model(None))]
    by_size: dict[int, list[int]] = {}
    models, rest = {}, []
    for i in range(m_hat.shape[0]):
        models[i] = _unless_failed(_lambda_model.krylov_lambda_model, m_hat[i:i + 1], u[i:i + 1], v[i:i + 1],
                                   sp.fit, tol=sp.solver["tol"], reach=sp.reach, **kw)
        if models[i] is None:
            rest.append(i)
        else:
            by_size.setdefault(models[i].eig.shape[-1], []).append(i)
    groups: list[tuple[torch.Tensor | None, Any]] = [
        (torch.tensor(idx, device=m_hat.device), _lambda_model.cat_models([models[i] for i in idx]))
        for idx in by_size.values()]
    if rest:
        idx = torch.tensor(rest, device=m_hat.device)
        groups.append((idx, full_model(idx)))
    return groups


def _unless_failed(build, *args, **kwargs):
    """A λ model from ``build``, or None (the solver then brackets from λ₀) where its
    eigendecomposition fails to converge (LAPACK on an ill-conditioned Gram matrix): the model
    only chooses where the solver starts."""
    try:
        return build(*args, **kwargs)
    except torch.linalg.LinAlgError:
        return None


def _solve(sp: Sphere, m_hat, u, v, lam0, model):
    """λ*, Φ and statistics of one group: the msign solver, or ``direction="spectral"``'s model
    root and model direction; a matrix that model did not certify (|h| > tol) is solved again by
    the msign solver (eager: a host read; while compiling it is reported unconverged instead)."""
    if sp.direction == "spectral" and model is not None:
        lam, phi, stats = _spectral_direction(model, m_hat, u, v, sp.solver["tol"], sp.reach)
        eager = not torch.compiler.is_compiling() and m_hat.device.type != "meta"
        if not eager or bool(stats.converged.all()):
            return lam, phi, stats
        bad = (~stats.converged).nonzero().squeeze(-1)
        again = _msign_solver(sp, m_hat[bad], u[bad], v[bad], None if lam0 is None else lam0[bad],
                              _lambda_model.select_rows(model, bad))
        good = stats.converged.nonzero().squeeze(-1)
        return _merge(m_hat.shape[0], [(good, (lam[good], phi[good], _lambda.SolverStats(*[s[good] for s in stats]))),
                                       (bad, again)])
    return _msign_solver(sp, m_hat, u, v, lam0, model)


def _msign_solver(sp: Sphere, m_hat, u, v, lam0, model):
    """The λ solver with this msign, started at the model's root (its Gram matrix reused)."""
    return _lambda.solve_lambda(m_hat, u, v, sp.msign, lambda0=lam0, model=model,
                                gram=None if model is None else model.gram, **sp.solver)


def _spectral_direction(model, m_hat, u, v, tol, reach):
    """``direction="spectral"``: λ* = the model's root, Φ from the model, |h| measured on Φ."""
    lam, ok = _lambda_model.model_root(model, m_hat.new_zeros(m_hat.shape[0], dtype=torch.float64), reach)
    lam = torch.where(ok, lam, 0.0)
    phi = _lambda_model.model_direction(model, m_hat, u, v, lam)
    h = spectral.bilinear(u.float(), phi, v.float()).abs()
    stats = _lambda.SolverStats(iterations=torch.ones_like(h, dtype=torch.int32), residual=h,
                                converged=ok & (h <= tol), fallback=~ok)
    return lam, phi, stats


def _merge(B: int, solved: list[tuple[torch.Tensor, tuple]]):
    """``(λ, Φ, SolverStats)`` of a batch of ``B`` from those of disjoint groups ``(rows, result)``."""
    def scatter(parts: list[torch.Tensor]) -> torch.Tensor:
        first = parts[0]
        out = first.new_empty((B,) + tuple(first.shape[1:]))
        for (rows, _), part in zip(solved, parts):
            out.index_copy_(0, rows, part)
        return out

    lam = scatter([r[0] for _, r in solved])
    phi = scatter([r[1] for _, r in solved])
    stats = _lambda.SolverStats(*[scatter([r[2][f] for _, r in solved]) for f in range(4)])
    return lam, phi, stats
