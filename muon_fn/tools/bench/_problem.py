"""The benchmarks' parameter sets and their real gradients.

A set is the hidden matrices of a pre-norm transformer, layer by layer (:data:`SETS`):

- ``"tiny"``, ``"gpt2-small"`` (``kind="gpt"``): per layer q, k, v, o (d×d), fc (4d×d), proj
  (d×4d); the sets timed by default, on the CPU as on a GPU.
- ``"llama3-1b"`` (``kind="llama"``): Llama-3.2-1B's layers (d = 2048, 32 query heads and 8
  KV heads of 64, SwiGLU MLP 8192): per layer q and o 2048×2048, k and v 512×2048, gate and up
  8192×2048, down 2048×8192; 16 layers, 112 matrices, 973 M parameters.
- ``"llama3-8b"``: Llama-3-8B's layers (d = 4096, 32 query heads and 8 KV heads of 128, MLP
  14336); 32 layers, of which the first 8 by default (56 matrices, 1.75 B parameters: with the
  bench's optimizer states, all 32 would not fit one 80 GB GPU).
- ``"deepseek-moe"`` (``kind="moe"``): the routed experts of a DeepSeekMoE-16B / DeepSeek-V2-Lite
  MLP (d = 2048, 64 experts of width 1408, top-6 routing): per layer three expert stacks
  ``(E, out, in)``, gate and up (64, 1408, 2048) and down (64, 2048, 1408), each E matrices under
  the ``"experts"`` view; 27 MoE layers, of which the first 2 by default (384 matrices, 1.1 B
  parameters). DeepSeek-V3's experts (256 of 2048×7168 per stack, 11 B parameters a layer) would
  not fit one GPU with the bench's states.

Shapes (:func:`matrix_shapes`) and meta tensors (:func:`meta_params`) cost nothing, so FLOP counts
and plans of every set need no memory. Gradients come from one forward/backward of a byte-level
model built from exactly these matrices on the source bytes of Python's standard library: low
stable rank, like real training gradients (Gaussian noise would flatter 4-step schedules).
"""

from __future__ import annotations

import glob
import math
import os
import pathlib
from typing import NamedTuple

import torch
import torch.nn.functional as F

from muon_fn.orthogonalization import DEFAULT_METHOD, coefficient_schedule
from ._bound import step_gemm_flops


class MatrixSet(NamedTuple):
    """A parameter set: the hidden matrices of ``layers`` transformer layers."""

    kind: str  # "gpt" (q, k, v, o, fc, proj; GELU MLP), "llama" (grouped-query attention,
    #            SwiGLU: q, k, v, o, gate, up, down) or "moe" (expert stacks gate, up, down)
    layers: int
    width: int  # d
    mlp: int  # MLP width (of each expert for "moe")
    heads: int  # query heads (attention only)
    kv_heads: int
    head_dim: int
    experts: int = 0  # routed experts per layer ("moe")
    top_k: int = 0  # experts per token ("moe")
    default_layers: int | None = None  # what layers=None selects (None: all)


SETS: dict[str, MatrixSet] = {
    "tiny": MatrixSet("gpt", 4, 256, 1024, 4, 4, 64),
    "gpt2-small": MatrixSet("gpt", 12, 768, 3072, 12, 12, 64),
    "llama3-1b": MatrixSet("llama", 16, 2048, 8192, 32, 8, 64),
    "llama3-8b": MatrixSet("llama", 32, 4096, 14336, 32, 8, 128, default_layers=8),
    "deepseek-moe": MatrixSet("moe", 27, 2048, 1408, 0, 0, 0, experts=64, top_k=6, default_layers=2),
}
MODEL_SIZES = {name: (s.layers, s.width) for name, s in SETS.items()}  # (layers, width)
DEFAULT_SIZES = ("tiny", "gpt2-small")  # --model-size all
MATRIX_NAMES = ("q", "k", "v", "o", "fc", "proj")  # per layer of the "gpt" sets
LAYER_NAMES = {"gpt": MATRIX_NAMES, "llama": ("q", "k", "v", "o", "gate", "up", "down"),
               "moe": ("gate", "up", "down")}
# A selection of more parameters is not timed on the CPU unless forced (gpt2-small: 85 M).
CPU_MAX_PARAMS = 100_000_000
_SEQ, _BATCH, _VOCAB = 64, 2, 256


def check_size(model_size: str, layers: int | None = None) -> int:
    """The number of layers used of ``model_size`` (its default if ``layers`` is None: all,
    except where :data:`SETS` says otherwise), or ``ValueError``."""
    if model_size not in SETS:
        raise ValueError(f"Invalid model_size: {model_size!r} (expected one of {sorted(SETS)})")
    total = SETS[model_size].layers
    if layers is None:
        return SETS[model_size].default_layers or total
    if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= total:
        raise ValueError(f"Invalid layers: {layers!r} (expected 1..{total} for {model_size})")
    return layers


