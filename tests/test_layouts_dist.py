"""Every optimizer class on DTensor parameters, as trainers hand them over, on CPU/gloo: one spawned
job per world size (2, then 3) runs every check.

- **At construction**: ``MuonOptimizer(model.parameters())``, the hybrid, SSO and the elementwise
  optimizers on a ``fully_shard``-ed model (Lightning's ``ModelParallelStrategy``, transformers'
  DTensor loading, torchtitan) and on a tensor-parallel one: bit for bit the single-device
  optimizer of the same class.
- **Swapped in afterwards**: accelerate's FSDP2 ``prepare`` builds the optimizer on the plain
  model, swaps each parameter for a placeholder, shards the model and switches the optimizer to
  the DTensors (its own ``fsdp2_switch_optimizer_parameters``): before any step and after steps
  whose state must follow, bit for bit.
- **Trainers' own flows**: the Hugging Face Trainer's factory call and accelerate's swap on a
  GPT-2; transformers' ``from_pretrained(tp_plan="auto")``, whose gradients come back with other
  placements than their weights.
- **Checkpoints through any module root**: ``torch.distributed.checkpoint``'s
  ``get/set_optimizer_state_dict`` given the optimizer's module, its parent (Lightning's module
  root) or a child, saved at W = 2 and loaded at W = 3 (resharded); a checkpoint of another
  model is refused before anything changes.

The harness (toy model with uneven and empty shards, synthetic gradients, references on rank 0)
is tests/test_fsdp.py's.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from _ranks import assert_check, job_runner, rank_main
from test_fsdp import JOB_TIMEOUT_S, Toy, assert_same, full, make, on_rank0, shard, synthetic_grad

pytestmark = pytest.mark.distributed

WORLD_SIZES = (2, 3)  # in this order: the W=2 job saves the checkpoint the W=3 job loads
STEPS = 3


def set_grads(model: nn.Module, step: int) -> None:
    """The same global gradients on every rank; a DTensor parameter gets its part (any placements)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for i, p in enumerate(model.parameters()):
        g = synthetic_grad(tuple(p.shape), step, i)
        p.grad = (
            distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None)
            if isinstance(p, DTensor)
            else g
        )


def train(pairs, steps: int, first: int = 0) -> None:
    for t in range(first, first + steps):
        for model, opt in pairs:
            set_grads(model, t)
            opt.step()


def refusal(call, what: str) -> str:
    """The message of the ``ValueError`` that ``call()`` raises."""
    try:
        call()
    except ValueError as e:
        return str(e)
    raise AssertionError(f"{what} was not refused")


class Lm(nn.Module):
    """An embedding, hidden matrices and a head over the embedding's vocabulary: the hybrid
    routes the embedding and the head to AdamW."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.l1 = nn.Linear(6, 10)
        self.l2 = nn.Linear(10, 6, bias=False)
        self.head = nn.Linear(6, 11, bias=False)


class Parent(nn.Module):
    """A trainer's module around the model (Lightning's ``LightningModule.model``)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


def builders():
    import muon_fn as mf

    return {
        "muon": lambda m: mf.MuonOptimizer(m.parameters(), weight_decay=0.01, compile=False),
        "muon_named_normuon": lambda m: mf.MuonOptimizer(
            m.named_parameters(), beta2=0.95, compile=False
        ),
        "hybrid": lambda m: mf.create_hybrid_optimizer(m, compile=False),
        "sso": lambda m: mf.SpectralSphereOptimizer(m.parameters(), compile=False),
        "triton_muon": lambda m: mf.TritonMuon(m.parameters(), compile=False),
        "triton_muonw": lambda m: mf.TritonMuonW(m.parameters(), compile=False),
        "muon_compiled": lambda m: mf.MuonOptimizer(m.parameters()),  # the default: inductor
    }


