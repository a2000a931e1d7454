"""Every rank of an FSDPMuonOptimizer job exits with code 0 after the teardown a user writes.

This is a regression test for an abort at interpreter exit: "terminate called without an active
exception", SIGABRT, exit code -6, after ``dist.destroy_process_group()``. Gloo's worker thread
holds a collective's tensors until just after the work completes, and ``wait()`` may return
before that. When the worker drops the reference that takes a tensor's count to 1 (its Python
object's own), or to 0, torch >= 2.10 makes the worker take the GIL. If the interpreter is
finalizing by then, Python ends the thread with ``pthread_exit``, and the unwind aborts the
process. ``muon_fn.fsdp._exchange._Kept`` now keeps one more reference to each tensor until the
backend has let go of it, so the last reference is always dropped on the main thread.

How it runs: a launcher process (this file, run as a script) imports torch once, then forks the
two ranks of each run. Each rank is a whole interpreter: it builds a tiny fully_shard model and
``FSDPMuonOptimizer``, takes two steps, calls ``destroy_process_group()`` and exits normally,
with the model and the optimizer still held by a global. The launcher collects the exit codes.

To make the race likely, each rank stresses the last step (see ``_stress``). Its main thread
and gloo's worker threads share one CPU, and the workers run at SCHED_IDLE, so they let go of
the step's tensors late. During exit, a global's destructor sleeps for a moment, so a worker that
still owes a release runs then. Measured on 2 busy cores: without the fix, 9 and 8 runs of 20
aborted; with it, 0 of 160. Without the stress, the abort is rare.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

RUNS = 20  # each a W = 2 job; overlap alternates False / True
W = 2
CONCURRENT = 2  # runs at a time
STEPS = 2
RUN_TIMEOUT_S = 60.0  # CONCURRENT runs (all their ranks), killed past it
JOB_TIMEOUT_S = 300.0  # the whole launcher
ROOT = Path(__file__).resolve().parents[1]
_GLOBALS: list = []  # a rank's model and optimizer, kept until its interpreter exits


# ---------------------------------------------------------------------------- a rank (forked)
def _stress(slot: int) -> None:
    """Pin this rank's main thread and its gloo worker threads to one CPU. Every rank of a run
    uses the same CPU, the ``slot``-th, so concurrent runs use different ones. Run the workers
    at SCHED_IDLE, or at nice 19 where that is refused, so they run only when no main thread
    can. Does nothing on a system without these calls."""
    if not hasattr(os, "sched_setaffinity") or not os.path.isdir("/proc/self/task"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    cpu = {cpus[slot % len(cpus)]}
    os.sched_setaffinity(0, cpu)
    for tid in os.listdir("/proc/self/task"):
        try:
            if Path(f"/proc/self/task/{tid}/comm").read_text().strip() != "pt_gloo_runloop":
                continue
            os.sched_setaffinity(int(tid), cpu)
            try:
                os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
            except (AttributeError, OSError):
                os.setpriority(os.PRIO_PROCESS, int(tid), 19)
        except OSError:  # the thread is gone
            continue


class _Pause:
    """A global whose destruction during interpreter finalization sleeps 50 ms with the GIL
    released, as destroying a process group then does. A worker thread that still has a tensor
    to let go of runs then, and takes the GIL if it needs it."""

    def __del__(self) -> None:
        time.sleep(0.05)


def _rank(rank: int, store: str, overlap: bool, slot: int) -> None:
    """One rank of a run, from init to the user's teardown."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard

    from muon_fn.fsdp import FSDPMuonOptimizer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=W,
                            timeout=timedelta(seconds=30))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    opt = FSDPMuonOptimizer(model, lr=0.02, compile=False, overlap=overlap)
    for step in range(STEPS):
        model(torch.randn(4, 8)).square().mean().backward()
        if step == STEPS - 1:  # the last step's collectives: the ones before the exit
            # First a pause, during which gloo lets go of the backward's own collectives
            # (FSDP2's reduce-scatter): those are torch's, not the optimizer's.
            time.sleep(0.05)
            _stress(slot)
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()
    # and the interpreter exits, as a user's script does: the model and the optimizer (with the
    # process groups they hold) are its globals, which die during interpreter finalization
    _GLOBALS.extend([model, opt, _Pause()])


# ---------------------------------------------------------------------------- the launcher
def _launch(runs: int, workdir: Path) -> dict:
    """Fork the ranks of ``runs`` runs, CONCURRENT runs at a time. Returns each run's exit codes
    (a negative code is a signal, ``None`` a rank killed past the deadline), or
    ``{"child": True}`` in a forked rank, which then ends the script."""
    import torch  # noqa: F401  (imported once, before forking)

    import muon_fn.fsdp  # noqa: F401

    gc.freeze()  # the ranks' final collections skip what they inherit: exit in 0.5 s, not 2 s
    codes: list[list[int | None]] = [[None] * W for _ in range(runs)]
    for first in range(0, runs, CONCURRENT):
        pids = {}
        for i in range(first, min(first + CONCURRENT, runs)):
            for rank in range(W):
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:  # a rank: run, then leave main() and end the script as a user's does
                    _rank(rank, str(workdir / f"store{i}"), overlap=bool(i % 2), slot=i - first)
                    return {"child": True}
                pids[pid] = (i, rank)
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while pids and time.monotonic() < deadline:
            for pid, (i, rank) in list(pids.items()):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[i][rank] = os.waitstatus_to_exitcode(status)
                    del pids[pid]
            time.sleep(0.02)
        for pid in pids:  # past the deadline
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    return {"codes": codes}


@pytest.mark.skipif(not hasattr(os, "fork"), reason="forks the ranks")
def test_every_rank_exits_cleanly_after_destroy_process_group(tmp_path):
    """RUNS runs × W ranks: every rank exits with code 0."""
    out = tmp_path / "codes.json"
    log = tmp_path / "launcher.log"
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, __file__, str(RUNS), str(tmp_path), str(out)], env=env,
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every rank it forked
            proc.wait()
    text = log.read_text()
    assert out.exists(), f"the launcher wrote no exit codes (rc {proc.returncode}); output:\n{text[-4000:]}"
    codes = json.loads(out.read_text())["codes"]
    assert len(codes) == RUNS
    bad = [(i, c) for i, c in enumerate(codes) if c != [0] * W]
    assert not bad, (f"{len(bad)} of {RUNS} runs had a rank exit non-zero (run, codes per rank; -6 = "
                     f"SIGABRT, None = killed past {RUN_TIMEOUT_S}s): {bad}\noutput:\n{text[-4000:]}")


if __name__ == "__main__":  # the launcher: RUNS WORKDIR OUT
    result = _launch(int(sys.argv[1]), Path(sys.argv[2]))
    if "codes" in result:
        Path(sys.argv[3]).write_text(json.dumps(result))
