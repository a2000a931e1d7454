"""Cautious weight decay and AdaMuon under FSDPMuonOptimizer on CPU/gloo (W = 3, then 2):
bit-exact against the single-device MuonOptimizer with the same settings.

Cautious decay is elementwise with the parameter: it runs on each rank's rows. AdaMuon's second
moment (``update_exp_avg_sq``, shaped like the parameter) travels to each matrix's owner next to
the update's rows and back, as NorMuon's row state does; the RMS alignment needs the whole matrix
and runs on the owner. The harness (models, synthetic gradients, references) is
``tests/test_fsdp.py``'s; one spawned job per world size runs every check.
"""

from __future__ import annotations

import pytest
import torch
from _ranks import assert_check, job_runner, rank_main
from test_fsdp import JOB_TIMEOUT_S, Pair, check_parity, make, muon_kwargs, shard, train

pytestmark = pytest.mark.distributed

WORLD_SIZES = (3, 2)


def check_adamuon_state_is_sharded(w):
    """The second moment lives as DTensor shards laid out like the parameter (DCP keys are the
    same on every rank) and ``state_dict`` round-trips."""
    from torch.distributed.tensor import DTensor

    from muon_fn.fsdp import FSDPMuonOptimizer

    def run():
        model = shard(make())
        opt = FSDPMuonOptimizer(model, adamuon_beta2=0.95, **muon_kwargs())
        train([(model, opt)], 2)
        state = opt.state[model.l1.weight]
        assert sorted(state) == ["momentum_buffer", "update_exp_avg_sq"], sorted(state)
        v = state["update_exp_avg_sq"]
        assert isinstance(v, DTensor) and tuple(v.shape) == (10, 6) and v.dtype == torch.float32
        assert v.placements == model.l1.weight.placements
        return {"local_rows": v.to_local().shape[0]}

    return run


def checks_for(w: int) -> dict:
    compiled = {"backend": "inductor"} if w == 2 else {"backend": "eager"}
    return {
        "parity_cautious": check_parity(
            w, cautious_weight_decay=True, adamw_weight_decay=0.1, adamw_decay_1d=True
        ),
        "parity_adamuon": check_parity(w, adamuon_beta2=0.95),
        "parity_adamuon_rms_cautious_nosign": check_parity(
            w,
            adamuon_beta2=0.9,
            adjust_lr_fn="match_rms_adamw",
            cautious_weight_decay=True,
            adamuon_sign=False,
        ),
        "parity_adamuon_bf16_iteration": check_parity(
            w, adamuon_beta2=0.95, ns_dtype=torch.bfloat16
        ),
        "parity_adamuon_replicate": check_parity(w, strategy="replicate", adamuon_beta2=0.95),
        f"parity_compiled_{compiled['backend']}": check_parity(
            w, Pair, compile=compiled, adamuon_beta2=0.95, cautious_weight_decay=True
        ),
        "adamuon_state_sharded": check_adamuon_state_is_sharded(w),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return job_runner(__file__, "variants", tmp_path_factory, JOB_TIMEOUT_S)


@pytest.mark.parametrize("w, name", [(w, name) for w in WORLD_SIZES for name in checks_for(w)])
def test_variants_fsdp(results, w, name):
    assert_check(results(w), w, name)


if __name__ == "__main__":  # one rank of a job: W RANK OUT
    rank_main(checks_for)
