"""Muon-specific transforms: ``orthogonalize`` (msign of each matrix), ``scale_by_shape`` and
``align_rms`` (AdaMuon's RMS alignment)."""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from . import checks as _checks, metrics as _metrics, newton_schulz as _newton_schulz, tree as _tree, views as _views
from .base import MATRIX, GradientTransformation, donated, init_empty_state, named, with_info
from .metrics import collector_of
from .views import View, matrix_shape

SHAPE_RULES = ("keller", "original", "match_rms_adamw", "spectral", "legacy", "none")
# What the recipes' and optimizers' adjust_lr_fn accepts: None is torch.optim.Muon's default,
# "original" (= "keller").
ADJUST_LR_FNS = (None, *SHAPE_RULES)


def shape_rule(adjust_lr_fn: str | None) -> str:
    """The :func:`scale_by_shape` rule of an ``adjust_lr_fn`` (``None`` is ``"original"``, as in
    torch.optim.Muon)."""
    _checks.one_of("adjust_lr_fn", adjust_lr_fn, ADJUST_LR_FNS)
    return rule_of(adjust_lr_fn)


def rule_of(adjust_lr_fn: str | None) -> str:
    """:func:`shape_rule` of a checked ``adjust_lr_fn``."""
    return "original" if adjust_lr_fn is None else adjust_lr_fn


def shape_scale(rule: str, shape: Sequence[int], *, view: str = "flatten") -> float:
    """The update multiplier of ``rule`` for each matrix ``(out, in)`` of a weight of global
    ``shape`` read through ``view`` (:mod:`muon_fn.core.views`: ``"flatten"`` or ``"experts"``).

    ``keller``/``original`` √max(1, out/in); ``match_rms_adamw`` 0.2·√max(out, in) (update RMS 0.2);
    ``spectral`` √(out/in); ``legacy`` √max(out, in); ``none`` 1.
    """
    out, inp = matrix_shape(shape, view)
    if out == 0 or inp == 0:  # an empty matrix: nothing to scale
        return 1.0
    if rule in ("keller", "original"):
        return math.sqrt(max(1.0, out / inp))
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(out, inp))
    if rule == "spectral":
        return math.sqrt(out / inp)
    if rule == "legacy":
        return math.sqrt(max(out, inp))
    if rule == "none":
        return 1.0
    _checks.one_of("rule", rule, SHAPE_RULES)
    raise AssertionError  # unreachable


def refuse_split(split: Any, where: str = "view") -> None:
    """``split=`` (row blocks for a whole transform or group) is gone: a head view says it per
    parameter."""
    if split is not None:
        raise TypeError(
            f"split= was removed: row blocks are a head view now, given per parameter: "
            f"{where}=muon_fn.heads(rows={split!r}) for one transform's leaves, or "
            f"matrix_view={{name: muon_fn.heads(rows=...)}} in an optimizer (cols= cuts columns)")


def _not_matrix(shape: Sequence[int], who: str, where: str = "") -> ValueError:
    return ValueError(
        f"{who} only supports matrices (ndim >= 2) whereas we found a leaf{where} with size: "
        f"{tuple(shape)}. Route 0-/1-D parameters (biases, norms) to another transform with "
        "muon_fn.partition, e.g. muon_fn.hybrid(...), or use muon_fn.MuonOptimizer / "
        "muon_fn.create_hybrid_optimizer, which do this for you."
    )


def _path_str(path: tuple) -> str:
    return "".join(f"[{k!r}]" for k in path) or "the root"


