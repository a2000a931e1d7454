"""Compile time (``muon-fn bench --compile-time``): the first optimizer step of a fresh process.

For each set, optimizer and execution policy, two processes run one step of a model built from
the set's shapes (:func:`model_for`: the bench set's layers, byte embeddings and a head), one after
the other with one new ``TORCHINDUCTOR_CACHE_DIR``:

- **cold**: the first process, an empty cache directory: Dynamo, AOTAutograd and inductor code
  generation and C++/Triton builds of every graph;
- **warm**: a second process, the same directory: Dynamo traces again, the graphs come from torch's
  FX graph and AOTAutograd caches.

Each reports the seconds of its first ``step()`` (compiling and running it; clocks read after a
device synchronize), of its second (running it only: what the first costs beyond compiling), the
graphs Dynamo compiled and the caches' hits and misses. The compile time of a process is its first
step less its second. On the CPU both
execution policies can run: ``"cpu"`` (the CPU's own) and ``"batched"`` (the GPU's, forced on CPU
tensors: inductor traces the iteration inline, so it is the proxy of a GPU's graphs).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any
from collections.abc import Sequence

import torch

from muon_fn import orthogonalization
from .._device import synchronize
from ._problem import SETS, gpt_model
from ._timing import Threads, check_device, check_threads, threads_env, using_threads

OPTIMIZERS = ("muon", "hybrid")  # MuonOptimizer(model.parameters()), create_hybrid_optimizer(model)
POLICIES = tuple(orthogonalization.POLICIES)
_SEQ = 64


GPT_SETS = tuple(name for name, spec in SETS.items() if spec.kind == "gpt")


def model_for(model_size: str, device: torch.device) -> torch.nn.Module:
    """A byte-level GPT with the set's layers, width and heads (one of :data:`GPT_SETS`): its
    hidden matrices are the bench set's, plus token and position embeddings, LayerNorms and a head."""
    check_args(model_size, OPTIMIZERS[0], POLICIES[0], 1)
    return gpt_model(model_size, device=device, gradients=False)


def first_step(model_size: str, optimizer: str, policy: str, device: torch.device | str = "cpu") -> dict[str, Any]:
    """This process's first compiled step of ``optimizer`` on ``model_size`` under ``policy``:
    seconds, graphs compiled and cache hits/misses (run it in a fresh process)."""
    from torch._dynamo.utils import counters

    from muon_fn.optim import MuonOptimizer, create_hybrid_optimizer

    device = check_device(device)
    model = model_for(model_size, device)
    tokens = torch.randint(0, 256, (2, _SEQ + 1), generator=torch.Generator().manual_seed(0)).to(device)
    model(tokens[:, :-1], tokens[:, 1:])[1].backward()
    with orthogonalization.forced(policy):
        if optimizer == "muon":
            opt = MuonOptimizer(model.parameters(), compile=True)
        else:
            opt = create_hybrid_optimizer(model, compile=True)
        first, second = (_timed_step(opt, device) for _ in range(2))
    return {"first_step_s": first, "second_step_s": second, "graphs": counters["stats"]["unique_graphs"],
            "fxgraph_cache_hit": counters["inductor"]["fxgraph_cache_hit"],
            "fxgraph_cache_miss": counters["inductor"]["fxgraph_cache_miss"],
            "autograd_cache_hit": counters["aot_autograd"]["autograd_cache_hit"],
            "autograd_cache_miss": counters["aot_autograd"]["autograd_cache_miss"]}


def _timed_step(opt: torch.optim.Optimizer, device: torch.device) -> float:
    synchronize(device)
    t0 = time.perf_counter()
    opt.step()
    synchronize(device)
    return time.perf_counter() - t0


