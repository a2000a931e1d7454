"""Orthogonalization math: odd polynomial (Newton–Schulz-type) iterations approximating msign.

``msign(X) = U Vᵀ`` for ``X = U Σ Vᵀ``. Every method here normalizes ``X`` by its Frobenius norm
(so σ_max ≤ 1), works on the wide orientation (``m ≤ n``, tall inputs are transposed), and applies
one odd quintic per iteration: ``X ← aX + (bA + cA²)X`` with ``A = XXᵀ``. Methods differ only in
their per-iteration coefficient schedule. Pure tensor functions; no state, no transforms.
"""

from __future__ import annotations

import itertools
from typing import Callable, Sequence, Union

import torch

from . import _checks

Coefficients = tuple[float, float, float]
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

# Classical cubic Newton–Schulz: converges to the exact polar factor (slowly from small σ).
CUBIC_COEFFICIENTS: tuple[Coefficients, ...] = ((1.5, -0.5, 0.0),)

METHODS = ("polar_express", "quintic", "you", "cubic")

# How a method's per-iteration schedule extends to ``steps`` iterations.
_SCHEDULES: dict[str, tuple[tuple[Coefficients, ...], str]] = {
    "polar_express": (POLAR_EXPRESS_COEFFICIENTS, "repeat_last"),
    "quintic": (KELLER_COEFFICIENTS, "repeat_last"),
    "you": (YOU_COEFFICIENTS, "cycle"),
    "cubic": (CUBIC_COEFFICIENTS, "repeat_last"),
}
# Extra factor on the Frobenius norm before iterating (Polar Express's safety margin).
_NORM_SCALE = {"polar_express": POLAR_EXPRESS_SAFETY}


def default_compute_dtype(device: torch.device | str | None = None) -> torch.dtype:
    """The iteration dtype used when none is given: bf16 on every device.

    Measured on a 2-core Zen 4 CPU (avx512_bf16): bf16 GEMMs run 2.2x faster than fp32 with
    σ within 5e-3 of the fp32 result; bf16 is also the tensor-core dtype on CUDA.
    """
    del device
    return torch.bfloat16


def validate_coefficients(coefficients: Sequence[Sequence[float]]) -> tuple[Coefficients, ...]:
    """Check a user schedule: a non-empty sequence of finite ``(a, b, c)`` triples."""
    try:
        rows = tuple(tuple(float(v) for v in row) for row in coefficients)
    except TypeError as e:
        raise ValueError(
            f"Invalid coefficients: {coefficients!r} (expected a sequence of (a, b, c) triples)"
        ) from e
    if not rows or any(len(r) != 3 for r in rows):
        raise ValueError(
            f"Invalid coefficients: {coefficients!r} (expected a non-empty sequence of (a, b, c) triples)"
        )
    if any(v != v or v in (float("inf"), float("-inf")) for r in rows for v in r):
        raise ValueError(f"Invalid coefficients: {coefficients!r} (values must be finite)")
    return rows


def coefficient_schedule(
    method: str = "polar_express",
    steps: int = 5,
    *,
    coefficients: Sequence[Sequence[float]] | None = None,
    stepsize: float = 1.0,
) -> tuple[Coefficients, ...]:
    """The ``steps`` triples ``(a, b, c)`` that ``method`` applies, one per iteration.

    ``coefficients`` (a user schedule) overrides the method's; its last triple repeats if it is
    shorter than ``steps``. ``stepsize`` η damps each iteration, ``X ← X + η(p(X) − X)``, i.e.
    ``(a, b, c) → (1 − η + ηa, ηb, ηc)``.
    """
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
        rows = [(1.0 - stepsize + stepsize * a, stepsize * b, stepsize * c) for a, b, c in rows]
    return tuple(rows)


def norm_scale(method: str) -> float:
    """Factor on ‖X‖_F in the pre-normalization (1.01 for Polar Express, else 1)."""
    return _NORM_SCALE.get(method, 1.0) if isinstance(method, str) else 1.0


def _addmm(bias: torch.Tensor, m1: torch.Tensor, m2: torch.Tensor, beta: float, alpha: float):
    """``beta*bias + alpha*(m1 @ m2)`` as one fused BLAS call (2-D or batched 3-D)."""
    if m1.ndim == 2:
        return torch.addmm(bias, m1, m2, beta=beta, alpha=alpha)
    return torch.baddbmm(bias, m1, m2, beta=beta, alpha=alpha)


def iterate(x: torch.Tensor, schedule: Sequence[Coefficients]) -> torch.Tensor:
    """Apply ``X ← aX + (bA + cA²)X``, ``A = XXᵀ``, once per triple. ``x``: (m, n) or (B, m, n)."""
    for a, b, c in schedule:
        gram = x @ x.mT
        if c == 0.0:  # cubic: skip the A² product
            x = _addmm(x, gram, x, beta=a, alpha=b)
        else:
            poly = _addmm(gram, gram, gram, beta=b, alpha=c)
            x = _addmm(x, poly, x, beta=a, alpha=1.0)
    return x


def newton_schulz(
    x: torch.Tensor,
    method: str = "polar_express",
    steps: int = 5,
    *,
    coefficients: Sequence[Sequence[float]] | None = None,
    dtype: torch.dtype | None = None,
    eps: float = 1e-7,
    stepsize: float = 1.0,
) -> torch.Tensor:
    """Approximate ``msign(x)`` for a matrix or a batch of matrices ``(..., m, n)``.

    Args:
      x: input of shape ``(..., m, n)``; tall matrices are transposed internally.
      method: ``"polar_express"``, ``"quintic"`` (Keller), ``"you"`` or ``"cubic"``.
      steps: number of iterations.
      coefficients: a custom schedule of ``(a, b, c)`` triples (overrides ``method``'s).
      dtype: iteration dtype; ``None`` iterates in ``x.dtype``.
      eps: added to the Frobenius norm, so a zero input maps to zero.
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


def orthogonalize_matrices(
    x: torch.Tensor,
    schedule: Sequence[Coefficients],
    *,
    dtype: torch.dtype,
    eps: float,
    norm_scale: float = 1.0,
) -> torch.Tensor:
    """The iteration behind :func:`newton_schulz` with a resolved schedule (no validation)."""
    out_dtype, shape = x.dtype, x.shape
    if x.ndim > 3:
        x = x.reshape(-1, *shape[-2:])
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True, dtype=torch.float32)
    y = (x / (norm * norm_scale + eps)).to(dtype)
    y = iterate(y, schedule)
    if tall:
        y = y.mT
    return y.to(out_dtype).reshape(shape)


def zeropower_via_newtonschulz5(G: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Keller Jordan's Muon orthogonalization: quintic (3.4445, -4.7750, 2.0315) in bf16."""
    return newton_schulz(G, "quintic", steps, dtype=torch.bfloat16, eps=1e-7)


def polar_express(G: torch.Tensor, steps: int = 5, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Polar Express (safety factor 1.01) in ``dtype`` (default: ``G.dtype``).

    5 steps land σ in about 1 ± 0.12; 8 or more steps in fp32 converge (‖OOᵀ − I‖_F/√m ≈ 1e-6).
    """
    return newton_schulz(G, "polar_express", steps, dtype=dtype)
