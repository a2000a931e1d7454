"""Recipes: full optimizers wired only from the public transforms."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import checks as _checks, defaults as _defaults, quantize as _quantize
from .base import GradientTransformation, Scalar, ScalarOrSchedule
from .combine import chain, leafwise_labels, partition
from .newton_schulz import METHODS, validate_coefficients
from .muon import (ADJUST_LR_FNS, align_rms, check_iteration_dtype, check_view_argument, orthogonalize,
                   refuse_callable_coefficients, refuse_split, resolve_view, rule_of, scale_by_shape)
from .views import View
from .transforms import (add_decoupled_weight_decay, check_moments, momentum as momentum_tx, normalize_layerwise,
                         normalize_rows, scale_by_adam, scale_by_learning_rate, scale_by_second_moment, scale_by_sign)


def _check_muon(lr: Any, momentum: Any, *, nesterov: Any, kind: Any, method: Any, ns_steps: Any,
                ns_coefficients: Any, ns_dtype: Any, eps: Any, ns_stepsize: Any, adjust_lr_fn: Any,
                weight_decay: Any, cautious_weight_decay: Any, beta2: Any, normuon_eps: Any, adamuon_beta2: Any,
                adamuon_eps: Any, adamuon_sign: Any, view: Any, split: Any, mu_dtype: Any, flatten: Any,
                layerwise_norm: Any, state_bits: Any) -> None:
    """:func:`muon`'s arguments, each once, in the order the recipe and then its parts checked them."""
    check_view_argument(view, flatten)
    refuse_split(split)
    _checks.boolean("layerwise_norm", layerwise_norm)
    if ns_steps is not None:
        _checks.positive_int("ns_steps", ns_steps)
    _checks.positive("eps", eps)
    _checks.positive("normuon_eps", normuon_eps)
    _checks.positive("ns_stepsize", ns_stepsize)
    _checks.boolean("cautious_weight_decay", cautious_weight_decay)
    _check_adamuon(beta2, adamuon_beta2, adamuon_eps, adamuon_sign)
    _checks.one_of("adjust_lr_fn", adjust_lr_fn, ADJUST_LR_FNS)
    if ns_coefficients is not None:
        validate_coefficients(ns_coefficients, name="ns_coefficients")
    # the parts' arguments that the recipe does not check above, in the parts' order and words
    momentum_tx.check(momentum, nesterov=nesterov, kind=kind, mu_dtype=mu_dtype, state_bits=state_bits)
    refuse_callable_coefficients(method, ns_coefficients)
    if method is not None and not callable(method):
        _checks.one_of("method", method, METHODS)
    check_iteration_dtype(method, ns_steps, ns_coefficients, ns_dtype, ns_stepsize)
    if beta2 is not None:
        _checks.in_unit_interval("beta2", beta2)
    _checks.non_negative("weight_decay", weight_decay)
    _checks.scalar_or_schedule("lr", lr)


