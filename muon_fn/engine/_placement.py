"""Where an optimizer's parameters live: plain tensors, or DTensors that the distributed step runs.

Every optimizer class takes either kind of parameter, at construction or swapped into
``param_groups`` afterwards (a trainer that shards the model after building the optimizer). An
optimizer holding a DTensor runs the owner-computes step of :mod:`muon_fn.fsdp`: each matrix is
orthogonalized whole by one rank (DTensor has no sharding rule for a Newton–Schulz iteration, and
running it through DTensor's ops would make every rank take part in every matrix).

This module only tells the two apart and hands the optimizer over: :func:`distribute` calls the
function that :mod:`muon_fn.distributed` registers when it is imported (:func:`register`;
``import muon_fn`` imports it), so the ``torch.optim`` engine never imports the distributed
executor that is built on it. That function gives the optimizer its distributed executor
(:class:`~._executor.Executor`); the optimizer's class never changes.

A swap is noticed at the next step by :class:`Placement`: the identity of every parameter,
compared by reference, costs well under a microsecond per parameter.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from . import views as _views
from ._distributed import DistributedOptions
from .views import caller_level
from ._step import step_not_traced

_DISTRIBUTE: list[Callable[..., None]] = []


def register(distribute: Callable[..., None]) -> None:
    """Set the function that runs an optimizer on the distributed executor:
    ``distribute(optimizer, previous, copied)`` (``previous``: the parameters it held before, per
    group, for a swap after construction; ``copied``: for a copy, what the original's executor
    kept (``Executor.getstate``); both None at construction)."""
    _DISTRIBUTE[:] = [distribute]


def distribute(optimizer: Any, previous: list[list[torch.Tensor | None]] | None = None,
               copied: dict[str, Any] | None = None) -> None:
    """Hand ``optimizer`` to the registered distributed executor (see :func:`register`)."""
    if not _DISTRIBUTE:  # only if muon_fn.distributed failed to import
        raise RuntimeError(f"{type(optimizer).__name__} holds DTensor parameters but the distributed executor is not "
                           "registered: import muon_fn.fsdp (importing muon_fn does)")
    _DISTRIBUTE[0](optimizer, previous, copied)


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (without importing torch.distributed:
    where that module is not loaded, nothing can be one)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def holds_dtensors(groups: Iterable[dict[str, Any]]) -> bool:
    """Whether any parameter of the param groups ``groups`` is a DTensor."""
    return any(is_dtensor(p) for g in groups for p in g["params"])


class Placed:
    """The part of :class:`muon_fn.Optimizer` that follows where its parameters are: the model
    they belong to (``model=``), a swap noticed at the next step, and what the distributed
    executor exposes (its options and plan)."""

    distributed_options: DistributedOptions
    _executor: Any

    def _know_model(self, model: nn.Module | None) -> None:
        """Keep ``model`` (see ``model=``): its parameters' names and their modules' views."""
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
        self._model = model
        named = () if model is None else model.named_parameters(remove_duplicate=False)
        self._names = {id(p): n for n, p in named}
        self._model_views = {} if model is None else _views.module_views(model)

    @step_not_traced
    def _follow_params(self) -> None:
        """Lay the step out again if parameters were swapped into ``param_groups`` since the last
        step (a trainer sharding the model after the optimizer was built): called first by
        ``step()``, ``state_dict()`` and ``load_state_dict()``; one reference comparison per
        parameter when nothing changed."""
        placement = self.__dict__.get("_placement")
        if placement is not None and placement.changed(self.param_groups):
            self._relayout(placement.previous())
            self._placement = Placement(self.param_groups)

    @step_not_traced
    def _check_model_holds_params(self) -> None:
        """Warn once when the model given as ``model=`` no longer holds the parameters this
        optimizer updates (``fully_shard`` applied after the optimizer was built, without
        swapping the new parameters into ``param_groups``): the steps then change tensors that
        the model no longer uses. One look-up per param group and step, only with a model."""
        model = self.__dict__.get("_model")
        if model is None or self.__dict__.get("_model_warned"):
            return
        names = self.__dict__.get("_names", {})
        for group in self.param_groups:
            p = group["params"][0] if group["params"] else None
            name = None if p is None else names.get(id(p))
            if name is None:  # swapped in since: not a parameter the model was seen with
                continue
            try:
                held = model.get_parameter(name)
            except AttributeError:
                held = None
            if held is not p:
                self._model_warned = True
                warnings.warn(
                    f"{type(self).__name__}: the model given as model= no longer holds this optimizer's "
                    f"parameter {name!r} (it was replaced, e.g. by fully_shard applied after the optimizer was "
                    "built): the steps update the former tensors, which the model does not use. Build the "
                    "optimizer after sharding the model, or swap the new parameters into param_groups",
                    UserWarning, stacklevel=caller_level())
                return

    def _relayout(self, previous: list[list[torch.Tensor | None]]) -> None:
        """After a swap: DTensors go to the distributed step (the state carried over there); plain
        tensors keep the state of the parameter they replace, which must have their shape. An
        empty state entry of a parameter no longer held is dropped (its stale key would fail
        torch's ``state_dict()``, and it would keep the former parameter alive)."""
        held = {id(p) for g in self.param_groups for p in g["params"]}
        for p in [p for p, st in self.state.items() if not st and id(p) not in held]:
            del self.state[p]
        if self._executor.distributed or holds_dtensors(self.param_groups):
            distribute(self, previous)
            return
        for group in self.param_groups:  # a bad swap is refused before anything changes
            self._check_param_types(group)
        for old, new in state_moves(self, previous):
            self.state[new] = {k: v.to(new.device) if isinstance(v, torch.Tensor) else v
                               for k, v in self.state.pop(old).items()}
        for index in range(len(self.param_groups)):
            self._rebuild_group(index)

    # ----------------------------------------------------------------------- distributed
    # What the distributed executor (muon_fn.fsdp) exposes, on every class: it runs once the
    # optimizer holds DTensors (the FSDP classes: always).
    @property
    def overlap(self) -> bool:
        """Whether each bucket's exchange starts during backward (``overlap=``). Setting it on
        DTensor parameters is collective (turning it on makes a process group): set it on every
        rank; turning it off removes the hooks."""
        ex: Any = self._executor
        return ex.overlap if ex.distributed else self.distributed_options.overlap

    @overlap.setter
    def overlap(self, on: bool) -> None:
        checked = self.distributed_options._replace(overlap=on).checked()  # the constructor's checks
        ex: Any = self._executor
        if ex.distributed:
            ex.overlap = on
        else:
            self.distributed_options = checked

    @property
    def strategy(self) -> str:
        """``strategy=`` of the distributed step: ``"owner"`` or ``"replicate"``."""
        ex: Any = self._executor
        return ex.strategy if ex.distributed else self.distributed_options.strategy

    @property
    def wire_dtype(self) -> torch.dtype | None:
        """``wire_dtype=`` of the distributed step (None: the parameters' dtype)."""
        ex: Any = self._executor
        return ex.wire_dtype if ex.distributed else self.distributed_options.wire_dtype

    @property
    def topology(self) -> Any:
        """Where the distributed step runs: ranks, mesh, groups (only on DTensor parameters)."""
        return self._distributed_attribute("topology")

    @property
    def plan(self) -> Any:
        """The distributed step's plan: each matrix's owner and bucket (only on DTensor parameters)."""
        return self._distributed_attribute("plan")

    def unshard_params(self) -> Any:
        """A context manager inside which every FSDP2 module of ``model=`` holds its full
        (unsharded) parameters; resharded on exit (only on DTensor parameters)."""
        if not self._executor.distributed:
            raise ValueError(f"unshard_params() needs a model wrapped with fully_shard (FSDP2), but "
                             f"{type(self).__name__}'s parameters are plain tensors")
        return self._distributed_attribute("unshard_params")()

    def _distributed_attribute(self, name: str) -> Any:
        if not self._executor.distributed:
            raise AttributeError(f"{type(self).__name__}.{name}: the optimizer holds no DTensor parameters "
                                 "(it exists on the distributed step)")
        return getattr(self._executor, name)


class Placement:
    """The parameters an optimizer was built (or last laid out) for, by reference, to notice a
    trainer swapping others into ``param_groups`` (accelerate's FSDP2 ``prepare``)."""

    def __init__(self, groups: list[dict[str, Any]]) -> None:
        self.groups = [[weakref.ref(p) for p in g["params"]] for g in groups]

    def changed(self, groups: list[dict[str, Any]]) -> bool:
        """Whether ``groups`` hold other parameters than those recorded (or in another order)."""
        if len(groups) != len(self.groups):
            return True
        for group, refs in zip(groups, self.groups):
            params = group["params"]
            if len(params) != len(refs) or any(r() is not p for r, p in zip(refs, params)):
                return True
        return False

    def previous(self) -> list[list[torch.Tensor | None]]:
        """The recorded parameters, per group and position (None where one no longer exists: it
        held no optimizer state, which would keep it alive)."""
        return [[r() for r in refs] for refs in self.groups]


def state_moves(optimizer: Any, previous: list[list[torch.Tensor | None]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The ``(old, new)`` parameters whose state moves to the parameter that replaced it at the
    same position of ``param_groups``; ``ValueError`` naming the first replacement that cannot take
    its state (another shape, or a group of another length), before anything changes."""
    moves = []
    for index, (group, old) in enumerate(zip(optimizer.param_groups, previous)):
        params = group["params"]
        held = [p for p in old if p is not None and optimizer.state.get(p)]
        if len(params) != len(old) and held:
            raise ValueError(f"param group {index} now holds {len(params)} parameters, but it held {len(old)} "
                             "with optimizer state: the state cannot follow them by position; swap in one "
                             "parameter for each, in the same order")
        for was, new in zip(old, params):
            if was is None or was is new or not optimizer.state.get(was):
                continue
            if tuple(was.shape) != tuple(new.shape):
                raise ValueError(
                    f"parameter {optimizer._name(group, new)} of group {index} replaced one of shape "
                    f"{tuple(was.shape)} that has optimizer state, "
                    f"by one of shape {tuple(new.shape)}: the state cannot follow it. Swap in parameters of the "
                    "same shape, or build the optimizer after the model is laid out")
            moves.append((was, new))
    return moves
