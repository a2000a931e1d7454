"""muon_fn.bench: structure of the results, the shared pieces, and the command line.

No timing is asserted anywhere (shared CPUs swing 2x). Runs use the tiny set's first layer;
conftest sets ``MUON_FN_COMPILE=0``, so the default row runs eagerly unless a test asks for the
compiled default.
"""

from __future__ import annotations

import json

import expecttest
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from muon_fn import MuonOptimizer, bench
from muon_fn import _newton_schulz as O
from muon_fn.bench import _rows, _timing

ONE_LAYER = dict(model_size="tiny", layers=1, rounds=1, quality_layers=1, gaussian=False)


# ----------------------------------------------------------------------------- the Muon step benchmark
def test_benchmark_smoke_with_torch_reference():
    rows = ["muon_fn", "muon_fn[eager]", "torch.optim.Muon", "replay[quintic5]"]
    res = bench.benchmark_muon_optimizers(rows=rows, **ONE_LAYER)
    cfg = res["config"]
    assert (cfg["matrices"], cfg["layers"], cfg["threads"]) == (6, 1, 1) and set(res["rows"]) == set(rows)
    assert cfg["compile_default"] is False  # MUON_FN_COMPILE=0 in the tests
    for r in res["rows"].values():
        assert len(r["seconds_per_step"]) == 1 and r["min"] <= r["median"] <= r["max"] and r["first_step_s"] > 0
        assert len(r["ratio_to_torch_muon"]) == 1
    ref, default = res["rows"]["torch.optim.Muon"], res["rows"]["muon_fn"]
    assert ref["ratio_to_torch_muon"] == [1.0] and ref["compiled"] is None and default["compiled"] is False
    assert default["own_replay"] == "replay[quintic5]" and len(default["ratio_to_own_replay"]) == 1
    assert "own_replay" not in ref  # replay[torch_quintic5] did not run
    # Persistent state: one fp32 momentum buffer per matrix, as torch.optim.Muon keeps.
    n = sum(s[0] * s[1] for _, s in bench.matrix_shapes("tiny", layers=1))
    assert ref["state_bytes"] == default["momentum_bytes"] == default["state_bytes"] == 4 * n
    assert default["state_ratio_to_torch_muon"] == 1.0
    assert default["peak_step_bytes"] > 0 and ref["peak_step_bytes"] > 0
    assert res["rows"]["replay[quintic5]"]["peak_step_bytes"] is None
    q = res["quality"]
    assert set(q["muon_fn"]) == {"q", "k", "v", "o", "fc", "proj"} and q["muon_fn"] == q["muon_fn[eager]"]
    for kind in q["torch.optim.Muon"].values():
        assert kind["ratio_to_torch"] == pytest.approx(1.0)
    for kind in q["muon_fn"].values():  # the default is the quintic; its σ lands in about [0.68, 1.21]
        assert kind["ratio_to_quintic_same_dtype"] == pytest.approx(1.0) and kind["max"] < 1.25
    json.dumps(res)
    table = bench.format_table(res)
    assert all(r in table for r in rows) and "tiny: 6 matrices" in table


def test_ratios_and_quality_need_their_reference_rows():
    res = bench.benchmark_muon_optimizers(rows=["muon_fn[eager]", "replay[polar_express5]"], memory=False,
                                          **{**ONE_LAYER, "gaussian": (32, 64)})
    row = res["rows"]["muon_fn[eager]"]
    assert not {"ratio_to_torch_muon", "ratio_to_own_replay", "own_replay", "state_ratio_to_torch_muon",
                "peak_step_bytes"} & set(row)
    assert res["rows"]["replay[polar_express5]"]["ratio_to_own_replay"] == [1.0]
    for per_kind in (res["quality"]["muon_fn[eager]"], res["gaussian_quality"]["muon_fn[eager]"]):
        for kind in per_kind.values():
            assert "ratio_to_torch" not in kind and kind["ratio_to_quintic_same_dtype"] > 0
    assert set(res["gaussian_quality"]["muon_fn[eager]"]) == {"32x64", "64x32"}
    assert " - " in bench.format_table(res).splitlines()[2]  # the absent ratios print as '-'


@pytest.mark.inductor
def test_default_row_compiles_on_its_first_step(compiled_default):
    res = bench.benchmark_muon_optimizers(rows=["muon_fn", "muon_fn[eager]"], quality=False, memory=False,
                                          **ONE_LAYER)
    assert res["config"]["compile_default"] is True
    assert res["rows"]["muon_fn"]["compiled"] is True and res["rows"]["muon_fn[eager]"]["compiled"] is False
    lines = bench.format_table(res).splitlines()
    assert lines[2].split()[1].endswith("c") and not lines[3].split()[1].endswith("c")  # the 1st step column


