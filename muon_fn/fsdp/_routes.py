"""The routes of a parameter group: each transform of the group with the parameters it updates.

A group with ``algorithm="auto"`` has two routes, as :class:`muon_fn.MuonOptimizer`'s partition
has two halves: Muon on the matrices and AdamW on the rest, both built by the optimizer's factory;
an ``algorithm="muon"`` or ``"adamw"`` group has one. A route holds its transform's
:class:`~muon_fn.fsdp._phases.Phases` and compiled steps, its same-shape buckets (each with its
state layouts) and, when it has a mid phase, the wire format of each of its matrices.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from .._alias import matrix_labels
from .._base import GradientTransformation
from ..optim import _state
from ..optim._adapter import buckets
from . import _phases, _rows

Meta = Callable[[list[torch.Tensor]], tuple[torch.Tensor, ...]]  # params -> meta tensors of their global shapes


class Bucket(NamedTuple):
    """Same-shape parameters of a route updated by one call."""

    indices: tuple[int, ...]  # positions in group["params"]
    layout: _state.StateLayout  # of the route's whole transform: keys in torch's state dicts
    phase_layouts: tuple[_state.StateLayout, ...]  # its pre, mid and post slices


class Route:
    """One transform over some of a group's parameters."""

    def __init__(self, label: str, tx: GradientTransformation, indices: tuple[int, ...],
                 params: list[torch.Tensor], meta: Meta, bucket_size: int,
                 compile_options: dict[str, Any] | None) -> None:
        self.label, self.indices, self._meta = label, indices, meta
        self.phases = _phases.split(tx, f"the {label!r} transform")
        self.steps = _phases.steps(self.phases, compile_options)
        self._mid_layouts: dict[tuple, _state.StateLayout] = {}
        self.buckets: list[Bucket] = []
        self.formats: dict[int, _rows.RowFormat] = {}  # position in the group -> wire format
        for members in buckets([params[i] for i in indices], bucket_size):
            idx = tuple(indices[k] for k in members)
            full, sliced = _phases.layouts(self.phases, meta([params[i] for i in idx]))
            self.buckets.append(Bucket(idx, full, sliced))
            if self.phases.mid is not None:
                self._add_formats(idx, params)

    def _add_formats(self, idx: tuple[int, ...], params: list[torch.Tensor]) -> None:
        ins, outs = _phases.update_dtypes(self.phases, self._meta([params[i] for i in idx]))
        for i, update_dtype, result_dtype in zip(idx, ins, outs):
            p = params[i]
            slots = self.mid_layout(tuple(p.shape), p.dtype, 1).slots
            param_dtype = p.dtype if self.phases.mid_needs_params else None
            self.formats[i] = _rows.row_format(tuple(p.shape), update_dtype, result_dtype, param_dtype, slots)

    def mid_layout(self, shape: tuple[int, ...], dtype: torch.dtype, n: int) -> _state.StateLayout:
        """The mid phase's state layout over ``n`` matrices of one shape and dtype (cached)."""
        key = (shape, dtype, n)
        if key not in self._mid_layouts:
            meta = tuple(torch.empty(shape, dtype=dtype, device="meta") for _ in range(n))
            self._mid_layouts[key] = _phases.layouts(self.phases, meta)[1][1]
        return self._mid_layouts[key]


def group_routes(group: dict[str, Any], hyper: dict[str, Any], factory: Callable[[dict], GradientTransformation],
                 meta: Meta, bucket_size: int, compile_options: dict[str, Any] | None) -> list[Route]:
    """The routes of ``group``, each transform built by ``factory`` (MuonOptimizer's) from the
    group's hyperparameters ``hyper``."""
    params = group["params"]
    if group["algorithm"] != "auto":
        txs = {group["algorithm"]: factory(hyper)}
        labels = [group["algorithm"]] * len(params)
    else:
        txs = {label: factory(auto_half(hyper, label)) for label in ("muon", "adamw")}
        labels = list(matrix_labels(tuple(params)))
    routes = []
    for label, tx in txs.items():
        indices = tuple(i for i, lab in enumerate(labels) if lab == label)
        if indices:
            routes.append(Route(label, tx, indices, params, meta, bucket_size, compile_options))
    return routes


def auto_half(hyper: dict[str, Any], label: str) -> dict[str, Any]:
    """The hyperparameters of one half of an ``algorithm="auto"`` group as a one-algorithm group:
    the matrices' Muon as is, and the rest's AdamW with ``adamw_lr_effective`` (``adamw_lr·lr/base_lr``)
    and ``adamw_weight_decay``, exactly the two halves of :func:`muon_fn.optim._muon.muon_factory`'s
    partition."""
    if label == "muon":
        return {**hyper, "algorithm": "muon"}
    return {**hyper, "algorithm": "adamw", "lr": hyper["adamw_lr_effective"],
            "weight_decay": hyper["adamw_weight_decay"]}
