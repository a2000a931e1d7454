"""Any optimizer of :mod:`muon_fn.optimizers` on DTensor parameters: run by the distributed executor.

``MuonOptimizer(model.parameters())`` on a ``fully_shard``-ed model (Lightning's
``ModelParallelStrategy``, transformers' DTensor loading, torchtitan), or one whose parameters a
trainer swaps for DTensors after building it (accelerate's FSDP2 ``prepare``), runs the
owner-computes step of :class:`~._executor.DistributedExecutor`, as
:class:`muon_fn.fsdp.FSDPMuonOptimizer` does: :func:`adopt` gives the optimizer that executor (its
class stays what it is) and a plan. :mod:`muon_fn.distributed` registers :func:`adopt` with
:func:`muon_fn.engine.register_distributed`; the engine calls it at construction, after a
swap and for a copy.

State made before a swap is carried over: each state tensor of a parameter that was replaced is
laid out like its replacement (:func:`_carry`); a replacement of another shape is refused first.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from .. import engine
from ..engine import GroupRuntime, Optimizer
from ._executor import DistributedExecutor


def adopt(optimizer: Optimizer, previous: list[list[torch.Tensor | None]] | None = None,
          copied: dict[str, Any] | None = None) -> None:
    """Run ``optimizer`` on the distributed executor from now on (collective: every rank calls
    it, as every rank builds the optimizer and steps it). ``previous``: the parameters it held
    before a swap, per group and position (their state is carried over); ``copied``: for a copy,
    what the original's executor kept (:meth:`DistributedExecutor.getstate`); both None at
    construction."""
    if any(g.get("micro_step", 0) for g in optimizer.param_groups):
        raise RuntimeError(f"{type(optimizer).__name__}: parameters were swapped inside a gradient accumulation "
                           "window; swap them at a window boundary (after the window's last step())")
    carried = _take_state(optimizer, previous or [])
    ex = optimizer._executor
    if isinstance(ex, DistributedExecutor):
        overlap = ex.overlap  # as set last; its hooks were registered on the former parameters
        ex.overlap = False
        k = ex._accumulation_steps
    else:
        k, overlap = _accumulation_steps(optimizer), None  # the distributed options'
        ex = optimizer._executor = DistributedExecutor(optimizer)
    if copied is not None:  # a copy runs without overlap (its hooks are made collectively)
        overlap = False
    optimizer._runtimes = [GroupRuntime() for _ in optimizer.param_groups]
    ex.distribute(k, overlap=overlap)
    if copied is not None:
        ex.resume(copied)
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
    ex = optimizer._executor
    ex._pending_init = [(index, route, bucket) for index, route, bucket in ex._pending_init
                        if not all(id(optimizer.param_groups[index]["params"][i]) in done for i in bucket.indices)]
