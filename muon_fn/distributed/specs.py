"""Model shape specs: the parameter shapes of a few real architectures, as small config dicts.

A spec is a plain dict of sizes (no weights, nothing downloaded). :func:`model_params` expands it
into every parameter as ``(name, global shape, matrix view or None)``, split as the library's
hybrid split does: hidden matrices (attention and MLP projections, expert stacks, the MoE
router) go to Muon; embeddings, the output head and norms (``None``) go to AdamW. An expert
stack is one parameter ``(E, out, in)`` read under the ``"experts"`` view (E matrices).

Shipped (:data:`SPECS`):

- ``"llama3-8b"``, ``"llama3-70b"``: dense Llama-3 layouts (grouped-query attention, SwiGLU).
- ``"deepseek-v3"``: a DeepSeek-V3-like MoE (multi-head latent attention, 3 dense layers, then 58
  layers of 256 routed experts + 1 shared expert; the multi-token-prediction module left out).
- ``"tiny"``: a 2-layer toy of the same layout with 4 experts, for tests and examples.
"""

from __future__ import annotations

from typing import Any, NamedTuple

Spec = dict[str, Any]


class Param(NamedTuple):
    """One parameter of a spec."""

    name: str
    shape: tuple[int, ...]  # global
    view: str | None  # matrix view ("flatten", "experts") for Muon; None: AdamW


LLAMA3_8B: Spec = {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128,
                   "ffn": 14336, "vocab": 128256}
LLAMA3_70B: Spec = {"layers": 80, "hidden": 8192, "heads": 64, "kv_heads": 8, "head_dim": 128,
                    "ffn": 28672, "vocab": 128256}
DEEPSEEK_V3: Spec = {"layers": 61, "hidden": 7168, "ffn": 18432, "vocab": 129280,
                     "attention": "mla", "heads": 128, "q_lora": 1536, "kv_lora": 512,
                     "qk_nope": 128, "qk_rope": 64, "v_head": 128,
                     "dense_layers": 3, "experts": 256, "shared_experts": 1, "expert_ffn": 2048}
TINY: Spec = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "ffn": 128,
              "vocab": 256, "dense_layers": 1, "experts": 4, "shared_experts": 0, "expert_ffn": 32}

SPECS: dict[str, Spec] = {"llama3-8b": LLAMA3_8B, "llama3-70b": LLAMA3_70B,
                          "deepseek-v3": DEEPSEEK_V3, "tiny": TINY}
"""The shipped specs by name (``muon-fn plan --model NAME``, :func:`muon_fn.fsdp.plan_model`):
``"llama3-8b"``, ``"llama3-70b"``, ``"deepseek-v3"`` (a DeepSeek-V3-like MoE: expert stacks
``(256, out, in)`` under the ``"experts"`` view) and ``"tiny"``, each a dict of sizes;
``specs.model_params(spec)`` lists every parameter as ``(name, shape, view)``, ``view=None`` for
the AdamW ones (embeddings, head, norms)."""


def get_spec(spec: str | Spec) -> Spec:
    """A spec by name (:data:`SPECS`), or ``spec`` itself when it is a dict."""
    if isinstance(spec, dict):
        return spec
    if spec not in SPECS:
        raise ValueError(f"Invalid model spec: {spec!r} (valid: {', '.join(map(repr, SPECS))})")
    return SPECS[spec]


def model_params(spec: str | Spec) -> list[Param]:
    """Every parameter of ``spec`` in model order: the embedding, each layer's attention then MLP
    (or MoE) and norms, the final norm and the (untied) output head."""
    s = get_spec(spec)
    h = s["hidden"]
    params = [Param("embed.weight", (s["vocab"], h), None)]
    for i in range(s["layers"]):
        pre = f"layers.{i}."
        params.append(Param(pre + "attn_norm.weight", (h,), None))
        params += [p._replace(name=pre + p.name) for p in _attention(s)]
        params.append(Param(pre + "mlp_norm.weight", (h,), None))
        params += [p._replace(name=pre + p.name) for p in _mlp(s, moe=_is_moe_layer(s, i))]
    params.append(Param("norm.weight", (h,), None))
    params.append(Param("head.weight", (s["vocab"], h), None))
    return params


def _is_moe_layer(s: Spec, i: int) -> bool:
    return s.get("experts", 0) > 0 and i >= s.get("dense_layers", 0)


def _attention(s: Spec) -> list[Param]:
    h = s["hidden"]
    if s.get("attention", "gqa") == "mla":
        heads, qk = s["heads"], s["qk_nope"] + s["qk_rope"]
        return [Param("attn.q_a_proj.weight", (s["q_lora"], h), "flatten"),
                Param("attn.q_a_norm.weight", (s["q_lora"],), None),
                Param("attn.q_b_proj.weight", (heads * qk, s["q_lora"]), "flatten"),
                Param("attn.kv_a_proj.weight", (s["kv_lora"] + s["qk_rope"], h), "flatten"),
                Param("attn.kv_a_norm.weight", (s["kv_lora"],), None),
                Param("attn.kv_b_proj.weight", (heads * (s["qk_nope"] + s["v_head"]), s["kv_lora"]), "flatten"),
                Param("attn.o_proj.weight", (h, heads * s["v_head"]), "flatten")]
    q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    return [Param("attn.q_proj.weight", (q, h), "flatten"), Param("attn.k_proj.weight", (kv, h), "flatten"),
            Param("attn.v_proj.weight", (kv, h), "flatten"), Param("attn.o_proj.weight", (h, q), "flatten")]


def _mlp(s: Spec, moe: bool) -> list[Param]:
    h = s["hidden"]
    if not moe:
        f = s["ffn"]
        return [Param("mlp.gate_proj.weight", (f, h), "flatten"), Param("mlp.up_proj.weight", (f, h), "flatten"),
                Param("mlp.down_proj.weight", (h, f), "flatten")]
    e, f = s["experts"], s["expert_ffn"]
    params = [Param("moe.router.weight", (e, h), "flatten"),
              Param("moe.experts.gate_proj", (e, f, h), "experts"),
              Param("moe.experts.up_proj", (e, f, h), "experts"),
              Param("moe.experts.down_proj", (e, h, f), "experts")]
    if s.get("shared_experts", 0):
        fs = f * s["shared_experts"]
        params += [Param("moe.shared.gate_proj.weight", (fs, h), "flatten"),
                   Param("moe.shared.up_proj.weight", (fs, h), "flatten"),
                   Param("moe.shared.down_proj.weight", (h, fs), "flatten")]
    return params
