"""One process of the compile-cache tests (tests/test_compile_cache.py).

``python tests/_compile_cache_child.py ROUND OUT DEVICE CASE [CASE ...]``

Each case compiles one update twice in a row, each time with another value of one float
hyperparameter (``ROUND`` "first": values 0 then 1; "second": 1 then 0), and this
writes to ``OUT`` (JSON), per case and value, the compiled update's distance from eager,
``max|compiled − eager| / max|eager|`` over the update of a state one eager step old (a transform)
or over two steps (an optimizer), and the AOTAutograd cache's hits and misses. The caller runs
both rounds in two processes that share one ``TORCHINDUCTOR_CACHE_DIR``. Inputs are drawn on the
CPU and moved to ``DEVICE``. Everything runs in float64, the iteration too (the
transforms' fp32 step counters and NorMuon's fp32 second moment round at about 1e-7), so a stale
constant shows as an error of order one.

Each case starts from a fresh Dynamo state (``torch._dynamo.reset()``): Dynamo keeps what it
learned about a function's inputs per code object, and cases of one transform share its code.
One float varies per compiled graph: torch's stale graph needs a single symbolic float in it
(measured on torch 2.13: varying β₁ and β₂ of one Adam together, or β₂ of Adam and of NorMuon's
rows in one graph, compiled correctly even with the old options). An optimizer compiles a graph
per algorithm, so it varies one float of its matrix half and one of its AdamW half.

A case named ``legacy:<case>`` compiles with torch.compile's default ``dynamic`` (automatic
dynamic: what muon_fn did before it passed ``dynamic=False``), to show that the harness sees the
stale graph where this torch serves one.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import muon_fn as mf

F64 = torch.float64
# The second process compiles the first's two values in the other order: with dynamic=False both
# are warm (an FX graph and AOTAutograd cache hit each, no cold compile); with automatic dynamic
# its second compile turns the float symbolic and is served the first process's symbolic graph,
# which burned in value 1, for value 0 (measured on torch 2.13: the legacy case's distance 0.86).
ROUNDS = {"first": (0, 1), "second": (1, 0)}

# Two values of each float, chosen so that each changes the update visibly.
MOMENTUM = (0.9, 0.5)
BETA1 = (0.9, 0.8)
BETA2 = (0.95, 0.999)
EPS = (1e-3, 3e-3)  # large enough to matter next to the gradients below
DECAY = (0.1, 0.3)
LR = (0.1, 0.05)
STEPSIZE = (1.0, 0.7)
COEFFICIENTS = ((3.4445, -4.7750, 2.0315), (1.875, -1.25, 0.375))
RADIUS = (2.0, 1.5)
ALPHA = (0.05, 0.2)
TOL = (2e-4, 1e-3)
ORTH = {"dtype": F64}
SPHERE = {"retract_mode": "dynamic", "msign_dtype": F64}

# Every public transform's float hyperparameters: (values, value -> transform, scale of the input).
TRANSFORMS: dict[str, tuple[tuple, Callable[[Any], mf.GradientTransformation], float]] = {
    "momentum(momentum)": (MOMENTUM, lambda x: mf.momentum(x), 1.0),
    "momentum(momentum, kind='ema')": (MOMENTUM, lambda x: mf.momentum(x, kind="ema"), 1.0),
    "scale_by_adam(betas[0])": (BETA1, lambda x: mf.scale_by_adam((x, 0.999), 1e-3), 1.0),
    "scale_by_adam(betas[1])": (BETA2, lambda x: mf.scale_by_adam((0.9, x), 1e-3), 1.0),
    "scale_by_adam(eps)": (EPS, lambda x: mf.scale_by_adam((0.9, 0.999), x), 1e-2),
    "add_decoupled_weight_decay(weight_decay)": (
        DECAY,
        lambda x: mf.chain(mf.add_decoupled_weight_decay(x), mf.scale_by_learning_rate(0.1)),
        1.0,
    ),
    "scale_by_learning_rate(lr)": (LR, lambda x: mf.scale_by_learning_rate(x), 1.0),
    "normalize_layerwise(eps)": (
        tuple(10 * e for e in EPS),
        lambda x: mf.normalize_layerwise(x, add_eps=True),
        1e-2,
    ),
    "orthogonalize(coefficients)": (
        COEFFICIENTS,
        lambda x: mf.orthogonalize(coefficients=x, **ORTH),
        1.0,
    ),
    "orthogonalize(stepsize)": (STEPSIZE, lambda x: mf.orthogonalize(stepsize=x, **ORTH), 1.0),
    "orthogonalize(eps)": (EPS, lambda x: mf.orthogonalize(eps=x, **ORTH), 1e-3),
    "normalize_rows(beta2)": (
        BETA2,
        lambda x: mf.chain(mf.orthogonalize(**ORTH), mf.normalize_rows(x)),
        1.0,
    ),
    "normalize_rows(eps)": (
        EPS,
        lambda x: mf.chain(mf.orthogonalize(**ORTH), mf.normalize_rows(0.95, x * 10)),
        1.0,
    ),
    "spectral_sphere(lr)": (LR, lambda x: mf.spectral_sphere(x, **SPHERE), 1.0),
    "spectral_sphere(radius_scale)": (
        RADIUS,
        lambda x: mf.spectral_sphere(0.1, radius_scale=x, **SPHERE),
        1.0,
    ),
    "spectral_sphere(retract_alpha)": (
        ALPHA,
        lambda x: mf.spectral_sphere(0.1, retract_alpha=x, **SPHERE),
        1.0,
    ),
    "spectral_sphere(tol)": (TOL, lambda x: mf.spectral_sphere(0.1, tol=x, **SPHERE), 1.0),
}


DEVICE = torch.device("cpu")  # set by main


def _matrix(seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(6, 4, dtype=F64, generator=torch.Generator().manual_seed(seed)) * scale).to(
        DEVICE
    )


def _raw_compile(tx: mf.GradientTransformation) -> mf.GradientTransformation:
    """torch.compile's own defaults (automatic dynamic), as muon_fn compiled before."""
    return mf.GradientTransformation(tx.init, torch.compile(tx.update, fullgraph=True))


