"""How each parameter is laid out across ranks, validated once with errors naming the parameter.

Every matrix is exchanged by rows (:mod:`._plan`), so each rank's part of a parameter must be, or
be made into, a contiguous block of rows of the parameter's ``(shape[0], prod(shape[1:]))`` view.

Two topologies:

- **one shard group** (the common case, no collective to set up): every DTensor parameter is an
  FSDP2 ``Shard(0)`` on a 1-D mesh or an HSDP ``(Replicate(), Shard(0))`` on a 2-D mesh, all over
  the same ranks; a rank holds ``torch.chunk``'s rows; HSDP replicas compute the same result
  independently. A plain tensor is held whole by every rank (DDP-style, "replicated").
- **the default group** (any other mesh: FSDP×TP, HSDP×TP, expert parallelism, parameters on
  different meshes): placements may be ``Replicate()``, ``Shard(d)`` or FSDP2's strided shard of
  dim 0 on any mesh dim. A ``Shard(d)`` with ``d ≥ 1`` (a row-wise TP weight, columns of the
  matrix) is redistributed on its mesh dim to ``Shard(0)`` for the exchange and back after it
  (:func:`to_rows`, :func:`from_rows`); the rows each rank then holds are gathered once from every
  rank (:func:`layouts`) and must tile the matrix: ranks hold the same rows (replicas) or
  disjoint ones. One copy of each row travels to the owner; every holder gets its rows back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from ._plan import Rows, chunk_rows


@dataclass(frozen=True)
class Layout:
    """Layout of one parameter on this rank."""

    name: str
    shape: tuple[int, ...]  # global
    sharded: bool  # ranks hold different rows (False: every rank holds all of them)
    rows: tuple[int, int]  # [start, stop) global rows this rank exchanges (its row block)
    offset: int = 0  # global row of the first row of this rank's own local tensor
    row_placements: tuple | None = None  # redistributed to these for the exchange; None: as held
    held: tuple[Rows, ...] | None = None  # every rank's rows (default group); None: from ``rows``


@dataclass(frozen=True)
class Topology:
    """The process group the adapter communicates over."""

    group: dist.ProcessGroup | None  # None: the default group, or no communication (one rank)
    rank: int
    world_size: int
    mesh: object | None  # the DTensor mesh of sharded parameters (None without DTensors)
    general: bool = False  # the default group over any meshes (``Layout.held`` is set)

    def describe(self) -> str:
        if self.general:
            return f"the default group of {self.world_size} ranks over every parameter's mesh"
        return "no device mesh" if self.mesh is None else f"mesh {tuple(self.mesh.shape)} {self.mesh.mesh_dim_names}"


def _shard_dim(p: DTensor) -> int | None:
    """The mesh dim of a one-shard-group layout (1-D FSDP: 0; HSDP: 1), else None."""
    placements, mesh = tuple(p.placements), p.device_mesh
    if mesh.ndim == 1 and placements == (Shard(0),):
        return 0
    if mesh.ndim == 2 and placements == (Replicate(), Shard(0)):
        return 1  # HSDP: replicate over dim 0, shard over dim 1
    return None


def _ranks(group: dist.ProcessGroup | None) -> list[int]:
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def resolve_topology(
    named: list[tuple[str, torch.Tensor]], process_group: dist.ProcessGroup | None = None
) -> Topology:
    """One shard group when every DTensor parameter has a one-group layout over the same ranks;
    the default group when some has another layout or they use different groups; without
    DTensors, ``process_group`` or the default group when torch.distributed is initialized, else
    a single rank."""
    dtensors = [(name, p) for name, p in named if isinstance(p, DTensor)]
    dims = [_shard_dim(p) for _, p in dtensors]
    groups = [None if d is None else _ranks(p.device_mesh.get_group(mesh_dim=d)) for d, (_, p) in zip(dims, dtensors)]
    if _any_rank_general(bool(dtensors) and (None in dims or any(g != groups[0] for g in groups)), process_group):
        for name, p in dtensors:
            _check_placements(name, p)
        if process_group is not None and _ranks(process_group) != _ranks(None):
            raise ValueError(
                f"process_group has ranks {_ranks(process_group)}, but parameters on several meshes "
                f"(e.g. {dtensors[0][0]!r}, placements {tuple(dtensors[0][1].placements)}) are exchanged "
                "over the default group; pass process_group=None")
        return Topology(None, dist.get_rank(), dist.get_world_size(), None, True)
    if dtensors:
        first, p = dtensors[0]
        group = p.device_mesh.get_group(mesh_dim=dims[0])
        if process_group is not None and _ranks(process_group) != _ranks(group):
            raise ValueError(
                f"process_group has ranks {_ranks(process_group)} but parameter {first!r} is sharded "
                f"over ranks {_ranks(group)}; pass the parameters' shard group or None"
            )
        return Topology(group, dist.get_rank(group), dist.get_world_size(group), p.device_mesh)
    if process_group is not None or (dist.is_available() and dist.is_initialized()):
        return Topology(process_group, dist.get_rank(process_group), dist.get_world_size(process_group), None)
    return Topology(None, 0, 1, None)


def _any_rank_general(general: bool, process_group: dist.ProcessGroup | None) -> bool:
    """Whether any rank needs the default group (then every rank takes it, so all make the same
    collectives; one object all-gather over the default group, the optimizer being built on every
    rank). Not asked with an explicit ``process_group`` (only one shard group is possible then)."""
    if process_group is not None or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return general
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, general)
    return any(every)


def _check_placements(name: str, p: DTensor) -> None:
    for placement in p.placements:
        strided = isinstance(placement, _StridedShard)
        if isinstance(placement, Replicate) or (isinstance(placement, Shard) and not strided) or (
                strided and placement.dim == 0):
            continue
        what = ("a pending reduction" if isinstance(placement, Partial)
                else "not a block of rows or columns")
        raise ValueError(
            f"parameter {name!r} has placements {tuple(p.placements)} on device mesh "
            f"{tuple(p.device_mesh.shape)}: {placement!r} is {what}; the FSDP optimizers support "
            "Replicate(), Shard(d) and FSDP2's strided Shard(0) on each mesh dim")


def _row_placements(p: DTensor) -> tuple | None:
    """``p``'s placements with every ``Shard(d ≥ 1)`` (columns) as ``Shard(0)``; None if none is."""
    if not any(isinstance(q, Shard) and q.dim != 0 for q in p.placements):
        return None
    return tuple(Shard(0) if isinstance(q, Shard) and q.dim != 0 else q for q in p.placements)


