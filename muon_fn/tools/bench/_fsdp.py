"""The FSDP benchmark: owner-computes vs replicate, and torch.optim.Muon on the same DTensors,
on the gpt2-small matrix set (CPU, gloo).

For each world size W, :func:`benchmark_fsdp` spawns W processes, shards 12 × [4 × 768²,
3072×768, 768×3072] with ``fully_shard`` (one block per layer) and times
``FSDPMuonOptimizer.step()`` with ``strategy="owner"`` (fp32 and bf16 on the wire) and
``"replicate"``, paired: each repeat runs every row back to back on the same gradients (the order
rotated by one row per repeat). A step's time is the slowest rank's. The result has the median
step times and their ratio, bytes sent per rank against 2(W−1)/W²·S, and the per-rank
Newton–Schulz FLOPs max/mean. ``muon_fn.fsdp`` is imported only in the spawned ranks.

Unless ``with_torch=False`` two more rows run on two more copies of the model (same initial weights,
same gradients), with torch.optim.Muon's settings (:data:`TORCH_SETTINGS`: its defaults but
``lr=0.02``):

- ``torch.optim.Muon``: ``torch.optim.Muon`` built on the model's matrices after ``fully_shard``
  (DTensors), as a trainer hands them to it: its Newton–Schulz runs through DTensor's ops, every
  rank taking part in every matrix (all-gathers and all-reduces inside each product);
- ``MuonOptimizer[like_torch]``: ``muon_fn.MuonOptimizer(model.parameters(), **TORCH_SETTINGS,
  ns_dtype=..., momentum_kind="ema")`` on the same kind of DTensors, which runs the owner-computes
  step by itself: the same algorithm as the torch row;
- ``MuonOptimizer[like_torch, inflight_bytes=16 MiB]``: the same with that budget of gathered
  matrices (:data:`SMALL_INFLIGHT`; the default is 8 MiB).

Both iterate in ``torch_dtype``: ``"bf16"`` (torch.optim.Muon as shipped, ``ns_dtype=torch.bfloat16``)
or ``"fp32"`` (torch's own iteration with its bf16 cast replaced by fp32,
:func:`muon_fn.tools.train.optimizers.torch_zeropower`, and ``ns_dtype=torch.float32``); ``"auto"``:
bf16 where the CPU has bf16 GEMMs, else fp32 (on an AVX2-only CPU bf16 is emulated and a bf16
timing says nothing). Every row gets its per-repeat ratio to the torch row's step
(``ratio_to_torch``). Each step is also timed in CPU seconds (``cpu_s``: the process's user and
system time over all its threads, gloo's included, the slowest rank's; ``cpu_ratio_to_torch``):
on a shared machine the wall time swings with the other processes' load, and a step that waits
on many collectives loses more to it (each waits for every rank to be scheduled), while CPU time
leaves out the waiting (the time a rank spends blocked on a slower one, too). After the timed
steps and one step per row under torch's profiler (below) the pair's parameters are compared
(``pair``: the largest difference over all ranks, and the tolerance: 1e-5 in fp32, as
tests/test_torch_compat.py; 4e-3 in bf16, where two faithful implementations round apart).

Memory per rank and row (:data:`MEMORY_ROWS`), each row in **a fresh set of W processes** of its
own, started with glibc's allocator set so that freed tensors leave the resident set
(:data:`muon_fn.tools.bench._memory.RESIDENT_ENV`: blocks of 64 KiB or more are their own
``mmap``): the model, the gradients and that row's optimizer alone, two warm-up steps, then one
step measured by the kernel: its peak resident set (``VmHWM`` after writing ``5`` to
``/proc/self/clear_refs``) less the resident set before it
(:func:`muon_fn.tools.bench._memory.resident_step_bytes`): ``peak_bytes``, the step's transient,
everything it allocates (torch's tensors, BLAS buffers, gloo's, Python objects) in one number
that a reviewer can check with ``/proc`` alone. ``state_bytes`` is this rank's bytes of
``optimizer.state`` (local shards of DTensor state). The torch row's collectives are counted in
the timing job (``collectives_per_step``, DTensor's ``CommDebugMode``, one more step).

:func:`benchmark_overlap` (``--overlap``) trains the same matrices through real forward and
backward passes (a residual MLP-style block per layer, ``tokens`` rows per rank) and compares
``overlap=False`` with ``overlap=True``, paired: each repeat runs one iteration of each back to
back, on two identical models. It reports the slowest rank's iteration, backward and step times,
and the exposed communication (``comm_wait_s`` of the step, the only place either variant
waits on the exchange), medians over the repeats.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import statistics
import tempfile
import time
from datetime import timedelta
from typing import Any

from ._timing import paired_ratio

GPT2_LAYER = [(768, 768)] * 4 + [(3072, 768), (768, 3072)]
VARIANTS = (("owner", None, 32), ("owner", "bf16", 32), ("owner", None, 8), ("replicate", None, 32))
TORCH_ROW = "torch.optim.Muon"
LIKE_TORCH_ROW = "MuonOptimizer[like_torch]"
SMALL_INFLIGHT = 16 * 2**20
SMALL_ROW = "MuonOptimizer[like_torch, inflight_bytes=16 MiB]"
# The rows whose step transient is measured, each in a fresh set of processes (fresh RSS).
MEMORY_ROWS = ("owner/fp32", "owner/bf16", "owner/fp32/state8", TORCH_ROW, LIKE_TORCH_ROW, SMALL_ROW)
# torch.optim.Muon's settings spelled out: its defaults, except lr (the pair's; Keller's scale).
TORCH_SETTINGS = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, ns_coefficients=(3.4445, -4.775, 2.0315),
                      eps=1e-7, ns_steps=5, adjust_lr_fn=None)
TORCH_DTYPES = ("auto", "bf16", "fp32")
# The pair's largest parameter difference allowed (tests/test_torch_compat.py's CPU tolerances).
PAIR_TOLERANCE = {"fp32": 1e-5, "bf16": 4e-3}


def _model(layers: int, dim: int):
    import torch.nn as nn

    class Block(nn.Module):
        """One transformer layer's matrices (q, k, v, o, mlp up, mlp down)."""

        def __init__(self, shapes):
            super().__init__()
            self.linears = nn.ModuleList(nn.Linear(n, m, bias=False) for m, n in shapes)

        def forward(self, x):  # unused: the benchmark sets gradients directly
            return x

    class Stack(nn.Module):
        def __init__(self, shapes):
            super().__init__()
            self.blocks = nn.ModuleList(Block(shapes) for _ in range(layers))

        def forward(self, x):
            return x

    scale = dim / 768
    return Stack([(int(m * scale), int(n * scale)) for m, n in GPT2_LAYER])


