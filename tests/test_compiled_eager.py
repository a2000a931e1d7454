"""Compiled equals eager, for every optimizer class, with the compiler of the machine running it.

Each class runs twice on the same model from the same start with the same gradients for
``STEPS`` steps: compiled with the real default compiler (inductor, with ``verify=False`` so that
what is compared is the compiled graph itself, not :mod:`muon_fn.core.verify`'s fallback) and eagerly
(``compile=False``). Every parameter and every state tensor must then meet :mod:`muon_fn.core.verify`'s
bound, per tensor, ``‖compiled − eager‖ ≤ RELATIVE·‖eager − before‖ + ULPS·eps(dtype)·‖eager‖``
(0-d solver figures and counters: finite where eager's are; see :func:`deviations` for SSO's
power-iteration block), and the telemetry figures must agree loosely (:data:`FIGURE_RTOL`).

Two configurations per class (:data:`CONFIGS`): no telemetry with 32-bit state, and telemetry
with 8-bit state. Each has its own model (:data:`LAYOUTS`): tall (64×32), wide (32×64) and square
(24×24) matrices and a bias, with ``bucket_size=2``, so that one optimizer compiles buckets of 2
and of 1 matrix. Compiling dominates the cost, one graph per bucket kind, so the two layouts
share the kinds out: over both, every shape comes in a bucket of 1 and a bucket of 2, and the
tall bucket of 2 (the one the known miscompile broke) in both. The FSDP optimizers run the same
table in one spawned job at W = 2 (gloo).

This is the test that fails where the host's C++ compiler miscompiles a graph: GCC 11–12 with
AVX-512 and ``-mtune=generic`` (``-march=native`` on Intel Emerald Rapids) garbles inductor's bf16
tile transpose (docs/reports/inductor-cpu-bf16-transpose.md). ``TORCHINDUCTOR_CPP_MARCH=x86-64-v4
TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)`` reproduces that on the (AVX-512, GCC 12) development
machine: so run, a Newton–Schulz whose bf16 result the fused NorMuon kernel read transposed
failed this test for ``normuon``, ``hybrid`` and ``fsdp_normuon`` (tall matrices not finite),
and the current code passes. On a CPU without bf16 instructions the Muon classes iterate in fp32 (their
default there), so the bf16 paths are not compiled.

Cost: compiling dominates, a few seconds a graph (GCC), about 15 s more for a process's first.
The FSDP job compiles in the background while this process compiles the single-device table
(on pytest-xdist workers the two run on two workers).
Measured on the 2-core development machine, shared with other work (load 2 to 2.5),
``OMP_NUM_THREADS=1``: 155–190 s for the file with a cold inductor cache (the FSDP job alone:
57 s), 71 s with a warm one.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import muon_fn as mf
from muon_fn.core import verify as _verify

sys.path.insert(0, str(Path(__file__).parent))
from _ranks import assert_check, rank_main, start_job

pytestmark = [pytest.mark.inductor, pytest.mark.slow]  # the per-configuration compiled sweep

COMPILED = {"compile": {"backend": "inductor"}, "verify": False}  # conftest turns compile=True off
EAGER = {"compile": False}
STEPS = 3
BUCKET_SIZE = 2  # three matrices of a shape: a bucket of 2 and a bucket of 1
# Tall and wide: multiples of 32, so inductor's bf16 32×32 tile transpose and whole vectors run
# (the known miscompile needs both: a 64×48 bucket ran inductor's scalar tail and was right);
# square: not a multiple of any vector width, so the masked tail loops run.
SHAPES = {"tall": (64, 32), "wide": (32, 64), "square": (24, 24)}
CONFIGS = {
    "plain": {"metrics": False, "state_bits": 32},
    "metrics_8bit": {"metrics": True, "state_bits": 8},
}
LAYOUTS = {  # matrices of each shape per configuration: 3 is a bucket of 2 and one of 1
    "plain": {"tall": 3, "wide": 2, "square": 2},
    "metrics_8bit": {"tall": 2, "wide": 1, "square": 1},  # its graphs compile slower: fewer
}
# Telemetry figures are computed inside the step's graph from its tensors, so compiled and eager
# differ as those do (measured: at most 1.1e-6 relative); loosely: _verify.RELATIVE, relative.
FIGURE_RTOL = _verify.RELATIVE
FIGURE_ATOL = 1e-6
# Figures of SSO's λ solver that rounding may change without changing the step (the residual is
# anywhere below the solver's tolerance: measured 4e-9 compiled, 1e-7 eager; an iteration more or
# less): finite where eager's are, like its 0-d state.
SOLVER_FIGURES = ("sso_residual", "sso_iterations", "sso_fallback")

CLASSES = ("muon", "normuon", "hybrid", "sso", "triton_muon", "triton_muon_w")
FSDP_CLASSES = ("fsdp_normuon", "fsdp_sso")


class Net(nn.Module):
    """The matrices of ``layout`` (``{shape: count}``, flat attributes: ``fully_shard`` takes no
    ModuleList) and a bias (AdamW)."""

    def __init__(self, layout: dict[str, int]) -> None:
        super().__init__()
        torch.manual_seed(0)
        for kind, count in layout.items():
            rows, cols = SHAPES[kind]
            for i in range(count):
                setattr(self, f"{kind}{i}", nn.Linear(cols, rows, bias=False))
        self.bias = nn.Parameter(torch.randn(16) * 0.1)


def build(name: str, net: nn.Module, **kw) -> torch.optim.Optimizer:
    """The optimizer class ``name`` over ``net``, ``bucket_size=BUCKET_SIZE`` and ``kw``."""
    kw = {"bucket_size": BUCKET_SIZE, **kw}
    if name == "muon":
        return mf.MuonOptimizer(net.named_parameters(), **kw)
    if name == "normuon":
        return mf.MuonOptimizer(net.named_parameters(), beta2=0.95, **kw)
    if name == "hybrid":
        return mf.create_hybrid_optimizer(net, **kw)  # NorMuon + AdamW: its default recipe
    if name == "sso":
        return mf.SpectralSphereOptimizer(net.named_parameters(), **kw)
    if name == "triton_muon":
        return mf.TritonMuon(net.named_parameters(), **kw)
    if name == "triton_muon_w":
        return mf.TritonMuonW(net.named_parameters(), **kw)
    if name == "fsdp_normuon":  # the FSDP recipe the known miscompile broke
        from muon_fn.fsdp import FSDPMuonOptimizer

        return FSDPMuonOptimizer(net, beta2=0.95, **kw)
    if name == "fsdp_sso":
        from muon_fn.fsdp import FSDPSpectralSphereOptimizer

        return FSDPSpectralSphereOptimizer(net, **kw)
    raise AssertionError(name)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (the tensor itself otherwise), detached."""
    return (t.to_local() if hasattr(t, "to_local") else t).detach()


