"""``TritonMuon`` and ``TritonMuonW``: the elementwise rule :func:`muon_fn.triton_muon` as
``torch.optim`` configuration (no math of its own). Despite the names (kept from the optimizers
they reproduce) neither orthogonalizes, and neither hand-writes a kernel: the compiled default
makes inductor fuse the rule (Triton on CUDA, C++ on CPU)."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch

from ..core import checks as _checks
from ..core.alias import TRITON_MUON_EPS, triton_muon
from ..core.base import GradientTransformation
from ..core.quantize import check_state_bits
from ..engine import Optimizer
from ._muon import convert_stored, keep_storage


class _ElementwiseOptimizer(Optimizer):
    """The shared body of :class:`TritonMuon` and :class:`TritonMuonW` (they differ only in
    where the weight decay goes, ``_decoupled``, and its default)."""

    _decoupled = False
    _extra_scalar_keys = ("velocity",)  # like lr and momentum: a 0-d tensor, schedulable

    def __init__(self, params: Iterable[Any], lr: float | torch.Tensor, momentum: float, velocity: float,
                 weight_decay: float, nesterov: bool, layerwise_norm: bool, *, eps: float, state_bits: int,
                 **options: Any) -> None:
        if "betas" in options:
            raise TypeError(f"{type(self).__name__}() got an unexpected keyword argument 'betas': "
                            "use momentum (beta1) and velocity (beta2)")
        defaults = dict(lr=lr, momentum=momentum, velocity=velocity, weight_decay=weight_decay,
                        nesterov=nesterov, layerwise_norm=layerwise_norm, eps=eps, state_bits=state_bits)
        # the adapter's options (gradient_accumulation_steps, nonfinite, compile, ...): Optimizer's
        super().__init__(params, functools.partial(elementwise_factory, decoupled=self._decoupled), defaults, **options)

    def _validate_group(self, group: dict[str, Any]) -> None:
        super()._validate_group(group)  # lr and momentum, in torch's wording
        _checks.momentum_value(group["velocity"], "velocity")
        _checks.decay_value("weight_decay", group["weight_decay"])
        _checks.eps_value("eps", group["eps"])
        _checks.boolean("nesterov", group["nesterov"])
        _checks.boolean("layerwise_norm", group["layerwise_norm"])
        check_state_bits(group.get("state_bits", 32))

    def _build(self, group: dict[str, Any], rt: Any, static_key: Any) -> None:
        super()._build(group, rt, static_key)
        convert_stored(self, group, rt)

    def load_state_dict(self, state_dict: dict[str, Any], *, allow_missing_state: bool = False) -> None:
        """torch's ``load_state_dict`` (see :meth:`muon_fn.Optimizer.load_state_dict`); the state of a
        checkpoint saved at another ``state_bits`` is converted to this optimizer's."""
        super().load_state_dict(keep_storage(state_dict, self.param_groups), allow_missing_state=allow_missing_state)


def elementwise_factory(h: dict[str, Any], *, decoupled: bool) -> GradientTransformation:
    """The transform of a :class:`TritonMuon` (or, ``decoupled``, :class:`TritonMuonW`) group."""
    # the group was checked (_validate_group): the recipe is built without its checks
    return triton_muon.build(h["lr"], h["momentum"], h["velocity"], weight_decay=h["weight_decay"],
                             decoupled=decoupled, nesterov=h["nesterov"], layerwise_norm=h["layerwise_norm"],
                             eps=h["eps"], state_bits=h.get("state_bits", 32))


