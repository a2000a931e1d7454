"""A routed mixture-of-experts MLP for the demo GPT (the ``moe-*`` presets).

Each token's router scores pick ``top_k`` of ``num_experts`` GELU MLPs. The experts' weights are
held the way grouped-GEMM MoE layers hold them: ONE parameter per projection, ``fc`` of shape
``(E, d_ff, d_model)`` and ``proj`` of shape ``(E, d_model, d_ff)``, each an expert stack
``(E, out, in)`` that Muon reads as E matrices (``matrix_view="experts"``).

Dispatch is capacity-based (Switch Transformer / GShard), without a Python loop over tokens or
experts: within each sequence an expert takes at most ``capacity = ceil(capacity_factor · top_k ·
t / E)`` tokens, first come first served in token order; a token an expert has no room for is
dropped by that expert (the residual stream carries it on). The tokens are gathered into a
``(E, b·capacity, d_model)`` buffer (an index gather), both projections are batched matmuls over
the expert dim, and the outputs are gathered back to their tokens and mixed by the gate weights.
Routing per sequence in token order keeps the layer causal (a token's slot depends only on the
tokens before it) and makes a sequence's output independent of the other sequences in the batch,
so evaluation batches, gradient accumulation and data-parallel shards all compute the same
function.

The load-balancing loss is Switch Transformer's ``E · Σ_e f_e · P_e`` (``f_e``: the fraction of
routing choices that picked expert e, ``P_e``: its mean router probability), computed per sequence
and averaged; it is 1 when routing is uniform. ``aux_loss`` holds it after each forward pass.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MoE", "Routing", "capacity", "route"]


class Routing(NamedTuple):
    """Where each routing choice went, for a batch of b sequences of t tokens and top-k routing.

    slot: ``(b, t·k)`` long, the choice's row in its sequence's ``(E·capacity)`` expert buffer,
      or ``E·capacity`` if the expert was full (dropped).
    gate: ``(b, t, k)``, the weight of each choice's expert output.
    expert: ``(b, t, k)`` long, the chosen experts.
    probs: ``(b, t, E)`` fp32, the router's softmax.
    """

    slot: torch.Tensor
    gate: torch.Tensor
    expert: torch.Tensor
    probs: torch.Tensor


def capacity(tokens: int, num_experts: int, top_k: int, factor: float) -> int:
    """Tokens one expert takes from a sequence of ``tokens``: ceil(factor · top_k · tokens / E)."""
    return max(1, math.ceil(factor * top_k * tokens / num_experts))


def route(logits: torch.Tensor, top_k: int, cap: int) -> Routing:
    """Top-k routing of ``logits`` ``(b, t, E)`` with ``cap`` slots per expert and sequence.

    The gate is the router probability of each chosen expert, renormalized over the k choices
    when k > 1 (k = 1 keeps the raw probability, so the router gets a gradient from the loss).
    """
    b, t, e = logits.shape
    probs = F.softmax(logits.float(), dim=-1)
    gate, expert = probs.topk(top_k, dim=-1)
    if top_k > 1:
        gate = gate / gate.sum(dim=-1, keepdim=True)
    flat = expert.reshape(b, t * top_k)  # token-major: token i's choices before token i+1's
    taken = F.one_hot(flat, e).cumsum(dim=1)  # (b, t·k, E): choices of each expert so far
    position = taken.gather(2, flat[..., None]).squeeze(-1) - 1
    slot = torch.where(position < cap, flat * cap + position, e * cap)
    return Routing(slot, gate.to(logits.dtype), expert, probs)


def balance_loss(r: Routing) -> torch.Tensor:
    """Switch Transformer's load-balancing loss ``E · Σ_e f_e · P_e``, per sequence, averaged."""
    e = r.probs.shape[-1]
    chosen = F.one_hot(r.expert, e).flatten(1, 2).float().mean(dim=1)  # f: (b, E), no gradient
    return e * (chosen * r.probs.mean(dim=1)).sum(dim=-1).mean()


class MoE(nn.Module):
    """``top_k`` of ``num_experts`` GELU MLPs per token, the expert weights as 3-D stacks."""

    def __init__(self, d_model: int, d_ff: int, num_experts: int, top_k: int = 1,
                 capacity_factor: float = 1.25, dropout: float = 0.0) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and num_experts={num_experts}")
        if capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
        self.top_k, self.capacity_factor = top_k, capacity_factor
        self.router = nn.Linear(d_model, num_experts, bias=False)
        self.fc = nn.Parameter(torch.empty(num_experts, d_ff, d_model))
        self.proj = nn.Parameter(torch.empty(num_experts, d_model, d_ff))
        self.drop = nn.Dropout(dropout)
        self.aux_loss: torch.Tensor | None = None
        nn.init.normal_(self.fc, std=0.02)
        nn.init.normal_(self.proj, std=0.02)

    @property
    def num_experts(self) -> int:
        return self.fc.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        e, k = self.num_experts, self.top_k
        cap = capacity(t, e, k, self.capacity_factor)
        r = route(self.router(x), k, cap)
        self.aux_loss = balance_loss(r)
        # Which token fills each of the E·cap slots (t: an empty slot, read from a zero row).
        token = torch.arange(t, device=x.device).repeat_interleave(k).expand(b, -1)
        table = torch.full((b, e * cap + 1), t, dtype=torch.long, device=x.device)
        table = table.scatter(1, r.slot, token)[:, : e * cap]  # dropped choices land in the last column
        padded = torch.cat([x, x.new_zeros(b, 1, d)], dim=1)
        xs = padded.gather(1, table[..., None].expand(-1, -1, d))  # (b, E·cap, d)
        xs = xs.view(b, e, cap, d).transpose(0, 1).reshape(e, b * cap, d)
        h = F.gelu(torch.bmm(xs, self.fc.transpose(1, 2)))  # (E, b·cap, d_ff)
        ys = torch.bmm(h, self.proj.transpose(1, 2))  # (E, b·cap, d)
        ys = ys.view(e, b, cap, d).transpose(0, 1).reshape(b, e * cap, d)
        ys = torch.cat([ys, ys.new_zeros(b, 1, d)], dim=1)  # a dropped choice reads zeros
        y = ys.gather(1, r.slot[..., None].expand(-1, -1, d)).view(b, t, k, d)
        return self.drop((y * r.gate[..., None]).sum(dim=2))
