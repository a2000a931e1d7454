"""FSDPMuonOptimizer on CPU/gloo: one spawned job per world size (4, then 3 and 2) runs every check.

A job is W processes (this file run as a script, one per rank); each check runs on every rank and
the ranks' results are gathered into a JSON file that the pytest tests below read, one test per
check.
Bit-exact checks feed the same synthetic gradients to the sharded model and to a default
single-device ``MuonOptimizer`` with the same settings (compiled the same way). A collective
timeout (60 s) and a job timeout bound every hang.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch.nn as nn
from _ranks import assert_check, job_runner, run_checks, run_ranks

pytestmark = pytest.mark.distributed

JOB_TIMEOUT_S = 240
STEPS = 4
WORLD_SIZES = (4, 3, 2)  # in this order: the W=4 job saves the checkpoint the others load
# bf16 parameters in the FSDP2 compute (MixedPrecisionPolicy): tolerance after 5 steps (measured
# 2.7e-3 at W=4; every step moves an entry by about lr·s = 0.02–0.03). State: 10x these.
MP_ATOL = 1e-2
# bf16 on the wire (updates rounded before orthogonalization): tolerance after STEPS steps
# (measured 4.5e-4 at W=4; every row is rounded once, whatever W).
WIRE_BF16_ATOL = 2e-3
# Real backward through FSDP2 (reduce-scatter sums in another order): tolerance after 4 steps
# (measured 1.5e-7 at W=4).
BACKWARD_ATOL = 2e-6


# ---------------------------------------------------------------------------- models
class Toy(nn.Module):
    """Matrices with uneven and empty shards: 10x6 (W=4: 3,3,3,1; W=3: 4,4,2), 3x6 (1,1,1,0),
    1x3 (1,0,0,0), 5x1, 6x10, two 5x5 (a shape shared by two matrices, so batching matters),
    plus 1-D params."""

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


class Pair(nn.Module):
    """Two matrices and a bias: few compiled graphs, for the inductor check."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(6, 10)
        self.l2 = nn.Linear(10, 5, bias=False)


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


