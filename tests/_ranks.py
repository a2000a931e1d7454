"""Helpers of the distributed test jobs: a free port, and W rank processes under one deadline.

A job runs its test file as a script, one process per rank; ``run_ranks`` starts them, waits
until the deadline, kills what is left (each rank in its own process group, so nothing it spawned
survives) and returns what the ranks printed, so a mismatch or a hang fails instead of blocking.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for ``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ranks(NamedTuple):
    """A started job (:func:`start_ranks`)."""

    procs: list
    files: list
    logs: Path
    deadline: float
    timeout_s: float


def start_ranks(script: str, w: int, args: list[str], logs: Path, timeout_s: float) -> Ranks:
    """Start ``script W RANK *args`` for each of the W ranks; :func:`finish_ranks` waits for them
    until ``timeout_s`` after now."""
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    files = [open(logs / f"rank{r}.log", "w") for r in range(w)]  # noqa: SIM115  closed when the ranks end
    procs = [
        subprocess.Popen(
            [sys.executable, script, str(w), str(r), *args],
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for r, f in enumerate(files)
    ]
    return Ranks(procs, files, logs, time.monotonic() + timeout_s, timeout_s)


def finish_ranks(ranks: Ranks) -> str:
    """Wait for a started job until its deadline, kill what is left (each rank in its own process
    group, so nothing it spawned survives) and return the ranks' output, rank 0 first."""
    timed_out = False
    for proc in ranks.procs:
        try:
            proc.wait(timeout=max(0.0, ranks.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
    for proc, f in zip(ranks.procs, ranks.files):
        if proc.poll() is None:
            os.killpg(proc.pid, 9)  # the rank's own process group
            proc.wait()
        f.close()
    text = "".join((ranks.logs / f"rank{r}.log").read_text() for r in range(len(ranks.procs)))
    return (f"TIMEOUT after {ranks.timeout_s}s\n" if timed_out else "") + text


def run_ranks(script: str, w: int, args: list[str], logs: Path, timeout_s: float) -> str:
    """Run ``script W RANK *args`` for each of the W ranks and wait at most ``timeout_s`` for
    all of them; a job past it is killed. Returns the ranks' output, rank 0 first."""
    return finish_ranks(start_ranks(script, w, args, logs, timeout_s))


def run_checks(checks: dict, rank: int, w: int, out: str) -> None:
    """One rank of a job: run every check (a callable returning a JSON-able value) with gloo
    (collective timeout 60 s), each followed by a barrier, and write every rank's results
    (``{"ok", "value"}`` or ``{"ok": False, "error"}`` per check, rank 0 first) to ``out``."""
    import json
    import traceback
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=w, timeout=timedelta(seconds=60))
    results = {}
    for name, fn in checks.items():
        t0 = time.perf_counter()
        try:
            results[name] = {"ok": True, "value": fn()}
        except Exception:  # reported to pytest
            results[name] = {"ok": False, "error": traceback.format_exc(limit=8)}
        print(
            f"[W={w} rank {rank}] {name}: {'ok' if results[name]['ok'] else 'FAIL'} "
            f"({time.perf_counter() - t0:.1f}s)",
            flush=True,
        )
        if not results[name]["ok"]:
            print(results[name]["error"], flush=True)
        dist.barrier()
    gathered = [None] * w
    dist.all_gather_object(gathered, results)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered, default=str))
    dist.barrier()
    dist.destroy_process_group()


def job_results(
    script: str, w: int, logs: Path, timeout_s: float, args: Sequence[str] = ()
) -> tuple[dict, str]:
    """Run the job ``script`` at world size ``w`` (its ranks write under ``logs``; ``args`` follow
    the results file on each rank's command line): the merged results of its checks
    (:func:`merge_ranks`; ``{}`` if it wrote none) and the tail of its output."""
    return start_job(script, w, logs, timeout_s, args)()


def start_job(
    script: str, w: int, logs: Path, timeout_s: float, args: Sequence[str] = ()
) -> Callable[..., tuple[dict, str]]:
    """:func:`job_results` started now, running in the background while the caller goes on: the
    returned function waits for it (at most until ``timeout_s`` after the start) and gives its
    results; ``results(stop=True)`` kills what is still running at once."""
    import json

    out = str(logs / "results.json")
    ranks = start_ranks(script, w, [out, *args], logs, timeout_s)

    def results(stop: bool = False) -> tuple[dict, str]:
        log = finish_ranks(ranks._replace(deadline=time.monotonic()) if stop else ranks)
        merged = json.loads(Path(out).read_text()) if os.path.exists(out) else None
        return (merge_ranks(merged) if merged else {}), log[-4000:]

    return results


def job_runner(
    script: str,
    prefix: str,
    tmp_path_factory,
    timeout_s: float,
    *,
    args: Sequence[str] = (),
    order: Sequence[int] = (),
) -> Callable[[int], tuple[dict, str]]:
    """A module fixture's value: ``get(w)`` gives :func:`job_results` at world size ``w``, run on
    first use, after the world sizes before ``w`` in ``order`` (a job that saves what a later one
    loads)."""
    done: dict[int, tuple[dict, str]] = {}

    def get(w: int) -> tuple[dict, str]:
        for v in (*order[: order.index(w)], w) if w in order else (w,):
            if v not in done:
                done[v] = job_results(
                    script, v, tmp_path_factory.mktemp(f"{prefix}_w{v}"), timeout_s, args
                )
        return done[w]

    return get


def assert_check(results: tuple[dict, str], w: int, name: str) -> None:
    """The check ``name`` of a job's results ran and passed on every rank."""
    merged, log = results
    assert merged, f"the W={w} job wrote no results; its output:\n{log}"
    assert name in merged, f"check {name} did not run at W={w}; output:\n{log}"
    assert merged[name]["ok"], merged[name]["error"]


def rank_main(checks_for) -> None:
    """The ``__main__`` of a job file run as one rank (``W RANK OUT``): its checks
    (``checks_for(W)``) through :func:`run_checks`, then exit at once."""
    w, rank, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    sys.path.insert(0, str(Path(__file__).parent))
    run_checks(checks_for(w), rank, w, out)
    sys.stdout.flush()
    os._exit(0)


def merge_ranks(ranks: list[dict]) -> dict:
    """Per check of :func:`run_checks`' output, over the ranks: ``ok`` (on every rank), ``error``
    (each failing rank's) and ``values`` (each rank's)."""
    out = {}
    for name in ranks[0]:
        per_rank = [r[name] for r in ranks]
        bad = [f"rank {k}: {x['error']}" for k, x in enumerate(per_rank) if not x["ok"]]
        out[name] = {
            "ok": not bad,
            "error": "\n".join(bad),
            "values": [x.get("value") for x in per_rank],
        }
    return out
