"""``overlap=True`` of the FSDP optimizers on CPU/gloo: each check trains two identical FSDP2
models through real backward passes, one optimizer with ``overlap=False`` and one with
``overlap=True``, and asserts parameters and optimizer state equal bit for bit. One spawned job
per world size (4 and 2) runs every check (``tests/_ranks.py``); a collective timeout and a job
timeout bound every hang.
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile
import warnings
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from _ranks import assert_check, job_runner, run_checks, run_ranks

pytestmark = pytest.mark.distributed

JOB_TIMEOUT_S = 150
WORLD_SIZES = (4, 2)
STEPS = 3


class Deep(nn.Module):
    """Five matrices of different shapes (uneven and empty shards at W=4) and biases; one layer
    (``spare``) that no forward uses, so its gradient is None on every rank."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 10)
        self.l2 = nn.Linear(10, 12)
        self.l3 = nn.Linear(12, 6, bias=False)
        self.l4 = nn.Linear(6, 6)
        self.l5 = nn.Linear(6, 3)
        self.spare = nn.Linear(3, 5, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in (self.l1, self.l2, self.l3, self.l4):
            x = torch.tanh(layer(x))
        return self.l5(x)


def build(optimizer: str, overlap: bool, **kw):
    from torch.distributed.fsdp import fully_shard

    from muon_fn.fsdp import FSDPMuonOptimizer, FSDPSpectralSphereOptimizer

    torch.manual_seed(0)
    model = Deep()
    for child in model.children():
        fully_shard(child)
    fully_shard(model)
    cls = FSDPMuonOptimizer if optimizer == "muon" else FSDPSpectralSphereOptimizer
    kw.setdefault("compile", False)
    # SSO makes its state from the whole matrices on the first step a matrix has a gradient, so a
    # bucket of a matrix that never gets one (spare) is posted by step(): leave it out.
    params = [p for n, p in model.named_parameters() if optimizer == "muon" or "spare" not in n]
    return model, cls(model, params, lr=0.02, overlap=overlap, **kw)


def batch(step: int, nan: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    rank = torch.distributed.get_rank()
    gen = torch.Generator().manual_seed(100 * step + rank)  # every rank its own batch
    x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 3, generator=gen)
    if nan:
        x[0, 0] = float("nan")
    return x, y


def backward(model, step: int, nan: bool = False) -> None:
    x, y = batch(step, nan)
    (model(x) - y).square().mean().backward()


def same(a, opt_a, b, opt_b, what: str) -> None:
    """Local shards of parameters and of every state entry equal bitwise."""
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p.to_local(), q.to_local()), f"{what}: parameter {name} differs"
        for key, v in opt_a.state[p].items():
            w = opt_b.state[q][key]
            v, w = (t.to_local() if hasattr(t, "to_local") else t for t in (v, w))
            assert torch.equal(v, w), f"{what}: state {key} of {name} differs"


def run_pair(
    optimizer: str, steps: int = STEPS, between=None, nan_at=None, k: int = 1, **kw
) -> list[int]:
    """Train the pair; ``between(model, opt, t)`` runs after each backward, before step.
    Returns the buckets the overlapped optimizer posted during each backward."""
    pairs = [
        build(optimizer, False, gradient_accumulation_steps=k, **kw),
        build(optimizer, True, gradient_accumulation_steps=k, **kw),
    ]
    posted = []
    for t in range(steps):
        for micro in range(k):
            for model, opt in pairs:
                backward(
                    model, k * t + micro, nan=(nan_at == t and torch.distributed.get_rank() == 1)
                )
                if between is not None:
                    between(model, opt, t)
                opt.step()
                opt.zero_grad()
            posted.append(pairs[1][1].last_step_stats.get("overlapped_buckets", 0))
        same(*pairs[0], *pairs[1], f"{optimizer} step {t}")
    return posted


def check_muon():
    posted = run_pair("muon")
    # From the second step on (the first learns that ``spare`` gets no gradient), every bucket
    # is posted during backward.
    assert posted[0] == 0 and all(n > 0 for n in posted[1:]), posted
    return posted


def check_sso():
    posted = run_pair("sso", steps=3)
    assert posted[0] == 0 and all(n > 0 for n in posted[1:]), (
        posted
    )  # the first step makes its state
    return posted


def check_normuon_bf16_wire():
    return run_pair("muon", beta2=0.95, wire_dtype=torch.bfloat16)


def check_compiled():
    return run_pair("muon", steps=2, compile={"backend": "eager"})


def check_accumulation():
    posted = run_pair("muon", k=2)
    assert posted[0::2] == [0] * STEPS and all(n > 0 for n in posted[3::2]), (
        posted
    )  # last micro-batch only
    return posted


def check_nonfinite():
    run_pair("muon", nan_at=1)  # "skip": every rank skips step 1, both optimizers alike
    model, opt = build("muon", True, nonfinite="error")
    backward(model, 0, nan=torch.distributed.get_rank() == 1)
    try:
        opt.step()
    except RuntimeError as e:
        assert "non-finite" in str(e), e
    else:
        raise AssertionError("no error")
    assert opt._executor._overlap.posted is None  # drained
    opt.zero_grad()
    backward(model, 1)
    opt.step()  # the next step runs


