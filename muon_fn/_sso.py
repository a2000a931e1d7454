"""The Spectral Sphere Optimizer (SSO) transform ``spectral_sphere`` and its recipe ``sso``.

Per matrix ``W`` (``(out, in)``, conv kernels folded into ``in``), with gradient ``g``
(notes/algorithms.md §1, arXiv:2601.08393):

1. momentum (EMA, Nesterov): ``b ← lerp(b, g, 1−μ)``, ``M = lerp(g, b, μ)``; ``M̂ = M/max(‖M‖_F, 1e-8)``;
2. ``σ, u, v`` = block power iteration on ``W`` started from last step's block (a warm start);
3. retraction to the sphere ``‖W‖₂ = R``, ``R = c·√(out/in)``: ``W ← (R/σ)·W`` (``"hard"``, the
   default), or a relative step ``α·lr`` toward it (``"dynamic"``: ``W ← (1 ∓ α·lr)·W``);
4. ``λ*`` = root of ``h(λ) = uᵀ msign(M̂ + λ u vᵀ) v`` (:func:`muon_fn.spectral.solve_lambda`),
   first evaluated where a closed-form model of h puts it (:func:`muon_fn.spectral.lambda_model`);
5. ``Φ = msign(M̂ + λ* u vᵀ)`` — tangent to the sphere at W (``⟨u vᵀ, Φ⟩ ≈ 0``);
6. ``W ← W − lr·s·Φ``.

**Retract, then update, as one additive update.** A transform may only return ``u`` with
``p_new = p + u``. Steps 3 and 6 together give ``p_new = (R/σ)·p − lr·s·Φ``, so the update is

    u = (R/σ − 1)·p − lr·s·Φ

(with ``retract_mode="dynamic"``, ``∓α·lr·p`` in place of ``(R/σ − 1)·p``), which is why
``spectral_sphere`` takes ``lr`` itself and is **final**: do not chain ``scale_by_learning_rate``
(or weight decay) after it. The retraction at the start of step t equals
one at the end of step t−1 (singular vectors do not change under scaling), so one power iteration
serves both; right after an update ``‖W‖₂`` is within about ``lr·s`` of ``R`` and the next step
retracts it exactly (hard mode).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, NamedTuple

import torch

from . import _checks, _newton_schulz as _orthogonalize, _tree, spectral
from ._base import GradientTransformation, ScalarOrSchedule, Updates, named
from ._muon import SHAPE_RULES, Split, _not_matrix, _validate_split, block_sizes, matrix_shape, shape_scale

SCALE_MODES = ("radius",) + SHAPE_RULES
RETRACT_MODES = ("hard", "dynamic")
DIRECTIONS = ("msign", "spectral")
_M_FLOOR = 1e-8  # floor of ‖M‖_F in the normalization (reference code)
_MSIGN_EPS = 1e-7  # the msign's normalization X / (norm_scale·‖X‖_F + eps) (reference code)
# init() computes each v accurately (power 2^13 on the Gram matrix), so even the first step's
# retraction is exact although random weights have σ₂/σ₁ ≈ 0.99 (plain power iteration: 3e-2 off
# after 10 steps on a 768×3072 nn.Linear init).
_INIT_SQUARINGS = 12
# Equal shapes are batched in chunks of at most this many matrix elements (8 MiB fp32): one batch
# of all 48 gpt2-small 768² matrices walks every intermediate (fp64 Gram, eigenvectors, Φ) through
# DRAM. Full gpt2-small set, SSO ÷ Muon-same-msign: 1.59 (one batch), 1.32 (2^21), 1.37 (2^20).
_CHUNK_ELEMENTS = 1 << 21


class SpectralSphereState(NamedTuple):
    """State of :func:`spectral_sphere`. Per-matrix fields have the params' tree structure."""

    count: torch.Tensor  # shape=(), int64: updates so far (drives an lr schedule)
    mu: Updates  # momentum buffer, like params (dtype mu_dtype or the param's)
    v: Updates  # shape=(in, k), fp32: orthonormal block tracking W's top right singular vectors
    #            (the warm start; init puts the accurate top vector in its first column)
    lam: Updates  # shape=(), fp32: λ* of the last step (the solver's start point)
    sigma: Updates  # shape=(), fp32: σ(W) before the last step's retraction
    residual: Updates  # shape=(), fp32: |h(λ*)| of the last step (the tangency error)
    iterations: Updates  # shape=(), int32: h evaluations (msign calls) in the last step
    fallback: Updates  # shape=(), bool: the last step found no bracket and used λ = 0
    fallbacks: Updates  # shape=(), int64: how many steps fell back to λ = 0 so far

    state_keys = {
        "count": "sso_count",
        "mu": "momentum_buffer",
        "v": "sso_v",
        "lam": "sso_lambda",
        "sigma": "sso_sigma",
        "residual": "sso_residual",
        "iterations": "sso_iterations",
        "fallback": "sso_fallback",
        "fallbacks": "sso_fallbacks",
    }


