"""The wait at exit for gloo's worker threads: registered (``atexit``) when the exchange module is
imported, so that no process that ran a distributed step aborts at exit.

The exchange module's collectives release their tensors on the main thread (its ``Kept``),
but a collective someone else posts just before the exit hands the worker tensors whose Python
objects the caller drops at once: torch.distributed.checkpoint.save ends with a
broadcast_object_list (all_gather_object and FSDP2's collectives are alike). A core of such an
abort (gdb): pt_gloo_runloop, ~AsyncBroadcastWork, TensorImpl::decref_pyobject, take_gil,
pthread_exit, std::terminate. Atexit handlers run before the interpreter starts finalizing, while
a thread may still take the GIL; this one sleeps, the
GIL released, until every gloo worker thread of the process is blocked and stays so between two
looks (a worker owing a release is runnable, or wakes as soon as the GIL is free). A worker
blocked inside a collective counts as settled: the wait is milliseconds, SETTLE_TIMEOUT_S at most.
"""

from __future__ import annotations

import atexit
import os
import time

SETTLE_TIMEOUT_S = 2.0
_GLOO_WORKER = "pt_gloo_runloop"  # the name ProcessGroupGloo gives its worker threads


def _gloo_workers() -> dict[str, tuple[str, str, str]]:
    """Per gloo worker thread of this process, its scheduler state and context-switch counts
    (Linux ``/proc``; empty elsewhere)."""
    workers: dict[str, tuple[str, str, str]] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return workers
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != _GLOO_WORKER:
                    continue
            with open(f"/proc/self/task/{tid}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
            workers[tid] = (status["State"].split()[0], status["voluntary_ctxt_switches"].strip(),
                            status["nonvoluntary_ctxt_switches"].strip())
        except (OSError, KeyError, IndexError):  # the thread is gone
            continue
    return workers


def settle_at_exit(timeout_s: float = SETTLE_TIMEOUT_S) -> None:
    """Wait until no gloo worker thread of this process is still letting go of a collective's
    tensors (see above); returns at once where there is none."""
    last = _gloo_workers()
    deadline = time.monotonic() + timeout_s
    while last and time.monotonic() < deadline:
        time.sleep(0.002)
        now = _gloo_workers()
        if now == last and all(state == "S" for state, _, _ in now.values()):
            return
        last = now


atexit.register(settle_at_exit)
