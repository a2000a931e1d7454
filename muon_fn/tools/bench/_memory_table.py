"""The memory table (``muon-fn bench --memory``): each row's persistent state and the peak of one
step, every row, torch's included, measured the same way in a fresh process of its own.

A row's process is started with :data:`~muon_fn.tools.bench._memory.RESIDENT_ENV` (glibc's mmap
threshold fixed at 64 KiB and its trim threshold set, so freed buffers leave the resident set;
every block filled when allocated, so it is resident from its allocation on) and the run's
thread count. It builds the set's parameters and their real gradients (for a model row,
``hybrid`` or ``torch.optim.Muon+AdamW[fused]``, the set's GPT model and one backward pass:
:func:`~muon_fn.tools.bench._problem.gpt_model`) and the row's optimizer, then runs three steps:

1. a first step, not measured: it allocates the state and, for a compiled row, compiles;
2. the resident step: on the CPU the peak resident set during the step less the resident set
   before it (the kernel's ``VmHWM``, reset by writing ``5`` to ``/proc/self/clear_refs``, less
   ``VmRSS``): :func:`~muon_fn.tools.bench._memory.resident_step_bytes`;
3. the allocator step: the peak of torch's allocator above what it held before the step (CPU:
   torch.profiler's allocator events; CUDA: ``torch.cuda.max_memory_allocated`` after
   ``torch.cuda.reset_peak_memory_stats``): :func:`~muon_fn.tools.bench._memory.peak_step_bytes`, the
   same measure as the ``peak MiB`` column of the timed benchmark.

Before each measured step Python's garbage is collected, glibc's free pages are returned and
muon_fn's CPU Newton–Schulz scratch is freed, so the peak includes what the step itself needs.
Per row (bytes in the JSON; MiB = 2**20 bytes, and multiples of the parameters' bytes):

- ``param_bytes``: the parameters the row optimizes (the set's matrices; for a model row every
  parameter of the GPT);
- ``state_bytes``: the tensors in ``optimizer.state`` after the steps (momentum buffers, AdamW
  moments and step counts, low-bit codes and their scales), ``momentum_bytes`` its
  ``momentum_buffer`` entries;
- ``peak_bytes``: the step's transient memory: the resident measure on the CPU, the allocator's on
  CUDA (where the resident set says nothing about device memory);
  ``resident_peak_bytes`` and ``allocated_peak_bytes`` both measures as taken;
- ``total_bytes``: state + peak, the most the optimizer adds to the parameters and gradients;
- ``ratio_to_reference``: total over the reference row's (``torch.optim.Muon``; for the model rows
  ``torch.optim.Muon+AdamW[fused]`` on the same split), when that row ran.

On the CPU the two peaks agree: the resident one is the allocator's plus what torch's allocator
does not see (Python objects, small heap blocks), a fraction of a MiB on the tiny and gpt2-small
sets. The result's ``config.largest_disagreement_bytes`` says how far apart they were in the run.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from typing import Any
from collections.abc import Callable, Sequence

import torch

from .._device import synchronize
from ._memory import RESIDENT_ENV, RESIDENT_METHOD, PEAK_METHODS, peak_step_bytes, resident_step_bytes, state_bytes
from ._problem import SETS, check_cpu_size, check_size, gpt_model, real_gradients
from ._rows import MODEL_REFERENCE, REFERENCE, ROW_SPECS, check_rows, memory_rows
from ._timing import Threads, check_device, check_threads, threads_env

_MIB = 2**20


def benchmark_memory(model_size: str = "tiny", rows: Sequence[str] | None = None, *, layers: int | None = None,
                     lr: float = 0.02, threads: Threads = 1, seed: int = 0, device: torch.device | str | None = None,
                     force: bool = False, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure every row of ``rows`` (default :func:`~muon_fn.tools.bench._rows.memory_rows`) on
    ``model_size`` (its first ``layers`` layers), each in a fresh process (module docstring).

    Returns a JSON-serializable dict: ``config`` and ``rows`` (per row the fields the module
    docstring lists). ``ValueError`` names the first argument it cannot use, before any work.
    """
    rows, device = check_memory_args(model_size, rows, layers, lr, threads, device, force)
    measured = {}
    for r in rows:
        t0 = time.perf_counter()
        measured[r] = _in_fresh_process(r, model_size, layers, lr, seed, device, threads)
        if progress is not None:
            progress(f"{r}: state {measured[r]['state_bytes'] / _MIB:.2f} MiB, peak "
                     f"{_mib(_peak(measured[r]))} MiB ({time.perf_counter() - t0:.0f} s)")
    out_rows = _summarize(measured)
    return {"config": _config(model_size, layers, lr, threads, device, out_rows), "rows": out_rows}


