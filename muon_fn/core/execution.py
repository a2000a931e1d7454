"""Execution policies: how one device runs the orthogonalization of a batch of same-shape matrices.

The math (schedules, polynomials, dtype rules) lives once, in :mod:`muon_fn.core.newton_schulz`. How
a batch of equal wide shapes is *executed* differs by device and is chosen here, by a small named
policy that tests can force on CPU tensors (:func:`forced`):

- ``"cpu"``: the tuned CPU path. Under ``torch.compile`` the iteration is one opaque operator that
  runs eager kernels: matrices of 384 rows and more one at a time (2-D GEMMs are faster than
  batched ones there on the CPUs measured), symmetric products split into blocks, scratch tensors
  reused between calls (a fresh allocation page-faults on first touch). Adapters update at most 4
  same-shape parameters per compiled call (inductor's compile time grows with the graph).
- ``"batched"`` (CUDA and every other accelerator): the batch is one stacked tensor, normalized by
  one reduction and iterated with one batched GEMM per product, whatever its size; under
  ``torch.compile`` the iteration is traced inline, so inductor fuses the normalization, casts
  and elementwise work around the GEMMs and a compiled step can be captured as CUDA graphs.
  Symmetric products (``XXᵀ``, ``A²``, the polynomial) of at least 2048 rows are computed as
  their two diagonal half blocks and one off-diagonal block (mirrored): 3/4 of the FLOPs, at
  sizes where half-size GEMMs still run near peak (a quintic iteration on a Llama-3-8B MLP
  matrix, 4096×14336: 14 % fewer FLOPs), in plain batched GEMMs that inductor traces.
  Adapters put up to 16 same-shape parameters of a group in one compiled call (inductor's cold
  compile grows by about half a second per parameter in a graph, measured on the CPU under this
  policy, while equal buckets reuse one graph: gpt2-small's 48 square matrices compile as one
  graph run three times), and mark parameters
  and optimizer state as static addresses for a compiled step (what torch's compiled optimizers
  do): ``compile={"mode": "reduce-overhead"}`` then captures the step as CUDA graphs instead of
  skipping them for its in-place writes (inductor skips graphs that mutate inputs it may not
  assume static). A step then launches
  O(buckets × GEMMs per iteration) GEMM kernels, not O(matrices). Gram Newton–Schulz
  iterates in fp16 by default (fp16's range suffices for magnitudes near 1 and its mantissa is
  finer than bf16's, in which Gram NS loses orthogonality).

A matrix's result does not depend on its batch mates on the CPU policy (every step is computed per
matrix on equally aligned memory), which makes FSDP and single-device runs bitwise equal there.
A batched GEMM library may choose its kernel by batch size, so under ``"batched"`` they agree to
rounding.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple
from collections.abc import Iterator

import torch

from . import checks as _checks


class ExecutionPolicy(NamedTuple):
    """How a batch of same-shape matrices is orthogonalized on one device."""

    name: str
    opaque: bool  # under torch.compile: one custom operator running eager kernels (else traced inline)
    loop_min_dim: int | None  # eager batches with m >= this run one matrix at a time (None: never)
    split_symmetric: bool  # symmetric products (XXᵀ, A²) computed blockwise, eager, per matrix (CPU)
    symmetric_min_dim: int | None  # batched symmetric products of m >= this rows: 3 half-size GEMMs
    scratch: bool  # intermediate products written into scratch reused across calls
    stack_inputs: bool  # normalize the batch as one stacked tensor (one reduction), not per matrix
    gram_dtype: torch.dtype  # Gram Newton–Schulz's default iteration dtype
    bucket_size: int | None  # adapters' default same-shape parameters per compiled call (None: all)
    bucket_bytes: int | None  # ... and at most this many bytes of them, nor more than the largest
    # parameter's (at least one; None: no bound)
    static_addresses: bool  # compiled steps mark parameters and state as static (CUDA graphs)


CPU = ExecutionPolicy("cpu", opaque=True, loop_min_dim=384, split_symmetric=True, symmetric_min_dim=None,
                      scratch=True,
                      stack_inputs=False, gram_dtype=torch.float32, bucket_size=4, bucket_bytes=8 << 20,
                      static_addresses=False)
BATCHED = ExecutionPolicy("batched", opaque=False, loop_min_dim=None, split_symmetric=False,
                          symmetric_min_dim=2048, scratch=False,
                          stack_inputs=True, gram_dtype=torch.float16, bucket_size=16, bucket_bytes=None,
                          static_addresses=True)
POLICIES = {p.name: p for p in (CPU, BATCHED)}

# Set by :func:`forced` (a plain global: torch.compile guards on it rather than tracing a lookup).
_FORCED: ExecutionPolicy | None = None


def policy(device: torch.device | str | None) -> ExecutionPolicy:
    """The policy that runs on ``device`` (``None``: the CPU): ``"cpu"`` there, ``"batched"`` on
    CUDA and other accelerators, unless :func:`forced` says otherwise."""
    if _FORCED is not None:
        return _FORCED
    device = torch.device("cpu" if device is None else device)
    return CPU if device.type in ("cpu", "meta") else BATCHED


@contextlib.contextmanager
def forced(name: str | ExecutionPolicy) -> Iterator[ExecutionPolicy]:
    """Run every device under the policy ``name`` (``"cpu"``, ``"batched"`` or an
    :class:`ExecutionPolicy`) inside the block: e.g. the CUDA execution on CPU tensors, to test it
    without a GPU."""
    global _FORCED
    if not isinstance(name, ExecutionPolicy):
        _checks.one_of("policy", name, POLICIES)
        name = POLICIES[name]
    previous, _FORCED = _FORCED, name
    torch._dynamo.reset()  # graphs compiled under another policy must not be reused
    try:
        yield _FORCED
    finally:
        _FORCED = previous
        torch._dynamo.reset()


def mark_static(tensors) -> None:
    """Mark ``tensors`` (parameters, optimizer state: what a compiled step writes in place) as
    static addresses, unguarded: CUDA graph trees then capture in-place writes to them instead of
    skipping the graph, and re-record should one move (a loaded state), without a recompile."""
    for t in tensors:
        if t is not None and getattr(t, "_dynamo_static_input_type", None) is None:
            torch._dynamo.mark_static_address(t, guard=False)


# Buckets of small matrices may hold this many bytes even where no parameter is as large: a call
# per matrix of a few KiB costs more in Python than the memory saves.
MIN_BUCKET_BYTES = 1 << 20


def bucket_limit(params: list[torch.Tensor], bucket_size: int | None,
                 among: list[torch.Tensor] | None = None) -> int:
    """Same-shape parameters ``params`` per compiled call: ``bucket_size`` if given, else the
    policy's of their device (all of them when it has none), and, where the policy bounds a
    bucket's bytes, no more than fit its ``bucket_bytes`` nor the bytes of the largest parameter
    ``among`` the others bucketed with them, nor less than :data:`MIN_BUCKET_BYTES` (at least
    one). A bucket's transient memory is proportional to its bytes: so bounded, a step's is at
    most about one large matrix's, as a loop over the parameters one at a time
    (torch.optim.Muon) holds, while small matrices still share calls."""
    if bucket_size is not None:
        return bucket_size
    rule = policy(params[0].device if params else None)
    limit = max(1, len(params)) if rule.bucket_size is None else rule.bucket_size
    if rule.bucket_bytes is None or not params:
        return limit
    size = lambda p: p.numel() * p.element_size()  # noqa: E731
    largest = max(size(p) for p in among) if among else rule.bucket_bytes
    budget = min(rule.bucket_bytes, max(largest, MIN_BUCKET_BYTES))
    return max(1, min(limit, budget // max(1, size(params[0]))))
