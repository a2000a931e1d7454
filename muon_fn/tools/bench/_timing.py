"""Paired timing: every round times every row back to back, so machine load (shared CPUs swing 2x)
cancels in the per-round ratios; clocks are read after a device synchronize; thread counts."""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import subprocess
import sys
import time
from typing import Any
from collections.abc import Callable, Iterator, Sequence

import torch

from .._device import synchronize

Threads = int | str  # a count, or "default": the count torch picks when nothing sets one


def check_device(device: torch.device | str | None) -> torch.device:
    """``device`` as a ``torch.device`` (default CPU), or ``ValueError`` if torch cannot use it here."""
    try:
        dev = torch.device("cpu" if device is None else device)
        torch.empty(1, device=dev).add_(1)  # CUDA without a GPU or a build without the backend fail here
    except (RuntimeError, AssertionError) as e:
        reason = str(e).splitlines()[0].split(". ")[0]  # torch's first sentence
        raise ValueError(f"Invalid device: {device!r} ({reason})") from None
    if dev.type == "meta":
        raise ValueError(f"Invalid device: {device!r} (meta tensors hold no data to time)")
    return dev


def paired_ratio(times: Sequence[float], reference: Sequence[float]) -> dict[str, Any]:
    """Per-round ratios ``times[k] / reference[k]`` of two rows timed in the same rounds, with
    their median, min and max (the paired figure the benchmarks report; robust to machine load)."""
    if len(times) != len(reference) or not times:
        raise ValueError(f"Invalid rounds: {len(times)} and {len(reference)} (expected the same number, at least 1)")
    rs = [a / b for a, b in zip(times, reference)]
    return {"median": statistics.median(rs), "min": min(rs), "max": max(rs), "per_round": rs}


def paired_rounds(rows: Sequence[str], step: Callable[[str], None], rounds: int, *,
                  device: torch.device, steps_per_round: int = 1,
                  before_round: Callable[[int], None] | None = None,
                  before_row: Callable[[str, int], None] | None = None,
                  after_row: Callable[[str, int, float], None] | None = None) -> dict[str, list[float]]:
    """Seconds per step of ``step(row)`` for every row in each of ``rounds`` rounds.

    Each round runs the rows back to back, the order rotated by one row per round, each row
    ``steps_per_round`` times between two :func:`synchronize` calls. The hooks run outside the
    clock: ``before_round(k)``, ``before_row(row, k)`` and ``after_row(row, k, seconds)``.
    """
    times: dict[str, list[float]] = {r: [] for r in rows}
    rows = list(rows)
    for k in range(rounds):
        if before_round is not None:
            before_round(k)
        for r in rows[k % len(rows):] + rows[:k % len(rows)]:
            if before_row is not None:
                before_row(r, k)
            synchronize(device)
            t0 = time.perf_counter()
            for _ in range(steps_per_round):
                step(r)
            synchronize(device)
            times[r].append((time.perf_counter() - t0) / steps_per_round)
            if after_row is not None:
                after_row(r, k, times[r][-1])
    return times


@functools.cache
def default_threads() -> int:
    """The thread count torch picks when ``OMP_NUM_THREADS`` is unset (its physical cores), asked
    of a fresh interpreter, since this process's count may have been set already."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    try:
        out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                             env=env, capture_output=True, text=True, timeout=120, check=True).stdout
        return int(out.split()[-1])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return os.cpu_count() or 1


def check_threads(threads: Threads) -> Threads:
    """``threads`` if it is a count >= 1 or ``"default"``, else ``ValueError``."""
    if threads != "default" and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"Invalid threads: {threads!r} (expected an integer >= 1 or 'default')")
    return threads


def parse_threads(text: str) -> list[Threads]:
    """``"1,default"`` -> ``[1, "default"]``: comma-separated counts or ``default``."""
    return [check_threads(item if item == "default" else int(item) if item.isdigit() else item)
            for item in (part.strip() for part in text.split(","))]


def threads_env(threads: Threads, env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a child process that runs at ``threads`` (``os.environ`` or ``env``,
    with ``OMP_NUM_THREADS`` set, or unset for ``"default"`` so torch picks its own count)."""
    env = dict(os.environ if env is None else env)
    if check_threads(threads) == "default":
        env.pop("OMP_NUM_THREADS", None)
        env.pop("MKL_NUM_THREADS", None)
    else:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


@contextlib.contextmanager
def using_threads(threads: Threads) -> Iterator[int]:
    """``torch.set_num_threads`` for the block (``"default"``: :func:`default_threads`); yields
    the count, and restores the previous one after."""
    n = default_threads() if check_threads(threads) == "default" else threads
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(old)
