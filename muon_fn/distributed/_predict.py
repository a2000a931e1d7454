"""What the owner-computes plan costs at scale, from shapes only (no process group, no tensors).

:func:`plan_model` runs the FSDP optimizers' own planner (:func:`~muon_fn.distributed._plan.make_plan`,
with the owner units ``FSDPMuonOptimizer`` makes: same-shape, same-view buckets of at most
``bucket_size`` parameters) on a list of ``(name, global shape, matrix view)`` or a model spec
(:mod:`muon_fn.distributed.specs`), every matrix sharded ``Shard(0)`` over the ``dp`` ranks, and
returns the plan with per-rank figures read off it:

- **Expert stacks** (``"experts"`` views, ndim ≥ 3) are planned per expert, as
  ``FSDPMuonOptimizer`` plans them for Muon when they are sharded: each rank computes the whole
  experts it holds and none of their elements travel (NorMuon's and SSO's stacks keep an owner
  in the optimizer; this planner models Muon).
- **NS FLOPs** of the matrices each rank owns (:func:`~muon_fn.distributed._plan.ns_flops`), their
  max/mean, and the *efficiency* mean/max (the fraction of the ideal 1/W speed-up the slowest rank
  allows; ranks that own nothing idle).
- **Bytes** each rank sends and receives in a step (both all-to-alls, self excluded), and the
  formula 2(W−1)/W²·S (S: the wire bytes of the Muon matrices that travel), which the mean equals exactly when
  every matrix's rows divide by W.
- **Extra peak memory** per rank: the buffers :func:`~muon_fn.distributed._exchange.exchange` holds at
  once, all in the wire dtype (every gather is posted up front: the send buffer of the rows this
  rank sends, and the whole matrices it owns, received; every return in flight: what it owns,
  sent back, and its rows of everything, coming back; and, for the bucket it computes, the
  assembled matrices and the results, 2·owned in that bucket), plus the Newton–Schulz workspace
  of its largest unit (X, XXᵀ, its square and the new X, in ``ns_bytes``). Plain Muon's rows are
  the update itself; a format with more columns (NorMuon's row state, SSO's weight rows) packs a
  copy, which this leaves out.
- **Optimizer state** per rank at ``state_bits`` (when given): the rows each rank holds (FSDP2's
  ``Shard(0)`` over the ``dp`` ranks; with TP, a dp shard's share divided by T) of every Muon
  matrix's momentum and, for a spec, every AdamW parameter's two moments and step
  (:func:`muon_fn.core.quantize.nbytes`: codes and scales at 16, 8 and 4 bits; fp32 parameters).
- The **step peak** per rank for the optimizers' ``inflight_bytes`` (when given): the plan cut
  into buckets as they cut it for that budget, and the most bytes each rank allocates and holds
  at once in a step of it (:func:`muon_fn.distributed._peak.step_transient`: the buffers of the
  buckets in flight, the owner's whole matrices and iteration workspace, the phases' updates).
- A **predicted step time** for a GEMM rate and a per-rank link bandwidth: rank r computes for
  C = FLOPs/rate and communicates for X = max(sent, received)/bandwidth; buckets overlap the two
  except one exchange's worth, so t_r = max(C, X) + X/buckets, and the step is the slowest rank's.
  A model, not a measurement.

Meshes: ``dp=W`` (FSDP2), ``replicate=R,dp=W`` (HSDP: R replica groups each plan and compute the
same as one ``dp=W`` group), ``tp=T`` with T = 1. Tensor parallelism is refused: the FSDP
optimizers do not run on it, and this planner predicts only what they run.
"""

from __future__ import annotations

import bisect
import enum
import functools
import math
from dataclasses import dataclass
from typing import NamedTuple
from collections.abc import Iterable, Sequence

import torch

from ..core import execution as _execution, quantize as _quantize, views as _views
from ..core.muon import group_by
from ..engine import BUCKET_SIZE  # FSDPMuonOptimizer's default, as MuonOptimizer's
from . import _peak
from . import specs as _specs
from ._plan import Plan, _nonzero, chunk_rows, cut_expert_stacks, make_plan, ns_flops, pieces_held

