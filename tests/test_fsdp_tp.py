"""The FSDP optimizers on 2-D and 3-D meshes, on CPU/gloo with 4 processes: FSDP×TP (2×2),
HSDP×TP (replicate 2 × shard 1 × TP 2) and expert parallelism (experts whole and split).

One spawned job (this file as a script, one process per rank, collective timeout 60 s, job
timeout 240 s). Bit-exact checks feed the same synthetic global gradients, each rank its own block
of them, to the distributed model and to the single-device optimizer with the same settings.

- FSDP×TP: a column-wise TP ``up`` (FSDP2 stores it as a strided shard of dim 0 on the data dim
  and ``Shard(0)`` on the TP dim), a row-wise TP ``down`` (``Shard(1)`` on the TP dim: its columns
  are sharded, so it is redistributed to rows for the exchange and back), and a plain Linear and
  LayerNorm that FSDP shards on the data dim only (held alike by both TP ranks). Muon (owner and
  replicate strategies), NorMuon (its per-row state refused on ``down``, exact on the rest) and SSO
  (the parameter travels too).
- Expert parallelism: stacks ``(E, out, in)`` sharded on the expert dim over an EP mesh dim and
  on the expert dim or on the rows of each expert over the data dim; dense weights on another
  mesh. Whole experts are computed where they lie (nothing is exchanged); experts split by rows
  are put back together, each on one rank, and (fewer experts than ranks) planned as one-expert
  pieces with owners of their own.
- DCP on FSDP×TP: saved and loaded into a fresh model, the run continues bit for bit.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from _ranks import run_checks, run_ranks

pytestmark = pytest.mark.distributed

JOB_TIMEOUT_S = 240
W = 4
STEPS = 3


def _fsdp():
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import test_fsdp

    return test_fsdp


class Block(nn.Module):
    """An MLP block: ``up`` 10×8 (uneven rows on the 2×2 mesh: 3, 2, 3, 2), ``down`` 7×10 (its 10
    columns cut by TP, its 7 rows uneven), a plain ``mid`` and a LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 10)
        self.down = nn.Linear(10, 7, bias=False)
        self.mid = nn.Linear(7, 6, bias=False)
        self.norm = nn.LayerNorm(6)


class Holder(nn.Module):
    def __init__(self, **params) -> None:
        super().__init__()
        for name, value in params.items():
            setattr(self, name, nn.Parameter(value))


def block_tp(mesh_dims=(2, 2), names=("dp", "tp"), net=Block) -> nn.Module:
    """Block with column-/row-wise TP on the last mesh dim and FSDP2 on the others (HSDP when two)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    t = _fsdp()
    mesh = init_device_mesh("cpu", mesh_dims, mesh_dim_names=names)
    model = t.make(net)
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    data = mesh[names[:-1]] if len(names) > 2 else mesh[names[0]]
    for child in model.children():
        fully_shard(child, mesh=data)
    return fully_shard(model, mesh=data)


def set_grads(model: nn.Module, step: int) -> None:
    """test_fsdp's synthetic global gradients; a DTensor parameter gets its own block of them."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    t = _fsdp()
    for i, p in enumerate(model.parameters()):
        g = t.synthetic_grad(tuple(p.shape), step, i)
        if isinstance(p, DTensor):
            shape, offset = compute_local_shape_and_global_offset(
                p.shape, p.device_mesh, p.placements
            )
            block = g[tuple(slice(o, o + s) for o, s in zip(offset, shape))].clone()
            p.grad = DTensor.from_local(
                block,
                p.device_mesh,
                p.placements,
                run_check=False,
                shape=p.shape,
                stride=p.stride(),
            )
        else:
            p.grad = g


def train(model: nn.Module, opt, steps: int = STEPS) -> None:
    for step in range(steps):
        set_grads(model, step)
        opt.step()