def group_by(keys: Sequence[Hashable], cap: int | None = None) -> list[list[int]]:
    """The one batching rule: indices of equal ``keys`` grouped in order of first appearance,
    each group cut into consecutive chunks of at most ``cap`` (``None``: no limit).

    ``orthogonalize`` batches equal matrix shapes with it, the adapters cut a parameter
    group into buckets with it, and the FSDP owner batches the matrices it computes with it."""
    groups: dict[Hashable, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    if cap is None:
        return list(groups.values())
    return [members[k:k + cap] for members in groups.values() for k in range(0, len(members), cap)]


def resolve_method(
    method: str | None,
    steps: int | None,
    *,
    coefficients: Sequence[Sequence[float]] | Sequence[float] | None = None,
    stepsize: float = 1.0,
) -> tuple[_newton_schulz.Schedule, float]:
    """``(schedule, norm_scale)`` that :func:`orthogonalize` runs for a named ``method``.

    ``method=None``: :data:`~muon_fn.core.newton_schulz.DEFAULT_METHOD`, or with ``coefficients``
    exactly their plain iteration (Frobenius normalization, no preconditioner, no safety factor:
    torch.optim.Muon's with its ``ns_coefficients``)."""
    if method is not None:
        _checks.one_of("method", method, _newton_schulz.METHODS)
    schedule = _newton_schulz.coefficient_schedule(method, steps, coefficients=coefficients, stepsize=stepsize)
    return schedule, 1.0 if coefficients is not None else _newton_schulz.norm_scale(method)


def _units(u: torch.Tensor, path: tuple, view: _views.Heads | str) -> list[torch.Tensor]:
    """The matrices ``orthogonalize`` sees in leaf ``u``: the units of its ``view``."""
    if u.ndim < 2:
        raise _not_matrix(u.shape, "orthogonalize", f" at {_path_str(path)}")
    return _views.split(u, view)


def view_argument(view: View, flatten: bool | None) -> View:
    """``view``, or the view named by ``flatten=``, its older spelling (``True``: ``"flatten"``,
    ``False``: ``"experts"``)."""
    check_view_argument(view, flatten)
    return resolve_view(view, flatten)


def check_view_argument(view: View, flatten: bool | None) -> None:
    """:func:`view_argument`'s checks."""
    _views.check_view(view)
    if flatten is None:
        return
    if not isinstance(flatten, bool):
        raise TypeError(f"Invalid flatten: {flatten!r} (expected True or False)")
    if view != "flatten":
        raise ValueError(f"pass view={view!r} alone: flatten= is its older spelling "
                         "(flatten=True is view='flatten', flatten=False is view='experts')")


def resolve_view(view: View, flatten: bool | None) -> View:
    """:func:`view_argument` of checked arguments."""
    return view if flatten is None else ("flatten" if flatten else "experts")


def _is_custom(method: Any) -> bool:
    """A user's iteration (a callable), not a named method."""
    return callable(method) and not isinstance(method, str)


def _check_orthogonalize(method: Any, steps: int | None, coefficients: Any, dtype: torch.dtype | None, eps: float,
                         stepsize: float, view: View, split: Any, batch: Any, flatten: bool | None) -> None:
    """:func:`orthogonalize`'s arguments, in the order its iteration resolves them."""
    custom = _is_custom(method)
    rows_checked = steps is None and coefficients is not None and not custom
    if steps is None:
        steps = _newton_schulz.default_steps(method, None if custom else coefficients)  # checks coefficients
    _checks.positive_int("steps", steps)
    refuse_callable_coefficients(method, coefficients)
    if not custom:
        if method is not None:
            _checks.one_of("method", method, _newton_schulz.METHODS)
        _checks.positive("stepsize", stepsize)
        if coefficients is not None and not rows_checked:
            _newton_schulz.validate_coefficients(coefficients)
    _checks.positive("eps", eps)
    check_iteration_dtype(method, steps, coefficients, dtype, stepsize)
    check_view_argument(view, flatten)
    refuse_split(split)


def refuse_callable_coefficients(method: Any, coefficients: Any) -> None:
    """A callable ``method`` runs its own iteration: it takes no ``coefficients``."""
    if _is_custom(method) and coefficients is not None:
        raise ValueError("Invalid coefficients: a callable method runs its own iteration; pass "
                         "coefficients with method=None (or a named method) instead")


def check_iteration_dtype(method: Any, steps: int | None, coefficients: Any, dtype: torch.dtype | None,
                          stepsize: float) -> None:
    """A named method's iteration ``dtype`` (the other arguments checked already): a compute
    dtype that can run its schedule (not the Gram form in bf16)."""
    if dtype is None or _is_custom(method):
        return
    _checks.dtype("dtype", dtype, _newton_schulz.COMPUTE_DTYPES)
    _newton_schulz.check_dtype(_iteration(method, steps, coefficients, stepsize)[1], dtype)


def _iteration(method: Any, steps: int | None, coefficients: Any, stepsize: float) -> tuple[int, Any, Any]:
    """``(steps, schedule, norm scale)`` that :func:`orthogonalize` runs for checked arguments
    (``schedule`` and the scale are ``None`` for a callable method)."""
    custom = _is_custom(method)
    if steps is None:
        steps = _newton_schulz.default_steps.build(method, None if custom else coefficients)
    if custom:
        return steps, None, None
    schedule = _newton_schulz.coefficient_schedule.build(method, steps, coefficients=coefficients, stepsize=stepsize)
    return steps, schedule, 1.0 if coefficients is not None else _newton_schulz.norm_scale(method)


# Longer than 80 lines only for its Args docstring (the public reference of every option);
# the code after it is 53 lines.
@_checks.checked(_check_orthogonalize)
def orthogonalize(
    method: str | Callable[[torch.Tensor], torch.Tensor] | None = None,
    steps: int | None = None,
    *,
    coefficients: Sequence[Sequence[float]] | Sequence[float] | None = None,
    dtype: torch.dtype | None = None,
    eps: float = 1e-7,
    stepsize: float = 1.0,
    view: View = "flatten",
    split: None = None,
    batch: bool = True,
    flatten: bool | None = None,
) -> GradientTransformation:
    """Replace each matrix update ``G`` by an approximation of ``msign(G) = UVᵀ``.

    Args:
      method: ``None`` (default: :data:`~muon_fn.core.newton_schulz.DEFAULT_METHOD`, ``"quintic"``, or
        the plain iteration of ``coefficients`` when they are given), ``"quintic"`` (Keller's,
        torch.optim.Muon's), ``"polar_express"``, ``"aol9"``, ``"you"``, ``"cubic"``, ``"aol"``,
        ``"gram"``, or a callable
        ``(B, m, n) -> (B, m, n)`` applied to each batch of equal-shape wide matrices (traced as
        is under ``torch.compile``).
      steps: iterations; ``None``: what the method is designed for (4 for ``"aol9"`` and
        ``"aol"``, else 5), or with ``coefficients`` their length (5 for a single triple).
      coefficients: a custom schedule: one ``(a, b, c)`` (torch.optim.Muon's ``ns_coefficients``,
        every iteration) or one triple per iteration (the last repeats). Without ``method`` they
        run exactly as given: Frobenius normalization, no preconditioner, no safety factor; with
        a named ``method`` they replace its rows and keep its preconditioner and form.
      dtype: iteration dtype; ``None`` = the device default
        (:func:`~muon_fn.core.newton_schulz.default_compute_dtype`: bf16, fp32 on CPUs without bf16 GEMMs;
        for ``"gram"`` fp16 on GPUs and fp32 on the CPU).
      eps: the normalization is ``X / max(‖X‖_F, eps)`` (torch.optim.Muon's; zero in → zero
        out, never NaN).
      stepsize: damping η of each iteration, ``X ← X + η(p(X) − X)``.
      view: how a leaf is read as matrices (:mod:`muon_fn.core.views`): ``"flatten"`` (default: one
        matrix ``(out, prod(rest))``, conv kernels folded into ``in``), ``"experts"`` (leading
        dims are a batch: an expert stack ``(E, out, in)`` is E matrices), a head view
        :func:`muon_fn.heads` (row or column blocks of each matrix, each orthogonalized on its own;
        it must fit every leaf), or a function ``leaf -> view``. Pass :func:`scale_by_shape` the
        same view.
      split: removed; a ``TypeError`` says to use ``view=muon_fn.heads(rows=...)``.
      batch: orthogonalize equal shapes together (one batched call); False: one at a time.
        The result of a matrix is the same either way (every step is computed per matrix).
      flatten: the older spelling of ``view``: ``True`` is ``"flatten"``, ``False`` ``"experts"``.

    A named method runs as one operator per batch (:func:`~muon_fn.core.newton_schulz.msign_batch`):
    under ``torch.compile`` it stays one opaque call to the tuned eager iteration.
    """
    custom = _is_custom(method)
    steps, schedule, scale = _iteration(method, steps, coefficients, stepsize)
    view = resolve_view(view, flatten)
    msign = _msign_of(method, schedule, scale, dtype, eps) if not custom else _custom_msign(method)

    def update(updates, state, params=None, **extra):
        del params
        return _orthogonalize_tree(updates, view, batch, msign, collector_of(extra), donated(extra)), state

    if coefficients is None and method is None:
        method = _newton_schulz.DEFAULT_METHOD  # named in the repr
    config: dict[str, Any] = {"method": getattr(method, "__name__", method) if custom else method,
                              "steps": steps}
    if coefficients is not None:
        config["coefficients"] = _newton_schulz.coefficient_rows(coefficients)
    config.update(dtype=dtype, eps=eps, stepsize=stepsize, view=_views.label(view))
    tx = named(GradientTransformation(init_empty_state, update), "orthogonalize", **config)
    # per_matrix: the operator computes every step per matrix (a callable method sees its batch).
    return with_info(tx, leafwise=True, scope=MATRIX, per_matrix=not custom)


def _custom_msign(method: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., torch.Tensor]:
    """A user's iteration on one group of equal shapes, stacked in the wide orientation; the
    results in the group's orientation."""
    def msign(group: list[torch.Tensor], consume: bool = False) -> torch.Tensor:
        del consume  # the stack is a copy
        tall = group[0].size(-2) > group[0].size(-1)
        out = method(torch.stack([x.mT if tall else x for x in group]))
        return out.mT if tall else out
    return msign


def _msign_of(method: Any, schedule: Any, scale: float, dtype: torch.dtype | None,
              eps: float) -> Callable[..., torch.Tensor]:
    """A named method's iteration on one group of equal shapes: the ``(B, *shape)`` results in
    the group's orientation, in the compute dtype (``dtype``, or the device's default);
    ``consume``: the group's tensors are donated (:func:`muon_fn.core.base.donated`), and the
    operator casts them itself, in their memory (the same values)."""
    def msign(group: list[torch.Tensor], consume: bool = False) -> torch.Tensor:
        compute = dtype or _newton_schulz.default_compute_dtype(group[0].device, schedule)
        if consume:
            return _newton_schulz.msign_batch(group, schedule, dtype=compute, eps=eps, norm_scale=scale,
                                              consume=True)
        if compute.itemsize < group[0].dtype.itemsize:
            # Cast first, as torch.optim.Muon does (G.bfloat16(), then normalize): compiled, the
            # update that enters the iteration is materialized in the compute dtype (half the
            # bytes of an fp32 one), its producer (the momentum) fused with the cast.
            group = [x.to(compute) for x in group]
        return _newton_schulz.msign_batch(group, schedule, dtype=compute, eps=eps, norm_scale=scale)
    return msign


def _orthogonalize_tree(updates: Any, view: View, batch: bool, msign: Callable[..., torch.Tensor],
                        collector: Any = None, consume: bool = False) -> Any:
    """Every matrix of every leaf of ``updates`` (as its view reads it) replaced by its msign,
    equal shapes in one batch (``batch``) or one at a time; with a ``collector``, each
    unit's orthogonality residual recorded (:func:`muon_fn.core.metrics.residual`); ``consume``:
    the updates are donated, and the iteration may use their memory."""
    paths, leaves, spec = _tree.tree_flatten_with_path(updates)
    views = [None if u is None or u.ndim < 2 else _views.view_of(view, u) for u in leaves]
    units = [[] if u is None else _units(u, path, v) for path, u, v in zip(paths, leaves, views)]
    flat = [(i, j) for i, us in enumerate(units) for j in range(len(us))]
    # one batch per shape (a tall and a wide matrix of one wide shape are two: results come back
    # in their inputs' orientation), dtype and device
    keys = [(tuple(units[i][j].shape), units[i][j].dtype, units[i][j].device) for i, j in flat]
    results = [list(us) for us in units]
    residuals = [[None] * len(us) for us in units]
    for members in group_by(keys, None if batch else 1):
        batch_out = msign([units[i][j] for i, j in (flat[k] for k in members)], consume)
        res = None if collector is None else _metrics.residual(batch_out)
        for n, (k, o) in enumerate(zip(members, batch_out.unbind(0))):
            i, j = flat[k]
            results[i][j] = o
            if res is not None:
                residuals[i][j] = res[n]
    if collector is not None:
        for i, rs in enumerate(residuals):
            if rs:
                collector.put("ortho_residual", i, torch.stack(rs))
    out_leaves = [None if u is None else _views.join(outs, u, v).to(u.dtype)
                  for u, outs, v in zip(leaves, results, views)]
    return _tree.tree_unflatten(spec, out_leaves)


def _check_scale_by_shape(rule: Any, view: View, split: Any) -> None:
    _checks.one_of("rule", rule, SHAPE_RULES)
    _views.check_view(view)
    refuse_split(split)


@_checks.checked(_check_scale_by_shape)
def scale_by_shape(rule: str = "keller", *, view: View = "flatten", split: None = None) -> GradientTransformation:
    """Multiply each matrix update by ``shape_scale(rule, (out, in))`` of its (global) shape.

    ``view`` says what a matrix is (:func:`orthogonalize`'s: ``"flatten"``, ``"experts"``, a head
    view :func:`muon_fn.heads` or a function ``leaf -> view``): under ``"experts"`` each matrix of
    a stack gets the scale of its own ``(out, in)``, under a head view each block its own.
    ``split`` is removed (use a head view).
    """

    def scale(u: torch.Tensor) -> torch.Tensor:
        if u.ndim < 2:
            raise _not_matrix(u.shape, "scale_by_shape")
        leaf_view = _views.view_of(view, u)
        scales = [shape_scale(rule, s) for s in _views.unit_shapes(u.shape, leaf_view)]
        if len(set(scales)) <= 1:  # one matrix, or all of one shape (an expert stack)
            return u * (scales[0] if scales else shape_scale(rule, u.shape, view=leaf_view))
        return _views.join([b * s for b, s in zip(_views.split(u, leaf_view), scales)], u, leaf_view)

    def update(updates, state, params=None, **extra):
        del params
        collector = _metrics.collector_of(extra)
        if collector is not None:
            collector.each("shape_scale", updates, lambda u, i: torch.tensor(
                [shape_scale(rule, sh) for sh in _views.unit_shapes(u.shape, _views.view_of(view, u))],
                dtype=torch.float32, device=u.device))
        return _tree.tree_map(lambda u: None if u is None else scale(u), updates), state

    tx = named(GradientTransformation(init_empty_state, update), "scale_by_shape", rule=rule,
               view=_views.label(view))
    return with_info(tx, leafwise=True, scope=MATRIX, per_matrix=True)


def _check_align_rms(eps: Any, view: View) -> None:
    _checks.positive("eps", eps)
    _views.check_view(view)


@_checks.checked(_check_align_rms)
def align_rms(eps: float = 1e-8, *, view: View = "flatten") -> GradientTransformation:
    """Rescale each matrix ``U`` (m×n) to the size of an exactly orthogonal m×n matrix:

    ``U ← U · √min(m, n) / max(‖U‖_F, eps)``

    so its RMS is ``1/√max(m, n)``, the RMS of ``msign`` — whatever a preceding normalization (the
    element-wise second moment, :func:`muon_fn.scale_by_second_moment`) did to its size — and a
    :func:`scale_by_shape` rule after it scales it as it scales ``msign``. With
    ``scale_by_shape("match_rms_adamw")`` (0.2·√max(m, n)) the product is AdaMuon's RMS-aligned
    rescaling ``γ = 0.2·√(mn) / ‖Ô‖_F`` (Si et al., *AdaMuon: Adaptive Muon Optimizer*,
    arXiv:2507.11005): the update's RMS is exactly 0.2, Adam's, so Adam's learning rate carries
    over. Zero in, zero out. ``view`` says what a matrix is (:func:`orthogonalize`'s): under
    ``"experts"`` each matrix of a stack, under a head view each block, has its own ``(m, n)`` and
    norm. Computed in float32 (float64 for float64 updates), the norm from float64 sums.
    """

    def align_matrices(x: torch.Tensor) -> torch.Tensor:
        """``x`` ``(count, m, n)`` (contiguous, compute dtype): each matrix aligned."""
        # ‖x‖_F from float64 sums of the (exact) squares: compiled, inductor orders a reduction by
        # the fusion around it, which differs between a whole chain on one device and the FSDP
        # owner's mid phase; in float64 the order no longer shows in the factor, which is
        # rounded to x's dtype (MPS has no float64: there it is summed in x's dtype).
        acc = x.dtype if x.device.type == "mps" else torch.promote_types(x.dtype, torch.float64)
        norm = x.to(acc).square().sum(dim=(-2, -1), keepdim=True).sqrt()
        return x * (math.sqrt(min(x.shape[-2:])) / norm.clamp_min(eps)).to(x.dtype)

    def align(u: torch.Tensor) -> torch.Tensor:
        if u.ndim < 2:
            raise _not_matrix(u.shape, "align_rms")
        compute = torch.promote_types(u.dtype, torch.float32)
        leaf_view = _views.view_of(view, u)
        if isinstance(leaf_view, _views.Heads):
            blocks = [align_matrices(b.to(compute).contiguous().unsqueeze(0))[0]
                      for b in _views.split(u, leaf_view)]
            return _views.join(blocks, u, leaf_view).to(u.dtype)
        x = _views.matrices(u.to(compute).contiguous(), leaf_view)
        return align_matrices(x).reshape(u.shape).to(u.dtype)

    def update(updates, state, params=None, **extra):
        del params, extra
        return _tree.tree_map(lambda u: None if u is None else align(u), updates), state

    tx = named(GradientTransformation(init_empty_state, update), "align_rms", eps=eps, view=_views.label(view))
    # MATRIX: the norm is a whole matrix's. Not per_matrix: compiled, inductor generates the norms
    # for each tensor shape, so a part of a stack could round differently from the whole (as
    # normalize_rows).
    return with_info(tx, leafwise=True, scope=MATRIX)
