"""QK-Clip (MuonClip): bound the attention logits by rescaling each head's query and key rows.

After a step, each attention layer's per-head maximum pre-softmax logit of that step's forward
pass, ``S_h = max_{i,j} q_i^h·k_j^h / √d``, gives a factor ``γ_h = min(1, τ / S_h)``; the rows of
head ``h`` in ``W_q`` and in ``W_k`` are each multiplied by ``√γ_h``, so the head's logits shrink
by ``γ_h`` and its largest one by the same batch becomes ``τ``. A head with ``S_h ≤ τ`` keeps its
rows bit for bit (the choice is a ``torch.where`` on the device: nothing is read back).

Grouped-query attention (``n_kv_head`` < ``n_head``, query head ``h`` reading key head
``h // (n_head / n_kv_head)``, as ``scaled_dot_product_attention(enable_gqa=True)``): a query head
is scaled by its own ``√γ_h``, a key head by ``√γ`` of the largest ``S`` of its group, so every
head's logits shrink by at least ``γ_h``; the other query heads of that group keep their rows.

Pieces: :func:`qk_clip_factors` and :func:`scale_head_rows` (the math, on tensors),
:func:`max_attention_logits` and :func:`record_max_logits` (the model side: an attention layer
reports ``S`` from its own forward), :class:`AttentionHeads` (where one layer's heads live) and
:func:`track_max_logits` and :class:`QKClip` (the post-step, run by ``MuonOptimizer(qk_clip=...)``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import torch
from torch import nn

from . import checks as _checks

# Elements of one block of logits in max_attention_logits (bounds its transient memory).
_CHUNK_ELEMENTS = 1 << 24


class QKClipFactors(NamedTuple):
    """Per-head factors of one layer (all on the device of ``S``)."""

    q: torch.Tensor  # (n_head,): √γ_h of each query head
    k: torch.Tensor  # (n_kv_head,): √γ of each key head (its group's smallest γ)
    q_clipped: torch.Tensor  # (n_head,) bool: S_h > τ
    k_clipped: torch.Tensor  # (n_kv_head,) bool: some head of the group has S_h > τ


def qk_clip_factors(max_logits: torch.Tensor, tau: float | torch.Tensor,
                    n_kv_head: int | None = None) -> QKClipFactors:
    """``√γ`` per query head and per key head, ``γ_h = min(1, τ / S_h)`` (``S_h`` = ``max_logits``,
    shape ``(n_head,)``), computed in fp32 at least; a key head takes the largest ``S`` of its
    group of ``n_head / n_kv_head`` query heads (``None``: one each)."""
    s = max_logits.float() if max_logits.dtype in (torch.float16, torch.bfloat16) else max_logits
    n_head = s.shape[-1]
    n_kv = n_head if n_kv_head is None else n_kv_head
    s_kv = s.reshape(n_kv, n_head // n_kv).amax(dim=-1)

    def factor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        clipped = x > tau
        return torch.where(clipped, tau / x, 1.0).sqrt(), clipped

    (fq, cq), (fk, ck) = factor(s), factor(s_kv)
    return QKClipFactors(fq, fk, cq, ck)


def scale_head_rows(w: torch.Tensor, start: int, first_row: int, head_dim: int, factor: torch.Tensor,
                    clipped: torch.Tensor) -> torch.Tensor:
    """``w`` (rows ``start, start+1, …`` of a weight) with the rows of each clipped head
    multiplied by its factor: global row ``r`` in ``[first_row, first_row + n·head_dim)`` is row
    ``(r − first_row) mod head_dim`` of head ``(r − first_row) // head_dim`` of ``factor``/
    ``clipped`` (shape ``(n,)``). Other rows, and every row of an unclipped head, are ``w``'s."""
    n = factor.shape[0]
    head = (torch.arange(start, start + w.shape[0], device=w.device) - first_row).div(head_dim, rounding_mode="floor")
    inside = (head >= 0) & (head < n)
    head = head.clamp(0, n - 1)
    scale = factor[head].reshape((-1,) + (1,) * (w.ndim - 1))
    where = (clipped[head] & inside).reshape(scale.shape)
    return torch.where(where, (w * scale).to(w.dtype), w)


