"""The examples and `muon-fn train`, each in a short mode.

Examples are imported from their files and their ``main(argv)`` called in-process (one torch
import); the FSDP run goes through torchrun as users run it. Optional extras (``hf``,
``lightning``) are skipped with a visible reason when they are not installed; .ci/run installs
them and sets ``MUON_FN_REQUIRE_EXTRAS=1``, so there a missing extra fails instead.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from muon_fn.tools import cli

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

# Small enough for seconds per run on 2 CPU cores.
SMALL = [
    "--steps",
    "4",
    "--eval-interval",
    "2",
    "--eval-windows",
    "8",
    "--batch-size",
    "4",
    "--seq-len",
    "32",
    "--max-bytes",
    "400000",
    "--no-progress",
    "--threads",
    "1",
]


def load_example(name: str):
    path = EXAMPLES / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _metrics(out: Path) -> dict:
    return json.loads((out / "metrics.json").read_text())


def _run(metrics: dict, label: str, seed: int = 0) -> dict:
    return next(r for r in metrics["runs"] if r["label"] == label and r["seed"] == seed)


@pytest.mark.slow
def test_train_compare_writes_table_metrics_and_plot(tmp_path, capsys):
    out = tmp_path / "run"
    assert (
        cli.main(["train", "--compare", "muon,adamw", *SMALL, "--out", str(out), "--no-checkpoint"])
        == 0
    )
    printed = capsys.readouterr().out
    assert "val loss mean" in printed and "lowest mean validation loss at equal steps" in printed
    m = _metrics(out)
    assert [r["label"] for r in m["runs"]] == ["muon", "adamw"]
    for run in m["runs"]:
        assert run["steps"] == 4
        assert [s for s, _ in run["history"]["train"]] == [1, 2, 3, 4]
        assert [s for s, _ in run["history"]["val"]] == [0, 2, 4]
        assert all(torch.isfinite(torch.tensor(v)) for _, v in run["history"]["train"])
        # from ln(256) = 5.55 at init, training must move the validation loss down
        assert run["history"]["val"][-1][1] < run["history"]["val"][0][1] - 0.3, run["label"]
    assert "create_hybrid_optimizer" in _run(m, "muon")["description"]
    png = out / "loss.png"
    if importlib.util.find_spec("matplotlib") is None:  # not installed: no plot, a hint instead
        assert not png.exists()
        return
    assert png.stat().st_size > 10_000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_train_moe_tiny(tmp_path, capsys):
    """--model moe-tiny: Muon with each expert as its own matrix, the per-stack reading
    (matrix_view=flatten, routers in AdamW) and AdamW train."""
    out = tmp_path / "moe"
    specs = "muon,muon[matrix_view=flatten,router=adamw],adamw"
    assert (
        cli.main(
            [
                "train",
                "--model",
                "moe-tiny",
                "--compare",
                specs,
                *SMALL,
                "--steps",
                "3",
                "--out",
                str(out),
                "--no-checkpoint",
                "--no-plot",
                "--verbose",
                "--no-compile",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "expert stack: 4 matrices 512x128" in printed and "flattened to 4x65536" in printed
    assert "blocks.0.mlp.router.weight               (4, 128)             hidden matrix" in printed
    assert (
        "blocks.0.mlp.router.weight               (4, 128)             adamw_predicate" in printed
    )
    m = _metrics(out)
    assert m["model"]["n_experts"] == 4 and m["model"]["moe_top_k"] == 1
    for run in m["runs"]:
        assert run["history"]["val"][-1][1] < run["history"]["val"][0][1] - 0.3, run["label"]


@pytest.mark.slow
def test_train_rows_at_identical_settings_step_alike(tmp_path, capsys):
    """torch-muon and muon with the same spec options (Muon weight decay, AdamW β₂ and weight
    decay, the no-decay rule, fp32 iteration) are the same optimizer: after 4 steps their
    validation losses agree to fp32 rounding; decaying 0-/1-D parameters (adamw_decay_1d=true)
    is a different one. The descriptions state the settings."""
    same = "lr=0.04,ns_dtype=fp32,weight_decay=0.01,adamw_weight_decay=0.1,adamw_beta2=0.95"
    specs = (
        f"torch-muon[{same}],muon[{same},beta2=none],muon[{same},beta2=none,adamw_decay_1d=true]"
    )
    out = tmp_path / "run"
    assert (
        cli.main(
            [
                "train",
                "--compare",
                specs,
                *SMALL,
                "--out",
                str(out),
                "--no-checkpoint",
                "--no-plot",
                "--no-compile",
            ]
        )
        == 0
    )
    capsys.readouterr()
    runs = _metrics(out)["runs"]
    torch_row, ours, decay_1d = (r["history"]["val"][-1][1] for r in runs)
    assert "iteration in float32" in runs[0]["description"]
    assert "weight_decay=0.01, adamw_weight_decay=0.1 on ndim >= 2" in runs[0]["description"]
    assert "weight_decay=0.01, adamw_weight_decay=0.1 on ndim >= 2" in runs[1]["description"]
    assert "on every parameter" in runs[2]["description"]
    assert abs(torch_row - ours) < 1e-4, (torch_row, ours)
    assert abs(decay_1d - ours) > 1e-4, (decay_1d, ours)


@pytest.mark.slow
def test_train_compare_torch_muon_over_seeds(tmp_path, capsys):
    """The quality comparison: torch.optim.Muon (+ AdamW, muon's split) as a row, several seeds,
    mean and spread per optimizer, steps to AdamW's final loss; runs of one seed share the
    initial weights and batches, and seeds differ."""
    out = tmp_path / "run"
    specs = "torch-muon,muon[method=quintic,ns_steps=5,lr=0.03],adamw"
    assert (
        cli.main(
            [
                "train",
                "--compare",
                specs,
                "--seeds",
                "2",
                *SMALL,
                "--out",
                str(out),
                "--no-checkpoint",
                "--no-plot",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    m = _metrics(out)
    assert [(r["label"], r["seed"]) for r in m["runs"]] == [
        (label, seed)
        for seed in (0, 1)
        for label in ("torch-muon", "muon[method=quintic,ns_steps=5,lr=0.03]", "adamw")
    ]
    assert "torch.optim.Muon" in _run(m, "torch-muon")["description"]
    assert "method=quintic" in _run(m, "muon[method=quintic,ns_steps=5,lr=0.03]", 1)["description"]
    for label, s in m["summary"].items():
        runs = [r["final_val_loss"] for r in m["runs"] if r["label"] == label]
        assert (
            s["mean"] == pytest.approx(sum(runs) / 2)
            and s["min"] == min(runs)
            and s["max"] == max(runs)
        )
        assert label in printed
    # same init: every run of one seed starts from the same validation loss; seeds differ
    starts = {
        seed: {r["history"]["val"][0][1] for r in m["runs"] if r["seed"] == seed} for seed in (0, 1)
    }
    assert len(starts[0]) == len(starts[1]) == 1 and starts[0] != starts[1]
    assert _run(m, "adamw")["steps_to_adamw_final"] == 4.0
    assert m["summary"]["torch-muon"]["steps_to_adamw_final"] <= 4.0


def test_steps_to_reach_interpolates():
    from muon_fn.tools.train.report import steps_to_reach

    val = [[0, 5.5], [10, 4.0], [20, 3.0], [30, 2.5]]
    assert steps_to_reach(val, 3.5) == pytest.approx(15.0)
    assert steps_to_reach(val, 3.0) == pytest.approx(20.0)
    assert steps_to_reach(val, 2.0) is None
    assert steps_to_reach(val, 6.0) == 0.0


def test_optimizer_specs():
    from muon_fn.tools.train.optimizers import parse_spec, split_specs

    assert split_specs("torch-muon, muon[method=quintic,ns_steps=5],adamw") == [
        "torch-muon",
        "muon[method=quintic,ns_steps=5]",
        "adamw",
    ]
    assert parse_spec("muon[ns_dtype=bf16,nesterov=false,lr=0.04,method=you]") == (
        "muon",
        {"ns_dtype": torch.bfloat16, "nesterov": False, "lr": 0.04, "method": "you"},
    )
    with pytest.raises(ValueError, match="unknown optimizer 'sgd'"):
        parse_spec("sgd")
    with pytest.raises(ValueError, match="expected key=value"):
        parse_spec("muon[quintic]")


def test_optimizer_specs_set_the_adamw_beta2():
    from muon_fn.tools.train.optimizers import build_single

    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4), nn.Linear(4, 8))
    betas = lambda opt: {g["adamw_betas"] for g in opt.param_groups}  # noqa: E731
    muon, _ = build_single("muon", {"adamw_beta2": 0.999}, model, 0.02, 3e-3, 0.0, compile=False)
    assert betas(muon) == {(0.9, 0.999)}
    muon, _ = build_single("muon", {"adamw_beta2": 0.99}, model, 0.02, 3e-3, 0.0, compile=False)
    assert betas(muon) == {(0.9, 0.99)}
    muon, _ = build_single("muon", {}, model, 0.02, 3e-3, 0.0, compile=False)
    assert betas(muon) == {(0.9, 0.95)}  # the hybrid's default
    adamw, _ = build_single("adamw", {}, model, 3e-3, 3e-3, 0.0, compile=False)
    assert {g["betas"] for g in adamw.param_groups} == {(0.9, 0.95)}
    adamw, _ = build_single("adamw", {"beta2": 0.999}, model, 3e-3, 3e-3, 0.0, compile=False)
    assert {g["betas"] for g in adamw.param_groups} == {(0.9, 0.999)}
    torch_muon, _ = build_single(
        "torch-muon", {"adamw_beta2": 0.99}, model, 0.02, 3e-3, 0.0, compile=False
    )
    assert torch_muon.optimizers[1].param_groups[0]["betas"] == (0.9, 0.99)


@pytest.mark.slow
def test_train_resume_continues_exactly(tmp_path):
    """Stopping at step 2 and resuming gives the uninterrupted run's losses bit for bit."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    common = ["--optimizer", "muon", *SMALL, "--no-plot"]
    assert cli.main(["train", *common, "--out", str(straight), "--no-checkpoint"]) == 0
    assert cli.main(["train", *common, "--out", str(split), "--stop-at", "2"]) == 0
    assert _run(_metrics(split), "muon")["steps"] == 2
    assert (split / "muon" / "checkpoint" / "state.pt").exists()
    assert cli.main(["train", *common, "--out", str(split), "--resume"]) == 0
    a, b = _run(_metrics(straight), "muon"), _run(_metrics(split), "muon")
    assert b["history"]["train"] == a["history"]["train"]
    assert b["final_val_loss"] == a["final_val_loss"]


def test_train_rejects_bad_options(tmp_path, capsys):
    """Usage errors: status 2 and a `muon-fn train: error:` line (tests/test_cli_errors.py has them all)."""
    for argv, message in (
        (["--compare", "muon,sgd"], "unknown optimizer"),
        (["--steps", "3", "--epochs", "1"], "argument --epochs: not allowed with argument --steps"),
        (["--fsdp", "--steps", "1"], "needs torchrun"),
        (["--seeds", "0"], "argument --seeds: expected an integer >= 1, got 0"),
        (
            ["--optimizer", "muon[frob=1]", *SMALL],
            r"muon\[frob=1\]: .*unexpected keyword argument 'frob'",
        ),
    ):
        with pytest.raises(SystemExit) as exc:
            cli.main(["train", *argv, "--out", str(tmp_path)])
        assert exc.value.code == 2
        assert re.search(f"muon-fn train: error: .*{message}", capsys.readouterr().err)


@pytest.mark.slow
def test_train_data_path_text_file(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 2000)
    out = tmp_path / "run"
    assert (
        cli.main(
            [
                "train",
                "--optimizer",
                "adamw",
                *SMALL,
                "--data",
                str(text),
                "--out",
                str(out),
                "--no-plot",
                "--no-checkpoint",
            ]
        )
        == 0
    )
    assert str(text) in _metrics(out)["corpus"]


def test_stdlib_split_is_deterministic_and_disjoint():
    from muon_fn.tools.train import data

    root, files = data.stdlib_files()
    assert files == sorted(files, key=lambda f: f.relative_to(root).as_posix())
    assert not any("site-packages" in f.parts for f in files)
    val = [f for f in files if data._is_val(f.relative_to(root).as_posix())]
    assert 0.05 < len(val) / len(files) < 0.15
    a = data.load_corpus(max_bytes=200_000)
    b = data.load_corpus(max_bytes=200_000)
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)