class Experts(nn.Module):
    """An MoE layer's weights: a router, two expert stacks ``(E, out, in)`` held as single
    parameters (fully_shard shards dim 0, so a rank holds whole experts; E = 5 is uneven at W = 2,
    3 and 4) and a Conv1d weight (3-D too, but flattened)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(6, 5, bias=False)
        self.w_up = nn.Parameter(torch.randn(5, 8, 6) / 6**0.5)
        self.w_down = nn.Parameter(torch.randn(5, 6, 8) / 8**0.5)
        self.conv = nn.Conv1d(2, 3, 3)


def make(cls=Toy, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return cls()


def shard(model: nn.Module, mesh=None, mp_policy=None) -> nn.Module:
    """``fully_shard`` every child module, then the model."""
    from torch.distributed.fsdp import fully_shard

    kw = {"mesh": mesh} if mesh is not None else {}
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, **kw)
    return fully_shard(model, **kw)


def mlp_loss(model: nn.Module, step: int, rows: slice | None = None) -> torch.Tensor:
    x = synthetic_grad((64, 8), 77, step)
    y = synthetic_grad((64, 3), 78, step)
    if rows is not None:
        x, y = x[rows], y[rows]
    return (model(x) - y).square().mean()


def single_mlp(steps: int, **kw):
    """The single-device Mlp and MuonOptimizer after ``steps`` backward passes and steps."""
    import muon_fn as mf

    ref = make(Mlp)
    opt = mf.MuonOptimizer(ref.parameters(), **muon_kwargs(**kw))
    for t in range(steps):
        mlp_loss(ref, t).backward()
        opt.step()
        opt.zero_grad()
    return ref, opt


def synthetic_grad(shape, step: int, index: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + index)
    return torch.randn(shape, generator=gen)


def set_grads(model: nn.Module, step: int) -> None:
    """The same global gradients on every rank; a DTensor parameter gets its exact shard."""
    from torch.distributed.tensor import DTensor

    from muon_fn.distributed._plan import chunk_rows

    for i, p in enumerate(model.parameters()):
        g = synthetic_grad(tuple(p.shape), step, i)
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            a, b = chunk_rows(g.shape[0], mesh.size(mesh.ndim - 1))[
                mesh.get_local_rank(mesh.ndim - 1)
            ]
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


def muon_kwargs(**extra):
    return dict(lr=0.02, momentum=0.95, weight_decay=0.01, **extra)


def train(pairs, steps: int, first: int = 0) -> None:
    """``steps`` steps of every (model, optimizer) pair on the same synthetic gradients."""
    for t in range(first, first + steps):
        for model, opt in pairs:
            set_grads(model, t)
            opt.step()


def full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def on_rank0(run) -> list:
    """``run()`` (a single-device model and optimizer after their steps) on rank 0 only; every
    rank gets its parameters and optimizer state (each rank running it costs as much again)."""
    import torch.distributed as dist

    out = [None]
    if dist.get_rank() == 0:
        model, opt = run()
        out = [
            [
                (q.detach().clone(), {k: v.clone() for k, v in opt.state[q].items()})
                for q in model.parameters()
            ]
        ]
    dist.broadcast_object_list(out, src=0)
    return out[0]


def muon_single(cls=Toy, groups=None, **kw):
    """Builds the single-device model and default MuonOptimizer, for :func:`reference`."""
    import muon_fn as mf

    def build():
        ref = make(cls)
        return ref, mf.MuonOptimizer(
            (groups or (lambda m: m.parameters()))(ref), **muon_kwargs(**kw)
        )

    return build


def reference(build, steps: int = STEPS) -> list:
    """``steps`` steps of the single-device ``build()`` (-> model, optimizer), on rank 0."""

    def run():
        model, opt = build()
        train([(model, opt)], steps)
        return model, opt

    return on_rank0(run)


def assert_same(model, opt, expected: list, *, atol: float = 0.0, what: str = "") -> float:
    """Parameters and every state entry of the reference equal (bitwise if atol == 0); returns
    the max abs error of the parameters."""
    worst = 0.0
    for (name, p), (q, state) in zip(model.named_parameters(), expected):
        entries = [("", p, q)] + [(f" state {k}", opt.state[p][k], v) for k, v in state.items()]
        for label, mine, theirs in entries:
            a, b = full(mine.detach()), theirs.detach()
            err = (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
            if not label:
                worst = max(worst, err)
            ok = torch.equal(a, b) if atol == 0.0 else err <= (atol if not label else 10 * atol)
            assert ok, f"{what}{name}{label}: max abs error {err} (atol {atol})"
    return worst


# ---------------------------------------------------------------------------- checks
def check_parity(w, cls=Toy, strategy="owner", compile=False, groups=None, **kw):
    """STEPS steps equal the default single-device MuonOptimizer's, compiled the same way.
    ``groups(model)``: param groups (default: all parameters in one)."""
    from muon_fn.fsdp import FSDPMuonOptimizer

    def run():
        from muon_fn.distributed import _stream

        model = shard(make(cls))
        params = groups(model) if groups else None
        opt = FSDPMuonOptimizer(
            model, params, strategy=strategy, compile=compile, **muon_kwargs(**kw)
        )
        alone, buckets = _stream._Run.alone, []
        _stream._Run.alone = lambda run, b: (buckets.append(b.index), alone(run, b))[1]
        try:
            train([(model, opt)], STEPS)
        finally:
            _stream._Run.alone = alone
        if kw.get("inflight_bytes") == 1:  # every bucket alone: in rounds from three ranks
            assert bool(buckets) == (w > 2), (w, buckets)
        expected = reference(muon_single(cls, groups, compile=compile, **kw))
        assert_same(model, opt, expected, what=f"W={w} {strategy} {kw}: ")
        return {"applied": opt.last_step_stats["applied"]}

    return run


def two_iterations(m):
    """Pair's groups: the first layer with the default iteration and NorMuon, the second with
    the bf16 iteration (one set of compiled graphs covers both)."""
    return [
        {"params": [m.l1.weight, m.l1.bias], "beta2": 0.95},
        {"params": [m.l2.weight], "ns_dtype": torch.bfloat16},
    ]


def check_expert_stacks(w, **kw):
    """FSDPMuonOptimizer knows the model: its expert stacks get matrix_view="experts" (the conv
    weight stays flattened) and every step equals single-device MuonOptimizer with those views
    bit for bit. Under Muon every rank computes the whole experts it holds (the stacks are local
    in the plan); NorMuon's stacks travel as rows of whole experts to one owner."""
    from muon_fn.fsdp import FSDPMuonOptimizer

    views = {"w_*": "experts", "conv.weight": "flatten"}

    def run():
        model = shard(make(Experts))
        opt = FSDPMuonOptimizer(model, **muon_kwargs(**kw))
        from muon_fn.fsdp import chunk_rows

        stacks = [mp for mp in opt.plan.matrices if mp.shape[0] == 5 and len(mp.shape) == 3]
        assert len(stacks) == 2 and all(
            mp.contrib == chunk_rows(5, w) for mp in stacks
        )  # whole experts
        assert [mp.cost for mp in stacks] == [
            5 * (4 * 6 * 6 * 8 + 2 * 6**3)
        ] * 2  # E matrices 8x6 (6x8)
        assert [mp.local for mp in stacks] == [kw.get("beta2") is None] * 2
        train([(model, opt)], STEPS)
        expected = reference(
            muon_single(Experts, lambda m: m.named_parameters(), matrix_view=views, **kw)
        )
        assert_same(model, opt, expected, what=f"W={w} experts {kw}: ")
        flat = reference(
            muon_single(
                Experts,
                lambda m: m.named_parameters(),
                matrix_view={"w_*": "flatten", "conv.weight": "flatten"},
                **kw,
            )
        )
        differs = [
            not torch.equal(full(p.detach()), q) for p, (q, _) in zip(model.parameters(), flat)
        ]
        assert differs == [True, True, False, False, False], (
            differs
        )  # only the stacks read differently
        return {"owners": [mp.owner for mp in stacks]}

    return run


