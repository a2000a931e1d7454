"""Checkpoints between ``torch.optim.Muon`` (+ ``torch.optim.AdamW`` for the rest) and
:class:`~muon_fn.MuonOptimizer` (the hybrid included), both ways: the public entry points, which
check the optimizer they are given. The format and the conversion: :mod:`muon_fn.engine.torch_state`.
"""

from __future__ import annotations

from typing import Any

from ..engine import torch_state as _torch_state
from ._muon import MuonOptimizer


def _check(optimizer: Any) -> None:
    if not isinstance(optimizer, MuonOptimizer):
        raise TypeError(f"expected a muon_fn.MuonOptimizer (or a hybrid built on it), got {type(optimizer).__name__}")


def from_torch_state_dict(optimizer: MuonOptimizer, muon_state_dict: dict[str, Any],
                          adamw_state_dict: dict[str, Any] | None = None) -> dict[str, Any]:
    """A state_dict for ``optimizer.load_state_dict`` from a ``torch.optim.Muon`` state_dict
    (and a ``torch.optim.AdamW`` one for the parameters this optimizer gives AdamW).

    The torch Muon's parameters are ``optimizer``'s Muon-routed parameters in order (by name when
    both sides have ``param_names``), the AdamW's the rest. Each group takes the torch groups'
    hyperparameters (``lr``, ``weight_decay``, ``momentum``, ``nesterov``, ``ns_coefficients``,
    ``eps``, ``ns_steps``, ``adjust_lr_fn``; AdamW's ``lr``, ``betas``, ``eps``, ``weight_decay``
    as the group's AdamW settings; a scheduler's ``initial_lr``) and torch's algorithm (EMA
    momentum, no NorMuon); the momentum buffers and AdamW moments and steps are carried over.
    ``optimizer`` itself is not changed. Raises ``ValueError`` when the parameters or groups do
    not correspond.
    """
    _check(optimizer)
    return _torch_state.from_torch(optimizer, muon_state_dict, adamw_state_dict)


def to_torch_state_dict(optimizer: MuonOptimizer) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``(muon_state_dict, adamw_state_dict)`` for ``torch.optim.Muon`` over ``optimizer``'s
    Muon-routed parameters and ``torch.optim.AdamW`` over the rest (``None`` if there are none),
    with one torch param group per group of ``optimizer`` that has such parameters, in order.

    Only torch-compatible settings convert: every Muon parameter 2-D, one ``(a, b, c)`` triple
    (``ns_coefficients``, ``method="quintic"`` or the default ``method=None``), EMA momentum, no
    NorMuon (``beta2=None``),
    no AdaMuon (``adamuon_beta2=None``), no cautious weight decay (in either half),
    ``ns_stepsize=1``, no head views, and ``adjust_lr_fn`` ``None``/``"original"``/``"keller"``/
    ``"match_rms_adamw"``; otherwise ``ValueError`` names what differs. Build the torch
    optimizers over the same parameters (e.g. ``[p for p in params if p.ndim == 2]`` and the
    rest for one ``"auto"`` group). torch.optim.Muon iterates in bf16. torch.optim.AdamW decays
    every parameter of a group, so a group whose 0-/1-D parameters get no decay
    (``adamw_decay_1d=False``) and whose ndim ≥ 2 ones do becomes two torch groups: those of
    ndim ≥ 2, then the rest with ``weight_decay=0`` (build the torch AdamW with the same two).

    ``optimizer.state_dict()`` itself is not a torch.optim.Muon state_dict: torch's
    ``load_state_dict`` checks only the number of groups and parameters, so it accepts one and
    its ``step()`` then fails (or, with a muon_fn-only ``adjust_lr_fn`` such as ``"spectral"``,
    silently uses a scale of 1). Convert with this function; muon_fn cannot make torch refuse it.
    """
    _check(optimizer)
    return _torch_state.to_torch(optimizer)
