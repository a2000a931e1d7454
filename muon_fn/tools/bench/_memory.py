"""Memory of an optimizer: persistent state bytes, and the peak transient memory of one step,
counted two ways.

**State** (:func:`state_bytes`): the bytes of the tensors in ``optimizer.state``, torch's
optimizers and muon_fn's alike (momentum buffers, AdamW moments and step counts, low-bit codes
and their scales).

**Peak of a step**: what the step holds at its highest point on top of what existed before it
(parameters, gradients, state). muon_fn keeps scratch tensors for its CPU iteration between
steps; both measures free them before the step (:func:`muon_fn.orthogonalization.clear_scratch`),
so the peak includes them.

- :func:`peak_step_bytes`, torch's allocator: on CUDA ``torch.cuda.max_memory_allocated`` over
  the step (after ``torch.cuda.reset_peak_memory_stats``) minus the bytes allocated before. On the
  CPU torch's profiler with ``profile_memory=True``: every allocation and free of torch's CPU
  allocator during the step, in time order, summed; the peak of that running sum. This counts
  every tensor (eager ops and inductor's generated code allocate through that allocator) but not
  memory that BLAS or OpenMP allocate themselves (GEMM packing buffers), nor Python objects.
  Other devices: not measured.
- :func:`resident_step_bytes`, the resident set (CPU): the peak resident set size during the step
  (the kernel's ``VmHWM``, reset to the current size by writing ``5`` to
  ``/proc/self/clear_refs`` just before) less the resident size before it (``VmRSS``). It counts
  everything the step allocates, torch's tensors, BLAS buffers and Python objects, in 4 KiB
  pages (the kernel's counters are exact to a few hundred KiB). It is only meaningful in a process
  started with :data:`RESIDENT_ENV`, three settings of glibc's allocator:

  - ``MALLOC_MMAP_THRESHOLD_=65536``: every block of 64 KiB or more is its own ``mmap``, returned
    to the kernel when freed, so freed buffers leave the resident set (glibc's default threshold
    rises to 32 MiB as large blocks are freed; freed blocks then stay resident in its heap, and a
    step reusing them would not show);
  - ``MALLOC_TRIM_THRESHOLD_=65536``: freed memory at the top of the heap is returned too;
  - ``MALLOC_PERTURB_=1``: every block is filled when allocated, so it is resident from its
    allocation, as allocated memory is on CUDA, not from its first write. (Otherwise a buffer
    allocated before the step's highest point and first written after it would not count: one
    bucket's Newton–Schulz result on gpt2-small, 4.5 MiB.)

  Before the step Python's garbage is collected and glibc's free heap pages are returned
  (``malloc_trim(0)``).

Measured so, the two agree on the CPU: the resident peak is the allocator's plus what torch's
allocator does not see, Python objects and small heap blocks, a fraction of a MiB
(:mod:`muon_fn.tools.bench._memory_table`).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import os
import sys
from typing import Any
from collections.abc import Callable, Iterator

import torch

from muon_fn.orthogonalization import clear_scratch
from .._device import synchronize
from muon_fn.engine import is_dtensor

PEAK_METHODS = {"cuda": "torch.cuda.max_memory_allocated", "cpu": "torch.profiler CPU allocator events"}
RESIDENT_METHOD = ("peak resident set (VmHWM after clear_refs) less VmRSS; glibc: mmap threshold 64 KiB, "
                   "blocks filled when allocated")
# glibc's allocator settings (read at process start) under which a block is resident from its
# allocation to its free, and no longer (module docstring).
RESIDENT_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536", "MALLOC_PERTURB_": "1"}
_CLEAR_REFS = "/proc/self/clear_refs"


def state_bytes(opt: Any, key: str | None = None) -> int:
    """Bytes of the tensors in ``opt.state`` (persistent optimizer state) that this process holds
    (of a DTensor, its local shard); only ``key`` if given."""
    if opt is None:
        return 0
    local = [v.to_local() if is_dtensor(v) else v for s in opt.state.values() for k, v in s.items()
             if isinstance(v, torch.Tensor) and (key is None or k == key)]
    return sum(v.numel() * v.element_size() for v in local)


def peak_step_bytes(step: Callable[[], Any], device: torch.device) -> int | None:
    """Peak bytes ``step()`` allocates above what was allocated before it, by torch's allocator
    (see the module docstring for how), or ``None`` on a device where it is not measured. Runs
    ``step`` once."""
    clear_scratch()
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


def resident_measurable() -> bool:
    """Whether :func:`resident_step_bytes` measures in this process: Linux's peak-resident reset
    is writable and the process was started with :data:`RESIDENT_ENV`."""
    return (sys.platform.startswith("linux") and os.access(_CLEAR_REFS, os.W_OK)
            and all(os.environ.get(k) == v for k, v in RESIDENT_ENV.items()))


def resident_step_bytes(step: Callable[[], Any], device: torch.device) -> int | None:
    """Peak resident bytes of ``step()`` above the resident set before it (see the module
    docstring), or ``None`` where it is not measured (off the CPU, or
    :func:`resident_measurable` is false). Runs ``step`` once."""
    if device.type != "cpu" or not resident_measurable():
        return None
    clear_scratch()
    _release_freed()
    with open(_CLEAR_REFS, "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = _status_bytes("VmRSS")
    step()
    return max(_status_bytes("VmHWM") - before, 0)


def _status_bytes(key: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def _release_freed() -> None:
    """Collect Python's garbage and return glibc's free heap pages to the kernel."""
    gc.collect()
    libc = ctypes.util.find_library("c")
    if libc is not None:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(libc).malloc_trim(0)


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
