"""The ``muon-fn`` commands answer a user's mistakes as argparse does: exit status 2, the message
``muon-fn <command>: error: ...`` naming the option, the value and what is allowed, no traceback.

Every case fails before any training or benchmark starts (the data cases after reading a few
bytes), so the whole file runs in seconds. The commands run in-process through ``cli.main``.
"""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from muon_fn.tools import cli
from muon_fn.tools.train import data, train
from muon_fn.tools.train.model import GPT, PRESETS, config_for

TORCH = torch.__version__
_REAL_READ = Path.read_bytes


def run(argv: list[str]) -> tuple[int, str, str]:
    """``muon-fn *argv`` in-process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


def assert_usage_error(argv: list[str], message: str) -> None:
    code, _, err = run(argv)
    assert "Traceback" not in err
    assert code == 2, err
    assert err.splitlines()[-1] == message


def _training_name() -> str:
    """A file name that the corpus's path hash puts in the training split."""
    return next(n for n in (f"f{i}.txt" for i in range(100)) if not data._is_val(n))


@pytest.fixture
def paths(tmp_path, monkeypatch) -> dict[str, str]:
    """The files of the data cases, a torch without CUDA and without another accelerator, no torchrun."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / _training_name()).write_text("x = 1\n" * 10)
    (tmp_path / "tiny.txt").write_text("hello")
    (tmp_path / "short.txt").write_text("x" * 50)
    (tmp_path / "secret.txt").write_text("x" * 5000)
    (tmp_path / "ok.txt").write_text("def f(x):\n    return x + 1\n" * 300)

    def read_bytes(self: Path) -> bytes:  # the tests may run as root, where chmod 000 still reads
        if self.name == "secret.txt":
            raise PermissionError(13, "Permission denied", str(self))
        return _REAL_READ(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    _no_cuda(monkeypatch, build=False)
    monkeypatch.delenv("RANK", raising=False)
    return {"tmp": str(tmp_path), "out": str(tmp_path / "out")}


def _no_cuda(monkeypatch, build: bool, visible: int = 0) -> None:
    """This torch as a CPU build (``build=False``) or a CUDA build with ``visible`` GPUs."""
    monkeypatch.setattr(torch.version, "cuda", "12.8" if build else None)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: visible > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: None)


NO_CUDA = (
    f"argument --device: 'cuda': this torch build ({TORCH}) has no CUDA; use --device cpu, "
    "or install a CUDA build of torch"
)

TRAIN = [
    # numbers, checked by their argparse types
    (["--steps", "0"], "argument --steps: expected an integer >= 1, got 0"),
    (["--steps", "-5"], "argument --steps: expected an integer >= 1, got -5"),
    (["--steps", "ten"], "argument --steps: expected an integer >= 1, got 'ten'"),
    (["--epochs", "0"], "argument --epochs: expected a finite number > 0, got 0"),
    (["--batch-size", "0"], "argument --batch-size: expected an integer >= 1, got 0"),
    (["--seq-len", "0"], "argument --seq-len: expected an integer >= 1, got 0"),
    (["--lr", "0"], "argument --lr: expected a finite number > 0, got 0"),
    (["--lr", "nan"], "argument --lr: expected a finite number > 0, got nan"),
    (["--adamw-lr=-1e-3"], "argument --adamw-lr: expected a finite number > 0, got -1e-3"),
    (
        ["--weight-decay", "-0.1"],
        "argument --weight-decay: expected a finite number >= 0, got -0.1",
    ),
    (["--weight-decay", "inf"], "argument --weight-decay: expected a finite number >= 0, got inf"),
    (["--warmup", "-1"], "argument --warmup: expected an integer >= 0, got -1"),
    (["--min-lr-ratio", "1.5"], "argument --min-lr-ratio: expected a number from 0 to 1, got 1.5"),
    (["--eval-interval", "0"], "argument --eval-interval: expected an integer >= 1, got 0"),
    (["--eval-windows", "0"], "argument --eval-windows: expected an integer >= 1, got 0"),
    (["--seeds", "0"], "argument --seeds: expected an integer >= 1, got 0"),
    (["--seed", "-1"], "argument --seed: expected an integer from 0 to 4294967295, got -1"),
    (["--threads", "0"], "argument --threads: expected an integer >= 1, got 0"),
    (
        ["--checkpoint-interval", "-1"],
        "argument --checkpoint-interval: expected an integer >= 0, got -1",
    ),
    (["--stop-at", "0"], "argument --stop-at: expected an integer >= 1, got 0"),
    (["--max-bytes", "0"], "argument --max-bytes: expected an integer >= 1, got 0"),
    (["--qk-clip", "0"], "argument --qk-clip: expected a finite number > 0, got 0"),
    # numbers checked against each other
    (
        ["--seq-len", "300"],
        "argument --seq-len: expected an integer from 1 to 256 (the 'tiny' preset's block size), got 300",
    ),
    (
        ["--model", "moe-tiny", "--seq-len", "257"],
        "argument --seq-len: expected an integer from 1 to 256 (the 'moe-tiny' preset's block size), got 257",
    ),
    (
        ["--steps", "10", "--warmup", "10"],
        "argument --warmup: expected an integer from 0 to 9 (below --steps 10), got 10",
    ),
    (
        ["--warmup", "300"],
        "argument --warmup: expected an integer from 0 to 299 (below the default 300 steps), got 300",
    ),
    (
        ["--steps", "10", "--stop-at", "11"],
        "argument --stop-at: expected an integer from 1 to 10 (--steps 10), got 11",
    ),
    (["--steps", "3", "--epochs", "1"], "argument --epochs: not allowed with argument --steps"),
    (
        ["--optimizer", "muon", "--compare", "muon,adamw"],
        "argument --compare: not allowed with argument --optimizer",
    ),
    # the device
    (["--device", "cdua"], "argument --device: invalid device 'cdua' (valid: cpu, cuda, cuda:N)"),
    (["--device", "meta"], "argument --device: invalid device 'meta' (valid: cpu, cuda, cuda:N)"),
    (["--device", "cuda"], NO_CUDA),
    # optimizer specs
    (
        ["--compare", "muon,sgd"],
        "argument --compare: unknown optimizer 'sgd'; valid: muon, torch-muon, adamw, "
        "normuon, sso (optionally with [key=value,...] options)",
    ),
    (
        ["--compare", "muon,muon"],
        "argument --compare: give each optimizer spec once, got 'muon,muon'",
    ),
    (
        ["--optimizer", "adamw[frob=1]"],
        "argument --optimizer: adamw[frob=1]: AdamW.__init__() got an unexpected keyword argument 'frob'",
    ),
    (
        ["--compare", "muon,adamw[frob=1]"],  # refused before muon's run trains
        "argument --compare: adamw[frob=1]: AdamW.__init__() got an unexpected keyword argument 'frob'",
    ),
    (
        ["--optimizer", "muon[router=mlp]"],
        "argument --optimizer: muon[router=mlp]: invalid option router='mlp' (valid: muon, adamw)",
    ),
    (
        ["--fsdp", "--compare", "muon,adamw"],
        "argument --compare: --fsdp trains the muon_fn optimizers (muon, normuon, sso), not 'adamw'",
    ),
    (
        ["--fsdp"],
        "--fsdp needs torchrun, e.g. torchrun --nproc_per_node=2 examples/train_gpt.py --fsdp",
    ),
    # the data, found after parsing
    (
        ["--optimizer", "adamw", "--data", "/nonexistent"],
        "--data '/nonexistent': no such file or directory",
    ),
    (["--optimizer", "adamw", "--data", "{tmp}/empty"], "--data '{tmp}/empty': no files to read"),
    (
        ["--optimizer", "adamw", "--data", "{tmp}/one"],
        "--data '{tmp}/one': its only file is in the training split (a file's split is a hash of its path: about "
        "1 in 10 files is validation); a run needs both: add files, or pass one text file",
    ),
    (
        ["--optimizer", "adamw", "--data", "{tmp}/tiny.txt"],
        "--data '{tmp}/tiny.txt': 5 bytes, too few to split into training and validation",
    ),
    (
        ["--optimizer", "adamw", "--data", "{tmp}/ok.txt", "--max-bytes", "3"],
        "--data '{tmp}/ok.txt': 3 bytes (--max-bytes 3), too few to split into training and validation",
    ),
    (
        ["--optimizer", "adamw", "--data", "{tmp}/secret.txt"],
        "--data '{tmp}/secret.txt': cannot read the file (Permission denied)",
    ),
    (
        ["--optimizer", "adamw", "--data", "{tmp}/short.txt"],
        "the training split of {tmp}/short.txt has 45 bytes, fewer than --seq-len + 2 = 258: give more data "
        "(--data, --max-bytes) or a smaller --seq-len",
    ),
    (
        [
            "--optimizer",
            "adamw",
            "--data",
            "{tmp}/ok.txt",
            "--seq-len",
            "32",
            "--epochs",
            "0.01",
            "--warmup",
            "5",
        ],
        "argument --warmup: expected an integer from 0 to 0 (below the 1 step of --epochs 0.01), got 5",
    ),
]


def _id(case: tuple[list[str], str]) -> str:
    return " ".join(a for a in case[0] if a != "--optimizer" and a != "adamw").replace("{tmp}/", "")


@pytest.mark.parametrize("argv, message", TRAIN, ids=[_id(c) for c in TRAIN])
def test_train_usage_error(argv, message, paths):
    argv = [a.format(**paths) for a in argv]
    assert_usage_error(
        ["train", *argv, "--out", paths["out"]], "muon-fn train: error: " + message.format(**paths)
    )


def test_train_model_choices_name_every_preset():
    code, _, err = run(["train", "--model", "tiny2"])
    assert code == 2 and "Traceback" not in err
    line = err.splitlines()[
        -1
    ]  # argparse quotes the choices on some Python versions, not on others
    assert line.startswith(
        "muon-fn train: error: argument --model: invalid choice: 'tiny2' (choose from "
    )
    assert [c.strip("'") for c in line.split("choose from ")[1].rstrip(")").split(", ")] == list(
        PRESETS
    )


def test_train_resume_from_another_models_checkpoint(paths):
    """A checkpoint of another model in the same --out (here another block size) is refused by name."""
    ckpt = Path(paths["out"]) / "adamw" / "checkpoint"
    ckpt.mkdir(parents=True)
    torch.save({"model": GPT(config_for("tiny", block_size=128)).state_dict()}, ckpt / "state.pt")
    argv = [
        "train",
        "--optimizer",
        "adamw",
        "--data",
        f"{paths['tmp']}/ok.txt",
        "--seq-len",
        "32",
        "--resume",
        "--out",
        paths["out"],
    ]
    assert_usage_error(
        argv,
        (
            f"muon-fn train: error: --resume: {ckpt / 'state.pt'} holds another model than this run's (another "
            "--model in the same --out?): size mismatch for pos_emb.weight: copying a param with shape "
            "torch.Size([128, 128]) from checkpoint, the shape in current model is torch.Size([256, 128])."
        ),
    )


@pytest.mark.parametrize(
    "build, visible, device, message",
    [
        (
            True,
            0,
            "cuda",
            "'cuda': no CUDA GPU is visible (check the driver and CUDA_VISIBLE_DEVICES); use --device cpu",
        ),
        (True, 1, "cuda:1", "'cuda:1': no such CUDA device (visible: cuda:0)"),
        (True, 2, "cuda:2", "'cuda:2': no such CUDA device (visible: cuda:0 to cuda:1)"),
        (
            False,
            0,
            "cuda:0",
            f"'cuda:0': this torch build ({TORCH}) has no CUDA; use --device cpu, or install a "
            "CUDA build of torch",
        ),
    ],
)
def test_cuda_device_errors(build, visible, device, message, monkeypatch):
    _no_cuda(monkeypatch, build, visible)
    for command in ("train", "bench"):
        assert_usage_error(
            [command, "--device", device], f"muon-fn {command}: error: argument --device: {message}"
        )


BENCH = [
    (["--steps", "0"], "muon-fn bench: error: argument --steps: expected an integer >= 1, got 0"),
    (["--rounds", "0"], "muon-fn bench: error: argument --rounds: expected an integer >= 1, got 0"),
    (
        ["--lr", "-0.02"],
        "muon-fn bench: error: argument --lr: expected a finite number > 0, got -0.02",
    ),
    (
        ["--device", "cdua"],
        "muon-fn bench: error: argument --device: invalid device 'cdua' (valid: cpu, cuda, cuda:N)",
    ),
    (["--device", "cuda"], f"muon-fn bench: error: {NO_CUDA}"),
    (
        ["--threads", "0"],
        "muon-fn bench: error: argument --threads: Invalid threads: 0 (expected an integer >= 1 or 'default')",
    ),
    (["--layers", "9"], "muon-fn bench: error: Invalid layers: 9 (expected 1..4 for tiny)"),
    (
        ["--memory", "--compile-time"],
        "muon-fn bench: error: --memory, --compile-time and --elementwise each choose what to measure: give one",
    ),
    (
        ["--memory", "--model-size", "tiny", "--layers", "5"],
        "muon-fn bench: error: Invalid layers: 5 (expected 1..4 for tiny)",
    ),
    (
        ["--rows", "hybrid"],
        "muon-fn bench: error: Invalid row: 'hybrid' (it runs on the set's GPT model, not on its "
        "matrices: the memory table only, muon-fn bench --memory)",
    ),
    (
        ["--json", "/nonexistent/b.json"],
        "muon-fn bench: error: argument --json: '/nonexistent/b.json': no such directory '/nonexistent'",
    ),
    (
        ["sso", "--layers", "0"],
        "muon-fn bench sso: error: Invalid layers: 0 (expected 1..12 for gpt2-small)",
    ),
    (
        ["sso", "--warmup", "-1"],
        "muon-fn bench sso: error: Invalid warmup: -1 (expected an integer >= 0)",
    ),
    (
        ["fsdp", "--world-sizes", "2", "1"],
        "muon-fn bench fsdp: error: argument --world-sizes: expected an integer >= 2, got 1",
    ),
    (
        ["fsdp", "--tokens", "0"],
        "muon-fn bench fsdp: error: argument --tokens: expected an integer >= 1, got 0",
    ),
    (
        ["fsdp", "--dim", "x"],
        "muon-fn bench fsdp: error: argument --dim: expected an integer >= 1, got 'x'",
    ),
]

PLAN = [
    (["--bucket-size", "0"], "argument --bucket-size: expected an integer >= 1, got 0"),
    (["--num-buckets", "-1"], "argument --num-buckets: expected an integer >= 1, got -1"),
    (["--ns-steps", "0"], "argument --ns-steps: expected an integer >= 1, got 0"),
    (["--gemm-tflops", "inf"], "argument --gemm-tflops: expected a finite number > 0, got inf"),
    (["--link-gbps", "0"], "argument --link-gbps: expected a finite number > 0, got 0"),
    (["--mesh", "dp=0"], "Invalid mesh: 'dp=0' (dp=0, expected >= 1)"),
]


@pytest.mark.parametrize("argv, message", BENCH, ids=[" ".join(c[0]) for c in BENCH])
def test_bench_usage_error(argv, message, paths):
    assert_usage_error(["bench", *argv], message)


@pytest.mark.parametrize("argv, message", PLAN, ids=[" ".join(c[0]) for c in PLAN])
def test_plan_usage_error(argv, message):
    assert_usage_error(["plan", "--model", "tiny", *argv], f"muon-fn plan: error: {message}")


def test_unknown_command_prints_usage():
    code, out, err = run(["frobnicate"])
    assert (code, out) == (2, "")
    assert err.startswith(
        "muon-fn: unknown command 'frobnicate'\n\nusage: muon-fn <command> [options]"
    )


@pytest.mark.slow
def test_python_dash_m_muon_fn_runs_the_command():
    """``python -m muon_fn`` is ``muon-fn`` (as users try it); a bad command exits with status 2."""
    ok = subprocess.run(
        [sys.executable, "-m", "muon_fn", "--help"], capture_output=True, text=True, timeout=120
    )
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("usage: muon-fn <command> [options]")
    assert all(f"\n  {command} " in ok.stdout for command in ("train", "bench", "plan"))
    bad = subprocess.run(
        [sys.executable, "-m", "muon_fn", "frobnicate"], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2 and "muon-fn: unknown command 'frobnicate'" in bad.stderr


def _option_help(text: str) -> dict[str, str]:
    """``{"--steps": "--steps N  optimizer steps (default 300)", ...}`` from ``--help``'s options."""
    blocks: dict[str, str] = {}
    flag = None
    for line in text.split("options:", 1)[1].splitlines():
        m = re.match(r"  (-\S+)", line)
        if m:
            flag = m.group(1).rstrip(",")
            blocks[flag] = line.strip()
        elif flag is not None:
            blocks[flag] += " " + line.strip()
    return blocks


