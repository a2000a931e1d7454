"""Orthogonalization math: odd polynomial (Newton–Schulz-type) iterations approximating msign.

``msign(X) = U Vᵀ`` for ``X = U Σ Vᵀ``. Every method here normalizes ``X`` by its Frobenius norm
(so σ_max ≤ 1), works on the wide orientation (``m ≤ n``, tall inputs are transposed), and applies
one odd quintic per iteration: ``X ← aX + (bA + cA²)X`` with ``A = XXᵀ``. Methods differ in their
per-iteration coefficient schedule and in two options a schedule carries (:class:`Schedule`).
A schedule row ``(c₀, c₁, …, c_d)`` is the odd polynomial ``p(σ) = σ·Σᵢ cᵢσ²ⁱ``, applied as
``X ← c₀X + (Σ_{i≥1} cᵢAⁱ)X``: ``(a, b, c)`` is a quintic, 5 numbers a degree-9 step (two m×m
products, like cubic-then-quintic but one n-sized product fewer). Options:
``precondition="aol"`` rescales the rows after the Frobenius normalization (Turbo-Muon, the first
Gram matrix is reused, so it costs no GEMM) and ``form="gram"`` runs the same polynomials as Gram
Newton–Schulz (m×m products only, one restart). Pure tensor functions; no state, no transforms.
"""

from __future__ import annotations

import functools
import itertools
import numbers
import platform
import threading
from typing import Callable, Sequence, Union

import torch

from . import _checks, _execution

Coefficients = tuple[float, ...]  # (c0, c1, ..., cd): p(σ) = σ·Σ cᵢ σ^{2i}; (a, b, c) for quintics
Method = Union[str, Callable[[torch.Tensor], torch.Tensor]]

# Keller Jordan's quintic: steep at 0, lands σ in about [0.68, 1.13] after 5 steps.
KELLER_COEFFICIENTS: tuple[Coefficients, ...] = ((3.4445, -4.7750, 2.0315),)

# Jiacheng You's five triples, cycled: σ within about ±3 % after 5 steps.
YOU_COEFFICIENTS: tuple[Coefficients, ...] = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)

# Polar Express (Amsel et al., arXiv:2505.16932), minimax quintics for l = 1e-3, before the safety
# factor. Row 8 (1.875, -1.25, 0.375) is the Padé/Newton–Schulz-5 quintic and repeats afterwards.
_POLAR_EXPRESS_RAW: tuple[Coefficients, ...] = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
POLAR_EXPRESS_SAFETY = 1.01
POLAR_EXPRESS_COEFFICIENTS: tuple[Coefficients, ...] = tuple(
    (a / POLAR_EXPRESS_SAFETY, b / POLAR_EXPRESS_SAFETY**3, c / POLAR_EXPRESS_SAFETY**5)
    for a, b, c in _POLAR_EXPRESS_RAW[:-1]
) + (_POLAR_EXPRESS_RAW[-1],)

# AOL-preconditioned schedule ("aol"), designed for this library: greedy minimax odd quintics
# (the Polar Express construction, one linear program per step) for σ ∈ [3e-3, 1.02] after AOL
# row scaling (1.02 covers bf16 rounding of the AOL bound σ_max ≤ 1). Each interval's top is
# widened by 2 % before the next step is solved (0.5 % before the last) so bf16 rounding cannot push
# σ past a steep edge, and the last row is scaled so the band tops out at 1.19. 4 steps: σ ≥ 3e-3
# lands in [0.76, 1.19], slope 279 at 0; a 5th step (the Newton–Schulz-5 quintic, repeated after)
# tightens that to [0.97, 1.02]. (The published 4-step AOL triples map σ = 1 to -0.99, and AOL scales
# a rank-1-dominated gradient to σ_max = 1 exactly: its top direction would be flipped.)
AOL_COEFFICIENTS: tuple[Coefficients, ...] = (
    (8.221799771637821, -23.347069036911204, 16.63392375746348),
    (3.9729122011800078, -2.8450772568990312, 0.5170406107124979),
    (3.4738159808886855, -2.5059705583992504, 0.4810374290212562),
    (2.4570313968385302, -1.7997161827028878, 0.4203963693941537),
    (1.875, -1.25, 0.375),
)

# "aol9", designed for this library as a fast schedule: AOL row scaling, three greedy minimax
# quintics (Polar Express construction on [2.5e-3, 1.02], each interval top widened by 3 %), then
# one minimax odd degree-9 step on the last interval (top widened by 0.5 %), constrained to stay in
# [0.6, 1.15] for 7 % past that top and to coefficients of magnitude ≤ 20, so bf16 rounding cannot
# throw a singular value onto a steep edge. A quintic costs 4m²n + 2m³ FLOPs per iteration, the
# degree-9 step 4m²n + 4m³: 4 steps cost 0.84x a 5-step quintic on GPT-2 shapes (0.87x square,
# 0.82x at n = 4m). Exact map: σ ∈ [2.5e-3, 1.02] → [0.86, 1.14]; slope at 0: 395 x the AOL lift.
# Measured in bf16 (docs/performance.md): RMS deviation of σ from 1 below torch's 5-step quintic on
# every real Nesterov momentum tried (312 from training runs, the bench's gpt2-small set);
# Gaussian 768×3072 σ ∈ [0.80, 1.17], RMS 0.107 (torch: [0.68, 1.14], 0.163). On tiny matrices
# (≤ 24 wide) bf16 rounding does not average out: largest σ 1.27 there (torch's quintic 1.20).
# Steps after the 4th: the NS-5 quintic.
AOL9_COEFFICIENTS: tuple[Coefficients, ...] = (
    (7.995806976539102, -21.429435938585584, 14.7098969157479),
    (3.935413914601173, -2.713529165929322, 0.47938249896797397),
    (3.563461028104475, -2.5191392750077104, 0.4675967183983483),
    (3.5265508922905515, -6.161220213822824, 4.998960885558363, -1.7109004864490664, 0.20562587308897573),
    (1.875, -1.25, 0.375),
)

# Iteration dtypes ``orthogonalize(dtype=...)`` accepts.
COMPUTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)

# Classical cubic Newton–Schulz: converges to the exact polar factor (slowly from small σ).
CUBIC_COEFFICIENTS: tuple[Coefficients, ...] = ((1.5, -0.5, 0.0),)

