"""The torch.optim engine: one :class:`Optimizer` class that runs any functional transform behind
torch's optimizer interface (buckets, state as pytrees, the guard, the commit, checkpoints), and
its executor for local tensors. Imports :mod:`muon_fn.core` only.

This package's names are its interface, for the optimizer classes (:mod:`muon_fn.optimizers`), the
distributed executor (:mod:`muon_fn.distributed`) and the tools; no other subpackage imports one
of its private modules (``tests/test_layering.py``). Its public modules :mod:`~muon_fn.engine.views`
(per-parameter matrix views by module name), :mod:`~muon_fn.engine.layout` (a checkpoint's
recorded parameter layout) and :mod:`~muon_fn.engine.torch_state` (torch.optim.Muon's checkpoint
format) are the optimizer classes' too.

- **The optimizer**: :class:`Optimizer`, :data:`NONFINITE_POLICIES`, :class:`StepReport`,
  :func:`step_not_traced`.
- **Buckets** of same-shape parameters that one compiled call updates: :func:`buckets`,
  :data:`BUCKET_SIZE`; a group's distinct per-parameter options (:func:`variants`) and the meta
  scalars a construction-time trace builds its transform from (:func:`meta_scalars`);
  :class:`GroupRuntime`, what a group built for its step; a hybrid's ``algorithm="auto"`` group
  split in two (:func:`auto_label`, :func:`auto_halves`).
- **State** as pytrees and back: :class:`StateLayout` (built by :func:`build_layout`) and its
  :class:`Slot` entries; :func:`gather_state`, :func:`scatter_state`, :func:`state_complete`.
- **The guard**: :func:`finite_flags` (the gradients' non-finite flag, on the device),
  :func:`guarded` (a bucket's result kept only where its update is finite), :func:`masked`,
  :func:`compute_bucket` (one bucket's update, staged).
- **The commit**: :class:`Staged` results written in place by :func:`commit`; whether a tensor
  alone holds its memory, so it may be overwritten (:func:`sole`).
- **The executor** an optimizer runs its step through: :class:`Executor` (the interface, and what
  an executor may use of its optimizer), :class:`LocalExecutor` (local tensors).
- **The step's checks**: the gradient checks and their messages (:func:`refuse_sparse`,
  :func:`nonfinite_error`); where parameters live: :func:`is_dtensor`, :func:`distribute` and
  :func:`register_distributed` (the distributed executor, which registers itself here on import,
  takes over an optimizer holding DTensors), :func:`state_moves`; the distributed options every
  optimizer takes (:class:`DistributedOptions`, :data:`DISTRIBUTED_DEFAULTS`, :data:`STRATEGIES`,
  :data:`WIRE_DTYPES`).
"""

from __future__ import annotations

from ._adapter import BUCKET_SIZE, NONFINITE_POLICIES, GroupRuntime, Optimizer, buckets, meta_scalars, variants
from ._distributed import DEFAULTS as DISTRIBUTED_DEFAULTS
from ._distributed import STRATEGIES, WIRE_DTYPES, DistributedOptions
from ._executor import Executor, LocalExecutor
from ._apply import Staged, commit, compute_bucket, finite_flags, guarded, masked, sole
from ._placement import distribute, is_dtensor, state_moves
from ._placement import register as register_distributed
from ._state import Slot, StateLayout, build_layout
from ._state import complete as state_complete
from ._state import gather as gather_state
from ._state import scatter as scatter_state
from ._split import auto_halves, auto_label
from ._step import StepReport, nonfinite_error, refuse_sparse, step_not_traced

__all__ = [
    "Optimizer", "NONFINITE_POLICIES", "BUCKET_SIZE", "GroupRuntime", "buckets", "meta_scalars", "variants",  # buckets
    "auto_label", "auto_halves",  # the hybrid's split
    "StateLayout", "Slot", "build_layout", "gather_state", "scatter_state", "state_complete",  # state
    "finite_flags", "guarded", "masked", "compute_bucket", "Staged", "commit", "sole",  # the guard and the commit
    "Executor", "LocalExecutor",  # the executors
    "StepReport", "step_not_traced", "refuse_sparse", "nonfinite_error",  # the step
    "is_dtensor", "distribute", "register_distributed", "state_moves",  # placement
    "DistributedOptions", "DISTRIBUTED_DEFAULTS", "STRATEGIES", "WIRE_DTYPES",  # the distributed options
]