def single(name, cls=Toy, steps=STEPS):
    """The single-device optimizer ``name`` after ``steps`` steps: parameters and state (rank 0's, sent to all)."""

    def run():
        model = make(cls)
        opt = builders()[name](model)
        train([(model, opt)], steps)
        return model, opt

    return on_rank0(run)


def check_construction(name, cls=Toy):
    """Built on DTensors: the class, not another; the distributed step; bit for bit."""

    def run():
        model = shard(make(cls))
        opt = builders()[name](model)
        train([(model, opt)], STEPS)
        assert type(opt) is type(builders()[name](make(cls)))  # its own class, no other made for it
        assert opt._executor.distributed
        if opt._model is None:  # a copy carries the model, and FSDP2 modules do not copy
            assert type(copy.deepcopy(opt)) is type(opt)
        assert_same(model, opt, single(name, cls), what=f"{name}: ")
        return {
            "class": type(opt).__name__,
            "matrices": opt.last_step_stats.get("matrices_computed"),
        }

    return run


def tensor_parallel(model: nn.Module) -> nn.Module:
    """``l1`` column-wise and ``l2`` row-wise over every rank (a 1-D tensor-parallel mesh)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    return parallelize_module(model, mesh, {"l1": ColwiseParallel(), "l2": RowwiseParallel()})


def check_tensor_parallel():
    def run():
        model = tensor_parallel(make(Lm))
        opt = builders()["muon"](model)
        train([(model, opt)], STEPS)
        assert_same(model, opt, single("muon", Lm), what="tp: ")
        return {"placements": [str(getattr(p, "placements", "plain")) for p in model.parameters()]}

    return run


def accelerate_swap(model: nn.Module, opt, blocks=None) -> nn.Module:
    """What accelerate's FSDP2 ``prepare`` does to an optimizer built on the plain model (its
    ``Accelerator._prepare_fsdp2``, with ``fully_shard`` for its ``fsdp2_prepare_model``, which
    needs a GPU): placeholders, shard (``blocks(model)``, then the root; default: every child),
    then its own ``fsdp2_switch_optimizer_parameters``."""
    from accelerate.utils.fsdp_utils import (
        fsdp2_canonicalize_names,
        fsdp2_switch_optimizer_parameters,
    )
    from torch.distributed.fsdp import fully_shard

    old = fsdp2_canonicalize_names(dict(model.named_parameters()))
    for group in opt.param_groups:
        for i, p in enumerate(group["params"]):
            group["params"][i] = torch.empty(1, dtype=p.dtype, device=p.device)
            group["params"][i].data_ptr = p.data_ptr()
    if blocks is None:
        shard(model)
    else:
        for block in blocks(model):
            fully_shard(block)
        fully_shard(model)
    new = fsdp2_canonicalize_names(dict(model.named_parameters()))
    fsdp2_switch_optimizer_parameters(opt, {p.data_ptr(): new[n] for n, p in old.items()})
    return model


def check_swap(name, before=0, cls=Toy):
    """Built on the plain model, ``before`` steps, swapped by accelerate, then the rest: bit for
    bit the single-device run (state made before the swap follows its parameter)."""

    def run():
        model = make(cls)
        opt = builders()[name](model)
        train([(model, opt)], before)
        accelerate_swap(model, opt)
        train([(model, opt)], STEPS - before, first=before)
        assert_same(model, opt, single(name, cls), what=f"{name} swapped after {before} steps: ")
        assert type(opt) is type(builders()[name](make(cls))) and opt._executor.distributed
        return {"class": type(opt).__name__}

    return run


def gpt2():
    """A tiny GPT-2 of transformers (Conv1D matrices stored (in, out), the head tied to the embedding)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(
        GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    )