def test_train_help_states_each_default_once(monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    code, out, _ = run(["train", "--help"])
    assert code == 0
    assert "(default: None)" not in out and "(default: False)" not in out
    blocks = _option_help(out)
    assert blocks["--steps"].count("300") == 1 and out.count("(default 300)") == 1
    for flag, text in blocks.items():
        if flag != "--optimizer":  # its help also names the AdamW betas' defaults
            assert text.count("default") <= 1, text
    assert all(
        preset in blocks["--model"].split("}", 1)[1]
        for preset in ("tiny", "small", "gpt2", "moe-tiny")
    )
    assert (
        "(default: muon 0.02, torch-muon 0.02, normuon 0.02, sso 0.02, adamw 0.003)"
        in blocks["--lr"]
    )
    assert (
        blocks["--seed"]
        == "--seed N              seed of the initial weights and of the batch order (default 0)"
    )


class _Bar:
    """A tqdm stand-in that records its postfixes."""

    def __init__(self) -> None:
        self.postfixes: list[str] = []

    def set_postfix_str(self, text: str) -> None:
        self.postfixes.append(text)

    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


class _Optimizer:
    """Records the progress bar's postfix when its step runs."""

    def __init__(self, bar: _Bar) -> None:
        self.bar, self.seen = bar, []

    def step(self) -> None:
        self.seen.append(self.bar.postfixes[-1] if self.bar.postfixes else None)

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


class _Scheduler:
    def step(self) -> None:
        pass


def _loop(compiles: bool, monkeypatch, *extra: str) -> tuple[_Bar, _Optimizer]:
    parser = train.build_parser("muon-fn train")
    args = train.resolve(
        parser.parse_args(
            [
                "--seq-len",
                "16",
                "--batch-size",
                "2",
                "--eval-windows",
                "2",
                "--no-checkpoint",
                *extra,
            ]
        ),
        parser,
    )
    gen = torch.Generator().manual_seed(0)
    corpus = data.Corpus(
        "random",
        torch.randint(0, 256, (2000,), dtype=torch.uint8, generator=gen),
        torch.randint(0, 256, (500,), dtype=torch.uint8, generator=gen),
        1,
    )
    bar = _Bar()
    monkeypatch.setattr(train, "_progress", lambda args, *a: None if args.no_progress else bar)
    opt, history = (
        _Optimizer(bar),
        {"train": [], "val": [], "tokens_per_s": [], "max_logit": [], "step_time": []},
    )
    model = GPT(config_for("tiny", n_layer=1))
    batcher = data.Batcher(corpus.train, 2, 16, seed=0)
    ctx = train.Dist(False, torch.device("cpu"))
    train._train_loop(
        "muon",
        model,
        opt,
        _Scheduler(),
        batcher,
        history,
        range(2),
        2,
        args,
        corpus,
        ctx,
        None,
        compiles=compiles,
    )
    return bar, opt


def test_progress_bar_says_compiling_during_the_first_step(monkeypatch):
    bar, opt = _loop(True, monkeypatch)
    assert opt.seen[0] == train.COMPILING and opt.seen[1] != train.COMPILING
    assert bar.postfixes[-1].startswith("loss=")  # cleared after the step
    bar, opt = _loop(False, monkeypatch)
    assert train.COMPILING not in bar.postfixes


def test_no_progress_prints_nothing_for_the_compile(monkeypatch, capsys):
    bar, opt = _loop(True, monkeypatch, "--no-progress")
    assert bar.postfixes == [] and capsys.readouterr() == ("", "")


def test_which_runs_compile(monkeypatch):
    monkeypatch.setenv("MUON_FN_COMPILE", "1")
    parser = train.build_parser()
    args = train.resolve(parser.parse_args([]), parser)
    rows = ("muon", "sso", "adamw", "torch-muon")
    assert [train._compiles(name, args) for name in rows] == [True, True, False, False]
    args.no_compile = True
    assert not train._compiles("muon", args)
    monkeypatch.setenv("MUON_FN_COMPILE", "0")
    args.no_compile = False
    assert not train._compiles("muon", args)