def check_wire_bf16(w):
    from muon_fn.fsdp import FSDPMuonOptimizer

    def run():
        model = shard(make())
        opt = FSDPMuonOptimizer(model, wire_dtype=torch.bfloat16, **muon_kwargs())
        train([(model, opt)], STEPS)
        err = assert_same(model, opt, reference(muon_single()), atol=WIRE_BF16_ATOL)
        assert err > 0.0, "bf16 on the wire should not be bit-exact (was the wire dtype used?)"
        return {"max_abs_err": err}

    return run


def check_wire_bf16_rounds(w):
    """The bf16 wire rounds alike whether a bucket is exchanged in rounds (every bucket alone)
    or in one all-to-all each way (the buckets two at a time): the same parameters bit for bit."""
    from muon_fn.fsdp import FSDPMuonOptimizer

    def run():
        pairs = []
        for inflight in (1, None):
            model = shard(make())
            opt = FSDPMuonOptimizer(
                model, wire_dtype=torch.bfloat16, inflight_bytes=inflight, **muon_kwargs()
            )
            pairs.append((model, opt))
        train(pairs, STEPS)
        (a, _), (b, _) = pairs
        assert all(
            torch.equal(p.to_local(), q.to_local()) for p, q in zip(a.parameters(), b.parameters())
        )

    return run


def check_plain_replicated(w):
    """A plain (non-FSDP) model on every rank: DDP-style, owners compute, results shared."""
    from muon_fn.fsdp import FSDPMuonOptimizer

    def run():
        model = make()
        opt = FSDPMuonOptimizer(model, **muon_kwargs())
        assert {mp.owner for mp in opt.plan.matrices} == set(range(w))
        train([(model, opt)], STEPS)
        assert_same(model, opt, reference(muon_single()))
        assert (
            opt.last_step_stats["bytes_sent"] > 0 or opt.last_step_stats["matrices_computed"] == 0
        )

    return run


def check_hybrid_groups(w):
    """Explicit groups: first layer and head on AdamW (``algorithm="adamw"``, and the older
    ``use_muon=False`` with the AdamW half's settings), the rest "auto"."""
    from muon_fn.fsdp import FSDPMuonOptimizer

    def groups(m, **adam):
        rest = [p for p in m.parameters() if p is not m.l1.weight and p is not m.l7.weight]
        return [{"params": rest}, {"params": [m.l1.weight, m.l7.weight], **adam}]

    def run():
        model, legacy = shard(make()), shard(make())
        adam = {"algorithm": "adamw", "lr": 1e-3, "weight_decay": 0.1}
        opt = FSDPMuonOptimizer(model, groups(model, **adam), **muon_kwargs())
        old = FSDPMuonOptimizer(
            legacy,
            groups(legacy, use_muon=False, adamw_lr=1e-3, adamw_weight_decay=0.1),
            **muon_kwargs(),
        )
        train([(model, opt), (legacy, old)], STEPS)
        expected = reference(muon_single(groups=lambda m: groups(m, **adam)))
        assert_same(model, opt, expected, what="hybrid: ")
        assert_same(legacy, old, expected, what="use_muon=False: ")
        assert "adamw l1.weight" in opt.describe()

    return run


class ColumnScaleState(NamedTuple):
    c: tuple  # per matrix: (in,), the EMA of each column's mean square
    count: tuple  # per matrix: (), float32


def column_scale(decay: float = 0.5):
    """A MATRIX transform with per-matrix state that does not follow the rows (a vector of the
    columns and a counter): the FSDP owner computes it and shares it with every rank."""
    from muon_fn import GradientTransformation
    from muon_fn.core import tree as _tree
    from muon_fn.core.base import MATRIX, with_info

    def init(params):
        return ColumnScaleState(
            _tree.tree_map(
                lambda p: torch.ones(p.shape[1:], dtype=torch.float32, device=p.device), params
            ),
            _tree.tree_map(lambda p: torch.zeros((), dtype=torch.float32, device=p.device), params),
        )

    def step(u, c, n):
        c = c.lerp(u.square().mean(0), 1 - decay)
        return u / (c.sqrt() + 1), c, n + 1

    def update(updates, state, params=None, **extra):
        res = _tree.tree_map(
            lambda u, c, n: (None, c, n) if u is None else step(u, c, n),
            updates,
            state.c,
            state.count,
        )
        pick = lambda i: _tree.tree_map(lambda _, r: r[i], updates, res)  # noqa: E731
        return pick(0), ColumnScaleState(pick(1), pick(2))

    return with_info(GradientTransformation(init, update), leafwise=True, scope=MATRIX)


