"""``SpectralSphereOptimizer``: SSO for matrices, AdamW for the rest, on the ``muon_fn.Optimizer`` adapter."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
from torch import nn

from ..core import checks as _checks, defaults as _defaults
from ..core.base import GradientTransformation
from ..core.combine import leafwise_labels
from ..core.newton_schulz import COMPUTE_DTYPES
from ..core.sso import SETTINGS_KEYS, VALIDATED_KEYS, check_options, sso
from ..engine import auto_label
from ._muon import HybridOptimizer, check_state_bits, hybrid_transform

# "muon" is accepted as an alias of "sso" so groups built for MuonOptimizer (e.g. by
# muon_fn.split_parameters / create_hybrid_optimizer) work unchanged.
ALGORITHMS = ("auto", "sso", "muon", "adamw")
_STAT_KEYS = ("sso_sigma", "sso_lambda", "sso_residual", "sso_iterations", "sso_fallback", "sso_fallbacks")


class SolverReport(NamedTuple):
    """Per-matrix SSO statistics of the last step (tensors of shape ``(N,)``, N = SSO matrices):
    ``names``, ``sigma`` (σ(W) before the retraction), ``lam`` (λ*), ``residual`` (|h(λ*)|),
    ``iterations`` (msign calls), ``fallback`` (no bracket: λ = 0 this step), ``fallbacks`` (so
    far); :meth:`summary` gives scalars for logging."""

    names: list[str]  # parameter names (or "#i of shape (...)"); "name[j]" for unit j (expert, head block)
    sigma: torch.Tensor  # σ(W) before the retraction
    lam: torch.Tensor  # λ*
    residual: torch.Tensor  # |h(λ*)|, the tangency error
    iterations: torch.Tensor  # msign calls of the solver
    fallback: torch.Tensor  # bool: no bracket, λ = 0 this step
    fallbacks: torch.Tensor  # fallbacks so far

    def summary(self) -> dict[str, float]:
        """Scalars for logging: mean/max iterations, max residual, fallbacks this step and total."""
        if not self.names:
            return {}
        it = self.iterations.float()
        return {"iterations_mean": float(it.mean()), "iterations_max": float(it.max()),
                "residual_max": float(self.residual.max()), "fallbacks_step": int(self.fallback.sum()),
                "fallbacks_total": int(self.fallbacks.sum())}


class SpectralSphereOptimizer(HybridOptimizer):
    """The Spectral Sphere Optimizer (arXiv:2601.08393) as a ``torch.optim`` optimizer.

    Configuration only: each group runs :func:`muon_fn.sso` (``chain(momentum(ema),
    spectral_sphere)``) and AdamW through the generic :class:`muon_fn.Optimizer` apply. In a group
    with ``algorithm="auto"`` (the default) parameters with ndim ≥ 2 (conv weights flattened to
    (out, in·kh·kw)) get SSO: each step the weight is retracted to ``‖W‖₂ = R =
    radius_scale·√(out/in)`` and moved by ``lr·s·Φ`` along the steepest spectral direction tangent
    to that sphere. 0-/1-D parameters get AdamW with ``adamw_*``, as in
    :class:`muon_fn.MuonOptimizer` (the AdamW lr follows schedulers: ``adamw_lr · lr / base_lr``).
    Groups with ``algorithm="sso"`` (alias ``"muon"``) or ``"adamw"`` use one algorithm with the
    group's ``lr`` (and ``weight_decay`` for AdamW); :meth:`from_model` builds such groups with
    :func:`muon_fn.split_parameters` (embeddings and the output head go to AdamW).

    Args:
      lr, momentum, nesterov: see :func:`muon_fn.sso` (``lr`` is the relative spectral step with
        the default ``scale_mode="radius"``).
      weight_decay: only used by ``algorithm="adamw"`` groups (SSO's retraction undoes decay).
      radius_scale, scale_mode, retract_mode, retract_alpha, power_steps, power_block, cold_start,
        msign_method, msign_steps, msign_dtype, tol, max_iterations, bracket_step, max_expansions,
        solver, warm_lambda, lambda_model, model_steps, direction, muon_sphere: see
        :func:`muon_fn.spectral_sphere`.
      momentum_dtype: dtype of the momentum buffer (default: the parameter's).
      state_bits: how the momentum and AdamW's moments are stored between steps (32, 16, 8 or 4),
        as in :class:`muon_fn.MuonOptimizer`; SSO's warm-start block and statistics stay fp32.
      matrix_view: how a parameter is read as matrices, as in :class:`muon_fn.MuonOptimizer`
        (``"experts"``: each matrix of an ``(E, out, in)`` stack is its own sphere; a head view
        per parameter: each block is); :meth:`from_model` gives expert stacks ``"experts"`` by
        module.
      adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: the AdamW half in ``"auto"`` groups.
      adamw_decay_1d: whether AdamW decays 0-/1-D parameters too (default ``False``: only ndim
        ≥ 2), as in :class:`muon_fn.MuonOptimizer`.
      gradient_accumulation_steps, nonfinite, bucket_size, metrics: see :class:`muon_fn.Optimizer`.
      compile: compiled by default, as every adapter: SSO's per-matrix math is one opaque operator
        (eager inside, so the λ solver still exits early), and inductor compiles only the momentum,
        the stacking and the write-back around it. Measured on a 2-core Zen 3 (fp32, one thread):
        a cold compile costs 22–33 s of CPU (6 s warm, from inductor's cache) for a small MLP's 2–5
        bucket signatures, and the compiled step is 3–5 % faster than eager (38.6 vs 40.6 ms on
        12 × Linear(64, 64)); tracing the solver itself instead took 317 s of CPU for one 16×24
        matrix. ``compile=False`` runs the same operator eagerly.

    State per SSO matrix: ``momentum_buffer``, ``sso_count``, ``sso_v`` (warm-start block),
    ``sso_lambda``, ``sso_sigma``, ``sso_residual``, ``sso_iterations``, ``sso_fallback``,
    ``sso_fallbacks``; :meth:`last_step_stats` collects them. The step reads the device back only
    inside that operator, where the λ solver and model document it (their early exits; see
    ``muon_fn.core.sso``), compiled or not.
    """

    algorithms = ALGORITHMS

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = _defaults.LR,
        momentum: float = _defaults.MOMENTUM,
        nesterov: bool = True,
        *,
        weight_decay: float = _defaults.WEIGHT_DECAY,
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
        momentum_dtype: torch.dtype | None = None,
        state_bits: int = 32,
        matrix_view: Any = None,
        adamw_lr: float = _defaults.ADAMW_LR,
        adamw_betas: tuple[float, float] = _defaults.ADAMW_BETAS,
        adamw_eps: float = _defaults.ADAMW_EPS,
        adamw_weight_decay: float = _defaults.ADAMW_WEIGHT_DECAY,
        adamw_decay_1d: bool = False,
        algorithm: str = "auto",
        **options: Any,
    ) -> None:
        defaults = dict(
            lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
            radius_scale=radius_scale, scale_mode=scale_mode, retract_mode=retract_mode,
            retract_alpha=retract_alpha, power_steps=power_steps,
            power_block=power_block, cold_start=cold_start, msign_method=msign_method,
            msign_steps=msign_steps, msign_dtype=msign_dtype, tol=tol,
            max_iterations=max_iterations, bracket_step=bracket_step,
            max_expansions=max_expansions, solver=solver, warm_lambda=warm_lambda,
            lambda_model=lambda_model, model_steps=model_steps, direction=direction,
            muon_sphere=muon_sphere, momentum_dtype=momentum_dtype, state_bits=state_bits, matrix_view=matrix_view,
            adamw_lr=adamw_lr,
            adamw_betas=tuple(adamw_betas), adamw_eps=adamw_eps,
            adamw_weight_decay=adamw_weight_decay, adamw_decay_1d=adamw_decay_1d, algorithm=algorithm,
        )
        super().__init__(params, sso_factory, defaults, **options)  # the adapter's options: Optimizer's

    @classmethod
    def from_model(cls, model: nn.Module, lr: float = _defaults.LR, adamw_lr: float = _defaults.ADAMW_LR,
                   adamw_weight_decay: float = _defaults.ADAMW_WEIGHT_DECAY, **kwargs: Any) -> SpectralSphereOptimizer:
        """Hidden matrices → SSO, embeddings / output head / 0-/1-D → AdamW, one optimizer:
        :func:`muon_fn.create_hybrid_optimizer` with ``optimizer_cls=SpectralSphereOptimizer``
        (the split is kept as ``optimizer.split``)."""
        from ._hybrid import create_hybrid_optimizer

        return create_hybrid_optimizer(model, lr, adamw_lr, adamw_weight_decay, optimizer_cls=cls, **kwargs)

    def _validate_group(self, group: dict[str, Any]) -> None:
        super()._validate_group(group)  # lr, momentum and the AdamW half, in torch's wording
        # the recipe's own checks, but lr and momentum (checked above)
        check_options(nesterov=group["nesterov"], **{key: group[key] for key in SETTINGS_KEYS})
        check_state_bits(group)
        if group["algorithm"] in ("sso", "muon"):
            for p in group["params"]:
                if p.ndim < 2:
                    raise ValueError(
                        f"parameter {self._name(group, p)} is in an algorithm={group['algorithm']!r} "
                        f"group, but SSO needs a matrix (ndim >= 2), got ndim {p.ndim}; use "
                        "algorithm='auto' or put it in an 'adamw' group"
                    )
        if group["algorithm"] != "adamw":  # the groups that build the recipe (sso_factory builds it unchecked)
            _checks.dtype("msign_dtype", group["msign_dtype"], COMPUTE_DTYPES)

    def solver_stats(self) -> SolverReport:
        """The λ solver's statistics of the last step for every SSO matrix (see :class:`SolverReport`;
        also :meth:`last_step_stats`).

        Reading them as Python numbers syncs with the device; the tensors themselves do not.
        """
        names, cols = [], {k: [] for k in _STAT_KEYS}
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state.get(p, {})
                if "sso_sigma" not in st:
                    continue
                name = self._name(group, p).strip("'")
                blocks = st["sso_sigma"].numel()  # > 1 for an expert stack or a head view
                names += [name] if st["sso_sigma"].ndim == 0 else [f"{name}[{j}]" for j in range(blocks)]
                for k in _STAT_KEYS:
                    cols[k].append(st[k].reshape(-1))

        def stack(k, dtype):
            return torch.cat(cols[k]) if cols[k] else torch.zeros(0, dtype=dtype)

        return SolverReport(names, stack("sso_sigma", torch.float32), stack("sso_lambda", torch.float32),
                            stack("sso_residual", torch.float32), stack("sso_iterations", torch.int32),
                            stack("sso_fallback", torch.bool), stack("sso_fallbacks", torch.int64))

    last_step_stats = solver_stats  # the name of the Muon optimizers' per-step figures


def sso_factory(h: dict[str, Any]) -> GradientTransformation:
    """The transform of a :class:`SpectralSphereOptimizer` group from its hyperparameters: the
    :func:`muon_fn.sso` recipe, AdamW, or both through :func:`muon_fn.partition`."""

    def sso_tx():
        # The group's keys are the recipe's argument names (VALIDATED_KEYS: lr, momentum, nesterov
        # and spectral_sphere's settings); three more are passed by name. The group was checked
        # (_validate_group): the recipe is built without its checks.
        return sso.build(mu_dtype=h["momentum_dtype"], msign_dtype=h["msign_dtype"],
                         view=h["matrix_view"] or "flatten", state_bits=h.get("state_bits", 32),
                         **{key: h[key] for key in VALIDATED_KEYS})

    return hybrid_transform(h, "sso", sso_tx, _sso_labels)


def _sso_label(p: torch.Tensor) -> str:
    return auto_label(p, "sso")


_sso_labels = leafwise_labels(_sso_label)
