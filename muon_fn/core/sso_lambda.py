"""The λ solver of SSO: the root of ``h(λ) = ⟨Θ, msign(M̂ + λΘ)⟩ = uᵀ msign(M̂ + λ u vᵀ) v``.

h is non-decreasing in λ, so the root is unique (docs/sso.md, "Solver"). :func:`solve_lambda`
finds it in phases, each a function below:

1. **first evaluation** at the root of a :class:`~muon_fn.core.sso_lambda_model.LambdaModel` if one is
   given and changes sign within the bracket's reach, else at the start point ``λ0``;
2. **model steps**: up to ``model_steps − 1`` more points, each the root of the model shifted by
   the last observed error (a secant step with the model's slope);
3. **bracket**: unless the evaluated points straddle the root, steps ``bracket_step·2^j`` away
   from the best point towards the root until h changes sign (from λ0 = 0 the defaults reach
   ±1.023, the reference range; ‖M̂‖_F = 1);
4. **bracketed search**: bisection or false position with the Illinois halving until
   ``|h| ≤ tol`` or ``max_iterations`` steps (then the evaluated λ with the smallest ``|h|``);
5. **finish**: no sign change found → λ = 0 (a plain Muon direction) and ``fallback = True``.

Every h evaluation is one msign, and every accepted λ is certified by it: Φ is that msign.

**Batch invariance.** The phases run on a batch ``(B, m, n)`` with per-matrix masks: a matrix
that converged, fell back or finished its bracket is frozen (``torch.where``), so its λ, Φ and
statistics are those it gets alone, whichever matrices share the batch and however long they
search (given an msign whose per-matrix result does not depend on its batch, as SSO's does).

**Host reads.** In eager mode (``early_exit=True``, the default there) the solver reads back
whether any matrix is still active after each evaluation, stops when none is, and evaluates only
the active ones: one host sync per evaluation. While compiling it reads nothing: each phase runs
its fixed number of masked evaluations, and the phases after the first evaluation sit behind
``torch.cond`` (skipped when every matrix converged at the first evaluation, the λ model's usual
case), so a compiled caller traces one graph. SSO itself runs the solver eagerly inside its
operator (``muon_fn.core.sso``).
"""

from __future__ import annotations

import math
from typing import NamedTuple
from collections.abc import Callable

import torch

from . import checks as _checks
from .sso_lambda_model import LambdaModel, model_residual, model_root
from .spectral import bilinear, matvec

SOLVER_METHODS = ("bisection", "illinois")
Msign = Callable[..., torch.Tensor]  # (B, m, n) -> (B, m, n); SSO's also accepts gram=XXᵀ


class SolverStats(NamedTuple):
    """Per-matrix statistics of :func:`solve_lambda` (each of shape ``(B,)``, or ``()`` unbatched)."""

    iterations: torch.Tensor  # int32: h evaluations (= msign calls), the first one included
    residual: torch.Tensor  # fp32: |h(λ)| at the returned λ
    converged: torch.Tensor  # bool: residual <= tol
    fallback: torch.Tensor  # bool: no sign change found, λ set to 0


def check_solver_args(tol, max_iterations, bracket_step, max_expansions, method, model_steps=1,
                      method_name: str = "method") -> None:
    """Validate :func:`solve_lambda`'s settings (errors name the argument and the value;
    ``method_name``: the caller's name of ``method``)."""
    _checks.positive("tol", tol)
    if isinstance(max_iterations, bool) or not isinstance(max_iterations, int) or max_iterations < 0:
        raise ValueError(f"Invalid max_iterations: {max_iterations!r} (expected an integer >= 0)")
    _checks.positive("bracket_step", bracket_step)
    if isinstance(max_expansions, bool) or not isinstance(max_expansions, int) or max_expansions < 0:
        raise ValueError(f"Invalid max_expansions: {max_expansions!r} (expected an integer >= 0)")
    _checks.one_of(method_name, method, SOLVER_METHODS)
    _checks.positive_int("model_steps", model_steps)


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
        a, q = (v, matvec(m_hat.mT, u)) if tall else (u, matvec(m_hat, v))
        lam2 = lam[..., None, None]
        aq = a.unsqueeze(-1) * q.unsqueeze(-2)
        phi = msign(x, gram=gram + lam2 * (aq + aq.mT) + lam2.square() * (a.unsqueeze(-1) * a.unsqueeze(-2)))
    return bilinear(u, phi.float(), v), phi