def _trained_model(layers: int, dim: int):
    """:func:`_model` with a forward that uses every matrix (q, k, v, o; up, down)."""
    import torch

    model = _model(layers, dim)

    def block_forward(self, x):
        q, k, v, o, up, down = self.linears
        x = x + o(q(x) * torch.sigmoid(k(x)) + v(x)) / 4
        return x + down(torch.tanh(up(x))) / 4

    def stack_forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x

    import types

    for block in model.blocks:
        block.forward = types.MethodType(block_forward, block)
    model.forward = types.MethodType(stack_forward, model)
    return model


def _overlap_worker(rank: int, w: int, port: int, cfg: dict[str, Any], out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from muon_fn.fsdp import FSDPMuonOptimizer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=w, timeout=timedelta(seconds=600))
    runs = {}
    for overlap in (False, True):
        torch.manual_seed(0)
        model = _trained_model(cfg["layers"], cfg["dim"])
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        opt = FSDPMuonOptimizer(model, lr=1e-3, method="polar_express", ns_steps=cfg["ns_steps"],
                                num_buckets=cfg["buckets"], overlap=overlap)
        runs["overlap" if overlap else "no_overlap"] = (model, opt)
    gen = torch.Generator().manual_seed(rank)
    dim = runs["overlap"][0].blocks[0].linears[0].in_features
    keys = ("iteration_s", "backward_s", "step_s", "comm_wait_s", "overlapped_buckets")
    rows: dict[str, dict[str, list[float]]] = {name: {k: [] for k in keys} for name in runs}
    for rep in range(cfg["repeats"] + 2):  # the first two rounds warm up (the second overlaps)
        x = torch.randn(cfg["tokens"], dim, generator=gen)
        for name, (model, opt) in runs.items():
            dist.barrier()
            t0 = time.perf_counter()
            loss = model(x).square().mean()
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            t3 = time.perf_counter()
            opt.zero_grad()
            st = opt.last_step_stats
            mine = torch.tensor([t3 - t0, t2 - t1, t3 - t2, st["comm_wait_s"]], dtype=torch.float64)
            dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # the slowest rank's
            if rep >= 2:
                for k, v in zip(keys, mine.tolist() + [st.get("overlapped_buckets", 0)]):
                    rows[name][k].append(v)
    if rank == 0:
        same = all(torch.equal(p.to_local(), q.to_local()) for p, q in
                   zip(runs["no_overlap"][0].parameters(), runs["overlap"][0].parameters()))
        with open(out, "w") as f:
            json.dump({"rows": rows, "bit_identical_rank0": same}, f)
    dist.barrier()
    dist.destroy_process_group()


