"""Each parameter's matrix view in an optimizer (what a view is: :mod:`muon_fn.core.views`).

A group's ``matrix_view`` is ``None`` (the default), a view name for every parameter of ndim ≥ 3
of the group, a mapping ``{name or glob pattern: view}`` over parameter names, or a function
``param -> view | None``. A parameter it does not name takes the view its module gives it when the
optimizer knows the model (:func:`module_views`: a conv weight is flattened, any other parameter
of ndim ≥ 3 is an expert stack); otherwise ``"flatten"``, a guess that a parameter of ndim ≥ 3 is
warned about (:func:`guess_warning`). 2-D parameters read the same under both names.

A head view (:func:`muon_fn.heads`) describes one parameter's layout (its fused blocks or its
heads), so it is accepted per parameter only: as a value of the mapping or returned by the
function, for 2-D parameters too. A group-wide head view is refused (:func:`check_spec`): it
would cut every matrix of the group whose shape it happens to fit.
"""

from __future__ import annotations

import fnmatch
import os
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ..core import views as _views

Spec = Any  # None | str | Mapping[str, str | Heads] | Callable[[torch.Tensor], str | Heads | None]


def check_spec(spec: Spec) -> None:
    """A group's ``matrix_view``, with an error naming the bad value."""
    if isinstance(spec, _views.Heads):
        raise ValueError(
            f"Invalid matrix_view: {spec!r} for a whole group: a head view is one parameter's layout; "
            f"give it per parameter, matrix_view={{name or glob pattern: {spec!r}}} (named parameters) "
            "or a function param -> view | None")
    if spec is None or (callable(spec) and not isinstance(spec, str)):
        return
    if isinstance(spec, Mapping):
        for pattern, view in spec.items():
            if not isinstance(pattern, str):
                raise ValueError(f"Invalid matrix_view: key {pattern!r} (expected a parameter name or glob pattern)")
            _views.check_view(view, f"matrix_view[{pattern!r}]")
        return
    _views.check_view(spec, "matrix_view")


def unmatched(spec: Spec, names: list[str | None]) -> list[str]:
    """The keys of a mapping ``spec`` that name none of ``names`` (exactly or as a glob pattern):
    a misspelled name would otherwise be ignored."""
    if not isinstance(spec, Mapping):
        return []
    named = [n for n in names if n is not None]
    return [k for k in spec if not any(n == k or fnmatch.fnmatchcase(n, k) for n in named)]


def refuse_unmatched(spec: Spec, names: list[str | None], what: str, elsewhere: dict[str, str] | None = None) -> None:
    """``ValueError`` for the first key of a mapping ``spec`` that names none of ``names`` (the
    parameters it may give a view, ``what``); ``elsewhere``: other parameters, name -> why the
    mapping does not apply to them."""
    missing = unmatched(spec, names)
    if not missing:
        return
    key = missing[0]
    hits = [n for n in (elsewhere or {}) if n == key or fnmatch.fnmatchcase(n, key)]
    why = (f" ({hits[0]!r} gets {elsewhere[hits[0]]}, which reads no matrix view)" if hits else "")
    shown = ", ".join(repr(n) for n in names[:8] if n is not None) + (", ..." if len(names) > 8 else "")
    raise ValueError(f"Invalid matrix_view: key {key!r} matches no {what}{why}; they are: {shown}")


def given(spec: Spec, name: str | None, p: torch.Tensor) -> str | _views.Heads | None:
    """The view ``spec`` gives parameter ``p`` named ``name`` (None: it names none). A mapping
    matches the exact name first, then its glob patterns in order; a function may return None."""
    if spec is None:
        return None
    if isinstance(spec, Mapping):
        if name is None:
            raise ValueError(
                f"matrix_view is a mapping of parameter names, but a parameter of shape {tuple(p.shape)} "
                "has no name: pass named parameters (model.named_parameters()) or groups with 'param_names'")
        if name in spec:
            return spec[name]
        return next((view for pattern, view in spec.items() if fnmatch.fnmatchcase(name, pattern)), None)
    if callable(spec) and not isinstance(spec, str):
        view = spec(p)
        return None if view is None else _views.returned(view, p)
    return spec


