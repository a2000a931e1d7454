"""A compiled graph is checked where it runs (``verify=True``, the default; muon_fn.core.verify).

Tested by injection, on any CPU: a compiler backend that writes NaN (or garbage) into what the
graph writes in place, as the GCC 12 miscompile did, or into what it returns (``atomic=True``).
The check must warn once, naming the graph and the compiler, leave the parameters as eager leaves
them, and run that signature eagerly
(or, for inductor, recompiled with safe options) from then on. One test runs a real miscompile
where the toolchain has it: inductor's bf16 tile transpose under ``-march=x86-64-v4`` on an
AVX-512 host with GCC 12 (``docs/reports/inductor-cpu-bf16-transpose.md``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import muon_fn as mf
from muon_fn.core import verify as _verify


def corrupting(value: float = float("nan")):
    """A torch.compile backend: the graph runs, then every floating tensor it wrote in place
    is overwritten with ``value`` (what a miscompiled kernel does to a parameter)."""

    def backend(gm, example_inputs):
        del example_inputs

        def run(*args):
            before = [
                a.clone() if isinstance(a, torch.Tensor) and a.is_floating_point() else None
                for a in args
            ]
            out = gm(*args)
            for a, b in zip(args, before):
                if b is not None and not torch.equal(a, b):
                    a.fill_(value)
            return out

        return run

    return backend


def corrupting_returns(value: float = float("nan")):
    """A torch.compile backend: the graph runs, then every floating tensor it returns is replaced
    by ``value`` (a miscompiled kernel whose output is returned, not written in place: what a
    graph of ``atomic=True`` hands to the step's commit)."""

    def backend(gm, example_inputs):
        del example_inputs

        def run(*args):
            out = gm(*args)
            return type(out)(
                torch.full_like(o, value)
                if isinstance(o, torch.Tensor) and o.is_floating_point()
                else o
                for o in out
            )

        return run

    return backend


def params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(24, 8), (24, 8), (8, 24), (16, 16), (24,)]
    return [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.1) for s in shapes]


