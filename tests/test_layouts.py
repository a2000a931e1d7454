"""One optimizer for every parameter layout, in one process: DTensors on a one-rank process group
(the multi-rank flows are tests/test_layouts_dist.py), parameters swapped into ``param_groups``
after construction, ``model=``, and checkpoints through another module root.

A swap is noticed at the next step (or ``state_dict``/``load_state_dict``) and the state follows
its parameter; a swap the state cannot follow is refused before anything changes.
"""

from __future__ import annotations

import copy
import pickle
import warnings

import expecttest
import pytest
import torch
import torch.nn as nn
from test_fsdp_single import (
    one_rank,  # noqa: F401 (a fixture)
    set_grads,
    sharded_twins,
)

import muon_fn as mf


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 10)
        self.fc2 = nn.Linear(10, 4)
        self.experts = nn.Parameter(torch.randn(3, 4, 5) / 3)


class Parent(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


def make(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def grads(model: nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def train(model: nn.Module, opt, steps: int, first: int = 0) -> None:
    for t in range(first, first + steps):
        grads(model, t)
        opt.step()


def muon(params, **kw):
    return mf.MuonOptimizer(params, matrix_view="experts", compile=False, **kw)


def same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


# ---------------------------------------------------------------------------- plain tensors swapped
def test_plain_swap_keeps_the_state_of_the_parameter_it_replaces():
    """Parameters replaced in ``param_groups`` by others of the same shapes (a trainer's copy of the
    model) take over their state: the run goes on as if nothing happened."""
    straight, swapped = make(), make()
    ref, opt = muon(straight.parameters()), muon(swapped.parameters())
    train(straight, ref, 2)
    train(swapped, opt, 2)
    twin = copy.deepcopy(swapped)
    opt.param_groups[0]["params"] = list(twin.parameters())
    train(straight, ref, 2, first=2)
    train(twin, opt, 2, first=2)
    assert same(straight, twin)
    assert not any(p in opt.state for p in swapped.parameters())


class TestRefusedSwap(expecttest.TestCase):
    def test_another_shape_is_refused_before_anything_changes(self):
        model = make()
        opt = muon(model.parameters())
        train(model, opt, 1)
        kept = [p.detach().clone() for p in model.parameters()]
        momentum = opt.state[model.experts]["momentum_buffer"].clone()
        opt.param_groups[0]["params"][0] = nn.Parameter(torch.zeros(3, 3))
        grads(model, 1)
        with self.assertRaises(ValueError) as ctx:
            opt.step()
        self.assertExpectedInline(
            str(ctx.exception),
            """parameter #0 of shape (3, 3) of group 0 replaced one of shape (3, 4, 5) that has optimizer state, by one of shape (3, 3): the state cannot follow it. Swap in parameters of the same shape, or build the optimizer after the model is laid out""",  # noqa: E501
        )
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), kept))
        assert torch.equal(opt.state[model.experts]["momentum_buffer"], momentum)


# ---------------------------------------------------------------------------- model=
def test_model_names_parameters_and_gives_module_views():
    """``model=`` names the parameters (messages, checkpoints) and gives a parameter of ndim ≥ 3 its
    module's view: no guess, no warning; the same step as the view given by hand."""
    model, ref_model = make(), make()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = mf.MuonOptimizer(model.parameters(), model=model, compile=False)
    ref = muon(ref_model.parameters())
    layout = opt.state_dict()["param_groups"][0]["param_layout"]
    assert [name for name, _, _ in layout] == [
        "experts",
        "fc1.weight",
        "fc1.bias",
        "fc2.weight",
        "fc2.bias",
    ]
    assert layout[0][2] == "experts"
    train(model, opt, 2)
    train(ref_model, ref, 2)
    assert same(model, ref_model)
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module or None, got list"):
        mf.MuonOptimizer(model.parameters(), model=[])


