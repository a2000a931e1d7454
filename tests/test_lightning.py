"""The Lightning recipe (examples/lightning.py) on one process, under DDP and under FSDP2
(Lightning's ``ModelParallelStrategy``: ``fully_shard`` in ``configure_model``, the optimizer built
on the DTensor parameters), on the CPU with gloo, launched as users launch it (``python
examples/lightning.py --devices 2``: Lightning starts rank 1 itself).

Every run trains 4 steps, 2 epochs of 2, one window per device and micro-batch. The example's
sampler gives rank r of W every W-th window of one shuffled order, so 2 devices see, step by step,
the windows that one process sees with ``--accumulate 2`` (micro-batch r on rank r). The ranks'
gradients are averaged (each halved, then summed) as the single process halves each micro-batch's
loss and sums the gradients: the same operations, so the final parameters are equal bit for bit.
Except clipping under FSDP2: ``clip_grad_norm_`` sums the norms of shards there, a few ulps off
the single-process norm, so FSDP2 runs clip nowhere (``--grad-clip 0``: bit for bit) or, once,
are held to a tolerance. DDP clips the all-reduced gradients, as one process does: bit for bit.

A launch costs about 10 s of process start on 2 cores (Lightning starts rank 1 after rank 0 has
imported everything), so one launch runs many fits: this file, run as a script, calls the
example's ``main`` once per argument list. Two launches in all (every straight run, then every
resumed run) and one single-process job, in fresh processes like the launches (no state left by
other tests), beside the first launch.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_examples import ROOT, _require_extra, load_example

STEPS = ["--steps", "4", "--epochs", "2", "--batch-size", "1"]
OPTIMIZERS = ("muon", "hybrid")
STRATEGIES = {"fsdp2": "0", "ddp": "1"}  # strategy: the --grad-clip of its runs (see above)
JOB_TIMEOUT_S = 360  # a job of up to 5 fits; a hang (a collective mismatch) fails instead
# FSDP2 with clipping against one process with clipping, max |Δp| after 4 steps: the clip
# coefficient differs in its last bits (a norm summed over shards), and 4 steps carry that to
# the 7.6e-7 measured (hybrid; parameters of magnitude up to 1). Both runs iterate in fp32
# (CLIPPED): in bf16 (the default on CPUs with bf16 GEMMs) a last-bit difference can flip a
# rounding of the iteration's input, which 4 steps carried to 6.9e-3 on an AVX-512 BF16 Xeon.
CLIPPED_ATOL = 1e-5
CLIPPED = ["--ns-dtype", "float32"]


def _start(tmp: Path, name: str, argvs: list[list[str]]) -> Callable[..., str]:
    """Start this file as a script in a new process (session): it calls the example's ``main``
    with each argument list in turn. The returned function waits for it, at most JOB_TIMEOUT_S
    after the start (then the whole session, Lightning's rank processes included, is killed;
    ``stop=True``: at once), and returns its output; a failure fails the test with its tail."""
    spec, log = tmp / f"{name}.json", tmp / f"{name}.log"
    spec.write_text(json.dumps(argvs))
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        MUON_FN_COMPILE="0",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, __file__, str(spec)],
            cwd=tmp,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + JOB_TIMEOUT_S

    def finish(stop: bool = False) -> str:
        try:
            rc = proc.wait(timeout=0 if stop else max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = "stopped" if stop else f"killed after {JOB_TIMEOUT_S} s"
        out = log.read_text()
        assert rc == 0, f"{name}: exit {rc}\n{out[-4000:]}"
        return out

    return finish


def _params(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def _assert_equal(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    diff = {k: (a[k] - b[k]).abs().max().item() for k in a if not torch.equal(a[k], b[k])}
    assert not diff, f"{what}: not bit for bit; max |Δ| per parameter: {diff}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Every run, each writing its final parameters to ``<name>.pt``:
    - ``one-<optimizer>-clip<0|1>``: one process, 2 micro-batches per step; a job of its own,
      started first, so that it runs while the first launch leaves a core idle (rank 1 importing);
    - ``<strategy>-<optimizer>``: 2 devices, straight, a checkpoint after each epoch (steps 2, 4);
      and ``fsdp2-hybrid-clip1``, FSDP2 with clipping, in the same launch;
    - ``<strategy>-<optimizer>-resumed``: a second launch (new processes) resuming each from its
      step-2 checkpoint (the one a run stopped at step 2 takes: the schedule reads --steps).
    """
    _require_extra("lightning", "lightning")
    tmp = tmp_path_factory.mktemp("lightning")
    one = [
        [
            *STEPS,
            "--accumulate",
            "2",
            "--optimizer",
            opt,
            "--grad-clip",
            clip,
            "--save-params",
            str(tmp / f"one-{opt}-clip{clip}.pt"),
        ]
        for opt in OPTIMIZERS
        for clip in "01"
    ]
    one.append(
        [
            *STEPS,
            "--accumulate",
            "2",
            "--optimizer",
            "hybrid",
            *CLIPPED,
            "--save-params",
            str(tmp / "one-hybrid-clip1-fp32.pt"),
        ]
    )
    straight, resumed = [], []
    for strategy, clip in STRATEGIES.items():
        for opt in OPTIMIZERS:
            run = f"{strategy}-{opt}"
            common = [
                *STEPS,
                "--strategy",
                strategy,
                "--devices",
                "2",
                "--grad-clip",
                clip,
                "--optimizer",
                opt,
            ]
            straight.append(
                [*common, "--ckpt-dir", str(tmp / run), "--save-params", str(tmp / f"{run}.pt")]
            )
            resumed.append(
                [
                    *common,
                    "--resume",
                    str(tmp / run / "epoch=0-step=2.ckpt"),
                    "--save-params",
                    str(tmp / f"{run}-resumed.pt"),
                ]
            )
    straight.append(
        [
            *STEPS,
            "--strategy",
            "fsdp2",
            "--devices",
            "2",
            "--optimizer",
            "hybrid",
            *CLIPPED,
            "--save-params",
            str(tmp / "fsdp2-hybrid-clip1.pt"),
        ]
    )
    one_job = _start(tmp, "one", one)
    try:
        out = _start(tmp, "straight", straight)()
    except BaseException:
        one_job(stop=True)
        raise
    assert "FSDPGPT" in out  # fully_shard applied in configure_model
    out += one_job() + _start(tmp, "resumed", resumed)()
    assert out.count("trained 4 steps") == len(one) + len(straight) + len(resumed), out[-3000:]
    assert out.count("Restored all states from the checkpoint") == len(resumed), out[-3000:]
    return tmp