def test_cli_usage_and_unknown_command(capsys):
    assert cli.main([]) == 2
    assert "muon-fn train --quick" in capsys.readouterr().out
    assert cli.main(["--help"]) == 0
    assert cli.main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


def test_cli_bench_delegates(monkeypatch):
    from muon_fn.tools import bench

    seen = []
    monkeypatch.setattr(bench, "main", lambda argv: seen.append(argv) or 0)
    assert cli.main(["bench", "--quick"]) == 0
    assert cli.main(["bench", "fsdp", "--world-sizes", "2"]) == 0
    assert cli.main(["bench-sso", "--layers", "1"]) == 0  # the alias of `muon-fn bench sso`
    assert seen == [["--quick"], ["fsdp", "--world-sizes", "2"], ["sso", "--layers", "1"]]


def test_cli_bench_sso_reports_bad_arguments(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench-sso", "--layers", "0"])
    assert exc.value.code == 2
    assert (
        "muon-fn bench sso: error: Invalid layers: 0 (expected 1..12 for gpt2-small)"
        in capsys.readouterr().err
    )


def test_example_mixed_adamw(capsys):
    assert load_example("mixed_adamw").main(["--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "embedding, tied to the output head" in out and "hidden matrix" in out
    assert "checkpoint round trip OK" in out


@pytest.mark.slow
def test_example_functional_loop(capsys):
    assert load_example("functional_loop").main(["--steps", "2", "--backend", "eager"]) == 0
    out = capsys.readouterr().out
    assert "step   2" in out and "compiled graphs" in out


@pytest.mark.slow
def test_example_train_sso(capsys):
    assert load_example("train_sso").main(["--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "solver iterations" in out and "σ(W) vs target radius" in out


@pytest.mark.slow
def test_example_bench_sso(tmp_path, capsys):
    """The SSO benchmark called from Python: ratios, the solver, the σ estimate (not timed)."""
    out = tmp_path / "sso.json"
    assert (
        load_example("bench_sso").main(
            [
                "--layers",
                "1",
                "--rounds",
                "1",
                "--warmup",
                "0",
                "--rows",
                "muon,sso",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    res = json.loads(out.read_text())
    assert res["matrices"] == 6 and len(res["ratios"]["sso/muon"]["per_round"]) == 1
    solver = res["solver"]["sso"]
    assert sum(solver["msigns_per_matrix_histogram"].values()) == 6 and solver["fallbacks"] == 0
    assert solver["residual_max"] <= 2e-4 and solver["sigma_rel_error_max"] <= 1e-5
    assert "sso/muon" in capsys.readouterr().out


def _require_extra(extra: str, *modules: str) -> None:
    """Skip with the install hint when ``extra`` is missing; fail instead under .ci/run
    (``MUON_FN_REQUIRE_EXTRAS=1``), which installs it."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        reason = f"optional extra {extra!r} not installed ({', '.join(missing)}): pip install 'muon-fn[{extra}]'"
        if os.environ.get("MUON_FN_REQUIRE_EXTRAS") == "1":
            pytest.fail(reason)
        pytest.skip(reason)


@pytest.mark.slow
def test_example_hf_transformers_resumes_bit_for_bit(tmp_path, capsys):
    """The Trainer builds the hybrid through HybridFactory (embeddings and the tied head to
    AdamW); 4 steps saving at 2, then a resume from step 2: the same parameters, bit for bit (a
    float64 sum printed with every digit)."""
    _require_extra("hf", "transformers", "accelerate")  # Trainer needs accelerate
    example, out = load_example("hf_transformers"), tmp_path / "ck"
    assert example.main(["--steps", "4", "--out", str(out), "--save-steps", "2"]) == 0
    straight = capsys.readouterr().out
    assert "final training loss" in straight
    wte = next(line for line in straight.splitlines() if "transformer.wte.weight" in line)
    assert "embedding" in wte, wte  # in the AdamW half
    shutil.rmtree(out / "checkpoint-4")
    assert example.main(["--steps", "4", "--out", str(out), "--resume"]) == 0
    resumed = capsys.readouterr().out
    fingerprint = [line for line in straight.splitlines() if line.startswith("parameters: sum")]
    assert fingerprint and fingerprint == [
        line for line in resumed.splitlines() if line.startswith("parameters: sum")
    ]


@pytest.mark.slow
def test_example_lightning(capsys):
    """One process, both optimizers (DDP and FSDP2: tests/test_lightning.py)."""
    _require_extra("lightning", "lightning")
    example = load_example("lightning")
    assert example.main(["--steps", "2"]) == 0
    assert example.main(["--steps", "2", "--optimizer", "muon", "--batch-size", "2"]) == 0
    assert capsys.readouterr().out.count("trained 2 steps") == 2


@pytest.mark.distributed
def test_train_gpt_fsdp_torchrun(tmp_path):
    """The documented FSDP command, shortened: torchrun --nproc_per_node=2 examples/train_gpt.py --fsdp."""
    out = tmp_path / "fsdp"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(EXAMPLES / "train_gpt.py"),
        "--fsdp",
        *SMALL,
        "--steps",
        "2",
        "--out",
        str(out),
        "--no-plot",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = _run(_metrics(out), "muon")
    assert "FSDPMuonOptimizer" in run["description"] and "world=2" in run["description"]
    assert (out / "muon" / "checkpoint" / "dcp" / ".metadata").exists()


@pytest.mark.slow
def test_train_reports_the_optimizers_share_of_a_step(tmp_path, capsys):
    """``optimizer.step`` time over the whole step (device-synchronized; on the CPU as on CUDA),
    per step in the history, as medians in the run record, the log and the table."""
    out = tmp_path / "run"
    assert (
        cli.main(
            [
                "train",
                "--model",
                "tiny",
                "--device",
                "cpu",
                "--optimizer",
                "muon",
                *SMALL,
                "--out",
                str(out),
                "--no-checkpoint",
                "--no-plot",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    run = _run(_metrics(out), "muon")
    times = run["history"]["step_time"]
    assert [s for s, _, _ in times] == [1, 2, 3, 4] and all(0 < o < t for _, o, t in times)
    assert 0 < run["optimizer_share"] < 1 and 0 < run["optimizer_step_s"] < run["step_s"]
    assert "[muon] optimizer.step: " in printed and "ms training step (" in printed
    assert (
        "optimizer.step share" in printed and f"{100 * run['optimizer_share']:.1f} % of" in printed
    )


def test_optimizer_share_uses_medians():
    from muon_fn.tools.train.report import optimizer_share

    share = optimizer_share(
        [[1, 9.0, 10.0], [2, 0.1, 0.4], [3, 0.2, 0.5], [4, 0.1, 0.5]]
    )  # step 1 compiles
    assert share == pytest.approx(
        {"optimizer_step_s": 0.15, "step_s": 0.5, "optimizer_share": 0.3, "steps": 4}
    )
    assert optimizer_share([]) is None