def transform(name: str, v: int, legacy: bool = False) -> dict[str, float]:
    values, build, scale = TRANSFORMS[name]
    tx = build(values[v])
    params = (_matrix(1),)
    state = tx.init(params)
    _, state = tx.update((_matrix(2, scale),), state, params)  # a real state: every float matters
    grads = (_matrix(3, scale),)
    eager, _ = tx.update(grads, state, params)
    compiled, _ = (_raw_compile if legacy else mf.compile_update)(tx).update(grads, state, params)
    return {"update": _distance(compiled, eager)}


# ----------------------------------------------------------------------------- the optimizers
class _LM(nn.Module):
    """One matrix shape and one vector shape: the fewest graphs (each optimizer compiles one per
    bucket signature and algorithm), with an embedding and a head for the hybrid's AdamW half."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 8)
        self.fc = nn.Linear(8, 8)
        self.proj = nn.Linear(8, 8, bias=False)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 8, bias=False)


def _adamw(v: int, key: str = "adamw_betas") -> dict[str, Any]:
    """The AdamW half's settings with one float (``key``) at value ``v``."""
    settings = dict(
        adamw_betas=(0.9, BETA2[0]),
        adamw_eps=EPS[0],
        adamw_weight_decay=DECAY[0],
        adamw_decay_1d=True,
    )
    settings[key] = (0.9, BETA2[v]) if key == "adamw_betas" else EPS[v]
    return settings


def _fsdp(name: str) -> type:
    from muon_fn import fsdp

    return getattr(fsdp, name)


