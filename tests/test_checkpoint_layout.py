"""Checkpoints record the parameter layout, and a load into another layout is refused before
anything changes.

``state_dict()`` stores ``param_layout`` (name, global shape, matrix view per parameter) in every
param group; ``load_state_dict`` compares it with its own first. Messages are pinned with
expecttest. The FSDP side (DCP, ranks) runs in tests/test_fsdp.py.

Tests taking ``device`` run on each device of the lane (tests/conftest.py): models and state on
the device, gradients drawn on the CPU from seeded generators and moved, checkpoints written on
the device and read on the CPU (``map_location``) before they load on the device. What they
compare is exact on every device (the same optimizer continuing on the same device, or state
moved as it is); the refusals' messages (the expecttest classes) name shapes and names only.
"""

from __future__ import annotations

import copy
import json

import expecttest
import pytest
import torch
from conftest import read_on_cpu, roundtrip
from torch import nn

import muon_fn as mf
from muon_fn.engine import layout as _layout

# Moe built without a matrix_view on purpose: the guessed view is what gets recorded.
pytestmark = pytest.mark.filterwarnings("ignore:MuonOptimizer. no matrix_view")


class TwoLayers(nn.Module):
    """Two same-shape hidden layers: swapping their order keeps every shape."""

    def __init__(self, swap: bool = False, rename: bool = False) -> None:
        super().__init__()
        first, second = ("b", "a") if swap else ("a", "b")
        setattr(self, first, nn.Linear(6, 6, bias=False))
        setattr(self, "c" if rename and second == "b" else second, nn.Linear(6, 6, bias=False))
        self.head = nn.Linear(6, 2)


class Moe(nn.Module):
    """An expert stack (E, out, in) and a conv weight: both 3-D, read differently."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.Parameter(torch.randn(3, 4, 5))
        self.conv = nn.Conv1d(2, 4, 3)


def build(model: nn.Module, **kw) -> mf.MuonOptimizer:
    return mf.MuonOptimizer(model.named_parameters(), compile=False, **kw)


def step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    """The same gradients on every device: drawn on the CPU, then moved."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g).to(p.device)
    opt.step()


def trained(model: nn.Module, steps: int = 2, **kw) -> mf.MuonOptimizer:
    opt = build(model, **kw)
    for t in range(steps):
        step(model, opt, t)
    return opt


def snapshot(opt: torch.optim.Optimizer):
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    state = {id(p): {k: v.clone() for k, v in st.items()} for p, st in opt.state.items()}
    return groups, state


def assert_unchanged(opt: torch.optim.Optimizer, snap) -> None:
    groups, state = snap
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups
    assert {id(p) for p in opt.state} == set(state)
    for p, st in opt.state.items():
        assert set(st) == set(state[id(p)])
        for k, v in st.items():
            assert torch.equal(v, state[id(p)][k]), k


def message(fn) -> str:
    with pytest.raises(ValueError) as info:
        fn()
    return str(info.value)


class TestRecord(expecttest.TestCase):
    def test_recorded_layout(self):
        torch.manual_seed(0)
        model = Moe()
        sd = build(model).state_dict()
        self.assertExpectedInline(
            repr(sd["param_groups"][0]["param_layout"]),
            """\
[('experts', (3, 4, 5), 'flatten'), ('conv.weight', (4, 2, 3), 'flatten'), ('conv.bias', (4,), 'flatten')]""",
        )
        opt = mf.create_hybrid_optimizer(model, compile=False)
        self.assertExpectedInline(
            repr([g["param_layout"] for g in opt.state_dict()["param_groups"]]),
            """\
[[('experts', (3, 4, 5), 'experts'), ('conv.weight', (4, 2, 3), 'flatten')], [('conv.bias', (4,), 'flatten')]]""",
        )

    def test_unnamed_parameters_and_a_plain_transform(self):
        lin = nn.Linear(3, 2)
        opt = mf.Optimizer([lin.weight], mf.muon(0.02), compile=False)
        self.assertExpectedInline(
            repr(opt.state_dict()["param_groups"][0]["param_layout"]), """[(None, (2, 3), None)]"""
        )

    def test_the_record_never_becomes_a_hyperparameter(self):
        model = TwoLayers()
        opt = trained(model)
        sd = roundtrip(opt.state_dict())
        other = build(TwoLayers())
        other.load_state_dict(sd)
        assert all(_layout.KEY not in g for g in other.param_groups)
        assert (
            other.state_dict()["param_groups"][0][_layout.KEY] == sd["param_groups"][0][_layout.KEY]
        )


