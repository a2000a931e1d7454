"""The optimizer classes: configuration only, each a :class:`muon_fn.engine.Optimizer` with its
recipe and defaults. Imports :mod:`muon_fn.engine`'s interface and :mod:`muon_fn.core`.

:class:`MuonOptimizer` (Muon + AdamW), :class:`SpectralSphereOptimizer` (SSO + AdamW) and
:func:`create_hybrid_optimizer` (one optimizer, parameters split by role); :class:`TritonMuon`
and :class:`TritonMuonW` (the elementwise rule :func:`muon_fn.triton_muon`);
:class:`FSDPMuonOptimizer` and :class:`FSDPSpectralSphereOptimizer` (the same classes given the
``fully_shard`` model, with its defaults); the torch.optim.Muon checkpoint conversions.
"""

from typing import Any

from ._elementwise import TritonMuon, TritonMuonW
from ._hybrid import NORMUON_BETA2, HybridSplit, create_hybrid_optimizer, split_parameters
from ._muon import HybridOptimizer, MuonOptimizer
from ._sso import SolverReport, SpectralSphereOptimizer
from ._torch_compat import from_torch_state_dict, to_torch_state_dict
from ._torch_dcp import from_torch_checkpoint, to_torch_checkpoint

__all__ = ["MuonOptimizer", "SpectralSphereOptimizer", "HybridOptimizer", "SolverReport", "TritonMuon", "TritonMuonW",
           "create_hybrid_optimizer", "split_parameters", "HybridSplit", "NORMUON_BETA2", "from_torch_state_dict",
           "to_torch_state_dict", "from_torch_checkpoint", "to_torch_checkpoint", "FSDPMuonOptimizer",
           "FSDPSpectralSphereOptimizer"]


def __getattr__(name: str) -> Any:
    # the FSDP classes on first use: their modules load torch.distributed.tensor (about a second)
    if name == "FSDPMuonOptimizer":
        from ._fsdp import FSDPMuonOptimizer

        return FSDPMuonOptimizer
    if name == "FSDPSpectralSphereOptimizer":
        from ._fsdp_sso import FSDPSpectralSphereOptimizer

        return FSDPSpectralSphereOptimizer
    raise AttributeError(f"module 'muon_fn.optimizers' has no attribute {name!r}")
