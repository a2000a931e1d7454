"""Telemetry (``metrics=``, ``optimizer.metrics()``, ``with_metrics``): each figure against an
eager reference computed from the same tensors; the compiled path with no host reads and no
recompiles over a learning-rate schedule; ``metrics=False`` the same graphs as without the option,
``metrics=k`` the unmeasured steps in those graphs; every optimizer class.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from test_compile import _host_reads
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import muon_fn as mf
from muon_fn.core import metrics as _metrics

LR, WD, B2, EPS = 0.02, 0.01, 0.95, 1e-8


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 24), nn.Tanh(), nn.Linear(24, 12), nn.Tanh(), nn.Linear(12, 6)
    )


def backward(net: nn.Module, seed: int) -> None:
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(seed))
    net.zero_grad()
    net(x).square().mean().backward()


def rms(t: torch.Tensor) -> float:
    return t.double().square().mean().sqrt().item()


def exact_residual(o: torch.Tensor) -> float:
    o = o.double()
    o = o if o.shape[0] <= o.shape[1] else o.mT
    return (
        torch.linalg.matrix_norm(o @ o.mT - torch.eye(o.shape[0], dtype=torch.float64))
        / math.sqrt(o.shape[0])
    ).item()


# The shape rules of design.md §3, written out (not muon_fn's shape_scale): s(out, in).
SHAPE_RULES = {
    "keller": lambda out, inp: math.sqrt(max(1.0, out / inp)),
    "match_rms_adamw": lambda out, inp: 0.2 * math.sqrt(max(out, inp)),
}


def documented_residual(o: torch.Tensor) -> float:
    """The residual as muon_fn.with_metrics' docstring defines it, in float64: ``O`` in its wide orientation
    (``m ≤ n``), the rows ``S = {⌊i·m/k⌋ : i < k}``, ``k = min(8, m)``, of ``OOᵀ − I``, and
    ``√(‖(OOᵀ − I)[S]‖²_F / k)`` (an estimate of ``‖OOᵀ − I‖_F / √m``, exact for ``m ≤ 8``)."""
    o = o.double()
    o = o if o.shape[0] <= o.shape[1] else o.mT
    m = o.shape[0]
    k = min(8, m)
    rows = [(i * m) // k for i in range(k)]
    gap = o[rows] @ o.mT - torch.eye(m, dtype=torch.float64)[rows]
    return math.sqrt(gap.square().sum().item() / k)


def test_every_figure_matches_an_eager_reference():
    """One NorMuon step of MuonOptimizer (fp32 iteration) and the figures recomputed by hand."""
    net = model()
    opt = mf.MuonOptimizer(
        net.named_parameters(),
        lr=LR,
        weight_decay=WD,
        beta2=B2,
        ns_dtype=torch.float32,
        compile=False,
        metrics=True,
    )
    backward(net, 0)
    w = net[2].weight  # 12 x 24: the estimate's 8 rows of 12
    before, grad = w.detach().clone(), w.grad.clone()
    opt.step()
    m = opt.metrics()
    st = opt.state[w]
    got = {k.split("/", 1)[1]: v for k, v in m.items() if k.startswith("2.weight/")}
    assert got["grad_rms"] == pytest.approx(rms(grad), rel=1e-6)
    assert got["momentum_rms"] == pytest.approx(rms(st["momentum_buffer"]), rel=1e-6)
    assert got["weight_rms"] == pytest.approx(rms(before), rel=1e-6)
    assert got["update_rms"] == pytest.approx(rms(w.detach() - before), rel=1e-4)
    assert got["effective_lr"] == pytest.approx(LR * SHAPE_RULES["keller"](12, 24))
    assert got["decay"] == pytest.approx(LR * WD)
    scales = st["row_variance"].double().sqrt() + EPS
    assert got["row_scale_range"] == pytest.approx((scales.max() / scales.min()).item(), rel=1e-6)
    o = orthogonalized(grad, st["momentum_buffer"])  # the step's O, recomputed
    assert got["ortho_residual"] == pytest.approx(documented_residual(o), rel=1e-5)
    assert abs(got["ortho_residual"] - exact_residual(o)) < 0.25 * exact_residual(
        o
    )  # estimates the exact
    small = net[4].weight  # 6 x 12: all 6 rows, the exact value
    assert m["4.weight/ortho_residual"] == pytest.approx(
        exact_residual(orthogonalized(small.grad, opt.state[small]["momentum_buffer"])), rel=1e-4
    )
    assert m["group0/skipped"] == 0.0
    assert m["group0/grad_norm"] == pytest.approx(
        math.sqrt(sum(p.grad.double().square().sum().item() for p in net.parameters())), rel=1e-6
    )


def _one_step(rule: str, beta2: float | None):
    """One step of MuonOptimizer (no weight decay) on a tall 24×16 and a wide 16×40 matrix:
    its figures, each weight before the step and its change (float64)."""
    torch.manual_seed(0)
    params = {"tall": nn.Parameter(torch.randn(24, 16)), "wide": nn.Parameter(torch.randn(16, 40))}
    opt = mf.MuonOptimizer(
        list(params.items()),
        lr=LR,
        adjust_lr_fn=rule,
        beta2=beta2,
        weight_decay=0.0,
        compile=False,
        metrics=True,
    )
    for p in params.values():
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(p.shape[1]))
    before = {n: p.detach().double().clone() for n, p in params.items()}
    opt.step()
    return opt.metrics(), before, {n: p.detach().double() - before[n] for n, p in params.items()}


@pytest.mark.parametrize("rule", sorted(SHAPE_RULES))
def test_figures_match_the_weight_change(rule):
    """Every figure against a float64 computation from the weights alone, on non-square
    matrices whose shape scale is not 1 and with more than 8 rows. Without weight decay a Muon
    step is ``ΔW = −lr·s·O``, so ``O = −ΔW / (lr·s)`` with ``s`` from design.md §3's formula;
    NorMuon's row scales are ``√v + eps`` with ``v = (1 − β₂)·mean_row(O²)`` at its first step,
    ``O`` the same as plain Muon's."""
    m, before, delta = _one_step(rule, None)
    normuon, n_before, n_delta = _one_step(rule, B2)
    for name, (out, inp) in {"tall": (24, 16), "wide": (16, 40)}.items():
        s = SHAPE_RULES[rule](out, inp)
        o = -delta[name] / (LR * s)  # the step's orthogonalized update
        assert m[f"{name}/weight_rms"] == pytest.approx(rms(before[name]), rel=1e-6)
        assert m[f"{name}/update_rms"] == pytest.approx(rms(delta[name]), rel=1e-5)
        assert m[f"{name}/effective_lr"] == pytest.approx(LR * s, rel=1e-6)
        assert m[f"{name}/ortho_residual"] == pytest.approx(documented_residual(o), rel=1e-3)
        scales = ((1 - B2) * o.square().mean(dim=1)).sqrt() + EPS
        assert normuon[f"{name}/row_scale_range"] == pytest.approx(
            (scales.max() / scales.min()).item(), rel=1e-3
        )
        assert normuon[f"{name}/update_rms"] == pytest.approx(rms(n_delta[name]), rel=1e-5)
        assert normuon[f"{name}/weight_rms"] == pytest.approx(rms(n_before[name]), rel=1e-6)
        assert normuon[f"{name}/effective_lr"] == pytest.approx(LR * s, rel=1e-6)
    assert m["group0/update_norm"] == pytest.approx(
        math.sqrt(sum(d.square().sum().item() for d in delta.values())), rel=1e-5
    )
    worst = max(("tall", "wide"), key=lambda n: m[f"{n}/ortho_residual"])
    assert (
        m[f"group0/ortho_residual_max@{worst}"]
        == m["group0/ortho_residual_max"]
        == m[f"{worst}/ortho_residual"]
    )