def benchmark_overlap(world_size: int, *, repeats: int = 5, ns_steps: int = 5, layers: int = 4,
                      dim: int = 512, buckets: int = 4, tokens: int = 1024) -> dict[str, Any]:
    """Spawn ``world_size`` gloo ranks; ``overlap=False`` against ``overlap=True``, paired."""
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cfg = dict(repeats=repeats, ns_steps=ns_steps, layers=layers, dim=dim, buckets=buckets, tokens=tokens)
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "bench.json")
        mp.spawn(_overlap_worker, args=(world_size, _free_port(), cfg, out), nprocs=world_size, join=True)
        with open(out) as f:
            raw = json.load(f)
    med = {name: {k: statistics.median(v) for k, v in row.items()} for name, row in raw["rows"].items()}
    a, b = raw["rows"]["overlap"]["iteration_s"], raw["rows"]["no_overlap"]["iteration_s"]
    return {"world_size": world_size, "config": cfg, "medians": med, "rows": raw["rows"],
            "bit_identical": raw["bit_identical_rank0"],
            "iteration_ratio": paired_ratio(a, b)}


def format_overlap_result(r: dict[str, Any]) -> str:
    """The human-readable summary of a :func:`benchmark_overlap` result."""
    lines = [f"W={r['world_size']}  config={r['config']}  (medians over repeats; slowest rank)"]
    for name, m in r["medians"].items():
        lines.append(f"  {name:10s} iteration {m['iteration_s']:6.3f} s  backward {m['backward_s']:6.3f} s"
                     f"  step {m['step_s']:6.3f} s  exposed comm (step wait) {m['comm_wait_s']:6.3f} s"
                     f"  buckets posted in backward {m['overlapped_buckets']:.0f}")
    q = r["iteration_ratio"]
    lines.append(f"  overlap/no_overlap iteration = {q['median']:.3f} (paired per repeat "
                 f"{', '.join(f'{x:.3f}' for x in q['per_round'])});  parameters bit-identical: {r['bit_identical']}")
    return "\n".join(lines)


def _sharded(cfg: dict[str, Any]):
    """:func:`_model` (seed 0) with ``fully_shard`` on each block and the root."""
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = _model(cfg["layers"], cfg["dim"])
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def _with_grads(model: Any, grads: list) -> Any:
    """``model`` with ``grads`` (local shards, cloned) as its parameters' DTensor gradients."""
    from torch.distributed.tensor import DTensor

    for p, local in zip(model.parameters(), grads):
        p.grad = DTensor.from_local(local.clone(), p.device_mesh, p.placements, run_check=False,
                                    shape=p.shape, stride=p.stride())
    return model


