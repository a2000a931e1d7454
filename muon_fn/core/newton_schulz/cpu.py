"""The CPU's execution of the Newton–Schulz iteration (execution policy ``"cpu"``).

What the iteration computes is :mod:`.iteration`'s; this module decides how a CPU computes it:

- symmetric products (``XXᵀ``, ``A²``, the quintic's polynomial) split into blocks on and above
  the diagonal, the block below mirrored (3/4 of the FLOPs), eager, per matrix;
- batches of matrices from :data:`LOOP_MIN_DIM` rows run one matrix at a time (2-D GEMMs), and
  every matrix of a batch starts on an aligned slot (:func:`aligned_slots`), so a matrix's result
  never depends on its batch mates (FSDP owners batch other matrices than a single device);
- intermediate products go into scratch reused across calls (:func:`scratch_buffers`);
- whether this CPU has bf16 GEMMs (:data:`CPU_HAS_BF16_GEMM`), and AMX's split rule.
"""

from __future__ import annotations

import functools
import math
import platform
import threading
from collections.abc import Callable, Sequence

import torch

from .. import execution as _execution
from .iteration import inverse_norm, ring_input, run_schedule, wide_shape
from .products import Buffers, Products, matmul, addmm, untracked
from .schedules import Coefficients


def cpu_has_bf16_gemm() -> bool:
    """Whether this CPU has bf16 dot-product instructions, which torch's CPU bf16 GEMMs need to be
    fast (without them they are emulated: 56–230x slower than fp32 on a Zen 3)."""
    if platform.machine().lower() in ("aarch64", "arm64"):
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())  # Arm BF16 (e.g. Neoverse V1+)
    cpu = getattr(torch, "cpu", None)
    return any(getattr(cpu, name, lambda: False)() for name in ("_is_avx512_bf16_supported",
                                                                  "_is_amx_tile_supported"))


# Read once at import: a plain global, so torch.compile guards on it instead of tracing the probe.
CPU_HAS_BF16_GEMM: bool = cpu_has_bf16_gemm()

# Products known to be symmetric (XXᵀ, A², c₁A + c₂A²) are computed from the blocks on and above
# the diagonal of a 2×2 split, recursively while a block keeps at least this many rows, and the
# block below is a transposed copy: 3/4 of the FLOPs per level. Each entry is the same dot product:
# in bf16 the result is bitwise one GEMM's (checked on every size below, and for every method's
# full iteration); fp32 GEMM kernels differ by shape (8 fp32 Polar Express steps: 2e-7).
# Measured on the 2-core Zen 4 CPU, bf16, ms (one GEMM → split): XXᵀ 768×3072 8.4 → 5.4, 768² 2.2 → 1.9,
# 1024×4096 20.1 → 12.9, 2048² 39.4 → 28.0; A² 768² 2.1 → 1.7, 2048² 42.6 → 30.4. Below 384 rows
# (the batched sizes) the halves lose more GEMM efficiency than they save (16×256²: 1.2 → 2.1).
# Eager only: compiled graphs keep one GEMM; so do products that autograd records or torch.func
# transforms.
SYMMETRIC_MIN_BLOCK = 192

# On AMX the GEMMs are ~6x faster than fp32 (768×3072 XXᵀ: 3.5 vs 22 ms) and the split's mirrored
# copies and smaller GEMMs cost more than the saved FLOPs unless the inner dimension is long:
# measured on a 1-thread Xeon with AMX, bf16, ms (one GEMM → split): A² 768² 0.73 → 1.13, XXᵀ 768²
# 0.86 → 1.10, XXᵀ 768×3072 3.46 → 3.18. So there only Gram products with k ≥ 2m are split.
AMX_SPLIT_MIN_RATIO = 2