# The default orthogonalization, chosen by the validation loss it trains to (docs/algorithms.md,
# "Choosing the default"): Keller's quintic, 5 steps — torch.optim.Muon's iteration. Polar Express
# (same FLOPs) and the AOL-preconditioned "aol9" (0.84x the FLOPs) trained to a higher loss at
# their best learning rate; AOL's row scaling moves the update off the gradient's singular basis.
DEFAULT_METHOD = "quintic"
# torch.optim.Muon's iteration count for its single quintic (what ns_coefficients=(a, b, c) runs).
TORCH_NS_STEPS = 5
METHODS = ("polar_express", "quintic", "you", "cubic", "aol", "aol9", "gram")

# How a method's per-iteration schedule extends to ``steps`` iterations.
_SCHEDULES: dict[str, tuple[tuple[Coefficients, ...], str]] = {
    "polar_express": (POLAR_EXPRESS_COEFFICIENTS, "repeat_last"),
    "quintic": (KELLER_COEFFICIENTS, "repeat_last"),
    "you": (YOU_COEFFICIENTS, "cycle"),
    "cubic": (CUBIC_COEFFICIENTS, "repeat_last"),
    "aol": (AOL_COEFFICIENTS, "repeat_last"),
    "aol9": (AOL9_COEFFICIENTS, "repeat_last"),
    "gram": (POLAR_EXPRESS_COEFFICIENTS, "repeat_last"),
}
# Extra factor on the Frobenius norm before iterating (Polar Express's safety margin).
_NORM_SCALE = {"polar_express": POLAR_EXPRESS_SAFETY, "gram": POLAR_EXPRESS_SAFETY}
# Iterations a method is designed for (what ``steps=None`` means).
_DEFAULT_STEPS = {"aol": 4, "aol9": 4}
# Gram Newton–Schulz restarts (recomputes X and XXᵀ) before these 0-based iterations.
GRAM_RESTARTS = (2,)
PRECONDITIONERS = ("frobenius", "aol")
FORMS = ("standard", "gram")


class Schedule(tuple):
    """A resolved tuple of polynomial rows (``(a, b, c)`` for a quintic) plus how to run them.

    ``precondition``: ``"frobenius"`` (``X/‖X‖_F``) or ``"aol"`` (then ``X ← diag(s)X`` with
    ``s_i = (Σ_j |(XXᵀ)_ij|)^(-1/2)``, which bounds σ_max by 1 and lifts small σ). ``form``:
    ``"standard"`` or ``"gram"`` (Gram Newton–Schulz: equal polynomials, fewer FLOPs when
    n ≫ m; fp32/fp16 only, it is unstable in bf16). ``fold_from``: from this 0-based iteration on,
    ``c₀`` is added to the diagonal of the m×m polynomial, ``X ← (c₀I + P)X``, instead of entering
    the GEMM as a bias ``c₀X`` (see :func:`_step`); ``None``: never.
    """

    precondition: str = "frobenius"
    form: str = "standard"
    fold_from: int | None = None

    def __new__(cls, rows: Sequence[Coefficients], *, precondition: str = "frobenius",
                form: str = "standard", fold_from: int | None = None) -> "Schedule":
        _checks.one_of("precondition", precondition, PRECONDITIONERS)
        _checks.one_of("form", form, FORMS)
        if fold_from is not None and (isinstance(fold_from, bool) or not isinstance(fold_from, int) or fold_from < 0):
            raise ValueError(f"Invalid fold_from: {fold_from!r} (expected None or an integer >= 0)")
        obj = super().__new__(cls, tuple(tuple(r) for r in rows))
        obj.precondition, obj.form, obj.fold_from = precondition, form, fold_from
        return obj

    def __repr__(self) -> str:
        return (f"Schedule({tuple(self)!r}, precondition={self.precondition!r}, form={self.form!r}, "
                f"fold_from={self.fold_from!r})")


_METHOD_OPTIONS = {"aol": {"precondition": "aol"}, "aol9": {"precondition": "aol"}, "gram": {"form": "gram"}}
# Where a method's own schedule folds c₀ into the polynomial's diagonal (Schedule.fold_from). The
# fold saves an m×n bias pass per iteration (gpt2-small default step, paired: 4 % from the second
# iteration on, 6 % from the first) but rounds c₀ + pᵢᵢ in the compute dtype, which is coarser
# than rounding pᵢᵢ alone while many σ are still small (pᵢᵢ ≈ 0, c₀ + pᵢᵢ ≈ c₀). Measured, bf16
# against fp32, mean relative Frobenius distance on well-conditioned 256–512 matrices (no fold →
# fold from iteration 0 / 1 / 2): aol9 0.0400 → 0.047 / 0.0401 / 0.040 (700–800: 0.0365 → 0.043 /
# 0.0370); aol 0.027 → 0.11 / 0.034 / 0.029; polar_express 0.0086 → 0.016 / 0.013 / 0.012; quintic
# 0.012 → 0.027 / 0.026 / 0.028. Only aol9 loses nothing (its first quintic lifts σ ≥ 2.5e-3 far
# enough), so only aol9 folds, from its second iteration.
_FOLD_FROM = {"aol9": 1}


def default_steps(method: Method | None, coefficients: Sequence[Sequence[float]] | None = None) -> int:
    """Iterations run when none are given: with ``coefficients`` (a user schedule) its length, or
    5 for a single triple (torch.optim.Muon's ``ns_steps``); else what ``method`` is designed
    for: 4 for ``"aol"`` and ``"aol9"``, else 5 (``None``: :data:`DEFAULT_METHOD`)."""
    if coefficients is not None:
        rows = validate_coefficients(coefficients)
        return len(rows) if len(rows) > 1 else TORCH_NS_STEPS
    method = DEFAULT_METHOD if method is None else method
    return _DEFAULT_STEPS.get(method, 5) if isinstance(method, str) else 5


def default_compute_dtype(device: torch.device | str | None = None,
                          schedule: Sequence[Coefficients] | None = None) -> torch.dtype:
    """The iteration dtype used when none is given: bf16, except fp32 on CPUs without bf16 GEMMs;
    for a Gram-form ``schedule`` (unstable in bf16) the execution policy's Gram dtype: fp16 on
    GPUs, fp32 on the CPU (:mod:`muon_fn._execution`).

    ``device=None`` means the CPU. bf16 is the tensor-core dtype on GPUs and the fast path on CPUs
    with bf16 instructions (x86 AVX-512 BF16 or AMX, Arm BF16; :data:`CPU_HAS_BF16_GEMM`).
    Measured, 1 thread, 768³: Zen 4 (AVX-512 BF16) bf16 2.2x faster than fp32; Zen 3 (AVX2 only)
    bf16 57x *slower* (796 vs 14 ms; fp16 alike), so there fp32 is the default.
    """
    device = torch.device("cpu" if device is None else device)
    if getattr(schedule, "form", "standard") == "gram":
        return _execution.policy(device).gram_dtype
    if device.type != "cpu" or CPU_HAS_BF16_GEMM:
        return torch.bfloat16
    return torch.float32


