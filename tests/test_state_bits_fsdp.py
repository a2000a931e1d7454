"""Low-bit optimizer state (``state_bits``) under the FSDP optimizers on CPU/gloo (W = 4, then 2):
bit-exact against the single-device optimizers at the same ``state_bits``.

Blocks lie within rows and every rank holds whole rows, so each rank quantizes its rows exactly as
one device does. The jobs shrink the block to 4 elements (``muon_fn.core.quantize.BLOCK``), so the
toy models' rows hold several blocks, one of them short. The W = 4 job saves a DCP checkpoint of
8-bit state that the W = 2 job loads (resharding). The harness is ``tests/test_fsdp.py``'s.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from _ranks import assert_check, job_runner, run_checks, run_ranks
from test_fsdp import (
    JOB_TIMEOUT_S,
    Pair,
    assert_same,
    check_expert_stacks,
    check_parity,
    make,
    muon_kwargs,
    muon_single,
    on_rank0,
    reference,
    shard,
    train,
    two_iterations,
)

pytestmark = pytest.mark.distributed

WORLD_SIZES = (4, 2)  # in this order: the W=4 job saves the checkpoint the W=2 job loads
BLOCK = 4


def adamw_groups(m):
    """Two matrices and their biases on AdamW (quantized moments on row shards), the rest "auto"."""
    adam = [m.l1.weight, m.l2.weight]
    return [
        {"params": [p for p in m.parameters() if all(p is not q for q in adam)]},
        {"params": adam, "algorithm": "adamw", "lr": 1e-3, "weight_decay": 0.1},
    ]


def check_layout(w):
    """8-bit state: codes and scales are DTensors laid out like the parameter (whole rows)."""
    from torch.distributed.tensor import DTensor

    from muon_fn.fsdp import FSDPMuonOptimizer

    def run():
        model = shard(make())
        opt = FSDPMuonOptimizer(model, state_bits=8, **muon_kwargs())
        train([(model, opt)], 1)
        p = model.l1.weight  # 10 x 6: rows of 2 blocks of 3
        state = opt.state[p]
        assert sorted(state) == ["momentum_buffer_codes", "momentum_buffer_scales"], sorted(state)
        codes, scales = state["momentum_buffer_codes"], state["momentum_buffer_scales"]
        assert (
            isinstance(codes, DTensor)
            and codes.dtype == torch.int8
            and tuple(codes.shape) == (10, 6)
        )
        assert (
            isinstance(scales, DTensor)
            and scales.dtype == torch.float32
            and tuple(scales.shape) == (10, 2)
        )
        assert codes.placements == scales.placements == p.placements
        rows = p.to_local().shape[0]
        assert codes.to_local().shape[0] == scales.to_local().shape[0] == rows
        assert opt.state[model.l1.bias]["exp_avg"].dtype == torch.float32  # 1-D: full precision
        return {"local_rows": rows}

    return run


def check_dcp_save(w, ckpt_dir):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from muon_fn.fsdp import FSDPMuonOptimizer

    def run():
        model = shard(make())
        opt = FSDPMuonOptimizer(
            model, adamw_groups(model), state_bits=8, beta2=0.9, **muon_kwargs()
        )
        train([(model, opt)], 2)
        osd = get_optimizer_state_dict(model, opt)
        assert (
            "momentum_buffer_codes" in osd["state"]["l3.weight"]
            and "exp_avg_sq_codes" in osd["state"]["l1.weight"]
        )
        dcp.save({"model": get_model_state_dict(model), "optim": osd}, checkpoint_id=ckpt_dir)

    return run


def check_dcp_load(w, ckpt_dir):
    """Load W=4's 8-bit checkpoint at W=2 and continue: 4 uninterrupted single-device steps."""
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
        model = shard(make(seed=123))
        opt = FSDPMuonOptimizer(
            model, adamw_groups(model), state_bits=8, beta2=0.9, **muon_kwargs()
        )
        state = {
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, opt),
        }
        dcp.load(state, checkpoint_id=ckpt_dir)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, opt, state["optim"])
        train([(model, opt)], 2, first=2)
        expected = reference(muon_single(groups=adamw_groups, state_bits=8, beta2=0.9), steps=4)
        assert_same(model, opt, expected, what=f"DCP W=4 -> W={w}: ")

    return run


def check_convert(w):
    """An fp32 optimizer's state_dict (DTensor state) loads into an 8-bit one, each rank
    quantizing its rows: after 2 more steps it equals the single-device optimizers doing the same."""
    import muon_fn as mf
    from muon_fn.fsdp import FSDPMuonOptimizer

    def single():
        ref32, ref8 = make(), make()
        opt32 = mf.MuonOptimizer(adamw_groups(ref32), **muon_kwargs())
        opt8 = mf.MuonOptimizer(adamw_groups(ref8), state_bits=8, **muon_kwargs())
        train([(ref32, opt32)], 2)
        ref8.load_state_dict(ref32.state_dict())
        opt8.load_state_dict(opt32.state_dict())
        train([(ref8, opt8)], 2, first=2)
        return ref8, opt8

    def run():
        m32, m8 = shard(make()), shard(make(seed=123))
        opt32 = FSDPMuonOptimizer(m32, adamw_groups(m32), **muon_kwargs())
        opt8 = FSDPMuonOptimizer(m8, adamw_groups(m8), state_bits=8, **muon_kwargs())
        train([(m32, opt32)], 2)
        with torch.no_grad():
            for p, q in zip(m8.parameters(), m32.parameters()):
                p.to_local().copy_(q.to_local())
        opt8.load_state_dict(opt32.state_dict())
        assert (
            "momentum_buffer_codes" in opt8.state[m8.l3.weight]
            and opt8.param_groups[0]["state_bits"] == 8
        )
        train([(m8, opt8)], 2, first=2)
        assert_same(m8, opt8, on_rank0(single), what=f"fp32 -> 8-bit W={w}: ")

    return run


