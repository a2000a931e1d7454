"""muon_fn in torchtitan's ``OptimizersContainer`` (:mod:`muon_fn.integrations.torchtitan`) on
CPU/gloo at W = 2: the container built from torchtitan's own config on a ``fully_shard``-ed model
with torchtitan's parameter names, its ``fused``/``foreach`` group keys and ``param_names``;
stepped, saved with the container's flat FQN-keyed state dict through DCP, loaded into a fresh
model and container, stepped again: bit for bit a single-device ``MuonOptimizer`` with the same
groups.

The same on one rank of the test device (``test_container_on_one_rank``; in the GPU lane, step
``trainers``: CUDA and nccl, compiled). torchtitan's own trainer is not run: its configs need the
repository's tokenizer and dataset assets, which the package does not ship. Skips without
torchtitan (fails under ``MUON_FN_REQUIRE_EXTRAS=1``, .ci/run, which installs it).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from _ranks import assert_check, job_runner, rank_main
from test_fsdp import JOB_TIMEOUT_S, assert_same, make, on_rank0
from test_fsdp_single import one_rank  # noqa: F401 (a fixture)

pytestmark = pytest.mark.distributed

STEPS = 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(8)
        self.attention = nn.ModuleDict({"wq": nn.Linear(8, 8, bias=False), "wo": nn.Linear(8, 8, bias=False)})
        self.feed_forward = nn.ModuleDict({"w1": nn.Linear(8, 12, bias=False), "w2": nn.Linear(12, 8, bias=False)})


class Titan(nn.Module):
    """torchtitan's llama names: ``tok_embeddings``, ``layers.N.attention.wq``, ``norm``, ``output``."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(20, 8)
        self.layers = nn.ModuleDict({"0": Block(), "1": Block()})
        self.norm = nn.LayerNorm(8)
        self.output = nn.Linear(8, 20, bias=False)


def shard(model: Titan, mesh=None) -> Titan:
    """As torchtitan's FSDP: each block, then the root."""
    from torch.distributed.fsdp import fully_shard

    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


GROUPS = [
    {"pattern": r"^(tok_embeddings|output)\.", "optimizer_kwargs": {"algorithm": "adamw", "lr": 3e-3,
                                                                    "weight_decay": 0.1}},
    {"pattern": r".*", "optimizer_kwargs": {"lr": 0.02, "weight_decay": 0.01, "adamw_lr": 3e-3}},
]


def container(model: nn.Module, compile: bool = False):
    from torchtitan.components.optimizer import ParamGroupConfig

    from muon_fn.integrations.torchtitan import MuonOptimizersContainer

    config = MuonOptimizersContainer.Config(
        param_groups=[ParamGroupConfig(optimizer_name="MuonOptimizer", **g) for g in GROUPS],
        optimizer_factory_kwargs_by_name={"MuonOptimizer": {"compile": compile}})
    return config.build(model_parts=[model])


def single(device: str = "cpu", compile: bool = False):
    """The same groups, by the same patterns, in one single-device MuonOptimizer."""
    import re

    import muon_fn as mf

    def build():
        model, claimed, groups = make(Titan).to(device), set(), []
        for g in GROUPS:
            named = [(n, p) for n, p in model.named_parameters() if n not in claimed and re.search(g["pattern"], n)]
            claimed |= {n for n, _ in named}
            groups.append({"params": [p for _, p in named], **g["optimizer_kwargs"]})
        return model, mf.MuonOptimizer(groups, compile=compile)

    return build


def set_grads(model: nn.Module, step: int) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    for i, p in enumerate(model.parameters()):
        g = torch.randn(tuple(p.shape), generator=torch.Generator().manual_seed(1000 * step + i)).to(p.device)
        p.grad = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None) if isinstance(p, DTensor) else g


def train(model, opt, steps: int, first: int = 0) -> None:
    for t in range(first, first + steps):
        set_grads(model, t)
        opt.step()
        opt.zero_grad()


def reference(steps: int):
    def run():
        model, opt = single()()
        train(model, opt, steps)
        return model, opt

    return on_rank0(run)


def check_container(tmp: Path):
    """Built from torchtitan's config on DTensors; two steps; saved (torchtitan's flat state dict)
    and loaded into a fresh model and container; one more step: the single-device run."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    def run():
        model = shard(make(Titan))
        box = container(model)
        opt = box.optimizers[0]
        assert type(opt).__name__ == "MuonOptimizer" and len(box.optimizers) == 1
        assert [g["algorithm"] for g in opt.param_groups] == ["adamw", "auto"]
        assert all(g["fused"] is True and g["foreach"] is False for g in opt.param_groups)
        train(model, box, 2)
        assert_same(model, opt, reference(2), what="torchtitan container, 2 steps: ")
        where = str(tmp / "titan")
        dcp.save({"model": get_model_state_dict(model), "optim": box.state_dict()}, checkpoint_id=where)
        dist.barrier()
        fresh = shard(make(Titan, seed=1))
        again = container(fresh)
        state = {"model": get_model_state_dict(fresh), "optim": again.state_dict()}
        dcp.load(state, checkpoint_id=where)
        set_model_state_dict(fresh, state["model"])
        again.load_state_dict(state["optim"])
        train(fresh, again, 1, first=2)
        assert_same(fresh, again.optimizers[0], reference(STEPS), what="torchtitan container, resumed: ")
        return {"keys": len(state["optim"])}

    return run


def checks_for(w: int, tmp: str) -> dict:
    return {"container": check_container(Path(tmp))}


def needs_torchtitan() -> None:
    if importlib.util.find_spec("torchtitan") is None:
        reason = "torchtitan is not installed (pip install torchtitan)"
        if os.environ.get("MUON_FN_REQUIRE_EXTRAS") == "1":
            pytest.fail(reason)
        pytest.skip(reason)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    needs_torchtitan()
    shared = tmp_path_factory.mktemp("titan_dcp")
    return job_runner(__file__, "titan", tmp_path_factory, JOB_TIMEOUT_S, args=[str(shared)])


@pytest.mark.parametrize("name", list(checks_for(2, ".")))
def test_torchtitan(results, name):
    assert_check(results(2), 2, name)


def test_container_on_one_rank(one_rank, device, tmp_path):  # noqa: F811
    """On one rank of the test device (nccl on CUDA), compiled there (eager on the CPU, as the
    W = 2 job): the container on the fully_shard-ed model, two steps, its flat state dict saved
    and loaded through DCP into a fresh model and container, one more step: the single-device
    MuonOptimizer with the same groups, bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    needs_torchtitan()
    compiled = device.type == "cuda"
    ref, plain = single(device, compiled)()
    train(ref, plain, STEPS)
    model = shard(make(Titan).to(device), one_rank)
    box = container(model, compiled)
    train(model, box, 2)
    dcp.save({"model": get_model_state_dict(model), "optim": box.state_dict()}, checkpoint_id=str(tmp_path / "ck"))
    fresh = shard(make(Titan, seed=1).to(device), one_rank)
    again = container(fresh, compiled)
    state = {"model": get_model_state_dict(fresh), "optim": again.state_dict()}
    dcp.load(state, checkpoint_id=str(tmp_path / "ck"))
    set_model_state_dict(fresh, state["model"])
    again.load_state_dict(state["optim"])
    train(fresh, again, 1, first=2)
    assert type(again.optimizers[0]).__name__ == "MuonOptimizer"
    for (n, p), q in zip(fresh.named_parameters(), ref.parameters()):
        assert torch.equal(p.full_tensor(), q), n


if __name__ == "__main__":
    rank_main(lambda w: checks_for(w, sys.argv[4]))