def run(name: str, config: str, options: dict, shard=None) -> tuple[dict, dict, dict, dict]:
    """``STEPS`` steps of class ``name`` in ``config``: parameters before and after, state after
    (``{"<param>.<key>": tensor}``) and the last step's figures."""
    from test_fsdp import set_grads  # the same gradients everywhere; a shard gets its rows

    net = Net(LAYOUTS[config])
    if shard is not None:
        net = shard(net)
    before = {n: local(p).clone() for n, p in net.named_parameters()}
    opt = build(name, net, **CONFIGS[config], **options)
    for step in range(STEPS):
        set_grads(net, step)
        opt.step()
    params = {n: local(p).clone() for n, p in net.named_parameters()}
    names = {id(p): n for n, p in net.named_parameters()}
    state = {
        f"{names[id(p)]}.{k}": local(v).clone()
        for p, st in opt.state.items()
        for k, v in st.items()
        if isinstance(v, torch.Tensor)
    }
    return before, params, state, opt.metrics()


def deviations(name: str, config: str, shard=None) -> list[str]:
    """Every tensor and figure where the compiled run of ``name`` leaves eager's bound."""
    before, params, state, figures = run(name, config, COMPILED, shard)
    _, eager_params, eager_state, eager_figures = run(name, config, EAGER, shard)
    assert params.keys() == eager_params.keys(), sorted(params.keys() ^ eager_params.keys())
    assert state.keys() == eager_state.keys(), sorted(state.keys() ^ eager_state.keys())
    bad = []
    for key in params:
        bad += unbounded(f"parameter {key}", params[key], eager_params[key], before[key])
    for key in state:
        got, expected = state[key], eager_state[key]
        if key.endswith(".sso_v"):
            # SSO's warm-start block: its first column is the top right singular vector that σ and
            # the tangent direction come from; the other columns span near-equal singular values,
            # where rounding rotates them or flips a sign (measured: up to 2x a column's norm, while
            # the first column was within 1.3e-6 of eager's and every parameter at 1e-5 of its
            # tolerance). They must be finite.
            if not torch.equal(got.isfinite(), expected.isfinite()):
                bad.append(f"state {key}: not finite where eager's is (or the other way round)")
            got, expected = got[..., :1], expected[..., :1]
        bad += unbounded(
            f"state {key}", got, expected
        )  # no "before": the change is the state's size
    figures, eager_figures = by_figure(figures), by_figure(eager_figures)
    assert figures.keys() == eager_figures.keys(), sorted(figures.keys() ^ eager_figures.keys())
    for key, value in figures.items():
        expected = eager_figures[key]
        if key.split("/")[-1].startswith(SOLVER_FIGURES):  # a figure or its maximum
            close = math.isfinite(value) == math.isfinite(expected)
        else:
            close = math.isclose(value, expected, rel_tol=FIGURE_RTOL, abs_tol=FIGURE_ATOL)
        if not close:
            bad.append(f"figure {key}: {value:.6g} compiled, {expected:.6g} eager")
    return bad


