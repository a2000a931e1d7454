"""FSDPMuonOptimizer on CPU/gloo: one spawned job per world size (4, then 2) runs every check.

The job (this file run as a script) spawns W processes; each check runs on every rank and the
ranks' results are gathered into a JSON file that the pytest tests below read, one test per check.
Bit-exact checks feed the same synthetic gradients to the sharded model and to a single-device
``MuonOptimizer`` reference. A collective timeout (60 s) and a job timeout bound every hang.
"""

from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.nn as nn

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[1]
JOB_TIMEOUT_S = 240
STEPS = 10
# bf16 parameters in the FSDP2 compute (MixedPrecisionPolicy): tolerance after 5 steps (measured
# 3.5e-3 at W=4; every step moves an entry by about lr·s = 0.02–0.03). State: 10x these.
MP_ATOL = 1e-2
# bf16 on the wire (momentum rounded before orthogonalization): tolerance after 10 steps.
WIRE_BF16_ATOL = 2e-3
# Real backward through FSDP2 (reduce-scatter sums in another order): tolerance after 4 steps.
BACKWARD_ATOL = 2e-6


# ---------------------------------------------------------------------------- models
class Toy(nn.Module):
    """Matrices with uneven and empty shards at W=4: 10x6 (3,3,3,1), 3x6 (1,1,1,0), 1x3, 5x1,
    6x10, two 5x5 (a shape shared by two matrices, so batching matters), plus 1-D params."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(6, 10)
        self.l2 = nn.Linear(10, 6, bias=False)
        self.l3 = nn.Linear(6, 3)
        self.l4 = nn.Linear(3, 1, bias=False)
        self.l5 = nn.Linear(1, 5)
        self.l6 = nn.Linear(5, 5, bias=False)
        self.l7 = nn.Linear(5, 5)
        self.norm = nn.LayerNorm(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in (self.l1, self.l2, self.l3, self.l4, self.l5, self.l6, self.l7):
            x = torch.tanh(layer(x))
        return self.norm(x)


class Mlp(nn.Module):
    """A well-conditioned net for checks through real backward passes (Muon's msign amplifies
    the noise in small singular directions, so a bottleneck like Toy's 1-wide layer is unfit)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 10)
        self.l2 = nn.Linear(10, 6)
        self.l3 = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l3(torch.tanh(self.l2(torch.tanh(self.l1(x)))))


def make_mlp(seed: int = 0) -> Mlp:
    torch.manual_seed(seed)
    return Mlp()


def shard_mlp(model: nn.Module, mp_policy=None) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    kw = {} if mp_policy is None else {"mp_policy": mp_policy}
    for layer in (model.l1, model.l2, model.l3):
        fully_shard(layer, **kw)
    return fully_shard(model, **kw)


def mlp_loss(model: nn.Module, step: int, rows: slice | None = None) -> torch.Tensor:
    x = synthetic_grad((64, 8), 77, step)
    y = synthetic_grad((64, 3), 78, step)
    if rows is not None:
        x, y = x[rows], y[rows]
    return (model(x) - y).square().mean()


def make_toy(seed: int = 0) -> Toy:
    torch.manual_seed(seed)
    return Toy()


def shard_toy(model: nn.Module, mesh=None, mp_policy=None) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw = {"mesh": mesh} if mesh is not None else {}
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    for name in ("l1", "l2", "l3", "l4", "l5", "l6", "l7"):
        fully_shard(getattr(model, name), **kw)
    fully_shard(model, **kw)
    del MixedPrecisionPolicy
    return model


def synthetic_grad(shape, step: int, index: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + index)
    return torch.randn(shape, generator=gen)


def set_grads(model: nn.Module, step: int) -> None:
    """The same global gradients on every rank; a DTensor parameter gets its exact shard."""
    from torch.distributed.tensor import DTensor

    for i, p in enumerate(model.parameters()):
        g = synthetic_grad(tuple(p.shape), step, i)
        if isinstance(p, DTensor):
            local = _rows_of(g, p)
            p.grad = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                        shape=p.shape, stride=p.stride())
        else:
            p.grad = g


