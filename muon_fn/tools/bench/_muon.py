"""The Muon step benchmark: paired step times, memory and orthogonality quality of every row.

Every round times every row back to back on the same parameters and gradients (real ones, see
:mod:`._problem`), so machine load cancels in the per-round ratios to ``torch.optim.Muon`` and to
each row's own GEMM replay. Each row's first step is timed apart: it allocates the state and, for
a compiled row, compiles.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any
from collections.abc import Callable, Sequence

import torch

from muon_fn import orthogonalization
from .._device import synchronize
from ._bound import bound_seconds, matmul_rate, representative_shape, step_gemm_flops
from ._memory import PEAK_METHODS, peak_step_bytes, state_bytes
from ._problem import check_cpu_size, check_size, real_gradients, set_size
from . import _quality
from ._quality import TORCH
from ._replay import shared_inputs
from ._rows import REFERENCE, ROW_SPECS, ROWS, Built, check_rows
from ._timing import Threads, check_device, check_threads, paired_ratio, paired_rounds, using_threads


def benchmark_muon_optimizers(
    model_size: str = "tiny",
    num_steps: int = 1,
    lr: float = 0.02,
    *,
    rows: Sequence[str] | None = None,
    rounds: int = 10,
    layers: int | None = None,
    quality: bool = True,
    quality_layers: int | None = 2,
    gaussian: bool | tuple[int, int] = True,
    memory: bool = True,
    threads: Threads = 1,
    seed: int = 0,
    device: torch.device | str | None = None,
    force: bool = False,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Time every row for ``rounds`` paired rounds of ``num_steps`` steps on ``model_size``.

    Args:
      model_size: a set of :data:`muon_fn.tools.bench._problem.SETS`: ``"tiny"`` (4 layers, d=256),
        ``"gpt2-small"`` (12 layers, d=768), ``"llama3-1b"``, ``"llama3-8b"`` (8 of its 32 layers
        unless ``layers`` says otherwise) or ``"deepseek-moe"`` (expert stacks; 2 of 27 layers).
      num_steps: optimizer steps per row per round (seconds per step = round time / num_steps).
      lr: Muon learning rate (AdamW and the elementwise rows use ``lr/20``).
      rows: names from :data:`ROW_SPECS` (default :data:`ROWS`). A ratio needs its reference
        among them: ``torch.optim.Muon`` for ``ratio_to_torch_muon``, the row's own replay for
        ``ratio_to_own_replay``; without it the ratio is absent.
      rounds: paired rounds after the first step; each times every row back to back, in a
        rotated order.
      layers: the set's first ``layers`` layers only (default: all, or the set's default).
      quality: measure orthogonality of each row's orthogonalization on the gradients.
      quality_layers: 1 (first layer), 2 (first and last) or ``None`` (all) layers measured.
      gaussian: also measure quality on rectangular Gaussian 768×3072 and 3072×768 inputs
        (or on the ``(m, n)`` given).
      memory: measure each optimizer row's peak transient memory in one more step (see
        :mod:`muon_fn.tools.bench._memory` for how, per device).
      threads: ``torch.set_num_threads`` for the run; ``"default"``: the count torch picks
        when nothing sets one.
      seed: parameters and the data batch.
      device: where the parameters live and every row runs (default CPU). On an accelerator each
        timed row ends with :func:`synchronize`; the quality SVDs run on the CPU.
      force: time a selection of more than :data:`~muon_fn.tools.bench._problem.CPU_MAX_PARAMS`
        parameters on the CPU (refused otherwise: hours of GEMMs).
      progress: called with a line after each row's first step and after each round (the CLI
        prints them to stderr, so a run stopped early still shows how far it got).

    Returns:
      A JSON-serializable dict: ``config`` (with ``matmul_rates``: per compute dtype of the
      rows, the measured FLOP/s of a representative GEMM, :mod:`muon_fn.tools.bench._bound`), ``rows``
      (per row: seconds per step per round, min/median/max, the first step's seconds, whether it
      compiled, its Newton–Schulz ``gemm_flops``, ``bound_s`` (those FLOPs at the measured rate)
      and ``ratio_to_bound`` (median / bound), state and peak step bytes,
      per-round ratios to torch.optim.Muon, to its own replay and, as ``ratio_to_peers``, to the
      rows it is compared with (the elementwise rows: torch's fused Adam, AdamW, SGD)), and ``quality`` and
      ``gaussian_quality`` (per row and matrix kind).
    """
    rows, device = check_muon_args(model_size, num_steps, lr, rows, rounds, layers, threads, device, force)
    with using_threads(threads) as n_threads:
        params, grads, names = real_gradients(model_size, layers=layers, seed=seed, device=device)
        for p, g in zip(params, grads):
            p.grad = g
        with shared_inputs():
            built = {r: ROW_SPECS[r].build(params, lr) for r in rows}
        first, times = _time_rows(built, params, rounds, num_steps, device, progress or (lambda _: None))
        rates = _matmul_rates(rows, params, device)
        out: dict[str, Any] = {
            "config": {**_config(model_size, layers, params, num_steps, lr, rounds, threads, n_threads, device),
                       "matmul_rates": rates},
            "rows": _summarize(built, first, times),
        }
        _add_bounds(out["rows"], params, rates, device)
        if memory:
            for r, (opt, step) in built.items():
                out["rows"][r]["peak_step_bytes"] = None if opt is None else peak_step_bytes(step, device)
        if quality:
            _measure_quality(out, rows, dict(zip(names, grads)), quality_layers, gaussian, seed, device)
    return out


