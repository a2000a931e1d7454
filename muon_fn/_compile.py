"""``compile_update``: one torch.compile'd graph per transform update; ``compile_per_shape``."""

from __future__ import annotations

import types
from typing import Any, Callable

import torch

from ._base import GradientTransformation


def compile_update(tx: GradientTransformation, **torch_compile_kwargs: Any) -> GradientTransformation:
    """``tx`` with ``update`` wrapped in ``torch.compile(fullgraph=True, **kwargs)``.

    Pass per-step scalars (lr, ...) as 0-d tensors — build the transform with a 0-d tensor and
    update it in place — so changing them never recompiles. ``init`` stays eager.
    """
    kwargs = {"fullgraph": True, **torch_compile_kwargs}
    compiled = torch.compile(tx.update, **kwargs)
    name = getattr(tx.update, "_muon_fn_repr", None)
    if name is not None:
        compiled._muon_fn_repr = f"compile_update({name})"
    return GradientTransformation(tx.init, compiled)


def compile_per_shape(fn: Callable[[torch.Tensor], torch.Tensor], **torch_compile_kwargs: Any
                      ) -> Callable[[torch.Tensor], torch.Tensor]:
    """``fn(x)`` compiled once per distinct shape, dtype, device and strides of ``x``.

    Each shape gets its own static graph (``fullgraph=True, dynamic=False`` unless overridden)
    through a fresh copy of ``fn``'s code object, so Dynamo's per-code recompile limit never
    applies however many shapes a model has, and a shape seen before never recompiles. Used by
    :class:`muon_fn.MuonOptimizer` (``compile=True``) for the orthogonalization of each
    ``(B, m, n)`` batch of same-shape matrices.
    """
    kwargs = {"fullgraph": True, "dynamic": False, **torch_compile_kwargs}
    compiled: dict[tuple, Callable[[torch.Tensor], torch.Tensor]] = {}

    def call(x: torch.Tensor) -> torch.Tensor:
        key = (tuple(x.shape), x.stride(), x.dtype, x.device)
        f = compiled.get(key)
        if f is None:
            copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                                      fn.__defaults__, fn.__closure__)
            f = compiled[key] = torch.compile(copy, **kwargs)
        return f(x)

    call.graphs = compiled  # type: ignore[attr-defined]
    return call
