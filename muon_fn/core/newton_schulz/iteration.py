"""The Newton–Schulz iteration as formulas: odd polynomials approximating ``msign(X) = UVᵀ``.

Every method normalizes ``X`` by its Frobenius norm (so σ_max ≤ 1) and applies one odd
polynomial per row of its :class:`~.schedules.Schedule`: ``X ← (c₀I + Σ_{i≥1} cᵢAⁱ)X`` with
``A = XXᵀ`` for a wide ``X`` (``m ≤ n``), and its transpose ``X ← X(c₀I + Σ_{i≥1} cᵢAⁱ)`` with
``A = XᵀX`` for a tall one, so both iterate on the small ``min(m, n)``-square Gram matrix in their
own layout (no transposed copy in or out; :func:`step`, :func:`poly`, :func:`iterate`).
``precondition="aol"`` rescales the rows (a tall matrix's columns) first (:func:`aol_scale`,
reusing the first Gram matrix); ``form="gram"`` runs the same polynomials through the Gram
matrix only (:func:`iterate_gram`). Every matrix product goes through a :class:`~.products.Products`
(``ops``), which the caller passes: these functions say *what* is computed, the products say *how*
on a device. Choosing a device's products is the execution side's (:mod:`.execution`:
``for_device``, and the entry points that run these functions through it: ``newton_schulz``, and
``gram_matrix``, ``iterate``, ``iterate_gram``, ``orthogonalize_matrices`` without ``ops``), so
this module imports no execution module.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .products import Products, addmm, matmul, untracked
from .schedules import GRAM_RESTARTS, Coefficients, check_dtype, degree_terms


def inverse_norm(x: torch.Tensor, norm_scale: float, eps: float, dims: tuple[int, ...] | None = None) -> torch.Tensor:
    """``1 / max(norm_scale·‖x‖_F, eps)`` in at least fp32 (over ``dims``, kept, for a batch):
    torch.optim.Muon's normalization (exactly scale-invariant above ``eps``; zero maps to zero)."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    norm = torch.linalg.vector_norm(x, dim=dims, keepdim=dims is not None, dtype=dtype)
    return 1.0 / (norm * norm_scale).clamp_min(eps)


def wide_shape(shape: Sequence[int]) -> tuple[int, int]:
    """``(min(m, n), max(m, n))`` of a matrix shape: the Gram matrix is ``min × min``."""
    m, n = int(shape[-2]), int(shape[-1])
    return (m, n) if m <= n else (n, m)


def is_tall(x: torch.Tensor) -> bool:
    """Whether ``x`` has more rows than columns: it iterates from the right, on ``XᵀX``."""
    return x.size(-2) > x.size(-1)


