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
from pathlib import Path
from typing import Any

import torch
from torch import nn

from muon_fn import orthogonalization
from .._device import synchronize
from muon_fn.integrations import MetricsReader
from . import logits, optimizers, report, telemetry
from .args import DEFAULT_STEPS, UsageError, build_parser, check_corpus, resolve, schedule_error
from .data import Batcher, Corpus, load_corpus, val_starts, windows
from .model import GPT, config_for
from .optimizers import DEFAULT_ADAMW_LR, DEFAULT_LR

__all__ = ["main", "build_parser", "run_all", "UsageError"]
COMPILING = "compiling the optimizer step (first step; later runs load it from torch's cache)"

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
                raise UsageError("--fsdp needs torchrun, e.g. torchrun --nproc_per_node=2 examples/train_gpt.py --fsdp")
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
    model = GPT(config_for(args.model)).to(ctx.device)
    if ctx.enabled:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    return model


def build_optimizer(label: str, name: str, options: dict, model: nn.Module, args: argparse.Namespace, ctx: Dist):
    """The optimizer of run ``label`` (spec ``name[options]``), a one-line description of it, and
    its logit log (:func:`logits.setup`). ``lr``/``adamw_lr`` in ``options`` override
    ``--lr``/``--adamw-lr``. A spec the optimizer refuses (an unknown key, a bad value: its
    constructor's ``TypeError``/``ValueError``) raises :class:`UsageError` naming the spec."""
    options = dict(options)
    lr = options.pop("lr", args.lr if args.lr is not None else DEFAULT_LR[name])
    adamw_lr = options.pop("adamw_lr", args.adamw_lr if args.adamw_lr is not None else DEFAULT_ADAMW_LR)
    try:
        options, logit_log = logits.setup(name, options, model, args.qk_clip, args.log_max_logit)
        if ctx.enabled:
            opt = optimizers.build_fsdp(name, options, model, lr, adamw_lr, args.weight_decay, ctx.world,
                                        not args.no_compile, getattr(args, "metrics", 0))
        else:
            opt = optimizers.build_single(name, options, model, lr, adamw_lr, args.weight_decay, not args.no_compile,
                                          getattr(args, "metrics", 0))
    except (TypeError, ValueError) as e:
        raise UsageError(f"argument {'--compare' if args.compare else '--optimizer'}: {label}: {e}") from None
    return (*opt, logit_log)


def check_optimizers(args: argparse.Namespace, ctx: Dist) -> None:
    """Build every run's optimizer on a meta-device model (no memory, no data), so that a spec
    the optimizer refuses stops the command before the first run trains, not after it
    (:class:`UsageError`). Under ``--fsdp`` the optimizers need the sharded model: not checked."""
    if ctx.enabled:
        return
    with torch.device("meta"):
        model = GPT(config_for(args.model))
    with warnings.catch_warnings():  # the real build warns, once
        warnings.simplefilter("ignore")
        for label, name, options in args.runs:
            build_optimizer(label, name, options, model, args, ctx)


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
        try:
            model.load_state_dict(meta["model"])
        except RuntimeError as e:  # e.g. a checkpoint of another --model in the same --out
            lines = str(e).strip().splitlines()  # torch's: "Error(s) in loading state_dict for GPT:", then each
            raise UsageError(f"--resume: {path / 'state.pt'} holds another model than this run's (another --model "
                             f"in the same --out?): {lines[-1].strip()}") from None
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
    return DEFAULT_STEPS


