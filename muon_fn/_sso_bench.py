"""SSO step time against Muon on the gpt2-small matrix set (a benchmark, not a test).

    OMP_NUM_THREADS=1 muon-fn bench-sso                       # 12 layers, 1 + 5 rounds (about 7 min)
    OMP_NUM_THREADS=1 muon-fn bench-sso --layers 1 --rounds 4 --rows muon,muon_same,sso,sso_classic
    python -m muon_fn._sso_bench ...                          # the same, without the console script

A table goes to stdout (progress lines to stderr), the full result to ``--json`` if given.

Rows (each its own optimizer over its own copy of the same matrices):

- ``muon``: ``MuonOptimizer`` defaults — the issue's "Muon" (``aol9``, 4 steps, since commit
  3f1c375; Polar Express, 5 steps before, which is what docs/sso.md's early tables used), in the
  default dtype: bf16, or fp32 on CPUs without bf16 GEMMs (since 2026-11-24).
- ``muon_pe5``: ``MuonOptimizer(method="polar_express", ns_steps=5)`` (the default before 3f1c375).
- ``muon_same``: ``MuonOptimizer(method="polar_express", ns_steps=8, ns_dtype=torch.float32)`` — Muon with SSO's own msign
  (Polar Express, 8 steps, fp32), so the ratio isolates what SSO adds over Muon.
- ``sso``: ``SpectralSphereOptimizer`` defaults.
- ``sso_classic``: ``SpectralSphereOptimizer(lambda_model=False)`` (bracket from last step's λ*,
  Illinois; the solver before the λ model).
- ``muon_sphere``: ``SpectralSphereOptimizer(muon_sphere=True)`` (retraction, λ = 0).
- ``sso_bf16`` / ``muon_sphere_bf16``: SSO / MuonSphere with Muon's default msign (``aol9``, 4 steps,
  bf16) and, for SSO, ``tol=5e-3`` (bf16 tangency).
- ``sso_spectral``: ``SpectralSphereOptimizer(direction="spectral")`` (λ* and Φ from the λ model's
  eigendecomposition, no Newton–Schulz iteration; opt-in).

Parameters and a base gradient come from one forward/backward of a byte-level gpt2-small-shaped
transformer (:func:`muon_fn.bench.real_gradients`: low stable rank, like real gradients); each round
every row gets the same gradient ``g_real + ξ`` with fresh Gaussian ξ of the same Frobenius norm
(stochastic-gradient-like, so M̂ changes every step). Every round times each row's
``optimizer.step()`` back to back (order alternating), so the per-round ratios cancel the load of a
shared machine; ratios are reported as median, min and max over rounds, with the per-matrix
histogram of solver msign evaluations over the timed rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from typing import Any, Callable, Sequence

import torch

from .bench import MATRIX_NAMES, paired_ratio, real_gradients
from .optim import MuonOptimizer
from ._sso_optim import SpectralSphereOptimizer

ROWS: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]] = {
    "muon": lambda ps: MuonOptimizer(ps, lr=0.02),
    "muon_pe5": lambda ps: MuonOptimizer(ps, lr=0.02, method="polar_express", ns_steps=5),
    "muon_same": lambda ps: MuonOptimizer(ps, lr=0.02, method="polar_express", ns_steps=8,
                                          ns_dtype=torch.float32),
    "sso": lambda ps: SpectralSphereOptimizer(ps, lr=0.02),
    "sso_classic": lambda ps: SpectralSphereOptimizer(ps, lr=0.02, lambda_model=False),
    "muon_sphere": lambda ps: SpectralSphereOptimizer(ps, lr=0.02, muon_sphere=True),
    "sso_spectral": lambda ps: SpectralSphereOptimizer(ps, lr=0.02, direction="spectral"),
    # Muon's own msign (aol9, 4 steps, bf16); tangency only to bf16 accuracy, hence tol 5e-3.
    "sso_bf16": lambda ps: SpectralSphereOptimizer(ps, lr=0.02, msign_method="aol9", msign_steps=4,
                                                   msign_dtype=torch.bfloat16, tol=5e-3),
    "muon_sphere_bf16": lambda ps: SpectralSphereOptimizer(ps, lr=0.02, muon_sphere=True, msign_method="aol9",
                                                           msign_steps=4, msign_dtype=torch.bfloat16),
}
DEFAULT_ROWS = ("muon", "muon_same", "sso")


def check_args(layers: int, rounds: int, warmup: int, rows: Sequence[str]) -> None:
    """Raise ``ValueError`` for arguments :func:`run` cannot use (before any work)."""
    for r in rows:
        if r not in ROWS:
            raise ValueError(f"Invalid row: {r!r} (valid: {', '.join(ROWS)})")
    if "muon" not in rows:
        raise ValueError("Invalid rows: must include 'muon' (the reference of every ratio)")
    if not 1 <= layers <= 12:
        raise ValueError(f"Invalid layers: {layers} (expected 1..12)")
    if rounds < 1 or warmup < 0:
        raise ValueError(f"Invalid rounds/warmup: {rounds}/{warmup} (expected rounds >= 1, warmup >= 0)")


def run(layers: int = 12, rounds: int = 5, warmup: int = 1, rows: Sequence[str] = DEFAULT_ROWS,
        seed: int = 0, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Paired rounds over ``rows``; returns medians, per-round ratios and SSO solver statistics."""
    check_args(layers, rounds, warmup, rows)
    params0, grad0, names = real_gradients("gpt2-small", seed=seed)
    n = len(MATRIX_NAMES) * layers
    params0, grad0, names = params0[:n], grad0[:n], names[:n]
    gen = torch.Generator().manual_seed(seed + 1)
    copies = {r: [torch.nn.Parameter(p.detach().clone()) for p in params0] for r in rows}
    t0 = time.perf_counter()
    opts = {r: ROWS[r](copies[r]) for r in rows}
    times: dict[str, list[float]] = {r: [] for r in rows}
    hist: dict[str, Counter] = {r: Counter() for r in rows if r.startswith("sso")}
    residual_max: dict[str, float] = {r: 0.0 for r in hist}
    fallbacks: dict[str, int] = {r: 0 for r in hist}
    for k in range(warmup + rounds):
        grads = []
        for g in grad0:
            xi = torch.randn(g.shape, generator=gen)
            grads.append(g + xi * (torch.linalg.matrix_norm(g) / torch.linalg.matrix_norm(xi)))
        order = list(rows) if k % 2 == 0 else list(rows)[::-1]
        line = []
        for r in order:
            for p, g in zip(copies[r], grads):
                p.grad = g.clone()
            t = time.perf_counter()
            opts[r].step()
            dt = time.perf_counter() - t
            line.append(f"{r} {dt:.2f}s")
            if k >= warmup:
                times[r].append(dt)
                if r in hist:
                    st = opts[r].last_step_stats()
                    hist[r].update(int(i) for i in st.iterations)
                    residual_max[r] = max(residual_max[r], float(st.residual.max()))
                    fallbacks[r] += int(st.fallback.sum())
        log(f"round {k}{' (warm-up)' if k < warmup else ''}: " + ", ".join(line))
    setup_s = time.perf_counter() - t0

    result: dict[str, Any] = {
        "layers": layers, "matrices": n, "rounds": rounds, "warmup": warmup,
        "threads": torch.get_num_threads(), "wall_s": setup_s,
        "median_step_s": {r: statistics.median(v) for r, v in times.items()},
        "ratios": {f"{a}/{b}": paired_ratio(times[a], times[b]) for b in ("muon", "muon_same") if b in rows
                   for a in rows if a not in ("muon", b)},
        "solver": {r: {"msigns_per_matrix_histogram": dict(sorted(h.items())),
                       "msigns_per_matrix_mean": sum(a * b for a, b in h.items()) / max(sum(h.values()), 1),
                       "residual_max": residual_max[r], "fallbacks": fallbacks[r]} for r, h in hist.items()},
    }
    return result


