"""``muon-fn bench``: paired timing and orthogonality quality of Muon optimizer steps.

Every round times every row back to back on the same parameters and gradients, so machine load
(shared CPUs swing 2x) cancels in the per-round ratios to ``torch.optim.Muon`` and to the GEMM
replay (exactly the matmuls of a schedule, nothing else: the empirical limit). Gradients are real:
one forward/backward of a byte-level transformer built from the parameter set.

    muon-fn bench --quick                         # tiny set, < 60 s
    muon-fn bench --model-size gpt2-small --json bench.json
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import statistics
import sys
import time
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from . import _newton_schulz as _ortho

MODEL_SIZES = {"tiny": (4, 256), "gpt2-small": (12, 768)}  # (layers, width); MLP is 4x width
MATRIX_NAMES = ("q", "k", "v", "o", "fc", "proj")
ROWS = ("muon_fn", "muon_fn[like_torch]", "torch.optim.Muon", "torch.optim.AdamW[fused]",
        "replay[aol9]", "replay[polar_express5]", "replay[torch_quintic5]")
# Opt-in rows (inductor cold compile takes minutes on a loaded 2-core CPU).
OPTIONAL_ROWS = ("muon_fn[compiled]", "muon_fn[aol4]", "muon_fn[aol4,compiled]", "muon_fn[aol4,nonfinite=None]",
                 "muon_fn[polar_express5]", "lean[aol9]", "lean[polar_express5]", "lean[aol4]", "replay[aol4]")
_REFERENCE, _REPLAY = "torch.optim.Muon", "replay[polar_express5]"
_SEQ, _BATCH, _VOCAB = 64, 2, 256


# ----------------------------------------------------------------------------- parameters and grads
def matrix_shapes(model_size: str) -> list[tuple[str, tuple[int, int]]]:
    """``(name, (out, in))`` of every hidden matrix of the set: per layer q, k, v, o, fc, proj."""
    if model_size not in MODEL_SIZES:
        raise ValueError(f"Invalid model_size: {model_size!r} (expected one of {sorted(MODEL_SIZES)})")
    layers, d = MODEL_SIZES[model_size]
    shapes = {"q": (d, d), "k": (d, d), "v": (d, d), "o": (d, d), "fc": (4 * d, d), "proj": (d, 4 * d)}
    return [(f"h{i}.{n}", shapes[n]) for i in range(layers) for n in MATRIX_NAMES]


def _corpus() -> torch.Tensor:
    here = os.path.dirname(os.path.abspath(__file__))
    files = sorted(glob.glob(os.path.join(here, "*.py")))
    files += sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))[:40]
    text = b"".join(open(f, "rb").read() for f in files)
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def real_gradients(model_size: str, *, seed: int = 0, device: torch.device | str | None = None,
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[str]]:
    """Hidden matrices of a byte-level pre-LN transformer of ``model_size`` and their gradients.

    One forward/backward on a batch of Python source bytes (low stable rank, like real training
    gradients; Gaussian noise would flatter 4-step schedules). Returns ``(params, grads, names)``,
    computed on the CPU (the same values for every device) and moved to ``device`` if given.
    """
    shapes = matrix_shapes(model_size)
    layers, d = MODEL_SIZES[model_size]
    g = torch.Generator().manual_seed(seed)
    params = [(torch.randn(s, generator=g) / math.sqrt(s[1])).requires_grad_() for _, s in shapes]
    emb = torch.randn(_VOCAB, d, generator=g) * 0.02
    data = _corpus()
    ix = torch.randint(0, len(data) - _SEQ - 1, (_BATCH,), generator=g)
    x = torch.stack([data[i:i + _SEQ] for i in ix])
    y = torch.stack([data[i + 1:i + _SEQ + 1] for i in ix])
    h = emb[x]
    heads = d // 64
    for layer in range(layers):
        wq, wk, wv, wo, wfc, wproj = params[6 * layer:6 * layer + 6]
        a = F.layer_norm(h, (d,))
        q, k, v = (t.view(_BATCH, _SEQ, heads, 64).transpose(1, 2) for t in (a @ wq.T, a @ wk.T, a @ wv.T))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(_BATCH, _SEQ, d)
        h = h + att @ wo.T
        h = h + F.gelu(F.layer_norm(h, (d,)) @ wfc.T) @ wproj.T
    loss = F.cross_entropy((F.layer_norm(h, (d,)) @ emb.T).view(-1, _VOCAB), y.view(-1))
    loss.backward()
    grads = [p.grad.detach().to(device, copy=True) for p in params]
    return [p.detach().to(device).requires_grad_() for p in params], grads, [n for n, _ in shapes]


def paired_ratio(times: Sequence[float], reference: Sequence[float]) -> dict[str, Any]:
    """Per-round ratios ``times[k] / reference[k]`` of two rows timed in the same rounds, with
    their median, min and max (the paired figure the benchmarks report; robust to machine load)."""
    if len(times) != len(reference) or not times:
        raise ValueError(f"Invalid rounds: {len(times)} and {len(reference)} (expected the same number, at least 1)")
    rs = [a / b for a, b in zip(times, reference)]
    return {"median": statistics.median(rs), "min": min(rs), "max": max(rs), "per_round": rs}


# ----------------------------------------------------------------------------- rows
def _replay_fn(params: Sequence[torch.Tensor], method: str, steps: int, batched: bool,
              dtype: torch.dtype | None = None) -> Callable[[], None]:
    """Exactly the GEMMs of ``method``'s schedule on wide-oriented inputs in ``dtype`` (default:
    the device's compute dtype, as the optimizer picks it), nothing else.

    The inputs are prepared once, outside the timed function, as the real path prepares them
    (Frobenius-normalized, then AOL-rescaled for an AOL schedule), so the GEMMs run on the values
    they would see: unnormalized weights make every schedule diverge to inf/NaN within a few steps
    (the timing was the same, measured 0.73 vs 0.74 s, but a limit should be measured on real data).
    """
    schedule = _ortho.coefficient_schedule(method, steps)
    aol = getattr(schedule, "precondition", "frobenius") == "aol"
    scale, eps = _ortho.norm_scale(method), 1e-7
    dtype = dtype or _ortho.default_compute_dtype(params[0].device)

    def prepared(p: torch.Tensor) -> torch.Tensor:
        w = (p.detach().mT if p.size(0) > p.size(1) else p.detach()).float()
        x = (w * _ortho._inverse_norm(w, scale, eps)).to(dtype)
        return _ortho._aol_scale(x, _ortho.gram_matrix(x), eps)[0] if aol else x

    wides = [prepared(p) for p in params]
    if batched:
        # As the eager step: equal shapes batched below LOOP_MIN_DIM, one matrix at a time above.
        groups: dict[tuple[int, int], list[torch.Tensor]] = {}
        for w in wides:
            groups.setdefault(tuple(w.shape), []).append(w)
        inputs = [x for (m, _), ws in groups.items()
                  for x in ([torch.stack(ws)] if m < _ortho.LOOP_MIN_DIM else ws)]
    else:
        inputs = wides
    buffers: dict = {}  # products into reused scratch, as the eager step (no allocation per product)

    def run() -> None:
        for x in inputs:
            _ortho.iterate(x, schedule, _ortho.gram_matrix(x, buffers) if aol else None, buffers)
    return run


def _lean_fn(params: Sequence[torch.Tensor], lr: float, method: str, steps: int,
             momentum: float = 0.95) -> Callable[[], None]:
    """What an eager adapter can reach: torch.optim.Muon's in-place momentum, the method's
    orthogonalization via :func:`muon_fn._orthogonalize.orthogonalize_many` (normalize+cast into
    batch slots, no fp32 stack), and ``p.add_(o, alpha=-lr*scale)`` (no cast-back pass), in the
    device's compute dtype."""
    schedule = _ortho.coefficient_schedule(method, steps)
    scale = _ortho.norm_scale(method)
    bufs = [torch.zeros_like(p) for p in params]
    alphas = [-lr * max(1.0, p.size(0) / p.size(1)) ** 0.5 for p in params]
    dtype = _ortho.default_compute_dtype(params[0].device)

    @torch.no_grad()
    def run() -> None:
        ups = []
        for p, b in zip(params, bufs):
            b.lerp_(p.grad, 1 - momentum)
            ups.append(p.grad.lerp(b, momentum))
        for p, u, a in zip(params, ups, alphas):
            o = _ortho.orthogonalize_batch([u], schedule, dtype=dtype, eps=1e-7, norm_scale=scale)[0]
            p.add_(o.mT if p.size(0) > p.size(1) else o, alpha=a)
    return run


