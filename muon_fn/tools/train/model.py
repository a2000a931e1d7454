"""A small, clean GPT for the examples and ``muon-fn train``.

Token + learned position embeddings, pre-LayerNorm blocks, causal self-attention through
``F.scaled_dot_product_attention``, a GELU MLP, a final LayerNorm and a linear head. Q, K and V are
separate ``nn.Linear`` layers so that Muon orthogonalizes each projection on its own shape (a fused
QKV matrix would need a head view, ``matrix_view={name: muon_fn.heads(rows=3)}``). Byte-level by
default (vocabulary 256).
With ``n_experts > 0`` (the ``moe-*`` presets) every block's MLP is a routed mixture of experts
(:class:`~muon_fn.tools.train.moe.MoE`) whose expert weights are 3-D stacks ``(E, out, in)``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from muon_fn import AttentionHeads, record_max_logits
from .moe import MoE

__all__ = ["GPT", "GPTConfig", "PRESETS", "config_for"]


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    tie_weights: bool = False
    # Mixture of experts (0: a dense MLP): top-k of n_experts MLPs of width 4·n_embd per token,
    # at most capacity·k·t/E tokens per expert and sequence; the load-balancing loss's weight.
    n_experts: int = 0
    moe_top_k: int = 1
    moe_capacity: float = 1.25
    moe_aux_coef: float = 0.01

    def to_dict(self) -> dict:
        return asdict(self)


# Architecture presets (random init). "gpt2" is GPT-2 small's shape (124M with a 50k vocabulary,
# 85M of matrices + byte embeddings here); it is far too slow for a CPU run but useful under
# torchrun/CUDA and for benchmarks.
PRESETS: dict[str, dict] = {
    "tiny": dict(n_layer=4, n_head=4, n_embd=128, block_size=256),
    "small": dict(n_layer=6, n_head=6, n_embd=384, block_size=256),
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024),
    # tiny with 4 experts per MLP, top-1 routing: the active parameters of tiny, 4x the MLP weights.
    "moe-tiny": dict(n_layer=4, n_head=4, n_embd=128, block_size=256, n_experts=4, moe_top_k=1),
}


def config_for(name: str, **overrides) -> GPTConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; valid presets: {sorted(PRESETS)}")
    kw = dict(PRESETS[name])
    kw.update({k: v for k, v in overrides.items() if v is not None})
    return GPTConfig(**kw)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd={cfg.n_embd} is not divisible by n_head={cfg.n_head}")
        self.n_head = cfg.n_head
        self.q = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.k = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.v = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = self.n_head
        q = self.q(x).view(b, t, h, c // h).transpose(1, 2)
        k = self.k(x).view(b, t, h, c // h).transpose(1, 2)
        v = self.v(x).view(b, t, h, c // h).transpose(1, 2)
        record_max_logits(self, q, k, causal=True)  # only while a QKClip tracks this layer
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(b, t, c))

    def qk_clip_heads(self) -> AttentionHeads:
        """Where QK-Clip finds this layer's heads (``muon_fn.QKClip(model, tau)``)."""
        return AttentionHeads(self, "q.weight", "k.weight", self.n_head, self.q.out_features // self.n_head)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=False)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=False)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = (MoE(cfg.n_embd, 4 * cfg.n_embd, cfg.n_experts, cfg.moe_top_k, cfg.moe_capacity, cfg.dropout)
                    if cfg.n_experts else MLP(cfg))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.tok_emb.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, 0.02), residual output projections scaled by 1/sqrt(2 * n_layer)."""
        std_resid = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, p in self.named_parameters():
            if p.ndim < 2:
                continue  # LayerNorm weights/biases keep their defaults (1, 0)
            std = std_resid if name.endswith(("proj.weight", "mlp.proj")) else 0.02
            nn.init.normal_(p, mean=0.0, std=std)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        b, t = idx.shape
        if t > self.config.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.config.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))
        balance = self._balance_term()
        return logits, loss if balance is None else loss + balance

    def _balance_term(self) -> torch.Tensor | None:
        """In training, ``moe_aux_coef`` × the MoE layers' load-balancing losses (summed), as
        ``coef·(aux − aux.detach())``: zero in value, so the reported loss is the cross-entropy
        alone, and the balancing loss's gradient in backward. None in eval or without experts."""
        aux = [blk.mlp.aux_loss for blk in self.blocks if isinstance(blk.mlp, MoE)]
        if not aux or not self.training or not self.config.moe_aux_coef:
            return None
        total = torch.stack(aux).sum()
        return self.config.moe_aux_coef * (total - total.detach())
