"""The batched execution of the Newton–Schulz iteration (execution policy ``"batched"``: CUDA and
other accelerators).

A batch of same-shape matrices is one stacked tensor, normalized by one reduction and iterated
with one batched GEMM per product (:meth:`BatchedProducts.orthogonalize_batch`), traced
inline under ``torch.compile``. Symmetric products of at least the policy's
``symmetric_min_dim`` rows are computed as their two diagonal half blocks and the block above
them, mirrored (:func:`half_blocks`: 3/4 of the FLOPs, in plain batched GEMMs inductor traces).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import execution as _execution
from .iteration import inverse_norm, run_schedule
from .products import Buffers, Products, addmm
from .schedules import Coefficients


class BatchedProducts(Products):
    """The iteration's products as plain (batched) GEMMs, symmetric ones of ``symmetric_min_dim``
    rows and more from half blocks; no scratch (the device's caching allocator reuses memory)."""

    def __init__(self, policy: _execution.ExecutionPolicy = _execution.BATCHED, buffers: Buffers | None = None) -> None:
        del buffers  # the policy keeps no scratch
        self.policy = policy

    def product(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None,
                bias: torch.Tensor | None = None, beta: float = 1.0, alpha: float = 1.0, *,
                symmetric: bool = False) -> torch.Tensor:
        limit = self.policy.symmetric_min_dim
        if symmetric and limit is not None and a.shape[-2] >= limit and a.ndim == 3:
            result = half_blocks(a, b, bias, beta, alpha)
            return result if out is None else out.copy_(result)
        return super().product(a, b, out, bias, beta, alpha)

    def orthogonalize_batch(self, xs: Sequence[torch.Tensor], schedule: Sequence[Coefficients], dtype: torch.dtype,
                            eps: float, norm_scale: float, consume: bool = False) -> torch.Tensor:
        """msign of each matrix of ``xs`` (one shape) as one ``(B, *shape)`` tensor: stacked,
        normalized by one reduction, iterated with one batched GEMM per product. ``consume``:
        cast to ``dtype`` first (the stack is a copy either way)."""
        y = torch.stack([x.to(dtype) for x in xs] if consume else list(xs))
        y = (y * inverse_norm(y, norm_scale, eps, dims=(-2, -1))).to(dtype)
        return run_schedule(y, schedule, eps, self)


def half_blocks(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, beta: float,
                alpha: float) -> torch.Tensor:
    """A symmetric batched product from its two diagonal half blocks and the block above them,
    mirrored below (3/4 of the FLOPs): plain batched GEMMs and copies, traceable by inductor."""
    h = a.size(-2) // 2
    top, low = slice(None, h), slice(h, None)

    def block(rows: slice, cols: slice) -> torch.Tensor:
        if bias is None:
            return a[:, rows] @ b[:, :, cols]
        return addmm(bias[:, rows, cols], a[:, rows], b[:, :, cols], beta=beta, alpha=alpha)

    upper = block(top, low)
    return torch.cat([torch.cat([block(top, top), upper], -1),
                      torch.cat([upper.mT, block(low, low)], -1)], -2)
