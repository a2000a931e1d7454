"""The options of ``muon-fn train`` (and ``examples/train_gpt.py``), checked before any work.

Every number and the device have an argparse type (:mod:`muon_fn.tools._argtypes`), so a bad value stops the
command with status 2 and one line such as ``muon-fn train: error: argument --steps: expected an
integer >= 1, got 0``; the checks between options (``--warmup`` below the steps, ``--seq-len``
within the preset's block size, one spec per ``--compare`` row) go through the same
``parser.error``. A mistake found later, in the data or an optimizer spec, raises
:class:`UsageError`, which ``main`` reports the same way (no traceback).
"""

from __future__ import annotations

import argparse

from .._argtypes import device_arg, float_arg, int_arg
from .model import PRESETS
from .optimizers import ADAMW_BETAS, DEFAULT_ADAMW_LR, DEFAULT_LR, HALF_BETAS, OPTIMIZERS, parse_spec, split_specs

__all__ = ["UsageError", "QUICK", "DEFAULT_STEPS", "build_parser", "resolve", "schedule_error", "check_corpus"]

# `--quick`: a few minutes on 2 CPU cores for muon + adamw (see docs/index.md for the figures).
# One thread: the tiny model's 128-wide GEMMs gain little from a second thread, and on a machine
# shared with other jobs OpenMP threads that spin-wait make a step many times slower. (Its warmup
# is the default, 10 % of the steps: 30 of 300.)
QUICK = dict(model="tiny", steps=300, batch_size=16, seq_len=128, eval_interval=50, eval_windows=64, threads=1)
DEFAULT_STEPS = 300
_DEFAULTS = dict(model="tiny", batch_size=16, eval_interval=50, eval_windows=64)  # seq_len: the preset's
_SEED_MAX = 2**32 - 1


class UsageError(ValueError):
    """A mistake in the command's options or inputs found after parsing (a missing ``--data``
    path, a corpus shorter than one ``--seq-len`` window, an optimizer spec's unknown key): the
    command prints ``<prog>: error: <message>`` and exits with status 2."""


def build_parser(prog: str = "train_gpt.py") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Train a small byte-level GPT from scratch with muon_fn optimizers "
        "(default corpus: this Python's standard library sources).",
    )
    _add_run_options(p)
    _add_schedule_options(p)
    _add_output_options(p)
    _add_system_options(p)
    return p


def _presets_help() -> str:
    def shape(name: str) -> str:
        cfg = PRESETS[name]
        experts = f", {cfg['n_experts']} experts per MLP" if cfg.get("n_experts") else ""
        return f"{name} ({cfg['n_layer']} layers, d={cfg['n_embd']}, block {cfg['block_size']}{experts})"

    return "architecture preset, random init: " + ", ".join(shape(n) for n in PRESETS) + " (default tiny)"


def _add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true",
                   help=f"a few-minute CPU run: {', '.join(f'{k}={v}' for k, v in QUICK.items())}, "
                   "and --compare muon,adamw unless --optimizer/--compare is given")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--optimizer", default=None, metavar="SPEC",
                       help=f"optimizer of a single run (default muon): one of {', '.join(OPTIMIZERS)}, optionally "
                       "with options: the optimizer's keywords and lr, e.g. muon[method=aol9,lr=0.04]; "
                       f"adamw_beta2= sets the β₂ of a Muon row's AdamW half (default {HALF_BETAS[1]}), "
                       f"beta2= that of the adamw row (default {ADAMW_BETAS[1]})")
    which.add_argument("--compare", default=None, metavar="A,B",
                       help="comma-separated optimizer specs trained from the same init and batches, e.g. "
                       "torch-muon,muon,adamw (torch-muon: torch.optim.Muon + torch.optim.AdamW, muon's split)")
    p.add_argument("--seeds", type=int_arg(1), default=1, metavar="N",
                   help="repeat the comparison for N seeds (--seed, --seed+1, ...): mean and spread (default 1)")
    p.add_argument("--seed", type=int_arg(0, _SEED_MAX), default=0, metavar="N",
                   help="seed of the initial weights and of the batch order (default 0)")
    p.add_argument("--model", choices=list(PRESETS), default=None, help=_presets_help())
    p.add_argument("--data", default=None, metavar="PATH",
                   help="a text file or a directory (default: the Python standard library's *.py files)")
    p.add_argument("--max-bytes", type=int_arg(1), default=None, metavar="N",
                   help="read at most N corpus bytes (default: all)")


