"""Telemetry where users read it: the Lightning and Hugging Face callbacks
(:mod:`muon_fn.integrations`) log ``optimizer.metrics()`` in a tiny training run, and ``muon-fn
train --metrics`` writes the series to metrics.json and plots it.

The framework tests skip without their extra, as tests/test_examples.py's do (and fail instead
under ``MUON_FN_REQUIRE_EXTRAS=1``, .ci/run).
"""

from __future__ import annotations

import csv
import importlib.util
import json
import subprocess
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch
from test_examples import _require_extra
from torch import nn

import muon_fn as mf
from muon_fn.integrations import _common
from muon_fn.tools import cli

GROUP_TOTALS = (
    "muon/grad_norm",
    "muon/update_norm",
    "muon/weight_norm",
    "muon/ortho_residual_max",
    "adamw/update_norm",
)


class Net(nn.Module):
    """Four matrices (Muon: the hybrid has no embedding or tied head to route to AdamW here)
    and their biases (AdamW)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.h1, self.h2, self.out = (
            nn.Linear(8, 16),
            nn.Linear(16, 16),
            nn.Linear(16, 16),
            nn.Linear(16, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.h2(torch.relu(self.h1(self.inp(x))))))


def _data(n: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)


def _check_figures(figures: dict, prefix: str = "optim/") -> None:
    for name in GROUP_TOTALS:
        value = figures[prefix + name]
        assert value == value and float(value) > 0, (name, value)


def _norm(tensors) -> float:
    """The L2 norm of ``tensors`` together, in float64."""
    return sum(t.detach().double().square().sum().item() for t in tensors) ** 0.5


def _muon_names(optimizer) -> set[str]:
    """The parameters of the hybrid's ``"muon"`` group."""
    return {n for g in optimizer.param_groups if g["algorithm"] == "muon" for n in g["param_names"]}


def _initial_muon_weight_norm(optimizer, prefix: str = "") -> float:
    """``muon/weight_norm`` of the first step: the Muon matrices of a fresh :class:`Net` (named
    ``prefix + name`` in the optimizer)."""
    return _norm(p for n, p in Net().named_parameters() if prefix + n in _muon_names(optimizer))


def _check_against_optimizer(logged: dict, optimizer, prefix: str = "optim/") -> None:
    """What a callback logged for the last measured step is what ``optimizer.metrics()`` gives."""
    figures = optimizer.metrics()
    names = [k[len(prefix) :] for k in logged if k.startswith(prefix)]
    assert names and set(names) <= set(figures)
    for name in names:
        assert float(logged[prefix + name]) == pytest.approx(figures[name], rel=1e-6), name


def test_lightning_callback_logs_every_measured_step(tmp_path):
    _require_extra("lightning", "lightning")
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    from muon_fn.integrations.lightning import MuonMetricsCallback

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = (self.net(x) - y).pow(2).mean()
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return mf.create_hybrid_optimizer(self.net, compile=False, metrics=2)

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_data()), batch_size=4)
    trainer = pl.Trainer(
        max_steps=3,
        logger=CSVLogger(tmp_path),
        callbacks=[MuonMetricsCallback()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        log_every_n_steps=1,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's own (few workers, deprecations)
        trainer.fit(Lit(), loader)
    with open(f"{trainer.logger.log_dir}/metrics.csv") as f:
        rows = list(csv.DictReader(f))
    measured = [r for r in rows if r.get("optim/step")]
    assert [float(r["optim/step"]) for r in measured] == [1.0, 3.0]  # metrics=2: steps 1 and 3
    for r in measured:
        _check_figures(r)
    optimizer = trainer.optimizers[0]
    assert float(measured[0]["optim/muon/weight_norm"]) == pytest.approx(
        _initial_muon_weight_norm(optimizer), rel=1e-6
    )
    _check_against_optimizer({k: v for k, v in measured[1].items() if v}, optimizer)
    # logged at the step of that batch's self.log values (Lightning counts from 0)
    losses = {r["step"] for r in rows if r.get("train_loss")}
    assert [r["step"] for r in measured] == ["0", "2"] and {"0", "2"} <= losses
    no_logger = SimpleNamespace(loggers=[], optimizers=[], is_global_zero=True)
    with pytest.raises(ValueError, match="needs a logger"):
        MuonMetricsCallback().on_train_start(no_logger, None)


def test_hf_callback_adds_figures_to_the_logs(tmp_path):
    _require_extra("hf", "transformers", "accelerate")
    from transformers import Trainer, TrainingArguments

    from muon_fn.integrations.hf import MuonMetricsCallback

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()

        def forward(self, x, labels):
            return {"loss": (self.net(x) - labels).pow(2).mean()}

    class Data(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.x, self.y = _data()

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int) -> dict:
            return {"x": self.x[i], "labels": self.y[i]}

    model = Model()
    optimizer = mf.create_hybrid_optimizer(model, compile=False, metrics=2)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=3,
        logging_steps=2,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        per_device_train_batch_size=4,
        dataloader_num_workers=0,
    )
    callback = MuonMetricsCallback(names=["*/*_norm", "*/ortho_residual_max"])
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=Data(),
        optimizers=(optimizer, None),
        callbacks=[callback],
    )
    trainer.train()
    history = [h for h in trainer.state.log_history if "loss" in h]
    # steps 1 and 3 are measured and logged although logging_steps=2 logs step 2 only
    assert [h["step"] for h in history] == [1, 2, 3]
    assert [h.get("optim/step") for h in history] == [1.0, None, 3.0]
    for h in (history[0], history[2]):
        _check_figures(h)
        assert not any(k.endswith("_rms") for k in h), sorted(h)  # names= kept the group totals
    assert history[0]["optim/muon/weight_norm"] == pytest.approx(
        _initial_muon_weight_norm(optimizer, "net."), rel=1e-6
    )
    _check_against_optimizer(history[2], optimizer)
    # report_to integrations run before the callback: it says how to reach them
    with pytest.warns(UserWarning, match=r"report_to integrations \['wandb'\].*report_to='none'"):
        callback.on_train_begin(
            SimpleNamespace(report_to=["wandb"]),
            SimpleNamespace(is_world_process_zero=True),
            None,
            optimizer=optimizer,
        )


