"""The owner-computes communication plan: a pure function of global shapes and the world size.

No torch.distributed here (and no tensors): every rank calls :func:`make_plan` with the same
global shapes in the same order and gets the same plan, so ranks agree on owners, buckets and the
split sizes of every ``all_to_all_single`` without talking to each other.

Terms. Matrix ``j`` has global shape ``(m, n)`` (a weight flattened to ``(shape[0], prod(rest))``):
its rows travel, whatever its matrix view (an expert stack ``(E, out, in)`` has E rows of
``out·in``, so each rank sends whole experts); the view sets the cost of computing it.
Each rank *contributes* a contiguous block of rows (its FSDP2 shard, or all rows on the owner for a
replicated parameter) and *receives back* a contiguous block of rows of the result (its shard again,
or all rows for a replicated parameter). The owner gathers the contributions, computes on the full
matrix, and returns the rows each rank receives. A bucket is a group of matrices exchanged by one
pair of ``all_to_all_single`` calls.

A *local* matrix has no owner (``owner == LOCAL``): each row of it is whole matrices of its view
(an expert stack sharded on its expert dim, so every rank holds whole experts), and every rank
computes the rows it holds, where they lie; none of its elements travel.
"""

from __future__ import annotations

import functools
import heapq
import math
from dataclasses import dataclass
from collections.abc import Sequence

from ..core import views as _views
from ..core.newton_schulz import gemm_flops
from ._budget import LOCAL, cut_by_bytes, held_bytes, unit_bytes

Rows = tuple[int, int]  # [start, stop) rows of a matrix