def _add_schedule_options(p: argparse.ArgumentParser) -> None:
    length = p.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int_arg(1), default=None, metavar="N",
                        help=f"optimizer steps (default {DEFAULT_STEPS})")
    length.add_argument("--epochs", type=float_arg(0, strict=True), default=None, metavar="E",
                        help="instead of --steps: passes over the training bytes "
                        "(steps = epochs·bytes/(batch·seq·world))")
    p.add_argument("--batch-size", type=int_arg(1), default=None, metavar="N",
                   help=f"sequences per step per rank (default {_DEFAULTS['batch_size']})")
    p.add_argument("--seq-len", type=int_arg(1), default=None, metavar="N",
                   help="tokens (bytes) per sequence, at most the preset's block size (default: the block size)")
    lrs = ", ".join(f"{name} {lr:g}" for name, lr in DEFAULT_LR.items())
    p.add_argument("--lr", type=float_arg(0, strict=True), default=None,
                   help=f"learning rate of the main optimizer (default: {lrs})")
    p.add_argument("--adamw-lr", type=float_arg(0, strict=True), default=None, metavar="LR",
                   help=f"AdamW lr for embeddings/head/1-D params of Muon-family runs (default {DEFAULT_ADAMW_LR:g})")
    p.add_argument("--weight-decay", type=float_arg(0), default=0.0, metavar="WD",
                   help="decoupled weight decay of every optimizer (default 0)")
    p.add_argument("--warmup", type=int_arg(0), default=None, metavar="N",
                   help="linear warmup steps, fewer than the steps (default 10%% of the steps, at least 1)")
    p.add_argument("--min-lr-ratio", type=float_arg(0, 1), default=0.1, metavar="R",
                   help="cosine decay ends at this fraction of the lr (default 0.1)")
    p.add_argument("--eval-interval", type=int_arg(1), default=None, metavar="N",
                   help=f"steps between validation evaluations (default {_DEFAULTS['eval_interval']})")
    p.add_argument("--eval-windows", type=int_arg(1), default=None, metavar="N",
                   help=f"fixed validation windows per evaluation (default {_DEFAULTS['eval_windows']})")


def _add_output_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="runs/train_gpt", metavar="DIR",
                   help="output directory: metrics.json, loss.png, checkpoints (default runs/train_gpt)")
    p.add_argument("--checkpoint-interval", type=int_arg(0), default=0, metavar="N",
                   help="save a checkpoint every N steps (default 0: only at the end)")
    p.add_argument("--no-checkpoint", action="store_true", help="do not write checkpoints")
    p.add_argument("--resume", action="store_true", help="continue from the run's checkpoint in --out if there is one")
    p.add_argument("--stop-at", type=int_arg(1), default=None, metavar="STEP",
                   help="checkpoint and stop after this step (the schedule still spans the steps); continue "
                   "with --resume")
    p.add_argument("--qk-clip", type=float_arg(0, strict=True), default=None, metavar="TAU",
                   help="QK-Clip: after each step rescale W_q and W_k of every attention head whose max logit "
                   "exceeded TAU (per optimizer: qk_clip=TAU in its spec); logs the max logit per step "
                   "(default: no clipping)")
    p.add_argument("--log-max-logit", action="store_true",
                   help="log (and plot) the largest attention logit of every step, without clipping")
    p.add_argument("--metrics", nargs="?", type=int_arg(1), const=1, default=0, metavar="K",
                   help="optimizer telemetry (metrics=K of the optimizer): record optimizer.metrics() of every "
                   "K-th step (steps 1, K+1, ...; --metrics alone: every step) in metrics.json and plot the "
                   "group totals beside the loss; the muon_fn rows only (torch-muon and adamw are "
                   "torch.optim optimizers, without telemetry) (default: off)")
    p.add_argument("--no-plot", action="store_true", help="do not write loss.png")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    p.add_argument("--verbose", action="store_true", help="print which parameter each optimizer half got")