def check_hf_trainer_fsdp2():
    """The Hugging Face Trainer under FSDP2, as far as it runs on the CPU: the optimizer built by
    the Trainer's factory call (``HybridFactory()(model, **kwargs)``) on the plain model, then
    accelerate's swap, sharding each GPT2Block (accelerate's default wrap) and the root: bit for bit
    the single-device run."""
    from muon_fn.integrations.hf import HybridFactory

    kwargs = {
        "muon_lr": 3e-3,
        "adamw_lr": 3e-3,
        "adjust_lr_fn": "match_rms_adamw",
        "compile": False,
    }

    def reference():
        model = gpt2()
        opt = HybridFactory()(model, **kwargs)
        train([(model, opt)], STEPS)
        return model, opt

    def run():
        model = gpt2()
        opt = HybridFactory()(model, **kwargs)
        accelerate_swap(model, opt, blocks=lambda m: list(m.transformer.h))
        train([(model, opt)], STEPS)
        assert_same(model, opt, on_rank0(reference), what="GPT-2 hybrid: ")
        return {"split": [n for g in opt.param_groups for n in g["param_names"]][:4]}

    return run


def accelerator():
    """accelerate's ``Accelerator`` in this rank (on the CPU: its FSDP2 plugin and ``prepare``
    need a GPU, as the Hugging Face Trainer's ``use_cpu=True`` drops FSDP), which
    ``AcceleratedOptimizer`` and the checkpoint functions read."""
    import os

    import torch.distributed as dist
    from accelerate import Accelerator

    os.environ.setdefault("RANK", str(dist.get_rank()))
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
    os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))
    return Accelerator(cpu=True)


def check_accelerate_checkpoint(tmp: Path):
    """The Hugging Face Trainer's FSDP2 flow with accelerate's own pieces: ``AcceleratedOptimizer``
    (which loads the optimizer's own state_dict before ``prepare`` swaps the parameters), the
    swap, two steps, ``save_fsdp_optimizer`` (DCP shards, what the Trainer's checkpoint calls);
    then a fresh model and optimizer through the same flow, ``load_fsdp_optimizer`` and the third
    step: bit for bit the single-device run. No state entry is left keyed by a former parameter
    (torch's ``state_dict()`` would fail on it, and it would keep the unsharded model alive)."""
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import load_fsdp_optimizer, save_fsdp_optimizer
    from torch.distributed.tensor import DTensor

    def run():
        acc = accelerator()
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, state_dict_type="SHARDED_STATE_DICT"
        )
        out = {}
        for name, cls in (("hybrid", Lm), ("muon_named_normuon", Toy)):

            def prepared(seed=0):
                model = make(cls, seed=seed)  # noqa: B023  called at once, in this iteration
                opt = AcceleratedOptimizer(builders()[name](model))  # noqa: B023  called at once, in this iteration
                assert not opt.state, (
                    f"{name}: {len(opt.state)} state entries after AcceleratedOptimizer"  # noqa: B023  called at once, in this iteration
                )
                accelerate_swap(model, opt)
                return model, opt

            where = str(tmp / f"accelerate_{name}")
            model, opt = prepared()
            train([(model, opt)], 2)
            assert all(isinstance(p, DTensor) and st for p, st in opt.state.items()), name
            save_fsdp_optimizer(plugin, acc, opt, model, where)
            resumed, ropt = prepared(
                seed=1
            )  # another start: the parameters and the state come from the run
            with torch.no_grad():
                for p, q in zip(resumed.parameters(), model.parameters()):
                    p.to_local().copy_(q.to_local())
            load_fsdp_optimizer(plugin, acc, ropt, resumed, where)
            train([(resumed, ropt)], STEPS - 2, first=2)
            assert_same(
                resumed, ropt, single(name, cls), what=f"{name} resumed through accelerate: "
            )
            out[name] = sorted(ropt.state_dict()["param_groups"][0])[:3]
        return out

    return run


