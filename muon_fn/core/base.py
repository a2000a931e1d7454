"""Base types of the functional core: ``GradientTransformation``, ``EmptyState``, aliases, and the
:class:`TransformInfo` an adapter reads to split an update into buckets or phases."""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Protocol
from collections.abc import Callable

import torch

Params = Any  # a pytree of tensors
Updates = Any  # a pytree of tensors (or None for missing gradients), same structure as Params
OptState = Any  # a pytree (NamedTuples, tuples, dicts) of tensors
Scalar = float | torch.Tensor  # a Python float or a 0-d tensor
Schedule = Callable[[torch.Tensor], torch.Tensor]  # step count (0-d tensor) -> value
ScalarOrSchedule = float | torch.Tensor | Schedule

# How much of a leaf a transform needs to see (TransformInfo.scope).
ELEMENTWISE = "elementwise"  # each element from the same element of the inputs and its state: works on any shard
MATRIX = "matrix"  # whole matrices (orthogonalization, norms of a matrix, shape scales)
SCOPES = (ELEMENTWISE, MATRIX)


class TransformUpdateFn(Protocol):
    def __call__(
        self, updates: Updates, state: OptState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, OptState]: ...


class TransformInitFn(Protocol):
    def __call__(self, params: Params) -> OptState: ...


class GradientTransformation(NamedTuple):
    """A pair of pure functions, as in optax.

    ``init(params) -> state`` builds the state for a pytree of parameters.
    ``update(updates, state, params=None, **extra) -> (updates, state)`` transforms a pytree of
    updates (gradients on entry). Neither function mutates its arguments, with one exception
    the caller opts into: ``update(..., donated=True)`` gives up the memory of the update tensors
    passed in, as JAX's donated buffers (:func:`donated`). Per-step scalars are 0-d tensors;
    static configuration is closed over by the factory that built the pair.
    """

    init: TransformInitFn
    update: TransformUpdateFn

    def __repr__(self) -> str:
        name = getattr(self.update, "_muon_fn_repr", None)
        return name if name is not None else f"GradientTransformation(init={self.init!r}, update={self.update!r})"


DONATED = "donated"  # the keyword of update(**extra) that :func:`donated` reads


def donated(extra: dict[str, Any]) -> bool:
    """Whether an update's ``**extra`` donate its updates: ``donated=True`` says the caller will
    not read the update tensors it passed again (it overwrites or drops them), so the transform
    may use their memory, e.g. as scratch (:func:`~muon_fn.orthogonalize` iterates in it). It
    covers the tensors as passed only: :func:`~muon_fn.chain` gives it to its first part alone,
    since a later part's input may be an earlier part's state."""
    return bool(extra.get(DONATED, False))


def donating(on: bool) -> dict[str, bool]:
    """The ``**extra`` of an update that donates its updates where ``on`` (:func:`donated`)."""
    return {DONATED: True} if on else {}


def without_donation(extra: dict[str, Any]) -> dict[str, Any]:
    """``extra`` for a transform that must not take the caller's tensors (:func:`donated`)."""
    return {k: v for k, v in extra.items() if k != DONATED}


class TransformInfo(NamedTuple):
    """What an adapter may assume about a transform (read with :func:`info`).

    ``leafwise``: each leaf's update and new state depend only on that leaf's update, state and
    param, so a tree may be updated in parts (the adapters' buckets) with the same result.
    ``scope``: :data:`ELEMENTWISE` (works on any row shard of a leaf: the FSDP adapter runs it
    on local shards) or :data:`MATRIX` (needs whole matrices: it runs on the matrix's owner);
    ``None`` when unknown. ``parts``: the transforms of a :func:`~muon_fn.chain`, in order.
    ``final``: the update already contains everything (SSO's retraction): nothing may follow it.
    ``needs_params``: ``update`` reads ``params`` (weight decay, SSO's retraction), so an
    adapter that runs it elsewhere than the parameter (the FSDP owner) must bring them along.
    ``per_matrix``: each matrix of a leaf's view (an expert of a stack) gets the same bits
    whatever other matrices are updated with it, so a stack may be computed in parts (the FSDP
    adapter computes each rank's experts where they lie).
    """

    leafwise: bool = False
    scope: str | None = None
    parts: tuple[GradientTransformation, ...] = ()
    final: bool = False
    needs_params: bool = False
    per_matrix: bool = False


def info(tx: GradientTransformation) -> TransformInfo:
    """The :class:`TransformInfo` of ``tx`` (unknown transforms: not leafwise, no scope)."""
    return getattr(tx.update, "_muon_fn_info", TransformInfo())


def with_info(tx: GradientTransformation, **fields: Any) -> GradientTransformation:
    """Attach a :class:`TransformInfo` to ``tx`` (returned for chaining)."""
    tx.update._muon_fn_info = TransformInfo(**fields)  # type: ignore[attr-defined]
    return tx


class EmptyState(NamedTuple):
    """The state of a stateless transform."""


def init_empty_state(params: Params) -> EmptyState:
    del params
    return EmptyState()


def identity() -> GradientTransformation:
    """The transform that returns its updates unchanged."""

    def update(updates, state, params=None, **extra):
        del params, extra
        return updates, state

    return with_info(GradientTransformation(init_empty_state, update), leafwise=True, scope=ELEMENTWISE)


def stateless(fn: Callable[[Updates, Params | None], Updates]) -> GradientTransformation:
    """Wrap ``fn(updates, params) -> updates`` as a stateless transform."""

    def update(updates, state, params=None, **extra):
        del extra
        return fn(updates, params), state

    return GradientTransformation(init_empty_state, update)


def shown(v: Any) -> Any:
    """What a repr shows for a configuration value: a 1-element tensor's value as a float (read
    once, at build time; see :func:`shortest_float`), anything else (a meta tensor, which has no
    value) as it is."""
    if isinstance(v, torch.Tensor) and v.numel() == 1 and v.device.type != "meta":
        return shortest_float(v)
    return v


def shortest_float(v: torch.Tensor) -> float:
    """The value of the 1-element tensor ``v`` as the float with the fewest significant digits
    that ``v``'s dtype stores as the same value: the hyperparameter as the user wrote it (a
    float32 0.95 shows as 0.95, not 0.949999988079071). float64 and integer values as they are."""
    x = float(v)
    if not v.is_floating_point() or v.dtype == torch.float64 or not math.isfinite(x):
        return x
    for digits in range(1, 18):
        short = float(f"{x:.{digits}g}")
        if torch.tensor(short, dtype=v.dtype).item() == x:
            return short
    return x


def named(tx: GradientTransformation, name: str, **config: Any) -> GradientTransformation:
    """Attach a readable repr ``name(k=v, ...)`` to ``tx`` (shown by ``repr(tx)``)."""
    args = ", ".join(f"{k}={shown(v)!r}" for k, v in config.items())
    tx.update._muon_fn_repr = f"{name}({args})"  # type: ignore[attr-defined]
    return tx