@_checks.checked(_check_muon)
def muon(
    lr: ScalarOrSchedule = _defaults.LR,
    momentum: Scalar = _defaults.MOMENTUM,
    *,
    nesterov: bool = True,
    kind: str = "sgd",
    method: str | Callable[[torch.Tensor], torch.Tensor] | None = None,
    ns_steps: int | None = None,
    ns_coefficients: Sequence[Sequence[float]] | Sequence[float] | None = None,
    ns_dtype: torch.dtype | None = None,
    eps: float = 1e-7,
    ns_stepsize: float = 1.0,
    adjust_lr_fn: str | None = "keller",
    weight_decay: Scalar = _defaults.WEIGHT_DECAY,
    cautious_weight_decay: bool = False,
    beta2: float | None = None,
    normuon_eps: float = 1e-8,
    adamuon_beta2: Scalar | None = None,
    adamuon_eps: float = 1e-8,
    adamuon_sign: bool = True,
    view: View = "flatten",
    split: None = None,
    mu_dtype: torch.dtype | None = None,
    flatten: bool | None = None,
    layerwise_norm: bool = False,
    state_bits: int = 32,
) -> GradientTransformation:
    """Muon for a tree of matrices.

    ``chain([normalize_layerwise if layerwise_norm], momentum, [scale_by_sign if AdaMuon],
    orthogonalize, [normalize_rows if beta2], [scale_by_second_moment, align_rms if AdaMuon],
    scale_by_shape, add_decoupled_weight_decay, scale_by_learning_rate)``: per matrix,
    ``p ← p(1 − lr·wd) − lr·s(out, in)·msign(M)``. Every leaf must be a matrix (ndim ≥ 2);
    use :func:`hybrid` for trees that also hold biases and norms. ``method=None`` is
    :data:`~muon_fn.core.newton_schulz.DEFAULT_METHOD`, or with ``ns_coefficients`` (torch's flat
    ``(a, b, c)`` or one triple per iteration) exactly that iteration; ``ns_steps=None`` runs the
    number of iterations the method is designed for (4 for ``"aol9"``, 5 for most, 5 for one
    triple). ``eps``: the Newton–Schulz normalization ``X / max(‖X‖_F, eps)`` (torch.optim.Muon's
    ``eps``); ``normuon_eps``: NorMuon's row normalization (with ``beta2``). ``adjust_lr_fn=None``
    is ``"original"`` (torch.optim.Muon's default). ``view`` (``"flatten"``, ``"experts"``, a head
    view :func:`muon_fn.heads` or ``leaf -> view``; ``flatten=`` is its older spelling) is what a
    matrix is, for the orthogonalization, the row normalization and the shape scale alike (see
    :func:`orthogonalize`). ``split`` is removed (a ``TypeError`` points to head views).
    ``layerwise_norm``: each matrix's gradient is divided by its own norm before it enters the
    momentum (:func:`normalize_layerwise`), so every step weighs the same in the buffer.
    ``state_bits``: the momentum's storage between steps (:func:`momentum`): 32 (``mu_dtype``),
    16 (bf16), 8 or 4 (blockwise absmax codes within rows, :mod:`muon_fn.core.quantize`); NorMuon's
    row statistics and AdaMuon's second moment stay fp32.
    ``cautious_weight_decay``: decay only where the update and the weight agree in sign
    (:func:`add_decoupled_weight_decay` ``cautious=True``, arXiv:2510.12402).
    ``adamuon_beta2``: a float enables AdaMuon (arXiv:2507.11005) with that β for its second
    moment; the authors use the momentum's β (``adamuon_beta2=momentum``, 0.95 here), which is
    what :func:`adamuon` passes. The momentum's sign is orthogonalized (``adamuon_sign=True``;
    ``False`` orthogonalizes the momentum itself, :func:`adamuon_nosign`), the result divided by
    the root of its element-wise second moment (:func:`scale_by_second_moment` with
    ``adamuon_eps``) and rescaled to the size of an orthogonal matrix (:func:`align_rms`) before
    the shape rule; the paper's RMS-aligned step is ``adjust_lr_fn="match_rms_adamw"`` (see
    :func:`adamuon`). NorMuon (``beta2``) and AdaMuon both normalize the orthogonalized update:
    pass one.
    """
    view = resolve_view(view, flatten)
    adamuon = adamuon_beta2 is not None
    parts = [normalize_layerwise.build()] if layerwise_norm else []
    parts.append(momentum_tx.build(momentum, nesterov=nesterov, kind=kind, mu_dtype=mu_dtype, state_bits=state_bits))
    parts += [scale_by_sign()] if adamuon and adamuon_sign else []
    parts.append(orthogonalize.build(method, ns_steps, coefficients=ns_coefficients, dtype=ns_dtype, eps=eps,
                                     stepsize=ns_stepsize, view=view))
    parts += [normalize_rows.build(beta2, normuon_eps, view=view)] if beta2 is not None else []
    if adamuon_beta2 is not None:
        parts += [scale_by_second_moment.build(adamuon_beta2, adamuon_eps), align_rms.build(view=view)]
    parts += [
        scale_by_shape.build(rule_of(adjust_lr_fn), view=view),
        add_decoupled_weight_decay.build(weight_decay, cautious=cautious_weight_decay),
        scale_by_learning_rate.build(lr),
    ]
    return chain(*parts)


def _check_adamuon(beta2: Any, adamuon_beta2: Any, adamuon_eps: Any, adamuon_sign: Any) -> None:
    """AdaMuon's arguments of :func:`muon` (one normalization of NorMuon's and AdaMuon's)."""
    check_one_normalization(beta2, adamuon_beta2)
    if adamuon_beta2 is not None:
        _checks.in_unit_interval("adamuon_beta2", adamuon_beta2)
    _checks.positive("adamuon_eps", adamuon_eps)
    _checks.boolean("adamuon_sign", adamuon_sign)


def check_one_normalization(beta2: Any, adamuon_beta2: Any) -> None:
    """NorMuon (``beta2``) and AdaMuon (``adamuon_beta2``) are two normalizations of the same
    orthogonalized update: refuse both at once."""
    if beta2 is not None and adamuon_beta2 is not None:
        raise ValueError(
            f"beta2={beta2!r} (NorMuon) and adamuon_beta2={adamuon_beta2!r} (AdaMuon) both normalize "
            "the orthogonalized update; pass one of them (the other None)")