class TestRefused(expecttest.TestCase):
    def test_reordered_model_would_get_another_layers_momentum(self):
        """Same shapes in another order: loaded by position, b's momentum would go to a. The
        record names the first parameter that differs, and nothing changes."""
        torch.manual_seed(0)
        sd = roundtrip(trained(TwoLayers()).state_dict())
        model = TwoLayers(swap=True)
        opt = trained(model, steps=1)
        snap = snapshot(opt)
        self.assertExpectedInline(
            message(lambda: opt.load_state_dict(sd)),
            """\
loaded state dict contains a parameter group that doesn't match optimizer's group 0: parameter 0 is 'a.weight' of shape (6, 6) in the state dict but 'b.weight' of shape (6, 6) in this optimizer; the state_dict comes from a different model layout""",  # noqa: E501
        )
        assert_unchanged(opt, snap)
        step(model, opt, 5)  # still usable

    def test_renamed_parameter(self):
        sd = roundtrip(trained(TwoLayers()).state_dict())
        opt = trained(TwoLayers(rename=True), steps=1)
        snap = snapshot(opt)
        self.assertExpectedInline(
            message(lambda: opt.load_state_dict(sd)),
            """\
loaded state dict contains a parameter group that doesn't match optimizer's group 0: parameter 1 is 'b.weight' of shape (6, 6) in the state dict but 'c.weight' of shape (6, 6) in this optimizer; the state_dict comes from a different model layout""",  # noqa: E501
        )
        assert_unchanged(opt, snap)

    def test_reshaped_parameter(self):
        src, dst = nn.Linear(4, 3), nn.Linear(3, 4)
        sd = roundtrip(trained(src).state_dict())
        opt = trained(dst, steps=1)
        snap = snapshot(opt)
        self.assertExpectedInline(
            message(lambda: opt.load_state_dict(sd)),
            """\
loaded state dict contains a parameter group that doesn't match optimizer's group 0: parameter 0 is 'weight' of shape (3, 4) in the state dict but 'weight' of shape (4, 3) in this optimizer; the state_dict comes from a different model layout""",  # noqa: E501
        )
        assert_unchanged(opt, snap)

    def test_other_matrix_view(self):
        """Same names and shapes, but the expert stack was one flattened matrix when saved."""
        torch.manual_seed(0)
        model = Moe()
        sd = roundtrip(trained(model, matrix_view={"experts": "flatten"}).state_dict())
        opt = trained(copy.deepcopy(model), steps=1, matrix_view={"experts": "experts"})
        snap = snapshot(opt)
        self.assertExpectedInline(
            message(lambda: opt.load_state_dict(sd)),
            """\
loaded state dict contains a parameter group that doesn't match optimizer's group 0: parameter 0 is 'experts' of shape (3, 4, 5) with view 'flatten' in the state dict but 'experts' of shape (3, 4, 5) with view 'experts' in this optimizer; the state_dict comes from a different model layout""",  # noqa: E501
        )
        assert_unchanged(opt, snap)

    def test_a_loader_that_wrote_in_place_is_named(self):
        """A loader that writes the checkpoint into the tensors ``state_dict()`` returned (DCP does,
        with the optimizer's own state tensors) has changed the state before the check: the refusal
        says so, and that the optimizer must be built again; a loaded copy's refusal does not."""
        torch.manual_seed(0)
        model = Moe()
        saved = roundtrip(trained(model, matrix_view={"experts": "flatten"}).state_dict())
        opt = trained(copy.deepcopy(model), steps=1, matrix_view={"experts": "experts"})
        assert _layout.OVERWRITTEN not in message(lambda: opt.load_state_dict(saved))
        live = (
            opt.state_dict()
        )  # the optimizer's own tensors, as DCP's get_optimizer_state_dict gives them
        for entry, loaded in zip(live["state"].values(), saved["state"].values()):
            for key, t in entry.items():
                if isinstance(t, torch.Tensor):
                    t.copy_(loaded[key])  # what dcp.load does
        live["param_groups"] = saved["param_groups"]
        self.assertExpectedInline(
            message(lambda: opt.load_state_dict(live)),
            """\
loaded state dict contains a parameter group that doesn't match optimizer's group 0: parameter 0 is 'experts' of shape (3, 4, 5) with view 'flatten' in the state dict but 'experts' of shape (3, 4, 5) with view 'experts' in this optimizer; the state_dict comes from a different model layout. The loader had already written this state_dict's state into the optimizer's own state tensors (torch.distributed.checkpoint loads in place into what get_optimizer_state_dict returned), so the optimizer's state is the refused checkpoint's now: build the optimizer again before stepping (the parameters are unchanged)""",  # noqa: E501
        )

    def test_group_of_another_size_in_torchs_words(self):
        sd = roundtrip(trained(TwoLayers()).state_dict())
        opt = build(nn.Linear(6, 6))
        self.assertExpectedInline(
            message(lambda: opt.load_state_dict(sd)),
            """\
loaded state dict contains a parameter group that doesn't match the size of optimizer's group: group 0 has 4 parameters in the state dict and 2 in this optimizer""",  # noqa: E501
        )

    def test_unnamed_parameters_are_compared_by_shape(self):
        src, dst = nn.Linear(4, 3), nn.Linear(3, 4)
        opt = mf.MuonOptimizer(src.parameters(), compile=False)
        step(src, opt, 0)
        other = mf.MuonOptimizer(dst.parameters(), compile=False)
        self.assertExpectedInline(
            message(lambda: other.load_state_dict(roundtrip(opt.state_dict()))),
            """\
loaded state dict contains a parameter group that doesn't match optimizer's group 0: parameter 0 is one of shape (3, 4) in the state dict but one of shape (4, 3) in this optimizer; the state_dict comes from a different model layout""",  # noqa: E501
        )


