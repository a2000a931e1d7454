"""Execution policies (muon_fn.core.execution): one math, run per device. The GPU's batched policy is
forced on CPU tensors here, so its results, GEMM counts and compiled graphs are tested without a
GPU; the CPU policy keeps the tuned per-matrix path."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import muon_fn as mf
from muon_fn.core import execution as _execution
from muon_fn.core import newton_schulz as _newton_schulz
from muon_fn.engine._adapter import BUCKET_SIZE

GEMMS = {"mm", "bmm", "addmm", "baddbmm", "addmm_", "baddbmm_"}  # ATen packet names (any overload)


class GemmCount(TorchDispatchMode):
    """Counts the GEMM calls (by ATen op) dispatched inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.operators = 0  # calls of the CPU policy's opaque orthogonalization operator

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.__name__.split(".")[0] in GEMMS
        self.operators += str(func).startswith("muon_fn.orthogonalize_batch")
        return func(*args, **(kwargs or {}))


def test_policy_by_device_and_forced():
    assert _execution.policy("cpu").name == "cpu"
    assert _execution.policy(torch.device("cuda", 0)).name == "batched"
    assert _execution.policy(None).name == "cpu"
    with _execution.forced("batched"):
        assert _execution.policy("cpu") is _execution.BATCHED
    assert _execution.policy("cpu") is _execution.CPU
    with (
        pytest.raises(ValueError, match=r"Invalid policy: 'gpu' \(valid: 'cpu', 'batched'\)"),
        _execution.forced("gpu"),
    ):
        pass


def test_bucket_limit_per_policy():
    params = [torch.zeros(4, 4) for _ in range(9)]
    assert _execution.bucket_limit(params, None) == BUCKET_SIZE == 4
    assert _execution.bucket_limit(params, 2) == 2
    with _execution.forced("batched"):
        assert _execution.bucket_limit(params, None) == 16 == _execution.BATCHED.bucket_size
        assert _execution.bucket_limit(params, 3) == 3


def test_gram_iterates_in_fp16_on_gpus_and_fp32_on_the_cpu():
    schedule = _newton_schulz.coefficient_schedule("gram", 5)
    assert _newton_schulz.default_compute_dtype(torch.device("cuda"), schedule) == torch.float16
    assert _newton_schulz.default_compute_dtype("cpu", schedule) == torch.float32
    quintic = _newton_schulz.coefficient_schedule("quintic", 5)
    assert _newton_schulz.default_compute_dtype(torch.device("cuda"), quintic) == torch.bfloat16
    # the default dtype of method="gram" is one it can run (it refused bf16 before choosing)
    model = nn.Linear(16, 64, bias=False)
    model.weight.grad = torch.randn(64, 16)
    mf.MuonOptimizer(model.parameters(), method="gram").step()
    assert torch.isfinite(model.weight).all()


SHAPES = [(24, 40), (40, 24), (32, 32), (400, 384), (384, 400)]
METHODS = ["quintic", "polar_express", "aol9", "aol", "you", "gram", "cubic"]


@pytest.mark.parametrize("method", METHODS)
def test_batched_policy_equals_the_cpu_policy(method):
    """Forcing the GPU's execution on CPU tensors gives the CPU path's msign (fp32: the two
    differ only in GEMM blocking, batched against per-matrix and split symmetric products)."""
    g = torch.Generator().manual_seed(0)
    schedule = _newton_schulz.coefficient_schedule(method, None)
    scale = _newton_schulz.norm_scale(method)
    for shape in SHAPES:
        xs = [torch.randn(shape, generator=g) for _ in range(3)]
        cpu = _newton_schulz.msign_batch(
            xs, schedule, dtype=torch.float32, eps=1e-7, norm_scale=scale
        )
        with _execution.forced("batched"):
            batched = _newton_schulz.msign_batch(
                xs, schedule, dtype=torch.float32, eps=1e-7, norm_scale=scale
            )
        torch.testing.assert_close(batched, cpu, rtol=0, atol=2e-5 if method != "gram" else 1e-4)


