"""muon_fn.tools.bench: structure of the results, the shared pieces, and the command line.

No timing is asserted anywhere (shared CPUs swing 2x). Runs use the tiny set's first layer;
conftest sets ``MUON_FN_COMPILE=0``, so the default row runs eagerly unless a test asks for the
compiled default.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import expecttest
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from muon_fn import MuonOptimizer, orthogonalization
from muon_fn.core import newton_schulz as O
from muon_fn.tools import bench
from muon_fn.tools.bench import _muon, _replay, _timing

ONE_LAYER = dict(model_size="tiny", layers=1, rounds=1, quality_layers=1, gaussian=False)


# ----------------------------------------------------------------------------- the Muon step benchmark
@pytest.mark.slow
def test_benchmark_smoke_with_torch_reference():
    rows = ["muon_fn", "muon_fn[eager]", "torch.optim.Muon", "replay[quintic5]"]
    res = bench.benchmark_muon_optimizers(rows=rows, **ONE_LAYER)
    cfg = res["config"]
    assert (cfg["matrices"], cfg["layers"], cfg["threads"]) == (6, 1, 1) and set(
        res["rows"]
    ) == set(rows)
    assert cfg["compile_default"] is False  # MUON_FN_COMPILE=0 in the tests
    for r in res["rows"].values():
        assert (
            len(r["seconds_per_step"]) == 1
            and r["min"] <= r["median"] <= r["max"]
            and r["first_step_s"] > 0
        )
        assert len(r["ratio_to_torch_muon"]) == 1
    ref, default = res["rows"]["torch.optim.Muon"], res["rows"]["muon_fn"]
    assert (
        ref["ratio_to_torch_muon"] == [1.0]
        and ref["compiled"] is None
        and default["compiled"] is False
    )
    assert default["own_replay"] == "replay[quintic5]" and len(default["ratio_to_own_replay"]) == 1
    assert "own_replay" not in ref  # replay[torch_quintic5] did not run
    # Persistent state: one fp32 momentum buffer per matrix, as torch.optim.Muon keeps.
    n = sum(s[0] * s[1] for _, s in bench.matrix_shapes("tiny", layers=1))
    assert ref["state_bytes"] == default["momentum_bytes"] == default["state_bytes"] == 4 * n
    assert default["state_ratio_to_torch_muon"] == 1.0
    assert default["peak_step_bytes"] > 0 and ref["peak_step_bytes"] > 0
    assert res["rows"]["replay[quintic5]"]["peak_step_bytes"] is None
    q = res["quality"]
    assert (
        set(q["muon_fn"]) == {"q", "k", "v", "o", "fc", "proj"}
        and q["muon_fn"] == q["muon_fn[eager]"]
    )
    for kind in q["torch.optim.Muon"].values():
        assert kind["ratio_to_torch"] == pytest.approx(1.0)
    for kind in q[
        "muon_fn"
    ].values():  # the default is the quintic; its σ lands in about [0.68, 1.21]
        assert kind["ratio_to_quintic_same_dtype"] == pytest.approx(1.0) and kind["max"] < 1.25
    # The bound: the row's GEMM FLOPs at the matmul rate measured in the run, in its dtype.
    rates = cfg["matmul_rates"]
    assert set(rates) == {"bfloat16", str(O.default_compute_dtype()).removeprefix("torch.")}
    assert all(
        r["shape"] == [256, 1024] and r["reps"] >= 3 and r["flops_per_s"] > 0
        for r in rates.values()
    )
    compute = str(O.default_compute_dtype()).removeprefix("torch.")
    for r, dtype in (
        ("muon_fn", compute),
        ("torch.optim.Muon", "bfloat16"),
        ("replay[quintic5]", compute),
    ):
        row = res["rows"][r]
        # 5 quintic iterations of q, k, v, o (6·256³ each) and fc, proj (4·256²·1024 + 2·256³ = 18·256³)
        assert row["gemm_flops"] == 5 * (4 * 6 + 2 * 18) * 256**3
        assert row["bound_s"] == pytest.approx(row["gemm_flops"] / rates[dtype]["flops_per_s"])
        assert row["ratio_to_bound"] == pytest.approx(row["median"] / row["bound_s"])
    json.dumps(res)
    table = bench.format_table(res)
    assert all(r in table for r in rows) and "tiny: 1 layer(s), 6 matrices" in table
    assert "state MiB" in table and "peak MiB" in table and " MB" not in table


def test_ratios_and_quality_need_their_reference_rows():
    res = bench.benchmark_muon_optimizers(
        rows=["muon_fn[eager]", "replay[polar_express5]"],
        memory=False,
        **{**ONE_LAYER, "gaussian": (32, 64)},
    )
    row = res["rows"]["muon_fn[eager]"]
    assert not {
        "ratio_to_torch_muon",
        "ratio_to_own_replay",
        "own_replay",
        "state_ratio_to_torch_muon",
        "peak_step_bytes",
    } & set(row)
    assert res["rows"]["replay[polar_express5]"]["ratio_to_own_replay"] == [1.0]
    for per_kind in (res["quality"]["muon_fn[eager]"], res["gaussian_quality"]["muon_fn[eager]"]):
        for kind in per_kind.values():
            assert "ratio_to_torch" not in kind and kind["ratio_to_quintic_same_dtype"] > 0
    assert set(res["gaussian_quality"]["muon_fn[eager]"]) == {"32x64", "64x32"}
    assert " - " in bench.format_table(res).splitlines()[2]  # the absent ratios print as '-'


@pytest.mark.inductor
@pytest.mark.slow
def test_default_row_compiles_on_its_first_step(compiled_default):
    res = bench.benchmark_muon_optimizers(
        rows=["muon_fn", "muon_fn[eager]"], quality=False, memory=False, **ONE_LAYER
    )
    assert res["config"]["compile_default"] is True
    assert (
        res["rows"]["muon_fn"]["compiled"] is True
        and res["rows"]["muon_fn[eager]"]["compiled"] is False
    )
    lines = bench.format_table(res).splitlines()
    assert lines[2].split()[1].endswith("c") and not lines[3].split()[1].endswith(
        "c"
    )  # the 1st step column


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"model_size": "gpt3"}, "model_size"),
        ({"layers": 5}, r"Invalid layers: 5 \(expected 1..4 for tiny\)"),
        ({"num_steps": 0}, "num_steps"),
        ({"rounds": 1.5}, "rounds"),
        ({"lr": -1.0}, "lr"),
        ({"rows": ["sgd"]}, "Invalid row: 'sgd'"),
        (
            {"rows": ["hybrid"]},
            r"Invalid row: 'hybrid' \(it runs on the set's GPT model.*muon-fn bench --memory",
        ),
        ({"threads": 0}, "Invalid threads: 0"),
        ({"device": "bogus"}, "Invalid device: 'bogus'"),
        ({"device": "meta"}, "meta tensors hold no data to time"),
    ],
)
def test_benchmark_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        bench.benchmark_muon_optimizers(**kwargs)


def test_every_timed_step_is_bracketed_by_a_device_synchronize(monkeypatch):
    calls = []
    monkeypatch.setattr(_timing, "synchronize", calls.append)
    res = bench.benchmark_muon_optimizers(
        rows=["muon_fn[eager]", "replay[aol9]"],
        quality=False,
        memory=False,
        device="cpu",
        **{**ONE_LAYER, "rounds": 2},
    )
    assert calls == [torch.device("cpu")] * (2 * 2 * 3)  # 2 rows, the first step and 2 rounds
    assert res["config"]["device"] == "cpu"
    assert ", cpu, 1 thread(s)," in bench.format_table(res).splitlines()[0]


def test_rows_name_their_own_replay_with_the_same_orthogonalization():
    cpu = torch.device("cpu")
    for name, spec in bench.ROW_SPECS.items():
        if spec.own_replay is not None:
            assert spec.own_replay in bench.ROW_SPECS, name
            if spec.method != "torch.optim.Muon":
                assert bench.ROW_SPECS[spec.own_replay].ortho(cpu) == spec.ortho(cpu), name
    assert set(bench.ROWS) | set(bench.OPTIONAL_ROWS) | set(bench.MODEL_ROWS) == set(
        bench.ROW_SPECS
    )
    assert set(bench.MEMORY_ROWS) <= set(bench.ROW_SPECS)


def test_default_rows_leave_out_emulated_bf16(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(orthogonalization, "CPU_HAS_BF16_GEMM", True)
    assert bench.default_rows("gpt2-small", cpu) == list(bench.ROWS)
    monkeypatch.setattr(orthogonalization, "CPU_HAS_BF16_GEMM", False)
    tiny, gpt2 = bench.default_rows("tiny", cpu), bench.default_rows("gpt2-small", cpu)
    assert "torch.optim.Muon" in tiny and "torch.optim.Muon" not in gpt2
    assert not {"muon_fn[like_torch]", "replay[torch_quintic5]"} & (set(tiny) | set(gpt2))
    assert "muon_fn" in gpt2 and "replay[quintic5]" in gpt2


def _gemm_flops(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        fn()
    return sum(
        e.flops
        for e in prof.events()
        if e.name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
    )


@pytest.mark.parametrize("method,steps", [("aol9", None), ("polar_express", 5)])
def test_replay_runs_exactly_the_gemms_of_the_step(method, steps):
    # A bucket of 4 and one of 1 below LOOP_MIN_DIM (batched), and one shape at it (per matrix).
    g = torch.Generator().manual_seed(0)
    shapes = [(64, 96)] * 5 + [(O.LOOP_MIN_DIM, 400)] * 2 + [(400, O.LOOP_MIN_DIM)]
    params = [torch.randn(s, generator=g).requires_grad_() for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    opt = MuonOptimizer(params, lr=0.02, method=method, ns_steps=steps, compile=False)
    opt.step()
    replay = bench.replay(params, method, steps, bucket_size=_replay.AUTO)
    assert _gemm_flops(replay) == _gemm_flops(opt.step) > 0


def test_replay_buckets_are_the_optimizers_buckets():
    # The CPU's byte bound (8 MiB, no more than the largest parameter): 768² fp32 matrices three
    # to a bucket beside 3072×768 ones, which are buckets of one; small ones four to a bucket.
    shapes = [(768, 768)] * 7 + [(3072, 768)] * 2 + [(64, 96)] * 5
    params = [torch.zeros(s).requires_grad_() for s in shapes]
    opt = MuonOptimizer(params, lr=0.02, compile=False)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    step_buckets = [list(b.indices) for b in opt._runtimes[0].buckets]
    assert [list(b) for b in _replay._buckets(params, _replay.AUTO)] == step_buckets
    assert [len(b) for b in step_buckets] == [3, 3, 1, 1, 1, 4, 1]


# ----------------------------------------------------------------------------- shared pieces
def test_peak_step_bytes_counts_what_a_step_allocates_at_its_highest():
    cpu = torch.device("cpu")
    x = torch.ones(1000, 1000)

    def step():
        a = x * 2  # 4 MB
        b = a + 1  # 8 MB live at the peak
        del a
        return b.sum()

    assert bench.peak_step_bytes(step, cpu) == pytest.approx(8e6, abs=1e3)
    assert (
        bench.peak_step_bytes(lambda: x.add_(1), cpu) < 100
    )  # in place: nothing (the profiler: a few bytes)
    assert bench.peak_step_bytes(step, torch.device("meta")) is None  # not measured there


_RESIDENT_CHILD = """
import json, torch
from muon_fn.tools.bench import _memory
x = torch.ones(1000, 1000)