def _rows_of(full: torch.Tensor, p) -> torch.Tensor:
    from muon_fn.fsdp._plan import chunk_rows

    mesh = p.device_mesh
    dim = mesh.ndim - 1
    a, b = chunk_rows(full.shape[0], mesh.size(dim))[mesh.get_local_rank(dim)]
    return full[a:b].clone()


def muon_kwargs(**extra):
    return dict(lr=0.02, momentum=0.95, weight_decay=0.01, ns_dtype=torch.float32, **extra)


def reference_run(model: nn.Module, steps: int, first: int = 0, **kw):
    import muon_fn as mf

    opt = mf.MuonOptimizer(model.parameters(), foreach=False, **muon_kwargs(**kw))
    for t in range(first, first + steps):
        set_grads(model, t)
        opt.step()
    return opt


def full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def assert_same(model, opt, ref, ref_opt, *, atol: float = 0.0, what: str = "",
                expected_steps: int = STEPS) -> float:
    """Parameters and optimizer state equal (bitwise if atol == 0); returns the max abs error."""
    worst = 0.0
    pairs = zip(model.named_parameters(), ref.parameters())
    for (name, p), q in pairs:
        a, b = full(p.detach()), q.detach()
        err = (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
        worst = max(worst, err)
        if atol == 0.0:
            assert torch.equal(a, b), f"{what}{name}: max abs error {err}"
        else:
            assert err <= atol, f"{what}{name}: max abs error {err} > {atol}"
        for key, value in ref_opt.state[q].items():
            if key == "step" and "momentum_buffer" in ref_opt.state[q]:
                # MuonOptimizer leaves a Muon param's "step" at 0 in mixed groups; ours counts.
                assert opt.state[p]["step"].item() in (value.item(), expected_steps), (name, key)
                continue
            mine = full(opt.state[p][key])
            e = (mine.float() - value.float()).abs().max().item() if value.numel() else 0.0
            if atol == 0.0:
                assert torch.equal(mine, value), f"{what}{name} state {key}: max abs error {e}"
            else:
                assert e <= 10 * atol, f"{what}{name} state {key}: max abs error {e} > {10 * atol}"
    return worst


# ---------------------------------------------------------------------------- checks
def check_parity(w, strategy="owner", compile=False, **kw):
    from muon_fn.fsdp import FSDPMuonOptimizer

    def run():
        ref = make_toy()
        model = shard_toy(copy.deepcopy(ref))
        opt = FSDPMuonOptimizer(model, strategy=strategy, compile=compile, **muon_kwargs(**kw))
        for t in range(STEPS):
            set_grads(model, t)
            opt.step()
        ref_opt = reference_run(ref, STEPS, **kw)
        assert_same(model, opt, ref, ref_opt, what=f"W={w} {strategy}: ")
        return {"applied": opt.last_step_stats["applied"]}

    return run


def check_wire_bf16(w):
    from muon_fn.fsdp import FSDPMuonOptimizer

    def run():
        ref = make_toy()
        model = shard_toy(copy.deepcopy(ref))
        opt = FSDPMuonOptimizer(model, wire_dtype=torch.bfloat16, **muon_kwargs())
        for t in range(STEPS):
            set_grads(model, t)
            opt.step()
        ref_opt = reference_run(ref, STEPS)
        err = assert_same(model, opt, ref, ref_opt, atol=WIRE_BF16_ATOL)
        assert err > 0.0, "bf16 on the wire should not be bit-exact (was the wire dtype used?)"
        return {"max_abs_err": err}

    return run


def check_plain_replicated(w):
    """A plain (non-FSDP) model on every rank: DDP-style, owners compute, results shared."""
    from muon_fn.fsdp import FSDPMuonOptimizer

    def run():
        ref = make_toy()
        model = copy.deepcopy(ref)
        opt = FSDPMuonOptimizer(model, **muon_kwargs())
        owners = {mp.owner for mp in opt.plan.matrices}
        assert owners == set(range(w)) or len(opt.plan.matrices) < w, owners
        for t in range(STEPS):
            set_grads(model, t)
            opt.step()
        ref_opt = reference_run(ref, STEPS)
        assert_same(model, opt, ref, ref_opt)
        assert opt.last_step_stats["bytes_sent"] > 0 or opt.last_step_stats["matrices_computed"] == 0

    return run


def check_normuon(w):
    from muon_fn.fsdp import FSDPMuonOptimizer

    def run():
        ref = make_toy()
        model = shard_toy(copy.deepcopy(ref))
        opt = FSDPMuonOptimizer(model, beta2=0.95, **muon_kwargs())
        for t in range(STEPS):
            set_grads(model, t)
            opt.step()
        ref_opt = reference_run(ref, STEPS, beta2=0.95)
        assert_same(model, opt, ref, ref_opt, what="NorMuon: ")

    return run


def check_hybrid_groups(w):
    """Explicit groups: embedding-like first layer and head on AdamW (use_muon=False)."""
    import muon_fn as mf
    from muon_fn.fsdp import FSDPMuonOptimizer

    def groups(m):
        adam = [m.l1.weight, m.l7.weight]
        ids = {id(p) for p in adam}
        rest = [p for p in m.parameters() if id(p) not in ids]
        return [{"params": rest}, {"params": adam, "use_muon": False}]

    def run():
        ref = make_toy()
        model = shard_toy(copy.deepcopy(ref))
        opt = FSDPMuonOptimizer(model, groups(model), **muon_kwargs())
        ref_opt = mf.MuonOptimizer(
            [{"params": [p for p in ref.parameters() if p is not ref.l1.weight and p is not ref.l7.weight]},
             {"params": [ref.l1.weight, ref.l7.weight], "algorithm": "adamw",
              "lr": 3e-4, "weight_decay": 0.0}],
            foreach=False, **muon_kwargs())
        for t in range(STEPS):
            set_grads(model, t)
            set_grads(ref, t)
            opt.step()
            ref_opt.step()
        assert_same(model, opt, ref, ref_opt, what="hybrid: ")
        assert "adamw l1.weight" in opt.describe()

    return run


def check_bytes_formula(w):
    """Shapes divisible by W: mean bytes per rank = 2(W-1)/W^2 * S (half with bf16 on the wire)."""
    from torch.distributed.fsdp import fully_shard

    from muon_fn.fsdp import FSDPMuonOptimizer
    from muon_fn._newton_schulz import coefficient_schedule
    from muon_fn.fsdp._plan import ns_flops

    def run():
        out = {}
        for wire, item in ((None, 4), (torch.bfloat16, 2)):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.Linear(16, 8, bias=False),
                                  nn.Linear(8, 8, bias=False))
            for layer in model:
                fully_shard(layer)
            fully_shard(model)
            opt = FSDPMuonOptimizer(model, wire_dtype=wire, **muon_kwargs())
            set_grads(model, 0)
            opt.step()
            s = item * sum(p.numel() for p in model.parameters())
            sent = torch.tensor([float(opt.last_step_stats["bytes_sent"])])
            torch.distributed.all_reduce(sent)
            mean = sent.item() / w
            assert mean == 2 * (w - 1) / w**2 * s, (mean, 2 * (w - 1) / w**2 * s)
            out[str(wire)] = mean
            rep = FSDPMuonOptimizer(model, strategy="replicate", wire_dtype=wire, **muon_kwargs())
            set_grads(model, 0)
            rep.step()
            assert rep.last_step_stats["bytes_sent"] == (w - 1) / w * s
            # replicate: every rank computes every matrix; owner: the ranks split them.
            schedule = coefficient_schedule("aol9", 4)  # the default method and its designed steps
            every = sum(ns_flops(mp.shape, schedule) for mp in opt.plan.matrices)
            assert rep.last_step_stats["ns_flops"] == every
            mine = torch.tensor([float(opt.last_step_stats["ns_flops"])])
            torch.distributed.all_reduce(mine)
            assert mine.item() == every
        return out

    return run


