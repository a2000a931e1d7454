"""``MuonOptimizer``: the Muon recipe as ``torch.optim`` configuration (no math of its own), and
``HybridOptimizer``, the base it shares with ``SpectralSphereOptimizer`` (a matrix algorithm for
ndim ≥ 2, AdamW for the rest)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

import torch

from ..core import checks as _checks, defaults as _defaults
from ..core.alias import adamw, check_one_normalization, matrix_labels, muon
from ..core.base import GradientTransformation
from ..core.combine import partition
from ..core.muon import ADJUST_LR_FNS, check_iteration_dtype, refuse_callable_coefficients, resolve_method
from ..core.newton_schulz import COMPUTE_DTYPES, METHODS, default_steps, gemm_flops, validate_coefficients
from ..core.qk_clip import QKClip, check_tracked
from ..core import quantize as _quantize
from ..core.quantize import check_state_bits as check_state_bits_value
from ..core.transforms import MOMENTUM_KINDS
from ..engine import layout as _layout, torch_state as _torch_state, views as _views
from ..engine import Optimizer, step_not_traced
from ..engine import auto_halves
from ..engine.views import caller_level

ALGORITHMS = ("auto", "muon", "adamw")


class HybridOptimizer(Optimizer):
    """Base of :class:`MuonOptimizer` and :class:`muon_fn.SpectralSphereOptimizer`: a matrix
    algorithm for ndim ≥ 2 and AdamW for the rest in ``algorithm="auto"`` groups, with the AdamW
    learning rate ``adamw_lr · lr / base_lr`` so schedulers scale both halves alike."""

    algorithms: tuple[str, ...] = ALGORITHMS
    _extra_scalar_keys = ("adamw_lr",)
    # Group keys added after the first checkpoints, with the value that reproduces those:
    # before adamw_decay_1d existed the AdamW half decayed every parameter.
    _later_keys: ClassVar[dict[str, Any]] = {"adamw_decay_1d": True}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group``; warns once about parameters of ndim ≥ 3 whose matrix
        view had to be guessed (see ``matrix_view``). ``use_muon`` is accepted as in other Muon
        optimizers (KellerJordan's ``MuonWithAuxAdam``, distributed Muon): ``True`` is the matrix
        algorithm (``algorithms[1]``), ``False`` is ``algorithm="adamw"`` at the group's
        ``adamw_lr`` and ``adamw_weight_decay``, as an ``"auto"`` group runs its AdamW half."""
        use_muon = param_group.pop("use_muon", None)
        if use_muon is not None:
            param_group["algorithm"] = self.algorithms[1] if use_muon else "adamw"
            if not use_muon:
                for key, source in (("lr", "adamw_lr"), ("weight_decay", "adamw_weight_decay")):
                    param_group[key] = param_group.get(source, self.defaults[source])
        param_group.setdefault("base_lr", _number_or_none(param_group.get("lr", self.defaults["lr"])))
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if group["algorithm"] != "adamw":
            _, guessed = self._matrix_views(group)
            if guessed:
                names, params = self._param_names(group), group["params"]
                shown = [(f"#{i}" if names[i] is None else repr(names[i]), tuple(params[i].shape)) for i in guessed]
                _views.warn(_views.guess_warning(type(self).__name__, shown))

    def _check_groups(self) -> None:
        """A ``matrix_view`` mapping's keys each name a parameter of the groups that use it (a
        misspelled name would be ignored)."""
        super()._check_groups()
        users: dict[int, list[dict[str, Any]]] = {}
        for group in self.param_groups:
            if isinstance(group["matrix_view"], Mapping) and group["algorithm"] != "adamw":
                users.setdefault(id(group["matrix_view"]), []).append(group)
        for groups in users.values():
            names = [n for g in groups for n in self._param_names(g)]
            _views.refuse_unmatched(groups[0]["matrix_view"], names, "parameter of its groups")

    def _validate_group(self, group: dict[str, Any]) -> None:
        _checks.foreign_group_keys(group)
        super()._validate_group(group)  # lr and momentum, in torch's wording
        _checks.adamw_half(group)
        _checks.one_of("algorithm", group["algorithm"], self.algorithms)
        _views.check_spec(group["matrix_view"])

    def _matrix_views(self, group: dict[str, Any]) -> tuple[list[str], list[int]]:
        """Each parameter's matrix view, and the positions of those of ndim ≥ 3 that were guessed."""
        return _views.resolve(group["matrix_view"], group["params"], self._param_names(group), self._known_view)

    def _known_view(self, p: torch.Tensor) -> str | None:
        """The view ``p``'s module gives it when the optimizer knows the model (``model=``): a
        conv weight is flattened, any other parameter of ndim ≥ 3 is a stack of matrices
        (:func:`muon_fn.engine.views.module_views`); None otherwise."""
        return self.__dict__.get("_model_views", {}).get(id(p))

    def _param_options(self, group: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"matrix_view": view} for view in self._matrix_views(group)[0]]

    def load_state_dict(self, state_dict: dict[str, Any], *, allow_missing_state: bool = False) -> None:
        """torch's ``load_state_dict``; a group saved before ``matrix_view`` existed keeps this
        optimizer's, and one saved with the former ``split=None`` loads without it."""
        state_dict = _views.drop_unset_split(state_dict)
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        if isinstance(groups, list) and len(groups) == len(self.param_groups) and any(
                isinstance(g, dict) and "matrix_view" not in g for g in groups):
            groups = [g if "matrix_view" in g else {**g, "matrix_view": ours["matrix_view"]}
                      for g, ours in zip(groups, self.param_groups)]
            state_dict = {**state_dict, "param_groups": groups}
        state_dict = keep_storage(_with_later_keys(state_dict, self._later_keys), self.param_groups)
        state_dict = _with_current_keys(state_dict, self.param_groups, type(self).__name__)
        super().load_state_dict(state_dict, allow_missing_state=allow_missing_state)

    def _build(self, group: dict[str, Any], rt: Any, static_key: Any) -> None:
        super()._build(group, rt, static_key)
        convert_stored(self, group, rt)

    def _derived_scalars(self, group: dict[str, Any], scalars: dict[str, torch.Tensor]) -> None:
        # adamw_lr · lr / base_lr, on the device (lr may be a tensor; nothing is read back). A
        # group built with lr = 0 runs its AdamW half at adamw_lr whenever lr > 0.
        base = float(group.get("base_lr") or 0.0)
        lr, adamw_lr = scalars["lr"], scalars["adamw_lr"]
        ratio = lr / base if base > 0 else (lr > 0).to(lr.dtype)
        effective = scalars.get("adamw_lr_effective")
        if effective is None:
            scalars["adamw_lr_effective"] = effective = torch.zeros_like(lr)
        torch.mul(adamw_lr, ratio, out=effective)