def orthogonalized(grad: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """The step's orthogonalized update of a matrix: msign (the default quintic, fp32) of the
    Nesterov direction ``lerp(g, b, μ)`` of torch.optim.Muon's buffer."""
    tx = mf.orthogonalize(dtype=torch.float32)
    return tx.update((grad.lerp(buffer, 0.95),), tx.init((grad,)))[0][0]


def test_residual_estimate_is_exact_for_at_most_eight_rows_and_follows_the_iteration():
    torch.manual_seed(0)
    for shape in [(4, 9), (8, 8), (3, 50)]:
        o = mf.zeropower_via_newtonschulz5(torch.randn(shape), steps=5)
        assert _metrics.residual(o.unsqueeze(0)).item() == pytest.approx(
            exact_residual(o), rel=1e-5
        )
    for shape in [(24, 16), (16, 40), (64, 9)]:  # more than 8 rows: the estimate of the doc
        o = mf.zeropower_via_newtonschulz5(torch.randn(shape), steps=5)
        assert _metrics.residual(
            (o if shape[0] <= shape[1] else o.mT).unsqueeze(0)
        ).item() == pytest.approx(documented_residual(o), rel=1e-5)
    g = torch.randn(64, 128)
    loose = _metrics.residual(mf.polar_express(g, steps=5).unsqueeze(0)).item()
    exact = _metrics.residual(mf.polar_express(g, steps=10).unsqueeze(0)).item()
    assert exact < 0.01 < loose  # the exact mode orthogonalizes; 5 steps land in a band around 1


def test_units_of_an_expert_stack_and_a_head_view():
    torch.manual_seed(0)
    stack = nn.Parameter(torch.randn(3, 6, 4))
    qkv = nn.Parameter(torch.randn(12, 4))
    opt = mf.MuonOptimizer(
        [("experts", stack), ("qkv", qkv)],
        matrix_view={"experts": "experts", "qkv": mf.heads(rows=3)},
        compile=False,
        metrics=True,
    )
    stack.grad, qkv.grad = torch.randn_like(stack), torch.randn_like(qkv)
    g_stack, g_qkv = stack.grad.clone(), qkv.grad.clone()
    opt.step()
    m = opt.metrics()
    for j in range(3):
        assert m[f"experts[{j}]/grad_rms"] == pytest.approx(rms(g_stack[j]), rel=1e-6)
        assert m[f"qkv[{j}]/grad_rms"] == pytest.approx(rms(g_qkv[4 * j : 4 * j + 4]), rel=1e-6)
        assert f"qkv[{j}]/ortho_residual" in m and f"experts[{j}]/effective_lr" in m
    assert m["group0/grad_rms_max"] == max(v for k, v in m.items() if k.endswith("/grad_rms"))


def _graphs(opt_factory, steps: int = 4):
    """The FX code of every graph compiled over ``steps`` steps with an lr schedule."""
    codes = []

    def backend(gm, example_inputs):
        codes.append(gm.code)
        return gm.forward

    net = model()
    opt = opt_factory(net, {"backend": backend})
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))
    for t in range(steps):
        backward(net, t)
        opt.step()
        sched.step()
    return codes, opt, net