def cpu_has_bf16_gemm() -> bool:
    """Whether this CPU has bf16 dot-product instructions, which torch's CPU bf16 GEMMs need to be
    fast (without them they are emulated: 56–230x slower than fp32 on a Zen 3)."""
    if platform.machine().lower() in ("aarch64", "arm64"):
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())  # Arm BF16 (e.g. Neoverse V1+)
    cpu = getattr(torch, "cpu", None)
    return any(getattr(cpu, name, lambda: False)() for name in ("_is_avx512_bf16_supported",
                                                                  "_is_amx_tile_supported"))


# Read once at import: a plain global, so torch.compile guards on it instead of tracing the probe.
CPU_HAS_BF16_GEMM: bool = cpu_has_bf16_gemm()


def validate_coefficients(coefficients: Sequence[Sequence[float]] | Sequence[float],
                          name: str = "coefficients") -> tuple[Coefficients, ...]:
    """Check a user schedule and return it as rows: torch.optim.Muon's flat ``(a, b, c)`` (one
    quintic, every iteration) or a non-empty sequence of finite ``(a, b, c)`` triples, one per
    iteration. ``name`` is the argument name used in the error (e.g. ``"ns_coefficients"``)."""
    expected = "expected an (a, b, c) triple or a sequence of (a, b, c) triples"
    if isinstance(coefficients, (str, bytes)) or not isinstance(coefficients, Sequence):
        raise ValueError(f"Invalid {name}: {coefficients!r} ({expected})")
    if coefficients and all(_is_real(v) for v in coefficients):  # torch's flat triple
        coefficients = (coefficients,)
    try:
        rows = tuple(tuple(_real(v) for v in row) for row in coefficients)
    except (TypeError, ValueError) as e:
        raise ValueError(f"Invalid {name}: {coefficients!r} ({expected})") from e
    if not rows or any(len(r) != 3 for r in rows):
        raise ValueError(f"Invalid {name}: {coefficients!r} ({expected})")
    if any(v != v or v in (float("inf"), float("-inf")) for r in rows for v in r):
        raise ValueError(f"Invalid {name}: {coefficients!r} (values must be finite)")
    return rows


def _is_real(v: object) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _real(v: object) -> float:
    if not _is_real(v):
        raise TypeError(f"not a real number: {v!r}")
    return float(v)


def coefficient_schedule(
    method: str | None = "polar_express",
    steps: int | None = 5,
    *,
    coefficients: Sequence[Sequence[float]] | Sequence[float] | None = None,
    stepsize: float = 1.0,
) -> Schedule:
    """The ``steps`` polynomial rows that ``method`` applies, one per iteration.

    Returns a :class:`Schedule` (a tuple of triples) that also carries the method's
    preconditioner and form. ``steps=None`` uses :func:`default_steps`. ``coefficients`` (a user
    schedule: one ``(a, b, c)`` or one triple per iteration, the last repeating) replaces the
    method's rows; with ``method=None`` they run as the plain iteration (Frobenius
    normalization, standard form: torch.optim.Muon's), with a named method they keep its
    preconditioner and form. ``method=None`` without coefficients is :data:`DEFAULT_METHOD`.
    ``stepsize`` η damps each iteration, ``X ← X + η(p(X) − X)``, i.e.
    ``(c₀, c₁, …) → (1 − η + ηc₀, ηc₁, …)``.
    """
    if method is None and coefficients is None:
        method = DEFAULT_METHOD
    if steps is None:
        steps = default_steps(method, coefficients)
    _checks.positive_int("steps", steps)
    _checks.positive("stepsize", stepsize)
    if coefficients is not None:
        base, extend = validate_coefficients(coefficients), "repeat_last"
    else:
        _checks.one_of("method", method, METHODS)
        base, extend = _SCHEDULES[method]
    if extend == "cycle":
        rows = list(itertools.islice(itertools.cycle(base), steps))
    else:
        rows = list(base[:steps]) + [base[-1]] * max(0, steps - len(base))
    if stepsize != 1.0:
        rows = [(1.0 - stepsize + stepsize * r[0], *(stepsize * c for c in r[1:])) for r in rows]
    options = dict(_METHOD_OPTIONS.get(method, {})) if isinstance(method, str) else {}
    if coefficients is None:  # measured for the method's own rows only
        options["fold_from"] = _FOLD_FROM.get(method)
    return Schedule(rows, **options)


def norm_scale(method: str | None) -> float:
    """Factor on ‖X‖_F in the pre-normalization (1.01 for Polar Express, else 1; ``None``:
    :data:`DEFAULT_METHOD`'s)."""
    method = DEFAULT_METHOD if method is None else method
    return _NORM_SCALE.get(method, 1.0) if isinstance(method, str) else 1.0


