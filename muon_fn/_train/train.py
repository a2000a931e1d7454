"""The training run behind ``examples/train_gpt.py`` and ``muon-fn train``.

One run = one optimizer: build the model from a seed, train for ``--steps`` with a warmup +
cosine learning-rate schedule, evaluate a fixed set of validation windows every
``--eval-interval`` steps, checkpoint, and return the history. ``--compare a,b`` repeats the run
for each optimizer from the same initial weights and the same batches, ``--seeds N`` repeats the
whole comparison for N seeds (initial weights and batch order), then prints per optimizer the mean
and spread of the final validation loss and the steps to reach AdamW's, and plots the curves.
``--fsdp`` (under ``torchrun``) shards the model with FSDP2 and checkpoints with
``torch.distributed.checkpoint``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..bench._timing import synchronize
from . import logits, optimizers, report
from .data import Batcher, Corpus, load_corpus, val_starts, windows
from .model import GPT, PRESETS, config_for
from .optimizers import ADAMW_BETAS, HALF_BETAS, DEFAULT_ADAMW_LR, DEFAULT_LR, OPTIMIZERS

# `--quick`: a few minutes on 2 CPU cores for muon + adamw (see docs/index.md for the figures).
# One thread: the tiny model's 128-wide GEMMs gain little from a second thread, and on a machine
# shared with other jobs OpenMP threads that spin-wait make a step many times slower.
QUICK = dict(model="tiny", steps=300, batch_size=16, seq_len=128, eval_interval=50, eval_windows=64,
             warmup=30, threads=1)


# --------------------------------------------------------------------------------------------
# arguments


def build_parser(prog: str = "train_gpt.py") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Train a small byte-level GPT from scratch with muon_fn optimizers "
        "(default corpus: this Python's standard library sources).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--quick", action="store_true",
                   help=f"a few-minute CPU run: {', '.join(f'{k}={v}' for k, v in QUICK.items())}, "
                   "and --compare muon,adamw unless --optimizer/--compare is given")
    p.add_argument("--optimizer", default=None, metavar="SPEC",
                   help=f"optimizer of a single run (default muon): one of {', '.join(OPTIMIZERS)}, optionally "
                   "with options: the optimizer's keywords and lr, e.g. muon[method=aol9,lr=0.04]; "
                   f"adamw_beta2= sets the β₂ of a Muon row's AdamW half (default {HALF_BETAS[1]}), "
                   f"beta2= that of the adamw row (default {ADAMW_BETAS[1]})")
    p.add_argument("--compare", default=None, metavar="A,B",
                   help="comma-separated optimizer specs trained from the same init and batches, e.g. "
                   "torch-muon,muon,adamw (torch-muon: torch.optim.Muon + torch.optim.AdamW, muon's split)")
    p.add_argument("--seeds", type=int, default=1,
                   help="repeat the comparison for this many seeds (--seed, --seed+1, ...): mean and spread")
    p.add_argument("--model", choices=sorted(PRESETS), default=None,
                   help="architecture preset, random init (default tiny; moe-tiny: tiny with 4 experts per MLP)")
    p.add_argument("--data", default=None, metavar="PATH",
                   help="a text file or a directory (default: the Python standard library's *.py files)")
    p.add_argument("--max-bytes", type=int, default=None, help="read at most this many corpus bytes")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 300)")
    p.add_argument("--epochs", type=float, default=None,
                   help="instead of --steps: passes over the training bytes (steps = epochs·bytes/(batch·seq·world))")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step per rank (default 16)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens (bytes) per sequence (default: the preset's block size)")
    p.add_argument("--lr", type=float, default=None,
                   help=f"learning rate of the main optimizer (default {DEFAULT_LR})")
    p.add_argument("--adamw-lr", type=float, default=None,
                   help=f"AdamW lr for embeddings/head/1-D params of Muon-family runs (default {DEFAULT_ADAMW_LR})")
    p.add_argument("--weight-decay", type=float, default=0.0, help="decoupled weight decay of every optimizer")
    p.add_argument("--warmup", type=int, default=None, help="linear warmup steps (default 10%% of steps)")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine decay ends at this fraction of the lr")
    p.add_argument("--eval-interval", type=int, default=None, help="steps between validation evaluations (default 50)")
    p.add_argument("--eval-windows", type=int, default=None, help="fixed validation windows per evaluation (default 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/train_gpt", help="output directory (metrics.json, loss.png, checkpoints)")
    p.add_argument("--checkpoint-interval", type=int, default=0,
                   help="save a checkpoint every N steps (0: only at the end)")
    p.add_argument("--no-checkpoint", action="store_true", help="do not write checkpoints")
    p.add_argument("--resume", action="store_true", help="continue from the run's checkpoint in --out if there is one")
    p.add_argument("--stop-at", type=int, default=None, metavar="STEP",
                   help="checkpoint and stop after this step (the schedule still spans --steps); continue with --resume")
    p.add_argument("--qk-clip", type=float, default=None, metavar="TAU",
                   help="QK-Clip: after each step rescale W_q and W_k of every attention head whose max logit "
                   "exceeded TAU (per optimizer: qk_clip=TAU in its spec); logs the max logit per step")
    p.add_argument("--log-max-logit", action="store_true",
                   help="log (and plot) the largest attention logit of every step, without clipping")
    p.add_argument("--fsdp", action="store_true",
                   help="shard with FSDP2 (run under torchrun; gloo on CPU, nccl on CUDA)")
    p.add_argument("--no-compile", action="store_true",
                   help="run muon_fn's optimizer step eagerly (default: compiled, as the library does)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    p.add_argument("--no-plot", action="store_true", help="do not write loss.png")
    p.add_argument("--verbose", action="store_true", help="print which parameter each optimizer half got")
    return p


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill defaults that depend on other options (``--quick``, the preset)."""
    if args.quick:
        for k, v in QUICK.items():
            if getattr(args, k) is None:
                setattr(args, k, v)
        if args.compare is None and args.optimizer is None:
            args.compare = "muon,adamw"
    args.model = args.model or "tiny"
    args.batch_size = args.batch_size or 16
    args.seq_len = args.seq_len or PRESETS[args.model]["block_size"]
    args.eval_interval = args.eval_interval or 50
    args.eval_windows = args.eval_windows or 64
    if args.compare and args.optimizer is not None:
        raise SystemExit("give either --optimizer or --compare, not both")
    specs = optimizers.split_specs(args.compare) if args.compare else [args.optimizer or "muon"]
    try:
        args.runs = [(spec, *optimizers.parse_spec(spec)) for spec in specs]
    except ValueError as e:
        raise SystemExit(f"{'--compare' if args.compare else '--optimizer'}: {e}") from None
    if not args.runs or len({label for label, _, _ in args.runs}) != len(args.runs):
        raise SystemExit(f"--compare: give each optimizer spec once, got {args.compare!r}")
    if args.seeds < 1:
        raise SystemExit(f"--seeds must be >= 1, got {args.seeds}")
    if args.steps is not None and args.epochs is not None:
        raise SystemExit("give either --steps or --epochs, not both")
    return args