def check_memory_args(model_size: str = "tiny", rows: Sequence[str] | None = None, layers: int | None = None,
                      lr: float = 0.02, threads: Threads = 1, device: Any = None,
                      force: bool = False) -> tuple[list[str], torch.device]:
    """The rows and the device of a :func:`benchmark_memory` call, or ``ValueError`` naming the
    first argument it cannot use (a set too large for the CPU included, unless ``force``)."""
    check_size(model_size, layers)
    if isinstance(lr, bool) or not (isinstance(lr, (int, float)) and lr > 0 and math.isfinite(lr)):
        raise ValueError(f"Invalid lr: {lr!r} (expected a positive finite float)")
    check_threads(threads)
    device = check_device(device)
    rows = check_rows(memory_rows(model_size, device) if rows is None else rows, models=True)
    gpt = sorted(name for name, spec in SETS.items() if spec.kind == "gpt")
    for r in rows:
        if ROW_SPECS[r].model and model_size not in gpt:
            raise ValueError(f"Invalid row: {r!r} on {model_size} (a model row runs on the GPT model of a gpt set: "
                             f"{gpt})")
    if not force:
        check_cpu_size(model_size, layers, device)
    return rows, device


def measure_row(row: str, model_size: str, *, layers: int | None = None, lr: float = 0.02, seed: int = 0,
                device: torch.device | str | None = None) -> dict[str, Any]:
    """This process's measures of ``row``: parameters, state, and the peaks of its second
    (resident) and third (allocator) steps. Run it in a fresh process started with
    :data:`~muon_fn.tools.bench._memory.RESIDENT_ENV` (:func:`benchmark_memory` does)."""
    device = check_device(device)
    spec = ROW_SPECS[row]
    if spec.model:
        target = gpt_model(model_size, layers=layers, seed=seed, device=device)
        params = [p for p in target.parameters() if p.requires_grad]
    else:
        params, grads, _ = real_gradients(model_size, layers=layers, seed=seed, device=device)
        for p, g in zip(params, grads):
            p.grad = g
        target = params
    opt, step = spec.build(target, lr)
    step()  # the state, and the compilation of a compiled row
    synchronize(device)
    resident = resident_step_bytes(step, device)
    allocated = peak_step_bytes(step, device)
    return {"params": sum(p.numel() for p in params), "param_bytes": sum(p.numel() * p.element_size() for p in params),
            "state_bytes": state_bytes(opt), "momentum_bytes": state_bytes(opt, "momentum_buffer"),
            "resident_peak_bytes": resident, "allocated_peak_bytes": allocated}


def _in_fresh_process(row: str, model_size: str, layers: int | None, lr: float, seed: int, device: torch.device,
                      threads: Threads) -> dict[str, Any]:
    """:func:`measure_row` in a new interpreter with :data:`RESIDENT_ENV` and ``threads``."""
    args = {"row": row, "model_size": model_size, "layers": layers, "lr": lr, "seed": seed, "device": str(device)}
    code = f"import sys; from {__name__} import _child; _child(sys.argv[1])"
    env = threads_env(threads, {**os.environ, **RESIDENT_ENV})
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(args)], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the memory process of row {row!r} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _child(args: str) -> None:
    """The fresh process's part: measure one row, print its measures as one JSON line."""
    kwargs = json.loads(args)
    print(json.dumps(measure_row(kwargs.pop("row"), kwargs.pop("model_size"), **kwargs)))


def _peak(m: dict[str, Any]) -> int | None:
    """The step's peak: resident where measured (the CPU), else the allocator's."""
    return m["resident_peak_bytes"] if m["resident_peak_bytes"] is not None else m["allocated_peak_bytes"]


