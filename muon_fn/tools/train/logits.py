"""QK-Clip in ``muon-fn train``: ``--qk-clip TAU`` (or ``qk_clip=TAU`` in one optimizer's spec) and
the largest attention logit of every step, logged as ``history["max_logit"]``.

Muon-family rows (``muon``, ``normuon``) clip inside their step (``qk_clip=`` of the optimizer);
the others (``adamw``, ``torch-muon``, ``sso``) call :meth:`muon_fn.QKClip.step` right after
theirs. ``--log-max-logit`` logs without clipping. The logged value is the max over layers and
heads of the step's forward pass, before that step's clip.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from muon_fn import QKClip, track_max_logits

IN_STEP = ("muon", "normuon")  # optimizers that take qk_clip= themselves


class MaxLogitLog:
    """Reads (and, for optimizers without the option, applies) QK-Clip after each step."""

    def __init__(self, model: nn.Module, clip: QKClip | None, clip_here: bool) -> None:
        self.clip, self.clip_here = clip, clip_here
        self.layers = clip.layers if clip is not None else track_max_logits(model)

    @torch.no_grad()
    def after_step(self) -> float:
        """The step's largest logit (a host read, in the training loop, not in the step)."""
        if self.clip is not None:
            if self.clip_here:
                self.clip.step()
            return float(self.clip.max_logit())
        buffers = [layer.module.max_logits for layer in self.layers]
        value = float(torch.stack([b.max() for b in buffers]).max())
        for b in buffers:
            b.fill_(-math.inf)
        return value


def setup(name: str, options: dict[str, Any], model: nn.Module, tau: float | None,
          log: bool) -> tuple[dict[str, Any], MaxLogitLog | None]:
    """The run's optimizer options (with ``qk_clip=`` a :class:`QKClip` for Muon-family rows) and
    its logit log (None when neither clipping nor logging). ``qk_clip`` in ``options`` overrides
    ``tau`` (``--qk-clip``); ``qk_clip=none`` turns it off for that row."""
    options, log = dict(options), log or tau is not None  # every row of a --qk-clip run logs
    tau = options.pop("qk_clip", tau)
    if tau is None and not log:
        return options, None
    clip = None if tau is None else QKClip(model, tau)
    if clip is not None and name in IN_STEP:
        options["qk_clip"] = clip
    return options, MaxLogitLog(model, clip, clip is not None and name not in IN_STEP)
