"""Low-bit optimizer state: blockwise quantization within rows (``state_bits=16|8|4``).

A state tensor shaped like its parameter is stored as **codes** and per-block **scales**; the
wrapper that stores a transform's state (:func:`muon_fn.core.storage.stored`) dequantizes it at the
start of each update, the transform computes in fp32, and the wrapper requantizes the new value,
so what persists between steps is only the codes and the scales.

**Blocks lie within rows.** A tensor is read as ``(rows, n)`` with ``rows = shape[0]`` and
``n = prod(shape[1:])`` (a conv kernel folded into its row, an expert stack ``(E, out, in)`` one
row per expert); each row is cut into ``⌈n/BLOCK⌉`` blocks of equal size (the last one shorter
by the remainder), and every block has one fp32 scale, its absolute maximum. Codes are
``(rows, n)`` (``(rows, ⌈n/2⌉)`` at 4 bits, two codes a byte) and scales ``(rows, ⌈n/BLOCK⌉)``:
both have one row per parameter row, so a rank that holds whole rows of the parameter (FSDP2's ``Shard(0)``) holds
whole blocks, quantizes them exactly as one device does, and a checkpoint reshards like any
row-sharded tensor.

Two formats, by what the state holds (docs/design.md, "Low-bit state", for the measurements):

- :data:`LINEAR` (Muon's momentum, Adam's first moment): linear absmax, ``code = round(x·q/M)``
  with ``q = 127`` (8 bits) or ``7`` (4 bits); ``x̂ = code·M/q``, error at most ``M/(2q)``. At 16
  bits: bf16, no scales (rounded to nearest from the fp32 result).
- :data:`UNSIGNED` (Adam's second moment ``v``): a small float relative to the block maximum,
  ``r = x/M ∈ (0, 1]`` rounded to ``m`` mantissa bits over ``R`` octaves (8 bits: m = 3,
  R = 31; 4 bits: powers of two, R = 14; 16 bits: m = 10, R = 31). The relative error is at
  most ``2^-(m+1)`` whatever the magnitude (linear codes would turn every ``v`` below ``M/254``
  into 0, and Adam's step ``m/(√v + eps)`` into ``m/eps``); a positive ``v`` never becomes 0 (one
  below the range is stored as the smallest code). Code 0 is exactly 0.

Codes are int8 at 8 bits, uint8 holding two codes at 4 bits and int16 at 16 bits, whatever the
format (:data:`CODE_DTYPES`), so a checkpoint's codes say their width.

Every operation is exact integer or IEEE arithmetic (a division, a multiplication, a
round-half-even, bit shifts of the fp32 representation): no transcendental function, so an
element quantizes to the same code whether a kernel's vectorized body or its tail computes it,
and a shard of rows gets the codes the whole tensor would.

Tensors of ndim < 2 (biases, norm gains, 0-d counters) keep full precision at every width: they
are a tiny part of the state, and FSDP2 shards them by elements, where no block is whole.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from . import tree as _tree

STATE_BITS = (32, 16, 8, 4)
"""The widths every optimizer's ``state_bits=`` takes: 32 (fp32 state) and the blockwise codes at 16, 8, 4."""
LINEAR, UNSIGNED = "linear", "unsigned"
KINDS = (LINEAR, UNSIGNED)

# Elements per block within a row (docs/design.md, "Low-bit state": chosen by measurement).
BLOCK = 256

# The UNSIGNED formats, per width: (mantissa bits m, octaves R below the block maximum, code
# offset). A value r = x/M is code 1 + (R + log2 r)·2^m + mantissa (0 .. R·2^m + 1); codes are
# stored minus the offset, so that each width has one code dtype: int16 (16 bits), int8 (8 bits,
# both formats), uint8 (4 bits, two a byte).
_UNSIGNED = {16: (10, 31, 0), 8: (3, 31, 128), 4: (0, 14, 0)}
CODE_DTYPES = {16: torch.int16, 8: torch.int8, 4: torch.uint8}
_LINEAR_MAX = {8: 127, 4: 7}


def check_state_bits(value: Any, name: str = "state_bits") -> None:
    """``ValueError`` naming ``name`` unless ``value`` is one of :data:`STATE_BITS`."""
    if isinstance(value, bool) or value not in STATE_BITS:
        raise ValueError(f"Invalid {name}: {value!r} (expected one of {', '.join(map(str, STATE_BITS))})")


def rows_of(shape: tuple[int, ...] | torch.Size) -> tuple[int, int]:
    """``(rows, n)``: how a tensor of ``shape`` (ndim ≥ 2) is cut into rows."""
    n = 1
    for s in shape[1:]:
        n *= s
    return shape[0], n