@torch.no_grad()
def max_attention_logits(q: torch.Tensor, k: torch.Tensor, *, causal: bool = False,
                         scale: float | None = None) -> torch.Tensor:
    """The largest pre-softmax logit of each query head, ``(n_head,)`` in fp32.

    ``q``: ``(batch, n_head, T, d)``; ``k``: ``(batch, n_kv_head, S, d)`` (``n_kv_head`` dividing
    ``n_head``: grouped-query attention, query head ``h`` reads key head ``h // (n_head/n_kv_head)``).
    ``scale`` defaults to ``1/√d``; ``causal`` masks as ``scaled_dot_product_attention(is_causal=True)``
    (query ``i`` sees keys ``j ≤ i``). Computed in blocks of queries, so its transient memory is
    bounded (about 64 MiB); it recomputes ``QKᵀ`` once, which a fused attention kernel does not expose.
    """
    b, h, t, d = q.shape
    hk, s = k.shape[1], k.shape[2]
    if h % hk:
        raise ValueError(f"k has {hk} heads, which does not divide q's {h}")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qg = q.float().reshape(b, hk, h // hk, t, d)
    kt = k.float().transpose(-1, -2).unsqueeze(2)  # (b, hk, 1, d, s)
    step = max(1, _CHUNK_ELEMENTS // max(1, b * h * s))
    best = torch.full((h,), -math.inf, device=q.device)
    for i in range(0, t, step):
        logits = (qg[..., i:i + step, :] @ kt) * scale  # (b, hk, g, rows, s)
        if causal:
            rows = torch.arange(i, min(t, i + step), device=q.device)
            logits = logits.masked_fill(torch.arange(s, device=q.device) > rows[:, None], -math.inf)
        best = torch.maximum(best, logits.amax(dim=(0, 3, 4)).reshape(h))
    return best


def record_max_logits(module: nn.Module, q: torch.Tensor, k: torch.Tensor, *, causal: bool = False,
                      scale: float | None = None) -> None:
    """Call inside an attention layer's ``forward`` with its ``q`` and ``k`` (as for
    :func:`max_attention_logits`): while :class:`QKClip` tracks ``module`` (it sets
    ``module.track_max_logits``) and the module is in training mode, ``module.max_logits`` becomes
    the running maximum, per head, over the forward passes since the last step (several
    micro-batches of one step included). Otherwise it does nothing and costs nothing."""
    if not (getattr(module, "track_max_logits", False) and module.training):
        return
    buf = module.max_logits
    torch.maximum(buf, max_attention_logits(q, k, causal=causal, scale=scale).to(buf.dtype), out=buf)


class AttentionHeads(NamedTuple):
    """Where the query and key heads of one attention layer live.

    ``module`` holds the weights (``q`` and ``k`` are their names in it, e.g. ``"q.weight"``; the
    same name for a fused QKV weight) and reports its logits through :func:`record_max_logits`.
    Query head ``h`` is rows ``q_row + h·head_dim …`` of ``q``; key head ``j`` rows
    ``k_row + j·head_dim …`` of ``k``. ``k_row=None``: 0 for separate weights, ``n_head·head_dim``
    for a fused ``[Q; K; V]`` weight. ``n_kv_head=None``: as many key heads as query heads.
    """

    module: nn.Module
    q: str
    k: str
    n_head: int
    head_dim: int
    n_kv_head: int | None = None
    q_row: int = 0
    k_row: int | None = None

    @property
    def kv_heads(self) -> int:
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def k_first_row(self) -> int:
        if self.k_row is not None:
            return self.k_row
        return self.n_head * self.head_dim if self.q == self.k else 0


Layers = nn.Module | Iterable[AttentionHeads]
Rows = Callable[[torch.Tensor], "tuple[torch.Tensor, int]"]


class QKClip:
    """QK-Clip over the attention layers of a model: ``MuonOptimizer(..., qk_clip=QKClip(model, tau))``.

    Args:
      layers: a model, whose modules with a ``qk_clip_heads()`` method (returning
        :class:`AttentionHeads`) are the layers, or the :class:`AttentionHeads` themselves.
      tau: the logit bound τ > 0 (Kimi K2 used 100).

    Each layer's module gets a non-persistent buffer ``max_logits`` (``(n_head,)``, fp32, -inf)
    and ``track_max_logits = True``; its ``forward`` fills the buffer with
    :func:`record_max_logits`. :meth:`step` (the optimizer calls it after each update) clips and
    resets the buffers; ``last_max_logits`` keeps the ``S`` it used, one tensor per layer.

    Every head whose largest pre-softmax logit ``S_h`` of that step's forward exceeded τ gets its
    rows in ``W_q`` and ``W_k`` multiplied by ``√(τ / S_h)``; the other heads keep their rows bit
    for bit (decided on the device with ``torch.where``, no host read). Pass it as ``qk_clip=`` to
    :class:`MuonOptimizer`, :func:`create_hybrid_optimizer` or :class:`FSDPMuonOptimizer` (its
    weights must be parameters of that optimizer; under FSDP2 build it after ``fully_shard``), or
    call ``clip.step()`` after any optimizer's step. A step that changed no parameter (an
    accumulation micro-step, a skipped step) does not clip. ``max_logit()`` is the max of
    ``last_max_logits`` (0-d tensor), ``parameters()`` the weights; ``tau`` must be finite and > 0.
    """

    def __init__(self, layers: Layers, tau: float) -> None:
        _checks.positive("tau", tau)
        self.tau = float(tau)
        self.layers = track_max_logits(layers)
        self.last_max_logits: list[torch.Tensor] | None = None

    def __repr__(self) -> str:
        return f"QKClip(tau={self.tau}, layers={len(self.layers)})"

    def parameters(self) -> list[torch.Tensor]:
        """The ``W_q`` and ``W_k`` weights (each once), as the modules hold them now."""
        found: dict[int, torch.Tensor] = {}
        for layer in self.layers:
            for name in (layer.q, layer.k):
                p = layer.module.get_parameter(name)
                found.setdefault(id(p), p)
        return list(found.values())

    def max_logit(self) -> torch.Tensor | None:
        """The largest ``S`` of the last step over every layer and head (0-d, on the device)."""
        if not self.last_max_logits:
            return None
        return torch.stack([s.max() for s in self.last_max_logits]).max()

    @torch.no_grad()
    def step(self, rows: Rows | None = None, *, enabled: torch.Tensor | None = None,
             reduce: Callable[[list[torch.Tensor]], None] | None = None) -> None:
        """Clip every layer by its recorded ``S``, then reset the records to -inf.

        ``rows(p)`` gives the tensor to scale in place and the global index of its first row
        (default ``(p, 0)``; the FSDP adapter gives a shard and its offset). ``enabled`` (0-d
        bool): where False nothing is scaled. ``reduce`` combines the records in place across
        data-parallel ranks (a max all-reduce) before they are used."""
        rows = rows or (lambda p: (p, 0))
        logits = [layer.module.max_logits for layer in self.layers]
        if reduce is not None:
            reduce(logits)
        self.last_max_logits = [s.clone() for s in logits]
        for layer, s in zip(self.layers, logits):
            f = qk_clip_factors(s, self.tau, layer.n_kv_head)
            cq, ck = (f.q_clipped, f.k_clipped) if enabled is None else (f.q_clipped & enabled, f.k_clipped & enabled)
            for name, first, factor, clipped in ((layer.q, layer.q_row, f.q, cq),
                                                 (layer.k, layer.k_first_row, f.k, ck)):
                w, start = rows(layer.module.get_parameter(name))
                w.copy_(scale_head_rows(w, start, first, layer.head_dim, factor, clipped))
            s.fill_(-math.inf)


def track_max_logits(layers: Layers) -> tuple[AttentionHeads, ...]:
    """The attention layers of a model (its modules with a ``qk_clip_heads()`` method) or the
    given :class:`AttentionHeads`, checked; each module records its max logits from now on (a
    ``max_logits`` buffer, see :class:`QKClip`). :class:`QKClip` calls it; call it alone to
    watch the logits without clipping them."""
    if isinstance(layers, nn.Module):
        model = layers
        layers = [m.qk_clip_heads() for m in model.modules() if callable(getattr(m, "qk_clip_heads", None))]
        if not layers:
            raise ValueError(f"QKClip found no attention layers in {type(model).__name__}: define "
                             "qk_clip_heads() on its attention modules, or pass AttentionHeads(...)")
    layers = tuple(layers)
    if not layers:
        raise ValueError("QKClip needs at least one attention layer")
    for index, layer in enumerate(layers):
        _check_layer(index, layer)
        _track(layer)
    return layers


def _check_layer(index: int, layer: AttentionHeads) -> None:
    """Shapes and layout of one layer, with errors naming the layer and the value."""
    if not isinstance(layer, AttentionHeads):
        raise TypeError(f"QKClip layer {index} must be an AttentionHeads, got {type(layer).__name__}")
    where = f"QKClip layer {index} ({type(layer.module).__name__})"
    for key in ("n_head", "head_dim"):
        _checks.positive_int(key, getattr(layer, key))
    if layer.n_kv_head is not None:
        _checks.positive_int("n_kv_head", layer.n_kv_head)
        if layer.n_head % layer.n_kv_head:
            raise ValueError(f"{where}: n_kv_head={layer.n_kv_head} does not divide n_head={layer.n_head}")
    for name, first, heads in ((layer.q, layer.q_row, layer.n_head), (layer.k, layer.k_first_row, layer.kv_heads)):
        try:
            p = layer.module.get_parameter(name)
        except AttributeError:
            raise ValueError(f"{where}: {type(layer.module).__name__} has no parameter {name!r}") from None
        need = first + heads * layer.head_dim
        if p.ndim != 2 or first < 0 or p.shape[0] < need:
            raise ValueError(f"{where}: parameter {name!r} of shape {tuple(p.shape)} cannot hold {heads} heads "
                             f"of {layer.head_dim} rows from row {first} (needs a matrix of at least {need} rows)")


def _track(layer: AttentionHeads) -> None:
    """The layer's module records its per-head max logit from now on."""
    module = layer.module
    existing = getattr(module, "max_logits", None)
    if isinstance(existing, torch.Tensor) and tuple(existing.shape) != (layer.n_head,):
        raise ValueError(f"{type(module).__name__}.max_logits has shape {tuple(existing.shape)}, "
                         f"expected ({layer.n_head},) (one per query head)")
    if existing is None:
        device = module.get_parameter(layer.q).device
        module.register_buffer("max_logits", torch.full((layer.n_head,), -math.inf, device=device),
                               persistent=False)
    module.track_max_logits = True


def check_tracked(clip: QKClip | None, params: Sequence[torch.Tensor], owner: str) -> None:
    """``clip`` is a :class:`QKClip` (or None) whose weights are all among ``params``."""
    if clip is None:
        return
    if not isinstance(clip, QKClip):
        raise TypeError(f"qk_clip must be a muon_fn.QKClip or None, got {type(clip).__name__}")
    mine = {id(p) for p in params}
    for layer in clip.layers:
        for name in (layer.q, layer.k):
            if id(layer.module.get_parameter(name)) not in mine:
                raise ValueError(f"qk_clip: {type(layer.module).__name__}.{name} is not a parameter of this "
                                 f"{owner} (QKClip must see the parameters the optimizer updates; build it "
                                 "after fully_shard)")
