"""Memory of an optimizer: persistent state bytes, and the peak transient memory of one step.

The peak is what a step allocates on top of what existed before it (parameters, gradients,
state), at its highest point. On CUDA it is ``torch.cuda.max_memory_allocated`` over the step
minus the bytes allocated before. On the CPU it comes from torch's profiler with
``profile_memory=True``: every allocation and free of torch's CPU allocator during the step, in
time order, summed; the peak of that running sum. This counts every tensor (eager ops and
inductor's generated code allocate through that allocator) but not memory that BLAS or OpenMP
allocate themselves (GEMM packing buffers), nor Python objects. Other devices: not measured.
muon_fn keeps scratch tensors for its CPU iteration between steps; they are freed before the
measured step (:func:`muon_fn._newton_schulz.clear_scratch`), so the peak includes them.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Callable, Iterator

import torch

from .. import _newton_schulz
from ._timing import synchronize

PEAK_METHODS = {"cuda": "torch.cuda.max_memory_allocated", "cpu": "torch.profiler CPU allocator events"}


def state_bytes(opt: Any, key: str | None = None) -> int:
    """Bytes of the tensors in ``opt.state`` (persistent optimizer state); only ``key`` if given."""
    if opt is None:
        return 0
    return sum(v.numel() * v.element_size() for s in opt.state.values() for k, v in s.items()
               if isinstance(v, torch.Tensor) and (key is None or k == key))


def peak_step_bytes(step: Callable[[], Any], device: torch.device) -> int | None:
    """Peak bytes ``step()`` allocates above what was allocated before it (see the module
    docstring for how), or ``None`` on a device where it is not measured. Runs ``step`` once."""
    _newton_schulz.clear_scratch()
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    if device.type != "cpu":
        return None
    from torch._C._autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == DeviceType.CPU)
    running = peak = 0
    for _, nbytes in events:
        running += nbytes
        peak = max(peak, running)
    return peak


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence the profiler's own stderr lines (start/stop markers, and a warning about blocks
    allocated before it started, which it rightly leaves out) for the block."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