# --------------------------------------------------------------------------------------------
# distributed context


class Dist:
    """World info; a no-op outside ``--fsdp``."""

    def __init__(self, enabled: bool, device: torch.device):
        self.enabled = enabled
        self.rank, self.world = 0, 1
        self.device = device
        if enabled:
            import torch.distributed as dist

            if "RANK" not in os.environ:
                raise SystemExit("--fsdp needs torchrun, e.g. torchrun --nproc_per_node=2 examples/train_gpt.py --fsdp")
            backend = "nccl" if device.type == "cuda" else "gloo"
            if device.type == "cuda":
                self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
                torch.cuda.set_device(self.device)
            dist.init_process_group(backend)
            self.rank, self.world = dist.get_rank(), dist.get_world_size()

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.enabled:
            import torch.distributed as dist

            dist.barrier()

    def mean(self, x: float) -> float:
        if not self.enabled:
            return x
        import torch.distributed as dist

        t = torch.tensor([x], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.item() / self.world

    def close(self) -> None:
        if self.enabled:
            import torch.distributed as dist

            dist.barrier()  # all async work done before teardown (notes: avoids an abort at exit)
            dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# model and optimizer


def build_model(args: argparse.Namespace, ctx: Dist) -> nn.Module:
    torch.manual_seed(args.seed)  # the same initial weights for every optimizer and every rank
    cfg = config_for(args.model)
    if args.seq_len > cfg.block_size:
        raise SystemExit(f"--seq-len {args.seq_len} exceeds the '{args.model}' preset's block size {cfg.block_size}")
    model = GPT(cfg).to(ctx.device)
    if ctx.enabled:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    return model


def build_optimizer(name: str, options: dict, model: nn.Module, args: argparse.Namespace, ctx: Dist):
    """The optimizer of one run and a one-line description of it (``lr``/``adamw_lr`` in
    ``options`` override ``--lr``/``--adamw-lr``)."""
    options = dict(options)
    lr = options.pop("lr", args.lr if args.lr is not None else DEFAULT_LR[name])
    adamw_lr = options.pop("adamw_lr", args.adamw_lr if args.adamw_lr is not None else DEFAULT_ADAMW_LR)
    try:
        if ctx.enabled:
            return optimizers.build_fsdp(name, options, model, lr, adamw_lr, args.weight_decay, ctx.world)
        return optimizers.build_single(name, options, model, lr, adamw_lr, args.weight_decay, not args.no_compile)
    except (TypeError, ValueError) as e:
        raise SystemExit(f"{name}: {e}") from None


class Schedulers:
    """One warmup + cosine ``LambdaLR`` per optimizer a run steps (``torch-muon`` has two)."""

    def __init__(self, opt, fn) -> None:
        self.items = [torch.optim.lr_scheduler.LambdaLR(o, fn) for o in getattr(opt, "optimizers", [opt])]

    def step(self) -> None:
        for s in self.items:
            s.step()

    def state_dict(self) -> list:
        return [s.state_dict() for s in self.items]

    def load_state_dict(self, state: list | dict) -> None:
        for s, st in zip(self.items, state if isinstance(state, list) else [state]):
            s.load_state_dict(st)


def lr_lambda(total: int, warmup: int, min_ratio: float):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))

    return f