def adamuon(
    lr: ScalarOrSchedule = 6e-4,
    momentum: Scalar = 0.95,
    beta2: Scalar | None = None,
    *,
    nesterov: bool = True,
    adjust_lr_fn: str = "match_rms_adamw",
    weight_decay: Scalar = 0.1,
    adamuon_eps: float = 1e-8,
    sign: bool = True,
    **muon_kwargs: Any,
) -> GradientTransformation:
    """AdaMuon (Si et al., *AdaMuon: Adaptive Muon Optimizer*, arXiv:2507.11005), per matrix:

    ::

        M ← momentum of G                       (Nesterov by default)
        O = msign(Sign(M))                      sign-stabilized orthogonal update (sign=True)
        V ← β·V + (1 − β)·O ⊙ O                 element-wise second moment, β = the momentum's
        Ô = O ⊘ (√V + eps)                      no bias correction
        p ← p(1 − lr·wd) − lr·γ·Ô,  γ = 0.2·√(mn) / ‖Ô‖_F    RMS-aligned: update RMS 0.2·lr

    ``chain(momentum, scale_by_sign, orthogonalize, scale_by_second_moment, align_rms,
    scale_by_shape("match_rms_adamw"), add_decoupled_weight_decay, scale_by_learning_rate)``
    (:func:`muon` with ``adamuon_beta2=beta2``): :func:`align_rms` gives Ô the Frobenius norm
    √min(m, n) of an orthogonal matrix and the shape rule multiplies by 0.2·√max(m, n), which is
    γ. The defaults are the authors' current algorithm and settings:

    - ``beta2=None``: the second moment uses the momentum's β (``momentum``, 0.95; a 0-d tensor
      momentum is shared, so a schedule moves both), as in the paper's Algorithm 1, which adds no
      hyperparameter to Muon's. A float sets its own β (0.999 was the first reference code's).
    - ``sign=True``: the sign before the orthogonalization (the paper from its second version on).
      ``sign=False`` is :func:`adamuon_nosign`.
    - ``lr=6e-4``, ``weight_decay=0.1``: the update's RMS is 0.2·lr, the RMS of an AdamW update at
      the same learning rate, so ``lr`` and ``weight_decay`` are an AdamW learning rate and decay;
      6e-4 and 0.1 are the authors' GPT-2 settings (nanoGPT's AdamW values), where the decay is
      ``p(1 − lr·wd)`` as here. Tune them as you would AdamW's: a smaller model or a shorter run
      takes a larger lr.

    ``adjust_lr_fn``: another shape rule in place of the RMS alignment's 0.2·√max(m, n) (e.g.
    ``"keller"``: Muon's step size and learning rate with AdaMuon's direction). ``adamuon_eps`` is
    the second moment's epsilon; ``eps`` (in ``muon_kwargs``) the Newton–Schulz one, as in
    :func:`muon`.
    """
    if beta2 is None:
        _checks.in_unit_interval("momentum", momentum)
        beta2 = momentum
    _checks.in_unit_interval("beta2", beta2)
    _checks.boolean("sign", sign)
    return muon(lr, momentum, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn, weight_decay=weight_decay,
                adamuon_beta2=beta2, adamuon_eps=adamuon_eps, adamuon_sign=sign, **muon_kwargs)


def adamuon_nosign(
    lr: ScalarOrSchedule = 6e-4,
    momentum: Scalar = 0.95,
    beta2: Scalar | None = None,
    **kwargs: Any,
) -> GradientTransformation:
    """AdaMuon without the sign: :func:`adamuon` with ``sign=False``, per matrix
    ``O = msign(M)`` (the momentum itself is orthogonalized, as in Muon), then the same element-wise
    second moment (β: the momentum's unless ``beta2`` is given), RMS alignment, decay and lr.

    This is the paper's first version (arXiv:2507.11005v1) and its first reference code's
    direction (that code also used β₂ 0.999 and bias correction, which the RMS alignment cancels
    except through ``eps``). The other keywords and the defaults are :func:`adamuon`'s; ``sign=``
    is not one of them.
    """
    if "sign" in kwargs:
        raise TypeError("adamuon_nosign() takes no sign= (it is adamuon(sign=False)); use adamuon(sign=...)")
    return adamuon(lr, momentum, beta2, sign=False, **kwargs)


