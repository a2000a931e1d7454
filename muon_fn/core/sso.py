"""The Spectral Sphere Optimizer (SSO): the transform ``spectral_sphere`` and the recipe ``sso``.

``sso(lr, μ) = chain(momentum(μ, nesterov=True, kind="ema"), spectral_sphere(lr))``. The momentum
is the shared transform (``b ← lerp(b, g, 1−μ)``, ``M = lerp(g, b, μ)``); ``spectral_sphere``
takes the direction ``M`` as its update and, per matrix ``W`` (``(out, in)``, conv kernels folded
into ``in``; docs/sso.md, arXiv:2601.08393), runs these phases:

1. normalize: ``M̂ = M/max(‖M‖_F, 1e-8)``;
2. top singular triple ``σ, u, v`` of ``W``: block iteration started from last step's block
   (a warm start; :func:`muon_fn.spectral.subspace_iteration`);
3. retraction factor ``f`` onto the sphere ``‖W‖₂ = R``, ``R = c·√(out/in)``: ``R/σ``
   (``"hard"``, the default) or a relative step ``1 ∓ α·lr`` toward it (``"dynamic"``); 1 at
   lr = 0 in both, so a step at lr = 0 changes no weight (as torch.optim's contract has it);
4. λ solve: ``λ*`` = root of ``h(λ) = uᵀ msign(M̂ + λ u vᵀ) v`` (``muon_fn.core.sso_lambda``), first
   evaluated where a closed-form model of h puts it (``muon_fn.core.sso_lambda_model``);
5. direction: ``Φ = msign(M̂ + λ* u vᵀ)``, the solver's accepted evaluation — tangent to the
   sphere at W (``⟨u vᵀ, Φ⟩ ≈ 0``); with ``direction="spectral"`` built from the model instead;
6. update assembly: ``u = (f − 1)·W − lr·s·Φ``.

**Retract, then update, as one additive update.** A transform may only return ``u`` with
``p_new = p + u``; steps 3 and 6 together give ``p_new = f·p − lr·s·Φ``. So ``spectral_sphere``
takes ``lr`` itself and is **final** (:class:`~muon_fn.TransformInfo`): do not chain
``scale_by_learning_rate`` (or weight decay) after it. The retraction at the start of step t
equals one at the end of step t−1 (singular vectors do not change under scaling), so one block
iteration serves both; right after an update ``‖W‖₂`` is within about ``lr·s`` of ``R`` and the
next step retracts it exactly (hard mode).

**Batches.** Each matrix (or block of a head view, :func:`muon_fn.heads`) is a unit; units of one shape, dtype
and device are batched, in chunks of at most ``_CHUNK_ELEMENTS`` elements. A unit's result does
not depend on which units share its batch (bit for bit with an fp32 msign; tested): vector
products go through batch-invariant helpers (:mod:`muon_fn.spectral`), the solver and the model
root freeze finished matrices, the Krylov model is built one matrix at a time, and every kernel
path is chosen by shape (the msign's per-matrix loop from ``LOOP_MIN_DIM`` rows). A half-precision
msign is not covered: CPU elementwise kernels round a tensor's vectorized body and its tail
differently (bf16 ``torch.add(..., alpha=)``), so its last elements depend on the batch size.

**One operator, compiled or not.** Phases 1–6 of a chunk run as one operator
(``torch.ops.muon_fn.spectral_sphere_step``, :mod:`muon_fn.core.sso_step`): under
``torch.compile`` it is an opaque call, so
inductor compiles only the momentum, the stacking and the write-back around it, and the math
inside runs eagerly either way (the same results compiled or not). It reads the device back only
where the parts document it: the solver's early exit (``muon_fn.core.sso_lambda``), the model root's stop,
the Krylov model's convergence checks and the ``"mixed"``-precision refinement's subspace sizes
(``muon_fn.core.sso_lambda_model``), and ``direction="spectral"``'s fallback to the msign solver for the
matrices its model did not certify (:func:`muon_fn.core.sso_step._solve`).
"""

from __future__ import annotations

import inspect
import json
import math
from typing import Any, NamedTuple

import torch

from . import checks as _checks, newton_schulz as _newton_schulz, spectral, sso_lambda as _lambda
from . import tree as _tree, views as _views
from .sso_step import STEP_OUTPUTS, Sphere, sphere, update_scale
from .base import MATRIX, GradientTransformation, ScalarOrSchedule, Updates, named, with_info
from .metrics import collector_of
from .combine import chain
from .muon import SHAPE_RULES, _not_matrix, group_by, refuse_split
from .transforms import check_storage, momentum as momentum_tx

