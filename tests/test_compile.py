"""torch.compile contract (docs/design.md §5): one graph, zero graph breaks, no recompile when the
learning rate changes (a 0-d tensor updated in place), compiled == eager.

Unit tests use ``backend="eager"`` (Dynamo tracing without code generation; fast). One test runs
inductor and is marked ``inductor``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import muon_fn as mf
from muon_fn.core import compile as _compile


def tree(seed=0, with_vectors=False):
    g = torch.Generator().manual_seed(seed)
    t = {
        "attn": {"q": torch.randn(32, 32, generator=g), "k": torch.randn(32, 32, generator=g)},
        "mlp": {"up": torch.randn(64, 32, generator=g), "down": torch.randn(32, 64, generator=g)},
        "conv": torch.randn(8, 4, 3, 3, generator=g),
    }
    if with_vectors:
        t["norm"] = torch.randn(32, generator=g)
        t["bias"] = torch.randn(64, generator=g)
    return t


def grads_like(params, seed):
    g = torch.Generator().manual_seed(seed)
    return {
        k: grads_like(v, seed + 1) if isinstance(v, dict) else torch.randn(v.shape, generator=g)
        for k, v in params.items()
    }


def recipe(lr, **kw):
    kw = {"weight_decay": 0.01, "ns_dtype": torch.float32, **kw}
    return mf.muon(lr, 0.95, **kw)


def assert_trees_close(a, b, **tol):
    la, sa = mf.core.tree.tree_flatten(a)
    lb, sb = mf.core.tree.tree_flatten(b)
    assert sa == sb
    for x, y in zip(la, lb):
        if x is None or y is None:
            assert x is None and y is None
        else:
            torch.testing.assert_close(x, y, **tol)


def test_explain_zero_graph_breaks_muon_over_dict():
    lr = torch.tensor(0.02)
    tx = recipe(lr)
    params = tree()
    state = tx.init(params)
    explanation = torch._dynamo.explain(tx.update)(grads_like(params, 1), state, params)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_explain_zero_graph_breaks_hybrid_with_none_grad():
    lr, adamw_lr = torch.tensor(0.02), torch.tensor(1e-3)
    tx = mf.hybrid(lr, adamw_lr=adamw_lr, ns_dtype=torch.float32)
    params = tree(with_vectors=True)
    state = tx.init(params)
    grads = grads_like(params, 1)
    grads["bias"] = None  # a missing gradient
    explanation = torch._dynamo.explain(tx.update)(grads, state, params)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.parametrize("via", ["torch.compile", "compile_update"])
def test_one_compile_across_ten_learning_rates(via):
    lr = torch.tensor(0.02)
    tx = recipe(lr)
    counter = CompileCounterWithBackend("eager")
    if via == "compile_update":
        step = mf.compile_update(tx, backend=counter).update
    else:
        step = torch.compile(tx.update, backend=counter, fullgraph=True)
    params = tree()
    state_c = state_e = tx.init(params)
    params_c = params_e = params
    for i, value in enumerate([0.02, 0.01, 0.005, 0.03, 1e-3, 0.1, 0.07, 0.0, 0.2, 0.015]):
        lr.fill_(value)
        grads = grads_like(params, 10 + i)
        upd_c, state_c = step(grads, state_c, params_c)
        upd_e, state_e = tx.update(grads, state_e, params_e)
        # compiled == eager at every step: the lr is read at run time, not baked into the graph.
        assert_trees_close(upd_c, upd_e, atol=1e-6, rtol=1e-6)
        assert_trees_close(state_c, state_e, atol=1e-6, rtol=1e-6)
        params_c, params_e = mf.apply_updates(params_c, upd_c), mf.apply_updates(params_e, upd_e)
        if value == 0.0:  # lr = 0 (with decoupled decay scaled by lr): no movement at all
            assert all(torch.equal(u, torch.zeros_like(u)) for u in mf.core.tree.tree_leaves(upd_c))
    assert counter.frame_count == 1
    assert_trees_close(params_c, params_e, atol=1e-5, rtol=1e-5)


def _entry_points(model):
    """Every muon_fn compile entry point, each stepped once (compiled by default)."""
    from muon_fn.fsdp import FSDPMuonOptimizer, FSDPSpectralSphereOptimizer

    params = list(model.parameters())
    for p in params:
        p.grad = torch.ones_like(p)
    tx = mf.compile_update(mf.adamw(0.1))
    tx.update(tuple(p.grad for p in params), tx.init(tuple(params)), tuple(params))
    for make in (
        lambda: mf.MuonOptimizer(params),
        lambda: mf.create_hybrid_optimizer(model),
        lambda: mf.SpectralSphereOptimizer(params),
        lambda: mf.TritonMuon(params),
        lambda: mf.TritonMuonW(params),
        lambda: FSDPMuonOptimizer(model),
        lambda: FSDPSpectralSphereOptimizer(model),
    ):
        make().step()


def test_every_entry_point_compiles_with_dynamic_false(device, compiled_default, monkeypatch):
    """Floats of the update stay constants of the Dynamo graph, so they are in every cache key
    (tests/test_compile_cache.py shows what happens otherwise)."""
    calls = []
    monkeypatch.setattr(
        torch, "compile", lambda fn, **kw: (calls.append(kw), fn)[1]
    )  # record, don't compile
    _entry_points(_SmallLM().to(device))
    # (a transform of whole matrices on the CPU also passes inductor an option: _compile.for_scope)
    plain = [{k: v for k, v in kw.items() if k != "options"} for kw in calls]
    assert len(calls) >= 8 and all(kw == {"fullgraph": True, "dynamic": False} for kw in plain), (
        calls
    )
    assert all(
        kw.get("options", _compile.MATRIX_CPU_OPTIONS) == _compile.MATRIX_CPU_OPTIONS
        for kw in calls
    )


@pytest.mark.parametrize("dynamic", [True, None])
def test_dynamic_compiles_are_refused_with_the_reason(dynamic):
    message = (
        f"Invalid dynamic: {dynamic} (muon_fn compiles with dynamic=False. A dynamic compile turns float "
        "hyperparameters such as betas or eps into symbolic values, and torch's on-disk compile caches "
        "(2.13 and 2.14 measured) can then serve a graph that burned in another value: a silently wrong "
        "update; pytorch/pytorch#194976 and #197889. Per-step scalars (lr, momentum, schedules) are 0-d "
        "tensors, so a static graph never recompiles for them; see docs/faq.md, 'Compilation')"
    )
    with pytest.raises(ValueError) as error:
        mf.compile_update(mf.adamw(0.1), dynamic=dynamic)
    assert str(error.value) == message
    with pytest.raises(ValueError, match="Invalid dynamic"):  # at construction, before any step
        mf.MuonOptimizer(_small_model(False).parameters(), compile={"dynamic": dynamic})


@pytest.mark.slow
def test_per_step_scalars_enter_the_graph_as_0d_tensors(device):
    """lr and momentum are graph inputs (0-d tensors refreshed in place), never constants: a
    scheduler changes them without a recompile and the graph reads the new values."""
    seen = []

    def backend(gm, example_inputs):
        seen.append([t for t in example_inputs if isinstance(t, torch.Tensor) and t.ndim == 0])
        return gm.forward

    model = _small_model(False, device)
    opt = mf.MuonOptimizer(model.parameters(), lr=0.02, momentum=0.9, compile={"backend": backend})
    _backward(model, 0)
    opt.step()
    graphs = len(seen)
    assert graphs == len(opt._runtimes[0].buckets)

    def values():  # each graph's 0-d float inputs (the optimizer's tensors, refreshed in place)
        return [sorted(float(t) for t in scalars if t.is_floating_point()) for scalars in seen]

    assert values() == [pytest.approx([0.02, 0.9], rel=1e-6)] * graphs
    opt.param_groups[0]["lr"] = 0.01
    _backward(model, 1)
    opt.step()
    assert len(seen) == graphs
    assert values() == [pytest.approx([0.01, 0.9], rel=1e-6)] * graphs


def test_schedule_lr_does_not_recompile():
    tx = recipe(lambda count: 0.02 * 0.9 ** count.to(torch.float32))
    counter = CompileCounterWithBackend("eager")
    step = mf.compile_update(tx, backend=counter).update
    params = tree()
    state_c = state_e = tx.init(params)
    for i in range(6):
        grads = grads_like(params, i)
        upd_c, state_c = step(grads, state_c, params)
        upd_e, state_e = tx.update(grads, state_e, params)
        assert_trees_close(upd_c, upd_e, atol=1e-6, rtol=1e-6)
    assert counter.frame_count == 1
    assert int(state_c[-1].count) == 6


@pytest.mark.parametrize(
    "make",
    [
        lambda lr: mf.adamw(lr, weight_decay=0.1),
        lambda lr: mf.normuon(lr, ns_dtype=torch.float32),
        lambda lr: mf.muon(lr, kind="ema", method="quintic", ns_dtype=torch.bfloat16),
        lambda lr: mf.muon(
            lr,
            method="you",
            view=lambda leaf: mf.heads(rows=2) if leaf.shape[0] == 32 else "flatten",
            ns_dtype=torch.float32,
        ),
    ],
    ids=["adamw", "normuon", "muon-ema-quintic-bf16", "muon-you-heads"],
)
def test_compiled_equals_eager_other_recipes(make):
    lr = torch.tensor(0.01)
    tx = make(lr)
    counter = CompileCounterWithBackend("eager")
    step = mf.compile_update(tx, backend=counter).update
    params = tree()
    state_c = state_e = tx.init(params)
    for i, value in enumerate([0.01, 0.02, 0.005]):
        lr.fill_(value)
        grads = grads_like(params, i)
        upd_c, state_c = step(grads, state_c, params)
        upd_e, state_e = tx.update(grads, state_e, params)
        assert_trees_close(upd_c, upd_e, atol=1e-6, rtol=1e-5)
        assert_trees_close(state_c, state_e, atol=1e-6, rtol=1e-5)
    assert counter.frame_count == 1


def test_compile_update_keeps_init_and_repr():
    tx = recipe(torch.tensor(0.02))
    ctx = mf.compile_update(tx, backend="eager")
    assert ctx.init is tx.init
    assert repr(ctx) == f"compile_update({tx!r})"


@pytest.mark.inductor
def test_inductor_matches_eager(device):
    lr = torch.tensor(0.02, device=device)
    tx = mf.muon(lr, 0.95, weight_decay=0.01, ns_dtype=torch.float32, ns_steps=3)
    g = torch.Generator().manual_seed(0)
    params = {
        "w": torch.randn(16, 24, generator=g).to(device),
        "v": torch.randn(24, 16, generator=g).to(device),
    }
    step = mf.compile_update(tx, backend="inductor").update
    state_c = state_e = tx.init(params)
    for i, value in enumerate([0.02, 0.01]):
        lr.fill_(value)
        grads = {k: v.to(device) for k, v in grads_like(params, i).items()}
        upd_c, state_c = step(grads, state_c, params)
        upd_e, state_e = tx.update(grads, state_e, params)
        # Inductor fuses and reorders fp32 arithmetic: rounding-level differences, amplified by NS.
        assert_trees_close(upd_c, upd_e, atol=1e-5, rtol=1e-4)
        assert_trees_close(state_c, state_e, atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------- MuonOptimizer(compile=...)
def _matrices(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(32, 32), (32, 32), (32, 32), (128, 32), (32, 128), (128, 32), (8, 4, 3, 3)]
    return [torch.nn.Parameter(torch.randn(s, generator=g) / s[1] ** 0.5) for s in shapes]


def _run_scheduled(opt, params, steps, seed=10):
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))
    for t in range(steps):
        g = torch.Generator().manual_seed(seed + t)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
        sched.step()


@pytest.mark.slow
def test_muon_optimizer_compiles_one_graph_per_bucket_signature_no_recompiles():
    """One fullgraph graph per bucket signature (up to BUCKET_SIZE parameters of one shape),
    none more over an LR schedule, and the result equals the eager step."""
    counter = CompileCounterWithBackend("eager")
    params = _matrices()
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    kw = dict(lr=0.02, weight_decay=0.01, ns_dtype=torch.float32)
    opt = mf.MuonOptimizer(params, compile={"backend": counter}, **kw)
    ref_opt = mf.MuonOptimizer(ref, compile=False, **kw)
    _run_scheduled(opt, params, 1)
    # Buckets: three 32x32, two 128x32, one 32x128, one 8x4x3x3.
    assert counter.frame_count == 4
    _run_scheduled(opt, params, 9, seed=11)
    assert counter.frame_count == 4
    _run_scheduled(ref_opt, ref, 1)
    _run_scheduled(ref_opt, ref, 9, seed=11)
    for p, q in zip(params, ref):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(
            opt.state[p]["momentum_buffer"], ref_opt.state[q]["momentum_buffer"]
        )


@pytest.mark.slow
def test_muon_optimizer_compiled_adamw_half_and_normuon():
    """Biases (AdamW) and NorMuon go through the same compiled apply."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    ref = copy.deepcopy(model)
    for kw in ({}, {"beta2": 0.95}):
        m, r = copy.deepcopy(model), copy.deepcopy(ref)
        opt = mf.MuonOptimizer(
            m.parameters(), compile={"backend": "eager"}, ns_dtype=torch.float32, **kw
        )
        ref_opt = mf.MuonOptimizer(r.parameters(), compile=False, ns_dtype=torch.float32, **kw)
        for t in range(3):
            x = torch.randn(5, 8, generator=torch.Generator().manual_seed(t))
            for mod, o in ((m, opt), (r, ref_opt)):
                o.zero_grad()
                mod(x).square().mean().backward()
                o.step()
        for p, q in zip(m.parameters(), r.parameters()):
            torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-6)