def normuon(
    lr: ScalarOrSchedule = 0.01,
    momentum: Scalar = 0.95,
    beta2: float = 0.95,
    *,
    nesterov: bool = False,
    adjust_lr_fn: str = "spectral",
    weight_decay: Scalar = 0.01,
    normuon_eps: float = 1e-8,
    **muon_kwargs: Any,
) -> GradientTransformation:
    """NorMuon: Muon with neuron-wise (row) normalization after orthogonalization.

    Defaults follow microsoft/dion's NorMuon: lr 0.01, β₂ 0.95, no Nesterov, √(out/in) scaling,
    weight decay 0.01. ``normuon_eps`` is the row normalization's epsilon; ``eps`` (in
    ``muon_kwargs``) the Newton–Schulz one, as in :func:`muon`.
    """
    return muon(lr, momentum, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn,
                weight_decay=weight_decay, beta2=beta2, normuon_eps=normuon_eps, **muon_kwargs)


def _check_adamw(lr: Any, betas: Any, eps: Any, weight_decay: Any, *, decay_1d: Any, cautious_weight_decay: Any,
                 state_bits: Any) -> None:
    """:func:`adamw`'s arguments, in the order the recipe and then its parts checked them."""
    _checks.boolean("decay_1d", decay_1d)
    _checks.boolean("cautious_weight_decay", cautious_weight_decay)
    _checks.non_negative("weight_decay", weight_decay)
    _quantize.check_state_bits(state_bits)
    check_moments(betas, eps)
    _checks.scalar_or_schedule("lr", lr)


@_checks.checked(_check_adamw)
def adamw(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[Scalar, Scalar] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: Scalar = 0.01,
    *,
    decay_1d: bool = True,
    cautious_weight_decay: bool = False,
    state_bits: int = 32,
) -> GradientTransformation:
    """AdamW with torch.optim.AdamW's defaults and arithmetic (decoupled decay ``p(1 − lr·wd)``).

    ``decay_1d=False`` decays only leaves of ndim ≥ 2 (biases and norm gains keep their scale);
    the default decays every leaf, as torch.optim.AdamW does with every parameter of a group.
    ``cautious_weight_decay``: decay only where Adam's direction ``m̂/(√v̂ + eps)`` and the weight
    agree in sign (:func:`add_decoupled_weight_decay` ``cautious=True``, arXiv:2510.12402).
    ``state_bits``: the moments' storage (:func:`scale_by_adam`; 32, 16, 8 or 4).
    """
    decay = add_decoupled_weight_decay.build(weight_decay, min_ndim=0 if decay_1d else 2,
                                             cautious=cautious_weight_decay)
    return chain(scale_by_adam.build(betas, eps, state_bits=state_bits), decay, scale_by_learning_rate.build(lr))


# The epsilon of TritonMuon's denominator √v + ε (a keyword of triton_muon and the classes).
TRITON_MUON_EPS = 1e-8


def _check_triton_muon(lr: Any, momentum: Any, velocity: Any, *, weight_decay: Any, decoupled: Any, nesterov: Any,
                       layerwise_norm: Any, eps: Any, state_bits: Any) -> None:
    """:func:`triton_muon`'s arguments, in the order the recipe and then its parts checked them."""
    _checks.in_unit_interval("momentum", momentum)
    _checks.in_unit_interval("velocity", velocity)
    _checks.non_negative("weight_decay", weight_decay)
    _checks.positive("eps", eps)
    for name, flag in (("decoupled", decoupled), ("nesterov", nesterov), ("layerwise_norm", layerwise_norm)):
        _checks.boolean(name, flag)
    _quantize.check_state_bits(state_bits)
    _checks.scalar_or_schedule("lr", lr)