class Stack(nn.Module):
    """Eight 32×64 matrices, six 48×48 ones, their biases and a norm: 2 distinct matrix shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.wide = nn.ModuleList(nn.Linear(64, 32) for _ in range(8))
        self.square = nn.ModuleList(nn.Linear(48, 48) for _ in range(6))
        self.norm = nn.LayerNorm(48)


def _step_gemms(policy: str, method: str = "quintic", **kw) -> GemmCount:
    torch.manual_seed(0)
    model = Stack()
    with _execution.forced(policy):
        opt = mf.MuonOptimizer(model.parameters(), method=method, compile=False, **kw)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        count = GemmCount()
        with count:
            opt.step()
    return count


# GEMMs of one batch per iteration schedule: a quintic iteration runs XXᵀ, the polynomial
# (one addmm) and its product with X: 3 × 5. aol9: 3 quintics, then XXᵀ, A², the degree-9
# polynomial and its product with X: 9 + 4 = 13 (the AOL rescale reuses the first XXᵀ). Gram NS on a wide matrix: R₀,
# per row its polynomial (5), Q·T (4), T·R·T where R is carried (2 × 2 of the 4 updates), the
# restart's Q·X and XXᵀ (2) and the final Q·X (1): 18; square matrices run the standard form: 15.
GEMMS_PER_SHAPE = {
    "quintic": (15, 15),
    "polar_express": (15, 15),
    "aol9": (13, 13),
    "gram": (18, 15),
}


@pytest.mark.parametrize("method", list(GEMMS_PER_SHAPE))
def test_batched_step_runs_gemms_per_distinct_shape_not_per_matrix(method):
    """Under the batched policy one step runs O(distinct shapes × GEMMs per iteration) GEMMs:
    the 2 shapes' schedules here, whatever the 14 matrices; no opaque operator."""
    batched = _step_gemms("batched", method)
    assert (batched.count, batched.operators) == (sum(GEMMS_PER_SHAPE[method]), 0)
    # the CPU policy: one opaque call per bucket of at most BUCKET_SIZE matrices, 2 + 2 here
    assert _step_gemms("cpu", method).operators == 4


def test_cpu_policy_loops_over_large_matrices_and_batched_does_not():
    """The eager iteration (what the CPU's opaque operator runs)."""
    xs = [torch.randn(384, 400) for _ in range(3)]
    schedule = _newton_schulz.coefficient_schedule("quintic", 5)
    counts = {}
    for policy in ("cpu", "batched"):
        with _execution.forced(policy):
            count = GemmCount()
            with count:
                _newton_schulz.orthogonalize_batch(xs, schedule, dtype=torch.float32, eps=1e-7)
            counts[policy] = count.count
    assert counts["batched"] == 15
    assert counts["cpu"] > 3 * 15  # one matrix at a time, symmetric products in blocks


