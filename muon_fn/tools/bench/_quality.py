"""Orthogonality quality: how close an orthogonalization lands the singular values to 1.

An orthogonalization is named by ``(method, steps, dtype)``: a :func:`muon_fn.newton_schulz`
method (``steps=None``: its default count) iterated in ``dtype``, or ``method=TORCH`` for
torch.optim.Muon's own function (Keller's quintic in bf16). Measures are computed in fp32 on the
CPU (σ to about 1e-6, far below the differences measured).
"""

from __future__ import annotations

from typing import NamedTuple
from collections.abc import Callable, Mapping

import torch

from muon_fn import newton_schulz

TORCH = "torch.optim.Muon"
TORCH_QUINTIC = (3.4445, -4.7750, 2.0315)


class Ortho(NamedTuple):
    """An orthogonalization whose quality is measured."""

    method: str  # a newton_schulz method, or TORCH
    steps: int | None  # None: the method's default count
    dtype: torch.dtype  # iteration dtype (TORCH: bf16)


TORCH_ORTHO = Ortho(TORCH, 5, torch.bfloat16)


def orthogonalizer(spec: Ortho) -> Callable[[torch.Tensor], torch.Tensor]:
    """The function ``g -> msign(g)`` approximation that ``spec`` names."""
    if spec.method == TORCH:
        from torch.optim._muon import _zeropower_via_newtonschulz

        return lambda g: _zeropower_via_newtonschulz(g, TORCH_QUINTIC, spec.steps, 1e-7)
    return lambda g: newton_schulz(g, spec.method, spec.steps, dtype=spec.dtype)


def orthogonality(g: torch.Tensor, out: torch.Tensor,
                  svd: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, float]:
    """Singular values of ``out`` (an approximation of msign(g)): RMS deviation from 1, min, max.

    ``signed_rms`` is the RMS of ``u_iᵀ out v_i − 1`` over g's singular pairs (``svd = (U, Vᴴ)`` of
    ``g`` if already computed), which also catches a flipped direction that singular values hide.
    ``leak`` measures how far ``out`` leaves g's singular basis: the RMS of the off-diagonal
    entries of ``Uᵀ·out·V`` on g's leading pairs (σ > 1e-2·σ₁), per pair. msign(g) and every
    polynomial iteration in ``ggᵀ`` keep the basis (leak 0 up to rounding); a preconditioner that
    rescales rows first (AOL) does not.
    """
    o = out.float().cpu()
    sv = torch.linalg.svdvals(o)
    if svd is None:
        u, _, vh = torch.linalg.svd(g.float().cpu(), full_matrices=False)
    else:
        u, vh = svd
    projected = u.mT @ o @ vh.mT
    signed = projected.diagonal()
    sg = torch.linalg.svdvals(g.float().cpu())
    k = max(1, int((sg > 1e-2 * sg[0]).sum()))
    lead = projected[:k, :k]
    leak = (lead - torch.diag(lead.diagonal())).norm() / k ** 0.5
    return {"rms": float(((sv - 1) ** 2).mean().sqrt()), "min": float(sv.min()), "max": float(sv.max()),
            "signed_rms": float(((signed - 1) ** 2).mean().sqrt()), "leak": float(leak)}


def quality(specs: Mapping[str, Ortho], inputs: Mapping[str, torch.Tensor], *,
            versus_torch: bool = True) -> dict[str, dict[str, dict[str, float]]]:
    """Per row of ``specs``, per matrix kind (the last part of the input's name): the worst RMS
    over the kind's inputs, σ range, and worst ratios to a reference on the same input.

    ``ratio_to_quintic_same_dtype`` compares with Keller's quintic (5 steps) in the row's own
    dtype: on rank-deficient inputs bf16 rounding noise lifts exact-zero singular values, which
    lowers the RMS of every bf16 row (torch's quintic: 4-7 % lower in bf16 than in fp32 on tiny's
    gradients), so an fp32 row is judged against fp32 there. With ``versus_torch``, also
    ``ratio_to_torch`` and ``signed_ratio_to_torch`` against torch.optim.Muon's own function.
    """
    svds = {}
    for n, g in inputs.items():
        u, _, vh = torch.linalg.svd(g.float().cpu(), full_matrices=False)
        svds[n] = (u, vh)
    measured: dict[Ortho, dict[str, dict[str, float]]] = {}

    def measure(spec: Ortho) -> dict[str, dict[str, float]]:
        if spec not in measured:
            fn = orthogonalizer(spec)
            measured[spec] = {n: orthogonality(g, fn(g), svds[n]) for n, g in inputs.items()}
        return measured[spec]

    out: dict[str, dict[str, dict[str, float]]] = {}
    for row, spec in specs.items():
        mine, same = measure(spec), measure(Ortho("quintic", 5, spec.dtype))
        ref = measure(TORCH_ORTHO) if versus_torch else None
        per_kind: dict[str, dict[str, float]] = {}
        for n, q in mine.items():
            k = per_kind.setdefault(n.split(".")[-1], {"rms": 0.0, "min": float("inf"), "max": 0.0,
                                                       "leak": 0.0, "ratio_to_quintic_same_dtype": 0.0})
            k["rms"], k["leak"] = max(k["rms"], q["rms"]), max(k["leak"], q["leak"])
            k["min"], k["max"] = min(k["min"], q["min"]), max(k["max"], q["max"])
            _worst(k, "ratio_to_quintic_same_dtype", q["rms"] / same[n]["rms"])
            if ref is not None:
                _worst(k, "ratio_to_torch", q["rms"] / ref[n]["rms"])
                _worst(k, "signed_ratio_to_torch", q["signed_rms"] / ref[n]["signed_rms"])
        out[row] = per_kind
    return out


def _worst(kind: dict[str, float], key: str, value: float) -> None:
    kind[key] = max(kind.get(key, 0.0), value)


def gaussian_inputs(size: tuple[int, int], *, seed: int = 0,
                    device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """Rectangular Gaussian matrices of ``size`` and its transpose (drawn on the CPU, moved to
    ``device``), named ``gauss.{m}x{n}``."""
    g = torch.Generator().manual_seed(seed)
    m, n = size
    return {f"gauss.{m}x{n}": torch.randn(m, n, generator=g).to(device),
            f"gauss.{n}x{m}": torch.randn(n, m, generator=g).to(device)}

