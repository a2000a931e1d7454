"""The planner at scale (muon_fn.fsdp.plan_model, `muon-fn plan`): pure, no processes."""

from __future__ import annotations

import contextlib
import io
import itertools
import math
import pathlib
import time

import expecttest
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from muon_fn.distributed import specs
from muon_fn.distributed._peak import _Scratch
from muon_fn.distributed._plan import chunk_rows, ns_flops
from muon_fn.distributed._predict import _least_capacity
from muon_fn.fsdp import FSDPMuonOptimizer, Mesh, format_plan, parse_mesh, plan_model
from muon_fn.tools import cli
from muon_fn.tools.plan import BENCH_FSDP

SPECS = ("llama3-8b", "llama3-70b", "deepseek-v3")
DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "distributed.md"


@pytest.mark.parametrize(
    "name, total, muon",
    [
        ("llama3-8b", 8_030_261_248, 6_979_321_856),  # Llama-3-8B's published count
        ("llama3-70b", 70_553_706_496, 68_451_041_280),
        ("deepseek-v3", 671_026_404_352, 669_172_039_680),  # 671B without the MTP module
    ],
)
def test_spec_parameter_counts_and_the_hybrid_split(name, total, muon):
    params = specs.model_params(name)
    assert sum(math.prod(p.shape) for p in params) == total
    assert sum(math.prod(p.shape) for p in params if p.view) == muon
    adamw = {p.name for p in params if p.view is None}
    assert {"embed.weight", "head.weight", "norm.weight"} <= adamw
    assert all(
        len(p.shape) == 1
        for p in params
        if p.view is None and "embed" not in p.name and "head" not in p.name
    )
    stacks = [p for p in params if p.view == "experts"]
    assert all(len(p.shape) == 3 for p in stacks) and (not stacks) == (name != "deepseek-v3")


def _tiny_model() -> tuple[nn.Module, list, list]:
    """A module whose parameters are the tiny spec's, in order (names do not matter to the plan)."""
    model = nn.Module()
    model.ps = nn.ParameterList(
        nn.Parameter(torch.zeros(p.shape)) for p in specs.model_params("tiny")
    )
    muon = [q for q, p in zip(model.ps, specs.model_params("tiny")) if p.view]
    adamw = [q for q, p in zip(model.ps, specs.model_params("tiny")) if not p.view]
    return model, muon, adamw


@pytest.mark.parametrize("bucket_size", [4, 1])
def test_plan_model_is_the_plan_the_optimizer_makes(bucket_size):
    """Same shapes, views (expert stacks from the model), units and buckets: the same Plan."""
    model, muon, adamw = _tiny_model()
    opt = FSDPMuonOptimizer(
        model,
        [{"params": muon}, {"params": adamw, "algorithm": "adamw"}],
        compile=False,
        bucket_size=bucket_size,
    )
    assert opt.plan == plan_model("tiny", "dp=1", bucket_size=bucket_size).plan


@pytest.mark.parametrize("inflight", [8 << 20, None])
def test_plan_model_on_the_cpu_is_the_plan_the_optimizer_makes_there(inflight):
    """The CPU policy's owner units (same-shape matrices within its 8 MiB bound: 768² matrices by
    three, 3072×768 alone) and the buckets cut for ``inflight_bytes``: the same Plan."""
    mats = BENCH_FSDP[:12]  # two gpt2-small layers
    model = nn.Module()
    model.ps = nn.ParameterList(nn.Parameter(torch.zeros(shape)) for _, shape, _ in mats)
    opt = FSDPMuonOptimizer(model, compile=False, inflight_bytes=inflight)
    report = plan_model(mats, "dp=1", policy="cpu", inflight_bytes=inflight)
    assert opt.plan == report.plan and report.units == 7  # squares by 3, 3 and 2; 4 rectangles


def _two_matrices(inflight, policy="batched"):
    """Two 8×8 fp32 matrices (256 B) on 2 ranks, one bucket each: rank 1 owns the first bucket's,
    rank 0 the second's; each rank holds 4 rows (128 B) of each."""
    mats = [("a", (8, 8), "flatten"), ("b", (8, 8), "flatten")]
    r = plan_model(
        mats, "dp=2", bucket_size=1, num_buckets=2, inflight_bytes=inflight, policy=policy
    )
    assert [[r.plan.matrices[j].owner for j in b.matrices] for b in r.plan.buckets] == [[1], [0]]
    return r