@pytest.mark.distributed
def test_lightning_resumed_run_equals_the_straight_run(runs):
    """For DDP and FSDP2, each optimizer: a run resumed in new processes from Lightning's step-2
    checkpoint (DCP shards under FSDP2, one file under DDP) ends on the straight run's parameters."""
    for strategy in STRATEGIES:
        for opt in OPTIMIZERS:
            ckpts = runs / f"{strategy}-{opt}"
            assert sorted(p.name for p in ckpts.iterdir()) == [
                "epoch=0-step=2.ckpt",
                "epoch=1-step=4.ckpt",
            ]
            assert (ckpts / "epoch=0-step=2.ckpt").is_dir() == (strategy == "fsdp2")
            _assert_equal(
                _params(runs / f"{strategy}-{opt}-resumed.pt"),
                _params(runs / f"{strategy}-{opt}.pt"),
                f"{strategy} {opt}: resumed vs straight",
            )


@pytest.mark.distributed
def test_lightning_fsdp2_equals_one_process(runs):
    """ModelParallelStrategy (FSDP2), --optimizer muon (MuonOptimizer(self.parameters())) and
    hybrid, no clipping: equal to one process accumulating the ranks' micro-batches, bit for bit;
    with clipping within CLIPPED_ATOL, and clipping changes the result."""
    for opt in OPTIMIZERS:
        _assert_equal(
            _params(runs / f"fsdp2-{opt}.pt"),
            _params(runs / f"one-{opt}-clip0.pt"),
            f"fsdp2 {opt} vs one process",
        )
    clipped = _params(runs / "fsdp2-hybrid-clip1.pt")
    one = _params(runs / "one-hybrid-clip1-fp32.pt")
    worst = max((clipped[k] - one[k]).abs().max().item() for k in one)
    assert worst <= CLIPPED_ATOL, worst
    assert not torch.equal(
        clipped["lm_head.weight"], _params(runs / "fsdp2-hybrid.pt")["lm_head.weight"]
    )


