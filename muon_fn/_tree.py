"""Thin optree wrappers: the only module that imports optree.

Every function treats ``None`` as a leaf (a missing gradient), so trees of updates, states and
params keep one structure whether or not every parameter received a gradient.
"""

from __future__ import annotations

from typing import Any, Callable

import optree
import torch

NAMESPACE = "muon_fn"
PyTreeSpec = optree.PyTreeSpec


def tree_map(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """Map ``fn`` over the leaves of ``tree`` (and the matching leaves of ``rest``)."""
    return optree.tree_map(fn, tree, *rest, none_is_leaf=True, namespace=NAMESPACE)


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