def layer_shapes(model_size: str) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of one layer's matrices (``(E, out, in)`` for an expert stack)."""
    s = SETS[model_size]
    d, f = s.width, s.mlp
    if s.kind == "gpt":
        return {"q": (d, d), "k": (d, d), "v": (d, d), "o": (d, d), "fc": (f, d), "proj": (d, f)}
    if s.kind == "llama":
        q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
        return {"q": (q, d), "k": (kv, d), "v": (kv, d), "o": (d, q), "gate": (f, d), "up": (f, d), "down": (d, f)}
    e = s.experts
    return {"gate": (e, f, d), "up": (e, f, d), "down": (e, d, f)}


def matrix_shapes(model_size: str, layers: int | None = None) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of every parameter of the set's first ``layers`` layers (default: see
    :func:`check_size`), named ``h{layer}.{kind}``: 2-D ``(out, in)``, or ``(E, out, in)`` for an
    expert stack (E matrices). Plain tuples: no tensor is made."""
    layers = check_size(model_size, layers)
    shapes = layer_shapes(model_size)
    return [(f"h{i}.{n}", shapes[n]) for i in range(layers) for n in LAYER_NAMES[SETS[model_size].kind]]


def set_size(model_size: str, layers: int | None = None) -> tuple[int, int]:
    """``(matrices, parameters)`` of the selection (an expert stack counts its E matrices)."""
    shapes = [s for _, s in matrix_shapes(model_size, layers)]
    return sum(math.prod(s[:-2]) for s in shapes), sum(math.prod(s) for s in shapes)


def check_cpu_size(model_size: str, layers: int | None, device: torch.device) -> None:
    """``ValueError`` if the selection is too large to time on the CPU (over
    :data:`CPU_MAX_PARAMS` parameters), saying how large and what to do instead."""
    matrices, params = set_size(model_size, layers)
    if device.type != "cpu" or params <= CPU_MAX_PARAMS:
        return
    flops = step_gemm_flops([s for _, s in matrix_shapes(model_size, layers)], coefficient_schedule(DEFAULT_METHOD))
    raise ValueError(
        f"Invalid model_size: {model_size!r} on the CPU ({check_size(model_size, layers)} layer(s), {matrices} "
        f"matrices, {params / 1e6:.0f} M params, {flops / 1e12:.1f} TFLOP of Newton-Schulz GEMMs per step of "
        f"each Muon row: minutes to hours a step here; the CPU limit is {CPU_MAX_PARAMS // 10**6} M params). "
        "Time it on a GPU (--device cuda), select fewer layers (--layers), or pass --force")


def meta_params(model_size: str, layers: int | None = None) -> tuple[list[torch.Tensor], list[str]]:
    """The selection's parameters as meta tensors (shapes and dtype, no memory), and their names:
    for planning and counting without allocating."""
    shapes = matrix_shapes(model_size, layers)
    return [torch.empty(s, device="meta") for _, s in shapes], [n for n, _ in shapes]


def _corpus() -> torch.Tensor:
    """Bytes of the first 40 modules of Python's standard library (not of this project, whose
    edits would change the gradients)."""
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))[:40]
    text = b"".join(pathlib.Path(f).read_bytes() for f in files)
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def real_gradients(model_size: str, *, layers: int | None = None, seed: int = 0,
                   device: torch.device | str | None = None,
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[str]]:
    """Hidden matrices of a byte-level pre-norm transformer of ``model_size`` and their gradients.

    One forward/backward on a batch of Python source bytes. The "gpt" sets run the whole model
    and keep the first ``layers`` layers' matrices (the same values as in the whole set); the
    larger sets run a model of the selected layers only. "gpt": LayerNorm, GELU MLP; "llama":
    RMSNorm, grouped-query attention, SwiGLU; "moe": RMSNorm and a routed MoE MLP per layer (a
    fixed random router, softmax, top-k, weights not renormalized; an expert no token reaches
    gets a zero gradient). None has positional encodings. Returns ``(params, grads, names)``,
    computed on the CPU (the same values for every device) and moved to ``device`` if given.
    """
    used = check_size(model_size, layers)
    spec = SETS[model_size]
    per_layer = len(LAYER_NAMES[spec.kind])
    shapes = matrix_shapes(model_size, spec.layers if spec.kind == "gpt" else used)
    d = spec.width
    g = torch.Generator().manual_seed(seed)
    params = [(torch.randn(s, generator=g) / math.sqrt(s[-1])).requires_grad_() for _, s in shapes]
    emb = torch.randn(_VOCAB, d, generator=g) * 0.02
    routers = [torch.randn(spec.experts, d, generator=g) * 0.02 for _ in range(used)] if spec.kind == "moe" else []
    data = _corpus()
    ix = torch.randint(0, len(data) - _SEQ - 1, (_BATCH,), generator=g)
    x = torch.stack([data[i:i + _SEQ] for i in ix])
    y = torch.stack([data[i + 1:i + _SEQ + 1] for i in ix])
    h = emb[x]
    block = {"gpt": _gpt_block, "llama": _llama_block, "moe": _moe_block}[spec.kind]
    for layer in range(len(shapes) // per_layer):
        h = block(spec, h, params[per_layer * layer:per_layer * (layer + 1)], routers[layer] if routers else None)
    norm = F.layer_norm if spec.kind == "gpt" else F.rms_norm
    loss = F.cross_entropy((norm(h, (d,)) @ emb.T).view(-1, _VOCAB), y.view(-1))
    loss.backward()
    keep = per_layer * used
    grads = [p.grad.detach().to(device, copy=True) for p in params[:keep]]
    return ([p.detach().to(device).requires_grad_() for p in params[:keep]], grads,
            [n for n, _ in shapes[:keep]])


def gpt_model(model_size: str, *, layers: int | None = None, seed: int = 0, device: torch.device | str | None = None,
              gradients: bool = True) -> torch.nn.Module:
    """A byte-level GPT (:class:`muon_fn.tools.train.model.GPT`) of a "gpt" set's first ``layers``
    layers, width and heads: the set's hidden matrices, plus token and position embeddings,
    LayerNorms, biases and a head: what :func:`muon_fn.create_hybrid_optimizer` splits. Its
    parameters are seeded; with ``gradients``, ``.grad`` is set by one forward/backward on a
    batch of the same source bytes as :func:`real_gradients`, on the CPU, then moved to ``device``."""
    from ..train.model import GPT, GPTConfig

    used = check_size(model_size, layers)
    spec = SETS[model_size]
    if spec.kind != "gpt":
        gpt = sorted(name for name, s in SETS.items() if s.kind == "gpt")
        raise ValueError(f"Invalid model_size: {model_size!r} (a GPT model is built of the gpt sets: {gpt})")
    torch.manual_seed(seed)
    model = GPT(GPTConfig(n_layer=used, n_head=spec.heads, n_embd=spec.width, block_size=_SEQ))
    if gradients:
        data, g = _corpus(), torch.Generator().manual_seed(seed)
        ix = torch.randint(0, len(data) - _SEQ - 1, (_BATCH,), generator=g)
        x = torch.stack([data[i:i + _SEQ] for i in ix])
        y = torch.stack([data[i + 1:i + _SEQ + 1] for i in ix])
        model(x, y)[1].backward()
    return model.to(device)


def _attention(spec: MatrixSet, a: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor,
               wo: torch.Tensor) -> torch.Tensor:
    """Causal attention with ``spec.heads`` query heads sharing ``spec.kv_heads`` key/value heads."""
    hd, repeat = spec.head_dim, spec.heads // spec.kv_heads
    q = (a @ wq.T).view(_BATCH, _SEQ, spec.heads, hd).transpose(1, 2)
    k, v = ((a @ w.T).view(_BATCH, _SEQ, spec.kv_heads, hd).transpose(1, 2) for w in (wk, wv))
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    return att.reshape(_BATCH, _SEQ, spec.heads * hd) @ wo.T


def _gpt_block(spec: MatrixSet, h: torch.Tensor, w: list[torch.Tensor], router: None) -> torch.Tensor:
    d = spec.width
    h = h + _attention(spec, F.layer_norm(h, (d,)), *w[:4])
    return h + F.gelu(F.layer_norm(h, (d,)) @ w[4].T) @ w[5].T


def _swiglu(a: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return (F.silu(a @ gate.T) * (a @ up.T)) @ down.T


def _llama_block(spec: MatrixSet, h: torch.Tensor, w: list[torch.Tensor], router: None) -> torch.Tensor:
    d = spec.width
    h = h + _attention(spec, F.rms_norm(h, (d,)), *w[:4])
    return h + _swiglu(F.rms_norm(h, (d,)), *w[4:])


def _moe_block(spec: MatrixSet, h: torch.Tensor, w: list[torch.Tensor], router: torch.Tensor) -> torch.Tensor:
    gate, up, down = w
    a = F.rms_norm(h, (spec.width,)).reshape(-1, spec.width)
    weights, chosen = (a @ router.T).softmax(-1).topk(spec.top_k, dim=-1)
    out = torch.zeros_like(a)
    for e in range(spec.experts):
        token, slot = (chosen == e).nonzero(as_tuple=True)
        if token.numel():
            y = _swiglu(a[token], gate[e], up[e], down[e]) * weights[token, slot, None]
            out = out.index_add(0, token, y)
    return h + out.view_as(h)
