"""What a checkpoint records besides torch's own: the parameter layout, checked on load, and
dtype hyperparameters by name.

``state_dict()`` stores in every saved param group, under :data:`KEY`, one
:class:`ParamLayout` ``(name, global shape, matrix view)`` per parameter, in the group's order.
``load_state_dict`` compares it with the loading optimizer's own layout before anything changes
(:func:`check_group`): state is keyed by position, so a renamed, reordered or reshaped parameter,
or one seen as other matrices, would otherwise receive another parameter's state.

Groups whose saved ``params`` are names (``torch.distributed.checkpoint``'s
``set_optimizer_state_dict``, which re-keys state by fully qualified name) are compared name by
name; if the record has no names, the saved order is lost and only the state's sizes are
checked. A checkpoint without the record (``torch.optim`` optimizers, older muon_fn versions) is
checked by its ``param_names`` where both sides have them, else only by the state's sizes.

Hyperparameters that are dtypes (``ns_dtype``, ``momentum_dtype``, ``msign_dtype``) are saved by
name, ``"torch.bfloat16"`` (:func:`dtypes_by_name`): a full state dict of
``torch.distributed.checkpoint`` takes only tensors, numbers, strings and containers. Loading reads
either form (:func:`dtypes_from_names`), so checkpoints that stored the dtype itself still load.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from . import _placement

KEY = "param_layout"
# The positions in a saved group of the parameters that had no state when it was saved (they had
# not received a gradient yet): the load tells them from state that went missing.
STATELESS = "params_without_state"
_MISMATCH = "loaded state dict contains a parameter group that doesn't match optimizer's group"


_DTYPES = {str(d): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


def dtypes_by_name(group: dict[str, Any]) -> dict[str, Any]:
    """``group`` with every ``torch.dtype`` value replaced by its name (``"torch.float32"``) and
    every container copied: ``torch.distributed.checkpoint`` loads into the state dict it got
    from ``state_dict()`` in place, down to a ``matrix_view`` mapping's entries, which must not
    be the optimizer's own."""
    return {k: str(v) if isinstance(v, torch.dtype) else _copied(v) for k, v in group.items()}


def dtypes_from_names(group: dict[str, Any]) -> dict[str, Any]:
    """``group`` with every dtype name (``"torch.float32"``) replaced by the ``torch.dtype`` and
    every container copied (the optimizer's groups share nothing with a loaded state dict)."""
    return {k: _DTYPES.get(v, v) if isinstance(v, str) else _copied(v) for k, v in group.items()}


def _copied(value: Any) -> Any:
    return copy.deepcopy(value) if isinstance(value, (dict, list)) else value


class ParamLayout(NamedTuple):
    """What a checkpoint records of one parameter."""

    name: str | None  # fully qualified name, where known
    shape: tuple[int, ...]  # global shape (of the whole parameter, not of a shard)
    view: str | None  # its matrix view (muon_fn.core.views), None where the optimizer has none


def entry(value: Any) -> ParamLayout:
    """A saved entry as a :class:`ParamLayout` (a JSON round trip turns tuples into lists)."""
    name, shape, view = value
    return ParamLayout(name, tuple(int(s) for s in shape), view)


def describe(p: ParamLayout, *, view: bool = False) -> str:
    """``'fc1.weight' of shape (24, 12)`` (``one of shape ...`` when unnamed), with the view if asked."""
    who = repr(p.name) if p.name is not None else "one"
    return f"{who} of shape {p.shape}" + (f" with view {p.view!r}" if view else "")


def _differ(saved: ParamLayout, ours: ParamLayout, names: bool) -> bool:
    return (names and saved.name != ours.name) or (saved.shape, saved.view) != (ours.shape, ours.view)


# Name segments of wrappers (torch.compile, activation checkpointing, FSDP1), which
# torch.distributed.checkpoint leaves out of the names it keys state by.
_WRAPPERS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