def custom_factory(h):
    """Muon with a replicated-state MATRIX part and weight decay inside the matrix span (so the
    owner needs the parameters too)."""
    import muon_fn as mf

    return mf.chain(
        mf.momentum(h["momentum"]),
        mf.orthogonalize(),
        column_scale(),
        mf.add_decoupled_weight_decay(0.1),
        mf.scale_by_shape(),
        mf.normalize_rows(0.9),
        mf.scale_by_learning_rate(h["lr"]),
    )


def check_generic_mid_state(w):
    """Any recipe through the distributed executor (muon_fn.Optimizer on DTensors): mid-phase
    state off the rows (replicated, shared from the owner) and a mid phase that reads params
    equal the single-device Optimizer running the same recipe."""
    import muon_fn as mf

    def Custom(model):  # the generic optimizer on DTensors: the distributed executor runs it
        return mf.Optimizer(
            list(model.parameters()), custom_factory, {"lr": 0.02, "momentum": 0.95}, model=model
        )

    def single(ref):
        return ref, mf.Optimizer(ref.parameters(), custom_factory, {"lr": 0.02, "momentum": 0.95})

    def matrices_only():
        m = make()
        m.l1.bias, m.l3.bias, m.l5.bias, m.l7.bias, m.norm = None, None, None, None, nn.Identity()
        return m

    def run():
        model = shard(matrices_only())
        opt = Custom(model)
        assert opt.plan.matrices[0].cols == 2 * 6 + 1  # update | param | row_variance
        train([(model, opt)], STEPS)
        expected = reference(lambda: single(matrices_only()))
        assert_same(model, opt, expected, what="custom recipe: ")
        assert sorted(opt.state[model.l6.weight]) == sorted(expected[4][1])

    return run


def check_bytes_formula(w):
    """Shapes divisible by W: mean bytes per rank = 2(W-1)/W^2 * S (half with bf16 on the wire),
    and each rank's figures are those plan_model predicts from the shapes alone."""
    from muon_fn.core.newton_schulz import coefficient_schedule
    from muon_fn.distributed._plan import ns_flops
    from muon_fn.fsdp import FSDPMuonOptimizer, plan_model

    def run():
        out = {}
        for wire, item in ((None, 4), (torch.bfloat16, 2)):
            torch.manual_seed(0)
            model = shard(
                nn.Sequential(
                    nn.Linear(12, 24, bias=False),
                    nn.Linear(24, 12, bias=False),
                    nn.Linear(12, 12, bias=False),
                )
            )
            opt = FSDPMuonOptimizer(model, wire_dtype=wire, **muon_kwargs())
            set_grads(model, 0)
            opt.step()
            s = item * sum(p.numel() for p in model.parameters())
            sent = torch.tensor([float(opt.last_step_stats["bytes_sent"])])
            torch.distributed.all_reduce(sent)
            mean = sent.item() / w
            assert mean == 2 * (w - 1) / w**2 * s, (mean, 2 * (w - 1) / w**2 * s)
            out[str(wire)] = mean
            # The pure planner predicts this rank's plan, bytes and FLOPs exactly (muon-fn plan).
            predicted = plan_model(
                [(n, tuple(p.shape), "flatten") for n, p in model.named_parameters()],
                f"dp={w}",
                wire_bytes=item,
            )
            rank = torch.distributed.get_rank()
            assert opt.plan == predicted.plan
            assert (
                opt.last_step_stats["bytes_sent"],
                opt.last_step_stats["bytes_received"],
                opt.last_step_stats["ns_flops"],
            ) == (predicted.sent[rank], predicted.received[rank], predicted.flops[rank])
            rep = FSDPMuonOptimizer(model, strategy="replicate", wire_dtype=wire, **muon_kwargs())
            set_grads(model, 0)
            rep.step()
            assert rep.last_step_stats["bytes_sent"] == (w - 1) / w * s
            # replicate: every rank computes every matrix; owner: the ranks split them.
            schedule = coefficient_schedule("quintic", 5)  # the default method and its steps
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
        model = shard(make())
        before = {n: p.to_local().clone() for n, p in model.named_parameters()}
        for strategy in ("owner", "replicate"):
            opt = FSDPMuonOptimizer(model, strategy=strategy, beta2=0.9, **muon_kwargs())
            set_grads(model, 0)
            if rank == 1:
                for p in model.parameters():
                    p.grad = None
            opt.step()
            opt.step()  # twice: nothing left half-done
        changed = [
            n
            for n, p in model.named_parameters()
            if p.to_local().numel() and not torch.equal(p.to_local(), before[n])
        ]
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


