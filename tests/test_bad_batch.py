"""A bad batch never half-applies a step, for every optimizer class, eager and compiled.

- ``nonfinite="skip"`` (the default): a NaN or inf in one matrix's gradient or in one 1-D
  parameter's leaves every parameter, every state tensor and every step count exactly as they
  were, counts the skip, and warns once, naming the parameter. No solver sees the non-finite
  value (SSO's ``eigh`` raised on it before).
- ``"error"``: raises, naming the parameter; nothing changes.
- ``None``: no check; the step is applied whole (the NaN reaches that parameter, as in
  torch.optim) and a NaN in it raises nothing midway (SSO included: under FSDP every rank must finish).
- The default writes each bucket in place: every check above is decided before the first write.
  With ``atomic=True`` an error in the middle of a step (here: raised from inside the second
  bucket's computation, or inside SSO's operator in a compiled graph) also leaves everything as it
  was: the step is staged, then committed.
- An optimizer fault (finite gradients, a non-finite update or state: here an overflow, or an
  inf update beside a finite state) keeps that bucket's parameters and state bit for bit, warns
  once that the fault is the optimizer's, and is counted; the other buckets of the step are
  applied. Low-bit state (codes beside per-block scales) is kept whole, codes with scales.
- The same for AdaMuon, NorMuon, cautious weight decay and 8- and 4-bit state.
- Gradient accumulation: under ``"error"`` a bad micro-batch is refused wherever it falls in the
  window; under ``"skip"`` it is accumulated and the window's step is skipped whole.

The FSDP optimizers run the same checks in one spawned job at W = 2 (gloo), the NaN on one rank,
eagerly and in their Dynamo graphs (the eager backend: the same traced graphs, with the checks
decided on the device, without inductor's code generation, which the single-device compiled test
and tests/test_compiled_eager.py's FSDP job exercise; inductor here cost 200 s of the job's 215).
"""

from __future__ import annotations

import copy
import warnings
from typing import NamedTuple

import pytest
import torch
from _ranks import assert_check, job_results, rank_main
from torch import nn

import muon_fn as mf
from muon_fn.core import base as _base
from muon_fn.core import compile as _compile
from muon_fn.core import sso_step as _sso_step

COMPILED = {
    "compile": {"backend": "inductor"}
}  # the real default's compiler (conftest turns compile=True off)
GRAPHS = {"compile": {"backend": "eager"}}  # the Dynamo graphs, run by the eager backend (fast)
EAGER = {"compile": False}


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 6)
    )


def build(name: str, net: nn.Module, **kw) -> torch.optim.Optimizer:
    if name in VARIANTS:
        base, options = VARIANTS[name]
        return build(base, net, **options, **kw)
    if name == "muon":
        return mf.MuonOptimizer(net.named_parameters(), ns_dtype=torch.float32, **kw)
    if name == "hybrid":
        return mf.create_hybrid_optimizer(net, ns_dtype=torch.float32, **kw)
    if name == "sso":
        return mf.SpectralSphereOptimizer(net.named_parameters(), **kw)
    if name == "triton_muon_w":
        return mf.TritonMuonW(net.named_parameters(), **kw)
    raise AssertionError(name)


CLASSES = ("muon", "hybrid", "sso", "triton_muon_w")
# Options whose state a skipped step must leave too: AdaMuon's and NorMuon's second moments, the
# cautious decay's sign test, and low-bit state (integer codes beside per-block scales).
VARIANTS = {
    "adamuon": ("muon", {"adamuon_beta2": 0.95}),
    "normuon": ("muon", {"beta2": 0.95}),
    "cautious": (
        "muon",
        {"cautious_weight_decay": True, "weight_decay": 0.1, "adamw_weight_decay": 0.1},
    ),
    "muon_8bit": ("muon", {"state_bits": 8}),
    "muon_4bit": ("muon", {"state_bits": 4}),
    "triton_muon_w_8bit": ("triton_muon_w", {"state_bits": 8}),
    "triton_muon_w_4bit": ("triton_muon_w", {"state_bits": 4}),
}
BAD = {"matrix": "2.weight", "vector": "4.bias"}


