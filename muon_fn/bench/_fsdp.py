"""The FSDP benchmark: owner-computes vs replicate on the gpt2-small matrix set (CPU, gloo).

For each world size W, :func:`benchmark_fsdp` spawns W processes, shards 12 × [4 × 768²,
3072×768, 768×3072] with ``fully_shard`` (one block per layer) and times
``FSDPMuonOptimizer.step()`` with ``strategy="owner"`` (fp32 and bf16 on the wire) and
``"replicate"``, paired: each repeat runs the three back to back on the same gradients. A step's
time is the slowest rank's. The result has the median step times and their ratio, bytes sent per
rank against 2(W−1)/W²·S, and the per-rank Newton–Schulz FLOPs max/mean. ``muon_fn.fsdp`` is
imported only in the spawned ranks.

:func:`benchmark_overlap` (``--overlap``) trains the same matrices through real forward and
backward passes (a residual MLP-style block per layer, ``tokens`` rows per rank) and compares
``overlap=False`` with ``overlap=True``, paired: each repeat runs one iteration of each back to
back, on two identical models. It reports the slowest rank's iteration, backward and step times,
and the exposed communication (``comm_wait_s`` of the step, the only place either variant
waits on the exchange), medians over the repeats.
"""

from __future__ import annotations

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
VARIANTS = (("owner", None), ("owner", "bf16"), ("replicate", None))


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


def _worker(rank: int, w: int, port: int, cfg: dict[str, Any], out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from muon_fn.fsdp import FSDPMuonOptimizer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=w, timeout=timedelta(seconds=600))
    torch.manual_seed(0)
    model = _model(cfg["layers"], cfg["dim"])
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    for p in model.parameters():
        local = torch.randn(p.to_local().shape)
        p.grad = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                    shape=p.shape, stride=p.stride())
    wire = {None: None, "bf16": torch.bfloat16}
    opts = {
        (s, wd): FSDPMuonOptimizer(model, lr=1e-4, strategy=s, wire_dtype=wire[wd],
                                   method="polar_express", ns_steps=cfg["ns_steps"],  # as documented
                                   num_buckets=cfg["buckets"])
        for s, wd in VARIANTS
    }
    times: dict[str, list[float]] = {f"{s}/{wd or 'fp32'}": [] for s, wd in VARIANTS}
    stats: dict[str, dict] = {}
    for rep in range(cfg["repeats"] + 1):  # the first round warms up
        for (s, wd), opt in opts.items():
            dist.barrier()
            t0 = time.perf_counter()
            opt.step()
            dt = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if rep:
                times[f"{s}/{wd or 'fp32'}"].append(dt.item())
            stats[f"{s}/{wd or 'fp32'}"] = dict(opt.last_step_stats)
    gathered = [None] * w
    dist.all_gather_object(gathered, stats)
    if rank == 0:
        s_bytes = 4 * sum(p.numel() for p in model.parameters())
        with open(out, "w") as f:
            json.dump({"times": times, "stats": gathered, "S_bytes": s_bytes}, f)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def benchmark_fsdp(world_size: int, *, repeats: int = 3, ns_steps: int = 5, layers: int = 12,
                  dim: int = 768, buckets: int = 4) -> dict[str, Any]:
    """Spawn ``world_size`` gloo ranks and measure; returns times, per-rank stats and the formula."""
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cfg = dict(repeats=repeats, ns_steps=ns_steps, layers=layers, dim=dim, buckets=buckets)
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "bench.json")
        mp.spawn(_worker, args=(world_size, _free_port(), cfg, out), nprocs=world_size, join=True)
        with open(out) as f:
            raw = json.load(f)
    w, s = world_size, raw["S_bytes"]
    result: dict[str, Any] = {"world_size": w, "S_bytes": s, "config": cfg, "variants": {}}
    for name, ts in raw["times"].items():
        per_rank = [st[name] for st in raw["stats"]]
        flops = [st["ns_flops"] for st in per_rank]
        result["variants"][name] = {
            "median_step_s": statistics.median(ts),
            "step_s": ts,
            "bytes_sent_per_rank": [st["bytes_sent"] for st in per_rank],
            "ns_flops_per_rank": flops,
            "ns_flops_max_over_mean": max(flops) / (sum(flops) / len(flops)),
            "comm_wait_s_per_rank": [round(st["comm_wait_s"], 3) for st in per_rank],
            "compute_s_per_rank": [round(st["compute_s"], 3) for st in per_rank],
        }
    result["formula_bytes_fp32"] = 2 * (w - 1) / w**2 * s
    result["formula_bytes_bf16"] = result["formula_bytes_fp32"] / 2
    v = result["variants"]
    result["owner_over_replicate"] = v["owner/fp32"]["median_step_s"] / v["replicate/fp32"]["median_step_s"]
    # Paired: owner and replicate of the same repeat ran back to back under the same load.
    result["paired_ratios"] = paired_ratio(v["owner/fp32"]["step_s"], v["replicate/fp32"]["step_s"])["per_round"]
    return result


def format_fsdp_result(r: dict[str, Any]) -> str:
    """The human-readable summary of a :func:`benchmark_fsdp` result."""
    w, v = r["world_size"], r["variants"]
    mb = 1e6
    lines = [f"W={w}  S={r['S_bytes'] / mb:.1f} MB (fp32 matrices)  config={r['config']}"]
    for name, x in v.items():
        b = x["bytes_sent_per_rank"]
        lines.append(
            f"  {name:15s} step {x['median_step_s']:7.2f} s (runs {', '.join(f'{t:.2f}' for t in x['step_s'])})"
            f"  sent/rank {min(b) / mb:7.1f}–{max(b) / mb:7.1f} MB"
            f"  NS FLOPs/rank max/mean {x['ns_flops_max_over_mean']:.3f}"
            f"  comm wait {min(x['comm_wait_s_per_rank']):.2f}–{max(x['comm_wait_s_per_rank']):.2f} s"
            f"  compute {min(x['compute_s_per_rank']):.2f}–{max(x['compute_s_per_rank']):.2f} s"
        )
    lines.append(
        f"  formula 2(W-1)/W^2*S = {r['formula_bytes_fp32'] / mb:.1f} MB fp32, "
        f"{r['formula_bytes_bf16'] / mb:.1f} MB bf16;  owner/replicate = {r['owner_over_replicate']:.3f}"
        f" (medians; per repeat {', '.join(f'{x:.3f}' for x in r['paired_ratios'])})"
    )
    return "\n".join(lines)