@pytest.mark.parametrize("kwargs,match", [
    ({"model_size": "gpt3"}, "model_size"),
    ({"layers": 5}, r"Invalid layers: 5 \(expected 1..4 for tiny\)"),
    ({"num_steps": 0}, "num_steps"),
    ({"rounds": 1.5}, "rounds"),
    ({"lr": -1.0}, "lr"),
    ({"rows": ["sgd"]}, "Invalid row: 'sgd'"),
    ({"threads": 0}, "Invalid threads: 0"),
    ({"device": "bogus"}, "Invalid device: 'bogus'"),
    ({"device": "meta"}, "meta tensors hold no data to time"),
])
def test_benchmark_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        bench.benchmark_muon_optimizers(**kwargs)


def test_every_timed_step_is_bracketed_by_a_device_synchronize(monkeypatch):
    calls = []
    monkeypatch.setattr(_timing, "synchronize", calls.append)
    res = bench.benchmark_muon_optimizers(rows=["muon_fn[eager]", "replay[aol9]"], quality=False, memory=False,
                                          device="cpu", **{**ONE_LAYER, "rounds": 2})
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
    assert set(bench.ROWS) | set(bench.OPTIONAL_ROWS) == set(bench.ROW_SPECS)


def test_default_rows_leave_out_emulated_bf16(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(O, "CPU_HAS_BF16_GEMM", True)
    assert bench.default_rows("gpt2-small", cpu) == list(bench.ROWS)
    monkeypatch.setattr(O, "CPU_HAS_BF16_GEMM", False)
    tiny, gpt2 = bench.default_rows("tiny", cpu), bench.default_rows("gpt2-small", cpu)
    assert "torch.optim.Muon" in tiny and "torch.optim.Muon" not in gpt2
    assert not {"muon_fn[like_torch]", "replay[torch_quintic5]"} & (set(tiny) | set(gpt2))
    assert "muon_fn" in gpt2 and "replay[quintic5]" in gpt2


def _gemm_flops(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        fn()
    return sum(e.flops for e in prof.events() if e.name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"))


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
    replay = bench.replay(params, method, steps, bucket_size=_rows.BUCKET_SIZE)
    assert _gemm_flops(replay) == _gemm_flops(opt.step) > 0


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
    assert bench.peak_step_bytes(lambda: x.add_(1), cpu) < 100  # in place: nothing (the profiler: a few bytes)
    assert bench.peak_step_bytes(step, torch.device("meta")) is None  # not measured there


def test_paired_rounds_rotate_the_order_and_run_the_hooks_outside_the_clock():
    seen = []
    times = bench.paired_rounds(["a", "b", "c"], lambda r: seen.append(r), 3, device=torch.device("cpu"),
                                steps_per_round=2, before_round=lambda k: seen.append(k),
                                before_row=lambda r, k: seen.append(f"<{r}"),
                                after_row=lambda r, k, s: seen.append(f"{r}>"))
    assert seen[:8] == [0, "<a", "a", "a", "a>", "<b", "b", "b"]
    assert [x for x in seen if x in (0, 1, 2) or x in ("<a", "<b", "<c")] == [
        0, "<a", "<b", "<c", 1, "<b", "<c", "<a", 2, "<c", "<a", "<b"]
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
    monkeypatch.setattr(_timing, "default_threads", lambda: 1)  # 2 threads on a shared 2-core CPU crawl
    path = tmp_path / "b.json"
    assert bench.main(["--model-size", "tiny", "--layers", "1", "--rounds", "1", "--rows", "muon_fn[eager]",
                       "replay[quintic5]", "--threads", "1,default", "--no-quality", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert list(data) == ["tiny,threads=1", "tiny,threads=default"]
    assert [data[k]["config"]["threads_requested"] for k in data] == [1, "default"]
    assert data["tiny,threads=1"]["rows"]["muon_fn[eager]"]["ratio_to_own_replay_median"] > 0
    assert capsys.readouterr().out.count("s/step min") == 2


def test_elementwise_rows_report_paired_ratios_to_their_torch_peers(tmp_path, capsys):
    path = tmp_path / "e.json"
    assert bench.main(["--elementwise", "--model-size", "tiny", "--layers", "1", "--rounds", "2",
                       "--no-memory", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["tiny,threads=1"]["rows"]
    assert list(rows) == list(bench.ELEMENTWISE_ROWS) and "quality" not in rows
    assert set(rows["TritonMuon"]["ratio_to_peers"]) == {"torch.optim.Adam[fused]", "torch.optim.SGD[fused]"}
    assert set(rows["TritonMuonW"]["ratio_to_peers"]) == {"torch.optim.AdamW[fused,wd=0.01]", "torch.optim.SGD[fused]"}
    for ratio in rows["TritonMuonW"]["ratio_to_peers"].values():
        assert len(ratio["per_round"]) == 2 and ratio["median"] > 0
    assert "ratio_to_peers" not in rows["torch.optim.Adam[fused]"]
    out = capsys.readouterr().out
    assert "/peer" in out and "TritonMuon: /torch.optim.Adam[fused] " in out
    for spec in bench.ROW_SPECS.values():
        assert all(p in bench.ROW_SPECS for p in spec.peers)


@pytest.mark.parametrize("argv,message", [
    (["--elementwise", "--rows", "muon_fn"], "--elementwise chooses the rows: give it or --rows, not both"),
    (["--device", "meta", "--quick"], "Invalid device: 'meta' (meta tensors hold no data to time)"),
    (["--threads", "0"], "argument --threads: Invalid threads: 0"),
    (["--model-size", "tiny", "--layers", "9", "--no-quality"], "Invalid layers: 9 (expected 1..4 for tiny)"),
    (["sso", "--rows", "sso"], "Invalid rows: must include 'muon'"),
    (["fsdp", "--world-sizes", "1"], "Invalid --world-sizes: [1] (expected each >= 2)"),
])
def test_main_reports_bad_arguments_as_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    prog = "muon-fn bench" + (f" {argv[0]}" if argv[0] in ("sso", "fsdp") else "")
    assert f"{prog}: error: {message}" in err


# ----------------------------------------------------------------------------- SSO and FSDP benchmarks
def test_sso_command_reports_ratios_and_warmup_times(tmp_path, capsys):
    path = tmp_path / "sso.json"
    assert bench.main(["sso", "--layers", "1", "--rounds", "1", "--warmup", "1", "--rows", "muon,muon_pe5",
                       "--json", str(path)]) == 0
    res = json.loads(path.read_text())["threads=1"]
    assert res["matrices"] == 6 and set(res["ratios"]) == {"muon_pe5/muon"} and res["solver"] == {}
    assert {r: len(t) for r, t in res["warmup_step_s"].items()} == {"muon": 1, "muon_pe5": 1}
    captured = capsys.readouterr()
    assert "round 0 (warm-up): " in captured.err and "round 1: " in captured.err
    assert "muon_pe5/muon" in captured.out


def test_sso_bench_rejects_bad_arguments():
    for kwargs, message in [(dict(rows=("sso",)), "must include 'muon'"), (dict(layers=13), "Invalid layers: 13"),
                            (dict(rounds=0), "Invalid rounds: 0"), (dict(warmup=-1), "Invalid warmup: -1"),
                            (dict(rows=("muon", "x")), "Invalid row: 'x'")]:
        with pytest.raises(ValueError, match=message):
            bench.benchmark_sso(**kwargs)


def test_fsdp_benchmark_is_importable_without_running_ranks():
    assert callable(bench.benchmark_fsdp) and callable(bench.format_fsdp_result)


class TestSSOBenchTable(expecttest.TestCase):
    def test_table(self):
        result = {
            "layers": 12, "matrices": 72, "rounds": 2, "warmup": 1, "threads": 1, "wall_s": 100.0,
            "median_step_s": {"muon": 5.93, "muon_same": 22.77, "sso": 30.53},
            "ratios": {"muon_same/muon": {"median": 3.79, "min": 3.49, "max": 3.85, "per_round": [3.49, 3.85]},
                       "sso/muon": {"median": 5.02, "min": 4.59, "max": 5.16, "per_round": [4.59, 5.16]},
                       "sso/muon_same": {"median": 1.323, "min": 1.304, "max": 1.342, "per_round": [1.304, 1.342]}},
            "solver": {"sso": {"msigns_per_matrix_histogram": {1: 143, 2: 1}, "msigns_per_matrix_mean": 1.0069,
                               "residual_max": 1.13e-5, "fallbacks": 0, "sigma_rel_error_max": 2.5e-7}},
        }
        self.assertExpectedInline(bench.format_sso_table(result), """\
gpt2-small matrix set, 12 layer(s) = 72 matrices; 1 warm-up + 2 paired rounds, 1 thread(s)
row                median s/step
muon                       5.930
muon_same                 22.770
sso                       30.530
ratio                     median     min     max  per round
muon_same/muon             3.790   3.490   3.850  3.490 3.850
sso/muon                   5.020   4.590   5.160  4.590 5.160
sso/muon_same              1.323   1.304   1.342  1.304 1.342
sso: msigns per matrix-step {1: 143, 2: 1} (mean 1.01), max |h| 1.1e-05, fallbacks 0, σ estimate rel. error max 2.5e-07""")


def test_quality_leak_separates_preconditioned_iterations():
    """``leak``: polynomial iterations in XXᵀ keep the gradient's singular basis (0 up to
    rounding); AOL's row rescaling does not (its fixed point is msign(D·X), not msign(X))."""
    from muon_fn.bench import _quality as Q

    gen = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(32, 32, generator=gen))[0]
    g = torch.randn(64, 32, generator=gen) @ torch.diag(torch.logspace(0, -4, 32)) @ basis
    leak = {m: Q.orthogonality(g, Q.orthogonalizer(Q.Ortho(m, None, torch.float32))(g))["leak"]
            for m in ("quintic", "polar_express", "aol9", "aol")}
    assert leak["quintic"] < 1e-5 and leak["polar_express"] < 1e-5
    assert leak["aol9"] > 0.02 and leak["aol"] > 0.02