def check_muon_args(model_size: str = "tiny", num_steps: int = 1, lr: float = 0.02,
                    rows: Sequence[str] | None = None, rounds: int = 1, layers: int | None = None,
                    threads: Threads = 1, device: Any = None, force: bool = False) -> tuple[list[str], torch.device]:
    """The rows and the device of a :func:`benchmark_muon_optimizers` call, or ``ValueError``
    naming the first argument it cannot use (before any work), a set too large for the CPU
    included (unless ``force``)."""
    check_size(model_size, layers)
    for arg, v in (("num_steps", num_steps), ("rounds", rounds)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"Invalid {arg}: {v!r} (expected an integer >= 1)")
    if not (isinstance(lr, (int, float)) and lr > 0 and math.isfinite(lr)):
        raise ValueError(f"Invalid lr: {lr!r} (expected a positive finite float)")
    check_threads(threads)
    rows, device = check_rows(ROWS if rows is None else rows), check_device(device)
    if not force:
        check_cpu_size(model_size, layers, device)
    return rows, device


def _row_flops(row: str, params: list[torch.Tensor], device: torch.device) -> int | None:
    """Newton–Schulz GEMM FLOPs of one step of ``row`` (None for a row that does not orthogonalize)."""
    ortho = ROW_SPECS[row].ortho(device)
    if ortho is None:
        return None
    method = "quintic" if ortho.method == TORCH else ortho.method  # torch.optim.Muon: Keller's quintic
    return step_gemm_flops([p.shape for p in params], orthogonalization.coefficient_schedule(method, ortho.steps))


def _add_bounds(rows: dict[str, dict[str, Any]], params: list[torch.Tensor], rates: dict[str, Any],
                device: torch.device) -> None:
    """Each orthogonalizing row's GEMM FLOPs, its bound (those FLOPs at the rate measured for its
    compute dtype) and its median over that bound."""
    for r, row in rows.items():
        f = _row_flops(r, params, device)
        if f is not None:
            bound = bound_seconds(f, rates[str(ROW_SPECS[r].ortho(device).dtype).removeprefix("torch.")])
            row.update(gemm_flops=f, bound_s=bound, ratio_to_bound=row["median"] / bound)


