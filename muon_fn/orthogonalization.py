"""Newton–Schulz orthogonalization as muon_fn runs it, under public names: what a tool that measures
it (the benchmarks of :mod:`muon_fn.tools.bench`) or a user who inspects it reads, without the
private modules that implement it (``muon_fn.core.newton_schulz``, ``muon_fn.core.execution``).

- **Schedules**: :func:`coefficient_schedule` (a method's polynomial rows, one per iteration),
  :func:`default_steps`, :data:`DEFAULT_METHOD`, :func:`norm_scale` (the pre-normalization's
  factor on ‖X‖_F).
- **Cost**: :func:`gemm_flops`, the dense GEMM FLOPs of orthogonalizing one matrix.
- **Execution** on a device: its products (:func:`for_device`) and the iteration through them
  (:func:`gram_matrix`, :func:`iterate`), the default dtype (:func:`default_compute_dtype`,
  :data:`CPU_HAS_BF16_GEMM`), the scratch eager calls keep (:func:`clear_scratch`), the
  execution policy (:func:`policy`, :func:`forced`, :data:`POLICIES`, :class:`ExecutionPolicy`),
  same-shape parameters per compiled call (:func:`bucket_limit`) and whether the optimizers'
  ``compile=True`` compiles here (:func:`compiles`).

To orthogonalize, use :func:`muon_fn.orthogonalize` (a transform) or :func:`muon_fn.newton_schulz`
(a function); this module is for looking inside.
"""

from __future__ import annotations

from typing import Any

from .core import compile as _compile, execution as _execution, newton_schulz as _newton_schulz
from .core.execution import ExecutionPolicy, bucket_limit, forced, policy
from .core.newton_schulz import (clear_scratch, coefficient_schedule, default_compute_dtype, default_steps, for_device,
                                 gemm_flops, gram_matrix, iterate, norm_scale)

__all__ = [
    "coefficient_schedule", "default_steps", "DEFAULT_METHOD", "norm_scale",  # schedules
    "gemm_flops",  # cost
    "for_device", "gram_matrix", "iterate", "default_compute_dtype", "CPU_HAS_BF16_GEMM", "clear_scratch",  # execution
    "policy", "forced", "POLICIES", "ExecutionPolicy", "bucket_limit", "compiles",  # the policy, compiling
]

DEFAULT_METHOD = _newton_schulz.DEFAULT_METHOD
"""The method :func:`muon_fn.orthogonalize` and the optimizers run when none is given."""

CPU_HAS_BF16_GEMM = _newton_schulz.CPU_HAS_BF16_GEMM
"""Whether this CPU has bf16 dot-product instructions (read once, at import): without them its bf16
GEMMs are emulated, and :func:`default_compute_dtype` is fp32 on the CPU."""

POLICIES = _execution.POLICIES
"""The execution policies by name: ``"cpu"`` and ``"batched"`` (CUDA and other accelerators)."""


def compiles(compile: Any = True) -> bool:
    """Whether an optimizer given ``compile`` (its ``compile=`` option: a bool or a dict of
    ``torch.compile`` options) compiles its step on this machine: False for ``compile=False``,
    with ``MUON_FN_COMPILE=0`` in the environment, or where Dynamo does not support this Python."""
    return _compile.resolve(compile) is not None