DEFAULT_GEMM_TFLOPS = 400.0
""":func:`plan_model`'s GEMM rate per rank, TFLOP/s: an H100's achieved dense bf16 rate (of ~990 peak)."""
DEFAULT_LINK_GBPS = 50.0
""":func:`plan_model`'s link bandwidth per rank, GB/s: between nodes, one 400 Gb/s NIC per GPU."""


class Mesh(NamedTuple):
    """The device mesh: ``dp`` shard ranks, ``replicate`` HSDP replica groups, ``tp`` (1)."""

    dp: int
    replicate: int = 1
    tp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.replicate * self.tp

    def __str__(self) -> str:
        parts = ([f"replicate={self.replicate}"] if self.replicate > 1 else []) + [f"dp={self.dp}"]
        return ",".join(parts + ([f"tp={self.tp}"] if self.tp > 1 else []))


def parse_mesh(mesh: str | int | Mesh) -> Mesh:
    """``"dp=64"``, ``"replicate=2,dp=64"``, ``"dp=64,tp=1"``, an int (``dp``) or a :class:`Mesh`."""
    if isinstance(mesh, Mesh):
        sizes = mesh._asdict()
    elif isinstance(mesh, int) and not isinstance(mesh, bool):
        sizes = {"dp": mesh}
    elif isinstance(mesh, str):
        sizes = {}
        for part in mesh.split(","):
            key, eq, value = part.strip().partition("=")
            if not eq or key not in Mesh._fields or key in sizes or not value.strip().isdigit():
                raise ValueError(f"Invalid mesh: {mesh!r} (expected comma-separated dims "
                                 f"{', '.join(f + '=N' for f in Mesh._fields)}, e.g. 'dp=64')")
            sizes[key] = int(value)
    else:
        raise ValueError(f"Invalid mesh: {mesh!r} (expected a string like 'dp=64', an int or a Mesh)")
    if "dp" not in sizes:
        raise ValueError(f"Invalid mesh: {mesh!r} (dp=N is required)")
    for key, value in sizes.items():
        if value < 1:
            raise ValueError(f"Invalid mesh: {mesh!r} ({key}={value}, expected >= 1)")
    return Mesh(**sizes)


# Tensor parallelism of the shipped specs, as torchtitan lays out Llama and DeepSeek-V3: these
# projections are row-wise (Shard(1): their columns are cut), those column-wise (Shard(0)); the
# rest (MLA's low-rank down-projections, the router) is not cut by TP; expert stacks are sharded
# on their expert dim over the data and TP dims together (expert parallelism).
ROWWISE = ("o_proj", "down_proj")
COLWISE = ("q_proj", "k_proj", "v_proj", "q_b_proj", "kv_b_proj", "gate_proj", "up_proj")


def tp_style(name: str, shape: Sequence[int], view: str | _views.Heads) -> str:
    """How TP lays out a spec matrix: ``"rowwise"``, ``"colwise"``, ``"experts"`` or ``"none"``."""
    if len(shape) >= 3 and _views.base(view) == "experts":
        return "experts"
    leaf = name.split(".")[-2] if name.endswith(".weight") else name.split(".")[-1]
    return "rowwise" if leaf in ROWWISE else "colwise" if leaf in COLWISE else "none"


def held_rows(m: int, mesh: Mesh, style: str) -> tuple[tuple[int, int], ...]:
    """The rows of an ``m``-row matrix each rank of a mesh with TP holds for the exchange (ranks
    ordered replicate, dp, tp): blocks over dp·tp (a row-wise weight after its redistribution to
    rows), or over dp alone and alike on the TP ranks for a matrix TP does not cut."""
    blocks = chunk_rows(m, mesh.dp * mesh.tp) if style != "none" else chunk_rows(m, mesh.dp)
    per_replica = [blocks[d * mesh.tp + t] if style != "none" else blocks[d]
                   for d in range(mesh.dp) for t in range(mesh.tp)]
    return tuple(per_replica * mesh.replicate)


Matrix = tuple[str, Sequence[int], str]  # (name, global shape, matrix view)


