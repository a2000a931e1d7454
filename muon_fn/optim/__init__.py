"""The ``torch.optim`` adapter and the optimizers built on it: the public names of
:mod:`muon_fn.engine` (the :class:`Optimizer` class) and :mod:`muon_fn.optimizers` (the classes).

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

from ..core.quantize import STATE_BITS
from . import engine  # noqa: F401  muon_fn.optim.engine: the engine's interface under its earlier name
from ..engine import BUCKET_SIZE, NONFINITE_POLICIES, Optimizer, StepReport
from ..optimizers import (NORMUON_BETA2, HybridOptimizer, HybridSplit, MuonOptimizer, SolverReport,
                          SpectralSphereOptimizer, TritonMuon, TritonMuonW, create_hybrid_optimizer,
                          from_torch_checkpoint, from_torch_state_dict, split_parameters, to_torch_checkpoint,
                          to_torch_state_dict)

__all__ = ["Optimizer", "MuonOptimizer", "SpectralSphereOptimizer", "HybridOptimizer", "SolverReport",
           "TritonMuon", "TritonMuonW", "StepReport", "create_hybrid_optimizer", "split_parameters", "HybridSplit",
           "NORMUON_BETA2",
           "BUCKET_SIZE", "NONFINITE_POLICIES", "STATE_BITS", "from_torch_state_dict", "to_torch_state_dict",
           "from_torch_checkpoint", "to_torch_checkpoint"]
