"""muon_fn in torchtitan's ``OptimizersContainer`` (:mod:`muon_fn.integrations.torchtitan`) on
CPU/gloo at W = 2: the container built from torchtitan's own config on a ``fully_shard``-ed model
with torchtitan's parameter names, its ``fused``/``foreach`` group keys and ``param_names``;
stepped, saved with the container's flat FQN-keyed state dict through DCP, loaded into a fresh
model and container, stepped again: bit for bit a single-device ``MuonOptimizer`` with the same
groups.

The same on one rank of the test device (``test_container_on_one_rank``; in the GPU lane, step
``trainers``: CUDA and nccl, compiled). The role routing (embeddings and the output head to AdamW, by
module) on torchtitan's llama3 debug model from its registry, in one process
(``test_llama3_*``). torchtitan's own trainer is not run: its configs need the
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
        self.attention = nn.ModuleDict(
            {"wq": nn.Linear(8, 8, bias=False), "wo": nn.Linear(8, 8, bias=False)}
        )
        self.feed_forward = nn.ModuleDict(
            {"w1": nn.Linear(8, 12, bias=False), "w2": nn.Linear(12, 8, bias=False)}
        )


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
    {
        "pattern": r"^(tok_embeddings|output)\.",
        "optimizer_kwargs": {"algorithm": "adamw", "lr": 3e-3, "weight_decay": 0.1},
    },
    {"pattern": r".*", "optimizer_kwargs": {"lr": 0.02, "weight_decay": 0.01, "adamw_lr": 3e-3}},
]


def container(model: nn.Module, compile: bool = False):
    from torchtitan.components.optimizer import ParamGroupConfig

    from muon_fn.integrations.torchtitan import MuonOptimizersContainer

    config = MuonOptimizersContainer.Config(
        param_groups=[ParamGroupConfig(optimizer_name="MuonOptimizer", **g) for g in GROUPS],
        optimizer_factory_kwargs_by_name={"MuonOptimizer": {"compile": compile}},
    )
    return config.build(model_parts=[model])


def single(device: str = "cpu", compile: bool = False):
    """The same groups, by the same patterns, in one single-device MuonOptimizer."""
    import re

    import muon_fn as mf

    def build():
        model, claimed, groups = make(Titan).to(device), set(), []
        for g in GROUPS:
            named = [
                (n, p)
                for n, p in model.named_parameters()
                if n not in claimed and re.search(g["pattern"], n)
            ]
            claimed |= {n for n, _ in named}
            groups.append({"params": [p for _, p in named], **g["optimizer_kwargs"]})
        return model, mf.MuonOptimizer(groups, compile=compile)

    return build


def set_grads(model: nn.Module, step: int) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    for i, p in enumerate(model.parameters()):
        g = torch.randn(
            tuple(p.shape), generator=torch.Generator().manual_seed(1000 * step + i)
        ).to(p.device)
        p.grad = (
            distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None)
            if isinstance(p, DTensor)
            else g
        )


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
        dcp.save(
            {"model": get_model_state_dict(model), "optim": box.state_dict()}, checkpoint_id=where
        )
        dist.barrier()
        fresh = shard(make(Titan, seed=1))
        again = container(fresh)
        state = {"model": get_model_state_dict(fresh), "optim": again.state_dict()}
        dcp.load(state, checkpoint_id=where)
        set_model_state_dict(fresh, state["model"])
        again.load_state_dict(state["optim"])
        train(fresh, again, 1, first=2)
        assert_same(
            fresh, again.optimizers[0], reference(STEPS), what="torchtitan container, resumed: "
        )
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
    dcp.save(
        {"model": get_model_state_dict(model), "optim": box.state_dict()},
        checkpoint_id=str(tmp_path / "ck"),
    )
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


KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"


def llama3_debugmodel(device: str | torch.device = "cpu") -> nn.Module:
    """torchtitan's llama3 ``debugmodel`` from its model registry (6 layers, dim 256, a
    vocabulary of 2048; the embedding ``tok_embeddings``, the head ``lm_head``), on ``device``.
    Its package imports the MoE dispatcher's Triton kernels at module level; without triton (a
    CPU-only torch) a stand-in whose kernels raise is imported in their place: the dense llama3
    never calls them."""
    import types

    needs_torchtitan()
    if importlib.util.find_spec("triton") is None and KERNELS not in sys.modules:

        def missing(name: str):
            if name.startswith("__"):
                raise AttributeError(name)

            def kernel(*args, **kwargs):
                raise RuntimeError(f"{KERNELS}.{name} needs triton")

            return kernel

        stub = types.ModuleType(KERNELS)
        stub.__getattr__ = missing
        sys.modules[KERNELS] = stub
    from torchtitan.models.llama3 import model_registry

    with torch.device(device):
        return model_registry("debugmodel").model.build()


CATCH_ALL = {"lr": 0.02, "weight_decay": 0.01, "adamw_lr": 3e-4, "adamw_weight_decay": 0.1}


def titan_config(*groups: tuple[str, dict], verbose: bool = False):
    from torchtitan.components.optimizer import ParamGroupConfig

    from muon_fn.integrations.torchtitan import MuonOptimizersContainer

    return MuonOptimizersContainer.Config(
        param_groups=[
            ParamGroupConfig(pattern=p, optimizer_name="MuonOptimizer", optimizer_kwargs=kw)
            for p, kw in groups
        ],
        optimizer_factory_kwargs_by_name={"MuonOptimizer": {"compile": False}},
        verbose=verbose,
    )


def test_llama3_roles(capsys):
    """torchtitan's llama3 debug model (its names and module types) under the recipe's one
    catch-all group: the embedding and the head ``lm_head`` get AdamW at the group's ``adamw_lr``
    and ``adamw_weight_decay`` (one step moves each of their entries by AdamW's first step, lr),
    every hidden matrix Muon, the norms AdamW; the split is create_hybrid_optimizer's, printed
    as it prints its own."""
    import muon_fn as mf

    model = llama3_debugmodel()
    names = dict(model.named_parameters())
    matrices = [n for n, p in names.items() if p.ndim == 2 and n.startswith("layers.")]
    norms = [n for n, p in names.items() if p.ndim == 1]
    assert len(matrices) == 30 and len(norms) == 13 and names["lm_head.weight"].shape == (2048, 256)
    box = titan_config((r".*", CATCH_ALL), verbose=True).build(model_parts=[model])
    printed = capsys.readouterr().out
    (opt,) = box.optimizers
    auto, twin = opt.param_groups
    assert auto["algorithm"] == "auto"
    assert auto["param_names"] == [
        n for n in names if n not in ("tok_embeddings.weight", "lm_head.weight")
    ]
    assert twin["algorithm"] == "adamw" and twin["param_names"] == [
        "tok_embeddings.weight",
        "lm_head.weight",
    ]
    assert (twin["lr"], twin["weight_decay"], twin["base_lr"]) == (3e-4, 0.1, 3e-4)
    assert (auto["lr"], auto["weight_decay"]) == (0.02, 0.01)
    (split,) = box.splits
    rows = {n: r for n, _, r in split.adamw}
    assert sorted(n for n, _, _ in split.muon) == sorted(matrices)
    assert rows == {
        "tok_embeddings.weight": "embedding",
        "lm_head.weight": "output head",
        **dict.fromkeys(norms, "1-D"),
    }
    hybrid = mf.create_hybrid_optimizer(model, compile=False).split
    assert sorted(split.muon) == sorted(hybrid.muon) and sorted(split.adamw) == sorted(hybrid.adamw)
    assert (
        printed == f"{split}\n"
        and "lm_head.weight" in printed
        and str(split).startswith("Muon: 30 tensors")
    )
    head = names["lm_head.weight"]
    before = head.detach().clone()
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()))
    box.step()
    step = before * (1 - 3e-4 * 0.1) - head.detach()  # AdamW's first step: lr·g / (|g| + eps)
    torch.testing.assert_close(
        step, 3e-4 * head.grad / (head.grad.abs() + 1e-8), rtol=1e-4, atol=1e-8
    )


def test_llama3_patterns_pin(capsys):
    """A group with an algorithm, listed first, pins what its pattern matches against the rule:
    ``lm_head`` to Muon; the earlier recipe's ``^(tok_embeddings|output)\\.`` AdamW group keeps
    the embedding, and the catch-all's head still gets AdamW. The split names the pinning group."""
    model = llama3_debugmodel()
    pinned = titan_config(
        (r"^lm_head\.", {"algorithm": "muon", "lr": 0.02}), (r".*", CATCH_ALL)
    ).build(model_parts=[model])
    groups = pinned.optimizers[0].param_groups
    assert [(g["algorithm"], g["param_names"][:1]) for g in groups] == [
        ("muon", ["lm_head.weight"]),
        ("auto", ["layers.0.attention.qkv_linear.wqkv.weight"]),
        ("adamw", ["tok_embeddings.weight"]),
    ]
    assert {n: r for n, _, r in pinned.splits[0].muon}[
        "lm_head.weight"
    ] == "algorithm='muon' group [^lm_head\\.]"
    earlier = titan_config(
        (r"^(tok_embeddings|output)\.", {"algorithm": "adamw", "lr": 3e-4, "weight_decay": 0.1}),
        (r".*", CATCH_ALL),
    ).build(model_parts=[model])
    assert [
        (g["algorithm"], g["param_names"])
        for g in earlier.optimizers[0].param_groups
        if g["algorithm"] == "adamw"
    ] == [("adamw", ["tok_embeddings.weight"]), ("adamw", ["lm_head.weight"])]
    assert capsys.readouterr().out == ""  # verbose=False prints nothing


def test_llama3_roles_sharded(one_rank, device):  # noqa: F811
    """The same split on the fully_shard-ed llama3 (DTensor parameters, FSDP's module classes),
    on one rank of the test device."""
    from torch.distributed.fsdp import fully_shard

    model = llama3_debugmodel(device)
    plain = titan_config((r".*", CATCH_ALL)).build(model_parts=[model]).splits[0]
    for block in model.layers.values():
        fully_shard(block, mesh=one_rank)
    fully_shard(model, mesh=one_rank)
    box = titan_config((r".*", CATCH_ALL)).build(model_parts=[model])
    assert box.optimizers[0].param_groups[1]["param_names"] == [
        "tok_embeddings.weight",
        "lm_head.weight",
    ]
    assert box.splits[0].muon == plain.muon and box.splits[0].adamw == plain.adamw


if __name__ == "__main__":
    rank_main(lambda w: checks_for(w, sys.argv[4]))
