"""The stateful adapter: a functional transform behind the ``torch.optim.Optimizer`` interface.

Each parameter group is a tuple pytree of its parameters. Its transform is built by a factory from
the group's hyperparameters: per-step scalars (``lr``, ``momentum`` and any tensor-valued key) reach
the transform as 0-d tensors that the optimizer owns and refreshes in place before every step, so
LR and momentum schedules never recompile; any other value (``weight_decay``, ints, strings,
tuples) is static and rebuilds the transform when it changes. State lives in torch's per-parameter
dicts holding exactly the transform's state (``state[p]["momentum_buffer"]`` for Muon, as
torch.optim.Muon; ``step``/``exp_avg``/``exp_avg_sq`` for AdamW; see ``_state``).

The step is generic (:mod:`._step`): for each *bucket* of a group (see :func:`buckets`) it runs
``updates, new_state = tx.update(grads, state, params)`` — as one ``torch.compile(fullgraph=True)``
graph per bucket signature by default, or eagerly with the same ops — and writes the result
in place (``state.copy_(new_state)``, ``p.add_(updates)``; :mod:`._apply`): inside each bucket's
graph by default, or all at once after the last bucket (``atomic=True``). Everything that can
refuse a step (missing, sparse or mis-shaped gradients, the accumulation window, non-finite
gradients) is decided before the first write, so a bad batch changes nothing either way. An
exception raised while the buckets run (an out-of-memory, a compiler error) is not decided in
advance: by default it leaves the buckets before it written; with ``atomic=True`` nothing.
Every algorithm (Muon, the hybrid, NorMuon, SSO, AdamW) is a transform run through this one apply.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from ..core import checks as _checks, compile as _compile, execution as _execution, metrics as _metrics
from ..core.base import GradientTransformation, info
from ..core.muon import group_by
from . import _placement, _state
from ._apply import bucket_step, without_figures
from ._checkpoint import ADAPTER_KEYS, Checkpointing
from ._distributed import DEFAULTS, DistributedOptions
from ._executor import Executor, LocalExecutor
from ._placement import Placed
from ._step import StagedStep, StepReport, signature, step_not_traced  # noqa: F401 (re-exported)
from ._telemetry import Telemetry, check_metrics

Factory = Callable[[dict[str, Any]], GradientTransformation]

NONFINITE_POLICIES = ("skip", "error", None)
"""What ``nonfinite=`` accepts: ``"skip"`` (a step with an inf/nan gradient changes no parameter
or state), ``"error"`` (also raises, naming the parameters), ``None`` (no check)."""
# Hyperparameters passed to the factory as 0-d tensors refreshed before every step (any
# tensor-valued key is one too); other keys are static and rebuild the transform on change.
# weight_decay is static: it rarely changes, and a static 0 removes the decay term entirely.
SCALAR_KEYS = frozenset({"lr", "momentum"})
# On the CPU, at most this many same-shape parameters, and at most 8 MiB of them, share one
# compiled call. Inductor's compile time grows by about a second per parameter in a graph (2-core
# CPU), while equal buckets reuse one graph: gpt2-small's 72 matrices compile as 3 graphs; and a
# step's transient memory is one bucket's (its stacked low-precision copy and the iteration's
# result). On GPUs up to 16 same-shape parameters share one call (one batched GEMM per product;
# the execution policy's default, muon_fn.core.execution). Larger buckets batch more matrices per
# orthogonalization call (see MuonOptimizer(bucket_size=...)).
BUCKET_SIZE = _execution.CPU.bucket_size
"""The CPU's default ``bucket_size``: at most this many same-shape parameters (and at most 8 MiB
of them) share one compiled call; on GPUs the default is 16."""


def buckets(params: list[torch.Tensor], size: int | Callable[..., int] | None) -> list[tuple[int, ...]]:
    """Positions of ``params`` in buckets of parameters of one shape, dtype and device, at most
    ``size`` of them (a function ``size(same_shape, params)``; ``None``: the whole group is one
    bucket)."""
    if size is None:
        return [tuple(range(len(params)))]
    keys = [(tuple(p.shape), p.dtype, p.device) for p in params]
    out = []
    for same in group_by(keys):
        cap = size([params[i] for i in same], params) if callable(size) else size
        out += [tuple(same[k:k + cap]) for k in range(0, len(same), cap)]
    return out


class _Variant(NamedTuple):
    """The transform of the group's parameters that share one set of per-parameter options."""

    options: dict[str, Any]  # what they override in the group's hyperparameters
    tx: GradientTransformation
    # the bucket step by (write, measure): written in the graph (atomic=False) or returned for
    # the step's commit; with telemetry (metrics=) or without (muon_fn.engine._apply.bucket_step)
    steps: dict[tuple[bool, bool], _compile.PerSignature]