def layouts(named: list[tuple[str, torch.Tensor]], topo: Topology) -> dict[int, Layout]:
    """The layout of every parameter, by ``id``; on the default group, every rank's rows are
    gathered (one object all-gather) and checked to tile each parameter."""
    out = {id(p): layout_of(name, p, topo) for name, p in named}
    if not topo.general:
        return out
    every: list[Any] = [None] * topo.world_size
    dist.all_gather_object(every, [out[id(p)].rows for _, p in named])
    for k, (name, p) in enumerate(named):
        held = tuple(tuple(rows[k]) for rows in every)
        _check_tiling(name, p, held)
        layout = out[id(p)]
        out[id(p)] = Layout(name, layout.shape, any(r != (0, layout.shape[0]) for r in held), layout.rows,
                            layout.offset, layout.row_placements, held)
    return out


def _check_tiling(name: str, p: torch.Tensor, held: tuple[Rows, ...]) -> None:
    """Distinct row blocks must be disjoint and cover every row (replicas hold equal blocks)."""
    m = p.shape[0] if p.ndim else 0
    covered = 0
    for start, stop in sorted({r for r in held if r[1] > r[0]}):
        if start != covered:
            placed = tuple(p.placements) if isinstance(p, DTensor) else "a plain tensor"
            raise ValueError(
                f"parameter {name!r} of shape {tuple(p.shape)} ({placed}) is held as row blocks "
                f"{list(held)} across the ranks, which do not tile its {m} rows; the FSDP optimizers "
                "need every rank's part to be a block of rows, equal to or disjoint from the others'")
        covered = stop
    if covered != m:
        raise ValueError(f"parameter {name!r} of shape {tuple(p.shape)}: the ranks hold rows up to "
                         f"{covered} of {m} ({list(held)})")


