r"""torchtitan: muon_fn's optimizers in torchtitan's ``OptimizersContainer``.

torchtitan builds its optimizers from a config: each ``ParamGroupConfig`` matches parameter names
with a regex and names an optimizer; the container resolves the name in a fixed table of
factories (``Adam``, ``AdamW``, ...). :class:`MuonOptimizersContainer` adds muon_fn's classes to
that table, and nothing else changes::

    from torchtitan.components.optimizer import ParamGroupConfig
    from muon_fn.integrations.torchtitan import MuonOptimizersContainer

    optimizer = MuonOptimizersContainer.Config(param_groups=[
        ParamGroupConfig(pattern=r"^(tok_embeddings|output)\.", optimizer_name="MuonOptimizer",
                         optimizer_kwargs={"algorithm": "adamw", "lr": 3e-4, "weight_decay": 0.1}),
        ParamGroupConfig(pattern=r".*", optimizer_name="MuonOptimizer",
                         optimizer_kwargs={"lr": 0.02, "weight_decay": 0.01, "adamw_lr": 3e-4}),
    ])

Groups naming the same optimizer become one optimizer with those groups, as torchtitan batches
them: here one :class:`muon_fn.MuonOptimizer` with an ``"adamw"`` group (the embedding and the
output head) and an ``"auto"`` one (Muon for the matrices, AdamW for norms and biases). Its
parameters are torchtitan's DTensors (FSDP2, TP, EP), so it runs the owner-computes step; the
``fused`` and ``foreach`` keys torchtitan puts in every group are accepted; its checkpoint
helpers key state by the groups' ``param_names``. ``optimizer_factory_kwargs_by_name``
passes optimizer-wide keywords (``{"MuonOptimizer": {"compile": False, "metrics": 10}}``).
AdamW's hyperparameters in a muon_fn group are spelled ``adamw_betas`` and ``adamw_eps``
(``betas`` is refused with that hint).

Needs torchtitan (``pip install torchtitan``); importing this module imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torchtitan.components.optimizer import OptimizersContainer

from ..optim import MuonOptimizer, SpectralSphereOptimizer, TritonMuon, TritonMuonW

__all__ = ["MuonOptimizersContainer", "FACTORIES"]

# The optimizer names a ParamGroupConfig may give, besides torchtitan's own.
FACTORIES: dict[str, Callable[..., Any]] = {
    "MuonOptimizer": MuonOptimizer,
    "SpectralSphereOptimizer": SpectralSphereOptimizer,
    "TritonMuon": TritonMuon,
    "TritonMuonW": TritonMuonW,
}


class MuonOptimizersContainer(OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` that also resolves muon_fn's optimizer names
    (:data:`FACTORIES`); ``MuonOptimizersContainer.Config`` builds it."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        """torchtitan's optimizer config; its ``param_groups`` may name muon_fn's optimizers."""

    @staticmethod
    def _resolve_optimizer_factory(name: str) -> Callable[..., Any]:
        if name in FACTORIES:
            return FACTORIES[name]
        return OptimizersContainer._resolve_optimizer_factory(name)