def _make_row(name: str, params: list[torch.Tensor], lr: float) -> tuple[Any, Callable[[], None]]:
    from .optim import MuonOptimizer  # lazy: the bench module imports nothing heavy at load

    if name == "muon_fn":
        opt = MuonOptimizer(params, lr=lr)
    elif name == "muon_fn[aol4]":
        opt = MuonOptimizer(params, lr=lr, method="aol", ns_steps=4)
    elif name == "muon_fn[polar_express5]":  # the default before "aol9"
        opt = MuonOptimizer(params, lr=lr, method="polar_express", ns_steps=5)
    elif name == "muon_fn[compiled]":
        opt = MuonOptimizer(params, lr=lr, compile=True)
    elif name == "muon_fn[aol4,compiled]":
        opt = MuonOptimizer(params, lr=lr, method="aol", ns_steps=4, compile=True)
    elif name == "muon_fn[aol4,nonfinite=None]":
        opt = MuonOptimizer(params, lr=lr, method="aol", ns_steps=4, nonfinite=None)
    elif name == "muon_fn[like_torch]":
        opt = MuonOptimizer(params, lr=lr, method="quintic", ns_steps=5, momentum_kind="ema",
                            adjust_lr_fn="original", ns_dtype=torch.bfloat16)
    elif name == "torch.optim.Muon":
        opt = torch.optim.Muon(params, lr=lr, weight_decay=0.0, adjust_lr_fn="original")
    elif name == "torch.optim.AdamW[fused]":
        opt = torch.optim.AdamW(params, lr=lr * 0.05, weight_decay=0.0, fused=True)
    elif name == "lean[polar_express5]":
        return None, _lean_fn(params, lr, "polar_express", 5)
    elif name == "lean[aol4]":
        return None, _lean_fn(params, lr, "aol", 4)
    elif name == "lean[aol9]":
        return None, _lean_fn(params, lr, "aol9", 4)
    elif name == "replay[polar_express5]":
        return None, _replay_fn(params, "polar_express", 5, batched=True)
    elif name == "replay[aol4]":
        return None, _replay_fn(params, "aol", 4, batched=True)
    elif name == "replay[aol9]":
        return None, _replay_fn(params, "aol9", 4, batched=True)
    elif name == "replay[torch_quintic5]":
        return None, _replay_fn(params, "quintic", 5, batched=False, dtype=torch.bfloat16)
    else:
        raise ValueError(f"Invalid row: {name!r} (expected one of {list(ROWS + OPTIONAL_ROWS)})")
    return opt, opt.step


