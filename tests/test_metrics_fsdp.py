"""``metrics=`` under FSDP2 (gloo, W = 2 and 4): every rank reads the same figures, and they are
single-device MuonOptimizer's / SpectralSphereOptimizer's on the same steps.

The owners' figures (orthogonality residual, NorMuon's row scales, the shape scale, SSO's solve)
are computed on the same whole matrices as on one device, so they are equal bit for bit; the
sums over rows (the gradient's, momentum's, update's and weight's RMS) are added over the ranks'
rows in another order, so they agree to float32 rounding (rtol 1e-5). The harness (models,
synthetic gradients) is tests/test_fsdp.py's; one spawned job per world size runs every check.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from _ranks import assert_check, job_runner, rank_main
from test_fsdp import JOB_TIMEOUT_S, Experts, Toy, make, muon_kwargs, shard, train

pytestmark = pytest.mark.distributed

WORLD_SIZES = (2, 4)
RTOL = 1e-5
OWNER = ("ortho_residual", "row_scale_range", "effective_lr", "decay", "sso_")


def _compare(mine: dict, theirs: dict) -> dict:
    assert mine.keys() == theirs.keys(), sorted(set(mine) ^ set(theirs))
    worst = 0.0
    for k, v in mine.items():
        ref = theirs[k]
        if any(tag in k for tag in OWNER) and "@" not in k and not k.endswith("_max"):
            assert v == ref or (math.isnan(v) and math.isnan(ref)), (k, v, ref)
        else:
            err = abs(v - ref) / max(abs(ref), 1e-12)
            worst = max(worst, err)
            assert err <= RTOL, (k, v, ref)
    return {"figures": len(mine), "worst_rel": worst}


def check_muon(w, cls=Toy, **kw):
    """FSDPMuonOptimizer(metrics=True) against MuonOptimizer(metrics=True), NorMuon on."""

    def run():
        import muon_fn as mf
        from muon_fn.fsdp import FSDPMuonOptimizer

        model = shard(make(cls))
        opt = FSDPMuonOptimizer(model, metrics=True, beta2=0.95, **muon_kwargs(**kw))
        train([(model, opt)], 3)
        ref = make(cls)
        views = {"w_*": "experts", "conv.weight": "flatten"} if cls is Experts else None
        single = mf.MuonOptimizer(
            ref.named_parameters(), metrics=True, beta2=0.95, matrix_view=views, **muon_kwargs(**kw)
        )
        train([(ref, single)], 3)
        return _same_everywhere(opt.metrics(), single.metrics())

    return run


def check_sso(w):
    def run():
        import muon_fn as mf
        from muon_fn.fsdp import FSDPSpectralSphereOptimizer

        model = shard(make(Toy))
        opt = FSDPSpectralSphereOptimizer(model, metrics=True)
        train([(model, opt)], 2)
        ref = make(Toy)
        single = mf.SpectralSphereOptimizer(ref.named_parameters(), metrics=True)
        train([(ref, single)], 2)
        return _same_everywhere(opt.metrics(), single.metrics())

    return run


def check_every_k(w):
    """metrics=3: the figures are those of steps 1 and 4, on every rank."""

    def run():
        from muon_fn.fsdp import FSDPMuonOptimizer

        model = shard(make(Toy))
        opt = FSDPMuonOptimizer(model, metrics=3, **muon_kwargs())
        steps = []
        for t in range(5):
            train([(model, opt)], 1, first=t)
            steps.append(opt.metrics()["step"])
        assert steps == [1.0, 1.0, 1.0, 4.0, 4.0], steps
        return _same_everywhere(opt.metrics(), None)

    return run


def _same_everywhere(mine: dict, reference: dict | None) -> dict:
    """Every rank's dict equals rank 0's bit for bit, and the single-device one (if given)."""
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, mine)
    assert all(
        json.dumps(g, sort_keys=True) == json.dumps(gathered[0], sort_keys=True) for g in gathered
    )
    return _compare(mine, reference) if reference is not None else {"figures": len(mine)}


def checks_for(w: int) -> dict:
    return {
        "muon": check_muon(w),
        "muon_experts": check_muon(w, Experts),
        "sso": check_sso(w),
        "every_k": check_every_k(w),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return job_runner(__file__, "metrics", tmp_path_factory, JOB_TIMEOUT_S)


@pytest.mark.parametrize("w, name", [(w, name) for w in WORLD_SIZES for name in checks_for(w)])
def test_metrics_fsdp(results, w, name):
    assert_check(results(w), w, name)


if __name__ == "__main__":  # one rank of a job: W RANK OUT
    rank_main(checks_for)