# --------------------------------------------------------------------------------------------
# checkpoints


def _ckpt_dir(args: argparse.Namespace, label: str) -> Path:
    path = Path(args.out) / label
    return (path / f"seed{args.seed}" if args.seeds > 1 else path) / "checkpoint"


def save_checkpoint(path: Path, model, opt, sched, batcher, step: int, history: dict, ctx: Dist) -> None:
    path.mkdir(parents=True, exist_ok=True)
    meta = {"step": step, "history": history, "scheduler": sched.state_dict()}
    if ctx.enabled:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(model, opt)
        with warnings.catch_warnings():  # "Detected an existing checkpoint ... overwriting": intended
            warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
            dcp.save({"model": msd, "optim": osd},
                     storage_writer=dcp.FileSystemWriter(str(path / "dcp"), overwrite=True))
        torch.save(batcher.state_dict(), path / f"batcher_rank{ctx.rank}.pt")
        if ctx.main:
            _atomic_write(path / "meta.json", json.dumps(meta))
        ctx.barrier()
    else:
        tmp = path / "state.pt.tmp"
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                    "batcher": batcher.state_dict(), **meta}, tmp)
        os.replace(tmp, path / "state.pt")


def load_checkpoint(path: Path, model, opt, sched, batcher, ctx: Dist) -> tuple[int, dict] | None:
    if ctx.enabled:
        if not (path / "meta.json").exists():
            return None
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=str(path / "dcp"))
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        batcher.load_state_dict(torch.load(path / f"batcher_rank{ctx.rank}.pt", weights_only=False))
        meta = json.loads((path / "meta.json").read_text())
    else:
        if not (path / "state.pt").exists():
            return None
        meta = torch.load(path / "state.pt", map_location=ctx.device, weights_only=False)
        model.load_state_dict(meta["model"])
        opt.load_state_dict(meta["optimizer"])
        batcher.load_state_dict(meta["batcher"])
    sched.load_state_dict(meta["scheduler"])
    return meta["step"], meta["history"]


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------
# one run


