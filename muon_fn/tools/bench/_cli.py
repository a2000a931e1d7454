"""``muon-fn bench [muon|sso|fsdp] [options]``: the benchmarks' command line.

    muon-fn bench --quick                          # the Muon step, tiny set (about a minute)
    muon-fn bench --model-size gpt2-small --threads 1,default --json bench.json
    muon-fn bench --elementwise --quick            # TritonMuon/TritonMuonW against torch's Adam, AdamW, SGD
    muon-fn bench --compile-time                   # cold and warm first steps, both execution policies
    muon-fn bench --memory --model-size gpt2-small # state and step peak of every row, each in a fresh process
    muon-fn bench --device cuda --model-size gpt2-small llama3-1b llama3-8b deepseek-moe  # LLM-size sets
    muon-fn bench sso --layers 2 --rounds 4        # SSO against Muon (alias: muon-fn bench-sso)
    muon-fn bench fsdp --world-sizes 2 4           # FSDP owner-computes, replicate, torch.optim.Muon (gloo)
    muon-fn bench fsdp --overlap --world-sizes 4   # FSDP overlap=False against overlap=True (gloo)

Each prints a table (progress lines to stderr) and writes the full result to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any
from collections.abc import Sequence

from muon_fn import orthogonalization
from .._argtypes import device_arg, float_arg, int_arg
from ._compile_time import GPT_SETS, benchmark_compile_time, format_compile_table
from ._fsdp import TORCH_DTYPES, benchmark_fsdp, benchmark_overlap, format_fsdp_result, format_overlap_result
from ._memory_table import benchmark_memory, check_memory_args, format_memory_table
from ._muon import benchmark_muon_optimizers, check_muon_args, compile_check, format_table
from ._problem import CPU_MAX_PARAMS, DEFAULT_SIZES, SETS
from ._rows import ELEMENTWISE_ROWS, MEMORY_ROWS, MODEL_ROWS, OPTIONAL_ROWS, ROW_SPECS, ROWS, default_rows, memory_rows
from ._sso import SSO_DEFAULT_ROWS, SSO_ROWS, benchmark_sso, check_sso_args, format_sso_table
from ._timing import Threads, check_device, parse_threads

COMMANDS = ("muon", "sso", "fsdp")
_EMULATED_BF16 = ("note: this CPU has no bf16 instructions, so torch emulates bf16 GEMMs (tens of times slower "
                  "than fp32: about 10 s per tiny step of torch.optim.Muon, over 15 min per gpt2-small step); "
                  "muon_fn's default runs in fp32 here. Left out unless named in --rows: {}")


def main(argv: Sequence[str] | None = None, prog: str = "muon-fn bench") -> int:
    """Entry point of ``muon-fn bench``: ``argv[0]`` may name a benchmark (default ``muon``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv and argv[0] in COMMANDS else "muon"
    run = {"muon": _muon_main, "sso": _sso_main, "fsdp": _fsdp_main}[command]
    return run(argv, prog if command == "muon" else f"{prog} {command}")


def _threads_arg(text: str) -> list[Threads]:
    try:
        return parse_threads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _parse(ap: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``ap``'s arguments; a ``--json`` in a missing directory is refused now, not after the benchmark."""
    args = ap.parse_args(argv)
    folder = os.path.dirname(os.path.abspath(args.json)) if args.json else None
    if folder is not None and not os.path.isdir(folder):
        ap.error(f"argument --json: {args.json!r}: no such directory {folder!r}")
    return args


def _write_json(path: str, results: Any) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
        print(f"wrote {path}")


def _muon_parser(prog: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=prog, description="Paired step times, memory and orthogonality quality of Muon optimizer steps.",
        epilog="Other benchmarks: muon-fn bench sso --help, muon-fn bench fsdp --help.")
    ap.add_argument("--model-size", nargs="+", choices=[*SETS, "all"], default=["all"], metavar="SET",
                    help="parameter sets, one after the other: tiny (4 layers, d = 256), gpt2-small (12 layers, "
                         "d = 768), llama3-1b (16 layers, 973 M params), llama3-8b (8 of 32 layers, 1.75 B), "
                         "deepseek-moe (expert stacks, 2 of 27 layers, 1.1 B), or all (tiny and gpt2-small; "
                         f"default). Sets over {CPU_MAX_PARAMS // 10**6} M params run on a GPU (--device cuda) "
                         "or with --force")
    ap.add_argument("--layers", type=int, default=None,
                    help="only the set's first N layers (default all; llama3-8b 8, deepseek-moe 2)")
    ap.add_argument("--force", action="store_true",
                    help=f"time a selection of more than {CPU_MAX_PARAMS // 10**6} M params on the CPU anyway")
    ap.add_argument("--steps", type=int_arg(1), default=1, metavar="N",
                    help="optimizer steps per row per round (default 1)")
    ap.add_argument("--rounds", type=int_arg(1), default=None, metavar="N",
                    help="paired rounds (default 25 tiny, 5 gpt2-small; --quick: 12)")
    ap.add_argument("--lr", type=float_arg(0, strict=True), default=0.02,
                    help="learning rate of every optimizer row (default 0.02)")
    ap.add_argument("--rows", nargs="+", choices=list(ROW_SPECS), default=None, metavar="ROW",
                    help="rows to time (default: " + ", ".join(ROWS) + "; also: " + ", ".join(OPTIONAL_ROWS)
                         + "; with --memory also the model rows " + ", ".join(MODEL_ROWS) + ")")
    ap.add_argument("--elementwise", action="store_true",
                    help="time the elementwise family instead: " + ", ".join(ELEMENTWISE_ROWS)
                         + " (no orthogonalization, so no quality measures)")
    ap.add_argument("--threads", type=_threads_arg, default=[1], metavar="N[,N...]",
                    help="torch threads, a comma-separated list run one after the other; 'default' is the "
                         "count torch picks itself (e.g. --threads 1,default; default 1: docs/performance.md)")
    ap.add_argument("--device", type=device_arg, default="cpu",
                    help="where every row runs: cpu (default), cuda, cuda:1, ... (timed with a synchronize per row)")
    ap.add_argument("--json", default="muon_fn_bench.json", help="write the results here ('' to skip)")
    ap.add_argument("--quick", action="store_true",
                    help="tiny set, 12 rounds (2 on CPUs without bf16 instructions), quality on layer 0 "
                         "and 256x1024 Gaussians")
    ap.add_argument("--compile", action="store_true",
                    help="also measure a cold compile and the recompiles over LR-scheduled steps")
    ap.add_argument("--compile-time", action="store_true",
                    help="instead: time the first step of a fresh process, cold (new cache directory) and warm "
                         "(a second process, same directory), for MuonOptimizer and the hybrid on the GPT sets "
                         f"({', '.join(GPT_SETS)}), under both execution policies on the CPU")
    ap.add_argument("--memory", action="store_true",
                    help="instead: the memory table, each row in a fresh process: its state and the transient peak "
                         "of one step (CPU: resident set; CUDA: torch.cuda.max_memory_allocated) in MiB and as "
                         "multiples of the parameters' bytes, against torch.optim.Muon (default rows: "
                         + ", ".join(MEMORY_ROWS) + "; the model rows on the gpt sets only)")
    ap.add_argument("--no-quality", action="store_true", help="skip the orthogonality quality measurements")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak step memory measurement")
    return ap


def _muon_main(argv: list[str], prog: str) -> int:
    ap = _muon_parser(prog)
    args = _parse(ap, argv)
    try:
        device = check_device(args.device)
    except ValueError as e:
        ap.error(str(e))
    sizes = ["tiny"] if args.quick else list(dict.fromkeys(
        size for arg in args.model_size for size in (DEFAULT_SIZES if arg == "all" else (arg,))))
    if sum((args.memory, args.compile_time, args.elementwise)) > 1:
        ap.error("--memory, --compile-time and --elementwise each choose what to measure: give one")
    if args.memory and args.no_memory:
        ap.error("--memory measures only memory: give it or --no-memory, not both")
    if args.compile_time:
        return _compile_time_main(ap, args, sizes, device)
    if args.memory:
        return _memory_main(ap, args, sizes, device)
    if args.elementwise:
        if args.rows is not None:
            ap.error("--elementwise chooses the rows: give it or --rows, not both")
        args.rows, args.no_quality = list(ELEMENTWISE_ROWS), True
    emulated = device.type == "cpu" and not orthogonalization.CPU_HAS_BF16_GEMM
    if emulated and args.rows is None:
        left_out = sorted({r for s in sizes for r in ROWS if r not in default_rows(s, device)})
        print(_EMULATED_BF16.format(", ".join(left_out)), file=sys.stderr, flush=True)
    runs = []
    for size in sizes:
        rounds = args.rounds
        if rounds is None and args.quick:  # 2 rounds where torch.optim.Muon's bf16 is emulated: near a minute
            rounds = 2 if emulated and args.rows is None else 12
        elif rounds is None:
            rounds = 25 if size == "tiny" else 5
        kwargs = dict(num_steps=args.steps, lr=args.lr, rows=args.rows or default_rows(size, device),
                      rounds=rounds, layers=args.layers, device=device, force=args.force)
        try:  # every run's arguments before the first run (e.g. --layers 9 of the tiny set)
            check_muon_args(size, **kwargs)
        except ValueError as e:
            ap.error(str(e))
        runs.append((size, kwargs))
    results: dict[str, Any] = {}
    large = [size for size, _ in runs if size not in DEFAULT_SIZES]
    if large and not args.no_quality:
        print(f"note: no quality measures on {', '.join(large)} (CPU SVDs of matrices up to this size take minutes "
              "each; benchmark_muon_optimizers(quality=True) measures them)", file=sys.stderr, flush=True)
    for size, kwargs in runs:
        for i, threads in enumerate(args.threads):  # quality does not depend on threads: measured once
            quality = not args.no_quality and i == 0 and size in DEFAULT_SIZES
            res = benchmark_muon_optimizers(size, **kwargs, threads=threads, quality=quality,
                                            memory=not args.no_memory, quality_layers=1 if args.quick else 2,
                                            gaussian=(256, 1024) if args.quick else True,
                                            progress=lambda line, size=size: print(f"{size}: {line}", file=sys.stderr,
                                                                                   flush=True))
            print(format_table(res), flush=True)
            results[f"{size},threads={threads}"] = res
        if args.compile:
            checks = [compile_check("tiny", steps=100, device=device), compile_check(size, steps=3, device=device)]
            results[f"{size},compile"] = checks
            for c in checks:
                print(f"compile ({c['model_size']}): cold first step {c['cold_first_step_seconds']:.1f} s, "
                      f"{c['recompiles']} recompiles over {c['steps']} LR-scheduled steps", flush=True)
    _write_json(args.json, results)
    return 0


def _compile_time_main(ap: argparse.ArgumentParser, args: argparse.Namespace, sizes: list[str],
                       device: Any) -> int:
    wrong = [s for s in sizes if s not in GPT_SETS]
    if wrong:
        ap.error(f"--compile-time measures the GPT sets ({', '.join(GPT_SETS)}), not {', '.join(wrong)}")
    results = {}
    for threads in args.threads:
        rows = benchmark_compile_time(sizes, device=device, threads=threads, log=_stderr_line)
        print(format_compile_table(rows), flush=True)
        results[f"compile_time,threads={threads}"] = rows
    _write_json(args.json, results)
    return 0


def _memory_main(ap: argparse.ArgumentParser, args: argparse.Namespace, sizes: list[str], device: Any) -> int:
    runs = []
    for size in sizes:
        kwargs = dict(rows=args.rows or memory_rows(size, device), layers=args.layers, lr=args.lr, device=device,
                      force=args.force)
        try:  # every run's arguments before the first run
            check_memory_args(size, **kwargs)
        except ValueError as e:
            ap.error(str(e))
        runs.append((size, kwargs))
    results = {}
    for size, kwargs in runs:
        for threads in args.threads:
            res = benchmark_memory(size, **kwargs, threads=threads,
                                   progress=lambda line, size=size: _stderr_line(f"{size}: {line}"))
            print(format_memory_table(res), flush=True)
            results[f"{size},memory,threads={threads}"] = res
    _write_json(args.json, results)
    return 0


def parser(command: str = "muon", prog: str = "muon-fn bench") -> argparse.ArgumentParser:
    """The argument parser of ``muon-fn bench [command]`` (``command`` one of :data:`COMMANDS`)."""
    build = {"muon": _muon_parser, "sso": _sso_parser, "fsdp": _fsdp_parser}[command]
    return build(prog if command == "muon" else f"{prog} {command}")


def _sso_parser(prog: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description="SSO step time against Muon on the gpt2-small matrix set.")
    ap.add_argument("--layers", type=int, default=12, help="gpt2-small layers (6 matrices each), 1..12")
    ap.add_argument("--rounds", type=int, default=5, help="timed paired rounds")
    ap.add_argument("--warmup", type=int, default=1, help="rounds timed apart first (the first compiles)")
    ap.add_argument("--rows", default=",".join(SSO_DEFAULT_ROWS),
                    help=f"comma-separated subset of {', '.join(SSO_ROWS)}")
    ap.add_argument("--threads", type=_threads_arg, default=[1], metavar="N[,N...]",
                    help="torch threads, a comma-separated list ('default': torch's own count; default 1)")
    ap.add_argument("--sigma", action="store_true", help="also measure the σ(W) estimate's error (an SVD per matrix)")
    ap.add_argument("--eager", action="store_true", help="run the optimizers with compile=False")
    ap.add_argument("--json", default="", help="also write the full result (per-round times, ratios) here")
    return ap


def _sso_main(argv: list[str], prog: str) -> int:
    ap = _sso_parser(prog)
    args = _parse(ap, argv)
    rows = args.rows.split(",")
    try:
        check_sso_args(args.layers, args.rounds, args.warmup, rows)
    except ValueError as e:
        ap.error(str(e))  # a usage error; errors inside the run are not
    results = {}
    for threads in args.threads:
        res = benchmark_sso(args.layers, args.rounds, args.warmup, rows, sigma=args.sigma, compile=not args.eager,
                            threads=threads, log=_stderr_line)
        print(format_sso_table(res), flush=True)
        results[f"threads={threads}"] = res
    _write_json(args.json, results)
    return 0


def _fsdp_parser(prog: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description="FSDP owner-computes against replicate, and torch.optim.Muon "
                                 "and MuonOptimizer on the same DTensors (CPU, gloo).")
    ap.add_argument("--world-sizes", type=int_arg(2), nargs="+", default=[2, 4], metavar="W",
                    help="process counts, one run each (default 2 4)")
    ap.add_argument("--repeats", type=int_arg(1), default=3, metavar="N", help="paired repeats (default 3)")
    ap.add_argument("--ns-steps", type=int_arg(1), default=5, metavar="N", help="Newton–Schulz steps (default 5)")
    ap.add_argument("--layers", type=int_arg(1), default=12, metavar="N",
                    help="layers of 4 D×D, 4D×D and D×4D matrices (default 12)")
    ap.add_argument("--dim", type=int_arg(1), default=768, metavar="D", help="model width (default 768: gpt2-small)")
    ap.add_argument("--buckets", type=int_arg(1), default=4, metavar="N",
                    help="num_buckets of the FSDPMuonOptimizer rows (default 4; MuonOptimizer on DTensors: 4)")
    ap.add_argument("--torch-dtype", choices=TORCH_DTYPES, default="auto",
                    help="iteration dtype of the torch.optim.Muon row and of MuonOptimizer[like_torch] "
                         "(auto, the default: bf16 where the CPU has bf16 GEMMs, else fp32: torch's "
                         "iteration with its bf16 cast replaced)")
    ap.add_argument("--no-torch", action="store_true",
                    help="leave out the torch.optim.Muon and MuonOptimizer[like_torch] rows")
    ap.add_argument("--overlap", action="store_true",
                    help="instead: overlap=False against overlap=True through real forward/backward "
                         "passes (defaults then: --layers 4 --dim 512 --repeats 5)")
    ap.add_argument("--tokens", type=int_arg(1), default=1024, metavar="N",
                    help="rows of each rank's batch (--overlap; default 1024)")
    ap.add_argument("--json", default="", help="also write the results to this file")
    return ap


def _fsdp_main(argv: list[str], prog: str) -> int:
    ap = _fsdp_parser(prog)
    args = _parse(ap, argv)
    results = []
    if args.overlap:
        given = {a.split("=")[0] for a in argv}
        kw = {name: getattr(args, name) for name in ("repeats", "ns_steps", "layers", "dim", "buckets", "tokens")
              if f"--{name.replace('_', '-')}" in given or name in ("ns_steps", "buckets", "tokens")}
        for w in args.world_sizes:
            r = benchmark_overlap(w, **kw)
            print(format_overlap_result(r), flush=True)
            results.append(r)
        _write_json(args.json, results)
        return 0
    for w in args.world_sizes:
        r = benchmark_fsdp(w, repeats=args.repeats, ns_steps=args.ns_steps, layers=args.layers,
                           dim=args.dim, buckets=args.buckets, with_torch=not args.no_torch,
                           torch_dtype=args.torch_dtype)
        print(format_fsdp_result(r), flush=True)
        results.append(r)
    _write_json(args.json, results)
    return 0


def _stderr_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)

