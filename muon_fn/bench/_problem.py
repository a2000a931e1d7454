"""The benchmarks' parameter sets and their real gradients.

A set is the hidden matrices of a pre-LN transformer (per layer q, k, v, o, fc, proj). Gradients
come from one forward/backward of a byte-level model built from exactly these matrices on the
source bytes of Python's standard library: low stable rank, like real training gradients
(Gaussian noise would flatter 4-step schedules).
"""

from __future__ import annotations

import glob
import math
import os

import torch
import torch.nn.functional as F

MODEL_SIZES = {"tiny": (4, 256), "gpt2-small": (12, 768)}  # (layers, width); MLP is 4x width
MATRIX_NAMES = ("q", "k", "v", "o", "fc", "proj")
_SEQ, _BATCH, _VOCAB = 64, 2, 256


def check_size(model_size: str, layers: int | None = None) -> int:
    """The number of layers used of ``model_size`` (all if ``layers`` is None), or ``ValueError``."""
    if model_size not in MODEL_SIZES:
        raise ValueError(f"Invalid model_size: {model_size!r} (expected one of {sorted(MODEL_SIZES)})")
    total = MODEL_SIZES[model_size][0]
    if layers is None:
        return total
    if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= total:
        raise ValueError(f"Invalid layers: {layers!r} (expected 1..{total} for {model_size})")
    return layers


def matrix_shapes(model_size: str, layers: int | None = None) -> list[tuple[str, tuple[int, int]]]:
    """``(name, (out, in))`` of every hidden matrix of the set's first ``layers`` layers (default
    all): per layer q, k, v, o, fc, proj."""
    layers = check_size(model_size, layers)
    d = MODEL_SIZES[model_size][1]
    shapes = {"q": (d, d), "k": (d, d), "v": (d, d), "o": (d, d), "fc": (4 * d, d), "proj": (d, 4 * d)}
    return [(f"h{i}.{n}", shapes[n]) for i in range(layers) for n in MATRIX_NAMES]


def _corpus() -> torch.Tensor:
    """Bytes of the first 40 modules of Python's standard library (not of this project, whose
    edits would change the gradients)."""
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))[:40]
    text = b"".join(open(f, "rb").read() for f in files)
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def real_gradients(model_size: str, *, layers: int | None = None, seed: int = 0,
                   device: torch.device | str | None = None,
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[str]]:
    """Hidden matrices of a byte-level pre-LN transformer of ``model_size`` and their gradients.

    One forward/backward of the whole model on a batch of Python source bytes; ``layers`` keeps
    the first layers' matrices (the same values as in the whole set). Returns
    ``(params, grads, names)``, computed on the CPU (the same values for every device) and moved
    to ``device`` if given.
    """
    keep = len(MATRIX_NAMES) * check_size(model_size, layers)
    shapes = matrix_shapes(model_size)
    n_layers, d = MODEL_SIZES[model_size]
    g = torch.Generator().manual_seed(seed)
    params = [(torch.randn(s, generator=g) / math.sqrt(s[1])).requires_grad_() for _, s in shapes]
    emb = torch.randn(_VOCAB, d, generator=g) * 0.02
    data = _corpus()
    ix = torch.randint(0, len(data) - _SEQ - 1, (_BATCH,), generator=g)
    x = torch.stack([data[i:i + _SEQ] for i in ix])
    y = torch.stack([data[i + 1:i + _SEQ + 1] for i in ix])
    h = emb[x]
    heads = d // 64
    for layer in range(n_layers):
        wq, wk, wv, wo, wfc, wproj = params[6 * layer:6 * layer + 6]
        a = F.layer_norm(h, (d,))
        q, k, v = (t.view(_BATCH, _SEQ, heads, 64).transpose(1, 2) for t in (a @ wq.T, a @ wk.T, a @ wv.T))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(_BATCH, _SEQ, d)
        h = h + att @ wo.T
        h = h + F.gelu(F.layer_norm(h, (d,)) @ wfc.T) @ wproj.T
    loss = F.cross_entropy((F.layer_norm(h, (d,)) @ emb.T).view(-1, _VOCAB), y.view(-1))
    loss.backward()
    grads = [p.grad.detach().to(device, copy=True) for p in params[:keep]]
    return ([p.detach().to(device).requires_grad_() for p in params[:keep]], grads,
            [n for n, _ in shapes[:keep]])