class _Bucket(NamedTuple):
    indices: tuple[int, ...]  # positions in group["params"]
    layout: _state.StateLayout  # where the bucket's state leaves live in torch's state dicts
    variant: int  # which of the group's variants updates it
    leaves: tuple[_metrics.Leaf, ...]  # what telemetry reads as each parameter's units


class GroupRuntime:
    """Per-group cache: the transforms (one per variant), their buckets and steps, the scalar tensors."""

    def __init__(self) -> None:
        self.static_key: Any = None
        self.scalars: dict[str, torch.Tensor] = {}
        self.variants: list[_Variant] = []
        self.variant_of: tuple[int, ...] = ()  # per parameter of the group
        self.buckets: list[_Bucket] = []


class Optimizer(Checkpointing, Placed, StagedStep, Telemetry, torch.optim.Optimizer):
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
      nonfinite: what a step with an inf/nan gradient does. ``"skip"`` (default) leaves every
        parameter and state unchanged, decided on the device (no host read), and counts it in
        :attr:`nonfinite_steps`; ``"error"`` also raises, naming the parameters (one read of a
        flag per step); ``None`` does not check.
      compile: ``True`` (default: ``torch.compile(fullgraph=True)`` with inductor, one graph per
        bucket signature; eager with one warning where compiling is impossible), ``False``
        (eager), or a dict of ``torch.compile`` options (e.g. ``{"backend": "eager"}``).
      bucket_size: same-shape parameters updated by one call; ``None`` (default): the device's
        execution policy's, on the CPU at most 4 (:data:`BUCKET_SIZE`) and 8 MiB of them (a
        step's transient memory is about one bucket's), 16 on GPUs; only for transforms that are
        *leafwise* (:class:`muon_fn.TransformInfo`; every built-in one is), others update each
        group as a whole.
      atomic: ``False`` (default): each bucket's graph writes its parameters and state in place
        (the transient memory of one bucket's intermediates). A step is still all or nothing
        for everything training meets: missing, sparse or mis-shaped gradients, the accumulation
        window and non-finite gradients are decided before the first write, and a bucket whose
        own result is not finite is kept back (``nonfinite``). ``True``: every bucket is
        computed before any is written, so an exception midway (an out-of-memory, a compiler
        error) also leaves the optimizer as it was; the price is the transient memory of the
        whole step's new state and updates (about one more state and parameter copy). Same
        results either way.
      verify: ``True`` (default): the first time a compiled graph runs in this optimizer, its
        result is checked against the same bucket run eagerly on copies of its inputs; a graph
        whose result is not finite where eager's is, or differs from eager's, per tensor, by
        more than 0.05 of the change eager made to it plus 4 ulps of the tensor's own dtype
        (Frobenius norms; :func:`muon_fn.core.verify.tolerance`), warns once (naming the graph and
        the host's compiler) and that signature runs with safe compiler options or eagerly
        (:mod:`muon_fn.core.verify`). ``False``: no check.
      metrics: telemetry. ``False`` (default): none, the same graphs as without the option;
        ``True``: every step's figures, computed inside the step's graphs; ``k``: every k-th
        step's (the others run the unmeasured graphs). :meth:`metrics` reads them.

      model: the module the parameters belong to (optional): names them in messages and
        checkpoints where ``params`` does not, gives parameters of ndim ≥ 3 their module's matrix
        view (conv weights flattened, any other a stack of matrices), and, on DTensor parameters,
        lets ``gradient_accumulation_steps > 1`` pause FSDP2's gradient sync.
      strategy, wire_dtype, num_buckets, overlap, process_group, inflight_bytes: the distributed
        options, which act once the optimizer holds DTensors (see below and
        :class:`muon_fn.fsdp.FSDPMuonOptimizer`): ``strategy`` ``"owner"`` (default) or
        ``"replicate"``; ``wire_dtype`` of the rows on the wire (``None``: the parameters');
        ``num_buckets`` exchanges per step (at least; default 4); ``overlap`` (default ``False``)
        starts each bucket's exchange during backward; ``process_group`` for plain parameters;
        ``inflight_bytes`` the bytes a rank holds at once for the exchange (default 8 MiB;
        ``None``: no bound). Kept in :attr:`distributed_options` (:mod:`muon_fn.engine._distributed`).

    Parameters may be plain tensors or DTensors (FSDP2, HSDP, tensor- and expert-parallel
    meshes), given at construction or swapped into ``param_groups`` later: an optimizer holding
    DTensors runs the owner-computes step of :mod:`muon_fn.fsdp` (each matrix orthogonalized
    whole by one rank, equal bit for bit to the single-device step), as
    :class:`muon_fn.fsdp.FSDPMuonOptimizer` does; construction and the first step after a swap
    are then collective. State made before a swap follows its parameter.

    torch's implementation keywords and group keys are accepted where their meaning holds:
    ``foreach`` and ``fused`` (any value: this step is batched and compiled whatever they say),
    ``capturable``, ``differentiable`` and ``maximize`` as ``False``; ``True`` for the last three
    raises ``ValueError`` saying why. Other unknown keywords raise ``TypeError``.

    **Compiling.** The first compile of a process prints one line (the ``"muon_fn"`` logger, on
    stderr where logging is not configured; ``logging.getLogger("muon_fn").setLevel(logging.WARNING)``
    silences it). Where compiling is impossible (no working C++ compiler, a Python that Dynamo
    does not support) the step runs eagerly after one ``RuntimeWarning``; ``MUON_FN_COMPILE=0``
    in the environment turns the default off. ``torch.compile(opt.step)`` runs (the step is
    already compiled); with ``fullgraph=True`` it raises, naming ``compile=``. When ``verify``
    finds a graph that fails, its inputs are restored; on the CPU under inductor it is then
    recompiled with ``cpp.simdlen=256`` (added to any ``options`` in ``compile=``) and checked
    again, and runs eagerly if that fails too (no second warning). With ``mode=`` in
    ``compile=``, a backend other than inductor, or a device other than the CPU, the failing
    signature runs eagerly at once. Only that signature falls back; the check costs one eager
    run and two copies of a bucket's inputs, once per signature.

    **Non-finite gradients and faults.** Under ``"skip"`` the transform sees the skipped step's
    gradients as zeros (no iteration or solver meets the inf or nan) and the first skip warns,
    naming the parameters (on a GPU at the next step, once the flag's copy has arrived: no
    sync); under ``"error"`` the steps that raised count in ``nonfinite_steps`` too. With
    ``gradient_accumulation_steps``, a micro-batch with a non-finite gradient that is not the
    window's last raises at once under ``"error"`` and is not accumulated, while ``"skip"``
    skips the whole window at its last micro-batch. Under ``"skip"`` and ``"error"`` the step
    also guards what it writes: finite gradients that give a non-finite update or state (a
    miscompiled graph, an overflow) are an optimizer fault and nothing non-finite is written.
    For a transform of whole matrices (Muon, NorMuon, AdaMuon, SSO, an ``"auto"`` group's AdamW
    part) the bucket's parameters and state keep every bit; for an elementwise one (TritonMuon
    without ``layerwise_norm``, an ``"adamw"`` group) each faulty element keeps its value (with
    ``state_bits`` 8 or 4 the bucket is kept whole). The first fault warns, naming the
    parameters; each is counted on the device in :attr:`optimizer_faults` and
    ``metrics()["optimizer_faults"]``. ``None`` checks nothing: a NaN or inf is applied with the
    rest, as torch.optim does.

    **State** is stored in torch's format, exactly the transform's state
    (``state[p]["momentum_buffer"]`` for Muon, as torch.optim.Muon; ``"step"``, ``"exp_avg"``,
    ``"exp_avg_sq"`` for AdamW; plain tensors, no NamedTuples). With
    ``gradient_accumulation_steps`` > 1 the state exists from construction, so
    ``torch.distributed.checkpoint``'s state-initializing step never counts as a micro-batch; the
    gradients accumulated inside a window are state (``"grad_accumulator"``), and a state_dict
    saved inside a window without them is refused on load, naming the window. A parameter
    swapped for one of another shape is refused, naming it, before anything changes.

    **Telemetry.** ``metrics=True`` or ``k`` computes the figures of :func:`muon_fn.with_metrics`
    inside the step's graphs and keeps them on the device; :meth:`metrics` reads them back in one
    transfer as a flat ``{name: float}`` dict. They change no bit of the step and are not part of
    ``state_dict()``; ``measured_step`` (None before the first) and ``metrics_every`` are
    host-side numbers, so asking whether there are new figures costs nothing. Names:

    - per unit: ``"<param>/<figure>"`` (``"<param>[j]/<figure>"`` for unit j of an expert stack
      or head view), ``<param>`` the parameter's name (from ``named_parameters()`` or
      ``param_names``), else ``#i``, its position among the optimizer's parameters (its id in
      ``state_dict()``): ``grad_rms``, ``momentum_rms``, ``update_rms``, ``weight_rms``,
      ``effective_lr``, ``decay``, ``ortho_residual``, ``row_scale_range``, ``sso_*``;
    - per group (its ``algorithm`` where no other group has it, else ``group<i>``: an ``"auto"``
      group, or two groups of one algorithm): ``grad_norm``, ``momentum_norm``, ``update_norm``,
      ``weight_norm``, ``skipped`` (only with ``nonfinite`` not None; 1.0: the step was skipped,
      its figures are the zeroed step's, its ``grad_rms`` shows the inf or nan), and for
      ``grad_rms``, ``update_rms``, ``ortho_residual``, ``row_scale_range`` and ``sso_residual``
      the largest value under ``<figure>_max`` and again under ``<figure>_max@<param>``, naming
      the unit;
    - ``qk_clip/max_logit`` and ``qk_clip/clipped_heads`` with ``qk_clip=``;
    - ``step``: the measured step's number, counted by this optimizer object (an optimizer that
      loads a state_dict counts from 1 again);
    - ``optimizer_faults``: the optimizer faults so far (as the property).

    With ``gradient_accumulation_steps=k`` a step is a window of k calls: its gradient figures
    are those of the window's mean gradient, the one the step applies.
    """

    _extra_scalar_keys: tuple[str, ...] = ()
    # True for classes that run the distributed executor on any parameters (muon_fn.fsdp's: plain
    # tensors are replicated ones); the others run it once they hold a DTensor.
    _always_distributed = False

    def __init__(
        self,
        params: Iterable[Any],
        tx_or_factory: GradientTransformation | Factory,
        defaults: Mapping[str, Any] | None = None,
        *,
        gradient_accumulation_steps: int = 1,
        nonfinite: str | None = "skip",
        compile: _compile.CompileOption = True,
        bucket_size: int | None = None,
        metrics: bool | int = False,
        atomic: bool = False,
        verify: bool = True,
        model: nn.Module | None = None,
        strategy: str = DEFAULTS.strategy,
        wire_dtype: torch.dtype | None = DEFAULTS.wire_dtype,
        num_buckets: int = DEFAULTS.num_buckets,
        overlap: bool = DEFAULTS.overlap,
        process_group: Any = DEFAULTS.process_group,
        inflight_bytes: int | None = DEFAULTS.inflight_bytes,
        **kwargs: Any,
    ) -> None:
        options = DistributedOptions(strategy, wire_dtype, num_buckets, overlap, process_group, inflight_bytes)
        self.distributed_options = options.checked()
        _checks.not_a_module(params, takes_model=not self._always_distributed)
        implementation = _checks.implementation_keywords(kwargs)
        _checks.unexpected_keywords(type(self).__name__, kwargs)
        self._know_model(model)
        _checks.boolean("atomic", atomic)
        _checks.boolean("verify", verify)
        self.atomic, self.verify = atomic, verify
        self._metrics_every, self._applied_steps = check_metrics(metrics), 0
        if isinstance(tx_or_factory, GradientTransformation):
            self._factory: Factory = lambda hyper, _tx=tx_or_factory: _tx
        elif callable(tx_or_factory):
            self._factory = tx_or_factory
        else:
            raise TypeError(
                "tx_or_factory must be a GradientTransformation or a function of the group's "
                f"hyperparameters, got {type(tx_or_factory).__name__}"
            )
        _checks.positive_int("gradient_accumulation_steps", gradient_accumulation_steps)
        _checks.one_of("nonfinite", nonfinite, NONFINITE_POLICIES)
        if bucket_size is not None:
            _checks.positive_int("bucket_size", bucket_size)
        self.nonfinite = nonfinite
        self._compile_options = _compile.resolve(compile)
        self._bucket_size = bucket_size
        self._scalar_keys = SCALAR_KEYS | frozenset(self._extra_scalar_keys)
        self._runtimes: list[GroupRuntime] = []
        self._nonfinite_count: torch.Tensor | None = None
        self.last_step: StepReport | None = None
        defaults = dict(defaults or {})
        defaults.setdefault("gradient_accumulation_steps", gradient_accumulation_steps)
        defaults.update(implementation)  # kept in every group, as torch's optimizers keep them
        self._executor: Executor = LocalExecutor(self)
        super().__init__(params, defaults)
        self._check_groups()
        if self._always_distributed or _placement.holds_dtensors(self.param_groups):
            _placement.distribute(self)  # the owner-computes executor of muon_fn.fsdp

    # ----------------------------------------------------------------------- copies
    # torch's Optimizer pickles only defaults, state and param_groups; the configuration below
    # travels too, so copy.deepcopy and pickle give an optimizer that steps like the original.
    # Compiled steps, scalar tensors and transforms are caches, rebuilt on the copy's first use.
    _CONFIG = ("distributed_options", "nonfinite", "_factory", "_compile_options", "_bucket_size", "_scalar_keys",
               "_nonfinite_count", "last_step", "split", "_built", "_metrics_every", "_applied_steps",
               "atomic", "verify", "_fault_count", "_model")

    def __getstate__(self) -> dict[str, Any]:
        if getattr(self, "distributed_options", DEFAULTS).process_group is not None:
            raise TypeError(f"cannot copy a {type(self).__name__} built with process_group=: a process "
                            "group cannot be copied; build a new optimizer instead")
        state = super().__getstate__()
        state.update({k: self.__dict__[k] for k in self._CONFIG if k in self.__dict__})
        executor = self._executor.getstate()
        if executor is not None:  # a copy runs on an executor like this one's (see __setstate__)
            state["_executor_state"] = executor
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # torch's __setstate__ adds ``differentiable`` to the defaults, which add_param_group
        # would then copy into every new group (and the checks refuse as a foreign key): keep
        # the defaults as they were.
        defaults = state.get("defaults", self.__dict__.get("defaults", {}))
        torch_added = "differentiable" not in defaults
        super().__setstate__(state)  # torch's load_state_dict calls it too: keep the caches then
        if torch_added:
            self.defaults.pop("differentiable", None)
        if len(self.__dict__.get("_runtimes", ())) != len(self.param_groups):
            self._runtimes = [GroupRuntime() for _ in self.param_groups]
        if "_placement" not in self.__dict__:  # a copy: parameter identities are its own
            self._know_model(self.__dict__.get("_model"))
            self._placement = _placement.Placement(self.param_groups)
        if "_executor" not in self.__dict__:  # a copy: laid out again, as the original was
            self._executor = LocalExecutor(self)
            executor = self.__dict__.pop("_executor_state", None)
            if executor is not None:
                _placement.distribute(self, None, executor)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's ``zero_grad`` (after the executor's hook: the distributed one first drains an
        exchange started by a backward without a step)."""
        self._executor.before_zero_grad()
        super().zero_grad(set_to_none)

    # ----------------------------------------------------------------------- groups
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group``, refusing a parameter listed twice (in the group or in
        another group), a key that looks like a misspelled hyperparameter, complex or integer
        parameters and invalid hyperparameters, each naming the parameter or key. A refused
        group is not added."""
        self._executor.check_new_group()
        if isinstance(param_group, dict) and "params" in param_group:
            _checks.listed_once(param_group, self.param_groups)
            _checks.misspelled_keys(param_group, self._hyperparameters(), type(self).__name__, ADAPTER_KEYS)
        super().add_param_group(param_group)
        try:
            self._accept_group(self.param_groups[-1])
            if len(self._runtimes) == len(self.param_groups) and "_built" in self.__dict__:
                self._check_groups()
        except BaseException:
            self.param_groups.pop()
            del self._runtimes[len(self.param_groups):]
            raise

    def _check_groups(self) -> None:
        """Hook for subclasses: checks across the param groups, once they are all there (at the
        end of construction, then at every ``add_param_group``)."""
        self.__dict__["_built"] = True
        self._placement = _placement.Placement(self.param_groups)

    def _hyperparameters(self) -> set[str]:
        """The hyperparameters a param group of this optimizer may set."""
        return set(self.defaults)

    def _accept_group(self, group: dict[str, Any]) -> None:
        group.setdefault("micro_step", 0)
        self._check_param_types(group)
        self._validate_group(group)
        self._runtimes.append(GroupRuntime())
        self._dry_run(len(self.param_groups) - 1)
        if group["gradient_accumulation_steps"] > 1:
            self._initial_state(len(self.param_groups) - 1)

    def _rebuild_group(self, index: int) -> None:
        """Group ``index``'s transforms and buckets made anew (its parameters were swapped)."""
        self._runtimes[index] = GroupRuntime()
        self._dry_run(index)

    def _check_param_types(self, group: dict[str, Any]) -> None:
        for p in group["params"]:
            if torch.is_complex(p):
                raise ValueError(f"muon_fn does not support complex parameters, got {self._name(group, p)}")
            if not p.is_floating_point():
                raise ValueError(f"muon_fn optimizes floating-point parameters only, got {self._name(group, p)} "
                                 f"with dtype {p.dtype}")

    def _initial_state(self, index: int) -> None:
        """Group ``index``'s state now (see :meth:`_local_initial_state`), as the executor makes it."""
        self._executor.initial_state(index)

    def _local_initial_state(self, index: int) -> None:
        """Create the transforms' state of group ``index`` now, not at its first update. Done for
        groups with gradient accumulation: torch.distributed.checkpoint initializes an optimizer
        that has no state by a step with zero gradients at lr = 0, which would count as the
        window's first micro-batch (and leave only an accumulator as the state to load into).
        Parameters still on the meta device (materialized later) get theirs at the first update;
        DTensor parameters get theirs from the distributed step, which lays them out."""
        group, rt = self.param_groups[index], self._runtime(index)
        for bucket in rt.buckets:
            params = tuple(group["params"][i] for i in bucket.indices)
            if not any(p.is_meta or _placement.is_dtensor(p) for p in params):
                _, fresh = self._bucket_state(rt.variants[bucket.variant].tx, bucket, params)
                for p, st in zip(params, fresh or ()):
                    if st:  # a parameter without state gets no entry (as torch's optimizers)
                        self.state[p].update(st)

    def _validate_group(self, group: dict[str, Any]) -> None:
        """Check a group's hyperparameters (subclasses add theirs): the per-step scalars ``lr`` and
        ``momentum`` in torch's wording, and every tensor value 1-element (it becomes a 0-d
        tensor for the transform)."""
        _checks.implementation_group_keys(group)
        if "lr" in group:
            _checks.learning_rate(group["lr"])
        if "momentum" in group:
            _checks.momentum_value(group["momentum"])
        for key, value in group.items():
            if isinstance(value, torch.Tensor) and key != "params" and value.numel() != 1:
                raise ValueError(f"Tensor {key} must be 1-element, got shape {tuple(value.shape)}")

    def _derived_scalars(self, group: dict[str, Any], scalars: dict[str, torch.Tensor]) -> None:
        """Hook for subclasses: refresh per-step scalars computed from the group's on the device
        (written into ``scalars``, passed to the factory like ``lr``)."""

    def _param_options(self, group: dict[str, Any]) -> list[dict[str, Any]]:
        """Hook for subclasses: per parameter of ``group``, static hyperparameters that override
        the group's (e.g. a matrix view). Parameters with equal options share a transform, built
        by the factory from the group's hyperparameters with them; none by default."""
        return [{} for _ in group["params"]]

    def _param_names(self, group: dict[str, Any]) -> list[str | None]:
        """The names of the group's parameters: its ``param_names``, else the model's names (see
        ``model=``); None where unknown."""
        names = group.get("param_names")
        return list(names) if names else [self.__dict__.get("_names", {}).get(id(p)) for p in group["params"]]

    def _name(self, group: dict[str, Any], p: torch.Tensor) -> str:
        idx = next(i for i, q in enumerate(group["params"]) if q is p)
        name = self._param_names(group)[idx]
        return repr(name) if name is not None else f"#{idx} of shape {tuple(p.shape)}"

    # ----------------------------------------------------------------------- transforms
    def _hyper(self, group: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        scalars, static = {}, {}
        for k, v in group.items():
            if k in ADAPTER_KEYS:
                continue
            if isinstance(v, torch.Tensor) or k in self._scalar_keys:
                scalars[k] = v
            else:
                static[k] = v
        return scalars, tuple(sorted((k, repr(v)) for k, v in static.items()))

    def _runtime(self, index: int) -> GroupRuntime:
        """The group's runtime with its scalars refreshed (rebuilt if a static value changed)."""
        group, rt = self.param_groups[index], self._runtimes[index]
        scalars, static_key = self._hyper(group)
        for k, v in scalars.items():
            t = rt.scalars.get(k)
            if t is None:
                dtype = torch.float64 if group["params"][0].dtype == torch.float64 else torch.float32
                rt.scalars[k] = t = torch.zeros((), dtype=dtype, device=group["params"][0].device)
                rt.variants = []
            if isinstance(v, torch.Tensor):
                t.copy_(v.detach().reshape(()))
            else:
                t.fill_(v)
        self._derived_scalars(group, rt.scalars)
        if not rt.variants or static_key != rt.static_key:
            self._build(group, rt, static_key)
        return rt

    def _build(self, group: dict[str, Any], rt: GroupRuntime, static_key: Any) -> None:
        hyper, params = self._group_hyper(group, rt), group["params"]
        per_param = self._param_options(group)
        options = variants(per_param)
        rt.static_key, rt.variants, rt.buckets = static_key, [], []
        self._forget_figures(next(i for i, g in enumerate(self.param_groups) if g is group))
        rt.variant_of = tuple(options.index(o) for o in per_param)
        for v, opts in enumerate(options):
            tx = self._factory({**hyper, **opts})
            what = f"{type(self).__name__}'s step"
            compile_options = _compile.for_scope(self._compile_options, info(tx).scope, params[0].device)
            steps = {(write, measure): _compile.PerSignature(bucket_step(tx, write=write, measure=measure),
                                                              compile_options, what, verify=self.verify,
                                                              compared=without_figures)
                     for write in (False, True) for measure in (False, True)}
            rt.variants.append(_Variant(opts, tx, steps))
            members = [i for i, w in enumerate(rt.variant_of) if w == v]
            mine = [params[i] for i in members]
            def limit(same: list[torch.Tensor], among: list[torch.Tensor]) -> int:
                return _execution.bucket_limit(same, self._bucket_size, among)

            for b in buckets(mine, limit if info(tx).leafwise else None):
                indices = tuple(members[k] for k in b)
                meta = self._executor.meta([params[i] for i in indices])
                leaves = tuple(_metrics.leaf_of(params[i], opts.get("matrix_view", "flatten")) for i in indices)
                rt.buckets.append(_Bucket(indices, _state.build_layout(tx.init(meta), len(indices)), v, leaves))
        self._executor.built(rt)

    @staticmethod
    def _group_hyper(group: dict[str, Any], rt: GroupRuntime) -> dict[str, Any]:
        """What the factory is called with: the group's hyperparameters, per-step scalars as the
        runtime's 0-d tensors."""
        hyper = {k: v for k, v in group.items() if k not in ADAPTER_KEYS}
        hyper.update(rt.scalars)
        hyper["_names"] = group.get("param_names")
        return hyper

    def _matrix_flops(self, group: dict[str, Any], shape: tuple[int, ...]) -> int:
        """GEMM FLOPs of one matrix's matrix step in ``group``, for the distributed step's
        ``last_step_stats["ns_flops"]`` (0 unless the class knows its algorithm's count)."""
        return 0

    def _dry_run(self, index: int) -> None:
        """Trace one update of the whole group on meta tensors (each variant's transform on its
        parameters), so shape errors surface at construction, naming the parameter. The traced
        transforms are built from meta copies of the per-step scalars: nothing real takes part,
        whatever device the parameters live on (torch lets a 0-d CPU tensor meet a meta one, but
        not a CUDA one)."""
        rt = self._runtime(index)
        group = self.param_groups[index]
        params = self._executor.meta(group["params"])
        hyper = meta_scalars(self._group_hyper(group, rt))
        with torch.no_grad():
            for v, variant in enumerate(rt.variants):
                tx = self._factory({**hyper, **variant.options})
                self._trace(group, tx, params, [i for i, w in enumerate(rt.variant_of) if w == v])

    def _trace(self, group: dict[str, Any], tx: GradientTransformation, params: tuple, mine: list[int]) -> None:
        """``tx.update`` of the parameters at ``mine`` (the others missing); a ``ValueError``
        names the parameter that fails alone."""
        def only(indices):
            return tuple(q if i in indices else None for i, q in enumerate(params))

        try:  # a variant's transform sees its own parameters only (a head view fits no others)
            tx.update(only(set(mine)), tx.init(only(set(mine))), params)
        except ValueError as error:
            for i in mine:
                try:
                    tx.update(only({i}), tx.init(only({i})), params)
                except ValueError:
                    raise ValueError(f"parameter {self._name(group, group['params'][i])}: {error}") from None
            raise

    # ----------------------------------------------------------------------- checkpoints
    def describe(self) -> str:
        """A table of the parameter groups, their transforms and buckets (on DTensors: which
        transform each parameter gets and who computes each matrix)."""
        if self._executor.distributed:
            return self._distributed_attribute("describe")()
        lines = []
        for index, group in enumerate(self.param_groups):
            rt = self._runtime(index)
            head = f"group {index}: {len(group['params'])} params in {len(rt.buckets)} buckets, "
            if len(rt.variants) == 1:
                lines.append(head + repr(rt.variants[0].tx))
                continue
            lines.append(head + f"{len(rt.variants)} transforms")
            for v, variant in enumerate(rt.variants):
                names = [self._name(group, p) for p, w in zip(group["params"], rt.variant_of) if w == v]
                shown = ", ".join(f"{k}={value!r}" for k, value in variant.options.items())
                lines.append(f"  {shown} for {', '.join(names)}: " + repr(variant.tx).replace("\n", "\n  "))
        return "\n".join(lines)


def variants(options: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The distinct per-parameter options, in order of first appearance."""
    distinct: list[dict[str, Any]] = []
    for o in options:
        if o not in distinct:
            distinct.append(o)
    return distinct


def meta_scalars(hyper: dict[str, Any]) -> dict[str, Any]:
    """``hyper`` with every tensor value replaced by an empty meta tensor of its shape and dtype:
    what a construction-time trace builds its transform from."""
    return {k: torch.empty_like(v, device="meta") if isinstance(v, torch.Tensor) else v
            for k, v in hyper.items()}
