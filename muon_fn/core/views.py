"""Matrix views: how a tensor of ndim ≥ 2 is read as matrices.

``"flatten"``: one matrix ``(shape[0], prod(shape[1:]))`` — a 2-D weight as is, a conv kernel
``(out, in, kh, kw)`` as ``(out, in·kh·kw)``. ``"experts"``: the leading dims are a batch and
each ``(shape[-2], shape[-1])`` slice is a matrix of its own — an expert stack ``(E, out, in)`` is
E matrices ``(out, in)``. A 2-D tensor is itself under either view.

A **head view** (:func:`heads`) cuts each of those matrices into blocks: row blocks (a fused
``q, k, v`` projection, or the heads of a query projection: ``heads(rows=(d, d, d))``,
``heads(rows=n_heads)``) or column blocks (the heads of an output projection:
``heads(cols=n_heads)``); both at once cut a grid. Each block is a matrix of its own, its *unit*:
orthogonalized, normalized and scaled by its own shape. ``heads(..., experts=True)`` cuts every
matrix of an expert stack.

Either way the matrices are row blocks of one 2-D reshape of the tensor, its *rows*
(:func:`rows_shape`): ``(out, in·k…)`` for ``"flatten"``, ``(E·out, in)`` for ``"experts"``; a
unit is a block of rows and columns of it (:func:`units`). The transforms that need whole
matrices (:func:`~muon_fn.orthogonalize`, :func:`~muon_fn.scale_by_shape`,
:func:`~muon_fn.normalize_rows`, :func:`~muon_fn.spectral_sphere`) and the FSDP planner read
every leaf through this module, so the matrix a step orthogonalizes is the matrix it scales.

A view is given as a name, a :class:`Heads`, or a function ``leaf -> view``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

VIEWS = ("flatten", "experts")
Blocks = int | tuple[int, ...] | None  # n equal blocks, or their sizes


@dataclass(frozen=True)
class Heads:
    """A head view (built by :func:`heads`): hashable and picklable, so it can sit in a param
    group, a state_dict and a compiled transform's configuration."""

    rows: Blocks = None
    cols: Blocks = None
    experts: bool = False

    def __repr__(self) -> str:
        parts = [f"{k}={getattr(self, k)!r}" for k in ("rows", "cols") if getattr(self, k) is not None]
        return f"heads({', '.join(parts + (['experts=True'] if self.experts else []))})"


View = str | Heads | Callable[[torch.Tensor], str | Heads]


def _blocks(name: str, value) -> Blocks:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise ValueError(f"Invalid {name}: {value!r} (expected a number of blocks >= 1 or block sizes)")
        return value
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value or not all(
            isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in value):
        raise ValueError(f"Invalid {name}: {value!r} (expected a number of blocks >= 1 or positive block sizes)")
    return tuple(value)


def heads(rows: int | Sequence[int] | None = None, cols: int | Sequence[int] | None = None, *,
          experts: bool = False) -> Heads:
    """A head view: each matrix cut into ``rows`` row blocks and/or ``cols`` column blocks, each
    block orthogonalized and scaled by its own shape.

    Args:
      rows: ``n`` equal row blocks (``n`` must divide the matrix's rows) or the blocks' sizes
        (they must sum to its rows), e.g. ``(d_q, d_kv, d_kv)`` for a fused grouped-query QKV.
      cols: the same along the columns (the input features), e.g. the heads feeding an output
        projection ``(d, n_heads·d_head)``.
      experts: the matrices are those of an expert stack (``"experts"``), each cut the same way;
        default: the ``"flatten"`` matrix.

    A head view names one layout, so give it per parameter: ``matrix_view={name: heads(...)}`` in
    the optimizers, or one transform per parameter set with :func:`muon_fn.partition`.
    """
    if rows is None and cols is None:
        raise ValueError("heads() needs rows= or cols= (the blocks of each matrix)")
    if not isinstance(experts, bool):
        raise TypeError(f"Invalid experts: {experts!r} (expected True or False)")
    return Heads(_blocks("rows", rows), _blocks("cols", cols), experts)


def check_view(view: View, name: str = "view") -> None:
    """``view`` is one of :data:`VIEWS`, a :class:`Heads` or a function of the leaf."""
    if isinstance(view, Heads) or (callable(view) and not isinstance(view, str)):
        return
    if view not in VIEWS:
        listed = ", ".join(repr(v) for v in VIEWS)
        raise ValueError(f"Invalid {name}: {view!r} (valid: {listed}, muon_fn.heads(...), "
                         "or a function leaf -> view)")


def view_of(view: View, leaf: torch.Tensor) -> str | Heads:
    """The view of ``leaf``: ``view`` itself, or what the function ``view`` returns for it."""
    if isinstance(view, (str, Heads)):
        return view
    return returned(view(leaf), leaf)


def returned(out, leaf: torch.Tensor) -> str | Heads:
    """``out``, what a view function returned for ``leaf``, if it is a view."""
    if not isinstance(out, Heads) and out not in VIEWS:
        listed = ", ".join(repr(v) for v in VIEWS)
        raise ValueError(f"view function returned {out!r} for a leaf of shape {tuple(leaf.shape)} "
                         f"(valid: {listed}, muon_fn.heads(...))")
    return out


def base(view: str | Heads) -> str:
    """The view whose matrices a head view cuts (``"flatten"`` or ``"experts"``)."""
    if isinstance(view, Heads):
        return "experts" if view.experts else "flatten"
    return view


def _check_ndim(shape: Sequence[int]) -> tuple[int, ...]:
    shape = tuple(int(s) for s in shape)
    if len(shape) < 2:
        raise ValueError(f"expected a matrix (ndim >= 2), got shape {shape}")
    return shape


