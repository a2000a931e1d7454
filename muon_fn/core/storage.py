"""Low-bit state as a wrapper around a transform: :func:`stored` (``state_bits=16|8|4``).

``stored(tx, bits, layout)`` keeps ``tx``'s state between steps at ``bits``: the fields that
``layout`` names (trees like the params) are held in the formats of :mod:`muon_fn.core.quantize`
(codes and per-block scales, or a plain tensor where a leaf is not quantized). Each update decodes
them (in fp32, fp64 for fp64 gradients), calls ``tx.update`` on the decoded state and encodes the
new one, all in the caller's traced graph: only the stored form persists between steps, and the
inner transform never knows its state's width (as optax's ``masked`` and ``MultiSteps`` wrap a
transform without its knowing).

A leaf whose update is ``None`` (no gradient) keeps its stored value; the inner transform sees
``None`` for it in the decoded state, and leaves it so (muon_fn's transforms keep a leaf's state
when its update is ``None``). The stored fields start at zero, whatever ``tx.init`` holds in them
(their shapes and dtypes are what count): optimizer moments start at zero.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from . import checks as _checks, quantize as _quantize, tree as _tree
from .base import GradientTransformation, OptState, Params, Updates, info, named, with_info


class Layout(NamedTuple):
    """How :func:`stored` holds the state of a transform below 32 bits.

    ``plain``: the inner transform's state class (a NamedTuple). ``kinds``: each stored field of
    it (a tree like the params) and its format, :data:`~muon_fn.core.quantize.LINEAR` (signed values)
    or :data:`~muon_fn.core.quantize.UNSIGNED` (values ≥ 0, such as a second moment). ``quantized``:
    the state class at a width where some field has codes: ``plain``'s fields in order, each
    stored one followed by two fields for its codes and its scales (``mu`` → ``mu, codes,
    scales``). Where no field has codes (:data:`~muon_fn.core.quantize.LINEAR` at 16 bits: bf16) the
    state keeps the class ``plain``.
    """

    plain: type[Any]
    quantized: type[Any]
    kinds: dict[str, str]


def _check_stored(tx: Any, state_bits: Any, layout: Layout) -> None:
    _quantize.check_state_bits(state_bits)
    _check(layout)


@_checks.checked(_check_stored)
def stored(tx: GradientTransformation, state_bits: int, layout: Layout) -> GradientTransformation:
    """``tx`` with the fields of its state that ``layout`` names kept at ``state_bits`` (32: ``tx``
    itself). The update's math is ``tx``'s, on the decoded state; a leaf whose field is stored
    quantized gets an update in the compute dtype (fp32 for fp32 and half gradients)."""
    if state_bits == 32:
        return tx
    storages = {field: _quantize.Storage(state_bits, kind) for field, kind in layout.kinds.items()}
    coded = any(s.has_codes() for s in storages.values())

    def pack(inner: OptState, triples: dict[str, tuple[Any, Any, Any]]) -> OptState:
        """The stored state: ``inner``'s fields, a stored one as its plain (codes, scales) trees."""
        if not coded:
            return inner._replace(**{field: plain for field, (plain, _, _) in triples.items()})
        fields: list[Any] = []
        for field in inner._fields:
            fields.extend(triples[field] if field in triples else (getattr(inner, field),))
        return layout.quantized(*fields)

    def unpack(state: OptState) -> tuple[dict[str, Any], dict[str, tuple[Any, Any, Any]]]:
        """``(unstored fields, stored field -> its (plain, codes, scales) trees)`` of a stored state."""
        if not coded:
            return ({f: getattr(state, f) for f in state._fields if f not in storages},
                    {f: (getattr(state, f), None, None) for f in storages})
        values, triples, at = {}, {}, 0
        for field in layout.plain._fields:
            if field in storages:
                triples[field], at = tuple(state[at:at + 3]), at + 3
            else:
                values[field], at = state[at], at + 1
        return values, triples

    def init(params: Params) -> OptState:
        inner = tx.init(params)
        return pack(inner, {f: _quantize.stored_zeros(s, getattr(inner, f)) for f, s in storages.items()})

    def update(updates: Updates, state: OptState, params: Params | None = None, **extra: Any):
        values, triples = unpack(state)
        decoded = {f: _load(storages[f], updates, *t) for f, t in triples.items()}
        out, new = tx.update(updates, layout.plain(**values, **decoded), params, **extra)
        return out, pack(new, {f: _store(storages[f], updates, getattr(new, f), *t) for f, t in triples.items()})

    wrapped = named(GradientTransformation(init, update), "stored", inner=tx, state_bits=state_bits)
    return with_info(wrapped, **info(tx)._replace(parts=())._asdict())


def _check(layout: Layout) -> None:
    """``ValueError`` unless ``layout.quantized`` has ``layout.plain``'s fields with two more
    for each stored one, and every stored field is one of ``plain``'s in a known format."""
    fields = layout.plain._fields
    unknown = [f for f, kind in layout.kinds.items() if f not in fields or kind not in _quantize.KINDS]
    if unknown or len(layout.quantized._fields) != len(fields) + 2 * len(layout.kinds):
        raise ValueError(f"stored(): {layout.quantized.__name__} does not store {layout.plain.__name__}'s fields "
                         f"{dict(layout.kinds)} (each stored field followed by its codes and scales)")


def _load(storage: _quantize.Storage, updates: Updates, *stored: Any) -> Any:
    """The tree of values that a field stored as ``(plain, codes, scales)`` trees holds, each in
    its update's compute dtype (``None`` where the update is ``None``)."""
    return _tree.tree_map(
        lambda g, t: None if g is None else storage.load(t, g.shape, _quantize.compute_dtype(g)),
        updates, _quantize.stored_triples(*stored),
    )


def _store(storage: _quantize.Storage, updates: Updates, values: Any, *stored: Any) -> tuple[Any, Any, Any]:
    """The ``(plain, codes, scales)`` trees of ``values`` stored as the old ``stored`` trees are
    (a leaf without an update keeps its old stored value)."""
    new = _tree.tree_map(lambda g, x, t: t if g is None else storage.store(x, t),
                         updates, values, _quantize.stored_triples(*stored))
    return _quantize.split_triples(updates, new)
