"""The MoE demo GPT under FSDP2 on CPU/gloo (W = 2) against the single-device trainer optimizer.

One spawned job (this file as a script, ``mp.spawn`` of two ranks) runs every check; rank 0
writes the gathered results to JSON, read by the tests below. The model is the trainer's GPT with
4 experts per MLP at a small width, sharded as ``muon-fn train --fsdp`` shards it (every block,
then the root: each rank holds 2 whole experts of each stack); the optimizers are the ones the
trainer builds (``build_fsdp`` / ``build_single``, routers in Muon). Collective timeout 60 s, job
timeout 240 s.
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
from _ranks import free_port

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[1]
JOB_TIMEOUT_S = 240
WORLD = 2
STEPS = 3
CONFIG = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16, n_experts=4)
# Real backward: FSDP2 reduce-scatters (averages) the two ranks' gradients, the reference
# backpropagates the whole batch at once, so gradients differ in rounding (2e-7 relative). The
# check runs the fp32 iteration: the default bf16 iteration turns such a difference into a whole
# bf16 rounding step of an entry now and then (1.7e-3 in the parameters after 3 steps). Parameters
# after STEPS steps in fp32, tolerance (measured: 4.5e-7, the largest in a router, a 4x16
# matrix whose small singular directions the orthogonalization amplifies).
BACKWARD_ATOL = 2e-6


def _model():
    from muon_fn.tools.train.model import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(**CONFIG))


def _shard(model):
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model)


def _optimizers(model, ref, **options):
    from muon_fn.tools.train import optimizers

    opt, _ = optimizers.build_fsdp("muon", options, model, 0.02, 3e-3, 0.01, WORLD)
    ref_opt, _ = optimizers.build_single("muon", options, ref, 0.02, 3e-3, 0.01, compile=False)
    return opt, ref_opt


def _grad(shape, step, index):
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * step + index))


def _set_grads(model, step):
    """The same global gradients on both models; a DTensor parameter gets its rows."""
    from torch.distributed.tensor import DTensor

    from muon_fn.distributed._plan import chunk_rows

    for i, p in enumerate(model.parameters()):
        g = _grad(tuple(p.shape), step, i)
        if isinstance(p, DTensor):
            a, b = chunk_rows(g.shape[0], WORLD)[p.device_mesh.get_local_rank(0)]
            p.grad = DTensor.from_local(
                g[a:b].clone(),
                p.device_mesh,
                p.placements,
                run_check=False,
                shape=p.shape,
                stride=p.stride(),
            )
        else:
            p.grad = g


def _diffs(model, ref) -> dict[str, float]:
    out = {}
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = float((full.detach() - q.detach()).abs().max())
    return out


def _check_synthetic(**options):
    """The same synthetic gradients: the sharded step equals the single-device step bit for bit;
    the expert stacks are planned as whole experts per rank, read as E matrices."""
    ref = _model()
    model = _shard(_model())
    opt, ref_opt = _optimizers(model, ref, **options)
    stacks = [mp for mp in opt.plan.matrices if len(mp.shape) == 3]
    views = [line for line in opt.describe().splitlines() if "view=" in line]
    for step in range(STEPS):
        _set_grads(model, step)
        _set_grads(ref, step)
        opt.step()
        ref_opt.step()
    diffs = _diffs(model, ref)
    return {
        "max_diff": max(diffs.values()),
        "diffs": diffs,
        "stacks": [list(mp.shape) for mp in stacks],
        "contrib": [list(map(list, mp.contrib)) for mp in stacks],
        "views": views,
    }


def _check_backward():
    """Real forward and backward: each rank trains on its half of the batch, the reference on the
    whole batch; parameters and the loss agree to rounding (fp32 iteration)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    ref = _model()
    model = _shard(_model())
    opt, ref_opt = _optimizers(model, ref, ns_dtype=torch.float32)
    losses = []
    for step in range(STEPS):
        tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(step))
        x, y = tokens[:, :-1], tokens[:, 1:]
        _, loss = model(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2])
        loss.backward()
        opt.step()
        opt.zero_grad()
        _, ref_loss = ref(x, y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append([float(mean) / WORLD, float(ref_loss)])
    diffs = _diffs(model, ref)
    return {"max_diff": max(diffs.values()), "diffs": diffs, "losses": losses}


CHECKS = {
    "synthetic": _check_synthetic,
    # every bucket alone, one at a time (at W = 2 one all-to-all each way, not in rounds)
    "synthetic_alone": lambda: _check_synthetic(inflight_bytes=1),
    "backward": _check_backward,
}


def _worker(rank, port, out):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    results = {}
    for name, fn in CHECKS.items():
        try:
            results[name] = {"ok": True, **fn()}
        except Exception:  # reported to the test
            results[name] = {"ok": False, "error": traceback.format_exc()}
            print(f"rank {rank} {name}:", results[name]["error"], flush=True)
        dist.barrier()
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks():
    out = os.path.join(tempfile.mkdtemp(), "moe_fsdp.json")
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        MUON_FN_COMPILE="0",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    proc = subprocess.Popen(
        [sys.executable, __file__, out, str(free_port())],
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
    assert os.path.exists(out), f"the W={WORLD} job wrote no results; its output:\n{log[-4000:]}"
    return json.load(open(out))


def _ok(ranks, name):
    for rank, res in enumerate(ranks):
        assert res[name]["ok"], f"rank {rank}:\n{res[name].get('error')}"
    return [res[name] for res in ranks]


@pytest.mark.parametrize("name", ["synthetic", "synthetic_alone"])
def test_moe_gpt_fsdp_equals_single_device_bit_for_bit(ranks, name):
    for r in _ok(ranks, name):
        assert r["max_diff"] == 0.0, r["diffs"]
        # fc (4, 64, 16) and proj (4, 16, 64) of both blocks; rank r sends experts 2r and 2r+1
        assert r["stacks"] == [[4, 64, 16], [4, 16, 64]] * 2
        assert all(c == [[0, 2], [2, 4]] for c in r["contrib"])
        assert len(r["views"]) == 4 and all("view=experts" in v for v in r["views"]), r["views"]


def test_moe_gpt_fsdp_backward_matches_single_device(ranks):
    for r in _ok(ranks, "backward"):
        assert r["max_diff"] <= BACKWARD_ATOL, r["diffs"]
        for mean, ref in r["losses"]:
            assert abs(mean - ref) <= 1e-6, r["losses"]


if __name__ == "__main__":
    import torch.multiprocessing as mp

    out_path, port_ = sys.argv[1], int(sys.argv[2])
    mp.spawn(_worker, args=(port_, out_path), nprocs=WORLD, join=True)
