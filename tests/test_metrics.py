"""Telemetry (``metrics=``, ``optimizer.metrics()``, ``with_metrics``): each figure against an
eager reference computed from the same tensors; the compiled path with no host reads and no
recompiles over a learning-rate schedule; ``metrics=False`` the same graphs as without the option,
``metrics=k`` the unmeasured steps in those graphs; every optimizer class.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import muon_fn as mf
from muon_fn import _metrics

from test_compile import _host_reads

LR, WD, B2, EPS = 0.02, 0.01, 0.95, 1e-8


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 24), nn.Tanh(), nn.Linear(24, 12), nn.Tanh(), nn.Linear(12, 6))


def backward(net: nn.Module, seed: int) -> None:
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(seed))
    net.zero_grad()
    net(x).square().mean().backward()


def rms(t: torch.Tensor) -> float:
    return t.double().square().mean().sqrt().item()


def exact_residual(o: torch.Tensor) -> float:
    o = o.double()
    o = o if o.shape[0] <= o.shape[1] else o.mT
    return (torch.linalg.matrix_norm(o @ o.mT - torch.eye(o.shape[0], dtype=torch.float64)) / math.sqrt(o.shape[0])).item()


def test_every_figure_matches_an_eager_reference():
    """One NorMuon step of MuonOptimizer (fp32 iteration) and the figures recomputed by hand."""
    net = model()
    opt = mf.MuonOptimizer(net.named_parameters(), lr=LR, weight_decay=WD, beta2=B2, ns_dtype=torch.float32,
                           compile=False, metrics=True)
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
    assert got["effective_lr"] == pytest.approx(LR * mf.shape_scale("original", (12, 24)))
    assert got["decay"] == pytest.approx(LR * WD)
    scales = st["row_variance"].double().sqrt() + EPS
    assert got["row_scale_range"] == pytest.approx((scales.max() / scales.min()).item(), rel=1e-6)
    o = orthogonalized(grad, st["momentum_buffer"])  # the step's O, recomputed
    assert got["ortho_residual"] == pytest.approx(_metrics.residual(o.unsqueeze(0)).item(), rel=1e-5)
    assert abs(got["ortho_residual"] - exact_residual(o)) < 0.25 * exact_residual(o)  # estimates the exact
    small = net[4].weight  # 6 x 12: all 6 rows, the exact value
    assert m["4.weight/ortho_residual"] == pytest.approx(
        exact_residual(orthogonalized(small.grad, opt.state[small]["momentum_buffer"])), rel=1e-4)
    assert m["group0/skipped"] == 0.0
    assert m["group0/grad_norm"] == pytest.approx(
        math.sqrt(sum(p.grad.double().square().sum().item() for p in net.parameters())), rel=1e-6)


def orthogonalized(grad: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """The step's orthogonalized update of a matrix: msign (the default quintic, fp32) of the
    Nesterov direction ``lerp(g, b, μ)`` of torch.optim.Muon's buffer."""
    tx = mf.orthogonalize(dtype=torch.float32)
    return tx.update((grad.lerp(buffer, 0.95),), tx.init((grad,)))[0][0]


def test_residual_estimate_is_exact_for_at_most_eight_rows_and_follows_the_iteration():
    torch.manual_seed(0)
    for shape in [(4, 9), (8, 8), (3, 50)]:
        o = mf.zeropower_via_newtonschulz5(torch.randn(shape), steps=5)
        assert _metrics.residual(o.unsqueeze(0)).item() == pytest.approx(exact_residual(o), rel=1e-5)
    g = torch.randn(64, 128)
    loose = _metrics.residual(mf.polar_express(g, steps=5).unsqueeze(0)).item()
    exact = _metrics.residual(mf.polar_express(g, steps=10).unsqueeze(0)).item()
    assert exact < 0.01 < loose  # the exact mode orthogonalizes; 5 steps land in a band around 1


def test_units_of_an_expert_stack_and_a_head_view():
    torch.manual_seed(0)
    stack = nn.Parameter(torch.randn(3, 6, 4))
    qkv = nn.Parameter(torch.randn(12, 4))
    opt = mf.MuonOptimizer([("experts", stack), ("qkv", qkv)], matrix_view={"experts": "experts",
                           "qkv": mf.heads(rows=3)}, compile=False, metrics=True)
    stack.grad, qkv.grad = torch.randn_like(stack), torch.randn_like(qkv)
    g_stack, g_qkv = stack.grad.clone(), qkv.grad.clone()
    opt.step()
    m = opt.metrics()
    for j in range(3):
        assert m[f"experts[{j}]/grad_rms"] == pytest.approx(rms(g_stack[j]), rel=1e-6)
        assert m[f"qkv[{j}]/grad_rms"] == pytest.approx(rms(g_qkv[4 * j:4 * j + 4]), rel=1e-6)
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


def test_off_is_the_same_graphs_and_every_k_reuses_them():
    plain, _, net_a = _graphs(lambda n, c: mf.MuonOptimizer(n.parameters(), compile=c, beta2=B2))
    off, _, net_b = _graphs(lambda n, c: mf.MuonOptimizer(n.parameters(), compile=c, beta2=B2, metrics=False))
    every, opt, net_c = _graphs(lambda n, c: mf.MuonOptimizer(n.parameters(), compile=c, beta2=B2, metrics=3))
    assert off == plain
    assert set(plain) <= set(every) and len(every) == 2 * len(plain)  # the unmeasured graphs, and one set more
    for a, b in zip(net_a.parameters(), net_c.parameters()):
        assert torch.equal(a, b)  # measuring changes no bit of the step
    assert opt.metrics()["step"] == 4.0


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
        LR / 5 * mf.shape_scale("original", (12, 24)), rel=1e-6)


@pytest.mark.parametrize("build", [
    lambda n, **k: mf.MuonOptimizer(n.named_parameters(), **k),
    lambda n, **k: mf.create_hybrid_optimizer(n, **k),
    lambda n, **k: mf.SpectralSphereOptimizer(n.named_parameters(), **k),
    lambda n, **k: mf.TritonMuon(n.named_parameters(), **k),
    lambda n, **k: mf.TritonMuonW(n.named_parameters(), **k),
], ids=["muon", "hybrid", "sso", "triton_muon", "triton_muon_w"])
def test_every_class(build):
    net = model()
    opt = build(net, compile=False, metrics=True)
    assert opt.metrics() == {}
    backward(net, 0)
    opt.step()
    m = opt.metrics()
    assert m["step"] == 1.0 and all(math.isfinite(v) for k, v in m.items() if "sso_" not in k)
    assert {"0.weight/grad_rms", "0.weight/update_rms", "0.weight/weight_rms"} <= set(m)
    names = {k.split("/")[0] for k in m}
    assert {n for n, _ in net.named_parameters()} <= names


def test_a_skipped_step_is_marked():
    net = model()
    opt = mf.MuonOptimizer(net.named_parameters(), compile=False, metrics=True)
    backward(net, 0)
    net[0].weight.grad[0, 0] = float("nan")
    with pytest.warns(UserWarning, match="skipped a step"):
        opt.step()
    m = opt.metrics()
    assert m["group0/skipped"] == 1.0 and math.isnan(m["0.weight/grad_rms"])
    assert m["group0/update_norm"] == 0.0


def test_metrics_keyword_is_checked():
    with pytest.raises(ValueError, match=r"Invalid metrics: 0 \(expected False, True, or an integer k >= 1"):
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
    assert m["step"] == 2.0 and m["muon/skipped"] == 0.0 and math.isfinite(m["muon/ortho_residual_max"])
