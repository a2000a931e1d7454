"""A transform split into the phases the FSDP adapter runs, read from :class:`~muon_fn.TransformInfo`.

The parts of a :func:`~muon_fn.chain`, in order:

- **pre**: the leading ``ELEMENTWISE`` parts, on each rank's local rows (Muon: ``momentum``);
- **mid**: from the first to the last ``MATRIX`` part, on each matrix's owner, on whole matrices
  (Muon: ``orthogonalize`` … ``scale_by_shape``);
- **post**: the trailing ``ELEMENTWISE`` parts, on local rows, then the in-place apply (Muon:
  weight decay and learning rate).

A transform without a ``MATRIX`` part (AdamW) runs whole on local rows, with no exchange; one that
is not a chain is a chain of one part. The state of ``chain(*parts)`` is the tuple of the parts'
states, so a phase's state is a slice of it, and so are the slots of its state layout.

The step functions built here are what the adapter compiles, one graph per signature; each
returns what it would write, and the adapter writes each bucket as soon as it is computed (or,
``atomic=True``, the whole step at once), as the single-device step does (:mod:`muon_fn.engine._apply`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..core import compile as _compile, metrics as _metrics, tree as _tree
from ..core.base import ELEMENTWISE, MATRIX, GradientTransformation, donating, info
from ..core.combine import chain
from .. import engine
from ..engine import compute_bucket, finite_flags, guarded, masked


class Phases(NamedTuple):
    """A transform's parts in three phases."""

    whole: GradientTransformation  # chain(*parts): its state is what torch's state dicts hold
    pre: GradientTransformation
    mid: GradientTransformation | None  # None: no MATRIX part, the transform runs whole on shards
    post: GradientTransformation
    sizes: tuple[int, int, int]  # parts in pre, mid, post
    mid_needs_params: bool
    mid_per_matrix: bool  # every mid part is per_matrix (or elementwise): a stack may be cut

    def states(self, state: tuple) -> tuple[tuple, tuple, tuple]:
        """The pre, mid and post slices of a state of :attr:`whole`."""
        a, b, _ = self.sizes
        return state[:a], state[a:a + b], state[a + b:]


def split(tx: GradientTransformation, name: str) -> Phases:
    """The phases of ``tx`` (``name`` labels it in errors)."""
    parts = info(tx).parts or (tx,)
    for part in parts:
        part_info = info(part)
        if part_info.scope not in (ELEMENTWISE, MATRIX) or not part_info.leafwise:
            raise ValueError(
                f"the FSDP adapter cannot run {name}: its part {part!r} has scope "
                f"{part_info.scope!r} and leafwise={part_info.leafwise} (it needs a known scope, "
                "ELEMENTWISE or MATRIX, and a leafwise update; see muon_fn.TransformInfo)")
    matrix = [i for i, part in enumerate(parts) if info(part).scope == MATRIX]
    if not matrix:
        return Phases(chain(*parts), chain(*parts), None, chain(), (len(parts), 0, 0), False, False)
    a, b = matrix[0], matrix[-1] + 1
    return Phases(chain(*parts), chain(*parts[:a]), chain(*parts[a:b]), chain(*parts[b:]),
                  (a, b - a, len(parts) - b), any(info(p).needs_params for p in parts[a:b]),
                  all(info(p).per_matrix or info(p).scope == ELEMENTWISE for p in parts[a:b]))


def layouts(phases: Phases, meta: tuple[torch.Tensor, ...]) -> tuple[engine.StateLayout, tuple]:
    """The state layout of :attr:`Phases.whole` over the (meta) parameters ``meta``, and its
    pre, mid and post slices."""
    state = phases.whole.init(meta)
    full = engine.build_layout(state, len(meta))
    sliced, start = [], 0
    for part in phases.states(state):
        n = len(_tree.tree_leaves(part))
        sliced.append(engine.StateLayout(_tree.tree_structure(part), full.slots[start:start + n]))
        start += n
    return full, tuple(sliced)


def update_dtypes(phases: Phases, meta: tuple[torch.Tensor, ...]) -> tuple[list, list]:
    """The dtypes of the updates entering and leaving the mid phase (traced on meta tensors)."""
    pre_state, mid_state, _ = phases.states(phases.whole.init(meta))
    updates, _ = phases.pre.update(meta, pre_state, meta)
    results, _ = phases.mid.update(updates, mid_state, meta)
    return [u.dtype for u in updates], [r.dtype for r in results]


def signature(*trees: Any) -> tuple:
    """What a compiled phase step is specialized on: the trees' structure and every tensor leaf's
    shape, strides, dtype and device."""
    leaves, spec = _tree.tree_flatten(trees)
    return (spec,) + tuple((tuple(x.shape), x.stride(), x.dtype, x.device) if isinstance(x, torch.Tensor)
                           else x for x in leaves)


class Steps(NamedTuple):
    """The compiled (or eager) steps of one :class:`Phases`; each is pure: it returns what the
    adapter writes (:mod:`muon_fn.engine._apply`), under the step's finite flag and the guard of
    what the phase writes (:func:`~muon_fn.engine._apply.guarded`: ``ok`` and ``fault``, 0-d bools,
    ``None`` without a non-finite policy). The ``*_measured`` ones also return the raw telemetry
    of their phase (:mod:`muon_fn.core.metrics`) for the ``Leaf`` of each parameter, their last argument."""

    pre: _compile.PerSignature  # (params, grads, state, finite) -> (updates, new state, fault)
    mid: _compile.PerSignature  # (params, updates, state, finite, into) -> (updates, new state); into:
    # the updates are the caller's to overwrite, masked in place already (masked_in_place),
    # donated to the mid transform (donate), and each result is written into its update (written_into)
    post: _compile.PerSignature  # (params, updates, state, mid state, new mid state, finite)
    # -> (updates, new state, new mid state, ok, fault)
    whole: _compile.PerSignature  # (params, grads, state, finite) -> (updates, new state, ok, fault): no mid
    pre_update: _compile.PerSignature  # (params, grads, state) -> (updates, new state): the pre
    # phase run before the step's finite flag is known (overlap); the step applies the flag
    pre_measured: _compile.PerSignature
    mid_measured: _compile.PerSignature
    post_measured: _compile.PerSignature
    whole_measured: _compile.PerSignature