def _in_process(model_size: str, optimizer: str, policy: str, device: torch.device, threads: Threads,
                cache: str) -> dict[str, Any]:
    """:func:`first_step` in a new interpreter with ``cache`` as its inductor cache directory."""
    env = threads_env(threads, dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, MUON_FN_COMPILE="1"))
    env.pop("TORCH_COMPILE_DISABLE", None)
    args = [model_size, optimizer, policy, str(device), str(threads)]
    proc = subprocess.run([sys.executable, "-m", __name__, *args], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the compile-time process ({' '.join(args)}) failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(model_size: str, optimizer: str, policy: str, *, device: torch.device | str = "cpu",
            threads: Threads = 1) -> dict[str, Any]:
    """Cold and warm first steps (two processes, one new cache directory) and their ratio."""
    check_args(model_size, optimizer, policy, threads)
    device = check_device(device)
    with tempfile.TemporaryDirectory(prefix="muon_fn_compile_") as cache:
        cold = _in_process(model_size, optimizer, policy, device, threads, cache)
        warm = _in_process(model_size, optimizer, policy, device, threads, cache)
    return {"model_size": model_size, "optimizer": optimizer, "policy": policy, "device": str(device),
            "threads": threads, "cold": cold, "warm": warm,
            "warm_over_cold": warm["first_step_s"] / cold["first_step_s"],
            "warm_compile_over_cold": compile_seconds(warm) / compile_seconds(cold)}


def compile_seconds(run: dict[str, Any]) -> float:
    """What a process's first step cost beyond running the step: first step less second."""
    return max(run["first_step_s"] - run["second_step_s"], 0.0)


def check_args(model_size: str, optimizer: str, policy: str, threads: Threads) -> None:
    """``ValueError`` naming the first invalid argument."""
    if model_size not in GPT_SETS:
        raise ValueError(f"Invalid model_size: {model_size!r} (compile time is measured on the GPT sets: "
                         f"{list(GPT_SETS)})")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"Invalid optimizer: {optimizer!r} (expected one of {list(OPTIMIZERS)})")
    if policy not in POLICIES:
        raise ValueError(f"Invalid policy: {policy!r} (expected one of {list(POLICIES)})")
    check_threads(threads)


def default_policies(device: torch.device) -> tuple[str, ...]:
    """Both policies on the CPU (``"batched"`` forced: the GPU's graphs); a GPU's own elsewhere."""
    return POLICIES if device.type == "cpu" else (orthogonalization.policy(device).name,)


def benchmark_compile_time(sizes: Sequence[str], *, optimizers: Sequence[str] = OPTIMIZERS,
                           policies: Sequence[str] | None = None, device: torch.device | str = "cpu",
                           threads: Threads = 1, log=None) -> list[dict[str, Any]]:
    """:func:`measure` for every set, optimizer and policy (default: :func:`default_policies`)."""
    device = check_device(device)
    rows = []
    for size in sizes:
        for policy in policies or default_policies(device):
            for optimizer in optimizers:
                row = measure(size, optimizer, policy, device=device, threads=threads)
                if log is not None:
                    log(format_compile_row(row))
                rows.append(row)
    return rows


def format_compile_row(r: dict[str, Any]) -> str:
    cold, warm = r["cold"], r["warm"]
    return (f"{r['model_size']:11s} {r['optimizer']:7s} {r['policy']:8s} {cold['first_step_s']:8.1f} "
            f"{warm['first_step_s']:8.1f} {r['warm_over_cold']:9.2f} {cold['second_step_s']:7.2f} "
            f"{compile_seconds(cold):9.1f} {compile_seconds(warm):9.1f} {r['warm_compile_over_cold']:6.2f} "
            f"{cold['graphs']:6d} "
            f"{warm['fxgraph_cache_hit']:>4d}/{warm['fxgraph_cache_hit'] + warm['fxgraph_cache_miss']:<4d} "
            f"{warm['autograd_cache_hit']:>5d}/{warm['autograd_cache_hit'] + warm['autograd_cache_miss']:<4d}")


def format_compile_table(rows: list[dict[str, Any]]) -> str:
    """The table of :func:`benchmark_compile_time`'s rows."""
    head = rows[0] if rows else {"device": "cpu", "threads": 1}
    lines = [f"compile time: first step of a fresh process, torch {torch.__version__}, {head['device']}"
             + (f" ({torch.backends.cpu.get_cpu_capability()})" if head["device"] == "cpu" else "")
             + f", {head['threads']} thread(s)",
             f"{'set':11s} {'opt':7s} {'policy':8s} {'cold s':>8s} {'warm s':>8s} {'warm/cold':>9s} {'step s':>7s} "
             f"{'compile c':>9s} {'compile w':>9s} {'w/c':>6s} {'graphs':>6s} warm hits: fx  aot",
             "cold, warm: first step of the first and the second process (one cache directory); step: a "
             "step without compiling; compile c, w: first step less step"]
    return "\n".join(lines + [format_compile_row(r) for r in rows])


def _main(argv: list[str]) -> None:
    model_size, optimizer, policy, device, threads = argv
    threads_value: Threads = threads if threads == "default" else int(threads)
    with using_threads(threads_value) if threads != "default" else contextlib.nullcontext():
        result = first_step(model_size, optimizer, policy, device)
    print(json.dumps(result))


if __name__ == "__main__":
    _main(sys.argv[1:])