def check_no_grad_rank(w):
    """Rank 1 has no gradients at all: it still joins every exchange; nothing hangs; its shards
    stay as they are while the other ranks update theirs."""
    from muon_fn.fsdp import FSDPMuonOptimizer

    def run():
        rank = torch.distributed.get_rank()
        model = shard_toy(make_toy())
        before = {n: p.to_local().clone() for n, p in model.named_parameters()}
        for strategy in ("owner", "replicate"):
            opt = FSDPMuonOptimizer(model, strategy=strategy, **muon_kwargs())
            set_grads(model, 0)
            if rank == 1:
                for p in model.parameters():
                    p.grad = None
            opt.step()
            opt.step()  # twice: nothing left half-done
        changed = [n for n, p in model.named_parameters()
                   if p.to_local().numel() and not torch.equal(p.to_local(), before[n])]
        if rank == 1:
            assert changed == [], changed
        else:
            assert "l1.weight" in changed, changed
        # Every rank without grads: a no-op, no hang.
        model.zero_grad(set_to_none=True)
        snap = {n: p.to_local().clone() for n, p in model.named_parameters()}
        FSDPMuonOptimizer(model, **muon_kwargs()).step()
        assert all(torch.equal(p.to_local(), snap[n]) for n, p in model.named_parameters())

    return run