@pytest.mark.distributed
def test_lightning_ddp_equals_one_process(runs):
    """DDP with the example's default clipping (of the all-reduced gradients, as on one process):
    equal to one process, bit for bit, for both optimizers, which differ."""
    for opt in OPTIMIZERS:
        _assert_equal(
            _params(runs / f"ddp-{opt}.pt"),
            _params(runs / f"one-{opt}-clip1.pt"),
            f"ddp {opt} vs one process",
        )
    muon, hybrid = (_params(runs / f"ddp-{opt}.pt") for opt in OPTIMIZERS)
    assert not torch.equal(muon["lm_head.weight"], hybrid["lm_head.weight"])


# ----------------------------------------------------------------- from and to torch.optim.Muon
# A model of 2-D matrices only, as torch.optim.Muon takes, trained under ModelParallelStrategy by
# torch.optim.Muon or MuonOptimizer (a fit per dict of _matrix_fit); DCP checkpoints converted
# between the two with muon_fn.optim.from_torch_checkpoint / to_torch_checkpoint.
def _matrix_fit(spec: dict) -> None:
    """One W = 2 fit of ``spec``: ``optimizer`` ("torch" or "muon"), ``steps``, ``ckpt_dir``
    (a checkpoint at step 2), ``resume`` (a checkpoint to start from), ``out``: a file for the
    optimizer's momentum buffers and groups right after the restore and the final parameters."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy

    import muon_fn as mf

    def full(t):
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()

    class Matrices(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            dims = (8, 16, 16, 4)
            self.net = torch.nn.Sequential(
                *(torch.nn.Linear(i, o, bias=False) for i, o in itertools.pairwise(dims))
            )
            self.dump: dict = {}

        def configure_model(self):
            from torch.distributed.fsdp import fully_shard

            for layer in self.net:
                fully_shard(layer, mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch, batch_idx):
            x = batch[0]
            for i, layer in enumerate(self.net):
                x = torch.tanh(layer(x)) if i < len(self.net) - 1 else layer(x)
            return torch.nn.functional.mse_loss(x, batch[1])

        def train_dataloader(self):
            g = torch.Generator().manual_seed(1)
            # 32 rows a step (16 per rank): full-rank gradients, whose orthogonalization is well
            # conditioned (a rank-deficient momentum's null directions are rounding noise, which
            # the iteration amplifies differently in every implementation)
            data = torch.utils.data.TensorDataset(
                torch.randn(128, 8, generator=g), torch.randn(128, 4, generator=g)
            )
            return torch.utils.data.DataLoader(data, batch_size=16)

        def configure_optimizers(self):
            if spec["optimizer"] == "torch":
                return torch.optim.Muon(self.parameters(), lr=0.02)
            kwargs = {
                k: getattr(torch, v) if k.endswith("dtype") else v
                for k, v in spec.get("kwargs", {}).items()
            }
            return mf.MuonOptimizer(self.parameters(), lr=0.02, **kwargs)

        def on_train_start(self):  # after the restore
            opt = self.optimizers().optimizer
            names = {p: n for n, p in self.named_parameters()}
            self.dump["momentum"] = {
                names[p]: full(s["momentum_buffer"])
                for p, s in opt.state.items()
                if "momentum_buffer" in s
            }
            self.dump["groups"] = [
                {k: v for k, v in g.items() if k != "params"} for g in opt.param_groups
            ]

        def on_train_end(self):
            self.dump["params"] = {n: full(p) for n, p in self.named_parameters()}

    callbacks = (
        [
            pl.callbacks.ModelCheckpoint(
                dirpath=spec["ckpt_dir"], every_n_train_steps=2, save_top_k=-1
            )
        ]
        if spec.get("ckpt_dir")
        else []
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(),
        max_steps=spec["steps"],
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=bool(callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = Matrices()
    trainer.fit(module, ckpt_path=spec.get("resume"))
    if trainer.global_rank == 0:
        torch.save(module.dump, spec["out"])
    print(f"trained {trainer.global_step} steps", flush=True)


@pytest.fixture(scope="module")
def torch_muon_runs(tmp_path_factory) -> Path:
    """``torch.pt``/``muon.pt``: torch.optim.Muon and MuonOptimizer, 2 steps each, a checkpoint at
    step 2 (``torch/``, ``muon/``), converted (``torch-as-muon/``, ``muon-as-torch/``); then, in new
    processes, 2 more steps of: MuonOptimizer from the converted torch checkpoint
    (``muon-from-torch.pt``), torch.optim.Muon from its own (``torch-from-torch.pt``) and from the
    converted MuonOptimizer one (``torch-from-muon.pt``)."""
    _require_extra("lightning", "lightning")
    from muon_fn.optim import from_torch_checkpoint, to_torch_checkpoint

    tmp = tmp_path_factory.mktemp("torch-muon")
    ckpt = "epoch=0-step=2.ckpt"
    first = [
        {"optimizer": opt, "steps": 2, "ckpt_dir": str(tmp / opt), "out": str(tmp / f"{opt}.pt")}
        for opt in ("torch", "muon")
    ]
    out = _start(tmp, "first", first)()
    assert from_torch_checkpoint(tmp / "torch" / ckpt, tmp / "torch-as-muon") == [
        "optimizer_0.param_groups.0"
    ]
    assert to_torch_checkpoint(tmp / "muon" / ckpt, tmp / "muon-as-torch") == [
        "optimizer_0.param_groups.0"
    ]
    second = [
        {
            "optimizer": "muon",
            "steps": 4,
            "resume": str(tmp / "torch-as-muon"),
            "out": str(tmp / "muon-from-torch.pt"),
        },
        {
            "optimizer": "torch",
            "steps": 4,
            "resume": str(tmp / "torch" / ckpt),
            "out": str(tmp / "torch-from-torch.pt"),
        },
        {
            "optimizer": "torch",
            "steps": 4,
            "resume": str(tmp / "muon-as-torch"),
            "out": str(tmp / "torch-from-muon.pt"),
        },
    ]
    out += _start(tmp, "second", second)()
    (tmp / "out.log").write_text(out)
    assert out.count("trained 2 steps") == 2 * len(first) and out.count(
        "trained 4 steps"
    ) == 2 * len(second), out
    return tmp


def _checkpoint(path: Path) -> dict:
    """A DCP checkpoint directory's whole state dict, read in this process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = path.parent / f"{path.name}.whole.pt"
    dcp_to_torch_save(str(path), str(whole))
    return torch.load(whole, weights_only=False)


