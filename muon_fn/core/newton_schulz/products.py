"""The products the Newton–Schulz iteration asks for (:class:`Products`), computed plainly: one
GEMM or batched GEMM each, fresh outputs, traceable by autograd, torch.func and torch.compile.

A device's execution module subclasses :class:`Products` to run the same products its own way
(:mod:`.cpu`: scratch reuse, block-split symmetric products, one matrix at a time;
:mod:`.batched`: half-block symmetric GEMMs); the execution side picks the one of a device's
execution policy (:func:`.execution.for_device`). The iteration (:mod:`.iteration`) only ever
calls these methods, so its formulas hold no device's tuning; and this module, like the
iteration, imports no execution module (the execution modules import it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Buffers = dict  # scratch kept by the caller across calls: one flat tensor per (role, dtype, device)

# torch.func (vmap, grad) wraps tensors; out= has no batching rule, so wrapped inputs keep one GEMM.
_is_functorch_wrapped = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor",
                                lambda t: False)


def untracked(t: torch.Tensor) -> bool:
    """Whether neither autograd (recording ``t`` for backward) nor torch.func (wrapping it) sees
    ``t``, so it may be written with ``out=`` or, as scratch, overwritten in place once read. The
    wrapper check is skipped under torch.compile, which cannot trace it and functionalizes anyway."""
    if torch.is_grad_enabled() and t.requires_grad:
        return False
    return torch.compiler.is_compiling() or not _is_functorch_wrapped(t)


def addmm(bias: torch.Tensor, m1: torch.Tensor, m2: torch.Tensor, beta: float, alpha: float,
          out: torch.Tensor | None = None):
    """``beta*bias + alpha*(m1 @ m2)`` as one fused BLAS call (2-D or batched 3-D), into ``out``
    if given (it must not alias an input)."""
    if m1.ndim == 2:
        return torch.addmm(bias, m1, m2, beta=beta, alpha=alpha, out=out)
    return torch.baddbmm(bias, m1, m2, beta=beta, alpha=alpha, out=out)


def matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    return a @ b if out is None else torch.matmul(a, b, out=out)


class Products:
    """How the iteration's products are computed; this base class computes them plainly.

    ``scratch(role, shape, like)``: a reusable output for the product of that role (``None``:
    allocate; :meth:`without_scratch` never reuses); ``product``: ``a @ b`` or
    ``beta·bias + alpha·(a @ b)``, ``symmetric`` when the caller knows the result is exactly
    symmetric; ``scaled_sum``: ``a + alpha·b``; and
    ``each_matrix(run, y, gram, out)`` runs the iteration of a batch ``y`` (``run(y, gram, out)``),
    whole or one matrix at a time. A device's subclass also has ``orthogonalize_batch``, which
    prepares and iterates a batch of same-shape matrices its way.
    """

    def scratch(self, role: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor | None:
        del role, shape, like
        return None

    def without_scratch(self) -> Products:
        """These products with fresh outputs only (for callers that hold products across calls)."""
        return self

    def product(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None,
                bias: torch.Tensor | None = None, beta: float = 1.0, alpha: float = 1.0, *,
                symmetric: bool = False) -> torch.Tensor:
        del symmetric
        return matmul(a, b, out) if bias is None else addmm(bias, a, b, beta=beta, alpha=alpha, out=out)

    def scaled_sum(self, a: torch.Tensor, b: torch.Tensor, alpha: float, out: torch.Tensor | None) -> torch.Tensor:
        """``a + alpha·b`` (into ``out`` if given), one matrix at a time for an eager batch: ATen's
        vectorized loop and its scalar tail round ``a + alpha·b`` differently in bf16, and in a
        batch only the last matrix's last elements reach the tail, so batching would change a
        matrix's result."""
        if a.ndim == 2 or torch.compiler.is_compiling():
            return torch.add(a, b, alpha=alpha, out=out)
        if not (untracked(a) and untracked(b)):  # autograd or torch.func: no out=
            return torch.stack([torch.add(a[i], b[i], alpha=alpha) for i in range(a.size(0))])
        out = torch.empty_like(a) if out is None else out
        for i in range(a.size(0)):
            torch.add(a[i], b[i], alpha=alpha, out=out[i])
        return out

    def each_matrix(self, run: Callable[..., torch.Tensor], y: torch.Tensor, gram: torch.Tensor | None,
                    out: torch.Tensor | None) -> torch.Tensor:
        return run(y, gram, out)