def step():
    a = x * 2  # 4 MB
    b = a + 1  # 8 MB live at the peak
    del a
    return b.sum()

def late():
    out = torch.empty(1000, 1000)  # 4 MB, first written after the 4 MB temporary is gone
    t = x * 2
    total = t.sum()
    del t
    return out.fill_(total)

cpu = torch.device("cpu")
for f in (step, late, lambda: x.add_(1)):
    f()  # first runs: their code's pages become resident, as in a row's first step
print(json.dumps([_memory.resident_step_bytes(f, cpu) for f in (step, late, lambda: x.add_(1))]))
"""


def test_resident_step_bytes_counts_the_peak_resident_set_of_a_fresh_process():
    """In a process started with RESIDENT_ENV a block is resident from its allocation to its free:
    the step's peak is 8 MB as torch's allocator counts it, a buffer written only after the peak
    included; nothing for an in-place step. Without that environment (this process) it is not
    measured."""
    from muon_fn.tools.bench import _memory

    env = {**os.environ, **_memory.RESIDENT_ENV}
    proc = subprocess.run(
        [sys.executable, "-c", _RESIDENT_CHILD],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    peak, late, in_place = json.loads(proc.stdout.splitlines()[-1])
    # the kernel's counters are exact to a few hundred KB (per-CPU batches of pages)
    assert (
        peak == pytest.approx(8e6, abs=1e6)
        and late == pytest.approx(8e6, abs=1e6)
        and in_place < 0.5e6
    )
    if not _memory.resident_measurable():
        assert bench.resident_step_bytes(lambda: None, torch.device("cpu")) is None
    assert bench.resident_step_bytes(lambda: None, torch.device("meta")) is None


@pytest.mark.slow
def test_memory_table_measures_every_row_the_same_way(tmp_path, capsys):
    """``muon-fn bench --memory``: torch's rows and muon_fn's, each in a fresh process; the
    hybrid against torch.optim.Muon + AdamW on the same split of the set's GPT model."""
    path = tmp_path / "m.json"
    rows = ["torch.optim.Muon", "muon_fn[state_bits=8]", "torch.optim.Muon+AdamW[fused]", "hybrid"]
    assert (
        bench.main(
            [
                "--memory",
                "--model-size",
                "tiny",
                "--layers",
                "1",
                "--rows",
                *rows,
                "--json",
                str(path),
            ]
        )
        == 0
    )
    res = json.loads(path.read_text())["tiny,memory,threads=1"]
    got = res["rows"]
    assert list(got) == rows
    n = 4 * sum(
        s[0] * s[1] for _, s in bench.matrix_shapes("tiny", layers=1)
    )  # fp32 bytes of the matrices
    torch_muon, eight = got["torch.optim.Muon"], got["muon_fn[state_bits=8]"]
    # torch.optim.Muon keeps one fp32 momentum buffer per matrix: state = momentum = parameter bytes.
    assert (
        torch_muon["state_bytes"] == torch_muon["momentum_bytes"] == torch_muon["param_bytes"] == n
    )
    assert torch_muon["ratio_to_reference"] == 1.0 and torch_muon["reference"] == "torch.optim.Muon"
    # 8-bit codes (a quarter) and one fp32 scale per block of 256 codes.
    assert eight["param_bytes"] == n and 0.25 < eight["state_over_params"] < 0.26
    pair, hybrid = got["torch.optim.Muon+AdamW[fused]"], got["hybrid"]
    assert (
        pair["param_bytes"] == hybrid["param_bytes"] > n
    )  # the GPT's embeddings, head and 1-D parameters too
    assert (
        pair["momentum_bytes"] == hybrid["momentum_bytes"] == n
    )  # its hidden matrices are the set's
    assert (
        hybrid["reference"] == "torch.optim.Muon+AdamW[fused]" and pair["ratio_to_reference"] == 1.0
    )
    for v in got.values():
        assert v["peak_bytes"] >= 0 and v["total_bytes"] == v["state_bytes"] + v["peak_bytes"]
        assert v["peak_over_params"] == pytest.approx(v["peak_bytes"] / v["param_bytes"])
        if v["resident_peak_bytes"] is not None:  # the resident peak and the allocator's agree
            assert v["peak_bytes"] == v["resident_peak_bytes"]
            assert abs(v["resident_peak_bytes"] - v["allocated_peak_bytes"]) < 2**20
    out = capsys.readouterr().out
    assert "state MiB" in out and "peak MiB" in out and "state+peak MiB" in out and " MB" not in out
    assert out.count("torch.optim.Muon") >= 2


