"""The routes of a parameter group: each transform of the group with the parameters it updates.

A group with ``algorithm="auto"`` has two routes, as the partition of a hybrid optimizer
(:class:`muon_fn.MuonOptimizer`) has two halves: its matrix algorithm (Muon) on the matrices and
AdamW on the rest, both built by the optimizer's factory; any other group has one. A route holds
its transform's :class:`~muon_fn.distributed._phases.Phases` and compiled steps, its same-shape buckets
(each with its state layouts) and, when it has a mid phase, the wire format of each of its
matrices.
"""

from __future__ import annotations

from typing import Any, NamedTuple
from collections.abc import Callable

import torch

from ..core.base import GradientTransformation
from .. import engine
from ..engine import auto_halves, auto_label, buckets, meta_scalars, variants
from . import _phases, _rows

# params -> meta tensors of their global shapes
Meta = Callable[[list[torch.Tensor]], tuple[torch.Tensor, ...]]


class Bucket(NamedTuple):
    """Same-shape parameters of a route updated by one call, as single-device MuonOptimizer
    buckets them (the owner computes a bucket's matrices together)."""

    indices: tuple[int, ...]  # positions in group["params"]
    layout: engine.StateLayout  # of the route's whole transform: keys in torch's state dicts
    rows: tuple[bool, ...]  # per slot of ``layout``: the leaf has one row per parameter row
    phase_layouts: tuple[engine.StateLayout, ...]  # the layout's pre, mid and post slices


class Route:
    """One transform over some of a group's parameters."""

    def __init__(self, label: str, tx: GradientTransformation, indices: tuple[int, ...],
                 params: list[torch.Tensor], meta: Meta, bucket_size: int | Callable[..., int],
                 compile_options: dict[str, Any] | None, options: dict[str, Any] | None = None,
                 traced: GradientTransformation | None = None, verify: bool = False) -> None:
        self.label, self.indices = label, indices
        self.options = options or {}  # the per-parameter options its transform was built with
        self.phases = _phases.split(tx, f"the {label!r} transform")
        # what is traced on meta tensors: ``tx`` built from meta copies of the per-step scalars
        self.traced = self.phases if traced is None else _phases.split(traced, f"the {label!r} transform")
        self.steps = _phases.steps(self.phases, compile_options, verify)
        self.buckets: list[Bucket] = []
        self.formats: dict[int, _rows.RowFormat] = {}  # position in the group -> wire format
        for members in buckets([params[i] for i in indices], bucket_size):
            idx = tuple(indices[k] for k in members)
            bucket = _bucket(self.traced, idx, meta([params[i] for i in idx]))
            self.buckets.append(bucket)
            if self.phases.mid is not None:
                self._add_formats(bucket, meta([params[i] for i in idx]))

    def _add_formats(self, bucket: Bucket, meta: tuple[torch.Tensor, ...]) -> None:
        ins, outs = _phases.update_dtypes(self.traced, meta)
        pre, mid, _ = bucket.phase_layouts
        first = len(pre.slots)
        for k, i in enumerate(bucket.indices):
            slots = [(slot, bucket.rows[first + n]) for n, slot in enumerate(mid.slots)
                     if slot is not None and slot.index == k]
            param_dtype = meta[k].dtype if self.phases.mid_needs_params else None
            self.formats[i] = _rows.row_format(tuple(meta[k].shape), ins[k], outs[k], param_dtype, slots)


def _bucket(phases: _phases.Phases, idx: tuple[int, ...], meta: tuple[torch.Tensor, ...]) -> Bucket:
    """A bucket's layouts, and which state leaves follow the rows: traced at the parameters'
    rows and at one row more (the same on every rank, whatever rows it holds). A head view that
    names its row blocks fits no other number of rows: then a leaf follows the rows when its
    leading dim is theirs (any such leaf may travel cut by rows and be whole on the owner)."""
    full, sliced = _phases.layouts(phases, meta)
    try:
        grown = _phases.layouts(phases, tuple(torch.empty((p.shape[0] + 1,) + p.shape[1:], dtype=p.dtype,
                                                          device="meta") for p in meta))[0].slots
    except ValueError:
        grown = [a if a is None or not a.shape else a._replace(shape=(a.shape[0] + 1,) + a.shape[1:])
                 for a in full.slots]
    rows = tuple(a is not None and a.index is not None and len(a.shape) >= 1
                 and a.shape[0] == meta[a.index].shape[0]
                 and b.shape == (a.shape[0] + 1,) + a.shape[1:]
                 for a, b in zip(full.slots, grown))
    return Bucket(idx, full, rows, sliced)


def group_routes(group: dict[str, Any], hyper: dict[str, Any], options: list[dict[str, Any]],
                 factory: Callable[[dict], GradientTransformation], matrix_algorithm: str, meta: Meta,
                 bucket_size: int | Callable[..., int],
                 compile_options: dict[str, Any] | None, verify: bool = False) -> list[Route]:
    """The routes of ``group``, each transform built by the optimizer's ``factory`` from the
    group's hyperparameters ``hyper``: for an ``algorithm="auto"`` group (a hybrid optimizer's)
    ``matrix_algorithm`` on ndim ≥ 2 and ``"adamw"`` on the rest, else one route; each split by
    the per-parameter ``options`` (the optimizer's variants, e.g. matrix views). ``verify``: the
    compiled steps check their first run (:class:`muon_fn.core.compile.PerSignature`)."""
    params = group["params"]
    algorithm = group.get("algorithm", "recipe")
    if algorithm != "auto":
        halves = {algorithm: hyper}
        labels = [algorithm] * len(params)
    else:
        halves = auto_halves(hyper, matrix_algorithm)
        labels = [auto_label(p, matrix_algorithm) for p in params]
    distinct = variants(options)
    routes = []
    for label, half in halves.items():
        for opts in distinct:
            indices = tuple(i for i, (lab, o) in enumerate(zip(labels, options)) if lab == label and o == opts)
            if indices:
                routes.append(Route(label, factory({**half, **opts}), indices, params, meta, bucket_size,
                                    compile_options, opts, factory(meta_scalars({**half, **opts})), verify))
    return routes