def _variant_name(strategy: str, wire: str | None, bits: int) -> str:
    return f"{strategy}/{wire or 'fp32'}" + ("" if bits == 32 else f"/state{bits}")


def _muon_fn_row(model: Any, cfg: dict[str, Any], strategy: str, wire: str | None, bits: int) -> tuple:
    """One ``FSDPMuonOptimizer`` of :data:`VARIANTS` on ``model``: (optimizer, step)."""
    import torch

    from muon_fn.fsdp import FSDPMuonOptimizer

    opt = FSDPMuonOptimizer(model, lr=1e-4, strategy=strategy, wire_dtype={None: None, "bf16": torch.bfloat16}[wire],
                            method="polar_express", ns_steps=cfg["ns_steps"],  # as documented
                            num_buckets=cfg["buckets"], state_bits=bits)
    return opt, opt.step


def _muon_fn_rows(model: Any, cfg: dict[str, Any]) -> dict[str, tuple]:
    """``FSDPMuonOptimizer`` per :data:`VARIANTS`, on ``model``: row -> (optimizer, step)."""
    return {_variant_name(*v): _muon_fn_row(model, cfg, *v) for v in VARIANTS}


def _torch_row(cfg: dict[str, Any], name: str, model: Any) -> tuple:
    """torch.optim.Muon or ``MuonOptimizer[like_torch]`` (``name``) on ``model``: (optimizer, step)."""
    import torch

    import muon_fn

    from ..train.optimizers import torch_iteration

    settings = {**TORCH_SETTINGS, "ns_steps": cfg["ns_steps"]}
    ns_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[cfg["torch_dtype"]]
    if name == TORCH_ROW:
        topt = torch.optim.Muon(list(model.parameters()), **settings)

        def torch_step(_opt=topt, _dtype=None if ns_dtype == torch.bfloat16 else ns_dtype):  # None: as shipped
            with torch_iteration(_dtype):
                _opt.step()

        return topt, torch_step
    small: dict[str, Any] = {"inflight_bytes": SMALL_INFLIGHT} if name == SMALL_ROW else {}
    mopt = muon_fn.MuonOptimizer(model.parameters(), **settings, ns_dtype=ns_dtype, momentum_kind="ema", **small)
    return mopt, mopt.step


def _torch_rows(cfg: dict[str, Any], grads: list) -> tuple[dict[str, tuple], list]:
    """torch.optim.Muon and ``MuonOptimizer[like_torch]``, each on its own sharded copy of the
    model with the same gradients: row -> (optimizer, step); and the two models."""
    names = (TORCH_ROW, LIKE_TORCH_ROW, SMALL_ROW)
    models = [_with_grads(_sharded(cfg), grads) for _ in names]
    return {name: _torch_row(cfg, name, m) for name, m in zip(names, models)}, models


def _one_row(cfg: dict[str, Any], name: str, grads: list) -> tuple:
    """Row ``name`` alone on its own sharded model with ``grads``: (optimizer, step)."""
    model = _with_grads(_sharded(cfg), grads)
    if name in (TORCH_ROW, LIKE_TORCH_ROW, SMALL_ROW):
        return _torch_row(cfg, name, model)
    (v,) = [v for v in VARIANTS if _variant_name(*v) == name]
    return _muon_fn_row(model, cfg, *v)


def _timed(steps: dict[str, tuple], repeats: int) -> tuple[dict, dict, dict]:
    """Every row's step, ``repeats`` paired rounds after one warm-up, the order rotated by one row
    per round; each time the slowest rank's. Returns wall times, CPU times, last step stats."""
    import torch
    import torch.distributed as dist

    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    stats: dict[str, dict] = {}
    for rep in range(repeats + 1):  # the first round warms up
        k = max(rep - 1, 0) % len(names)
        for name in names[k:] + names[:k]:
            opt, step = steps[name]
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            step()
            dt = torch.tensor([time.perf_counter() - t0, time.process_time() - c0])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if rep:
                times[name].append(dt[0].item())
                cpu[name].append(dt[1].item())
            stats[name] = dict(getattr(opt, "last_step_stats", {}))
    return times, cpu, stats