def unbounded(
    what: str, got: torch.Tensor, expected: torch.Tensor, before: torch.Tensor | None = None
) -> list[str]:
    """``[what and how]`` if ``got`` is outside :func:`muon_fn.core.verify.compare`'s bound, else ``[]``."""
    verdict = _verify.compare(got, expected, before)
    return [] if verdict.ok else [f"{what}: {verdict.detail} ({verdict.worst:.3g}x the tolerance)"]


def by_figure(figures: dict[str, float]) -> dict[str, float]:
    """``figures`` without the parameter named after ``@`` in a key (which of near-equal values is
    the largest may differ); the value is compared."""
    return {key.split("@")[0]: value for key, value in figures.items()}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("name", CLASSES)
def test_compiled_equals_eager(name, config):
    bad = deviations(name, config)
    assert not bad, f"{name} ({config}) compiled with inductor leaves eager's bound:\n" + "\n".join(
        bad
    )


# ------------------------------------------------------------------------------------------- FSDP
# The job starts with the module's first test and compiles in the background while this process
# compiles the table above (which keeps one core busy): on 2 cores the two overlap.
JOB_TIMEOUT_S = 600  # from its start, while the table above runs (measured: 57 s alone, cold)


def _fsdp_check(name: str, config: str):
    def check():
        from test_fsdp import shard

        bad = deviations(name, config, shard)
        assert not bad, (
            f"{name} ({config}) compiled with inductor leaves eager's bound on this rank:\n"
            + "\n".join(bad)
        )

    return check


def checks() -> dict:
    return {
        f"{name}_{config}": _fsdp_check(name, config) for name in FSDP_CLASSES for config in CONFIGS
    }


def _start(tmp_path_factory):
    return start_job(__file__, 2, tmp_path_factory.mktemp("compiled_eager_fsdp"), JOB_TIMEOUT_S)


@pytest.fixture(scope="module", autouse=True)
def fsdp_job(request, tmp_path_factory):
    """The W = 2 job, started with the module's first test if any of its tests is selected
    (stopped at the end if its results were never read). On a pytest-xdist worker it starts with
    its first test instead: every worker collects every test, the job's tests run on the spawned
    process groups' worker (conftest's ``--dist loadgroup``), and a job started beside the table
    on another worker would run twice."""
    if os.environ.get("PYTEST_XDIST_WORKER") or not any(
        item.module is request.module and "fsdp_results" in item.fixturenames
        for item in request.session.items
    ):
        yield None
        return
    results = _start(tmp_path_factory)
    yield results
    results(stop=True)


@pytest.fixture(scope="module")
def fsdp_results(fsdp_job, tmp_path_factory):
    return (fsdp_job or _start(tmp_path_factory))()


@pytest.mark.distributed
@pytest.mark.parametrize("check", list(checks()))
def test_fsdp_compiled_equals_eager_w2(fsdp_results, check):
    assert_check(fsdp_results, 2, check)


if __name__ == "__main__":  # one rank of a job: W RANK OUT
    rank_main(lambda w: checks())