def check_hybrid_accumulation():
    """``create_hybrid_optimizer(model, gradient_accumulation_steps=2)`` on a fully_shard-ed model
    builds (it hands the model on, whose gradient sync the step pauses) and accumulates as one
    process does, bit for bit: the gradients as FSDP2 leaves them (``None`` on a window's first
    micro-batch, the window's sum on its last) against the single-device hybrid's micro-batches."""
    from torch.distributed.tensor import distribute_tensor

    import muon_fn as mf

    def reference():
        model = make(Lm)
        opt = mf.create_hybrid_optimizer(model, gradient_accumulation_steps=2, compile=False)
        train([(model, opt)], 4)
        return model, opt

    def run():
        model = shard(make(Lm))
        opt = mf.create_hybrid_optimizer(model, gradient_accumulation_steps=2, compile=False)
        for t in range(4):
            for i, p in enumerate(model.parameters()):
                g = (
                    None
                    if t % 2 == 0
                    else synthetic_grad(tuple(p.shape), t - 1, i)
                    + synthetic_grad(tuple(p.shape), t, i)
                )
                p.grad = (
                    None
                    if g is None
                    else distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None)
                )
            opt.step()
            assert opt.last_step.applied == (t % 2 == 1), t
        assert_same(model, opt, on_rank0(reference), what="hybrid accumulating: ")
        return {"class": type(opt).__name__}

    return run


def check_transformers_tp_plan(tmp: Path):
    """transformers' own DTensor loading: ``from_pretrained(tp_plan="auto", device_mesh=...)`` (a
    tiny Llama saved here), ``MuonOptimizer(model.parameters())``. The gradients a real backward
    gives carry their own placements (the vocabulary-parallel embedding's is ``Replicate()`` for a
    ``Shard(0)`` weight): the steps use gradients with exactly those placements and equal the
    single-device run bit for bit."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from transformers import LlamaConfig, LlamaForCausalLM

    def run():
        path = tmp / "llama"
        if dist.get_rank() == 0 and not path.exists():
            torch.manual_seed(0)
            LlamaForCausalLM(
                LlamaConfig(
                    vocab_size=64,
                    hidden_size=16,
                    intermediate_size=32,
                    num_hidden_layers=1,
                    num_attention_heads=2,
                    num_key_value_heads=2,
                )
            ).save_pretrained(path)
        dist.barrier()
        model = LlamaForCausalLM.from_pretrained(
            path, tp_plan="auto", device_mesh=init_device_mesh("cpu", (dist.get_world_size(),))
        )
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
        model(input_ids=ids, labels=ids).loss.backward()
        placed = [
            (p.grad.device_mesh, p.grad.placements) if hasattr(p.grad, "placements") else None
            for p in model.parameters()
        ]
        opt = builders()["muon"](model)
        ref = LlamaForCausalLM.from_pretrained(path)
        plain = builders()["muon"](ref)
        for t in range(STEPS):
            for i, (p, q, where) in enumerate(zip(model.parameters(), ref.parameters(), placed)):
                g = synthetic_grad(tuple(q.shape), t, i)
                p.grad, q.grad = (
                    g if where is None else distribute_tensor(g, *where, src_data_rank=None),
                    g.clone(),
                )
            opt.step()
            plain.step()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(full(p.detach()), q.detach()), name
        return {"grad placements": sorted({str(w[1]) for w in placed if w is not None})}

    return run


def check_swap_refused():
    """A swap the state cannot follow (another shape) is refused by the next step, naming the
    parameter, before anything changes."""
    import muon_fn as mf

    def run():
        model = shard(make())
        opt = mf.MuonOptimizer(model.parameters(), compile=False)
        train([(model, opt)], 1)
        other = shard(nn.Linear(7, 4))
        kept = [full(p).clone() for p in model.parameters()]
        opt.param_groups[0]["params"][0] = other.weight
        message = refusal(opt.step, "the swap")
        assert "parameter #0 of shape (4, 7) of group 0 replaced one of shape (10, 6)" in message, (
            message
        )
        assert all(torch.equal(full(p), q) for p, q in zip(model.parameters(), kept))
        return {"message": message[:80]}

    return run


class Moe(Lm):
    """Lm with a stack of experts (3, 4, 6): a matrix view the checkpoint records."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.Parameter(torch.randn(3, 4, 6) / 3)