def _number_or_none(lr: Any) -> float | None:
    """``float(lr)``; None for a value that is no number (``_validate_group`` refuses it, in
    torch's wording, before the group is used)."""
    try:
        return float(lr)
    except (TypeError, ValueError, RuntimeError):
        return None


class MuonOptimizer(HybridOptimizer):
    """Muon for matrices, AdamW for everything else, as one ``torch.optim`` optimizer.

    In a group with ``algorithm="auto"`` (the default) parameters with ndim ≥ 2 (conv weights
    flattened to (out, in·kh·kw)) get Muon: ``p ← p(1 − lr·wd) − lr·s(out, in)·msign(M)``; 0-/1-D
    parameters (biases, norm gains) get AdamW with ``adamw_betas``, ``adamw_eps`` and learning rate
    ``adamw_lr · lr / base_lr`` — so LR schedulers scale both halves alike (``base_lr`` is the
    group's ``lr`` at construction) — and no weight decay unless ``adamw_decay_1d=True``. Groups
    with ``algorithm="muon"`` or ``"adamw"`` use one algorithm with the group's own ``lr`` and
    ``weight_decay`` (this is what :func:`create_hybrid_optimizer` builds); in an ``"adamw"``
    group too, only parameters of ndim ≥ 2 decay unless ``adamw_decay_1d=True``.

    Every keyword of ``torch.optim.Muon`` has torch's meaning here (``weight_decay``,
    ``momentum``, ``nesterov``, ``ns_coefficients``, ``eps``, ``ns_steps``, ``adjust_lr_fn``), so a
    call spelling out torch's settings — ``ns_coefficients=(3.4445, -4.775, 2.0315), eps=1e-7,
    ns_steps=5, adjust_lr_fn=None, ns_dtype=torch.bfloat16`` — runs torch.optim.Muon's algorithm;
    the defaults differ: ``lr`` (0.02 here, 1e-3 there), ``weight_decay`` (0.01, 0.1) and, on CPUs
    without bf16 GEMMs, the iteration dtype (fp32 here, always bf16 there), so spell out the ones
    you rely on (tested against torch in fp32 to 1e-5, in bf16 to 4e-3 after 5 steps: torch
    casts to bf16 before taking the norm, muon_fn after). ``momentum`` must be < 1 and
    ``nesterov`` a bool. Positional arguments after ``lr`` raise ``TypeError``, so
    ``MuonOptimizer(p, 1e-3, 0.1)`` cannot set momentum where torch sets weight decay. A
    torch.optim.Muon ``state_dict`` loads
    directly when this optimizer's parameters are exactly its matrices; otherwise convert it with
    :func:`muon_fn.optim.from_torch_state_dict` (and back with :func:`to_torch_state_dict`).
    Loading one restores torch's hyperparameters and algorithm (``method=None`` with its
    ``ns_coefficients``, EMA momentum, no NorMuon); keys torch does not save (``ns_dtype``,
    ``momentum_dtype``, ``compile``, …) keep this optimizer's values. Older muon_fn checkpoints
    load with the rule they ran with: without ``adamuon_beta2``/``cautious_weight_decay``, with
    them off; without ``adamw_decay_1d``, with it ``True``; holding ``ns_eps``, with ``eps`` ←
    ``ns_eps`` and ``normuon_eps`` ← their ``eps``.

    Inside the compiled step the orthogonalization of each batch of equal-shape matrices is one
    operator (``torch.ops.muon_fn.orthogonalize_batch``) running the tuned iteration; inductor
    fuses the momentum, scaling, decay and the in-place update around it.

    The step is :func:`muon_fn.muon` (and :func:`muon_fn.adamw`) run through the generic
    :class:`muon_fn.Optimizer` apply: compiled by default, nothing read back from the device.

    Args:
      lr: Muon learning rate (0.02, Keller's default for the ``"original"`` shape rule).
      momentum: μ. ``momentum_kind="ema"`` (default, torch.optim.Muon's buffer) or ``"sgd"``.
      weight_decay: decoupled, ``p ← p(1 − lr·wd)``.
      nesterov: Nesterov momentum.
      ns_coefficients: ``None`` (default: ``method``'s schedule), torch.optim.Muon's flat
        ``(a, b, c)`` or one triple per iteration: then exactly that iteration runs (Frobenius
        normalization, no preconditioner, no safety factor), ``ns_steps`` times.
      eps: the Newton–Schulz normalization ``X / max(‖X‖_F, eps)`` (torch.optim.Muon's ``eps``).
      ns_steps: iterations; ``None`` (default): 5 with ``ns_coefficients`` (the length of a
        per-iteration list), else what ``method`` is designed for (5; 4 for ``"aol9"`` and ``"aol"``).
      adjust_lr_fn: shape rule ``None`` (= ``"original"``, torch's default), ``"original"``
        (alias ``"keller"``) √max(1, out/in), ``"match_rms_adamw"``, ``"spectral"``,
        ``"legacy"`` or ``"none"`` (see :func:`muon_fn.shape_scale`).
      method: ``None`` (default: :data:`muon_fn.core.newton_schulz.DEFAULT_METHOD`, ``"quintic"``, or
        the plain iteration of ``ns_coefficients``), ``"quintic"`` (torch.optim.Muon's quintic),
        ``"polar_express"``, ``"aol9"``, ``"you"``, ``"cubic"``, ``"aol"``, ``"gram"``, or a callable
        (see :func:`muon_fn.orthogonalize`). With ``ns_coefficients`` a named method keeps its
        preconditioner and form.
      ns_dtype: iteration dtype (default: bf16, fp32 on CPUs without bf16 GEMMs; torch.optim.Muon
        always iterates in bf16). ``ns_stepsize``: see :func:`muon_fn.orthogonalize`.
      beta2: ``None`` for Muon; a float enables NorMuon row normalization with ``normuon_eps``.
      adamuon_beta2: ``None`` (default) for Muon; a float enables AdaMuon (arXiv:2507.11005,
        :func:`muon_fn.adamuon`) with that β for its second moment. Recommended: the momentum's
        value (``adamuon_beta2=0.95`` at the default momentum), the authors' one β; any float
        keeps its meaning (0.999 was the first reference code's). The sign of the momentum is
        orthogonalized (``adamuon_sign=True``, the paper's current version; ``False``: the
        momentum itself, its first version, :func:`muon_fn.adamuon_nosign`), divided by the root
        of its element-wise second moment (state ``update_exp_avg_sq``, fp32, with
        ``adamuon_eps``) and rescaled to the size of an orthogonal matrix before the shape rule.
        ``adjust_lr_fn`` keeps its meaning: the default (``"original"``) gives Muon's step size,
        ``"match_rms_adamw"`` the paper's RMS-aligned update (RMS 0.2·lr: use an AdamW learning
        rate and decay). NorMuon and AdaMuon together raise ``ValueError``.
      cautious_weight_decay: Cautious Weight Decay (arXiv:2510.12402) in both halves: the decay
        ``lr·wd·p`` (Muon's ``weight_decay``, AdamW's ``adamw_weight_decay``) reaches only the
        coordinates where the update direction and the weight agree in sign. Default off.
      momentum_dtype: dtype of the momentum buffer (default: the parameter's), e.g. fp32 for
        bf16 parameters.
      state_bits: how the state is stored between steps: ``32`` (default: the momentum in
        ``momentum_dtype``, AdamW's moments in the parameter's dtype), ``16`` (bf16; AdamW's
        second moment as 16-bit codes), ``8`` or ``4`` (blockwise codes within rows with one fp32
        scale per block: the momentum and AdamW's first moment linear absmax, its second moment a
        small float relative to each block's maximum; :mod:`muon_fn.core.quantize`). The step
        dequantizes, updates in fp32 and requantizes inside its compiled graph; no full-precision copy is kept. 0-/1-D
        parameters, NorMuon's row statistics and AdaMuon's second moment stay fp32. A
        checkpoint of another width loads (converted; :meth:`muon_fn.Optimizer.load_state_dict`).
    ``momentum_dtype`` and ``state_bits`` ≠ 32 both set the momentum's storage: pass one.
      layerwise_norm: divide each Muon parameter's gradient by its own norm before the momentum
        (:func:`muon_fn.normalize_layerwise`; default off). The AdamW half sees the raw
        gradients: Adam's update already ignores the gradient's scale (up to ``adamw_eps``).
      matrix_view: how a parameter is read as matrices (:mod:`muon_fn.core.views`): ``"flatten"``
        (one ``(out, prod(rest))`` matrix: conv weights) or ``"experts"`` (leading dims are a
        batch: an MoE stack ``(E, out, in)`` is E matrices, each orthogonalized and scaled by its
        own shape) for every parameter of ndim ≥ 3 of the group; a mapping ``{name or glob
        pattern: view}`` over parameter names; or a function ``param -> view | None``. A head
        view :func:`muon_fn.heads` (row or column blocks: fused QKV, attention heads) names one
        parameter's layout, so it is accepted only per parameter (in a mapping or from a
        function), for a 2-D parameter too. ``None`` (default) reads a parameter of ndim ≥ 3 as
        ``"flatten"`` and warns once, naming it (:func:`create_hybrid_optimizer` knows the
        modules and warns about nothing). A group key like any other.
      adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: the AdamW half in ``"auto"`` groups.
      adamw_decay_1d: ``False`` (default): AdamW decays only parameters of ndim ≥ 2 (embeddings,
        an output head in an ``"adamw"`` group), never biases and norm gains, as nanoGPT and the
        Hugging Face Trainer do; ``True``: every AdamW parameter decays, as torch.optim.AdamW does
        with every parameter of a group. An ``"auto"`` group's AdamW half holds only 0-/1-D
        parameters, so there ``adamw_weight_decay`` acts only with ``adamw_decay_1d=True``.
      qk_clip: a :class:`muon_fn.QKClip` (or None, the default): after every update that
        changes the parameters (not an accumulation micro-step, not a skipped step), rescale the
        query and key rows of each attention head whose max logit exceeded τ, on the device.
        Its weights must be parameters of this optimizer. Not saved in ``state_dict``.
      gradient_accumulation_steps, nonfinite, compile, bucket_size, metrics: see :class:`muon_fn.Optimizer`.

    Keywords of other torch optimizers are accepted for drop-in use: ``foreach`` and ``fused`` with
    any value (the step batches and compiles its own kernels), ``maximize``, ``capturable`` and
    ``differentiable`` as False (True raises a ``ValueError`` that says why). Former names
    (``ns_eps``, ``split``) are refused with a ``TypeError`` that says what to use.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = _defaults.LR,
        *,
        momentum: float = _defaults.MOMENTUM,
        weight_decay: float = _defaults.WEIGHT_DECAY,
        nesterov: bool = True,
        ns_coefficients: Any = None,
        eps: float = 1e-7,
        ns_steps: int | None = None,
        adjust_lr_fn: str | None = None,
        method: Any = None,
        ns_dtype: torch.dtype | None = None,
        ns_stepsize: float = 1.0,
        beta2: float | None = None,
        normuon_eps: float = 1e-8,
        adamuon_beta2: float | None = None,
        adamuon_eps: float = 1e-8,
        adamuon_sign: bool = True,
        cautious_weight_decay: bool = False,
        momentum_kind: str = "ema",
        momentum_dtype: torch.dtype | None = None,
        state_bits: int = 32,
        layerwise_norm: bool = False,
        matrix_view: Any = None,
        adamw_lr: float = _defaults.ADAMW_LR,
        adamw_betas: tuple[float, float] = _defaults.ADAMW_BETAS,
        adamw_eps: float = _defaults.ADAMW_EPS,
        adamw_weight_decay: float = _defaults.ADAMW_WEIGHT_DECAY,
        adamw_decay_1d: bool = False,
        algorithm: str = "auto",
        qk_clip: QKClip | None = None,
        **options: Any,
    ) -> None:
        defaults = dict(
            lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov,
            ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
            method=method, ns_dtype=ns_dtype, ns_stepsize=ns_stepsize, beta2=beta2,
            normuon_eps=normuon_eps, adamuon_beta2=adamuon_beta2, adamuon_eps=adamuon_eps,
            adamuon_sign=adamuon_sign, cautious_weight_decay=cautious_weight_decay,
            momentum_kind=momentum_kind, momentum_dtype=momentum_dtype, state_bits=state_bits,
            layerwise_norm=layerwise_norm, matrix_view=matrix_view, adamw_lr=adamw_lr,
            adamw_betas=adamw_betas, adamw_eps=adamw_eps, adamw_weight_decay=adamw_weight_decay,
            adamw_decay_1d=adamw_decay_1d, algorithm=algorithm,
        )
        super().__init__(params, muon_factory, defaults, **options)  # the adapter's options: Optimizer's
        check_tracked(qk_clip, [p for g in self.param_groups for p in g["params"]], type(self).__name__)
        self.qk_clip = qk_clip

    _CONFIG = HybridOptimizer._CONFIG + ("qk_clip",)
    _converts_torch_state = True  # a refused torch checkpoint's message names from_torch_state_dict

    @step_not_traced
    def _post_step(self) -> None:
        """QK-Clip after an update that changed the parameters (see ``qk_clip``)."""
        clip, last = getattr(self, "qk_clip", None), self.last_step
        if clip is None or last is None or not last.applied:
            return
        ex = self._executor  # this rank's rows of each weight, and how the ranks' max logits combine
        clip.step(ex.qk_rows, enabled=None if self.nonfinite is None else last.finite, reduce=ex.qk_reduce)

    def _matrix_flops(self, group: dict[str, Any], shape: tuple[int, ...]) -> int:
        """Newton–Schulz GEMM FLOPs of one matrix under the group's orthogonalization settings (a
        callable ``method``: ``ns_steps`` quintic iterations)."""
        method = group["method"]
        steps = group["ns_steps"] or default_steps(method, None if callable(method) else group["ns_coefficients"])
        m, n = shape[0], math.prod(shape[1:])
        if callable(method):
            s, l = min(m, n), max(m, n)  # noqa: E741  the formula's s and l
            return steps * (4 * s * s * l + 2 * s**3)
        schedule, _ = resolve_method(method, steps, coefficients=group["ns_coefficients"],
                                     stepsize=group["ns_stepsize"])
        return gemm_flops((m, n), schedule)

    def _validate_group(self, group: dict[str, Any]) -> None:
        super()._validate_group(group)
        validate_muon_group(group)

    def load_state_dict(self, state_dict: dict[str, Any], *, allow_missing_state: bool = False) -> None:
        """torch's ``load_state_dict`` (see :meth:`muon_fn.Optimizer.load_state_dict`); a
        ``torch.optim.Muon`` state_dict loads directly when this optimizer's parameters are
        exactly that optimizer's (its matrices, group by group), through
        :func:`muon_fn.optim.from_torch_state_dict`; so does one that
        :func:`muon_fn.optim.from_torch_checkpoint` converted, with one warning naming the keys
        that keep this optimizer's values."""
        state_dict, unset = _torch_state.drop_unset(state_dict)
        if _torch_state.is_torch_muon_state_dict(state_dict):
            state_dict = _torch_state.from_torch(self, state_dict)
            kept = _torch_state.kept_values(unset, state_dict["param_groups"])
            if kept:
                warnings.warn(f"{type(self).__name__}.load_state_dict: a torch.optim.Muon checkpoint does not "
                              f"save these keys; they keep this optimizer's values: {'; '.join(kept)}",
                              UserWarning, stacklevel=caller_level())
        super().load_state_dict(_torch_state.upgrade_eps_keys(state_dict), allow_missing_state=allow_missing_state)

    # Checkpoints saved before these keys existed ran plain Muon with plain decay.
    _later_keys: ClassVar[dict[str, Any]] = {
        **HybridOptimizer._later_keys, "state_bits": 32, "layerwise_norm": False, "adamuon_beta2": None,
        "adamuon_eps": 1e-8, "adamuon_sign": True, "cautious_weight_decay": False}


