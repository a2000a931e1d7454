"""Head views and per-expert planning under FSDP2, on CPU/gloo at W = 2, 3 and 4.

One spawned job per world size (this file as a script, one process per rank, every check on
every rank; collective timeout 60 s, job timeout 240 s). Bit-exact checks feed the same synthetic
gradients to the sharded model and to the single-device optimizer with the same views.

- Head views: a fused QKV (18 rows: uneven at W = 4), a per-head output projection (7 rows) and an
  MLP weight of the QKV's shape that no view names; FSDPMuonOptimizer (Muon and NorMuon) and
  FSDPSpectralSphereOptimizer equal their single-device optimizers bit for bit.
- Per-expert planning: expert stacks sharded on their expert dim are computed where they lie
  (every rank its whole experts): no bytes exchanged, for an evenly divisible stack and an uneven
  one alike, and the same results as single device (Muon, compiled by default, with a gate/up
  stack cut by ``heads(rows=2, experts=True)``); NorMuon and SSO keep each stack on one owner
  (their matrix step is not per matrix) and are exact too.
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
WORLD_SIZES = (2, 3, 4)


class Attn(nn.Module):
    """A fused QKV ``(18, 6)`` (heads of 3 rows), an output projection ``(7, 12)`` fed by 3 heads
    of 4 columns, and an MLP weight with the QKV's shape that no view names."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(6, 18)
        self.out = nn.Linear(12, 7, bias=False)
        self.mlp = nn.Linear(6, 18, bias=False)


class Stacks(nn.Module):
    """Only expert stacks: 4 experts (whole on every rank: 2 each at W = 2 and 4; 2, 2, 0 at
    W = 3) and a gate/up stack cut into its two halves by a head view."""

    def __init__(self) -> None:
        super().__init__()
        self.w_up = nn.Parameter(torch.randn(4, 8, 6) / 6**0.5)
        self.w_gate_up = nn.Parameter(torch.randn(4, 10, 6) / 6**0.5)
        self.w_down = nn.Parameter(torch.randn(4, 6, 8) / 8**0.5)


class FewExperts(nn.Module):
    """Stacks with fewer experts than ranks at W = 3 and 4 (2 and 3 experts): cut into one-expert
    pieces whose owners LPT spreads over every rank, idle ones included; plus a plain matrix."""

    def __init__(self) -> None:
        super().__init__()
        self.w_up = nn.Parameter(torch.randn(2, 8, 6) / 6**0.5)
        self.w_down = nn.Parameter(torch.randn(3, 6, 8) / 8**0.5)
        self.router = nn.Linear(6, 3, bias=False)


def head_views():
    import muon_fn as mf

    return {"qkv.weight": mf.heads(rows=(6, 6, 6)), "out.weight": mf.heads(cols=3)}


def stack_views():
    import muon_fn as mf

    return {"w_gate_up": mf.heads(rows=2, experts=True)}


def _fsdp():
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import test_fsdp

    return test_fsdp


def check_heads_muon(w, **kw):
    """FSDPMuonOptimizer with per-parameter head views equals MuonOptimizer with the same views
    (compiled the same way: ``compile`` in ``kw``, else the compiled default)."""
    t = _fsdp()
    from muon_fn.fsdp import FSDPMuonOptimizer

    def run():
        model = t.shard(t.make(Attn))
        opt = FSDPMuonOptimizer(model, matrix_view=head_views(), **t.muon_kwargs(**kw))
        t.train([(model, opt)], t.STEPS)
        expected = t.reference(
            t.muon_single(Attn, lambda m: m.named_parameters(), matrix_view=head_views(), **kw)
        )
        t.assert_same(model, opt, expected, what=f"W={w} heads {kw}: ")
        plain = t.reference(t.muon_single(Attn, lambda m: m.named_parameters(), **kw))
        same = [torch.equal(t.full(p.detach()), q) for p, (q, _) in zip(model.parameters(), plain)]
        assert same == [False, True, False, True], (
            same
        )  # qkv.weight, qkv.bias, out.weight, mlp.weight
        text = opt.describe()
        assert "view=heads(rows=(6, 6, 6))" in text and "view=heads(cols=3)" in text, text
        return {}

    return run


def check_heads_sso(w):
    """FSDPSpectralSphereOptimizer with head views equals SpectralSphereOptimizer: every head its
    own sphere, its state travelling with the rows."""
    t = _fsdp()
    from muon_fn import SpectralSphereOptimizer
    from muon_fn.fsdp import FSDPSpectralSphereOptimizer

    def run():
        model = t.shard(t.make(Attn))
        opt = FSDPSpectralSphereOptimizer(model, matrix_view=head_views(), compile=False)
        t.train([(model, opt)], 3)

        def build():
            ref = t.make(Attn)
            return ref, SpectralSphereOptimizer(
                ref.named_parameters(), matrix_view=head_views(), compile=False
            )

        t.assert_same(model, opt, t.reference(build, 3), what=f"W={w} heads sso: ")
        return {}

    return run


