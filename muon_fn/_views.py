"""Matrix views: how a tensor of ndim ≥ 2 is read as matrices.

``"flatten"``: one matrix ``(shape[0], prod(shape[1:]))`` — a 2-D weight as is, a conv kernel
``(out, in, kh, kw)`` as ``(out, in·kh·kw)``. ``"experts"``: the leading dims are a batch and
each ``(shape[-2], shape[-1])`` slice is a matrix of its own — an expert stack ``(E, out, in)`` is
E matrices ``(out, in)``. A 2-D tensor is itself under either view.

Either way the matrices are row blocks of one 2-D reshape of the tensor, its *rows*
(:func:`rows_shape`): ``(out, in·k…)`` for ``"flatten"``, ``(E·out, in)`` for ``"experts"``. The
transforms that need whole matrices (:func:`~muon_fn.orthogonalize`,
:func:`~muon_fn.scale_by_shape`, :func:`~muon_fn.normalize_rows`,
:func:`~muon_fn.spectral_sphere`) read every leaf through this module, so the matrix a step
orthogonalizes is the matrix it scales.

A view is given as a name or as a function ``leaf -> name``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Callable, Union

import torch

VIEWS = ("flatten", "experts")
View = Union[str, Callable[[torch.Tensor], str]]


def check_view(view: View, name: str = "view") -> None:
    """``view`` is one of :data:`VIEWS` or a function of the leaf."""
    if callable(view) and not isinstance(view, str):
        return
    if view not in VIEWS:
        listed = ", ".join(repr(v) for v in VIEWS)
        raise ValueError(f"Invalid {name}: {view!r} (valid: {listed}, or a function leaf -> view)")


def view_of(view: View, leaf: torch.Tensor) -> str:
    """The view name of ``leaf``: ``view`` itself, or what the function ``view`` returns for it."""
    if isinstance(view, str):
        return view
    name = view(leaf)
    if name not in VIEWS:
        listed = ", ".join(repr(v) for v in VIEWS)
        raise ValueError(f"view function returned {name!r} for a leaf of shape {tuple(leaf.shape)} "
                         f"(valid: {listed})")
    return name


def _check_ndim(shape: Sequence[int]) -> tuple[int, ...]:
    shape = tuple(int(s) for s in shape)
    if len(shape) < 2:
        raise ValueError(f"expected a matrix (ndim >= 2), got shape {shape}")
    return shape


def matrix_shape(shape: Sequence[int], view: str = "flatten") -> tuple[int, int]:
    """The ``(out, in)`` of each matrix of a tensor of ``shape``: ``(shape[0], prod(shape[1:]))``
    for ``"flatten"`` (conv kernels folded into ``in``), ``shape[-2:]`` for ``"experts"``."""
    shape = _check_ndim(shape)
    if view == "experts":
        return shape[-2], shape[-1]
    return shape[0], math.prod(shape[1:])


def count(shape: Sequence[int], view: str = "flatten") -> int:
    """How many matrices a tensor of ``shape`` holds: 1, or ``prod(shape[:-2])`` for ``"experts"``."""
    shape = _check_ndim(shape)
    return math.prod(shape[:-2]) if view == "experts" else 1


def rows_shape(shape: Sequence[int], view: str = "flatten") -> tuple[int, int]:
    """The 2-D reshape whose row blocks are the matrices: ``(count·out, in)``."""
    out, inp = matrix_shape(shape, view)
    return count(shape, view) * out, inp


def rows(x: torch.Tensor, view: str = "flatten") -> torch.Tensor:
    """``x`` as its rows (:func:`rows_shape`), a view of ``x``'s memory when ``x`` is contiguous."""
    return x.reshape(rows_shape(x.shape, view))


def matrices(x: torch.Tensor, view: str = "flatten") -> torch.Tensor:
    """``x`` as a batch ``(count, out, in)`` of its matrices."""
    return x.reshape(count(x.shape, view), *matrix_shape(x.shape, view))


def label(view: View) -> str:
    """``view`` as a transform's repr shows it: its name, or the function's name."""
    return view if isinstance(view, str) else getattr(view, "__name__", repr(view))