@pytest.mark.slow
def test_off_is_the_same_graphs_and_every_k_reuses_them():
    plain, _, net_a = _graphs(lambda n, c: mf.MuonOptimizer(n.parameters(), compile=c, beta2=B2))
    off, _, net_b = _graphs(
        lambda n, c: mf.MuonOptimizer(n.parameters(), compile=c, beta2=B2, metrics=False)
    )
    every, opt, net_c = _graphs(
        lambda n, c: mf.MuonOptimizer(n.parameters(), compile=c, beta2=B2, metrics=3)
    )
    assert off == plain
    assert set(plain) <= set(every) and len(every) == 2 * len(
        plain
    )  # the unmeasured graphs, and one set more
    for a, b in zip(net_a.parameters(), net_c.parameters()):
        assert torch.equal(a, b)  # measuring changes no bit of the step
    assert opt.metrics()["step"] == 4.0


@pytest.mark.slow
def test_compiled_step_reads_nothing_back_and_never_recompiles():
    counter = CompileCounterWithBackend("eager")
    net = model()
    opt = mf.create_hybrid_optimizer(net, compile={"backend": counter}, metrics=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))
    backward(net, 0)
    opt.step()
    compiles = counter.frame_count
    for t in range(1, 6):
        backward(net, t)
        assert _host_reads(opt.step) == 0
        sched.step()
    assert counter.frame_count == compiles
    m = opt.metrics()
    # the sixth step ran at the scheduler's fifth value (its first step came before the loop)
    assert m["step"] == 6.0 and m["2.weight/effective_lr"] == pytest.approx(
        LR / 5 * SHAPE_RULES["keller"](12, 24), rel=1e-6
    )


BUILDS = {
    "muon": lambda n, **k: mf.MuonOptimizer(n.named_parameters(), **k),
    "hybrid": lambda n, **k: mf.create_hybrid_optimizer(n, **k),
    "sso": lambda n, **k: mf.SpectralSphereOptimizer(n.named_parameters(), **k),
    "triton_muon": lambda n, **k: mf.TritonMuon(n.named_parameters(), **k),
    "triton_muon_w": lambda n, **k: mf.TritonMuonW(n.named_parameters(), **k),
}


def _figures_of(build, compile, steps: int = 2) -> dict[str, float]:
    """``metrics()`` after ``steps`` steps of ``build``'s optimizer on :func:`model`, with no
    warning of muon_fn's (a compiled step that fell back to eager warns)."""
    net = model()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="muon_fn")
        opt = build(net, compile=compile, metrics=True)
        assert opt.metrics() == {}
        for t in range(steps):
            backward(net, t)
            opt.step()
    return opt.metrics()


SSO_TOL = 2e-4  # spectral_sphere's default tolerance on |h|