# Group keys that say how this optimizer stores its state, not what it computes: a loaded
# checkpoint keeps the loading optimizer's values, and its state is converted to them
# (muon_fn.engine._state.cast_to_layout).
STORAGE_KEYS = ("state_bits",)


def keep_storage(state_dict: Any, groups: list[dict[str, Any]]) -> Any:
    """``state_dict`` with every saved group's :data:`STORAGE_KEYS` set to ``groups``' values."""
    saved = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
    if not isinstance(saved, list) or len(saved) != len(groups):
        return state_dict
    mine = [{k: g[k] for k in STORAGE_KEYS if k in g} for g in groups]
    return {**state_dict, "param_groups": [{**g, **own} if isinstance(g, dict) else g
                                           for g, own in zip(saved, mine)]}


def convert_stored(optimizer: Optimizer, group: dict[str, Any], rt: Any) -> None:
    """After a group's transforms are rebuilt (its ``state_bits`` changed, say), state stored at
    another width is converted to the new layout (:func:`muon_fn.core.quantize.convert`) instead of
    restarting from zero."""
    for bucket in rt.buckets:
        for k, i in enumerate(bucket.indices):
            st = optimizer.state.get(group["params"][i])
            if st:
                _quantize.convert(st, {slot.key: (slot.shape, slot.dtype) for slot in bucket.layout.slots
                                       if slot is not None and slot.index in (k, None)})


