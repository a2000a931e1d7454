"""The ``torch.optim`` adapter and the optimizers built on it.

:class:`Optimizer` runs any functional transform behind torch's optimizer interface (the generic
apply: ``tx.update`` per bucket, written back in place, compiled by default). The optimizer
classes are configuration only: :class:`MuonOptimizer` (Muon + AdamW),
:class:`SpectralSphereOptimizer` (SSO + AdamW) and :func:`create_hybrid_optimizer` (one optimizer,
parameters split by role); :class:`TritonMuon` and :class:`TritonMuonW` (the elementwise rule
:func:`muon_fn.triton_muon`, which does not orthogonalize). :func:`from_torch_state_dict` and
:func:`to_torch_state_dict` move checkpoints between ``torch.optim.Muon`` (+ ``torch.optim.AdamW``)
and :class:`MuonOptimizer`; :func:`from_torch_checkpoint` and
:func:`to_torch_checkpoint` do the same for ``torch.distributed.checkpoint`` directories. Option
values every optimizer shares: :data:`BUCKET_SIZE`, :data:`NONFINITE_POLICIES`, :data:`STATE_BITS`
(the widths ``state_bits=`` takes).
"""

from ._adapter import BUCKET_SIZE, NONFINITE_POLICIES, Optimizer, StepReport
from ._elementwise import TritonMuon, TritonMuonW
from ._hybrid import NORMUON_BETA2, HybridSplit, create_hybrid_optimizer, split_parameters
from ._muon import HybridOptimizer, MuonOptimizer
from ._sso import SolverReport, SpectralSphereOptimizer
from ._torch_compat import from_torch_state_dict, to_torch_state_dict
from ._torch_dcp import from_torch_checkpoint, to_torch_checkpoint
from .._quantize import STATE_BITS

__all__ = ["Optimizer", "MuonOptimizer", "SpectralSphereOptimizer", "HybridOptimizer", "SolverReport",
           "TritonMuon", "TritonMuonW", "StepReport", "create_hybrid_optimizer", "split_parameters", "HybridSplit",
           "NORMUON_BETA2",
           "BUCKET_SIZE", "NONFINITE_POLICIES", "STATE_BITS", "from_torch_state_dict", "to_torch_state_dict",
           "from_torch_checkpoint", "to_torch_checkpoint"]