def check_nonfinite(w, **kw):
    """A NaN on rank 1 only: every rank skips ("skip", decided on the device) or raises
    ("error"); nothing changes."""
    from muon_fn.fsdp import FSDPMuonOptimizer

    def run():
        rank = torch.distributed.get_rank()
        model = shard(make())
        snap = {n: p.to_local().clone() for n, p in model.named_parameters()}
        for policy in ("skip", "error"):
            opt = FSDPMuonOptimizer(model, nonfinite=policy, beta2=0.9, **muon_kwargs(**kw))
            moments = {
                n: opt.state[p]["momentum_buffer"].to_local().clone()
                for n, p in model.named_parameters()
                if p.ndim >= 2
            }
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
                assert not bool(opt.last_step.finite)
            else:
                assert "non-finite" in raised, raised
                assert ("'l1.weight'" in raised) == (rank == 1), raised
            assert all(
                torch.equal(opt.state[p]["momentum_buffer"].to_local(), moments[n])
                for n, p in model.named_parameters()
                if p.ndim >= 2
            )
        assert all(torch.equal(p.to_local(), snap[n]) for n, p in model.named_parameters())

    return run


def check_dcp_save(w, ckpt_dir):
    """Save model and optimizer after 2 steps (DTensor state, FQN keys)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from muon_fn.fsdp import FSDPMuonOptimizer

    def run():
        model = shard(make())
        opt = FSDPMuonOptimizer(model, beta2=0.9, **muon_kwargs())
        osd = get_optimizer_state_dict(model, opt)  # before any step: state exists, no step taken
        assert "l1.weight" in osd["state"] and "momentum_buffer" in osd["state"]["l1.weight"]
        train([(model, opt)], 2)
        dcp.save(
            {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
            checkpoint_id=ckpt_dir,
        )
        return {"keys": sorted(get_optimizer_state_dict(model, opt)["state"])}

    return run


def check_dcp_load(w, ckpt_dir):
    """Load what W=4 saved, continue 2 steps: equals 4 uninterrupted single-device steps."""
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
        model = shard(make(seed=123))  # different init: everything must come from the file
        opt = FSDPMuonOptimizer(model, beta2=0.9, **muon_kwargs())
        state = {
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, opt),
        }
        dcp.load(state, checkpoint_id=ckpt_dir)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, opt, state["optim"])
        train([(model, opt)], 2, first=2)
        expected = reference(muon_single(beta2=0.9), steps=4)
        assert_same(model, opt, expected, what=f"DCP W=4 -> W={w}: ")

    return run


def check_full_state_dict(w):
    """A full state dict (every DTensor gathered and offloaded to rank 0's CPU; dtype
    hyperparameters by name) after 2 steps of NorMuon with the fp32 iteration, broadcast from rank
    0 into a fresh sharded model and optimizer, which continue as 4 uninterrupted single-device
    steps do, bit for bit."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from muon_fn.fsdp import FSDPMuonOptimizer

    kw = muon_kwargs(beta2=0.9, ns_dtype=torch.float32)

    def run():
        model = shard(make())
        opt = FSDPMuonOptimizer(model, **kw)
        train([(model, opt)], 2)
        gather = StateDictOptions(full_state_dict=True, cpu_offload=True)
        saved = {
            "model": get_model_state_dict(model, options=gather),
            "optim": get_optimizer_state_dict(model, opt, options=gather),
        }
        if dist.get_rank() == 0:  # the other ranks get empty dicts (cpu_offload)
            assert saved["optim"]["param_groups"][0]["ns_dtype"] == "torch.float32"
        resumed = shard(make(seed=123))
        ropt = FSDPMuonOptimizer(resumed, **kw)
        full_sd = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(resumed, saved["model"], options=full_sd)
        set_optimizer_state_dict(resumed, ropt, saved["optim"], options=full_sd)
        train([(resumed, ropt)], 2, first=2)
        expected = reference(muon_single(beta2=0.9, ns_dtype=torch.float32), steps=4)
        assert_same(resumed, ropt, expected, what=f"full state dict W={w}: ")

    return run


