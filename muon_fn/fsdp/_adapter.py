"""The FSDP2 adapter: a :class:`muon_fn.Optimizer`'s recipe run on sharded parameters, each
matrix computed whole by one owner.

:class:`FSDPAdapter` is a mixin for an optimizer class of :mod:`muon_fn.optim` (before it in the
bases, e.g. ``class FSDPMuonOptimizer(FSDPAdapter, MuonOptimizer)``): the groups, their checks
and their transforms stay the optimizer's (the same factory on the same hyperparameters); the
adapter changes where each part of a transform runs. Each group's routes (:mod:`._routes`) split
their transforms into phases (:mod:`._phases`); per step:

1. **pre** on every rank's local rows (Muon: momentum), in place;
2. the rows of every matrix travel to its owner (:mod:`._rows`, :mod:`._plan`, :mod:`._exchange`),
   which runs the **mid** phase on the whole matrices (Muon: orthogonalize … scale_by_shape), one
   call per bucket of the single-device optimizer, and returns each rank's rows of the result;
   an expert stack sharded on its expert dim does not travel: each rank runs the mid phase on
   the whole experts it holds (:meth:`FSDPAdapter._is_local`);
3. **post** on local rows (Muon: weight decay and learning rate), then ``p += u`` in place.

Transforms without a matrix part (AdamW) run whole on local rows with no communication.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import time
import warnings
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
import torch.nn as nn

from .. import _checks, _tree, _views
from .._muon import group_by
from ..optim import _state
from ..optim._adapter import BUCKET_SIZE, StepReport, _all_finite, step_not_traced, write_back
from ..optim._views import module_views
from . import _exchange, _overlap, _params, _phases, _plan, _rows
from ._routes import Bucket, Route, group_routes

STRATEGIES = ("owner", "replicate")
WIRE_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)


class _Matrix(NamedTuple):
    """A matrix of the plan: a parameter of a route with a mid phase."""

    group: int
    route: Route
    bucket: Bucket  # the matrices its owner computes together (as single-device MuonOptimizer)
    position: int  # in group["params"]
    param: torch.Tensor
    fmt: _rows.RowFormat
    flops: int  # of its orthogonalization (for last_step_stats)
    view: str | _views.Heads  # its matrix view
    piece: int | None = None  # a one-row piece of an expert stack: the row (expert); None: whole


class FSDPAdapter:
    """Runs the step of the :class:`muon_fn.Optimizer` subclass it is mixed into on FSDP2-sharded
    (or DDP-replicated) parameters; see the module docstring. A subclass's ``__init__`` calls
    :meth:`_setup`, then the optimizer's ``__init__``, then :meth:`_distribute`.

    After each step ``last_step_stats`` holds this rank's figures: ``bytes_sent``,
    ``bytes_received``, ``ns_flops`` (see :meth:`_matrix_flops`), ``matrices_computed``,
    ``comm_wait_s``, ``compute_s``, ``step_s``, ``applied``.
    """

    def _setup(self, model: nn.Module, strategy: str, wire_dtype: torch.dtype | None,
               num_buckets: int, overlap: bool = False) -> None:
        """Check and keep the adapter's own options (before the optimizer adds its groups)."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        _checks.one_of("strategy", strategy, STRATEGIES)
        _checks.one_of("wire_dtype", wire_dtype, WIRE_DTYPES)
        _checks.positive_int("num_buckets", num_buckets)
        _checks.one_of("overlap", overlap, (True, False))
        if overlap and strategy != "owner":
            raise ValueError(f"overlap=True needs strategy='owner' (the exchange it starts during "
                             f"backward), got strategy={strategy!r}")
        self._overlap_wanted, self._overlap = overlap, None
        self._model, self.strategy, self.wire_dtype = model, strategy, wire_dtype
        self._num_buckets = num_buckets
        self._names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        self._model_views = module_views(model)
        self._distributed = False
        self._builds = itertools.count()

    def _distribute(self, process_group: Any, k: int) -> None:
        """Where every parameter lives, its state, and the plan (once all groups are in)."""
        self._process_group = process_group
        named = [(self._fqn(p), p) for g in self.param_groups for p in g["params"]]
        self.topology = _params.resolve_topology(named, process_group)
        self._layouts = _params.layouts(named, self.topology)
        self._fsdp_modules = _fsdp_modules(self._model)
        if k > 1 and not self._fsdp_modules:
            raise ValueError(
                f"gradient_accumulation_steps={k} needs a model wrapped with "
                f"torch.distributed.fsdp.fully_shard (FSDP2), but {type(self._model).__name__} "
                "contains no FSDPModule")
        self._accumulation_steps, self._micro_step = k, 0
        self._device = _params.local(named[0][1]).device if named else torch.device("cpu")
        self._plan_key: Any = None
        self._pending_init: list[tuple[int, Route, Bucket]] = []
        self.last_step_stats: dict[str, Any] = {}
        self._matrices()
        self._set_gradient_sync(k == 1)
        self._distributed = True
        self.overlap = self._overlap_wanted

    # ------------------------------------------------------------------ copies
    # A copy (copy.deepcopy, pickle) carries the model with the parameters, so the two stay one
    # model, and rebuilds the plan from them; a process group cannot travel (a copy uses the
    # DTensor parameters' group, else the default one).
    # A copy runs without overlap (the hooks and their process group are made collectively):
    # set ``overlap = True`` on the copies of every rank.
    _FSDP_CONFIG = ("_model", "strategy", "wire_dtype", "_num_buckets", "_accumulation_steps", "_micro_step")

    def __getstate__(self) -> dict[str, Any]:
        if getattr(self, "_process_group", None) is not None:
            raise TypeError(f"cannot copy a {type(self).__name__} built with process_group=: a process "
                            "group cannot be copied; build a new optimizer instead")
        state = super().__getstate__()
        state.update({k: self.__dict__[k] for k in self._FSDP_CONFIG if k in self.__dict__})
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # torch's load_state_dict calls it too: nothing to rebuild then
        if "_layouts" not in self.__dict__ and "_model" in self.__dict__:
            self._names = {id(p): n for n, p in self._model.named_parameters(remove_duplicate=False)}
            self._model_views = module_views(self._model)
            self._distributed, self._builds = False, itertools.count()
            self._overlap_wanted, self._overlap = False, None
            micro = self._micro_step
            self._distribute(None, self._accumulation_steps)
            self._micro_step = micro
            self._set_gradient_sync(self._accumulation_steps == 1 or micro == self._accumulation_steps - 1)

    # ------------------------------------------------------------------ groups and state
    def _fqn(self, p: torch.Tensor) -> str:
        return self._names.get(id(p), f"<parameter of shape {tuple(p.shape)} not in model>")

    def _name(self, group: dict[str, Any], p: torch.Tensor) -> str:
        return repr(self._fqn(p))

    def _param_names(self, group: dict[str, Any]) -> list[str | None]:
        return [self._names.get(id(p)) for p in group["params"]]

    def _known_view(self, p: torch.Tensor) -> str | None:
        """The model is known: a conv weight is flattened, any other parameter of ndim ≥ 3 is a
        stack of matrices (:func:`muon_fn.optim._views.module_views`)."""
        return self._model_views.get(id(p))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """The optimizer's ``add_param_group`` before the plan is made (refused after)."""
        if self._distributed:
            raise RuntimeError(f"{type(self).__name__} cannot add parameter groups after construction "
                               "(the communication plan is fixed); pass every group to __init__")
        super().add_param_group(param_group)

    def _matrix_algorithm(self) -> str:
        """The algorithm of a hybrid's matrices (``algorithms[1]``: "muon", "sso")."""
        return getattr(self, "algorithms", ("auto", "matrix"))[1]

    def _matrix_flops(self, group: dict[str, Any], shape: tuple[int, ...]) -> int:
        """FLOPs of one matrix's mid phase, for ``last_step_stats`` (0 unless a subclass knows)."""
        return 0

    def _param_flops(self, group: dict[str, Any], shape: tuple[int, ...], view: str | _views.Heads) -> int:
        """FLOPs of a parameter's mid phase: its matrices' (or head blocks') under ``view``."""
        return sum(self._matrix_flops(group, s) for s in _views.unit_shapes(shape, view))

    @staticmethod
    def _meta(params: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return tuple(torch.empty(tuple(p.shape), dtype=p.dtype, device="meta") for p in params)

    def _build(self, group: dict[str, Any], rt: Any, static_key: Any) -> None:
        super()._build(group, rt, static_key)
        rt.routes, rt.build = None, next(self._builds)  # built on first use, after the dry run

    def _owner_bucket_size(self) -> int:
        """Same-shape matrices one owner computes together: the CPU's :data:`BUCKET_SIZE` on every
        device unless given (the planner balances owners in such buckets; an unbounded GPU
        bucket would give every same-shape matrix to one owner)."""
        return BUCKET_SIZE if self._bucket_size is None else self._bucket_size

    def _routes(self, index: int) -> list[Route]:
        rt = self._runtimes[index]
        if rt.routes is None:
            group = self.param_groups[index]
            rt.routes = group_routes(group, self._group_hyper(group, rt), self._param_options(group), self._factory,
                                     self._matrix_algorithm(), self._meta, self._owner_bucket_size(),
                                     self._compile_options)
        return rt.routes

    def _init_state(self, index: int) -> None:
        """Every state entry now, so state_dict keys are the same on every rank (DCP): rows of a
        sharded parameter's state are DTensors laid out like the parameter, the rest plain.

        The state of a mid phase that reads parameters (SSO's warm-start block) is made from the
        whole matrices, as single-device optimizers make it, on the first step
        (:meth:`_init_from_whole`); until then it holds zeros of its shape."""
        params = self.param_groups[index]["params"]
        for route in self._routes(index):
            for bucket in route.buckets:
                ps = [params[i] for i in bucket.indices]
                states = [self.state[p] for p in ps]
                fresh, whole = self._fresh_leaves(route, bucket, ps)
                if whole and not _state.complete(bucket.phase_layouts[1], states):
                    self._pending_init.append((index, route, bucket))
                leaves = [None if leaf is None else self._state_leaf(ps[slot.index or 0], slot, leaf, rows)
                          for slot, rows, leaf in zip(bucket.layout.slots, bucket.rows, fresh)]
                _state.scatter(bucket.layout, _tree.tree_unflatten(bucket.layout.spec, leaves), states,
                               overwrite=False)

    def _fresh_leaves(self, route: Route, bucket: Bucket, ps: list[torch.Tensor]) -> tuple[list, bool]:
        """The leaves of a fresh state of the bucket from its local rows, and whether its mid
        phase's leaves are placeholders to make from the whole matrices."""
        local = tuple(_params.local(p) for p in ps)
        phases = route.phases
        if phases.mid is None or not phases.mid_needs_params:
            return _tree.tree_leaves(phases.whole.init(local)), False
        pre, mid, _ = bucket.phase_layouts
        first = len(pre.slots)
        held = [None if slot is None else torch.zeros(
            ((local[slot.index].shape[0],) + slot.shape[1:]) if bucket.rows[first + n] else slot.shape,
            dtype=slot.dtype, device=self._device) for n, slot in enumerate(mid.slots)]
        leaves = (_tree.tree_leaves(phases.pre.init(local)) + held
                  + _tree.tree_leaves(phases.post.init(local)))
        return leaves, any(slot is not None for slot in mid.slots)

    def _init_from_whole(self, grads: list[tuple]) -> None:
        """Make the pending mid state of the buckets that have a gradient on some rank from their
        whole matrices: each rank gathers them (one all-gather per bucket, once) and keeps its rows
        of row states and all of the rest. A step without gradients leaves the state alone."""
        topo, pending = self.topology, self._pending_init
        due = _exchange.any_rank([any(grads[gi][i] is not None for i in bucket.indices)
                                  for gi, _, bucket in pending], topo.group, topo.world_size)
        self._pending_init = [entry for entry, now in zip(pending, due) if not now]
        for index, route, bucket in (entry for entry, now in zip(pending, due) if now):
            ps = [self.param_groups[index]["params"][i] for i in bucket.indices]
            whole = tuple(p.full_tensor() if isinstance(p, _params.DTensor) else p for p in ps)
            pre, mid, _ = bucket.phase_layouts
            made = _tree.tree_leaves(route.phases.mid.init(tuple(w.detach() for w in whole)))
            for n, (slot, value) in enumerate(zip(mid.slots, made)):
                if slot is None:
                    continue
                for k in ([slot.index] if slot.index is not None else range(len(ps))):
                    a, b = self._layouts[id(ps[k])].rows if bucket.rows[len(pre.slots) + n] else (None, None)
                    _params.local(self.state[ps[k]][slot.key]).copy_(value if a is None else value[a:b])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._drop_overlap()
        super().load_state_dict(state_dict)
        self._pending_init = []  # the loaded state is the state

    def _state_leaf(self, p: torch.Tensor, slot: _state.Slot, local: torch.Tensor,
                    rows: bool) -> torch.Tensor:
        if rows:
            return _params.rows_like(p, local, slot.shape)
        if tuple(local.shape) != slot.shape:
            raise ValueError(f"state {slot.key!r} of parameter {self._fqn(p)!r} has shape "
                             f"{tuple(local.shape)} on this rank's rows but {slot.shape} on the whole "
                             "parameter: the FSDP adapter cannot hold it (neither per row nor whole)")
        return local

    def _local_state(self, bucket: Bucket, params: list[torch.Tensor]) -> Any:
        """The bucket's state as this rank's tensors (views of the stored ones)."""
        stored = _state.gather(bucket.layout, [self.state[params[i]] for i in bucket.indices])
        return _tree.tree_map(lambda t: None if t is None else _params.local(t), stored)

    # ------------------------------------------------------------------ the plan
    def _matrices(self) -> list[_Matrix]:
        """Every matrix with a mid phase, in group order; the plan is rebuilt when they change."""
        key = tuple(self._runtime(i).build for i in range(len(self.param_groups)))
        if key == self._plan_key:
            return self._matrix_list
        matrices = []
        for gi, group in enumerate(self.param_groups):
            buckets = {i: (r, b) for r in self._routes(gi) for b in r.buckets for i in b.indices}
            for i, p in enumerate(group["params"]):
                route, bucket = buckets[i]
                if route.phases.mid is not None:
                    self._check_columns(p, route, route.formats[i])
                    view = route.options.get("matrix_view", "flatten")
                    matrices.append(_Matrix(gi, route, bucket, i, p, route.formats[i],
                                            self._param_flops(group, tuple(p.shape), view), view))
        for index in range(len(self.param_groups)):  # the state a rebuilt transform adds
            self._init_state(index)
        matrices = self._set_plan(matrices)
        self._plan_key, self._matrix_list = key, matrices
        self._index: dict[tuple[int, int], list[int]] = {}  # (group, position) -> plan matrices
        for j, m in enumerate(matrices):
            self._index.setdefault((m.group, m.position), []).append(j)
        return matrices

    def _check_columns(self, p: torch.Tensor, route: Route, fmt: _rows.RowFormat) -> None:
        """A parameter sharded by columns (a row-wise TP weight) travels as rows; a per-row state
        (NorMuon's) cannot be kept in its columns' layout."""
        if self._layouts[id(p)].row_placements is not None and fmt.row_states:
            raise ValueError(
                f"parameter {self._fqn(p)!r} has placements {tuple(p.placements)}, which shard its "
                f"columns, but the {route.label!r} transform keeps a per-row state "
                f"({', '.join(leaf.key for leaf in fmt.row_states)}); use plain Muon for column-sharded "
                "(row-wise tensor parallel) weights, or shard them by rows")

    def _is_local(self, m: _Matrix) -> bool:
        """Whether every rank can compute its own rows of ``m`` (per-expert planning), under
        ``strategy="owner"``: a sharded expert stack (each row of dim 0 is whole matrices of its
        view, so a rank holds whole experts) whose mid phase is per matrix (an expert's bits do
        not depend on the others: Muon; not NorMuon or SSO, see ``muon_fn.TransformInfo``) and
        keeps no state shared by all its rows other than counters (0-d integers, the same on
        every rank)."""
        return (self.strategy == "owner" and self._layouts[id(m.param)].sharded and m.param.ndim >= 3
                and _views.base(m.view) == "experts" and m.route.phases.mid_per_matrix
                and all(leaf.shape == () and not leaf.dtype.is_floating_point for leaf in m.fmt.replicated))

    def _set_plan(self, matrices: list[_Matrix]) -> list[_Matrix]:
        """The plan of ``matrices``; returns the plan's matrices: those of a stack with fewer rows
        (experts) than ranks, planned per expert, become one-row pieces with owners of their own
        (:func:`~muon_fn.fsdp._plan.cut_expert_stacks`), the rest stay whole."""
        topo = self.topology
        units = group_by([id(m.bucket) for m in matrices])  # the owner computes whole buckets
        entries, plan_units, split, local = _plan.cut_expert_stacks(
            units, [m.param.shape[0] for m in matrices],
            [all(self._is_local(matrices[k]) for k in unit) for unit in units],
            # a piece's owner keeps nothing for the other pieces: only a stack without mid state is cut
            [not m.fmt.replicated and not m.fmt.row_states for m in matrices], topo.world_size)
        pieces = {k: _plan.pieces_held(self._held_rows(matrices[k]), matrices[k].param.shape[0])
                  for k, e in entries if e == 0}
        planned, shapes, held = [], [], []
        for k, e in entries:
            m = matrices[k]
            planned.append(m if e is None else m._replace(piece=e, flops=m.flops // m.param.shape[0]))
            shapes.append(tuple(m.param.shape) if e is None else (1,) + tuple(m.param.shape[1:]))
            held.append(self._layouts[id(m.param)].held if e is None else pieces[k][e])
        plan = _plan.make_plan(
            shapes, topo.world_size, replicated=[not self._layouts[id(m.param)].sharded for m in planned],
            held=held, num_buckets=self._num_buckets, extra_cols=[m.fmt.sent_cols - m.fmt.cols for m in planned],
            units=plan_units, views=[m.view for m in planned], local=local, split=split)
        _exchange.check_same(self._plan_description(plan), "the optimizer's plan", topo.group, topo.world_size)
        self.plan, self._wire_in = plan, _rows.common_dtype([m.fmt for m in planned])
        return planned

    def _held_rows(self, m: _Matrix) -> tuple[tuple[int, int], ...]:
        """Every rank's rows of ``m``'s parameter (as exchanged)."""
        layout = self._layouts[id(m.param)]
        return layout.held if layout.held is not None else _plan.chunk_rows(layout.shape[0], self.topology.world_size)

    def _plan_description(self, plan: _plan.Plan) -> list[tuple[str, str]]:
        """What every rank must agree on, entry by entry: the options that decide which
        collectives a step makes, the mesh, each parameter (name, global shape, placements,
        route, matrix view of ndim ≥ 3), and the plan (owners, buckets, split sizes) by its hash."""
        topo = self.topology
        where = topo.describe()
        out = [("the options", f"strategy={self.strategy!r}, wire_dtype={self.wire_dtype}, "
                               f"num_buckets={self._num_buckets}, gradient_accumulation_steps="
                               f"{self._accumulation_steps}, nonfinite={self.nonfinite!r}, "
                               f"overlap={self._overlap_wanted}, {topo.world_size} ranks, {where}")]
        for gi, group in enumerate(self.param_groups):
            routes = {i: route for route in self._routes(gi) for i in route.indices}
            for i, p in enumerate(group["params"]):
                placed = (f"placements {tuple(p.placements)}" if isinstance(p, _params.DTensor)
                          else "a plain (replicated) tensor")
                view = routes[i].options.get("matrix_view", "flatten")
                view = f", view {view!r}" if p.ndim >= 3 or view not in (None, "flatten") else ""
                out.append((f"parameter {i} of group {gi}",
                             f"{self._fqn(p)!r} of shape {tuple(p.shape)}, {placed}, {routes[i].label}{view}"))
        out.append(("the plan's owners and buckets", hashlib.sha256(repr(plan).encode()).hexdigest()[:16]))
        return out

    # ------------------------------------------------------------------ the step
    @step_not_traced
    def _step(self) -> None:
        start = time.perf_counter()
        k = self._accumulation_steps
        if k > 1 and not self._last_micro_batch(k):
            return
        grads = [self._local_grads(group, k) for group in self.param_groups]
        ready = self._overlap_complete(grads)
        try:
            finite = self._finite(grads)
        except BaseException:
            if ready is not None:  # "error": nothing changed, nothing left in flight
                ready.posted.drain()
            raise
        stats = self._apply(grads, finite, ready)
        if finite is not None:
            self._count_nonfinite(finite)
        self.last_step = StepReport(torch.ones((), dtype=torch.bool) if finite is None else finite, True)
        self.last_step_stats = {**stats, "step_s": time.perf_counter() - start, "applied": True}

    def _last_micro_batch(self, k: int) -> bool:
        """Count a micro-step; sync the next backward only if it is the last of a step."""
        self._micro_step += 1
        final = self._micro_step == k
        if final:
            self._micro_step = 0
        self._set_gradient_sync(self._micro_step == k - 1)
        if not final:
            self.last_step = StepReport(torch.ones((), dtype=torch.bool), False)
            self.last_step_stats = {"applied": False, "micro_step": self._micro_step}
        return final

    def _local_grads(self, group: dict[str, Any], k: int) -> tuple[torch.Tensor | None, ...]:
        return tuple(self._local_grad(group, p, k) for p in group["params"])

    def _local_grad(self, group: dict[str, Any], p: torch.Tensor, k: int) -> torch.Tensor | None:
        g = p.grad
        if g is not None and g.is_sparse:
            raise RuntimeError("muon_fn does not support sparse gradients "
                               f"(parameter {self._name(group, p)})")
        g = None if g is None else _params.local(g.detach())
        return g / k if g is not None and k > 1 else g

    def _finite(self, grads: list[tuple]) -> torch.Tensor | None:
        """Whether every rank's gradients are finite (agreed by all ranks, decided on the device)."""
        if self.nonfinite is None:
            return None
        local = [g for gs in grads for g in gs if g is not None]
        flag = _all_finite(local) if local else torch.ones((), dtype=torch.bool, device=self._device)
        finite = _exchange.all_ranks_finite(flag, self.topology.group, self.topology.world_size)
        if self.nonfinite == "error" and not bool(finite):
            self._count_nonfinite(finite)
            bad = self._nonfinite_params(list(enumerate(grads)))
            raise RuntimeError(
                f"non-finite gradient (inf or nan) in {', '.join(bad) or 'parameters of another rank'}; "
                "parameters and optimizer state were left unchanged. Pass nonfinite='skip' to skip "
                "such steps.")
        return finite

    def _apply(self, grads: list[tuple], finite: torch.Tensor | None,
               ready: _overlap.Ready | None = None) -> dict[str, Any]:
        matrices, topo = self._matrices(), self.topology
        if self._pending_init and ready is None:
            self._init_from_whole(grads)
        new_replicated: dict[int, list[torch.Tensor]] = {}
        compute = functools.partial(self._mid, matrices, new_replicated)
        cols = [m.fmt.returned_cols for m in matrices]
        if ready is None:
            held = self._pre(matrices, grads, finite)
            run = _exchange.exchange if self.strategy == "owner" else _exchange.exchange_replicated
            mine, ex = run(self.plan, topo.rank, held, compute, group=topo.group, wire_dtype=self.wire_dtype,
                           result_cols=cols)
        else:  # every gather posted (overlap): the pre phase's state is written now, under finite
            for state, new_state in ready.deferred:
                write_back(state, new_state, finite)
            mine, ex = ready.posted.finish(compute, result_cols=cols)
        self._post(matrices, grads, mine, self._share(matrices, new_replicated), finite)
        self._elementwise(grads, finite)
        computed = [j for j, mp in enumerate(self.plan.matrices) if self.strategy == "replicate" or
                    mp.owner == topo.rank or (mp.local and mp.cost_on(topo.rank))]
        flops = sum(matrices[j].flops if self.strategy == "replicate" or not self.plan.matrices[j].local else
                    matrices[j].flops * self.plan.matrices[j].cost_on(topo.rank) // max(self.plan.matrices[j].cost, 1)
                    for j in computed)
        stats = {"strategy": self.strategy, "rank": topo.rank, "world_size": topo.world_size,
                 "bytes_sent": ex.bytes_sent, "bytes_received": ex.bytes_received,
                 "ns_flops": flops, "matrices_computed": len(computed),
                 "comm_wait_s": ex.comm_wait_s, "compute_s": ex.compute_s}
        if self._overlap is not None:
            stats.update(overlapped_buckets=0 if ready is None else ready.in_backward,
                         overlap_backward_s=0.0 if ready is None else ready.backward_s)
        return stats

    def _mid_buckets(self) -> Iterator[tuple[int, Route, Bucket, list[torch.Tensor]]]:
        """(group index, route, bucket, group params) of every route with a mid phase."""
        for gi, group in enumerate(self.param_groups):
            for route in self._routes(gi):
                if route.phases.mid is not None:
                    for bucket in route.buckets:
                        yield gi, route, bucket, group["params"]

    def _pre(self, matrices: list[_Matrix], grads: list[tuple], finite: torch.Tensor | None,
             only: set[int] | None = None, deferred: list | None = None) -> list[torch.Tensor]:
        """The pre phase on local rows; returns every matrix's rows to send (:mod:`._rows`).
        ``only``: the ids of the buckets to run (default: all); ``deferred``: a list that gets
        each bucket's (state, new state) instead of the state being written (overlap)."""
        held: list[torch.Tensor | None] = [None] * len(matrices)
        for gi, route, bucket, params in self._mid_buckets():
            if only is not None and id(bucket) not in only:
                continue
            local = tuple(_params.local(params[i]) for i in bucket.indices)
            g = tuple(grads[gi][i] for i in bucket.indices)
            state, _, _ = route.phases.states(self._local_state(bucket, params))
            if all(x is None for x in g):
                updates = (None,) * len(g)
            elif deferred is None:
                updates = route.steps.pre(_phases.signature(local, g, state, finite), local, g, state, finite)
            else:
                updates, new_state = route.steps.pre_update(_phases.signature(local, g, state), local, g, state)
                deferred.append((state, new_state))
            for i, p, u in zip(bucket.indices, local, updates):
                js = self._index[(gi, i)]
                fmt = matrices[js[0]].fmt
                rows = [_params.local(self.state[params[i]][leaf.key]) for leaf in fmt.row_states]
                packed = _rows.pack(fmt, *self._as_rows(fmt, params[i], u, p), rows, self._wire_in)
                start = self._layouts[id(params[i])].rows[0]
                for j in js:  # a stack cut into pieces: each piece's row, if this rank holds it
                    e = matrices[j].piece
                    held[j] = packed if e is None else packed[e - start:e - start + 1] if (
                        0 <= e - start < packed.shape[0]) else packed[:0]
        return held  # type: ignore[return-value]

    def _as_rows(self, fmt: _rows.RowFormat, param: torch.Tensor, update: torch.Tensor | None,
                 local: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The update and the parameter as this rank's row block of ``param`` (the same tensors
        unless columns are sharded: then every rank takes part, zeros standing in for no update)."""
        layout = self._layouts[id(param)]
        if layout.row_placements is None:
            return update, local
        if update is None:
            update = torch.zeros(local.shape, dtype=fmt.update_dtype, device=local.device)
        carried = _params.to_rows(layout, param, local) if fmt.param_dtype is not None else local
        return _params.to_rows(layout, param, update), carried

    def _from_rows(self, fmt: _rows.RowFormat, param: torch.Tensor, local: torch.Tensor,
                   result: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """This rank's rows of a matrix's result as its update (laid out like ``local``) and
        its new row states (the inverse of :meth:`_as_rows`; every rank takes part)."""
        layout = self._layouts[id(param)]
        if layout.row_placements is None:
            return _rows.unpack_result(fmt, result, local.shape)
        start, stop = layout.rows
        update, rows = _rows.unpack_result(fmt, result, (stop - start,) + tuple(param.shape[1:]))
        return _params.from_rows(layout, param, update), rows

    def _mid(self, matrices: list[_Matrix], new_replicated: dict, idx: list[int],
             mats: list[torch.Tensor]) -> list[torch.Tensor]:
        """The owner's mid phase on whole matrices ``mats`` (plan indices ``idx``), one call per
        bucket, as single-device MuonOptimizer batches them; new replicated state goes to
        ``new_replicated``."""
        results: dict[int, torch.Tensor] = {}
        for members in group_by([id(matrices[j].bucket) for j in idx]):
            batch, inputs, pieces = self._whole_bucket(matrices, [idx[q] for q in members], [mats[q] for q in members])
            rows = {idx[q]: mats[q].shape[0] for q in members}
            route, bucket = matrices[batch[0]].route, matrices[batch[0]].bucket
            assert [matrices[j].position for j in batch] == list(bucket.indices)  # the plan's units
            sent = [_rows.unpack_sent(matrices[j].fmt, x) for j, x in zip(batch, inputs)]
            for j, (_, _, states) in zip(batch, sent):
                for leaf in matrices[j].fmt.replicated:
                    states[leaf.key] = _params.local(self.state[matrices[j].param][leaf.key])
            layout = bucket.phase_layouts[1]
            state = _state.gather(layout, [states for _, _, states in sent])
            updates = tuple(u for u, _, _ in sent)
            params = tuple(p for _, p, _ in sent) if route.phases.mid_needs_params else None
            args = (params, updates, state)
            out, new_state = route.steps.mid(_phases.signature(*args), *args)
            new = [{} for _ in batch]
            _state.scatter(layout, new_state, new)
            for j, u, n, own in zip(batch, out, new, pieces):
                result = _rows.pack_result(matrices[j].fmt, u, n, self._wire_in)
                for k, piece in zip(own, result.split([rows[k] for k in own])) if own is not None else [(j, result)]:
                    results[k] = piece
                    new_replicated[k] = [n[leaf.key] for leaf in matrices[j].fmt.replicated]
        return [results[j] for j in idx]

    def _whole_bucket(self, matrices: list[_Matrix], batch: list[int],
                      mats: list[torch.Tensor]) -> tuple[list[int], list[torch.Tensor], list]:
        """A bucket's matrices as its mid step takes them, one per parameter: a stack cut into
        pieces as the stack of the pieces given here (in row order; none: 0 rows). Returns a plan
        index per parameter, the inputs, and per parameter its pieces' plan indices (None if whole)."""
        if all(matrices[j].piece is None for j in batch):
            return batch, mats, [None] * len(batch)
        gi = matrices[batch[0]].group
        given = {j: x for j, x in zip(batch, mats)}
        by_position: dict[int, list[int]] = {}
        for j in sorted(batch, key=lambda j: matrices[j].piece):
            by_position.setdefault(matrices[j].position, []).append(j)
        out, inputs, pieces = [], [], []
        for position in matrices[batch[0]].bucket.indices:
            own = by_position.get(position, [])
            out.append(self._index[(gi, position)][0])
            like = mats[0]
            inputs.append(torch.cat([given[j] for j in own]) if own else like.new_zeros((0, like.shape[1])))
            pieces.append(own)
        return out, inputs, pieces

    def _share(self, matrices: list[_Matrix],
               new: dict[int, list[torch.Tensor]]) -> dict[int, list[torch.Tensor]]:
        """Every rank's copy of the replicated mid state each owner computed (one all-reduce); a
        local matrix's (counters) each rank computed itself."""
        topo = self.topology
        with_state = [j for j, m in enumerate(matrices) if m.fmt.replicated and not self.plan.matrices[j].local]
        if not with_state or self.strategy == "replicate" or topo.world_size == 1:
            return new
        like = [_params.local(self.state[matrices[j].param][leaf.key]) for j in with_state
                for leaf in matrices[j].fmt.replicated]
        values = [v for j in with_state for v in new.get(j, [None] * len(matrices[j].fmt.replicated))]
        flat = iter(_exchange.share_from_owners(values, like, topo.group))
        shared = {j: [next(flat) for _ in matrices[j].fmt.replicated] for j in with_state}
        return {**{j: v for j, v in new.items() if self.plan.matrices[j].local}, **shared}

    def _post(self, matrices: list[_Matrix], grads: list[tuple], mine: list[torch.Tensor],
              shared: dict[int, list[torch.Tensor]], finite: torch.Tensor | None) -> None:
        """The mid state written back and the post phase applied, on local rows."""
        for gi, route, bucket, params in self._mid_buckets():
            local = tuple(_params.local(params[i]) for i in bucket.indices)
            _, _, state = route.phases.states(self._local_state(bucket, params))
            updates, old_mid, new_mid = [], [], []
            for i, p in zip(bucket.indices, local):
                js = self._index[(gi, i)]
                j, fmt = js[0], matrices[js[0]].fmt
                result = mine[j] if len(js) == 1 else torch.cat([mine[k] for k in js])  # pieces in row order
                u, rows = self._from_rows(fmt, params[i], p, result)
                if grads[gi][i] is None:  # this rank leaves the parameter and its state alone
                    u = old = new = None
                else:
                    old = tuple(_params.local(self.state[params[i]][leaf.key])
                                for leaf in fmt.row_states + fmt.replicated)
                    new = tuple(rows) + tuple(shared.get(j, ()))
                updates.append(u)
                old_mid.append(old)
                new_mid.append(new)
            if any(u is not None for u in updates):
                args = (local, tuple(updates), state, tuple(old_mid), tuple(new_mid), finite)
                route.steps.post(_phases.signature(*args), *args)

    def _elementwise(self, grads: list[tuple], finite: torch.Tensor | None) -> None:
        """Transforms without a mid phase (AdamW), whole on local rows."""
        for gi, group in enumerate(self.param_groups):
            for route in self._routes(gi):
                if route.phases.mid is not None:
                    continue
                for bucket in route.buckets:
                    g = tuple(grads[gi][i] for i in bucket.indices)
                    if all(x is None for x in g):
                        continue
                    local = tuple(_params.local(group["params"][i]) for i in bucket.indices)
                    args = (local, g, self._local_state(bucket, group["params"]), finite)
                    route.steps.whole(_phases.signature(*args), *args)

    # ------------------------------------------------------------------ QK-Clip
    def _qk_rows(self, p: torch.Tensor) -> tuple[torch.Tensor, int]:
        """This rank's rows of ``p`` and the global index of the first (the shard's offset), so
        QK-Clip finds the head of every local row, also of a head split across ranks."""
        return _params.local(p), self._layouts[id(p)].offset

    def _qk_reduce(self, logits: list[torch.Tensor]) -> None:
        """Each layer's max logits, the max over every rank (each saw its own batch)."""
        _exchange.all_ranks_max(logits)

    # ------------------------------------------------------------------ overlap
    @property
    def overlap(self) -> bool:
        """Whether each bucket's exchange starts during backward (see ``overlap=`` of the
        optimizer). Setting it is collective (turning it on makes a process group): set it on
        every rank. Turning it off removes the hooks."""
        return self._overlap_wanted

    @overlap.setter
    def overlap(self, on: bool) -> None:
        _checks.one_of("overlap", on, (True, False))
        if on and self.strategy != "owner":
            raise ValueError(f"overlap=True needs strategy='owner', got strategy={self.strategy!r}")
        if on and self._overlap is None and self.topology.world_size > 1:
            self._overlap = _overlap.Overlap(self)
        elif not on and self._overlap is not None:
            self._overlap.remove()
            self._overlap = None
        self._overlap_wanted = bool(on)

    def _overlap_armed(self) -> bool:
        """Whether a gradient made final now belongs to the next step's exchange: the backward is
        the last of an accumulation. (A bucket whose mid state is still to be made from the whole
        matrices, :meth:`_init_from_whole`, is posted by the step.)"""
        k = self._accumulation_steps
        return k == 1 or self._micro_step == k - 1

    def _overlap_complete(self, grads: list[tuple]) -> _overlap.Ready | None:
        """The step's round with every gather posted, or None (no overlap this step)."""
        if self._overlap is None:
            return None
        self._matrices()
        if self._pending_init:
            self._init_from_whole(grads)  # before the buckets that read it are posted
        return self._overlap.complete(grads)

    def _drop_overlap(self) -> None:
        if getattr(self, "_overlap", None) is not None:
            self._overlap.drop()

    def _warn_overlap_stale(self) -> None:
        if not getattr(self, "_overlap_warned", False):
            self._overlap_warned = True
            warnings.warn(
                f"{type(self).__name__}(overlap=True): a gradient read during backward was replaced "
                "or changed before step() on some rank (or a parameter without gradient in the last "
                "backward got one), so the exchange started during backward was dropped and this "
                "step ran without overlap. Gradients must not change between backward and step() "
                "with overlap=True (use overlap=False to clip or edit them).",
                stacklevel=4)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's ``zero_grad``; first drains an exchange started by a backward without a step."""
        self._drop_overlap()
        super().zero_grad(set_to_none)

    # ------------------------------------------------------------------ FSDP2 helpers
    def _set_gradient_sync(self, enabled: bool) -> None:
        for m in self._fsdp_modules:
            m.set_requires_gradient_sync(enabled, recurse=False)

    @contextlib.contextmanager
    def unshard_params(self) -> Iterator[nn.Module]:
        """Inside, every FSDP2 module holds its full (unsharded) parameters; resharded on exit."""
        if not self._fsdp_modules:
            raise ValueError(
                f"unshard_params() needs a model wrapped with fully_shard (FSDP2), but "
                f"{type(self._model).__name__} contains no FSDPModule"
            )
        for m in self._fsdp_modules:
            m.unshard()
        try:
            yield self._model
        finally:
            for m in self._fsdp_modules:
                m.reshard()

    def describe(self) -> str:
        """Which transform each parameter gets, and who computes each matrix (``local``: each
        rank its own rows, nothing exchanged; ``per expert``: a stack cut into one-expert pieces,
        each computed by its owner or ``here``, where it lies)."""
        more = ", overlap=True" if self._overlap_wanted else ""
        lines = [f"{type(self).__name__}(strategy={self.strategy!r}, world_size={self.topology.world_size}{more})"]
        self._matrices()
        for gi, group in enumerate(self.param_groups):
            for route in self._routes(gi):
                for i in route.indices:
                    p, js = group["params"][i], self._index.get((gi, i), [])
                    mp = self.plan.matrices[js[0]] if js else None
                    who = "local" if mp is not None and mp.local else f"owner={mp.owner}" if mp else ""
                    if len(js) > 1:
                        who = "per expert, owners=[" + ", ".join(
                            "here" if self.plan.matrices[j].local else str(self.plan.matrices[j].owner) for j in js) + "]"
                    where = "" if mp is None else f" {who} bucket={mp.bucket}"
                    view = route.options.get("matrix_view", "flatten")
                    if mp is not None and (p.ndim >= 3 or isinstance(view, _views.Heads)):
                        where += f" view={view}"
                    lines.append(f"  {route.label:<5} {self._fqn(p)} {tuple(p.shape)}{where}")
        return "\n".join(lines)


def _fsdp_modules(model: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]
