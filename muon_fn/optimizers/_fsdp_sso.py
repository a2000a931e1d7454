"""``FSDPSpectralSphereOptimizer``: :class:`muon_fn.SpectralSphereOptimizer` on FSDP2
(``fully_shard``) models, run by the distributed executor (:mod:`._executor`). Configuration only."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn

from ._sso import SpectralSphereOptimizer
from ..distributed import check_model


class FSDPSpectralSphereOptimizer(SpectralSphereOptimizer):
    """:class:`muon_fn.SpectralSphereOptimizer` for FSDP2-sharded (or DDP-replicated) models.

    The recipe is SpectralSphereOptimizer's (:func:`muon_fn.sso`: EMA momentum, then
    :func:`muon_fn.spectral_sphere`), split by the FSDP adapter: the momentum runs on each rank's
    rows; the rows of the direction ``M`` and of the weight ``W`` travel to the matrix's owner
    (``2·in`` columns), which runs ``spectral_sphere`` on whole matrices, one call per bucket of
    the single-device optimizer, and returns each rank's rows of the update (``in`` columns); the
    owner's per-matrix state (warm-start block, λ*, σ, solver statistics) reaches every rank's
    copy by one all-reduce. 0-/1-D parameters get AdamW on local rows. Results equal
    single-device SpectralSphereOptimizer with the same settings bit for bit (``strategy="owner"``
    or ``"replicate"``, eager or compiled alike).

    The warm-start block is made from the whole weight on the first step, as single-device
    SpectralSphereOptimizer makes it (one all-gather of each SSO matrix, once); a loaded state
    dict is kept as it is.

    Args:
      model, params, strategy, wire_dtype, num_buckets, overlap, process_group, inflight_bytes: as
        :class:`muon_fn.fsdp.FSDPMuonOptimizer` (``use_muon=True`` groups get SSO,
        ``use_muon=False`` AdamW at the group's ``adamw_lr`` and ``adamw_weight_decay``).
      lr, momentum, nesterov, **sso_options: SpectralSphereOptimizer's, with its meaning and
        defaults (``radius_scale``, ``power_steps``, ``tol``, ``muon_sphere``, ``matrix_view``,
        ``adamw_*``, ``nonfinite``, ``compile``, ...).

    ``last_step_stats`` holds this rank's exchange figures (see
    :class:`muon_fn.fsdp.FSDPMuonOptimizer`); :meth:`solver_stats` the λ solver's statistics of
    every SSO matrix, the same on every rank.
    """

    algorithms = SpectralSphereOptimizer.algorithms

    def __init__(
        self,
        model: nn.Module,
        params: Iterable[Any] | None = None,
        lr: float | torch.Tensor = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        *,
        gradient_accumulation_steps: int = 1,
        **sso_options: Any,
    ) -> None:
        check_model(model)
        if params is None:  # frozen parameters never get gradients: leave them out of the plan
            params = [p for p in model.parameters() if p.requires_grad]
        super().__init__(params, lr, momentum, nesterov,
                         gradient_accumulation_steps=gradient_accumulation_steps, model=model, **sso_options)

    _always_distributed = True  # plain tensors are replicated parameters of the plan