class TritonMuon(_ElementwiseOptimizer):
    """An Adam-like elementwise optimizer with L2 weight decay (the signature and defaults of the
    original ``TritonMuon``, whose hand-written Triton kernels this reproduces).

    **It does not orthogonalize** — it is not Muon; for Muon use :class:`muon_fn.MuonOptimizer`.
    Per parameter, with β₁ = ``momentum`` and β₂ = ``velocity``::

        g ← g + weight_decay·θ       (L2 decay, added to the gradient)
        g ← g / (‖g‖ + 1e-8)         if layerwise_norm (per tensor: the sum is normalized)
        m ← β₁m + (1 − β₁)g,  v ← β₂v + (1 − β₂)g²
        θ ← θ − lr·m / (√v + eps)

    No bias correction: for a constant gradient the step is ``lr·(1 − β₁ᵗ)/√(1 − β₂ᵗ)`` per
    entry, longer than Adam's ``lr`` early on (3.2·lr at the first step, 6.6·lr near step 12,
    1.3·lr at step 1000 with the defaults). With ``nesterov`` the numerator is
    ``β₁m + (1 − β₁)g`` with the updated ``m``. The step is :func:`muon_fn.triton_muon` run through
    the generic :class:`muon_fn.Optimizer` apply: compiled by default (inductor fuses the rule
    into one kernel per bucket on CPU, a reduction kernel before it with ``layerwise_norm``),
    nothing read back from the device. State per parameter:
    ``step``, ``exp_avg`` (m) and ``exp_avg_sq`` (v), as torch.optim.Adam names them.

    Args:
      lr, momentum, velocity, weight_decay, nesterov, layerwise_norm: the original signature and
        defaults (``lr=1e-3``, β₁ 0.9, β₂ 0.999, no decay, no Nesterov, no normalization).
      eps: ε of the denominator, ``1e-8`` (keyword-only, after the original arguments).
      state_bits: how ``exp_avg`` and ``exp_avg_sq`` are stored between steps: 32 (default, the
        parameter's dtype), 16, 8 or 4 (blockwise within rows, :func:`muon_fn.scale_by_adam`);
        0-/1-D parameters keep fp32 moments.
      gradient_accumulation_steps, nonfinite, compile, bucket_size, metrics: see :class:`muon_fn.Optimizer`.

    ``lr``, ``momentum`` and ``velocity`` are per-step scalars (schedulers change them without a
    recompile), held as 0-d fp32 tensors (fp64 for fp64 parameters), as in every
    muon_fn optimizer: ``velocity=0.999`` acts as fp32(0.999). Errors use torch's wording:
    ``Invalid learning rate: -1.0``, ``Invalid momentum value: 1.0``, ``Invalid velocity value: 1.0``,
    ``Invalid weight_decay value: -0.1``.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-3,
        momentum: float = 0.9,
        velocity: float = 0.999,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        layerwise_norm: bool = False,
        *,
        eps: float = TRITON_MUON_EPS,
        state_bits: int = 32,
        **options: Any,
    ) -> None:
        super().__init__(params, lr, momentum, velocity, weight_decay, nesterov, layerwise_norm, eps=eps,
                         state_bits=state_bits, **options)


class TritonMuonW(_ElementwiseOptimizer):
    """:class:`TritonMuon` with decoupled weight decay (the original ``TritonMuonW``), default ``1e-2``.

    **It does not orthogonalize** — it is not Muon; for Muon use :class:`muon_fn.MuonOptimizer`.
    The same rule as :class:`TritonMuon` except the decay, which leaves the gradient and the
    moments alone and shrinks the weight (AdamW's form, ``lr`` unscaled by the moments)::

        θ ← θ − lr·m / (√v + eps) − lr·weight_decay·θ

    Arguments as :class:`TritonMuon`.
    """

    _decoupled = True

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-3,
        momentum: float = 0.9,
        velocity: float = 0.999,
        weight_decay: float = 1e-2,
        nesterov: bool = False,
        layerwise_norm: bool = False,
        *,
        eps: float = TRITON_MUON_EPS,
        state_bits: int = 32,
        **options: Any,
    ) -> None:
        super().__init__(params, lr, momentum, velocity, weight_decay, nesterov, layerwise_norm, eps=eps,
                         state_bits=state_bits, **options)