def check_no_grad_rank():
    """Rank 1 drops one gradient after backward (detected: that step runs without overlap, as
    agreed by every rank); ``spare`` never has a gradient (its bucket is posted by step)."""

    def drop(model, opt, t):
        if t == 1 and torch.distributed.get_rank() == 1:
            model.l2.weight.grad = None

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        posted = run_pair("muon", steps=4, between=drop)
    assert posted[1] == 0 and posted[2] > 0 and posted[3] > 0, posted
    assert any("overlap=True" in str(w.message) for w in caught)  # on every rank: all agreed
    return posted


def check_backward_without_step():
    """A backward without a step (its exchange is drained by the next backward or zero_grad),
    two backward passes accumulating before one step."""
    pairs = [build("muon", False), build("muon", True)]
    for model, opt in pairs:
        backward(model, -1)
        opt.step()
        opt.zero_grad()
        backward(model, 0)
        opt.zero_grad()  # drains
        backward(model, 1)
        model.zero_grad()  # not the optimizer's: the next backward drains
        backward(model, 2)
        backward(model, 3)  # accumulates onto step 2's gradients
        opt.step()
        opt.zero_grad()
    same(*pairs[0], *pairs[1], "backward without step")
    assert pairs[1][1].last_step_stats["overlapped_buckets"] > 0


def check_state_and_hooks():
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    model, opt = build("muon", True)
    assert "overlap=True" in opt.describe()
    backward(model, 0)
    opt.step()
    sd = get_optimizer_state_dict(model, opt)
    with tempfile.TemporaryDirectory() as d:
        path = [d]
        torch.distributed.broadcast_object_list(path, src=0)
        dcp.save({"optim": sd}, checkpoint_id=path[0])
        torch.distributed.barrier()
        model2, opt2 = build("muon", True)
        sd2 = get_optimizer_state_dict(model2, opt2)
        dcp.load({"optim": sd2}, checkpoint_id=path[0])
        set_optimizer_state_dict(model2, opt2, sd2)
        torch.distributed.barrier()
    for p, q in zip(model.parameters(), model2.parameters()):
        for key, v in opt.state[p].items():
            w = opt2.state[q][key]
            assert torch.equal(
                getattr(v, "to_local", lambda: v)(),  # noqa: B023  called at once, in this iteration
                getattr(w, "to_local", lambda: w)(),  # noqa: B023  called at once, in this iteration
            )
    # Hooks go with the optimizer, or with overlap=False.
    hooked = model.l1.weight
    assert len(hooked._post_accumulate_grad_hooks) == 1
    ref = weakref.ref(opt)
    del opt, sd
    gc.collect()
    assert ref() is None and not hooked._post_accumulate_grad_hooks
    opt2.overlap = False
    assert not model2.l1.weight._post_accumulate_grad_hooks
    backward(model2, 1)
    opt2.step()
    assert "overlapped_buckets" not in opt2.last_step_stats


def check_metrics():
    """metrics=2 with overlap: a measured step drains the round posted during backward and runs
    without overlap (its pre phase records), the others overlap; results equal the pair's."""
    posted = run_pair("muon", metrics=2)
    assert posted[0::2] == [0] * len(posted[0::2]) and all(n > 0 for n in posted[1::2]), posted
    return posted


def checks() -> dict:
    return {
        "metrics": check_metrics,
        "muon": check_muon,
        "sso": check_sso,
        "normuon_bf16_wire": check_normuon_bf16_wire,
        "compiled": check_compiled,
        "accumulation": check_accumulation,
        "nonfinite": check_nonfinite,
        "no_grad_rank": check_no_grad_rank,
        "backward_without_step": check_backward_without_step,
        "state_and_hooks": check_state_and_hooks,
    }


def test_posted_refuses_out_of_order():
    """Buckets are posted in plan order only (checked before any collective), and finish needs
    them all."""
    from muon_fn.distributed._exchange import Posted
    from muon_fn.distributed._plan import make_plan

    plan = make_plan([(4, 3), (6, 2), (5, 5)], 2, num_buckets=3)
    posted = Posted(plan, 0)
    with pytest.raises(ValueError, match="out of order"):
        posted.post(1, {})
    with pytest.raises(ValueError, match="buckets posted"):
        posted.finish(lambda idx, mats: mats)
    with pytest.raises(ValueError, match="holds matrices"):
        posted.post(0, {})
    with pytest.raises(ValueError, match="one rank"):
        Posted(make_plan([(4, 3)], 1), 0)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return job_runner(__file__, "overlap", tmp_path_factory, JOB_TIMEOUT_S)


@pytest.mark.parametrize("w, name", [(w, name) for w in WORLD_SIZES for name in checks()])
def test_overlap(results, w, name):
    assert_check(results(w), w, name)


if __name__ == "__main__":
    if len(sys.argv) == 4:  # one rank of a job: W RANK OUT
        run_checks(checks(), int(sys.argv[2]), int(sys.argv[1]), sys.argv[3])
        sys.stdout.flush()
        os._exit(0)
    logs_dir = Path(tempfile.mkdtemp(prefix="muon_fn_overlap_"))
    print(
        run_ranks(
            __file__, int(sys.argv[1]), [str(logs_dir / "results.json")], logs_dir, JOB_TIMEOUT_S
        )
    )
