"""Which execution runs where: the default iteration dtype of a device, the batched
orthogonalization of same-shape matrices through the device's products, and the operator
``torch.ops.muon_fn.orthogonalize_batch`` that keeps it one opaque call under ``torch.compile``
where the execution policy asks for that (the CPU's)."""

from __future__ import annotations

from typing import Sequence

import torch

from .. import _execution
from . import cpu
from .iteration import wide_shape
from .products import Buffers, for_device
from .schedules import Coefficients, Schedule, check_dtype


def default_compute_dtype(device: torch.device | str | None = None,
                          schedule: Sequence[Coefficients] | None = None) -> torch.dtype:
    """The iteration dtype used when none is given: bf16, except fp32 on CPUs without bf16 GEMMs;
    for a Gram-form ``schedule`` (unstable in bf16) the execution policy's Gram dtype: fp16 on
    GPUs, fp32 on the CPU (:mod:`muon_fn._execution`).

    ``device=None`` means the CPU. bf16 is the tensor-core dtype on GPUs and the fast path on CPUs
    with bf16 instructions (x86 AVX-512 BF16 or AMX, Arm BF16; :data:`.cpu.CPU_HAS_BF16_GEMM`).
    Measured, 1 thread, 768³: Zen 4 (AVX-512 BF16) bf16 2.2x faster than fp32; Zen 3 (AVX2 only)
    bf16 57x *slower* (796 vs 14 ms; fp16 alike), so there fp32 is the default.
    """
    device = torch.device("cpu" if device is None else device)
    if getattr(schedule, "form", "standard") == "gram":
        return _execution.policy(device).gram_dtype
    if device.type != "cpu" or cpu.CPU_HAS_BF16_GEMM:
        return torch.bfloat16
    return torch.float32


def orthogonalize_batch(xs: Sequence[torch.Tensor], schedule: Sequence[Coefficients], *, dtype: torch.dtype,
                        eps: float, norm_scale: float = 1.0, buffers: Buffers | None = None) -> torch.Tensor:
    """msign of each matrix of ``xs`` (2-D, one wide shape ``(m, n)`` in either orientation) as
    one ``(B, m, n)`` tensor in ``dtype``, wide orientation (transpose tall results back), run by
    the products of the matrices' device (:func:`~.products.for_device`; ``buffers``: scratch kept
    across calls where that execution reuses scratch). The result is always fresh."""
    check_dtype(schedule, dtype)
    return for_device(xs[0].device, buffers).orthogonalize_batch(xs, schedule, dtype, eps, norm_scale)


@torch.library.custom_op("muon_fn::orthogonalize_batch", mutates_args=())
def _orthogonalize_batch_op(xs: list[torch.Tensor], coefficients: list[float], degrees: list[int],
                            precondition: str, form: str, fold_from: int, eps: float, norm_scale: float,
                            dtype: torch.dtype) -> torch.Tensor:
    rows, k = [], 0
    for d in degrees:
        rows.append(tuple(coefficients[k:k + d]))
        k += d
    schedule = Schedule(rows, precondition=precondition, form=form, fold_from=None if fold_from < 0 else fold_from)
    return orthogonalize_batch(xs, schedule, dtype=dtype, eps=eps, norm_scale=norm_scale,
                               buffers=cpu.scratch_buffers(xs[0].device))


@_orthogonalize_batch_op.register_fake
def _(xs, coefficients, degrees, precondition, form, fold_from, eps, norm_scale, dtype):
    return torch.empty((len(xs),) + wide_shape(xs[0].shape), dtype=dtype, device=xs[0].device)


def msign_batch(xs: Sequence[torch.Tensor], schedule: Sequence[Coefficients], *, dtype: torch.dtype,
                eps: float, norm_scale: float = 1.0) -> torch.Tensor:
    """:func:`orthogonalize_batch` as one operator (``torch.ops.muon_fn.orthogonalize_batch``).

    Under the CPU execution policy (:mod:`muon_fn._execution`) the iteration stays one opaque call
    under ``torch.compile`` that runs the CPU's tuned eager kernels (:mod:`.cpu`: reused scratch,
    symmetric Gram products) while inductor fuses everything around it. Under the batched policy
    (GPUs) it is traced inline: inductor fuses the normalization and casts with the neighbouring
    work, and the graph can be captured as CUDA graphs. Inputs that autograd records take the
    plain tensor path too (no backward is defined for the operator).
    """
    if not _execution.policy(xs[0].device).opaque or (
            torch.is_grad_enabled() and any(x.requires_grad for x in xs)):
        return orthogonalize_batch(xs, schedule, dtype=dtype, eps=eps, norm_scale=norm_scale)
    return _orthogonalize_batch_op(
        list(xs), [float(c) for row in schedule for c in row], [len(row) for row in schedule],
        getattr(schedule, "precondition", "frobenius"), getattr(schedule, "form", "standard"),
        -1 if getattr(schedule, "fold_from", None) is None else schedule.fold_from, float(eps),
        float(norm_scale), dtype)