@torch.no_grad()
def evaluate(model: nn.Module, val: torch.Tensor, starts: torch.Tensor, args, ctx: Dist) -> float:
    """Mean loss over this rank's share of the fixed validation windows, averaged over ranks."""
    model.eval()
    mine = starts[ctx.rank :: ctx.world]
    total, n = 0.0, 0
    for i in range(0, mine.numel(), args.batch_size):
        x, y = windows(val, mine[i : i + args.batch_size], args.seq_len)
        _, loss = model(x.to(ctx.device), y.to(ctx.device))
        total += loss.item() * x.shape[0]
        n += x.shape[0]
    model.train()
    return ctx.mean(total / max(n, 1))


def total_steps(args, corpus: Corpus, world: int) -> int:
    if args.steps is not None:
        return args.steps
    if args.epochs is not None:
        return max(1, math.ceil(args.epochs * corpus.train.numel() / (args.batch_size * args.seq_len * world)))
    return 300


def run_one(label: str, name: str, options: dict, args, corpus: Corpus, ctx: Dist) -> dict[str, Any]:
    """Train one model with one optimizer (spec ``label``) for ``args.seed``; the run's record."""
    steps = total_steps(args, corpus, ctx.world)
    warmup = args.warmup if args.warmup is not None else max(1, steps // 10)
    model = build_model(args, ctx)
    opt_options, logit_log = logits.setup(name, options, model, args.qk_clip, args.log_max_logit)
    opt, opt_desc = build_optimizer(name, opt_options, model, args, ctx)
    sched = Schedulers(opt, lr_lambda(steps, warmup, args.min_lr_ratio))
    batcher = Batcher(corpus.train, args.batch_size, args.seq_len, seed=args.seed * 1000 + ctx.rank)
    history: dict[str, list] = {"train": [], "val": [], "tokens_per_s": [], "max_logit": [], "step_time": []}
    start, ckpt = 0, _ckpt_dir(args, label)
    if args.resume:
        loaded = load_checkpoint(ckpt, model, opt, sched, batcher, ctx)
        if loaded is not None:
            start, history = loaded
            _log(ctx, f"[{label}] resumed from {ckpt} at step {start}")
    n_params = sum(p.numel() for p in model.parameters())
    _log(ctx, f"[{label}] {args.model} GPT, {n_params / 1e6:.2f}M params, seed {args.seed}, {steps} steps × "
              f"{args.batch_size * ctx.world}×{args.seq_len} tokens; {opt_desc}")
    if getattr(opt, "split", None) is not None and args.verbose:
        _log(ctx, _indent(str(opt.split)))
    stop = steps if args.stop_at is None else max(start, min(args.stop_at, steps))
    t_run, cpu_run = time.perf_counter(), time.process_time()
    _train_loop(label, model, opt, sched, batcher, history, range(start, stop), steps, args, corpus, ctx, ckpt,
                logit_log)
    wall, cpu = time.perf_counter() - t_run, time.process_time() - cpu_run
    share = report.optimizer_share(history.get("step_time", []))
    if share is not None:
        _log(ctx, f"[{label}] optimizer.step: {share['optimizer_step_s'] * 1e3:.2f} ms of a "
                  f"{share['step_s'] * 1e3:.2f} ms training step ({100 * share['optimizer_share']:.1f} %, "
                  f"medians over {share['steps']} steps, {ctx.device.type})")
    _log(ctx, f"[{label}] seed {args.seed}: validation loss {history['val'][-1][1]:.4f} at step {stop} "
              f"({wall:.0f} s)")
    if not args.no_checkpoint or stop < steps:
        save_checkpoint(ckpt, model, opt, sched, batcher, stop, history, ctx)
        if stop < steps:
            _log(ctx, f"[{label}] stopped at step {stop} of {steps}; checkpoint in {ckpt} (continue with --resume)")
    tps = [t for _, t in history["tokens_per_s"]]
    return {
        "label": label, "optimizer": name, "options": {k: str(v) for k, v in options.items()},
        "seed": args.seed, "description": opt_desc, "steps": stop, "scheduled_steps": steps, "warmup": warmup,
        "final_val_loss": history["val"][-1][1],
        "best_val_loss": min(v for _, v in history["val"]),
        "final_train_loss": _tail_mean(history["train"], 10),
        "qk_clip": options.get("qk_clip", args.qk_clip),
        "max_logit": max((v for _, v in history.get("max_logit", [])), default=None),
        "tokens_per_s": sorted(tps)[len(tps) // 2] if tps else None,
        "wall_s": wall,
        "cpu_s": cpu,  # process CPU time of this run, all threads (less load-dependent than wall time)
        **(share or {}),  # optimizer_step_s, step_s, optimizer_share (report.optimizer_share)
        "history": history,
    }


def _train_loop(label, model, opt, sched, batcher, history, steps_range, total, args, corpus, ctx, ckpt,
                logit_log=None) -> None:
    """The steps of one run: evaluate every ``--eval-interval``, step, schedule, checkpoint
    (and log the max attention logit when ``logit_log`` is given). Each step's time in
    ``optimizer.step`` and in the whole step (batch, forward, backward, step, schedule, the
    loss read; not evaluation or checkpoints) go to ``history["step_time"]`` as
    ``[step, optimizer_s, step_s]``, clocks read after a device synchronize (a no-op on the CPU;
    on CUDA one more wait per step, before the optimizer, since reading the loss waits anyway)."""
    starts = val_starts(corpus.val, args.eval_windows, args.seq_len)
    tokens_per_step = args.batch_size * args.seq_len * ctx.world
    bar = _progress(args, ctx, total, steps_range.start, label)
    t_last, tok_last, tok_s = time.perf_counter(), 0, 0.0
    for step in steps_range:
        if step % args.eval_interval == 0 and not (history["val"] and history["val"][-1][0] == step):
            history["val"].append([step, evaluate(model, corpus.val, starts, args, ctx)])
        t_step = time.perf_counter()
        x, y = batcher.next()
        _, loss = model(x.to(ctx.device), y.to(ctx.device))
        loss.backward()
        synchronize(ctx.device)
        t_opt = time.perf_counter()
        opt.step()
        synchronize(ctx.device)
        opt_s = time.perf_counter() - t_opt
        if logit_log is not None:
            history.setdefault("max_logit", []).append([step + 1, logit_log.after_step()])
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss_v = ctx.mean(loss.item())
        if not math.isfinite(loss_v):
            raise FloatingPointError(f"[{label}] training loss is {loss_v} at step {step}; see docs/faq.md (NaN)")
        history["train"].append([step + 1, loss_v])
        history.setdefault("step_time", []).append([step + 1, opt_s, time.perf_counter() - t_step])
        tok_last += tokens_per_step
        now = time.perf_counter()
        if now - t_last >= 2.0 or step + 1 == total:
            tok_s = tok_last / (now - t_last)
            history["tokens_per_s"].append([step + 1, tok_s])
            t_last, tok_last = now, 0
        if bar is not None:
            bar.update(1)
            bar.set_postfix_str(_postfix(history, tok_s))
        if (not args.no_checkpoint and args.checkpoint_interval
                and (step + 1) % args.checkpoint_interval == 0 and step + 1 < steps_range.stop):
            save_checkpoint(ckpt, model, opt, sched, batcher, step + 1, history, ctx)
    end = steps_range.stop
    if not (history["val"] and history["val"][-1][0] == end):
        history["val"].append([end, evaluate(model, corpus.val, starts, args, ctx)])
    if bar is not None:
        bar.set_postfix_str(_postfix(history, tok_s))
        bar.close()


def _tail_mean(points: list, n: int) -> float:
    tail = [v for _, v in points[-n:]]
    return sum(tail) / len(tail) if tail else float("nan")


def _postfix(history: dict, tok_s: float) -> str:
    parts = []
    if history["train"]:
        parts.append(f"loss={history['train'][-1][1]:.3f}")
    if history["val"]:
        parts.append(f"val={history['val'][-1][1]:.3f}")
    if tok_s:
        parts.append(f"tok/s={tok_s:,.0f}")
    return " ".join(parts)


def _progress(args, ctx: Dist, total: int, initial: int, name: str):
    if args.no_progress or not ctx.main:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is in the `examples` extra; fall back to plain log lines
        _log(ctx, "(install tqdm for a progress bar: pip install 'muon-fn[examples]')")
        return None
    return tqdm(total=total, initial=initial, desc=name, dynamic_ncols=True, file=sys.stderr)


def _log(ctx: Dist, msg: str) -> None:
    if ctx.main:
        print(msg, flush=True)


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


# --------------------------------------------------------------------------------------------
# reporting


def write_metrics(path: Path, args, corpus: Corpus, results: list[dict], summary: dict, argv: list[str]) -> None:
    doc = {
        "command": "muon-fn train " + " ".join(argv),
        "corpus": corpus.describe(),
        "model": config_for(args.model).to_dict(),
        "settings": {k: v for k, v in vars(args).items() if k != "runs"},
        "torch": torch.__version__,
        "summary": summary,
        "runs": results,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(path, json.dumps(doc, indent=1, default=str))


def run_all(args, corpus: Corpus, ctx: Dist) -> list[dict[str, Any]]:
    """Every optimizer spec for every seed (seed-major: one seed's runs share init and batches)."""
    first, results = args.seed, []
    try:
        for seed in range(first, first + args.seeds):
            args.seed = seed
            results += [run_one(label, name, options, args, corpus, ctx) for label, name, options in args.runs]
    finally:
        args.seed = first
    report.add_steps_to_adamw(results)
    return results


def main(argv: list[str] | None = None, *, prog: str = "train_gpt.py") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = resolve(build_parser(prog).parse_args(argv))
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    ctx = Dist(args.fsdp, device)
    try:
        corpus = load_corpus(args.data, max_bytes=args.max_bytes)
        _log(ctx, corpus.describe())
        results = run_all(args, corpus, ctx)
        if ctx.main:
            _report(args, corpus, results, argv, ctx)
        ctx.barrier()
    finally:
        ctx.close()
    return 0


def _report(args, corpus: Corpus, results: list[dict], argv: list[str], ctx: Dist) -> None:
    out = Path(args.out)
    summary = report.summarize(results)
    write_metrics(out / "metrics.json", args, corpus, results, summary, argv)
    print()
    print(report.comparison_table(summary, results[0]["scheduled_steps"]))
    peaks = [f"{r['label']} (seed {r['seed']}) {r['max_logit']:.2f}" for r in results if r.get("max_logit") is not None]
    if peaks:
        clip = f"; --qk-clip {args.qk_clip:g}" if args.qk_clip is not None else ""
        print(f"largest attention logit of any step{clip}: " + ", ".join(peaks))
    print(f"metrics: {out / 'metrics.json'}")
    if not args.no_plot:
        from .plot import plot_runs

        png = plot_runs(results, out / "loss.png", title=_plot_title(args, corpus, ctx))
        if png is not None:
            print(f"plot:    {png}")


def _plot_title(args, corpus: Corpus, ctx: Dist) -> str:
    cfg = config_for(args.model)
    src = "Python stdlib" if args.data is None else Path(args.data).name
    seeds = f"seed {args.seed}" if args.seeds == 1 else f"seeds {args.seed}–{args.seed + args.seeds - 1} (mean, band: min–max)"
    moe = f", {cfg.n_experts} experts, top-{cfg.moe_top_k}" if cfg.n_experts else ""
    return (f"byte-level GPT '{args.model}' ({cfg.n_layer}L, d={cfg.n_embd}{moe}) on {src}; "
            f"batch {args.batch_size * ctx.world}×{args.seq_len}, {seeds}")
