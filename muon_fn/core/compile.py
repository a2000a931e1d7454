"""Compilation: ``compile_update`` for the functional core, and the compiled-by-default rule the
adapters follow (one ``fullgraph=True`` graph per signature, eager with one warning where
compiling is impossible).

``compile=True`` (every adapter's default) means ``torch.compile(fullgraph=True, dynamic=False)``
with inductor; a dict passes more ``torch.compile`` options (e.g. ``{"backend": "eager"}``; never
``dynamic=True``, see :func:`options`); ``False`` runs eager. Torch's on-disk caches (inductor's FX
graph cache, AOTAutograd's) stay on, so a second process starts warm. The
environment variable ``MUON_FN_COMPILE=0`` turns the default off process-wide (as
``TORCH_COMPILE_DISABLE`` does for torch) — for debugging, and for test suites that do not test
compilation.
"""

from __future__ import annotations

import inspect
import os
import sys
import types
import warnings
from collections.abc import Callable, Hashable, Mapping
from typing import Any, cast

import torch

from . import verify as _verify
from .base import MATRIX, GradientTransformation, info, with_info
from .log import notice
from .tree import tree_leaves

CompileOption = bool | Mapping[str, Any]


def compile_update(tx: GradientTransformation, **torch_compile_kwargs: Any) -> GradientTransformation:
    """``tx`` with ``update`` wrapped in ``torch.compile(fullgraph=True, dynamic=False, **kwargs)``.

    Pass per-step scalars (lr, ...) as 0-d tensors — build the transform with a 0-d tensor and
    update it in place — so changing them never recompiles. Float hyperparameters (betas, eps, NS
    coefficients) are constants of the graph (see :func:`options`). ``init`` stays eager.
    """
    compiled = torch.compile(tx.update, **options(torch_compile_kwargs))
    name = getattr(tx.update, "_muon_fn_repr", None)
    if name is not None:
        cast(Any, compiled)._muon_fn_repr = f"compile_update({name})"  # torch.compile returns a function
    return with_info(GradientTransformation(tx.init, compiled), **info(tx)._asdict())


def check_option(compile: Any) -> None:
    """``compile`` is a bool or a mapping of ``torch.compile`` options."""
    if not isinstance(compile, (bool, Mapping)):
        raise TypeError(f"compile must be a bool or a dict of torch.compile options, got {compile!r}")


def resolve(compile: CompileOption) -> dict[str, Any] | None:
    """The ``torch.compile`` keyword arguments ``compile`` asks for, or None for eager."""
    check_option(compile)
    if compile is False or (compile is True and os.environ.get("MUON_FN_COMPILE", "1") == "0"):
        return None
    if not torch._dynamo.is_dynamo_supported():  # e.g. a Python version Dynamo does not support yet
        _fall_back(RuntimeError(f"torch.compile does not support Python {sys.version.split()[0]}"))
        return None
    return options(compile if isinstance(compile, Mapping) else {})


# What every muon_fn compile passes unless told otherwise.
DEFAULTS = {"fullgraph": True, "dynamic": False}
_DYNAMIC_REFUSED = (
    "Invalid dynamic: {!r} (muon_fn compiles with dynamic=False. A dynamic compile turns float "
    "hyperparameters such as betas or eps into symbolic values, and torch's on-disk compile caches "
    "(2.13 and 2.14 measured) can then serve a graph that burned in another value: a silently wrong "
    "update; pytorch/pytorch#194976 and #197889. Per-step scalars (lr, momentum, schedules) are "
    "0-d tensors, so a static graph never recompiles for them; see docs/faq.md, 'Compilation')")