# An owner's compute of one 8×8 matrix, in bytes: the whole matrix (256), the bf16 iteration's X,
# XXᵀ and polynomial (3 × 64 × 2 = 384), the matrix cast to bf16 and its result in bf16
# (128 + 128); the fp32 result is written into the whole matrix.
COMPUTE = 256 + 384 + 128 + 128
# The same under the CPU policy, where the owner's gathered matrix is donated to the iteration:
# cast in its own memory, which then holds X, so no bf16 copy and no X scratch (256 + 256 + 128).
CPU_COMPUTE = 256 + 2 * 128 + 128


def test_step_peak_one_bucket_at_a_time():
    """A bucket holds 512 bytes on its owner (its matrix gathered and its result: 2 × 256) and 256
    elsewhere (4 rows sent, 4 back), so 300 and 512 bytes hold one bucket, not two: each bucket is
    applied and released before the next is packed, and both owners peak computing theirs."""
    for inflight in (300, 512):
        r = _two_matrices(inflight)
        assert r.inflight_bytes == inflight and r.step_peak == (COMPUTE, COMPUTE) == (896, 896)


def test_step_peak_two_buckets_in_flight():
    """1,024 bytes hold both buckets: while rank 1 computes the first, the second's gather is in
    flight, so it also holds its send buffer (its 4 rows of the second matrix, 128); while rank 0
    computes the second, it still holds the receive buffer of its rows of the first's result
    (128; its gather's send buffer was freed at its wait)."""
    assert _two_matrices(1024).step_peak == (COMPUTE + 128, COMPUTE + 128)


def test_step_peak_unbounded_and_scratch_kept():
    """No bound: every next bucket travels while one is computed, as at 1,024 bytes here. Without
    a bound the CPU policy keeps the iteration's scratch (XXᵀ and polynomial, 256; X is the
    donated matrix's own memory: ``CPU_COMPUTE``) after the owner's compute. Each result is
    computed in its gather's receive buffer and travels back in it, the owner's own rows with it
    (``_pieces.returns_in_place``). Rank 0 then peaks in the first bucket's post phase, which
    runs after it computed the second, just before the second's return is posted: scratch + the
    second's results (256) + the first's return receive buffer (128) + the post phase (the final
    update, into which p + u and the guarded where are computed: 128); rank 1 as it posts the
    first's return: the second's gather send buffer (128) + scratch + the first's results (256,
    the return's send buffer) + the return's receive buffer (its own rows, 128). Under a bound the
    scratch is freed after each owner's compute, so both ranks peak computing, as with no scratch
    kept."""
    assert _two_matrices(None).step_peak == _two_matrices(1024).step_peak
    assert _two_matrices(None, "cpu").step_peak == (
        256 + 256 + 128 + 128,
        128 + 256 + 256 + 128,
    )
    assert _two_matrices(1024, "cpu").step_peak == (CPU_COMPUTE + 128, CPU_COMPUTE + 128)
    assert _two_matrices(300, "cpu").step_peak == (CPU_COMPUTE, CPU_COMPUTE)
    assert plan_model("tiny", "dp=2").step_peak == ()  # not asked: no prediction


def test_step_peak_one_rank():
    """One rank exchanges nothing: its rows are the pre phase's (not the exchange's to
    overwrite), so its compute holds them (256), the workspace (384) and the result in bf16 and
    fp32 (128 + 256), above the post phase (rows and result kept, the final update: 3 × 256)."""
    r = plan_model([("a", (8, 8), "flatten")], "dp=1", inflight_bytes=None)
    assert r.step_peak == (256 + 384 + 128 + 256,)


def test_kept_scratch_depends_on_the_order_of_the_units():
    """The CPU products' scratch (X, XXᵀ, polynomial, elements): a buffer is made anew when too
    small or more than twice too large. Three 768² matrices after one 768×3072 reuse the larger X
    and grow the Gram buffers; in the other order the Gram buffers shrink back to one matrix's."""
    square, wide = 3 * 768 * 768, 768 * 3072
    scratch = _Scratch(kept=True)
    scratch.run(1, 768, 3072)
    scratch.run(3, 768, 768)
    assert scratch.roles == {"x": wide, "gram": square, "poly": square}
    scratch = _Scratch(kept=True)
    scratch.run(3, 768, 768)
    scratch.run(1, 768, 3072)
    assert scratch.roles == {"x": wide, "gram": 768 * 768, "poly": 768 * 768}


PERFORMANCE = DOC.with_name("performance.md")