def aol_scale(x: torch.Tensor, gram: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """AOL rescale: ``x ← diag(s) x`` (a tall ``x``: ``x diag(s)``) and ``gram ← diag(s) gram
    diag(s)``, ``s_i = (Σ_j|gram_ij|)^-½``; in place (both are the caller's scratch) unless
    autograd or torch.func needs the inputs."""
    s = gram.abs().sum(-1, dtype=torch.promote_types(x.dtype, torch.float32)).add_(eps).rsqrt_().to(x.dtype)
    row, col = s.unsqueeze(-1), s.unsqueeze(-2)
    side = col if is_tall(x) else row
    if untracked(x) and untracked(gram):
        return x.mul_(side), gram.mul_(row).mul_(col)
    return x * side, gram * row * col


def gram_matrix(x: torch.Tensor, ops: Products) -> torch.Tensor:
    """The Gram matrix of a (batch of) matrices: ``XXᵀ`` of a wide one, ``XᵀX`` of a tall one
    (into ``ops``' ``"gram"`` scratch, if it keeps one)."""
    k = min(x.shape[-2:])
    a, b = (x.mT, x) if is_tall(x) else (x, x.mT)
    return ops.product(a, b, ops.scratch("gram", x.shape[:-2] + (k, k), x), symmetric=True)


def times(x: torch.Tensor, p: torch.Tensor, out: torch.Tensor | None = None, *, beta: float | None = None,
          alpha: float = 1.0) -> torch.Tensor:
    """``p X`` (a tall ``X``: ``X p``), ``p`` an m×m polynomial of its Gram matrix; with ``beta``,
    ``beta·X + alpha·(p X)`` in one fused call (into ``out`` if given)."""
    a, b = (x, p) if is_tall(x) else (p, x)
    return matmul(a, b, out) if beta is None else addmm(x, a, b, beta=beta, alpha=alpha, out=out)


def poly(gram: torch.Tensor, row: Coefficients, ops: Products, symmetric: bool = True,
         overwrite: bool = False) -> torch.Tensor | None:
    """``Σ_{i≥1} cᵢ Aⁱ`` for ``row = (c₀, c₁, …, c_d)``, ``d ≤ 4``, in the fewest m×m products and
    elementwise passes (quintic: one fused ``addmm``; degree 7 and 9: ``A²``, one elementwise pass,
    one ``addmm``). ``None`` for a cubic (no m×m product needed). ``symmetric``: ``gram`` is
    exactly symmetric (a fresh ``XXᵀ``), so are ``A²`` and the quintic's polynomial (the products
    may use it; Gram Newton–Schulz's ``R`` is symmetric only up to rounding). ``overwrite``:
    ``gram`` is the caller's scratch, not needed afterwards; degree 9 then accumulates into it in
    place (no copy of ``c₁A`` into the output first; same values)."""
    c = degree_terms(row)
    if len(c) == 1:
        return None
    out = ops.scratch("poly", gram.shape, gram)
    if len(c) == 2:
        return ops.product(gram, gram, out, gram, beta=c[0], alpha=c[1], symmetric=symmetric)
    if len(c) > 4:
        raise ValueError(f"Invalid schedule row {tuple(row)!r} (at most degree 9: 5 coefficients)")
    sq = ops.product(gram, gram, ops.scratch("square", gram.shape, gram), symmetric=symmetric)
    inner = ops.scratch("inner", gram.shape, gram)
    if len(c) == 3:  # c₁A + c₃·A(A² + (c₂/c₃)A)
        return addmm(gram, gram, ops.scaled_sum(sq, gram, c[1] / c[2], inner), beta=c[0], alpha=c[2], out=out)
    if c[2] != 0.0:  # c₁A + c₃·A²(A + (c₄/c₃)A² + (c₂/c₃)I)
        inner, alpha = ops.scaled_sum(gram, sq, c[3] / c[2], inner), c[2]
        inner.diagonal(dim1=-2, dim2=-1).add_(c[1] / c[2])
    else:  # c₁A + A²(c₄A² + c₂I)
        inner, alpha = torch.mul(sq, c[3], out=inner), 1.0
        inner.diagonal(dim1=-2, dim2=-1).add_(c[1])
    if overwrite and untracked(gram):
        return gram.addmm_(sq, inner, beta=c[0], alpha=alpha) if gram.ndim == 2 else \
            gram.baddbmm_(sq, inner, beta=c[0], alpha=alpha)
    return addmm(gram, sq, inner, beta=c[0], alpha=alpha, out=out)


def step(x: torch.Tensor, gram: torch.Tensor, row: Coefficients, ops: Products, out: torch.Tensor | None = None,
         symmetric: bool = True, overwrite: bool = False, fold: bool = False) -> torch.Tensor:
    """One iteration ``X ← (c₀I + Σ_{i≥1} cᵢAⁱ)X`` given ``A = XXᵀ`` (into ``out`` if given;
    ``symmetric`` and ``overwrite``: see :func:`poly`).

    ``fold``: ``c₀`` goes onto the diagonal of the m×m polynomial ``P`` instead of into the GEMM
    as a bias, which is first copied into the output and read again, an m×n pass (768×3072 bf16
    on a Xeon with AMX: 3.50 → 3.06 ms). Only the rounding of the diagonal changes: ``c₀ + pᵢᵢ``
    instead of ``pᵢᵢ`` (``schedules._FOLD_FROM`` says when that is no coarser)."""
    p = poly(gram, row, ops, symmetric, overwrite)
    if p is None:  # cubic: skip the A² product
        return times(x, gram, out, beta=row[0], alpha=row[1])
    if not fold:
        return times(x, p, out, beta=row[0])
    p.diagonal(dim1=-2, dim2=-1).add_(row[0])
    return times(x, p, out)


def iterate(x: torch.Tensor, schedule: Sequence[Coefficients], gram: torch.Tensor | None, ops: Products,
            out: torch.Tensor | None = None, partner: torch.Tensor | None = None) -> torch.Tensor:
    """Apply ``X ← c₀X + (Σ_{i≥1} cᵢAⁱ)X``, ``A = XXᵀ``, once per row (``aX + (bA + cA²)X`` for a
    quintic). ``x``: (m, n) or (B, m, n). A :class:`~.schedules.Schedule`'s ``fold_from`` says
    from which iteration on ``c₀`` goes onto the polynomial's diagonal (:func:`step`).

    ``gram``: ``XXᵀ`` of the input if already computed (used by the first iteration; it need not
    be exactly symmetric, e.g. after the AOL rescale, so its square is one GEMM; ``None``: computed).
    ``ops``: the products; where they keep scratch, every intermediate product is written into it.
    ``out``: where the last iteration writes; if it is contiguous, X alternates between ``out``
    and one scratch tensor (:func:`ring_input` says where to put ``x`` so that neither is read
    while written), or ``partner`` where the caller gives one (a buffer of ``out``'s shape and
    dtype that it may lose: the input's own memory, :func:`~.cpu.own_slot`), else between two
    scratch tensors (``"x0"``, ``"x1"``: a transposed ``out`` is written once). Without ``out``
    the result may be scratch, overwritten by the next call with the same shapes. Bitwise the
    same values either way.
    """
    fold_from = getattr(schedule, "fold_from", None)
    last = len(schedule) - 1
    for k, row in enumerate(schedule):
        a = gram_matrix(x, ops) if gram is None else gram
        if out is not None and out.is_contiguous():
            target = out if (last - k) % 2 == 0 else (
                ops.scratch("x", x.shape, x) if partner is None else partner)
        else:
            target = out if k == last and out is not None else ops.scratch(f"x{k % 2}", x.shape, x)
        x = step(x, a, row, ops, target, symmetric=gram is None, overwrite=gram is None,
                 fold=fold_from is not None and k >= fold_from)
        gram = None
    return x


def ring_input(steps: int, out: torch.Tensor, ops: Products, like: torch.Tensor) -> torch.Tensor | None:
    """Where to put the input of :func:`iterate` with ``out`` so that no buffer of X's size is
    held beyond the two it alternates between: of those, the one its first iteration reads, not
    writes (``out`` itself for an even number of ``steps``; for a transposed ``out``, the
    ``"x1"`` scratch); None where ``ops`` keep no scratch."""
    if not out.is_contiguous():
        return ops.scratch("x1", tuple(out.shape), like)
    if steps % 2 == 0:
        return out
    return ops.scratch("x", tuple(out.shape), like)


def iterate_gram(x: torch.Tensor, schedule: Sequence[Coefficients], gram: torch.Tensor | None,
                 restarts: Sequence[int] = GRAM_RESTARTS, *, ops: Products) -> torch.Tensor:
    """Gram Newton–Schulz: the polynomials of :func:`iterate` applied through ``R = XXᵀ`` only.

    Keeps ``X_k = Q X_0`` with ``Q`` a polynomial in ``R_0``: per row ``T = c₀I + Σ cᵢRⁱ``,
    ``Q ← QT`` and ``R ← TRT`` (all m×m, they commute); at a restart ``X ← QX``, ``R ← XXᵀ``.
    Equal to :func:`iterate` in exact arithmetic; ``4m²n`` + O(m³) FLOPs per restart instead of
    ``4m²n`` per iteration. Loses orthogonality in bf16 (spurious negative eigenvalues of ``R``).
    ``ops`` must keep no scratch (``Q`` holds a polynomial across rows).
    """
    if x.size(-2) == x.size(-1):  # square: nothing to save
        return iterate(x, schedule, gram, ops)
    r = gram_matrix(x, ops) if gram is None else gram
    eye = torch.eye(min(x.shape[-2:]), dtype=x.dtype, device=x.device)
    q = None
    n = len(schedule)
    for k, row in enumerate(schedule):
        if k in restarts and q is not None:
            x, q = times(x, q), None
            r = gram_matrix(x, ops)
        t = poly(r, row, ops)
        t = (r * row[1] if t is None else t) + row[0] * eye
        q = t if q is None else q @ t
        if k + 1 < n and (k + 1) not in restarts:
            r = t @ (r @ t)
    return x if q is None else times(x, q)


def run_schedule(y: torch.Tensor, schedule: Sequence[Coefficients], eps: float, ops: Products,
                 gram: torch.Tensor | None = None, out: torch.Tensor | None = None,
                 partner: torch.Tensor | None = None) -> torch.Tensor:
    """Iterate a normalized ``y`` (compute dtype, either orientation) with ``schedule``: the AOL rescale first if
    the schedule asks for it (its Gram matrix feeds the first iteration), in the schedule's form.
    ``y`` may be rescaled in place (it is the caller's normalized copy). ``out``: see
    :func:`iterate` (the Gram form keeps no scratch), and ``partner``, with ``out``, the buffer X
    alternates with (:func:`iterate`; the batch is then run whole). ``gram``: its Gram matrix if
    known. ``ops`` runs a batch whole or one matrix at a time (:meth:`~.products.Products.each_matrix`)."""
    def run(y: torch.Tensor, gram: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor:
        if getattr(schedule, "precondition", "frobenius") == "aol":
            y, gram = aol_scale(y, gram_matrix(y, ops) if gram is None else gram, eps)
        if getattr(schedule, "form", "standard") == "gram":
            result = iterate_gram(y, schedule, gram, ops=ops.without_scratch())
            return result if out is None else out.copy_(result)
        return iterate(y, schedule, gram, ops, out, partner)

    return run(y, gram, out) if partner is not None else ops.each_matrix(run, y, gram, out)


def orthogonalize_matrices(
    x: torch.Tensor,
    schedule: Sequence[Coefficients],
    *,
    dtype: torch.dtype,
    eps: float,
    norm_scale: float = 1.0,
    gram: torch.Tensor | None = None,
    ops: Products,
) -> torch.Tensor:
    """The iteration behind ``newton_schulz`` with a resolved schedule, through the products
    ``ops`` (plain tensor code: traceable by autograd, torch.func and torch.compile;
    :func:`.execution.orthogonalize_matrices` runs it through the products of ``x``'s device).

    A :class:`~.schedules.Schedule` brings its preconditioner and form; a plain tuple of triples
    runs the standard iteration after Frobenius normalization. ``gram``: ``XXᵀ`` of ``x``'s wide
    orientation (``XᵀX`` for tall ``x``), ``(..., k, k)`` with ``k = min(m, n)``, if the caller
    already has it (SSO forms it by a rank-two update); the first iteration then uses it, scaled
    and cast like ``x``, instead of a product.
    """
    check_dtype(schedule, dtype)
    out_dtype, shape = x.dtype, x.shape
    if x.ndim > 3:
        x = x.reshape(-1, *shape[-2:])
        gram = None if gram is None else gram.reshape(-1, *gram.shape[-2:])
    inv = inverse_norm(x, norm_scale, eps, dims=(-2, -1))
    y = (x * inv).to(dtype)
    if gram is not None:
        gram = (gram * inv.square()).to(dtype)
    y = run_schedule(y, schedule, eps, ops, gram=gram)
    return y.to(out_dtype).reshape(shape)
