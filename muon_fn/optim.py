"""The stateful adapter: functional transforms behind the ``torch.optim.Optimizer`` interface.

Each parameter group is a tuple pytree of its parameters. Its transform is built by a factory from
the group's hyperparameters: per-step scalars (``lr``, ``momentum`` and any tensor-valued key) reach
the transform as 0-d tensors that the optimizer owns and refreshes in place before every step, so
LR schedulers work and a compiled update never recompiles; any other value (``weight_decay``,
ints, strings, tuples) is static and rebuilds the transform when it changes. State lives in torch's
per-parameter dicts holding exactly the transform's state (``state[p]["momentum_buffer"]`` for
Muon, as torch.optim.Muon; ``step``/``exp_avg``/``exp_avg_sq`` for AdamW) and is rebuilt into the
functional state pytree at every step (see ``_state_layout``).

A subclass may route some parameters of a group to an in-place eager implementation of the same
math (:meth:`Optimizer._inplace_plan`; :class:`MuonOptimizer` does for its matrices); the
functional transform then sees those parameters' gradients as ``None``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple, Union

import torch

from . import _checks, _muon, _orthogonalize, _state_layout, _tree
from ._compile import compile_per_shape
from ._alias import DEFAULT_METHOD, adamw, muon
from ._base import GradientTransformation
from ._combine import partition
from ._muon import SHAPE_RULES
from ._orthogonalize import METHODS

Factory = Callable[[dict[str, Any]], GradientTransformation]
CompileOption = Union[bool, Mapping[str, Any]]

NONFINITE_POLICIES = ("error", "skip", None)
# Group keys the adapter itself uses; they never reach the factory.
_ADAPTER_KEYS = frozenset({"params", "param_names", "gradient_accumulation_steps", "micro_step",
                           "initial_lr", "base_lr"})
# Hyperparameters passed to the factory as 0-d tensors refreshed before every step (any
# tensor-valued key is one too); other keys are static and rebuild the transform on change.
# weight_decay is static: it rarely changes, and a static 0 removes the decay term entirely.
SCALAR_KEYS = frozenset({"lr", "momentum"})


class InplacePlan(NamedTuple):
    """Parameters of a group that a subclass updates in place, and how (see ``_inplace_plan``)."""

    indices: tuple[int, ...]  # positions in group["params"]
    step: Callable[..., None]  # step(params, grads, states, scalars, workspace) -> None


class _GroupRuntime:
    """Per-group cache: the transform, its compiled step, the state layout, the scalar tensors."""

    def __init__(self) -> None:
        self.static_key: Any = None
        self.scalars: dict[str, torch.Tensor] = {}
        self.tx: GradientTransformation | None = None
        self.step_fn: Callable[..., Any] | None = None
        self.layout: _state_layout.StateLayout | None = None
        self.inplace: InplacePlan | None = None
        self.workspace: dict[Any, Any] = {}  # scratch buffers of the in-place path (not state)


class StepReport(NamedTuple):
    """What the last ``step()`` did (read lazily: reading the flag syncs with the device)."""

    finite: torch.Tensor  # shape=(), bool: False if the step was skipped for non-finite grads
    applied: bool  # False for an accumulation micro-step that changed no parameter


class Optimizer(torch.optim.Optimizer):
    _extra_scalar_keys: tuple[str, ...] = ()

    """A ``torch.optim.Optimizer`` running a functional transform per parameter group.

    Args:
      params: parameters, ``(name, param)`` pairs, or param-group dicts, as for torch optimizers.
      tx_or_factory: a :class:`~muon_fn.GradientTransformation` used for every group as is, or a
        factory ``hyperparams -> GradientTransformation`` called with each group's hyperparameters
        (``lr``, ``momentum`` and tensor values as 0-d tensors). Only a factory lets schedulers
        change ``lr``.
      defaults: default hyperparameters of the groups (e.g. ``{"lr": 0.02}``).
      gradient_accumulation_steps: ``k``: call ``step()`` after every micro-batch; every ``k``-th
        call applies the mean of the last ``k`` gradients, the others change no parameter.
      nonfinite: ``"error"`` (default) raises after leaving parameters and state unchanged,
        ``"skip"`` leaves them unchanged and counts the step in ``nonfinite_steps``, ``None``
        does not check.
      compile: ``False`` (eager), ``True`` (``torch.compile(fullgraph=True)``), or a dict of
        ``torch.compile`` keyword arguments (e.g. ``{"backend": "eager"}``).
    """

    def __init__(
        self,
        params: Iterable[Any],
        tx_or_factory: Union[GradientTransformation, Factory],
        defaults: Mapping[str, Any] | None = None,
        *,
        gradient_accumulation_steps: int = 1,
        nonfinite: str | None = "error",
        compile: CompileOption = False,
    ) -> None:
        if isinstance(tx_or_factory, GradientTransformation):
            self._factory: Factory = lambda hyper, _tx=tx_or_factory: _tx  # noqa: E731
        elif callable(tx_or_factory):
            self._factory = tx_or_factory
        else:
            raise TypeError(
                "tx_or_factory must be a GradientTransformation or a function of the group's "
                f"hyperparameters, got {type(tx_or_factory).__name__}"
            )
        _checks.positive_int("gradient_accumulation_steps", gradient_accumulation_steps)
        _checks.one_of("nonfinite", nonfinite, NONFINITE_POLICIES)
        if not isinstance(compile, (bool, Mapping)):
            raise TypeError(f"compile must be a bool or a dict of torch.compile options, got {compile!r}")
        self.nonfinite = nonfinite
        self._compile = compile
        self._scalar_keys = SCALAR_KEYS | frozenset(self._extra_scalar_keys)
        self._runtimes: list[_GroupRuntime] = []
        self._nonfinite_count: torch.Tensor | None = None
        self.last_step: StepReport | None = None
        defaults = dict(defaults or {})
        defaults.setdefault("gradient_accumulation_steps", gradient_accumulation_steps)
        super().__init__(params, defaults)

    # ----------------------------------------------------------------------- groups
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        group.setdefault("micro_step", 0)
        for p in group["params"]:
            if torch.is_complex(p):
                raise ValueError(f"muon_fn does not support complex parameters, got {self._name(group, p)}")
        self._validate_group(group)
        self._runtimes.append(_GroupRuntime())
        self._dry_run(len(self.param_groups) - 1)

    def _validate_group(self, group: dict[str, Any]) -> None:
        """Hook for subclasses: check a group's hyperparameters (raise ValueError)."""

    def _derived_scalars(self, group: dict[str, Any]) -> dict[str, float]:
        """Hook for subclasses: per-step scalars computed from the group (passed like ``lr``)."""
        return {}

    def _name(self, group: dict[str, Any], p: torch.Tensor) -> str:
        names = group.get("param_names")
        idx = next(i for i, q in enumerate(group["params"]) if q is p)
        return repr(names[idx]) if names else f"#{idx} of shape {tuple(p.shape)}"

    # ----------------------------------------------------------------------- transforms
    def _hyper(self, group: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        scalars, static = {}, {}
        for k, v in group.items():
            if k in _ADAPTER_KEYS:
                continue
            if isinstance(v, torch.Tensor) or k in self._scalar_keys:
                scalars[k] = v
            else:
                static[k] = v
        scalars.update(self._derived_scalars(group))
        return scalars, tuple(sorted((k, repr(v)) for k, v in static.items()))

    def _runtime(self, index: int) -> _GroupRuntime:
        group, rt = self.param_groups[index], self._runtimes[index]
        scalars, static_key = self._hyper(group)
        device = group["params"][0].device
        for k, v in scalars.items():
            if isinstance(v, torch.Tensor) and v.numel() != 1:
                raise ValueError(f"Tensor {k} must be 1-element")
            t = rt.scalars.get(k)
            if t is None:
                dtype = torch.float64 if group["params"][0].dtype == torch.float64 else torch.float32
                rt.scalars[k] = t = torch.zeros((), dtype=dtype, device=device)
                rt.tx = None
            if isinstance(v, torch.Tensor):
                t.copy_(v.detach().reshape(()))
            else:
                t.fill_(float(v))
        if rt.tx is None or static_key != rt.static_key:
            hyper = {k: v for k, v in group.items() if k not in _ADAPTER_KEYS}
            hyper.update(rt.scalars)
            hyper["_names"] = group.get("param_names")
            rt.tx = self._factory(hyper)
            rt.static_key = static_key
            rt.layout = None
            rt.step_fn = self._build_step_fn(rt.tx)
            rt.inplace = self._inplace_plan(group, hyper)
            rt.workspace = {}
        if rt.layout is None:
            rt.layout = _state_layout.build_layout(rt.tx.init(self._meta(group["params"])), len(group["params"]))
        return rt

    @staticmethod
    def _meta(params: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return tuple(torch.empty_like(p, device="meta") for p in params)

    def _dry_run(self, index: int) -> None:
        """Trace one update on meta tensors, so shape errors surface at construction."""
        rt = self._runtime(index)
        group = self.param_groups[index]
        params = self._meta(group["params"])
        with torch.no_grad():
            try:
                rt.tx.update(params, rt.tx.init(params), params)
            except ValueError as error:
                for i, p in enumerate(group["params"]):  # find the parameter that fails alone
                    only = tuple(q if j == i else None for j, q in enumerate(params))
                    try:
                        rt.tx.update(only, rt.tx.init(params), params)
                    except ValueError:
                        raise ValueError(f"parameter {self._name(group, p)}: {error}") from None
                raise

    def _inplace_plan(self, group: dict[str, Any], hyper: dict[str, Any]) -> InplacePlan | None:
        """Hook for subclasses: parameters of ``group`` to update with an in-place implementation
        of the same math as the group's transform (``hyper``: what the factory got), or None."""
        return None

    def _build_step_fn(self, tx: GradientTransformation) -> Callable[..., Any]:
        """``step_fn(params, grads, state) -> new_state``; updates ``params`` in place.

        Eager: the new state is returned for the caller to store. Compiled: the new state is
        written into the old buffers (one graph, ``fullgraph=True``) and the old state returned.
        The caller has already checked the gradients (see ``step``).
        """

        def apply(params, updates):
            for p, u in zip(params, updates):
                if u is not None:
                    p.add_(u.to(p.dtype))

        def eager_step(params, grads, state):
            updates, new_state = tx.update(grads, state, params)
            apply(params, updates)
            return new_state

        def compiled_step(params, grads, state):
            updates, new_state = tx.update(grads, state, params)
            _tree.tree_map(lambda old, new: None if old is None else old.copy_(new), state, new_state)
            apply(params, updates)
            return state

        if self._compile is False:
            return eager_step
        return torch.compile(compiled_step, **self._compile_options())

    def _compile_kwargs(self) -> dict[str, Any]:
        return dict(self._compile) if isinstance(self._compile, Mapping) else {}

    def _compile_options(self) -> dict[str, Any]:
        return {"fullgraph": True} | self._compile_kwargs()

    # ----------------------------------------------------------------------- state
    def _param_states(self, group: dict[str, Any]) -> list[dict[str, Any]]:
        return [self.state[p] for p in group["params"]]

    def _ensure_state(self, index: int, rt: _GroupRuntime) -> Any:
        group = self.param_groups[index]
        params = group["params"]
        states = self._param_states(group)
        if not _state_layout.complete(rt.layout, states):  # first step, or a param added later
            fresh = rt.tx.init(tuple(p.detach() for p in params))
            _state_layout.scatter(rt.layout, fresh, states, overwrite=False)  # keep loaded state
        return _state_layout.gather(rt.layout, states)

    # ----------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimization step (or accumulate one micro-batch)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = []
        self._last_grads: dict[int, tuple] = {}
        for index, group in enumerate(self.param_groups):
            grads = self._grads(group)
            if grads is None:
                continue
            rt = self._runtime(index)
            state = self._ensure_state(index, rt)
            k = group["gradient_accumulation_steps"]
            if k > 1:
                grads = self._accumulate(group, grads, k)
                if grads is None:
                    continue
            self._last_grads[index] = grads
            work.append((index, group, rt, grads, state))
        applied = bool(work)
        # One check over every gradient before anything changes (so a skipped or failed step
        # leaves every group's parameters and state as they were).
        if self.nonfinite is not None and work:
            finite = _all_finite([g for *_, grads, _ in work for g in grads])
        else:
            finite = torch.ones((), dtype=torch.bool)
        if self.nonfinite is None or bool(finite):
            for index, group, rt, grads, state in work:
                self._apply_group(group, rt, grads, state)
        self.last_step = StepReport(finite, applied)
        if applied and self.nonfinite is not None:
            self._nonfinite_count = (0 if self._nonfinite_count is None else self._nonfinite_count) + (~finite).long()
            if self.nonfinite == "error" and not bool(finite):
                raise RuntimeError(
                    "non-finite gradient (inf or nan) in " + ", ".join(self._nonfinite_params())
                    + "; parameters and optimizer state were left unchanged. Pass nonfinite='skip' "
                    "to skip such steps, or use torch.amp.GradScaler."
                )
        return loss

    def _apply_group(self, group: dict[str, Any], rt: _GroupRuntime, grads: tuple, state: Any) -> None:
        params = tuple(group["params"])
        plan = rt.inplace
        if plan is not None:
            mine = set(plan.indices)
            rest = tuple(None if i in mine else g for i, g in enumerate(grads))
        else:
            rest = grads
        if any(g is not None for g in rest):
            new_state = rt.step_fn(params, rest, state)
            if new_state is not state:
                _state_layout.scatter(rt.layout, new_state, self._param_states(group))
        if plan is not None:
            plan.step([params[i] for i in plan.indices], [grads[i] for i in plan.indices],
                      [self.state[params[i]] for i in plan.indices], rt.scalars, rt.workspace)

    @property
    def nonfinite_steps(self) -> int:
        """How many steps were skipped (or raised) because of non-finite gradients."""
        return 0 if self._nonfinite_count is None else int(self._nonfinite_count)

    def _nonfinite_params(self) -> list[str]:
        bad = []
        for index, grads in self._last_grads.items():
            group = self.param_groups[index]
            for p, g in zip(group["params"], grads):
                if g is not None and not bool(torch.isfinite(g).all()):
                    bad.append(self._name(group, p))
        return bad

    def _grads(self, group: dict[str, Any]) -> tuple[torch.Tensor | None, ...] | None:
        grads = []
        for p in group["params"]:
            g = p.grad
            if g is not None and g.is_sparse:
                raise RuntimeError(f"muon_fn does not support sparse gradients (parameter {self._name(group, p)})")
            grads.append(None if g is None else g.detach())
        return None if all(g is None for g in grads) else tuple(grads)

    def _accumulate(self, group, grads, k):
        """Add this micro-batch's grads; return the mean over ``k`` on every k-th call, else None."""
        group["micro_step"] = group.get("micro_step", 0) + 1
        total = []
        for p, g in zip(group["params"], grads):
            st = self.state[p]
            acc = st.get("grad_accumulator")
            if g is not None:
                acc = g.clone() if acc is None else acc.add_(g)
                st["grad_accumulator"] = acc
            total.append(acc)
        if group["micro_step"] < k:
            return None
        group["micro_step"] = 0
        out = tuple(None if a is None else a / k for a in total)
        for p in group["params"]:
            self.state[p].pop("grad_accumulator", None)
        return out

    # ----------------------------------------------------------------------- checkpoints
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's ``load_state_dict``, with every state tensor in the dtype its transform uses
        (torch would cast all tensor state to the parameter's dtype, e.g. fp32 momentum of a bf16
        parameter, or integer counters) and a check that the state_dict has this optimizer's
        layout; a rejected state_dict leaves the optimizer as it was."""
        self._check_saved_groups(state_dict)
        saved = state_dict["state"]
        backup_state, backup_groups = self.state, self.param_groups
        try:
            super().load_state_dict(state_dict)
            params = [p for g in self.param_groups for p in g["params"]]
            for idx, p in enumerate(params):
                entry = saved.get(idx, saved.get(str(idx)))
                for key, value in (entry or {}).items():
                    if isinstance(value, torch.Tensor):
                        self.state[p][key] = value.detach().to(device=p.device, copy=True)
            for index, group in enumerate(self.param_groups):
                rt = self._runtime(index)
                states = self._param_states(group)
                names = [self._name(group, p) for p in group["params"]]
                _state_layout.drop_legacy_keys(rt.layout, states)
                _state_layout.check(rt.layout, states, names)
                _state_layout.cast_to_layout(rt.layout, states)
        except Exception:
            self.state, self.param_groups = backup_state, backup_groups
            for index in range(len(self.param_groups)):
                self._runtime(index)
            raise

    def _check_saved_groups(self, state_dict: dict[str, Any]) -> None:
        saved_groups = state_dict.get("param_groups")
        if not isinstance(saved_groups, list) or "state" not in state_dict:
            raise ValueError("state_dict must have 'state' and 'param_groups' entries")
        if len(saved_groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        for i, (ours, theirs) in enumerate(zip(self.param_groups, saved_groups)):
            missing = sorted(set(ours) - set(theirs) - {"params", "param_names"} - _ADAPTER_KEYS)
            if missing:
                raise ValueError(
                    f"loaded param group {i} lacks this optimizer's hyperparameters {missing}: the "
                    "state_dict comes from a different optimizer layout"
                )

    def describe(self) -> str:
        """A table of the parameter groups and their transforms."""
        lines = []
        for index, group in enumerate(self.param_groups):
            rt = self._runtime(index)
            lines.append(f"group {index}: {len(group['params'])} params, {repr(rt.tx)}")
        return "\n".join(lines)


def _all_finite(grads: tuple[torch.Tensor | None, ...]) -> torch.Tensor:
    """One reduction per gradient: a sum is non-finite iff an entry is (or the sum overflows fp32)."""
    low = (torch.float16, torch.bfloat16)
    sums = [g.sum(dtype=torch.float32) if g.dtype in low else g.sum() for g in grads if g is not None]
    if len({(s.dtype, s.device) for s in sums}) > 1:
        sums = [s.to(device=sums[0].device, dtype=torch.float64) for s in sums]
    return torch.stack(sums).isfinite().all()


ALGORITHMS = ("auto", "muon", "adamw")


class HybridOptimizer(Optimizer):
    """Base of :class:`MuonOptimizer` and :class:`muon_fn.SpectralSphereOptimizer`: a matrix
    algorithm for ndim ≥ 2 and AdamW for the rest in ``algorithm="auto"`` groups, with the AdamW
    learning rate ``adamw_lr · lr / base_lr`` so schedulers scale both halves alike."""

    algorithms: tuple[str, ...] = ALGORITHMS

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        lr = param_group.get("lr", self.defaults["lr"])
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        param_group.setdefault("base_lr", float(lr))
        super().add_param_group(param_group)

    def _validate_group(self, group: dict[str, Any]) -> None:
        lr = group["lr"]
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not 0.0 <= float(lr):
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= group["momentum"] < 1.0:
            raise ValueError(f"Invalid momentum value: {group['momentum']} (expected 0 <= momentum < 1)")
        for key in ("weight_decay", "adamw_weight_decay", "adamw_lr"):
            if not 0.0 <= group[key]:
                raise ValueError(f"Invalid {key} value: {group[key]}")
        if not group["adamw_eps"] > 0.0:
            raise ValueError(f"Invalid adamw_eps value: {group['adamw_eps']} (expected > 0)")
        for i, b in enumerate(group["adamw_betas"]):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"Invalid adamw_betas parameter at index {i}: {b}")
        _checks.one_of("algorithm", group["algorithm"], self.algorithms)

    def _derived_scalars(self, group: dict[str, Any]) -> dict[str, float]:
        lr = float(group["lr"])
        base = float(group.get("base_lr") or 0.0)
        if base > 0:
            ratio = lr / base
        else:  # built with lr = 0: the AdamW half runs at adamw_lr whenever lr > 0
            ratio = 1.0 if lr > 0 else 0.0
        return {"adamw_lr_effective": float(group["adamw_lr"]) * ratio}


class MuonOptimizer(HybridOptimizer):

    """Muon for matrices, AdamW for everything else, as one ``torch.optim`` optimizer.

    In a group with ``algorithm="auto"`` (the default) parameters with ndim ≥ 2 (conv weights
    flattened to (out, in·kh·kw)) get Muon: ``p ← p(1 − lr·wd) − lr·s(out, in)·msign(M)``; 0-/1-D
    parameters (biases, norm gains) get AdamW with ``adamw_betas``, ``adamw_eps``,
    ``adamw_weight_decay`` and learning rate ``adamw_lr · lr / base_lr`` — so LR schedulers scale
    both halves alike (``base_lr`` is the group's ``lr`` at construction). Groups with
    ``algorithm="muon"`` or ``"adamw"`` use one algorithm with the group's own ``lr`` and
    ``weight_decay`` (this is what :func:`create_hybrid_optimizer` builds).

    Args:
      lr: Muon learning rate (0.02, Keller's default, pairs with ``adjust_lr_fn="keller"``).
      momentum: μ. ``momentum_kind="ema"`` (default, torch.optim.Muon's buffer) or ``"sgd"``.
      weight_decay: decoupled, ``p ← p(1 − lr·wd)``.
      nesterov: Nesterov momentum.
      ns_steps: iterations of the orthogonalization ``method``; ``None`` (default): the count
        the method is designed for (4 for ``"aol9"`` and ``"aol"``, else 5).
      method: ``"aol9"`` (default: AOL row scaling, three quintics and one degree-9 step; 0.84x
        the FLOPs of a 5-step quintic, no worse than torch's on real gradients), ``"polar_express"``,
        ``"quintic"`` (torch.optim.Muon's), ``"you"``, ``"cubic"``, ``"aol"``, ``"gram"``
        (see :func:`muon_fn.orthogonalize`).
      adjust_lr_fn: shape rule ``"keller"``/``"original"``, ``"match_rms_adamw"``, ``"spectral"``,
        ``"legacy"`` or ``"none"`` (see :func:`muon_fn.shape_scale`).
      beta2: ``None`` for Muon; a float enables NorMuon row normalization with ``eps``.
      ns_dtype: iteration dtype (default: bf16, fp32 on CPUs without bf16 GEMMs), ``ns_eps``, ``ns_stepsize``, ``ns_coefficients``:
        see :func:`muon_fn.orthogonalize`. ``split``: row blocks of fused weights.
      momentum_dtype: dtype of the momentum buffer (default: the parameter's), e.g. fp32 for
        bf16 parameters.
      adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: the AdamW half in ``"auto"`` groups.
      gradient_accumulation_steps, nonfinite: see :class:`Optimizer`.
      compile: ``False``, ``True`` or a dict of ``torch.compile`` options. On the in-place path
        (see ``foreach``) the orthogonalization is compiled once per distinct ``(B, m, n)`` batch
        of same-shape matrices (one ``(m, n)`` graph for shapes with min(m, n) ≥ 384, which run
        one at a time), ``fullgraph=True``; everything else is compiled as in :class:`Optimizer`
        (one graph per group transform). LR and momentum schedules never recompile.
      foreach: ``None`` or ``True`` (default): Muon matrices take an in-place multi-tensor path
        (:func:`muon_fn._muon.muon_step_`: momentum in place, normalize+cast straight into bf16
        batches, ``p.add_(O, alpha=-lr·s)``) whenever the group's settings allow it (not with
        ``beta2`` or a callable ``method``; contiguous weights); ``False``: always the functional
        transforms, whose fp32 arithmetic :class:`muon_fn.FSDPMuonOptimizer` reproduces bit for
        bit. The two agree to rounding (about 1e-7 relative in fp32).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 0.02,
        momentum: float = 0.95,
        weight_decay: float = 0.0,
        nesterov: bool = True,
        ns_steps: int | None = None,
        *,
        method: str = DEFAULT_METHOD,
        adjust_lr_fn: str = "keller",
        beta2: float | None = None,
        eps: float = 1e-8,
        ns_coefficients: Any = None,
        ns_dtype: torch.dtype | None = None,
        ns_eps: float = 1e-7,
        ns_stepsize: float = 1.0,
        momentum_kind: str = "ema",
        momentum_dtype: torch.dtype | None = None,
        split: Any = None,
        adamw_lr: float = 3e-4,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.0,
        algorithm: str = "auto",
        gradient_accumulation_steps: int = 1,
        nonfinite: str | None = "error",
        compile: CompileOption = False,
        foreach: bool | None = None,
    ) -> None:
        if foreach not in (None, True, False):
            raise TypeError(f"foreach must be None, True or False, got {foreach!r}")
        self._foreach = foreach
        defaults = dict(
            lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov,
            ns_steps=ns_steps, method=method, adjust_lr_fn=adjust_lr_fn, beta2=beta2, eps=eps,
            ns_coefficients=ns_coefficients, ns_dtype=ns_dtype, ns_eps=ns_eps,
            ns_stepsize=ns_stepsize, momentum_kind=momentum_kind, momentum_dtype=momentum_dtype,
            split=split, adamw_lr=adamw_lr, adamw_betas=tuple(adamw_betas), adamw_eps=adamw_eps,
            adamw_weight_decay=adamw_weight_decay, algorithm=algorithm,
        )
        super().__init__(params, _muon_factory, defaults,
                         gradient_accumulation_steps=gradient_accumulation_steps,
                         nonfinite=nonfinite, compile=compile)

    def _inplace_plan(self, group: dict[str, Any], hyper: dict[str, Any]) -> InplacePlan | None:
        if (self._foreach is False or hyper["beta2"] is not None
                or not isinstance(hyper["method"], str) or hyper["algorithm"] == "adamw"):
            return None
        indices = tuple(i for i, p in enumerate(group["params"])
                        if p.ndim >= 2 and _muon.inplace_supported(p))
        if not indices:
            return None
        schedule, norm_scale = _muon.resolve_method(
            hyper["method"], hyper["ns_steps"], coefficients=hyper["ns_coefficients"],
            stepsize=hyper["ns_stepsize"])
        static = dict(weight_decay=hyper["weight_decay"], nesterov=hyper["nesterov"],
                      kind=hyper["momentum_kind"], rule=hyper["adjust_lr_fn"], split=hyper["split"],
                      schedule=schedule, norm_scale=norm_scale, dtype=hyper["ns_dtype"],
                      eps=hyper["ns_eps"])

        if self._compile is not False:
            # One static graph per distinct (B, m, n) batch of the iteration (tall matrices are
            # transposed into their wide group first, so fc and proj share one; shapes with
            # min(m, n) >= LOOP_MIN_DIM run one (m, n) graph per matrix, as eager loops: measured
            # on gpt2-small, compiled bf16 bmm of 768-wide batches ran 8 % slower than 2-D
            # GEMMs); the elementwise steps stay eager and in place and read lr as a float, so
            # an LR schedule never recompiles.
            eps = static["eps"]

            def iterate(y: torch.Tensor) -> torch.Tensor:
                return _orthogonalize._run_schedule(y, schedule, eps)

            static.update(msign=compile_per_shape(iterate, **self._compile_kwargs()))

        def step(params, grads, states, scalars, workspace):
            _muon.muon_step_(params, grads, [st["momentum_buffer"] for st in states],
                             lr=scalars["lr"], momentum=scalars["momentum"], workspace=workspace,
                             **static)

        return InplacePlan(indices, step)

    def _validate_group(self, group: dict[str, Any]) -> None:
        super()._validate_group(group)
        steps = group["ns_steps"]
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ValueError(f"Invalid ns_steps value: {steps!r} (expected an integer >= 1, or None)")
        if not callable(group["method"]):
            _checks.one_of("method", group["method"], METHODS)
        _checks.one_of("adjust_lr_fn", group["adjust_lr_fn"], SHAPE_RULES)
        _checks.one_of("momentum_kind", group["momentum_kind"], ("ema", "sgd"))
        if group["beta2"] is not None and not 0.0 <= group["beta2"] < 1.0:
            raise ValueError(f"Invalid beta2 value: {group['beta2']} (expected 0 <= beta2 < 1, or None for Muon)")
        for key in ("eps", "ns_eps"):
            if not group[key] > 0.0:
                raise ValueError(f"Invalid {key} value: {group[key]} (expected > 0)")


def _muon_factory(h: dict[str, Any]) -> GradientTransformation:
    def muon_tx():
        return muon(
            h["lr"], h["momentum"], nesterov=h["nesterov"], kind=h["momentum_kind"],
            method=h["method"], ns_steps=h["ns_steps"], ns_coefficients=h["ns_coefficients"],
            ns_dtype=h["ns_dtype"], ns_eps=h["ns_eps"], ns_stepsize=h["ns_stepsize"],
            adjust_lr_fn=h["adjust_lr_fn"], weight_decay=h["weight_decay"], beta2=h["beta2"],
            eps=h["eps"], split=h["split"], mu_dtype=h["momentum_dtype"],
        )

    algorithm = h["algorithm"]
    if algorithm == "muon":
        return muon_tx()
    if algorithm == "adamw":
        return adamw(h["lr"], h["adamw_betas"], h["adamw_eps"], h["weight_decay"])
    from ._alias import matrix_labels

    return partition(
        {"muon": muon_tx(),
         "adamw": adamw(h["adamw_lr_effective"], h["adamw_betas"], h["adamw_eps"], h["adamw_weight_decay"])},
        matrix_labels,
    )