SCALE_MODES = ("radius",) + SHAPE_RULES
RETRACT_MODES = ("hard", "dynamic")
DIRECTIONS = ("msign", "spectral")
# init() computes each v accurately (power 2^13 on the Gram matrix), so even the first step's
# retraction is exact although random weights have σ₂/σ₁ ≈ 0.99 (plain power iteration: 3e-2 off
# after 10 steps on a 768×3072 nn.Linear init).
_INIT_SQUARINGS = 12
# Equal shapes are batched in chunks of at most this many matrix elements (8 MiB fp32): one batch
# of all 48 gpt2-small 768² matrices walks every intermediate (fp64 Gram, eigenvectors, Φ) through
# DRAM. Full gpt2-small set, SSO ÷ Muon-same-msign: 1.59 (one batch), 1.32 (2^21), 1.37 (2^20).
_CHUNK_ELEMENTS = 1 << 21


class SpectralSphereState(NamedTuple):
    """State of :func:`spectral_sphere`; every field has the params' tree structure (the
    per-matrix fields of a leaf of several units, an expert stack or a head view, gain a leading
    unit dimension)."""

    count: Updates  # shape=(), int64: updates of this leaf so far (drives an lr schedule)
    v: Updates  # shape=(in, k), fp32: orthonormal block tracking W's top right singular vectors
    #            (the warm start; init puts the accurate top vector in its first column)
    lam: Updates  # shape=(), fp32: λ* of the last step (the solver's start point)
    sigma: Updates  # shape=(), fp32: σ(W) before the last step's retraction
    residual: Updates  # shape=(), fp32: |h(λ*)| of the last step (the tangency error)
    iterations: Updates  # shape=(), int32: h evaluations (msign calls) in the last step
    fallback: Updates  # shape=(), bool: the last step found no bracket and used λ = 0
    fallbacks: Updates  # shape=(), int64: how many steps fell back to λ = 0 so far

    state_keys = {  # noqa: RUF012  NamedTuple: annotated, it would be a field
        "count": "sso_count",
        "v": "sso_v",
        "lam": "sso_lambda",
        "sigma": "sso_sigma",
        "residual": "sso_residual",
        "iterations": "sso_iterations",
        "fallback": "sso_fallback",
        "fallbacks": "sso_fallbacks",
    }


_STATS = ("v", "lam", "sigma", "residual", "iterations", "fallback")  # replaced every step per unit


def check_options(*, nesterov, **sphere_settings) -> None:
    """Check a ``SpectralSphereOptimizer`` group's :func:`sso` hyperparameters, but ``lr`` and
    ``momentum`` (the optimizer checks those in torch's wording) and ``msign_dtype``."""
    _check_flag("nesterov", nesterov)
    check_sphere_settings(**sphere_settings)


def _check_flag(name: str, flag: Any) -> None:
    if not isinstance(flag, bool):
        raise ValueError(f"Invalid {name}: {flag!r} (expected True or False)")


def check_sphere_settings(*, radius_scale, scale_mode, retract_mode, retract_alpha, power_steps, power_block,
                          cold_start, msign_method, msign_steps, tol, max_iterations, bracket_step, max_expansions,
                          solver, warm_lambda, lambda_model, model_steps, direction, muon_sphere) -> None:
    """Check :func:`spectral_sphere`'s settings (every hyperparameter but ``lr``, ``msign_dtype`` and ``view``)."""
    _checks.positive("radius_scale", radius_scale)
    if isinstance(power_steps, bool) or not isinstance(power_steps, int) or power_steps < 1:
        raise ValueError(f"Invalid power_steps: {power_steps!r} (expected an integer >= 1)")
    _checks.positive_int("power_block", power_block)
    _checks.positive_int("msign_steps", msign_steps)
    _checks.one_of("msign_method", msign_method, _newton_schulz.METHODS)
    _checks.one_of("scale_mode", scale_mode, SCALE_MODES)
    _checks.one_of("retract_mode", retract_mode, RETRACT_MODES)
    _checks.positive("retract_alpha", retract_alpha)
    _lambda.check_solver_args(tol, max_iterations, bracket_step, max_expansions, solver, model_steps, "solver")
    for name, flag in (("cold_start", cold_start), ("warm_lambda", warm_lambda), ("lambda_model", lambda_model),
                       ("muon_sphere", muon_sphere)):
        _check_flag(name, flag)
    _checks.one_of("direction", direction, DIRECTIONS)
    if direction == "spectral" and (not lambda_model or muon_sphere):
        raise ValueError("Invalid direction: 'spectral' computes Φ from the λ model; it needs "
                         "lambda_model=True and muon_sphere=False")


