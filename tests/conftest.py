"""Shared test settings: one OpenMP thread, hypothesis profiles, a clean Dynamo cache per test."""

from __future__ import annotations

import io
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
# The adapters compile by default; most tests check behaviour, not compilation, and run eagerly.
# Tests of the compiled default use the ``compiled_default`` fixture (or pass compile options).
os.environ.setdefault("MUON_FN_COMPILE", "0")

import pytest
import torch
from hypothesis import HealthCheck, settings

torch.set_num_threads(1)

# "ci" is the default (and what .ci/run uses): bounded, derandomized, no deadline (CPU jitter).
settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# "dev": more examples, random seeds; `HYPOTHESIS_PROFILE=dev pytest`.
settings.register_profile(
    "dev",
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# The device lane (tests/test_device_lane.py and every test taking the ``device`` fixture): the CPU
# always, CUDA where a GPU is present. MUON_FN_DEVICES=cuda runs the lane on the GPU only
# (.ci/gpu-lane); MUON_FN_DEVICES=cpu,cuda both.
def _lane_devices() -> list[str]:
    wanted = os.environ.get("MUON_FN_DEVICES")
    if wanted:
        return [d.strip() for d in wanted.split(",") if d.strip()]
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


DEVICES = _lane_devices()


# Two tiers. The fast tier (the README's ``pytest -q``: unit, property, eager and a representative
# set of compiled tests) is the default. The full tier adds what costs seconds to minutes a test:
# the spawned process groups (``distributed``), the example trainings, the compile-cache
# subprocesses and the per-configuration compiled sweeps (``slow``). ``--tier full`` (or
# MUON_FN_TIER=full) runs both; ``--tier slow`` only what the fast tier leaves out (CI runs the two
# halves one after the other). Without ``--tier``, a run that names test files or node ids
# (``pytest tests/test_fsdp.py``) runs them whole.
TIERS = ("fast", "full", "slow")


def pytest_addoption(parser):
    parser.addoption(
        "--tier",
        choices=TIERS,
        default=None,
        help="fast (the default): the quick tier; full: everything; slow: the full tier "
        "less the fast one. Default: MUON_FN_TIER, else full when test files or "
        "node ids are named, else fast",
    )


def _named(config) -> bool:
    """Whether the command line names test files or node ids (not only directories)."""
    return any("::" in arg or arg.split("::")[0].endswith(".py") for arg in config.args)


def _tier(config) -> str:
    chosen = config.getoption("--tier") or os.environ.get("MUON_FN_TIER")
    if chosen:
        if chosen not in TIERS:
            raise pytest.UsageError(f"MUON_FN_TIER={chosen!r}: expected one of {', '.join(TIERS)}")
        return chosen
    return "full" if _named(config) else "fast"


MAX_WORKERS = 8


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pyproject's addopts): one pytest-xdist worker per usable CPU, at most
    MAX_WORKERS (each runs one thread: OMP_NUM_THREADS=1); none when test files or node ids are
    named, where starting workers costs more than it saves. PYTEST_XDIST_AUTO_NUM_WORKERS (or
    ``-n N``) chooses otherwise."""
    chosen = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS")
    if chosen:
        return int(chosen)
    return 0 if _named(config) else min(MAX_WORKERS, len(os.sched_getaffinity(0)))


# Cases of a parametrized test that cost seconds (a compile, SSO's solver, bf16 on a CPU without bf16
# GEMMs) where the test's other cases are quick: full tier.
SLOW_CASES = frozenset(
    {
        "tests/test_optim.py::test_step_never_modifies_grads[cpu-compiled]",
        "tests/test_optim.py::test_copied_optimizer_steps_like_the_original[deepcopy-normuon-compiled]",
        "tests/test_optim.py::test_copied_optimizer_steps_like_the_original[pickle-normuon-compiled]",
        "tests/test_optim_apply.py::test_bf16_params[momentum_dtype1]",
        "tests/test_optim_conventions.py::test_inputs_go_the_right_direction[SpectralSphereOptimizer]",
        "tests/test_optim_conventions.py::test_inputs_go_the_right_direction[FSDPSpectralSphereOptimizer]",
        "tests/test_qk_clip.py::test_step_reads_nothing_back[cpu-compiled-muon]",
        "tests/test_quantize.py::test_every_class[SpectralSphereOptimizer]",
        "tests/test_schedules.py::test_aol9_no_worse_than_torch_quintic_on_every_real_tiny_gradient[dtype0]",
    }
)


def _full_tier_only(item) -> bool:
    return (
        item.get_closest_marker("slow") is not None
        or item.get_closest_marker("distributed") is not None
        or item.nodeid in SLOW_CASES
    )


def _select_tier(config, items) -> None:
    tier = _tier(config)
    if tier == "full":
        return
    keep, drop = [], []
    for item in items:
        (drop if _full_tier_only(item) == (tier == "fast") else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_report_header(config):
    return f"muon_fn test tier: {_tier(config)} (--tier fast|full|slow)"


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's worker reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    """Every test that takes the ``device`` fixture is in the lane: ``pytest -m lane`` selects
    them (.ci/gpu-lane runs them with MUON_FN_DEVICES=cuda). Then the tier's tests are kept."""
    for item in items:
        if "device" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.lane)
        _group(item)
    _select_tier(config, items)


def _group(item) -> None:
    """The pytest-xdist group of a full-tier test (``--dist loadgroup``): every spawned process
    group in one worker, one after another (two at once would oversubscribe the CPUs that each
    already fills, against its timeouts), and each other slow module's tests in one worker, so
    that its module-scoped fixture (an example's training, a compiled sweep) runs once."""
    if item.get_closest_marker("distributed") is not None:
        item.add_marker(pytest.mark.xdist_group("spawn"))
    elif _full_tier_only(item):
        item.add_marker(pytest.mark.xdist_group(item.module.__name__))


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    """Each device of the lane in turn (skipped where it is absent)."""
    dev = torch.device(request.param)
    if dev.type == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    return dev


@pytest.fixture(autouse=True)
def _reset_dynamo():
    torch._dynamo.reset()
    yield


@pytest.fixture
def compiled_default(monkeypatch):
    """The adapters' real default: compiled with inductor."""
    monkeypatch.setenv("MUON_FN_COMPILE", "1")


def roundtrip(obj, map_location=None):
    """``obj`` through ``torch.save`` and ``torch.load(weights_only=True)``, as a checkpoint travels
    (``map_location`` as torch.load's)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, map_location=map_location, weights_only=True)


def read_on_cpu(obj):
    """A checkpoint written on the device and read on the CPU (``torch.load(map_location="cpu")``);
    ``load_state_dict`` moves its state to the parameters' device."""
    return roundtrip(obj, map_location="cpu")


# Hypothesis settings for a @given test that takes the ``device`` fixture (function-scoped, but a
# torch.device: the same, immutable value for every example).
lane_examples = settings(
    suppress_health_check=[
        *settings.default.suppress_health_check,
        HealthCheck.function_scoped_fixture,
    ]
)