def _collectives(steps: dict[str, tuple], stats: dict[str, dict]) -> None:
    """One more step of every row (the pair stays in step), the torch row's under DTensor's
    ``CommDebugMode``: its collectives."""
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode

    for name, (_, step) in steps.items():
        dist.barrier()
        with CommDebugMode() if name == TORCH_ROW else contextlib.nullcontext() as comm:
            step()
        if name == TORCH_ROW:
            stats[name]["collectives_per_step"] = {str(op).rsplit(".", 1)[-1]: n
                                                   for op, n in comm.get_comm_counts().items()}


def _memory_worker(rank: int, w: int, port: int, cfg: dict[str, Any], name: str, out: str) -> None:
    """A fresh rank measuring row ``name``'s step transient by its resident set (module docstring)."""
    import torch
    import torch.distributed as dist

    from ._memory import resident_step_bytes, state_bytes

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=w, timeout=timedelta(seconds=600))
    torch.manual_seed(0)
    grads = [torch.randn(p.to_local().shape) for p in _sharded(cfg).parameters()]
    opt, step = _one_row(cfg, name, grads)
    for _ in range(2):  # warm-up: state, plan, scratch and the backend's buffers exist
        step()
    dist.barrier()
    peak = resident_step_bytes(step, torch.device("cpu"))
    mine = {"peak_bytes": peak, "state_bytes": state_bytes(opt)}
    gathered: list[Any] = [None] * w
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.barrier()
    dist.destroy_process_group()


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    """``os.environ`` with ``values`` set inside (what spawned processes inherit)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _measure_memory(world_size: int, cfg: dict[str, Any], names: list[str]) -> dict[str, list[dict]]:
    """Every row of ``names``: its per-rank step transient and state, each row in fresh processes."""
    import torch.multiprocessing as mp

    from ._memory import RESIDENT_ENV

    out: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as d, _environment(RESIDENT_ENV):
        for name in names:
            path = os.path.join(d, "memory.json")
            mp.spawn(_memory_worker, args=(world_size, _free_port(), cfg, name, path), nprocs=world_size, join=True)
            with open(path) as f:
                out[name] = json.load(f)
    return out


def _pair(models: list, start: list, cfg: dict[str, Any]) -> dict[str, Any]:
    """The torch pair's largest parameter difference and travel over all ranks, and its tolerance."""
    import torch
    import torch.distributed as dist

    ps = [(p.to_local(), q.to_local()) for p, q in zip(models[0].parameters(), models[1].parameters())]
    diff = torch.tensor([max((a - b).abs().max().item() for a, b in ps if a.numel()),
                         max((a - s0).abs().max().item() for (a, _), s0 in zip(ps, start) if a.numel())],
                        dtype=torch.float64)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    tolerance = PAIR_TOLERANCE[cfg["torch_dtype"]]
    return {"max_abs_diff": diff[0].item(), "travelled": diff[1].item(), "steps": cfg["repeats"] + 2,
            "torch_dtype": cfg["torch_dtype"], "tolerance": tolerance, "within_tolerance": diff[0].item() <= tolerance}