def test_paired_rounds_rotate_the_order_and_run_the_hooks_outside_the_clock():
    seen = []
    times = bench.paired_rounds(
        ["a", "b", "c"],
        lambda r: seen.append(r),
        3,
        device=torch.device("cpu"),
        steps_per_round=2,
        before_round=lambda k: seen.append(k),
        before_row=lambda r, k: seen.append(f"<{r}"),
        after_row=lambda r, k, s: seen.append(f"{r}>"),
    )
    assert seen[:8] == [0, "<a", "a", "a", "a>", "<b", "b", "b"]
    assert [x for x in seen if x in (0, 1, 2) or x in ("<a", "<b", "<c")] == [
        0,
        "<a",
        "<b",
        "<c",
        1,
        "<b",
        "<c",
        "<a",
        2,
        "<c",
        "<a",
        "<b",
    ]
    assert {r: len(t) for r, t in times.items()} == {"a": 3, "b": 3, "c": 3}


def test_paired_ratio_is_per_round():
    r = bench.paired_ratio([2.0, 3.0, 12.0], [1.0, 2.0, 4.0])
    assert r == {"median": 2.0, "min": 1.5, "max": 3.0, "per_round": [2.0, 1.5, 3.0]}
    for times, ref in (([1.0], [1.0, 2.0]), ([], [])):
        with pytest.raises(ValueError, match="Invalid rounds"):
            bench.paired_ratio(times, ref)