def _matmul_rates(rows: Sequence[str], params: list[torch.Tensor], device: torch.device) -> dict[str, Any]:
    """The measured GEMM rate of every dtype the orthogonalizing rows iterate in."""
    dtypes = {o.dtype for r in rows if (o := ROW_SPECS[r].ortho(device)) is not None}
    shape = representative_shape([p.shape for p in params])
    return {str(dt).removeprefix("torch."): matmul_rate(shape, dt, device)
            for dt in sorted(dtypes, key=str)}


def _time_rows(built: dict[str, Built], params: list[torch.Tensor], rounds: int, num_steps: int,
               device: torch.device,
               progress: Callable[[str], None]) -> tuple[dict[str, float], dict[str, list[float]]]:
    """The first step of every row (state allocation, compilation), then ``rounds`` paired rounds;
    the parameters go back to their start after every round (lr does not matter here), copied
    from the host (no second copy of a large set on the device)."""
    def step(r: str) -> None:
        built[r][1]()

    def first_step(r: str, _: int, seconds: float) -> None:
        progress(f"{r}: first step {seconds:.2f} s")

    first = {r: t[0] for r, t in paired_rounds(list(built), step, 1, device=device, after_row=first_step).items()}
    saved = [p.detach().to("cpu", copy=True) for p in params]

    def restore(k: int) -> None:
        if k > 0:
            progress(f"round {k} of {rounds} timed")
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)

    times = paired_rounds(list(built), step, rounds, device=device, steps_per_round=num_steps,
                          before_round=restore)
    restore(rounds)
    return first, times


def _summarize(built: dict[str, Built], first: dict[str, float],
               times: dict[str, list[float]]) -> dict[str, dict[str, Any]]:
    """Per row: the times, the first step, state bytes, and the paired ratios whose reference ran."""
    out: dict[str, dict[str, Any]] = {}
    reference_state = state_bytes(built[REFERENCE][0]) if REFERENCE in built else None
    for r, t in times.items():
        spec, opt = ROW_SPECS[r], built[r][0]
        row: dict[str, Any] = {
            "seconds_per_step": t, "min": min(t), "median": statistics.median(t), "max": max(t),
            "first_step_s": first[r], "compiled": spec.compiled(),
            "state_bytes": state_bytes(opt), "momentum_bytes": state_bytes(opt, "momentum_buffer"),
        }
        if reference_state and opt is not None:
            row["state_ratio_to_torch_muon"] = row["state_bytes"] / reference_state
        if spec.own_replay in times:
            row["own_replay"] = spec.own_replay
        for key, ref in (("ratio_to_torch_muon", REFERENCE), ("ratio_to_own_replay", spec.own_replay)):
            if ref in times:
                q = paired_ratio(t, times[ref])
                row[key], row[key + "_median"] = q["per_round"], q["median"]
        peers = {p: paired_ratio(t, times[p]) for p in spec.peers if p in times}
        if peers:
            row["ratio_to_peers"] = {p: {"median": q["median"], "per_round": q["per_round"]} for p, q in peers.items()}
        out[r] = row
    return out


def _config(model_size: str, layers: int | None, params: list[torch.Tensor], num_steps: int, lr: float,
            rounds: int, threads: Threads, n_threads: int, device: torch.device) -> dict[str, Any]:
    return {
        "model_size": model_size, "layers": check_size(model_size, layers), "num_steps": num_steps, "lr": lr,
        "rounds": rounds, "threads": n_threads, "threads_requested": threads, "device": str(device),
        "torch": torch.__version__, "matrices": set_size(model_size, layers)[0],
        "params": sum(p.numel() for p in params),
        "compute_dtype": str(orthogonalization.default_compute_dtype(device)).removeprefix("torch."),
        "cpu_bf16_gemm": orthogonalization.CPU_HAS_BF16_GEMM,
        "compile_default": orthogonalization.compiles(True),
        "peak_memory_method": PEAK_METHODS.get(device.type),
    }