def set_grads(
    net: nn.Module, seed: int, bad: str | None = None, value: float = float("nan")
) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in net.named_parameters():
        p.grad = torch.randn(p.shape, generator=gen)
        if name == bad:
            p.grad.view(-1)[3] = value


def snapshot(net: nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {
        "params": {n: p.detach().clone() for n, p in net.named_parameters()},
        "state": copy.deepcopy({k: dict(st) for k, st in opt.state_dict()["state"].items()}),
    }


def same(a: dict, b: dict) -> bool:
    """Bit for bit (NaN equal to NaN)."""

    def eq(x, y):
        if isinstance(x, torch.Tensor):
            return (
                x.shape == y.shape
                and x.dtype == y.dtype
                and torch.equal(x.nan_to_num(), y.nan_to_num())
                and torch.equal(x.isnan(), y.isnan())
            )
        if isinstance(x, dict):
            return x.keys() == y.keys() and all(eq(x[k], y[k]) for k in x)
        return x == y

    return eq(a, b)


def skipped_step_leaves_everything(name: str, where: str, value: float, options: dict) -> None:
    net = model()
    opt = build(name, net, **options)
    set_grads(net, 0)
    opt.step()  # state exists
    before = snapshot(net, opt)
    set_grads(net, 1, BAD[where], value)
    grads = {n: p.grad.clone() for n, p in net.named_parameters()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    assert same(snapshot(net, opt), before)
    assert opt.nonfinite_steps == 1 and not bool(opt.last_step.finite)
    assert all(
        torch.equal(p.grad.nan_to_num(), grads[n].nan_to_num()) for n, p in net.named_parameters()
    )
    notes = [str(w.message) for w in caught if "skipped a step" in str(w.message)]
    assert len(notes) == 1 and f"'{BAD[where]}'" in notes[0], notes
    with warnings.catch_warnings(record=True) as again:  # once per optimizer
        warnings.simplefilter("always")
        opt.step()
    assert not [w for w in again if "skipped a step" in str(w.message)]
    assert opt.nonfinite_steps == 2
    set_grads(net, 2)
    opt.step()  # a good batch after bad ones: applied
    assert not same(snapshot(net, opt)["params"], before["params"])


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("where", sorted(BAD))
@pytest.mark.parametrize("name", CLASSES)
def test_skip_eager(name, where, value):
    skipped_step_leaves_everything(name, where, value, EAGER)


@pytest.mark.parametrize("name", VARIANTS)
def test_skip_eager_variants(name):
    """Every state tensor of these options too (AdaMuon's second moment, codes and scales)."""
    for where, value in (("matrix", float("nan")), ("vector", float("inf"))):
        skipped_step_leaves_everything(name, where, value, EAGER)


def error_raises_before_anything(name: str, options: dict) -> None:
    net = model()
    opt = build(name, net, nonfinite="error", **options)
    set_grads(net, 0)
    opt.step()
    before = snapshot(net, opt)
    set_grads(net, 1, BAD["matrix"], float("inf"))
    with pytest.raises(RuntimeError, match=r"non-finite gradient \(inf or nan\) in '2.weight'"):
        opt.step()
    assert same(snapshot(net, opt), before)


def none_applies_the_whole_step(name: str, options: dict) -> None:
    net = model()
    opt = build(name, net, nonfinite=None, **options)
    set_grads(net, 0)
    opt.step()
    before = snapshot(net, opt)
    set_grads(net, 1, BAD["matrix"])
    opt.step()  # a NaN in the batch raises nothing midway
    after = snapshot(net, opt)["params"]
    for n, p in after.items():
        changed = not torch.equal(p, before["params"][n])
        assert changed, f"{n} was not updated"
        assert bool(p.isfinite().all()) == (n != BAD["matrix"]), n


class Injected(RuntimeError):
    pass


def fail_in_second_bucket(monkeypatch) -> None:
    """The second bucket step of a step raises (after the first bucket was computed)."""
    calls = {"n": 0}
    real = _compile.PerSignature.__call__

    def call(self, key, *args):
        calls["n"] += 1
        if calls["n"] == 2:
            raise Injected("injected")
        return real(self, key, *args)

    monkeypatch.setattr(_compile.PerSignature, "__call__", call)


def step_failing_midway(name: str, options: dict, monkeypatch) -> tuple:
    """One good step, then one whose second bucket raises: ``(net, opt, snapshot before it)``."""
    net = model()
    opt = build(name, net, **options)  # buckets: one per shape
    set_grads(net, 0)
    opt.step()
    before = snapshot(net, opt)
    set_grads(net, 1)
    with monkeypatch.context() as m:
        fail_in_second_bucket(m)
        with pytest.raises(Injected):
            opt.step()
    return net, opt, before


def error_midway_changes_nothing(name: str, options: dict, monkeypatch) -> None:
    net, opt, before = step_failing_midway(name, {**options, "atomic": True}, monkeypatch)
    assert same(snapshot(net, opt), before)
    opt.step()  # and the step runs once the error is gone
    assert not same(snapshot(net, opt)["params"], before["params"])


@pytest.mark.parametrize("name", CLASSES)
def test_error_and_none_eager(name, monkeypatch):
    error_raises_before_anything(name, EAGER)
    none_applies_the_whole_step(name, EAGER)
    error_midway_changes_nothing(name, EAGER, monkeypatch)


@pytest.mark.inductor
@pytest.mark.parametrize("name", CLASSES)
@pytest.mark.slow
def test_compiled(name, monkeypatch):
    """The compiled default (inductor): the default policy (a NaN in a matrix, an inf in a bias)
    and an optimizer fault, decided on the device by inductor's code for the guard. The other
    policies and an error midway (atomic=True) in their Dynamo graphs, run by the eager backend:
    what they add is what the host does with the guard's flag (raise, ignore, commit staged
    writes), and compiling each with inductor too cost half of this test."""
    for where, value in (("matrix", float("nan")), ("vector", float("inf"))):
        skipped_step_leaves_everything(name, where, value, COMPILED)
    fault_keeps_the_bucket(name, COMPILED)
    error_raises_before_anything(name, GRAPHS)
    none_applies_the_whole_step(name, GRAPHS)
    error_midway_changes_nothing(name, GRAPHS, monkeypatch)


OVERFLOW = 2e38  # finite, but its square overflows fp32: AdamW's second moment becomes inf


ELEMENTWISE = (
    "hybrid",
    "triton_muon_w",
)  # the bias's transform is elementwise: guarded per element


def fault_keeps_the_bucket(
    name: str, options: dict, policy: str = "skip", atomic: bool = False
) -> None:
    """Finite gradients, one of which overflows inside the update (a bias: the AdamW part of every
    class, TritonMuonW's moments): what the guard covers keeps every bit — the whole bucket, or
    for an elementwise transform the faulty element — the rest of the step is applied, one warning
    blames the optimizer, and the fault is counted (and shown by metrics())."""
    bad, at = BAD["vector"], 3  # set_grads puts the value at flat index 3
    net = model()
    opt = build(name, net, nonfinite=policy, metrics=True, atomic=atomic, **options)
    set_grads(net, 0)
    opt.step()
    before = snapshot(net, opt)
    set_grads(net, 1, bad, OVERFLOW)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    after = snapshot(net, opt)
    pid = [n for n, _ in net.named_parameters()].index(bad)
    kept = (lambda t: t.reshape(-1)[at : at + 1]) if name in ELEMENTWISE else (lambda t: t)
    assert same({"p": kept(after["params"][bad])}, {"p": kept(before["params"][bad])})
    assert same(
        {k: kept(v) if v.ndim else v for k, v in after["state"][pid].items() if v.ndim},
        {k: kept(v) if v.ndim else v for k, v in before["state"][pid].items() if v.ndim},
    )
    if name in ELEMENTWISE:  # the other elements of the bias are updated
        rest = torch.ones(after["params"][bad].numel(), dtype=torch.bool)
        rest[at] = False
        assert not torch.equal(
            after["params"][bad].reshape(-1)[rest], before["params"][bad].reshape(-1)[rest]
        )
    others = [n for n in after["params"] if n != bad]
    assert all(not torch.equal(after["params"][n], before["params"][n]) for n in others), others
    assert all(bool(p.isfinite().all()) for p in net.parameters())
    assert all(
        bool(v.isfinite().all())
        for st in after["state"].values()
        for v in st.values()
        if isinstance(v, torch.Tensor) and v.is_floating_point()
    )
    notes = [str(w.message) for w in caught if "optimizer fault" in str(w.message)]
    assert len(notes) == 1 and f"'{bad}'" in notes[0], notes
    assert opt.optimizer_faults == 1 and opt.nonfinite_steps == 0 and bool(opt.last_step.finite)
    assert opt.metrics()["optimizer_faults"] == 1.0
    set_grads(net, 2)
    opt.step()  # training goes on
    assert not same(snapshot(net, opt)["params"][bad], before["params"][bad])


@pytest.mark.parametrize("name", CLASSES)
def test_fault_eager(name):
    for policy, atomic in (("skip", False), ("error", False), ("skip", True)):
        fault_keeps_the_bucket(name, EAGER, policy, atomic)


class Trace(NamedTuple):
    mu: tuple  # like params: the sum of the gradients


def inf_update(scope: str) -> mf.GradientTransformation:
    """A transform of ``scope`` whose state stays finite while a matrix's update is inf (what a
    miscompiled update writes); a vector's update is finite."""

    def init(params):
        return Trace(tuple(None if p is None else torch.zeros_like(p) for p in params))

    def update(updates, state, params=None, **extra):
        del params, extra
        mu = tuple(None if g is None else m + g for m, g in zip(state.mu, updates))
        return tuple(
            None if m is None else m + float("inf") if m.ndim == 2 else -0.1 * m for m in mu
        ), Trace(mu)

    return _base.with_info(mf.GradientTransformation(init, update), leafwise=True, scope=scope)


@pytest.mark.parametrize("atomic", [False, True], ids=["in_place", "atomic"])
@pytest.mark.parametrize("options", [EAGER, GRAPHS], ids=["eager", "graphs"])
@pytest.mark.parametrize("scope", [_base.MATRIX, _base.ELEMENTWISE])
def test_fault_of_the_update_alone(scope, options, atomic):
    """The guard checks the update, not only the new state: an inf update beside a finite state
    (a miscompile; AdamW's overflow above makes its state inf too) keeps that bucket's parameter
    and state bit for bit and counts one fault; the other bucket is applied."""
    w, b = nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(3))
    opt = mf.Optimizer([("w", w), ("b", b)], inf_update(scope), atomic=atomic, **options)
    w.grad, b.grad = torch.ones(4, 3), torch.ones(3)
    kept = w.detach().clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    assert torch.equal(w, kept) and torch.equal(opt.state[w]["trace.mu"], torch.zeros(4, 3))
    assert torch.equal(opt.state[b]["trace.mu"], torch.ones(3)) and bool(b.isfinite().all())
    notes = [str(x.message) for x in caught if "optimizer fault" in str(x.message)]
    assert len(notes) == 1 and "'w'" in notes[0] and "'b'" not in notes[0], notes
    assert opt.optimizer_faults == 1 and opt.nonfinite_steps == 0


@pytest.mark.parametrize("bits", [8, 4])
def test_fault_keeps_low_bit_state_whole(bits):
    """An elementwise transform whose state is stored as codes beside per-block scales
    (TritonMuonW's moments at 8 or 4 bits) is guarded per bucket, not per element: a code is
    read against its block's scale. A matrix gradient whose square overflows keeps that matrix,
    its codes, scales and count bit for bit; the other parameters are applied."""
    net = model()
    opt = build("triton_muon_w", net, state_bits=bits, **EAGER)
    set_grads(net, 0)
    opt.step()
    before = snapshot(net, opt)
    set_grads(net, 1, BAD["matrix"], OVERFLOW)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.step()
    after = snapshot(net, opt)
    pid = [n for n, _ in net.named_parameters()].index(BAD["matrix"])
    assert any(k.endswith("_codes") for k in after["state"][pid])
    assert same(after["state"][pid], before["state"][pid])
    assert all(
        torch.equal(p, before["params"][n]) == (n == BAD["matrix"])
        for n, p in after["params"].items()
    )
    assert opt.optimizer_faults == 1 and opt.nonfinite_steps == 0


def test_skip_keeps_a_schedules_count():
    """An elementwise chain with a learning-rate schedule (AdamW): the schedule's integer count,
    beside the floating state the per-element guard masks, is kept by a skipped step too."""
    w = nn.Parameter(torch.ones(4, 3))
    opt = mf.Optimizer([w], mf.adamw(lr=lambda count: 0.01 / (1 + count)), compile=False)
    w.grad = torch.ones(4, 3)
    opt.step()
    before = {"p": w.detach().clone(), "state": copy.deepcopy(dict(opt.state[w]))}
    w.grad = torch.full((4, 3), float("nan"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.step()
    assert same({"p": w.detach(), "state": dict(opt.state[w])}, before) and opt.nonfinite_steps == 1
    assert int(opt.state[w]["lr_schedule_count"]) == 1


@pytest.mark.parametrize("options", [EAGER, COMPILED], ids=["eager", "compiled"])
@pytest.mark.slow
def test_sso_operator_error_inside_a_compiled_graph_changes_nothing(options, monkeypatch):
    """SSO's per-chunk operator raises on its second chunk (inside the graph when compiled);
    ``atomic=True``."""
    net = model()
    opt = build("sso", net, bucket_size=1, atomic=True, **options)
    set_grads(net, 0)
    opt.step()
    before = snapshot(net, opt)
    calls = {"n": 0}
    real = _sso_step._finite_step

    def finite_step(*args):
        calls["n"] += 1
        if calls["n"] == 2:
            raise Injected("inside the operator")
        return real(*args)

    monkeypatch.setattr(_sso_step, "_finite_step", finite_step)
    set_grads(net, 1)
    with pytest.raises(Injected):
        opt.step()
    assert same(snapshot(net, opt), before)


def test_sso_skip_never_reaches_the_solver(monkeypatch):
    """Under "skip" the solver sees zeros, not the NaN: a lone (6, 12) parameter, whose eigh
    raised ``LinAlgError`` on the NaN before."""
    w = nn.Parameter(torch.randn(6, 12))
    opt = mf.SpectralSphereOptimizer([w], compile=False)
    seen = []
    real = _sso_step._finite_step
    monkeypatch.setattr(
        _sso_step,
        "_finite_step",
        lambda sp, W, M, *rest: seen.append(bool(M.isfinite().all())) or real(sp, W, M, *rest),
    )
    w.grad = torch.full_like(w, float("nan"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.step()
    assert seen == [True] and opt.nonfinite_steps == 1


def test_in_place_writes_bucket_by_bucket(monkeypatch):
    """The in-place default and ``atomic=True``: the same steps bit for bit; in place, an error
    midway leaves the buckets computed before it applied (the documented price of one bucket's
    transient memory)."""
    results = []
    for atomic in (True, False):
        net = model()
        opt = build("hybrid", net, atomic=atomic, **EAGER)
        for t in range(3):
            set_grads(net, t)
            opt.step()
        results.append([p.detach().clone() for p in net.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))
    net, opt, before = step_failing_midway("muon", EAGER, monkeypatch)
    changed = [
        n
        for n, p in snapshot(net, opt)["params"].items()
        if not torch.equal(p, before["params"][n])
    ]
    assert len(changed) == 1, changed  # the first bucket (one parameter), written before the error


def test_skip_warns_once_on_every_device(device):
    """The lane: on a GPU the first skip's warning comes from a pinned copy of the flags, read by
    the next step once its event has completed (no sync); on the CPU at once."""
    net = model().to(device)
    opt = mf.MuonOptimizer(net.named_parameters(), compile=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t, bad in enumerate((BAD["matrix"], None, BAD["vector"], None)):
            set_grads(net, t, bad)
            for p in net.parameters():
                p.grad = p.grad.to(device)
            opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
    notes = [str(w.message) for w in caught if "skipped a step" in str(w.message)]
    assert len(notes) == 1 and "'2.weight'" in notes[0], notes
    assert opt.nonfinite_steps == 2


# -------------------------------------------------------------------------- gradient accumulation
K = 3  # micro-batches per window
POSITIONS = {"first": 0, "middle": 1, "last": 2}  # of the bad micro-batch in its window


@pytest.mark.parametrize("at", POSITIONS)
def test_skip_drops_the_window_of_a_bad_micro_batch(at):
    """Under "skip" a non-finite micro-batch is accumulated, not refused (nothing raises, nothing
    is read back): the window's step is skipped whole at its last micro-batch (parameters and
    state as they were, one skip counted), and the next window starts afresh."""
    net, fresh_net = model(), model()
    opt, fresh = (
        build("muon", n, gradient_accumulation_steps=K, **EAGER) for n in (net, fresh_net)
    )
    before = snapshot(net, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(K):
            set_grads(net, i, BAD["matrix"] if i == POSITIONS[at] else None)
            opt.step()
    assert same(snapshot(net, opt), before)
    assert opt.nonfinite_steps == 1 and opt.param_groups[0]["micro_step"] == 0
    for i in range(K, 2 * K):  # the next window: as a fresh optimizer's first
        for n, o in ((net, opt), (fresh_net, fresh)):
            set_grads(n, i)
            o.step()
    assert same(snapshot(net, opt), snapshot(fresh_net, fresh))
    assert not same(snapshot(net, opt)["params"], before["params"])


@pytest.mark.parametrize("at", POSITIONS)
def test_error_refuses_a_bad_micro_batch_anywhere_in_the_window(at):
    """Under "error" a non-finite micro-batch raises before anything changes wherever it falls
    (the window's first, before any accumulator exists; its last, before the step): parameters,
    state, accumulators and the window's position stay, and the window ends as without it."""
    runs = []
    for with_bad in (True, False):
        net = model()
        opt = build("muon", net, gradient_accumulation_steps=K, nonfinite="error", **EAGER)
        for i in range(K):
            if with_bad and i == POSITIONS[at]:
                set_grads(net, 99, BAD["matrix"], float("inf"))
                before = snapshot(net, opt)
                with pytest.raises(
                    RuntimeError, match=r"non-finite gradient \(inf or nan\) in '2.weight'"
                ):
                    opt.step()
                assert same(snapshot(net, opt), before) and opt.param_groups[0]["micro_step"] == i
            set_grads(net, i)
            opt.step()
        runs.append((snapshot(net, opt), opt.nonfinite_steps))
    assert same(runs[0][0], runs[1][0]) and (runs[0][1], runs[1][1]) == (1, 0)


# ------------------------------------------------------------------------------------------- FSDP
JOB_TIMEOUT_S = 300


def _fsdp_check(cls_name: str, compile_option):
    """On every rank: skip (a NaN on rank 1 only in a matrix, then an inf in a bias), error,
    None (no rank raises, no hang), and an error raised on every rank after the exchange, before
    the commit: nothing changes."""

    def run():
        import torch.distributed as dist
        from test_fsdp import shard

        from muon_fn.fsdp import FSDPMuonOptimizer, FSDPSpectralSphereOptimizer

        cls = {"muon": FSDPMuonOptimizer, "sso": FSDPSpectralSphereOptimizer}[cls_name]
        rank = dist.get_rank()

        def local(net):
            return {n: p.to_local().clone() for n, p in net.named_parameters()}

        def states(opt, net):
            return {
                n: {
                    k: (v.to_local() if hasattr(v, "to_local") else v).clone()
                    for k, v in opt.state[p].items()
                    if isinstance(v, torch.Tensor)
                }
                for n, p in net.named_parameters()
            }

        def fsdp_grads(net, seed, bad=None, value=float("nan")):
            gen = torch.Generator().manual_seed(seed)
            for n, p in net.named_parameters():
                g = torch.randn(p.to_local().shape, generator=gen)
                if n == bad and rank == 1 and g.numel():
                    g.view(-1)[0] = value
                p.grad = torch.distributed.tensor.DTensor.from_local(
                    g,
                    p.device_mesh,
                    p.placements,
                    run_check=False,
                    shape=p.shape,
                    stride=p.stride(),
                )

        out = {}
        for policy in ("skip", "error", None):
            net = shard(model())
            opt = cls(net, nonfinite=policy, compile=compile_option)
            fsdp_grads(net, 0)
            opt.step()
            before = (local(net), states(opt, net))
            fsdp_grads(net, 1, BAD["matrix"])
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    opt.step()
                    raised = ""
                except RuntimeError as e:
                    raised = str(e)
            now = (local(net), states(opt, net))
            if policy == "skip":
                assert not raised and opt.nonfinite_steps == 1, raised
                assert same({"a": now[0], "b": now[1]}, {"a": before[0], "b": before[1]})
                notes = [str(w.message) for w in caught if "skipped a step" in str(w.message)]
                named = "'2.weight'" if rank == 1 else "a parameter of another rank"
                assert len(notes) == 1 and named in notes[0], notes
                fsdp_grads(net, 2, BAD["vector"], float("inf"))
                opt.step()
                assert same({"a": local(net)}, {"a": before[0]}) and opt.nonfinite_steps == 2
            elif policy == "error":
                assert "non-finite" in raised, raised
                assert same({"a": now[0], "b": now[1]}, {"a": before[0], "b": before[1]})
            else:
                assert not raised, raised
                assert all(
                    not torch.equal(now[0][n], before[0][n]) for n in now[0] if now[0][n].numel()
                )
        # atomic=True: an error on every rank after the exchange, before the commit
        net = shard(model())
        opt = cls(net, compile=compile_option, atomic=True)
        fsdp_grads(net, 0)
        opt.step()
        before = (local(net), states(opt, net))
        fsdp_grads(net, 1)
        # the class that runs the step's elementwise phase: the distributed executor's (the
        # optimizer's own where the FSDP step is mixed into it)
        runner = next(
            type(x)
            for x in (getattr(opt, "_executor", None), opt)
            if hasattr(type(x), "_elementwise")
        )
        real = runner._elementwise

        def failing(self, *args):
            real(self, *args)
            raise Injected("after the exchange")

        runner._elementwise = failing
        try:
            opt.step()
        except Injected:
            out["injected"] = True
        finally:
            runner._elementwise = real
        assert out.get("injected") and same(
            {"a": local(net), "b": states(opt, net)}, {"a": before[0], "b": before[1]}
        )
        return out

    return run


def checks() -> dict:
    return {
        f"{name}_{mode}": _fsdp_check(name, option)
        for name in ("muon", "sso")
        for mode, option in (("eager", False), ("graphs", GRAPHS["compile"]))
    }


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory):
    return job_results(__file__, 2, tmp_path_factory.mktemp("bad_batch_fsdp"), JOB_TIMEOUT_S)


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(checks()))
def test_fsdp_w2(fsdp_results, name):
    assert_check(fsdp_results, 2, name)


if __name__ == "__main__":  # one rank of a job: W RANK OUT
    rank_main(lambda w: checks())