def _summarize(measured: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each row's measures with its peak, total, multiples of its parameters' bytes and the ratio
    of its total to its reference row's."""
    out: dict[str, dict[str, Any]] = {}
    for r, m in measured.items():
        peak = _peak(m)
        total = None if peak is None else m["state_bytes"] + peak
        row = {**m, "peak_bytes": peak, "total_bytes": total}
        for key in ("state", "peak", "total"):
            value = row[f"{key}_bytes"]
            row[f"{key}_over_params"] = None if value is None else value / m["param_bytes"]
        out[r] = row
    for r, row in out.items():
        reference = out.get(MODEL_REFERENCE if ROW_SPECS[r].model else REFERENCE)
        if reference is not None and reference["total_bytes"] and row["total_bytes"] is not None:
            row["reference"] = MODEL_REFERENCE if ROW_SPECS[r].model else REFERENCE
            row["ratio_to_reference"] = row["total_bytes"] / reference["total_bytes"]
    return out


def _config(model_size: str, layers: int | None, lr: float, threads: Threads, device: torch.device,
            rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    both = [abs(v["resident_peak_bytes"] - v["allocated_peak_bytes"]) for v in rows.values()
            if v["resident_peak_bytes"] is not None and v["allocated_peak_bytes"] is not None]
    resident = any(v["resident_peak_bytes"] is not None for v in rows.values())
    return {"model_size": model_size, "layers": check_size(model_size, layers), "lr": lr, "threads": threads,
            "device": str(device), "torch": torch.__version__,
            "peak_method": RESIDENT_METHOD if resident else PEAK_METHODS.get(device.type),
            "allocator_method": PEAK_METHODS.get(device.type),
            "largest_disagreement_bytes": max(both) if both else None}


# ----------------------------------------------------------------------------- table
def format_memory_table(result: dict[str, Any]) -> str:
    """The table of a :func:`benchmark_memory` result: MiB and multiples of the parameters' bytes."""
    cfg, rows = result["config"], result["rows"]
    width = max([30, *(len(r) for r in rows)])
    lines = [f"memory: {cfg['model_size']}, {cfg['layers']} layer(s), {cfg['device']}, {cfg['threads']} thread(s), "
             f"torch {cfg['torch']}; peak: {cfg['peak_method']}",
             f"{'row':{width}s} {'params MiB':>10s} {'state MiB':>10s} {'/params':>7s} {'peak MiB':>9s} "
             f"{'/params':>7s} {'state+peak MiB':>14s} {'/params':>7s} {'/torch':>6s} {'alloc peak MiB':>14s}"]
    for r, v in rows.items():
        lines.append(f"{r:{width}s} {v['param_bytes'] / _MIB:10.2f} {v['state_bytes'] / _MIB:10.2f} "
                     f"{v['state_over_params']:7.3f} {_mib(v['peak_bytes']):>9s} {_num(v['peak_over_params'], 7, 3)} "
                     f"{_mib(v['total_bytes']):>14s} {_num(v['total_over_params'], 7, 3)} "
                     f"{_num(v.get('ratio_to_reference'), 6, 3)} {_mib(v['allocated_peak_bytes']):>14s}")
    gap = cfg.get("largest_disagreement_bytes")
    lines.append("Each row in a fresh process: a first step (state, compilation), then the measured steps. state: "
                 "the tensors in optimizer.state. peak: what one step holds above parameters, gradients and state "
                 f"({cfg['peak_method']}). /params: multiples of the row's parameter bytes. /torch: state+peak over "
                 f"{REFERENCE}'s (model rows: over {MODEL_REFERENCE}'s, on the same split). alloc peak: torch's "
                 f"allocator over the same kind of step ({cfg['allocator_method']}; the timed table's peak MiB)"
                 + ("" if gap is None else f"; it and the resident peak differ by at most {gap / _MIB:.2f} MiB here")
                 + ".")
    return "\n".join(lines)


def _mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / _MIB:.2f}"


def _num(x: float | None, width: int, digits: int) -> str:
    return f"{'-':>{width}s}" if x is None else f"{x:{width}.{digits}f}"