def _measure_quality(out: dict[str, Any], rows: list[str], grads: dict[str, torch.Tensor],
                     quality_layers: int | None, gaussian: bool | tuple[int, int], seed: int,
                     device: torch.device) -> None:
    """Quality of each row's orthogonalization on the gradients of the chosen layers: each step
    sees the same gradient, so every row's Nesterov momentum is a multiple of it, and msign is
    scale-invariant; of an expert stack, the expert with the largest gradient. Against torch's
    own function only if torch.optim.Muon is a row."""
    specs = {r: o for r in rows if (o := ROW_SPECS[r].ortho(device)) is not None}
    used = out["config"]["layers"]
    keep = set(range(used)) if quality_layers is None else {0, used - 1} if quality_layers >= 2 else {0}
    inputs = {n: g if g.ndim == 2 else g[torch.linalg.vector_norm(g, dim=(-2, -1)).argmax()]
              for n, g in grads.items() if int(n.split(".")[0][1:]) in keep}  # a stack: its busiest expert
    versus_torch = REFERENCE in rows
    out["quality"] = _quality.quality(specs, inputs, versus_torch=versus_torch)
    if gaussian:
        size = (768, 3072) if gaussian is True else tuple(gaussian)
        out["gaussian_quality"] = _quality.quality(specs, _quality.gaussian_inputs(size, seed=seed, device=device),
                                                   versus_torch=versus_torch)


# ----------------------------------------------------------------------------- compile check
def compile_check(model_size: str = "tiny", *, steps: int = 100, lr: float = 0.02,
                  device: torch.device | str | None = None, **kwargs: Any) -> dict[str, Any]:
    """Cold first step of a compiled ``MuonOptimizer`` and recompiles over ``steps`` LR-scheduled
    steps, on ``device`` (default CPU); compiled whatever ``MUON_FN_COMPILE`` says."""
    from torch._dynamo.utils import counters

    from muon_fn.optim import MuonOptimizer

    device = check_device(device)
    torch._dynamo.reset()
    params, grads, _ = real_gradients(model_size, device=device)
    for p, g in zip(params, grads):
        p.grad = g
    opt = MuonOptimizer(params, lr=lr, compile={}, **kwargs)  # {}: torch.compile's defaults
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.01 * s))
    before = counters["stats"]["unique_graphs"]  # counters are process-wide
    t0 = time.perf_counter()
    opt.step()
    synchronize(device)
    cold = time.perf_counter() - t0
    graphs_after_first = counters["stats"]["unique_graphs"]
    t0 = time.perf_counter()
    for _ in range(steps - 1):
        sched.step()
        opt.step()
    synchronize(device)
    warm = (time.perf_counter() - t0) / max(1, steps - 1)
    return {"model_size": model_size, "cold_first_step_seconds": cold, "warm_seconds_per_step": warm,
            "graphs_first_step": graphs_after_first - before,
            "recompiles": counters["stats"]["unique_graphs"] - graphs_after_first, "steps": steps}