def resolve(spec: Spec, params: list[torch.Tensor], names: list[str | None],
            known: Callable[[torch.Tensor], str | None]) -> tuple[list[str | _views.Heads], list[int]]:
    """The view of each parameter and the positions of the parameters of ndim ≥ 3 whose view was
    guessed. ``known(p)``: the view the model gives ``p`` (None: unknown). A head view must fit
    its parameter (an error names both)."""
    views, guessed = [], []
    for i, (p, name) in enumerate(zip(params, names)):
        view = given(spec, name, p) or known(p)
        if view is None and p.ndim >= 3:
            guessed.append(i)
        if isinstance(view, _views.Heads) and p.ndim >= 2:
            fits(view, p, f"#{i}" if name is None else repr(name))
            views.append(view)
            continue
        views.append(view if view is not None and p.ndim >= 3 else "flatten")
    return views, guessed


def fits(view: _views.Heads, p: torch.Tensor, name: str) -> None:
    """Raise unless head view ``view`` cuts parameter ``p`` (named ``name``) into whole blocks."""
    try:
        _views.block_sizes(p.shape, view)
    except ValueError as e:
        raise ValueError(f"Invalid matrix_view for parameter {name} of shape {tuple(p.shape)}: {e}") from None


def drop_unset_split(state_dict: Any) -> Any:
    """A state_dict saved when groups had a ``split`` key: without it when it was None (a
    ``split`` that was set cannot load: its blocks are a head view now)."""
    groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
    if not isinstance(groups, list) or not any(isinstance(g, dict) and "split" in g for g in groups):
        return state_dict
    for g in groups:
        if isinstance(g, dict) and g.get("split") is not None:
            raise ValueError(f"cannot load a param group saved with split={g['split']!r}: row blocks are a "
                             "head view now; build the optimizer with matrix_view={name: muon_fn.heads(rows=...)} "
                             "and load a state_dict whose groups have no 'split' key")
    return {**state_dict, "param_groups": [{k: v for k, v in g.items() if k != "split"} for g in groups]}


def module_views(model: nn.Module) -> dict[int, str]:
    """``id(param) -> view`` for every parameter of ndim ≥ 3 of ``model``: ``"flatten"`` for the
    weights of conv modules (``nn.Conv1d/2d/3d`` and their transposed and lazy forms), else
    ``"experts"`` (a stack of matrices, e.g. MoE experts ``(E, out, in)``)."""
    conv = {id(p) for m in model.modules() if isinstance(m, nn.modules.conv._ConvNd)
            for p in m.parameters(recurse=False)}
    return {id(p): "flatten" if id(p) in conv else "experts"
            for p in model.parameters() if p.ndim >= 3}


def guess_warning(owner: str, guessed: list[tuple[str, tuple[int, ...]]]) -> str:
    """The warning for parameters of ndim ≥ 3 whose view was guessed (``(name, shape)`` pairs)."""
    listed = ", ".join(f"{name} {shape}" for name, shape in guessed)
    name, shape = guessed[0]
    out, inp = _views.matrix_shape(shape)
    e, (mo, mi) = _views.count(shape, "experts"), _views.matrix_shape(shape, "experts")
    return (
        f"{owner}: no matrix_view is given for {listed}: each is read as one matrix "
        f"(shape[0], prod(shape[1:])), {name} as {out}x{inp}, which is right for a conv weight. For a "
        f"stack of matrices such as MoE experts (E, out, in) pass matrix_view='experts' ({name}: {e} "
        f"matrices {mo}x{mi}, each orthogonalized and scaled by its own shape) or a mapping "
        "{name or glob pattern: view}; pass matrix_view='flatten' to keep this without the warning. "
        "Given the model (model=model, or muon_fn.create_hybrid_optimizer(model)) the optimizer chooses by module.")


def caller_level() -> int:
    """The ``stacklevel`` of the first frame outside muon_fn and torch, for a ``warnings.warn``
    in the calling function: the user's line (that built the optimizer, or called ``step()``)."""
    inside = (os.path.dirname(os.path.dirname(__file__)), os.path.dirname(torch.__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


def warn(message: str) -> None:
    """Warn at the first caller outside muon_fn and torch (the line that built the optimizer)."""
    warnings.warn(message, UserWarning, stacklevel=caller_level())
