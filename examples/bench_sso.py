"""Benchmark (not a test): SSO step time vs Muon on the GPT-2-small matrix set, plus solver statistics.

Per layer the matrices are 4 × (768, 768) (q, k, v, o), (3072, 768) (MLP up) and (768, 3072)
(MLP down). Each step every optimizer gets the same synthetic gradient: a fixed rank-4 signal
plus fresh Gaussian noise of the same Frobenius norm. Updates are applied, so SSO's weights move on
the sphere as in training. Timings are paired: in every step each optimizer's update is timed
back to back (order alternating), and the per-step ratio SSO/Muon is reported (median, min, max),
which is robust to the noise of a shared machine. Outside the timed region the exact σ(W) is
computed to report the accuracy of SSO's warm-started σ estimate.

  OMP_NUM_THREADS=1 python examples/bench_sso.py --layers 1 --steps 6 --warmup 2

Compared: ``muon`` (muon_fn.muon defaults: aol9, 4 steps in bf16), ``muon_fp32x8`` (Muon with
SSO's msign: Polar Express 8 steps in fp32), ``muon_sphere`` (MuonSphere: retraction, λ = 0) and
``sso`` (muon_fn.sso defaults); opt-in ``sso_bf16`` (SSO with Muon's msign: aol9, 4 steps in bf16).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections import Counter

import torch

import muon_fn as mf
from muon_fn import spectral
from muon_fn.bench import paired_ratio

GPT2_LAYER = [(768, 768)] * 4 + [(3072, 768), (768, 3072)]


def make_problem(layers: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shapes = GPT2_LAYER * layers
    params = tuple(torch.empty(s).uniform_(-1 / math.sqrt(s[1]), 1 / math.sqrt(s[1]), generator=g) for s in shapes)
    signals = []
    for out, inp in shapes:
        a, b = torch.randn(out, 4, generator=g), torch.randn(inp, 4, generator=g)
        s = a @ b.T
        signals.append(s / torch.linalg.matrix_norm(s) * math.sqrt(out * inp))
    return params, signals, g


def grads_for(signals, g):
    return tuple(s + torch.randn(s.shape, generator=g) for s in signals)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--steps", type=int, default=6, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (solver warms up too)")
    ap.add_argument("--json", type=str, default=None, help="write the results here")
    ap.add_argument("--variants", type=str, default="muon,muon_fp32x8,muon_sphere,sso",
                    help="comma-separated subset of: muon, muon_fp32x8, muon_sphere, sso, sso_bf16")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    params, signals, gen = make_problem(args.layers)
    txs = {
        "muon": mf.muon(0.02),
        "muon_fp32x8": mf.muon(0.02, method="polar_express", ns_steps=8, ns_dtype=torch.float32),
        "muon_sphere": mf.sso(0.02, muon_sphere=True),
        "sso": mf.sso(0.02),
        # Economy: Muon's default msign (aol9, 4 steps, bf16), tolerance loosened to bf16's h noise.
        "sso_bf16": mf.sso(0.02, msign_method="aol9", msign_steps=4, msign_dtype=torch.bfloat16, tol=5e-3),
    }
    wanted = args.variants.split(",")
    unknown = set(wanted) - set(txs)
    if unknown or "muon" not in wanted:
        raise SystemExit(f"--variants must include 'muon' and name only {sorted(txs)}; got {args.variants!r}")
    txs = {k: v for k, v in txs.items() if k in wanted}
    sso_name = "sso" if "sso" in txs else next((k for k in txs if k.startswith("sso")), None)
    t0 = time.perf_counter()
    states = {k: tx.init(params) for k, tx in txs.items()}
    init_s = time.perf_counter() - t0
    weights = {k: params for k in txs}
    times = {k: [] for k in txs}
    iters, sigma_err, residuals, fallbacks = Counter(), [], [], 0
    order = list(txs)
    for step in range(args.warmup + args.steps):
        grads = grads_for(signals, gen)
        exact = spectral.compute_spectral_norm  # σ of SSO's W before its update (untimed)
        true_sigma = [float(exact(w)) for w in weights[sso_name]] if sso_name else []
        for name in (order if step % 2 == 0 else order[::-1]):
            t = time.perf_counter()
            updates, states[name] = txs[name].update(grads, states[name], weights[name])
            weights[name] = mf.apply_updates(weights[name], updates)
            dt = time.perf_counter() - t
            if step >= args.warmup:
                times[name].append(dt)
        st = states[sso_name] if sso_name else None
        if st is not None and step >= args.warmup:
            iters.update(int(i) for i in st.iterations)
            residuals += [float(r) for r in st.residual]
            fallbacks += int(sum(int(f) for f in st.fallback))
            sigma_err += [abs(ts / float(s) - 1) for ts, s in zip(true_sigma, st.sigma)]
        print(f"step {step}: " + ", ".join(f"{k} {times[k][-1]:.2f}s" for k in txs if times[k] and step >= args.warmup)
              + (f"  {sso_name} iterations {[int(i) for i in st.iterations]}" if st is not None else ""), flush=True)

    def ratio(a, b):  # per-step ratios of two variants timed back to back, or None if one was not run
        return paired_ratio(times[a], times[b]) if a in times and b in times else None

    total = sum(iters.values())
    result = {
        "layers": args.layers, "matrices": len(params), "timed_steps": args.steps, "warmup": args.warmup,
        "init_s_all_optimizers": init_s,
        "median_step_s": {k: statistics.median(v) for k, v in times.items()},
        "ratio_sso_over_muon": ratio("sso", "muon"),
        "ratio_sso_over_muon_fp32x8": ratio("sso", "muon_fp32x8"),
        "ratio_muon_sphere_over_muon": ratio("muon_sphere", "muon"),
        "ratio_sso_over_muon_sphere": ratio("sso", "muon_sphere"),
        "ratio_sso_bf16_over_muon": ratio("sso_bf16", "muon"),
        "solver_stats_of": sso_name,
        "solver_iterations_histogram": {int(k): v for k, v in sorted(iters.items())},
        "solver_iterations_mean": sum(k * v for k, v in iters.items()) / max(total, 1),
        "fallbacks": fallbacks,
        "residual_max": max(residuals) if residuals else None,
        "sigma_rel_error_max": max(sigma_err) if sigma_err else None,
        "sigma_rel_error_median": statistics.median(sigma_err) if sigma_err else None,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
