"""A compiled graph checked where it runs: the first run of a graph signature is compared with the
same function run eagerly on copies of its inputs (:func:`first_run`).

A compiled graph is only as right as the compiler on the machine that built it: GCC 12 at
``-O3`` with ``-mtune=generic`` (what it makes of ``-march=native`` on a CPU newer than itself,
e.g. Intel Emerald Rapids) miscompiles inductor's bf16 tile transpose, and a compiled step then
writes NaN where eager is right. So the first time a signature runs, the compiled function runs
on the real inputs and its eager self on a copy of them; the results (what it returns, and every
input it wrote in place) must agree within :func:`tolerance`. If they do not, the real inputs are
restored from a backup, one warning names the graph, the compiler and what to do, and the caller
runs that signature with safe compiler options or eagerly. ``verify=False`` on the optimizers
turns the check off.

The bound. The same function compiled and eager differs only by rounding: inductor fuses and
reorders fp32 arithmetic (relative differences of a few fp32 ulps), which may flip the rounding
of a value cast to the bf16 iteration dtype, and a solver (SSO's λ) may stop elsewhere within its
tolerance. Measured for every optimizer class, one step from the same state (tall, wide and
square buckets of 1 and 4 matrices, fp32 parameters, 32- and 8-bit state; a 2-core Xeon with
AMX): the change a parameter or state tensor receives differs by at most 5e-6 of its size, except
through SSO's λ solve, 8.5e-3 with the bf16 iteration (8.4e-5 with fp32); a miscompiled graph by
0.3 to infinity. A result passes if, per tensor, ``‖compiled − eager‖ ≤ RELATIVE·‖eager − before‖
+ ULPS·eps(dtype)·‖eager‖``: RELATIVE = 0.05 (6x the largest spread), plus a few ulps of the
tensor's own dtype for the rounding of ``p + u``. 0-d tensors (counters, flags, solver figures)
are compared for finiteness only.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from . import tree as _tree

RELATIVE = 0.05  # of the change a tensor receives: 6x the largest measured spread (module doc)
ULPS = 4.0  # of the tensor's own dtype, relative to its size: the rounding of p + u


class Verdict(NamedTuple):
    """The comparison of one compiled run with eager."""

    ok: bool
    conclusive: bool  # False: eager changed nothing (a skipped step), nothing was compared
    worst: float  # the largest deviation found, in units of its tolerance
    detail: str  # which tensor deviated, and how


def first_run(compiled: Callable[..., Any], eager: Callable[..., Any], args: tuple,
              compared: Callable[[Any], Any] | None = None) -> tuple[Any, Verdict]:
    """Run ``compiled(*args)`` on the real inputs and ``eager`` on a copy of them; return the
    compiled result and how it compares: every input written in place, and of the result what
    ``compared(result)`` selects (default: all of it; telemetry, whose solver figures may stop
    anywhere within their tolerance, is left out by the callers). If it fails, the real inputs
    are restored to their values before the call (the result must then be discarded)."""
    backup = _copy(args)
    mirror = _copy(args)
    result = compiled(*args)
    expected = eager(*mirror)
    select = compared or (lambda r: r)
    verdict = worse(compare(select(result), select(expected)), compare(args, mirror, backup))
    if not verdict.ok:
        _restore(args, backup)
    return result, verdict


def compare(got: Any, expected: Any, before: Any = None) -> Verdict:
    """``got`` against ``expected`` tensor by tensor (:func:`tolerance`); ``before``: what
    in-place arguments held before the call (same structure), or ``None`` for returned values."""
    got_leaves, exp_leaves = _tree.tree_leaves(got), _tree.tree_leaves(expected)
    if len(got_leaves) != len(exp_leaves):
        return Verdict(False, True, float("inf"), "the compiled graph returned a different structure")
    before_leaves = [None] * len(exp_leaves) if before is None else _tree.tree_leaves(before)
    worst, detail, changed = 0.0, "", False
    for i, (c, e, b) in enumerate(zip(got_leaves, exp_leaves, before_leaves)):
        if not isinstance(e, torch.Tensor):
            continue
        if not isinstance(c, torch.Tensor):
            return Verdict(False, True, float("inf"), f"tensor {i}: missing from the compiled result")
        ratio, why, moved = _deviation(c, e, b)
        changed = changed or moved
        if ratio > worst:
            worst, detail = ratio, f"tensor {i} of shape {tuple(e.shape)} ({e.dtype}): {why}"
    return Verdict(worst <= 1.0, changed, worst, detail)


def worse(a: Verdict, b: Verdict) -> Verdict:
    """Both comparisons at once: failed if either failed, conclusive if either compared a change."""
    top = a if a.worst >= b.worst else b
    return Verdict(a.ok and b.ok, a.conclusive or b.conclusive, top.worst, top.detail)


def _deviation(c: torch.Tensor, e: torch.Tensor, b: torch.Tensor | None) -> tuple[float, str, bool]:
    """``(deviation in units of the tolerance, why, whether eager changed or produced it)``."""
    if c.shape != e.shape:
        return float("inf"), f"shape {tuple(c.shape)} instead of {tuple(e.shape)}", True
    e64, c64 = e.detach().double(), c.detach().double()
    base = torch.zeros_like(e64) if b is None else b.detach().double()
    moved = bool(((e64 != base) & ~(e64.isnan() & base.isnan())).any())  # NaN in, NaN out: unchanged
    finite = torch.isfinite(e64)
    if not torch.equal(torch.isfinite(c64), finite):
        return float("inf"), "not finite where eager's result is (or the other way round)", moved
    if e.ndim == 0:  # a counter, flag or solver figure (SSO's λ, |h|): only its finiteness is compared
        return 0.0, "", moved
    if not finite.all():
        c64, e64, base = c64[finite], e64[finite], base[finite]
    diff = float((c64 - e64).norm())
    if diff == 0.0:
        return 0.0, "", moved
    return diff / tolerance(e, float((e64 - base).norm()), float(e64.norm())), \
        f"off by {diff:.3g} where the change is {float((e64 - base).norm()):.3g}", moved


def tolerance(e: torch.Tensor, change: float, size: float) -> float:
    """How far a compiled tensor may be from eager's ``e`` (Frobenius): a fraction of the change
    the call made to it, plus a few ulps of its dtype (module doc)."""
    eps = torch.finfo(e.dtype).eps if e.is_floating_point() else 0.0
    return RELATIVE * change + ULPS * eps * size + 1e-30


def _copy(tree: Any) -> Any:
    """A copy of every tensor of ``tree`` (strides kept), other leaves as they are."""
    return _tree.tree_map(lambda t: t.detach().clone(memory_format=torch.preserve_format)
                          if isinstance(t, torch.Tensor) else t, tree)


def _restore(tree: Any, backup: Any) -> None:
    for t, b in zip(_tree.tree_leaves(tree), _tree.tree_leaves(backup)):
        if isinstance(t, torch.Tensor):
            with torch.no_grad():
                t.copy_(b)


# ---------------------------------------------------------------------- what to tell the user
@functools.cache
def compiler() -> str:
    """The host's C++ compiler as inductor runs it on the CPU: version, what ``-march=native``
    resolves to (``march``, ``mtune``), and ``TORCHINDUCTOR_CPP_MARCH`` if set."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or "c++"
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=10).stdout
        target = subprocess.run([cxx, "-march=native", "-Q", "--help=target"], capture_output=True, text=True,
                                timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return f"{cxx} (not runnable here)"
    first = version.splitlines()[0] if version else cxx
    tuned = dict(re.findall(r"^\s*-(march|mtune)=\s+(\S+)", target, flags=re.M))
    native = ", ".join(f"-{k}={v}" for k, v in tuned.items())
    forced = os.environ.get("TORCHINDUCTOR_CPP_MARCH")
    return f"{first}" + (f" (-march=native: {native})" if native else "") + \
        (f", TORCHINDUCTOR_CPP_MARCH={forced}" if forced else "")


def message(what: str, verdict: Verdict, device: torch.device, fallback: str) -> str:
    """The warning for a graph that failed its check."""
    where = f"the host compiler {compiler()}" if device.type == "cpu" else f"torch {torch.__version__} on {device}"
    return (f"muon_fn: the compiled graph of {what} gave a wrong result on this machine ({verdict.detail}; "
            f"{verdict.worst:.3g}x the tolerance) while the same step run eagerly is right. The compiler is at "
            f"fault ({where}, torch {torch.__version__}); parameters were left as they were, and this graph now "
            f"runs {fallback}. On Intel CPUs with GCC 12, TORCHINDUCTOR_CPP_MARCH=sapphirerapids (or a GCC >= 13) "
            "fixes the known case; compile=False runs every step eagerly; verify=False turns this check off. "
            "See docs/faq.md, 'Compiled graphs are checked where they run'.")
