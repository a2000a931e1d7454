"""``metrics=`` of the FSDP optimizers: the raw figures of each phase (:mod:`muon_fn.core.metrics`)
made whole and the same on every rank.

A measured step runs the measured variant of each phase (:class:`~._phases.Steps`): the pre and
post phases and the elementwise routes record on each rank's rows (the figures that are sums
over rows: the gradient's, the momentum's, the update's and the weight's Σx² per unit), the mid
phase on each matrix's owner (the figures of whole matrices: the orthogonality residual,
NorMuon's row scales, the shape scale, SSO's solve). After the commit one all-reduce of a flat
vector sums the row sums and carries the owners' figures to every rank (each with a count of the
ranks that computed it, so a matrix every rank computes, ``strategy="replicate"``, is not counted
W times), and one max all-reduce carries the figures every rank records alike (lr, weight decay).
Every rank then holds the same figures, and ``optimizer.metrics()`` reads them locally: no
collective at read time, so rank 0 alone may call it.

The vector's layout is the same on every rank: per route bucket, per parameter, the figures a
meta trace of the route's whole transform records, each over the parameter's units. A measured
step runs without ``overlap`` (its exchange posted during backward is drained and the step runs
as without overlap: the pre phase must record).
"""

from __future__ import annotations

from typing import Any

import torch

from ..core import metrics as _metrics
from ..core.views import count as view_count, rows_shape