# Batches of matrices with min(m, n) >= this run one matrix at a time (2-D GEMMs) in eager mode,
# whatever the batch size, so a matrix's result never depends on its batch mates: on the 2-core
# Zen 4 CPU, bf16 baddbmm is 9-14 % slower than a loop of addmm from 512² up (16×768²: 603 vs
# 525 ms) and 5-16 % faster below 384 (16×256²: 19.1 vs 22.8 ms). Where the dtype's GEMMs run on
# AMX tiles the batched GEMMs are the faster ones at every size measured (1-thread Xeon with AMX,
# bf16, ms, batched vs loop, 4 matrices: A·X 384×1536 1.72 vs 1.85, 768² 3.02 vs 3.34, 768×3072
# 13.19 vs 13.55; XXᵀ 768² 2.68 vs 2.70), so there batches are looped only when the caller gives
# them up, from this many rows (CPUProducts.consumes_each): each matrix then iterates in its own memory with one
# matrix's scratch (on AMX a batched GEMM rounds each matrix as its 2-D GEMM does).
LOOP_MIN_DIM = _execution.CPU.loop_min_dim

# CPU BLAS kernels choose their code path by the operands' address: measured with MKL (AVX-512),
# an fp32 XXᵀ of a 10×11 matrix rounds differently at every 16-byte offset of X (bf16 GEMMs through
# oneDNN do not). The i-th matrix of a contiguous (B, m, n) batch starts i·m·n elements in.
SLOT_ALIGNMENT = 64  # bytes: torch's CPU allocator's alignment of a fresh tensor


@functools.cache
def _amx_dtypes() -> frozenset[torch.dtype]:
    """The half dtypes whose CPU GEMMs oneDNN runs on AMX tiles here (Intel Sapphire Rapids and
    later: bf16; Granite Rapids: also fp16)."""
    cpu = getattr(torch, "cpu", None)
    probe = {torch.bfloat16: "_is_amx_tile_supported", torch.float16: "_is_amx_fp16_supported"}
    return frozenset(dt for dt, name in probe.items() if getattr(cpu, name, lambda: False)())


@functools.cache
def _symmetric_blocks(m: int, min_block: int) -> tuple[tuple[slice, slice, bool], ...]:
    """The blocks ``(rows, cols, mirrored)`` computed for a symmetric ``m × m`` product split
    recursively 2×2 while halves keep ``min_block`` rows: the diagonal leaves, then each corner
    above the diagonal (``mirrored``: its transpose fills the block below)."""
    leaves: list[tuple[slice, slice, bool]] = []
    corners: list[tuple[slice, slice, bool]] = []

    def split(r0: int, r2: int) -> None:
        h = (r2 - r0) // 2
        if h < min_block:
            leaves.append((slice(r0, r2), slice(r0, r2), False))
            return
        split(r0, r0 + h)
        split(r0 + h, r2)
        corners.append((slice(r0, r0 + h), slice(r0 + h, r2), True))

    split(0, m)
    return tuple(leaves + corners)


# The scratch roles of m × m products (the others are m × n).
GRAM_ROLES = frozenset({"gram", "poly", "square", "inner"})


