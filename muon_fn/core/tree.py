"""Thin optree wrappers: the only module that imports optree.

Every function treats ``None`` as a leaf (a missing gradient), so trees of updates, states and
params keep one structure whether or not every parameter received a gradient.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Callable

import optree
import torch

NAMESPACE = "muon_fn"
PyTreeSpec = optree.PyTreeSpec


def tree_map(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """Map ``fn`` over the leaves of ``tree`` (and the matching leaves of ``rest``)."""
    return optree.tree_map(fn, tree, *rest, none_is_leaf=True, namespace=NAMESPACE)


def map_step(step: Callable[[Any, Any], tuple[Any, Any]], updates: Any, state: Any) -> tuple[Any, Any]:
    """``(out, new_state)``: ``step(u, s) -> (out leaf, new state leaf)`` on each leaf of ``updates``
    and the matching leaf of ``state``; a ``None`` update (no gradient) keeps its state leaf."""
    res = tree_map(lambda u, s: (None, s) if u is None else step(u, s), updates, state)
    return tree_map(lambda _, r: r[0], updates, res), tree_map(lambda _, r: r[1], updates, res)


def tree_leaves(tree: Any) -> list[Any]:
    return optree.tree_leaves(tree, none_is_leaf=True, namespace=NAMESPACE)


def tree_flatten(tree: Any) -> tuple[list[Any], PyTreeSpec]:
    return optree.tree_flatten(tree, none_is_leaf=True, namespace=NAMESPACE)


def tree_unflatten(spec: PyTreeSpec, leaves: list[Any]) -> Any:
    return optree.tree_unflatten(spec, leaves)


def tree_structure(tree: Any) -> PyTreeSpec:
    return optree.tree_structure(tree, none_is_leaf=True, namespace=NAMESPACE)


def tree_flatten_with_path(tree: Any) -> tuple[list[tuple[Any, ...]], list[Any], PyTreeSpec]:
    return optree.tree_flatten_with_path(tree, none_is_leaf=True, namespace=NAMESPACE)


def zeros_like(tree: Any, dtype: torch.dtype | None = None) -> Any:
    """Zeros shaped like every tensor leaf; ``None`` leaves stay ``None``."""
    return tree_map(lambda t: None if t is None else torch.zeros_like(t, dtype=dtype), tree)


def is_none(x: Any) -> bool:
    return x is None


def path_name(path: tuple[Any, ...]) -> str:
    """A leaf's path as its keys joined, e.g. ``"['layer'][0]"`` (``"the tree"`` for the root)."""
    return "".join(f"[{k!r}]" for k in path) or "the tree"


def mismatch(updates: Any, params: Any) -> str | None:
    """Why ``updates`` cannot be the updates of ``params`` (another structure, or a leaf of
    another shape), or None. Missing gradients (``None`` leaves) match anything."""
    u_leaves, u_spec = tree_flatten(updates)
    p_leaves, p_spec = tree_flatten(params)
    if len(u_leaves) != len(p_leaves) or u_spec.num_nodes != p_spec.num_nodes or _paths(updates) != _paths(params):
        got, want = set(_paths(updates)), set(_paths(params))
        missing, extra = sorted(map(path_name, want - got)), sorted(map(path_name, got - want))
        if not missing and not extra:
            return (f"their trees have the same leaves but different containers (updates: {u_spec}, "
                    f"params: {p_spec})")
        return "; ".join(part for part in (missing and f"no update for {', '.join(missing[:5])}",
                                           extra and f"updates for {', '.join(extra[:5])}, which are not parameters")
                         if part)
    for i, (u, p) in enumerate(zip(u_leaves, p_leaves)):
        if u is not None and p is not None and u.shape != p.shape:
            hint = " (transposed?)" if u.ndim == 2 and u.shape == p.shape[::-1] else ""
            return (f"the update at {path_name(_paths(params)[i])} has shape {tuple(u.shape)} but its parameter "
                    f"has shape {tuple(p.shape)}{hint}")
    return None


def _paths(tree: Any) -> list[tuple[Any, ...]]:
    return optree.tree_paths(tree, none_is_leaf=True, namespace=NAMESPACE)