@_checks.checked(_check_triton_muon)
def triton_muon(
    lr: ScalarOrSchedule = 1e-3,
    momentum: Scalar = 0.9,
    velocity: Scalar = 0.999,
    *,
    weight_decay: Scalar = 0.0,
    decoupled: bool = False,
    nesterov: bool = False,
    layerwise_norm: bool = False,
    eps: float = TRITON_MUON_EPS,
    state_bits: int = 32,
) -> GradientTransformation:
    """The elementwise rule of :class:`~muon_fn.TritonMuon` (``decoupled=False``) and
    :class:`~muon_fn.TritonMuonW` (``decoupled=True``). It does not orthogonalize: it is an
    Adam-like rule, not Muon (for Muon see :func:`muon` and :class:`~muon_fn.MuonOptimizer`).

    Per tensor, with β₁ = ``momentum`` and β₂ = ``velocity``::

        g ← g + wd·θ                         L2 decay (decoupled=False)
        g ← g / (‖g‖ + 1e-8)                 if layerwise_norm
        m ← β₁m + (1 − β₁)g,  v ← β₂v + (1 − β₂)g²
        θ ← θ − lr·m̃ / (√v + eps) − lr·wd·θ  (the decay term only if decoupled)

    with ``m̃ = m``, or ``β₁m + (1 − β₁)g`` (the updated ``m``) with ``nesterov``. No bias
    correction. As the original TritonMuon's layer-wise kernel, the L2 term is added before
    the normalization, which sees their sum. ``chain([add_decoupled_weight_decay],
    [normalize_layerwise(add_eps=True)], scale_by_adam((momentum, velocity), eps,
    bias_correction=False, nesterov=...), [add_decoupled_weight_decay], scale_by_learning_rate)``:
    the decay transform before the moments is L2 regularization, after them decoupled decay.
    ``state_bits``: the moments' storage (:func:`scale_by_adam`; 32, 16, 8 or 4).
    """
    moments = scale_by_adam.build((momentum, velocity), eps, bias_correction=False, nesterov=nesterov,
                                  state_bits=state_bits)
    decay = add_decoupled_weight_decay.build(weight_decay)
    parts = [] if decoupled else [decay]
    parts += [normalize_layerwise.build(add_eps=True)] if layerwise_norm else []
    parts += [moments, decay] if decoupled else [moments]
    return chain(*parts, scale_by_learning_rate.build(lr))


def _matrix_label(p: torch.Tensor) -> str:
    return "muon" if p.ndim >= 2 else "adamw"


matrix_labels = leafwise_labels(_matrix_label)
matrix_labels.__name__ = "matrix_labels"
matrix_labels.__doc__ = """``"muon"`` for leaves with ndim ≥ 2, ``"adamw"`` for the rest (the default hybrid split)."""


def _check_hybrid(lr: Any, momentum: Any, *, adamw_lr: Any, adamw_betas: Any, adamw_eps: Any, adamw_weight_decay: Any,
                  adamw_decay_1d: Any, cautious_weight_decay: Any, labels: Any, state_bits: Any,
                  muon_kwargs: dict[str, Any]) -> None:
    """:func:`hybrid`'s arguments: ``adamw_lr``, the Muon half's (:func:`muon`'s check), then the
    AdamW half's that the Muon half does not share, in its parts' words."""
    _checks.scalar_or_schedule("adamw_lr", adamw_lr)
    muon.check(lr, momentum, cautious_weight_decay=cautious_weight_decay, state_bits=state_bits, **muon_kwargs)
    _checks.boolean("decay_1d", adamw_decay_1d)
    _checks.non_negative("weight_decay", adamw_weight_decay)
    check_moments(adamw_betas, adamw_eps)


@_checks.checked(_check_hybrid)
def hybrid(
    lr: ScalarOrSchedule = _defaults.LR,
    momentum: Scalar = _defaults.MOMENTUM,
    *,
    adamw_lr: ScalarOrSchedule = _defaults.ADAMW_LR,
    adamw_betas: tuple[Scalar, Scalar] = _defaults.ADAMW_BETAS,
    adamw_eps: float = _defaults.ADAMW_EPS,
    adamw_weight_decay: Scalar = _defaults.ADAMW_WEIGHT_DECAY,
    adamw_decay_1d: bool = False,
    cautious_weight_decay: bool = False,
    labels: Any = None,
    state_bits: int = 32,
    **muon_kwargs: Any,
) -> GradientTransformation:
    """Muon on matrices, AdamW on everything else, via :func:`partition`.

    ``labels`` (a tree of ``"muon"``/``"adamw"`` or a function of the params) overrides the
    default ndim rule (:func:`matrix_labels`) — e.g. to send embeddings and the output head to AdamW.
    ``adamw_weight_decay`` decays the AdamW leaves of ndim ≥ 2 (embeddings, a head); 0-/1-D leaves
    (biases, norm gains) decay only with ``adamw_decay_1d=True``. ``cautious_weight_decay``
    makes both halves' decay cautious (see :func:`add_decoupled_weight_decay`). ``state_bits``
    stores both halves' state in 32, 16, 8 or 4 bits (:func:`momentum`, :func:`scale_by_adam`).
    """
    return partition(
        {"muon": muon.build(lr, momentum, cautious_weight_decay=cautious_weight_decay, state_bits=state_bits,
                            **muon_kwargs),
         "adamw": adamw.build(adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay, decay_1d=adamw_decay_1d,
                              cautious_weight_decay=cautious_weight_decay, state_bits=state_bits)},
        matrix_labels if labels is None else labels,
    )