# The settings check_sphere_settings checks, by name (the optimizer's group keys are the same names).
SETTINGS_KEYS = tuple(inspect.signature(check_sphere_settings).parameters)
# The recipe's hyperparameters that are group keys of the same name (check_options checks all but
# lr and momentum, which the optimizer checks in torch's wording).
VALIDATED_KEYS = ("momentum", "nesterov", "lr") + SETTINGS_KEYS


def _check_spectral_sphere(lr: Any, *, view: Any, split: Any, msign_dtype: Any, **settings: Any) -> None:
    """:func:`spectral_sphere`'s arguments: ``lr``, the settings, ``msign_dtype``, ``view``."""
    _checks.scalar_or_schedule("lr", lr)
    check_sphere_settings(**settings)
    _checks.dtype("msign_dtype", msign_dtype, _newton_schulz.COMPUTE_DTYPES)
    _views.check_view(view)
    refuse_split(split)


class _Transform(NamedTuple):
    """What ``spectral_sphere``'s ``init`` and ``update`` need besides the per-chunk math."""

    lr: Any  # float, 0-d tensor or schedule count -> lr
    lr_schedule: bool
    power_block: int
    warm_lambda: bool
    view: _views.View
    key: str  # the per-chunk math's options (JSON, see muon_fn.core.sso_step.sphere)
    sphere: Sphere  # sphere(key), resolved at construction: traced code never parses the key


