"""The default of each shared hyperparameter: one value for every optimizer class and recipe.

:class:`~muon_fn.MuonOptimizer`, :class:`~muon_fn.FSDPMuonOptimizer`, the spectral-sphere
classes, :func:`~muon_fn.create_hybrid_optimizer` and the :func:`~muon_fn.muon` and
:func:`~muon_fn.hybrid` recipes take these defaults from here, so the same model trains the same
way whichever class gets it (docs/api.md, "Defaults", gives each value's reason). Recipes named
after a paper or another library (:func:`~muon_fn.normuon`, :func:`~muon_fn.adamuon`,
:func:`~muon_fn.adamw`, :func:`~muon_fn.triton_muon`) keep that source's values.
"""

from __future__ import annotations

LR = 0.02
"""Muon's learning rate, with the ``"keller"`` shape scaling (KellerJordan/Muon, modded-nanogpt)."""

MOMENTUM = 0.95
"""Muon's momentum (Nesterov), as KellerJordan/Muon and torch.optim.Muon."""

WEIGHT_DECAY = 0.01
"""Muon's decoupled weight decay (KellerJordan/Muon's; beat 0 on every seed measured)."""

ADAMW_LR = 1e-3
"""The AdamW half's learning rate (embeddings, the output head, 0-/1-D parameters)."""

ADAMW_BETAS = (0.9, 0.95)
"""The AdamW half's betas: β₂ = 0.95 beat 0.999 on every seed measured (LLM practice since GPT-3)."""

ADAMW_EPS = 1e-8
"""The AdamW half's epsilon (torch.optim.AdamW's)."""

ADAMW_WEIGHT_DECAY = 0.01
"""The AdamW half's decoupled weight decay on ndim ≥ 2 (torch.optim.AdamW's value)."""