# ----------------------------------------------------------------------------- table
def format_table(result: dict[str, Any]) -> str:
    """The timing/memory/quality table of a :func:`benchmark_muon_optimizers` result."""
    cfg = result["config"]
    width = max([26, *(len(r) for r in result["rows"])])
    rates = ", ".join(f"{dt} {r['flops_per_s'] / 1e12:.3g} TFLOP/s" for dt, r in cfg.get("matmul_rates", {}).items())
    lines = [f"{cfg['model_size']}: {cfg['layers']} layer(s), {cfg['matrices']} matrices, "
             f"{cfg['params'] / 1e6:.1f} M params, "
             f"{cfg['rounds']} paired rounds x {cfg['num_steps']} steps, {cfg['device']}, "
             f"{cfg['threads']} thread(s), torch {cfg['torch']}, default compute dtype {cfg['compute_dtype']} "
             f"(CPU bf16 GEMMs: {cfg['cpu_bf16_gemm']})" + (f"; matmul {rates}" if rates else ""),
             f"{'row':{width}s} {'1st step':>9s} {'ms/step min':>11s} {'median':>9s} {'max':>9s} {'bound ms':>9s} "
             f"{'/bound':>6s} {'/torch':>7s} {'/own':>6s} {'/peer':>6s} {'state MiB':>9s} {'peak MiB':>8s}  "
             "quality: worst RMS ratio per matrix (σ range)"]
    q, gq = result.get("quality", {}), result.get("gaussian_quality", {})
    for r, v in result["rows"].items():
        first = f"{v['first_step_s']:8.2f}{'c' if v.get('compiled') else ' '}"
        peak = v.get("peak_step_bytes")
        peer = next(iter(v.get("ratio_to_peers", {}).values()), {}).get("median")
        bound = v.get("bound_s")
        lines.append(f"{r:{width}s} {first} {v['min'] * 1e3:11.2f} {v['median'] * 1e3:9.2f} {v['max'] * 1e3:9.2f} "
                     f"{_fmt(None if bound is None else bound * 1e3, 9, 2)} {_fmt(v.get('ratio_to_bound'), 6, 2)} "
                     f"{_fmt(v.get('ratio_to_torch_muon_median'), 7, 3)} "
                     f"{_fmt(v.get('ratio_to_own_replay_median'), 6, 3)} {_fmt(peer, 6, 3)} "
                     f"{v['state_bytes'] / 2**20:9.2f} {_fmt(None if peak is None else peak / 2**20, 8, 2)}  "
                     f"{_quality_cell(q.get(r), gq.get(r))}")
    for r, v in result["rows"].items():  # every peer of the rows that have several
        peers = v.get("ratio_to_peers", {})
        if len(peers) > 1:
            lines.append(f"{r}: " + ", ".join(f"/{p} {ratio['median']:.3f}" for p, ratio in peers.items()))
    lines.append("1st step: the first step alone, s (state allocation; 'c': compiled there). bound: the row's "
                 "Newton-Schulz GEMM FLOPs at the matmul rate measured above in its dtype; /bound: median/bound. "
                 "/peer: to the first "
                 "of the row's peers, for the elementwise rows the torch optimizer with the same rule. "
                 "Ratios are medians of paired per-round ratios. Quality: ratios to torch.optim.Muon's quintic "
                 "if it is a row; 'same dtype': to the quintic in the row's dtype; "
                 "'leak': RMS off-diagonal of Uᵀ·O·V on the gradient's leading singular pairs (0 for msign).")
    return "\n".join(lines)


def _fmt(x: float | None, width: int, digits: int) -> str:
    return f"{'-':>{width}s}" if x is None else f"{x:{width}.{digits}f}"


def _quality_cell(per_kind: dict[str, Any] | None, gauss: dict[str, Any] | None) -> str:
    if not per_kind:
        return ""
    same = "ratio_to_quintic_same_dtype"
    key = "ratio_to_torch" if "ratio_to_torch" in next(iter(per_kind.values())) else same
    cell = " ".join(f"{k}:{d[key]:.2f}[{d['min']:.2f},{d['max']:.2f}]" for k, d in per_kind.items())
    if any(d[key] != d[same] for d in per_kind.values()):  # an fp32 row against torch's bf16
        cell += " | same dtype " + " ".join(f"{k}:{d[same]:.2f}" for k, d in per_kind.items())
    leak = max(d["leak"] for d in per_kind.values())
    if leak > 1e-3:  # the update left the gradient's singular basis (e.g. an AOL preconditioner)
        cell += f" | leak {leak:.3f}"
    if gauss:
        cell += " | gauss " + " ".join(f"{d['rms']:.3f}[{d['min']:.2f},{d['max']:.2f}]" for d in gauss.values())
    return cell
