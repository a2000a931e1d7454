"""``FSDPMuonOptimizer``: Muon on FSDP2 (``fully_shard``) models, each matrix computed by one owner.

Per step and parameter group, with the functional core's public transforms:

- pre (local shards): ``momentum`` on each rank's rows;
- mid (full matrices, on the owner): ``orthogonalize`` (+ ``normalize_rows`` for NorMuon) and
  ``scale_by_shape`` of the global shape; shards travel to the owner and back through
  :mod:`._exchange` following the cached :mod:`._plan`;
- post (local shards): ``add_decoupled_weight_decay`` and ``scale_by_learning_rate``, then
  ``p += u``.

0-/1-D parameters (and groups with ``use_muon=False``) get AdamW on local shards, with no
communication. Every scalar hyperparameter reaches the transforms as a 0-d float32 tensor, as in
:class:`muon_fn.MuonOptimizer`, so an fp32 run is bit-identical to it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.nn as nn

from .. import _checks
from .._alias import DEFAULT_METHOD
from .._base import EmptyState
from .._combine import chain
from .._compile import compile_update
from .._muon import SHAPE_RULES, _stack_pays, orthogonalize, scale_by_shape
from .._orthogonalize import (METHODS, coefficient_schedule, default_compute_dtype, default_steps, newton_schulz,
                              validate_coefficients)
from .._transforms import (
    MomentumState,
    NormalizeRowsState,
    ScaleByAdamState,
    add_decoupled_weight_decay,
    momentum as momentum_tx,
    normalize_rows,
    scale_by_adam,
    scale_by_learning_rate,
)
from . import _exchange, _params, _plan

STRATEGIES = ("owner", "replicate")
WIRE_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)
# Group keys that are per-step scalars (0-d float32 tensors refreshed before every step).
_SCALARS = ("lr", "weight_decay", "momentum", "adamw_weight_decay")


class FSDPMuonOptimizer(torch.optim.Optimizer):
    """Muon for FSDP2-sharded (or DDP-replicated) models; AdamW for everything else.

    Results equal single-device :class:`muon_fn.MuonOptimizer` with the same settings (bit-exact
    in fp32 for ``strategy="owner"`` against ``MuonOptimizer(foreach=False)``, whose functional
    arithmetic this adapter follows; its default in-place path agrees to rounding): each matrix is
    orthogonalized whole by one rank. Defaults
    match ``MuonOptimizer``'s except ``weight_decay``.

    Args:
      model: the module whose parameters are optimized (wrapped with ``fully_shard``, any
        nesting, 1-D mesh or HSDP; a plain module's parameters are treated as replicated).
      params: parameters or param-group dicts (default: the model's parameters that require
        grad); a group may set
        ``use_muon`` (True: Muon, ndim >= 2 required; False: AdamW; default: by ndim).
      lr, weight_decay, momentum, nesterov: Muon's ``p ← p(1 − lr·wd) − lr·s·msign(M)``.
      ns_steps, ns_stepsize: iterations (``None``: what ``method`` is designed for, 4 for the
        default ``"aol9"``) and damping η of the orthogonalization ``method``.
      beta2, eps: ``None`` for Muon; a float enables NorMuon row normalization.
      gradient_accumulation_steps: ``k``; call ``step()`` after every micro-batch: FSDP2 gradient
        sync is off for the first ``k − 1`` backward passes and on for the last, whose reduced
        gradient (divided by ``k``) is applied. Requires a ``fully_shard`` model when ``k > 1``.
      strategy: ``"owner"`` (each matrix computed once, on its owner) or ``"replicate"`` (every
        rank all-gathers and computes every matrix; the baseline).
      method, adjust_lr_fn, ns_dtype, ns_eps, ns_coefficients, momentum_kind: as in
        :class:`muon_fn.MuonOptimizer`.
      adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: the AdamW half; its learning rate
        follows ``lr`` (``adamw_lr · lr / base_lr``) so schedulers scale both.
      wire_dtype: dtype of the shards on the wire (``torch.bfloat16`` halves the bytes).
      num_buckets: exchanges per step (communication of later buckets overlaps computation).
      process_group: the group to use for plain (replicated) parameters; must match the
        DTensor parameters' shard group if given.
      compile: ``True`` (or a dict of ``torch.compile`` options, e.g. ``{"backend": "eager"}``)
        compiles the owner's matrix update (``orthogonalize`` … ``scale_by_shape``) with
        :func:`muon_fn.compile_update`, one graph per set of shapes it computes together.
      nonfinite: if any rank has an inf/nan gradient, ``"error"`` raises on every rank and
        ``"skip"`` skips the step (counted in ``nonfinite_steps``), both leaving parameters and
        state unchanged; ``None`` does not check (saves one tiny all-reduce per step).

    A parameter whose ``.grad`` is ``None`` on a rank still joins every exchange (with zeros), so
    nothing hangs; that rank leaves the parameter and its state unchanged.

    After each step ``last_step_stats`` holds this rank's figures: ``bytes_sent``,
    ``bytes_received``, ``ns_flops``, ``matrices_computed``, ``comm_wait_s``, ``compute_s``,
    ``step_s``, ``applied``.
    """

    def __init__(
        self,
        model: nn.Module,
        params: Iterable[Any] | None = None,
        lr: float = 0.02,
        weight_decay: float = 0.01,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int | None = None,
        ns_stepsize: float = 1.0,
        beta2: float | None = None,
        eps: float = 1e-8,
        gradient_accumulation_steps: int = 1,
        *,
        strategy: str = "owner",
        method: str = DEFAULT_METHOD,
        adjust_lr_fn: str = "keller",
        ns_dtype: torch.dtype | None = None,
        ns_eps: float = 1e-7,
        ns_coefficients: Any = None,
        momentum_kind: str = "ema",
        adamw_lr: float = 3e-4,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.0,
        wire_dtype: torch.dtype | None = None,
        num_buckets: int = 4,
        process_group: Any = None,
        nonfinite: str | None = "error",
        compile: bool | Mapping[str, Any] = False,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        _checks.non_negative("lr", lr)
        _checks.non_negative("weight_decay", weight_decay)
        _checks.in_unit_interval("momentum", momentum)
        if ns_steps is None:
            ns_steps = default_steps(method)
        _checks.positive_int("ns_steps", ns_steps)
        _checks.positive("ns_stepsize", ns_stepsize)
        if beta2 is not None:
            _checks.in_unit_interval("beta2", beta2)
        _checks.positive("eps", eps)
        _checks.positive("ns_eps", ns_eps)
        _checks.positive_int("gradient_accumulation_steps", gradient_accumulation_steps)
        _checks.one_of("strategy", strategy, STRATEGIES)
        if not callable(method):
            _checks.one_of("method", method, METHODS)
        _checks.one_of("adjust_lr_fn", adjust_lr_fn, SHAPE_RULES)
        _checks.one_of("momentum_kind", momentum_kind, ("ema", "sgd"))
        _checks.non_negative("adamw_lr", adamw_lr)
        _checks.in_unit_interval("adamw_betas[0]", adamw_betas[0])
        _checks.in_unit_interval("adamw_betas[1]", adamw_betas[1])
        _checks.positive("adamw_eps", adamw_eps)
        _checks.non_negative("adamw_weight_decay", adamw_weight_decay)
        _checks.one_of("wire_dtype", wire_dtype, WIRE_DTYPES)
        _checks.positive_int("num_buckets", num_buckets)
        _checks.one_of("nonfinite", nonfinite, ("error", "skip", None))
        if not isinstance(compile, (bool, Mapping)):
            raise TypeError(f"compile must be a bool or a dict of torch.compile options, got {compile!r}")
        self._compile = compile
        self._mid_cache: dict[Any, Any] = {}
        self.nonfinite = nonfinite
        self.nonfinite_steps = 0
        self._model = model
        self._names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        self.strategy = strategy
        self.wire_dtype = wire_dtype
        self.accumulation_steps = gradient_accumulation_steps
        self._micro_step = 0
        self._config = dict(
            nesterov=nesterov, ns_steps=ns_steps, ns_stepsize=ns_stepsize, beta2=beta2, eps=eps,
            method=method, adjust_lr_fn=adjust_lr_fn, ns_dtype=ns_dtype, ns_eps=ns_eps,
            ns_coefficients=ns_coefficients, momentum_kind=momentum_kind,
            adamw_betas=tuple(adamw_betas), adamw_eps=adamw_eps,
        )
        if ns_coefficients is not None:
            validate_coefficients(ns_coefficients, name="ns_coefficients")
        # What ``last_step_stats()["ns_flops"]`` counts per matrix (static: resolved once).
        self._flops_schedule = ns_steps if callable(method) else coefficient_schedule(
            method, ns_steps, coefficients=ns_coefficients, stepsize=ns_stepsize)
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, adamw_lr=adamw_lr,
                        adamw_weight_decay=adamw_weight_decay, use_muon=None)
        if params is None:  # frozen parameters never get gradients: leave them out of the plan
            params = [p for p in model.parameters() if p.requires_grad]
        super().__init__(params, defaults)

        named = [(self._name(p), p) for g in self.param_groups for p in g["params"]]
        self.topology = _params.resolve_topology(named, process_group)
        self._layouts = {id(p): _params.layout_of(n, p, self.topology) for n, p in named}
        self._fsdp_modules = _fsdp_modules(model)
        if gradient_accumulation_steps > 1 and not self._fsdp_modules:
            raise ValueError(
                f"gradient_accumulation_steps={gradient_accumulation_steps} needs a model wrapped "
                f"with torch.distributed.fsdp.fully_shard (FSDP2), but {type(model).__name__} "
                "contains no FSDPModule"
            )
        # The matrices, in group order, and the plan every rank derives identically from them.
        self._muon = [p for g in self.param_groups if g["use_muon"] for p in g["params"]]
        self._muon_group = {id(p): i for i, g in enumerate(self.param_groups) if g["use_muon"]
                            for p in g["params"]}
        self.plan = _plan.make_plan(
            [tuple(p.shape) for p in self._muon], self.topology.world_size,
            replicated=[not self._layouts[id(p)].sharded for p in self._muon],
            num_buckets=num_buckets, extra_cols=0 if beta2 is None else 1,
        )
        self._batched_singletons = _orthogonalize_batches_singletons()
        self._scalars: list[dict[str, torch.Tensor]] = [{} for _ in self.param_groups]
        self._init_state()
        self._set_gradient_sync(gradient_accumulation_steps == 1)
        self.last_step_stats: dict[str, Any] = {}

    # ------------------------------------------------------------------ groups and state
    def _name(self, p: torch.Tensor) -> str:
        return self._names.get(id(p), f"<parameter of shape {tuple(p.shape)} not in model>")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if hasattr(self, "plan"):
            raise RuntimeError("FSDPMuonOptimizer cannot add parameter groups after construction "
                               "(the communication plan is fixed); pass every group to __init__")
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for key in ("lr", "weight_decay", "adamw_lr", "adamw_weight_decay"):
            _checks.non_negative(key, group[key])
        _checks.in_unit_interval("momentum", group["momentum"])
        lr = group["lr"]
        group.setdefault("base_lr", float(lr))
        for p in group["params"]:
            if torch.is_complex(p):
                raise ValueError(f"muon_fn does not support complex parameters, got {self._name(p)!r}")
        use = group["use_muon"]
        if use is None:
            matrices = [p.ndim >= 2 for p in group["params"]]
            if any(matrices) and not all(matrices):
                # Split the group: Muon for matrices, AdamW for the rest, same hyperparameters.
                rest = [p for p, m in zip(group["params"], matrices) if not m]
                group["params"] = [p for p, m in zip(group["params"], matrices) if m]
                group["use_muon"] = True
                super().add_param_group({**{k: v for k, v in group.items() if k != "params"},
                                         "params": rest, "use_muon": False})
            else:
                group["use_muon"] = bool(matrices) and all(matrices)
        elif use:
            for p in group["params"]:
                if p.ndim < 2:
                    raise ValueError(
                        f"parameter {self._name(p)!r} of shape {tuple(p.shape)} is in a group with "
                        "use_muon=True, but Muon needs a matrix (ndim >= 2); put it in an AdamW group"
                    )

    def _init_state(self) -> None:
        """Create every state entry now, so state_dict keys are the same on every rank (DCP)."""
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                if st:
                    continue
                st["step"] = torch.zeros((), dtype=torch.float32, device=_params.local(p).device)
                if group["use_muon"]:
                    st["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    if self._config["beta2"] is not None:
                        st["row_variance"] = _params.zeros_rows_state(p, (1,) * (p.ndim - 1), torch.float32)
                else:
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)

    def _refresh_scalars(self, index: int) -> dict[str, torch.Tensor]:
        """0-d float32 tensors holding the group's current scalars (as MuonOptimizer passes them)."""
        group, scalars = self.param_groups[index], self._scalars[index]
        device = _params.local(group["params"][0]).device if group["params"] else None
        values = {k: group[k] for k in _SCALARS}
        lr = float(group["lr"])
        base = group.get("base_lr") or 0.0
        values["adamw_lr_effective"] = float(group["adamw_lr"]) * (lr / base if base > 0 else 1.0)
        for k, v in values.items():
            t = scalars.get(k)
            if t is None:
                scalars[k] = t = torch.zeros((), dtype=torch.float32, device=device)
            if isinstance(v, torch.Tensor):
                t.copy_(v.detach().reshape(()))
            else:
                t.fill_(float(v))
        return scalars

    # ------------------------------------------------------------------ the matrix update
    def _msign(self, wide_counts: dict[tuple, int]) -> Callable[[torch.Tensor], torch.Tensor]:
        """The orthogonalization the owner runs, taking the same kernel path (batched or not) as a
        single-device ``orthogonalize`` over the whole group would for each matrix."""
        c = self._config

        def msign(x: torch.Tensor) -> torch.Tensor:
            dtype = c["ns_dtype"] or default_compute_dtype(x.device)
            run = lambda y: newton_schulz(  # noqa: E731
                y, c["method"], c["ns_steps"], coefficients=c["ns_coefficients"], dtype=dtype,
                eps=c["ns_eps"], stepsize=c["ns_stepsize"])
            if callable(c["method"]):
                return c["method"](x)
            if x.ndim == 2 and (self._batched_singletons or (
                    wide_counts.get((tuple(x.shape), x.dtype), 0) > 1 and _stack_pays(x))):
                # As torch.stack would: a contiguous batch (a transposed view takes another kernel).
                return run(x.unsqueeze(0).contiguous()).squeeze(0)
            return run(x)

        return msign

    def _mid(self, wide_counts: dict[tuple, int]):
        """The owner's transform: orthogonalize (+ normalize_rows) + scale_by_shape, cached per
        batching pattern (so a compiled one is reused step after step)."""
        key = tuple(sorted((k, v > 1) for k, v in wide_counts.items()))
        mid = self._mid_cache.get(key)
        if mid is None:
            c = self._config
            parts = [orthogonalize(self._msign(dict(wide_counts)))]
            if c["beta2"] is not None:
                parts.append(normalize_rows(c["beta2"], c["eps"]))
            parts.append(scale_by_shape(c["adjust_lr_fn"]))
            mid = chain(*parts)
            if self._compile is not False:
                options = dict(self._compile) if isinstance(self._compile, Mapping) else {}
                mid = compile_update(mid, **options)
            self._mid_cache[key] = mid
        return mid

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimization step (or one accumulation micro-step). Never modifies ``.grad``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        t_start = time.perf_counter()
        k = self.accumulation_steps
        if k > 1:
            self._micro_step += 1
            final = self._micro_step == k
            if final:
                self._micro_step = 0
            # Sync the next backward only if it is the last micro-batch of a step.
            self._set_gradient_sync(self._micro_step == k - 1)
            if not final:
                self.last_step_stats = {"applied": False, "micro_step": self._micro_step}
                return loss
        if self.nonfinite is not None and not self._grads_finite(k):
            self.nonfinite_steps += 1
            self.last_step_stats = {"applied": False, "nonfinite": True}
            if self.nonfinite == "error":
                bad = [self._name(p) for g in self.param_groups for p in g["params"]
                       if p.grad is not None and not bool(torch.isfinite(_params.local(p.grad)).all())]
                where = ", ".join(repr(b) for b in bad) if bad else "parameters of another rank"
                raise RuntimeError(
                    f"non-finite gradient (inf or nan) in {where}; parameters and optimizer state "
                    "were left unchanged. Pass nonfinite='skip' to skip such steps."
                )
            return loss
        stats = self._muon_step(k)
        self._adamw_step(k)
        stats["step_s"] = time.perf_counter() - t_start
        stats["applied"] = True
        self.last_step_stats = stats
        return loss

    def _grads_finite(self, k: int) -> bool:
        """True if every rank's gradients are finite (agreed by all ranks, so none hangs)."""
        flags = [torch.isfinite(_params.local(p.grad)).all()
                 for g in self.param_groups for p in g["params"] if p.grad is not None]
        local_ok = bool(torch.stack(flags).all()) if flags else True
        topo = self.topology
        return _exchange.all_ranks_true(local_ok, topo.group, topo.world_size)

    def _grad(self, p: torch.Tensor, k: int) -> torch.Tensor | None:
        g = p.grad
        if g is None:
            return None
        if g.is_sparse:
            raise RuntimeError(f"muon_fn does not support sparse gradients (parameter {self._name(p)!r})")
        g = _params.local(g.detach())
        return g / k if k > 1 else g

    def _muon_step(self, k: int) -> dict[str, Any]:
        c, topo, beta2 = self._config, self.topology, self._config["beta2"]
        mu_dtypes = [self.state[p]["momentum_buffer"].dtype for p in self._muon]
        # One dtype on the way to the owner (the exchange needs it): fp32 if any matrix or the
        # NorMuon row state is fp32; up-casts are exact, and the owner casts back.
        wire_in = torch.float32 if beta2 is not None or torch.float32 in mu_dtypes else mu_dtypes[0] \
            if mu_dtypes else torch.float32
        held: list[torch.Tensor] = []
        has_grad: list[bool] = []
        wide_counts: list[dict[tuple, int]] = [{} for _ in self.param_groups]
        # pre: momentum on local rows, one call per group.
        for index, group in enumerate(self.param_groups):
            if not group["use_muon"]:
                continue
            s = self._refresh_scalars(index)
            params = group["params"]
            grads = tuple(self._grad(p, k) for p in params)
            bufs = tuple(_params.local(self.state[p]["momentum_buffer"]) for p in params)
            pre = momentum_tx(s["momentum"], nesterov=c["nesterov"], kind=c["momentum_kind"])
            out, new = pre.update(grads, MomentumState(mu=bufs))
            for p, g, b, nb, u in zip(params, grads, bufs, new.mu, out):
                rows, cols = _plan.flat_shape(p.shape)
                has_grad.append(g is not None)
                if g is not None:
                    b.copy_(nb)
                    key = ((min(rows, cols), max(rows, cols)), u.dtype)  # wide orientation
                    wide_counts[index][key] = wide_counts[index].get(key, 0) + 1
                x = (u if u is not None else torch.zeros_like(b)).reshape(b.shape[0], cols).to(wire_in)
                if beta2 is not None:
                    v = _params.local(self.state[p]["row_variance"]).reshape(b.shape[0], 1)
                    x = torch.cat([x, v.to(wire_in)], dim=1)
                held.append(x)
        group_of = [self._muon_group[id(p)] for p in self._muon]
        mids = {i: self._mid(wide_counts[i]) for i, g in enumerate(self.param_groups) if g["use_muon"]}
        flops = 0
        schedule = self._flops_schedule

        def compute(idx: list[int], mats: list[torch.Tensor]) -> list[torch.Tensor]:
            """mid on the full matrices of ``idx`` (the owner's), one call per parameter group."""
            nonlocal flops
            results: list[torch.Tensor | None] = [None] * len(idx)
            by_group: dict[int, list[int]] = {}
            for pos, j in enumerate(idx):
                by_group.setdefault(group_of[j], []).append(pos)
            for gi, positions in by_group.items():
                shapes = [self.plan.matrices[idx[q]].shape for q in positions]
                fulls = tuple(
                    (mats[q][:, :-1] if beta2 is not None else mats[q]).to(mu_dtypes[idx[q]])
                    .contiguous().reshape(shape)
                    for q, shape in zip(positions, shapes)
                )
                mid = mids[gi]
                state = tuple(mid.init(fulls))
                if beta2 is not None:  # the rows' NorMuon state travelled as the last column
                    nus = tuple(mats[q][:, -1:].float().reshape((shape[0],) + (1,) * (len(shape) - 1))
                                for q, shape in zip(positions, shapes))
                    state = (state[0], NormalizeRowsState(nu=nus), state[2])
                outs, new_state = mid.update(fulls, state)
                for n, (q, o, shape) in enumerate(zip(positions, outs, shapes)):
                    r = o.reshape(shape[0], -1).to(wire_in)
                    if beta2 is not None:
                        r = torch.cat([r, new_state[1].nu[n].reshape(-1, 1).to(wire_in)], dim=1)
                    results[q] = r
                    flops += _plan.ns_flops(shape, schedule)
            return results  # type: ignore[return-value]

        run = _exchange.exchange if self.strategy == "owner" else _exchange.exchange_replicated
        mine, ex = run(self.plan, topo.rank, held, compute, group=topo.group, wire_dtype=self.wire_dtype)
        # post: weight decay and learning rate on local rows, then p += u.
        j = 0
        for index, group in enumerate(self.param_groups):
            if not group["use_muon"]:
                continue
            s = self._scalars[index]
            params = group["params"]
            locs = tuple(_params.local(p) for p in params)
            dirs = []
            for p, lo in zip(params, locs):
                r = mine[j]
                if beta2 is not None:
                    if has_grad[j]:
                        v = _params.local(self.state[p]["row_variance"])
                        v.copy_(r[:, -1:].reshape(v.shape))
                    r = r[:, :-1]
                dirs.append(r.to(mu_dtypes[j]).reshape(lo.shape) if has_grad[j] else None)
                j += 1
            post = chain(add_decoupled_weight_decay(s["weight_decay"]), scale_by_learning_rate(s["lr"]))
            updates, _ = post.update(tuple(dirs), (EmptyState(), EmptyState()), locs)
            for p, lo, u in zip(params, locs, updates):
                if u is not None:
                    lo.add_(u.to(lo.dtype))
                    self.state[p]["step"].add_(1)
        computed = sum(1 for mp in self.plan.matrices
                       if self.strategy == "replicate" or mp.owner == topo.rank)
        return {
            "strategy": self.strategy, "rank": topo.rank, "world_size": topo.world_size,
            "bytes_sent": ex.bytes_sent, "bytes_received": ex.bytes_received,
            "ns_flops": flops, "matrices_computed": computed,
            "comm_wait_s": ex.comm_wait_s, "compute_s": ex.compute_s,
        }

    def _adamw_step(self, k: int) -> None:
        c = self._config
        for index, group in enumerate(self.param_groups):
            if group["use_muon"] or not group["params"]:
                continue
            s = self._refresh_scalars(index)
            params = group["params"]
            grads = tuple(self._grad(p, k) for p in params)
            locs = tuple(_params.local(p) for p in params)
            sts = [self.state[p] for p in params]
            state = ScaleByAdamState(
                count=tuple(st["step"] for st in sts),
                mu=tuple(_params.local(st["exp_avg"]) for st in sts),
                nu=tuple(_params.local(st["exp_avg_sq"]) for st in sts),
            )
            tx = chain(scale_by_adam(c["adamw_betas"], c["adamw_eps"]),
                       add_decoupled_weight_decay(s["adamw_weight_decay"]),
                       scale_by_learning_rate(s["adamw_lr_effective"]))
            updates, new = tx.update(grads, (state, EmptyState(), EmptyState()), locs)
            adam = new[0]
            for st, g, cnt, m, v in zip(sts, grads, adam.count, adam.mu, adam.nu):
                if g is None:
                    continue
                st["step"].copy_(cnt)
                _params.local(st["exp_avg"]).copy_(m)
                _params.local(st["exp_avg_sq"]).copy_(v)
            for lo, u in zip(locs, updates):
                if u is not None:
                    lo.add_(u.to(lo.dtype))

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
        """Which parameters get Muon or AdamW, and who computes each matrix."""
        lines = [f"FSDPMuonOptimizer(strategy={self.strategy!r}, world_size={self.topology.world_size})"]
        for j, p in enumerate(self._muon):
            mp = self.plan.matrices[j]
            lines.append(f"  muon  {self._name(p)} {tuple(p.shape)} owner={mp.owner} bucket={mp.bucket}")
        for g in self.param_groups:
            if not g["use_muon"]:
                lines += [f"  adamw {self._name(p)} {tuple(p.shape)}" for p in g["params"]]
        return "\n".join(lines)


def _fsdp_modules(model: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _orthogonalize_batches_singletons() -> bool:
    """Whether the core's ``orthogonalize`` hands a lone matrix to ``method`` as a batch of one."""
    seen = []
    probe = orthogonalize(lambda x: seen.append(x.ndim) or x)
    probe.update((torch.zeros(2, 3),), EmptyState())
    return seen == [3]
