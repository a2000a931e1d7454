"""How each parameter is laid out across ranks, validated once with errors naming the parameter.

Supported layouts: an FSDP2 ``DTensor`` sharded ``Shard(0)`` on a 1-D mesh; an HSDP ``DTensor``
``(Replicate(), Shard(0))`` on a 2-D mesh (the shard sub-mesh is used; replicas compute the same
result independently); a plain tensor, held whole by every rank (DDP-style, "replicated").
Every sharded parameter must use the same process group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from ._plan import chunk_rows


@dataclass(frozen=True)
class Layout:
    """Layout of one parameter on this rank."""

    name: str
    shape: tuple[int, ...]  # global
    sharded: bool  # True: Shard(0) over the shard group; False: every rank holds it whole
    rows: tuple[int, int]  # [start, stop) global rows held by this rank


@dataclass(frozen=True)
class Topology:
    """The process group the adapter communicates over."""

    group: dist.ProcessGroup | None  # None: no communication (one rank)
    rank: int
    world_size: int
    mesh: object | None  # the DTensor mesh of sharded parameters (None without DTensors)


def _shard_dim(p: DTensor, name: str) -> int:
    """Index of the mesh dim the parameter is sharded over (checks the placements)."""
    placements = tuple(p.placements)
    mesh = p.device_mesh
    if mesh.ndim == 1 and placements == (Shard(0),):
        return 0
    if mesh.ndim == 2 and placements == (Replicate(), Shard(0)):
        return 1  # HSDP: replicate over dim 0, shard over dim 1
    raise ValueError(
        f"parameter {name!r} has placements {placements} on a {mesh.ndim}-D device mesh "
        f"{tuple(mesh.shape)}; FSDPMuonOptimizer supports fully_shard's (Shard(0),) on a 1-D mesh "
        "and HSDP's (Replicate(), Shard(0)) on a 2-D mesh (e.g. not Shard(1) or tensor parallelism)"
    )


def _ranks(group: dist.ProcessGroup | None) -> list[int]:
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def resolve_topology(
    named: list[tuple[str, torch.Tensor]], process_group: dist.ProcessGroup | None = None
) -> Topology:
    """The shard group of the DTensor parameters (all must agree), else ``process_group`` or the
    default group when torch.distributed is initialized, else a single rank."""
    group, mesh, first = None, None, None
    for name, p in named:
        if not isinstance(p, DTensor):
            continue
        dim = _shard_dim(p, name)
        g = p.device_mesh.get_group(mesh_dim=dim)
        if first is None:
            group, mesh, first = g, p.device_mesh, name
            dim0 = dim
        elif _ranks(g) != _ranks(group) or (dim, p.device_mesh.shape) != (dim0, mesh.shape):
            raise ValueError(
                f"parameter {name!r} is sharded over ranks {_ranks(g)} (mesh {tuple(p.device_mesh.shape)}) "
                f"but {first!r} over ranks {_ranks(group)} (mesh {tuple(mesh.shape)}); "
                "every parameter must use the same process group"
            )
    if first is not None:
        if process_group is not None and _ranks(process_group) != _ranks(group):
            raise ValueError(
                f"process_group has ranks {_ranks(process_group)} but parameter {first!r} is sharded "
                f"over ranks {_ranks(group)}; pass the parameters' shard group or None"
            )
        return Topology(group, dist.get_rank(group), dist.get_world_size(group), mesh)
    if process_group is not None or (dist.is_available() and dist.is_initialized()):
        return Topology(process_group, dist.get_rank(process_group), dist.get_world_size(process_group), None)
    return Topology(None, 0, 1, None)


def layout_of(name: str, p: torch.Tensor, topo: Topology) -> Layout:
    """The layout of ``p``; checks that a DTensor's local shard has ``torch.chunk``'s rows."""
    shape = tuple(p.shape)
    if not isinstance(p, DTensor):
        return Layout(name, shape, False, (0, shape[0] if shape else 0))
    _shard_dim(p, name)
    if not shape:
        raise ValueError(f"parameter {name!r} is a sharded 0-d tensor")
    rows = chunk_rows(shape[0], topo.world_size)[topo.rank]
    local = tuple(p.to_local().shape)
    expected = (rows[1] - rows[0],) + shape[1:]
    if local != expected:
        raise ValueError(
            f"parameter {name!r} of global shape {shape} has a local shard of shape {local} on rank "
            f"{topo.rank}, but torch.chunk over {topo.world_size} ranks gives {expected}"
        )
    return Layout(name, shape, True, rows)


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor of a DTensor (shares storage), or ``t`` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def rows_like(p: torch.Tensor, local_rows: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``local_rows`` (this rank's rows of a tensor of global ``shape`` whose rows are ``p``'s) as
    a DTensor with ``p``'s mesh and placements, or as it is when ``p`` is a plain tensor."""
    if not isinstance(p, DTensor):
        return local_rows
    return DTensor.from_local(
        local_rows, p.device_mesh, p.placements, run_check=False, shape=torch.Size(shape),
        stride=torch.empty(shape, device="meta").stride(),
    )
