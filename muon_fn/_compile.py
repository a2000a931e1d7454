"""``compile_update``: one torch.compile'd graph per transform update."""

from __future__ import annotations

from typing import Any

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
