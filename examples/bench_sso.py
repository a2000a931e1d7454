"""Benchmark SSO against Muon from Python (the same as ``muon-fn bench sso``, as a library call).

:func:`muon_fn.tools.bench.benchmark_sso` times ``SpectralSphereOptimizer`` and ``MuonOptimizer`` steps
in paired rounds on the first layers of the gpt2-small matrix set (real gradients plus fresh
noise every round) and reports the λ solver's statistics; ``sigma=True`` also checks SSO's
warm-started σ(W) estimate against an exact SVD.

  OMP_NUM_THREADS=1 python examples/bench_sso.py --layers 1 --rounds 4 --rows muon,sso
"""

from __future__ import annotations

import argparse
import json

from muon_fn.tools import bench


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=1, help="gpt2-small layers, 1..12")
    ap.add_argument("--rounds", type=int, default=4, help="timed paired rounds")
    ap.add_argument("--warmup", type=int, default=1, help="rounds timed apart first")
    ap.add_argument(
        "--rows",
        default="muon,muon_same,sso",
        help=f"comma-separated subset of {', '.join(bench.SSO_ROWS)}",
    )
    ap.add_argument("--json", default=None, help="write the result here")
    args = ap.parse_args(argv)
    result = bench.benchmark_sso(
        args.layers, args.rounds, args.warmup, args.rows.split(","), sigma=True
    )
    print(bench.format_sso_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
