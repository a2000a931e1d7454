"""Every rank of a W = 2 FSDP2 job with a muon_fn optimizer exits with code 0, whatever its end.

This is a regression test for an abort at interpreter exit: "terminate called without an active
exception", SIGABRT, exit code -6. Gloo's worker thread holds a collective's tensors until just
after the work completes, and ``wait()`` may return before that. When the worker drops the
reference that takes a tensor's count to 1 (its Python object's own), or to 0, torch >= 2.10 makes
the worker take the GIL. If the interpreter is finalizing by then, Python ends the thread with
``pthread_exit``, and the unwind aborts the process. Two fixes in ``muon_fn.distributed``:
``Kept`` keeps one more reference to each tensor of the optimizer's own collectives until the
backend has let go of it, so their last reference is dropped on the main thread; and
``settle_at_exit`` (an atexit handler) waits for gloo's workers to let go of any other
collective's tensors before the interpreter finalizes. The job that still aborted with ``Kept``
alone ends with ``torch.distributed.checkpoint.save``, whose last collective is a
``broadcast_object_list`` (gdb on the core: ``~AsyncBroadcastWork``, ``decref_pyobject``,
``take_gil``, ``pthread_exit``, ``std::terminate``).

How it runs: a launcher process (this file, run as a script) imports torch once, then forks the
two ranks of each run. Each rank is a whole interpreter that runs a user's script: it builds a
tiny fully_shard model and an optimizer, takes two steps, maybe saves a checkpoint with DCP,
maybe calls ``destroy_process_group()``, and exits normally with the model and the optimizer
still held by a global. The runs cycle through the ends of such a script (:data:`JOBS`), half of
them the one that aborted. The launcher collects the exit codes.

To make the race likely, each rank stresses its last collectives (see ``_stress``). Its main
thread and gloo's worker threads share one CPU, and the workers run at SCHED_IDLE, so they let go
of the tensors late. During exit, a global's destructor sleeps for a moment, so a worker that
still owes a release runs then. Without the stress, the abort is rare.
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

RUNS = 40  # each a W = 2 job, the i-th of kind JOBS[i % len(JOBS)]
W = 2
# (optimizer, checkpoint with DCP after the steps, destroy_process_group() before the exit): a
# user's MuonOptimizer(model.parameters()) on the DTensors, which torchrun scripts often end
# without destroy_process_group(), and FSDPMuonOptimizer with overlap=True (its dedicated group).
JOBS = (
    ("muon", True, False),
    ("muon", False, False),
    ("muon", True, True),
    ("fsdp-overlap", False, True),
)
CONCURRENT = 2  # runs at a time
STEPS = 2
RUN_TIMEOUT_S = 60.0  # CONCURRENT runs (all their ranks), killed past it
JOB_TIMEOUT_S = 600.0  # the whole launcher
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


def _rank(rank: int, store: str, job: tuple[str, bool, bool], checkpoint: str, slot: int) -> None:
    """One rank of a run, from init to the end of a user's script."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.nn as nn
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    from muon_fn import MuonOptimizer
    from muon_fn.fsdp import FSDPMuonOptimizer

    optimizer, save, destroy = job
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=W,
        timeout=timedelta(seconds=30),
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    if optimizer == "muon":
        opt = MuonOptimizer(model.parameters(), lr=0.02, compile=False)
    else:
        opt = FSDPMuonOptimizer(model, lr=0.02, compile=False, overlap=True)
    for step in range(STEPS):
        model(torch.randn(4, 8)).square().mean().backward()
        if (
            step == STEPS - 1
        ):  # the last step's collectives (and the checkpoint's): the ones before the exit
            # First a pause, during which gloo lets go of the backward's own collectives
            # (FSDP2's reduce-scatter), which come long before the exit in a real job.
            time.sleep(0.05)
            _stress(slot)
        opt.step()
        opt.zero_grad()
    if save:
        model_state, optim_state = get_state_dict(model, opt)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=checkpoint)
    if destroy:
        dist.destroy_process_group()
    # and the interpreter exits, as a user's script does: the model and the optimizer (with the
    # process groups they hold) are its globals, which die during interpreter finalization
    _GLOBALS.extend([model, opt, _Pause()])


# ---------------------------------------------------------------------------- the launcher
def _launch(runs: int, workdir: Path) -> dict:
    """Fork the ranks of ``runs`` runs, CONCURRENT runs at a time. Returns each run's exit codes
    (a negative code is a signal, ``None`` a rank killed past the deadline), or
    ``{"child": True}`` in a forked rank, which then ends the script."""
    # imported once, before forking
    import torch.distributed.checkpoint
    import torch.distributed.checkpoint.state_dict  # noqa: F401

    import muon_fn.distributed._adopt  # noqa: F401

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
                    _rank(
                        rank,
                        str(workdir / f"store{i}"),
                        JOBS[i % len(JOBS)],
                        str(workdir / f"checkpoint{i}"),
                        slot=i - first,
                    )
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
def test_every_rank_exits_cleanly(tmp_path):
    """RUNS runs × W ranks, of every kind of JOBS: every rank exits with code 0."""
    out = tmp_path / "codes.json"
    log = tmp_path / "launcher.log"
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, __file__, str(RUNS), str(tmp_path), str(out)],
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every rank it forked
            proc.wait()
    text = log.read_text()
    assert out.exists(), (
        f"the launcher wrote no exit codes (rc {proc.returncode}); output:\n{text[-4000:]}"
    )
    codes = json.loads(out.read_text())["codes"]
    assert len(codes) == RUNS
    bad = [(i, JOBS[i % len(JOBS)], c) for i, c in enumerate(codes) if c != [0] * W]
    assert not bad, (
        f"{len(bad)} of {RUNS} runs had a rank exit non-zero (run, job, codes per rank; -6 = "
        f"SIGABRT, None = killed past {RUN_TIMEOUT_S}s): {bad}\noutput:\n{text[-4000:]}"
    )


if __name__ == "__main__":  # the launcher: RUNS WORKDIR OUT
    result = _launch(int(sys.argv[1]), Path(sys.argv[2]))
    if "codes" in result:
        Path(sys.argv[3]).write_text(json.dumps(result))