# MuonOptimizer against torch.optim.Muon, each continuing 2 steps from the same torch.optim.Muon
# checkpoint, max |Δp|: torch.optim.Muon iterates in bf16, MuonOptimizer here in fp32, and a
# 5-step quintic (which does not converge) carries rounding into the update at the 1e-3 level on
# these 16 × 16 matrices: 2.5e-3 measured, as between MuonOptimizer's own fp32 and bf16 runs (3.1e-3).
TORCH_MUON_ATOL = 5e-3


@pytest.mark.distributed
def test_lightning_muon_optimizer_resumes_a_torch_muon_checkpoint(torch_muon_runs):
    """A ModelParallelStrategy checkpoint written by torch.optim.Muon, converted by
    from_torch_checkpoint, resumes with MuonOptimizer: the momentum buffers bit for bit, torch's
    hyperparameters and algorithm (EMA momentum, its quintic), one warning naming the keys kept at
    the optimizer's values; then it trains as torch.optim.Muon does from the same checkpoint."""
    runs = torch_muon_runs
    saved = _checkpoint(runs / "torch" / "epoch=0-step=2.ckpt")["optimizer_0"]
    resumed = torch.load(runs / "muon-from-torch.pt", weights_only=False)
    assert resumed["momentum"].keys() == saved["state"].keys()
    _assert_equal(
        resumed["momentum"],
        {k: v["momentum_buffer"] for k, v in saved["state"].items()},
        "momentum",
    )
    group, torch_group = resumed["groups"][0], saved["param_groups"][0]
    assert {k: group[k] for k in torch_group if k != "params"} == {
        k: v for k, v in torch_group.items() if k != "params"
    }
    assert (group["momentum_kind"], group["method"], group["beta2"]) == ("ema", None, None)
    log = (runs / "out.log").read_text()
    assert (
        "a torch.optim.Muon checkpoint does not save these keys; they keep this optimizer's values: group 0: "
        in log
    )
    assert "ns_dtype=None" in log and "Missing key" not in log
    ours, theirs = (
        torch.load(runs / f"{n}.pt", weights_only=False)["params"]
        for n in ("muon-from-torch", "torch-from-torch")
    )
    worst = max((ours[k] - theirs[k]).abs().max().item() for k in ours)
    assert worst <= TORCH_MUON_ATOL, worst
    start = _checkpoint(runs / "torch-as-muon")["state_dict"]
    assert all(not torch.equal(ours[k], start[k]) for k in ours)  # it trained