def train(cls, steps: int = 3, **kw) -> tuple[list[torch.Tensor], torch.optim.Optimizer, list[str]]:
    ps = params()
    opt = cls(ps, **kw)
    gen = torch.Generator().manual_seed(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
    return [p.detach().clone() for p in ps], opt, [str(w.message) for w in caught]


CLASSES = [mf.MuonOptimizer, mf.TritonMuonW, mf.SpectralSphereOptimizer]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("value", [float("nan"), 1e3], ids=["nan", "garbage"])
@pytest.mark.slow
def test_a_wrong_graph_is_caught_and_training_goes_on_at_eager(cls, value):
    eager, _, _ = train(cls, compile=False)
    got, opt, notes = train(cls, compile={"backend": corrupting(value)})
    assert all(torch.equal(a, b) for a, b in zip(got, eager)), "not eager's result"
    wrong = [n for n in notes if "gave a wrong result on this machine" in n]
    assert wrong and all(
        f"{cls.__name__}'s step" in n and "runs eagerly" in n and "verify=False" in n for n in wrong
    ), notes
    # one warning per graph signature that failed, none at later steps
    steps = [s for v in opt._runtimes[0].variants for s in v.steps.values()]
    assert len(wrong) == sum(len(s.eager) for s in steps) >= 1


@pytest.mark.parametrize("cls", [mf.MuonOptimizer, mf.TritonMuonW], ids=lambda c: c.__name__)
def test_a_wrong_returned_value_is_caught(cls):
    """``atomic=True``: the graphs write nothing; they return the updates and new state that one
    commit writes after the last bucket. What a graph returns is checked as what it writes: a
    finite wrong value (the subtle case) is caught, and training goes on at eager's result."""
    eager, _, _ = train(cls, compile=False)
    got, _, notes = train(cls, compile={"backend": corrupting_returns(1e3)}, atomic=True)
    assert all(torch.equal(a, b) for a, b in zip(got, eager)), "not eager's result"
    wrong = [n for n in notes if "gave a wrong result on this machine" in n]
    assert wrong and all(f"{cls.__name__}'s step" in n and "runs eagerly" in n for n in wrong), (
        notes
    )


@pytest.mark.slow
def test_verify_false_trusts_the_graph():
    """The opt-out: no check, no warning; the corrupted graph's result is what the parameters get."""
    got, _, notes = train(mf.MuonOptimizer, compile={"backend": corrupting()}, verify=False)
    assert not [n for n in notes if "wrong result" in n]
    assert not all(bool(p.isfinite().all()) for p in got)


@pytest.mark.slow
def test_the_check_runs_once_per_signature(monkeypatch):
    calls = []
    real = _verify.first_run
    monkeypatch.setattr(_verify, "first_run", lambda *a, **k: calls.append(1) or real(*a, **k))
    _, opt, notes = train(mf.MuonOptimizer, steps=4, compile={"backend": "eager"})
    buckets = len(opt._runtimes[0].buckets)
    assert len(calls) == buckets and not [n for n in notes if "wrong result" in n]


@pytest.mark.slow
def test_a_skipped_first_step_is_checked_at_the_next():
    """A step skipped for a non-finite gradient writes nothing, so it compares nothing: the
    signature is checked at its next (applied) run, which catches the wrong graph."""
    eager, _, _ = train(mf.MuonOptimizer, compile=False, steps=2)
    ps = params()
    opt = mf.MuonOptimizer(ps, compile={"backend": corrupting()})
    gen = torch.Generator().manual_seed(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for p in ps:
            p.grad = torch.full(p.shape, float("nan"))
        opt.step()  # skipped: inconclusive
        for _ in range(2):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
    assert opt.nonfinite_steps == 1
    assert any("gave a wrong result" in str(w.message) for w in caught)
    assert all(torch.equal(p, q) for p, q in zip(ps, eager))


def test_the_bound_separates_rounding_from_a_fault():
    """The tolerance: rounding of a few fp32 ulps and the bf16 iteration's spread pass, a wrong
    update (scaled, zeroed, non-finite) does not."""
    gen = torch.Generator().manual_seed(0)
    before = torch.randn(64, 32, generator=gen)
    update = 0.02 * torch.randn(64, 32, generator=gen)
    after = before + update

    def verdict(got):
        return _verify.compare((got,), (after,), (before,))

    assert verdict(after).ok
    assert verdict(after + 1e-3 * update).ok  # the measured bf16 spread is below 1e-2 of the change
    assert verdict(after.nextafter(torch.full_like(after, float("inf")))).ok  # one ulp everywhere
    for wrong in (
        before,
        before + 0.8 * update,
        before + 1.2 * update,
        after.clone().fill_(float("nan")),
    ):
        assert not verdict(wrong).ok
    assert not _verify.compare((after,), (after,), (after,)).conclusive  # nothing changed


@pytest.mark.inductor
@pytest.mark.slow
def test_a_failed_inductor_graph_is_recompiled_with_safe_options(monkeypatch):
    """Inductor: the first failure recompiles with SAFE_CPU_OPTIONS and checks that graph too."""
    real = _verify.first_run
    failed = []

    def fail_once(compiled, eager, args, compared=None):
        if failed:
            return real(compiled, eager, args, compared)
        failed.append(1)

        def wrong(*a):  # the first inductor graph writes NaN into its parameters
            result = compiled(*a)
            for p in a[0]:
                p.fill_(float("nan"))
            return result

        return real(wrong, eager, args, compared)

    monkeypatch.setattr(_verify, "first_run", fail_once)
    eager, _, _ = train(mf.MuonOptimizer, compile=False, bucket_size=1)
    ps = params()
    opt = mf.MuonOptimizer(ps[:1], compile={"backend": "inductor"})
    gen = torch.Generator().manual_seed(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            grads = [torch.randn(p.shape, generator=gen) for p in ps]
            ps[0].grad = grads[0]
            opt.step()
    step = opt._runtimes[0].variants[0].steps[(True, False)]
    (key,) = step.compiled
    assert key in step.safe and key in step.checked and key not in step.eager
    notes = [str(w.message) for w in caught if "gave a wrong result" in str(w.message)]
    assert len(notes) == 1 and "cpp.simdlen=256" in notes[0]
    torch.testing.assert_close(ps[0].detach(), eager[0], rtol=1e-5, atol=1e-7)


_REAL_FAULT = textwrap.dedent("""
    import os, warnings, torch
    from muon_fn.core import compile as _compile
    torch.set_num_threads(1)
    def f(x, out):                      # the known bad kernel: bf16 read transposed, two nests
        for t, o in zip(x.unbind(0), out):
            o.copy_(t.mT.float())
    x = torch.randn(2, 128, 512).to(torch.bfloat16)
    ref = [torch.empty(512, 128) for _ in range(2)]
    f(x, ref)
    raw = [torch.empty(512, 128) for _ in range(2)]
    torch.compile(f, fullgraph=True, dynamic=False)(x, raw)
    wrong = not all(torch.equal(a, b) for a, b in zip(raw, ref))
    checked = _compile.PerSignature(f, {"fullgraph": True, "dynamic": False}, "the probe", verify=True)
    got = [torch.empty(512, 128) for _ in range(2)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checked("k", x, got)
    warned = any("gave a wrong result" in str(w.message) for w in caught)
    print(wrong, warned, all(torch.equal(a, b) for a, b in zip(got, ref)))
""")


@pytest.mark.inductor
@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() != "AVX512", reason="needs an AVX-512 CPU"
)
def test_the_real_miscompile_where_the_toolchain_has_it(tmp_path):
    """On an AVX-512 host whose GCC miscompiles the tile transpose under -mtune=generic (GCC 12:
    forced here by TORCHINDUCTOR_CPP_MARCH=x86-64-v4), the unchecked graph is wrong, the check
    warns and the result is eager's; where the toolchain is right, no warning."""
    env = {
        **os.environ,
        "TORCHINDUCTOR_CPP_MARCH": "x86-64-v4",
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path),
        "OMP_NUM_THREADS": "1",
    }
    out = subprocess.run(
        [sys.executable, "-c", _REAL_FAULT], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    wrong, warned, right = out.stdout.split()[-3:]
    assert right == "True" and warned == wrong, out.stdout
