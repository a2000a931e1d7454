"""Compilation: ``compile_update`` for the functional core, and the compiled-by-default rule the
adapters follow (one ``fullgraph=True`` graph per signature, eager with one warning where
compiling is impossible).

``compile=True`` (every adapter's default) means ``torch.compile(fullgraph=True)`` with inductor;
a dict passes ``torch.compile`` options (e.g. ``{"backend": "eager"}``); ``False`` runs eager. The
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
from collections.abc import Hashable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Callable, Union

import torch
import torch._functorch.config
import torch._inductor.config

from ._base import GradientTransformation, info, with_info

CompileOption = Union[bool, Mapping[str, Any]]


def compile_update(tx: GradientTransformation, **torch_compile_kwargs: Any) -> GradientTransformation:
    """``tx`` with ``update`` wrapped in ``torch.compile(fullgraph=True, **kwargs)``.

    Pass per-step scalars (lr, ...) as 0-d tensors — build the transform with a 0-d tensor and
    update it in place — so changing them never recompiles. ``init`` stays eager.
    """
    kwargs = {"fullgraph": True, **torch_compile_kwargs}
    compiled = torch.compile(tx.update, **kwargs)
    name = getattr(tx.update, "_muon_fn_repr", None)
    if name is not None:
        compiled._muon_fn_repr = f"compile_update({name})"
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
    return {"fullgraph": True, **(dict(compile) if isinstance(compile, Mapping) else {})}


def not_traced(reason: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``torch.compiler.disable`` with ``reason`` (shown by ``fullgraph=True`` errors) where
    this torch accepts one: the adapters' step code runs its own compiled graphs."""
    if "reason" in inspect.signature(torch.compiler.disable).parameters:
        return torch.compiler.disable(reason=reason)
    return torch.compiler.disable


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


class PerSignature:
    """``fn`` compiled once per signature key, each with a fresh copy of ``fn``'s code object, so
    Dynamo's per-code recompile limit never applies however many signatures there are, and a
    signature seen before never recompiles. ``options=None`` runs ``fn`` eagerly.

    If compiling is impossible (no C++ compiler, an unsupported platform or Python), the first
    failure warns once and every later call runs eagerly: a failed compilation runs nothing, so
    no state has changed when it is retried eagerly.
    """

    def __init__(self, fn: Callable[..., Any], options: dict[str, Any] | None) -> None:
        self.fn, self.options = fn, options
        self.compiled: dict[Hashable, Callable[..., Any]] = {}

    def __call__(self, key: Hashable, *args: Any) -> Any:
        if self.options is None or (_UNUSABLE is not None and self.options.get("backend", "inductor") == "inductor"):
            return self.fn(*args)
        f = self.compiled.get(key)
        first = f is None
        if first:
            code = self.fn.__code__.replace()
            copy = types.FunctionType(code, self.fn.__globals__, self.fn.__name__, self.fn.__defaults__,
                                      self.fn.__closure__)
            f = self.compiled[key] = torch.compile(copy, **self.options)
        try:
            if not first:  # compiled already: no config to set (the patch costs ~50 µs a call)
                return f(*args)
            with no_compile_cache():
                return f(*args)
        except Exception as e:  # the compiler itself failed: nothing ran
            if not _cannot_compile(e):
                raise
            _fall_back(e)
            self.options = None
            return self.fn(*args)


@contextmanager
def no_compile_cache() -> Iterator[None]:
    """Compile without torch's on-disk graph caches (inductor's FX graph cache and AOTAutograd's).

    Their keys miss a float of the update: measured on torch 2.13, the hybrid's compiled AdamW
    step built with ``adamw_betas=(0.9, 0.999)`` after one built with ``(0.9, 0.95)`` had run (in
    this process or an earlier one, same cache directory) reused that graph's bias correction
    ``√(1 − β₂ᵗ)`` with β₂ = 0.95: an update √50 ≈ 7.1× too large, silently
    (``tests/test_compile.py::test_compiled_hybrid_does_not_reuse_another_betas_graph``). A
    compile therefore costs its full time in every process. Only the call that compiles a
    signature runs under it.
    """
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        yield


def _cannot_compile(error: BaseException) -> bool:
    """Whether ``error`` says this platform cannot compile (no usable C++ compiler), as opposed
    to an error in the update itself, which is raised as is."""
    inner = getattr(error, "inner_exception", None) or error.__cause__ or error
    return bool({type(error).__name__, type(inner).__name__} & {"InvalidCxxCompiler", "CppCompileError"})