def _with_later_keys(state_dict: Any, later: dict[str, Any]) -> Any:
    """``state_dict`` with the group keys ``later`` (key: the value that reproduces a checkpoint
    saved before the key existed) filled in where a saved group lacks them."""
    groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
    if not isinstance(groups, list) or all(not isinstance(g, dict) or later.keys() <= g.keys() for g in groups):
        return state_dict
    return {**state_dict, "param_groups": [{**later, **g} if isinstance(g, dict) else g for g in groups]}


# Group keys that are not hyperparameters a checkpoint must carry: their absence means what torch
# makes of it (no LR scheduler had set initial_lr; a checkpoint at an accumulation window's
# boundary; no recorded layout), so none is taken from the loading optimizer.
_NOT_FILLED = frozenset({"params", "param_names", "initial_lr", "micro_step", _layout.KEY, _layout.STATELESS})


def _with_current_keys(state_dict: Any, groups: list[dict[str, Any]], owner: str) -> Any:
    """``state_dict`` with every group key that muon_fn adds to torch.optim.Muon's and that a
    saved Muon group (one with all of torch.optim.Muon's keys) lacks taken from the loading
    optimizer's group at its position, with one warning naming them. Other groups, and groups
    lacking one of torch's keys, pass as they are (the load checks them)."""
    saved = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
    if not isinstance(saved, list) or len(saved) != len(groups):
        return state_dict
    filled, out = [], []
    for i, (theirs, ours) in enumerate(zip(saved, groups)):
        if not isinstance(theirs, dict) or not set(_torch_state.TORCH_MUON_KEYS) <= theirs.keys():
            out.append(theirs)
            continue
        missing = [k for k in ours if k not in theirs and k not in _NOT_FILLED]
        filled += [f"group {i}: {k}={ours[k]!r}" for k in missing]
        out.append({**theirs, **{k: ours[k] for k in missing}})
    if not filled:
        return state_dict
    warnings.warn(f"{owner}.load_state_dict: the state_dict's param groups lack keys that muon_fn adds to "
                  f"torch.optim.Muon's; they keep this optimizer's values: {'; '.join(filled)}",
                  UserWarning, stacklevel=caller_level())
    return {**state_dict, "param_groups": out}