def assert_same_figures(got: dict[str, float], want: dict[str, float]) -> None:
    """Equal figures to fp tolerance. SSO's λ solve stops anywhere within its tolerance on |h|,
    so an ulp of difference in its inputs (inductor fuses the momentum's lerp) may take one more
    or one fewer evaluation: its λ*, |h| and evaluation count are compared to the solve's
    accuracy, and the matrix named by ``sso_residual_max@`` may differ."""

    def names(m):
        return {k for k in m if "sso_residual_max@" not in k}

    assert names(got) == names(want)
    for k in names(want):
        if k.endswith(("sso_residual", "sso_residual_max")):
            assert max(got[k], want[k]) <= SSO_TOL, k
        elif k.endswith("sso_iterations"):
            assert abs(got[k] - want[k]) <= 1, k
        elif k.endswith("sso_lambda"):
            assert got[k] == pytest.approx(want[k], rel=1e-2, abs=1e-4), k
        else:
            assert got[k] == pytest.approx(want[k], rel=1e-4, abs=1e-6, nan_ok=True), k


@pytest.mark.parametrize("name", BUILDS)
@pytest.mark.slow
def test_every_class(name):
    """Every class measures every parameter, eagerly and compiled (Dynamo with the eager
    backend, no fallback), and the compiled figures equal the eager ones."""
    net = model()
    m = _figures_of(BUILDS[name], False)
    assert m["step"] == 2.0 and all(math.isfinite(v) for k, v in m.items() if "sso_" not in k)
    assert {"0.weight/grad_rms", "0.weight/update_rms", "0.weight/weight_rms"} <= set(m)
    names = {k.split("/")[0] for k in m}
    assert {n for n, _ in net.named_parameters()} <= names
    counter = CompileCounterWithBackend("eager")
    assert_same_figures(_figures_of(BUILDS[name], {"backend": counter}), m)
    assert counter.frame_count >= 1


@pytest.mark.inductor
@pytest.mark.slow
def test_sso_metrics_compile_with_inductor(compiled_default):
    """SSO's telemetry reads its configuration outside the traced code, so the default
    compiled (inductor) step measures too, and its figures equal eager's."""
    assert_same_figures(_figures_of(BUILDS["sso"], True), _figures_of(BUILDS["sso"], False))
    assert mf.core.compile._UNUSABLE is None  # inductor compiled: it did not fall back to eager


def test_names_of_groups_and_unnamed_parameters():
    """Without names a parameter is ``#i``, its position in the optimizer (torch's state_dict
    id), unique across groups; a group is its ``algorithm`` where that names it alone, else
    ``group<i>`` (``"auto"``, or two groups of one algorithm)."""
    net = model()
    w0, w2, w4 = net[0].weight, net[2].weight, net[4].weight
    opt = mf.MuonOptimizer(
        [
            {"params": [w0], "algorithm": "muon"},
            {"params": [w2], "algorithm": "muon"},
            {"params": [w4], "algorithm": "adamw"},
            {"params": [net[0].bias]},
        ],
        compile=False,
        metrics=True,
    )
    backward(net, 0)
    grads = [w0.grad.clone(), w2.grad.clone(), w4.grad.clone()]
    opt.step()
    m = opt.metrics()
    for i, g in enumerate(grads):
        assert m[f"#{i}/grad_rms"] == pytest.approx(rms(g), rel=1e-6)
    assert "#3/grad_rms" in m
    groups = {k.split("/")[0] for k in m if "/" in k and not k.startswith("#")}
    assert groups == {"group0", "group1", "adamw", "group3"}


def test_skipped_only_with_a_nonfinite_check_and_step_restarts_in_a_loaded_optimizer():
    net = model()
    unchecked = mf.MuonOptimizer(
        net.named_parameters(), compile=False, metrics=True, nonfinite=None
    )
    backward(net, 0)
    unchecked.step()
    assert "group0/grad_norm" in unchecked.metrics() and "group0/skipped" not in unchecked.metrics()
    opt = mf.MuonOptimizer(net.named_parameters(), compile=False, metrics=True)
    for t in range(3):
        backward(net, t)
        opt.step()
    assert opt.metrics()["step"] == 3.0
    loaded = mf.MuonOptimizer(net.named_parameters(), compile=False, metrics=True)
    loaded.load_state_dict(opt.state_dict())
    loaded.step()
    assert loaded.metrics()["step"] == 1.0  # counted by the optimizer object, not saved