def dcp_builders():
    """Optimizers whose names differ from the root DCP is given: (build(parent), DCP's root)."""
    import muon_fn as mf
    from muon_fn.fsdp import FSDPMuonOptimizer

    return {
        # names relative to the child (the hybrid's model), DCP through the parent (Lightning)
        "hybrid_via_parent": (
            lambda parent: mf.create_hybrid_optimizer(parent.model, compile=False),
            lambda parent: parent,
        ),
        # names relative to the parent, DCP through the child
        "fsdp_via_child": (
            lambda parent: FSDPMuonOptimizer(parent, compile=False),
            lambda parent: parent.model,
        ),
        # no names at all, DCP through the parent
        "muon_via_parent": (
            lambda parent: mf.MuonOptimizer(
                parent.model.parameters(), matrix_view="experts", compile=False
            ),
            lambda parent: parent,
        ),
    }


def dcp_single(name):
    """The single-device reference of ``dcp_builders()[name]``, three steps."""
    import muon_fn as mf

    def run():
        model = make(Moe)
        opt = {
            "hybrid_via_parent": lambda: mf.create_hybrid_optimizer(model, compile=False),
            "fsdp_via_child": lambda: mf.MuonOptimizer(
                model.parameters(), weight_decay=0.01, matrix_view="experts", compile=False
            ),
            "muon_via_parent": lambda: mf.MuonOptimizer(
                model.parameters(), matrix_view="experts", compile=False
            ),
        }[name]()
        train([(model, opt)], STEPS)
        return model, opt

    return on_rank0(run)


def check_dcp_root(tmp: Path, w: int, name: str):
    """W=2 takes two steps and saves model and optimizer through DCP's root; W=3 (resharded)
    loads them through the same root into a fresh model and optimizer, takes the third step and
    equals the single-device run bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    def run():
        build, root_of = dcp_builders()[name]
        parent = Parent(
            shard(make(Moe, seed=1 if w == 3 else 0))
        )  # W=3 starts elsewhere: the load must set it
        opt, root = build(parent), root_of(parent)
        where = str(tmp / f"dcp_{name}")
        if w == 2:
            train([(parent.model, opt)], 2)
            dcp.save(
                {"model": get_model_state_dict(root), "optim": get_optimizer_state_dict(root, opt)},
                checkpoint_id=where,
            )
            return {"saved": sorted(get_optimizer_state_dict(root, opt)["state"])[:3]}
        state = {"model": get_model_state_dict(root), "optim": get_optimizer_state_dict(root, opt)}
        dcp.load(state, checkpoint_id=where)
        set_model_state_dict(root, state["model"])
        set_optimizer_state_dict(root, opt, state["optim"])
        train([(parent.model, opt)], 1, first=2)
        assert_same(parent.model, opt, dcp_single(name), what=f"{name} W={w}: ")
        return {"loaded": True}

    return run


def check_other_view_refused(tmp: Path):
    """A checkpoint whose state fits another layout (the expert stack read as one flattened
    matrix; plain Muon, whose state has the same shapes under both views) is refused through the
    parent too, naming the parameter under the optimizer's own name; the parameters are left as
    they were (DCP has loaded the state in place by then)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    import muon_fn as mf

    def run():
        parent = Parent(shard(make(Moe)))
        opt = mf.create_hybrid_optimizer(
            parent.model, matrix_view={"experts": "flatten"}, beta2=None, compile=False
        )
        kept = [full(p).clone() for p in parent.parameters()]
        state = {"optim": get_optimizer_state_dict(parent, opt)}
        dcp.load(state, checkpoint_id=str(tmp / "dcp_hybrid_via_parent"))
        message = refusal(
            lambda: set_optimizer_state_dict(parent, opt, state["optim"]),
            "a checkpoint of another layout",
        )
        assert "'experts' of shape (3, 4, 6) with view 'experts' in the state dict" in message, (
            message
        )
        assert message.endswith(
            "build the optimizer again before stepping (the parameters are unchanged)"
        ), message
        assert all(torch.equal(full(p), q) for p, q in zip(parent.parameters(), kept))
        return {"message": message}

    return run