def check_tp(build=block_tp, strategy="owner", **kw):
    """FSDPMuonOptimizer on a TP model equals MuonOptimizer on the whole model, bit for bit;
    the row-wise weight's per-rank rows tile it."""
    t = _fsdp()
    from muon_fn.fsdp import FSDPMuonOptimizer

    def run():
        model = build()
        opt = FSDPMuonOptimizer(model, strategy=strategy, **t.muon_kwargs(compile=False, **kw))
        assert opt.topology.general and opt.topology.world_size == W
        train(model, opt)
        t.assert_same(
            model,
            opt,
            t.reference(t.muon_single(Block, compile=False, **kw), STEPS),
            what=f"TP {strategy} {kw}: ",
        )
        layout = opt._executor._layouts[id(model.down.weight)]
        return {
            "down_rows": layout.rows,
            "down_placements": str(tuple(model.down.weight.placements)),
            "sent": opt.last_step_stats["bytes_sent"],
        }

    return run


def check_tp_normuon():
    """NorMuon keeps a per-row state: refused on the column-sharded ``down`` (naming it and its
    placements), exact on the rest when ``down`` is in an AdamW group."""
    t = _fsdp()
    from muon_fn.fsdp import FSDPMuonOptimizer

    def groups(m):
        return [
            {"params": [q for n, q in m.named_parameters() if n != "down.weight"]},
            {"params": [m.down.weight], "use_muon": False},
        ]

    def run():
        model = block_tp()
        kw = t.muon_kwargs(beta2=0.95, compile=False)
        try:
            FSDPMuonOptimizer(model, **kw)
        except ValueError as e:
            message = str(e)
        else:
            raise AssertionError("NorMuon on a column-sharded weight was accepted")
        assert (
            "'down.weight'" in message and "Shard(dim=1)" in message and "row_variance" in message
        ), message
        opt = FSDPMuonOptimizer(model, groups(model), **kw)
        train(model, opt)

        def build():
            import muon_fn as mf

            ref = t.make(Block)
            return ref, mf.MuonOptimizer(groups(ref), **kw)

        t.assert_same(model, opt, t.reference(build, STEPS), what="TP NorMuon: ")
        return {"error": message}

    return run


def check_tp_sso():
    """FSDPSpectralSphereOptimizer on the TP model: the row-wise weight and its parameter travel
    as rows; equal to SpectralSphereOptimizer."""
    t = _fsdp()
    from muon_fn import SpectralSphereOptimizer
    from muon_fn.fsdp import FSDPSpectralSphereOptimizer

    def run():
        model = block_tp()
        opt = FSDPSpectralSphereOptimizer(model, compile=False)
        train(model, opt)

        def build():
            ref = t.make(Block)
            return ref, SpectralSphereOptimizer(ref.parameters(), compile=False)

        t.assert_same(model, opt, t.reference(build, STEPS), what="TP SSO: ")
        return {}

    return run


class Net(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.mid(self.down(torch.nn.functional.gelu(self.up(x)))))


def check_tp_overlap():
    """Through real backward passes of the FSDP×TP model: ``overlap=True`` (gathers posted from
    FSDP2's gradient hooks, the row-wise weight redistributed there) equals ``overlap=False`` bit
    for bit, parameters and state, and posts every bucket during backward."""
    from muon_fn.fsdp import FSDPMuonOptimizer

    def run():
        pairs = []
        for overlap in (False, True):
            model = block_tp(net=Net)
            pairs.append((model, FSDPMuonOptimizer(model, overlap=overlap, compile=False, lr=0.02)))
        gen = torch.Generator().manual_seed(3)
        dp = torch.distributed.get_rank() // 2
        for _ in range(STEPS):
            x = torch.randn(8, 8, generator=gen)[dp * 4 : dp * 4 + 4]
            for model, opt in pairs:
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
        (a, oa), (b, ob) = pairs
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            assert torch.equal(p.to_local(), q.to_local()), name
            for key, v in oa.state[p].items():
                assert torch.equal(
                    v.to_local() if hasattr(v, "to_local") else v,
                    ob.state[q][key].to_local() if hasattr(v, "to_local") else ob.state[q][key],
                ), (name, key)
        assert ob.last_step_stats["overlapped_buckets"] == len(ob.plan.buckets), ob.last_step_stats
        return {}

    return run


