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


def orthogonalize(
    method: Union[str, Callable[[torch.Tensor], torch.Tensor]] = "polar_express",
    steps: int = 5,
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
      method: ``"polar_express"``, ``"quintic"`` (Keller), ``"you"``, ``"cubic"``, or a callable
        ``(…, m, n) -> (…, m, n)`` applied to each (batch of) matrix.
      steps: iterations of the method's coefficient schedule.
      coefficients: a custom per-iteration schedule of ``(a, b, c)`` triples.
      dtype: iteration dtype; ``None`` = the device default (bf16).
      eps: added to the Frobenius norm (zero in → zero out, never NaN).
      stepsize: damping η of each iteration, ``X ← X + η(p(X) − X)``.
      flatten: view N-D leaves as ``(out, prod(rest))``; if False, leading dims are a batch.
      split: row-block sizes of fused weights (each block orthogonalized on its own), or a
        function ``leaf -> sizes | None``.
      batch: stack same-shape matrices into one batched call (compiled, or eager when
        min(m, n) < 384; larger matrices run one at a time in eager mode, which is faster on CPU).
    """
    custom = callable(method) and not isinstance(method, str)
    _checks.positive_int("steps", steps)
    if not custom:
        _checks.one_of("method", method, _orthogonalize.METHODS)
        schedule = _orthogonalize.coefficient_schedule(
            method, steps, coefficients=coefficients, stepsize=stepsize
        )
        scale = 1.0 if coefficients is not None else _orthogonalize.norm_scale(method)
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