class FSDPTelemetry:
    """A base of :class:`~._step.AdapterStep`: the FSDP side of ``metrics=``."""

    def _local_leaves(self, gi: int, bucket: Any, params: list[torch.Tensor]) -> tuple[_metrics.Leaf, ...]:
        """The :class:`~muon_fn.core.metrics.Leaf` of each parameter of ``bucket`` as this rank holds it."""
        return tuple(self._leaf(gi, params[i], self._layouts[id(params[i])].offset) for i in bucket.indices)

    def _leaf(self, gi: int, p: torch.Tensor, offset: int = 0, units: tuple[int, ...] | None = None) -> _metrics.Leaf:
        """``p``'s Leaf; ``offset``: the first dim-0 index this rank holds (as rows of its view)."""
        shape = tuple(p.shape)
        view = self._views_of(gi).get(id(p), "flatten") if len(shape) >= 2 else "flatten"
        per_index = rows_shape(shape, view)[0] // max(shape[0], 1) if len(shape) >= 2 else 1
        return _metrics.Leaf(shape, view, offset * per_index, units)

    def _views_of(self, gi: int) -> dict[int, Any]:
        cache = self.__dict__.setdefault("_leaf_views", {})
        if gi not in cache:
            group = self.opt.param_groups[gi]
            views = [o.get("matrix_view", "flatten") for o in self.opt._param_options(group)]
            cache[gi] = {id(p): v for p, v in zip(group["params"], views)}
        return cache[gi]

    @staticmethod
    def _piece_units(shape: tuple[int, ...], view: Any, experts: list[int]) -> tuple[int, ...]:
        """The unit positions of experts ``experts`` of a stack of ``shape`` (each one's units in order)."""
        per = _metrics.unit_count(_metrics.Leaf(shape, view)) // max(view_count(shape, view), 1)
        return tuple(e * per + b for e in experts for b in range(per))

    def _owner_leaves(self, matrices: list, batch: list[int], pieces: list) -> tuple[_metrics.Leaf, ...]:
        """The Leaf of each parameter of an owner's mid batch (``batch``: a plan index per
        parameter; ``pieces``: per parameter the plan indices of the experts it got, or None: whole)."""
        out = []
        for j, own in zip(batch, pieces):
            m = matrices[j]
            shape = tuple(m.param.shape)
            units = None if own is None else self._piece_units(shape, m.view, [matrices[q].piece for q in own])
            out.append(_metrics.Leaf(shape, m.view, 0, units))
        return tuple(out)

    @staticmethod
    def _note(figs: dict | None, gi: int, positions: tuple[int, ...], leaves: tuple, raw: tuple) -> None:
        """Keep a phase's raw figures of the parameters at ``positions`` of group ``gi``."""
        if figs is None:
            return
        for i, leaf, r in zip(positions, leaves, raw):
            if r:
                figs.setdefault((gi, i), []).append((leaf, r))

    # ------------------------------------------------------------------ after the commit
    def _keep_fsdp_figures(self, figs: dict, finite: torch.Tensor | None) -> None:
        """Make every rank's figures whole (two all-reduces) and keep them (:meth:`_keep_figures`)."""
        layout = self._figure_layout()
        size = sum(n for *_, n in layout)
        device = self._device
        sums = torch.zeros(2 * size, dtype=torch.float32, device=device)  # values, then owner counts
        highs = torch.zeros(size, dtype=torch.float32, device=device)
        for (gi, i, name, start, n) in layout:
            for leaf, raw in figs.get((gi, i), ()):
                if name in raw:
                    self._place(sums, highs, size, name, start, n, leaf, raw[name])
        topo = self.topology
        if topo.world_size > 1:
            torch.distributed.all_reduce(sums, group=topo.group)
            torch.distributed.all_reduce(highs, op=torch.distributed.ReduceOp.MAX, group=topo.group)
        self.opt._keep_figures(self._unpack(layout, sums, highs, size), finite)

    @staticmethod
    def _place(sums, highs, size, name, start, n, leaf, value) -> None:
        kind = _metrics.KINDS.get(name, _metrics.OWNER)
        where = (torch.tensor(leaf.units, device=sums.device) + start if leaf.units is not None
                 else torch.arange(start, start + n, device=sums.device))
        value = value.to(sums.device, torch.float32)
        if kind == _metrics.SAME:
            highs[where] = torch.maximum(highs[where], value)
            return
        sums.index_add_(0, where, value)
        if kind == _metrics.OWNER:
            sums.index_add_(0, where + size, torch.ones_like(value))

    def _unpack(self, layout: list, sums: torch.Tensor, highs: torch.Tensor, size: int) -> list:
        """``(key, labels, raw)`` per parameter (:meth:`_keep_figures`), figures over its units."""
        by_param: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        for (gi, i, name, start, n) in layout:
            kind = _metrics.KINDS.get(name, _metrics.OWNER)
            if kind == _metrics.SAME:
                value = highs[start:start + n]
            elif kind == _metrics.OWNER:
                value = sums[start:start + n] / sums[size + start:size + start + n]  # nan: no owner
            else:
                value = sums[start:start + n]
            by_param.setdefault((gi, i), {})[name] = value
        out = []
        for (gi, i), raw in by_param.items():
            p = self.opt.param_groups[gi]["params"][i]
            out.append(((gi, "fsdp", i), self.opt._labels(gi, (i,), (self._leaf(gi, p),)), (raw,)))
        return out

    def _figure_layout(self) -> list[tuple[int, int, str, int, int]]:
        """``(group, position, figure, start, units)`` of every figure in the flat vector, the same
        on every rank (from a meta trace of each route's whole transform; cached per plan)."""
        key = self._plan_key
        cached = self.__dict__.get("_figure_layout_cache")
        if cached is not None and cached[0] == key:
            return cached[1]
        layout, start = [], 0
        for gi, group in enumerate(self.opt.param_groups):
            for route in self._routes(gi):
                for bucket in route.buckets:
                    ps = [group["params"][i] for i in bucket.indices]
                    meta = tuple(torch.empty(tuple(p.shape), dtype=p.dtype, device="meta") for p in ps)
                    leaves = tuple(self._leaf(gi, p) for p in ps)
                    whole = route.traced.whole
                    _, _, raw = _metrics.measured_update(whole, meta, whole.init(meta), meta, leaves)
                    for i, leaf, r in zip(bucket.indices, leaves, raw):
                        for name in sorted(r or {}):
                            n = _metrics.unit_count(leaf)
                            layout.append((gi, i, name, start, n))
                            start += n
        self.__dict__["_figure_layout_cache"] = (key, layout)
        return layout