class _Problem(NamedTuple):
    """What every phase evaluates h on (a batch ``(B, m, n)``)."""

    m_hat: torch.Tensor  # fp32 (B, m, n)
    u: torch.Tensor  # fp32 (B, m)
    v: torch.Tensor  # fp32 (B, n)
    msign: Msign
    gram: torch.Tensor | None  # M̂M̂ᵀ (wide), eager only
    tol: float
    early_exit: bool  # eager: stop when no matrix is active, evaluate only the active ones

    def evaluate(self, lam: torch.Tensor, active: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h and Φ at ``lam``; with ``early_exit`` only the ``active`` matrices are computed."""
        if not self.early_exit or bool(active.all()):  # all rows: no gather of M̂, no scatter of Φ
            return tangent_residual(self.m_hat, self.u, self.v, lam, self.msign, self.gram)
        idx = active.nonzero().squeeze(-1)
        h_a, phi_a = tangent_residual(self.m_hat[idx], self.u[idx], self.v[idx], lam[idx], self.msign,
                                      None if self.gram is None else self.gram[idx])
        B = self.m_hat.shape[0]
        h = h_a.new_zeros(B).index_copy(0, idx, h_a)
        return h, phi_a.new_zeros((B,) + phi_a.shape[1:]).index_copy(0, idx, phi_a)

    def idle(self, active: torch.Tensor) -> bool:
        """Eager early exit: no matrix is active (a host read); always False while compiling."""
        return self.early_exit and not bool(active.any())


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

    def record(self, active, lam, f, phi, tol) -> _Search:
        """This state with the evaluation ``(λ, h, Φ)`` of the ``active`` matrices taken in."""
        better = active & (f.abs() < self.res_best)
        new_lo = active & (f < 0) & (lam > self.lo)
        new_hi = active & (f >= 0) & (lam < self.hi)
        return _Search(
            lam_best=torch.where(better, lam, self.lam_best),
            res_best=torch.where(better, f.abs(), self.res_best), f_best=torch.where(better, f, self.f_best),
            phi_best=torch.where(better[:, None, None], phi, self.phi_best),
            done=self.done | (active & (f.abs() <= tol)), iters=self.iters + active.to(torch.int32),
            lo=torch.where(new_lo, lam, self.lo), hi=torch.where(new_hi, lam, self.hi),
            flo=torch.where(new_lo, f, self.flo), fhi=torch.where(new_hi, f, self.fhi))

    def bracketed(self) -> torch.Tensor:
        return torch.isfinite(self.lo) & torch.isfinite(self.hi)


def solve_lambda(
    m_hat: torch.Tensor, u: torch.Tensor, v: torch.Tensor, msign: Msign, *, lambda0: torch.Tensor | None = None,
    tol: float = 2e-4, max_iterations: int = 20, bracket_step: float = 1e-3, max_expansions: int = 10,
    method: str = "bisection", model: LambdaModel | None = None, model_steps: int = 3,
    early_exit: bool | None = None, gram: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, SolverStats]:
    """Root λ* of ``h(λ) = uᵀ msign(M̂ + λ u vᵀ) v`` and ``Φ = msign(M̂ + λ* u vᵀ)`` (module doc).

    Args:
      m_hat: ``(B, m, n)`` or ``(m, n)``, fp32 (the Frobenius-normalized momentum).
      u, v: unit top singular vectors of W, ``(B, m)`` / ``(B, n)``.
      msign: batched orthogonalization ``(B, m, n) -> (B, m, n)``; every h evaluation calls it once.
      lambda0: start point ``(B,)`` (e.g. last step's λ*); ``None`` = 0. Changes the cost, not the root.
      tol: tolerance on ``|h(λ)|``.
      max_iterations, bracket_step, max_expansions: caps of the bracketed search and the bracket.
      method: ``"bisection"`` or ``"illinois"``.
      model: a :class:`~muon_fn.core.sso_lambda_model.LambdaModel` of this batch, or None.
      model_steps: msign evaluations guided by the model before bracketing (>= 1).
      early_exit: stop when no matrix is active and evaluate only active ones (one host read per
        evaluation). ``None``: True in eager mode, False while compiling and on meta tensors.
      gram: ``M̂M̂ᵀ`` of the wide orientation, fp32 ``(B, k, k)`` (e.g. ``model.gram``): each
        evaluation then calls ``msign(X, gram=XXᵀ)`` with that Gram matrix formed by a rank-two
        update (:func:`tangent_residual`). Eager only (ignored while compiling).

    Returns:
      ``(λ, Φ, SolverStats)``; λ ``(B,)`` fp32, Φ like ``msign``'s output.
    """
    check_solver_args(tol, max_iterations, bracket_step, max_expansions, method, model_steps)
    unbatched = m_hat.ndim == 2
    if unbatched:
        m_hat, u, v, lambda0, model, gram = _as_batch(m_hat, u, v, lambda0, model, gram)
    compiling = torch.compiler.is_compiling()
    if early_exit is None:
        early_exit = not compiling and m_hat.device.type != "meta"
    # While compiling gram is dropped: lifted into torch.cond next to the model, it aliased an input.
    pb = _Problem(m_hat.float(), u.float(), v.float(), msign, None if compiling else gram, tol, early_exit)
    B = m_hat.shape[0]
    lam0 = m_hat.new_zeros(B, dtype=torch.float32) if lambda0 is None else lambda0.float().reshape(B)
    reach = float(bracket_step) * (2.0 ** max_expansions - 1)
    first, guided, f0 = _first_evaluation(pb, lam0, model, reach)

    def search(*fields):
        """Everything after the first evaluation."""
        s = _model_steps(pb, _Search(*fields[:-2]), model, model_steps, reach, *fields[-2:])
        s = _bracket(pb, s, bracket_step, max_expansions)
        s = _bracketed_search(pb, s, max_iterations, method)
        return _finish(pb, s)

    def converged_first(*fields):
        """The first evaluation converged everywhere: nothing to search (new tensors: cond's rule)."""
        s = _Search(*fields[:-2])
        return (s.lam_best.clone(), s.phi_best.clone(), s.res_best.clone(), s.iters.clone(),
                torch.zeros_like(s.done))

    operands = tuple(first) + (guided, f0)
    if compiling:  # one graph either way; the fixed search runs only when a matrix needs it
        lam, phi, residual, iters, fallback = torch.cond(first.done.all(), converged_first, search, operands)
    else:
        lam, phi, residual, iters, fallback = search(*operands)
    stats = SolverStats(iterations=iters, residual=residual, converged=(residual <= tol) & ~fallback,
                        fallback=fallback)
    if unbatched:
        return lam[0], phi[0], SolverStats(*[s[0] for s in stats])
    return lam, phi, stats


def _as_batch(m_hat, u, v, lambda0, model, gram):
    """The unbatched inputs of :func:`solve_lambda` as a batch of one."""
    if model is not None and model.eig.ndim == 1:
        model = model._replace(eig=model.eig[None], a=model.a[None], p=model.p[None], fro2=model.fro2[None],
                               Q=None if model.Q is None else model.Q[None],
                               gram=None if model.gram is None else model.gram[None])
    return (m_hat.unsqueeze(0), u.unsqueeze(0), v.unsqueeze(0), None if lambda0 is None else lambda0.reshape(1),
            model, None if gram is None else gram.unsqueeze(0))


def _first_evaluation(pb: _Problem, lam0: torch.Tensor, model: LambdaModel | None, reach: float):
    """Phase 1: h at the model's root (where it has one) or at ``lam0``, for every matrix.
    Returns the search state, which matrices the model guided, and h there."""
    B, dev = lam0.shape[0], lam0.device
    start, guided = lam0, torch.zeros(B, dtype=torch.bool, device=dev)
    if model is not None:
        guess, guided = model_root(model, torch.zeros(B, device=dev), reach)
        start = torch.where(guided, guess, lam0)
    f0, phi0 = pb.evaluate(start, torch.ones(B, dtype=torch.bool, device=dev))
    inf = torch.full((B,), math.inf, device=dev)
    below = f0 < 0  # known ends: the largest evaluated λ with h < 0 and the smallest with h >= 0
    first = _Search(lam_best=start, res_best=f0.abs(), f_best=f0, phi_best=phi0, done=f0.abs() <= pb.tol,
                    iters=torch.ones(B, dtype=torch.int32, device=dev),
                    lo=torch.where(below, start, -inf), hi=torch.where(below, inf, start),
                    flo=torch.where(below, f0, -inf), fhi=torch.where(below, inf, f0))
    return first, guided, f0


def _model_steps(pb: _Problem, s: _Search, model, model_steps: int, reach: float, guided, f_last) -> _Search:
    """Phase 2: secant steps on the model — the root of the model shifted by the last observed error."""
    last = s.lam_best
    for _ in range(model_steps - 1 if model is not None else 0):
        active = guided & ~s.done
        if pb.idle(active):
            break
        shift = f_last.double() - model_residual(model, last)
        nxt, ok = model_root(model, shift, reach)
        inside = (nxt > s.lo) & (nxt < s.hi)
        mid = torch.where(s.bracketed(), 0.5 * (s.lo + s.hi), last)
        nxt = torch.where(inside, nxt, mid)
        active = active & ok & (inside | s.bracketed())
        f, phi = pb.evaluate(nxt, active)
        s = s.record(active, nxt, f, phi, pb.tol)
        last, f_last = torch.where(active, nxt, last), torch.where(active, f, f_last)
        guided = active
    return s


def _bracket(pb: _Problem, s: _Search, bracket_step: float, max_expansions: int) -> _Search:
    """Phase 3: expand from the best point towards the root (h is non-decreasing: up if h < 0)
    until h changes sign. ``a`` is the near end; the root lies beyond it."""
    bracketed = s.bracketed()
    direction = torch.where(s.f_best < 0, 1.0, -1.0)
    a = s.lam_best
    step = torch.full_like(a, float(bracket_step))
    for _ in range(max_expansions):
        active = ~s.done & ~bracketed
        if pb.idle(active):
            break
        b = a + direction * step
        fb, phi = pb.evaluate(b, active)
        s = s.record(active, b, fb, phi, pb.tol)
        crossed = active & ~s.done & (fb * direction >= 0)
        bracketed = bracketed | crossed
        moved = active & ~s.done & ~crossed
        a = torch.where(moved, b, a)
        step = torch.where(moved, 2 * step, step)
    return s


def _bracketed_search(pb: _Problem, s: _Search, max_iterations: int, method: str) -> _Search:
    """Phase 4: bisection or Illinois false position on the bracketed, unconverged matrices
    (invariant h(lo) < 0 <= h(hi)); the others keep their state."""
    bracketed = s.bracketed()
    side = torch.zeros_like(s.iters, dtype=torch.int8)  # Illinois: which end moved last (−1 lo, +1 hi)
    s = s._replace(lo=torch.where(bracketed, s.lo, 0.0), hi=torch.where(bracketed, s.hi, 0.0),
                   flo=torch.where(bracketed, s.flo, -1.0), fhi=torch.where(bracketed, s.fhi, 1.0))
    for _ in range(max_iterations):
        active = bracketed & ~s.done
        if pb.idle(active):
            break
        mid = 0.5 * (s.lo + s.hi)
        if method == "illinois":
            denom = s.fhi - s.flo
            fp = (s.lo * s.fhi - s.hi * s.flo) / torch.where(denom > 0, denom, 1.0)
            mid = torch.where((denom > 0) & (fp > s.lo) & (fp < s.hi), fp, mid)
        fm, phi = pb.evaluate(mid, active)
        s = s.record(active, mid, fm, phi, pb.tol)
        go_lo, go_hi = active & (fm < 0), active & (fm >= 0)  # the root is above / below mid
        if method == "illinois":
            # The end that did not move twice in a row gets its h halved (keeps superlinear speed).
            s = s._replace(fhi=torch.where(go_lo & (side == -1), 0.5 * s.fhi, s.fhi),
                           flo=torch.where(go_hi & (side == 1), 0.5 * s.flo, s.flo))
            side = torch.where(go_lo, -1, torch.where(go_hi, 1, side)).to(torch.int8)
    return s._replace(lo=torch.where(bracketed, s.lo, -math.inf), hi=torch.where(bracketed, s.hi, math.inf))


def _finish(pb: _Problem, s: _Search):
    """Phase 5: ``(λ, Φ, |h|, evaluations, fallback)``; matrices that neither converged nor found
    a sign change fall back to λ = 0 (one more msign, at 0)."""
    fallback = ~s.done & ~s.bracketed()
    lam = torch.where(fallback, 0.0, s.lam_best)
    phi, residual, iters = s.phi_best, s.res_best, s.iters
    if not pb.early_exit or bool(fallback.any()):  # a host read, eager only
        active = fallback if pb.early_exit else torch.ones_like(fallback)
        f_zero, phi_zero = pb.evaluate(torch.zeros_like(lam), active)
        phi = torch.where(fallback[:, None, None], phi_zero, phi)
        residual = torch.where(fallback, f_zero.abs(), residual)
        iters = iters + fallback.to(torch.int32)
    return lam, phi, residual, iters, fallback
