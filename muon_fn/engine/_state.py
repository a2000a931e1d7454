"""Where each leaf of a group's functional state lives in torch's per-parameter state dicts.

torch.optim keeps ``state[p] = {"momentum_buffer": t, "step": t, ...}``; the functional core keeps
one state pytree per parameter group. A :class:`StateLayout` maps every leaf of that pytree to
``(param index, key)`` so the adapter can store plain dicts (which ``load_state_dict`` handles)
and rebuild the pytree for each step. Leaves inside a subtree shaped like the group's params
belong to one parameter; other leaves (group-level scalars) are stored on every parameter.
Keys come from the state classes' ``state_keys`` (e.g. ``MomentumState.mu -> "momentum_buffer"``).
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import torch

from ..core import quantize as _quantize, tree as _tree


class Slot(NamedTuple):
    index: int | None  # parameter index in the group; None = a group-level scalar
    key: str  # key in state[p]
    shape: tuple[int, ...]
    dtype: torch.dtype


class StateLayout(NamedTuple):
    spec: Any  # PyTreeSpec of the state (None leaves included)
    slots: tuple[Slot | None, ...]  # one per leaf; None for None leaves

    def keys_for(self, index: int) -> list[str]:
        return [s.key for s in self.slots if s is not None and (s.index in (index, None))]


def _snake(name: str) -> str:
    name = name[:-5] if name.endswith("State") and len(name) > 5 else name
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _name(node: Any, entry: Any) -> str:
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        field = node._fields[entry]
        return getattr(type(node), "state_keys", {}).get(field, f"{_snake(type(node).__name__)}.{field}")
    return str(entry)


def build_layout(state: Any, n_params: int) -> StateLayout:
    """The layout of ``state`` (a functional state for a group of ``n_params`` parameters)."""
    paths, leaves, spec = _tree.tree_flatten_with_path(state)
    param_spec = _tree.tree_structure(tuple(range(n_params)))
    slots: list[Slot | None] = []
    taken: dict[tuple[int | None, str], int] = {}
    for path, leaf in zip(paths, leaves):
        if leaf is None:
            slots.append(None)
            continue
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"optimizer state leaves must be tensors, found {type(leaf).__name__} at {path}")
        # Walk down the path, remembering the last meaningful name and the parent container.
        node, names, parent = state, [], None
        for entry in path:
            parent = node
            names.append(_name(node, entry))
            node = node[entry]
        per_param = (
            parent is not None
            and isinstance(parent, tuple)
            and not hasattr(parent, "_fields")
            and _tree.tree_structure(parent) == param_spec
        )
        if per_param:
            index, label = int(path[-1]), _last_field(names[:-1])
        else:
            index, label = None, _last_field(names)
        n = taken.get((index, label), 0)
        taken[(index, label)] = n + 1
        key = label if n == 0 else f"{label}_{n}"
        slots.append(Slot(index, key, tuple(leaf.shape), leaf.dtype))
    return StateLayout(spec, tuple(slots))


def _last_field(names: list[str]) -> str:
    """The innermost non-numeric name on a path (a state field), e.g. ``momentum_buffer``."""
    for name in reversed(names):
        if not name.isdigit():
            return name
    return "state"


def _owners(slot: Slot, n: int) -> range | tuple[int]:
    """The parameters whose dicts hold ``slot`` (all of them for a group-level scalar)."""
    return range(n) if slot.index is None else (slot.index,)


def scatter(layout: StateLayout, state: Any, param_states: list[dict[str, Any]], *,
            overwrite: bool = True) -> None:
    """Store the leaves of ``state`` into the per-parameter dicts (only missing keys unless
    ``overwrite``)."""
    for slot, leaf in zip(layout.slots, _tree.tree_leaves(state)):
        if slot is None:
            continue
        for i in _owners(slot, len(param_states)):
            if overwrite or slot.key not in param_states[i]:
                param_states[i][slot.key] = leaf


def complete(layout: StateLayout, param_states: list[dict[str, Any]]) -> bool:
    """Whether every parameter's dict holds all of its keys."""
    return all(slot.key in param_states[i] for slot in layout.slots if slot is not None
               for i in _owners(slot, len(param_states)))


def gather(layout: StateLayout, param_states: list[dict[str, Any]]) -> Any:
    """Rebuild the state pytree from the per-parameter dicts (no copies)."""
    leaves = []
    for slot in layout.slots:
        if slot is None:
            leaves.append(None)
        elif slot.index is None:
            leaves.append(next(s[slot.key] for s in param_states if slot.key in s))
        else:
            leaves.append(param_states[slot.index][slot.key])
    return _tree.tree_unflatten(layout.spec, leaves)


def check(layout: StateLayout, param_states: list[dict[str, Any]], names: list[str]) -> None:
    """Raise a clear error if the dicts do not hold this layout's keys with its shapes."""
    for slot in layout.slots:
        if slot is None:
            continue
        for i in _owners(slot, len(param_states)):
            st = param_states[i]
            if not st:
                continue  # state not created yet (e.g. loaded before the first step)
            if slot.key not in st:
                raise ValueError(
                    f"loaded state for parameter {names[i]} has keys {sorted(st)} but this optimizer "
                    f"expects {sorted(layout.keys_for(i))}: the state_dict comes from a different "
                    "optimizer layout"
                )
            value = st[slot.key]
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != slot.shape:
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(
                    f"loaded state {slot.key!r} for parameter {names[i]} has shape {got}, expected "
                    f"{slot.shape}: the state_dict comes from a different optimizer layout"
                )


def cast_to_layout(layout: StateLayout, param_states: list[dict[str, Any]]) -> None:
    """Give every stored leaf the dtype the transform's ``init`` creates; a Python number (an old
    torch checkpoint's ``step``) becomes a 0-d tensor. State stored at another ``state_bits``
    (an fp32 ``momentum_buffer`` where this layout keeps ``momentum_buffer_codes`` and
    ``_scales``, or the reverse, or codes of another width) is converted first
    (:func:`muon_fn.core.quantize.convert`; the rows each rank holds, for DTensor state)."""
    for i, st in enumerate(param_states):
        if st:
            _quantize.convert(st, {slot.key: (slot.shape, slot.dtype) for slot in layout.slots
                                   if slot is not None and slot.index in (i, None)})
    for slot in layout.slots:
        if slot is None:
            continue
        for i in _owners(slot, len(param_states)):
            value = param_states[i].get(slot.key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and slot.shape == ():
                param_states[i][slot.key] = torch.tensor(value, dtype=slot.dtype)
            elif isinstance(value, torch.Tensor) and value.dtype != slot.dtype:
                param_states[i][slot.key] = value.to(slot.dtype)


# Keys older muon_fn versions stored that no transform owns any more: the adapter kept a ``step``
# counter for every parameter, Muon matrices included (torch.optim.Muon keeps none).
LEGACY_KEYS = ("step",)


def drop_legacy_keys(layout: StateLayout, param_states: list[dict[str, Any]]) -> None:
    """Remove :data:`LEGACY_KEYS` that this layout does not hold (old checkpoints load as is)."""
    for i, st in enumerate(param_states):
        owned = layout.keys_for(i)
        for key in LEGACY_KEYS:
            if key in st and key not in owned:
                del st[key]
