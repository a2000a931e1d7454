"""``muon-fn plan``: the owner-computes plan of a model spec on a mesh, as a table.

    muon-fn plan --model llama3-70b --mesh dp=64 dp=256 --bucket-size 1
    muon-fn plan --model bench-fsdp --mesh dp=2 dp=4 --policy cpu --inflight-bytes 8MiB

One row per (model, mesh) from :func:`muon_fn.fsdp.plan_model`, as
:func:`muon_fn.fsdp.format_plan` lays it out (which makes the same table from code). Besides
the specs, ``--model bench-fsdp`` is the matrix set ``muon-fn bench fsdp`` measures
(:data:`BENCH_FSDP`), so that its step peaks can be set beside the prediction.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence

from muon_fn.fsdp import DEFAULT_GEMM_TFLOPS, DEFAULT_LINK_GBPS, format_plan, parse_mesh, plan_model
from muon_fn.distributed import specs
from muon_fn.optim import BUCKET_SIZE, STATE_BITS
from muon_fn.orthogonalization import POLICIES

from ._argtypes import float_arg, int_arg

# ``muon-fn bench fsdp``'s matrices: gpt2-small's 12 layers of q, k, v, o (768²), MLP up and down.
BENCH_FSDP = [(f"blocks.{i}.linears.{k}.weight", shape, "flatten") for i in range(12)
              for k, shape in enumerate([(768, 768)] * 4 + [(3072, 768), (768, 3072)])]
MODELS = {"bench-fsdp": BENCH_FSDP}
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30}


def inflight_arg(text: str) -> int | None:
    """An argparse type: a byte count ``>= 1`` (``8388608``, ``8MiB``, ``16 MiB``, ``1GB``), or
    ``none`` (no bound)."""
    if text.strip().lower() == "none":
        return None
    number = text.strip().rstrip("BbIiKkMmGg ")
    unit = text.strip()[len(number):].strip().lower()
    try:
        value = float(number) * _UNITS[unit]
    except (ValueError, KeyError):
        value = 0.0
    if not value >= 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"expected a byte count >= 1 (e.g. 8388608, 8MiB, 16MiB) or none, "
                                         f"got {text!r}")
    return int(value)


def _parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=(
        "Plan FSDPMuonOptimizer's owner-computes step for a model spec on a mesh: per-rank Newton–Schulz "
        "FLOPs, bytes, extra memory and a predicted step time. No GPU or process group needed."))
    p.add_argument("--model", nargs="+", required=True, metavar="SPEC",
                   help=f"model spec(s): {', '.join(specs.SPECS)}, or bench-fsdp (muon-fn bench fsdp's matrices)")
    p.add_argument("--mesh", nargs="+", default=["dp=8"], metavar="MESH",
                   help="mesh(es): dp=W, replicate=R,dp=W (HSDP), either with ,tp=T (tensor parallel) (default: dp=8)")
    p.add_argument("--gemm-tflops", type=float_arg(0, strict=True), default=DEFAULT_GEMM_TFLOPS, metavar="TFLOPS",
                   help=f"achieved GEMM rate per rank, TFLOP/s (default {DEFAULT_GEMM_TFLOPS:g}: H100 bf16 dense)")
    p.add_argument("--link-gbps", type=float_arg(0, strict=True), default=DEFAULT_LINK_GBPS, metavar="GBPS",
                   help=f"link bandwidth per rank, GB/s (default {DEFAULT_LINK_GBPS:g}: 400 Gb/s between nodes)")
    p.add_argument("--ns-steps", type=int_arg(1), default=5, metavar="N", help="Newton–Schulz iterations (default 5)")
    p.add_argument("--bucket-size", type=int_arg(1), default=BUCKET_SIZE, metavar="N",
                   help=f"FSDPMuonOptimizer's bucket_size: same-shape matrices one owner computes together "
                        f"(default {BUCKET_SIZE}, the optimizer's)")
    p.add_argument("--num-buckets", type=int_arg(1), default=4, metavar="N",
                   help="FSDPMuonOptimizer's num_buckets (default 4)")
    p.add_argument("--wire", choices=("fp32", "bf16"), default="fp32",
                   help="dtype on the wire (FSDPMuonOptimizer's wire_dtype; default fp32)")
    p.add_argument("--state-bits", type=int, choices=STATE_BITS, default=None, metavar="BITS",
                   help="the optimizers' state_bits (32, 16, 8 or 4): add a column with the optimizer state each "
                        "rank holds at that width, Muon momentum and AdamW moments (default: no column)")
    p.add_argument("--inflight-bytes", type=inflight_arg, default=argparse.SUPPRESS, metavar="BYTES",
                   help="the optimizers' inflight_bytes (e.g. 8MiB, their default; 16MiB; 8388608; none: no bound): "
                        "plan the buckets as they do and add a column with each rank's predicted step peak (the "
                        "step's transient; with --state-bits, also state + transient) (default: no column)")
    p.add_argument("--policy", choices=sorted(POLICIES), default="batched",
                   help="execution policy of the owners: batched (GPUs, the default) or cpu (its byte-bounded "
                        "units, kept scratch and matrix-at-a-time iteration)")
    p.add_argument("--ns-dtype", choices=("bf16", "fp32"), default="bf16",
                   help="dtype of the Newton–Schulz iteration (the optimizers' ns_dtype; default bf16)")
    return p


def main(argv: Sequence[str] | None = None, prog: str = "muon-fn plan") -> int:
    """Print the table; bad arguments exit with status 2 and a message naming the value."""
    parser = _parser(prog)
    args = parser.parse_args(argv)
    try:
        meshes = [parse_mesh(m) for m in args.mesh]
        reports = [plan_model(MODELS.get(model, model), mesh, ns_steps=args.ns_steps, bucket_size=args.bucket_size,
                              num_buckets=args.num_buckets, wire_bytes=4 if args.wire == "fp32" else 2,
                              ns_bytes=2 if args.ns_dtype == "bf16" else 4, gemm_tflops=args.gemm_tflops,
                              link_gbps=args.link_gbps, state_bits=args.state_bits, policy=args.policy,
                              **({"inflight_bytes": args.inflight_bytes} if "inflight_bytes" in args else {}))
                   for model in args.model for mesh in meshes]
        labels = [m for m in args.model for _ in meshes]
        reports = [dataclasses.replace(r, model=m) if m in MODELS else r for r, m in zip(reports, labels)]
    except ValueError as e:
        parser.error(str(e))
    print(format_plan(reports))
    return 0