def test_synchronize_waits_only_off_the_cpu(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.accelerator, "synchronize", seen.append)
    bench.synchronize(torch.device("cpu"))
    bench.synchronize(torch.device("cuda", 1))  # never reaches CUDA itself: the call is recorded
    assert seen == [torch.device("cuda", 1)]


def test_thread_lists():
    assert bench.parse_threads("1,default") == [1, "default"] and bench.parse_threads("2") == [2]
    for bad in ("0", "x", "1,"):
        with pytest.raises(ValueError, match="Invalid threads"):
            bench.parse_threads(bad)
    assert bench.default_threads() >= 1


def test_real_gradients_of_some_layers_are_those_of_the_whole_set():
    _, all_grads, all_names = bench.real_gradients("tiny")
    _, grads, names = bench.real_gradients("tiny", layers=1)
    assert names == all_names[:6] == ["h0.q", "h0.k", "h0.v", "h0.o", "h0.fc", "h0.proj"]
    for g, h in zip(grads, all_grads):
        assert torch.equal(g, h)


# ----------------------------------------------------------------------------- the command line
def test_main_runs_each_thread_count_and_writes_json(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(
        _timing, "default_threads", lambda: 1
    )  # 2 threads on a shared 2-core CPU crawl
    path = tmp_path / "b.json"
    assert (
        bench.main(
            [
                "--model-size",
                "tiny",
                "--layers",
                "1",
                "--rounds",
                "1",
                "--rows",
                "muon_fn[eager]",
                "replay[quintic5]",
                "--threads",
                "1,default",
                "--no-quality",
                "--json",
                str(path),
            ]
        )
        == 0
    )
    data = json.loads(path.read_text())
    assert list(data) == ["tiny,threads=1", "tiny,threads=default"]
    assert [data[k]["config"]["threads_requested"] for k in data] == [1, "default"]
    assert data["tiny,threads=1"]["rows"]["muon_fn[eager]"]["ratio_to_own_replay_median"] > 0
    assert capsys.readouterr().out.count("s/step min") == 2


def test_elementwise_rows_report_paired_ratios_to_their_torch_peers(tmp_path, capsys):
    path = tmp_path / "e.json"
    assert (
        bench.main(
            [
                "--elementwise",
                "--model-size",
                "tiny",
                "--layers",
                "1",
                "--rounds",
                "2",
                "--no-memory",
                "--json",
                str(path),
            ]
        )
        == 0
    )
    rows = json.loads(path.read_text())["tiny,threads=1"]["rows"]
    assert list(rows) == list(bench.ELEMENTWISE_ROWS) and "quality" not in rows
    assert set(rows["TritonMuon"]["ratio_to_peers"]) == {
        "torch.optim.Adam[fused]",
        "torch.optim.SGD[fused]",
    }
    assert set(rows["TritonMuonW"]["ratio_to_peers"]) == {
        "torch.optim.AdamW[fused,wd=0.01]",
        "torch.optim.SGD[fused]",
    }
    for ratio in rows["TritonMuonW"]["ratio_to_peers"].values():
        assert len(ratio["per_round"]) == 2 and ratio["median"] > 0
    assert "ratio_to_peers" not in rows["torch.optim.Adam[fused]"]
    out = capsys.readouterr().out
    assert "/peer" in out and "TritonMuon: /torch.optim.Adam[fused] " in out
    for spec in bench.ROW_SPECS.values():
        assert all(p in bench.ROW_SPECS for p in spec.peers)


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["--elementwise", "--rows", "muon_fn"],
            "--elementwise chooses the rows: give it or --rows, not both",
        ),
        (
            ["--device", "meta", "--quick"],
            "argument --device: invalid device 'meta' (valid: cpu, cuda, cuda:N",
        ),
        (["--threads", "0"], "argument --threads: Invalid threads: 0"),
        (
            ["--model-size", "tiny", "--layers", "9", "--no-quality"],
            "Invalid layers: 9 (expected 1..4 for tiny)",
        ),
        (["sso", "--rows", "sso"], "Invalid rows: must include 'muon'"),
        (["fsdp", "--world-sizes", "1"], "argument --world-sizes: expected an integer >= 2, got 1"),
        (
            ["fsdp", "--torch-dtype", "fp16"],
            "argument --torch-dtype: invalid choice: 'fp16'",
        ),  # (choose from ...)
        (
            ["--memory", "--elementwise"],
            "--memory, --compile-time and --elementwise each choose what to measure: give one",
        ),
        (
            ["--memory", "--no-memory"],
            "--memory measures only memory: give it or --no-memory, not both",
        ),
        (
            ["--memory", "--model-size", "llama3-1b", "--layers", "1", "--rows", "hybrid"],
            "Invalid row: 'hybrid' on llama3-1b (a model row runs on the GPT model of a gpt set: ['gpt2-small', 'tiny'])",  # noqa: E501
        ),
    ],
)
def test_main_reports_bad_arguments_as_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    prog = "muon-fn bench" + (f" {argv[0]}" if argv[0] in ("sso", "fsdp") else "")
    assert f"{prog}: error: {message}" in err


