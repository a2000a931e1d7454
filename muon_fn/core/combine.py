"""Combinators: ``chain`` and ``partition``."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any, NamedTuple

import torch

from . import tree as _tree
from .base import (ELEMENTWISE, MATRIX, GradientTransformation, OptState, Params, Updates, info, with_info,
                   without_donation)

Labels = Any | Callable[[Params], Any]  # a pytree of labels, or params -> pytree of labels


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply ``transforms`` in sequence; the state is the tuple of their states."""
    for i, tx in enumerate(transforms):
        if not isinstance(tx, GradientTransformation):
            raise TypeError(
                f"chain() argument {i} must be a GradientTransformation, got {type(tx).__name__}"
            )

    def init(params: Params) -> tuple[OptState, ...]:
        return tuple(tx.init(params) for tx in transforms)

    def update(updates: Updates, state: tuple, params: Params | None = None, **extra: Any):
        check_updates(updates, params)
        new_state = []
        later = without_donation(extra)  # donation covers the input only
        for i, (tx, s) in enumerate(zip(transforms, state)):
            updates, s = tx.update(updates, s, params, **(extra if i == 0 else later))
            new_state.append(s)
        return updates, tuple(new_state)

    update._muon_fn_repr = "chain(" + "".join(  # type: ignore[attr-defined]
        "\n  " + repr(tx).replace("\n", "\n  ") + "," for tx in transforms
    ) + ("\n)" if transforms else ")")
    infos = [info(tx) for tx in transforms]
    return with_info(GradientTransformation(init, update), leafwise=all(i.leafwise for i in infos),
                     scope=_common_scope(infos), parts=tuple(transforms),
                     final=bool(infos) and infos[-1].final, needs_params=any(i.needs_params for i in infos))


def check_updates(updates: Updates, params: Params | None) -> None:
    """``ValueError`` unless ``updates`` fit ``params`` (when given): the same tree, each leaf of
    its parameter's shape. Eager calls only: Dynamo's tree polyfills mis-trace the comparison
    (torch 2.13), and a compiled update's first call is checked by Dynamo itself."""
    if params is None or torch.compiler.is_compiling():
        return
    why = _tree.mismatch(updates, params)
    if why is not None:
        raise ValueError(f"the updates (gradients) do not match the parameters: {why}")


def _common_scope(infos) -> str | None:
    """ELEMENTWISE if every part is, MATRIX if every part is known and one needs matrices."""
    scopes = {i.scope for i in infos}
    if None in scopes:
        return None
    return MATRIX if MATRIX in scopes else ELEMENTWISE


class PartitionState(NamedTuple):
    """State of :func:`partition`: one inner state per label."""

    inner_states: Mapping[Hashable, OptState]


def partition(
    transforms: Mapping[Hashable, GradientTransformation], labels: Labels
) -> GradientTransformation:
    """Route each leaf to ``transforms[label]``.

    Args:
      transforms: label -> transform.
      labels: a pytree of labels with the structure of the params, or a function
        ``params -> labels`` (called on ``params`` in ``update`` when given, else on the updates).

    Each inner transform sees the full tree with the other labels' leaves replaced by ``None``
    (as missing gradients), so its state keeps the params' structure.
    """
    if not transforms:
        raise ValueError("partition() needs at least one transform")
    for label, tx in transforms.items():
        if not isinstance(tx, GradientTransformation):
            raise TypeError(
                f"partition() transform for label {label!r} must be a GradientTransformation, "
                f"got {type(tx).__name__}"
            )

    def label_tree(tree: Any) -> Any:
        tree_labels = labels(tree) if callable(labels) else labels
        found = set(_tree.tree_leaves(tree_labels))
        unknown = [lab for lab in found if lab is not None and lab not in transforms]
        if unknown:
            raise ValueError(
                f"partition(): labels {sorted(map(repr, unknown))} have no transform "
                f"(transforms given for {sorted(map(repr, transforms))})"
            )
        return tree_labels

    def mask(tree: Any, tree_labels: Any, label: Hashable) -> Any:
        return _tree.tree_map(lambda x, lab: x if lab == label else None, tree, tree_labels)

    def init(params: Params) -> PartitionState:
        tree_labels = label_tree(params)
        return PartitionState(
            {label: tx.init(mask(params, tree_labels, label)) for label, tx in transforms.items()}
        )

    def update(updates: Updates, state: PartitionState, params: Params | None = None, **extra: Any):
        check_updates(updates, params)
        tree_labels = label_tree(params if params is not None else updates)
        new_inner, outs = {}, {}
        for label, tx in transforms.items():
            masked_params = None if params is None else mask(params, tree_labels, label)
            outs[label], new_inner[label] = tx.update(
                mask(updates, tree_labels, label), state.inner_states[label], masked_params, **extra
            )
        order = list(transforms)

        def pick(u, lab, *outs_):
            if u is None:
                return None
            if lab is None:
                raise ValueError("partition(): a leaf with an update has the label None; give it a label")
            return outs_[order.index(lab)]

        merged = _tree.tree_map(
            pick,
            updates,
            tree_labels,
            *(outs[label] for label in order),
        )
        return merged, PartitionState(new_inner)

    infos = [info(tx) for tx in transforms.values()]
    leafwise = getattr(labels, "_muon_fn_leafwise", False) and all(i.leafwise for i in infos)
    update._muon_fn_repr = "partition({" + "".join(  # type: ignore[attr-defined]
        f"\n  {label!r}: " + repr(tx).replace("\n", "\n  ") + "," for label, tx in transforms.items()
    ) + "\n}, labels=" + (getattr(labels, "__name__", "<fn>") if callable(labels) else "<tree>") + ")"
    return with_info(GradientTransformation(init, update), leafwise=leafwise, scope=_common_scope(infos),
                     needs_params=any(i.needs_params for i in infos))


def leafwise_labels(fn: Callable[[Any], Hashable]) -> Callable[[Params], Any]:
    """Labels for :func:`partition` from a function of one leaf (``param -> label``).

    Because each leaf's label depends on that leaf alone, the partition stays *leafwise*
    (:class:`~muon_fn.TransformInfo`): adapters may update the tree in parts."""

    def labels(params: Params) -> Any:
        return _tree.tree_map(lambda p: None if p is None else fn(p), params)

    labels.__name__ = getattr(fn, "__name__", "labels")
    labels._muon_fn_leafwise = True  # type: ignore[attr-defined]
    return labels