def _add_system_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fsdp", action="store_true",
                   help="shard with FSDP2 (run under torchrun; gloo on CPU, nccl on CUDA)")
    p.add_argument("--no-compile", action="store_true",
                   help="run muon_fn's optimizer step eagerly (default: compiled, as the library does)")
    p.add_argument("--device", type=device_arg, default=None,
                   help="cpu, cuda or cuda:N (default: cuda if a GPU is visible, else cpu)")
    p.add_argument("--threads", type=int_arg(1), default=None, metavar="N",
                   help="torch.set_num_threads (default: torch's choice)")


def resolve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Fill the defaults that depend on other options (``--quick``, the preset) and check the
    options against each other; a mistake exits through ``parser.error`` (status 2)."""
    if args.quick:
        for k, v in QUICK.items():
            if getattr(args, k) is None:
                setattr(args, k, v)
        if args.compare is None and args.optimizer is None:
            args.compare = "muon,adamw"
    for k, v in {**_DEFAULTS, "seq_len": PRESETS[args.model or _DEFAULTS["model"]]["block_size"]}.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    block = PRESETS[args.model]["block_size"]
    if args.seq_len > block:
        parser.error(f"argument --seq-len: expected an integer from 1 to {block} (the '{args.model}' preset's "
                     f"block size), got {args.seq_len}")
    args.runs = _runs(args, parser)
    if args.epochs is None:
        message = schedule_error(args, DEFAULT_STEPS if args.steps is None else args.steps)
        if message:
            parser.error(message)
    return args


def _runs(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[tuple[str, str, dict]]:
    """``(spec, optimizer, options)`` per run of ``--optimizer`` or ``--compare``."""
    flag = "--compare" if args.compare else "--optimizer"
    specs = split_specs(args.compare) if args.compare else [args.optimizer or "muon"]
    try:
        runs = [(spec, *parse_spec(spec)) for spec in specs]
    except ValueError as e:
        parser.error(f"argument {flag}: {e}")
    if not runs or len({label for label, _, _ in runs}) != len(runs):
        parser.error(f"argument --compare: give each optimizer spec once, got {args.compare!r}")
    not_sharded = [label for label, name, _ in runs if name in ("adamw", "torch-muon")]
    if args.fsdp and not_sharded:
        parser.error(f"argument {flag}: --fsdp trains the muon_fn optimizers (muon, normuon, sso), "
                     f"not {not_sharded[0]!r}")
    return runs


def schedule_error(args: argparse.Namespace, steps: int) -> str | None:
    """The message for a ``--warmup`` or ``--stop-at`` that a run of ``steps`` cannot take, or None."""
    n = f"{steps} step{'s' * (steps != 1)}"
    source = (f"--steps {steps}" if args.steps is not None else f"the default {n}" if args.epochs is None
              else f"the {n} of --epochs {args.epochs:g}")
    if args.warmup is not None and args.warmup >= steps:
        return f"argument --warmup: expected an integer from 0 to {steps - 1} (below {source}), got {args.warmup}"
    if args.stop_at is not None and args.stop_at > steps:
        return f"argument --stop-at: expected an integer from 1 to {steps} ({source}), got {args.stop_at}"
    return None


def check_corpus(args: argparse.Namespace, corpus) -> None:
    """:class:`UsageError` if a split of ``corpus`` cannot hold a window of ``--seq-len`` + 1
    bytes with a byte to spare (the batches draw their starts from the bytes before the last window)."""
    need = args.seq_len + 2
    for split, data in (("training", corpus.train), ("validation", corpus.val)):
        if data.numel() < need:
            raise UsageError(f"the {split} split of {corpus.name} has {data.numel()} bytes, fewer than "
                             f"--seq-len + 2 = {need}: give more data (--data, --max-bytes) or a smaller --seq-len")
