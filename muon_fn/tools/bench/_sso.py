"""The SSO benchmark: ``SpectralSphereOptimizer`` step time against ``MuonOptimizer`` on the
gpt2-small matrix set, with the λ solver's statistics (public API only: the optimizers and
``last_step_stats()``).

Rows (each its own optimizer over its own copy of the same matrices):

- ``muon``: ``MuonOptimizer`` defaults (its default method and dtype).
- ``muon_pe5``: ``MuonOptimizer(method="polar_express", ns_steps=5)``.
- ``muon_same``: ``MuonOptimizer(method="polar_express", ns_steps=8, ns_dtype=torch.float32)`` —
  Muon with SSO's own msign, so the ratio isolates what SSO adds over Muon.
- ``sso``: ``SpectralSphereOptimizer`` defaults.
- ``sso_classic``: ``SpectralSphereOptimizer(lambda_model=False)`` (bracket and Illinois solver).
- ``muon_sphere``: ``SpectralSphereOptimizer(muon_sphere=True)`` (retraction, λ = 0).
- ``sso_bf16`` / ``muon_sphere_bf16``: SSO / MuonSphere with Muon's default msign (Keller's
  quintic, 5 steps) in bf16 and, for SSO, ``tol=5e-3`` (tangency only to bf16 accuracy).
- ``sso_spectral``: ``SpectralSphereOptimizer(direction="spectral")`` (λ* and Φ from an
  eigendecomposition, no Newton–Schulz iteration).

Parameters and a base gradient come from :func:`muon_fn.tools.bench.real_gradients`; each round every
row gets the same gradient ``g_real + ξ`` with fresh Gaussian ξ of the same Frobenius norm
(stochastic-gradient-like, so M̂ changes every step). Warm-up rounds (the first compiles the
compiled rows) are timed apart; the ratios are paired over the timed rounds.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from typing import Any
from collections.abc import Callable, Sequence

import torch

from muon_fn import MuonOptimizer, SpectralSphereOptimizer
from muon_fn.core import spectral
from muon_fn.orthogonalization import DEFAULT_METHOD, default_steps
from ._problem import MATRIX_NAMES, check_size, real_gradients
from ._timing import Threads, check_threads, paired_ratio, paired_rounds, using_threads

Factory = Callable[[list[torch.nn.Parameter], bool], torch.optim.Optimizer]  # (params, compile)
_BF16_MSIGN = dict(msign_method=DEFAULT_METHOD, msign_steps=default_steps(DEFAULT_METHOD), msign_dtype=torch.bfloat16)

SSO_ROWS: dict[str, Factory] = {
    "muon": lambda ps, c: MuonOptimizer(ps, lr=0.02, compile=c),
    "muon_pe5": lambda ps, c: MuonOptimizer(ps, lr=0.02, method="polar_express", ns_steps=5, compile=c),
    "muon_same": lambda ps, c: MuonOptimizer(ps, lr=0.02, method="polar_express", ns_steps=8,
                                             ns_dtype=torch.float32, compile=c),
    "sso": lambda ps, c: SpectralSphereOptimizer(ps, lr=0.02, compile=c),
    "sso_classic": lambda ps, c: SpectralSphereOptimizer(ps, lr=0.02, lambda_model=False, compile=c),
    "muon_sphere": lambda ps, c: SpectralSphereOptimizer(ps, lr=0.02, muon_sphere=True, compile=c),
    "sso_spectral": lambda ps, c: SpectralSphereOptimizer(ps, lr=0.02, direction="spectral", compile=c),
    "sso_bf16": lambda ps, c: SpectralSphereOptimizer(ps, lr=0.02, tol=5e-3, compile=c, **_BF16_MSIGN),
    "muon_sphere_bf16": lambda ps, c: SpectralSphereOptimizer(ps, lr=0.02, muon_sphere=True, compile=c,
                                                              **_BF16_MSIGN),
}
SSO_DEFAULT_ROWS = ("muon", "muon_same", "sso")


def check_sso_args(layers: int, rounds: int, warmup: int, rows: Sequence[str], threads: Threads = 1) -> None:
    """Raise ``ValueError`` for arguments :func:`benchmark_sso` cannot use (before any work)."""
    for r in rows:
        if r not in SSO_ROWS:
            raise ValueError(f"Invalid row: {r!r} (valid: {', '.join(SSO_ROWS)})")
    if "muon" not in rows:
        raise ValueError("Invalid rows: must include 'muon' (the reference of every ratio)")
    check_size("gpt2-small", layers)
    for name, value, low in (("rounds", rounds, 1), ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"Invalid {name}: {value!r} (expected an integer >= {low})")
    check_threads(threads)


def benchmark_sso(layers: int = 12, rounds: int = 5, warmup: int = 1, rows: Sequence[str] = SSO_DEFAULT_ROWS,
                  *, seed: int = 0, sigma: bool = False, compile: bool = True, threads: Threads = 1,
                  log: Callable[[str], None] = print) -> dict[str, Any]:
    """Paired rounds over ``rows`` on the first ``layers`` layers of the gpt2-small set.

    ``sigma``: also compare each SSO row's σ(W) estimate with the exact σ (an SVD per matrix
    per round, untimed). ``compile``: the optimizers' ``compile`` option. ``log`` gets one line
    per round. Returns medians, per-round ratios (to ``muon`` and ``muon_same``), the warm-up
    rounds' times, and per SSO row the solver's statistics over the timed rounds.
    """
    check_sso_args(layers, rounds, warmup, rows, threads)
    rows = list(rows)
    with using_threads(threads) as n_threads:
        t0 = time.perf_counter()
        params0, grad0, _ = real_gradients("gpt2-small", layers=layers, seed=seed)
        copies = {r: [torch.nn.Parameter(p.detach().clone()) for p in params0] for r in rows}
        opts = {r: SSO_ROWS[r](copies[r], compile) for r in rows}
        stats = _SolverStats([r for r in rows if r.startswith("sso")], sigma)
        noisy = _NoisyGradients(grad0, torch.Generator().manual_seed(seed + 1))
        line: list[str] = []

        def before_row(r: str, k: int) -> None:
            for p, g in zip(copies[r], noisy.grads):
                p.grad = g.clone()
            stats.before(r, copies[r], k >= warmup)

        def after_row(r: str, k: int, seconds: float) -> None:
            stats.after(r, opts[r], k >= warmup)
            line.append(f"{r} {seconds:.2f}s")
            if len(line) == len(rows):
                log(f"round {k}{' (warm-up)' if k < warmup else ''}: " + ", ".join(line))
                line.clear()

        times = paired_rounds(rows, lambda r: opts[r].step(), warmup + rounds, device=torch.device("cpu"),
                              before_round=noisy.draw, before_row=before_row, after_row=after_row)
        timed = {r: t[warmup:] for r, t in times.items()}
        return {
            "layers": layers, "matrices": len(MATRIX_NAMES) * layers, "rounds": rounds, "warmup": warmup,
            "threads": n_threads, "compile": compile, "wall_s": time.perf_counter() - t0,
            "warmup_step_s": {r: t[:warmup] for r, t in times.items()},
            "median_step_s": {r: statistics.median(t) for r, t in timed.items()},
            "ratios": {f"{a}/{b}": paired_ratio(timed[a], timed[b]) for b in ("muon", "muon_same") if b in rows
                       for a in rows if a not in ("muon", b)},
            "solver": stats.result(),
        }


class _NoisyGradients:
    """Each round: the real gradient plus fresh Gaussian noise of its Frobenius norm."""

    def __init__(self, base: list[torch.Tensor], gen: torch.Generator) -> None:
        self.base, self.gen, self.grads = base, gen, base

    def draw(self, _round: int) -> None:
        self.grads = []
        for g in self.base:
            xi = torch.randn(g.shape, generator=self.gen)
            self.grads.append(g + xi * (torch.linalg.matrix_norm(g) / torch.linalg.matrix_norm(xi)))


class _SolverStats:
    """Per SSO row over the timed rounds: msign calls per matrix-step, the largest tangency
    residual, fallbacks, and (with ``sigma``) the σ estimate's relative error."""

    def __init__(self, rows: list[str], sigma: bool) -> None:
        self.hist = {r: Counter() for r in rows}
        self.residual_max = dict.fromkeys(rows, 0.0)
        self.fallbacks = dict.fromkeys(rows, 0)
        self.sigma_error: dict[str, list[float]] | None = {r: [] for r in rows} if sigma else None
        self.exact: list[float] = []

    def before(self, row: str, params: list[torch.Tensor], timed: bool) -> None:
        if self.sigma_error is not None and row in self.hist and timed:
            self.exact = [float(spectral.compute_spectral_norm(p.detach())) for p in params]

    def after(self, row: str, opt: Any, timed: bool) -> None:
        if row not in self.hist or not timed:
            return
        st = opt.last_step_stats()
        self.hist[row].update(int(i) for i in st.iterations)
        self.residual_max[row] = max(self.residual_max[row], float(st.residual.max()))
        self.fallbacks[row] += int(st.fallback.sum())
        if self.sigma_error is not None:
            self.sigma_error[row] += [abs(float(s) / e - 1) for s, e in zip(st.sigma, self.exact)]

    def result(self) -> dict[str, dict[str, Any]]:
        out = {}
        for r, h in self.hist.items():
            out[r] = {"msigns_per_matrix_histogram": dict(sorted(h.items())),
                      "msigns_per_matrix_mean": sum(a * b for a, b in h.items()) / max(sum(h.values()), 1),
                      "residual_max": self.residual_max[r], "fallbacks": self.fallbacks[r]}
            if self.sigma_error is not None and self.sigma_error[r]:
                errors = self.sigma_error[r]
                out[r].update(sigma_rel_error_max=max(errors), sigma_rel_error_median=statistics.median(errors))
        return out


