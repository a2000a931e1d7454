"""``FSDPMuonOptimizer``: :class:`muon_fn.MuonOptimizer` on FSDP2 (``fully_shard``) models, run by
the distributed executor (:mod:`._executor`). Configuration only: MuonOptimizer's groups, checks,
factory and options, the model, and the distributed executor from construction."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch.nn as nn

from ..core import defaults as _defaults
from ._muon import MuonOptimizer
from ..distributed import check_model


class FSDPMuonOptimizer(MuonOptimizer):
    """:class:`muon_fn.MuonOptimizer` for FSDP2-sharded (or DDP-replicated) models.

    Results equal single-device :class:`muon_fn.MuonOptimizer` with the same settings bit for bit
    (``strategy="owner"`` or ``"replicate"``, eager or compiled alike): the transforms are
    MuonOptimizer's, each bucket of same-shape matrices is orthogonalized whole on one rank, as
    single-device MuonOptimizer batches it, and the elementwise parts run on each rank's rows.
    Defaults are MuonOptimizer's (:mod:`muon_fn.core.defaults`: one value per hyperparameter).

    Args:
      model: the module whose parameters are optimized (wrapped with ``fully_shard``, any
        nesting, 1-D mesh or HSDP; a plain module's parameters are treated as replicated).
      params: parameters or param-group dicts (default: the model's parameters that require
        grad). Groups take MuonOptimizer's keys: ``algorithm`` ``"auto"`` (default: Muon for
        ndim ≥ 2, AdamW at ``adamw_lr·lr/base_lr`` for the rest), ``"muon"`` or ``"adamw"`` (the
        group's own ``lr`` and ``weight_decay``). ``use_muon`` is accepted too: ``True`` is
        ``algorithm="muon"``, ``False`` is ``algorithm="adamw"`` at the group's ``adamw_lr`` and
        ``adamw_weight_decay``.
      lr, weight_decay, momentum, nesterov, ns_steps, ns_stepsize, beta2, eps: as in
        MuonOptimizer (``eps`` is the Newton–Schulz epsilon, torch.optim.Muon's; ``beta2`` a
        float enables NorMuon, with ``normuon_eps``).
      gradient_accumulation_steps: ``k``; call ``step()`` after every micro-batch: FSDP2 gradient
        sync is off for the first ``k − 1`` backward passes and on for the last, whose reduced
        gradient (divided by ``k``) is applied. Requires a ``fully_shard`` model when ``k > 1``.
      strategy, wire_dtype, num_buckets, overlap, process_group, inflight_bytes: the distributed
        options, which every optimizer class takes (:class:`muon_fn.Optimizer`), with the same defaults:
      strategy: ``"owner"`` (default: each matrix computed once, on its owner) or ``"replicate"`` (every
        rank all-gathers and computes every matrix; the baseline).
      wire_dtype: dtype of the rows on the wire (``torch.bfloat16`` halves the bytes; rounds them).
      num_buckets: exchanges per step (communication of later buckets overlaps computation); the
        least: ``inflight_bytes`` may cut more.
      inflight_bytes: the bytes a rank holds at once for the exchange (default 8 MiB; ``None``:
        no bound): the step runs bucket by bucket (:mod:`muon_fn.distributed._stream`), each bucket at
        most half of it on any rank (``_budget.held_bytes``) but one unit per owner at least; the
        next bucket travels while one is computed where both fit, else one bucket at a time, each
        freed before the next is packed. A bucket is never less than one batch of the single-device optimizer, so
        results stay the same bit for bit. With ``overlap=True`` every bucket is posted during backward (not bounded).
      overlap: start each bucket's exchange during backward, as soon as FSDP2 has reduced its
        gradients (its pre phase runs then, its gather is posted); ``step()`` posts what is left,
        waits and computes. Results are the same bit for bit. Needs ``strategy="owner"``; plain
        (replicated) matrices are exchanged by ``step()``. Gradients must not change between
        backward and ``step()`` (no clipping or editing in between; a replaced gradient is
        detected and that step runs without overlap, with a warning). The hooks and a process
        group of the optimizer's ranks are made in ``__init__`` (see ``docs/distributed.md``).
      process_group: the group to use for plain (replicated) parameters; must match the
        DTensor parameters' shard group if given.
      **muon_options: every other keyword of MuonOptimizer (``method``, ``adjust_lr_fn``,
        ``ns_dtype``, ``momentum_kind``, ``matrix_view``, ``adamw_*``, ``nonfinite``,
        ``compile``, ``bucket_size``, ...), with its meaning and default, except that the model
        is known: a parameter of ndim ≥ 3 that ``matrix_view`` does not name is flattened if a
        conv module owns it and is an expert stack otherwise (the owner computes it whole), with
        no warning. ``qk_clip`` (a :class:`muon_fn.QKClip` built after ``fully_shard``): the
        ranks' recorded logits are max-reduced over all ranks, then each rank scales its shards'
        rows, each row's head found from the shard's global row offset. ``compile`` compiles
        the pre and post phases per bucket and the owner's mid phase per bucket;
        ``nonfinite="skip"`` decides on
        the device after one tiny all-reduce of a flag, so a step skipped for an inf/nan on any
        rank is skipped on every rank.

    A parameter whose ``.grad`` is ``None`` on a rank still joins every exchange (with zeros), so
    nothing hangs; that rank leaves the parameter and its state unchanged.

    After each step ``last_step_stats`` holds this rank's figures: ``bytes_sent``,
    ``bytes_received``, ``ns_flops``, ``matrices_computed``, ``comm_wait_s``, ``compute_s``,
    ``step_s``, ``applied``.

    A stack sharded on its expert dim is planned per expert: every rank computes the whole
    experts it holds and none of its elements travel (``describe()`` marks it ``local``; Muon,
    whose matrix parts are ``per_matrix``; NorMuon's and SSO's stacks keep an owner). Head views
    work as in MuonOptimizer (the owner computes every block). ``metrics=`` gives every rank the
    same figures (two small all-reduces per measured step; ``metrics()`` itself needs no
    collective, so rank 0 may call it alone); a measured step runs without ``overlap``. The
    non-finite guard runs in each phase on what that phase writes, and an owner whose bucket
    gives a non-finite result returns it all NaN, so that every rank keeps its rows of those
    matrices back alike. ``bucket_size`` sets the owner units (same-shape matrices one owner
    computes together); ``None``: on the CPU the single-device buckets, at most 4 and within the
    CPU policy's byte bound (at most 8 MiB and no more bytes than the group's largest matrix, but
    at least 1 MiB or one matrix: in fp32 gpt2-small's 768² matrices go three to an owner, its
    768×3072 ones one each); elsewhere at most 4, no byte bound. ``unshard_params()`` is a context
    manager with full parameters inside. Both FSDP optimizers support ``copy.deepcopy`` and
    pickle (the copy carries the model and rebuilds the plan); one built with an explicit
    ``process_group`` cannot be copied (``TypeError``).
    """

    def __init__(
        self,
        model: nn.Module,
        params: Iterable[Any] | None = None,
        lr: float = _defaults.LR,
        weight_decay: float = _defaults.WEIGHT_DECAY,
        momentum: float = _defaults.MOMENTUM,
        nesterov: bool = True,
        ns_steps: int | None = None,
        ns_stepsize: float = 1.0,
        beta2: float | None = None,
        eps: float = 1e-7,
        gradient_accumulation_steps: int = 1,
        **muon_options: Any,
    ) -> None:
        check_model(model)
        if params is None:  # frozen parameters never get gradients: leave them out of the plan
            params = [p for p in model.parameters() if p.requires_grad]
        super().__init__(params, lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov,
                         ns_steps=ns_steps, ns_stepsize=ns_stepsize, beta2=beta2, eps=eps,
                         gradient_accumulation_steps=gradient_accumulation_steps, model=model, **muon_options)

    _always_distributed = True  # plain tensors are replicated parameters of the plan