def check_distributed_options():
    """The distributed options given to MuonOptimizer (built on DTensors) act as on
    FSDPMuonOptimizer: the same options give the same result bit for bit, and a bf16 wire
    another than the default fp32 one."""
    import muon_fn as mf
    from muon_fn.fsdp import FSDPMuonOptimizer

    def trained(build):
        model = shard(make(Toy))
        opt = build(model)
        train([(model, opt)], STEPS)
        return opt, {n: full(p) for n, p in model.named_parameters()}

    def run():
        finals = {}
        for label, kw in (
            ("bf16_wire", {"wire_dtype": torch.bfloat16, "num_buckets": 2}),
            ("replicate", {"strategy": "replicate"}),
        ):
            ours, finals[label] = trained(
                lambda m, kw=kw: mf.MuonOptimizer(
                    m.parameters(), weight_decay=0.01, compile=False, **kw
                )
            )
            _, theirs = trained(lambda m, kw=kw: FSDPMuonOptimizer(m, compile=False, **kw))
            assert type(ours) is mf.MuonOptimizer
            assert ours.distributed_options._asdict().items() >= kw.items()
            assert (ours.strategy, ours.wire_dtype) == (
                kw.get("strategy", "owner"),
                kw.get("wire_dtype"),
            )
            assert ours.last_step_stats["strategy"] == kw.get("strategy", "owner")
            different = [k for k in theirs if not torch.equal(theirs[k], finals[label][k])]
            assert not different, (
                f"{label}: MuonOptimizer and FSDPMuonOptimizer differ on {different}"
            )
        _, fp32_wire = trained(
            lambda m: mf.MuonOptimizer(m.parameters(), weight_decay=0.01, compile=False)
        )
        assert any(not torch.equal(fp32_wire[k], finals["bf16_wire"][k]) for k in fp32_wire)
        return {"options": sorted(finals)}

    return run


def checks_for(w: int, tmp: str) -> dict:
    tmp = Path(tmp)
    out = {f"construct_{name}": check_construction(name) for name in builders() if name != "hybrid"}
    out["construct_hybrid"] = check_construction("hybrid", Lm)
    out["tensor_parallel"] = check_tensor_parallel()
    out["swap_fresh"] = check_swap("muon", 0)
    out["swap_with_state"] = check_swap("muon_named_normuon", 2)
    out["swap_hybrid_with_state"] = check_swap("hybrid", 1, Lm)
    out["swap_refused"] = check_swap_refused()
    if w == 2:
        out["distributed_options"] = check_distributed_options()
        out["hf_trainer_fsdp2"] = check_hf_trainer_fsdp2()
        out["transformers_tp_plan"] = check_transformers_tp_plan(tmp)
        out["accelerate_checkpoint"] = check_accelerate_checkpoint(tmp)
        out["hybrid_accumulation"] = check_hybrid_accumulation()
    for name in dcp_builders():
        out[f"dcp_{name}"] = check_dcp_root(tmp, w, name)
    if w == 3:
        out["dcp_other_view_refused"] = check_other_view_refused(tmp)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    shared = tmp_path_factory.mktemp("layouts_dcp")
    return job_runner(
        __file__, "layouts", tmp_path_factory, JOB_TIMEOUT_S, args=[str(shared)], order=WORLD_SIZES
    )


CHECKS = list(dict.fromkeys([*checks_for(2, "."), *checks_for(3, ".")]))


@pytest.mark.parametrize("w", WORLD_SIZES)
@pytest.mark.parametrize("name", CHECKS)
def test_layouts(results, w, name):
    if name not in checks_for(w, "."):
        pytest.skip(f"{name} runs at one world size only")
    assert_check(results(w), w, name)


if __name__ == "__main__":
    rank_main(lambda w: checks_for(w, sys.argv[4]))