# Longer than 80 lines only for its Args docstring (the public reference of every option);
# the code after it is 30 lines.
@_checks.checked(_check_spectral_sphere)
def spectral_sphere(
    lr: ScalarOrSchedule = 0.02, *, radius_scale: float = 2.0, scale_mode: str = "radius",
    retract_mode: str = "hard", retract_alpha: float = 0.05, power_steps: int = 5, power_block: int = 16,
    cold_start: bool = False, msign_method: str = "polar_express", msign_steps: int = 8,
    msign_dtype: torch.dtype = torch.float32, tol: float = 2e-4, max_iterations: int = 20,
    bracket_step: float = 1e-3, max_expansions: int = 10, solver: str = "illinois", warm_lambda: bool = True,
    lambda_model: bool = True, model_steps: int = 3, direction: str = "msign", muon_sphere: bool = False,
    view: _views.View = "flatten", split: None = None,
) -> GradientTransformation:
    """SSO's step after the momentum: the final update ``(f − 1)·W − lr·s·Φ`` (module doc).

    The update input is the momentum direction ``M`` of each matrix; ``params`` are required.
    Defaults and the measurements behind them: docs/sso.md (where the sources disagree).

    Args:
      lr: float, 0-d tensor or schedule ``count -> lr`` (count per leaf). With ``scale_mode=
        "radius"`` it is the relative spectral step ``‖ΔW‖₂/‖W‖₂``.
      radius_scale: c in ``R = c·√(out/in)``; 2.0, the paper's best.
      scale_mode: ``s`` in ``W − lr·s·Φ``: ``"radius"`` (s = R, the paper's) or a
        :func:`muon_fn.shape_scale` rule (``"spectral"``, ``"match_rms_adamw"``, ...).
      retract_mode: ``"hard"``: ``W ← (R/σ)·W`` (where lr > 0); ``"dynamic"``: ``W ← (1 + α·lr·d)·W``, ``d = −1``
        if ``σ > R`` else ``+1`` (a relative step toward the sphere). retract_alpha: that α.
      power_steps, power_block: products with ``WᵀW`` per step and vectors ``k`` of the
        Chebyshev-filtered block iteration (:func:`muon_fn.spectral.subspace_iteration`), warm
        started from last step's block; 5 and 16. cold_start: restart from a fixed block instead.
      msign_method, msign_steps, msign_dtype: the msign; Polar Express, 8 steps, fp32 (the
        paper's "FP32 msign": tangency to ``tol`` needs an accurate msign).
      tol, max_iterations, bracket_step, max_expansions, solver: the λ solver
        (``muon_fn.core.sso_lambda.solve_lambda``): tolerance on ``|h|`` 2e-4, 20 bracketed steps, a
        bracket of 1e-3 doubled up to 10 times, ``"illinois"`` (or ``"bisection"``).
      warm_lambda: start at last step's λ* when the model gives no start.
      lambda_model, model_steps: evaluate h first where a closed-form model of it puts the root
        (``muon_fn.core.sso_lambda_model``; the full model costs an ``eigh`` of the smaller side, clearly
        rectangular matrices use a Krylov form), then up to ``model_steps`` model-guided points.
        With a bf16/fp16 msign only the Krylov form is used.
      direction: ``"msign"`` (Φ from the configured iteration) or ``"spectral"`` (Φ = φ(XXᵀ)·X from
        the model's eigendecomposition: the same map up to the fit, no iteration; needs
        ``lambda_model=True``, ``muon_sphere=False``).
      muon_sphere: MuonSphere: λ fixed at 0 (``Φ = msign(M̂)``), no solver; keeps the retraction.
      view: what a matrix is (:func:`muon_fn.orthogonalize`'s): ``"flatten"`` (default),
        ``"experts"`` (each matrix of an ``(E, out, in)`` stack its own sphere), a head view
        :func:`muon_fn.heads` (each block its own sphere with its own R, s, σ, λ* and warm block;
        column blocks of equal width), or a function ``leaf -> view``.
      split: removed; a ``TypeError`` says to use ``view=muon_fn.heads(rows=...)``.

    Weight decay is not offered: the retraction undoes it. Every non-None leaf must be a matrix
    (ndim ≥ 2); an empty one gets a zero update.

    Returns:
      A final, leafwise, matrix-scope :class:`~muon_fn.GradientTransformation` with state
      :class:`SpectralSphereState` that needs ``params``.
    """
    options = dict(radius_scale=radius_scale, scale_mode=scale_mode, retract_mode=retract_mode,
                   retract_alpha=retract_alpha, power_steps=power_steps, cold_start=cold_start,
                   msign_method=msign_method, msign_steps=msign_steps, tol=tol, max_iterations=max_iterations,
                   bracket_step=bracket_step, max_expansions=max_expansions, solver=solver,
                   lambda_model=lambda_model, model_steps=model_steps, direction=direction, muon_sphere=muon_sphere)
    key = json.dumps(dict(options, radius_scale=float(radius_scale), retract_alpha=float(retract_alpha),
                          tol=float(tol), bracket_step=float(bracket_step),
                          msign_dtype=str(msign_dtype).removeprefix("torch.")), sort_keys=True)
    resolved = sphere(key)  # fits the msign's spectral function now, outside any compiled region
    lr_schedule = callable(lr) and not isinstance(lr, torch.Tensor)
    cfg = _Transform(lr=lr, lr_schedule=lr_schedule, power_block=power_block, warm_lambda=warm_lambda, view=view,
                     key=key, sphere=resolved)

    def init(params):
        return _init(cfg, params)

    def update(updates, state, params=None, **extra):
        if params is None:
            raise ValueError("spectral_sphere needs params: call update(updates, state, params)")
        out, new_state = _update(cfg, updates, state, params)
        collector = collector_of(extra)
        if collector is not None:
            _record(collector, cfg, updates, params, state, new_state)
        return out, new_state

    shown = dict(lr=getattr(lr, "__name__", lr) if lr_schedule else lr, power_block=power_block,
                 msign_dtype=msign_dtype, warm_lambda=warm_lambda, view=view, **options)
    tx = named(GradientTransformation(init, update), "spectral_sphere", **_shown_config(shown))
    # Not per_matrix: a unit's bits can depend on its batch mates for shapes whose batch slots
    # are not 64-byte aligned (1.2e-7 on 5x6 experts, 4 in a batch vs 1), so the FSDP adapter
    # computes each stack whole on one owner.
    return with_info(tx, leafwise=True, scope=MATRIX, final=True, needs_params=True)