def matrix_shape(shape: Sequence[int], view: str | Heads = "flatten") -> tuple[int, int]:
    """The ``(out, in)`` of each matrix of a tensor of ``shape``: ``(shape[0], prod(shape[1:]))``
    for ``"flatten"`` (conv kernels folded into ``in``), ``shape[-2:]`` for ``"experts"`` (a head
    view: of the matrices it cuts)."""
    shape = _check_ndim(shape)
    if base(view) == "experts":
        return shape[-2], shape[-1]
    return shape[0], math.prod(shape[1:])


def count(shape: Sequence[int], view: str | Heads = "flatten") -> int:
    """How many matrices a tensor of ``shape`` holds: 1, or ``prod(shape[:-2])`` for ``"experts"``."""
    shape = _check_ndim(shape)
    return math.prod(shape[:-2]) if base(view) == "experts" else 1


def rows_shape(shape: Sequence[int], view: str | Heads = "flatten") -> tuple[int, int]:
    """The 2-D reshape whose row blocks are the matrices: ``(count·out, in)``."""
    out, inp = matrix_shape(shape, view)
    return count(shape, view) * out, inp


def rows(x: torch.Tensor, view: str | Heads = "flatten") -> torch.Tensor:
    """``x`` as its rows (:func:`rows_shape`), a view of ``x``'s memory when ``x`` is contiguous."""
    return x.reshape(rows_shape(x.shape, view))


def matrices(x: torch.Tensor, view: str | Heads = "flatten") -> torch.Tensor:
    """``x`` as a batch ``(count, out, in)`` of its matrices."""
    return x.reshape(count(x.shape, view), *matrix_shape(x.shape, view))


def _cut(blocks: Blocks, size: int, what: str, view: Heads, shape: tuple[int, ...]) -> list[int]:
    """The block sizes ``blocks`` gives a side of ``size``, or an error naming the view and shape."""
    if blocks is None:
        return [size]
    if isinstance(blocks, int):
        if size % blocks == 0:
            return [size // blocks] * blocks
    elif sum(blocks) == size:
        return list(blocks)
    raise ValueError(f"{view!r} does not fit a leaf of shape {shape}: its matrices have {size} {what}")


def block_sizes(shape: Sequence[int], view: str | Heads) -> tuple[list[int], list[int]]:
    """The row and column sizes of the blocks of each matrix (one block each without heads)."""
    out, inp = matrix_shape(shape, view)
    if not isinstance(view, Heads):
        return [out], [inp]
    shape = tuple(int(s) for s in shape)
    return _cut(view.rows, out, "rows", view, shape), _cut(view.cols, inp, "columns", view, shape)


def column_blocks(shape: Sequence[int], view: str | Heads) -> int:
    """How many column blocks each matrix has (1 without heads); reads the columns only, so it
    holds for any rows of the tensor (an FSDP shard's too)."""
    if not isinstance(view, Heads):
        return 1
    shape = tuple(int(s) for s in shape)
    return len(_cut(view.cols, matrix_shape(shape, view)[1], "columns", view, shape))


class Unit(tuple):
    """A block of a leaf's rows (:func:`rows`): ``(rows, cols)`` slices."""

    __slots__ = ()

    @property
    def shape(self) -> tuple[int, int]:
        r, c = self
        return r.stop - r.start, c.stop - c.start


def units(shape: Sequence[int], view: str | Heads = "flatten") -> list[Unit]:
    """Every unit of a tensor of ``shape`` as slices of its rows: matrix by matrix, then its row
    blocks, then its column blocks."""
    row_sizes, col_sizes = block_sizes(shape, view)
    out, _ = matrix_shape(shape, view)
    col_starts = [sum(col_sizes[:j]) for j in range(len(col_sizes))]
    found = []
    for e in range(count(shape, view)):
        r0 = e * out
        for size in row_sizes:
            found += [Unit((slice(r0, r0 + size), slice(c0, c0 + cs))) for c0, cs in zip(col_starts, col_sizes)]
            r0 += size
    return found


def unit_shapes(shape: Sequence[int], view: str | Heads = "flatten") -> list[tuple[int, int]]:
    """The ``(m, n)`` of every unit."""
    return [u.shape for u in units(shape, view)]


def split(x: torch.Tensor, view: str | Heads) -> list[torch.Tensor]:
    """``x``'s units: views of its rows, copied to contiguous memory where columns are cut (so a
    block is laid out as the same matrix alone, and reductions over it round alike)."""
    r = rows(x, view)
    blocks = [r[u[0], u[1]] for u in units(x.shape, view)]
    if len(block_sizes(x.shape, view)[1]) == 1:
        return blocks
    return [b.contiguous() for b in blocks]


def join(outs: Sequence[torch.Tensor], like: torch.Tensor, view: str | Heads) -> torch.Tensor:
    """Inverse of :func:`split`: a tensor shaped like ``like`` from its units' results, in order
    (zeros of ``like``'s shape for a stack of no matrices)."""
    if not outs:
        return like.new_zeros(like.shape)
    k = len(block_sizes(like.shape, view)[1])
    bands = [outs[i] if k == 1 else torch.cat(list(outs[i:i + k]), dim=1) for i in range(0, len(outs), k)]
    return (torch.cat(bands) if len(bands) > 1 else bands[0]).reshape(like.shape)


def label(view: View) -> str | Heads:
    """``view`` as a transform's repr shows it: its name or head view, or the function's name."""
    return view if isinstance(view, (str, Heads)) else getattr(view, "__name__", repr(view))
