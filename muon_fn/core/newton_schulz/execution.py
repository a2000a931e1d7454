"""Which execution runs where: the products of a device's execution policy (:func:`for_device`),
the iteration run through them (:func:`newton_schulz` and its presets; :func:`gram_matrix`,
:func:`iterate`, :func:`iterate_gram`, :func:`orthogonalize_matrices`: :mod:`.iteration`'s
formulas with the device's products unless given), the default iteration dtype of a device, the
batched orthogonalization of same-shape matrices through the device's products, and the operator
``torch.ops.muon_fn.orthogonalize_batch`` that keeps it one opaque call under ``torch.compile``
where the execution policy asks for that (the CPU's).

This module picks the products; the math (:mod:`.schedules`, :mod:`.iteration`, :mod:`.products`)
imports no execution module, so imports point down only: execution → cpu, batched → iteration →
products, schedules.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import checks as _checks, execution as _execution
from . import batched, cpu, iteration
from .products import Buffers, Products
from .schedules import GRAM_RESTARTS, Coefficients, Schedule, check_dtype, coefficient_schedule
from .schedules import norm_scale as method_norm_scale


def for_device(device: torch.device, buffers: Buffers | None = None) -> cpu.CPUProducts | batched.BatchedProducts:
    """The products of ``device``'s execution policy (scratch kept in ``buffers`` where the
    policy reuses scratch)."""
    policy = _execution.policy(device)
    executions: dict[str, type[cpu.CPUProducts | batched.BatchedProducts]] = {
        "cpu": cpu.CPUProducts, "batched": batched.BatchedProducts}
    return executions[policy.name](policy, buffers)


def gram_matrix(x: torch.Tensor, ops: Products | None = None) -> torch.Tensor:
    """``XXᵀ`` of a (batch of) wide matrices (:func:`.iteration.gram_matrix`; into ``ops``'
    ``"gram"`` scratch, if it keeps one; default: the products of ``x``'s device)."""
    return iteration.gram_matrix(x, for_device(x.device) if ops is None else ops)


def iterate(x: torch.Tensor, schedule: Sequence[Coefficients], gram: torch.Tensor | None = None,
            ops: Products | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`.iteration.iterate` (``ops``: the products, default: those of ``x``'s device)."""
    return iteration.iterate(x, schedule, gram, for_device(x.device) if ops is None else ops, out)


def iterate_gram(x: torch.Tensor, schedule: Sequence[Coefficients], gram: torch.Tensor | None = None,
                 restarts: Sequence[int] = GRAM_RESTARTS, ops: Products | None = None) -> torch.Tensor:
    """:func:`.iteration.iterate_gram` (``ops``: the products, default: those of ``x``'s device;
    they must keep no scratch)."""
    return iteration.iterate_gram(x, schedule, gram, restarts, ops=for_device(x.device) if ops is None else ops)


def orthogonalize_matrices(
    x: torch.Tensor,
    schedule: Sequence[Coefficients],
    *,
    dtype: torch.dtype,
    eps: float,
    norm_scale: float = 1.0,
    gram: torch.Tensor | None = None,
) -> torch.Tensor:
    """The iteration behind :func:`newton_schulz` with a resolved schedule, through the products
    of ``x``'s device (:func:`.iteration.orthogonalize_matrices`: plain tensor code, traceable by
    autograd, torch.func and torch.compile).

    A :class:`~.schedules.Schedule` brings its preconditioner and form; a plain tuple of triples
    runs the standard iteration after Frobenius normalization. ``gram``: ``XXᵀ`` of ``x``'s wide
    orientation (``XᵀX`` for tall ``x``), ``(..., k, k)`` with ``k = min(m, n)``, if the caller
    already has it (SSO forms it by a rank-two update); the first iteration then uses it, scaled
    and cast like ``x``, instead of a product.
    """
    return iteration.orthogonalize_matrices(x, schedule, dtype=dtype, eps=eps, norm_scale=norm_scale, gram=gram,
                                            ops=for_device(x.device))


def newton_schulz(
    x: torch.Tensor,
    method: str = "polar_express",
    steps: int | None = 5,
    *,
    coefficients: Sequence[Sequence[float]] | None = None,
    dtype: torch.dtype | None = None,
    eps: float = 1e-7,
    stepsize: float = 1.0,
) -> torch.Tensor:
    """Approximate ``msign(x)`` for a matrix or a batch of matrices ``(..., m, n)``.

    Args:
      x: input of shape ``(..., m, n)``; a tall matrix iterates in its own layout, on ``XᵀX``.
      method: ``"polar_express"``, ``"quintic"`` (Keller), ``"you"``, ``"cubic"``, ``"aol"``
        (AOL-preconditioned, 4 steps by default), ``"aol9"`` or ``"gram"`` (Polar Express as
        Gram NS; fp32/fp16 only).
      steps: number of iterations (``None``: :func:`~.schedules.default_steps`).
      coefficients: a custom schedule of ``(a, b, c)`` triples (overrides ``method``'s).
      dtype: iteration dtype; ``None`` iterates in ``x.dtype``.
      eps: the normalization is ``x / max(‖x‖_F, eps)`` (torch.optim.Muon's), so a zero
        input maps to zero.
      stepsize: damping η of each iteration (1 = the plain iteration).

    Returns:
      A tensor of ``x``'s shape and dtype.
    """
    if x.ndim < 2:
        raise ValueError(f"newton_schulz expects a matrix or a batch of matrices, got shape {tuple(x.shape)}")
    _checks.positive("eps", eps)
    schedule = coefficient_schedule(method, steps, coefficients=coefficients, stepsize=stepsize)
    scale = 1.0 if coefficients is not None else method_norm_scale(method)
    return orthogonalize_matrices(x, schedule, dtype=dtype or x.dtype, eps=eps, norm_scale=scale)


def zeropower_via_newtonschulz5(G: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Keller Jordan's Muon orthogonalization: quintic (3.4445, -4.7750, 2.0315) in bf16."""
    return newton_schulz(G, "quintic", steps, dtype=torch.bfloat16, eps=1e-7)


def polar_express(G: torch.Tensor, steps: int = 5, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Polar Express (safety factor 1.01) in ``dtype`` (default: ``G.dtype``).

    5 steps land σ in about 1 ± 0.12; 8 or more steps in fp32 converge (‖OOᵀ − I‖_F/√m ≈ 1e-6).
    """
    return newton_schulz(G, "polar_express", steps, dtype=dtype)


def default_compute_dtype(device: torch.device | str | None = None,
                          schedule: Sequence[Coefficients] | None = None) -> torch.dtype:
    """The iteration dtype used when none is given: bf16, except fp32 on CPUs without bf16 GEMMs;
    for a Gram-form ``schedule`` (unstable in bf16) the execution policy's Gram dtype: fp16 on
    GPUs, fp32 on the CPU (:mod:`muon_fn.core.execution`).

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
                        eps: float, norm_scale: float = 1.0, buffers: Buffers | None = None,
                        consume: bool = False) -> torch.Tensor:
    """msign of each matrix of ``xs`` (2-D, one shape) as one contiguous ``(B, *xs[0].shape)``
    tensor in ``dtype``, run by the products of the matrices' device (:func:`for_device`;
    ``buffers``: scratch kept across calls where that execution reuses scratch). A tall batch
    iterates in its own layout, on ``XᵀX`` (:mod:`.iteration`): nothing is transposed in or out.
    The result is always fresh. ``consume``: ``xs`` are the caller's to lose; the result is that
    of ``[x.to(dtype) for x in xs]``, bit for bit, and the CPU iterates in their memory
    (:meth:`.cpu.CPUProducts.orthogonalize_batch`)."""
    check_dtype(schedule, dtype)
    shapes = {tuple(x.shape) for x in xs}
    if len(shapes) != 1:
        raise ValueError(f"orthogonalize_batch takes matrices of one shape, got {sorted(shapes)}")
    return for_device(xs[0].device, buffers).orthogonalize_batch(xs, schedule, dtype, eps, norm_scale, consume)


def _schedule(coefficients: list[float], degrees: list[int], precondition: str, form: str,
              fold_from: int) -> Schedule:
    """The :class:`Schedule` the operators' flat arguments describe."""
    rows, k = [], 0
    for d in degrees:
        rows.append(tuple(coefficients[k:k + d]))
        k += d
    return Schedule(rows, precondition=precondition, form=form, fold_from=None if fold_from < 0 else fold_from)


@torch.library.custom_op("muon_fn::orthogonalize_batch", mutates_args=())
def _orthogonalize_batch_op(xs: list[torch.Tensor], coefficients: list[float], degrees: list[int],
                            precondition: str, form: str, fold_from: int, eps: float, norm_scale: float,
                            dtype: torch.dtype) -> torch.Tensor:
    return orthogonalize_batch(xs, _schedule(coefficients, degrees, precondition, form, fold_from), dtype=dtype,
                               eps=eps, norm_scale=norm_scale, buffers=cpu.scratch_buffers(xs[0].device))


@_orthogonalize_batch_op.register_fake
def _(xs, coefficients, degrees, precondition, form, fold_from, eps, norm_scale, dtype):
    return torch.empty((len(xs),) + tuple(xs[0].shape), dtype=dtype, device=xs[0].device)


@torch.library.custom_op("muon_fn::orthogonalize_batch_consumed", mutates_args=("xs",))
def _orthogonalize_consumed_op(xs: list[torch.Tensor], coefficients: list[float], degrees: list[int],
                               precondition: str, form: str, fold_from: int, eps: float, norm_scale: float,
                               dtype: torch.dtype) -> torch.Tensor:
    return orthogonalize_batch(xs, _schedule(coefficients, degrees, precondition, form, fold_from), dtype=dtype,
                               eps=eps, norm_scale=norm_scale, buffers=cpu.scratch_buffers(xs[0].device),
                               consume=True)


@_orthogonalize_consumed_op.register_fake
def _(xs, coefficients, degrees, precondition, form, fold_from, eps, norm_scale, dtype):
    return torch.empty((len(xs),) + tuple(xs[0].shape), dtype=dtype, device=xs[0].device)


def msign_batch(xs: Sequence[torch.Tensor], schedule: Sequence[Coefficients], *, dtype: torch.dtype,
                eps: float, norm_scale: float = 1.0, consume: bool = False) -> torch.Tensor:
    """:func:`orthogonalize_batch` as one operator (``torch.ops.muon_fn.orthogonalize_batch``;
    ``consume``: ``torch.ops.muon_fn.orthogonalize_batch_consumed``, which declares that it writes
    ``xs``: see :func:`orthogonalize_batch`).

    Under the CPU execution policy (:mod:`muon_fn.core.execution`) the iteration stays one opaque call
    under ``torch.compile`` that runs the CPU's tuned eager kernels (:mod:`.cpu`: reused scratch,
    symmetric Gram products) while inductor fuses everything around it. Under the batched policy
    (GPUs) it is traced inline: inductor fuses the normalization and casts with the neighbouring
    work, and the graph can be captured as CUDA graphs. Inputs that autograd records take the
    plain tensor path too (no backward is defined for the operator).
    """
    if not _execution.policy(xs[0].device).opaque or (
            torch.is_grad_enabled() and any(x.requires_grad for x in xs)):
        xs = [x.to(dtype) for x in xs] if consume else xs  # traced: the casts fuse with their producers
        return orthogonalize_batch(xs, schedule, dtype=dtype, eps=eps, norm_scale=norm_scale)
    fold_from = getattr(schedule, "fold_from", None)  # a Schedule's; None for a plain sequence
    return (_orthogonalize_consumed_op if consume else _orthogonalize_batch_op)(
        list(xs), [float(c) for row in schedule for c in row], [len(row) for row in schedule],
        getattr(schedule, "precondition", "frobenius"), getattr(schedule, "form", "standard"),
        -1 if fold_from is None else fold_from, float(eps), float(norm_scale), dtype)