def layout_of(name: str, p: torch.Tensor, topo: Topology) -> Layout:
    """This rank's layout of ``p``; checks that a DTensor's local shard has the rows its layout says."""
    shape = tuple(p.shape)
    if not isinstance(p, DTensor):
        return Layout(name, shape, False, (0, shape[0] if shape else 0))
    if not shape:
        raise ValueError(f"parameter {name!r} is a sharded 0-d tensor")
    if topo.general:
        return _general_layout(name, p)
    rows = chunk_rows(shape[0], topo.world_size)[topo.rank]
    local = tuple(p.to_local().shape)
    expected = (rows[1] - rows[0],) + shape[1:]
    if local != expected:
        raise ValueError(
            f"parameter {name!r} of global shape {shape} has a local shard of shape {local} on rank "
            f"{topo.rank}, but torch.chunk over {topo.world_size} ranks gives {expected}"
        )
    return Layout(name, shape, True, rows, rows[0])


def _general_layout(name: str, p: DTensor) -> Layout:
    shape = tuple(p.shape)
    own, offset = compute_local_shape_and_global_offset(shape, p.device_mesh, p.placements)
    if tuple(p.to_local().shape) != tuple(own):
        raise ValueError(f"parameter {name!r} of global shape {shape} with placements {tuple(p.placements)} "
                         f"has a local tensor of shape {tuple(p.to_local().shape)}, expected {tuple(own)}")
    row_placements = _row_placements(p)
    local, start = own, offset
    if row_placements is not None:
        local, start = compute_local_shape_and_global_offset(shape, p.device_mesh, row_placements)
    if tuple(local[1:]) != shape[1:]:
        raise ValueError(f"parameter {name!r} of global shape {shape} with placements {tuple(p.placements)} "
                         f"is held as a block of shape {tuple(local)}, not a block of whole rows")
    rows = (start[0], start[0] + local[0]) if local[0] else (0, 0)
    return Layout(name, shape, True, rows, offset[0], row_placements)


def to_rows(layout: Layout, p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t`` (laid out like ``p``'s local tensor) as this rank's row block (a collective on the
    mesh dims whose columns become rows; ``t`` itself when there are none)."""
    if layout.row_placements is None:
        return t
    return _redistribute(t, p, p.placements, layout.row_placements)


def from_rows(layout: Layout, p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`to_rows`: this rank's row block ``t`` laid out like ``p``'s local tensor."""
    if layout.row_placements is None:
        return t
    return _redistribute(t, p, layout.row_placements, p.placements)


def _redistribute(t: torch.Tensor, p: DTensor, src: Any, dst: Any) -> torch.Tensor:
    shape = torch.Size(p.shape)
    d = DTensor.from_local(t, p.device_mesh, src, run_check=False, shape=shape,
                           stride=torch.empty(shape, device="meta").stride())
    return d.redistribute(p.device_mesh, dst).to_local()


def placed_like(g: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Gradient ``g`` laid out like its parameter ``p``: a DTensor gradient with other placements
    (transformers' vocabulary-parallel embedding returns a ``Replicate()`` gradient for a
    ``Shard(0)`` weight; a pending ``Partial()`` sum) is redistributed to ``p``'s (collective where
    it reduces; every rank reads its gradients in the same order)."""
    if isinstance(g, DTensor) and isinstance(p, DTensor) and (
            g.placements != p.placements or g.device_mesh != p.device_mesh):
        return g.redistribute(p.device_mesh, p.placements)
    return g


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