def test_gradient_figures_under_accumulation_are_the_windows_mean():
    net = model()
    opt = mf.MuonOptimizer(
        net.named_parameters(), compile=False, metrics=True, gradient_accumulation_steps=2
    )
    grads = []
    for t in range(2):
        backward(net, t)
        grads.append([p.grad.double().clone() for p in net.parameters()])
        opt.step()
    mean = [(a + b) / 2 for a, b in zip(*grads)]
    m = opt.metrics()
    assert m["step"] == 1.0
    assert m["group0/grad_norm"] == pytest.approx(
        math.sqrt(sum(g.square().sum().item() for g in mean)), rel=1e-6
    )
    assert m["0.weight/grad_rms"] == pytest.approx(rms(mean[0]), rel=1e-6)


def test_a_skipped_step_is_marked():
    net = model()
    opt = mf.MuonOptimizer(net.named_parameters(), compile=False, metrics=True)
    backward(net, 0)
    net[0].weight.grad[0, 0] = float("nan")
    with pytest.warns(UserWarning, match="skipped a step"):
        opt.step()
    m = opt.metrics()
    assert m["group0/skipped"] == 1.0 and math.isnan(m["0.weight/grad_rms"])
    assert m["group0/update_norm"] == 0.0  # weight decay (0.01) computed an update: not applied
    backward(net, 1)
    opt.step()
    assert opt.metrics()["group0/update_norm"] > 0.0
    backward(net, 2)
    net[0].weight.grad[0, 0] = float("inf")
    before = [p.detach().clone() for p in net.parameters()]
    opt.step()  # a non-zero momentum would move the weights: the step is skipped, so none moved
    m = opt.metrics()
    assert m["group0/skipped"] == 1.0 and m["group0/update_norm"] == 0.0
    assert all(m[f"{n}/update_rms"] == 0.0 for n, _ in net.named_parameters())
    assert all(torch.equal(a, p) for a, p in zip(before, net.parameters()))


def test_metrics_keyword_is_checked():
    with pytest.raises(
        ValueError, match=r"Invalid metrics: 0 \(expected False, True, or an integer k >= 1"
    ):
        mf.MuonOptimizer(model().parameters(), metrics=0)


def test_functional_with_metrics():
    torch.manual_seed(0)
    params = {"w": torch.randn(6, 10), "b": torch.randn(6, 10)}
    tx = _metrics.with_metrics(mf.muon(LR, weight_decay=WD))
    state = tx.init(params)
    assert all(math.isnan(v) for v in _metrics.read_metrics(state, params).values())
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    updates, state = tx.update(grads, state, params)
    m = _metrics.read_metrics(state, params)
    assert m["w/grad_rms"] == pytest.approx(rms(grads["w"]), rel=1e-6)
    assert m["w/update_rms"] == pytest.approx(rms(updates["w"]), rel=1e-6)
    _, later = tx.update(grads, state, params, measure=False)
    assert _metrics.read_metrics(later, params) == m  # unmeasured: the last figures kept


class _CountedReads(torch.Tensor):
    """A tensor that counts the reads of its values to the host (``cpu``, ``tolist``, ``item``,
    ``numpy``, ``float``), whatever the device: on the CPU these cost nothing, on a GPU each is
    a synchronizing copy."""

    reads = 0
    READS = frozenset(
        {
            torch.Tensor.cpu,
            torch.Tensor.tolist,
            torch.Tensor.item,
            torch.Tensor.numpy,
            torch.Tensor.__float__,
        }
    )

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in cls.READS:
            _CountedReads.reads += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def test_read_metrics_reads_the_device_once():
    torch.manual_seed(0)
    params = {"w": torch.randn(6, 10), "v": torch.randn(12, 4)}
    tx = _metrics.with_metrics(mf.muon(LR))
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    _, state = tx.update(grads, tx.init(params), params)
    want = _metrics.read_metrics(state, params)
    counted = _metrics.MetricsState(
        state.inner,
        tuple(
            None if r is None else {k: v.as_subclass(_CountedReads) for k, v in r.items()}
            for r in state.raw
        ),
    )
    _CountedReads.reads = 0
    assert _metrics.read_metrics(counted, params) == want and len(want) > 10
    assert _CountedReads.reads == 1


def test_on_every_device(device):
    """The lane: figures on the device, no host read in a measured step, one read by metrics()."""
    torch.manual_seed(0)
    net = model().to(device)
    opt = mf.create_hybrid_optimizer(net, compile=False, metrics=True)
    for t in range(2):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(t)).to(device)
        net.zero_grad()
        net(x).square().mean().backward()
        if t:
            assert _host_reads(opt.step) == 0
        else:
            opt.step()
    m = opt.metrics()
    assert (
        m["step"] == 2.0
        and m["muon/skipped"] == 0.0
        and math.isfinite(m["muon/ortho_residual_max"])
    )