def _record(collector: Any, cfg: _Transform, updates, params, state: SpectralSphereState,
            new_state: SpectralSphereState) -> None:
    """Telemetry (:mod:`muon_fn.core.metrics`): each unit's solve (σ, λ*, |h|, evaluations, fallback),
    the step's ``lr`` and the update scale ``s``, so the effective learning rate is ``lr·s``."""
    for field, name in (("sigma", "sso_sigma"), ("lam", "sso_lambda"), ("residual", "sso_residual"),
                        ("iterations", "sso_iterations"), ("fallback", "sso_fallback")):
        values = _tree.tree_leaves(getattr(new_state, field))
        collector.each(name, updates, lambda u, i, values=values: values[i])
    sp, counts = cfg.sphere, _tree.tree_leaves(state.count)
    p_leaves = _tree.tree_leaves(params)

    def scales(u, i):
        shapes = _views.unit_shapes(p_leaves[i].shape, _views.view_of(cfg.view, p_leaves[i]))
        return torch.tensor([update_scale(sp.scale_mode, sh, spectral.target_radius(sh, sp.radius_scale))
                             for sh in shapes], dtype=torch.float32, device=u.device)

    collector.each("shape_scale", updates, scales)
    collector.each("lr", updates, lambda u, i: _unit_lr(cfg, [counts[i]], u.device).reshape(-1)[:1])


_SHOWN = ("lr", "radius_scale", "scale_mode", "power_steps", "power_block", "cold_start", "msign_method",
          "msign_steps", "msign_dtype", "tol", "max_iterations", "solver", "warm_lambda", "lambda_model",
          "model_steps", "muon_sphere")


def _shown_config(options: dict[str, Any]) -> dict[str, Any]:
    """The repr's settings: the usual ones, then those only shown when not at their default."""
    config = {k: options[k] for k in _SHOWN}
    if options["direction"] != "msign":
        config["direction"] = options["direction"]
    if options["retract_mode"] != "hard":
        config.update(retract_mode=options["retract_mode"], retract_alpha=options["retract_alpha"])
    if options["view"] != "flatten":
        config["view"] = _views.label(options["view"])
    return config


def _check_sso(lr: Any, momentum: Any, *, nesterov: Any, mu_dtype: Any, state_bits: Any,
               kwargs: dict[str, Any]) -> None:
    """:func:`sso`'s arguments: ``nesterov``, the momentum's, then :func:`spectral_sphere`'s."""
    _check_flag("nesterov", nesterov)
    _checks.in_unit_interval("momentum", momentum)
    check_storage(mu_dtype, state_bits)
    spectral_sphere.check(lr, **kwargs)


@_checks.checked(_check_sso)
def sso(
    lr: ScalarOrSchedule = 0.02,
    momentum: float | torch.Tensor = 0.95,
    *,
    nesterov: bool = True,
    mu_dtype: torch.dtype | None = None,
    state_bits: int = 32,
    **kwargs: Any,
) -> GradientTransformation:
    """The Spectral Sphere Optimizer for a tree of matrices:
    ``chain(momentum(momentum, nesterov=nesterov, kind="ema", mu_dtype=mu_dtype), spectral_sphere(lr, **kwargs))``.

    Args:
      lr: see :func:`spectral_sphere`; 0.02.
      momentum: EMA coefficient μ; 0.95 (Muon's; the reference code's 0.9). EMA or SGD form does
        not matter: ``M̂`` is scale-invariant.
      nesterov: Nesterov momentum (every source's default).
      mu_dtype: dtype of the momentum buffer (default: the param's).
      state_bits: the momentum's storage (:func:`muon_fn.momentum`: 32, 16, 8 or 4 bits); the
        warm-start block and the per-matrix statistics stay fp32 (they are ``in × k`` per matrix).
      kwargs: any other :func:`spectral_sphere` option; ``muon_sphere=True`` gives MuonSphere.

    The chain is final (it contains the retraction). Use :func:`muon_fn.partition` (or
    :class:`muon_fn.SpectralSphereOptimizer`) to send 0-/1-D params to AdamW.
    """
    return chain(momentum_tx.build(momentum, nesterov=nesterov, kind="ema", mu_dtype=mu_dtype, state_bits=state_bits),
                 spectral_sphere.build(lr, **kwargs))


