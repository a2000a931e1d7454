"""FSDPSpectralSphereOptimizer on CPU/gloo (W = 2, 3 and 4) against single-device SpectralSphereOptimizer.

One spawned job per world size runs every check on every rank (this file as a script); rank 0
writes the gathered results to JSON, read by the tests below. Same synthetic full gradients on
every rank (a DTensor parameter gets its rows). Bit for bit after 3 steps: the owner runs the
single-device optimizer's transform on the same buckets of whole matrices. Collective timeout
60 s, job timeout 240 s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from _ranks import free_port

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[1]
JOB_TIMEOUT_S = 240
STEPS = 3


class Net(nn.Module):
    """Uneven shards at W=4 (5 rows: 2, 2, 1, 0), two same-shape matrices, 1-D params."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 12)
        self.l2 = nn.Linear(12, 12, bias=False)
        self.l3 = nn.Linear(12, 12, bias=False)
        self.l4 = nn.Linear(12, 5)

    def forward(self, x):
        for layer in (self.l1, self.l2, self.l3, self.l4):
            x = torch.tanh(layer(x))
        return x


class Experts(nn.Module):
    """A router and an expert stack (E = 5 experts 8x6 in one parameter: whole experts per rank,
    uneven at W = 2 and 4), which the FSDP optimizer knows by its module to be E matrices."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(6, 5, bias=False)
        self.w_up = nn.Parameter(torch.randn(5, 8, 6) / 6**0.5)


def _grad(shape, step, index):
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 * step + index))


def _set_grads(model, step):
    from torch.distributed.tensor import DTensor

    from muon_fn.distributed._plan import chunk_rows

    for i, p in enumerate(model.parameters()):
        g = _grad(tuple(p.shape), step, i)
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            a, b = chunk_rows(g.shape[0], mesh.size(0))[mesh.get_local_rank(0)]
            p.grad = DTensor.from_local(
                g[a:b].clone(),
                mesh,
                p.placements,
                run_check=False,
                shape=p.shape,
                stride=p.stride(),
            )
        else:
            p.grad = g


def _check_parity(strategy, rescale=None, cls=Net, views=None, heads=False, **sso_kwargs):
    """``rescale``: multiply every weight by it after both optimizers are built (as loading a
    checkpoint into the model would): the warm-start block must come from the weights of the
    first step, as single-device SSO makes it. ``views``: the single-device optimizer's
    ``matrix_view`` (the FSDP one reads the model). ``heads``: both get a head view for the
    12-row matrices. The single-device run is rank 0's, sent to every rank (:func:`_reference`)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from muon_fn import FSDPSpectralSphereOptimizer

    torch.manual_seed(0)
    model = cls()
    for layer in model.children():
        fully_shard(layer)
    fully_shard(model)
    if heads:
        import muon_fn as mf

        views = sso_kwargs["matrix_view"] = {"l[123].weight": mf.heads(rows=(4, 4, 4))}
    opt = FSDPSpectralSphereOptimizer(model, strategy=strategy, **sso_kwargs)
    sso_kwargs.pop("matrix_view", None)
    _rescale(model, rescale)
    for step in range(STEPS):
        _set_grads(model, step)
        opt.step()
    expected, ref_lam, ref_iterations = _reference(cls, views, rescale, sso_kwargs)
    diffs = {}
    for (name, p), q in zip(model.named_parameters(), expected):
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        diffs[name] = float((full.detach() - q).abs().max())
    stats = opt.solver_stats()
    lam = [float(x) for x in stats.lam.reshape(-1)]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, lam)
    return {
        "max_diff": max(diffs.values()),
        "diffs": diffs,
        "ranks_agree": all(x == everyone[0] for x in everyone),
        "lam": lam,
        "ref_lam": ref_lam,
        "iterations": [int(x) for x in stats.iterations.reshape(-1)],
        "ref_iterations": ref_iterations,
    }


def _rescale(model, rescale):
    if rescale is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(rescale)


def _reference(cls, views, rescale, sso_kwargs):
    """Single-device SpectralSphereOptimizer from the same start (seed 0, then ``rescale``) after
    STEPS steps of the same gradients, run on rank 0 only (each rank running it cost as much
    again): its parameters, λ* and solver iterations, sent to every rank."""
    import torch.distributed as dist

    from muon_fn import SpectralSphereOptimizer

    out = [None]
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        ref_model = cls()
        ref = SpectralSphereOptimizer(ref_model.named_parameters(), matrix_view=views, **sso_kwargs)
        _rescale(ref_model, rescale)
        for step in range(STEPS):
            _set_grads(ref_model, step)
            ref.step()
        stats = ref.solver_stats()
        out = [
            (
                [q.detach().clone() for q in ref_model.parameters()],
                [float(x) for x in stats.lam],
                [int(x) for x in stats.iterations],
            )
        ]
    dist.broadcast_object_list(out, src=0)
    return out[0]