@pytest.mark.inductor
def test_muon_optimizer_inductor_matches_eager(compiled_default):
    params = _matrices()[:5]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = mf.MuonOptimizer(params, method="aol", ns_steps=2)  # the default: compiled with inductor
    ref_opt = mf.MuonOptimizer(ref, compile=False, method="aol", ns_steps=2)
    _run_scheduled(opt, params, 2)
    _run_scheduled(ref_opt, ref, 2)
    assert opt._runtimes[0].variants[0].steps[(True, False)].compiled, "the default did not compile"
    for p, q in zip(params, ref):
        # The iteration is the same operator in both; inductor only fuses the elementwise steps.
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


def test_per_signature_one_graph_per_signature_beyond_the_recompile_limit():
    """PerSignature: a fresh code object per signature, so more distinct bucket signatures than
    Dynamo's recompile limit (8) still compile each once, with fullgraph=True."""
    counter = CompileCounterWithBackend("eager")
    fn = mf.core.compile.PerSignature(
        lambda x: (x @ x.mT) @ x * 0.5, {"backend": counter, "fullgraph": True}
    )
    shapes = [(2, n, n + 1) for n in range(1, 13)]
    for _ in range(2):
        for s in shapes:
            x = torch.randn(s)
            torch.testing.assert_close(fn(s, x), (x @ x.mT) @ x * 0.5)
    assert counter.frame_count == len(shapes) > torch._dynamo.config.recompile_limit