# ------------------------------------------------------------------------------ init
def _blocks_of(cfg: _Transform, p: torch.Tensor) -> list[_views.Unit] | None:
    """The units of leaf ``p`` as blocks of its rows (None: the whole leaf is one sphere)."""
    if p.ndim < 2:
        raise _not_matrix(p.shape, "spectral_sphere")
    view = _views.view_of(cfg.view, p)
    if not isinstance(view, _views.Heads) and _views.count(p.shape, view) == 1:
        return None
    units = _views.units(p.shape, view)
    if len({u.shape[1] for u in units}) > 1:
        raise ValueError(f"spectral_sphere: {view!r} cuts a leaf of shape {tuple(p.shape)} into column "
                         "blocks of different widths; SSO's warm blocks need equal widths")
    return units


def _unit_dims(cfg: _Transform, p: torch.Tensor) -> tuple[int, ...]:
    """The leading dims of ``p``'s per-unit state: ``()`` (one sphere), ``(U,)`` for U units, or
    ``(E, U/E)`` for a head view cutting each matrix of a 3-D stack of E (so the state follows
    the stack's dim 0, as its rows do; the FSDP adapter keeps it with the experts)."""
    units = _blocks_of(cfg, p)
    if units is None:
        return ()
    view = _views.view_of(cfg.view, p)
    if isinstance(view, _views.Heads) and view.experts and p.ndim == 3:
        per = math.prod(len(sizes) for sizes in _views.block_sizes(p.shape, view))
        if per > 1:
            return (p.shape[0], per)
    return (len(units),)


def _rows_shape(cfg: _Transform, p: torch.Tensor) -> tuple[int, int]:
    """``(m, n)`` of leaf ``p``'s rows, whose row blocks are its spheres."""
    return _views.rows_shape(p.shape, _views.view_of(cfg.view, p))


def _start_block(w: torch.Tensor, k: int) -> torch.Tensor:
    """The first warm block of matrix ``w``: the accurate top vector, then a fixed block."""
    n = w.shape[-1]
    start = spectral.default_start_block(n, k, device=w.device)
    if w.numel() == 0 or k == 0:  # an empty matrix: nothing to track
        return start
    top = spectral.top_singular(w.detach(), squarings=_INIT_SQUARINGS)[2]
    return torch.linalg.qr(torch.cat([top[:, None], start[:, 1:]], dim=1))[0]


def _init(cfg: _Transform, params) -> SpectralSphereState:
    def block(p):
        if p is None:
            return None
        sizes = _blocks_of(cfg, p)
        m, n = _rows_shape(cfg, p)
        w = p.reshape(m, n)
        if sizes is None:
            return _start_block(w, min(cfg.power_block, m, n))
        if not sizes:  # a stack of no matrices
            return torch.zeros((0, n, 0), dtype=torch.float32, device=p.device)
        k = min(cfg.power_block, *(min(u.shape) for u in sizes))
        blocks = torch.stack([_start_block(w[u[0], u[1]].contiguous(), k) for u in sizes])
        return blocks.reshape(_unit_dims(cfg, p) + blocks.shape[1:])

    def per_matrix(dtype, per_block=True):
        def make(p):
            if p is None:
                return None
            return torch.zeros(_unit_dims(cfg, p) if per_block else (), dtype=dtype, device=p.device)
        return _tree.tree_map(make, params)

    return SpectralSphereState(
        count=per_matrix(torch.int64, per_block=False), v=_tree.tree_map(block, params),
        lam=per_matrix(torch.float32), sigma=per_matrix(torch.float32), residual=per_matrix(torch.float32),
        iterations=per_matrix(torch.int32), fallback=per_matrix(torch.bool), fallbacks=per_matrix(torch.int64))


# ------------------------------------------------------------------------------ update
class _Unit(NamedTuple):
    """One sphere: leaf ``leaf``'s block ``rows, cols`` of its ``(m, n)`` rows (unit ``block``, or
    None: the whole leaf)."""

    leaf: int
    block: int | None
    rows: slice
    cols: slice


