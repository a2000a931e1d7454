"""The GEMM bound of a step: the Newton–Schulz GEMM FLOPs it runs over the matmul rate measured
on the same device, in the same run.

:func:`step_gemm_flops` counts dense FLOPs (pure: shapes in, an integer out);
:func:`matmul_rate` times one representative GEMM. A row's bound is what its step would take if
it ran nothing but those FLOPs at that rate: a floor for an implementation of the same iteration
that computes every product densely. (On the CPU muon_fn computes the symmetric products of large
matrices blockwise, 3/4 of their FLOPs per split, so its step can come in under the bound.)
"""

from __future__ import annotations

import math
import time
from typing import Any
from collections.abc import Sequence

import torch

from muon_fn.orthogonalization import gemm_flops
from .._device import synchronize


def step_gemm_flops(shapes: Sequence[Sequence[int]], schedule: Sequence[Sequence[float]]) -> int:
    """Dense GEMM FLOPs of orthogonalizing every matrix of ``shapes`` once with ``schedule``
    (:func:`muon_fn.orthogonalization.gemm_flops`); a shape ``(E, out, in)`` is an expert stack of
    E matrices. Quintic ×5 on gpt2-small: 3600·768³ = 1.63 TFLOP."""
    return sum(_count(s) * gemm_flops(s, schedule) for s in shapes)


def _count(shape: Sequence[int]) -> int:
    """The matrices a tensor of ``shape`` holds: E for an expert stack ``(E, out, in)``, else 1."""
    return math.prod(int(d) for d in shape[:-2])


def representative_shape(shapes: Sequence[Sequence[int]]) -> tuple[int, int]:
    """The wide ``(m, n)`` that carries the most of a quintic step's FLOPs over ``shapes``."""
    totals: dict[tuple[int, int], int] = {}
    for s in shapes:
        m, n = int(s[-2]), int(s[-1])
        wide = (min(m, n), max(m, n))
        totals[wide] = totals.get(wide, 0) + _count(s) * gemm_flops(wide, ((1, 1, 1),))
    return max(totals, key=totals.__getitem__)


def matmul_rate(shape: tuple[int, int], dtype: torch.dtype, device: torch.device, *,
                min_seconds: float = 0.05, min_reps: int = 3) -> dict[str, Any]:
    """FLOP/s of ``X·Xᵀ`` for an ``(m, n)`` ``X`` in ``dtype`` on ``device`` (the Gram product of
    the iteration, into a reused output): one warm-up, then at least ``min_reps`` products and
    ``min_seconds``, timed between two :func:`synchronize` calls."""
    m, n = shape
    x = torch.randn(m, n, device=device).to(dtype)
    out = torch.empty(m, m, dtype=dtype, device=device)
    torch.matmul(x, x.mT, out=out)
    synchronize(device)
    reps, t0 = 0, time.perf_counter()
    while reps < min_reps or time.perf_counter() - t0 < min_seconds:
        torch.matmul(x, x.mT, out=out)
        reps += 1
        if reps >= min_reps:
            synchronize(device)
    seconds = time.perf_counter() - t0
    return {"flops_per_s": 2 * m * m * n * reps / seconds, "shape": [m, n], "reps": reps, "seconds": seconds}


def bound_seconds(flops: int, rate: dict[str, Any]) -> float:
    """``flops`` at ``rate`` (a :func:`matmul_rate` result), in seconds."""
    return flops / rate["flops_per_s"] if rate["flops_per_s"] > 0 else math.inf
