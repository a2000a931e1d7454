"""The distributed executor: an optimizer's recipe run on sharded parameters, each matrix
computed whole by one owner.

:class:`DistributedExecutor` is what an optimizer of :mod:`muon_fn.optim` runs its step through
once it holds DTensors (:mod:`._adopt`; the FSDP classes from construction): the groups, their
checks and their transforms stay the optimizer's (the same factory on the same hyperparameters);
the executor changes where each part of a transform runs. Each group's routes (:mod:`._routes`)
split their transforms into phases (:mod:`._phases`); per step:

1. **pre** on every rank's local rows (Muon: momentum), in place;
2. the rows of every matrix travel to its owner (:mod:`._rows`, :mod:`._plan`, :mod:`._exchange`),
   which runs the **mid** phase on the whole matrices (Muon: orthogonalize … scale_by_shape), one
   call per bucket of the single-device optimizer, and returns each rank's rows of the result;
   an expert stack sharded on its expert dim does not travel: each rank runs the mid phase on
   the whole experts it holds (:meth:`DistributedExecutor._is_local`);
3. **post** on local rows (Muon: weight decay and learning rate), then ``p += u`` in place.

Transforms without a matrix part (AdamW) run whole on local rows with no communication. This
module builds what the step reads (routes, the plan, the state layout, the exchange topology);
the step itself is :class:`._step.AdapterStep`. Of its optimizer the executor uses what
:class:`muon_fn.engine.Executor` lists.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn

from ..core import execution as _execution, quantize as _quantize, tree as _tree, views as _views
from ..core.muon import group_by
from .. import engine
from ..engine import BUCKET_SIZE
from . import _exchange, _overlap, _params, _plan, _rows
from ._routes import Bucket, Route, group_routes
from ._step import AdapterStep, Matrix

STRATEGIES = engine.STRATEGIES
"""What ``strategy=`` accepts: ``"owner"`` (each matrix computed once, on its owner rank) or
``"replicate"`` (every rank all-gathers and computes every matrix; the baseline)."""


class DistributedExecutor(AdapterStep, engine.Executor):
    """The step of an optimizer of :mod:`muon_fn.optim` on FSDP2-sharded (or DDP-replicated)
    parameters; see the module docstring. The optimizer holds it as its executor
    (:class:`muon_fn.engine.Executor`) from the first DTensor on (:func:`~._adopt.adopt`),
    or from construction for the FSDP classes; its class never changes.

    After each step the optimizer's ``last_step_stats`` holds this rank's figures:
    ``bytes_sent``, ``bytes_received``, ``ns_flops`` (the optimizer's ``_matrix_flops``),
    ``matrices_computed``, ``comm_wait_s``, ``compute_s``, ``step_s``, ``applied``.
    """

    distributed = True

    def __init__(self, opt: Any) -> None:
        super().__init__(opt)
        self._overlap_wanted, self._overlap = False, None
        self._distributed = False
        self._builds = itertools.count()

    def distribute(self, k: int, overlap: bool | None = None) -> None:
        """Where every parameter lives, its state, and the plan (once all groups are in), run as
        the optimizer's :attr:`distributed_options` say (checked where they were given);
        ``k``: the gradient accumulation steps; ``overlap``: whether to overlap instead (a copy:
        no; a swap: as it was)."""
        opt, options = self.opt, self.opt.distributed_options
        self.strategy, self.wire_dtype, self._num_buckets = options.strategy, options.wire_dtype, options.num_buckets
        self.inflight_bytes = options.inflight_bytes
        self._overlap_wanted = options.overlap if overlap is None else overlap
        self._process_group, self._fqns = options.process_group, None
        named = [(self._fqn(p), p) for g in opt.param_groups for p in g["params"]]
        self.topology = _params.resolve_topology(named, options.process_group)
        self._layouts = _params.layouts(named, self.topology)
        self._fsdp_modules = [] if opt._model is None else _fsdp_modules(opt._model)
        if k > 1 and not self._fsdp_modules:
            raise ValueError(
                f"gradient_accumulation_steps={k} needs a model wrapped with torch.distributed.fsdp.fully_shard "
                f"(FSDP2), whose gradient sync it pauses, but {_model_name(opt._model)}; pass model= (the "
                "fully_shard-ed model), or let the trainer accumulate with gradient_accumulation_steps=1")
        self._accumulation_steps, self._micro_step = k, 0
        self._device = _params.local(named[0][1]).device if named else torch.device("cpu")
        self._plan_key: Any = None
        self._pending_init: list[tuple[int, Route, Bucket]] = []
        opt.last_step_stats = {}
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
    def getstate(self) -> dict[str, Any]:
        """What a copy of the optimizer needs to continue where this one is (:meth:`resume`)."""
        return {"micro_step": self._micro_step}

    def resume(self, state: dict[str, Any]) -> None:
        """Continue, as a copy, at the original's place in its accumulation window (:meth:`getstate`)."""
        k, self._micro_step = self._accumulation_steps, state["micro_step"]
        self._set_gradient_sync(k == 1 or self._micro_step == k - 1)

    # ------------------------------------------------------------------ the optimizer's hooks
    def check_new_group(self) -> None:
        """``add_param_group`` before the plan is made (refused after)."""
        if self._distributed:
            raise RuntimeError(f"{type(self.opt).__name__} cannot add parameter groups after construction "
                               "(the communication plan is fixed); pass every group to __init__")

    def initial_state(self, index: int) -> None:
        """Nothing here: the plan creates every group's state (:meth:`distribute`)."""

    def built(self, rt: Any) -> None:
        """A group's transforms were built: its routes are built on first use, after the dry run."""
        rt.routes, rt.build = None, next(self._builds)

    def before_load(self) -> None:
        self._drop_overlap()

    def after_load(self) -> None:
        self._pending_init = []  # the loaded state is the state

    def before_zero_grad(self) -> None:
        """First drain an exchange started by a backward without a step."""
        self._drop_overlap()

    # ------------------------------------------------------------------ groups and state
    def _fqn(self, p: torch.Tensor) -> str:
        """``p``'s name in messages and in the plan every rank compares: its name (the group's
        ``param_names`` or the model's), else its position."""
        names = self.__dict__.get("_fqns")
        if names is None or id(p) not in names:
            names = self._fqns = {id(q): f"#{i} of group {gi}" if n is None else n
                                  for gi, g in enumerate(self.opt.param_groups)
                                  for i, (q, n) in enumerate(zip(g["params"], self.opt._param_names(g)))}
        return names.get(id(p), f"<parameter of shape {tuple(p.shape)} not in the optimizer>")

    def _matrix_algorithm(self) -> str:
        """The algorithm of a hybrid's matrices (``algorithms[1]``: "muon", "sso")."""
        return getattr(self.opt, "algorithms", ("auto", "matrix"))[1]

    def _param_flops(self, group: dict[str, Any], shape: tuple[int, ...], view: str | _views.Heads) -> int:
        """FLOPs of a parameter's mid phase: its matrices' (or head blocks') under ``view``."""
        return sum(self.opt._matrix_flops(group, s) for s in _views.unit_shapes(shape, view))

    def _owner_bucket_size(self) -> Callable[..., int]:
        """Same-shape matrices one owner computes together, a function of the matrices of one
        shape: the single-device optimizer's buckets on the CPU (at most :data:`BUCKET_SIZE` and
        the execution policy's byte bound), at most :data:`BUCKET_SIZE` on every other device
        unless given (the planner balances owners in such buckets; an unbounded GPU bucket would
        give every same-shape matrix to one owner)."""
        if self.opt._bucket_size is not None:
            return lambda same, among: self.opt._bucket_size
        return lambda same, among: min(BUCKET_SIZE, _execution.bucket_limit(same, None, among))

    def _routes(self, index: int) -> list[Route]:
        rt = self.opt._runtimes[index]
        if rt.routes is None:
            opt = self.opt
            group = opt.param_groups[index]
            rt.routes = group_routes(group, opt._group_hyper(group, rt), opt._param_options(group), opt._factory,
                                     self._matrix_algorithm(), self.meta, self._owner_bucket_size(),
                                     opt._compile_options, opt.verify)
        return rt.routes

    def _init_state(self, index: int) -> None:
        """Every state entry now, so state_dict keys are the same on every rank (DCP): rows of a
        sharded parameter's state are DTensors laid out like the parameter, the rest plain.

        The state of a mid phase that reads parameters (SSO's warm-start block) is made from the
        whole matrices, as single-device optimizers make it, on the first step
        (:meth:`_init_from_whole`); until then it holds zeros of its shape."""
        params = self.opt.param_groups[index]["params"]
        for route in self._routes(index):
            for bucket in route.buckets:
                ps = [params[i] for i in bucket.indices]
                self._check_blocks(ps, bucket, self.opt.param_groups[index].get("state_bits"))
                states = [self.opt.state[p] for p in ps]
                fresh, whole = self._fresh_leaves(route, bucket, ps)
                if whole and not engine.state_complete(bucket.phase_layouts[1], states):
                    self._pending_init.append((index, route, bucket))
                leaves = [None if leaf is None else self._state_leaf(ps[slot.index or 0], slot, leaf, rows)
                          for slot, rows, leaf in zip(bucket.layout.slots, bucket.rows, fresh)]
                engine.scatter_state(bucket.layout, _tree.tree_unflatten(bucket.layout.spec, leaves), states,
                               overwrite=False)
                for p, st in zip(ps, states):
                    if not st:  # a parameter without state gets no entry (as torch's optimizers)
                        self.opt.state.pop(p, None)

    def _check_blocks(self, ps: list[torch.Tensor], bucket: Bucket, bits: Any) -> None:
        """Quantized state (``state_bits`` 16, 8, 4) keeps its blocks within rows: a parameter
        whose columns are sharded (a row-wise TP weight) cannot hold it."""
        for slot in bucket.layout.slots:
            if slot is not None and slot.key.endswith(_quantize.CODES) and slot.index is not None:
                p = ps[slot.index]
                if self._layouts[id(p)].row_placements is not None:
                    raise ValueError(
                        f"parameter {self._fqn(p)!r} has placements {tuple(p.placements)}, which shard its "
                        f"columns, but its state {slot.key[:-len(_quantize.CODES)]!r} is quantized in blocks "
                        f"within rows (state_bits={bits}); use state_bits=32 "
                        "(or 16 for the momentum alone) for column-sharded (row-wise tensor parallel) weights, "
                        "or shard them by rows")

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
            ps = [self.opt.param_groups[index]["params"][i] for i in bucket.indices]
            whole = tuple(p.full_tensor() if isinstance(p, _params.DTensor) else p for p in ps)
            pre, mid, _ = bucket.phase_layouts
            made = _tree.tree_leaves(route.phases.mid.init(tuple(w.detach() for w in whole)))
            for n, (slot, value) in enumerate(zip(mid.slots, made)):
                if slot is None:
                    continue
                for k in ([slot.index] if slot.index is not None else range(len(ps))):
                    a, b = self._layouts[id(ps[k])].rows if bucket.rows[len(pre.slots) + n] else (None, None)
                    _params.local(self.opt.state[ps[k]][slot.key]).copy_(value if a is None else value[a:b])

    def _state_leaf(self, p: torch.Tensor, slot: engine.Slot, local: torch.Tensor,
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
        stored = engine.gather_state(bucket.layout, [self.opt.state.get(params[i], {}) for i in bucket.indices])
        return _tree.tree_map(lambda t: None if t is None else _params.local(t), stored)

    # ------------------------------------------------------------------ the plan
    def _matrices(self) -> list[Matrix]:
        """Every matrix with a mid phase, in group order; the plan is rebuilt when they change."""
        key = tuple(self.opt._runtime(i).build for i in range(len(self.opt.param_groups)))
        if key == self._plan_key:
            return self._matrix_list
        matrices = []
        for gi, group in enumerate(self.opt.param_groups):
            buckets = {i: (r, b) for r in self._routes(gi) for b in r.buckets for i in b.indices}
            for i, p in enumerate(group["params"]):
                route, bucket = buckets[i]
                if route.phases.mid is not None:
                    self._check_columns(p, route, route.formats[i])
                    view = route.options.get("matrix_view", "flatten")
                    matrices.append(Matrix(gi, route, bucket, i, p, route.formats[i],
                                            self._param_flops(group, tuple(p.shape), view), view))
        for index in range(len(self.opt.param_groups)):  # the state a rebuilt transform adds
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

    def _is_local(self, m: Matrix) -> bool:
        """Whether every rank can compute its own rows of ``m`` (per-expert planning), under
        ``strategy="owner"``: a sharded expert stack (each row of dim 0 is whole matrices of its
        view, so a rank holds whole experts) whose mid phase is per matrix (an expert's bits do
        not depend on the others: Muon; not NorMuon or SSO, see ``muon_fn.TransformInfo``) and
        keeps no state shared by all its rows other than counters (0-d integers, the same on
        every rank)."""
        return (self.strategy == "owner" and self._layouts[id(m.param)].sharded and m.param.ndim >= 3
                and _views.base(m.view) == "experts" and m.route.phases.mid_per_matrix
                and all(leaf.shape == () and not leaf.dtype.is_floating_point for leaf in m.fmt.replicated))

    def _set_plan(self, matrices: list[Matrix]) -> list[Matrix]:
        """The plan of ``matrices``; returns the plan's matrices: those of a stack with fewer rows
        (experts) than ranks, planned per expert, become one-row pieces with owners of their own
        (:func:`~muon_fn.distributed._plan.cut_expert_stacks`), the rest stay whole."""
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
        wire_in = _rows.common_dtype([m.fmt for m in planned])
        limit = None if self.inflight_bytes is None else max(self.inflight_bytes // 2, 1)
        plan = _plan.make_plan(
            shapes, topo.world_size, replicated=[not self._layouts[id(m.param)].sharded for m in planned],
            held=held, num_buckets=self._num_buckets, extra_cols=[m.fmt.sent_cols - m.fmt.cols for m in planned],
            units=plan_units, views=[m.view for m in planned], local=local, split=split,
            bucket_bytes=limit, item_bytes=wire_in.itemsize)
        _exchange.check_same(self._plan_description(plan), "the optimizer's plan", topo.group, topo.world_size)
        self.plan, self._wire_in = plan, wire_in
        return planned

    def _held_rows(self, m: Matrix) -> tuple[tuple[int, int], ...]:
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
                               f"num_buckets={self._num_buckets}, inflight_bytes={self.inflight_bytes}, "
                               "gradient_accumulation_steps="
                               f"{self._accumulation_steps}, nonfinite={self.opt.nonfinite!r}, "
                               f"overlap={self._overlap_wanted}, {topo.world_size} ranks, {where}")]
        for gi, group in enumerate(self.opt.param_groups):
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

    # ------------------------------------------------------------------ QK-Clip
    def qk_rows(self, p: torch.Tensor) -> tuple[torch.Tensor, int]:
        """This rank's rows of ``p`` and the global index of the first (the shard's offset), so
        QK-Clip finds the head of every local row, also of a head split across ranks."""
        return _params.local(p), self._layouts[id(p)].offset

    def qk_reduce(self, logits: list[torch.Tensor]) -> None:
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
        self.opt.distributed_options._replace(overlap=on).checked()  # the constructor's checks and messages
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
                f"{type(self.opt).__name__}(overlap=True): a gradient read during backward was replaced "
                "or changed before step() on some rank (or a parameter without gradient in the last "
                "backward got one), so the exchange started during backward was dropped and this "
                "step ran without overlap. Gradients must not change between backward and step() "
                "with overlap=True (use overlap=False to clip or edit them).",
                stacklevel=4)

    # ------------------------------------------------------------------ FSDP2 helpers
    def _set_gradient_sync(self, enabled: bool) -> None:
        for m in self._fsdp_modules:
            m.set_requires_gradient_sync(enabled, recurse=False)

    def unshard_params(self) -> contextlib.AbstractContextManager[nn.Module]:
        """Inside, every FSDP2 module holds its full (unsharded) parameters; resharded on exit."""
        if not self._fsdp_modules:
            raise ValueError(
                f"unshard_params() needs a model wrapped with fully_shard (FSDP2), but {_model_name(self.opt._model)}"
            )
        return _unsharded(self.opt._model, self._fsdp_modules)  # holds the model, not the optimizer

    def describe(self) -> str:
        """Which transform each parameter gets, and who computes each matrix (``local``: each
        rank its own rows, nothing exchanged; ``per expert``: a stack cut into one-expert pieces,
        each computed by its owner or ``here``, where it lies)."""
        more = ", overlap=True" if self._overlap_wanted else ""
        lines = [f"{type(self.opt).__name__}(strategy={self.strategy!r}, world_size={self.topology.world_size}{more})"]
        self._matrices()
        for gi, group in enumerate(self.opt.param_groups):
            for route in self._routes(gi):
                for i in route.indices:
                    p, js = group["params"][i], self._index.get((gi, i), [])
                    mp = self.plan.matrices[js[0]] if js else None
                    who = "local" if mp is not None and mp.local else f"owner={mp.owner}" if mp else ""
                    if len(js) > 1:
                        who = "per expert, owners=[" + ", ".join(
                            "here" if self.plan.matrices[j].local else str(self.plan.matrices[j].owner)
                            for j in js) + "]"
                    where = "" if mp is None else f" {who} bucket={mp.bucket}"
                    view = route.options.get("matrix_view", "flatten")
                    if mp is not None and (p.ndim >= 3 or isinstance(view, _views.Heads)):
                        where += f" view={view}"
                    lines.append(f"  {route.label:<5} {self._fqn(p)} {tuple(p.shape)}{where}")
        return "\n".join(lines)


@contextlib.contextmanager
def _unsharded(model: nn.Module, modules: list[nn.Module]) -> Iterator[nn.Module]:
    for m in modules:
        m.unshard()
    try:
        yield model
    finally:
        for m in modules:
            m.reshard()


def check_model(model: Any) -> None:
    """The FSDP classes' ``model`` must be a module (their parameters' default and their sync)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")


def _model_name(model: nn.Module | None) -> str:
    return ("the optimizer was given no model" if model is None
            else f"{type(model).__name__} contains no FSDPModule")


def _fsdp_modules(model: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]