def check_sso(w):
    """FSDPSpectralSphereOptimizer with 8-bit momentum and AdamW moments."""
    import muon_fn as mf

    def build():
        ref = make()
        return ref, mf.SpectralSphereOptimizer(ref.parameters(), state_bits=8, lr=0.02)

    def run():
        model = shard(make())
        opt = mf.FSDPSpectralSphereOptimizer(model, state_bits=8, lr=0.02)
        train([(model, opt)], 2)
        assert_same(model, opt, reference(build, steps=2), what=f"SSO W={w}: ")

    return run


def check_columns_refused(w):
    """A column-sharded weight (a row-wise TP layout, Shard(1)) cannot hold blocks within rows."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from muon_fn.fsdp import FSDPMuonOptimizer

    def run():
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        model = torch.nn.Linear(8, 6, bias=False)
        model.weight = torch.nn.Parameter(
            distribute_tensor(model.weight.detach(), mesh, [Shard(1)])
        )
        with pytest.raises(
            ValueError,
            match=r"'weight' has placements \(Shard\(dim=1\),\), which shard its "
            r"columns, but its state 'momentum_buffer' is quantized",
        ):
            FSDPMuonOptimizer(model, state_bits=8, **muon_kwargs())
        FSDPMuonOptimizer(model, state_bits=16, **muon_kwargs())  # bf16: no blocks

    return run


def checks_for(w: int, ckpt_dir: str) -> dict:
    compiled = {"backend": "inductor"} if w == 2 else {"backend": "eager"}
    checks = {
        "parity_8bit": check_parity(w, state_bits=8),
        "parity_4bit_normuon": check_parity(w, state_bits=4, beta2=0.95, nesterov=False),
        "parity_16bit": check_parity(w, state_bits=16),
        "parity_8bit_adamw": check_parity(w, groups=adamw_groups, state_bits=8),
        "parity_4bit_adamw": check_parity(w, groups=adamw_groups, state_bits=4),
        f"parity_compiled_{compiled['backend']}": check_parity(
            w, Pair, compile=compiled, groups=two_iterations, state_bits=8
        ),
        "expert_stacks_8bit": check_expert_stacks(w, state_bits=8),
        "layout": check_layout(w),
        "convert_fp32_to_8bit": check_convert(w),
        "sso_8bit": check_sso(w),
        "columns_refused": check_columns_refused(w),
    }
    checks.update(
        {"dcp_save_w4": check_dcp_save(w, ckpt_dir)}
        if w == 4
        else {f"dcp_load_w{w}": check_dcp_load(w, ckpt_dir)}
    )
    return checks


def _worker(rank: int, w: int, out: str, ckpt_dir: str) -> None:
    from muon_fn.core import quantize as _quantize

    _quantize.BLOCK = BLOCK
    run_checks(checks_for(w, ckpt_dir), rank, w, out)


@pytest.fixture(scope="module")
def ckpt_dir():
    with tempfile.TemporaryDirectory(prefix="muon_fn_dcp_bits_") as d:
        yield d


@pytest.fixture(scope="module")
def results(ckpt_dir, tmp_path_factory):
    """Each world size's results, run on first use, W=4 first (it saves the checkpoint)."""
    return job_runner(
        __file__, "state_bits", tmp_path_factory, JOB_TIMEOUT_S, args=[ckpt_dir], order=WORLD_SIZES
    )


@pytest.mark.parametrize(
    "w, name", [(w, name) for w in WORLD_SIZES for name in checks_for(w, "/nonexistent")]
)
def test_state_bits_fsdp(results, w, name):
    assert_check(results(w), w, name)


if __name__ == "__main__":
    if len(sys.argv) == 5:  # one rank of a job: W RANK OUT CKPT_DIR
        _worker(int(sys.argv[2]), int(sys.argv[1]), sys.argv[3], sys.argv[4])
        sys.stdout.flush()
        os._exit(0)
    logs_dir = Path(
        tempfile.mkdtemp(prefix="muon_fn_state_bits_")
    )  # by hand: python tests/test_state_bits_fsdp.py W
    print(
        run_ranks(
            __file__,
            int(sys.argv[1]),
            [str(logs_dir / "results.json"), str(logs_dir / "ckpt")],
            logs_dir,
            JOB_TIMEOUT_S,
        )
    )