def options(torch_compile_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The ``torch.compile`` keyword arguments muon_fn uses: :data:`DEFAULTS`, then the caller's.

    ``dynamic`` must stay ``False``: floats of the update (closed-over betas, eps, NS coefficients)
    are then constants of the Dynamo graph, hence part of every cache key, and no compile does
    dynamic-shape work. With Dynamo's default (automatic dynamic), a second compile of the same
    code with another float makes that float a SymFloat; torch 2.13 burns the value of a use it
    cannot tensorify (``b2 ** count``) into the AOT graph behind a guard that AOTAutograd's cache
    drops, under a key that is the same for every value, so a later process (or a compile after
    ``torch._dynamo.reset()``) is served the old constant. ``ValueError`` for ``dynamic=True`` or
    ``None``.
    """
    kwargs = {**DEFAULTS, **torch_compile_kwargs}
    if kwargs["dynamic"] is not False:
        raise ValueError(_DYNAMIC_REFUSED.format(kwargs["dynamic"]))
    return kwargs


def not_traced(reason: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``torch.compiler.disable`` with ``reason`` (shown by ``fullgraph=True`` errors): the
    adapters' step code runs its own compiled graphs.

    Decorating imports no ``torch._dynamo`` (``torch.compiler.disable`` would, at import of
    muon_fn: about 2 s): torch's own lazy form, ``torch._disable_dynamo``, applies the disable on
    the first call, and Dynamo skips its wrapper (torch's ``torch._compile`` module is on Dynamo's
    skip list). The wrapper carries the marks ``torch.compiler.disable`` sets, so an outer
    ``fullgraph=True`` compile fails with ``reason``, as it does on the disabled function itself."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        lazy = getattr(torch, "_disable_dynamo", None)
        if lazy is None:  # a torch without the lazy form: disable now
            if "reason" in inspect.signature(torch.compiler.disable).parameters:
                return torch.compiler.disable(fn, reason=reason)
            return torch.compiler.disable(fn)
        wrapped = lazy(fn)
        wrapped._torchdynamo_disable = True
        wrapped._torchdynamo_disable_msg = reason
        return wrapped

    return decorate


_UNUSABLE: Exception | None = None  # the first compiler failure of this process, if any


def _fall_back(error: Exception) -> None:
    """Warn once and remember: every later default compile in this process runs eagerly."""
    global _UNUSABLE
    if _UNUSABLE is None:
        _UNUSABLE = error
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        warnings.warn(
            f"muon_fn: torch.compile is not usable here ({type(error).__name__}: {reason}); the "
            "optimizer step runs eagerly (same results, slower). Pass compile=False to choose eager "
            "and silence this warning.", RuntimeWarning, stacklevel=4)


# Inductor's options for the graph of a transform of whole matrices on the CPU. There the update
# comes from the iteration's result and per-row or per-matrix factors (NorMuon's row scales and its
# rescale to ‖U‖_F), and the step's guard reads it once more before it is written: with inductor's
# default (a node read more than 4 times is kept in memory) the update was kept as an fp32 tensor
# of the bucket's size (9 MiB for a 3072×768 matrix); recomputing it from the bf16 result costs no
# measured time (gpt2-small, 2 layers, 1 thread: Muon 0.995x, NorMuon 1.00x the step). Elementwise
# transforms keep the default: recomputing their update made TritonMuonW's step 1.8x slower.
MATRIX_CPU_OPTIONS = {"realize_reads_threshold": 64}


def for_scope(options: dict[str, Any] | None, scope: str | None, device: torch.device) -> dict[str, Any] | None:
    """``options`` for the graph of a transform of ``scope`` on ``device``: with
    :data:`MATRIX_CPU_OPTIONS` for a :data:`~muon_fn.MATRIX` transform on the CPU under inductor
    when the caller gave no ``options`` or ``mode`` of its own; else as they are."""
    if (options is None or scope != MATRIX or torch.device(device).type != "cpu"
            or options.get("backend", "inductor") != "inductor" or "options" in options or "mode" in options):
        return options
    return {**options, "options": dict(MATRIX_CPU_OPTIONS)}


# What a graph that failed its check (muon_fn.core.verify) is compiled with next, on the CPU: 256-bit
# vectors, which avoid the known miscompile (GCC 11-12 at -O3 under -mtune=generic delete stores of
# inductor's 512-bit bf16 tile transpose in its RTL dead-store pass: docs/reports/
# inductor-cpu-bf16-transpose.md); if that also fails, the signature runs eagerly.
SAFE_CPU_OPTIONS = {"cpp.simdlen": 256}


class PerSignature:
    """``fn`` compiled once per signature key, each with a fresh copy of ``fn``'s code object, so
    Dynamo's per-code recompile limit never applies however many signatures there are, and a
    signature seen before never recompiles. ``options=None`` runs ``fn`` eagerly.

    If compiling is impossible (no C++ compiler, an unsupported platform or Python), the first
    failure warns once and every later call runs eagerly: a failed compilation runs nothing, so
    no state has changed when it is retried eagerly.

    ``verify``: the first run of each signature is checked against ``fn`` run eagerly on copies
    of its inputs (:mod:`muon_fn.core.verify`; ``compared`` selects what of the result is compared,
    default all); a graph that fails is recompiled with safe options (inductor on the CPU:
    :data:`SAFE_CPU_OPTIONS`) and checked again, else that signature runs eagerly, with one
    warning. Every later call of a checked signature costs nothing more.
    """

    def __init__(self, fn: Callable[..., Any], options: dict[str, Any] | None,
                 what: str = "the optimizer step", verify: bool = False,
                 compared: Callable[[Any], Any] | None = None) -> None:
        self.fn, self.options, self.what, self.verify, self.compared = fn, options, what, verify, compared
        self.compiled: dict[Hashable, Callable[..., Any]] = {}
        self.checked: set[Hashable] = set()  # signatures whose graph passed its check
        self.safe: set[Hashable] = set()  # signatures compiled with safe options
        self.eager: set[Hashable] = set()  # signatures whose graphs failed: run eagerly

    def __call__(self, key: Hashable, *args: Any) -> Any:
        if self.options is None or key in self.eager or (
                _UNUSABLE is not None and self.options.get("backend", "inductor") == "inductor"):
            return self.fn(*args)
        f = self.compiled.get(key)
        if f is None:
            f = self.compiled[key] = self._compile(self.options)
            _announce(self.what, self.options)
        try:
            if not self.verify or key in self.checked:
                return f(*args)
            return self._first_run(key, f, args)
        except Exception as e:  # the compiler itself failed: nothing ran
            if not _cannot_compile(e):
                raise
            _fall_back(e)
            self.options = None
            return self.fn(*args)

    def _compile(self, options: dict[str, Any]) -> Callable[..., Any]:
        code = self.fn.__code__.replace()
        copy = types.FunctionType(code, self.fn.__globals__, self.fn.__name__, self.fn.__defaults__,
                                  self.fn.__closure__)
        return torch.compile(copy, **options)

    def _first_run(self, key: Hashable, f: Callable[..., Any], args: tuple) -> Any:
        """Run a signature's graph for the first time, checked (class doc)."""
        result, verdict = _verify.first_run(f, self.fn, args, self.compared)
        if verdict.ok:
            if verdict.conclusive:  # a skipped step compares nothing: check the next one
                self.checked.add(key)
            return result
        device = _device_of(args)
        safe = self._safe_options(device)
        if safe is not None and key not in self.safe:
            self.safe.add(key)
            fallback = "compiled with safe options (" + ", ".join(f"{k}={v}" for k, v in SAFE_CPU_OPTIONS.items()) + \
                ") if they pass the same check, else eagerly"
            warnings.warn(_verify.message(self.what, verdict, device, fallback), RuntimeWarning, stacklevel=4)
            self.compiled[key] = self._compile(safe)
            return self(key, *args)
        if key not in self.safe:
            warnings.warn(_verify.message(self.what, verdict, device, "eagerly"), RuntimeWarning, stacklevel=4)
        self.eager.add(key)
        return self.fn(*args)

    def _safe_options(self, device: torch.device) -> dict[str, Any] | None:
        """The options of a recompile after a failed check (None: none known; run eagerly)."""
        compiled = cast("dict[str, Any]", self.options)  # only a compiled first run is checked
        if device.type != "cpu" or compiled.get("backend", "inductor") != "inductor":
            return None
        extra = dict(compiled.get("options") or {})
        if compiled.get("mode") is not None:  # torch.compile takes mode or options, not both
            return None
        return {**compiled, "options": {**extra, **SAFE_CPU_OPTIONS}}


def _device_of(args: tuple) -> torch.device:
    """The device of the first tensor among ``args`` (the CPU if none)."""
    return next((t.device for t in tree_leaves(args) if isinstance(t, torch.Tensor)), torch.device("cpu"))


_ANNOUNCED = False  # the first compile of this process has said what it does


def _announce(what: str, options: dict[str, Any]) -> None:
    """One line, at the first compile of the process (:func:`muon_fn.core.log.notice`)."""
    global _ANNOUNCED
    if _ANNOUNCED:
        return
    _ANNOUNCED = True
    backend = options.get("backend", "inductor")
    backend = backend if isinstance(backend, str) else getattr(backend, "__name__", "a custom backend")
    notice(f"compiling {what} with torch.compile ({backend}) on first use: one graph per bucket shape, "
           "seconds to a minute on a CPU; later processes load them from torch's on-disk cache. "
           "compile=False runs eagerly; logging.getLogger('muon_fn').setLevel(logging.WARNING) silences this.")


def _cannot_compile(error: BaseException) -> bool:
    """Whether ``error`` says this platform cannot compile (no usable C++ compiler), as opposed
    to an error in the update itself, which is raised as is."""
    inner = getattr(error, "inner_exception", None) or error.__cause__ or error
    return bool({type(error).__name__, type(inner).__name__} & {"InvalidCxxCompiler", "CppCompileError"})