def update_scale(scale_mode: str, shape: tuple[int, ...], radius: float) -> float:
    """The multiplier ``s`` of ``Φ``: ``"radius"`` gives ``s = R`` (the paper), else a shape rule."""
    return radius if scale_mode == "radius" else shape_scale(scale_mode, shape)


def _validate(*, lr, momentum, nesterov, radius_scale, scale_mode, retract_mode, retract_alpha, power_steps,
              power_block, cold_start, msign_method, msign_steps, tol, max_iterations, bracket_step,
              max_expansions, solver, warm_lambda, lambda_model, model_steps, direction, muon_sphere) -> None:
    """Check :func:`spectral_sphere`'s hyperparameters (also each ``SpectralSphereOptimizer`` group's)."""
    _checks.scalar_or_schedule("lr", lr)
    _checks.in_unit_interval("momentum", momentum)
    _checks.positive("radius_scale", radius_scale)
    if isinstance(power_steps, bool) or not isinstance(power_steps, int) or power_steps < 1:
        raise ValueError(f"Invalid power_steps: {power_steps!r} (expected an integer >= 1)")
    _checks.positive_int("power_block", power_block)
    _checks.positive_int("msign_steps", msign_steps)
    _checks.one_of("msign_method", msign_method, _orthogonalize.METHODS)
    _checks.one_of("scale_mode", scale_mode, SCALE_MODES)
    _checks.one_of("retract_mode", retract_mode, RETRACT_MODES)
    _checks.positive("retract_alpha", retract_alpha)
    _checks.one_of("solver", solver, spectral.SOLVER_METHODS)
    spectral._check_solver_args(tol, max_iterations, bracket_step, max_expansions, solver, model_steps)
    for name, flag in (("nesterov", nesterov), ("cold_start", cold_start), ("warm_lambda", warm_lambda),
                       ("lambda_model", lambda_model), ("muon_sphere", muon_sphere)):
        if not isinstance(flag, bool):
            raise ValueError(f"Invalid {name}: {flag!r} (expected True or False)")
    _checks.one_of("direction", direction, DIRECTIONS)
    if direction == "spectral" and (not lambda_model or muon_sphere):
        raise ValueError("Invalid direction: 'spectral' computes Φ from the λ model; it needs "
                         "lambda_model=True and muon_sphere=False")


# The hyperparameters _validate checks, by name (the optimizer's group keys are the same names).
VALIDATED_KEYS = tuple(inspect.signature(_validate).parameters)