def _check_bytes():
    """Shapes divisible by W: [M | W] goes out (2·in columns) and only the update (in columns) comes
    back, so the mean bytes per rank are 3(W−1)/W²·S (S: fp32 bytes of the matrices); Muon's are
    2(W−1)/W²·S (tests/test_fsdp.py)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from muon_fn import FSDPSpectralSphereOptimizer

    w = dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16, bias=False), nn.Linear(16, 8, bias=False), nn.Linear(8, 8, bias=False)
    )
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = FSDPSpectralSphereOptimizer(model)
    _set_grads(model, 0)
    opt.step()
    s = 4 * sum(p.numel() for p in model.parameters())
    sent = torch.tensor([float(opt.last_step_stats["bytes_sent"])])
    dist.all_reduce(sent)
    mean, expected = sent.item() / w, 3 * (w - 1) / w**2 * s
    return {"mean_bytes": mean, "expected": expected}


CHECKS = {
    "owner": lambda: _check_parity("owner"),
    "replicate": lambda: _check_parity("replicate"),
    "bytes": _check_bytes,
    # A head view on the three 12-row matrices: one sphere per 4-row block.
    "owner_heads": lambda: _check_parity("owner", heads=True),
    # The dynamic retraction (α·lr = 1 %): the owner runs the same transform.
    "owner_dynamic": lambda: _check_parity("owner", retract_mode="dynamic", retract_alpha=0.5),
    "owner_rescaled": lambda: _check_parity("owner", rescale=3.0),
    # An expert stack: one sphere per expert; its per-expert state travels with its rows.
    "owner_experts": lambda: _check_parity("owner", cls=Experts, views={"w_up": "experts"}),
}


def _worker(rank, w, port, out):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=w, timeout=timedelta(seconds=60))
    results = {}
    for name, fn in CHECKS.items():
        try:
            results[name] = {"ok": True, **fn()}
        except Exception:  # reported to the test
            results[name] = {"ok": False, "error": traceback.format_exc()}
            print(f"rank {rank} {name}:", results[name]["error"], flush=True)
    gathered = [None] * w
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.barrier()
    dist.destroy_process_group()


_CACHE: dict[int, object] = {}


def _job(w):
    if w in _CACHE:
        return _CACHE[w]
    out = os.path.join(tempfile.mkdtemp(), f"sso_fsdp_{w}.json")
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    proc = subprocess.Popen(
        [sys.executable, __file__, str(w), out, str(free_port())],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        text=True,
    )
    try:
        log, _ = proc.communicate(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the job's own process group: its ranks only
        log, _ = proc.communicate()
    result = json.loads(Path(out).read_text()) if os.path.exists(out) else log
    _CACHE[w] = result
    return result


@pytest.mark.parametrize("w", [2, 3, 4])
@pytest.mark.parametrize(
    "strategy",
    ["owner", "replicate", "owner_heads", "owner_dynamic", "owner_rescaled", "owner_experts"],
)
def test_fsdp_sso_matches_single_device(w, strategy):
    ranks = _job(w)
    assert isinstance(ranks, list), f"job failed:\n{ranks}"
    for rank, res in enumerate(ranks):
        r = res[strategy]
        assert r["ok"], f"rank {rank}:\n{r.get('error')}"
        assert r["max_diff"] == 0.0, (rank, r["diffs"])
        assert r["ranks_agree"], r["lam"]
        assert r["iterations"] == r["ref_iterations"]
        assert r["lam"] == r["ref_lam"]


@pytest.mark.parametrize("w", [2, 4])  # shapes divisible by W: the formula is exact
def test_fsdp_sso_returns_only_the_update(w):
    ranks = _job(w)
    assert isinstance(ranks, list), f"job failed:\n{ranks}"
    for rank, res in enumerate(ranks):
        r = res["bytes"]
        assert r["ok"], f"rank {rank}:\n{r.get('error')}"
        assert r["mean_bytes"] == r["expected"], r


if __name__ == "__main__":
    import torch.multiprocessing as mp

    world, out_path, port_ = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    mp.spawn(_worker, args=(world, port_, out_path), nprocs=world, join=True)
