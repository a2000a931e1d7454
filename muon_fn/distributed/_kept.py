"""A collective's CPU tensors, released by the thread that posted it, never by the backend's
worker thread (:class:`Kept`): :mod:`._exchange` keeps every tensor it hands a collective."""

from __future__ import annotations

import time
import warnings

import torch

# Why a collective's tensors are kept (torch >= 2.10, gloo). A tensor's Python object owns one
# reference to the C++ tensor, and every C++ holder owns one more. The thread that drops the count
# from 2 to 1 (or to 0, once the Python object is gone) takes the GIL. Gloo's worker thread
# (``pt_gloo_runloop``) holds a collective's tensors until just after it completes the work, and
# ``wait()`` can return first. If the worker drops the last reference but one, it takes the GIL.
# If the interpreter is finalizing by then, Python ends the thread (``pthread_exit``). The unwind
# reaches a noexcept destructor, and std::terminate aborts the process ("terminate called without
# an active exception", exit code -6). That happens after the user's ``destroy_process_group()``,
# when the exit follows a step's last collective within milliseconds. So this thread keeps one
# more reference to each tensor (a view of it), from before the collective is posted until the
# backend has let go. The worker then never drops the last reference but one; this thread does.
KEEP_TIMEOUT_S = 10.0  # a backend that holds the tensors longer: warn, and keep no more
_keeping = hasattr(torch.Tensor, "_use_count")


class Kept:
    """The CPU tensors about to be handed to one collective, each with an extra reference held
    here (a view of it) until :meth:`release`. They must not be views themselves (a view of a
    view references the first one's base, not it)."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        assert not any(t._is_view() for t in tensors), "Kept: a collective's tensor is a view"
        self.tensors = [t for t in tensors if _keeping and t.device.type == "cpu"]
        self.views = [t.view(t.shape) for t in self.tensors]
        # with the view, before the collective (_use_count: torch's, not in its stubs)
        self.counts = [t._use_count() for t in self.tensors]  # type: ignore[attr-defined]

    def release(self) -> None:
        """After the collective completed and its work handle was dropped: wait until the backend
        holds none of the tensors, then drop the views (on this thread). Sleeping releases the
        GIL and the CPU to the worker thread that still holds them."""
        global _keeping
        # A count of 1 is a view without a reference to its base (inference mode): nothing kept.
        held = [(t, c) for t, c in zip(self.tensors, self.counts) if c > 1]
        deadline, pause = time.monotonic() + KEEP_TIMEOUT_S, 0.0
        while any(t._use_count() > c for t, c in held):  # type: ignore[attr-defined]
            if time.monotonic() > deadline:
                _keeping = False
                warnings.warn(f"muon_fn: the backend still held a collective's tensors {KEEP_TIMEOUT_S:.0f} s after "
                              "it completed; no longer waiting for that (the process may abort at exit)",
                              RuntimeWarning, stacklevel=3)
                break
            time.sleep(pause)
            pause = min(2 * pause + 1e-5, 1e-3)
        self.tensors, self.views = [], []