def test_performance_docs_show_the_predictions():
    """docs/performance.md's predicted-against-measured table: each row's predicted step peak
    per rank is plan_model's for that row (min–max over the ranks, MiB), fp32 iterations as
    measured (an fp32 iteration is never run on AMX tiles: the same prediction on every CPU)."""
    text = PERFORMANCE.read_text()
    table = text[text.index("| W | row | `inflight_bytes` | predicted / rank") :].split("\n\n")[0]
    rows = [line.split(" | ") for line in table.splitlines()[2:]]
    assert len(rows) == 4
    for w, row, budget, predicted, *_ in rows:
        inflight = None if budget == "none" else int(budget.split()[0]) << 20
        wire = 2 if "bf16 wire" in row else 4
        peaks = plan_model(
            BENCH_FSDP,
            f"dp={w.strip('| ')}",
            policy="cpu",
            inflight_bytes=inflight,
            wire_bytes=wire,
            ns_bytes=4,
        ).step_peak
        lo, hi = (f"{x / 2**20:.1f}" for x in (min(peaks), max(peaks)))
        assert predicted == (f"{lo} MiB" if lo == hi else f"{lo}–{hi} MiB"), (w, row, budget)


def test_figures_by_hand():
    """Two 4x4 matrices on 2 ranks: each rank owns one, sends its half of the other and returns
    the other's half of its own: 16 elements = 2(W−1)/W²·S."""
    r = plan_model(
        [("a", (4, 4), "flatten"), ("b", (4, 4), "flatten")], "dp=2", bucket_size=1, ns_steps=5
    )
    assert sorted(mp.owner for mp in r.plan.matrices) == [0, 1]
    assert r.flops == (5 * (4 * 16 * 4 + 2 * 64),) * 2 == (ns_flops((4, 4), 5),) * 2
    assert r.sent == r.received == (64, 64) and r.muon_bytes == 128 and r.bytes_formula == 64
    # Gather send 8 + 8, gather receive 16 (owned), return send 16 (owned), return receive 8 + 8,
    # one bucket's assembled matrix and result 2·16: 4·(16 + 16 + 16 + 16 + 32) bytes; and the bf16
    # iteration's X, XXᵀ, its square, the new X: (2·16 + 2·16)·2.
    assert r.peak == (4 * (16 + 16 + 16 + 16 + 32) + 128,) * 2
    assert (r.flops_max_mean, r.efficiency, r.idle_ranks, r.matrices, r.units) == (
        1.0,
        1.0,
        0,
        2,
        2,
    )


@pytest.mark.parametrize("name", SPECS)
def test_each_spec_at_1024_ranks(name):
    """Fast at W = 1,024; bytes as the exchange sends them (the plan's split sizes); the mean equals
    2(W−1)/W²·S where every matrix's rows divide by W and otherwise 2/W·Σ (S_j − S_j at its owner)."""
    w, start = 1024, time.perf_counter()
    r = plan_model(name, f"dp={w}", bucket_size=1)
    elapsed = time.perf_counter() - start
    print(f"{name}: plan_model at W={w} in {elapsed:.2f} s")  # the goal is well under a second
    for rank in (0, 1, 511, 1023, max(range(w), key=r.sent.__getitem__)):
        assert r.sent[rank] == 4 * r.plan.sent_elements(rank)
    assert sum(r.sent) == sum(r.received)
    travel = [mp for mp in r.plan.matrices if not mp.local]  # expert stacks stay where they lie
    kept = sum(mp.contrib_numel(mp.owner) * 4 for mp in travel)
    assert sum(r.sent) == 2 * (r.muon_bytes - kept)
    if all(mp.rows % w == 0 for mp in travel):
        assert r.sent_mean == r.bytes_formula
    assert r.efficiency == pytest.approx(sum(r.flops) / w / max(r.flops))
    assert r.step_s >= r.ideal_step_s / r.efficiency
    if name == "deepseek-v3":  # 256 experts on 1,024 ranks: one-expert pieces spread the work
        assert r.flops_max_mean <= 1.05 and r.idle_ranks == 0
    else:  # ranks outnumber the matrices' worth of work: the largest sets the step, LPT reaches
        # that bound exactly and the ranks left over idle
        assert r.flops_max_mean == pytest.approx(r.bound_max_mean, rel=1e-12) and r.idle_ranks > 0