@functools.lru_cache(maxsize=4096)
def chunk_rows(m: int, world_size: int) -> tuple[Rows, ...]:
    """Row ranges of ``torch.chunk(x, world_size, dim=0)`` padded to ``world_size`` entries.

    This is FSDP2's (and ``Shard(0)``'s) layout: ``ceil(m / W)`` rows per rank, only trailing
    ranks short, possibly empty (10 rows on 4 ranks: 3, 3, 3, 1; 3 rows: 1, 1, 1, 0).
    """
    if m < 0:
        raise ValueError(f"Invalid number of rows: {m} (expected >= 0)")
    if world_size < 1:
        raise ValueError(f"Invalid world_size: {world_size} (expected >= 1)")
    size = -(-m // world_size) if m else 0
    return tuple(
        (min(r * size, m), min((r + 1) * size, m)) for r in range(world_size)
    )


def flat_shape(shape: Sequence[int]) -> tuple[int, int]:
    """``(out, in)`` of a weight of ndim >= 2: ``(shape[0], prod(shape[1:]))``."""
    shape = tuple(int(s) for s in shape)
    if len(shape) < 2:
        raise ValueError(f"Expected a shape with at least 2 dims, got {shape}")
    return shape[0], math.prod(shape[1:])


@functools.lru_cache(maxsize=4096)
def ns_cost(shape: Sequence[int], view: str | _views.Heads = "flatten") -> int:
    """Newton–Schulz cost of a weight: the GEMM FLOPs of one quintic iteration,
    ``4s²l + 2s³`` (``s = min(m, n)``, ``l = max(m, n)``), for each of its matrices ``(m, n)``
    under ``view`` (each block of a head view). Every iteration of the quintic and Polar Express
    costs this, so owners balanced on it are balanced on FLOPs (:func:`ns_flops`)."""
    return sum(ns_flops((m, n), 1) for m, n in _views.unit_shapes(shape, view))


def ns_flops(shape: Sequence[int], steps: int | Sequence[Sequence[float]]) -> int:
    """Dense GEMM FLOPs of an orthogonalization of one matrix (elementwise terms ignored).

    ``steps``: a number of quintic iterations, ``steps·(4s²l + 2s³)`` with ``s = min(m, n)``,
    ``l = max(m, n)`` (``A = XXᵀ`` 2s²l, ``bA + cA²`` 2s³, ``(…)X`` 2s²l); or a schedule, counted
    by :func:`muon_fn.core.newton_schulz.gemm_flops` (each row ``4s²l + 2s³·k`` with ``k`` its m×m
    products, 0 cubic, 1 quintic, 2 degree 7/9; the Gram form's own count).
    """
    m, n = flat_shape(shape)
    s, l = min(m, n), max(m, n)  # noqa: E741  the docstring's s and l
    if isinstance(steps, int):
        return steps * (4 * s * s * l + 2 * s**3)
    return gemm_flops((m, n), steps)


@dataclass(frozen=True)
class MatrixPlan:
    """Where one matrix lives and where it is computed."""

    index: int  # position in the input list
    shape: tuple[int, ...]  # global shape (as given)
    rows: int  # m
    cols: int  # n (elements per row)
    owner: int  # LOCAL: every rank computes the rows it holds
    bucket: int
    contrib: tuple[Rows, ...]  # rows each rank sends to the owner (they tile [0, m))
    receive: tuple[Rows, ...]  # rows each rank gets back
    cost: int = 0  # ns_cost of computing it

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def local(self) -> bool:
        return self.owner == LOCAL

    def cost_on(self, rank: int) -> int:
        """The share of ``cost`` that ``rank`` computes: all of it on the owner; on a local matrix,
        that of the rows the rank holds."""
        if not self.local:
            return self.cost if rank == self.owner else 0
        return self.row_share(self.cost, rank)

    def row_share(self, value: int, rank: int) -> int:
        """``value`` (of the whole matrix) in proportion to the rows ``rank`` holds."""
        start, stop = self.receive[rank]
        return value * (stop - start) // max(self.rows, 1)

    def contrib_numel(self, rank: int) -> int:
        start, stop = self.contrib[rank]
        return (stop - start) * self.cols

    def receive_numel(self, rank: int) -> int:
        start, stop = self.receive[rank]
        return (stop - start) * self.cols


@dataclass(frozen=True)
class BucketPlan:
    """One exchange: matrices in a fixed order, and every rank's split sizes (in elements)."""

    index: int
    matrices: tuple[int, ...]  # indices into Plan.matrices, in exchange order
    # to_owner[d][r]: elements rank r sends to rank d in the gather (forward) all-to-all, by
    # receiver, as the planner sums them (:attr:`gather` is the same table by sender).
    to_owner: tuple[tuple[int, ...], ...]
    # scatter[r][d]: elements rank r sends to rank d in the scatter (return) all-to-all.
    scatter: tuple[tuple[int, ...], ...]

    @functools.cached_property
    def gather(self) -> tuple[tuple[int, ...], ...]:
        """gather[r][d]: elements rank r sends to rank d in the gather all-to-all."""
        return tuple(zip(*self.to_owner))

    def gather_send(self, rank: int) -> list[int]:
        return [row[rank] for row in self.to_owner]

    def gather_recv(self, rank: int) -> list[int]:
        return list(self.to_owner[rank])

    def scatter_send(self, rank: int) -> list[int]:
        return list(self.scatter[rank])

    def scatter_recv(self, rank: int) -> list[int]:
        return [row[rank] for row in self.scatter]


@dataclass(frozen=True)
class Plan:
    """The whole plan; identical on every rank."""

    world_size: int
    matrices: tuple[MatrixPlan, ...]
    buckets: tuple[BucketPlan, ...]

    def owned(self, rank: int, bucket: int | None = None) -> list[int]:
        """Indices of the matrices ``rank`` owns (computes whole; in one bucket, or in all)."""
        order = self.buckets[bucket].matrices if bucket is not None else range(len(self.matrices))
        return [j for j in order if self.matrices[j].owner == rank]

    def load(self) -> list[int]:
        """Newton–Schulz cost (:func:`ns_cost`) each rank computes."""
        loads = [0] * self.world_size
        for mp in self.matrices:
            if mp.local:
                for r, _ in _nonzero(mp.receive):
                    loads[r] += mp.cost_on(r)
            else:
                loads[mp.owner] += mp.cost
        return loads

    def local(self, bucket: int) -> list[int]:
        """Indices of the bucket's local matrices (every rank computes its rows of them)."""
        return [j for j in self.buckets[bucket].matrices if self.matrices[j].local]

    def describe(self, names: Sequence[str] | None = None) -> str:
        """One line per matrix (its bucket, its owner or ``local``, the rows each rank holds), then
        each rank's Newton–Schulz load and the elements it sends per step."""
        w = self.world_size
        lines = [f"Plan(world_size={w}, matrices={len(self.matrices)}, buckets={len(self.buckets)})"]
        for mp in self.matrices:
            name = names[mp.index] if names is not None else f"#{mp.index}"
            who = "local" if mp.local else f"owner={mp.owner}"
            held = [b - a for a, b in mp.receive]
            lines.append(f"  {name} {mp.shape} bucket={mp.bucket} {who} rows per rank={held}")
        lines.append(f"  load per rank={self.load()}")
        lines.append(f"  elements sent per rank={[self.sent_elements(r) for r in range(w)]}")
        return "\n".join(lines)

    def sent_elements(self, rank: int) -> int:
        """Elements ``rank`` sends to other ranks in one step (both directions, self excluded)."""
        total = 0
        for b in self.buckets:
            total += sum(v for d, v in enumerate(b.gather_send(rank)) if d != rank)
            total += sum(v for d, v in enumerate(b.scatter[rank]) if d != rank)
        return total


def lpt_owners(costs: Sequence[int], world_size: int, loads: Sequence[int] | None = None,
               prefer: Sequence[int] | None = None) -> list[int]:
    """Longest-processing-time-first assignment: biggest cost first to the least-loaded rank.

    Ties go to the smaller index (matrix) and the lower rank, so the result is deterministic.
    ``loads`` seeds the per-rank loads (e.g. work already assigned in earlier buckets).
    ``prefer``: per item, a rank that holds its data (or -1): the item stays there while that
    rank's load stays within what the step costs anyway (the mean load of the whole assignment,
    or the largest item if that is more), so data moves only where the balance needs it.
    """
    current = list(loads) if loads is not None else [0] * world_size
    target = max((sum(current) + sum(costs)) / world_size, max(costs, default=0))
    order = sorted(range(len(costs)), key=lambda j: (-costs[j], j))
    owners = [-1] * len(costs)
    for j in order:  # first every item its holder can keep, so the others fill the rest
        r = prefer[j] if prefer is not None else -1
        if r >= 0 and current[r] + costs[j] <= target:
            owners[j] = r
            current[r] += costs[j]
    heap = [(load, r) for r, load in enumerate(current)]
    heapq.heapify(heap)  # (load, rank): the least loaded, then the lowest rank, on top
    for j in order:
        if owners[j] < 0:
            load, r = heap[0]
            owners[j] = r
            heapq.heapreplace(heap, (load + costs[j], r))
    return owners


def make_buckets(sizes: Sequence[int], num_buckets: int) -> list[list[int]]:
    """Split matrix indices ``0..len(sizes)-1`` into at most ``num_buckets`` contiguous groups of
    about equal total size, in reverse order (the last layers' gradients are ready first)."""
    if num_buckets < 1:
        raise ValueError(f"Invalid num_buckets: {num_buckets} (expected >= 1)")
    order = list(reversed(range(len(sizes))))
    total = sum(sizes)
    if not order:
        return []
    k = min(num_buckets, len(order))
    buckets: list[list[int]] = [[]]
    acc = 0
    for j in order:
        # Open a new bucket when this one has reached its share of the total.
        if buckets[-1] and len(buckets) < k and acc >= total * len(buckets) / k:
            buckets.append([])
        buckets[-1].append(j)
        acc += sizes[j]
    return buckets


def make_plan(
    shapes: Sequence[Sequence[int]],
    world_size: int,
    *,
    replicated: Sequence[bool] | None = None,
    num_buckets: int = 4,
    extra_cols: int | Sequence[int] = 0,
    units: Sequence[Sequence[int]] | None = None,
    views: Sequence[str | _views.Heads] | None = None,
    local: bool | Sequence[bool] = False,
    held: Sequence[Sequence[Rows] | None] | None = None,
    split: bool | Sequence[bool] = False,
    bucket_bytes: int | None = None,
    item_bytes: int = 4,
) -> Plan:
    """Owners, row splits and buckets for matrices of global ``shapes`` on ``world_size`` ranks.

    Args:
      shapes: global shape of each matrix (ndim >= 2; flattened to ``(shape[0], prod(rest))``).
      world_size: number of ranks W (>= 1).
      replicated: per matrix, True if every rank holds the full matrix (a plain, DDP-style
        parameter): the owner contributes all rows and every rank receives all rows back.
        Default: all sharded as ``Shard(0)`` with ``torch.chunk`` rows.
      num_buckets: exchanges per step (fewer if there are fewer units).
      extra_cols: columns appended to every row on the wire (e.g. a per-row state travelling
        with the matrix), one count for every matrix or one per matrix; they add to ``cols`` but
        not to the cost.
      units: groups of matrix indices computed together, by one owner, in one exchange bucket
        and in this order (every matrix in exactly one); default: every matrix alone.
      views: the matrix view of each (:mod:`muon_fn.core.views`; default ``"flatten"``): it sets the
        cost (an expert stack costs its E matrices, a head view its blocks, :func:`ns_cost`).
      local: per matrix (or one for all), True if each of its rows is whole matrices that the rank
        holding the row can compute alone (an expert stack, sharded): it gets no owner, every rank
        computes its own rows, nothing travels. Not for replicated matrices; a unit's matrices
        must agree.
      held: per matrix, None or the rows each rank holds (FSDP×TP, expert parallelism: any
        layout whose row blocks tile the matrix, equal blocks on replicas); it overrides
        ``replicated`` for that matrix. The first rank holding a block contributes it; every
        holder receives it back.
      split: per unit (or one for all), True if its matrices may have different owners (the
        pieces of expert stacks, :func:`expert_pieces`): they stay in one exchange bucket, but LPT
        places each matrix on its own. The owner computes its matrices of the unit together.
      bucket_bytes: at most this many bytes held on any rank by one exchange bucket
        (:func:`held_bytes`: twice its owned whole matrices, ``rows · cols · item_bytes``, and
        twice the rows it sends of the others): the ``num_buckets`` buckets are cut further, a
        unit that would not fit waiting for the next bucket of its group, except that every
        owner gets at least one unit in each bucket (a unit is never cut), so the owners compute
        side by side; ``None``: no bound.

    Local matrices are planned first (their cost falls where their rows lie). Owners are assigned
    to the other units by LPT on :func:`ns_cost` (FLOPs) over all units at once, from the loads of
    the local matrices, the costliest first to the least-loaded rank: the step waits for the most
    loaded rank, so the total over the step is what is balanced, not each exchange bucket's.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"Invalid world_size: {world_size!r} (expected an integer >= 1)")
    shapes = [tuple(int(s) for s in shape) for shape in shapes]
    flat = [flat_shape(s) for s in shapes]
    replicated = _per_matrix("replicated", False if replicated is None else replicated, len(shapes))
    extra = _per_matrix("extra_cols", extra_cols, len(shapes))
    costs = [ns_cost(s, v) for s, v in zip(shapes, _per_matrix("views", views or "flatten", len(shapes)))]
    if any(e < 0 for e in extra):
        raise ValueError(f"Invalid extra_cols: {extra_cols} (expected >= 0)")
    units = _check_units(units, len(shapes))
    local = _check_local(_per_matrix("local", local, len(shapes)), replicated, units)
    held, receives = _held_rows(held, replicated, flat, world_size)
    groups = make_buckets([0 if local[u[0]] else sum(flat[j][0] * flat[j][1] for j in u) for u in units],
                          num_buckets)
    seed = _local_loads(local, receives, costs, flat, world_size)
    split = _per_matrix("split", split, len(units))
    holders = [(_nonzero(rows) or ((-1, 0),))[0][0] for rows in receives]
    owners, bucket_of = _assign_owners(costs, units, groups, world_size, seed, local, split, holders)
    for u, unit in enumerate(units):  # a piece its only holder keeps is computed where it lies
        for j in unit if split[u] else ():
            if owners[j] == holders[j] and len(_nonzero(receives[j])) == 1:
                owners[j], local[j] = LOCAL, True
    contribs = [_contributions(receives[j], held[j], local[j], replicated[j], owners[j], m)
                for j, (m, _) in enumerate(flat)]
    if bucket_bytes is not None:
        weights = [unit_bytes([held_bytes(owners[j], flat[j][0], flat[j][1] + extra[j], contribs[j], receives[j],
                                           item_bytes) for j in unit]) for unit in units]
        groups = cut_by_bytes(groups, weights, [{owners[j] for j in unit} - {LOCAL} for unit in units],
                               bucket_bytes, world_size)
        for b, members in enumerate(groups):
            for u in members:
                for j in units[u]:
                    bucket_of[j] = b
    matrices = [MatrixPlan(j, shape, m, n + extra[j], owners[j], bucket_of[j], contribs[j], receives[j], costs[j])
                for j, (shape, (m, n)) in enumerate(zip(shapes, flat))]
    buckets = [_bucket_plan(b, [j for u in members for j in units[u]], matrices, world_size)
               for b, members in enumerate(groups)]
    return Plan(world_size, tuple(matrices), tuple(buckets))


def _held_rows(held, replicated: list[bool], flat: list[tuple[int, int]],
               world_size: int) -> tuple[list[tuple[Rows, ...] | None], list[tuple[Rows, ...]]]:
    """``(held, receives)``: ``held`` as tuples, and the rows each rank receives back of each
    matrix (what it holds: given, all of it if replicated, else its ``torch.chunk`` rows)."""
    held = [None if h is None else h if type(h) is tuple and (not h or type(h[0]) is tuple)
            else tuple(tuple(r) for r in h) for h in (held or [None] * len(flat))]
    receives = [h if h is not None else ((0, m),) * world_size if rep else chunk_rows(m, world_size)
                for h, rep, (m, _) in zip(held, replicated, flat)]
    if len(receives) != len(flat) or any(len(r) != world_size for r in receives):
        raise ValueError(f"held must give the rows of each of {world_size} ranks for each of {len(flat)} matrices")
    return held, receives


def _local_loads(local: list[bool], receives, costs: list[int], flat: list[tuple[int, int]],
                 world_size: int) -> list[int]:
    """Each rank's share of the local matrices' cost (by the rows it holds): LPT's starting loads."""
    seed = [0] * world_size
    for j in (j for j, lo in enumerate(local) if lo):
        for r, n in _nonzero(receives[j]):
            seed[r] += costs[j] * n // max(flat[j][0], 1)
    return seed


def _contributions(receive: tuple[Rows, ...], held, local: bool, replicated: bool, owner: int,
                   m: int) -> tuple[Rows, ...]:
    """The rows each rank sends of one matrix: each held block once (from the owner where it
    holds it), a replicated matrix's rows from the owner alone, else what each rank holds."""
    if held is not None and not local:
        return receive if _no_replicas(receive) else first_holders(receive, owner)
    if replicated:
        return tuple((0, m) if r == owner else (0, 0) for r in range(len(receive)))
    return receive


def first_holders(held: Sequence[Rows], owner: int) -> tuple[Rows, ...]:
    """Each rank's contribution when ranks hold ``held`` rows: each block once, from the owner
    if it holds it (it need not travel), else from the first rank holding it."""
    seen: set[Rows] = {tuple(held[owner])}
    out = []
    for r, rows in enumerate(held):
        rows = tuple(rows)
        out.append(rows if r == owner or (rows not in seen and rows[1] > rows[0]) else (0, 0))
        seen.add(rows)
    return tuple(out)


def _check_units(units: Sequence[Sequence[int]] | None, n: int) -> list[list[int]]:
    if units is None:
        return [[j] for j in range(n)]
    units = [[int(j) for j in u] for u in units]
    if sorted(j for u in units for j in u) != list(range(n)) or not all(units):
        raise ValueError(f"units must hold every matrix index 0..{n - 1} once, in non-empty "
                         f"groups, got {units}")
    return units


def _check_local(local: list, replicated: list, units: list[list[int]]) -> list[bool]:
    local = [bool(x) for x in local]
    for j, (lo, rep) in enumerate(zip(local, replicated)):
        if lo and rep:
            raise ValueError(f"matrix {j} is replicated: every rank holds all of it, so it cannot be local")
    for u in units:
        if len({local[j] for j in u}) > 1:
            raise ValueError(f"the matrices of unit {u} disagree on local")
    return local


def _assign_owners(costs: list[int], units: list[list[int]], groups: list[list[int]], world_size: int,
                   loads: list[int], local: list[bool], split: list[bool],
                   holders: list[int]) -> tuple[list[int], list[int]]:
    """Owner and bucket of every matrix (of ``costs``): LPT over all units that are not local at
    once (each matrix of a ``split`` unit on its own, kept by its first holder in ``holders``
    while that rank's load allows), from the ``loads`` of the local matrices (which get
    :data:`LOCAL`)."""
    owners, bucket_of = [LOCAL] * len(costs), [0] * len(costs)
    split_of = [False] * len(costs)
    for u, unit in enumerate(units):
        for j in unit:
            split_of[j] = split[u]
    for b, members in enumerate(groups):
        for u in members:
            for j in units[u]:
                bucket_of[j] = b
    placed = [members for u, unit in enumerate(units) if not local[unit[0]]
              for members in ([[j] for j in unit] if split[u] else [unit])]
    unit_costs = [sum(costs[j] for j in members) for members in placed]
    prefer = [holders[members[0]] if split_of[members[0]] else -1 for members in placed]
    for members, r in zip(placed, lpt_owners(unit_costs, world_size, loads, prefer)):
        for j in members:
            owners[j] = r
    return owners, bucket_of


def _bucket_plan(b: int, members: list[int], matrices: list[MatrixPlan], world_size: int) -> BucketPlan:
    """Split sizes of one exchange, summed per owner over per-rank element counts (only the ranks
    holding rows of a matrix, so many small pieces at W = 1,024 stay fast): ``into[d][r]``
    elements go from rank r to owner d, ``out_of[d][r]`` from owner d back to rank r."""
    zeros = (0,) * world_size
    into: dict[int, list[int]] = {}
    out_of: dict[int, list[int]] = {}
    for j in members:
        mp = matrices[j]
        if mp.local:  # computed where it lies: nothing to send
            continue
        _add(into, mp.owner, _nonzero(mp.contrib), mp.cols, world_size)
        _add(out_of, mp.owner, _nonzero(mp.receive), mp.cols, world_size)
    to_owner = tuple(tuple(into[d]) if d in into else zeros for d in range(world_size))
    scatter = tuple(tuple(out_of[d]) if d in out_of else zeros for d in range(world_size))
    return BucketPlan(b, tuple(members), to_owner, scatter)


def _add(sums: dict[int, list[int]], key: int, rows: tuple[tuple[int, int], ...], cols: int, w: int) -> None:
    """``sums[key][r] += rows·cols`` for each ``(r, rows)`` of ``rows``."""
    total = sums.get(key)
    if total is None:
        total = sums[key] = [0] * w
    for r, n in rows:
        total[r] += n * cols


def _by_identity(fn):
    """``fn`` of a row layout, remembered by the layout's identity: plans share layout tuples
    (``chunk_rows``, :func:`pieces_held`), and hashing a 1,024-rank layout costs more than ``fn``."""
    memo: dict[int, tuple] = {}

    @functools.wraps(fn)
    def cached(rows: tuple[Rows, ...]):
        hit = memo.get(id(rows))
        if hit is None or hit[0] is not rows:
            if len(memo) >= 4096:
                memo.clear()
            hit = memo[id(rows)] = (rows, fn(rows))  # the layout is kept alive with its value
        return hit[1]

    return cached


@_by_identity
def _nonzero(rows: tuple[Rows, ...]) -> tuple[tuple[int, int], ...]:
    """``(rank, row count)`` of every rank holding rows in ``rows``."""
    return tuple((r, stop - start) for r, (start, stop) in enumerate(rows) if stop > start)


@_by_identity
def _no_replicas(held: tuple[Rows, ...]) -> bool:
    """No two ranks hold the same non-empty block (each block has one holder)."""
    blocks = [r for r in held if r[1] > r[0]]
    return len(blocks) == len(set(blocks))


def expert_pieces(rows: int, world_size: int) -> bool:
    """Whether a stack of ``rows`` whole matrices (an expert stack on its expert dim), planned per
    matrix, is cut into one-row pieces, each with an owner of its own, instead of being computed
    where it lies: when there are fewer rows than ranks, so that computing in place would leave
    ranks idle (DeepSeek-V3's 256 experts on 1,024 ranks)."""
    return rows < world_size


def cut_expert_stacks(units: Sequence[Sequence[int]], rows: Sequence[int], per_expert: Sequence[bool],
                      cuttable: Sequence[bool], world_size: int
                      ) -> tuple[list[tuple[int, int | None]], list[list[int]], list[bool], list[bool]]:
    """The plan's matrices from parameters grouped in owner ``units``: a unit planned per expert
    (``per_expert``) whose stacks all have fewer ``rows`` (experts) than ranks (:func:`expert_pieces`)
    and may be cut (``cuttable``) becomes one-row pieces; everything else stays whole. Returns, in
    parameter order, ``(parameter index, row)`` per plan matrix (row None: whole), the units over
    the plan matrices, per unit whether it was cut (``make_plan``'s ``split``), and per plan
    matrix whether it is local (planned per expert and not cut). FSDPMuonOptimizer and
    :func:`~muon_fn.fsdp.plan_model` both plan through it."""
    split = [per_expert[u] and all(cuttable[k] and expert_pieces(rows[k], world_size) for k in unit)
             for u, unit in enumerate(units)]
    unit_of = {k: u for u, unit in enumerate(units) for k in unit}
    entries: list[tuple[int, int | None]] = []
    plan_units: list[list[int]] = [[] for _ in units]
    local: list[bool] = []
    for k in range(len(rows)):
        u = unit_of[k]
        for e in range(rows[k]) if split[u] else (None,):
            plan_units[u].append(len(entries))
            entries.append((k, e))
            local.append(per_expert[u] and not split[u])
    return entries, plan_units, split, local


@functools.lru_cache(maxsize=256)
def pieces_held(held: tuple[Rows, ...], rows: int) -> tuple[tuple[Rows, ...], ...]:
    """For each row ``e`` of a matrix of ``rows`` rows whose rows the ranks hold as ``held``: per
    rank, ``(0, 1)`` if it holds row ``e``, else ``(0, 0)`` (the one-row pieces' layouts)."""
    none = ((0, 0),) * len(held)
    pieces = [list(none) for _ in range(rows)]
    for r, (start, stop) in enumerate(held):
        for e in range(start, stop):
            pieces[e][r] = (0, 1)
    return tuple(tuple(p) for p in pieces)


def _per_matrix(name: str, value, n: int) -> list:
    """``value`` for each of ``n`` matrices: a sequence of ``n`` entries, or one value for all."""
    if isinstance(value, (bool, int, str, _views.Heads)):
        return [value] * n
    value = list(value)
    if len(value) != n:
        raise ValueError(f"{name} has {len(value)} entries for {n} shapes")
    return value