def validate_muon_group(group: dict[str, Any]) -> None:
    """The Muon-specific hyperparameters of a group (also the FSDP adapter's)."""
    steps = group["ns_steps"]
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ValueError(f"Invalid ns_steps value: {steps!r} (expected an integer >= 1, or None)")
    if group["method"] is not None and not callable(group["method"]):
        _checks.one_of("method", group["method"], METHODS)
    if group["ns_coefficients"] is not None:
        validate_coefficients(group["ns_coefficients"], name="ns_coefficients")
    _checks.one_of("adjust_lr_fn", group["adjust_lr_fn"], ADJUST_LR_FNS)
    _checks.one_of("momentum_kind", group["momentum_kind"], MOMENTUM_KINDS)
    _checks.boolean("nesterov", group["nesterov"])
    _checks.boolean("layerwise_norm", group["layerwise_norm"])
    if group["beta2"] is not None:
        _checks.momentum_value(group["beta2"], "beta2", ", or None for Muon")
    if group["adamuon_beta2"] is not None:
        _checks.momentum_value(group["adamuon_beta2"], "adamuon_beta2", ", or None for Muon")
    check_one_normalization(group["beta2"], group["adamuon_beta2"])
    _checks.boolean("adamuon_sign", group["adamuon_sign"])
    _checks.boolean("cautious_weight_decay", group["cautious_weight_decay"])
    for key in ("eps", "normuon_eps", "adamuon_eps", "ns_stepsize"):
        _checks.eps_value(key, group[key])
    for key, valid in (("ns_dtype", COMPUTE_DTYPES), ("momentum_dtype", COMPUTE_DTYPES)):
        if group[key] is not None:
            _checks.dtype(key, group[key], valid)
    check_state_bits(group)
    if group["algorithm"] != "adamw":  # the groups that build the recipe (muon_factory builds it unchecked)
        refuse_callable_coefficients(group["method"], group["ns_coefficients"])
        check_iteration_dtype(group["method"], group["ns_steps"], group["ns_coefficients"], group["ns_dtype"],
                              group["ns_stepsize"])


