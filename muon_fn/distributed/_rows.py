"""How a matrix travels to its owner and back: the columns of its rows.

Sent, per row of the matrix (``(out, in)``, conv kernels folded into ``in``): the update (``in``
columns), the parameter's row when the mid phase reads parameters (``in`` more), then every *row
state* of the mid phase — a state leaf whose leading dim is the matrix's rows, such as NorMuon's
``row_variance`` — flattened to ``(out, k)``. Returned: the mid phase's update, then the new row
states. Every other mid-state leaf is *replicated*: each rank holds it whole, the owner computes
its new value, and the adapter shares it after the exchange. Everything travels in one dtype
(:func:`common_dtype`, an exact up-cast) and is cast back on arrival.
"""

from __future__ import annotations

import math
from typing import NamedTuple
from collections.abc import Sequence

import torch

from ..engine import Slot


class Leaf(NamedTuple):
    """One mid-state leaf of one matrix."""

    key: str  # its key in torch's state dict
    shape: tuple[int, ...]  # global
    dtype: torch.dtype

    @property
    def width(self) -> int:
        """Columns it takes on the wire (a row state)."""
        return math.prod(self.shape[1:])


class RowFormat(NamedTuple):
    """The columns of one matrix on the wire."""

    shape: tuple[int, ...]  # the parameter's global shape
    update_dtype: torch.dtype  # of the update entering the mid phase
    result_dtype: torch.dtype  # of the update the mid phase returns
    param_dtype: torch.dtype | None  # None: the parameter does not travel
    row_states: tuple[Leaf, ...]
    replicated: tuple[Leaf, ...]

    @property
    def cols(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def sent_cols(self) -> int:
        return self.cols * (2 if self.param_dtype is not None else 1) + self._state_cols

    @property
    def returned_cols(self) -> int:
        return self.cols + self._state_cols

    @property
    def _state_cols(self) -> int:
        return sum(leaf.width for leaf in self.row_states)

    def dtypes(self) -> set[torch.dtype]:
        return {self.update_dtype, self.result_dtype, *(leaf.dtype for leaf in self.row_states)} | (
            set() if self.param_dtype is None else {self.param_dtype})


def row_format(shape: Sequence[int], update_dtype: torch.dtype, result_dtype: torch.dtype,
               param_dtype: torch.dtype | None, mid_slots: Sequence[tuple[Slot, bool]]) -> RowFormat:
    """The format of a matrix of global ``shape`` whose mid-phase state is ``mid_slots``
    (``(slot, follows the rows)`` pairs); ``param_dtype`` None when the mid phase reads no params."""
    rows, replicated = [], []
    for slot, follows_rows in mid_slots:
        (rows if follows_rows else replicated).append(Leaf(slot.key, slot.shape, slot.dtype))
    return RowFormat(tuple(shape), update_dtype, result_dtype, param_dtype, tuple(rows), tuple(replicated))


def common_dtype(formats: Sequence[RowFormat]) -> torch.dtype:
    """One dtype that holds every column of every format exactly (fp32 for fp32 and bf16)."""
    dtypes = {d for f in formats for d in f.dtypes()}
    out = torch.float32 if not dtypes else dtypes.pop()
    for d in dtypes:
        out = torch.promote_types(out, d)
    return out


def _columns(tensors: Sequence[torch.Tensor], widths: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """``tensors`` side by side as ``(rows, sum(widths))`` columns (rows may be 0)."""
    rows = tensors[0].shape[0]
    flat = [t.reshape(rows, w).to(dtype) for t, w in zip(tensors, widths)]
    return flat[0] if len(flat) == 1 else torch.cat(flat, dim=1)


def _split(x: torch.Tensor, widths: Sequence[int]) -> list[torch.Tensor]:
    return list(torch.split(x, list(widths), dim=1))


def pack(fmt: RowFormat, update: torch.Tensor | None, param: torch.Tensor, states: Sequence[torch.Tensor],
         dtype: torch.dtype) -> torch.Tensor:
    """This rank's rows to send, ``(rows, sent_cols)``: ``update`` (zeros if None), ``param`` (if
    the format carries it) and the row ``states`` in the format's order."""
    if update is None:
        update = torch.zeros((param.shape[0], fmt.cols), dtype=dtype, device=param.device)
    carried = [param] if fmt.param_dtype is not None else []
    return _columns([update, *carried, *states], _sent_widths(fmt), dtype)


def _sent_widths(fmt: RowFormat) -> list[int]:
    return [fmt.cols] * (2 if fmt.param_dtype is not None else 1) + [leaf.width for leaf in fmt.row_states]


def _returned_widths(fmt: RowFormat) -> list[int]:
    return [fmt.cols] + [leaf.width for leaf in fmt.row_states]


def unpack_sent(fmt: RowFormat, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
    """On the owner, the whole matrix's update, parameter (or None) and row states, each in its
    own dtype and global shape, contiguous (as a single-device step would see them); on a rank
    computing its rows of a local matrix, the same for those rows."""
    cols = _split(x, _sent_widths(fmt))
    rows = x.shape[0]
    whole = lambda c, dtype, shape: c.to(dtype).contiguous().reshape((rows,) + tuple(shape[1:]))  # noqa: E731
    update = whole(cols.pop(0), fmt.update_dtype, fmt.shape)
    param = None if fmt.param_dtype is None else whole(cols.pop(0), fmt.param_dtype, fmt.shape)
    states = {leaf.key: whole(c, leaf.dtype, leaf.shape) for leaf, c in zip(fmt.row_states, cols)}
    return update, param, states


def pack_result(fmt: RowFormat, update: torch.Tensor, states: dict[str, torch.Tensor],
                dtype: torch.dtype) -> torch.Tensor:
    """On the owner, the result to return, ``(out, returned_cols)``."""
    return _columns([update] + [states[leaf.key] for leaf in fmt.row_states], _returned_widths(fmt), dtype)


def unpack_result(fmt: RowFormat, x: torch.Tensor,
                  local_shape: Sequence[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """This rank's rows of the result: the update shaped like the local parameter, and the new
    row states shaped like the local state leaves."""
    rows = x.shape[0]
    cols = _split(x, _returned_widths(fmt))
    update = cols[0].to(fmt.result_dtype).reshape(tuple(local_shape))
    states = [c.to(leaf.dtype).reshape((rows,) + leaf.shape[1:]) for leaf, c in zip(fmt.row_states, cols[1:])]
    return update, states