def _aol_scale(x: torch.Tensor, gram: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """AOL rescale: ``x ← diag(s) x`` and ``gram ← diag(s) gram diag(s)``, ``s_i = (Σ_j|gram_ij|)^-½``;
    in place (both are the caller's scratch) unless autograd or torch.func needs the inputs."""
    s = gram.abs().sum(-1, dtype=torch.promote_types(x.dtype, torch.float32)).add_(eps).rsqrt_().to(x.dtype)
    row, col = s.unsqueeze(-1), s.unsqueeze(-2)
    if _untracked(x) and _untracked(gram):
        return x.mul_(row), gram.mul_(row).mul_(col)
    return x * row, gram * row * col


def _addmm(bias: torch.Tensor, m1: torch.Tensor, m2: torch.Tensor, beta: float, alpha: float,
           out: torch.Tensor | None = None):
    """``beta*bias + alpha*(m1 @ m2)`` as one fused BLAS call (2-D or batched 3-D), into ``out``
    if given (it must not alias an input)."""
    if m1.ndim == 2:
        return torch.addmm(bias, m1, m2, beta=beta, alpha=alpha, out=out)
    return torch.baddbmm(bias, m1, m2, beta=beta, alpha=alpha, out=out)


def _matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    return a @ b if out is None else torch.matmul(a, b, out=out)


Buffers = dict  # scratch tensors kept by the caller across calls, keyed by (role, shape, dtype, device)


def _buffer(buffers: Buffers | None, role: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor | None:
    """A reusable ``empty`` tensor for ``role`` (None without ``buffers``). Reusing them avoids a
    fresh allocation per product, whose first touch page-faults (measured: the tiny bench set ran
    ~10 % faster for every row once freed memory stayed mapped)."""
    if buffers is None:
        return None
    key = (role, tuple(shape), like.dtype, like.device)
    t = buffers.get(key)
    if t is None:
        t = buffers[key] = torch.empty(shape, dtype=like.dtype, device=like.device)
    return t


# Products known to be symmetric (XXᵀ, A², c₁A + c₂A²) are computed from the blocks on and above
# the diagonal of a 2×2 split, recursively while a block keeps at least this many rows, and the
# block below is a transposed copy: 3/4 of the FLOPs per level. Each entry is the same dot product:
# in bf16 the result is bitwise one GEMM's (checked on every size below, and for every method's
# full iteration); fp32 GEMM kernels differ by shape (8 fp32 Polar Express steps: 2e-7).
# Measured on the 2-core Zen 4 CPU, bf16, ms (one GEMM → split): XXᵀ 768×3072 8.4 → 5.4, 768² 2.2 → 1.9,
# 1024×4096 20.1 → 12.9, 2048² 39.4 → 28.0; A² 768² 2.1 → 1.7, 2048² 42.6 → 30.4. Below 384 rows
# (the batched sizes) the halves lose more GEMM efficiency than they save (16×256²: 1.2 → 2.1).
# CPU and eager only: on CUDA each level adds kernel launches (not measured there), and compiled
# graphs keep one GEMM; so do products that autograd records or torch.func transforms.
SYMMETRIC_MIN_BLOCK = 192


# torch.func (vmap, grad) wraps tensors; out= has no batching rule, so wrapped inputs keep one GEMM.
_is_functorch_wrapped = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor",
                                lambda t: False)


def _untracked(t: torch.Tensor) -> bool:
    """Whether neither autograd (recording ``t`` for backward) nor torch.func (wrapping it) sees
    ``t``, so it may be written with ``out=`` or, as scratch, overwritten in place once read. The
    wrapper check is skipped under torch.compile, which cannot trace it and functionalizes anyway."""
    if torch.is_grad_enabled() and t.requires_grad:
        return False
    return torch.compiler.is_compiling() or not _is_functorch_wrapped(t)


@functools.cache
def _amx_dtypes() -> frozenset[torch.dtype]:
    """The half dtypes whose CPU GEMMs oneDNN runs on AMX tiles here (Intel Sapphire Rapids and
    later: bf16; Granite Rapids: also fp16)."""
    cpu = getattr(torch, "cpu", None)
    probe = {torch.bfloat16: "_is_amx_tile_supported", torch.float16: "_is_amx_fp16_supported"}
    return frozenset(dt for dt, name in probe.items() if getattr(cpu, name, lambda: False)())


# On AMX the GEMMs are ~6x faster than fp32 (768×3072 XXᵀ: 3.5 vs 22 ms) and the split's mirrored
# copies and smaller GEMMs cost more than the saved FLOPs unless the inner dimension is long:
# measured on a 1-thread Xeon with AMX, bf16, ms (one GEMM → split): A² 768² 0.73 → 1.13, XXᵀ 768²
# 0.86 → 1.10, XXᵀ 768×3072 3.46 → 3.18. So there only Gram products with k ≥ 2m are split.
AMX_SPLIT_MIN_RATIO = 2


def _split_symmetric(m: int, k: int, *tensors: torch.Tensor | None) -> bool:
    """Whether to split an ``m × m`` product with inner dimension ``k``: CPU, eager, big enough,
    worth it for the dtype (see ``AMX_SPLIT_MIN_RATIO``), and no autograd graph to record and no
    torch.func wrapper (the blocks are written with ``out=``, which neither supports)."""
    a = tensors[0]
    if m < 2 * SYMMETRIC_MIN_BLOCK or not _execution.policy(a.device).split_symmetric \
            or torch.compiler.is_compiling():
        return False
    if a.dtype in _amx_dtypes() and k < AMX_SPLIT_MIN_RATIO * m:
        return False
    return all(_untracked(t) for t in tensors if t is not None)


@functools.lru_cache(maxsize=None)
def _symmetric_blocks(m: int, min_block: int) -> tuple[tuple[slice, slice, bool], ...]:
    """The blocks ``(rows, cols, mirrored)`` computed for a symmetric ``m × m`` product split
    recursively 2×2 while halves keep ``min_block`` rows: the diagonal leaves, then each corner
    above the diagonal (``mirrored``: its transpose fills the block below)."""
    leaves: list[tuple[slice, slice, bool]] = []
    corners: list[tuple[slice, slice, bool]] = []

    def split(r0: int, r2: int) -> None:
        h = (r2 - r0) // 2
        if h < min_block:
            leaves.append((slice(r0, r2), slice(r0, r2), False))
            return
        split(r0, r0 + h)
        split(r0 + h, r2)
        corners.append((slice(r0, r0 + h), slice(r0 + h, r2), True))

    split(0, m)
    return tuple(leaves + corners)


def _product(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, bias: torch.Tensor | None = None,
             beta: float = 1.0, alpha: float = 1.0, *, symmetric: bool = False) -> torch.Tensor:
    """``a @ b``, or ``beta·bias + alpha·(a @ b)`` with a ``bias``, into ``out`` if given.

    ``symmetric``: the caller knows the result is exactly symmetric (``XXᵀ``, or ``A·A`` and
    ``bias`` for an exactly symmetric ``A``); then it is computed blockwise where
    :func:`_split_symmetric` allows (eager CPU from 384 rows up, see ``SYMMETRIC_MIN_BLOCK``; on
    AMX dtypes only for inner dimensions ≥ ``AMX_SPLIT_MIN_RATIO``·rows); 2-D, or 3-D batches
    (split per matrix)."""
    m = a.shape[-2]
    limit = _execution.policy(a.device).symmetric_min_dim
    if symmetric and limit is not None and m >= limit and a.ndim == 3:
        result = _half_blocks(a, b, bias, beta, alpha)
        return result if out is None else out.copy_(result)
    if not (symmetric and _split_symmetric(m, a.shape[-1], a, b, bias)):
        return _matmul(a, b, out) if bias is None else _addmm(bias, a, b, beta=beta, alpha=alpha, out=out)
    if out is None:
        out = torch.empty(a.shape[:-1] + b.shape[-1:], dtype=a.dtype, device=a.device)
    if a.ndim == 3:  # one matrix at a time: bf16 bmm on strided halves is slower than one GEMM
        for i in range(a.size(0)):
            _product(a[i], b[i], out[i], None if bias is None else bias[i], beta, alpha, symmetric=True)
        return out
    for rows, cols, mirrored in _symmetric_blocks(m, SYMMETRIC_MIN_BLOCK):
        block = out[rows, cols]
        if bias is None:
            _matmul(a[rows], b[:, cols], block)
        else:
            _addmm(bias[rows, cols], a[rows], b[:, cols], beta=beta, alpha=alpha, out=block)
        if mirrored:
            out[cols, rows].copy_(block.mT)
    return out


def _half_blocks(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, beta: float,
                 alpha: float) -> torch.Tensor:
    """A symmetric batched product from its two diagonal half blocks and the block above them,
    mirrored below (3/4 of the FLOPs): plain batched GEMMs and copies, traceable by inductor (the
    batched execution policy's; the CPU's splits per matrix in place, see :func:`_product`)."""
    h = a.size(-2) // 2
    top, low = slice(None, h), slice(h, None)

    def block(rows: slice, cols: slice) -> torch.Tensor:
        if bias is None:
            return a[:, rows] @ b[:, :, cols]
        return _addmm(bias[:, rows, cols], a[:, rows], b[:, :, cols], beta=beta, alpha=alpha)

    upper = block(top, low)
    return torch.cat([torch.cat([block(top, top), upper], -1),
                      torch.cat([upper.mT, block(low, low)], -1)], -2)


def gram_matrix(x: torch.Tensor, buffers: Buffers | None = None) -> torch.Tensor:
    """``XXᵀ`` of a (batch of) wide matrices, into the ``"gram"`` buffer if ``buffers`` is given."""
    return _product(x, x.mT, _buffer(buffers, "gram", x.shape[:-1] + x.shape[-2:-1], x), symmetric=True)


def _degree_terms(row: Coefficients) -> tuple[float, ...]:
    """``(c₁, …, c_d)`` of a row with trailing zeros dropped (a quintic with c = 0 is a cubic)."""
    c = tuple(row[1:])
    while len(c) > 1 and c[-1] == 0.0:
        c = c[:-1]
    return c


def gram_products(row: Coefficients) -> int:
    """m×m matrix products one iteration with ``row`` needs: 0 (cubic), 1 (quintic), 2 (degree 7/9)."""
    return min(len(_degree_terms(row)) - 1, 2)


def gemm_flops(shape: Sequence[int], schedule: Sequence[Coefficients]) -> int:
    """Dense GEMM FLOPs of orthogonalizing one ``(m, n)`` matrix with ``schedule``: the matrix
    products the iteration runs, ``2·a·b·c`` for an ``(a×b)(b×c)`` one (elementwise terms ignored).

    With ``s = min(m, n)``, ``l = max(m, n)``, the standard form runs per row ``XXᵀ`` (2s²l; AOL's
    Gram matrix takes its place in the first row), the row's m×m products (2s³ each,
    :func:`gram_products`: 0 cubic, 1 quintic, 2 degree 7/9) and ``(…)X`` (2s²l): a quintic row is
    ``4s²l + 2s³``. The Gram form (``Schedule.form == "gram"``, non-square) runs ``R = XXᵀ`` once,
    per row the polynomial's products, ``Q·T`` (2s³, not at a start) and ``R ← T·R·T`` (4s³,
    before every row but a restart), at each restart ``X ← QX`` and ``R ← XXᵀ`` (4s²l), and
    ``QX`` (2s²l) at the end.
    """
    m, n = int(shape[-2]), int(shape[-1])
    s, l = min(m, n), max(m, n)
    products = [gram_products(row) for row in schedule]
    if getattr(schedule, "form", "standard") != "gram" or m == n:
        return sum(4 * s * s * l + 2 * s**3 * k for k in products)
    flops, started = 2 * s * s * l, False
    for i, k in enumerate(products):
        if i in GRAM_RESTARTS and started:
            flops, started = flops + 4 * s * s * l, False
        flops += 2 * s**3 * (k + started)
        started = True
        if i + 1 < len(products) and i + 1 not in GRAM_RESTARTS:
            flops += 4 * s**3
    return flops + 2 * s * s * l


def _poly(gram: torch.Tensor, row: Coefficients, buffers: Buffers | None = None,
          symmetric: bool = True, overwrite: bool = False) -> torch.Tensor | None:
    """``Σ_{i≥1} cᵢ Aⁱ`` for ``row = (c₀, c₁, …, c_d)``, ``d ≤ 4``, in the fewest m×m products and
    elementwise passes (quintic: one fused ``addmm``; degree 7 and 9: ``A²``, one elementwise pass,
    one ``addmm``). ``None`` for a cubic (no m×m product needed). ``buffers``: see :func:`iterate`.
    ``symmetric``: compute ``A²`` blockwise (:func:`_product`) for a symmetric ``gram``: with an
    exactly symmetric one (a fresh ``XXᵀ``) the bf16 result is bitwise one GEMM's; Gram
    Newton–Schulz's ``R`` (fp32/fp16, symmetric up to rounding) differs from it by rounding.
    ``overwrite``: ``gram`` is the caller's scratch, not needed afterwards; degree 9 then
    accumulates into it in place (no copy of ``c₁A`` into the output first; same values)."""
    c = _degree_terms(row)
    if len(c) == 1:
        return None
    out = _buffer(buffers, "poly", gram.shape, gram)
    if len(c) == 2:
        return _product(gram, gram, out, gram, beta=c[0], alpha=c[1], symmetric=symmetric)
    if len(c) > 4:
        raise ValueError(f"Invalid schedule row {tuple(row)!r} (at most degree 9: 5 coefficients)")
    sq = _product(gram, gram, _buffer(buffers, "square", gram.shape, gram), symmetric=symmetric)
    inner = _buffer(buffers, "inner", gram.shape, gram)
    if len(c) == 3:  # c₁A + c₃·A(A² + (c₂/c₃)A)
        return _addmm(gram, gram, _scaled_sum(sq, gram, c[1] / c[2], inner), beta=c[0], alpha=c[2], out=out)
    if c[2] != 0.0:  # c₁A + c₃·A²(A + (c₄/c₃)A² + (c₂/c₃)I)
        inner, alpha = _scaled_sum(gram, sq, c[3] / c[2], inner), c[2]
        inner.diagonal(dim1=-2, dim2=-1).add_(c[1] / c[2])
    else:  # c₁A + A²(c₄A² + c₂I)
        inner, alpha = torch.mul(sq, c[3], out=inner), 1.0
        inner.diagonal(dim1=-2, dim2=-1).add_(c[1])
    if overwrite and _untracked(gram):
        return gram.addmm_(sq, inner, beta=c[0], alpha=alpha) if gram.ndim == 2 else \
            gram.baddbmm_(sq, inner, beta=c[0], alpha=alpha)
    return _addmm(gram, sq, inner, beta=c[0], alpha=alpha, out=out)


def _scaled_sum(a: torch.Tensor, b: torch.Tensor, alpha: float, out: torch.Tensor | None) -> torch.Tensor:
    """``a + alpha·b`` (into ``out`` if given), one matrix at a time for a batch: ATen's vectorized
    loop and its scalar tail round ``a + alpha·b`` differently in bf16, and in a batch only the
    last matrix's last elements reach the tail, so batching would change a matrix's result."""
    if a.ndim == 2 or torch.compiler.is_compiling():
        return torch.add(a, b, alpha=alpha, out=out)
    if not (_untracked(a) and _untracked(b)):  # autograd or torch.func: no out=
        return torch.stack([torch.add(a[i], b[i], alpha=alpha) for i in range(a.size(0))])
    out = torch.empty_like(a) if out is None else out
    for i in range(a.size(0)):
        torch.add(a[i], b[i], alpha=alpha, out=out[i])
    return out


def _step(x: torch.Tensor, gram: torch.Tensor, row: Coefficients, buffers: Buffers | None = None,
          out: torch.Tensor | None = None, symmetric: bool = True, overwrite: bool = False,
          fold: bool = False) -> torch.Tensor:
    """One iteration ``X ← (c₀I + Σ_{i≥1} cᵢAⁱ)X`` given ``A = XXᵀ`` (into ``out`` if given;
    ``symmetric`` and ``overwrite``: see :func:`_poly`).

    ``fold``: ``c₀`` goes onto the diagonal of the m×m polynomial ``P`` instead of into the GEMM
    as a bias, which is first copied into the output and read again, an m×n pass (768×3072 bf16
    on a Xeon with AMX: 3.50 → 3.06 ms). Only the rounding of the diagonal changes: ``c₀ + pᵢᵢ``
    instead of ``pᵢᵢ`` (see ``_FOLD_FROM`` for when that is no coarser)."""
    poly = _poly(gram, row, buffers, symmetric, overwrite)
    if poly is None:  # cubic: skip the A² product
        return _addmm(x, gram, x, beta=row[0], alpha=row[1], out=out)
    if not fold:
        return _addmm(x, poly, x, beta=row[0], alpha=1.0, out=out)
    poly.diagonal(dim1=-2, dim2=-1).add_(row[0])
    return _matmul(poly, x, out)


# Batches of matrices with min(m, n) >= this run one matrix at a time (2-D GEMMs) in eager mode,
# whatever the batch size, so a matrix's result never depends on its batch mates (the FSDP owner
# batches other matrices than a single device does): on the 2-core Zen 4 CPU, bf16 baddbmm is
# 9-14 % slower than a loop of addmm from 512² up (16×768²: 603 vs 525 ms) and 5-16 % faster below
# 384 (16×256²: 19.1 vs 22.8 ms). The CPU execution policy's (:mod:`muon_fn._execution`); the
# batched policy of GPUs never loops.
LOOP_MIN_DIM = _execution.CPU.loop_min_dim


def _loops(m: int, device: torch.device) -> bool:
    """Whether an eager batch of wide matrices with ``m`` rows runs one matrix at a time."""
    limit = _execution.policy(device).loop_min_dim
    return limit is not None and m >= limit and not torch.compiler.is_compiling()


def iterate(x: torch.Tensor, schedule: Sequence[Coefficients], gram: torch.Tensor | None = None,
            buffers: Buffers | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Apply ``X ← c₀X + (Σ_{i≥1} cᵢAⁱ)X``, ``A = XXᵀ``, once per row (``aX + (bA + cA²)X`` for a
    quintic). ``x``: (m, n) or (B, m, n). A :class:`Schedule`'s ``fold_from`` says from which
    iteration on ``c₀`` goes onto the polynomial's diagonal (:func:`_step`).

    ``gram``: ``XXᵀ`` of the input if already computed (used by the first iteration; it need not
    be exactly symmetric, e.g. after the AOL rescale, so its square is one GEMM).
    ``buffers``: a dict the caller keeps across calls (eager only): every intermediate product is
    written into a reused scratch tensor (X alternates between two). ``out``: where the last
    iteration writes (it must not alias ``x``); without it the result may be a scratch tensor,
    overwritten by the next call with the same shapes. Bitwise the same values either way.
    """
    fold_from = getattr(schedule, "fold_from", None)
    last = len(schedule) - 1
    for k, row in enumerate(schedule):
        a = gram_matrix(x, buffers) if gram is None else gram
        target = out if k == last and out is not None else _buffer(buffers, f"x{k % 2}", x.shape, x)
        x = _step(x, a, row, buffers, target, symmetric=gram is None, overwrite=gram is None,
                  fold=fold_from is not None and k >= fold_from)
        gram = None
    return x


def iterate_gram(
    x: torch.Tensor,
    schedule: Sequence[Coefficients],
    gram: torch.Tensor | None = None,
    restarts: Sequence[int] = GRAM_RESTARTS,
) -> torch.Tensor:
    """Gram Newton–Schulz: the polynomials of :func:`iterate` applied through ``R = XXᵀ`` only.

    Keeps ``X_k = Q X_0`` with ``Q`` a polynomial in ``R_0``: per row ``T = c₀I + Σ cᵢRⁱ``,
    ``Q ← QT`` and ``R ← TRT`` (all m×m, they commute); at a restart ``X ← QX``, ``R ← XXᵀ``.
    Equal to :func:`iterate` in exact arithmetic; ``4m²n`` + O(m³) FLOPs per restart instead of
    ``4m²n`` per iteration. Loses orthogonality in bf16 (spurious negative eigenvalues of ``R``).
    """
    if x.size(-2) == x.size(-1):  # square: nothing to save
        return iterate(x, schedule, gram)
    r = x @ x.mT if gram is None else gram
    eye = torch.eye(x.size(-2), dtype=x.dtype, device=x.device)
    q = None
    n = len(schedule)
    for k, row in enumerate(schedule):
        if k in restarts and q is not None:
            x, q = q @ x, None
            r = x @ x.mT
        t = _poly(r, row)
        t = (r * row[1] if t is None else t) + row[0] * eye
        q = t if q is None else q @ t
        if k + 1 < n and (k + 1) not in restarts:
            r = t @ (r @ t)
    return x if q is None else q @ x


def newton_schulz(
    x: torch.Tensor,
    method: str = "polar_express",
    steps: int | None = 5,
    *,
    coefficients: Sequence[Sequence[float]] | None = None,
    dtype: torch.dtype | None = None,
    eps: float = 1e-7,
    stepsize: float = 1.0,
) -> torch.Tensor:
    """Approximate ``msign(x)`` for a matrix or a batch of matrices ``(..., m, n)``.

    Args:
      x: input of shape ``(..., m, n)``; tall matrices are transposed internally.
      method: ``"polar_express"``, ``"quintic"`` (Keller), ``"you"``, ``"cubic"``, ``"aol"``
        (AOL-preconditioned, 4 steps by default), ``"aol9"`` or ``"gram"`` (Polar Express as
        Gram NS; fp32/fp16 only).
      steps: number of iterations (``None``: :func:`default_steps`).
      coefficients: a custom schedule of ``(a, b, c)`` triples (overrides ``method``'s).
      dtype: iteration dtype; ``None`` iterates in ``x.dtype``.
      eps: the normalization is ``x / max(‖x‖_F, eps)`` (torch.optim.Muon's), so a zero
        input maps to zero.
      stepsize: damping η of each iteration (1 = the plain iteration).

    Returns:
      A tensor of ``x``'s shape and dtype.
    """
    if x.ndim < 2:
        raise ValueError(f"newton_schulz expects a matrix or a batch of matrices, got shape {tuple(x.shape)}")
    _checks.positive("eps", eps)
    schedule = coefficient_schedule(method, steps, coefficients=coefficients, stepsize=stepsize)
    scale = 1.0 if coefficients is not None else norm_scale(method)
    return orthogonalize_matrices(x, schedule, dtype=dtype or x.dtype, eps=eps, norm_scale=scale)


def check_dtype(schedule: Sequence[Coefficients], dtype: torch.dtype) -> None:
    """Raise ``ValueError`` if ``dtype`` cannot run ``schedule`` (Gram form in bf16)."""
    if getattr(schedule, "form", "standard") == "gram" and dtype == torch.bfloat16:
        raise ValueError(
            "Invalid dtype for method 'gram': torch.bfloat16 (Gram Newton-Schulz loses "
            "orthogonality in bf16; use torch.float32, or torch.float16 on GPUs)"
        )


def _run_schedule(y: torch.Tensor, schedule: Sequence[Coefficients], eps: float,
                  buffers: Buffers | None = None, gram: torch.Tensor | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Iterate a normalized ``y`` (wide, compute dtype) with ``schedule``: the AOL rescale first if
    the schedule asks for it (its Gram matrix feeds the first iteration), in the schedule's form.
    ``y`` may be rescaled in place (it is the caller's normalized copy). ``buffers`` and ``out``:
    see :func:`iterate` (the Gram form uses neither). ``gram``: ``yyᵀ`` if known. Eager batches of
    matrices of at least the execution policy's ``loop_min_dim`` rows (CPU: :data:`LOOP_MIN_DIM`)
    run one matrix at a time."""
    if y.ndim == 3 and _loops(y.size(-2), y.device):
        out = torch.empty_like(y) if out is None else out
        for i in range(y.size(0)):
            _run_schedule(y[i], schedule, eps, buffers, None if gram is None else gram[i], out[i])
        return out
    if getattr(schedule, "precondition", "frobenius") == "aol":
        y, gram = _aol_scale(y, gram_matrix(y, buffers) if gram is None else gram, eps)
    if getattr(schedule, "form", "standard") == "gram":
        result = iterate_gram(y, schedule, gram)
        return result if out is None else out.copy_(result)
    return iterate(y, schedule, gram, buffers, out)


def _inverse_norm(x: torch.Tensor, norm_scale: float, eps: float, dims: tuple[int, ...] | None = None) -> torch.Tensor:
    """``1 / max(norm_scale·‖x‖_F, eps)`` in at least fp32 (over ``dims``, kept, for a batch):
    torch.optim.Muon's normalization (exactly scale-invariant above ``eps``; zero maps to zero)."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    norm = torch.linalg.vector_norm(x, dim=dims, keepdim=dims is not None, dtype=dtype)
    return 1.0 / (norm * norm_scale).clamp_min(eps)


def orthogonalize_matrices(
    x: torch.Tensor,
    schedule: Sequence[Coefficients],
    *,
    dtype: torch.dtype,
    eps: float,
    norm_scale: float = 1.0,
    gram: torch.Tensor | None = None,
) -> torch.Tensor:
    """The iteration behind :func:`newton_schulz` with a resolved schedule (plain tensor code:
    traceable by autograd, torch.func and torch.compile).

    A :class:`Schedule` brings its preconditioner and form; a plain tuple of triples runs the
    standard iteration after Frobenius normalization. ``gram``: ``XXᵀ`` of ``x``'s wide
    orientation (``XᵀX`` for tall ``x``), ``(..., k, k)`` with ``k = min(m, n)``, if the caller
    already has it (SSO forms it by a rank-two update); the first iteration then uses it, scaled
    and cast like ``x``, instead of a product.
    """
    check_dtype(schedule, dtype)
    out_dtype, shape = x.dtype, x.shape
    if x.ndim > 3:
        x = x.reshape(-1, *shape[-2:])
        gram = None if gram is None else gram.reshape(-1, *gram.shape[-2:])
    tall = x.size(-2) > x.size(-1)
    inv = _inverse_norm(x, norm_scale, eps, dims=(-2, -1))
    y = (x * inv).to(dtype)
    if tall:
        y = y.mT
    if gram is not None:
        gram = (gram * inv.square()).to(dtype)
    y = _run_schedule(y, schedule, eps, gram=gram)
    if tall:
        y = y.mT
    return y.to(out_dtype).reshape(shape)


# --------------------------------------------------------------------------- the batched operator
def wide_shape(shape: Sequence[int]) -> tuple[int, int]:
    """``(min(m, n), max(m, n))`` of a matrix shape: the orientation the iteration runs in."""
    m, n = int(shape[-2]), int(shape[-1])
    return (m, n) if m <= n else (n, m)


def orthogonalize_batch(xs: Sequence[torch.Tensor], schedule: Sequence[Coefficients], *, dtype: torch.dtype,
                        eps: float, norm_scale: float = 1.0, buffers: Buffers | None = None) -> torch.Tensor:
    """msign of each matrix of ``xs`` (2-D, one wide shape ``(m, n)`` in either orientation) as
    one ``(B, m, n)`` tensor in ``dtype``, wide orientation (transpose tall results back).

    Each matrix is normalized by its own Frobenius norm (in at least fp32, on its own layout) and
    cast straight into its slot of the batch, then the batch is iterated: batched GEMMs below
    :data:`LOOP_MIN_DIM` rows, one matrix at a time from there or when the slots are not aligned
    (eager; :func:`aligned_slots`). Every step is computed per matrix on equally aligned memory,
    so a matrix's result does not depend on which others share its batch.
    ``buffers``: scratch kept across calls (see :func:`iterate`); the result is always fresh.
    """
    check_dtype(schedule, dtype)
    m, n = wide_shape(xs[0].shape)
    device = xs[0].device
    if _execution.policy(device).stack_inputs:
        return _stacked(xs, schedule, eps, norm_scale, dtype)
    out = torch.empty((len(xs), m, n), dtype=dtype, device=device)
    aligned = aligned_slots(m, n, dtype, device)
    loop = (_loops(m, device) or not aligned) and not torch.compiler.is_compiling()
    shape = (m, n) if loop else (len(xs), m, n)
    y = _buffer(buffers, "input", shape, out)
    y = torch.empty(shape, dtype=dtype, device=device) if y is None else y
    for i, x in enumerate(xs):
        slot = y if loop else y[i]
        inv = _inverse_norm(x, norm_scale, eps)
        torch.mul(x.mT if x.size(-2) > x.size(-1) else x, inv, out=slot)
        if loop and aligned:
            _run_schedule(slot, schedule, eps, buffers, out=out[i])
        elif loop:  # the last product goes to aligned scratch, then into the slot
            out[i].copy_(_run_schedule(slot, schedule, eps, buffers))
    if not loop:
        _run_schedule(y, schedule, eps, buffers, out=out)
    return out


def _stacked(xs: Sequence[torch.Tensor], schedule: Sequence[Coefficients], eps: float, norm_scale: float,
             dtype: torch.dtype) -> torch.Tensor:
    """The batched policy's :func:`orthogonalize_batch`: one stacked ``(B, m, n)`` tensor in the
    wide orientation, normalized by one reduction, iterated with one batched GEMM per product."""
    y = torch.stack([x.mT if x.size(-2) > x.size(-1) else x for x in xs])
    y = (y * _inverse_norm(y, norm_scale, eps, dims=(-2, -1))).to(dtype)
    return _run_schedule(y, schedule, eps)


# CPU BLAS kernels choose their code path by the operands' address: measured with MKL (AVX-512),
# an fp32 XXᵀ of a 10×11 matrix rounds differently at every 16-byte offset of X (bf16 GEMMs through
# oneDNN do not). The i-th matrix of a contiguous (B, m, n) batch starts i·m·n elements in.
SLOT_ALIGNMENT = 64  # bytes: torch's CPU allocator's alignment of a fresh tensor


def aligned_slots(m: int, n: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether every matrix of a batch of wide ``(m, n)`` matrices, and of their ``(m, m)`` Gram
    products, starts as a fresh tensor does (on a :data:`SLOT_ALIGNMENT` boundary) on the CPU, so
    a batched GEMM computes each as it would alone; off the CPU, True."""
    if torch.device(device).type != "cpu":
        return True
    size = torch.empty((), dtype=dtype).element_size()
    return (m * n * size) % SLOT_ALIGNMENT == 0 and (m * m * size) % SLOT_ALIGNMENT == 0


_SCRATCH = threading.local()  # per thread: {(role, shape, dtype, device): tensor}, CPU only


def clear_scratch() -> None:
    """Free the scratch tensors this thread's eager orthogonalizations keep between calls."""
    _SCRATCH.__dict__.clear()


def _scratch(device: torch.device) -> Buffers | None:
    """Reused scratch where the execution policy asks for it: on the CPU, where a fresh
    allocation page-faults on first touch (about 10 % of a small step); CUDA's caching allocator
    already reuses memory."""
    if not _execution.policy(device).scratch:
        return None
    if not hasattr(_SCRATCH, "buffers"):
        _SCRATCH.buffers = {}
    return _SCRATCH.buffers


@torch.library.custom_op("muon_fn::orthogonalize_batch", mutates_args=())
def _orthogonalize_batch_op(xs: list[torch.Tensor], coefficients: list[float], degrees: list[int],
                            precondition: str, form: str, fold_from: int, eps: float, norm_scale: float,
                            dtype: torch.dtype) -> torch.Tensor:
    rows, k = [], 0
    for d in degrees:
        rows.append(tuple(coefficients[k:k + d]))
        k += d
    schedule = Schedule(rows, precondition=precondition, form=form, fold_from=None if fold_from < 0 else fold_from)
    return orthogonalize_batch(xs, schedule, dtype=dtype, eps=eps, norm_scale=norm_scale,
                               buffers=_scratch(xs[0].device))


@_orthogonalize_batch_op.register_fake
def _(xs, coefficients, degrees, precondition, form, fold_from, eps, norm_scale, dtype):
    return torch.empty((len(xs),) + wide_shape(xs[0].shape), dtype=dtype, device=xs[0].device)


def msign_batch(xs: Sequence[torch.Tensor], schedule: Sequence[Coefficients], *, dtype: torch.dtype,
                eps: float, norm_scale: float = 1.0) -> torch.Tensor:
    """:func:`orthogonalize_batch` as one operator (``torch.ops.muon_fn.orthogonalize_batch``).

    Under the CPU execution policy (:mod:`muon_fn._execution`) the iteration stays one opaque call
    under ``torch.compile`` that runs the tuned eager kernels above (reused scratch, symmetric
    Gram products) while inductor fuses everything around it. Under the batched policy (GPUs) it
    is traced inline: inductor fuses the normalization and casts with the neighbouring work, and
    the graph can be captured as CUDA graphs. Inputs that autograd records take the plain tensor
    path too (no backward is defined for the operator).
    """
    if not _execution.policy(xs[0].device).opaque or (
            torch.is_grad_enabled() and any(x.requires_grad for x in xs)):
        return orthogonalize_batch(xs, schedule, dtype=dtype, eps=eps, norm_scale=norm_scale)
    return _orthogonalize_batch_op(
        list(xs), [float(c) for row in schedule for c in row], [len(row) for row in schedule],
        getattr(schedule, "precondition", "frobenius"), getattr(schedule, "form", "standard"),
        -1 if getattr(schedule, "fold_from", None) is None else schedule.fold_from, float(eps),
        float(norm_scale), dtype)


def zeropower_via_newtonschulz5(G: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Keller Jordan's Muon orthogonalization: quintic (3.4445, -4.7750, 2.0315) in bf16."""
    return newton_schulz(G, "quintic", steps, dtype=torch.bfloat16, eps=1e-7)


def polar_express(G: torch.Tensor, steps: int = 5, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Polar Express (safety factor 1.01) in ``dtype`` (default: ``G.dtype``).

    5 steps land σ in about 1 ± 0.12; 8 or more steps in fp32 converge (‖OOᵀ − I‖_F/√m ≈ 1e-6).
    """
    return newton_schulz(G, "polar_express", steps, dtype=dtype)
