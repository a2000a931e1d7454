"""A hybrid group's ``algorithm="auto"`` split: which half runs a parameter (:func:`auto_label`)
and the two halves' hyperparameters (:func:`auto_halves`). The optimizer classes build their
transforms from it and the distributed executor routes parameters by it, so it is made once, here."""

from __future__ import annotations

from typing import Any

import torch


def auto_label(p: torch.Tensor, name: str) -> str:
    """Which half of an ``algorithm="auto"`` group runs ``p``: ``name`` (the hybrid's matrix
    algorithm) for ndim ≥ 2, ``"adamw"`` for the rest."""
    return name if p.ndim >= 2 else "adamw"


def auto_halves(h: dict[str, Any], name: str) -> dict[str, dict[str, Any]]:
    """The two halves of an ``algorithm="auto"`` group's hyperparameters ``h``, each as a
    one-algorithm group: ``name`` on the matrices as is, and AdamW at ``adamw_lr_effective``
    (``adamw_lr·lr/base_lr``) with ``adamw_weight_decay``."""
    adamw_half = {"algorithm": "adamw", "lr": h["adamw_lr_effective"], "weight_decay": h["adamw_weight_decay"]}
    return {name: {**h, "algorithm": name}, "adamw": {**h, **adamw_half}}