def spectral_sphere(
    lr: ScalarOrSchedule = 0.02,
    momentum: float | torch.Tensor = 0.95,
    *,
    nesterov: bool = True,
    radius_scale: float = 2.0,
    scale_mode: str = "radius",
    retract_mode: str = "hard",
    retract_alpha: float = 0.05,
    power_steps: int = 5,
    power_block: int = 16,
    cold_start: bool = False,
    msign_method: str = "polar_express",
    msign_steps: int = 8,
    msign_dtype: torch.dtype = torch.float32,
    tol: float = 2e-4,
    max_iterations: int = 20,
    bracket_step: float = 1e-3,
    max_expansions: int = 10,
    solver: str = "illinois",
    warm_lambda: bool = True,
    lambda_model: bool = True,
    model_steps: int = 3,
    direction: str = "msign",
    muon_sphere: bool = False,
    mu_dtype: torch.dtype | None = None,
    split: Split = None,
) -> GradientTransformation:
    """SSO on a tree of matrices; returns the final update ``(R/σ − 1)·W − lr·s·Φ`` (see module doc).

    Defaults, against the sources in notes/algorithms.md §1.4 (which disagree):

    Args:
      lr: float, 0-d tensor or schedule ``count -> lr``. 0.02: with ``scale_mode="radius"``
        (``s = R``) lr is the relative spectral step ``‖ΔW‖₂/‖W‖₂`` per update; 0.02 is Muon's
        default and the issue's (the paper's runs: 1e-2 preferred, 5e-3 used; SB's class default
        3e-4 goes with align_adamw_rms).
      momentum: EMA coefficient μ; 0.95 (Muon's, and the issue's; SB/configs use 0.9). EMA vs SGD
        form does not matter: ``M̂`` is scale-invariant.
      nesterov: True (all sources).
      radius_scale: c in ``R = c·√(out/in)``; 2.0, the paper's best (code default 1.0).
      scale_mode: ``s`` in ``W − lr·s·Φ``: ``"radius"`` (s = R, the paper's "spectral µP scaler"),
        or a :func:`muon_fn.shape_scale` rule (``"spectral"`` = √(out/in), the later configs';
        ``"match_rms_adamw"`` = SB's align_adamw_rms; ``"keller"``, ``"legacy"``, ``"none"``).
      retract_mode: how W is brought back to the sphere each step. ``"hard"`` (every source's
        default, and the paper's): ``W ← (R/σ)·W``, exactly onto it. ``"dynamic"`` (the reference
        code's alternative): ``W ← (1 + α·lr·d)·W`` with ``d = −1`` if ``σ > R``, else ``+1`` — a
        relative step of ``α·lr`` toward the sphere, so a weight far from it (e.g. a fresh
        initialization) gets there in about ``|ln(σ/R)|/(α·lr)`` steps instead of one.
      retract_alpha: α of ``"dynamic"``; 0.05 (the reference code's). Unused by ``"hard"``.
      power_steps: products with ``WᵀW`` per step in the Chebyshev-filtered block iteration
        (:func:`muon_fn.spectral.subspace_iteration`); 5, warm-started from last step's block
        (SB: 10, Megatron: 20 plain power steps, both one vector, cold from all-ones; the paper
        caches vectors). Measured retraction error, max over steps 3–15 with noise gradients,
        k = 16, 768×768 / 768×3072: 1.3e-6 / 5.4e-6 (5 Chebyshev steps), 6.5e-7 / 2.3e-6 (6),
        against 1.8e-5 / 5.3e-5 for the 8 plain power steps used before (docs/sso.md).
      power_block: k vectors iterated together, σ from Rayleigh–Ritz
        (:func:`muon_fn.spectral.subspace_iteration`); 16: SSO flattens the top of the spectrum
        (tangent steps raise σ₂, σ₃, … but not σ₁), where one vector fails — measured retraction
        error with noise gradients 1e-1 (k = 1), 1e-3 (k = 8), 5e-5 (k = 16) on 64×96. Costs
        ``4·m·n·k`` flops per round, < 1 % of one msign for k = 16, m ≥ 768.
      cold_start: restart from a fixed block every step (the reference code restarts from
        all-ones); then use ``power_steps`` ≥ 10.
      msign_method, msign_steps, msign_dtype: ``"polar_express"``, 8 steps, fp32 — the paper's
        "FP32 msign" (8 PE steps converge in fp32, notes §4). Tangency to ``tol`` needs an accurate
        msign: bf16 perturbs σ by ~5e-3.
      tol, max_iterations: solver tolerance on ``|h|`` and cap on bracketed steps; 2e-4 / 20, the
        paper runs' values (SB: 1e-8 / 100, unreachable with 8-step msign in fp32).
      bracket_step, max_expansions: 1e-3 doubled up to 10 times (SB's): reaches ±1.023 around
        the start point; measured |λ*| range from ~1e-3 (768-wide noisy gradients) to ~0.1
        (small or structured ones).
      solver: ``"illinois"`` (default: false position with Illinois halving on the same bracket;
        measured 3–5 msigns vs 6–10 for bisection at the same tolerance) or ``"bisection"`` (SB).
      warm_lambda: start the solver at last step's λ* instead of 0 (cost only; the root is unique).
        With ``lambda_model`` it is only the start when the model finds no root.
      lambda_model: True (default): predict λ* from a closed-form model of h
        (:func:`muon_fn.spectral.lambda_model`: one Gram matrix and one eigendecomposition of the
        smaller side, then each model evaluation is O(m·60) instead of one msign) and evaluate
        the real msign there first. The reference brackets from λ = 0 (notes §1.2 e); the root,
        the tolerance and the certification by a real msign are unchanged, only the evaluation
        points differ. Measured: 1 msign in 360 of 360 matrix-steps on the full gpt2-small set
        (max |h| 1.4e-6) and 120 of 120 on an MLP run, against ≈3.2–4.3 from last step's λ* with
        Illinois and 6–10 with bisection (docs/sso.md). Costs one fp64 Gram + ``eigh`` of the
        smaller side (≈ 0.1–0.2 s per 768² on one CPU thread; a PE-8 fp32 msign: ≈ 0.17–0.38 s).
        Clearly rectangular batches use the Krylov form instead
        (:func:`muon_fn.spectral.krylov_lambda_model`, no ``eigh``). With a bf16/fp16 msign
        (cheaper than that fp64 ``eigh``: 30 vs 78 ms on 768²) the other batches skip the model
        and bracket from last step's λ*.
      model_steps: msign evaluations guided by the model (each at the model's root shifted by
        the last observed error) before falling back to bracketing; 3.
      direction: how Φ is computed. ``"msign"`` (default): the configured iteration
        (``msign_method`` / ``msign_steps`` / ``msign_dtype``), as in the paper and the reference.
        ``"spectral"`` (opt-in, CPU speed): λ* is the λ model's root and Φ = φ(XXᵀ)·X is built
        from the model's eigendecomposition (:func:`muon_fn.spectral.model_direction`): the same
        map as the configured iteration in exact arithmetic, up to the fit (|Δg| ≤ 2.2e-5), with
        no Newton–Schulz iteration at all; measured max |ΔΦ| ≤ 1.1e-5 against fp32 PE-8 and
        0.55× its time on 768² / 0.35× on 768×3072. Tangency is still measured on the returned Φ;
        in eager mode a group whose |h| exceeds ``tol`` falls back to the msign solver (while
        compiling it cannot, and reports ``converged=False``). ``iterations`` then counts the one
        spectral evaluation. Needs ``lambda_model=True`` and ``muon_sphere=False``.
      muon_sphere: MuonSphere: λ fixed at 0 (``Φ = msign(M̂)``), no solver; keeps the retraction.
      mu_dtype: dtype of the momentum buffer (default: the param's).
      split: row blocks of fused weights (QKV, gate/up: sizes along dim 0, or a function
        ``leaf -> sizes | None``, as in :func:`muon_fn.orthogonalize`). Each block is its own
        sphere — its own R, s, σ, λ*, M̂ and warm-start block — as in the reference's QKV/SwiGLU
        splitting (notes §1.3; per-head splitting gave the paper's largest gain). A split leaf's
        per-matrix state gains a leading block dimension: ``v`` ``(blocks, in, k)``, ``lam`` etc.
        ``(blocks,)``.

    Weight decay is not offered: the retraction undoes it (at once, or, dynamic, over a few steps;
    paper: none on 2-D hidden weights). Every non-None leaf must be a matrix (ndim ≥ 2).

    Returns:
      A :class:`~muon_fn.GradientTransformation` with state :class:`SpectralSphereState`; it needs
      ``params`` in ``update``.
    """
    _validate(lr=lr, momentum=momentum, nesterov=nesterov, radius_scale=radius_scale, scale_mode=scale_mode,
              retract_mode=retract_mode, retract_alpha=retract_alpha, power_steps=power_steps,
              power_block=power_block, cold_start=cold_start, msign_method=msign_method,
              msign_steps=msign_steps, tol=tol, max_iterations=max_iterations, bracket_step=bracket_step,
              max_expansions=max_expansions, solver=solver, warm_lambda=warm_lambda,
              lambda_model=lambda_model, model_steps=model_steps, direction=direction,
              muon_sphere=muon_sphere)
    _validate_split(split)
    schedule = _orthogonalize.coefficient_schedule(msign_method, msign_steps)
    norm_scale = _orthogonalize.norm_scale(msign_method)
    # The msign's scalar map g, fitted once here (outside any compiled region) for the λ model.
    fit = spectral.spectral_function_fit(schedule) if lambda_model and not muon_sphere else None
    # The full model costs an fp64 eigh (78 ms per 768²): worth it against fp32 msigns (173 ms
    # for PE-8), not against half-precision ones (aol9 bf16: 30 ms), where the warm bracket wins.
    eigh_model = msign_dtype in (torch.float32, torch.float64)
    reach = float(bracket_step) * (2.0 ** max_expansions - 1)
    lr_schedule: Callable[[torch.Tensor], Any] | None = (
        lr if callable(lr) and not isinstance(lr, torch.Tensor) else None
    )

    def msign(x: torch.Tensor, gram: torch.Tensor | None = None) -> torch.Tensor:
        return _orthogonalize.orthogonalize_matrices(
            x, schedule, dtype=msign_dtype, eps=_MSIGN_EPS, norm_scale=norm_scale, gram=gram
        ).float()

    def blocks_of(p: torch.Tensor) -> list[int] | None:
        """Row-block sizes of leaf ``p`` (None: the whole matrix is one sphere)."""
        if p.ndim < 2:
            raise _not_matrix(p.shape, "spectral_sphere")
        m, n = matrix_shape(p.shape)
        return block_sizes(split, p.reshape(m, n))

    def init(params):
        def one_block(w: torch.Tensor, k: int) -> torch.Tensor:
            n = w.shape[-1]
            start = spectral.default_start_block(n, k, device=w.device)
            top = spectral.top_singular(w.detach(), squarings=_INIT_SQUARINGS)[2]
            return torch.linalg.qr(torch.cat([top[:, None], start[:, 1:]], dim=1))[0]

        def vec(p):
            if p is None:
                return None
            sizes = blocks_of(p)
            m, n = matrix_shape(p.shape)
            w = p.reshape(m, n)
            if sizes is None:
                return one_block(w, min(power_block, m, n))
            k = min(power_block, min(sizes), n)
            return torch.stack([one_block(b, k) for b in w.split(sizes)])

        def scalar(dtype):
            def make(p):
                if p is None:
                    return None
                sizes = blocks_of(p)
                shape = () if sizes is None else (len(sizes),)
                return torch.zeros(shape, dtype=dtype, device=p.device)
            return make

        return SpectralSphereState(
            count=torch.zeros((), dtype=torch.int64),
            mu=_tree.zeros_like(params, dtype=mu_dtype),
            v=_tree.tree_map(vec, params),
            lam=_tree.tree_map(scalar(torch.float32), params),
            sigma=_tree.tree_map(scalar(torch.float32), params),
            residual=_tree.tree_map(scalar(torch.float32), params),
            iterations=_tree.tree_map(scalar(torch.int32), params),
            fallback=_tree.tree_map(scalar(torch.bool), params),
            fallbacks=_tree.tree_map(scalar(torch.int64), params),
        )

    def update(updates, state: SpectralSphereState, params=None, **extra):
        del extra
        if params is None:
            raise ValueError("spectral_sphere needs params: call update(updates, state, params)")
        step_lr = lr_schedule(state.count) if lr_schedule is not None else lr
        g_leaves, spec = _tree.tree_flatten(updates)
        p_leaves = spec.flatten_up_to(params)
        fields = {f: spec.flatten_up_to(getattr(state, f)) for f in SpectralSphereState._fields[1:]}
        new = {f: list(vals) for f, vals in fields.items()}
        out: list[torch.Tensor | None] = [None] * len(g_leaves)

        # Momentum (elementwise), then every leaf cut into spheres (blocks; one unless split),
        # grouped by equal shape for batched math. A unit is (leaf i, block b or None, rows).
        groups: dict[tuple, list[tuple[int, int | None, slice]]] = {}
        directions: dict[int, torch.Tensor] = {}
        pieces: dict[int, list[torch.Tensor | None]] = {}
        for i, (g, p) in enumerate(zip(g_leaves, p_leaves)):
            if g is None:
                continue
            if g.ndim < 2:
                raise _not_matrix(g.shape, "spectral_sphere")
            b = fields["mu"][i]
            g_b = g.to(b.dtype)
            b = b.lerp(g_b, 1 - momentum)
            new["mu"][i] = b
            directions[i] = g_b.lerp(b, momentum) if nesterov else b
            m, n = matrix_shape(p.shape)
            sizes = blocks_of(p)
            units = [(None, slice(0, m))] if sizes is None else [
                (j, slice(sum(sizes[:j]), sum(sizes[:j + 1]))) for j in range(len(sizes))]
            pieces[i] = [None] * len(units)
            for j, rows in units:
                key = ((rows.stop - rows.start, n), p.dtype, p.device)
                groups.setdefault(key, []).append((i, j, rows))

        def pick(field: str, i: int, j: int | None) -> torch.Tensor:
            return fields[field][i] if j is None else fields[field][i][j]

        results: dict[str, dict[tuple[int, int | None], torch.Tensor]] = {
            f: {} for f in ("v", "lam", "sigma", "residual", "iterations", "fallback")}
        for (m, n), units in _chunks(groups):
            radius = spectral.target_radius((m, n), radius_scale)
            s = update_scale(scale_mode, (m, n), radius)
            W = _batch([p_leaves[i].reshape(-1, n)[rows] for i, _, rows in units]).float()
            # M̂ in place where M is ours: a stack, a cast, or the Nesterov direction (not the state).
            M = _batch([directions[i].reshape(-1, n)[rows] for i, _, rows in units])
            owned = len(units) > 1 or nesterov or M.dtype != torch.float32
            M = M.float()
            norm = torch.linalg.matrix_norm(M, keepdim=True).clamp_min(_M_FLOOR)
            m_hat = M.div_(norm) if owned else M / norm
            V0 = torch.stack([pick("v", i, j) for i, j, _ in units])
            if cold_start:
                V0 = spectral.default_start_block(n, V0.shape[-1], device=W.device).expand_as(V0)
            sigma, u, v, V = spectral.subspace_iteration(W, power_steps, V0)
            if muon_sphere:
                lam = torch.zeros(len(units), device=W.device)
                h, phi = spectral.tangent_residual(m_hat, u, v, lam, msign)
                stats = spectral.SolverStats(
                    iterations=torch.ones(len(units), dtype=torch.int32, device=W.device),
                    residual=h.abs(), converged=h.abs() <= tol,
                    fallback=torch.zeros(len(units), dtype=torch.bool, device=W.device))
            else:
                lam0 = torch.stack([pick("lam", i, j) for i, j, _ in units]) if warm_lambda else None
                # Clearly rectangular batches get the Krylov model (no m³ eigh) when it converges;
                # direction="spectral" builds Φ from the full model: fp64 throughout (docs/sso.md).
                model = None
                if fit is not None and direction == "msign":
                    model = spectral.krylov_lambda_model(m_hat, u, v, fit, norm_scale=norm_scale, eps=_MSIGN_EPS,
                                                         tol=tol, reach=reach)
                if fit is not None and model is None and (eigh_model or direction == "spectral"):
                    model = spectral.lambda_model(m_hat, u, v, fit, norm_scale=norm_scale, eps=_MSIGN_EPS,
                                                  precision="fp64" if direction == "spectral" else None)
                solved = None
                if direction == "spectral":
                    solved = _spectral_direction(model, m_hat, u, v, tol, reach)
                    eager = not torch.compiler.is_compiling() and m_hat.device.type != "meta"
                    if eager and not bool(solved[2].converged.all()):
                        solved = None  # the model did not certify: use the msign solver
                lam, phi, stats = solved if solved is not None else spectral.solve_lambda(
                    m_hat, u, v, msign, lambda0=lam0, tol=tol, max_iterations=max_iterations,
                    bracket_step=bracket_step, max_expansions=max_expansions, method=solver,
                    model=model, model_steps=model_steps, gram=None if model is None else model.gram)
            if retract_mode == "hard":
                factor = radius / sigma.clamp_min(1e-30)
            else:  # a relative step α·lr toward the sphere: shrink above R, grow otherwise
                factor = 1 + (retract_alpha * step_lr) * torch.where(sigma > radius, -1.0, 1.0)
            # u = (f − 1)·W − lr·s·Φ (f: the retraction factor), in place on Φ (the solver's fresh
            # output): two m×n passes.
            delta = phi.mul_(-(step_lr * s)).addcmul_(W, (factor - 1)[:, None, None])
            for k, (i, j, _) in enumerate(units):
                pieces[i][0 if j is None else j] = delta[k]
                for field, value in (("v", V), ("lam", lam), ("sigma", sigma), ("residual", stats.residual),
                                     ("iterations", stats.iterations), ("fallback", stats.fallback)):
                    results[field][(i, j)] = value[k]

        for i, parts in pieces.items():
            p = p_leaves[i]
            whole = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
            out[i] = whole.reshape(p.shape).to(p.dtype)
            split_leaf = fields["lam"][i].ndim == 1
            for field, by_unit in results.items():
                if split_leaf:
                    new[field][i] = torch.stack([by_unit[(i, j)] for j in range(len(parts))])
                else:
                    new[field][i] = by_unit[(i, None)]
            new["fallbacks"][i] = fields["fallbacks"][i] + new["fallback"][i].to(torch.int64)

        new_state = SpectralSphereState(
            count=state.count + 1, **{f: _tree.tree_unflatten(spec, vals) for f, vals in new.items()})
        return _tree.tree_unflatten(spec, out), new_state

    config = dict(lr=getattr(lr, "__name__", lr) if lr_schedule else lr, momentum=momentum,
                  nesterov=nesterov, radius_scale=radius_scale, scale_mode=scale_mode,
                  power_steps=power_steps, power_block=power_block, cold_start=cold_start, msign_method=msign_method,
                  msign_steps=msign_steps, msign_dtype=msign_dtype, tol=tol,
                  max_iterations=max_iterations, solver=solver, warm_lambda=warm_lambda,
                  lambda_model=lambda_model, model_steps=model_steps, muon_sphere=muon_sphere)
    if direction != "msign":
        config["direction"] = direction
    if retract_mode != "hard":
        config.update(retract_mode=retract_mode, retract_alpha=retract_alpha)
    if split is not None:
        config["split"] = split
    return named(GradientTransformation(init, update), "spectral_sphere", **config)


