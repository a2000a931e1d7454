"""Device-clean construction: no op of an optimizer's construction or step mixes a meta tensor
with a real one.

Every adapter traces one update on meta tensors at construction (so shape errors surface early,
naming the parameter). torch lets a 0-d *CPU* tensor meet a meta tensor in an op, so a CPU-only
suite never sees a real per-step scalar (lr, momentum) leak into that trace; on CUDA the same op
raises ("Tensor on device cuda:0 is not on the expected device meta!"). The dispatch mode below
records every such mix on the CPU, where it would pass silently.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import muon_fn as mf
from muon_fn.tools.train.model import GPT, config_for


class MetaMixes(TorchDispatchMode):
    """Records the ops whose tensor arguments include a meta tensor and a non-meta one."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        devices = {
            t.device.type for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
        }
        if "meta" in devices and len(devices) > 1:
            self.ops.append(str(func))
        return func(*args, **kwargs)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.conv = nn.Conv1d(16, 16, 3, padding=1)
        self.fc1 = nn.Linear(16, 24)
        self.fc2 = nn.Linear(24, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 32, bias=False)

    def forward(self, x):
        h = self.conv(self.emb(x).mT).mT
        return self.head(self.norm(self.fc2(torch.tanh(self.fc1(h)))))


def _gpt():
    torch.manual_seed(0)
    return GPT(config_for("tiny", n_layer=1, n_embd=32, n_head=2, block_size=16, vocab_size=32))


def _matrices(m):
    return [p for p in m.parameters() if p.ndim == 2]


BUILDERS = {
    "Optimizer": (
        Net,
        lambda m: mf.Optimizer(_matrices(m), lambda h: mf.muon(h["lr"]), {"lr": 0.02}),
    ),
    "MuonOptimizer": (
        Net,
        lambda m: mf.MuonOptimizer(m.parameters(), weight_decay=0.01, matrix_view="flatten"),
    ),
    "MuonOptimizer-normuon": (
        Net,
        lambda m: mf.MuonOptimizer(m.parameters(), beta2=0.95, matrix_view="flatten"),
    ),
    "MuonOptimizer-gram": (
        Net,
        lambda m: mf.MuonOptimizer(
            m.parameters(), method="gram", ns_dtype=torch.float32, matrix_view="flatten"
        ),
    ),
    "create_hybrid_optimizer": (
        Net,
        lambda m: mf.create_hybrid_optimizer(m, muon_weight_decay=0.01),
    ),
    "hybrid-qk-clip": (_gpt, lambda m: mf.create_hybrid_optimizer(m, qk_clip=mf.QKClip(m, 10.0))),
    "SpectralSphereOptimizer": (
        Net,
        lambda m: mf.SpectralSphereOptimizer(m.parameters(), matrix_view="flatten"),
    ),
    "TritonMuon": (Net, lambda m: mf.TritonMuon(m.parameters(), weight_decay=0.01)),
    "TritonMuonW": (Net, lambda m: mf.TritonMuonW(m.parameters(), weight_decay=0.01)),
    "FSDPMuonOptimizer": (Net, lambda m: mf.FSDPMuonOptimizer(m)),
    "FSDPSpectralSphereOptimizer": (Net, lambda m: mf.FSDPSpectralSphereOptimizer(m)),
}


@pytest.mark.parametrize("name", list(BUILDERS))
def test_construction_and_step_mix_no_meta_tensor_with_a_real_one(name):
    make_model, build = BUILDERS[name]
    model = make_model()
    mixes = MetaMixes()
    with mixes:
        opt = build(model)
    assert mixes.ops == [], (
        f"{name} construction mixed meta and real tensors in {sorted(set(mixes.ops))}"
    )
    x = torch.randint(0, 32, (2, 8))
    model(x).float().square().mean().backward()
    with mixes:
        opt.step()
    assert mixes.ops == [], f"{name} step mixed meta and real tensors in {sorted(set(mixes.ops))}"


def test_the_detector_sees_a_cpu_scalar_meeting_a_meta_tensor():
    """The mix torch lets through on the CPU (and refuses on CUDA) is what the mode records."""
    mixes = MetaMixes()
    with mixes:
        torch.empty(3, device="meta").lerp(torch.empty(3, device="meta"), torch.tensor(0.5))
    assert mixes.ops == ["aten.lerp.Tensor"]