class CPUProducts(Products):
    """The iteration's products on the CPU: scratch kept in ``buffers`` (when given), symmetric
    products split into blocks (:func:`split_symmetric`), batches of large matrices one matrix at
    a time (:meth:`loops`)."""

    def __init__(self, policy: _execution.ExecutionPolicy = _execution.CPU, buffers: Buffers | None = None) -> None:
        self.policy, self.buffers = policy, buffers

    def scratch(self, role: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor | None:
        """A reusable ``empty`` tensor for ``role`` (None without buffers): the front of one flat
        buffer per role and dtype, so the scratch kept between calls is one matrix's (or batch's),
        not one set per shape; it is made anew when too small, or more than twice too large (a
        step runs its buckets shape by shape, so that happens a few times a step). Reusing it
        avoids a fresh allocation per product, whose first touch page-faults (measured: the tiny
        bench set ran ~10 % faster for every row once freed memory stayed mapped). One call's
        roles are distinct buffers; a tensor returned here is valid until the next call asks for
        its role."""
        if self.buffers is None:
            return None
        key = (role, like.dtype, like.device)
        numel = math.prod(shape)
        flat = self.buffers.get(key)
        if flat is None or not numel <= flat.numel() <= 2 * numel:
            flat = self.buffers.pop(key, None)
            del flat  # the old buffer is freed before the new one is made
            flat = self.buffers[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return flat[:numel].view(shape)

    def release_oversized(self, matrices: int, m: int, n: int) -> None:
        """Before a call's first allocation, free the kept scratch more than twice as large as a
        call iterating ``matrices`` ``m × n`` matrices at once can use (their ``m × m`` Gram
        roles, their ``m × n`` ones): the call's peak then does not hold an earlier shape's."""
        if self.buffers is None:
            return
        for key in list(self.buffers):
            need = matrices * m * (m if key[0] in GRAM_ROLES else n)
            if self.buffers[key].numel() > 2 * need:
                del self.buffers[key]

    def without_scratch(self) -> CPUProducts:
        return self if self.buffers is None else CPUProducts(self.policy)

    def product(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None,
                bias: torch.Tensor | None = None, beta: float = 1.0, alpha: float = 1.0, *,
                symmetric: bool = False) -> torch.Tensor:
        """``a @ b`` or ``beta·bias + alpha·(a @ b)`` (into ``out``); a product the caller knows is
        exactly symmetric is computed blockwise where :meth:`split_symmetric` allows, a batch one
        matrix at a time (bf16 bmm on strided halves is slower than one GEMM). A batch with a
        transposed operand (a tall batch's Gram ``XᵀX``) runs one matrix at a time too: BLAS
        reads a transposed 2-D operand in place, where bmm first copies it (and a temporary of
        the result's size)."""
        m = a.shape[-2]
        if a.ndim == 3 and out is not None and (transposed(a) or transposed(b)) and untracked(a) and untracked(b):
            for i in range(a.size(0)):
                self.product(a[i], b[i], out[i], None if bias is None else bias[i], beta, alpha, symmetric=symmetric)
            return out
        if not (symmetric and self.split_symmetric(m, a.shape[-1], a, b, bias)):
            return super().product(a, b, out, bias, beta, alpha)
        if out is None:
            out = torch.empty(a.shape[:-1] + b.shape[-1:], dtype=a.dtype, device=a.device)
        if a.ndim == 3:
            for i in range(a.size(0)):
                self.product(a[i], b[i], out[i], None if bias is None else bias[i], beta, alpha, symmetric=True)
            return out
        for rows, cols, mirrored in _symmetric_blocks(m, SYMMETRIC_MIN_BLOCK):
            block = out[rows, cols]
            if bias is None:
                matmul(a[rows], b[:, cols], block)
            else:
                addmm(bias[rows, cols], a[rows], b[:, cols], beta=beta, alpha=alpha, out=block)
            if mirrored:
                out[cols, rows].copy_(block.mT)
        return out

    def split_symmetric(self, m: int, k: int, a: torch.Tensor, *others: torch.Tensor | None) -> bool:
        """Whether to split an ``m × m`` product with inner dimension ``k``: eager, big enough,
        worth it for the dtype (see ``AMX_SPLIT_MIN_RATIO``), and no autograd graph to record and
        no torch.func wrapper (the blocks are written with ``out=``, which neither supports)."""
        if m < 2 * SYMMETRIC_MIN_BLOCK or not self.policy.split_symmetric or torch.compiler.is_compiling():
            return False
        if a.dtype in _amx_dtypes() and k < AMX_SPLIT_MIN_RATIO * m:
            return False
        return all(untracked(t) for t in (a, *others) if t is not None)

    def loops(self, m: int, dtype: torch.dtype) -> bool:
        """Whether an eager batch of ``dtype`` matrices whose smaller dimension is ``m`` runs one
        matrix at a time (never where ``dtype``'s GEMMs run on AMX: see :data:`LOOP_MIN_DIM`)."""
        limit = self.policy.loop_min_dim
        return (limit is not None and m >= limit and dtype not in _amx_dtypes()
                and not torch.compiler.is_compiling())

    def consumes_each(self, m: int) -> bool:
        """Whether an eager batch the caller gives up (``consume``) iterates one matrix at a time,
        each in its own memory, so that a loop holds one matrix's scratch instead of the batch's:
        from :data:`LOOP_MIN_DIM` rows in every dtype, where :meth:`loops` loops anyway and where
        the dtype's GEMMs run on AMX tiles, whose batched and one-matrix GEMMs round alike there
        (the batch's results, bit for bit; below it they need not: an MoE layer's small experts
        differ)."""
        limit = self.policy.loop_min_dim
        return limit is not None and m >= limit and not torch.compiler.is_compiling()

    def each_matrix(self, run: Callable[..., torch.Tensor], y: torch.Tensor, gram: torch.Tensor | None,
                    out: torch.Tensor | None) -> torch.Tensor:
        if y.ndim == 3 and self.loops(min(y.shape[-2:]), y.dtype):
            out = torch.empty_like(y) if out is None else out
            for i in range(y.size(0)):
                run(y[i], None if gram is None else gram[i], out[i])
            return out
        return run(y, gram, out)

    def orthogonalize_batch(self, xs: Sequence[torch.Tensor], schedule: Sequence[Coefficients], dtype: torch.dtype,
                            eps: float, norm_scale: float, consume: bool = False) -> torch.Tensor:
        """Each matrix normalized by its own Frobenius norm (in at least fp32, on its own layout)
        and cast straight into its slot of the batch, then the batch iterated: batched GEMMs below
        :data:`LOOP_MIN_DIM` rows, one matrix at a time from there or when the slots are not
        aligned (eager). Every step is computed per matrix on equally aligned memory, so a
        matrix's result does not depend on which others share its batch. A tall batch iterates
        in its own layout (:mod:`.iteration`), so nothing is transposed in or out.

        ``consume``: the matrices are the caller's to lose. Each is cast to ``dtype`` first (the
        values of ``[x.to(dtype) for x in xs]``, bit for bit) and, where its memory can hold the
        iteration's second buffer (:func:`own_slot`), normalized into it and iterated there, so
        that a matrix costs the call no scratch of its size; a batch of them is then iterated one
        matrix at a time where :meth:`consumes_each`; ``xs`` then hold no meaningful values. Where
        every matrix's memory holds both iterates (fp32 inputs of a bf16 iteration:
        :func:`own_slots`), X alternates within it (:meth:`iterate_within`) and the output is made
        only once the products are done, so that it never coexists with their working memory."""
        m, n = wide_shape(xs[0].shape)
        aligned = aligned_slots(m, n, dtype, xs[0].device)
        batched = not ((self.loops(m, dtype) or not aligned) and not torch.compiler.is_compiling())
        each = consume and aligned and (len(xs) == 1 or self.consumes_each(m))  # loops() implies consumes_each
        self.release_oversized(len(xs) if batched and not each else 1, m, n)
        shape = (len(xs),) + tuple(xs[0].shape)
        if each and getattr(schedule, "form", "standard") != "gram" and all(own_slots(x, dtype) for x in xs):
            results = [self.iterate_within(x, dtype, schedule, eps, norm_scale) for x in xs]
            out = torch.empty(shape, dtype=dtype, device=xs[0].device)  # made once the products are done
            for r, target in zip(results, out.unbind(0)):
                target.copy_(r)
            return out
        out = torch.empty(shape, dtype=dtype, device=xs[0].device)
        if each:
            for x, target in zip(xs, out.unbind(0) if len(xs) > 1 or not batched else [out]):
                self.iterate_consumed(x, target, schedule, eps, norm_scale)
            return out
        xs = [x.to(dtype) for x in xs] if consume else xs
        if batched:
            y = self.input_slot(schedule, out)
            for x, slot in zip(xs, y.unbind(0)):
                normalize_into(x, slot, norm_scale, eps)
            run_schedule(y, schedule, eps, self, out=out)
            return out
        for x, target in zip(xs, out.unbind(0)):
            y = self.input_slot(schedule, target if aligned else None, out)
            normalize_into(x, y, norm_scale, eps)
            if aligned:
                run_schedule(y, schedule, eps, self, out=target)
            else:  # the last product goes to aligned scratch, then into the slot
                target.copy_(run_schedule(y, schedule, eps, self))
        return out

    def iterate_consumed(self, x: torch.Tensor, out: torch.Tensor, schedule: Sequence[Coefficients],
                         eps: float, norm_scale: float) -> None:
        """One matrix ``x`` the caller gives up, iterated into ``out`` (aligned and contiguous: its
        slot, or a batch of one) with ``x``'s memory as the second buffer where it can be
        (:func:`own_slot`; else scratch): normalized, cast first, into whichever of the two
        the first iteration reads (:meth:`input_slot`)."""
        partner = own_slot(x, out.dtype)
        if partner is None:
            y = self.input_slot(schedule, out)
            normalize_into(x.to(out.dtype), y.view(x.shape), norm_scale, eps)
            run_schedule(y, schedule, eps, self, out=out)
            return
        gram_form = getattr(schedule, "form", "standard") == "gram"
        y = partner.view(out.shape) if gram_form or len(schedule) % 2 == 1 else out
        normalize_cast_into(x, y.view(x.shape), norm_scale, eps)
        run_schedule(y, schedule, eps, self, out=out, partner=None if gram_form else partner.view(out.shape))

    def iterate_within(self, x: torch.Tensor, dtype: torch.dtype, schedule: Sequence[Coefficients],
                       eps: float, norm_scale: float) -> torch.Tensor:
        """One matrix ``x`` the caller gives up, at least twice as wide per element as ``dtype``,
        iterated in its own memory: X alternates between its two halves (:func:`own_slots`),
        normalized and cast first into the head, from which the first iteration reads. Returns
        the half holding the result (the same values as :meth:`iterate_consumed`'s, bit for bit:
        the same products on equally aligned memory)."""
        head, tail = own_slots(x, dtype)  # type: ignore[misc]
        out, partner = (tail, head) if len(schedule) % 2 == 1 else (head, tail)
        normalize_cast_into(x, head, norm_scale, eps)
        run_schedule(head, schedule, eps, self, out=out, partner=partner)
        return out

    def input_slot(self, schedule: Sequence[Coefficients], out: torch.Tensor | None,
                   like: torch.Tensor | None = None) -> torch.Tensor:
        """Where a matrix (or batch) is normalized before its iteration into ``out``: of the two
        buffers X alternates between, the one its first iteration reads, not writes
        (:func:`.iteration.ring_input`); a Gram-form schedule, or no ``out`` (unaligned slots:
        the result comes from scratch), a scratch tensor of the shape of ``like``'s matrices."""
        if out is not None and getattr(schedule, "form", "standard") != "gram":
            slot = ring_input(len(schedule), out, self, out)
            return torch.empty(out.shape, dtype=out.dtype, device=out.device) if slot is None else slot
        like = out if out is not None else like
        assert like is not None  # without out the caller passes like
        slot = self.scratch("input", tuple(like.shape[-2:]) if out is None else tuple(like.shape), like)
        return torch.empty(like.shape if out is not None else like.shape[-2:], dtype=like.dtype,
                           device=like.device) if slot is None else slot


# A low-precision matrix's norm is summed in fp32 over row blocks of at most this many elements,
# each converted to fp32 on its own: torch.linalg.vector_norm(x, dtype=torch.float32) makes an fp32
# copy of all of x first (9 MiB for a bf16 768×3072 matrix, once the largest transient of a
# compiled gpt2-small step). 32K-element blocks cost 2.8 % of a 4-layer gpt2-small step in calls,
# 8 blocks per matrix 2.3 % but 1.1 MiB at the step's peak.
NORM_BLOCK = 1 << 16


def normalize_into(x: torch.Tensor, slot: torch.Tensor, norm_scale: float, eps: float) -> None:
    """``slot ← x / max(norm_scale·‖x‖_F, eps)``, in ``slot``'s dtype
    (:func:`.iteration.inverse_norm`, the norm in fp32 without a copy of ``x``)."""
    if x.element_size() >= 4 or x.numel() <= NORM_BLOCK:
        inv = inverse_norm(x, norm_scale, eps)
    else:
        rows = max(1, NORM_BLOCK // x.size(-1))
        blocks = torch.stack([torch.linalg.vector_norm(x[r:r + rows], dtype=torch.float32)
                              for r in range(0, x.size(0), rows)])
        inv = 1.0 / (torch.linalg.vector_norm(blocks) * norm_scale).clamp_min(eps)
    torch.mul(x, inv, out=slot)


def normalize_cast_into(x: torch.Tensor, slot: torch.Tensor, norm_scale: float, eps: float) -> None:
    """:func:`normalize_into` of ``x.to(slot.dtype)``, bit for bit, without a copy of all of ``x``:
    ``x`` is cast into ``slot`` in row blocks of :data:`NORM_BLOCK` elements, in order, then the
    norm is taken and ``slot`` scaled in place, so ``slot`` may be the head of ``x``'s own memory
    (:func:`own_slot`): a block written never reaches a block not yet read (the first, which
    overlaps its own rows, goes through a small temporary). The blocks lie where the cast copy's
    would, so the norm's sums are the same."""
    if x.dtype == slot.dtype:
        normalize_into(x, slot, norm_scale, eps)
        return
    rows = max(1, NORM_BLOCK // x.size(-1))
    starts = range(0, x.size(-2), rows)
    for r in starts:
        block = x[r:r + rows]
        slot[r:r + rows].copy_(block.to(slot.dtype) if r == 0 else block)
    if slot.element_size() >= 4 or x.numel() <= NORM_BLOCK:
        inv = inverse_norm(slot, norm_scale, eps)
    else:
        blocks = torch.stack([torch.linalg.vector_norm(slot[r:r + rows], dtype=torch.float32) for r in starts])
        inv = 1.0 / (torch.linalg.vector_norm(blocks) * norm_scale).clamp_min(eps)
    slot.mul_(inv)


def own_slot(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """``x``'s memory, from its start, as an ``empty`` tensor of ``x``'s shape in ``dtype``, where
    it can stand in for a fresh one: ``x`` contiguous, at least as wide per element, and on a
    :data:`SLOT_ALIGNMENT` boundary (so its GEMMs round as a fresh tensor's); else None."""
    size = dtype.itemsize
    if (not x.is_contiguous() or x.element_size() < size or x.element_size() % size
            or x.data_ptr() % SLOT_ALIGNMENT or x.dtype.is_complex or dtype.is_complex):
        return None
    return x.view(-1).view(dtype)[:x.numel()].view(x.shape)


def own_slots(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``x``'s memory as two ``empty`` tensors of ``x``'s shape in ``dtype``, its head and the
    part after it, where both can stand in for fresh ones (:func:`own_slot`): ``x`` at least
    twice as wide per element (fp32 for bf16), both on a :data:`SLOT_ALIGNMENT` boundary; else None."""
    head = own_slot(x, dtype)
    if head is None or x.element_size() < 2 * dtype.itemsize:
        return None
    tail = x.view(-1).view(dtype)[x.numel():2 * x.numel()]
    return None if tail.data_ptr() % SLOT_ALIGNMENT else (head, tail.view(x.shape))


def transposed(t: torch.Tensor) -> bool:
    """Whether the matrices of ``t`` are laid out column by column (a ``.mT`` view)."""
    return t.stride(-2) == 1 and t.stride(-1) != 1


def aligned_slots(m: int, n: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether every matrix of a batch of wide ``(m, n)`` matrices, and of their ``(m, m)`` Gram
    products, starts as a fresh tensor does (on a :data:`SLOT_ALIGNMENT` boundary) on the CPU, so
    a batched GEMM computes each as it would alone; off the CPU, True."""
    return torch.device(device).type != "cpu" or slots_align(m, n, dtype.itemsize)


def slots_align(m: int, n: int, item_bytes: int) -> bool:
    """:func:`aligned_slots` on the CPU, for elements of ``item_bytes`` bytes."""
    return (m * n * item_bytes) % SLOT_ALIGNMENT == 0 and (m * m * item_bytes) % SLOT_ALIGNMENT == 0


_SCRATCH = threading.local()  # per thread: {(role, shape, dtype, device): tensor}


def clear_scratch() -> None:
    """Free the scratch tensors this thread's eager orthogonalizations keep between calls."""
    _SCRATCH.__dict__.clear()


def scratch_buffers(device: torch.device) -> Buffers | None:
    """This thread's reused scratch where the execution policy asks for it: on the CPU, where a
    fresh allocation page-faults on first touch (about 10 % of a small step); CUDA's caching
    allocator already reuses memory."""
    if not _execution.policy(device).scratch:
        return None
    if not hasattr(_SCRATCH, "buffers"):
        _SCRATCH.buffers = {}
    return _SCRATCH.buffers
