"""Telemetry of a step: per-matrix figures computed inside the (compiled) update.

A step is measured by passing a :class:`Collector` to ``tx.update(..., metrics=collector)``.
Every transform forwards its ``extra`` keywords (``chain``, ``partition``), and those with
something to say about the step record it, per leaf and per *unit* (a matrix, an expert of a
stack, a block of a head view: :mod:`muon_fn.core.views`), as float32 tensors of shape ``(units,)``:

========================  =================================================  ===========  =======
raw figure                recorded by                                        how          phase
========================  =================================================  ===========  =======
``grad_sumsq``            the caller: Σg² of the update that enters ``tx``   sum          pre
``momentum_sumsq``        :func:`~muon_fn.momentum`: Σb² of the new buffer   sum          pre
``update_sumsq``          the caller: Σu² of the final update                sum          post
``weight_sumsq``          the caller: Σp² of the parameter before the step   sum          post
``ortho_residual``        :func:`~muon_fn.orthogonalize` (see below)         owner        mid
``row_scale_min/max``     :func:`~muon_fn.normalize_rows`: √v + eps range    owner        mid
``shape_scale``           :func:`~muon_fn.scale_by_shape`: s(out, in)        owner        mid
``lr``                    :func:`~muon_fn.scale_by_learning_rate`            same         post
``weight_decay``          :func:`~muon_fn.add_decoupled_weight_decay`:       same         post
                          wd (cautious: wd × the fraction decayed)
``sso_*``                 :func:`~muon_fn.spectral_sphere`: σ, λ, |h|,       owner        mid
                          evaluations, fallback of the unit's solve
========================  =================================================  ===========  =======

"sum" figures are partial sums over the rows a caller holds (all of them on one device; an FSDP
rank's rows, summed over ranks); "owner" figures come from the rank that holds the whole
matrix; "same" figures are equal wherever they are recorded. :func:`figures` turns the raw
records of a leaf into what users read (on the host, after one read of the device): RMS values
``√(Σx²/numel)``, the effective learning rate ``lr·s``, the decay applied ``lr·wd``, NorMuon's
row-scale range ``max/min``, and the rest as recorded.

**Orthogonality residual** ``‖OOᵀ − I‖_F / √m`` of each unit's orthogonalized update ``O``
(``m × n`` in its wide orientation, ``m ≤ n``): the RMS distance of ``OOᵀ``'s rows from the
identity's. Estimated on ``k = min(8, m)`` evenly spaced rows ``S`` of ``OOᵀ − I``
(``O[S]·Oᵀ``, ``2kmn`` FLOPs, exact when ``m ≤ 8``), in float32 from ``O`` as the iteration
returned it (in its compute dtype). A 5-step Muon iteration lands singular values in a band
around 1 rather than at 1, so a healthy value is not 0 (measured, :func:`with_metrics`: on
Gaussian matrices the default quintic gives 0.32–0.39 on squares from 64² to 768² and 0.26–0.30
on 4:1 ones, Polar Express 0.17–0.22 on those squares and 0.17–0.18 on 4:1 ones; on the tiny GPT of
``muon-fn train --quick`` each matrix's is 0.39–0.87 at the first step and 0.33–0.62 after step
100). A value near 1 means most singular values are far from 1: a near rank-deficient gradient,
or an iteration in too low a precision.

Recording is Python at trace time: with no collector (``metrics`` absent, the default) nothing
of this runs, so an unmeasured step is the same graph as one without telemetry.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from . import tree as _tree, views as _views

# How each raw figure combines over the ranks of an FSDP step (see the module doc).
SUM, OWNER, SAME = "sum", "owner", "same"
KINDS = {"grad_sumsq": SUM, "momentum_sumsq": SUM, "update_sumsq": SUM, "weight_sumsq": SUM,
         "ortho_residual": OWNER, "row_scale_min": OWNER, "row_scale_max": OWNER, "shape_scale": OWNER,
         "lr": SAME, "weight_decay": SAME, "sso_sigma": OWNER, "sso_lambda": OWNER, "sso_residual": OWNER,
         "sso_iterations": OWNER, "sso_fallback": OWNER}
RESIDUAL_ROWS = 8  # k of the orthogonality residual's estimate


class Leaf(NamedTuple):
    """What the collector needs to know of a leaf: the whole parameter's shape, its matrix view,
    the first of the whole parameter's rows (:func:`muon_fn.core.views.rows`) the leaf holds (0
    unless the leaf is an FSDP rank's rows), and, for a leaf that holds some of the parameter's
    units whole (an FSDP owner's experts of a stack), their positions among its units."""

    shape: tuple[int, ...]
    view: Any = "flatten"  # a view name or a Heads; ignored for ndim < 2
    start: int = 0
    units: tuple[int, ...] | None = None


def leaf_of(p: torch.Tensor, view: Any = "flatten") -> Leaf:
    """The :class:`Leaf` of a whole parameter ``p`` read through ``view``."""
    return Leaf(tuple(p.shape), view if p.ndim >= 2 else "flatten", 0)


def unit_count(leaf: Leaf) -> int:
    """How many units the leaf's tensor holds (its figures' length)."""
    if leaf.units is not None:
        return len(leaf.units)
    return 1 if len(leaf.shape) < 2 else len(_views.units(leaf.shape, leaf.view))


def unit_numels(leaf: Leaf) -> list[int]:
    """Each unit's number of elements (the whole leaf's for ndim < 2)."""
    if len(leaf.shape) < 2:
        return [math.prod(leaf.shape)]
    return [m * n for m, n in _views.unit_shapes(leaf.shape, leaf.view)]


class Collector:
    """The raw figures of one update of a tree whose leaves are described by ``leaves`` (a
    :class:`Leaf` per leaf of the tree, in its flattened order; None for a leaf without one)."""

    def __init__(self, leaves: tuple[Leaf | None, ...]) -> None:
        self.leaves = leaves
        self.raw: list[dict[str, torch.Tensor]] = [{} for _ in leaves]

    # ------------------------------------------------------------------ recording
    def put(self, name: str, index: int, value: torch.Tensor) -> None:
        """Record ``value`` (``(units,)`` or a scalar, broadcast to the leaf's units) as ``name`` of leaf ``index``."""
        leaf = self.leaves[index]
        if leaf is None:
            return
        value = value.detach().float().reshape(-1)
        self.raw[index][name] = value.expand(unit_count(leaf)) if value.numel() == 1 else value

    def each(self, name: str, tree: Any, fn: Callable[[torch.Tensor, int], torch.Tensor]) -> None:
        """Record ``fn(leaf_tensor, index)`` as ``name`` for every non-None leaf of ``tree``."""
        for i, x in enumerate(_tree.tree_leaves(tree)):
            if x is not None and self.leaves[i] is not None:
                self.put(name, i, fn(x, i))

    def sumsq(self, name: str, tree: Any) -> None:
        """Record Σx² of every unit of every leaf of ``tree`` (rows a leaf holds only)."""
        def one(x: torch.Tensor, i: int) -> torch.Tensor:
            leaf = self.leaves[i]
            assert leaf is not None  # each calls fn only for a leaf with a Leaf
            return unit_sumsq(x, leaf)

        self.each(name, tree, one)

    def scalar(self, name: str, tree: Any, value: Any) -> None:
        """Record the same scalar (a float or a 0-d tensor) for every non-None leaf of ``tree``."""
        self.each(name, tree, lambda x, i: torch.as_tensor(value, dtype=torch.float32, device=x.device))

    def result(self) -> tuple[dict[str, torch.Tensor] | None, ...]:
        """The raw figures, one dict per leaf (None for a leaf without a :class:`Leaf`)."""
        return tuple(None if leaf is None else dict(raw) for leaf, raw in zip(self.leaves, self.raw))


def collector_of(extra: dict[str, Any]) -> Collector | None:
    """The collector a transform's ``update`` received in its ``extra`` keywords, if any."""
    collector = extra.get("metrics")
    return collector if isinstance(collector, Collector) else None


def unit_sumsq(x: torch.Tensor, leaf: Leaf) -> torch.Tensor:
    """Σx² per unit of the rows of ``leaf``'s whole parameter that ``x`` holds (``(units,)``,
    float32; zero for a unit with none of ``x``'s rows). ``x`` may hold some of the columns only
    (tensor parallel): then a unit's sum is over those, and a view that cuts columns into units
    gets nan (which columns ``x`` holds is not known here)."""
    if len(leaf.shape) < 2:
        return x.float().square().sum().reshape(1)
    rows = x.float().reshape(_views.rows_shape(x.shape, leaf.view))
    units = _views.units(leaf.shape, leaf.view)
    whole_width = rows.shape[1] == _views.rows_shape(leaf.shape, leaf.view)[1]
    if not whole_width and _views.column_blocks(leaf.shape, leaf.view) > 1:
        return torch.full((len(units),), math.nan, device=x.device)
    if len(units) == 1 and leaf.start == 0 and rows.shape[0] == units[0].shape[0]:
        return rows.square().sum().reshape(1)
    sums = []
    stop = leaf.start + rows.shape[0]
    for r, c in units:
        a, b = max(r.start, leaf.start), min(r.stop, stop)
        cols = c if whole_width else slice(None)
        part = rows[a - leaf.start:b - leaf.start, cols] if a < b else rows[:0, cols]
        sums.append(part.square().sum())
    return torch.stack(sums)


# ---------------------------------------------------------------------- what users read
def figures(raw: dict[str, torch.Tensor] | dict[str, list[float]], leaf: Leaf) -> dict[str, list[float]]:
    """The figures users read from one leaf's raw records (host values, one per unit)."""
    vals = {k: (v.tolist() if isinstance(v, torch.Tensor) else list(v)) for k, v in raw.items()}
    numels = unit_numels(leaf)
    out: dict[str, list[float]] = {}
    for key in ("grad", "momentum", "update", "weight"):
        if f"{key}_sumsq" in vals:
            out[f"{key}_rms"] = [math.sqrt(max(s, 0.0) / n) if n else 0.0 for s, n in zip(vals[f"{key}_sumsq"], numels)]
    lr = vals.get("lr")
    if lr is not None:
        out["effective_lr"] = [a * b for a, b in zip(lr, vals.get("shape_scale", [1.0] * len(lr)))]
        if "weight_decay" in vals:
            out["decay"] = [a * b for a, b in zip(lr, vals["weight_decay"])]
    if "ortho_residual" in vals:
        out["ortho_residual"] = vals["ortho_residual"]
    if "row_scale_min" in vals:
        out["row_scale_range"] = [hi / lo if lo > 0 else math.inf
                                  for lo, hi in zip(vals["row_scale_min"], vals["row_scale_max"])]
    for key in ("sigma", "lambda", "residual", "iterations", "fallback"):
        if f"sso_{key}" in vals:
            out[f"sso_{key}"] = vals[f"sso_{key}"]
    return out


# ---------------------------------------------------------------------- the orthogonality residual
def residual(o: torch.Tensor) -> torch.Tensor:
    """``‖OOᵀ − I‖_F / √m`` of each matrix of a batch ``(B, m, n)`` in its wide orientation
    (``m = min``: ``OᵀO`` of a tall batch), estimated on ``min(8, m)`` evenly spaced rows (module
    doc); ``(B,)`` float32. A tall batch is read as it is laid out (no transposed copy)."""
    tall = o.shape[-2] > o.shape[-1]
    m = min(o.shape[-2:])
    k = min(RESIDUAL_ROWS, m)
    rows = [(i * m) // k for i in range(k)]
    o32 = o.float()
    # (B, k, m): rows S of OOᵀ (wide), or of OᵀO (tall)
    gram_rows = o32[:, :, rows].mT @ o32 if tall else o32[:, rows, :] @ o32.mT
    eye = torch.zeros(k, m, dtype=torch.float32, device=o.device)
    eye[range(k), rows] = 1.0
    return (gram_rows - eye).square().sum(dim=(-2, -1)).div(k).sqrt()


# ---------------------------------------------------------------------- measuring an update
def measured_update(tx: Any, updates: Any, state: Any, params: Any, leaves: tuple[Leaf | None, ...],
                    grads: Any = None) -> tuple[Any, Any, tuple]:
    """``tx.update`` with a :class:`Collector`: ``(updates, new state, raw figures)``. Records the
    sums of squares of ``grads`` (default: ``updates``, the update entering ``tx``), of the
    parameters that get an update, and of the result."""
    collector = Collector(leaves)
    collector.sumsq("grad_sumsq", updates if grads is None else grads)
    if params is not None:
        collector.sumsq("weight_sumsq", _tree.tree_map(lambda u, p: None if u is None else p, updates, params))
    out, new_state = tx.update(updates, state, params, metrics=collector)
    collector.sumsq("update_sumsq", out)
    return out, new_state, collector.result()


class MetricsState(NamedTuple):
    """State of :func:`with_metrics`."""

    inner: Any  # the wrapped transform's state
    raw: Any  # per leaf of the params' tree: {raw figure: (units,) float32}, of the last measured step


def leaves_of(params: Any, view: Any = "flatten") -> tuple[Leaf | None, ...]:
    """A :class:`Leaf` per leaf of ``params`` (whole parameters; ``view`` a name, a Heads or a
    function ``leaf -> view`` for the leaves of ndim ≥ 2)."""
    return tuple(None if p is None else leaf_of(p, _views.view_of(view, p) if p.ndim >= 2 else "flatten")
                 for p in _tree.tree_leaves(params))


def with_metrics(tx: Any, *, view: Any = "flatten") -> Any:
    """``tx`` with telemetry: every update called with ``measure=True`` (the default) also
    records the step's figures (module doc) in the state, ``MetricsState(inner, raw)``; one
    called with ``measure=False`` runs ``tx`` alone and keeps the last figures (two compiled
    graphs at most: ``measure`` is static). :func:`read_metrics` turns the state into a flat
    ``{name: float}`` dict. ``view`` (as :func:`muon_fn.orthogonalize`'s) says what a unit is for
    the figures of elementwise quantities (RMS of the gradient, the momentum, the update).

    The figures, per unit (a matrix, an expert of a stack, a block of a head view), are the
    same for the optimizers' ``metrics=`` (:class:`muon_fn.Optimizer`, "Telemetry", names them):

    | figure | what it is |
    |---|---|
    | ``grad_rms``, ``momentum_rms``, ``update_rms``, ``weight_rms`` | RMS of the unit's gradient (as it came), momentum buffer (Adam's first moment for AdamW parameters), final update ``Δp``, and weight before the step |
    | ``effective_lr`` | ``lr·s(out, in)``: the learning rate after the shape scale (SSO: ``lr·s`` of its ``scale_mode``) |
    | ``decay`` | ``lr·wd``, the relative shrink of the weight this step (cautious decay: times the fraction of entries it reached) |
    | ``ortho_residual`` | ``‖OOᵀ − I‖_F/√m`` of the orthogonalized update ``O`` (``m × n``, ``m ≤ n``), estimated on ``k = min(8, m)`` evenly spaced rows (exact for ``m ≤ 8``), in float32 from ``O`` in its iteration dtype. A 5-step iteration lands singular values in a band around 1, so a healthy value is not 0: on Gaussian matrices the default quintic gives 0.32–0.39 on squares (64² to 768²) and 0.26–0.30 on 4:1 ones, Polar Express 0.17–0.22 and 0.17–0.18; on the tiny GPT of ``muon-fn train --quick`` each matrix's is 0.39–0.87 at step 1 and 0.33–0.62 after step 100. Near 1, most singular values are far from 1 (a near rank-deficient gradient, an iteration in too low a precision) |
    | ``row_scale_range`` | NorMuon: the largest over the smallest row divisor ``√v + eps`` of the unit |
    | ``sso_sigma``, ``sso_lambda``, ``sso_residual``, ``sso_iterations``, ``sso_fallback`` | SSO: σ(W) before the retraction, λ*, the tangency error abs(h(λ*)), msign evaluations, whether λ fell back to 0 |

    The cost is a few fused reductions per matrix and ``2·8·m·n`` FLOPs for the residual."""  # noqa: E501  (a table's rows)
    from .base import GradientTransformation, info, named, with_info

    def init(params):
        inner = tx.init(params)
        meta = _tree.tree_map(lambda p: None if p is None else torch.empty_like(p, device="meta"), params)
        _, _, raw = measured_update(tx, meta, tx.init(meta), meta, leaves_of(meta, view))
        device = next((p.device for p in _tree.tree_leaves(params) if p is not None), None)
        fresh = tuple(None if r is None else {k: torch.full(v.shape, math.nan, device=device) for k, v in r.items()}
                      for r in raw)
        return MetricsState(inner, fresh)

    def update(updates, state, params=None, *, measure: bool = True, **extra):
        if not measure:
            out, inner = tx.update(updates, state.inner, params, **extra)
            return out, MetricsState(inner, state.raw)
        like = params if params is not None else updates
        out, inner, raw = measured_update(tx, updates, state.inner, params, leaves_of(like, view))
        kept = tuple(old if new is None else {k: new.get(k, v) for k, v in old.items()}
                     for old, new in zip(state.raw, raw))
        return out, MetricsState(inner, kept)

    wrapped = named(GradientTransformation(init, update), f"with_metrics({tx!r})")
    return with_info(wrapped, **{**info(tx)._asdict(), "leafwise": False, "parts": ()})


def read_metrics(state: MetricsState, params: Any, *, view: Any = "flatten") -> dict[str, float]:
    """The figures of :func:`with_metrics`'s last measured step as ``{"<path>/<figure>": value}``
    (``"<path>[j]/<figure>"`` for unit j of a leaf with several): one device-to-host copy
    (:func:`host_floats`)."""
    paths, leaves, _ = _tree.tree_flatten_with_path(params)
    infos = leaves_of(params, view)
    values = iter(host_floats([v for raw in state.raw for v in (raw or {}).values()]))
    out: dict[str, float] = {}
    for path, info, raw in zip(paths, infos, state.raw):
        if raw is None or info is None:
            continue
        host = {k: [next(values) for _ in range(v.numel())] for k, v in raw.items()}
        out.update(flat_names(".".join(str(k) for k in path) or "params", figures(host, info)))
    return out


def host_floats(tensors: list[torch.Tensor]) -> list[float]:
    """Every element of ``tensors``, in order, as Python floats: the tensors of each device are
    concatenated there and copied to the host at once (one read per device, not per tensor)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t.detach().reshape(-1).float())
    host = {d: iter(torch.cat(ts).tolist()) for d, ts in by_device.items()}
    return [next(host[t.device]) for t in tensors for _ in range(t.numel())]


def flat_names(name: str, figs: dict[str, list[float]]) -> dict[str, float]:
    """``{name/figure: value}``, with ``name[j]`` for unit j where a leaf has several units."""
    out = {}
    for figure, values in figs.items():
        for j, v in enumerate(values):
            out[f"{name}/{figure}" if len(values) == 1 else f"{name}[{j}]/{figure}"] = float(v)
    return out
