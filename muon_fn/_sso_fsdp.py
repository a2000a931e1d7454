"""``FSDPSpectralSphereOptimizer``: SSO on FSDP2 models through the owner-computes exchange.

SSO needs, on one rank, the full weight ``W`` (power iteration, retraction) and the full momentum
direction ``M`` (λ solver, msign). Per step and matrix:

- pre (local shards): EMA Nesterov momentum on this rank's rows (elementwise, as single-device);
- the rows of ``[M | W]`` (``2·in`` columns) travel to the matrix's owner (the FSDP adapter's
  plan and ``all_to_all_single`` exchange, built for shapes ``(out, 2·in)``);
- the owner runs :func:`muon_fn.spectral_sphere` (with its momentum switched off: the direction
  arrives ready) on the full matrices it owns and returns the update ``(R/σ − 1)·W − lr·s·Φ``
  (``in`` columns: the exchange's ``result_cols``, so the return costs what Muon's does);
- each rank adds its rows of the update; the owner's per-matrix state (the warm-start block, λ*,
  σ, solver statistics) is summed into every rank's replicated copy by one ``all_reduce``, so
  every rank holds the same state (distributed checkpoints see one value).

0-/1-D parameters get AdamW on local shards, as in :class:`muon_fn.fsdp.FSDPMuonOptimizer`.
Results equal single-device :class:`muon_fn.SpectralSphereOptimizer` up to floating-point
rounding (owners batch different sets of same-shape matrices).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from . import _tree
from ._muon import block_sizes
from ._sso import SpectralSphereState, spectral_sphere
from ._sso_optim import SolverReport
from ._transforms import MomentumState, momentum as momentum_tx
from .fsdp import FSDPMuonOptimizer
from .fsdp import _exchange, _params, _plan

_STATS = ("sso_lambda", "sso_sigma", "sso_residual", "sso_iterations", "sso_fallback", "sso_fallbacks")
_STAT_DTYPES = (torch.float32, torch.float32, torch.float32, torch.int32, torch.bool, torch.int64)


class FSDPSpectralSphereOptimizer(FSDPMuonOptimizer):
    """SSO for FSDP2-sharded (or replicated) models; AdamW for 0-/1-D parameters.

    Args:
      model, params: as :class:`muon_fn.fsdp.FSDPMuonOptimizer` (``use_muon`` groups get SSO).
      lr, momentum, nesterov: SSO's (see :func:`muon_fn.spectral_sphere`).
      sso_kwargs: any other :func:`muon_fn.spectral_sphere` keyword (``radius_scale``,
        ``power_steps``, ``tol``, ``muon_sphere``, ``split`` ...). A callable ``split`` is called
        on a meta ``(out, in)`` tensor to size the state.
      strategy, adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay, wire_dtype, num_buckets,
        process_group: as :class:`muon_fn.fsdp.FSDPMuonOptimizer`.
    """

    def __init__(
        self,
        model: nn.Module,
        params: Iterable[Any] | None = None,
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        *,
        sso_kwargs: dict[str, Any] | None = None,
        strategy: str = "owner",
        adamw_lr: float = 3e-4,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.0,
        wire_dtype: torch.dtype | None = None,
        num_buckets: int = 4,
        process_group: Any = None,
    ) -> None:
        self._sso_kwargs = dict(sso_kwargs or {})
        for key in ("lr", "momentum", "nesterov", "mu_dtype"):
            if key in self._sso_kwargs:
                raise ValueError(f"Invalid sso_kwargs key: {key!r} (pass it as an argument)")
        spectral_sphere(lr, momentum, nesterov=nesterov, **self._sso_kwargs)  # validate early
        super().__init__(
            model, params, lr=lr, weight_decay=0.0, momentum=momentum, nesterov=nesterov,
            strategy=strategy, momentum_kind="ema", adamw_lr=adamw_lr, adamw_betas=adamw_betas,
            adamw_eps=adamw_eps, adamw_weight_decay=adamw_weight_decay, wire_dtype=wire_dtype,
            num_buckets=num_buckets, process_group=process_group,
        )
        # Rows of [M | W] travel: plan for (out, 2·in).
        self.plan = _plan.make_plan(
            [(_plan.flat_shape(p.shape)[0], 2 * _plan.flat_shape(p.shape)[1]) for p in self._muon],
            self.topology.world_size,
            replicated=[not self._layouts[id(p)].sharded for p in self._muon],
            num_buckets=num_buckets,
        )

    def _init_state(self) -> None:
        super()._init_state()
        k_max = self._sso_kwargs.get("power_block", 16)
        for group in self.param_groups:
            if not group["use_muon"]:
                continue
            for p in group["params"]:
                st = self.state[p]
                if "sso_v" in st:
                    continue
                m, n = _plan.flat_shape(p.shape)
                dev = _params.local(p).device
                # A split (fused) weight: one sphere per row block, with a leading block dim.
                sizes = block_sizes(self._sso_kwargs.get("split"), torch.empty(m, n, device="meta"))
                lead = () if sizes is None else (len(sizes),)
                k = min(k_max, m if sizes is None else min(sizes), n)
                st["sso_v"] = torch.zeros(lead + (n, k), device=dev)  # set on the first step
                st["sso_count"] = torch.zeros((), dtype=torch.int64, device=dev)
                for key, dtype in zip(_STATS, _STAT_DTYPES):
                    st[key] = torch.zeros(lead, dtype=dtype, device=dev)

    def _tx(self, index: int):
        s = self._scalars[index]
        return spectral_sphere(s["lr"], 0.0, nesterov=False, **self._sso_kwargs)

    def _muon_step(self, k: int) -> dict[str, Any]:
        topo = self.topology
        held, has_grad = [], []
        group_of: dict[int, int] = {}
        for index, group in enumerate(self.param_groups):
            if not group["use_muon"]:
                continue
            s = self._refresh_scalars(index)
            params = group["params"]
            grads = tuple(self._grad(p, k) for p in params)
            bufs = tuple(_params.local(self.state[p]["momentum_buffer"]) for p in params)
            pre = momentum_tx(s["momentum"], nesterov=self._config["nesterov"], kind="ema")
            out, new = pre.update(grads, MomentumState(mu=bufs))
            for p, g, b, nb, u in zip(params, grads, bufs, new.mu, out):
                has_grad.append(g is not None)
                if g is not None:
                    b.copy_(nb)
                rows, n = b.shape[0], _plan.flat_shape(p.shape)[1]  # n explicit: empty shards
                m_rows = (u if u is not None else torch.zeros_like(b)).reshape(rows, n)
                w_rows = _params.local(p).detach().reshape(rows, n).to(m_rows.dtype)
                held.append(torch.cat([m_rows, w_rows], dim=1))
                group_of[len(held) - 1] = index
        results: dict[int, dict[str, torch.Tensor]] = {}

        def compute(idx: list[int], mats: list[torch.Tensor]) -> list[torch.Tensor]:
            outs: list[torch.Tensor | None] = [None] * len(idx)
            by_group: dict[int, list[int]] = {}
            for pos, j in enumerate(idx):
                if has_grad[j]:
                    by_group.setdefault(group_of[j], []).append(pos)
                else:
                    outs[pos] = mats[pos].new_zeros(mats[pos].shape[0], mats[pos].shape[1] // 2)
            for gi, positions in by_group.items():
                tx = self._tx(gi)
                shapes = [self._muon[idx[q]].shape for q in positions]
                n_of = [_plan.flat_shape(sh)[1] for sh in shapes]
                dirs = tuple(mats[q][:, :n].reshape(sh) for q, n, sh in zip(positions, n_of, shapes))
                ws = tuple(mats[q][:, n:].reshape(sh) for q, n, sh in zip(positions, n_of, shapes))
                sts = [self.state[self._muon[idx[q]]] for q in positions]
                # First step of a matrix: the accurate warm-start block init() computes from W.
                blocks = tuple(tx.init((w,)).v[0] if int(st["sso_count"]) == 0 else st["sso_v"]
                               for w, st in zip(ws, sts))
                state = SpectralSphereState(
                    count=torch.zeros((), dtype=torch.int64),
                    mu=_tree.zeros_like(dirs),
                    v=blocks,
                    lam=tuple(st["sso_lambda"] for st in sts),
                    sigma=tuple(st["sso_sigma"] for st in sts),
                    residual=tuple(st["sso_residual"] for st in sts),
                    iterations=tuple(st["sso_iterations"] for st in sts),
                    fallback=tuple(st["sso_fallback"] for st in sts),
                    fallbacks=tuple(st["sso_fallbacks"] for st in sts),
                )
                updates, new = tx.update(dirs, state, ws)
                for n_i, (q, u) in enumerate(zip(positions, updates)):
                    outs[q] = u.reshape(u.shape[0], n_of[n_i]).to(mats[q].dtype)
                    results[idx[q]] = {"sso_v": new.v[n_i], "sso_lambda": new.lam[n_i],
                                       "sso_sigma": new.sigma[n_i], "sso_residual": new.residual[n_i],
                                       "sso_iterations": new.iterations[n_i],
                                       "sso_fallback": new.fallback[n_i], "sso_fallbacks": new.fallbacks[n_i]}
            return outs  # type: ignore[return-value]

        run = _exchange.exchange if self.strategy == "owner" else _exchange.exchange_replicated
        # [M | W] travels to the owner; only the update (in columns) comes back.
        mine, ex = run(self.plan, topo.rank, held, compute, group=topo.group, wire_dtype=self.wire_dtype,
                       result_cols=[mp.cols // 2 for mp in self.plan.matrices])
        for j, p in enumerate(self._muon):
            if not has_grad[j]:
                continue
            lo = _params.local(p)
            n = _plan.flat_shape(p.shape)[1]
            lo.add_(mine[j].reshape(lo.shape).to(lo.dtype))
            self.state[p]["step"].add_(1)
        self._sync_state(results, has_grad)
        return {"strategy": self.strategy, "rank": topo.rank, "world_size": topo.world_size,
                "bytes_sent": ex.bytes_sent, "bytes_received": ex.bytes_received,
                "comm_wait_s": ex.comm_wait_s, "compute_s": ex.compute_s}

    def _sync_state(self, results: dict[int, dict[str, torch.Tensor]], has_grad: list[bool]) -> None:
        """Every rank gets the owners' new per-matrix state (one all_reduce of a flat buffer)."""
        keys = ("sso_v",) + _STATS
        pieces = []
        for j, p in enumerate(self._muon):
            st = self.state[p]
            res = results.get(j)
            for key in keys:
                ref = st[key]
                val = res[key] if res is not None else torch.zeros_like(ref)
                pieces.append(val.reshape(-1).to(torch.float64))
        if not pieces:
            return
        flat = torch.cat(pieces)
        if self.topology.world_size > 1 and self.strategy == "owner":
            dist.all_reduce(flat, group=self.topology.group)
        elif self.strategy == "replicate":
            pass  # every rank computed every matrix
        offset = 0
        for j, p in enumerate(self._muon):
            st = self.state[p]
            for key in keys:
                ref = st[key]
                part = flat[offset:offset + ref.numel()].reshape(ref.shape)
                offset += ref.numel()
                if has_grad[j]:
                    ref.copy_(part.to(ref.dtype))
            if has_grad[j]:
                st["sso_count"].add_(1)

    def last_step_stats_sso(self) -> SolverReport:
        """The λ solver's statistics of the last step, per SSO matrix (identical on every rank)."""
        names, cols = [], {k: [] for k in _STATS}
        for p in self._muon:
            st = self.state[p]
            name = self._name(p)
            names += [name] if st["sso_sigma"].ndim == 0 else [f"{name}[{j}]" for j in range(st["sso_sigma"].numel())]
            for k in _STATS:
                cols[k].append(st[k].reshape(-1))
        stack = {k: (torch.cat(v) if v else torch.zeros(0)) for k, v in cols.items()}
        return SolverReport(names, stack["sso_sigma"], stack["sso_lambda"], stack["sso_residual"],
                            stack["sso_iterations"], stack["sso_fallback"], stack["sso_fallbacks"])