def muon_matrices(model: str | dict | Sequence) -> tuple[str, list[Matrix]]:
    """``(label, matrices)``: a spec's Muon parameters (:func:`muon_fn.distributed.specs.model_params`,
    AdamW ones left out), or a list of ``(name, shape, view)`` checked and returned as is."""
    if isinstance(model, (str, dict)):
        label = model if isinstance(model, str) else "custom"
        return label, [(p.name, p.shape, p.view) for p in _specs.model_params(model) if p.view]
    matrices = []
    for k, entry in enumerate(model):
        name, shape, view = entry
        shape = tuple(int(s) for s in shape)
        if len(shape) < 2:
            raise ValueError(f"matrix {k} ({name!r}) has shape {shape}: Muon matrices need ndim >= 2")
        _views.check_view(view, f"view of {name!r}")
        matrices.append((str(name), shape, view))
    return "custom", matrices


def owner_units(matrices: Sequence[Matrix], bucket_size: int | None, policy: str = "batched") -> list[list[int]]:
    """The units FSDPMuonOptimizer gives one owner: its single-device buckets (equal shape and
    view, at most ``bucket_size``, in parameter order), ordered by their first parameter. Under
    the ``"cpu"`` policy also no more fp32 bytes than its bound allows
    (:func:`muon_fn.orthogonalization.bucket_limit`), as the optimizers' default makes them there."""
    metas = [torch.empty(shape, device="meta") for _, shape, _ in matrices] if policy == "cpu" else []
    units = []
    for same in group_by([(tuple(shape), view) for _, shape, view in matrices]):
        cap = len(same) if bucket_size is None else bucket_size
        if metas:  # fp32 meta tensors: the CPU policy's bound (meta tensors plan as the CPU)
            cap = min(cap, _execution.bucket_limit([metas[i] for i in same], None, metas))
        units += [same[k:k + cap] for k in range(0, len(same), cap)]
    return sorted(units, key=lambda u: u[0])


class _Unset(enum.Enum):
    UNSET = "not given"


NOT_GIVEN = _Unset.UNSET
""":func:`plan_model`'s ``inflight_bytes`` when not given: no byte bound, no step peak reported."""