def check_experts_local(w, local=True, **kw):
    """Expert stacks are planned per expert: local (no owner), nothing on the wire, results equal
    MuonOptimizer with the same views (compiled the same way). ``local=False``: a mid phase that
    is not per matrix (NorMuon's compiled row sums) keeps one owner per stack, as exact."""
    t = _fsdp()
    from muon_fn.fsdp import FSDPMuonOptimizer

    def run():
        model = t.shard(t.make(Stacks))
        opt = FSDPMuonOptimizer(model, matrix_view=stack_views(), **t.muon_kwargs(**kw))
        assert all(mp.local == local for mp in opt.plan.matrices), opt.plan.describe()
        assert all((opt.plan.sent_elements(r) == 0) == local for r in range(w))
        t.train([(model, opt)], t.STEPS)
        stats = opt.last_step_stats
        assert (stats["bytes_sent"] == stats["bytes_received"] == 0) == local, stats
        views = {"w_up": "experts", "w_down": "experts", **stack_views()}
        expected = t.reference(
            t.muon_single(Stacks, lambda m: m.named_parameters(), matrix_view=views, **kw)
        )
        t.assert_same(model, opt, expected, what=f"W={w} local experts {kw}: ")
        return {
            "describe": opt.describe(),
            "plan": opt.plan.describe([n for n, _ in model.named_parameters()]),
            "ns_flops": stats["ns_flops"],
        }

    return run


def check_experts_mixed(w):
    """A model with expert stacks (local) and plain matrices (owned): only the plain matrices
    travel, and the run equals single device (test_fsdp's Experts: E = 5, uneven at every W)."""
    t = _fsdp()
    from muon_fn.fsdp import FSDPMuonOptimizer

    def run():
        model = t.shard(t.make(t.Experts))
        opt = FSDPMuonOptimizer(model, **t.muon_kwargs(compile=False))
        names = [n for n, _ in model.named_parameters()]
        local = {
            names[opt._executor._matrices()[j].position]: mp.local
            for j, mp in enumerate(opt.plan.matrices)
        }
        assert local == {
            "w_up": True,
            "w_down": True,
            "router.weight": False,
            "conv.weight": False,
        }, local
        t.train([(model, opt)], t.STEPS)
        views = {"w_*": "experts", "conv.weight": "flatten"}
        t.assert_same(
            model,
            opt,
            t.reference(
                t.muon_single(
                    t.Experts, lambda m: m.named_parameters(), matrix_view=views, compile=False
                )
            ),
            what=f"W={w} mixed: ",
        )
        moved = sum(mp.numel for mp in opt.plan.matrices if not mp.local)
        sent = torch.tensor([float(opt.last_step_stats["bytes_sent"])])
        torch.distributed.all_reduce(sent)
        assert 0 < sent.item() <= 2 * 4 * moved, (sent.item(), moved)  # the two plain matrices only
        return {}

    return run


def check_expert_pieces(w, **kw):
    """A stack with fewer experts than ranks is cut into one-expert pieces, each with its own
    owner (ranks that hold no expert compute some), exchanged, and equal to MuonOptimizer bit for
    bit (compiled the same way); with as many experts as ranks or more it stays local."""
    t = _fsdp()
    from muon_fn.fsdp import FSDPMuonOptimizer

    def run():
        model = t.shard(t.make(FewExperts))
        opt = FSDPMuonOptimizer(model, **t.muon_kwargs(**kw))
        kinds = {}
        for m, mp in zip(opt._executor._matrices(), opt.plan.matrices):
            kinds.setdefault(m.position, set()).add(
                "piece" if m.piece is not None else "local" if mp.local else "owned"
            )
        expected = {
            0: {"piece" if w > 2 else "local"},
            1: {"piece" if w > 3 else "local"},
            2: {"owned"},
        }
        assert kinds == expected, (kinds, opt.plan.describe())
        t.train([(model, opt)], t.STEPS)
        views = {"w_*": "experts"}
        reference = t.reference(
            t.muon_single(FewExperts, lambda m: m.named_parameters(), matrix_view=views, **kw)
        )
        t.assert_same(model, opt, reference, what=f"W={w} expert pieces {kw}: ")
        return {"load": opt.plan.load(), "describe": opt.describe()}

    return run


class RoutedPair(nn.Module):
    """Two expert stacks of 2 experts and a Linear, with a forward that uses every expert."""

    def __init__(self) -> None:
        super().__init__()
        self.w_up = nn.Parameter(torch.randn(2, 8, 6) / 3)
        self.w_down = nn.Parameter(torch.randn(2, 6, 8) / 3)
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.einsum("bi,eoi->beo", x, self.w_up).relu()
        return self.lin(torch.einsum("beo,eio->bi", h, self.w_down))