def check_state_bits(group: dict[str, Any]) -> None:
    """A group's ``state_bits`` (one of 32, 16, 8, 4), and not with a ``momentum_dtype``."""
    bits = group.get("state_bits", 32)
    check_state_bits_value(bits)
    if bits != 32 and group.get("momentum_dtype") is not None:
        raise ValueError(f"momentum_dtype={group['momentum_dtype']} and state_bits={bits} both set how the "
                         "momentum is stored; pass one of them (state_bits=16 stores it in bf16)")


def muon_factory(h: dict[str, Any]) -> GradientTransformation:
    """The transform of a :class:`MuonOptimizer` group from its hyperparameters, which
    ``_validate_group`` checked: the recipe is built without its checks (:func:`muon_fn.core.checks.checked`)."""

    def muon_tx():
        return muon.build(
            h["lr"], h["momentum"], nesterov=h["nesterov"], kind=h["momentum_kind"],
            method=h["method"], ns_steps=h["ns_steps"], ns_coefficients=h["ns_coefficients"],
            ns_dtype=h["ns_dtype"], eps=h["eps"], ns_stepsize=h["ns_stepsize"],
            adjust_lr_fn=h["adjust_lr_fn"], weight_decay=h["weight_decay"], beta2=h["beta2"],
            normuon_eps=h["normuon_eps"], adamuon_beta2=h["adamuon_beta2"], adamuon_eps=h["adamuon_eps"],
            adamuon_sign=h["adamuon_sign"], cautious_weight_decay=h["cautious_weight_decay"],
            view=h["matrix_view"] or "flatten", mu_dtype=h["momentum_dtype"], layerwise_norm=h["layerwise_norm"],
            state_bits=h.get("state_bits", 32),
        )

    return hybrid_transform(h, "muon", muon_tx, matrix_labels)


def hybrid_transform(h: dict[str, Any], name: str, matrix_tx: Callable[[], GradientTransformation],
                     labels: Any) -> GradientTransformation:
    """A :class:`HybridOptimizer` group's transform: ``matrix_tx()`` alone (``algorithm`` ``name``
    or an alias), AdamW alone (``"adamw"``, with the group's ``lr`` and ``weight_decay``), or both
    through :func:`muon_fn.partition` (``"auto"``: ``labels`` sends each leaf to ``name`` or
    ``"adamw"``; AdamW with the ``adamw_*`` settings)."""
    algorithm = h["algorithm"]
    if algorithm == "auto":
        halves = auto_halves(h, name)
        return partition({name: matrix_tx(), "adamw": hybrid_transform(halves["adamw"], name, matrix_tx, labels)},
                         labels)
    # cautious_weight_decay: MuonOptimizer's key (both halves); other hybrids decay plainly
    decay = {"decay_1d": h["adamw_decay_1d"], "cautious_weight_decay": h.get("cautious_weight_decay", False),
             "state_bits": h.get("state_bits", 32)}
    if algorithm == "adamw":
        return adamw.build(h["lr"], h["adamw_betas"], h["adamw_eps"], h["weight_decay"], **decay)
    return matrix_tx()
