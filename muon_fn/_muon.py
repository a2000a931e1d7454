"""Muon-specific transforms: ``orthogonalize`` (msign of each matrix) and ``scale_by_shape``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Callable, Union

import torch

from . import _checks, _orthogonalize, _tree
from ._base import GradientTransformation, init_empty_state, named

# Row split of a fused weight (QKV, gate/up): block sizes along dim 0, or a function of the leaf.
Split = Union[None, Sequence[int], Callable[[torch.Tensor], Union[Sequence[int], None]]]

SHAPE_RULES = ("keller", "original", "match_rms_adamw", "spectral", "legacy", "none")


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """The (out, in) of a weight: ``(shape[0], prod(shape[1:]))`` — conv kernels folded into ``in``."""
    if len(shape) < 2:
        raise ValueError(f"expected a matrix (ndim >= 2), got shape {tuple(shape)}")
    return int(shape[0]), int(math.prod(shape[1:]))


def shape_scale(rule: str, shape: Sequence[int]) -> float:
    """The update multiplier of ``rule`` for a weight of global ``shape``.

    ``keller``/``original`` √max(1, out/in); ``match_rms_adamw`` 0.2·√max(out, in) (update RMS 0.2);
    ``spectral`` √(out/in); ``legacy`` √max(out, in); ``none`` 1.
    """
    out, inp = matrix_shape(shape)
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


def _validate_split(split: Split) -> None:
    if split is None or callable(split):
        return
    if isinstance(split, (str, bytes)) or not all(
        isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in split
    ) or len(split) == 0:
        raise ValueError(f"Invalid split: {split!r} (expected positive row-block sizes or a function)")


def block_sizes(split: Split, leaf: torch.Tensor) -> list[int] | None:
    """Row blocks of ``leaf`` under ``split``; a sequence applies to leaves whose rows it sums to."""
    if split is None:
        return None
    sizes = split(leaf) if callable(split) else split
    if sizes is None:
        return None
    sizes = [int(s) for s in sizes]
    if sum(sizes) != leaf.shape[0]:
        if callable(split):
            raise ValueError(f"split returned {sizes} for a leaf with {leaf.shape[0]} rows")
        return None
    return sizes


def _not_matrix(shape: Sequence[int], who: str, where: str = "") -> ValueError:
    return ValueError(
        f"{who} only supports matrices (ndim >= 2) whereas we found a leaf{where} with size: "
        f"{tuple(shape)}. Route 0-/1-D parameters (biases, norms) to another transform with "
        "muon_fn.partition, e.g. muon_fn.hybrid(...), or use muon_fn.MuonOptimizer / "
        "muon_fn.create_hybrid_optimizer, which do this for you."
    )


def _stack_pays(matrix: torch.Tensor) -> bool:
    """Whether to orthogonalize a same-shape group as one batch.

    Compiled: always (one graph, inductor fuses the stack into the cast). Eager: only below
    ``LOOP_MIN_DIM`` — on CPU large batched GEMMs are slower than a loop of 2-D ones, and the
    stacked fp32/bf16 copies of a whole group cost more (measured on gpt2-small: stack, cast and
    cast-back copies of the 768×3072 group took 2.5 s of a 9.6 s step) than batching saves.
    """
    return torch.compiler.is_compiling() or min(matrix.shape[-2:]) < _orthogonalize.LOOP_MIN_DIM


def _path_str(path: tuple) -> str:
    return "".join(f"[{k!r}]" for k in path) or "the root"


def resolve_method(
    method: str,
    steps: int | None,
    *,
    coefficients: Sequence[Sequence[float]] | None = None,
    stepsize: float = 1.0,
) -> tuple[_orthogonalize.Schedule, float]:
    """``(schedule, norm_scale)`` that :func:`orthogonalize` runs for a named ``method``."""
    _checks.one_of("method", method, _orthogonalize.METHODS)
    schedule = _orthogonalize.coefficient_schedule(method, steps, coefficients=coefficients, stepsize=stepsize)
    return schedule, 1.0 if coefficients is not None else _orthogonalize.norm_scale(method)


def orthogonalize(
    method: Union[str, Callable[[torch.Tensor], torch.Tensor]] = _orthogonalize.DEFAULT_METHOD,
    steps: int | None = None,
    *,
    coefficients: Sequence[Sequence[float]] | None = None,
    dtype: torch.dtype | None = None,
    eps: float = 1e-7,
    stepsize: float = 1.0,
    flatten: bool = True,
    split: Split = None,
    batch: bool = True,
) -> GradientTransformation:
    """Replace each matrix update ``G`` by an approximation of ``msign(G) = UVᵀ``.

    Args:
      method: ``"aol9"`` (default), ``"polar_express"``, ``"quintic"`` (Keller), ``"you"``,
        ``"cubic"``, ``"aol"``, ``"gram"``, or a callable ``(…, m, n) -> (…, m, n)`` applied to each
        (batch of) matrix.
      steps: iterations of the method's coefficient schedule; ``None``: what the method is
        designed for (4 for ``"aol9"`` and ``"aol"``, else 5).
      coefficients: a custom per-iteration schedule of ``(a, b, c)`` triples.
      dtype: iteration dtype; ``None`` = the device default
        (:func:`~muon_fn._orthogonalize.default_compute_dtype`: bf16, fp32 on CPUs without bf16 GEMMs).
      eps: added to the Frobenius norm (zero in → zero out, never NaN).
      stepsize: damping η of each iteration, ``X ← X + η(p(X) − X)``.
      flatten: view N-D leaves as ``(out, prod(rest))``; if False, leading dims are a batch.
      split: row-block sizes of fused weights (each block orthogonalized on its own), or a
        function ``leaf -> sizes | None``.
      batch: stack same-shape matrices into one batched call (compiled, or eager when
        min(m, n) < 384; larger matrices run one at a time in eager mode, which is faster on CPU).
    """
    custom = callable(method) and not isinstance(method, str)
    if steps is None:
        steps = _orthogonalize.default_steps(method)
    _checks.positive_int("steps", steps)
    if not custom:
        schedule, scale = resolve_method(method, steps, coefficients=coefficients, stepsize=stepsize)
    _checks.positive("eps", eps)
    _validate_split(split)

    def msign(x: torch.Tensor) -> torch.Tensor:
        if custom:
            return method(x)
        return _orthogonalize.orthogonalize_matrices(
            x, schedule, dtype=dtype or _orthogonalize.default_compute_dtype(x.device),
            eps=eps, norm_scale=scale,
        )

    def as_matrices(u: torch.Tensor, path: tuple) -> torch.Tensor:
        if u.ndim < 2:
            raise _not_matrix(u.shape, "orthogonalize", f" at {_path_str(path)}")
        if u.ndim > 2 and flatten:
            return u.reshape(matrix_shape(u.shape))
        return u

    def update(updates, state, params=None, **extra):
        del params, extra
        paths, leaves, spec = _tree.tree_flatten_with_path(updates)
        # Cut every leaf into matrices (blocks), orient them wide, group equal shapes.
        blocks: list[list[torch.Tensor]] = []
        groups: dict[tuple, list[tuple[int, int]]] = {}
        for i, u in enumerate(leaves):
            if u is None:
                blocks.append([])
                continue
            m = as_matrices(u, paths[i])
            sizes = block_sizes(split, m)
            parts = list(m.split(sizes, dim=-2 if m.ndim > 2 and not flatten else 0)) if sizes else [m]
            blocks.append(parts)
            for j, b in enumerate(parts):
                wide = b.mT if b.size(-2) > b.size(-1) else b
                key = (tuple(wide.shape), b.dtype, b.device) if batch else (i, j)
                groups.setdefault(key, []).append((i, j))
        results = [list(parts) for parts in blocks]
        for members in groups.values():
            first = blocks[members[0][0]][members[0][1]]
            if len(members) > 1 and _stack_pays(first):
                wides = []
                for i, j in members:
                    b = blocks[i][j]
                    wides.append(b.mT if b.size(-2) > b.size(-1) else b)
                for (i, j), o in zip(members, msign(torch.stack(wides)).unbind(0)):
                    b = blocks[i][j]
                    results[i][j] = o.mT if b.size(-2) > b.size(-1) else o
            else:  # one matrix at a time, in the wide orientation like the batched path
                for i, j in members:
                    b = blocks[i][j]
                    tall = b.size(-2) > b.size(-1)
                    o = msign(b.mT if tall else b)
                    results[i][j] = o.mT if tall else o
        out_leaves = []
        for u, parts in zip(leaves, results):
            if u is None:
                out_leaves.append(None)
                continue
            whole = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2 if parts[0].ndim > 2 and not flatten else 0)
            out_leaves.append(whole.reshape(u.shape))
        return _tree.tree_unflatten(spec, out_leaves), state

    config: dict[str, Any] = {"method": getattr(method, "__name__", method) if custom else method,
                              "steps": steps}
    if coefficients is not None:
        config["coefficients"] = coefficients
    config.update(dtype=dtype, eps=eps, stepsize=stepsize, flatten=flatten)
    if split is not None:
        config["split"] = split
    return named(GradientTransformation(init_empty_state, update), "orthogonalize", **config)


def scale_by_shape(rule: str = "keller", *, split: Split = None) -> GradientTransformation:
    """Multiply each matrix update by ``shape_scale(rule, (out, in))`` of its (global) shape.

    With ``split``, each row block is scaled by its own shape.
    """
    _checks.one_of("rule", rule, SHAPE_RULES)
    _validate_split(split)

    def scale(u: torch.Tensor) -> torch.Tensor:
        if u.ndim < 2:
            raise _not_matrix(u.shape, "scale_by_shape")
        m = u.reshape(matrix_shape(u.shape))
        sizes = block_sizes(split, m)
        if not sizes:
            return u * shape_scale(rule, u.shape)
        parts = [b * shape_scale(rule, b.shape) for b in m.split(sizes, dim=0)]
        return torch.cat(parts, dim=0).reshape(u.shape)

    def update(updates, state, params=None, **extra):
        del params, extra
        return _tree.tree_map(lambda u: None if u is None else scale(u), updates), state

    config: dict[str, Any] = {"rule": rule}
    if split is not None:
        config["split"] = split
    return named(GradientTransformation(init_empty_state, update), "scale_by_shape", **config)


# ----------------------------------------------------------------------------- in-place eager step
def inplace_supported(param: torch.Tensor) -> bool:
    """Whether :func:`muon_step_` can update ``param`` in place (its matrix view is a view)."""
    return param.ndim == 2 or (param.ndim > 2 and param.is_contiguous())


def _step_plan(shapes: tuple[tuple[int, ...], ...], rule: str, split: Split, stack_all: bool, devices):
    """Static part of :func:`muon_step_` for params of ``shapes`` (``None``: no gradient):
    per param its row blocks ``(start, stop, scale, key, tall)``, and which wide shapes batch."""
    blocks: list[list[tuple[int, int, float, tuple, bool]]] = []
    counts: dict[tuple, int] = {}
    for shape, device in zip(shapes, devices):
        if shape is None:
            blocks.append([])
            continue
        rows, cols = matrix_shape(shape)
        sizes = block_sizes(split, torch.empty((rows, cols), device="meta")) or [rows]
        mine, start = [], 0
        for size in sizes:
            key = (min(size, cols), max(size, cols), device)
            mine.append((start, start + size, shape_scale(rule, (size, cols)), key, size > cols))
            counts[key] = counts.get(key, 0) + 1
            start += size
        blocks.append(mine)
    batched = {key for key, n in counts.items()
               if n > 1 and (stack_all or key[0] < _orthogonalize.LOOP_MIN_DIM)}
    return blocks, batched, counts


def muon_step_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    bufs: Sequence[torch.Tensor],
    *,
    lr: Any,
    momentum: Any,
    weight_decay: float,
    nesterov: bool,
    kind: str,
    rule: str,
    split: Split,
    schedule: Sequence[Sequence[float]],
    norm_scale: float,
    dtype: torch.dtype | None,
    eps: float,
    workspace: dict,
    msign: Callable[[torch.Tensor], torch.Tensor] | None = None,
    stack_all: bool = False,
) -> None:
    """:func:`muon_fn.muon` (without ``beta2``) as one in-place eager step over lists of matrices.

    The same arithmetic as ``chain(momentum, orthogonalize, scale_by_shape,
    add_decoupled_weight_decay, scale_by_learning_rate)`` followed by ``p += u``, up to rounding
    of the last steps: ``bufs`` are updated in place (:func:`momentum_step_`), each direction is
    normalized and cast straight into its slot of a per-shape batch in the compute ``dtype``
    (equal wide shapes batch when ``min(m, n) < LOOP_MIN_DIM`` or ``stack_all``; tall blocks are
    transposed), orthogonalized with ``msign`` (default: the ``schedule``'s iteration), and applied
    as ``p ← p(1 − lr·wd)`` then ``p += −lr·s·O`` — no fp32 copies of the update. Parameters
    whose ``grads`` entry is ``None`` are skipped. ``params`` must satisfy
    :func:`inplace_supported`. ``workspace``: a dict kept by the caller across steps for reusable
    scratch buffers (cast targets and the Nesterov direction; none of it is optimizer state).
    """
    from ._transforms import momentum_step_, momentum_weights

    dtype = dtype or _orthogonalize.default_compute_dtype(params[0].device if params else None)
    _orthogonalize.check_dtype(schedule, dtype)
    if msign is None:
        # On CPU the products reuse scratch kept across steps (a fresh allocation page-faults on
        # first touch); CUDA's caching allocator already reuses blocks, so there they allocate.
        ns_buffers = workspace.setdefault("ns", {})

        def msign(y: torch.Tensor) -> torch.Tensor:
            return _orthogonalize._run_schedule(y, schedule, eps, ns_buffers if y.device.type == "cpu" else None)
    lr = float(lr)
    decay = 1.0 - lr * float(weight_decay) if weight_decay else None
    weights = momentum_weights(momentum)  # read a 0-d tensor once, not per matrix

    shapes = tuple(None if g is None else tuple(p.shape) for p, g in zip(params, grads))
    plan_key = ("plan", shapes, tuple(p.device for p in params), stack_all)
    plan = workspace.get(plan_key)
    if plan is None:
        plan = workspace[plan_key] = _step_plan(shapes, rule, split, stack_all, [p.device for p in params])
    blocks, batched, counts = plan

    def scratch(key: tuple, shape: tuple[int, ...], dt: torch.dtype, device) -> torch.Tensor:
        t = workspace.get(key)
        if t is None or t.shape != shape:
            t = workspace[key] = torch.empty(shape, dtype=dt, device=device)
        return t

    batches = {key: scratch(("batch", key, dtype), (counts[key], key[0], key[1]), dtype, key[2])
               for key in batched}
    members: dict[tuple, list[tuple[torch.Tensor, float, torch.Tensor | None]]] = {key: [] for key in batched}
    for p, g, b, mine in zip(params, grads, bufs, blocks):
        if g is None:
            continue
        out = None
        if nesterov:  # one reused scratch: the direction is consumed before the next is made
            flat = workspace.get(("direction", b.dtype, b.device))
            if flat is None or flat.numel() < b.numel():
                flat = workspace[("direction", b.dtype, b.device)] = torch.empty(
                    b.numel(), dtype=b.dtype, device=b.device)
            out = flat[:b.numel()].view(b.shape)
        d = momentum_step_(b, g, weights, nesterov=nesterov, kind=kind, out=out)
        if decay is not None:
            p.mul_(decay)
        pm = p if p.ndim == 2 else p.view(p.shape[0], -1)
        dm = d if d.ndim == 2 else d.reshape(pm.shape)
        for start, stop, scale, key, tall in mine:
            db = dm[start:stop] if len(mine) > 1 else dm
            pb = pm[start:stop] if len(mine) > 1 else pm
            x = db.mT if tall else db
            # Tall blocks: scale/cast and the final add go through a scratch in their own layout.
            tall_scratch = scratch(("tall", key, dtype), (key[1], key[0]), dtype, key[2]) if tall else None
            if key in batched:
                slot = batches[key][len(members[key])]
                members[key].append((pb, scale, tall_scratch))
            else:
                slot = scratch(("one", key, dtype), (key[0], key[1]), dtype, key[2])
            _orthogonalize.normalize_into(x, slot, norm_scale=norm_scale, eps=eps, scratch=tall_scratch,
                                          overwrite=out is not None)  # the Nesterov scratch
            if key not in batched:
                add_update_(pb, msign(slot), -lr * scale, tall_scratch)
    for key, mem in members.items():
        if not mem:
            continue
        outs = msign(batches[key])
        for (pb, scale, tall_scratch), o in zip(mem, outs.unbind(0)):
            add_update_(pb, o, -lr * scale, tall_scratch)


def add_update_(p: torch.Tensor, o: torch.Tensor, alpha: float, tall_scratch: torch.Tensor | None) -> None:
    """``p += alpha·o`` for a wide ``o``, or ``alpha·oᵀ`` when ``tall_scratch`` (``p``'s shape,
    ``o``'s dtype) is given: ``oᵀ`` is first copied there (a blocked same-dtype transposed copy;
    adding the strided ``o.mT`` directly cost 8.0 instead of 2.2 ms on 3072×768). Bitwise the same."""
    if tall_scratch is None:
        p.add_(o, alpha=alpha)
    else:
        p.add_(tall_scratch.copy_(o.mT), alpha=alpha)