def check_expert_pieces_overlap(w):
    """Through real backward passes, expert pieces (W = 3, 4) or local stacks (W = 2) give the
    same bits with ``overlap=True`` as without."""
    t = _fsdp()
    from muon_fn.fsdp import FSDPMuonOptimizer

    def run():
        pairs = []
        for overlap in (False, True):
            model = t.shard(t.make(RoutedPair))
            pairs.append((model, FSDPMuonOptimizer(model, overlap=overlap, compile=False)))
        gen, rank = torch.Generator().manual_seed(1), torch.distributed.get_rank()
        for _ in range(3):
            x = torch.randn(2 * w, 6, generator=gen)[2 * rank : 2 * rank + 2]
            for model, opt in pairs:
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
        (a, _), (b, ob) = pairs
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            assert torch.equal(p.to_local(), q.to_local()), name
        assert any(m.piece is not None for m in ob._executor._matrices()) == (w > 2)
        return {"describe": ob.describe()}

    return run


def check_experts_sso(w):
    """FSDPSpectralSphereOptimizer keeps each stack on one owner (SSO's operator is not per
    matrix: an expert's bits can depend on its batch mates), and equals SpectralSphereOptimizer
    with the same views, a head-cut stack included."""
    t = _fsdp()
    from muon_fn import SpectralSphereOptimizer
    from muon_fn.fsdp import FSDPSpectralSphereOptimizer

    def run():
        model = t.shard(t.make(Stacks))
        opt = FSDPSpectralSphereOptimizer(model, matrix_view=stack_views(), compile=False)
        assert not any(mp.local for mp in opt.plan.matrices), opt.plan.describe()
        t.train([(model, opt)], 3)

        def build():
            ref = t.make(Stacks)
            views = {"w_up": "experts", "w_down": "experts", **stack_views()}
            return ref, SpectralSphereOptimizer(
                ref.named_parameters(), matrix_view=views, compile=False
            )

        t.assert_same(model, opt, t.reference(build, 3), what=f"W={w} sso stacks: ")
        return {}

    return run


def checks_for(w: int) -> dict:
    return {
        "heads_muon": check_heads_muon(w),
        "heads_normuon": check_heads_muon(w, beta2=0.95, nesterov=False, compile=False),
        "heads_bf16_iteration": check_heads_muon(w, ns_dtype=torch.bfloat16, compile=False),
        "heads_sso": check_heads_sso(w),
        "experts_local": check_experts_local(w),
        "experts_normuon_owned": check_experts_local(w, local=False, beta2=0.95),
        "experts_mixed": check_experts_mixed(w),
        "experts_sso": check_experts_sso(w),
        "expert_pieces": check_expert_pieces(w, compile=False),
        "expert_pieces_compiled": check_expert_pieces(w),
        "expert_pieces_overlap": check_expert_pieces_overlap(w),
    }


def run_job(w: int, out: str, logs: Path) -> str:
    return run_ranks(__file__, w, [out], logs, JOB_TIMEOUT_S)


_DONE: dict[int, tuple] = {}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    def get(w: int):
        if w not in _DONE:
            logs = tmp_path_factory.mktemp(f"fsdp_views_w{w}")
            out = logs / "results.json"
            log = run_job(w, str(out), logs)
            _DONE[w] = (json.loads(out.read_text()) if out.exists() else None, log[-4000:])
        return _DONE[w]

    return get


@pytest.mark.parametrize("w, name", [(w, n) for w in WORLD_SIZES for n in checks_for(w)])
def test_fsdp_views(results, w, name):
    ranks, log = results(w)
    assert ranks, f"the W={w} job wrote no results; its output:\n{log}"
    for rank, res in enumerate(ranks):
        assert res[name]["ok"], f"rank {rank}:\n{res[name]['error']}"


def test_describe_shows_per_expert_planning(results):
    """What ``describe()`` prints for the stacks at W = 2: every stack ``local``, nothing sent."""
    ranks, log = results(2)
    assert ranks, log
    value = ranks[0]["experts_local"]["value"]
    assert (
        value["describe"]
        == """\
FSDPMuonOptimizer(strategy='owner', world_size=2)
  muon  w_up (4, 8, 6) local bucket=2 view=experts
  muon  w_down (4, 6, 8) local bucket=0 view=experts
  muon  w_gate_up (4, 10, 6) local bucket=1 view=heads(rows=2, experts=True)"""
    ), value["describe"]
    assert (
        value["plan"]
        == """\
Plan(world_size=2, matrices=3, buckets=3)
  w_up (4, 8, 6) bucket=2 local rows per rank=[2, 2]
  w_gate_up (4, 10, 6) bucket=1 local rows per rank=[2, 2]
  w_down (4, 6, 8) bucket=0 local rows per rank=[2, 2]
  load per rank=[9736, 9736]
  elements sent per rank=[0, 0]"""
    ), value["plan"]


if __name__ == "__main__":
    if len(sys.argv) == 4:  # one rank of a job started by run_job: W RANK OUT
        run_checks(checks_for(int(sys.argv[1])), int(sys.argv[2]), int(sys.argv[1]), sys.argv[3])
        sys.stdout.flush()
        os._exit(0)
    logs_dir = Path(tempfile.mkdtemp(prefix="muon_fn_fsdp_views_"))
    print(run_job(int(sys.argv[1]), str(logs_dir / "results.json"), logs_dir))
