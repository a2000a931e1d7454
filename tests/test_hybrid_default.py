"""create_hybrid_optimizer's default recipe: NorMuon on the hidden matrices (docs/performance.md,
"Variants against torch.optim.Muon"); ``beta2=None`` is plain Muon, torch.optim.Muon's update;
a checkpoint loads with the rule it ran with."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

import muon_fn as mf
from muon_fn.optimizers._hybrid import NORMUON_BETA2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(16, 8),
        nn.Linear(8, 12),
        nn.Tanh(),
        nn.Linear(12, 8),
        nn.LayerNorm(8),
        nn.Linear(8, 16, bias=False),
    )


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, 16, (4, 6), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x).flatten(0, 1), x.roll(1, 1).flatten()).backward()
        opt.step()


def _muon_group(opt):
    return next(g for g in opt.param_groups if g["algorithm"] == "muon")


def _head(opt) -> str:
    return str(opt.split).splitlines()[0].split(":")[0]


def test_default_is_normuon_and_says_so():
    opt = mf.create_hybrid_optimizer(_model(), compile=False)
    group = _muon_group(opt)
    assert NORMUON_BETA2 == 0.95 and group["beta2"] == 0.95 and group["adamuon_beta2"] is None
    assert _head(opt) == "NorMuon" and "beta2: 0.95" in repr(opt)
    assert "normalize_rows(beta2=0.95" in opt.describe()


def test_default_steps_as_normuon_spelled_out():
    """The default is exactly ``beta2=0.95`` (the other keys as they were), bit for bit."""
    a, b = _model(), _model()
    _train(a, mf.create_hybrid_optimizer(a, compile=False), 4, seed=1)
    _train(b, mf.create_hybrid_optimizer(b, beta2=0.95, compile=False), 4, seed=1)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize(
    "kwargs, head",
    [({"beta2": None}, "Muon"), ({"adamuon_beta2": 0.999}, "AdaMuon"), ({"beta2": 0.9}, "NorMuon")],
    ids=["muon", "adamuon", "beta2"],
)
def test_other_recipes_are_one_keyword_away(kwargs, head):
    opt = mf.create_hybrid_optimizer(_model(), compile=False, **kwargs)
    group = _muon_group(opt)
    assert _head(opt) == head
    assert group["beta2"] == kwargs.get("beta2") and group["adamuon_beta2"] == kwargs.get(
        "adamuon_beta2"
    )
    assert ("normalize_rows" in opt.describe()) == (head == "NorMuon")


def test_optimizer_classes_without_normuon_get_no_beta2():
    opt = mf.create_hybrid_optimizer(
        _model(), optimizer_cls=mf.SpectralSphereOptimizer, compile=False
    )
    assert "beta2" not in _muon_group(opt)


@pytest.mark.parametrize(
    "saved_beta2, built_beta2",
    [(None, NORMUON_BETA2), (NORMUON_BETA2, None)],
    ids=["old-muon-checkpoint", "normuon-checkpoint-into-muon"],
)
def test_checkpoint_runs_the_rule_it_ran_with(saved_beta2, built_beta2):
    """An older checkpoint (the hybrid ran Muon then: ``beta2=None``) loaded into today's default
    continues as Muon, bit for bit with the optimizer that wrote it; and the other way round. The
    split names the loaded rule."""
    model = _model()
    before = mf.create_hybrid_optimizer(model, beta2=saved_beta2, compile=False)
    _train(model, before, 3, seed=2)
    saved_model, saved = copy.deepcopy(model.state_dict()), copy.deepcopy(before.state_dict())
    _train(model, before, 3, seed=3)  # the run as it went on

    again = _model()
    again.load_state_dict(saved_model)
    after = mf.create_hybrid_optimizer(again, beta2=built_beta2, compile=False)
    assert _head(after) == ("NorMuon" if built_beta2 else "Muon")
    after.load_state_dict(saved)
    assert _muon_group(after)["beta2"] == saved_beta2
    assert _head(after) == ("NorMuon" if saved_beta2 else "Muon")
    _train(again, after, 3, seed=3)
    for p, q in zip(model.parameters(), again.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize(
    "copy_of", [copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o))], ids=["deepcopy", "pickle"]
)
def test_a_copy_names_the_rule_it_loads(copy_of):
    """The split reads the rule from its own optimizer: a copy's split follows the copy's groups."""
    old = mf.create_hybrid_optimizer(_model(), beta2=None, compile=False).state_dict()
    opt = mf.create_hybrid_optimizer(_model(), compile=False)
    twin = copy_of(opt)
    assert twin.split.optimizer is twin and _head(twin) == "NorMuon"
    twin.load_state_dict(old)
    assert (_head(twin), _head(opt)) == ("Muon", "NorMuon")