_ROW_ORTHO: dict[str, tuple[str, int]] = {
    "muon_fn": ("default", None), "muon_fn[aol4]": ("aol", 4), "muon_fn[like_torch]": ("quintic", 5),
    "muon_fn[compiled]": ("default", None), "muon_fn[polar_express5]": ("polar_express", 5), "muon_fn[aol4,compiled]": ("aol", 4),
    "muon_fn[aol4,nonfinite=None]": ("aol", 4),
    "torch.optim.Muon": ("torch", 5), "replay[polar_express5]": ("polar_express", 5),
    "replay[aol4]": ("aol", 4), "replay[torch_quintic5]": ("torch", 5),
    "lean[polar_express5]": ("polar_express", 5), "lean[aol4]": ("aol", 4),
    "replay[aol9]": ("aol9", 4), "lean[aol9]": ("aol9", 4),
}


# The replay row with the same schedule as each row (for "ratio to its own replay").
_OWN_REPLAY = {
    "muon_fn": "replay[aol9]", "muon_fn[compiled]": "replay[aol9]",  # the default method, "aol9"
    "muon_fn[polar_express5]": "replay[polar_express5]",
    "lean[polar_express5]": "replay[polar_express5]", "muon_fn[aol4]": "replay[aol4]",
    "muon_fn[aol4,compiled]": "replay[aol4]", "muon_fn[aol4,nonfinite=None]": "replay[aol4]",
    "lean[aol4]": "replay[aol4]", "muon_fn[like_torch]": "replay[torch_quintic5]",
    "torch.optim.Muon": "replay[torch_quintic5]",
    "lean[aol9]": "replay[aol9]",
}