@pytest.mark.parametrize(
    "name, w, bucket_size",
    [
        ("llama3-8b", 8, 4),
        ("llama3-70b", 8, 4),
        ("deepseek-v3", 8, 4),
        ("llama3-8b", 8, 1),
        ("llama3-70b", 8, 1),
        ("deepseek-v3", 8, 1),
        ("llama3-70b", 64, 1),
        ("deepseek-v3", 64, 1),
        ("deepseek-v3", 1024, 1),
    ],
)
def test_flops_balance_goal(name, w, bucket_size):
    r = plan_model(name, w, bucket_size=bucket_size)
    assert r.flops_max_mean <= 1.05 and r.idle_ranks == 0


def test_where_whole_matrices_cannot_reach_the_goal_lpt_reaches_the_bound():
    """Llama-3-8B at W = 64: 96 MLP matrices on 64 ranks, so some rank computes two (1.057);
    Llama-3-70B at W = 1,024: its largest matrices alone are 3.406× the mean."""
    for name, w, bound in (("llama3-8b", 64, 1.057), ("llama3-70b", 1024, 3.406)):
        r = plan_model(name, w, bucket_size=1)
        assert round(r.bound_max_mean, 3) == bound and r.flops_max_mean == pytest.approx(
            r.bound_max_mean
        )


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=7), st.integers(1, 3), st.integers(0, 20))
def test_l2_bound_is_never_above_the_best_assignment(costs, w, base):
    """The L2 bin-packing bound never exceeds the optimal makespan (brute force over every
    assignment), with every rank carrying ``base`` already."""
    best = min(
        max(base + sum(c for c, r in zip(costs, owners) if r == k) for k in range(w))
        for owners in itertools.product(range(w), repeat=len(costs))
    )
    start = max(base + sum(costs) / w, base + max(costs))
    assert _least_capacity(costs, w, start, base) <= best + 1e-9


def test_missed_cells_are_at_their_bound():
    """Where max/mean misses 1.05 with as many matrices as ranks, no assignment of whole
    matrices does better: LPT sits at the lower bound."""
    for name, w in (("llama3-8b", 64), ("llama3-70b", 256), ("deepseek-v3", 256)):
        r = plan_model(name, w, bucket_size=1)
        assert r.flops_max_mean > 1.05 and r.flops_max_mean == pytest.approx(
            r.bound_max_mean, rel=1e-5
        )


def test_hsdp_replicas_plan_like_one_shard_group():
    one, hsdp = plan_model("tiny", "dp=4"), plan_model("tiny", "replicate=2,dp=4")
    assert hsdp.mesh == Mesh(dp=4, replicate=2) and hsdp.mesh.world_size == 8
    assert (hsdp.plan, hsdp.flops, hsdp.sent, hsdp.peak) == (
        one.plan,
        one.flops,
        one.sent,
        one.peak,
    )


def test_rows_follow_fsdp2_chunks():
    r = plan_model("deepseek-v3", "dp=256", bucket_size=1)
    stack = r.plan.matrices[r.names.index("layers.3.moe.experts.gate_proj")]
    assert stack.local and stack.contrib == chunk_rows(256, 256) and stack.cols == 2048 * 7168


def test_fewer_experts_than_ranks_are_cut_into_pieces():
    """256 experts on 1,024 ranks: FSDP2 leaves 768 ranks without an expert, so each expert is a
    one-row piece. Its holder (rank e) keeps (computes where it lies) what fits within the mean
    load and the rest goes to owners on the other ranks; the optimizer makes the same pieces
    (test_fsdp_views)."""
    r = plan_model("deepseek-v3", "dp=1024", bucket_size=1)
    piece = r.plan.matrices[r.names.index("layers.3.moe.experts.gate_proj[5]")]
    assert piece.shape == (1, 2048, 7168) and piece.cols == 2048 * 7168
    assert (
        piece.receive == piece.contrib == tuple((0, 1) if k == 5 else (0, 0) for k in range(1024))
    )
    pieces = [mp for name, mp in zip(r.names, r.plan.matrices) if ".experts." in name]
    assert len(pieces) == 58 * 3 * 256
    kept = sum(mp.local for mp in pieces)
    assert 0.2 < kept / len(pieces) < 0.3  # about the mean load's worth (43 of 174) per holder
    moved = [mp for mp in pieces if not mp.local]  # the rest travels, mostly to the idle ranks
    assert all(mp.receive[mp.owner] == (0, 0) for mp in moved)
    assert sum(mp.owner >= 256 for mp in moved) > 0.9 * len(moved)
    assert r.flops_max_mean <= 1.05 and r.idle_ranks == 0


