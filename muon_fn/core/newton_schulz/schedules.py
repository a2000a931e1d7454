"""Newton–Schulz schedules: the coefficients of each method, how a schedule extends to ``steps``
iterations, and what a schedule costs in GEMM FLOPs. Data and arithmetic only.

A schedule row ``(c₀, c₁, …, c_d)`` is the odd polynomial ``p(σ) = σ·Σᵢ cᵢσ²ⁱ``, applied as
``X ← c₀X + (Σ_{i≥1} cᵢAⁱ)X`` with ``A = XXᵀ``: ``(a, b, c)`` is a quintic, 5 numbers a degree-9
step. A :class:`Schedule` also carries its preconditioner and form.
"""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Callable, Sequence
from typing import Any, TypeGuard

import torch

from .. import checks as _checks

Coefficients = tuple[float, ...]  # (c0, c1, ..., cd): p(σ) = σ·Σ cᵢ σ^{2i}; (a, b, c) for quintics
Method = str | Callable[[torch.Tensor], torch.Tensor]

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
                form: str = "standard", fold_from: int | None = None) -> Schedule:
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


def _check_default_steps(method: Any, coefficients: Any) -> None:
    if coefficients is not None:
        validate_coefficients(coefficients)


@_checks.checked(_check_default_steps)
def default_steps(method: Method | None,
                  coefficients: Sequence[Sequence[float]] | Sequence[float] | None = None) -> int:
    """Iterations run when none are given: with ``coefficients`` (a user schedule) its length, or
    5 for a single triple (torch.optim.Muon's ``ns_steps``); else what ``method`` is designed
    for: 4 for ``"aol"`` and ``"aol9"``, else 5 (``None``: :data:`DEFAULT_METHOD`)."""
    if coefficients is not None:
        rows = coefficient_rows(coefficients)
        return len(rows) if len(rows) > 1 else TORCH_NS_STEPS
    method = DEFAULT_METHOD if method is None else method
    return _DEFAULT_STEPS.get(method, 5) if isinstance(method, str) else 5



def validate_coefficients(coefficients: Sequence[Sequence[float]] | Sequence[float],
                          name: str = "coefficients") -> tuple[Coefficients, ...]:
    """Check a user schedule and return it as rows: torch.optim.Muon's flat ``(a, b, c)`` (one
    quintic, every iteration) or a non-empty sequence of finite ``(a, b, c)`` triples, one per
    iteration. ``name`` is the argument name used in the error (e.g. ``"ns_coefficients"``)."""
    expected = "expected an (a, b, c) triple or a sequence of (a, b, c) triples"
    if isinstance(coefficients, (str, bytes)) or not isinstance(coefficients, Sequence):
        raise ValueError(f"Invalid {name}: {coefficients!r} ({expected})")
    given: Sequence[Any] = coefficients  # user input: its rows are checked below
    if coefficients and all(_is_real(v) for v in coefficients):  # torch's flat triple
        given = (coefficients,)
    try:
        rows = tuple(tuple(_real(v) for v in row) for row in given)
    except (TypeError, ValueError) as e:
        raise ValueError(f"Invalid {name}: {given!r} ({expected})") from e
    if not rows or any(len(r) != 3 for r in rows):
        raise ValueError(f"Invalid {name}: {given!r} ({expected})")
    if any(v != v or v in (float("inf"), float("-inf")) for r in rows for v in r):
        raise ValueError(f"Invalid {name}: {given!r} (values must be finite)")
    return rows


def coefficient_rows(coefficients: Sequence[Sequence[float]] | Sequence[float]) -> tuple[Coefficients, ...]:
    """The rows of a schedule that :func:`validate_coefficients` accepted, without its checks."""
    flat = bool(coefficients) and all(_is_real(v) for v in coefficients)
    rows: Sequence[Any] = (coefficients,) if flat else coefficients
    return tuple(tuple(float(v) for v in row) for row in rows)


def _is_real(v: object) -> TypeGuard[numbers.Real]:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _real(v: object) -> float:
    if not _is_real(v):
        raise TypeError(f"not a real number: {v!r}")
    return float(v)


def _check_schedule(method: Any, steps: Any, coefficients: Any, stepsize: Any) -> None:
    if method is None and coefficients is None:
        method = DEFAULT_METHOD
    rows_checked = steps is None and coefficients is not None
    if steps is None:
        steps = default_steps(method, coefficients)  # checks the coefficients
    _checks.positive_int("steps", steps)
    _checks.positive("stepsize", stepsize)
    if coefficients is None:
        _checks.one_of("method", method, METHODS)
    elif not rows_checked:
        validate_coefficients(coefficients)


@_checks.checked(_check_schedule)
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
        steps = default_steps.build(method, coefficients)
    fold_from = None  # measured for the method's own rows only
    if coefficients is not None:
        base, extend = coefficient_rows(coefficients), "repeat_last"
    else:
        assert method is not None  # DEFAULT_METHOD when neither is given
        base, extend = _SCHEDULES[method]
        fold_from = _FOLD_FROM.get(method)
    if extend == "cycle":
        rows = list(itertools.islice(itertools.cycle(base), steps))
    else:
        rows = list(base[:steps]) + [base[-1]] * max(0, steps - len(base))
    if stepsize != 1.0:
        rows = [(1.0 - stepsize + stepsize * r[0], *(stepsize * c for c in r[1:])) for r in rows]
    options = dict(_METHOD_OPTIONS.get(method, {})) if isinstance(method, str) else {}
    return Schedule(rows, fold_from=fold_from, **options)


def norm_scale(method: str | None) -> float:
    """Factor on ‖X‖_F in the pre-normalization (1.01 for Polar Express, else 1; ``None``:
    :data:`DEFAULT_METHOD`'s)."""
    method = DEFAULT_METHOD if method is None else method
    return _NORM_SCALE.get(method, 1.0) if isinstance(method, str) else 1.0


def degree_terms(row: Coefficients) -> tuple[float, ...]:
    """``(c₁, …, c_d)`` of a row with trailing zeros dropped (a quintic with c = 0 is a cubic)."""
    c = tuple(row[1:])
    while len(c) > 1 and c[-1] == 0.0:
        c = c[:-1]
    return c


def gram_products(row: Coefficients) -> int:
    """m×m matrix products one iteration with ``row`` needs: 0 (cubic), 1 (quintic), 2 (degree 7/9)."""
    return min(len(degree_terms(row)) - 1, 2)


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
    s, l = min(m, n), max(m, n)  # noqa: E741  the docstring's s and l
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


def check_dtype(schedule: Sequence[Coefficients], dtype: torch.dtype) -> None:
    """Raise ``ValueError`` if ``dtype`` cannot run ``schedule`` (Gram form in bf16)."""
    if getattr(schedule, "form", "standard") == "gram" and dtype == torch.bfloat16:
        raise ValueError(
            "Invalid dtype for method 'gram': torch.bfloat16 (Gram Newton-Schulz loses "
            "orthogonality in bf16; use torch.float32, or torch.float16 on GPUs)"
        )