def format_table(result: dict[str, Any]) -> str:
    """The human-readable summary of a :func:`run` result: median step per row, each ratio's
    median / min / max and per-round values, and the SSO rows' solver statistics."""
    lines = [f"gpt2-small matrix set, {result['layers']} layer(s) = {result['matrices']} matrices; "
             f"{result['warmup']} warm-up + {result['rounds']} paired rounds, {result['threads']} thread(s)",
             f"{'row':<18}{'median s/step':>14}"]
    lines += [f"{r:<18}{t:>14.3f}" for r, t in result["median_step_s"].items()]
    lines.append(f"{'ratio':<24}{'median':>8}{'min':>8}{'max':>8}  per round")
    for name, q in result["ratios"].items():
        if q is not None:
            rounds = " ".join(f"{x:.3f}" for x in q["per_round"])
            lines.append(f"{name:<24}{q['median']:>8.3f}{q['min']:>8.3f}{q['max']:>8.3f}  {rounds}")
    for r, st in result["solver"].items():
        hist = ", ".join(f"{k}: {v}" for k, v in st["msigns_per_matrix_histogram"].items())
        lines.append(f"{r}: msigns per matrix-step {{{hist}}} (mean {st['msigns_per_matrix_mean']:.2f}), "
                     f"max |h| {st['residual_max']:.1e}, fallbacks {st['fallbacks']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, prog: str = "python -m muon_fn._sso_bench") -> int:
    """Entry point of ``muon-fn bench-sso`` (and ``python -m muon_fn._sso_bench``)."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12, help="gpt2-small layers (6 matrices each), 1..12")
    ap.add_argument("--rounds", type=int, default=5, help="timed paired rounds")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    ap.add_argument("--rows", default=",".join(DEFAULT_ROWS), help=f"comma-separated subset of {', '.join(ROWS)}")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: see docs/performance.md)")
    ap.add_argument("--json", default="", help="also write the full result (per-round times, ratios) here")
    args = ap.parse_args(argv)
    rows = args.rows.split(",")
    try:
        check_args(args.layers, args.rounds, args.warmup, rows)
    except ValueError as e:
        ap.error(str(e))  # a usage error; errors inside the run are not
    torch.set_num_threads(args.threads)
    result = run(args.layers, args.rounds, args.warmup, rows,
                 log=lambda line: print(line, file=sys.stderr, flush=True))
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            f.write(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