def _orthogonalizer(row: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
    if row not in _ROW_ORTHO:
        return None
    method, steps = _ROW_ORTHO[row]
    if method == "torch":
        from torch.optim._muon import _zeropower_via_newtonschulz
        return lambda g: _zeropower_via_newtonschulz(g, (3.4445, -4.7750, 2.0315), steps, 1e-7)
    if method == "default":
        from ._alias import DEFAULT_METHOD
        method = DEFAULT_METHOD
    return lambda g: _ortho.newton_schulz(g, method, steps, dtype=_row_dtype(row, g.device))


# ----------------------------------------------------------------------------- quality
def orthogonality(g: torch.Tensor, out: torch.Tensor, svd: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, float]:
    """Singular values of ``out`` (an approximation of msign(g)): RMS deviation from 1, min, max.

    ``signed_rms`` is the RMS of ``u_iᵀ out v_i − 1`` over g's singular pairs (``svd = (U, Vᴴ)`` of
    ``g`` if already computed), which also catches a flipped direction that singular values hide.
    Computed in fp32 on the CPU (σ to ~1e-6, far below the differences measured).
    """
    o = out.float().cpu()
    sv = torch.linalg.svdvals(o)
    if svd is None:
        u, _, vh = torch.linalg.svd(g.float().cpu(), full_matrices=False)
    else:
        u, vh = svd
    signed = ((u.mT @ o) * vh).sum(-1)
    return {"rms": float(((sv - 1) ** 2).mean().sqrt()), "min": float(sv.min()), "max": float(sv.max()),
            "signed_rms": float(((signed - 1) ** 2).mean().sqrt())}


_BF16_ROWS = ("torch.optim.Muon", "muon_fn[like_torch]", "replay[torch_quintic5]")  # torch's dtype


def _row_dtype(row: str, device: torch.device) -> torch.dtype:
    """The compute dtype of ``row``'s orthogonalization: torch's bf16, else the device default."""
    return torch.bfloat16 if row in _BF16_ROWS else _ortho.default_compute_dtype(device)


def _quality(rows: Sequence[str], inputs: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Per row, per matrix kind: worst RMS ratio to torch's quintic on the same input, and σ range.

    ``ratio_to_quintic_same_dtype`` compares with the same quintic run in the row's compute dtype
    instead: on rank-deficient inputs bf16 rounding noise lifts exact-zero singular values, which
    lowers the RMS of every bf16 row (torch's quintic: 4-7 % lower in bf16 than in fp32 on tiny's
    gradients), so an fp32 row is judged against fp32 there.
    """
    torch_ortho = _orthogonalizer("torch.optim.Muon")
    svds = {}
    for n, g in inputs.items():
        u, _, vh = torch.linalg.svd(g.float().cpu(), full_matrices=False)
        svds[n] = (u, vh)
    ref = {n: orthogonality(g, torch_ortho(g), svds[n]) for n, g in inputs.items()}
    refs = {torch.bfloat16: ref}

    def same_dtype_ref(dtype: torch.dtype) -> dict[str, dict[str, float]]:
        if dtype not in refs:
            refs[dtype] = {n: orthogonality(g, _ortho.newton_schulz(g, "quintic", 5, dtype=dtype), svds[n])
                           for n, g in inputs.items()}
        return refs[dtype]

    out: dict[str, Any] = {}
    done: dict[tuple[str, int], dict[str, dict[str, float]]] = {}
    for row in rows:
        fn = _orthogonalizer(row)
        if fn is None:
            continue
        if _ROW_ORTHO[row] in done:  # same orthogonalization as an earlier row
            out[row] = done[_ROW_ORTHO[row]]
            continue
        per_kind: dict[str, dict[str, float]] = {}
        for n, g in inputs.items():
            q = ref[n] if _ROW_ORTHO[row][0] == "torch" else orthogonality(g, fn(g), svds[n])
            same = same_dtype_ref(_row_dtype(row, g.device))[n]
            k = per_kind.setdefault(n.split(".")[-1], {"rms": 0.0, "ratio_to_torch": 0.0, "min": 9.0, "max": 0.0,
                                                       "signed_ratio_to_torch": 0.0,
                                                       "ratio_to_quintic_same_dtype": 0.0})
            k["rms"] = max(k["rms"], q["rms"])
            k["ratio_to_torch"] = max(k["ratio_to_torch"], q["rms"] / ref[n]["rms"])
            k["signed_ratio_to_torch"] = max(k["signed_ratio_to_torch"], q["signed_rms"] / ref[n]["signed_rms"])
            k["ratio_to_quintic_same_dtype"] = max(k["ratio_to_quintic_same_dtype"], q["rms"] / same["rms"])
            k["min"], k["max"] = min(k["min"], q["min"]), max(k["max"], q["max"])
        out[row] = done[_ROW_ORTHO[row]] = per_kind
    return out


def gaussian_quality(rows: Sequence[str], *, seed: int = 0, size: tuple[int, int] = (768, 3072),
                     device: torch.device | str | None = None) -> dict[str, Any]:
    """σ range and RMS per row on rectangular Gaussian inputs of ``size`` and its transpose
    (drawn on the CPU, orthogonalized on ``device``)."""
    g = torch.Generator().manual_seed(seed)
    m, n = size
    inputs = {f"gauss.{m}x{n}": torch.randn(m, n, generator=g).to(device),
              f"gauss.{n}x{m}": torch.randn(n, m, generator=g).to(device)}
    return _quality(rows, inputs)


# ----------------------------------------------------------------------------- timing
def check_device(device: torch.device | str | None) -> torch.device:
    """``device`` as a ``torch.device`` (default CPU), or ``ValueError`` if torch cannot use it here."""
    try:
        dev = torch.device("cpu" if device is None else device)
        torch.empty(1, device=dev).add_(1)  # CUDA without a GPU or a build without the backend fail here
    except (RuntimeError, AssertionError) as e:
        reason = str(e).splitlines()[0].split(". ")[0]  # torch's first sentence
        raise ValueError(f"Invalid device: {device!r} ({reason})") from None
    if dev.type == "meta":
        raise ValueError(f"Invalid device: {device!r} (meta tensors hold no data to time)")
    return dev


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a no-op on the CPU), so a clock read covers it."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def state_bytes(opt: Any, key: str | None = None) -> int:
    """Bytes of the tensors in ``opt.state`` (persistent optimizer state); only ``key`` if given."""
    if opt is None:
        return 0
    return sum(v.numel() * v.element_size() for s in opt.state.values() for k, v in s.items()
               if isinstance(v, torch.Tensor) and (key is None or k == key))


def _nesterov_inputs(opt: torch.optim.Optimizer, params, names, momentum=0.95) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in zip(names, params):
        buf = opt.state[p]["momentum_buffer"]
        out[n] = p.grad.lerp(buf, momentum)
    return out


def benchmark_muon_optimizers(
    model_size: str = "tiny",
    num_steps: int = 1,
    lr: float = 0.02,
    *,
    rows: Sequence[str] | None = None,
    rounds: int = 10,
    quality: bool = True,
    quality_layers: int | None = 2,
    gaussian: bool | tuple[int, int] = True,
    threads: int = 1,
    seed: int = 0,
    device: torch.device | str | None = None,
) -> dict[str, Any]:
    """Time every row for ``rounds`` paired rounds of ``num_steps`` steps on ``model_size``.

    Args:
      model_size: ``"tiny"`` (4 layers, d=256) or ``"gpt2-small"`` (12 layers, d=768).
      num_steps: optimizer steps per row per round (seconds per step = round time / num_steps).
      lr: Muon learning rate (AdamW uses ``lr/20``).
      rows: subset of :data:`ROWS` (default all); the reference and replay rows are always added.
      rounds: paired rounds; each times every row back to back, in a rotated order.
      quality: measure orthogonality of each row's orthogonalization on the actual inputs.
      quality_layers: 1 (first layer), 2 (first and last) or ``None`` (all) layers measured.
      gaussian: also measure quality on rectangular Gaussian 768×3072 and 3072×768 inputs
        (or on the ``(m, n)`` given).
      threads: ``torch.set_num_threads`` for the run.
      seed: parameters and the data batch.
      device: where the parameters live and every row runs (default CPU). On an accelerator each
        timed row ends with :func:`synchronize`; the quality SVDs run on the CPU.

    Returns:
      A JSON-serializable dict: ``config``, ``rows`` (per row: seconds per step per round,
      min/median/max, per-round ratios to torch.optim.Muon and to the replay, state bytes),
      ``quality`` and ``gaussian_quality`` (per row and matrix kind).
    """
    if model_size not in MODEL_SIZES:
        raise ValueError(f"Invalid model_size: {model_size!r} (expected one of {sorted(MODEL_SIZES)})")
    for arg, v in (("num_steps", num_steps), ("rounds", rounds), ("threads", threads)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"Invalid {arg}: {v!r} (expected an integer >= 1)")
    if not (isinstance(lr, (int, float)) and lr > 0 and math.isfinite(lr)):
        raise ValueError(f"Invalid lr: {lr!r} (expected a positive finite float)")
    device = check_device(device)
    rows = list(ROWS if rows is None else rows)
    for r in rows:
        if r not in ROWS + OPTIONAL_ROWS:
            raise ValueError(f"Invalid row: {r!r} (expected one of {list(ROWS + OPTIONAL_ROWS)})")
    for must in (_REFERENCE, _REPLAY):
        if must not in rows:
            rows.append(must)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        params, grads, names = real_gradients(model_size, seed=seed, device=device)
        for p, g in zip(params, grads):
            p.grad = g
        built = {r: _make_row(r, params, lr) for r in rows}
        saved = [p.detach().clone() for p in params]
        for r in rows:  # warm-up step: allocates state, builds caches
            built[r][1]()
        times: dict[str, list[float]] = {r: [] for r in rows}
        for k in range(rounds):
            order = rows[k % len(rows):] + rows[:k % len(rows)]
            for r in order:
                step = built[r][1]
                synchronize(device)
                t0 = time.perf_counter()
                for _ in range(num_steps):
                    step()
                synchronize(device)
                times[r].append((time.perf_counter() - t0) / num_steps)
            with torch.no_grad():  # keep the parameters near their start (lr does not matter here)
                for p, s in zip(params, saved):
                    p.copy_(s)
        ref_opt = built[_REFERENCE][0]
        result_rows = {}
        for r in rows:
            t = times[r]
            result_rows[r] = {
                "seconds_per_step": t, "min": min(t), "median": statistics.median(t), "max": max(t),
                "state_bytes": state_bytes(built[r][0]),
                "momentum_bytes": state_bytes(built[r][0], "momentum_buffer"),
            }
            own = _OWN_REPLAY.get(r)
            if own in times:
                result_rows[r]["own_replay"] = own
            for key, ref in (("ratio_to_torch_muon", _REFERENCE), ("ratio_to_replay", _REPLAY),
                             ("ratio_to_own_replay", own)):
                if ref in times:
                    q = paired_ratio(t, times[ref])
                    result_rows[r][key], result_rows[r][key + "_median"] = q["per_round"], q["median"]
        out: dict[str, Any] = {
            "config": {"model_size": model_size, "num_steps": num_steps, "lr": lr, "rounds": rounds,
                       "threads": threads, "device": str(device), "torch": torch.__version__, "matrices": len(params),
                       "params": sum(p.numel() for p in params),
                       "compute_dtype": str(_ortho.default_compute_dtype(params[0].device)).removeprefix("torch."),
                       "cpu_bf16_gemm": _ortho.cpu_has_bf16_gemm()},
            "rows": result_rows,
        }
        if quality:
            layers = MODEL_SIZES[model_size][0]
            keep = set(range(layers)) if quality_layers is None else {0, layers - 1} if quality_layers >= 2 else {0}
            inputs = {n: g for n, g in _nesterov_inputs(ref_opt, params, names).items()
                      if int(n.split(".")[0][1:]) in keep}
            out["quality"] = _quality(rows, inputs)
            if gaussian:
                size = (768, 3072) if gaussian is True else tuple(gaussian)
                out["gaussian_quality"] = gaussian_quality(rows, seed=seed, size=size, device=device)
        return out
    finally:
        torch.set_num_threads(old_threads)


# ----------------------------------------------------------------------------- compile checks
def compile_check(model_size: str = "tiny", *, steps: int = 100, lr: float = 0.02,
                  device: torch.device | str | None = None, **kwargs: Any) -> dict[str, Any]:
    """Cold first step of ``MuonOptimizer(compile=True)`` and recompiles over ``steps`` LR-scheduled
    steps, on ``device`` (default CPU)."""
    from torch._dynamo.utils import counters

    from .optim import MuonOptimizer

    device = check_device(device)
    torch._dynamo.reset()
    params, grads, _ = real_gradients(model_size, device=device)
    for p, g in zip(params, grads):
        p.grad = g
    opt = MuonOptimizer(params, lr=lr, compile=True, **kwargs)
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


# ----------------------------------------------------------------------------- CLI
def format_table(result: dict[str, Any]) -> str:
    """The timing/quality table printed by :func:`main`."""
    cfg = result["config"]
    lines = [f"{cfg['model_size']}: {cfg['matrices']} matrices, {cfg['params'] / 1e6:.1f} M params, "
             f"{cfg['rounds']} paired rounds x {cfg['num_steps']} steps, {cfg.get('device', 'cpu')}, {cfg['threads']} thread(s), torch {cfg['torch']}, "
             f"default compute dtype {cfg.get('compute_dtype', '?')} (CPU bf16 GEMMs: {cfg.get('cpu_bf16_gemm', '?')})",
             f"{'row':28s} {'s/step min':>10s} {'median':>8s} {'max':>8s} {'/torch':>7s} {'/replay':>8s} {'/own':>6s} {'state MB':>9s}"
             "  worst RMS ratio to torch per matrix (σ range)"]
    q = result.get("quality", {})
    gq = result.get("gaussian_quality", {})
    for r, v in result["rows"].items():
        qual = " ".join(f"{k}:{d['ratio_to_torch']:.2f}[{d['min']:.2f},{d['max']:.2f}]" for k, d in q.get(r, {}).items())
        if q.get(r) and r not in _BF16_ROWS and cfg.get("compute_dtype", "bfloat16") != "bfloat16":
            qual += f" | vs quintic in {cfg['compute_dtype']} " + " ".join(
                f"{k}:{d['ratio_to_quintic_same_dtype']:.2f}" for k, d in q[r].items())
        if r in gq:
            qual += " | gauss " + " ".join(f"{d['rms']:.3f}[{d['min']:.2f},{d['max']:.2f}]" for d in gq[r].values())
        own = f"{v['ratio_to_own_replay_median']:6.3f}" if "ratio_to_own_replay_median" in v else f"{'':6s}"
        lines.append(f"{r:28s} {v['min']:10.4f} {v['median']:8.4f} {v['max']:8.4f} "
                     f"{v['ratio_to_torch_muon_median']:7.3f} {v['ratio_to_replay_median']:8.3f} {own} "
                     f"{v['state_bytes'] / 2**20:9.2f}  {qual}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``muon-fn bench``."""
    ap = argparse.ArgumentParser(prog="muon-fn bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-size", choices=[*MODEL_SIZES, "all"], default="all",
                    help="parameter set: tiny (4 layers, d = 256), gpt2-small (12 layers, d = 768) or both")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per row per round")
    ap.add_argument("--rounds", type=int, default=None, help="paired rounds")
    ap.add_argument("--lr", type=float, default=0.02, help="learning rate of every optimizer row")
    ap.add_argument("--rows", nargs="+", choices=ROWS + OPTIONAL_ROWS, default=None, metavar="ROW",
                    help="rows to time (default: " + ", ".join(ROWS) + "; also: " + ", ".join(OPTIONAL_ROWS) + ")")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: see docs/performance.md)")
    ap.add_argument("--device", default="cpu",
                    help="where every row runs: cpu (default), cuda, cuda:1, ... (timed with a synchronize per row)")
    ap.add_argument("--json", default="muon_fn_bench.json", help="write the results here ('' to skip)")
    ap.add_argument("--quick", action="store_true",
                    help="tiny set, 12 rounds (2 and no bf16 rows but torch's on CPUs without bf16 "
                         "instructions), quality on layer 0 and 256x1024 Gaussians (< 60 s)")
    ap.add_argument("--compile", action="store_true", help="also measure cold compile and recompiles")
    ap.add_argument("--no-quality", action="store_true", help="skip the orthogonality quality measurements")
    args = ap.parse_args(argv)
    try:
        device = check_device(args.device)
    except ValueError as e:
        ap.error(str(e))
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    sizes = ["tiny"] if args.quick else (list(MODEL_SIZES) if args.model_size == "all" else [args.model_size])
    rows, quick_rounds = args.rows, 12
    if device.type == "cpu" and not _ortho.CPU_HAS_BF16_GEMM:
        print("note: this CPU has no bf16 instructions, so torch emulates the bf16 GEMMs of torch.optim.Muon "
              "and the other bf16 rows (tens of times slower than fp32; about 10 s per tiny step, over "
              "15 min per gpt2-small step); muon_fn's default runs in fp32 here", file=sys.stderr, flush=True)
        if args.quick and rows is None:  # keep --quick under a minute: torch.optim.Muon as the only bf16 row
            rows, quick_rounds = [r for r in ROWS if r not in _BF16_ROWS or r == _REFERENCE], 2
    results: dict[str, Any] = {}
    for size in sizes:
        # One step per round and many rounds: adjacent single steps share the machine's load best.
        steps = args.steps or 1
        rounds = args.rounds or (quick_rounds if args.quick else 25 if size == "tiny" else 5)
        res = benchmark_muon_optimizers(size, steps, args.lr, rows=rows, rounds=rounds,
                                        quality=not args.no_quality, threads=args.threads, device=device,
                                        quality_layers=1 if args.quick else 2,
                                        gaussian=(256, 1024) if args.quick else True)
        print(format_table(res), flush=True)
        if args.compile:
            res["compile"] = [compile_check("tiny", steps=100, device=device), compile_check(size, steps=3, device=device)]
            for c in res["compile"]:
                print(f"compile ({c['model_size']}): cold first step {c['cold_first_step_seconds']:.1f} s, "
                      f"{c['recompiles']} recompiles over {c['steps']} LR-scheduled steps", flush=True)
        results[size] = res
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
