"""muon_fn: the Muon optimizer family for PyTorch.

A pure functional core (``init``/``update`` transforms over pytrees, composed with ``chain`` and
``partition``, compiled with ``compile_update``) and thin adapters for ``torch.optim`` loops and
FSDP2. See ``docs/api.md`` and ``docs/reference/``.
"""

from .core.alias import adamuon, adamuon_nosign, adamw, hybrid, matrix_labels, muon, normuon, triton_muon
from .core.base import EmptyState, GradientTransformation, TransformInfo, identity, info, stateless
from .core.combine import PartitionState, chain, leafwise_labels, partition
from .core.compile import compile_update
from .core.metrics import MetricsState, read_metrics, with_metrics
from .core.muon import align_rms, orthogonalize, scale_by_shape, shape_scale
from .core.newton_schulz import newton_schulz, polar_express, zeropower_via_newtonschulz5
from .core.qk_clip import (AttentionHeads, QKClip, QKClipFactors, max_attention_logits, qk_clip_factors,
                           record_max_logits, scale_head_rows, track_max_logits)
from .core.sso import SpectralSphereState, spectral_sphere, sso
from .optim import (MuonOptimizer, Optimizer, SolverReport, SpectralSphereOptimizer, TritonMuon, TritonMuonW,
                    create_hybrid_optimizer, split_parameters)
from . import spectral
from . import fsdp  # noqa: F401  registers the distributed executor with the engine (torch.distributed: on first use)
from .core.views import Heads, heads
from .core.transforms import (MomentumState, NormalizeRowsState, QuantizedAdamState, QuantizedMomentumState,
                              ScaleByAdamState, ScaleByScheduleState, ScaleBySecondMomentState,
                              add_decoupled_weight_decay, apply_updates, momentum, normalize_layerwise, normalize_rows,
                              scale_by_adam, scale_by_learning_rate, scale_by_second_moment, scale_by_sign)

__version__ = "0.1.0"

__all__ = [
    # base and combinators
    "GradientTransformation",
    "EmptyState",
    "identity",
    "stateless",
    "chain",
    "partition",
    "PartitionState",
    "leafwise_labels",
    "TransformInfo",
    "info",
    "apply_updates",
    "compile_update",
    # telemetry
    "with_metrics",
    "MetricsState",
    "read_metrics",
    # transforms
    "momentum",
    "MomentumState",
    "QuantizedMomentumState",
    "orthogonalize",
    "heads",
    "Heads",
    "scale_by_shape",
    "shape_scale",
    "add_decoupled_weight_decay",
    "scale_by_learning_rate",
    "ScaleByScheduleState",
    "scale_by_adam",
    "ScaleByAdamState",
    "QuantizedAdamState",
    "normalize_rows",
    "NormalizeRowsState",
    "normalize_layerwise",
    "scale_by_sign",
    "scale_by_second_moment",
    "ScaleBySecondMomentState",
    "align_rms",
    # recipes
    "muon",
    "adamw",
    "normuon",
    "adamuon",
    "adamuon_nosign",
    "hybrid",
    "matrix_labels",
    "triton_muon",
    # math
    "newton_schulz",
    "zeropower_via_newtonschulz5",
    "polar_express",
    # adapters
    "Optimizer",
    "MuonOptimizer",
    "create_hybrid_optimizer",
    "split_parameters",
    "TritonMuon",
    "TritonMuonW",
    # spectral sphere (SSO)
    "spectral_sphere",
    "SpectralSphereState",
    "sso",
    "SpectralSphereOptimizer",
    "SolverReport",
    "spectral",
    # QK-Clip (MuonClip)
    "QKClip",
    "AttentionHeads",
    "QKClipFactors",
    "qk_clip_factors",
    "scale_head_rows",
    "max_attention_logits",
    "record_max_logits",
    "track_max_logits",
    # FSDP2 (imported on first use: muon_fn.fsdp loads torch.distributed)
    "FSDPMuonOptimizer",
    "FSDPSpectralSphereOptimizer",
]

_LAZY = {
    "FSDPMuonOptimizer": ("muon_fn.fsdp", "FSDPMuonOptimizer"),
    "FSDPSpectralSphereOptimizer": ("muon_fn.fsdp", "FSDPSpectralSphereOptimizer"),
}




def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'muon_fn' has no attribute {name!r}")