# ----------------------------------------------------------------------------- SSO and FSDP benchmarks
@pytest.mark.slow
def test_sso_command_reports_ratios_and_warmup_times(tmp_path, capsys):
    path = tmp_path / "sso.json"
    assert (
        bench.main(
            [
                "sso",
                "--layers",
                "1",
                "--rounds",
                "1",
                "--warmup",
                "1",
                "--rows",
                "muon,muon_pe5",
                "--json",
                str(path),
            ]
        )
        == 0
    )
    res = json.loads(path.read_text())["threads=1"]
    assert res["matrices"] == 6 and set(res["ratios"]) == {"muon_pe5/muon"} and res["solver"] == {}
    assert {r: len(t) for r, t in res["warmup_step_s"].items()} == {"muon": 1, "muon_pe5": 1}
    captured = capsys.readouterr()
    assert "round 0 (warm-up): " in captured.err and "round 1: " in captured.err
    assert "muon_pe5/muon" in captured.out


def test_sso_bench_rejects_bad_arguments():
    for kwargs, message in [
        (dict(rows=("sso",)), "must include 'muon'"),
        (dict(layers=13), "Invalid layers: 13"),
        (dict(rounds=0), "Invalid rounds: 0"),
        (dict(warmup=-1), "Invalid warmup: -1"),
        (dict(rows=("muon", "x")), "Invalid row: 'x'"),
    ]:
        with pytest.raises(ValueError, match=message):
            bench.benchmark_sso(**kwargs)


def test_fsdp_benchmark_is_importable_without_running_ranks():
    assert callable(bench.benchmark_fsdp) and callable(bench.format_fsdp_result)