def blocks(n: int) -> int:
    """Blocks in a row of ``n`` elements: ``⌈n/BLOCK⌉``, of ``⌈n/blocks⌉`` elements each (the last
    one shorter by the remainder), so a row shorter than :data:`BLOCK` is one block."""
    return max(1, -(-n // BLOCK))


def block_size(n: int) -> int:
    """Elements per block in a row of ``n`` elements."""
    return max(1, -(-n // blocks(n)))


class Storage(NamedTuple):
    """How one state tensor of a transform is stored: ``bits`` wide, in format ``kind``.

    A stored value is a triple ``(plain, codes, scales)``: ``plain`` holds it unquantized (any
    tensor at 32 bits, one of ndim < 2, a :data:`LINEAR` one at 16 bits: bf16), else ``codes``
    and ``scales`` hold it; the other entries are ``None``.
    """

    bits: int = 32
    kind: str = LINEAR

    def has_codes(self) -> bool:
        """Whether matrices are stored as codes and scales at this width (not at 32 bits, nor
        :data:`LINEAR` at 16: bf16)."""
        return self.bits < 32 and not (self.bits == 16 and self.kind == LINEAR)

    def quantizes(self, shape: tuple[int, ...] | torch.Size) -> bool:
        """Whether a tensor of ``shape`` is stored as codes and scales."""
        return self.has_codes() and len(shape) >= 2

    def plain_dtype(self, dtype: torch.dtype, ndim: int = 2) -> torch.dtype:
        """The dtype of an unquantized tensor of ``ndim`` for a parameter of ``dtype``: bf16 for a
        signed matrix at 16 bits, else the parameter's, fp32 at least."""
        if self.bits == 16 and self.kind == LINEAR and ndim >= 2:
            return torch.bfloat16
        return torch.promote_types(dtype, torch.float32)

    def codes_dtype(self) -> torch.dtype:
        return CODE_DTYPES[self.bits]

    def codes_shape(self, shape: tuple[int, ...] | torch.Size) -> tuple[int, int]:
        rows, n = rows_of(shape)
        return (rows, -(-n // 2)) if self.bits == 4 else (rows, n)

    def scales_shape(self, shape: tuple[int, ...] | torch.Size) -> tuple[int, int]:
        rows, n = rows_of(shape)
        return rows, blocks(n)

    def init(self, p: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """The stored zeros of a state tensor shaped like ``p``."""
        if not self.quantizes(p.shape):
            return torch.zeros(p.shape, dtype=self.plain_dtype(p.dtype, p.ndim), device=p.device), None, None
        return (None, torch.zeros(self.codes_shape(p.shape), dtype=self.codes_dtype(), device=p.device),
                torch.zeros(self.scales_shape(p.shape), dtype=torch.float32, device=p.device))

    def load(self, stored: tuple, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """The value of ``stored`` as a tensor of ``shape``, computed in ``dtype`` (fp32 for an fp32
        or half parameter)."""
        plain, codes, scales = stored
        if plain is not None:
            return plain.to(dtype)
        return decode(codes, scales, tuple(shape), self, dtype)

    def store(self, x: torch.Tensor, like: tuple) -> tuple[torch.Tensor | None, ...]:
        """``x`` stored as ``like`` is (the same entries ``None``)."""
        plain = like[0]
        if plain is not None:
            return x.to(plain.dtype), None, None
        return (None,) + encode(x, self)


def _blocked(x2: torch.Tensor) -> torch.Tensor:
    """``(rows, n)`` as ``(rows, blocks, block_size)``, the last block of each row padded with zeros."""
    rows, n = x2.shape
    nb, size = blocks(n), block_size(n)
    if nb * size != n:
        x2 = torch.nn.functional.pad(x2, (0, nb * size - n))
    return x2.reshape(rows, nb, size)


def _unblocked(xb: torch.Tensor, n: int) -> torch.Tensor:
    rows, nb, size = xb.shape
    x2 = xb.reshape(rows, nb * size)
    return x2 if nb * size == n else x2[:, :n]


def encode(x: torch.Tensor, storage: Storage) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)`` of ``x`` (ndim ≥ 2; see the module docstring)."""
    rows, n = rows_of(x.shape)
    xb = _blocked(x.reshape(rows, n).float())
    scale = xb.abs().amax(dim=-1, keepdim=True)  # (rows, blocks, 1): M of each block
    if storage.kind == LINEAR:
        q = _LINEAR_MAX[storage.bits]
        codes = torch.round(xb * torch.where(scale > 0, q / scale, 0.0)).to(torch.int8)
    else:
        codes = _encode_unsigned(xb, scale, storage.bits)
    codes = _unblocked(codes, n)
    if storage.bits == 4:
        codes = _pack4(codes)
    return codes, scale.reshape(rows, blocks(n))


def decode(codes: torch.Tensor, scales: torch.Tensor, shape: tuple[int, ...], storage: Storage,
           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The tensor of ``shape`` that ``(codes, scales)`` hold, in ``dtype``."""
    rows, n = rows_of(shape)
    if storage.bits == 4:
        codes = _unpack4(codes, n, signed=storage.kind == LINEAR)
    cb = _blocked(codes)
    scale = scales.reshape(rows, blocks(n), 1)
    if storage.kind == LINEAR:
        xb = cb.float() * (scale / _LINEAR_MAX[storage.bits])
    else:
        xb = _decode_unsigned(cb, scale, storage.bits)
    return _unblocked(xb, n).reshape(shape).to(dtype)


def _encode_unsigned(xb: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes of ``r = x/M`` (``x ≥ 0``): the fp32 bits of ``r`` rounded to ``m`` mantissa bits (an
    integer add, carrying into the exponent), shifted so that ``2^-R`` is code 1 and ``r = 1`` is
    code ``R·2^m + 1``; 0 for ``x = 0``, 1 for a positive ``r`` below ``2^-R`` (a second moment is
    never 0 unless it is)."""
    m, octaves, offset = _UNSIGNED[bits]
    shift = 23 - m
    r = xb / torch.where(scale > 0, scale, 1.0)
    q = (r.view(torch.int32) + (1 << (shift - 1))) >> shift  # biased exponent · 2^m + mantissa
    code = torch.where(r > 0, (q - ((127 - octaves) << m) + 1).clamp(min=1), 0)
    return (code - offset).to(CODE_DTYPES[bits])


def _decode_unsigned(cb: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    m, octaves, offset = _UNSIGNED[bits]
    c = cb.to(torch.int32) + offset
    r = ((c - 1 + ((127 - octaves) << m)) << (23 - m)).view(torch.float32)
    return torch.where(c > 0, r * scale, 0.0)


def _pack4(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (signed -7..7, or unsigned 0..15) two a byte: column ``2j``
    in the low nibble, ``2j + 1`` in the high one (a zero byte is two zero codes)."""
    rows, n = codes.shape
    c = codes.to(torch.int32)
    if n % 2:
        c = torch.nn.functional.pad(c, (0, 1))
    c = c.reshape(rows, c.shape[1] // 2, 2) & 15
    return (c[..., 0] | (c[..., 1] << 4)).to(torch.uint8)


def _unpack4(packed: torch.Tensor, n: int, *, signed: bool) -> torch.Tensor:
    b = packed.to(torch.int32)
    c = torch.stack([b & 15, b >> 4], dim=-1).reshape(packed.shape[0], 2 * packed.shape[1])
    if signed:
        c = (c ^ 8) - 8  # the nibble's two's complement
    return c[:, :n] if c.shape[1] != n else c


# ---------------------------------------------------------------------------------------------
# Trees of stored values (what a transform's state holds per field, for a tree of parameters).
def compute_dtype(g: torch.Tensor) -> torch.dtype:
    """The dtype a stored state's update is computed in: fp32, or fp64 for fp64 gradients."""
    return torch.promote_types(g.dtype, torch.float32)


def stored_zeros(storage: Storage, params: Any) -> tuple[Any, Any, Any]:
    """The ``(plain, codes, scales)`` trees of a state like ``params`` kept by ``storage``, zero."""
    triples = _tree.tree_map(lambda p: (None, None, None) if p is None else storage.init(p), params)
    return split_triples(params, triples)


def stored_triples(plain: Any, codes: Any = None, scales: Any = None) -> Any:
    """Per leaf, the stored value ``(plain, codes, scales)`` (:meth:`Storage.load`) of a state
    whose fields are ``plain`` (and ``codes``, ``scales``)."""
    if codes is None:
        return _tree.tree_map(lambda a: (a, None, None), plain)
    return _tree.tree_map(lambda a, b, c: (a, b, c), plain, codes, scales)


def split_triples(like: Any, triples: Any) -> tuple[Any, Any, Any]:
    """The ``(plain, codes, scales)`` trees of a tree of stored triples with ``like``'s structure."""
    return tuple(_tree.tree_map(lambda _, t: t[i], like, triples) for i in range(3))  # noqa: B023  called at once


# ---------------------------------------------------------------------------------------------
# Checkpoints: a stored quantity ``key`` is ``state[p][key]`` unquantized, or
# ``state[p][key + "_codes"]`` and ``state[p][key + "_scales"]``. Its format, by key, lets a
# checkpoint of one width load at another.
CODES, SCALES = "_codes", "_scales"
# The quantities the transforms store (muon_fn.momentum, muon_fn.scale_by_adam) and their formats.
STORED_KINDS: dict[str, str] = {"momentum_buffer": LINEAR, "exp_avg": LINEAR, "exp_avg_sq": UNSIGNED}
_BITS_OF = {dtype: bits for bits, dtype in CODE_DTYPES.items()}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _like(ref: torch.Tensor, local: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``local`` as ``ref`` is held: a DTensor with ``ref``'s mesh and placements and global
    ``shape`` when ``ref`` is one (rows of a row-sharded state), else ``local`` itself."""
    if not hasattr(ref, "to_local"):
        return local
    dtensor: Any = ref  # a DTensor (duck-typed: this module imports no torch.distributed)
    return type(dtensor).from_local(local, dtensor.device_mesh, dtensor.placements, run_check=False,
                                    shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride())


def _value(entry: dict[str, Any], key: str, kind: str, n: int | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(value, reference)`` of stored quantity ``key`` of ``entry`` as a ``(rows, n)`` fp32
    tensor of this rank's rows (``n`` None: from the codes), or None if ``entry`` lacks it."""
    if key in entry:
        plain = entry[key]
        local = _local(plain)
        return (local.reshape(rows_of(local.shape)) if local.ndim >= 2 else local).float(), plain
    if key + CODES not in entry or key + SCALES not in entry:
        return None
    codes, scales = entry[key + CODES], entry[key + SCALES]
    storage = Storage(_BITS_OF[codes.dtype], kind)
    local = _local(codes)
    width = local.shape[1] if storage.bits != 4 else (n if n is not None else 2 * local.shape[1])
    return decode(local, _local(scales), (local.shape[0], width), storage), codes


def convert(entry: dict[str, Any], wanted: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
    """Store every quantity of one parameter's state dict ``entry`` in the format ``wanted``
    (key → global shape and dtype, from the loading optimizer's layout): an unquantized value
    is quantized, codes are dequantized, codes of another width are decoded and encoded again;
    in place. Each rank converts its own rows (blocks lie within rows)."""
    for key, kind in STORED_KINDS.items():
        to_codes = key + CODES in wanted
        if to_codes == (key + CODES in entry) and (not to_codes or entry[key + CODES].dtype == wanted[key + CODES][1]):
            continue  # already as wanted (an unquantized dtype is cast by the caller)
        if not to_codes and key not in wanted:
            continue
        if to_codes:  # the row length, where the target says it (a 4-bit target: from the source)
            codes_shape, codes_dtype = wanted[key + CODES]
            n = codes_shape[1] if _BITS_OF[codes_dtype] != 4 else None
        else:
            n = rows_of(wanted[key][0])[1] if len(wanted[key][0]) >= 1 else 1
        found = _value(entry, key, kind, n)
        if found is None:
            continue
        value, ref = found
        for k in (key, key + CODES, key + SCALES):
            entry.pop(k, None)
        if to_codes:
            codes_shape, codes_dtype = wanted[key + CODES]
            codes, scales = encode(value, Storage(_BITS_OF[codes_dtype], kind))
            entry[key + CODES] = _like(ref, codes, codes_shape)
            entry[key + SCALES] = _like(ref, scales, wanted[key + SCALES][0])
        else:
            shape, dtype = wanted[key]
            local_shape = (value.shape[0],) + tuple(shape[1:]) if len(shape) >= 1 else tuple(shape)
            entry[key] = _like(ref, value.reshape(local_shape).to(dtype), shape)


def dequantized(entry: dict[str, Any], shape: tuple[int, ...]) -> dict[str, Any]:
    """A copy of one parameter's state dict ``entry`` (a parameter of ``shape``, held whole)
    with every quantized quantity as an fp32 tensor under its own key (for a torch optimizer)."""
    out = dict(entry)
    convert(out, {key: (tuple(shape), torch.float32) for key in STORED_KINDS if key + CODES in entry})
    return out


def nbytes(shape: tuple[int, ...] | torch.Size, bits: int, kind: str, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of one state tensor shaped like a parameter of ``shape`` and ``dtype``, stored at
    ``bits`` in format ``kind``: codes and scales included (what ``Storage(bits, kind).init``
    allocates, without allocating)."""
    storage = Storage(bits, kind)
    numel = 1
    for s in shape:
        numel *= s
    if bits == 32:  # the parameter's dtype, as torch.optim keeps it
        return numel * torch.empty((), dtype=dtype).element_size()
    if not storage.quantizes(shape):
        return numel * torch.empty((), dtype=storage.plain_dtype(dtype, len(shape))).element_size()
    codes, scales = storage.codes_shape(shape), storage.scales_shape(shape)
    itemsize = torch.empty((), dtype=storage.codes_dtype()).element_size()
    return codes[0] * codes[1] * itemsize + scales[0] * scales[1] * 4