def check_tp_dcp():
    """DCP on FSDP×TP: save after 2 steps, load into a fresh model and optimizer (another init),
    2 more steps: equal to 4 uninterrupted single-device steps, bit for bit."""
    import shutil
    import tempfile

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    t = _fsdp()
    from muon_fn.fsdp import FSDPMuonOptimizer

    def run():
        path = [
            tempfile.mkdtemp(prefix="muon_fn_tp_dcp_")
            if torch.distributed.get_rank() == 0
            else None
        ]
        torch.distributed.broadcast_object_list(path)
        model = block_tp()
        opt = FSDPMuonOptimizer(model, **t.muon_kwargs(compile=False))
        train(model, opt, 2)
        dcp.save(
            {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
            checkpoint_id=path[0],
        )
        torch.manual_seed(99)
        fresh = block_tp()
        with torch.no_grad():
            for p in fresh.parameters():
                p.to_local().normal_()
        opt = FSDPMuonOptimizer(fresh, **t.muon_kwargs(compile=False))
        state = {
            "model": get_model_state_dict(fresh),
            "optim": get_optimizer_state_dict(fresh, opt),
        }
        dcp.load(state, checkpoint_id=path[0])
        set_model_state_dict(fresh, state["model"])
        set_optimizer_state_dict(fresh, opt, state["optim"])
        for step in (2, 3):
            set_grads(fresh, step)
            opt.step()
        t.assert_same(
            fresh, opt, t.reference(t.muon_single(Block, compile=False), 4), what="TP DCP: "
        )
        torch.distributed.barrier()
        if torch.distributed.get_rank() == 0:
            shutil.rmtree(path[0])
        return {}

    return run


def experts(split: bool):
    """Expert stacks on a (dp=2, ep=2) mesh: ``w_up`` (4, 6, 5) and ``w_down`` (4, 5, 6) sharded on
    the expert dim over both dims (one whole expert per rank) or, ``split``, 2 experts on the EP
    dim with the data dim cutting each expert's rows; a dense ``router`` on the data dim only."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    full = expert_params(split)
    stack = [Shard(1), Shard(0)] if split else [Shard(0), Shard(0)]
    return Holder(
        w_up=distribute_tensor(full["w_up"], mesh, stack),
        w_down=distribute_tensor(full["w_down"], mesh, stack),
        router=distribute_tensor(full["router"], mesh["dp"], [Shard(0)]),
    )


def expert_params(split: bool) -> dict:
    e = 2 if split else 4
    gen = torch.Generator().manual_seed(5)
    return {
        "w_up": torch.randn(e, 6, 5, generator=gen) / 5**0.5,
        "w_down": torch.randn(e, 5, 6, generator=gen) / 6**0.5,
        "router": torch.randn(e, 5, generator=gen) / 5**0.5,
    }


def check_experts(split: bool, **kw):
    """Expert parallelism: per-expert Muon equals single device bit for bit; whole experts are
    computed where they lie (nothing exchanged); split experts are gathered by rows first."""
    t = _fsdp()
    import muon_fn as mf
    from muon_fn.fsdp import FSDPMuonOptimizer

    def run():
        model = experts(split)
        opt = FSDPMuonOptimizer(model, **t.muon_kwargs(compile=False, **kw))
        kinds = [
            "piece" if m.piece is not None else "local" if mp.local else "owned"
            for m, mp in zip(opt._executor._matrices(), opt.plan.matrices)
        ]
        # 2 experts on 4 ranks are cut into one-expert pieces with owners of their own
        assert kinds == (["piece"] * 4 if split else ["local"] * 2) + ["owned"], opt.plan.describe()
        train(model, opt)

        def build():
            ref = Holder(**expert_params(split))
            return ref, mf.MuonOptimizer(
                ref.named_parameters(),
                matrix_view={"w_*": "experts"},
                **t.muon_kwargs(compile=False),
            )

        t.assert_same(model, opt, t.reference(build, STEPS), what=f"EP split={split}: ")
        if not split:  # whole experts are computed where they lie: only the router travels
            moved = opt.plan.matrices[-1].numel
            sent = torch.tensor([float(opt.last_step_stats["bytes_sent"])])
            torch.distributed.all_reduce(sent)
            assert 0 < sent.item() <= 2 * 4 * moved, (sent.item(), moved)
        return {"describe": opt.describe()}

    return run


def check_refused():
    """A pending reduction is no layout to update: refused, naming the parameter and placement."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard

    from muon_fn.fsdp import FSDPMuonOptimizer

    def run():
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        x = torch.zeros(4, 4)
        partial = DTensor.from_local(
            x, mesh, [Shard(0), Partial()], shape=torch.Size((8, 4)), stride=(4, 1)
        )
        try:
            FSDPMuonOptimizer(Holder(proj=partial))
        except ValueError as e:
            message = str(e)
        else:
            raise AssertionError("a Partial placement was accepted")
        assert "'proj'" in message and "Partial" in message, message
        return {"error": message}

    return run


def checks() -> dict:
    return {
        "fsdp_tp_muon": check_tp(),
        "fsdp_tp_replicate": check_tp(strategy="replicate"),
        "fsdp_tp_bf16_iteration": check_tp(ns_dtype=torch.bfloat16),
        "hsdp_tp_muon": check_tp(lambda: block_tp((2, 1, 2), ("replicate", "shard", "tp"))),
        "fsdp_tp_normuon": check_tp_normuon(),
        "fsdp_tp_sso": check_tp_sso(),
        "fsdp_tp_overlap": check_tp_overlap(),
        "fsdp_tp_dcp": check_tp_dcp(),
        "ep_whole_experts": check_experts(split=False),
        "ep_split_experts": check_experts(split=True),
        # inflight_bytes=1: every bucket alone, exchanged in rounds of one peer each way (W = 4)
        "fsdp_tp_rounds": check_tp(inflight_bytes=1),
        "hsdp_tp_rounds": check_tp(
            lambda: block_tp((2, 1, 2), ("replicate", "shard", "tp")), inflight_bytes=1
        ),
        "ep_whole_experts_rounds": check_experts(split=False, inflight_bytes=1),
        "ep_split_experts_rounds": check_experts(split=True, inflight_bytes=1),
        "refused": check_refused(),
    }


_DONE: list = []


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    if not _DONE:
        logs = tmp_path_factory.mktemp("fsdp_tp")
        out = logs / "results.json"
        log = run_ranks(__file__, W, [str(out)], logs, JOB_TIMEOUT_S)
        _DONE.append((json.loads(out.read_text()) if out.exists() else None, log[-4000:]))
    return _DONE[0]


@pytest.mark.parametrize("name", list(checks()))
def test_fsdp_tp(results, name):
    ranks, log = results
    assert ranks, f"the job wrote no results; its output:\n{log}"
    bad = [f"rank {r}: {res[name]['error']}" for r, res in enumerate(ranks) if not res[name]["ok"]]
    assert not bad, "\n".join(bad)


def test_rowwise_weight_travels_as_rows(results):
    """``down`` (7×10, Shard(1) on TP) is exchanged as rows: dp halves 4 and 3, each cut by TP."""
    ranks, _ = results
    values = [r["fsdp_tp_muon"]["value"] for r in ranks]
    assert [tuple(v["down_rows"]) for v in values] == [(0, 2), (2, 4), (4, 6), (6, 7)]
    assert values[0]["down_placements"] == "(Shard(dim=0), Shard(dim=1))"


if __name__ == "__main__":
    if len(sys.argv) == 4:  # one rank of the job: W RANK OUT
        run_checks(checks(), int(sys.argv[2]), int(sys.argv[1]), sys.argv[3])
        sys.stdout.flush()
        os._exit(0)
    logs_dir = Path(tempfile.mkdtemp(prefix="muon_fn_fsdp_tp_"))
    print(run_ranks(__file__, W, [str(logs_dir / "results.json")], logs_dir, JOB_TIMEOUT_S))