class TestWithoutRecord(expecttest.TestCase):
    """Checkpoints without ``param_layout`` (older muon_fn, torch.optim): accepted when sizes
    match; their ``param_names`` are compared where both sides have them."""

    @staticmethod
    def old(sd):
        for g in sd["param_groups"]:
            del g[_layout.KEY]
        return sd

    def test_param_names_are_compared(self):
        sd = self.old(roundtrip(trained(TwoLayers()).state_dict()))
        opt = trained(TwoLayers(swap=True), steps=1)
        snap = snapshot(opt)
        self.assertExpectedInline(
            message(lambda: opt.load_state_dict(sd)),
            """\
loaded state dict contains a parameter group that doesn't match optimizer's group 0: parameter 0 is 'a.weight' in the state dict's param_names but 'b.weight' in this optimizer; the state_dict comes from a different model layout""",  # noqa: E501
        )
        assert_unchanged(opt, snap)

    def test_without_names_only_sizes_are_checked(self):
        src, dst = nn.Linear(4, 3), nn.Linear(3, 4)
        sd = self.old(roundtrip(trained(src).state_dict()))
        for g in sd["param_groups"]:
            del g["param_names"]
        opt = trained(dst, steps=1)
        snap = snapshot(opt)
        self.assertExpectedInline(
            message(lambda: opt.load_state_dict(sd)),
            """\
loaded state 'momentum_buffer' for parameter 'weight' has shape (3, 4), expected (4, 3): the state_dict comes from a different optimizer layout""",  # noqa: E501
        )
        assert_unchanged(opt, snap)


def test_old_checkpoint_loads_when_sizes_match_and_continues_bit_for_bit(device):
    """A checkpoint without the record (TestWithoutRecord), written on the device and read on the
    CPU, loads on the device and continues as the uninterrupted run does, bit for bit."""
    torch.manual_seed(0)
    model = TwoLayers().to(device)
    opt = trained(model)
    clone = copy.deepcopy(model)
    other = build(clone)
    other.load_state_dict(TestWithoutRecord.old(read_on_cpu(opt.state_dict())))
    assert all(
        v.device == p.device
        for p, st in other.state.items()
        for v in st.values()
        if isinstance(v, torch.Tensor)
    )
    step(model, opt, 7)
    step(clone, other, 7)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), clone.parameters()))


def test_record_survives_json(device):
    """Tuples come back as lists through JSON; the record still matches."""
    model = TwoLayers().to(device)
    sd = trained(model).state_dict()
    groups = json.loads(
        json.dumps([{k: v for k, v in g.items() if k == _layout.KEY} for g in sd["param_groups"]])
    )
    for g, j in zip(sd["param_groups"], groups):
        g[_layout.KEY] = j[_layout.KEY]
    build(copy.deepcopy(model)).load_state_dict(sd)