@pytest.mark.parametrize("policy,opaque", [("cpu", True), ("batched", False)])
@pytest.mark.slow
def test_compiled_iteration_is_opaque_on_cpu_and_inline_when_batched(policy, opaque):
    """Under torch.compile the CPU policy keeps the iteration one custom operator; the batched
    policy traces it inline (inductor fuses around its GEMMs; CUDA graphs can capture it)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.manual_seed(0)
    model = Stack()
    with _execution.forced(policy):
        opt = mf.MuonOptimizer(model.parameters(), compile={"backend": backend})
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
    targets = {str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"}
    assert any("orthogonalize_batch" in t for t in targets) == opaque
    assert any("bmm" in t or "baddbmm" in t for t in targets) == (not opaque)


def test_optimizer_results_agree_across_policies():
    """A few steps of the hybrid under each policy (fp32 iteration): equal to rounding."""
    results = []
    for policy in ("cpu", "batched"):
        torch.manual_seed(0)
        model = Stack()
        with _execution.forced(policy):
            opt = mf.MuonOptimizer(
                model.parameters(), ns_dtype=torch.float32, compile=False, weight_decay=0.01
            )
            for step in range(3):
                g = torch.Generator().manual_seed(step)
                for p in model.parameters():
                    p.grad = torch.randn(p.shape, generator=g)
                opt.step()
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("policy,static", [("cpu", False), ("batched", True)])
@pytest.mark.slow
def test_compiled_batched_steps_mark_parameters_and_state_static(policy, static):
    """What lets compile={"mode": "reduce-overhead"} capture the step as CUDA graphs: the tensors
    the step writes in place are static addresses (unguarded: a moved one re-records, it does not
    recompile). Eager steps and the CPU policy mark nothing."""
    torch.manual_seed(0)
    model = Stack()
    with _execution.forced(policy):
        opt = mf.MuonOptimizer(model.parameters(), compile={"backend": "eager"})
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
    marked = [
        getattr(t, "_dynamo_static_input_type", None)
        for p in model.parameters()
        for t in opt.state[p].values()
        if isinstance(t, torch.Tensor)
    ]
    assert len(marked) == 14 + 16 * 3  # 14 momentum buffers; 16 AdamW params: step, exp_avg(_sq)
    assert marked == ["unguarded" if static else None] * len(marked)
    if static:
        assert all(getattr(p, "_dynamo_static_input_type", None) for p in model.parameters())
    assert all(
        getattr(p.grad, "_dynamo_static_input_type", None) is None for p in model.parameters()
    )


@pytest.mark.inductor
@pytest.mark.slow
def test_batched_policy_compiles_with_inductor_as_one_graph_per_shape(
    compiled_default, method="quintic"
):
    """The GPU's execution, compiled by inductor (the adapters' default) on CPU tensors: one
    fullgraph graph per distinct bucket signature (2 matrix shapes, one AdamW bucket per 1-D
    shape), the eager batched results to fp32 rounding."""
    from torch._dynamo.testing import CompileCounterWithBackend

    results, counter = [], CompileCounterWithBackend("inductor")
    for compile in (False, {"backend": counter}):
        torch.manual_seed(0)
        model = Stack()
        with _execution.forced("batched"):
            opt = mf.MuonOptimizer(
                model.parameters(), method=method, ns_dtype=torch.float32, compile=compile
            )
            for step in range(2):
                g = torch.Generator().manual_seed(step)
                for p in model.parameters():
                    p.grad = torch.randn(p.shape, generator=g)
                opt.step()
        results.append([p.detach().clone() for p in model.parameters()])
    assert (
        counter.frame_count == len(opt._runtimes[0].buckets) == 4
    )  # 32x64, 48x48, (32,), (48,): biases, norm
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_batched_symmetric_products_from_half_blocks():
    """At or above the batched policy's symmetric_min_dim, XXᵀ, A² and the quintic's polynomial
    are 3 half-size GEMMs each (the block below the diagonal mirrored): the one-GEMM results to
    fp32 rounding, and exactly symmetric."""
    policy = _execution.BATCHED._replace(symmetric_min_dim=64)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, 96, generator=g) / 20
    schedule = _newton_schulz.coefficient_schedule("quintic", 5)
    with _execution.forced("batched"):
        plain = _newton_schulz.msign_batch(list(x), schedule, dtype=torch.float32, eps=1e-7)
    with _execution.forced(policy):
        gram = _newton_schulz.gram_matrix(x)
        count = GemmCount()
        with count:
            split = _newton_schulz.msign_batch(list(x), schedule, dtype=torch.float32, eps=1e-7)
    torch.testing.assert_close(gram, x @ x.mT, rtol=0, atol=1e-6)
    assert torch.equal(gram, gram.mT)
    assert count.count == 5 * (3 + 3 + 1)  # per iteration: XXᵀ and the polynomial in 3, then ·X
    torch.testing.assert_close(split, plain, rtol=0, atol=2e-5)
    with _execution.forced(policy):  # below the threshold: one GEMM per product
        count = GemmCount()
        with count:
            _newton_schulz.msign_batch(list(x[:, :32]), schedule, dtype=torch.float32, eps=1e-7)
    assert count.count == 15