def format_sso_table(result: dict[str, Any]) -> str:
    """The human-readable summary of a :func:`benchmark_sso` result: median step per row, each
    ratio's median / min / max and per-round values, and the SSO rows' solver statistics."""
    lines = [f"gpt2-small matrix set, {result['layers']} layer(s) = {result['matrices']} matrices; "
             f"{result['warmup']} warm-up + {result['rounds']} paired rounds, {result['threads']} thread(s)",
             f"{'row':<18}{'median s/step':>14}"]
    lines += [f"{r:<18}{t:>14.3f}" for r, t in result["median_step_s"].items()]
    lines.append(f"{'ratio':<24}{'median':>8}{'min':>8}{'max':>8}  per round")
    for name, q in result["ratios"].items():
        rounds = " ".join(f"{x:.3f}" for x in q["per_round"])
        lines.append(f"{name:<24}{q['median']:>8.3f}{q['min']:>8.3f}{q['max']:>8.3f}  {rounds}")
    for r, st in result["solver"].items():
        hist = ", ".join(f"{k}: {v}" for k, v in st["msigns_per_matrix_histogram"].items())
        line = (f"{r}: msigns per matrix-step {{{hist}}} (mean {st['msigns_per_matrix_mean']:.2f}), "
                f"max |h| {st['residual_max']:.1e}, fallbacks {st['fallbacks']}")
        if "sigma_rel_error_max" in st:
            line += f", σ estimate rel. error max {st['sigma_rel_error_max']:.1e}"
        lines.append(line)
    return "\n".join(lines)