@pytest.mark.slow
def test_fsdp_command_has_torch_muon_on_the_same_dtensors(tmp_path, capsys):
    """One W=2 job on one tiny layer (64-wide): every row with its step times, ratio to
    torch.optim.Muon's step and per-rank memory; torch.optim.Muon on the FSDP2 DTensors and
    MuonOptimizer(model.parameters()) on their own copy, both in fp32, end equal within 1e-5
    (tests/test_torch_compat.py's fp32 tolerance) after the warm-up, timed and profiled steps."""
    path = tmp_path / "fsdp.json"
    assert (
        bench.main(
            [
                "fsdp",
                "--world-sizes",
                "2",
                "--layers",
                "1",
                "--dim",
                "64",
                "--repeats",
                "1",
                "--buckets",
                "2",
                "--torch-dtype",
                "fp32",
                "--json",
                str(path),
            ]
        )
        == 0
    )
    (res,) = json.loads(path.read_text())
    rows = res["variants"]
    assert list(rows) == [
        "owner/fp32",
        "owner/bf16",
        "owner/fp32/state8",
        "replicate/fp32",
        "torch.optim.Muon",
        "MuonOptimizer[like_torch]",
        "MuonOptimizer[like_torch, inflight_bytes=16 MiB]",
    ]
    measured = [name for name in rows if name != "replicate/fp32"]  # each in fresh processes
    for name, row in rows.items():
        assert len(row["step_s"]) == 1 and row["median_step_s"] > 0, name
        assert len(row["ratio_to_torch"]["per_round"]) == 1, name
        assert (
            len(row["cpu_s"]) == 1
            and row["median_cpu_s"] > 0
            and len(row["cpu_ratio_to_torch"]["per_round"]) == 1
        )
        if name not in measured:
            assert "peak_bytes_per_rank" not in row, name
            continue
        assert len(row["state_bytes_per_rank"]) == 2 and len(row["peak_bytes_per_rank"]) == 2, name
        assert all(b > 0 for b in row["peak_bytes_per_rank"]), name  # the resident set grew
        assert row["peak_ratio_to_torch"] == max(row["peak_bytes_per_rank"]) / max(
            rows["torch.optim.Muon"]["peak_bytes_per_rank"]
        )
    assert rows["torch.optim.Muon"]["ratio_to_torch"]["per_round"] == [1.0]
    # Momentum only (fp32 local shards): 64² · 4 + 2 · 256 · 64 = 48 Ki elements, half per rank.
    assert rows["torch.optim.Muon"]["state_bytes_per_rank"] == [4 * 48 * 1024 // 2] * 2
    assert rows["MuonOptimizer[like_torch]"]["state_bytes_per_rank"] == [4 * 48 * 1024 // 2] * 2
    assert "bytes_sent_per_rank" in rows["MuonOptimizer[like_torch]"]  # the owner-computes step ran
    assert "bytes_sent_per_rank" not in rows["torch.optim.Muon"]
    assert rows["torch.optim.Muon"][
        "collectives_per_step"
    ]  # DTensor's ops: every rank in every matrix
    pair = res["pair"]
    assert (pair["torch_dtype"], pair["steps"], pair["tolerance"]) == ("fp32", 3, 1e-5)
    assert pair["within_tolerance"] and pair["max_abs_diff"] <= 1e-5, pair
    assert pair["travelled"] > 1e-2, pair  # it moved (lr 0.02): a wrong formula would show
    out = capsys.readouterr().out
    assert "MuonOptimizer[like_torch]  step" in out and "/torch " in out and "max |Δparam|" in out


def test_fsdp_table_without_the_torch_rows():
    """``--no-torch``: muon_fn's rows only, no ratio column and no pair line."""
    row = {
        "median_step_s": 1.0,
        "step_s": [1.0],
        "median_cpu_s": 0.9,
        "cpu_s": [0.9],
        "state_bytes_per_rank": [2**20] * 2,
        "peak_bytes_per_rank": [2**21, 3 * 2**20],
        "bytes_sent_per_rank": [1e6, 1e6],
        "ns_flops_max_over_mean": 1.0,
        "comm_wait_s_per_rank": [0.1, 0.2],
        "compute_s_per_rank": [0.8, 0.9],
    }
    res = {
        "world_size": 2,
        "S_bytes": 4e6,
        "config": {},
        "formula_bytes_fp32": 1e6,
        "formula_bytes_bf16": 5e5,
        "owner_over_replicate": 0.5,
        "paired_ratios": [0.5],
        "variants": {
            "owner/fp32": row,
            "replicate/fp32": {**row, "median_step_s": 2.0, "step_s": [2.0]},
        },
    }
    text = bench.format_fsdp_result(res)
    assert "/torch" not in text and "max |Δparam|" not in text
    assert "state/rank 1.0 MiB  step peak/rank 2.0–3.0 MiB" in text


def test_fsdp_torch_dtype_resolves_by_cpu(monkeypatch):
    from muon_fn.tools.bench import _fsdp

    assert (
        _fsdp.resolve_torch_dtype("bf16") == "bf16" and _fsdp.resolve_torch_dtype("fp32") == "fp32"
    )
    monkeypatch.setattr(orthogonalization, "CPU_HAS_BF16_GEMM", False)
    assert _fsdp.resolve_torch_dtype("auto") == "fp32"  # emulated bf16 would time nothing real
    monkeypatch.setattr(orthogonalization, "CPU_HAS_BF16_GEMM", True)
    assert _fsdp.resolve_torch_dtype("auto") == "bf16"
    with pytest.raises(ValueError, match="Invalid torch_dtype: 'fp16'"):
        _fsdp.resolve_torch_dtype("fp16")


class TestSSOBenchTable(expecttest.TestCase):
    def test_table(self):
        result = {
            "layers": 12,
            "matrices": 72,
            "rounds": 2,
            "warmup": 1,
            "threads": 1,
            "wall_s": 100.0,
            "median_step_s": {"muon": 5.93, "muon_same": 22.77, "sso": 30.53},
            "ratios": {
                "muon_same/muon": {
                    "median": 3.79,
                    "min": 3.49,
                    "max": 3.85,
                    "per_round": [3.49, 3.85],
                },
                "sso/muon": {"median": 5.02, "min": 4.59, "max": 5.16, "per_round": [4.59, 5.16]},
                "sso/muon_same": {
                    "median": 1.323,
                    "min": 1.304,
                    "max": 1.342,
                    "per_round": [1.304, 1.342],
                },
            },
            "solver": {
                "sso": {
                    "msigns_per_matrix_histogram": {1: 143, 2: 1},
                    "msigns_per_matrix_mean": 1.0069,
                    "residual_max": 1.13e-5,
                    "fallbacks": 0,
                    "sigma_rel_error_max": 2.5e-7,
                }
            },
        }
        self.assertExpectedInline(
            bench.format_sso_table(result),
            """\
gpt2-small matrix set, 12 layer(s) = 72 matrices; 1 warm-up + 2 paired rounds, 1 thread(s)
row                median s/step
muon                       5.930
muon_same                 22.770
sso                       30.530
ratio                     median     min     max  per round
muon_same/muon             3.790   3.490   3.850  3.490 3.850
sso/muon                   5.020   4.590   5.160  4.590 5.160
sso/muon_same              1.323   1.304   1.342  1.304 1.342
sso: msigns per matrix-step {1: 143, 2: 1} (mean 1.01), max |h| 1.1e-05, fallbacks 0, σ estimate rel. error max 2.5e-07""",  # noqa: E501
        )


def test_quality_leak_separates_preconditioned_iterations():
    """``leak``: polynomial iterations in XXᵀ keep the gradient's singular basis (0 up to
    rounding); AOL's row rescaling does not (its fixed point is msign(D·X), not msign(X))."""
    from muon_fn.tools.bench import _quality as Q

    gen = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(32, 32, generator=gen))[0]
    g = torch.randn(64, 32, generator=gen) @ torch.diag(torch.logspace(0, -4, 32)) @ basis
    leak = {
        m: Q.orthogonality(g, Q.orthogonalizer(Q.Ortho(m, None, torch.float32))(g))["leak"]
        for m in ("quintic", "polar_express", "aol9", "aol")
    }
    assert leak["quintic"] < 1e-5 and leak["polar_express"] < 1e-5
    assert leak["aol9"] > 0.02 and leak["aol"] > 0.02


# ----------------------------------------------------------------------------- GEMM FLOPs and the sets
def test_gemm_flops_by_hand():
    quintic5, pe5 = O.coefficient_schedule("quintic", 5), O.coefficient_schedule("polar_express", 5)
    # Per quintic iteration of a wide (m, n): XXᵀ 2m²n, A² 2m³, (bA + cA²)·X 2m²n.
    assert O.gemm_flops((768, 3072), quintic5) == 5 * (
        2 * 768**2 * 3072 + 2 * 768**3 + 2 * 768**2 * 3072
    )
    assert O.gemm_flops((3072, 768), quintic5) == O.gemm_flops(
        (768, 3072), quintic5
    )  # tall: transposed
    assert O.gemm_flops((64, 64), O.coefficient_schedule("cubic", 3)) == 3 * 4 * 64**3  # no A²
    # aol9: AOL's Gram matrix feeds iteration 1 (no extra GEMM); iteration 4 is degree 9 (A², then one more m×m).
    assert (
        O.gemm_flops((64, 96), O.coefficient_schedule("aol9", None))
        == 4 * 4 * 64**2 * 96 + 5 * 2 * 64**3
    )
    # Gram form, one restart before iteration 2 (s = 64, l = 256): X·Xᵀ twice, Q·X twice (8s²l);
    # per iteration the polynomial's A² (2s³), Q·T after a start (2s³), R ← T·R·T (4s³) unless
    # the next iteration restarts or none follows: 6 + 4 + 6 + 8 + 4 = 28s³.
    gram = O.coefficient_schedule("gram", 5)
    assert O.gemm_flops((64, 256), gram) == 8 * 64**2 * 256 + 28 * 64**3
    assert O.gemm_flops((64, 256), gram) / O.gemm_flops((64, 256), pe5) == pytest.approx(
        60 / 90
    )  # 67 % at α = 4
    assert O.gemm_flops((64, 64), gram) == O.gemm_flops(
        (64, 64), pe5
    )  # square: the standard iteration


@pytest.mark.parametrize(
    "method,steps",
    [
        ("quintic", 5),
        ("polar_express", 7),
        ("cubic", 2),
        ("aol", 4),
        ("gram", 5),
        ("gram", 2),
        ("you", 3),
    ],
)
def test_gemm_flops_equal_the_profilers_count(method, steps):
    """What the iteration runs, counted by torch's profiler (fp32, below the blockwise sizes;
    aol9 is counted by hand above: the profiler gives its in-place addmm_ no FLOPs)."""
    schedule = O.coefficient_schedule(method, steps)
    for shape in ((48, 80), (80, 48), (40, 40)):
        x = torch.randn(shape)
        assert _gemm_flops(
            lambda: O.newton_schulz(x, method, steps, dtype=torch.float32)  # noqa: B023  called at once, in this iteration
        ) == O.gemm_flops(shape, schedule), shape


def test_step_gemm_flops_of_the_sets_and_their_sizes_cost_no_memory():
    from muon_fn.tools.bench._bound import step_gemm_flops

    quintic5 = O.coefficient_schedule("quintic", 5)

    def flops(size, layers=None):
        return step_gemm_flops([s for _, s in bench.matrix_shapes(size, layers)], quintic5)

    def it(s, l):  # noqa: E741  one quintic iteration of a wide (s, l)
        return 4 * s * s * l + 2 * s**3

    assert flops("gpt2-small") == 3600 * 768**3 == 1_630_745_395_200  # 12·5·(4·6 + 2·18)·768³
    # Per layer: q, o 2048²; k, v 512×2048; gate, up, down 2048×8192.
    assert flops("llama3-1b") == 16 * 5 * (
        2 * it(2048, 2048) + 2 * it(512, 2048) + 3 * it(2048, 8192)
    )
    assert flops("llama3-8b") == 8 * 5 * (
        2 * it(4096, 4096) + 2 * it(1024, 4096) + 3 * it(4096, 14336)
    )
    assert flops("deepseek-moe") == 2 * 5 * 3 * 64 * it(
        1408, 2048
    )  # 3 stacks of 64 experts a layer
    sizes = {name: bench.set_size(name) for name in bench.SETS}
    assert sizes["llama3-1b"] == (112, 973_078_528) and sizes["gpt2-small"] == (72, 84_934_656)
    assert sizes["llama3-8b"] == (56, 1_744_830_464) and bench.set_size("llama3-8b", 32)[0] == 224
    assert sizes["deepseek-moe"] == (384, 1_107_296_256)
    params, names = bench.meta_params("deepseek-moe")
    assert all(p.is_meta for p in params) and names[:3] == ["h0.gate", "h0.up", "h0.down"]
    assert [tuple(p.shape) for p in params[:3]] == [
        (64, 1408, 2048),
        (64, 1408, 2048),
        (64, 2048, 1408),
    ]


def test_sets_too_large_for_the_cpu_are_refused_with_what_to_do(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--model-size", "llama3-8b"])
    err = capsys.readouterr().err
    assert (
        "Invalid model_size: 'llama3-8b' on the CPU (8 layer(s), 56 matrices, 1745 M params" in err
    )
    assert "--device cuda" in err and "--force" in err
    with pytest.raises(ValueError, match="deepseek-moe"):
        bench.benchmark_muon_optimizers("deepseek-moe", layers=1)
    _muon.check_muon_args("llama3-1b", layers=1)  # 61 M params: timed on the CPU like gpt2-small


TOY_SETS = {
    "llama-toy": bench.MatrixSet("llama", 2, 64, 128, 4, 2, 16),
    "moe-toy": bench.MatrixSet("moe", 3, 64, 32, 0, 0, 0, experts=4, top_k=2, default_layers=2),
}


@pytest.mark.parametrize("size", list(TOY_SETS))
def test_llama_and_expert_sets_run_every_kind_of_row(size, monkeypatch):
    """The "llama" and "moe" kinds at toy sizes: grouped-query and SwiGLU shapes, expert stacks
    (E matrices each; torch.optim.Muon sees them as 2-D views of the stacks' storage)."""
    monkeypatch.setitem(bench.SETS, size, TOY_SETS[size])
    rows = ["muon_fn[eager]", "torch.optim.Muon", "replay[quintic5]", "replay[torch_quintic5]"]
    res = bench.benchmark_muon_optimizers(size, rows=rows, rounds=1, gaussian=False)
    matrices = 14 if size == "llama-toy" else 2 * 3 * 4
    assert (res["config"]["layers"], res["config"]["matrices"]) == (2, matrices)
    flops = {r: v["gemm_flops"] for r, v in res["rows"].items()}
    assert len(set(flops.values())) == 1 and flops["muon_fn[eager]"] > 0
    states = {r: res["rows"][r]["state_bytes"] for r in ("muon_fn[eager]", "torch.optim.Muon")}
    assert states["muon_fn[eager]"] == states["torch.optim.Muon"] == 4 * res["config"]["params"]
    kinds = {
        "llama-toy": {"q", "k", "v", "o", "gate", "up", "down"},
        "moe-toy": {"gate", "up", "down"},
    }[size]
    assert set(res["quality"]["torch.optim.Muon"]) == kinds


def test_replay_of_expert_stacks_runs_the_gemms_of_the_step():
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 32, 48)] * 5 + [(2, O.LOOP_MIN_DIM, 400)]
    params = [torch.randn(s, generator=g).requires_grad_() for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    opt = MuonOptimizer(params, lr=0.02, matrix_view="experts", compile=False)
    opt.step()
    replay = bench.replay(params, "quintic", 5, bucket_size=_replay.AUTO)
    assert _gemm_flops(replay) == _gemm_flops(opt.step) > 0


def test_replays_built_together_share_their_prepared_inputs():
    from muon_fn.tools.bench import _replay

    params = [torch.randn(32, 48), torch.randn(3, 32, 48)]
    with _replay.shared_inputs():
        for method, bucket_size in (("quintic", 4), ("quintic", None), ("polar_express", 4)):
            bench.replay(params, method, 5, bucket_size=bucket_size, dtype=torch.float32)
        shared = dict(_replay._SHARED)
    assert (
        len(shared) == 2 and _replay._SHARED is None
    )  # quintic twice: one copy; Polar Express: its 1.01 scale


# ----------------------------------------------------------------------------- compile time
def test_compile_time_runs_cold_then_warm_in_one_new_cache_directory(tmp_path, capsys, monkeypatch):
    """Each set, policy and optimizer: a cold process on a new cache directory, then a warm one on
    the same directory; the ratio is warm over cold."""
    from muon_fn.tools.bench import _compile_time

    calls = []

    def fake(model_size, optimizer, policy, device, threads, cache):
        calls.append((model_size, optimizer, policy, cache))
        warm = any(c[3] == cache for c in calls[:-1])
        return {
            "first_step_s": 2.0 if warm else 10.0,
            "second_step_s": 1.0,
            "graphs": 3,
            "fxgraph_cache_hit": 3 if warm else 0,
            "fxgraph_cache_miss": 0 if warm else 3,
            "autograd_cache_hit": 3 if warm else 0,
            "autograd_cache_miss": 0 if warm else 3,
        }

    monkeypatch.setattr(_compile_time, "_in_process", fake)
    path = tmp_path / "c.json"
    assert bench.main(["--compile-time", "--model-size", "tiny", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["compile_time,threads=1"]
    assert [(r["policy"], r["optimizer"]) for r in rows] == [
        ("cpu", "muon"),
        ("cpu", "hybrid"),
        ("batched", "muon"),
        ("batched", "hybrid"),
    ]
    assert [r["warm_over_cold"] for r in rows] == [0.2] * 4
    assert [r["warm_compile_over_cold"] for r in rows] == [1 / 9] * 4
    caches = [c[3] for c in calls]
    assert (
        caches[0::2] == caches[1::2] and len(set(caches)) == 4
    )  # cold and warm share one, new per row
    out = capsys.readouterr().out
    assert "compile time: first step of a fresh process" in out and out.count("tiny ") == 4


@pytest.mark.slow
def test_compile_time_first_step_counts_graphs_and_cache_lookups(compiled_default, monkeypatch):
    """The measured process's own part, with Dynamo's eager backend (no code generation)."""
    from muon_fn.core import compile as _compile
    from muon_fn.tools.bench import _compile_time

    monkeypatch.setattr(_compile, "DEFAULTS", {**_compile.DEFAULTS, "backend": "eager"})
    result = _compile_time.first_step("tiny", "hybrid", "batched")
    assert result["first_step_s"] > 0 and result["graphs"] >= 2
    assert set(result) == {
        "first_step_s",
        "second_step_s",
        "graphs",
        "fxgraph_cache_hit",
        "fxgraph_cache_miss",
        "autograd_cache_hit",
        "autograd_cache_miss",
    }


def test_compile_time_refuses_sets_it_does_not_measure(capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--compile-time", "--model-size", "llama3-1b"])
    assert exc.value.code == 2
    assert (
        "--compile-time measures the GPT sets (tiny, gpt2-small), not llama3-1b"
        in capsys.readouterr().err
    )
    from muon_fn.tools.bench import _compile_time

    with pytest.raises(
        ValueError, match=r"Invalid policy: 'gpu' \(expected one of \['cpu', 'batched'\]\)"
    ):
        _compile_time.measure("tiny", "muon", "gpu")