def _update(cfg: _Transform, updates, state: SpectralSphereState, params):
    m_leaves, spec = _tree.tree_flatten(updates)
    p_leaves = spec.flatten_up_to(params)
    fields = {f: spec.flatten_up_to(getattr(state, f)) for f in SpectralSphereState._fields}
    units, keys, out = [], [], [None] * len(m_leaves)
    for i, (g, p) in enumerate(zip(m_leaves, p_leaves)):
        if g is None:
            continue
        if g.ndim < 2:
            raise _not_matrix(g.shape, "spectral_sphere")
        m, n = _rows_shape(cfg, p)
        if m * n == 0:  # an empty matrix: no update, its state as it was
            out[i] = torch.zeros_like(p)
            continue
        blocks = _blocks_of(cfg, p)
        for j, (rows, cols) in enumerate([(slice(0, m), slice(0, n))] if blocks is None else blocks):
            units.append(_Unit(i, None if blocks is None else j, rows, cols))
            keys.append(((rows.stop - rows.start, cols.stop - cols.start), p.dtype, p.device))
    results: dict[tuple[int, int | None], dict[str, torch.Tensor]] = {}
    for members in group_by(keys):
        rows, n = keys[members[0]][0]
        size = max(1, _CHUNK_ELEMENTS // (rows * n))
        for k in range(0, len(members), size):
            chunk = [units[c] for c in members[k:k + size]]
            results.update(_chunk_step(cfg, chunk, m_leaves, p_leaves, fields))
    new = _assemble_leaves(cfg, m_leaves, p_leaves, fields, results, out)
    return _tree.tree_unflatten(spec, out), SpectralSphereState(
        **{f: _tree.tree_unflatten(spec, vals) for f, vals in new.items()})


def _pick(fields, field: str, unit: _Unit) -> torch.Tensor:
    value = fields[field][unit.leaf]
    if unit.block is None:
        return value
    lead = fields["lam"][unit.leaf].ndim  # the per-unit dims (lam has no others)
    return value.reshape((-1,) + tuple(value.shape[lead:]))[unit.block]


def _batch(mats: list[torch.Tensor]) -> torch.Tensor:
    """``(B, m, n)`` from B equal-shape matrices: a view for one, a stack (a copy) for more."""
    return mats[0].unsqueeze(0) if len(mats) == 1 else torch.stack(mats)


def _chunk_step(cfg: _Transform, chunk: list[_Unit], m_leaves, p_leaves, fields):
    """Phases 1–6 on a batch of equal-shape units (one call of the sphere operator); returns each
    unit's update and new statistics."""
    n = _rows_shape(cfg, p_leaves[chunk[0].leaf])[1]
    W = _batch([p_leaves[c.leaf].reshape(-1, n)[c.rows, c.cols].contiguous() for c in chunk])
    M = _batch([m_leaves[c.leaf].reshape(-1, n)[c.rows, c.cols].contiguous() for c in chunk])
    V0 = torch.stack([_pick(fields, "v", c) for c in chunk])
    lam0 = torch.stack([_pick(fields, "lam", c) for c in chunk]) if cfg.warm_lambda else None
    lr = _unit_lr(cfg, [fields["count"][c.leaf] for c in chunk], W.device)
    outs = torch.ops.muon_fn.spectral_sphere_step(W, M, V0, lam0, lr, cfg.key)
    return {(c.leaf, c.block): {f: x[k] for f, x in zip(STEP_OUTPUTS, outs)} for k, c in enumerate(chunk)}


def _unit_lr(cfg: _Transform, counts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The learning rate as a tensor: ``()``, or ``(B,)`` with a schedule (one count per leaf)."""
    if cfg.lr_schedule:
        return torch.stack([torch.as_tensor(cfg.lr(c), dtype=torch.float32, device=c.device) for c in counts])
    if isinstance(cfg.lr, torch.Tensor):
        return cfg.lr.reshape(())
    return torch.tensor(cfg.lr, dtype=torch.float64, device=device)


def _assemble_leaves(cfg: _Transform, m_leaves, p_leaves, fields, results, out):
    """Each leaf's update from its units' (joined as its view cut them) and its new state."""
    new = {f: list(vals) for f, vals in fields.items()}
    for i, (g, p) in enumerate(zip(m_leaves, p_leaves)):
        if g is None:
            continue
        new["count"][i] = fields["count"][i] + 1
        if out[i] is not None:  # empty: nothing else changes
            continue
        lead = tuple(fields["lam"][i].shape)  # the per-unit dims: () for one sphere
        split_leaf = len(lead) > 0
        parts = [results[(i, j)] for j in (range(fields["lam"][i].numel()) if split_leaf else (None,))]
        out[i] = _views.join([r["delta"] for r in parts], p, _views.view_of(cfg.view, p)).to(p.dtype)
        for field in _STATS:
            new[field][i] = torch.stack([r[field] for r in parts]).reshape(
                lead + tuple(parts[0][field].shape)) if split_leaf else parts[0][field]
        new["fallbacks"][i] = fields["fallbacks"][i] + new["fallback"][i].to(torch.int64)
    return new