def test_tensor_parallel_plan():
    """FSDP×TP: the optimizer exchanges over all dp·tp ranks. Column- and row-wise projections are
    held in dp·tp row blocks (a row-wise weight after its redistribution to rows, which costs each
    rank (tp−1)/tp of its block both ways); a matrix TP does not cut is held in dp blocks, alike on
    the TP ranks, and travels once; expert stacks stay local."""
    one, two = (
        plan_model("llama3-8b", "dp=8", bucket_size=1),
        plan_model("llama3-8b", "dp=4,tp=2", bucket_size=1),
    )
    assert two.world_size == 8 and two.flops == one.flops
    q = two.plan.matrices[two.names.index("layers.0.attn.q_proj.weight")]
    assert q.receive == q.contrib == chunk_rows(4096, 8)
    rowwise = sum(
        mp.numel
        for name, mp in zip(two.names, two.plan.matrices)
        if name.endswith(("o_proj.weight", "down_proj.weight"))
    )
    assert two.sent_mean == pytest.approx(one.sent_mean + 2 * rowwise / 8 / 2 * 4)
    ds = plan_model("deepseek-v3", "dp=2,tp=4", bucket_size=1)
    qa = ds.plan.matrices[ds.names.index("layers.0.attn.q_a_proj.weight")]
    assert qa.receive == (chunk_rows(1536, 2)[0],) * 4 + (chunk_rows(1536, 2)[1],) * 4
    assert sum(b - a for a, b in qa.contrib) == 1536  # one copy of each block travels
    assert all(mp.local for name, mp in zip(ds.names, ds.plan.matrices) if ".experts." in name)
    assert str(parse_mesh("replicate=2,dp=4,tp=2")) == "replicate=2,dp=4,tp=2"
    assert plan_model("tiny", "replicate=2,dp=2,tp=2").world_size == 8


@pytest.mark.parametrize(
    "mesh, message",
    [
        ("dp=0", "Invalid mesh: 'dp=0' (dp=0, expected >= 1)"),
        (
            "ep=8",
            "Invalid mesh: 'ep=8' (expected comma-separated dims dp=N, replicate=N, tp=N, e.g. 'dp=64')",
        ),
        ("dp=x", "Invalid mesh: 'dp=x' (expected comma-separated dims"),
        ("dp=2,dp=4", "Invalid mesh: 'dp=2,dp=4' (expected comma-separated dims"),
        ("replicate=2", "Invalid mesh: 'replicate=2' (dp=N is required)"),
        (2.5, "Invalid mesh: 2.5 (expected a string like 'dp=64', an int or a Mesh)"),
    ],
)
def test_bad_meshes_name_the_value(mesh, message):
    with pytest.raises(ValueError) as e:
        parse_mesh(mesh)
    assert str(e.value).startswith(message)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"model": "llama4"},
            "Invalid model spec: 'llama4' (valid: 'llama3-8b', 'llama3-70b', 'deepseek-v3', 'tiny')",
        ),
        ({"bucket_size": 0}, "Invalid bucket_size: 0 (expected an integer >= 1)"),
        ({"num_buckets": True}, "Invalid num_buckets: True (expected an integer >= 1)"),
        ({"ns_steps": 2.5}, "Invalid ns_steps: 2.5 (expected an integer >= 1)"),
        ({"gemm_tflops": -1.0}, "Invalid gemm_tflops: -1.0 (expected a number > 0)"),
        ({"link_gbps": 0}, "Invalid link_gbps: 0 (expected a number > 0)"),
        ({"inflight_bytes": 0}, "Invalid inflight_bytes: 0 (expected an integer >= 1)"),
        (
            {"inflight_bytes": "8MiB"},
            "Invalid inflight_bytes: '8MiB' (expected an integer >= 1 or None)",
        ),
        ({"policy": "gpu"}, "Invalid policy: 'gpu' (valid: 'batched', 'cpu')"),
        (
            {"model": [("w", (4,), "flatten")]},
            "matrix 0 ('w') has shape (4,): Muon matrices need ndim >= 2",
        ),
        (
            {"model": [("w", (4, 4), "rows")]},
            "Invalid view of 'w': 'rows' (valid: 'flatten', 'experts'",
        ),
    ],
)
def test_bad_arguments_name_the_value(kwargs, message):
    kwargs = {"model": "tiny", **kwargs}
    with pytest.raises(ValueError) as e:
        plan_model(kwargs.pop("model"), "dp=2", **kwargs)
    assert str(e.value).startswith(message)


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(list(argv))
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


