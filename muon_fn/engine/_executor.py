"""How an optimizer's step runs where its parameters live: the optimizer's *executor*.

Every :class:`muon_fn.Optimizer` holds one (``optimizer._executor``). :class:`LocalExecutor`
runs the step on local tensors (:mod:`._step`); an optimizer that holds DTensors (at
construction, or swapped in later) is handed to the distributed executor of :mod:`muon_fn.fsdp`
(:func:`muon_fn.engine.distribute`), which replaces it. The optimizer's class never
changes: the groups, their checks, their transforms and the state stay the optimizer's; the
executor decides where each part of a transform runs.

:class:`Executor` is the interface both implement: the step, and what the optimizer asks at
the points where a distributed step differs (a group built, a group added, initial state, meta
tensors for a trace, a load, ``zero_grad``, QK-Clip's rows, a copy). Of its optimizer an
executor uses the groups and state (``param_groups``, ``state``, ``_runtime(i)``,
``_runtimes``, ``_group_hyper``, ``_param_options``, ``_param_names``, ``_name``), its
configuration (``_factory``, ``_compile_options``, ``_bucket_size``, ``verify``, ``nonfinite``,
``distributed_options``, ``_model``, ``_matrix_flops``), the guard and its counters
(``_stage``, ``_skip_notice``, ``_count_nonfinite``, ``_count_faults``, ``_nonfinite_params``),
telemetry (``_measure_now``, ``_keep_figures``, ``_labels``) and what a step reports
(``last_step``, ``_applied_steps``, ``last_step_stats``).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch


class Executor:
    """The step of an optimizer and its hooks (see the module docstring); the optimizer is held
    weakly (it holds its executor)."""

    distributed = False

    def __init__(self, opt: Any) -> None:
        self._opt = weakref.ref(opt)

    @property
    def opt(self) -> Any:
        """The optimizer this executor runs."""
        return self._opt()

    def step(self) -> None:
        raise NotImplementedError

    def check_new_group(self) -> None:
        """Called before ``add_param_group`` adds a group; raises if this executor cannot take one."""

    def initial_state(self, index: int) -> None:
        """Create group ``index``'s state now (gradient accumulation), not at its first update."""

    def built(self, rt: Any) -> None:
        """Group runtime ``rt``'s transforms and buckets were just built."""

    def meta(self, params: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Meta tensors like ``params`` (a DTensor's of its global shape), for construction-time traces."""
        return tuple(torch.empty(tuple(p.shape), dtype=p.dtype, device="meta") for p in params)

    def before_load(self) -> None:
        """Called first by ``load_state_dict``."""

    def after_load(self) -> None:
        """Called when ``load_state_dict`` has loaded."""

    def before_zero_grad(self) -> None:
        """Called first by ``zero_grad``."""

    def qk_rows(self, p: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The tensor QK-Clip scales for ``p`` and the global index of its first row."""
        return p, 0

    qk_reduce: Any = None  # how the ranks' max logits are combined (None: one process)

    def getstate(self) -> dict[str, Any] | None:
        """What a copy of the optimizer needs to run on an executor like this one (None: a local one)."""
        return None


class LocalExecutor(Executor):
    """The step on local tensors: :class:`~._step.StagedStep`'s, every bucket in place."""

    def step(self) -> None:
        self.opt._local_step()

    def initial_state(self, index: int) -> None:
        self.opt._local_initial_state(index)

    def meta(self, params: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Meta tensors like ``params`` (strides included); a DTensor's of its global shape."""
        from ._placement import is_dtensor

        return tuple(torch.empty(tuple(p.shape), dtype=p.dtype, device="meta") if is_dtensor(p)
                     else torch.empty_like(p, device="meta") for p in params)
