"""Any optimizer of :mod:`muon_fn.optim` on DTensor parameters: handed to the FSDP adapter's step.

``MuonOptimizer(model.parameters())`` on a ``fully_shard``-ed model (Lightning's
``ModelParallelStrategy``, transformers' DTensor loading, torchtitan), or one whose parameters a
trainer swaps for DTensors after building it (accelerate's FSDP2 ``prepare``), runs the
owner-computes step of :class:`~._adapter.FSDPAdapter`, as :class:`~._optimizer.FSDPMuonOptimizer`
does: :func:`adopt` gives the optimizer the class ``cls`` with the adapter mixed in (made once per
class, named as ``cls``; FSDP2's ``fully_shard`` does the same to modules), the adapter's default
options, and a plan. ``muon_fn/__init__.py`` registers :func:`adopt` with
:mod:`muon_fn.optim._placement`, which calls it at construction and after a swap.

State made before a swap is carried over: each state tensor of a parameter that was replaced is
laid out like its replacement (:func:`_carry`); a replacement of another shape is refused first.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from ..optim import MuonOptimizer, engine
from ..optim.engine import GroupRuntime, Optimizer
from ._adapter import FSDPAdapter
from ._optimizer import MuonFlops

_CLASSES: dict[type, type] = {}


def distributed_class(cls: type) -> type:
    """``cls`` with the FSDP adapter's step (and Muon's FLOP count where ``cls`` is a Muon
    optimizer): made once per class, with ``cls``'s name, so messages and ``repr`` read as the
    user's class; ``cls`` itself if it runs the adapter already."""
    if issubclass(cls, FSDPAdapter):
        return cls
    made = _CLASSES.get(cls)
    if made is None:
        bases = (MuonFlops, FSDPAdapter, cls) if issubclass(cls, MuonOptimizer) else (FSDPAdapter, cls)
        made = _CLASSES[cls] = type(cls.__name__, bases, {
            "__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__,
            "_single_device_class": cls, "__reduce_ex__": _reduce_ex})
    return made


def _reduce_ex(self: Any, protocol: int) -> tuple:
    """Pickle (and ``copy.deepcopy``) by the user's class: a made class cannot be found by name."""
    return _rebuild, (self._single_device_class,), self.__getstate__()


def _rebuild(cls: type) -> Any:
    made = distributed_class(cls)
    return made.__new__(made)


def adopt(optimizer: Optimizer, previous: list[list[torch.Tensor | None]] | None = None) -> None:
    """Run ``optimizer`` on the FSDP adapter's step from now on (collective: every rank calls it,
    as every rank builds the optimizer and steps it). ``previous``: the parameters it held before
    a swap, per group and position (their state is carried over); None at construction."""
    if any(g.get("micro_step", 0) for g in optimizer.param_groups):
        raise RuntimeError(f"{type(optimizer).__name__}: parameters were swapped inside a gradient accumulation "
                           "window; swap them at a window boundary (after the window's last step())")
    carried = _take_state(optimizer, previous or [])
    if isinstance(optimizer, FSDPAdapter):
        overlap = optimizer.overlap  # as set last; its hooks were registered on the former parameters
        optimizer.overlap = False
        k = optimizer._accumulation_steps
    else:
        k, overlap = _accumulation_steps(optimizer), None  # the distributed options'
        optimizer.__class__ = distributed_class(type(optimizer))
        optimizer._prepare()
    optimizer._runtimes = [GroupRuntime() for _ in optimizer.param_groups]
    optimizer._distribute(k, overlap=overlap)
    _carry(optimizer, carried)


def _accumulation_steps(optimizer: Optimizer) -> int:
    """The one ``gradient_accumulation_steps`` of the groups (the FSDP step pauses FSDP2's gradient
    sync for the whole model, so every group accumulates alike)."""
    ks = {g["gradient_accumulation_steps"] for g in optimizer.param_groups}
    if len(ks) > 1:
        raise ValueError(f"{type(optimizer).__name__} on DTensor parameters needs one gradient_accumulation_steps "
                         f"for every param group, got {sorted(ks)}")
    return ks.pop() if ks else 1


def _take_state(optimizer: Optimizer, previous: list[list[torch.Tensor | None]]) -> list[tuple[torch.Tensor, dict]]:
    """``(new parameter, state of the one it replaced)`` for every replaced parameter with state,
    the state as whole tensors (a DTensor's gathered: collective, in the same order on every
    rank); removed from the optimizer. A replacement of another shape is refused first."""
    pairs = engine.state_moves(optimizer, previous)
    return [(new, {key: _whole(value) for key, value in sorted(optimizer.state.pop(was).items())})
            for was, new in pairs]


def _whole(value: Any) -> Any:
    return value.full_tensor() if isinstance(value, DTensor) else value


def _carry(optimizer: Optimizer, carried: list[tuple[torch.Tensor, dict]]) -> None:
    """Write each carried state into the state the plan made for its parameter (every key the new
    layout has; a DTensor gets this rank's part, as ``distribute_tensor`` lays it out)."""
    for p, old in carried:
        state = optimizer.state.get(p, {})
        for key, value in old.items():
            new = state.get(key)
            if not isinstance(new, torch.Tensor) or not isinstance(value, torch.Tensor):
                continue
            if isinstance(new, DTensor):
                part = distribute_tensor(value.to(new.device), new.device_mesh, new.placements, src_data_rank=None)
                new.to_local().copy_(part.to_local())
            else:
                new.copy_(value)
    done = {id(p) for p, _ in carried}
    optimizer._pending_init = [(index, route, bucket) for index, route, bucket in optimizer._pending_init
                               if not all(id(optimizer.param_groups[index]["params"][i]) in done
                                          for i in bucket.indices)]
