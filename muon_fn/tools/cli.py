"""The ``muon-fn`` console command.

    muon-fn train [options]            train a byte-level GPT with muon_fn (``muon-fn train --quick``)
    muon-fn bench [options]            time the Muon step against torch.optim.Muon (muon_fn.tools.bench)
    muon-fn bench sso|fsdp [options]   the SSO and FSDP benchmarks (``bench-sso``: alias of ``bench sso``)
    muon-fn plan --model SPEC --mesh dp=W   the FSDP owner-computes plan of a model spec, predicted

``muon-fn <command> --help`` lists a command's options. A mistake in the options exits with
status 2 and one ``muon-fn <command>: error: ...`` line naming the option, the value and what is
allowed (argparse's error path; the commands share the argument types of :mod:`muon_fn.tools._argtypes`).

Synopses (every option: ``--help``):

    muon-fn train [--quick] [--optimizer muon|torch-muon|adamw|normuon|sso | --compare A,B]
                  [--model tiny|small|gpt2|moe-tiny] [--data PATH] [--steps N | --epochs E]
                  [--qk-clip TAU] [--log-max-logit] [--metrics[=K]] [--fsdp] [--resume] ...
    muon-fn bench [muon] [--elementwise] [--memory] [--model-size SET ...] [--threads 1,default]
                  [--device cuda] [--force] ...
    muon-fn bench sso [--layers N] [--rounds N] [--warmup N] [--rows muon,muon_same,sso,...]
                  [--sigma] [--eager] [--threads N,...] [--json PATH]
    muon-fn bench fsdp [--world-sizes W [W ...]] [--repeats N] [--ns-steps N] [--layers N]
                  [--dim D] [--buckets N] [--torch-dtype auto|bf16|fp32] [--no-torch]
                  [--overlap] [--tokens N] [--json PATH]
    muon-fn plan --model SPEC [SPEC ...] [--mesh dp=W [replicate=R,dp=W ...]] [--gemm-tflops 400]
                  [--link-gbps 50] [--ns-steps 5] [--bucket-size 4] [--num-buckets 4]
                  [--wire fp32|bf16] [--state-bits 32|16|8|4] [--inflight-bytes 8MiB|N|none]
                  [--policy batched|cpu] [--ns-dtype bf16|fp32]

``muon-fn train`` is ``examples/train_gpt.py``. ``--qk-clip TAU`` clips every row
(``qk_clip=TAU`` or ``qk_clip=none`` in one row's spec overrides it) and logs each step's largest
attention logit; ``--log-max-logit`` logs it without clipping. ``--metrics[=K]`` passes
``metrics=K`` to the muon_fn rows (alone: every step; the torch-muon and adamw rows have no
telemetry), keeps ``optimizer.metrics()`` of each measured step in ``metrics.json``
(``history["metrics"]``) and plots the group totals. Every run reports the optimizer's share of
a training step (median ``optimizer.step`` time over the median step, clocks read after a device
synchronize): ``optimizer_step_s``, ``step_s``, ``optimizer_share`` and ``history["step_time"]``.

``muon-fn bench`` is :func:`muon_fn.tools.bench.main`; the first argument names the benchmark,
``muon`` by default. ``--model-size`` takes sets of ``muon_fn.tools.bench.SETS`` (``tiny``,
``gpt2-small``, both: ``all``, the default; the LLM-size ``llama3-1b``, ``llama3-8b``,
``deepseek-moe``, refused on the CPU above 100 M parameters unless ``--force``). ``--elementwise``
times TritonMuon and TritonMuonW against torch's fused Adam, AdamW and SGD; the rows
``muon_fn[state_bits=16|8|4]`` and ``TritonMuonW[state_bits=8]`` time low-bit state against their
fp32 peers. ``--memory`` measures each row's persistent state and one step's peak, each row in a
fresh process. ``bench fsdp --overlap`` runs ``overlap=False`` against ``overlap=True`` through real
forward and backward passes. ``muon-fn plan`` prints :func:`muon_fn.fsdp.format_plan` of
:func:`muon_fn.fsdp.plan_model` for every model and mesh. ``python -m muon_fn`` runs the same
command without the console script.
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
        from muon_fn.tools.train.train import main as train_main

        return int(train_main(rest, prog="muon-fn train") or 0)
    if command in ("bench", "bench-sso"):
        try:
            from muon_fn.tools import bench
        except ImportError as e:
            print(f"muon-fn {command}: muon_fn.tools.bench is not available in this installation ({e})",
                  file=sys.stderr)
            return 2
        return int(bench.main(rest if command == "bench" else ["sso", *rest]) or 0)
    if command == "plan":
        from muon_fn.tools.plan import main as plan_main

        return int(plan_main(rest) or 0)
    print(f"muon-fn: unknown command {command!r}\n\n{USAGE}", end="", file=sys.stderr)
    return 2