def test_cli_bad_arguments_exit_2_naming_the_value():
    for argv, message in (
        (["--mesh", "dp=8,tp=0"], "Invalid mesh: 'dp=8,tp=0' (tp=0, expected >= 1)"),
        (["--bucket-size", "0"], "argument --bucket-size: expected an integer >= 1, got 0"),
        (["--wire", "fp8"], "argument --wire: invalid choice: 'fp8'"),
        (["--inflight-bytes", "0"], "argument --inflight-bytes: expected a byte count >= 1 (e.g."),
        (
            ["--inflight-bytes", "8 parsecs"],
            "argument --inflight-bytes: expected a byte count >= 1",
        ),
        (["--policy", "gpu"], "argument --policy: invalid choice: 'gpu'"),
    ):
        code, out, err = _cli("plan", "--model", "tiny", *argv)
        assert code == 2 and message in err and not out
    code, _, err = _cli("plan", "--model", "gpt5")
    assert code == 2 and "Invalid model spec: 'gpt5'" in err


@pytest.mark.slow
def test_docs_table_is_the_commands_output():
    """docs/distributed.md shows `muon-fn plan --bucket-size 1` on the three specs at W = 8 … 1,024
    verbatim."""
    reports = [plan_model(name, w, bucket_size=1) for name in SPECS for w in (8, 64, 256, 1024)]
    assert format_plan(reports) in DOC.read_text()


class TestCLI(expecttest.TestCase):
    def test_prints_the_table(self):
        code, out, err = _cli(
            "plan", "--model", "tiny", "--mesh", "dp=2", "replicate=2,dp=4", "--bucket-size", "1"
        )
        self.assertEqual((code, err), (0, ""))
        self.assertExpectedInline(
            out,
            """\
| model | mesh | matrices | units | buckets | NS FLOPs/rank max | max/mean | lower bound | efficiency | idle ranks | sent/rank mean | 2(W−1)/W²·S | sent max | received max | extra peak max | compute | comm | step |
|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|
| tiny | dp=2 | 24 | 15 | 4 | 48.8 MFLOP | 1.007 | 1.000 | 99% | 0/2 | 98.8 kB | 98.8 kB | 98.8 kB | 98.8 kB | 525 kB | 0.122 µs | 1.98 µs | 2.47 µs |
| tiny | replicate=2,dp=4 | 24 | 15 | 4 | 25.9 MFLOP | 1.067 | 1.067 | 94% | 0/4 | 74.1 kB | 74.1 kB | 78.1 kB | 78.1 kB | 328 kB | 0.0647 µs | 1.56 µs | 1.95 µs |
""",  # noqa: E501
        )

    def test_prints_the_step_peak(self):
        code, out, err = _cli(
            "plan",
            "--model",
            "bench-fsdp",
            "--mesh",
            "dp=2",
            "dp=4",
            "--policy",
            "cpu",
            "--inflight-bytes",
            "8MiB",
            "--state-bits",
            "32",
            "--ns-dtype",
            "fp32",
        )
        self.assertEqual((code, err), (0, ""))
        self.assertIn(out, DOC.read_text())  # docs/distributed.md shows it
        self.assertExpectedInline(
            out,
            """\
| model | mesh | matrices | units | buckets | NS FLOPs/rank max | max/mean | lower bound | efficiency | idle ranks | sent/rank mean | 2(W−1)/W²·S | sent max | received max | extra peak max | state/rank max (32-bit) | step peak/rank max (inflight 8 MiB) | state + step peak max | compute | comm | step |
|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|
| bench-fsdp | dp=2 | 72 | 40 | 20 | 815 GFLOP | 1.000 | 1.000 | 100% | 0/2 | 170 MB | 170 MB | 170 MB | 170 MB | 727 MB | 170 MB | 23.6 MB | 193 MB | 2.04 ms | 3.4 ms | 3.57 ms |
| bench-fsdp | dp=4 | 72 | 40 | 12 | 408 GFLOP | 1.000 | 1.000 | 100% | 0/4 | 127 MB | 127 MB | 127 MB | 127 MB | 387 MB | 84.9 MB | 23.6 MB | 109 MB | 1.02 ms | 2.55 ms | 2.76 ms |
""",  # noqa: E501
        )