# ----------------------------------------------------------------------------- the step contract
def _host_reads(fn) -> int:
    """``aten::item`` / ``aten::_local_scalar_dense`` calls (device-to-host reads) while ``fn`` runs,
    seen by the profiler in eager code, in the custom iteration operator and in compiled graphs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name in ("aten::_local_scalar_dense", "aten::item"))


def _small_model(bias: bool, device: torch.device | str = "cpu"):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16, bias=bias),
        torch.nn.GELU(),
        torch.nn.Linear(16, 16, bias=bias),
        torch.nn.Linear(16, 4, bias=bias),
    ).to(device)


def _backward(model, step):
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(step)).to(
        next(model.parameters()).device
    )
    model.zero_grad()
    model(x).square().mean().backward()


def test_probe_counts_host_reads():
    x = torch.ones(())
    assert _host_reads(lambda: float(x)) >= 1 and _host_reads(lambda: x + 1) == 0


@pytest.mark.parametrize("compile", [False, {"backend": "eager"}], ids=["eager", "compiled"])
@pytest.mark.parametrize("bias", [False, True], ids=["muon", "hybrid"])
@pytest.mark.slow
def test_step_reads_nothing_back(compile, bias):
    """No .item()/float()/bool() of a device tensor in a step, eager or compiled, Muon-only or
    hybrid (torch.optim.AdamW itself reads its step count back every step), nonfinite="skip"."""
    model = _small_model(bias)
    opt = mf.MuonOptimizer(model.parameters(), compile=compile, weight_decay=0.01, beta2=None)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=0.05, total_steps=10, cycle_momentum=True, base_momentum=0.85, max_momentum=0.95
    )
    _backward(model, 0)
    opt.step()  # the first compiled step compiles (inductor and Dynamo read constants then)
    for step in range(1, 4):
        _backward(model, step)
        assert _host_reads(opt.step) == 0, step
        sched.step()


@pytest.mark.inductor
def test_inductor_step_reads_nothing_back(device, compiled_default):
    model = _small_model(True, device)
    opt = mf.create_hybrid_optimizer(model, beta2=0.95)
    _backward(model, 0)
    opt.step()
    _backward(model, 1)
    assert _host_reads(opt.step) == 0


@pytest.mark.slow
def test_no_recompiles_over_100_steps_with_lr_and_momentum_schedules(device):
    counter = CompileCounterWithBackend("eager")
    model = _small_model(True, device)
    opt = mf.MuonOptimizer(model.parameters(), compile={"backend": counter}, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=0.05, total_steps=100, cycle_momentum=True, base_momentum=0.8, max_momentum=0.95
    )
    _backward(model, 0)
    opt.step()
    sched.step()
    first = counter.frame_count
    assert first == len(opt._runtimes[0].buckets)
    seen = set()
    for step in range(1, 100):
        _backward(model, step)
        opt.step()
        seen.add((opt.param_groups[0]["lr"], opt.param_groups[0]["momentum"]))
        sched.step()
    assert len(seen) > 50 and counter.frame_count == first


@pytest.mark.slow
def test_adding_a_param_group_compiles_that_group_once():
    counter = CompileCounterWithBackend("eager")
    model = _small_model(False)
    first, rest = list(model.parameters())[:1], list(model.parameters())[1:]
    opt = mf.MuonOptimizer(first, compile={"backend": counter})
    _backward(model, 0)
    opt.step()
    assert counter.frame_count == 1
    opt.add_param_group({"params": rest, "lr": 0.01})
    for step in range(1, 5):
        _backward(model, step)
        opt.step()
    assert counter.frame_count == 1 + len(opt._runtimes[1].buckets) == 3  # 16x16, 4x16


@pytest.mark.parametrize(
    "make",
    [
        lambda m: mf.MuonOptimizer(m.parameters()),
        lambda m: mf.MuonOptimizer(m.parameters(), beta2=0.95),
        lambda m: mf.SpectralSphereOptimizer(m.parameters()),
        lambda m: mf.Optimizer(m.parameters(), lambda h: mf.hybrid(h["lr"]), {"lr": 0.02}),
        lambda m: mf.create_hybrid_optimizer(m),
        lambda m: mf.FSDPMuonOptimizer(m),
        lambda m: mf.FSDPSpectralSphereOptimizer(m),
    ],
    ids=["muon", "normuon", "sso", "generic", "hybrid", "fsdp-muon", "fsdp-sso"],
)
def test_torch_compile_of_opt_step(make):
    """torch's compiled-optimizer recipe, torch.compile(opt.step), runs and gives the plain step's
    results: the step is already compiled, so the outer compile leaves it to those graphs."""
    from torch._dynamo.testing import CompileCounter

    a, b = _small_model(True), _small_model(True)
    opt_a, opt_b = make(a), make(b)
    outer = CompileCounter()
    step_b = torch.compile(opt_b.step, backend=outer)
    for step in range(3):
        for model, fn in ((a, opt_a.step), (b, step_b)):
            _backward(model, step)
            fn()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    assert outer.frame_count == 0  # nothing of the step traced twice, nothing recompiled
    with pytest.raises(Exception, match="compile their own step"):
        torch.compile(opt_b.step, fullgraph=True, backend="eager")()


@pytest.mark.inductor
def test_compiling_impossible_falls_back_to_eager_with_one_warning(compiled_default, monkeypatch):
    """No usable C++ compiler: one RuntimeWarning naming the cause and compile=False, then eager
    steps with the eager results."""
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(mf.core.compile, "_UNUSABLE", None)
    a, b = _small_model(False), _small_model(False)
    opt_a = mf.MuonOptimizer(a.parameters())
    opt_b = mf.MuonOptimizer(b.parameters(), compile=False)
    # inductor's own patch: monkeypatch's undo of a config attribute deletes it, which breaks
    # every later cold compile in the process ("config.cpp.cxx does not exist").
    with (
        inductor_config.patch({"cpp.cxx": ("/nonexistent/g++",)}),
        pytest.warns(RuntimeWarning, match="C\\+\\+ compiler.*compile=False") as record,
    ):
        for step in range(2):
            for model, opt in ((a, opt_a), (b, opt_b)):
                _backward(model, step)
                opt.step()
    assert len([w for w in record if "muon_fn" in str(w.message)]) == 1
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


class _SmallLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16)
        self.fc = torch.nn.Linear(16, 16, bias=False)
        self.norm = torch.nn.LayerNorm(16)
        self.head = torch.nn.Linear(16, 32, bias=False)


@pytest.mark.inductor
@pytest.mark.slow
def test_compiled_hybrid_does_not_reuse_another_betas_graph(
    device, compiled_default, monkeypatch, tmp_path
):
    """In one process, with torch's caches on: compiled with Dynamo's default (automatic
    dynamic), the hybrid's AdamW step for adamw_betas=(0.9, 0.999) after one for (0.9, 0.95) was
    served a graph with 0.95 burned into the bias correction √(1 − β₂ᵗ) (Adam's first step
    √50 ≈ 7.1 × lr instead of lr; torch 2.13, docs/faq.md "Compilation"). With dynamic=False β₂
    is a constant of the graph and of its cache key: each first step here is ±lr. Across
    processes: tests/test_compile_cache.py."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    for beta2 in (0.95, 0.999):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = _SmallLM().to(device)
        opt = mf.create_hybrid_optimizer(
            model,
            adamw_lr=1e-2,
            adamw_weight_decay=0.1,
            adamw_betas=(0.9, beta2),
            ns_dtype=torch.float32,
        )
        before = model.norm.bias.detach().clone()
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        step = (model.norm.bias.detach() - before) / 1e-2
        torch.testing.assert_close(
            step, torch.full_like(step, -1.0), atol=1e-4, rtol=0, msg=f"beta2={beta2}"
        )