def check_dcp_refused(w, ckpt_dir):
    """What W=4 saved, into a model with a renamed or a reshaped parameter: DCP refuses it while
    planning the read, naming the key, before anything changes (the optimizer's state tensors are
    the ones dcp.load would write into)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from muon_fn.fsdp import FSDPMuonOptimizer

    def renamed():
        model = make()
        model.l8 = model.l7
        del model.l7
        return model

    def reshaped():
        model = make()
        model.l1 = nn.Linear(7, 10)
        return model

    def run():
        msgs = {}
        for what, build, needle in (
            ("renamed", renamed, "l8.weight"),
            ("reshaped", reshaped, "l1.weight"),
        ):
            model = shard(build())
            opt = FSDPMuonOptimizer(model, beta2=0.9, **muon_kwargs())
            train([(model, opt)], 1)
            before = {
                n: {
                    k: v.to_local().clone() if hasattr(v, "to_local") else v.clone()
                    for k, v in opt.state[p].items()
                }
                for n, p in model.named_parameters()
            }
            try:
                dcp.load({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=ckpt_dir)
            except CheckpointException as e:  # a BaseException, wrapping every rank's error
                msgs[what] = str(e)
            else:
                raise AssertionError(f"DCP loaded the checkpoint into the {what} model")
            assert needle in msgs[what], msgs[what]
            for n, p in model.named_parameters():
                for k, v in opt.state[p].items():
                    now = v.to_local() if hasattr(v, "to_local") else v
                    assert torch.equal(now, before[n][k]), f"{what}: {n} {k} changed"
        return {k: v[-300:] for k, v in msgs.items()}

    return run


def check_plan_mismatch(w):
    """The last rank builds a different optimizer (a renamed, an extra, a replicated parameter;
    another num_buckets or nonfinite policy; another matrix view): every rank raises one clear
    error naming the first difference, at construction, and no collective is left hanging."""
    import torch.distributed as dist

    from muon_fn.fsdp import FSDPMuonOptimizer

    def renamed():
        model = make(Pair)
        model.l3 = model.l2
        del model.l2
        return model

    def extra():
        model = make(Pair)
        model.l3 = nn.Linear(5, 5)
        return model

    cases = {  # name: (what the last rank builds, keyword arguments, needles of the message)
        "renamed": (
            lambda: shard(renamed()),
            {},
            [
                "parameter 2 of group 0",
                "'l2.weight' of shape (5, 10)",
                "'l3.weight' of shape (5, 10)",
            ],
        ),
        "extra": (
            lambda: shard(extra()),
            {},
            ["parameter 3 of group 0", "none on rank 0", "'l3.weight'"],
        ),
        "replicated": (
            lambda: make(Pair),
            {},
            ["at the options", f"{w} ranks, mesh ({w},)", f"{w} ranks, no device mesh on rank"],
        ),
        "num_buckets": (
            lambda: shard(make(Pair)),
            {"num_buckets": 1},
            ["num_buckets=4", "num_buckets=1"],
        ),
        "nonfinite": (
            lambda: shard(make(Pair)),
            {"nonfinite": None},
            ["nonfinite='skip'", "nonfinite=None"],
        ),
        "view": (
            lambda: shard(make(Experts)),
            {"matrix_view": {"w_up": "flatten"}},
            ["parameter 0 of group 0", "view 'experts' on rank 0", "view 'flatten' on rank"],
        ),
    }

    def run():
        last, msgs = dist.get_rank() == w - 1, {}
        for name, (odd, kw, needles) in cases.items():
            model = odd() if last else shard(make(Experts if name == "view" else Pair))
            try:
                FSDPMuonOptimizer(model, **(kw if last else {}), **muon_kwargs())
            except RuntimeError as e:
                msgs[name] = str(e)
            else:
                raise AssertionError(f"{name}: no error on rank {dist.get_rank()}")
            assert msgs[name].startswith(
                f"the ranks disagree on the optimizer's plan: rank {w - 1} differs from rank 0 at "
            ), msgs[name]
            for needle in needles:
                assert needle in msgs[name], f"{needle!r} not in: {msgs[name]}"
        return msgs

    return run


def check_accumulation(w):
    """k=2 micro-batches with real backward: sync off for the first (grads stay None), on for the
    last; equals single-device MuonOptimizer(gradient_accumulation_steps=2) within BACKWARD_ATOL."""
    from muon_fn.fsdp import FSDPMuonOptimizer

    def run():
        rank = torch.distributed.get_rank()
        rows = slice(rank * 64 // w, (rank + 1) * 64 // w)
        model = shard(make(Mlp))
        opt = FSDPMuonOptimizer(model, gradient_accumulation_steps=2, **muon_kwargs())
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
        assert saw_none == 4 and saw_grad == 4, (saw_none, saw_grad)
        expected = on_rank0(lambda: single_mlp(8, gradient_accumulation_steps=2))
        return {"max_abs_err": assert_same(model, opt, expected, atol=BACKWARD_ATOL)}

    return run


def check_mixed_precision(w):
    """MixedPrecisionPolicy(bf16 params, fp32 reduce) runs and stays within MP_ATOL of fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from muon_fn.fsdp import FSDPMuonOptimizer

    def run():
        rank = torch.distributed.get_rank()
        rows = slice(rank * 64 // w, (rank + 1) * 64 // w)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        model = shard(make(Mlp), mp_policy=policy)
        opt = FSDPMuonOptimizer(model, **muon_kwargs())
        for t in range(5):
            mlp_loss(model, t, rows).backward()
            assert all(p.grad.dtype == torch.float32 for p in model.parameters())
            opt.step()
            opt.zero_grad()
        assert all(p.dtype == torch.float32 for p in model.parameters())
        expected = on_rank0(lambda: single_mlp(5))
        return {"max_abs_err": assert_same(model, opt, expected, atol=MP_ATOL)}

    return run


def check_unshard(w):
    from torch.distributed.tensor import DTensor

    from muon_fn.fsdp import FSDPMuonOptimizer

    def run():
        model = shard(make())
        opt = FSDPMuonOptimizer(model, **muon_kwargs())
        with opt.unshard_params() as m:
            w1 = m.l1.weight
            assert not isinstance(w1, DTensor) and tuple(w1.shape) == (10, 6), type(w1)
            assert torch.equal(w1.detach(), make().l1.weight.detach())
        assert isinstance(model.l1.weight, DTensor)

    return run


def check_hsdp(w):
    """HSDP (2-D mesh: replicate x shard): the shard sub-mesh is used; bit-exact parity."""
    from torch.distributed.device_mesh import init_device_mesh

    from muon_fn.fsdp import FSDPMuonOptimizer

    def run():
        mesh = init_device_mesh("cpu", (2, w // 2), mesh_dim_names=("replicate", "shard"))
        model = shard(make(), mesh=mesh)
        opt = FSDPMuonOptimizer(model, beta2=0.9, **muon_kwargs())
        assert opt.topology.world_size == w // 2
        train([(model, opt)], STEPS)
        expected = reference(muon_single(beta2=0.9))
        assert_same(model, opt, expected, what="HSDP: ")

    return run


def check_errors(w):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

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
        x = torch.randn(8, 8)
        # Layouts beyond one shard group run over the default group (test_fsdp_tp checks them).
        col = Holder(proj=distribute_tensor(x, mesh, [Shard(1)]))
        assert FSDPMuonOptimizer(col).topology.general
        if w % 2 == 0:
            mesh_b = init_device_mesh("cpu", (2, w // 2), mesh_dim_names=("a", "b"))["b"]
            mixed = Holder(
                up=distribute_tensor(x, mesh, [Shard(0)]),
                down=distribute_tensor(x, mesh_b, [Shard(0)]),
            )
            msgs["groups_pg"] = expect(
                lambda: FSDPMuonOptimizer(mixed, process_group=mesh_b.get_group()),
                "process_group",
                "default group",
            )
        other = dist.new_group(list(range(w // 2)))
        one = Holder(up=distribute_tensor(torch.randn(8, 8), mesh, [Shard(0)]))
        msgs["pg"] = expect(
            lambda: FSDPMuonOptimizer(one, process_group=other), "process_group", "'up'"
        )
        plain = nn.Linear(4, 4)
        msgs["accum"] = expect(
            lambda: FSDPMuonOptimizer(plain, gradient_accumulation_steps=2),
            "gradient_accumulation_steps=2",
            "fully_shard",
            "Linear",
        )
        msgs["unshard"] = expect(
            lambda: FSDPMuonOptimizer(plain).unshard_params().__enter__(),
            "unshard_params",
            "fully_shard",
            "Linear",
        )
        msgs["muon_bias"] = expect(
            lambda: FSDPMuonOptimizer(plain, [{"params": [plain.bias], "use_muon": True}]),
            "'bias'",
            "ndim >= 2",
        )
        msgs["strategy"] = expect(
            lambda: FSDPMuonOptimizer(plain, strategy="gather"), "strategy", "'gather'"
        )
        msgs["lr"] = expect(lambda: FSDPMuonOptimizer(plain, lr=-1.0), "learning rate", "-1.0")
        msgs["model"] = expect(
            lambda: FSDPMuonOptimizer([plain.weight]), "model must be a torch.nn.Module"
        )
        return msgs

    return run


def checks_for(w: int, ckpt_dir: str) -> dict:
    """Every world size runs the parity checks: fp32 and bf16 iterations eager, and both at once
    compiled (the eager backend at W=3 and 4, inductor at W=2) on the small Pair model (compiling
    costs about a second per graph). The other checks are spread over the jobs."""
    compiled = {"backend": "inductor"} if w == 2 else {"backend": "eager"}
    checks = {
        "parity_owner": check_parity(w),
        "parity_owner_bf16_iteration": check_parity(w, ns_dtype=torch.bfloat16),
        "parity_normuon": check_parity(w, beta2=0.95, nesterov=False),
        "parity_layerwise_norm": check_parity(w, layerwise_norm=True),
        f"parity_compiled_{compiled['backend']}": check_parity(
            w, Pair, compile=compiled, groups=two_iterations
        ),
        # inflight_bytes=1: every bucket alone, from W = 3 exchanged in rounds of one peer each way
        "parity_rounds": check_parity(w, inflight_bytes=1),
        "parity_rounds_normuon": check_parity(w, inflight_bytes=1, beta2=0.95, nesterov=False),
        "expert_stacks_rounds": check_expert_stacks(w, inflight_bytes=1),
        "expert_stacks_rounds_normuon": check_expert_stacks(
            w, inflight_bytes=1, beta2=0.95, nesterov=False
        ),
        "wire_bf16_rounds": check_wire_bf16_rounds(w),
        "nonfinite_rounds": check_nonfinite(w, inflight_bytes=1),
        "parity_plain_replicated": check_plain_replicated(w),
        "generic_mid_state": check_generic_mid_state(w),
        "no_grad_rank": check_no_grad_rank(w),
        "nonfinite": check_nonfinite(w),
        "bytes_formula": check_bytes_formula(w),
        "errors": check_errors(w),
        "expert_stacks": check_expert_stacks(w),
        "expert_stacks_normuon": check_expert_stacks(w, beta2=0.95, nesterov=False),
        "plan_mismatch": check_plan_mismatch(w),
        "full_state_dict": check_full_state_dict(w),
    }
    if w == 4:
        checks.update(
            {
                "parity_replicate": check_parity(w, strategy="replicate"),
                "parity_sgd_momentum_quintic": check_parity(
                    w, momentum_kind="sgd", method="quintic", adjust_lr_fn="match_rms_adamw"
                ),
                "parity_hybrid_groups": check_hybrid_groups(w),
                "wire_bf16": check_wire_bf16(w),
                "accumulation": check_accumulation(w),
                "mixed_precision": check_mixed_precision(w),
                "unshard_params": check_unshard(w),
                "hsdp": check_hsdp(w),
                "dcp_save_w4": check_dcp_save(w, ckpt_dir),
            }
        )
    else:
        checks[f"dcp_load_w{w}"] = check_dcp_load(w, ckpt_dir)
    if w == 2:
        checks["dcp_refused"] = check_dcp_refused(w, ckpt_dir)
    if w == 3:
        checks["parity_replicate"] = check_parity(w, strategy="replicate", beta2=0.95)
    return checks


def _names(w: int) -> list[str]:
    return list(checks_for(w, "/nonexistent"))


# ---------------------------------------------------------------------------- the job
def _worker(rank: int, w: int, out: str, ckpt_dir: str) -> None:
    only = os.environ.get("MUON_FN_FSDP_CHECKS")  # comma-separated subset, for debugging
    checks = {
        name: fn
        for name, fn in checks_for(w, ckpt_dir).items()
        if not only or name in only.split(",")
    }
    run_checks(checks, rank, w, out)


def run_job(w: int, out: str, ckpt_dir: str, logs: Path) -> str:
    """Start the W ranks (this file as a script, one process each) and wait for them; a job
    past JOB_TIMEOUT_S is killed. Returns the ranks' output."""
    return run_ranks(__file__, w, [out, ckpt_dir], logs, JOB_TIMEOUT_S)


@pytest.fixture(scope="module")
def ckpt_dir():
    with tempfile.TemporaryDirectory(prefix="muon_fn_dcp_") as d:
        yield d


@pytest.fixture(scope="module")
def results(ckpt_dir, tmp_path_factory):
    """Each world size's results, run on first use, W=4 first (it saves the checkpoint)."""
    return job_runner(
        __file__, "fsdp", tmp_path_factory, JOB_TIMEOUT_S, args=[ckpt_dir], order=WORLD_SIZES
    )


@pytest.mark.parametrize("w, name", [(w, name) for w in WORLD_SIZES for name in _names(w)])
def test_fsdp(results, w, name):
    assert_check(results(w), w, name)


if __name__ == "__main__":
    if len(sys.argv) == 5:  # one rank of a job started by run_job: W RANK OUT CKPT_DIR
        _worker(int(sys.argv[2]), int(sys.argv[1]), sys.argv[3], sys.argv[4])
        sys.stdout.flush()
        os._exit(0)  # the results are written and every rank passed the last barrier: skip the
        # interpreter's teardown (about 4 s a process here)
    # By hand: python tests/test_fsdp.py W [CKPT_DIR] runs one job and prints its output.
    logs_dir = Path(tempfile.mkdtemp(prefix="muon_fn_fsdp_"))
    ckpt_arg = sys.argv[2] if len(sys.argv) > 2 else str(logs_dir / "ckpt")
    print(run_job(int(sys.argv[1]), str(logs_dir / "results.json"), ckpt_arg, logs_dir))