def run_one(label: str, name: str, options: dict, args, corpus: Corpus, ctx: Dist) -> dict[str, Any]:
    """Train one model with one optimizer (spec ``label``) for ``args.seed``; the run's record."""
    steps = total_steps(args, corpus, ctx.world)
    warmup = args.warmup if args.warmup is not None else max(1, steps // 10)
    model = build_model(args, ctx)
    opt, opt_desc, logit_log = build_optimizer(label, name, options, model, args, ctx)
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
    if getattr(args, "metrics", 0) and not getattr(opt, "metrics_every", 0):
        _log(ctx, f"[{label}] --metrics: a torch.optim row, without telemetry: nothing recorded")
    stop = steps if args.stop_at is None else max(start, min(args.stop_at, steps))
    t_run, cpu_run = time.perf_counter(), time.process_time()
    _train_loop(label, model, opt, sched, batcher, history, range(start, stop), steps, args, corpus, ctx, ckpt,
                logit_log, compiles=_compiles(name, args))
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
                logit_log=None, compiles=False) -> None:
    """The steps of one run: evaluate every ``--eval-interval``, step, schedule, checkpoint
    (and log the max attention logit when ``logit_log`` is given; ``optimizer.metrics()`` of each
    step the optimizer measured, ``--metrics``, to ``history["metrics"]``: :mod:`.telemetry`).
    Each step's time in ``optimizer.step`` and in the whole step (batch, forward, backward, step,
    schedule, the loss read; not evaluation or checkpoints) go to ``history["step_time"]`` as
    ``[step, optimizer_s, step_s]``, clocks read after a device synchronize (a no-op on the CPU;
    on CUDA one more wait per step, before the optimizer, since reading the loss waits anyway).
    ``compiles``: the first ``optimizer.step`` compiles; the progress bar says so until it returns."""
    starts = val_starts(corpus.val, args.eval_windows, args.seq_len)
    figures = MetricsReader("", None)  # optimizer.metrics() of each measured step -> history["metrics"]
    tokens_per_step = args.batch_size * args.seq_len * ctx.world
    bar = _progress(args, ctx, total, steps_range.start, label)
    t_last, tok_last, tok_s = time.perf_counter(), 0, 0.0
    for step in steps_range:
        if step % args.eval_interval == 0 and not (history["val"] and history["val"][-1][0] == step):
            history["val"].append([step, evaluate(model, corpus.val, starts, args, ctx)])
        if bar is not None and compiles and step == steps_range.start:
            bar.set_postfix_str(COMPILING)  # 5-60 s on a CPU: not a frozen bar
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
        if ctx.main and figures.fresh([opt]):  # a host-side check: a device read only on measured steps
            telemetry.record(history, step + 1, opt.metrics())
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


def _compiles(name: str, args: argparse.Namespace) -> bool:
    """Whether the run's first step compiles: a muon_fn row (the torch.optim rows run eager)
    without --no-compile or ``MUON_FN_COMPILE=0``."""
    muon_fn_row = args.fsdp or name not in ("adamw", "torch-muon")
    return muon_fn_row and not args.no_compile and orthogonalization.compiles(True)


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
    _atomic_write(path, telemetry.dumps(doc))


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
    """Run the command; a mistake in the options or the data exits with status 2 and one
    ``<prog>: error: ...`` line (argparse's exit), without a traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(prog)
    args = resolve(parser.parse_args(argv), parser)
    try:
        return _run(args, argv)
    except UsageError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")


def _run(args: argparse.Namespace, argv: list[str]) -> int:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    ctx = Dist(args.fsdp, device)
    try:
        check_optimizers(args, ctx)
        corpus = load_corpus(args.data, max_bytes=args.max_bytes)
        _check_data(args, corpus, ctx)
        _log(ctx, corpus.describe())
        results = run_all(args, corpus, ctx)
        if ctx.main:
            _report(args, corpus, results, argv, ctx)
        ctx.barrier()
    finally:
        ctx.close()
    return 0


def _check_data(args: argparse.Namespace, corpus: Corpus, ctx: Dist) -> None:
    """:class:`UsageError` if the corpus is too short for ``--seq-len``, or if the steps that
    ``--epochs`` gives leave no room for ``--warmup``/``--stop-at`` (known only now)."""
    check_corpus(args, corpus)
    if args.epochs is not None:
        message = schedule_error(args, total_steps(args, corpus, ctx.world))
        if message:
            raise UsageError(message)


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
    seeds = (f"seed {args.seed}" if args.seeds == 1
             else f"seeds {args.seed}–{args.seed + args.seeds - 1} (mean, band: min–max)")
    moe = f", {cfg.n_experts} experts, top-{cfg.moe_top_k}" if cfg.n_experts else ""
    return (f"byte-level GPT '{args.model}' ({cfg.n_layer}L, d={cfg.n_embd}{moe}) on {src}; "
            f"batch {args.batch_size * ctx.world}×{args.seq_len}, {seeds}")
