"""The GEMM replay: exactly the matrix products of a schedule, nothing else (the empirical limit of
a step that orthogonalizes with it)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch

from muon_fn.engine import buckets
from muon_fn.orthogonalization import (bucket_limit, coefficient_schedule, default_compute_dtype, for_device,
                                        gram_matrix, iterate, norm_scale)

AUTO = "auto"  # bucket_size: the optimizers' buckets (the device policy's count and byte bound)


def replay(params: Sequence[torch.Tensor], method: str, steps: int | None, *, bucket_size: int | str | None,
           dtype: torch.dtype | None = None) -> Callable[[], None]:
    """A function running the GEMMs of ``method``'s schedule on ``params``' shapes, in ``dtype``
    (default: the device's compute dtype, as the optimizer picks it), through
    :func:`muon_fn.orthogonalization.iterate`, the iteration the op runs.

    Batching follows the op: parameters of one shape in buckets of at most ``bucket_size``
    (:data:`AUTO`: the buckets the optimizers make, :func:`muon_fn.orthogonalization.bucket_limit`, so
    the replay runs exactly the step's GEMMs; ``None``: one matrix per call, as
    torch.optim.Muon runs), each bucket's matrices (an expert
    stack ``(E, out, in)`` brings E) one batched call, or one matrix at a time where the CPU's
    products loop (their ``loops``).

    The inputs are prepared once, outside the returned function, as the real path prepares them
    (in their own orientation, Frobenius-normalized, then AOL-rescaled for an AOL schedule: a tall
    matrix iterates on ``XᵀX``, from the right, as the op runs it), so the GEMMs
    run on the values they would see: unnormalized weights make every schedule overflow to
    inf/NaN within a few steps. Products are the device's (:func:`muon_fn.orthogonalization.for_device`):
    on the CPU they go into reused scratch, as the op's do.
    Inside :func:`shared_inputs`, replays of the same parameters with the same normalization and
    dtype share one prepared copy.
    """
    schedule = coefficient_schedule(method, steps)
    aol = getattr(schedule, "precondition", "frobenius") == "aol"
    dtype = dtype or default_compute_dtype(params[0].device)
    scale = norm_scale(method)
    key = (tuple(id(p) for p in params), scale, aol, dtype)
    wides = None if _SHARED is None else _SHARED.get(key)
    if wides is None:
        wides = [[_prepared(m, scale, aol).to(dtype) for m in (p.unbind(0) if p.ndim == 3 else (p,))] for p in params]
        if _SHARED is not None:
            _SHARED[key] = wides
    ops = for_device(params[0].device, buffers={})
    loops = getattr(ops, "loops", lambda m, dtype: False)
    calls: list[torch.Tensor] = []
    for members in _buckets(params, bucket_size):
        bucket = [w for i in members for w in wides[i]]
        if bucket_size is None or loops(min(bucket[0].shape), bucket[0].dtype):
            calls += bucket
        else:
            calls.append(torch.stack(bucket))

    def run() -> None:
        for x in calls:
            gram = gram_matrix(x, ops) if aol else None  # AOL's Gram feeds step 1
            iterate(x, schedule, gram, ops)
    return run


def _buckets(params: Sequence[torch.Tensor], bucket_size: int | str | None) -> list[tuple[int, ...]]:
    """Positions of ``params`` in the replay's buckets (:func:`replay`'s ``bucket_size``): with
    :data:`AUTO`, the optimizers' own rule (:func:`muon_fn.engine.buckets` cut by
    :func:`muon_fn.orthogonalization.bucket_limit`)."""
    if bucket_size != AUTO:
        return buckets(list(params), bucket_size or 1)
    return buckets(list(params), lambda same, among: bucket_limit(same, None, among))


_SHARED: dict | None = None  # prepared inputs by (parameters, norm scale, AOL, dtype), in shared_inputs()


@contextlib.contextmanager
def shared_inputs() -> Iterator[None]:
    """Replays built in the block share the prepared inputs of equal parameters, normalization and
    dtype (``replay[quintic5]`` and ``replay[torch_quintic5]`` on a GPU, both bf16): one copy in
    memory instead of one per row, which the LLM-size sets need to fit one GPU."""
    global _SHARED
    _SHARED = {}
    try:
        yield
    finally:
        _SHARED = None


def _prepared(p: torch.Tensor, norm_scale: float, aol: bool, eps: float = 1e-7) -> torch.Tensor:
    w = p.detach().float()
    w = w / (norm_scale * torch.linalg.vector_norm(w)).clamp_min(eps)
    if aol:  # AOL: rows (a tall matrix's columns) scaled by (Σⱼ |Gram|ᵢⱼ)^(-1/2), bounding σ by 1
        tall = w.size(0) > w.size(1)
        gram = w.mT @ w if tall else w @ w.mT
        s = (gram.abs().sum(-1) + eps).rsqrt()
        w = w * (s.unsqueeze(0) if tall else s.unsqueeze(-1))
    return w
