"""The FSDP benchmark: owner-computes vs replicate on the gpt2-small matrix set (CPU, gloo).

For each world size W, :func:`benchmark_fsdp` spawns W processes, shards 12 × [4 × 768²,
3072×768, 768×3072] with ``fully_shard`` (one block per layer) and times
``FSDPMuonOptimizer.step()`` with ``strategy="owner"`` (fp32 and bf16 on the wire) and
``"replicate"``, paired: each repeat runs the three back to back on the same gradients. A step's
time is the slowest rank's. The result has the median step times and their ratio, bytes sent per
rank against 2(W−1)/W²·S, and the per-rank Newton–Schulz FLOPs max/mean. ``muon_fn.fsdp`` is
imported only in the spawned ranks.
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
