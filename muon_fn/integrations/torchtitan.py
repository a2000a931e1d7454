r"""torchtitan: muon_fn's optimizers in torchtitan's ``OptimizersContainer``.

torchtitan builds its optimizers from a config: each ``ParamGroupConfig`` matches parameter names
with a regex and names an optimizer; the container resolves the name in a fixed table of
factories (``Adam``, ``AdamW``, ...). :class:`MuonOptimizersContainer` adds muon_fn's classes to
that table::

    from torchtitan.components.optimizer import ParamGroupConfig
    from muon_fn.integrations.torchtitan import MuonOptimizersContainer

    optimizer = MuonOptimizersContainer.Config(param_groups=[
        ParamGroupConfig(pattern=r".*", optimizer_name="MuonOptimizer",
                         optimizer_kwargs={"lr": 0.02, "weight_decay": 0.01,
                                           "adamw_lr": 3e-4, "adamw_weight_decay": 0.1}),
    ], verbose=True)

and routes each model part's embeddings and output head as :func:`muon_fn.create_hybrid_optimizer`
does, by module and not by name (:func:`muon_fn.optim.split_parameters`: ``nn.Embedding``
weights, and a ``nn.Linear`` tied to one or else the last whose ``out_features`` is an
embedding's vocabulary size: llama3's ``tok_embeddings`` and ``lm_head``). Those parameters of
an ``algorithm="auto"`` group (the default) of a :class:`muon_fn.MuonOptimizer` or
:class:`muon_fn.SpectralSphereOptimizer` move to a group of their own next to it, the group's
``use_muon=False`` twin: AdamW at its ``adamw_lr`` and ``adamw_weight_decay``. The other
matrices get Muon, 0-/1-D parameters (norms, biases) AdamW, as an ``"auto"`` group does. A group
with ``"algorithm": "muon"`` or ``"adamw"`` is left as its pattern made it, so a pattern listed
first overrides the rule (first match wins). With pipeline parallelism a stage that holds the head
but no embedding has no vocabulary size to compare with: pin its head with such a group
(``r"^lm_head\."``, ``"algorithm": "adamw"``). ``container.splits`` has the split of each muon_fn
optimizer (a :class:`muon_fn.optim.HybridSplit`, as ``create_hybrid_optimizer``'s ``split``),
printed when ``verbose``.

Groups naming the same optimizer become one optimizer with those groups, as torchtitan batches
them. Its parameters are torchtitan's DTensors (FSDP2, TP, EP), so it runs the owner-computes
step; the ``fused`` and ``foreach`` keys torchtitan puts in every group are accepted; its
checkpoint helpers key state by the groups' ``param_names``. ``optimizer_factory_kwargs_by_name``
passes optimizer-wide keywords (``{"MuonOptimizer": {"compile": False, "metrics": 10}}``).
AdamW's hyperparameters in a muon_fn group are spelled ``adamw_betas`` and ``adamw_eps``
(``betas`` is refused with that hint).

Needs torchtitan (``pip install torchtitan``); importing this module imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from collections.abc import Callable

from torch import nn
from torchtitan.components.optimizer import OptimizersContainer

from ..optim import (
    HybridOptimizer,
    HybridSplit,
    MuonOptimizer,
    SpectralSphereOptimizer,
    TritonMuon,
    TritonMuonW,
    split_parameters,
)

__all__ = ["MuonOptimizersContainer", "FACTORIES"]

# The optimizer names a ParamGroupConfig may give, besides torchtitan's own.
FACTORIES: dict[str, Callable[..., Any]] = {
    "MuonOptimizer": MuonOptimizer,
    "SpectralSphereOptimizer": SpectralSphereOptimizer,
    "TritonMuon": TritonMuon,
    "TritonMuonW": TritonMuonW,
}
"""The optimizer names a ``ParamGroupConfig`` may give, besides torchtitan's own, and the class
each builds."""


def _routes(name: str) -> bool:
    """Whether the optimizer named ``name`` has ``"auto"`` groups (a matrix algorithm and AdamW)."""
    factory = FACTORIES.get(name)
    return isinstance(factory, type) and issubclass(factory, HybridOptimizer)


def _is_auto(group: dict[str, Any]) -> bool:
    return group.get("algorithm", "auto") == "auto" and "use_muon" not in group


def _role_split(model: nn.Module) -> dict[int, tuple[bool, str]]:
    """``id(param) -> (gets Muon, why)`` by :func:`muon_fn.optim.split_parameters`."""
    muon, adamw = split_parameters(model)
    return {**{id(p): (True, why) for _, p, why in muon}, **{id(p): (False, why) for _, p, why in adamw}}


class MuonOptimizersContainer(OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` that also resolves muon_fn's optimizer names
    (:data:`FACTORIES`) and gives embeddings and the output head AdamW in their ``"auto"`` groups
    (see the module's documentation); ``MuonOptimizersContainer.Config`` builds it.
    ``splits``: one :class:`muon_fn.optim.HybridSplit` per muon_fn optimizer with ``"auto"``
    groups, in the order of ``optimizers``."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        """torchtitan's optimizer config; its ``param_groups`` may name muon_fn's optimizers."""

        verbose: bool = False
        """Print each muon_fn optimizer's split (``container.splits``), as
        ``create_hybrid_optimizer(verbose=True)`` prints its own."""

    splits: list[HybridSplit]

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        self._built: list[tuple[Any, int, list[str]]] = []  # filled by _log_optimizer
        super().__init__(config, model_parts=model_parts)
        self.splits = [self._split(opt, part, patterns) for opt, part, patterns in self._built
                       if isinstance(opt, HybridOptimizer)]
        del self._built
        if config.verbose:
            for split in self.splits:
                print(split)

    @staticmethod
    def _resolve_optimizer_factory(name: str) -> Callable[..., Any]:
        if name in FACTORIES:
            return FACTORIES[name]
        return OptimizersContainer._resolve_optimizer_factory(name)

    @staticmethod
    def _build_param_groups(model: nn.Module, param_group_configs: list[Any],
                            impl_kwargs: dict[str, Any],
                            ) -> tuple[dict[str, list[dict[str, Any]]], dict[str, list[str]]]:
        """torchtitan's groups, with the embeddings and the output head of each ``"auto"`` group
        of a muon_fn optimizer moved to its ``use_muon=False`` twin, placed after it."""
        groups, patterns = OptimizersContainer._build_param_groups(model, param_group_configs, impl_kwargs)
        if not any(_routes(name) for name in groups):
            return groups, patterns
        to_adamw = {i for i, (muon, _) in _role_split(model).items() if not muon}
        for name in [n for n in groups if _routes(n)]:
            routed, routed_patterns = [], []
            for group, pattern in zip(groups[name], patterns[name]):
                moved = [k for k, p in enumerate(group["params"]) if id(p) in to_adamw and p.ndim >= 2]
                kept = [k for k in range(len(group["params"])) if k not in moved]
                if _is_auto(group) and moved:
                    twin = {key: v for key, v in group.items() if key != "algorithm"}
                    twin.update(params=[group["params"][k] for k in moved],
                                param_names=[group["param_names"][k] for k in moved], use_muon=False)
                    if kept:
                        routed.append({**group, "params": [group["params"][k] for k in kept],
                                       "param_names": [group["param_names"][k] for k in kept]})
                        routed_patterns.append(pattern)
                    routed.append(twin)
                    routed_patterns.append(f"{pattern} (embeddings, output head)")
                else:
                    routed.append(group)
                    routed_patterns.append(pattern)
            groups[name], patterns[name] = routed, routed_patterns
        return groups, patterns

    def _log_optimizer(self, optimizer: Any, part_idx: int, patterns: list[str]) -> None:
        super()._log_optimizer(optimizer, part_idx, patterns)
        self._built.append((optimizer, part_idx, patterns))

    def _split(self, optimizer: HybridOptimizer, part_idx: int, patterns: list[str]) -> HybridSplit:
        """Where each parameter of ``optimizer`` went, with split_parameters' reason, or its group's
        pattern where that pinned it against the rule."""
        roles = _role_split(self.model_parts[part_idx])
        muon: list[tuple[str, nn.Parameter, str]] = []  # (name, param, why), as split_parameters gives
        adamw: list[tuple[str, nn.Parameter, str]] = []
        for group, pattern in zip(optimizer.param_groups, patterns):
            for name, p in zip(group["param_names"], group["params"]):
                algorithm = group["algorithm"]
                to_muon = algorithm != "adamw" and (algorithm != "auto" or p.ndim >= 2)
                rule, why = roles.get(id(p), (None, ""))
                if rule != to_muon:
                    why = f"algorithm={algorithm!r} group [{pattern}]"
                (muon if to_muon else adamw).append((name, p, why))
        return HybridSplit(muon, adamw, optimizer=optimizer)