def _batch(mats: list[torch.Tensor]) -> torch.Tensor:
    """``(B, m, n)`` from B equal-shape matrices: a view for one, a stack (a copy) for more."""
    return mats[0].unsqueeze(0) if len(mats) == 1 else torch.stack(mats)


def _chunks(groups: dict[tuple, list]):
    """Each shape group's units in batches of at most ``_CHUNK_ELEMENTS`` matrix elements."""
    for ((m, n), _, _), units in groups.items():
        size = max(1, _CHUNK_ELEMENTS // (m * n))
        for k in range(0, len(units), size):
            yield (m, n), units[k:k + size]


def _spectral_direction(model, m_hat, u, v, tol, reach):
    """``direction="spectral"``: λ* = the model's root, Φ from the model, |h| measured on Φ."""
    lam, ok = spectral.model_root(model, torch.zeros(m_hat.shape[0], dtype=torch.float64, device=m_hat.device),
                                  reach)
    lam = torch.where(ok, lam, 0.0)
    phi = spectral.model_direction(model, m_hat, u, v, lam)
    h = (u.float().unsqueeze(-2) @ phi @ v.float().unsqueeze(-1)).reshape(-1).abs()
    stats = spectral.SolverStats(iterations=torch.ones_like(h, dtype=torch.int32), residual=h,
                                 converged=ok & (h <= tol), fallback=~ok)
    return lam, phi, stats


def sso(lr: ScalarOrSchedule = 0.02, momentum: float | torch.Tensor = 0.95, **kwargs: Any) -> GradientTransformation:
    """The Spectral Sphere Optimizer for a tree of matrices: :func:`spectral_sphere` alone.

    SSO's update is final (it contains the retraction), so the recipe is the transform with its
    documented defaults; ``muon_sphere=True`` gives MuonSphere. Use :func:`muon_fn.partition` (or
    :class:`muon_fn.SpectralSphereOptimizer`) to send 0-/1-D params to AdamW.
    """
    return spectral_sphere(lr, momentum, **kwargs)