def check_nonfinite(w):
    """A NaN on rank 1 only: every rank skips ("skip") or raises ("error"); nothing changes."""
    from muon_fn.fsdp import FSDPMuonOptimizer

    def run():
        rank = torch.distributed.get_rank()
        model = shard_toy(make_toy())
        snap = {n: p.to_local().clone() for n, p in model.named_parameters()}
        for policy in ("skip", "error"):
            opt = FSDPMuonOptimizer(model, nonfinite=policy, **muon_kwargs())
            set_grads(model, 0)
            if rank == 1:
                model.l1.weight.grad.to_local()[0, 0] = float("nan")
            raised = ""
            try:
                opt.step()
            except RuntimeError as e:
                raised = str(e)
            if policy == "skip":
                assert not raised and opt.nonfinite_steps == 1, raised
            else:
                assert "non-finite" in raised, raised
                assert ("'l1.weight'" in raised) == (rank == 1), raised
        assert all(torch.equal(p.to_local(), snap[n]) for n, p in model.named_parameters())

    return run


def check_dcp_save(w, ckpt_dir):
    """Save model and optimizer after 5 steps (DTensor state, FQN keys)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from muon_fn.fsdp import FSDPMuonOptimizer

    def run():
        model = shard_toy(make_toy())
        opt = FSDPMuonOptimizer(model, **muon_kwargs())
        osd = get_optimizer_state_dict(model, opt)  # before any step: state exists, no step taken
        assert "l1.weight" in osd["state"] and "momentum_buffer" in osd["state"]["l1.weight"]
        for t in range(5):
            set_grads(model, t)
            opt.step()
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                 checkpoint_id=ckpt_dir)
        return {"keys": sorted(get_optimizer_state_dict(model, opt)["state"])}

    return run


def check_dcp_load(w, ckpt_dir):
    """Load what W=4 saved at W=2, continue 5 steps: equals 10 uninterrupted single-device steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from muon_fn.fsdp import FSDPMuonOptimizer

    def run():
        if not os.path.isdir(ckpt_dir) or not os.listdir(ckpt_dir):
            raise AssertionError(f"no checkpoint in {ckpt_dir}: the W=4 job did not save one")
        model = shard_toy(make_toy(seed=123))  # different init: everything must come from the file
        opt = FSDPMuonOptimizer(model, **muon_kwargs())
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(state, checkpoint_id=ckpt_dir)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, opt, state["optim"])
        for t in range(5, 10):
            set_grads(model, t)
            opt.step()
        ref = make_toy()
        ref_opt = reference_run(ref, 10)
        assert_same(model, opt, ref, ref_opt, what="DCP W=4 -> W=2: ")

    return run