@pytest.mark.distributed
def test_lightning_torch_muon_resumes_a_muon_optimizer_checkpoint(torch_muon_runs):
    """The other way: a MuonOptimizer checkpoint converted by to_torch_checkpoint resumes with
    torch.optim.Muon (its own group values: ns_steps 5, Keller's triple), the momentum buffers bit
    for bit; the copy still holds muon_fn's keys; an unconvertible group is refused by name."""
    from muon_fn.optim import to_torch_checkpoint

    runs = torch_muon_runs
    saved = _checkpoint(runs / "muon" / "epoch=0-step=2.ckpt")["optimizer_0"]
    resumed = torch.load(runs / "torch-from-muon.pt", weights_only=False)
    _assert_equal(
        resumed["momentum"],
        {k: v["momentum_buffer"] for k, v in saved["state"].items()},
        "momentum",
    )
    assert resumed["groups"][0]["ns_steps"] == 5 and resumed["groups"][0]["ns_coefficients"] == (
        3.4445,
        -4.775,
        2.0315,
    )
    assert (
        saved["param_groups"][0]["ns_steps"] is None
    )  # muon_fn's own terms, rewritten in the copy
    copy = _checkpoint(runs / "muon-as-torch")["optimizer_0"]["param_groups"][0]
    assert copy["algorithm"] == "auto" and copy["ns_steps"] == 5
    with pytest.raises(ValueError, match="holds no muon_fn param group"):
        to_torch_checkpoint(runs / "torch" / "epoch=0-step=2.ckpt", runs / "refused")
    assert not (runs / "refused").exists()


if __name__ == "__main__":  # a job of _start: every rank calls the example's main per argument list
    example = load_example("lightning")
    for argv in json.loads(Path(sys.argv[1]).read_text()):
        t0 = time.perf_counter()
        if isinstance(argv, dict):
            _matrix_fit(argv)
            continue
        assert example.main(argv) == 0
        rank = os.environ.get("LOCAL_RANK", "0")
        print(f"[{rank}] {' '.join(argv)}: {time.perf_counter() - t0:.1f} s", flush=True)
