"""``muon-fn plan``: the owner-computes plan of a model spec on a mesh, as a table.

    muon-fn plan --model llama3-70b --mesh dp=64 dp=256 --bucket-size 1

One row per (model, mesh) from :func:`muon_fn.fsdp.plan_model`, as
:func:`muon_fn.fsdp.format_plan` lays it out (which makes the same table from code).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from muon_fn.fsdp import DEFAULT_GEMM_TFLOPS, DEFAULT_LINK_GBPS, format_plan, parse_mesh, plan_model
from muon_fn.distributed import specs
from muon_fn.optim import BUCKET_SIZE, STATE_BITS

from ._argtypes import float_arg, int_arg


def _parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=(
        "Plan FSDPMuonOptimizer's owner-computes step for a model spec on a mesh: per-rank Newton–Schulz "
        "FLOPs, bytes, extra memory and a predicted step time. No GPU or process group needed."))
    p.add_argument("--model", nargs="+", required=True, metavar="SPEC",
                   help=f"model spec(s): {', '.join(specs.SPECS)}")
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
    return p


def main(argv: Sequence[str] | None = None, prog: str = "muon-fn plan") -> int:
    """Print the table; bad arguments exit with status 2 and a message naming the value."""
    parser = _parser(prog)
    args = parser.parse_args(argv)
    try:
        meshes = [parse_mesh(m) for m in args.mesh]
        reports = [plan_model(model, mesh, ns_steps=args.ns_steps, bucket_size=args.bucket_size,
                              num_buckets=args.num_buckets, wire_bytes=4 if args.wire == "fp32" else 2,
                              gemm_tflops=args.gemm_tflops, link_gbps=args.link_gbps, state_bits=args.state_bits)
                   for model in args.model for mesh in meshes]
    except ValueError as e:
        parser.error(str(e))
    print(format_plan(reports))
    return 0
