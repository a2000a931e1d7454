"""The distributed options: how an optimizer holding DTensor parameters runs the owner-computes
step of :mod:`muon_fn.fsdp`. Every optimizer class takes them (they act once DTensors arrive, at
construction or swapped in later); they are defined, defaulted and checked here, once.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..core import checks as _checks

STRATEGIES = ("owner", "replicate")
"""What ``strategy=`` accepts: ``"owner"`` (each matrix computed once, on its owner rank) or
``"replicate"`` (every rank all-gathers and computes every matrix; the baseline)."""
WIRE_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)
INFLIGHT_BYTES = 8 * 2**20
"""``inflight_bytes=``'s default: the bytes a rank holds at once for the owner-computes exchange
(exchange buckets of at most half of it per rank, counted by ``muon_fn.distributed._budget.held_bytes``,
one unit per owner at least; the next travels while one is computed where both fit)."""


class DistributedOptions(NamedTuple):
    """The distributed options of an optimizer (see :class:`muon_fn.Optimizer`)."""

    strategy: str = "owner"
    wire_dtype: torch.dtype | None = None
    num_buckets: int = 4
    overlap: bool = False
    process_group: Any = None
    inflight_bytes: int | None = INFLIGHT_BYTES

    def checked(self) -> DistributedOptions:
        """These options, or a ``ValueError`` naming the first invalid one and its value."""
        _checks.one_of("strategy", self.strategy, STRATEGIES)
        _checks.one_of("wire_dtype", self.wire_dtype, WIRE_DTYPES)
        _checks.positive_int("num_buckets", self.num_buckets)
        _checks.one_of("overlap", self.overlap, (True, False))
        if self.inflight_bytes is not None:
            _checks.positive_int("inflight_bytes", self.inflight_bytes,
                                 ", the bytes of gathered matrices a rank holds at once, or None: no bound")
        if self.overlap and self.strategy != "owner":
            raise ValueError(f"overlap=True needs strategy='owner' (the exchange it starts during "
                             f"backward), got strategy={self.strategy!r}")
        return self


DEFAULTS = DistributedOptions()