def _worker(rank: int, w: int, port: int, cfg: dict[str, Any], out: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=w, timeout=timedelta(seconds=600))
    torch.manual_seed(0)
    model = _sharded(cfg)
    grads = [torch.randn(p.to_local().shape) for p in model.parameters()]
    steps = _muon_fn_rows(_with_grads(model, grads), cfg)
    if cfg["torch"]:
        torch_steps, models = _torch_rows(cfg, grads)
        steps.update(torch_steps)
        start = [p.to_local().clone() for p in models[0].parameters()]
    times, cpu, stats = _timed(steps, cfg["repeats"])
    _collectives(steps, stats)
    pair = _pair(models, start, cfg) if cfg["torch"] else {}
    gathered = [None] * w
    dist.all_gather_object(gathered, stats)
    if rank == 0:
        s_bytes = 4 * sum(p.numel() for p in model.parameters())
        with open(out, "w") as f:
            json.dump({"times": times, "cpu": cpu, "stats": gathered, "S_bytes": s_bytes, "pair": pair}, f)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_torch_dtype(torch_dtype: str) -> str:
    """``"bf16"`` or ``"fp32"`` for ``torch_dtype`` (``"auto"``: bf16 where this CPU has bf16
    GEMMs, else fp32); ``ValueError`` for anything else."""
    if torch_dtype not in TORCH_DTYPES:
        raise ValueError(f"Invalid torch_dtype: {torch_dtype!r} (expected one of {list(TORCH_DTYPES)})")
    if torch_dtype != "auto":
        return torch_dtype
    from muon_fn.orthogonalization import CPU_HAS_BF16_GEMM

    return "bf16" if CPU_HAS_BF16_GEMM else "fp32"


def benchmark_fsdp(world_size: int, *, repeats: int = 3, ns_steps: int = 5, layers: int = 12,
                   dim: int = 768, buckets: int = 4, with_torch: bool = True,
                   torch_dtype: str = "auto") -> dict[str, Any]:
    """Spawn ``world_size`` gloo ranks and measure; returns times, per-rank stats and the formula
    (with ``with_torch``: the torch.optim.Muon pair too, iterating in ``torch_dtype``)."""
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cfg = dict(repeats=repeats, ns_steps=ns_steps, layers=layers, dim=dim, buckets=buckets, torch=with_torch,
               torch_dtype=resolve_torch_dtype(torch_dtype))
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "bench.json")
        mp.spawn(_worker, args=(world_size, _free_port(), cfg, out), nprocs=world_size, join=True)
        with open(out) as f:
            raw = json.load(f)
    memory = _measure_memory(world_size, cfg, [n for n in MEMORY_ROWS if n in raw["times"]])
    for name, per_rank in memory.items():
        for st, m in zip(raw["stats"], per_rank):
            st[name].update(m)
    w, s = world_size, raw["S_bytes"]
    result: dict[str, Any] = {"world_size": w, "S_bytes": s, "config": cfg, "variants": {}}
    for name, ts in raw["times"].items():
        per_rank = [st[name] for st in raw["stats"]]
        row: dict[str, Any] = {
            "median_step_s": statistics.median(ts),
            "step_s": ts,
            "median_cpu_s": statistics.median(raw["cpu"][name]),
            "cpu_s": raw["cpu"][name],
        }
        if name in memory:
            row["state_bytes_per_rank"] = [st["state_bytes"] for st in per_rank]
            row["peak_bytes_per_rank"] = [st["peak_bytes"] for st in per_rank]
        if "ns_flops" in per_rank[0]:  # muon_fn's rows (the distributed step's figures)
            flops = [st["ns_flops"] for st in per_rank]
            row.update({
                "bytes_sent_per_rank": [st["bytes_sent"] for st in per_rank],
                "ns_flops_per_rank": flops,
                "ns_flops_max_over_mean": max(flops) / max(sum(flops) / len(flops), 1),
                "comm_wait_s_per_rank": [round(st["comm_wait_s"], 3) for st in per_rank],
                "compute_s_per_rank": [round(st["compute_s"], 3) for st in per_rank],
            })
        if "collectives_per_step" in per_rank[0]:
            row["collectives_per_step"] = per_rank[0]["collectives_per_step"]
        if TORCH_ROW in raw["times"]:
            row["ratio_to_torch"] = paired_ratio(ts, raw["times"][TORCH_ROW])
            row["cpu_ratio_to_torch"] = paired_ratio(raw["cpu"][name], raw["cpu"][TORCH_ROW])
        result["variants"][name] = row
    result["formula_bytes_fp32"] = 2 * (w - 1) / w**2 * s
    result["formula_bytes_bf16"] = result["formula_bytes_fp32"] / 2
    v = result["variants"]
    result["owner_over_replicate"] = v["owner/fp32"]["median_step_s"] / v["replicate/fp32"]["median_step_s"]
    # Paired: owner and replicate of the same repeat ran back to back under the same load.
    result["paired_ratios"] = paired_ratio(v["owner/fp32"]["step_s"], v["replicate/fp32"]["step_s"])["per_round"]
    if TORCH_ROW in memory:
        ref = max(v[TORCH_ROW]["peak_bytes_per_rank"])
        for row in v.values():
            if "peak_bytes_per_rank" in row:
                row["peak_ratio_to_torch"] = max(row["peak_bytes_per_rank"]) / max(ref, 1)
    if raw["pair"]:
        result["pair"] = raw["pair"]
    return result