def test_state_dict_loads_through_another_module_root():
    """Names recorded relative to the optimizer's module match those of a parent's optimizer (a
    trainer's module around the model): the load is accepted; a model whose parameters come in
    another order is still refused."""
    child = make()
    saved = mf.MuonOptimizer(child.parameters(), model=child, compile=False)
    train(child, saved, 1)
    parent = Parent(make())
    loader = mf.MuonOptimizer(parent.parameters(), model=parent, compile=False)
    loader.load_state_dict(saved.state_dict())
    assert torch.equal(
        loader.state[parent.model.fc1.weight]["momentum_buffer"],
        saved.state[child.fc1.weight]["momentum_buffer"],
    )
    reordered = nn.Module()
    reordered.fc2, reordered.fc1, reordered.experts = (
        nn.Linear(10, 4),
        nn.Linear(6, 10),
        nn.Parameter(torch.zeros(3, 4, 5)),
    )
    other = mf.MuonOptimizer(reordered.parameters(), model=reordered, compile=False)
    with pytest.raises(
        ValueError,
        match=r"parameter 1 is 'fc1\.weight' of shape \(10, 6\) in the state dict but "
        r"'fc2\.weight' of shape \(4, 10\) in this optimizer",
    ):
        other.load_state_dict(saved.state_dict())


# ---------------------------------------------------------------------------- DTensors, one rank
class Holder:
    """What ``set_grads`` reads of a model: its parameters (a copied optimizer's own)."""

    def __init__(self, params) -> None:
        self.params = list(params)

    def parameters(self):
        return iter(self.params)


def test_dtensors_at_construction_keep_the_users_class(one_rank, device):  # noqa: F811
    """Built on FSDP2 DTensors: the user's class (name, isinstance, repr), the distributed step,
    bit for bit the plain run; a deepcopy and a pickle round trip step like the original."""
    model, ref = sharded_twins(one_rank, device, Net)
    opt = muon(model.parameters())
    plain = muon(ref.parameters())
    assert type(opt) is mf.MuonOptimizer and opt._executor.distributed  # its class, its executor
    assert repr(opt).startswith("MuonOptimizer (") and "owner=0" in opt.describe()
    for t in range(2):
        set_grads(model, t)
        set_grads(ref, t)
        opt.step()
        plain.step()
    copies = [
        copy.deepcopy(opt),
        pickle.loads(pickle.dumps(opt)),
    ]  # FSDP2 modules do not copy: the optimizer alone
    assert all(
        type(c) is mf.MuonOptimizer and c._executor.distributed and c.last_step_stats == {}
        for c in copies
    )
    holders = [Holder(c.param_groups[0]["params"]) for c in copies]
    for t in range(2, 4):
        for m, o in [(model, opt), (ref, plain), *zip(holders, copies)]:
            set_grads(m, t)
            o.step()
    for m in [model, *holders]:
        assert all(
            torch.equal(p.full_tensor().cpu(), q.cpu())
            for p, q in zip(m.parameters(), ref.parameters())
        )


def test_accumulation_on_dtensors_needs_the_model(one_rank, device):  # noqa: F811
    """gradient_accumulation_steps > 1 pauses FSDP2's gradient sync, which needs the model."""
    model, _ = sharded_twins(one_rank, device, Net)
    with pytest.raises(
        ValueError,
        match=r"gradient_accumulation_steps=2 needs a model wrapped with "
        r"torch\.distributed\.fsdp\.fully_shard \(FSDP2\), whose gradient sync it "
        r"pauses, but the optimizer was given no model; pass model=",
    ):
        muon(model.parameters(), gradient_accumulation_steps=2)
    opt = muon(model.parameters(), gradient_accumulation_steps=2, model=model)
    assert opt.last_step is None and type(opt).__name__ == "MuonOptimizer"


def test_swap_to_dtensors_after_steps(one_rank, device):  # noqa: F811
    """Built and stepped on the plain model, then sharded and swapped (accelerate's flow): the
    state follows, the run goes on bit for bit."""
    from test_fsdp import shard

    model, ref = make().to(device), make().to(device)
    opt, plain = muon(model.parameters()), muon(ref.parameters())
    for t in range(2):
        set_grads(model, t)
        set_grads(ref, t)
        opt.step()
        plain.step()
    names = [n for n, _ in model.named_parameters()]
    assert type(opt._executor) is mf.optim.engine.LocalExecutor
    shard(model, mesh=one_rank)
    opt.param_groups[0]["params"] = [dict(model.named_parameters())[n] for n in names]
    for t in range(2, 4):
        set_grads(model, t)
        set_grads(ref, t)
        opt.step()
        plain.step()
    assert "matrices_computed" in opt.last_step_stats
    assert (
        type(opt) is mf.MuonOptimizer and opt._executor.distributed
    )  # the executor switched, not the class
    assert all(
        torch.equal(p.full_tensor().cpu(), q.cpu())
        for p, q in zip(model.parameters(), ref.parameters())
    )
