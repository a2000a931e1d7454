"""The ``muon-fn`` console command.

    muon-fn train [options]            train a byte-level GPT with muon_fn (``muon-fn train --quick``)
    muon-fn bench [options]            time the Muon step against torch.optim.Muon (muon_fn.bench)
    muon-fn bench sso|fsdp [options]   the SSO and FSDP benchmarks (``bench-sso``: alias of ``bench sso``)
    muon-fn plan --model SPEC --mesh dp=W   the FSDP owner-computes plan of a model spec, predicted

``muon-fn <command> --help`` lists a command's options. A mistake in the options exits with
status 2 and one ``muon-fn <command>: error: ...`` line naming the option, the value and what is
allowed (argparse's error path; the commands share the argument types of :mod:`muon_fn._argtypes`).
"""

from __future__ import annotations

import sys

USAGE = """usage: muon-fn <command> [options]

commands:
  train   train a small byte-level GPT from scratch (default corpus: the Python standard library);
          `muon-fn train --quick` compares Muon with AdamW in a few minutes on a CPU
  bench   benchmark the Muon step (muon_fn compiled and eager, torch.optim.Muon, AdamW, GEMM replays);
          `muon-fn bench sso`: the Spectral Sphere Optimizer's step against Muon (alias: bench-sso);
          `muon-fn bench fsdp`: the FSDP adapter, owner-computes against replicate
  plan    the FSDP optimizer's plan for a model spec on a mesh, without GPUs: per-rank Newton–Schulz
          FLOPs, bytes, extra memory and a predicted step time (`muon-fn plan --model llama3-8b --mesh dp=64`)

`muon-fn <command> --help` lists the command's options. Docs: docs/index.md
"""


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``muon-fn``; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from muon_fn import __version__

        print(f"muon-fn {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command == "train":
        from muon_fn._train.train import main as train_main

        return int(train_main(rest, prog="muon-fn train") or 0)
    if command in ("bench", "bench-sso"):
        try:
            from muon_fn import bench
        except ImportError as e:
            print(f"muon-fn {command}: muon_fn.bench is not available in this installation ({e})", file=sys.stderr)
            return 2
        return int(bench.main(rest if command == "bench" else ["sso", *rest]) or 0)
    if command == "plan":
        from muon_fn.fsdp._plan_cli import main as plan_main

        return int(plan_main(rest) or 0)
    print(f"muon-fn: unknown command {command!r}\n\n{USAGE}", end="", file=sys.stderr)
    return 2


if __name__ == "__main__":  # python -m muon_fn.cli
    sys.exit(main())
