"""FSDP2 adapter: owner-computes Muon on ``fully_shard`` models.

``FSDPMuonOptimizer`` orthogonalizes each full weight matrix on one owner rank (planned by
:mod:`muon_fn.fsdp._plan`, exchanged by :mod:`muon_fn.fsdp._exchange`) and matches single-device
``muon_fn.MuonOptimizer``. ``python -m muon_fn.fsdp.bench`` measures it against the replicate
baseline.
"""

from ._optimizer import STRATEGIES, FSDPMuonOptimizer
from ._plan import Plan, chunk_rows, make_plan

__all__ = ["FSDPMuonOptimizer", "STRATEGIES", "Plan", "chunk_rows", "make_plan"]