def test_dcp_state_dict_matches_by_name(device):
    """``get_optimizer_state_dict`` keys state by name, so a reordered model loads correctly
    through ``set_optimizer_state_dict``, as copies of the saved tensors (torch's own load would
    share them with the live optimizer they came from); a changed view is still refused, naming it."""
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    torch.manual_seed(0)
    model = TwoLayers().to(device)
    opt = trained(model)
    osd = get_optimizer_state_dict(model, opt)
    swapped = TwoLayers(swap=True).to(device)
    swapped.load_state_dict(model.state_dict())
    other = build(swapped)
    set_optimizer_state_dict(swapped, other, copy.deepcopy(osd))
    for name in ("a.weight", "b.weight"):
        p, q = dict(model.named_parameters())[name], dict(swapped.named_parameters())[name]
        assert torch.equal(opt.state[p]["momentum_buffer"], other.state[q]["momentum_buffer"]), name
    shared = {v.data_ptr() for st in opt.state.values() for v in st.values()}
    assert not shared & {v.data_ptr() for st in other.state.values() for v in st.values()}  # copies
    torch.manual_seed(0)
    moe = Moe().to(device)
    flat = trained(moe, matrix_view={"experts": "flatten"})
    moe2 = copy.deepcopy(moe)
    stacks = trained(
        moe2, steps=1, matrix_view={"experts": "experts"}
    )  # torch would init the state
    snap = snapshot(stacks)
    with pytest.raises(
        ValueError, match="'experts' of shape \\(3, 4, 5\\) with view 'flatten' in the state dict"
    ):
        set_optimizer_state_dict(moe2, stacks, get_optimizer_state_dict(moe, flat))
    assert_unchanged(stacks, snap)


def test_dcp_state_dict_of_unnamed_parameters_loads(device):
    """Saved without names, keyed by name by torch.distributed.checkpoint: the record cannot be
    aligned, so the state's sizes are what is checked."""
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3)).to(device)
    opt = mf.MuonOptimizer(model.parameters(), compile=False)
    step(model, opt, 0)
    clone = copy.deepcopy(model)
    other = mf.MuonOptimizer(clone.parameters(), compile=False)
    set_optimizer_state_dict(clone, other, copy.deepcopy(get_optimizer_state_dict(model, opt)))
    step(model, opt, 1)
    step(clone, other, 1)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), clone.parameters()))


@pytest.mark.parametrize(
    "cls, kw",
    [
        (mf.MuonOptimizer, dict(ns_dtype=torch.float32, momentum_dtype=torch.float32)),
        (mf.SpectralSphereOptimizer, dict(msign_dtype=torch.float32)),  # a dtype by default
    ],
    ids=["muon", "sso"],
)
@pytest.mark.parametrize("form", ["full_state_dict", "dtypes_themselves"])
def test_dtype_hyperparameters_are_saved_by_name(device, cls, kw, form):
    """Dtype hyperparameters are saved as their names, so the full state dict of
    torch.distributed.checkpoint (tensors, numbers, strings and containers only; offloaded to the
    CPU) and JSON take the param groups; the load restores the dtypes and continues as the
    uninterrupted run, bit for bit. A checkpoint that stored the dtypes themselves loads as well."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    torch.manual_seed(0)
    model = TwoLayers().to(device)
    opt = cls(model.named_parameters(), compile=False, **kw)
    step(model, opt, 0)
    clone = copy.deepcopy(model)
    other = cls(clone.named_parameters(), compile=False)
    if form == "full_state_dict":
        osd = get_optimizer_state_dict(
            model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        assert {k: osd["param_groups"][0][k] for k in kw} == {k: str(v) for k, v in kw.items()}
        osd["param_groups"] = json.loads(json.dumps(osd["param_groups"]))
        set_optimizer_state_dict(clone, other, osd, options=StateDictOptions(full_state_dict=True))
    else:
        sd = read_on_cpu(opt.state_dict())
        other.load_state_dict({**sd, "param_groups": [{**g, **kw} for g in sd["param_groups"]]})
    assert {k: other.param_groups[0][k] for k in kw} == kw
    for t in (1, 2):
        step(model, opt, t)
        step(clone, other, t)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), clone.parameters()))