def steps(phases: Phases, options: dict[str, Any] | None, verify: bool = False) -> Steps:
    """The phase steps of ``phases``, compiled with ``options`` (None: eager); ``verify``: each
    signature's first run is checked (:class:`muon_fn.core.compile.PerSignature`).

    What each guards: the pre phase its new state (its updates travel on as they are, so that a
    non-finite one reaches the post phase's guard); the owner's mid phase nothing, but a bucket
    with a non-finite result is returned all non-finite, so that every rank keeps its rows of
    those matrices back alike; the post phase the parameters, its state and the mid state."""
    pre, mid, post, whole = phases.pre, phases.mid, phases.post, phases.whole

    def pre_step(params, grads, state, finite):
        updates, new_state = pre.update(masked(grads, finite), state, params)
        _, new_state, _, fault = guarded(state, (), new_state, finite)
        return updates, new_state, fault

    def mid_step(params, updates, state, finite, into):
        out, new_state = mid.update(updates if into else masked(updates, finite), state, params, **donating(into))
        return written_into(updates, poisoned(out, finite), into), new_state

    def post_step(params, updates, state, mid_state, new_mid_state, finite):
        final, new_state = post.update(masked(updates, finite), state, params)
        final, (new_state, kept_mid), ok, fault = guarded((state, mid_state), final, (new_state, new_mid_state),
                                                          finite)
        return final, new_state, kept_mid, ok, fault

    def whole_step(params, grads, state, finite):
        return compute_bucket(whole, params, grads, state, finite)

    def pre_update(params, grads, state):
        return pre.update(grads, state, params)

    def pre_measured(params, grads, state, finite, leaves):
        c = _metrics.Collector(leaves)
        c.sumsq("grad_sumsq", grads)
        updates, new_state = pre.update(masked(grads, finite), state, params, metrics=c)
        _, new_state, _, fault = guarded(state, (), new_state, finite)
        return updates, new_state, fault, c.result()

    def mid_measured(params, updates, state, finite, into, leaves):
        c = _metrics.Collector(leaves)
        out, new_state = mid.update(updates if into else masked(updates, finite), state, params, metrics=c,
                                    **donating(into))
        return written_into(updates, poisoned(out, finite), into), new_state, c.result()

    def post_measured(params, updates, state, mid_state, new_mid_state, finite, leaves):
        c = _metrics.Collector(leaves)
        c.sumsq("weight_sumsq", _tree.tree_map(lambda u, p: None if u is None else p, updates, params))
        final, new_state = post.update(masked(updates, finite), state, params, metrics=c)
        c.sumsq("update_sumsq", final)
        final, (new_state, kept_mid), ok, fault = guarded((state, mid_state), final, (new_state, new_mid_state),
                                                          finite)
        return final, new_state, kept_mid, ok, fault, c.result()

    def whole_measured(params, grads, state, finite, leaves):
        updates, new_state, raw = _metrics.measured_update(whole, masked(grads, finite), state, params, leaves,
                                                           grads=grads)
        return (*guarded(state, updates, new_state, finite, elementwise=info(whole).scope == ELEMENTWISE), raw)

    plain = (pre_step, mid_step, post_step, whole_step, pre_update)
    measured = (pre_measured, mid_measured, post_measured, whole_measured)
    return Steps(*(_compile.PerSignature(f, options, "the FSDP optimizer's step", verify=verify,
                                         compared=None if f in plain else without_figures)
                   for f in plain + measured))


def without_figures(result: tuple) -> tuple:
    """A measured phase's result without its telemetry, its last element (see
    :func:`muon_fn.engine._apply.without_figures`)."""
    return result[:-1]


def masked_in_place(updates: tuple, finite: torch.Tensor | None) -> None:
    """:func:`~muon_fn.engine.masked` in the updates' own memory, eagerly, before an ``into``
    mid step: compiled, the masked copy would be a second copy of every matrix, held while the
    iteration (one opaque operator) runs."""
    if finite is not None:
        for u in updates:
            if u is not None:
                u.masked_fill_(~finite, 0)


def written_into(updates: tuple, out: tuple, into: bool) -> tuple:
    """``out``, with ``into`` each result written into the update it was computed from where
    they agree in shape and dtype (the caller's buffers to overwrite: the owner's gathered
    matrices), so that a bucket's owner holds one copy of its matrices, not two (compiled, the
    last kernel of a result stores into its input)."""
    if not into:
        return out
    return tuple(o if o is None or u is None or o.shape != u.shape or o.dtype != u.dtype else u.copy_(o)
                 for u, o in zip(updates, out))


def poisoned(out: tuple, finite: torch.Tensor | None) -> tuple:
    """The owner's results of one bucket, all NaN if any is not finite (with a non-finite policy),
    so that every rank's guard keeps its rows of those matrices back (none is half updated)."""
    if finite is None:
        return out
    whole = finite_flags([u for u in out if u is not None]).all() if any(u is not None for u in out) else None
    if whole is None:
        return out
    return tuple(None if u is None else torch.where(whole, u, float("nan")) for u in out)