@pytest.mark.slow
def test_callbacks_name_the_extra_and_stay_out_of_import_muon_fn():
    """``import muon_fn`` (and its integrations package) imports no framework; a callback whose
    framework is missing raises ImportError naming the extra to install."""
    code = """
import sys
for name in ("lightning", "pytorch_lightning", "transformers"):
    sys.modules[name] = None  # as if not installed
import muon_fn, muon_fn.integrations
from muon_fn.integrations import hf, lightning
for module, extra in ((lightning, "lightning"), (hf, "hf")):
    try:
        module.MuonMetricsCallback()
    except ImportError as e:
        assert f"pip install 'muon-fn[{extra}]'" in str(e), e
    else:
        raise AssertionError(module)
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_reader_reads_each_measured_step_once():
    model = Net()
    opt = mf.create_hybrid_optimizer(model, compile=False, metrics=2)
    reader = _common.Reader("optim/", ("*/update_norm",))
    assert _common.no_measuring_hint("cb", [opt]) is None
    assert "metrics=True" in _common.no_measuring_hint(
        "cb", [mf.create_hybrid_optimizer(model, compile=False)]
    )
    assert "no muon_fn optimizer" in _common.no_measuring_hint(
        "cb", [torch.optim.SGD(model.parameters(), lr=0.1)]
    )
    x, y = _data(4)
    seen, changes = [], []
    for _ in range(4):
        (model(x) - y).pow(2).mean().backward()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        seen.append(reader.read([opt]))
        changes.append({n: p.detach() - before[n] for n, p in model.named_parameters()})
    assert [f.get("optim/step") for f in seen] == [1.0, None, 3.0, None]
    assert sorted(seen[0]) == ["optim/adamw/update_norm", "optim/muon/update_norm", "optim/step"]
    muon = _muon_names(opt)
    assert muon and muon < {n for n, _ in model.named_parameters()}
    for figures, change in (
        (seen[0], changes[0]),
        (seen[2], changes[2]),
    ):  # the weight change, in float64
        assert figures["optim/muon/update_norm"] == pytest.approx(
            _norm(d for n, d in change.items() if n in muon), rel=1e-5
        )
        assert figures["optim/adamw/update_norm"] == pytest.approx(
            _norm(d for n, d in change.items() if n not in muon), rel=1e-5
        )
    with pytest.raises(ValueError, match="Invalid names"):
        _common.Reader("optim/", [])


@pytest.mark.slow
def test_train_metrics_series_and_plot(tmp_path, capsys):
    """``--metrics 2``: the muon row's metrics.json history holds optimizer.metrics() of steps 1
    and 3; the adamw row (torch.optim) none, and the log says so; loss.png gets the figures' panels."""
    out = tmp_path / "run"
    argv = [
        "train",
        "--compare",
        "muon,adamw",
        "--metrics",
        "2",
        "--steps",
        "4",
        "--eval-interval",
        "2",
        "--eval-windows",
        "4",
        "--batch-size",
        "2",
        "--seq-len",
        "32",
        "--max-bytes",
        "200000",
        "--no-progress",
        "--no-checkpoint",
        "--threads",
        "1",
        "--out",
        str(out),
    ]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "[adamw] --metrics: a torch.optim row, without telemetry" in printed
    runs = {r["label"]: r for r in json.loads((out / "metrics.json").read_text())["runs"]}
    series = runs["muon"]["history"]["metrics"]  # one list per figure, aligned with "step"
    assert series["step"] == [1, 3]
    assert all(len(values) == 2 for values in series.values())
    for i in range(2):
        step = {name: values[i] for name, values in series.items()}
        _check_figures(step, prefix="")
        matrices = [k.split("/")[0] for k in step if k.endswith("/ortho_residual")]  # Muon's
        assert "blocks.0.attn.q.weight" in matrices
        for figure in ("ortho_residual", "update_rms", "grad_rms"):
            worst = max(step[f"{m}/{figure}"] for m in matrices)
            assert step[f"muon/{figure}_max"] == worst and worst > 0
            named = [
                k
                for k, v in step.items()
                if k.startswith(f"muon/{figure}_max@") and v is not None and v == v
            ]
            assert named == [
                f"muon/{figure}_max@{max(matrices, key=lambda m: step[f'{m}/{figure}'])}"
            ]
    assert "metrics" not in runs["adamw"]["history"]
    text = (out / "metrics.json").read_text()
    assert '"step": [1,3]' in text  # each series on one line
    assert [s for s, _ in runs["muon"]["history"]["train"]] == [1, 2, 3, 4]  # the rest as before
    png = out / "loss.png"
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        from PIL import Image  # matplotlib's own dependency

        assert Image.open(png).size[1] > 900  # the second row of panels


def test_train_metrics_option_is_validated(capsys):
    from muon_fn.tools.train.train import build_parser

    parser = build_parser("muon-fn train")
    assert parser.parse_args([]).metrics == 0
    assert parser.parse_args(["--metrics"]).metrics == 1
    assert parser.parse_args(["--metrics=5", "--no-plot"]).metrics == 5
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["--metrics=0"])
    assert e.value.code == 2
    assert "argument --metrics: expected an integer >= 1, got 0" in capsys.readouterr().err