# Each optimizer varies one float of its matrix half and one of its AdamW half (one per graph);
# built with (model, value, compile=...).
OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "MuonOptimizer(ns_stepsize, adamw_betas)": lambda model, v, **kw: mf.MuonOptimizer(
        model.parameters(), ns_stepsize=STEPSIZE[v], ns_dtype=F64, **_adamw(v), **kw
    ),
    "MuonOptimizer(beta2, adamw_eps)": lambda model, v, **kw: mf.MuonOptimizer(
        model.parameters(), beta2=BETA2[v], ns_dtype=F64, **_adamw(v, "adamw_eps"), **kw
    ),
    "create_hybrid_optimizer(muon_weight_decay, adamw_betas)": lambda model, v, **kw: (
        mf.create_hybrid_optimizer(
            model, muon_weight_decay=DECAY[v], adamw_betas=(0.9, BETA2[v]), ns_dtype=F64, **kw
        )
    ),
    "SpectralSphereOptimizer(radius_scale, adamw_betas)": lambda model, v, **kw: (
        mf.SpectralSphereOptimizer(
            model.parameters(), radius_scale=RADIUS[v], msign_dtype=F64, **_adamw(v), **kw
        )
    ),
    "TritonMuon(velocity)": lambda model, v, **kw: mf.TritonMuon(
        model.parameters(), velocity=BETA2[v], **kw
    ),
    "TritonMuonW(weight_decay)": lambda model, v, **kw: mf.TritonMuonW(
        model.parameters(), weight_decay=DECAY[v], **kw
    ),
    "FSDPMuonOptimizer(ns_stepsize, adamw_betas)": lambda model, v, **kw: _fsdp(
        "FSDPMuonOptimizer"
    )(model, ns_stepsize=STEPSIZE[v], ns_dtype=F64, **_adamw(v), **kw),
    "FSDPSpectralSphereOptimizer(radius_scale, adamw_betas)": lambda model, v, **kw: _fsdp(
        "FSDPSpectralSphereOptimizer"
    )(model, radius_scale=RADIUS[v], msign_dtype=F64, **_adamw(v), **kw),
}


def optimizer(name: str, v: int) -> dict[str, float]:
    """Two steps of the compiled optimizer against its eager twin: each step's distance."""
    torch.manual_seed(0)
    model = _LM().to(device=DEVICE, dtype=F64)
    twin = copy.deepcopy(model)
    opt, eager = OPTIMIZERS[name](model, v, compile=True), OPTIMIZERS[name](twin, v, compile=False)
    out = {}
    for step in (1, 2):
        before = [p.detach().clone() for p in model.parameters()]
        g = torch.Generator().manual_seed(step)
        for p, q in zip(model.parameters(), twin.parameters()):
            p.grad = torch.randn(p.shape, dtype=F64, generator=g).to(DEVICE)
            q.grad = p.grad.clone()
        opt.step()
        eager.step()
        out[f"step {step}"] = max(
            _distance(p.detach() - b, q.detach() - b)
            for p, q, b in zip(model.parameters(), twin.parameters(), before)
        )
    return out


# ----------------------------------------------------------------------------- driver
def _distance(compiled: Any, eager: Any) -> float:
    pairs = zip(mf.core.tree.tree_leaves(compiled), mf.core.tree.tree_leaves(eager))
    return max(float((c - e).abs().max() / e.abs().max().clamp_min(1e-300)) for c, e in pairs)


def _counted(run: Callable[[str, int], dict[str, float]], case: str, v: int) -> dict[str, Any]:
    """``{"distance": run(case, v), "cache": {"hit": h, "miss": m}}``: the distances and the
    AOTAutograd cache lookups the case's compiles made (none where Dynamo reused a graph this
    process had compiled for an equal update)."""
    from torch._dynamo.utils import counters

    before = dict(counters["aot_autograd"])
    distance = run(case, v)
    cache = {
        k: counters["aot_autograd"][f"autograd_cache_{k}"] - before.get(f"autograd_cache_{k}", 0)
        for k in ("hit", "miss")
    }
    return {"distance": distance, "cache": cache}


def run(case: str, v: int) -> dict[str, float]:
    if case in OPTIMIZERS:
        return optimizer(case, v)
    legacy = case.startswith("legacy:")
    return transform(case.removeprefix("legacy:"), v, legacy)


def main(argv: list[str]) -> None:
    global DEVICE
    round_, out, DEVICE, cases = argv[0], argv[1], torch.device(argv[2]), argv[3:]
    # Set here, not at import: tests/test_compile_cache.py imports this module for its case
    # names, and the rest of the suite runs eagerly on its threads.
    os.environ["MUON_FN_COMPILE"] = "1"
    torch.set_num_threads(1)
    results = {}
    for case in cases:
        torch._dynamo.reset()  # each case from a fresh Dynamo state (automatic dynamic is kept per code object)
        results[case] = {str(v): _counted(run, case, v) for v in ROUNDS[round_]}
    with open(out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