def canonical(name: str) -> str:
    """``name`` without wrapper segments: ``layers.0._checkpoint_wrapped_module.w`` -> ``layers.0.w``."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPERS)


def root_shift(loaded: Sequence[str], recorded: Sequence[str]) -> dict[str, str] | None:
    """Each of ``loaded`` (names relative to the module a checkpoint is loaded through) to one of
    ``recorded`` (relative to the optimizer's own module), one to one: the same names up to
    wrapper segments, or all with one module root swapped for another (loaded through the
    optimizer's parent, ``model.0.weight`` for ``0.weight``, or a child); None if none fits."""
    known = {canonical(n): n for n in recorded}
    plain = [canonical(n) for n in loaded]
    candidates = [("", "")] + sorted((_roots(plain[0], n) for n in known if plain),
                                     key=lambda shift: len(shift[0]) + len(shift[1]))
    for strip, add in candidates:
        mapped = [add + n[len(strip):] if n.startswith(strip) else None for n in plain]
        if all(m in known for m in mapped) and len(set(mapped)) == len(mapped):
            return {n: known[m] for n, m in zip(loaded, mapped)}
    return None


def _roots(a: str, b: str) -> tuple[str, str]:
    """The prefixes before the longest run of whole trailing segments ``a`` and ``b`` share."""
    x, y = a.split("."), b.split(".")
    k = 0
    while k < min(len(x), len(y)) and x[-1 - k] == y[-1 - k]:
        k += 1
    return ".".join(x[:len(x) - k] + [""]) if k < len(x) else "", ".".join(y[:len(y) - k] + [""]) if k < len(y) else ""


def _difference(index: int, position: int, saved: ParamLayout, ours: ParamLayout) -> str:
    show_view = saved.view != ours.view
    return (f"{_MISMATCH} {index}: parameter {position} is "
            f"{describe(saved, view=show_view)} in the state dict but "
            f"{describe(ours, view=show_view)} in this optimizer; the state_dict "
            "comes from a different model layout")


def check_group(index: int, saved_group: dict[str, Any], ours: Sequence[ParamLayout]) -> None:
    """Raise ``ValueError`` naming the first parameter of group ``index`` whose saved layout
    differs from ``ours`` (torch's wording for a group of another size)."""
    saved_params = list(saved_group.get("params", ()))
    if len(saved_params) != len(ours):
        raise ValueError(f"loaded state dict contains a parameter group that doesn't match the size of "
                         f"optimizer's group: group {index} has {len(saved_params)} parameters in the "
                         f"state dict and {len(ours)} in this optimizer")
    record = saved_group.get(KEY)
    if record is None:
        _check_names(index, saved_group.get("param_names"), ours)
        return
    saved = [entry(e) for e in record]
    if len(saved) != len(ours):
        raise ValueError(f"{_MISMATCH} {index}: its {KEY} lists {len(saved)} parameters for "
                         f"{len(saved_params)} params")
    if saved_params and all(isinstance(pid, str) for pid in saved_params):
        if any(p.name is None for p in saved):
            return  # keyed by name, saved without names: the order is unknown, sizes are checked
        saved = _by_name(index, saved, saved_params)  # state keyed by name: order is free
    named = all(p.name is not None for p in saved) and all(p.name is not None for p in ours)
    if named and root_shift([p.name for p in saved], [p.name for p in ours]) == {
            s.name: o.name for s, o in zip(saved, ours)}:
        saved = [s._replace(name=o.name) for s, o in zip(saved, ours)]  # the same names through another root
    for position, (s, o) in enumerate(zip(saved, ours)):
        if _differ(s, o, named):
            raise ValueError(_difference(index, position, s, o))


def _by_name(index: int, saved: list[ParamLayout], order: list[str]) -> list[ParamLayout]:
    """The saved entries in the order of ``order`` (the names the loader put in ``params``, which
    torch.distributed.checkpoint makes relative to the module it is given: the recorded names
    are matched through another root, :func:`root_shift`)."""
    by_name = {p.name: p for p in saved}
    rename = root_shift(order, list(by_name))
    if rename is None:
        missing = [n for n in order if canonical(n) not in {canonical(m) for m in by_name}]
        shown = ", ".join(repr(n) for n in list(by_name)[:4]) + (", ..." if len(by_name) > 4 else "")
        raise ValueError(f"{_MISMATCH} {index}: the state dict records no parameter named "
                         f"{(missing or order)[0]!r}, nor the same names under another module root (it records "
                         f"{shown})")
    return [by_name[rename[n]] for n in order]


def _check_names(index: int, names: Any, ours: Sequence[ParamLayout]) -> None:
    """A checkpoint without the record: its ``param_names`` (if any) against ours, in order."""
    if names is None or any(p.name is None for p in ours):
        return
    for position, (name, p) in enumerate(zip(names, ours)):
        if name != p.name:
            raise ValueError(f"{_MISMATCH} {index}: parameter {position} is {name!r} in the state dict's "
                             f"param_names but {p.name!r} in this optimizer; the state_dict comes from a "
                             "different model layout")


def stateless_positions(params: Sequence[torch.Tensor], state: Any) -> list[int]:
    """The positions of ``params`` that hold no state in ``state`` (an optimizer's ``state``)."""
    return [i for i, p in enumerate(params) if not state.get(p)]


def check_state_present(index: int, saved_group: dict[str, Any], saved_state: dict[Any, Any],
                        name: Any) -> None:
    """``ValueError`` naming the first parameter of saved group ``index`` whose state the state
    dict lacks although it had state when saved (its :data:`STATELESS` record does not list it);
    for a checkpoint without the record, one whose state is missing while other parameters have
    theirs. ``name(position)``: the loading optimizer's name for the parameter at that position."""
    record = saved_group.get(STATELESS)
    if record is None and not saved_state:
        return  # saved before the first step: no parameter had state
    listed = set(record or ())
    for position, pid in enumerate(saved_group.get("params", ())):
        if position in listed or saved_state.get(pid, saved_state.get(str(pid))):
            continue
        why = ("which had state when the state_dict was saved" if record is not None else
               "while other parameters have theirs (if it had none when saved, as a parameter that never "
               "received a gradient, this is expected)")
        raise ValueError(
            f"loaded state dict has no state for parameter {name(position)} of group {index}, {why}: it would "
            "restart from zero momentum. Load the complete state_dict, or pass allow_missing_state=True to "
            "start the state of such parameters afresh")


OVERWRITTEN = ("The loader had already written this state_dict's state into the optimizer's own state tensors "
               "(torch.distributed.checkpoint loads in place into what get_optimizer_state_dict returned), so "
               "the optimizer's state is the refused checkpoint's now: build the optimizer again before "
               "stepping (the parameters are unchanged)")


def loaded_in_place(live: dict[Any, dict[str, Any]], loaded: dict[Any, dict[str, Any]]) -> bool:
    """Whether a state_dict's state tensors (``loaded``) share storage with the optimizer's own
    (``live``): a loader wrote the checkpoint into what ``state_dict()`` returned before the
    optimizer could check it."""
    ours = {_storage(t) for entry in live.values() for t in entry.values() if isinstance(t, torch.Tensor)}
    ours.discard(0)
    return any(_storage(t) in ours for entry in loaded.values() if isinstance(entry, dict)
               for t in entry.values() if isinstance(t, torch.Tensor))


def _storage(t: torch.Tensor) -> int:
    """The address of ``t``'s storage (of its local shard, for a DTensor); 0 where it has none."""
    local = t.to_local() if _placement.is_dtensor(t) else t
    return local.untyped_storage().data_ptr()