def _span(xs: list[float], fmt: str) -> str:
    lo, hi = min(xs), max(xs)
    return format(lo, fmt) if lo == hi else f"{lo:{fmt}}–{hi:{fmt}}"


def format_fsdp_result(r: dict[str, Any]) -> str:
    """The human-readable summary of a :func:`benchmark_fsdp` result."""
    w, v = r["world_size"], r["variants"]
    mb, mib = 1e6, 2**20
    lines = [f"W={w}  S={r['S_bytes'] / mb:.1f} MB (fp32 matrices)  config={r['config']}"]
    torch_ran = TORCH_ROW in v
    for name, x in v.items():
        line = f"  {name:26s} step {x['median_step_s']:7.3f} s (runs {', '.join(f'{t:.3f}' for t in x['step_s'])})"
        if torch_ran:
            q = x["ratio_to_torch"]
            line += f"  /torch {q['median']:.3f} (per repeat {', '.join(f'{t:.3f}' for t in q['per_round'])})"
        line += f"  CPU {x['median_cpu_s']:.3f} s"
        if torch_ran:
            line += f" (/torch {x['cpu_ratio_to_torch']['median']:.3f})"
        if "peak_bytes_per_rank" in x:
            line += (f"  state/rank {_span([b / mib for b in x['state_bytes_per_rank']], '.1f')} MiB"
                     f"  step peak/rank {_span([b / mib for b in x['peak_bytes_per_rank']], '.1f')} MiB")
            if "peak_ratio_to_torch" in x:
                line += f" (/torch {x['peak_ratio_to_torch']:.2f})"
        if "bytes_sent_per_rank" in x:
            b = x["bytes_sent_per_rank"]
            line += (f"  sent/rank {min(b) / mb:.1f}–{max(b) / mb:.1f} MB"
                     f"  NS FLOPs/rank max/mean {x['ns_flops_max_over_mean']:.3f}"
                     f"  comm wait {min(x['comm_wait_s_per_rank']):.2f}–{max(x['comm_wait_s_per_rank']):.2f} s"
                     f"  compute {min(x['compute_s_per_rank']):.2f}–{max(x['compute_s_per_rank']):.2f} s")
        if "collectives_per_step" in x:
            line += "  collectives/step " + ", ".join(f"{k} {n}" for k, n in x["collectives_per_step"].items())
        lines.append(line)
    lines.append(
        f"  formula 2(W-1)/W^2*S = {r['formula_bytes_fp32'] / mb:.1f} MB fp32, "
        f"{r['formula_bytes_bf16'] / mb:.1f} MB bf16;  owner/replicate = {r['owner_over_replicate']:.3f}"
        f" (medians; per repeat {', '.join(f'{x:.3f}' for x in r['paired_ratios'])})"
    )
    if "pair" in r:
        p = r["pair"]
        lines.append(
            f"  {LIKE_TORCH_ROW} vs {TORCH_ROW} ({p['torch_dtype']} iteration, {p['steps']} steps): "
            f"max |Δparam| {p['max_abs_diff']:.2e} (tolerance {p['tolerance']:.0e}: "
            f"{'ok' if p['within_tolerance'] else 'EXCEEDED'}; parameters moved up to {p['travelled']:.2e})")
    return "\n".join(lines)