@dataclass(frozen=True)
class PlanReport:
    """A plan and its per-rank figures (index r: rank r of a ``dp`` shard group).

    ``flops`` (Newton–Schulz GEMM FLOPs), ``sent`` and ``received`` (bytes per step, self
    excluded), ``peak`` (extra bytes held at once, an estimate), and the properties
    ``flops_max_mean``, ``bound_max_mean`` (the least max/mean any assignment of these units can
    reach), ``efficiency`` (mean/max), ``idle_ranks``, ``sent_mean``, ``bytes_formula``
    (2(W−1)/W²·S), ``step_s`` (predicted), ``ideal_step_s`` and ``rank_step_s(rank)``. With
    ``plan_model(..., state_bits=b)``, ``state``: the optimizer state each rank of a shard group
    holds at that width (Muon momentum; for a spec, also AdamW's moments and step), a
    ``state/rank max`` column in :func:`format_plan`. With ``plan_model(..., inflight_bytes=n)``,
    ``step_peak``: the bytes each rank allocates and holds at once in one step
    (:func:`muon_fn.distributed._peak.step_transient`), a ``step peak/rank max`` column."""

    model: str
    mesh: Mesh
    plan: Plan
    names: tuple[str, ...]  # of the plan's matrices (parameters), in plan order
    matrices: int  # matrices Newton–Schulz runs on (an expert stack counts its experts)
    units: int  # owner units (the optimizer's same-shape buckets)
    flops: tuple[int, ...]  # NS GEMM FLOPs each rank computes
    sent: tuple[int, ...]  # bytes each rank sends to others in one step
    received: tuple[int, ...]
    peak: tuple[int, ...]  # extra bytes each rank holds at once (estimate, module doc)
    muon_bytes: int  # S: wire bytes of the Muon matrices that travel (not the local expert stacks)
    placed_flops: tuple[int, ...]  # NS FLOPs of what LPT places: owner units, expert pieces
    fixed_flops: tuple[int, ...]  # per rank, NS FLOPs of the stacks computed where they lie
    gemm_flops_per_s: float
    link_bytes_per_s: float
    matrix_flops: tuple[int, ...] = ()  # NS FLOPs of each of the plan's matrices
    state: tuple[int, ...] = ()  # optimizer state bytes each rank holds (module doc); () if not asked
    state_bits: int | None = None
    step_peak: tuple[int, ...] = ()  # each rank's step transient at inflight_bytes; () if not asked
    inflight_bytes: int | None = None

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    @property
    def flops_max_mean(self) -> float:
        mean = sum(self.flops) / self.world_size
        return max(self.flops) / mean if mean else 1.0

    @property
    def efficiency(self) -> float:
        """mean/max NS FLOPs: the share of the ideal 1/W compute time the slowest rank reaches."""
        return 1.0 / self.flops_max_mean

    @property
    def bound_max_mean(self) -> float:
        """A lower bound on the max/mean any assignment of what LPT places (owner units, expert
        pieces) can reach, the local stacks where they lie: the mean, the largest item, the most
        loaded rank's local experts, k + 1 of the kW + 1 largest items on one rank, and
        Martello–Toth's L2 bin-packing bound on the items (:func:`_least_capacity`)."""
        w = self.world_size
        mean = sum(self.flops) / w
        if not mean:
            return 1.0
        costs = sorted(self.placed_flops, reverse=True) or [0]
        best = max(mean, costs[0], max(self.fixed_flops, default=0))
        for k in range(1, (len(costs) - 1) // w + 1):  # some rank gets k + 1 of the kW + 1 largest
            best = max(best, sum(costs[k * w - k:k * w + 1]))
        return max(best, _least_capacity(costs, w, best, min(self.fixed_flops, default=0))) / mean

    @property
    def idle_ranks(self) -> int:
        return sum(f == 0 for f in self.flops)

    @property
    def bytes_formula(self) -> float:
        """2(W−1)/W²·S, the mean bytes sent per rank when every matrix's rows divide by W."""
        w = self.world_size
        return 2 * (w - 1) / w**2 * self.muon_bytes

    @property
    def sent_mean(self) -> float:
        return sum(self.sent) / self.world_size

    def rank_step_s(self, rank: int) -> float:
        """Predicted time of ``rank``: max(compute, comm) + one exchange's comm (module doc)."""
        compute = self.flops[rank] / self.gemm_flops_per_s
        comm = max(self.sent[rank], self.received[rank]) / self.link_bytes_per_s
        return max(compute, comm) + comm / max(1, len(self.plan.buckets))

    @property
    def step_s(self) -> float:
        return max(self.rank_step_s(r) for r in range(self.world_size))

    @property
    def ideal_step_s(self) -> float:
        """Total NS FLOPs / (W · rate): perfect balance and free communication."""
        return sum(self.flops) / self.world_size / self.gemm_flops_per_s


def plan_model(model: str | dict | Sequence[Matrix], mesh: str | int | Mesh = "dp=8", *,
               ns_steps: int = 5, bucket_size: int | None = BUCKET_SIZE, num_buckets: int = 4,
               wire_bytes: int = 4, ns_bytes: int = 2, gemm_tflops: float = DEFAULT_GEMM_TFLOPS,
               link_gbps: float = DEFAULT_LINK_GBPS, state_bits: int | None = None,
               inflight_bytes: int | _Unset | None = NOT_GIVEN, policy: str = "batched") -> PlanReport:
    """The FSDP optimizer's plan for ``model`` on ``mesh`` and its per-rank figures.

    Args:
      model: a spec name (:data:`muon_fn.distributed.specs.SPECS`), a spec dict, or a list of
        ``(name, global shape, matrix view)`` of the Muon matrices.
      mesh: ``"dp=W"``, ``"replicate=R,dp=W"`` (HSDP) or either with ``",tp=T"`` (FSDP×TP,
        HSDP×TP; :func:`parse_mesh`). With TP the optimizer exchanges over all R·W·T ranks
        (:func:`tp_style`, :func:`held_rows`); without, over the W ranks of a shard group.
      ns_steps: Newton–Schulz iterations (quintic / Polar Express: 4s²l + 2s³ FLOPs each).
      bucket_size: FSDPMuonOptimizer's ``bucket_size`` (its owner units); ``None``: no limit.
      num_buckets: FSDPMuonOptimizer's ``num_buckets`` (exchanges per step).
      wire_bytes: bytes per element on the wire (4: fp32, 2: ``wire_dtype=torch.bfloat16``).
      ns_bytes: bytes per element of the Newton–Schulz iteration (2: bf16, the GPU default).
      gemm_tflops, link_gbps: the achieved GEMM rate (TFLOP/s) and the per-rank link bandwidth
        (GB/s) of the predicted step time.
      state_bits: the optimizers' ``state_bits`` (32, 16, 8, 4): count the optimizer state each
        rank holds at that width (``PlanReport.state``); ``None`` (default): not counted.
      inflight_bytes: the optimizers' ``inflight_bytes`` (bytes, or ``None``: no bound): plan the
        buckets as they do for it and predict each rank's step transient
        (``PlanReport.step_peak``, :func:`muon_fn.distributed._peak.step_transient`); not given
        (default): buckets without a byte bound, no step peak.
      policy: the execution policy of the owners' devices, ``"batched"`` (GPUs) or ``"cpu"``: on
        the CPU the owner units also keep to its byte bound (:func:`owner_units`), and the step
        peak counts its kept scratch and matrix-at-a-time iteration.
    """
    if state_bits is not None:
        _quantize.check_state_bits(state_bits)
    _check_positive(ns_steps=ns_steps, num_buckets=num_buckets, wire_bytes=wire_bytes, ns_bytes=ns_bytes,
                    gemm_tflops=gemm_tflops, link_gbps=link_gbps, **({} if bucket_size is None
                                                                   else {"bucket_size": bucket_size}))
    given = inflight_bytes is not NOT_GIVEN
    if isinstance(inflight_bytes, int):
        _check_positive(inflight_bytes=inflight_bytes)
    elif given and inflight_bytes is not None:
        raise ValueError(f"Invalid inflight_bytes: {inflight_bytes!r} (expected an integer >= 1 or None)")
    if policy not in _peak.POLICIES:
        raise ValueError(f"Invalid policy: {policy!r} (valid: {', '.join(map(repr, _peak.POLICIES))})")
    bound = inflight_bytes if isinstance(inflight_bytes, int) else None
    limit = None if bound is None else max(bound // 2, 1)  # the bucket bound the optimizers plan with
    label, matrices = muon_matrices(model)
    mesh = parse_mesh(mesh)
    world = mesh.world_size if mesh.tp > 1 else mesh.dp
    units = owner_units(matrices, bucket_size, policy)
    expanded = _expert_pieces(matrices, units, mesh, world)
    plan = make_plan([e.shape for e in expanded.matrices], world, num_buckets=num_buckets,
                     units=expanded.units, views=[e.view for e in expanded.matrices],
                     local=[e.local for e in expanded.matrices],
                     held=[e.held for e in expanded.matrices] if mesh.tp > 1 or any(expanded.split) else None,
                     split=expanded.split, bucket_bytes=limit, item_bytes=4)
    flops = [_matrix_flops(e.shape, e.view, ns_steps) for e in expanded.matrices]
    per_rank = _rank_figures(plan, flops, expanded.units, [e.view for e in expanded.matrices], wire_bytes, ns_bytes)
    if mesh.tp > 1:
        per_rank = _with_tp_redistribution(per_rank, plan, [e.style for e in expanded.matrices], mesh.tp, wire_bytes)
    placed = [sum(flops[j] for j in unit) for unit, cut in zip(expanded.units, expanded.split)
              if not cut and not expanded.matrices[unit[0]].local]
    placed += [flops[j] for unit, cut in zip(expanded.units, expanded.split) if cut for j in unit]
    fixed = [0] * world
    for unit, cut in zip(expanded.units, expanded.split):
        for j in unit if expanded.matrices[unit[0]].local and not cut else ():
            for r, _ in _nonzero(plan.matrices[j].receive):
                fixed[r] += plan.matrices[j].row_share(flops[j], r)
    return PlanReport(label, mesh, plan, tuple(e.name for e in expanded.matrices),
                      sum(_views.count(shape, view) for _, shape, view in matrices), len(units),
                      *per_rank, muon_bytes=sum(mp.numel for mp in plan.matrices if not mp.local) * wire_bytes,
                      placed_flops=tuple(placed), fixed_flops=tuple(fixed), matrix_flops=tuple(flops),
                      gemm_flops_per_s=gemm_tflops * 1e12, link_bytes_per_s=link_gbps * 1e9,
                      state=() if state_bits is None else state_per_rank(model, mesh, state_bits),
                      state_bits=state_bits, inflight_bytes=bound,
                      step_peak=() if not given else _peak.rank_transients(
                          plan, expanded.units, [e.view for e in expanded.matrices], inflight_bytes=bound,
                          wire_bytes=wire_bytes, ns_bytes=ns_bytes, policy=policy))


def state_per_rank(model: str | dict | Sequence[Matrix], mesh: str | int | Mesh,
                   state_bits: int = 32) -> tuple[int, ...]:
    """Optimizer state bytes each rank of a ``dp`` shard group holds (module doc): Muon matrices'
    momentum (linear format) and, for a spec, AdamW parameters' moments (``exp_avg``,
    ``exp_avg_sq``) and 4-byte step."""
    mesh = parse_mesh(mesh)
    if isinstance(model, (str, dict)):
        params = [(p.shape, p.view is not None) for p in _specs.model_params(model)]
    else:
        params = [(shape, True) for _, shape, _ in muon_matrices(model)[1]]
    out = [0] * mesh.dp
    for shape, muon in params:
        shape = tuple(shape)
        for r, (a, b) in enumerate(chunk_rows(shape[0], mesh.dp)):
            local = (b - a,) + shape[1:]
            if muon:
                out[r] += _quantize.nbytes(local, state_bits, _quantize.LINEAR)
            else:
                out[r] += (_quantize.nbytes(local, state_bits, _quantize.LINEAR)
                           + _quantize.nbytes(local, state_bits, _quantize.UNSIGNED) + 4)
    return tuple(-(-b // mesh.tp) for b in out)


@functools.lru_cache(maxsize=4096)
def _matrix_flops(shape: tuple[int, ...], view: str | _views.Heads, ns_steps: int) -> int:
    """NS FLOPs of a parameter: its matrices under ``view``, each ``ns_steps`` iterations."""
    return _views.count(shape, view) * ns_flops(_views.matrix_shape(shape, view), ns_steps)


@functools.lru_cache(maxsize=4096)
def _workspace(shape: tuple[int, ...], view: str | _views.Heads, ns_bytes: int) -> int:
    """Bytes of a parameter's Newton–Schulz workspace: X, XXᵀ, its square and the new X of each
    of its matrices, (2sl + 2s²) elements."""
    m, n = _views.matrix_shape(shape, view)
    s, l = min(m, n), max(m, n)  # noqa: E741  the docstring's s and l
    return _views.count(shape, view) * (2 * s * l + 2 * s * s) * ns_bytes


class _Planned(NamedTuple):
    """One matrix of the plan: a Muon parameter, or a one-expert piece of a stack."""

    name: str
    shape: tuple[int, ...]
    view: str | _views.Heads
    style: str  # its TP layout (tp_style), "none" without TP
    held: tuple[tuple[int, int], ...]  # every rank's rows
    local: bool


class _Expanded(NamedTuple):
    matrices: list[_Planned]
    units: list[list[int]]  # the optimizer's owner units, over ``matrices``
    split: list[bool]  # per unit: cut into pieces with owners of their own


def _expert_pieces(matrices: Sequence[Matrix], units: list[list[int]], mesh: Mesh, world: int) -> _Expanded:
    """The plan's matrices as FSDPMuonOptimizer makes them: an expert stack is planned per expert
    (local) and, with fewer experts than ranks (:func:`~muon_fn.distributed._plan.cut_expert_stacks`), cut
    into one-expert pieces; everything else whole."""
    experts = [len(shape) >= 3 and _views.base(view) == "experts" for _, shape, view in matrices]
    entries, plan_units, split, local = cut_expert_stacks(
        units, [shape[0] for _, shape, _ in matrices],
        [mesh.dp * mesh.tp > 1 and all(experts[k] for k in unit) for unit in units],
        [True] * len(matrices), world)
    styles = [tp_style(name, shape, view) if mesh.tp > 1 else "none" for name, shape, view in matrices]
    held = [held_rows(shape[0], mesh, style) if mesh.tp > 1 else chunk_rows(shape[0], world)
            for (_, shape, _), style in zip(matrices, styles)]
    pieces = {k: pieces_held(held[k], matrices[k][1][0]) for k, e in entries if e == 0}
    out = []
    for (k, e), lo in zip(entries, local):
        name, shape, view = matrices[k]
        if e is None:
            out.append(_Planned(name, tuple(shape), view, styles[k], held[k], lo))
        else:
            out.append(_Planned(f"{name}[{e}]", (1,) + tuple(shape[1:]), view, styles[k], pieces[k][e], lo))
    return _Expanded(out, plan_units, split)


def _least_capacity(costs: Sequence[int], w: int, start: float, base: float = 0) -> float:
    """The least per-rank capacity C ≥ ``start`` (from below, to 1e-6) at which Martello–Toth's L2
    bound does not prove that ``costs`` cannot go on ``w`` ranks: for every t ≤ C/2, the items above C − t
    need a rank each, so do those in (C/2, C − t], and the items in [t, C/2] need ranks for what
    does not fit in the second group's room; every rank already carries ``base`` (the least load
    of the stacks computed where they lie), so the items have C − base. A bound on the makespan
    of any assignment."""
    xs = sorted(costs)
    if not xs:
        return start
    prefix = [0]
    for x in xs:
        prefix.append(prefix[-1] + x)
    sizes = sorted(set(xs))

    def count(lo: float, hi: float, open_lo: bool) -> tuple[int, int]:  # items in (lo|[lo, hi]
        a = bisect.bisect_right(xs, lo) if open_lo else bisect.bisect_left(xs, lo)
        b = bisect.bisect_right(xs, hi)
        return max(0, b - a), prefix[max(a, b)] - prefix[a]

    def ranks_needed(c: float) -> float:
        if xs[-1] > c:
            return math.inf
        need = 0
        for t in [0] + [x for x in sizes if x <= c / 2]:
            n1 = len(xs) - bisect.bisect_right(xs, c - t)
            n2, s2 = count(c / 2, c - t, True)
            n3, s3 = count(t, c / 2, False) if t else count(0, c / 2, False)
            need = max(need, n1 + n2 + max(0, math.ceil((s3 - (n2 * c - s2)) / c - 1e-12)))
        return need

    lo, hi = start, max(start, float(prefix[-1]))
    if ranks_needed(lo - base) <= w:
        return lo
    hi += base
    while hi - lo > 1e-6 * lo:  # lo stays infeasible: the bound returned is never above the truth
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if ranks_needed(mid - base) <= w else (mid, hi)
    return lo


def _with_tp_redistribution(per_rank: tuple, plan: Plan, styles: list[str], tp: int,
                            wire_bytes: int) -> tuple:
    """Per-rank figures plus the redistribution of row-wise TP weights: each rank sends and
    receives (tp−1)/tp of its block on the way to rows and again on the way back."""
    flops, sent, received, peak = per_rank
    extra = [0] * plan.world_size
    for mp, style in zip(plan.matrices, styles):
        if style == "rowwise":
            for r in range(plan.world_size):
                extra[r] += 2 * mp.receive_numel(r) * (tp - 1) // tp * wire_bytes
    return (flops, tuple(a + b for a, b in zip(sent, extra)), tuple(a + b for a, b in zip(received, extra)),
            tuple(a + b for a, b in zip(peak, extra)))


def _check_positive(**values: float) -> None:
    """Counts are integers >= 1, rates numbers > 0; the error names the argument and value."""
    for key, value in values.items():
        if key in ("gemm_tflops", "link_gbps"):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"Invalid {key}: {value!r} (expected a number > 0)")
        elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"Invalid {key}: {value!r} (expected an integer >= 1)")


def _rank_figures(plan: Plan, flops: list[int], units: list[list[int]], views: list[str],
                  wire_bytes: int, ns_bytes: int) -> tuple[tuple[int, ...], ...]:
    """Per rank: NS FLOPs, bytes sent, bytes received, extra peak bytes (module doc).

    Sums of per-rank row vectors (shared by equal layouts), so W = 1,024 stays fast; they equal
    the plan's split sizes (:meth:`~muon_fn.distributed._plan.Plan.sent_elements`)."""
    w = plan.world_size
    zeros = [0] * w
    rank_flops, owned, kept, returned = list(zeros), list(zeros), list(zeros), list(zeros)
    owned_in_bucket = [list(zeros) for _ in plan.buckets]
    # row layout -> columns summed over the matrices laid out so; keyed by the layout's identity
    # (plans share layout tuples, and hashing a 1,024-rank layout per matrix is slow)
    contributed: dict[int, list] = {}
    held: dict[int, list] = {}
    copies: dict[int, int] = {}
    for j, mp in enumerate(plan.matrices):
        if mp.local:  # every rank computes the experts it holds; nothing travels
            for r, _ in _nonzero(mp.receive):
                rank_flops[r] += mp.row_share(flops[j], r)
            continue
        contributed.setdefault(id(mp.contrib), [mp.contrib, 0])[1] += mp.cols
        held.setdefault(id(mp.receive), [mp.receive, 0])[1] += mp.cols
        o = mp.owner
        rank_flops[o] += flops[j]
        owned[o] += mp.numel
        owned_in_bucket[mp.bucket][o] += mp.numel
        kept[o] += mp.contrib_numel(o) + mp.receive_numel(o)  # rows the owner keeps both ways
        if id(mp.receive) not in copies:  # rows returned in all: m (sharded) or W·m (replicated)
            copies[id(mp.receive)] = sum(stop - start for start, stop in mp.receive)
        returned[o] += copies[id(mp.receive)] * mp.cols
    sends, holds = _sum_layouts(contributed.values(), w), _sum_layouts(held.values(), w)
    sent = [wire_bytes * (sends[r] + returned[r] - kept[r]) for r in range(w)]
    received = [wire_bytes * (owned[r] + holds[r] - kept[r]) for r in range(w)]
    workspace = _workspaces(plan, units, views, ns_bytes)
    peak = [wire_bytes * (sends[r] + holds[r] + 2 * owned[r] + 2 * max(b[r] for b in owned_in_bucket))
            + workspace[r] for r in range(w)]
    return tuple(rank_flops), tuple(sent), tuple(received), tuple(peak)


def _sum_layouts(columns: Iterable[list], w: int) -> list[int]:
    """Per rank, the elements of its rows summed over ``(row layout, total columns)`` pairs."""
    total = [0] * w
    for rows, cols in columns:
        total = [t + (stop - start) * cols for t, (start, stop) in zip(total, rows)]
    return total


def _workspaces(plan: Plan, units: list[list[int]], views: list[str], ns_bytes: int) -> list[int]:
    """Per rank, the Newton–Schulz workspace of the largest unit it computes: X, XXᵀ, its square
    and the new X of each matrix, (2sl + 2s²) elements in the iteration's dtype."""
    out = [0] * plan.world_size
    for unit in units:
        sizes: dict[int, int] = {}  # per rank computing some of it (an owner; a rank holding local rows)
        for j in unit:
            mp, size = plan.matrices[j], _workspace(plan.matrices[j].shape, views[j], ns_bytes)
            for r, _ in _nonzero(mp.receive) if mp.local else ((mp.owner, 0),):
                sizes[r] = sizes.get(r, 0) + (mp.row_share(size, r) if mp.local else size)
        for r, size in sizes.items():
            out[r] = max(out[r], size)
    return out