def check_accumulation(w):
    """k=2 micro-batches with real backward: sync off for the first (grads stay None), on for the
    last; equals single-device MuonOptimizer(gradient_accumulation_steps=2) within BACKWARD_ATOL."""
    import muon_fn as mf
    from muon_fn.fsdp import FSDPMuonOptimizer

    def run():
        rank = torch.distributed.get_rank()
        rows = slice(rank * 64 // w, (rank + 1) * 64 // w)
        ref = make_mlp()
        model = shard_mlp(copy.deepcopy(ref))
        opt = FSDPMuonOptimizer(model, gradient_accumulation_steps=2, **muon_kwargs())
        ref_opt = mf.MuonOptimizer(ref.parameters(), gradient_accumulation_steps=2, foreach=False, **muon_kwargs())
        saw_none = saw_grad = 0
        for t in range(8):  # 4 optimizer steps
            mlp_loss(model, t, rows).backward()
            grads = [p.grad for p in model.parameters()]
            if t % 2 == 0:
                saw_none += all(g is None for g in grads)
            else:
                saw_grad += all(g is not None for g in grads)
            before = [g.to_local().clone() for g in grads if g is not None]
            opt.step()
            after = [g.to_local() for g in grads if g is not None]
            assert all(torch.equal(a, b) for a, b in zip(before, after)), "step() modified .grad"
            opt.zero_grad()
            mlp_loss(ref, t).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        assert saw_none == 4 and saw_grad == 4, (saw_none, saw_grad)
        return {"max_abs_err": assert_same(model, opt, ref, ref_opt, atol=BACKWARD_ATOL, expected_steps=4)}

    return run


def check_mixed_precision(w):
    """MixedPrecisionPolicy(bf16 params, fp32 reduce) runs and stays within MP_ATOL of fp32."""
    import muon_fn as mf
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from muon_fn.fsdp import FSDPMuonOptimizer

    def run():
        rank = torch.distributed.get_rank()
        rows = slice(rank * 64 // w, (rank + 1) * 64 // w)
        ref = make_mlp()
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        model = shard_mlp(copy.deepcopy(ref), mp_policy=policy)
        opt = FSDPMuonOptimizer(model, **muon_kwargs())
        ref_opt = mf.MuonOptimizer(ref.parameters(), foreach=False, **muon_kwargs())
        for t in range(5):
            mlp_loss(model, t, rows).backward()
            assert all(p.grad.dtype == torch.float32 for p in model.parameters())
            opt.step()
            opt.zero_grad()
            mlp_loss(ref, t).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        assert all(p.dtype == torch.float32 for p in model.parameters())
        return {"max_abs_err": assert_same(model, opt, ref, ref_opt, atol=MP_ATOL, expected_steps=5)}

    return run


def check_unshard(w):
    from torch.distributed.tensor import DTensor

    from muon_fn.fsdp import FSDPMuonOptimizer

    def run():
        ref = make_toy()
        model = shard_toy(copy.deepcopy(ref))
        opt = FSDPMuonOptimizer(model, **muon_kwargs())
        with opt.unshard_params() as m:
            w1 = m.l1.weight
            assert not isinstance(w1, DTensor) and tuple(w1.shape) == (10, 6), type(w1)
            assert torch.equal(w1.detach(), ref.l1.weight.detach())
        assert isinstance(model.l1.weight, DTensor)

    return run


def check_hsdp(w):
    """HSDP (2-D mesh: replicate x shard): the shard sub-mesh is used; bit-exact parity."""
    from torch.distributed.device_mesh import init_device_mesh

    from muon_fn.fsdp import FSDPMuonOptimizer

    def run():
        mesh = init_device_mesh("cpu", (2, w // 2), mesh_dim_names=("replicate", "shard"))
        ref = make_toy()
        model = shard_toy(copy.deepcopy(ref), mesh=mesh)
        opt = FSDPMuonOptimizer(model, **muon_kwargs())
        assert opt.topology.world_size == w // 2
        for t in range(STEPS):
            set_grads(model, t)
            opt.step()
        ref_opt = reference_run(ref, STEPS)
        assert_same(model, opt, ref, ref_opt, what="HSDP: ")

    return run


def check_errors(w):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from muon_fn.fsdp import FSDPMuonOptimizer

    def expect(fn, *needles):
        try:
            fn()
        except (ValueError, TypeError, RuntimeError) as e:
            for n in needles:
                assert n in str(e), f"{n!r} not in: {e}"
            return str(e)
        raise AssertionError(f"no error; expected one mentioning {needles}")

    class Holder(nn.Module):
        def __init__(self, **params):
            super().__init__()
            for k, v in params.items():
                setattr(self, k, nn.Parameter(v))

    def run():
        msgs = {}
        mesh = init_device_mesh("cpu", (w,))
        mesh2 = init_device_mesh("cpu", (2, w // 2))
        x = torch.randn(8, 8)
        col = Holder(proj=distribute_tensor(x, mesh, [Shard(1)]))
        msgs["shard1"] = expect(lambda: FSDPMuonOptimizer(col), "'proj'", "Shard(dim=1)")
        two = Holder(attn=distribute_tensor(x, mesh2, [Shard(0), Replicate()]))
        msgs["2d"] = expect(lambda: FSDPMuonOptimizer(two), "'attn'", "2-D device mesh")
        sub = mesh2["dim_1"] if mesh2.mesh_dim_names else None
        del sub
        mesh_b = init_device_mesh("cpu", (2, w // 2), mesh_dim_names=("a", "b"))["b"]
        mixed = Holder(up=distribute_tensor(x, mesh, [Shard(0)]),
                       down=distribute_tensor(x, mesh_b, [Shard(0)]))
        msgs["groups"] = expect(lambda: FSDPMuonOptimizer(mixed), "'down'", "same process group")
        other = dist.new_group(list(range(w // 2)))
        msgs["pg"] = expect(lambda: FSDPMuonOptimizer(mixed_one(mesh), process_group=other),
                            "process_group", "'up'")
        plain = nn.Linear(4, 4)
        msgs["accum"] = expect(lambda: FSDPMuonOptimizer(plain, gradient_accumulation_steps=2),
                               "gradient_accumulation_steps=2", "fully_shard", "Linear")
        msgs["unshard"] = expect(lambda: FSDPMuonOptimizer(plain).unshard_params().__enter__(),
                                 "unshard_params", "fully_shard", "Linear")
        msgs["use_muon"] = expect(lambda: FSDPMuonOptimizer(plain, [{"params": [plain.bias], "use_muon": True}]),
                                  "'bias'", "ndim >= 2")
        msgs["strategy"] = expect(lambda: FSDPMuonOptimizer(plain, strategy="gather"), "strategy", "'gather'")
        msgs["lr"] = expect(lambda: FSDPMuonOptimizer(plain, lr=-1.0), "lr", "-1.0")
        msgs["model"] = expect(lambda: FSDPMuonOptimizer([plain.weight]), "model must be a torch.nn.Module")
        return msgs

    def mixed_one(mesh):
        return Holder(up=distribute_tensor(torch.randn(8, 8), mesh, [Shard(0)]))

    return run


def checks_for(w: int, ckpt_dir: str) -> dict:
    checks = {
        "parity_owner": check_parity(w),
        "parity_replicate": check_parity(w, strategy="replicate"),
        "parity_sgd_momentum_quintic": check_parity(w, momentum_kind="sgd", method="quintic",
                                                    adjust_lr_fn="match_rms_adamw"),
        "parity_normuon": check_normuon(w),
        "parity_hybrid_groups": check_hybrid_groups(w),
        "parity_plain_replicated": check_plain_replicated(w),
        "wire_bf16": check_wire_bf16(w),
        "bytes_formula": check_bytes_formula(w),
        "no_grad_rank": check_no_grad_rank(w),
        "nonfinite": check_nonfinite(w),
        "accumulation": check_accumulation(w),
        "mixed_precision": check_mixed_precision(w),
        "unshard_params": check_unshard(w),
        "errors": check_errors(w),
    }
    if w == 4:
        checks["hsdp"] = check_hsdp(w)
        checks["dcp_save_w4"] = check_dcp_save(w, ckpt_dir)
    if w == 2:
        checks["dcp_load_w2"] = check_dcp_load(w, ckpt_dir)
        checks["parity_owner_compiled"] = check_parity(w, compile={"backend": "eager"})
    return checks


def _names(w: int) -> list[str]:
    base = ["parity_owner", "parity_replicate", "parity_sgd_momentum_quintic", "parity_normuon",
            "parity_hybrid_groups", "parity_plain_replicated", "wire_bf16", "bytes_formula",
            "no_grad_rank", "nonfinite", "accumulation", "mixed_precision", "unshard_params", "errors"]
    return base + (["hsdp", "dcp_save_w4"] if w == 4 else ["dcp_load_w2", "parity_owner_compiled"])


# ---------------------------------------------------------------------------- the job
def _worker(rank: int, w: int, port: int, out: str, ckpt_dir: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=w, timeout=timedelta(seconds=60))
    results = {}
    only = os.environ.get("MUON_FN_FSDP_CHECKS")  # comma-separated subset, for debugging
    for name, fn in checks_for(w, ckpt_dir).items():
        if only and name not in only.split(","):
            continue
        t0 = time.perf_counter()
        try:
            value = fn()
            results[name] = {"ok": True, "value": value}
        except Exception:  # noqa: BLE001 - reported to pytest
            results[name] = {"ok": False, "error": traceback.format_exc(limit=8)}
        print(f"[W={w} rank {rank}] {name}: {'ok' if results[name]['ok'] else 'FAIL'} "
              f"({time.perf_counter() - t0:.1f}s)", flush=True)
        if not results[name]["ok"]:
            print(results[name]["error"], flush=True)
        dist.barrier()
    gathered = [None] * w
    dist.all_gather_object(gathered, results)
    if rank == 0:
        merged = {}
        for name in results:
            per_rank = [g[name] for g in gathered]
            bad = [f"rank {r}: {x['error']}" for r, x in enumerate(per_rank) if not x["ok"]]
            merged[name] = {"ok": not bad, "error": "\n".join(bad),
                            "values": [x.get("value") for x in per_rank]}
        Path(out).write_text(json.dumps(merged, indent=1, default=str))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(w: int, out: str, ckpt_dir: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, __file__, str(w), out, ckpt_dir, str(_free_port())]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, text=True)
    try:
        stdout, _ = proc.communicate(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the job's own process group: its spawned ranks only
        stdout, _ = proc.communicate()
        stdout = f"TIMEOUT after {JOB_TIMEOUT_S}s\n" + (stdout or "")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, "")


@pytest.fixture(scope="module")
def ckpt_dir():
    with tempfile.TemporaryDirectory(prefix="muon_fn_dcp_") as d:
        yield d


def _load(w: int, ckpt: str, tmp_path_factory) -> tuple[dict, str]:
    out = str(tmp_path_factory.mktemp(f"fsdp_w{w}") / "results.json")
    proc = run_job(w, out, ckpt)
    if not os.path.exists(out):
        return {}, proc.stdout[-4000:]
    return json.loads(Path(out).read_text()), proc.stdout[-2000:]


@pytest.fixture(scope="module")
def results_w4(ckpt_dir, tmp_path_factory):
    return _load(4, ckpt_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def results_w2(ckpt_dir, tmp_path_factory, results_w4):
    # Depends on the W=4 job: it writes the checkpoint the W=2 job loads.
    return _load(2, ckpt_dir, tmp_path_factory)


def _assert_check(results: tuple[dict, str], name: str) -> None:
    merged, log = results
    assert merged, f"the distributed job wrote no results; its output:\n{log}"
    assert name in merged, f"check {name} did not run; output:\n{log}"
    assert merged[name]["ok"], merged[name]["error"]


@pytest.mark.parametrize("name", _names(4))
def test_fsdp_w4(results_w4, name):
    _assert_check(results_w4, name)


@pytest.mark.parametrize("name", _names(2))
def test_fsdp_w2(results_w2, name):
    _assert_check(results_w2, name)


def test_job_names_match_checks():
    for w in (2, 4):
        assert sorted(_names(w)) == sorted(checks_for(w, "/nonexistent"))


if __name__ == "__main__":
    import torch.multiprocessing as mp

    world, out_path, ckpt, port_ = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    mp.spawn(_worker, args=(world, port_, out_path, ckpt), nprocs=world, join=True)
