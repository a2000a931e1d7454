"""QK-Clip (MuonClip): the math on tensors, the model side, the optimizers' ``qk_clip=`` option,
and FSDP2 at W = 2 on gloo (one spawned job, bit-exact against single-device MuonOptimizer).

The guarantee checked: after a step, the logits each attention layer produces *from the inputs it
saw in that step's forward* are at most τ (up to fp32 rounding of √γ·√γ, a relative 1e-6); a head
whose max logit was at most τ keeps its W_q and W_k rows bit for bit (they equal the rows of the
same step without QK-Clip).

Tests taking ``device`` run on each device of the lane (tests/conftest.py): models on the device,
inputs drawn on the CPU from seeded generators and moved. Tolerances per device in ``TOL``: the
CPU's are the suite's; on CUDA the logits checked are recomputed by GEMMs that reduce in another
order than the ones the step saw (TF32 stays off, torch's default) and ``torch.where``/``sqrt`` run
as GPU kernels: ten times the CPU's relative rounding. What is bit for bit (rows left alone, rows
scaled by a factor computed the same way on the same device) stays bit for bit.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import os
import socket
import subprocess
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import expecttest
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import lane_examples
from hypothesis import given
from hypothesis import strategies as st

import muon_fn as mf
from muon_fn.tools.train.model import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[1]
TOL = {
    # rounding: relative, (√γ)² is γ to fp32 rounding; logits: written out against the function's
    "cpu": {"rounding": 1e-6, "logits": dict(rtol=1e-6, atol=1e-6)},
    "cuda": {"rounding": 1e-5, "logits": dict(rtol=1e-5, atol=1e-5)},
}


def rounding(device: torch.device) -> float:
    return TOL[device.type]["rounding"]


# ---------------------------------------------------------------------------- the math
@lane_examples
@given(
    s=st.lists(st.floats(-1e4, 1e4, width=32), min_size=1, max_size=8),
    tau=st.floats(1e-2, 1e3),
    group=st.sampled_from([1, 2, 4]),
)
def test_factors(device, s, tau, group):
    """γ = min(1, τ/S) per query head; a key head takes its group's smallest γ; heads at or
    below τ get exactly 1 and are not marked."""
    n_kv = len(s)
    S = torch.tensor(s).repeat_interleave(group).to(device)  # n_head = n_kv · group
    f = mf.qk_clip_factors(S, tau, n_kv if group > 1 else None)
    assert f.q.device == S.device and torch.equal(f.q_clipped, S > tau)
    assert torch.equal(f.q[~f.q_clipped], torch.ones(int((~f.q_clipped).sum()), device=device))
    clipped = S[f.q_clipped]
    scaled = clipped * f.q[f.q_clipped] ** 2
    r = rounding(device)
    assert (scaled <= tau * (1 + r)).all() and (scaled >= tau * (1 - r)).all()
    assert torch.equal(f.k, f.q.reshape(n_kv, group).amin(1))
    assert torch.equal(f.k_clipped, f.q_clipped.reshape(n_kv, group).any(1))


def _rows_reference(w, first, d, factor, clipped):
    out = w.clone()
    for h in range(factor.shape[0]):
        if clipped[h]:
            out[first + h * d : first + (h + 1) * d] *= factor[h]
    return out


@lane_examples
@given(
    n=st.integers(1, 5),
    d=st.integers(1, 4),
    first=st.integers(0, 6),
    extra=st.integers(0, 5),
    cuts=st.lists(st.integers(0, 40), max_size=3),
    seed=st.integers(0, 2**16),
)
def test_scale_head_rows_by_shards(device, n, d, first, extra, cuts, seed):
    """Each head's rows scaled by its factor where clipped, the rest untouched; shards scaled from
    their global offset and concatenated equal the whole weight scaled (bit for bit)."""
    g = torch.Generator().manual_seed(seed)
    rows = first + n * d + extra
    w = torch.randn(rows, 3, generator=g).to(device)
    factor = torch.rand(n, generator=g).to(device)
    clipped = (torch.rand(n, generator=g) > 0.5).to(device)
    whole = mf.scale_head_rows(w, 0, first, d, factor, clipped)
    assert torch.equal(whole, _rows_reference(w, first, d, factor, clipped))
    bounds = sorted({0, rows, *(min(c, rows) for c in cuts)})
    parts = [
        mf.scale_head_rows(w[a:b], a, first, d, factor, clipped)
        for a, b in itertools.pairwise(bounds)
    ]
    assert torch.equal(torch.cat(parts), whole)


@pytest.mark.parametrize(
    "n_head, n_kv, causal", [(4, 4, True), (4, 4, False), (6, 2, True), (4, 1, False)]
)
def test_max_attention_logits(device, n_head, n_kv, causal, monkeypatch):
    """Against the logits written out on the CPU (grouped heads as
    scaled_dot_product_attention(enable_gqa)), in several query blocks too."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, n_head, 7, 5, generator=g)
    k = torch.randn(2, n_kv, 7, 5, generator=g)
    kk = k.repeat_interleave(n_head // n_kv, dim=1)
    logits = q @ kk.transpose(-1, -2) / math.sqrt(5)
    if causal:
        logits = logits.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), -math.inf)
    expected = logits.amax(dim=(0, 2, 3))
    q, k, kw = q.to(device), k.to(device), TOL[device.type]["logits"]
    torch.testing.assert_close(mf.max_attention_logits(q, k, causal=causal).cpu(), expected, **kw)
    monkeypatch.setattr(
        "muon_fn.core.qk_clip._CHUNK_ELEMENTS", 2 * n_head * 7 * 2
    )  # blocks of 2 queries
    torch.testing.assert_close(mf.max_attention_logits(q, k, causal=causal).cpu(), expected, **kw)


# ---------------------------------------------------------------------------- models
def forced_gpt(n_layer=2, seed=0, device="cpu"):
    """A small demo GPT whose heads 0 and 2 have logits far above the others (W_q rows × 100)."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(n_layer=n_layer, n_head=4, n_embd=32, block_size=16))
    with torch.no_grad():
        for block in model.blocks:
            block.attn.q.weight.mul_(
                torch.tensor([100.0, 1.0, 100.0, 1.0]).repeat_interleave(8)[:, None]
            )
            block.attn.k.weight.mul_(10.0)
    return model.to(device)


class FusedGQA(nn.Module):
    """Attention with a fused [Q; K; V] weight and grouped-query heads (6 query, 2 key/value)."""

    def __init__(self, d_model=24, n_head=6, n_kv=2) -> None:
        super().__init__()
        self.n_head, self.n_kv, self.d = n_head, n_kv, d_model // n_head
        self.qkv = nn.Linear(d_model, (n_head + 2 * n_kv) * self.d, bias=False)
        self.out = nn.Linear(n_head * self.d, d_model, bias=False)

    def split(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).split(
            [self.n_head * self.d, self.n_kv * self.d, self.n_kv * self.d], dim=-1
        )
        return (
            q.view(b, t, self.n_head, self.d).transpose(1, 2),
            k.view(b, t, self.n_kv, self.d).transpose(1, 2),
            v.view(b, t, self.n_kv, self.d).transpose(1, 2),
        )

    def forward(self, x):
        q, k, v = self.split(x)
        mf.record_max_logits(self, q, k, causal=True)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.out(y.transpose(1, 2).flatten(2))

    def qk_clip_heads(self):
        return mf.AttentionHeads(
            self, "qkv.weight", "qkv.weight", self.n_head, self.d, n_kv_head=self.n_kv
        )


def attention_inputs(model):
    """Every attention layer's input of the next forward, captured by hooks (remove with .remove())."""
    seen = {}
    handles = [
        m.register_forward_pre_hook(
            lambda mod, args, _n=name: seen.__setitem__(_n, args[0].detach())
        )
        for name, m in model.named_modules()
        if hasattr(m, "qk_clip_heads")
    ]
    return seen, handles


def gpt_logits(model, seen):
    """Each layer's per-head max logit from the captured inputs with the current weights."""
    out = []
    for name, m in model.named_modules():
        if hasattr(m, "qk_clip_heads"):
            x = seen[name]
            b, t, c = x.shape
            q = m.q(x).view(b, t, 4, c // 4).transpose(1, 2)
            k = m.k(x).view(b, t, 4, c // 4).transpose(1, 2)
            out.append(mf.max_attention_logits(q, k, causal=True))
    return out


def step_once(model, opt, tokens):
    _, loss = model(tokens, tokens)
    loss.backward()
    opt.step()
    opt.zero_grad()


TOKENS = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
TAU = 5.0


# ---------------------------------------------------------------------------- the optimizers
@pytest.mark.parametrize("build", ["hybrid", "muon_optimizer"])
def test_logits_bounded_and_small_heads_untouched(device, build):
    """A real step (lr 0.02): every layer's logits from its step inputs are ≤ τ afterwards with
    lr = 0, and with lr > 0 each head's W_q/W_k rows equal the step without QK-Clip — scaled by
    exactly √γ for clipped heads, bit for bit for the others."""

    def make(lr, clip):
        model = forced_gpt(device=device)
        kw = {"qk_clip": mf.QKClip(model, TAU)} if clip else {}
        if build == "hybrid":
            return model, mf.create_hybrid_optimizer(
                model, muon_lr=lr, adamw_lr=lr / 10, compile=False, **kw
            )
        return model, mf.MuonOptimizer(
            model.parameters(), lr=lr, adamw_lr=lr / 10, compile=False, **kw
        )

    tokens = TOKENS.to(device)
    model, opt = make(0.0, True)
    seen, handles = attention_inputs(model)
    step_once(model, opt, tokens)
    for h in handles:
        h.remove()
    S = opt.qk_clip.last_max_logits
    assert all(
        (s[[0, 2]] > 2 * TAU).all() and (s[[1, 3]] < TAU).all() for s in S
    )  # the forcing works
    for after in gpt_logits(model, seen):
        assert (after <= TAU * (1 + rounding(device))).all(), after
    assert all(
        torch.equal(m.max_logits, torch.full((4,), -math.inf, device=device))
        for m in model.modules()
        if hasattr(m, "qk_clip_heads")
    )  # reset for the next step

    (clipped_model, clipped_opt), (plain_model, plain_opt) = make(0.02, True), make(0.02, False)
    _, loss = clipped_model(tokens, tokens)
    loss.backward()  # one backward for both: on GPUs attention's backward may sum in any order
    for a, b in zip(clipped_model.parameters(), plain_model.parameters()):
        b.grad = a.grad.clone()
    clipped_opt.step()
    plain_opt.step()
    for (name, a), (_, b) in zip(clipped_model.named_parameters(), plain_model.named_parameters()):
        if not name.endswith(("attn.q.weight", "attn.k.weight")):
            assert torch.equal(a, b), name
            continue
        layer = int(name.split(".")[1])
        f = mf.qk_clip_factors(clipped_opt.qk_clip.last_max_logits[layer], TAU)
        for h in range(4):
            rows = slice(8 * h, 8 * h + 8)
            expected = b[rows] * f.q[h] if f.q_clipped[h] else b[rows]
            assert torch.equal(a[rows], expected), (name, h)


def test_fresh_forward_bounded_one_layer(device):
    """A one-layer model with lr = 0: a fresh forward after the step has every head's max logit ≤ τ."""
    model, tokens = forced_gpt(n_layer=1, device=device), TOKENS.to(device)
    opt = mf.create_hybrid_optimizer(
        model, muon_lr=0.0, adamw_lr=0.0, qk_clip=mf.QKClip(model, TAU), compile=False
    )
    step_once(model, opt, tokens)
    assert (opt.qk_clip.max_logit() > 5 * TAU).item()
    model(tokens)
    fresh = model.blocks[0].attn.max_logits
    assert fresh.device.type == device.type
    assert (fresh <= TAU * (1 + rounding(device))).all() and (
        fresh.max() >= TAU * (1 - 1e-5)
    ).item(), fresh


def test_fused_qkv_grouped_query(device):
    """Fused [Q; K; V] with 6 query heads over 2 key heads: logits ≤ τ after the step (lr = 0);
    unclipped query heads, key heads of unclipped groups and every V row unchanged bit for bit."""
    torch.manual_seed(0)
    attn = FusedGQA()
    with torch.no_grad():  # query head 1 (group 0) far above τ; group 1 below
        attn.qkv.weight[4:8].mul_(40.0)
    attn.to(device)
    clip = mf.QKClip(attn, TAU)
    opt = mf.MuonOptimizer(attn.parameters(), lr=0.0, qk_clip=clip, compile=False)
    x = torch.randn(3, 9, 24, generator=torch.Generator().manual_seed(2)).to(device)
    before = attn.qkv.weight.detach().clone()
    attn(x).square().mean().backward()
    opt.step()
    S = clip.last_max_logits[0]
    assert S[1] > 4 * TAU and (S[3:] < TAU).all() and (S[[0, 2]] < TAU).all(), S
    with torch.no_grad():
        q, k, _ = attn.split(x)
    after = mf.max_attention_logits(q, k, causal=True)
    assert (after <= TAU * (1 + rounding(device))).all(), after
    w = attn.qkv.weight.detach()
    unchanged = list(range(4)) + list(range(8, 24)) + list(range(28, 32)) + list(range(32, 40))
    assert torch.equal(w[unchanged], before[unchanged])  # q heads 0, 2..5, k head 1, all of V
    f = mf.qk_clip_factors(S, TAU, 2)
    assert torch.equal(w[4:8], before[4:8] * f.q[1]) and torch.equal(
        w[24:28], before[24:28] * f.k[0]
    )


def test_accumulation_and_skipped_steps(device):
    """Micro-steps only record (the max over the micro-batches is used at the applied step); a
    step skipped for a non-finite gradient scales nothing and starts a fresh record."""
    model, tokens = forced_gpt(n_layer=1, device=device), TOKENS.to(device)
    opt = mf.create_hybrid_optimizer(
        model,
        muon_lr=0.0,
        adamw_lr=0.0,
        qk_clip=mf.QKClip(model, TAU),
        gradient_accumulation_steps=2,
        compile=False,
    )
    attn = model.blocks[0].attn
    q0 = attn.q.weight.detach().clone()
    step_once(model, opt, tokens[:2])
    first = attn.max_logits.clone()
    assert torch.equal(attn.q.weight, q0) and (first > -math.inf).all()  # micro-step: recorded only
    step_once(model, opt, tokens[2:])
    assert torch.equal(
        opt.qk_clip.last_max_logits[0], torch.maximum(first, opt.qk_clip.last_max_logits[0])
    )
    assert not torch.equal(attn.q.weight, q0)

    model = forced_gpt(n_layer=1, device=device)
    opt = mf.create_hybrid_optimizer(
        model, muon_lr=0.0, adamw_lr=0.0, qk_clip=mf.QKClip(model, TAU), compile=False
    )
    q0 = model.blocks[0].attn.q.weight.detach().clone()
    _, loss = model(tokens, tokens)
    loss.backward()
    model.lm_head.weight.grad[0, 0] = float("nan")
    opt.step()
    assert not opt.last_step.finite.item() and torch.equal(model.blocks[0].attn.q.weight, q0)
    assert (model.blocks[0].attn.max_logits == -math.inf).all()


def _host_reads(fn):
    sys.path.insert(0, str(Path(__file__).parent))
    from test_compile import _host_reads as count

    return count(fn)


@pytest.mark.parametrize(
    "compile, hybrid",
    [(False, True), ({"backend": "eager"}, False)],
    ids=["eager-hybrid", "compiled-muon"],
)
def test_step_reads_nothing_back(device, compile, hybrid):
    """No .item()/float()/bool() of a device tensor in a step with qk_clip on (the profiler counter
    of tests/test_compile.py), eager and compiled."""
    model, tokens = forced_gpt(n_layer=1, device=device), TOKENS.to(device)
    clip = mf.QKClip(model, TAU)
    opt = (
        mf.create_hybrid_optimizer(model, qk_clip=clip, compile=compile)
        if hybrid
        else mf.MuonOptimizer(model.parameters(), qk_clip=clip, compile=compile)
    )
    step_once(model, opt, tokens)  # compiles
    _, loss = model(tokens, tokens)
    loss.backward()
    w = model.blocks[0].attn.q.weight.detach().clone()
    assert _host_reads(opt.step) == 0
    assert not torch.equal(w, model.blocks[0].attn.q.weight)


@pytest.mark.inductor
@pytest.mark.slow
def test_inductor_default(device, compiled_default, monkeypatch):
    """The real compiled default: no host read with qk_clip on, and the same parameters as the
    eager step (the clip runs eagerly after the compiled update; lr = 0 makes the update exact)."""
    tokens = TOKENS.to(device)

    def run():
        model = forced_gpt(n_layer=1, device=device)
        opt = mf.create_hybrid_optimizer(
            model, muon_lr=0.0, adamw_lr=0.0, qk_clip=mf.QKClip(model, TAU)
        )
        step_once(model, opt, tokens)
        _, loss = model(tokens, tokens)
        loss.backward()
        assert _host_reads(opt.step) == 0
        return model

    compiled = run()
    monkeypatch.setenv("MUON_FN_COMPILE", "0")
    eager = run()
    for (name, a), b in zip(compiled.named_parameters(), eager.parameters()):
        assert torch.equal(a, b), name


def test_standalone_and_copies(device):
    """QKClip.step() works after any optimizer's step; a deepcopy of an optimizer clips its copy."""
    model = forced_gpt(n_layer=1, device=device)
    clip = mf.QKClip(model, TAU)
    adam = torch.optim.AdamW(model.parameters(), lr=0.0)
    step_once(model, adam, TOKENS.to(device))
    clip.step()
    assert (clip.max_logit() > TAU).item()

    opt = mf.create_hybrid_optimizer(model, muon_lr=0.0, adamw_lr=0.0, qk_clip=clip, compile=False)
    twin = copy.deepcopy(opt)
    assert twin.qk_clip is not clip and twin.qk_clip.layers[0].module is not clip.layers[0].module
    twin_q = twin.qk_clip.parameters()[0]
    assert any(twin_q is p for g in twin.param_groups for p in g["params"])


# ---------------------------------------------------------------------------- the trainer
def test_trainer_qk_clip(tmp_path, capsys):
    """``muon-fn train --qk-clip TAU``: every row logs the step's max logit; a Muon row (in its step)
    and an AdamW row (after it) are clipped, ``qk_clip=none`` turns one row's clip off."""
    from muon_fn.tools import cli

    out = tmp_path / "run"
    small = [
        "--steps",
        "6",
        "--eval-interval",
        "3",
        "--eval-windows",
        "8",
        "--batch-size",
        "4",
        "--seq-len",
        "32",
        "--max-bytes",
        "400000",
        "--no-progress",
        "--threads",
        "1",
        "--no-checkpoint",
        "--no-compile",
    ]
    assert (
        cli.main(
            [
                "train",
                "--compare",
                "muon[qk_clip=none],muon,adamw[qk_clip=none],adamw",
                "--qk-clip",
                "0.1",
                *small,
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert "largest attention logit of any step; --qk-clip 0.1" in capsys.readouterr().out
    runs = {r["label"]: r for r in json.loads((out / "metrics.json").read_text())["runs"]}
    logged = {label: [v for _, v in r["history"]["max_logit"]] for label, r in runs.items()}
    assert all(len(v) == 6 for v in logged.values())
    assert runs["muon"]["qk_clip"] == 0.1 and runs["muon[qk_clip=none]"]["qk_clip"] is None
    for label in ("muon", "adamw"):  # each later step starts from clipped weights
        free, clipped = logged[f"{label}[qk_clip=none]"], logged[label]
        assert free[0] == clipped[0] > 0.1  # the same first forward; τ binds
        assert all(c < f for c, f in zip(clipped[1:], free[1:])), (label, clipped, free)
    # Muon's update moves the logits little: the next steps stay near τ (AdamW's ±lr per entry
    # moves such small logits by about as much as the clip)
    assert max(logged["muon"][1:]) < 0.1 + 0.5 * (logged["muon"][0] - 0.1), logged["muon"]


# ---------------------------------------------------------------------------- errors
class TestErrors(expecttest.TestCase):
    def message(self, fn, error=ValueError):
        with pytest.raises(error) as info:
            fn()
        return str(info.value)

    def test_tau(self):
        model = forced_gpt(n_layer=1)
        for tau in (0.0, -1.0, math.inf, math.nan):
            assert f"Invalid tau: {tau}" in self.message(lambda: mf.QKClip(model, tau))  # noqa: B023  called at once, in this iteration
        self.assertExpectedInline(
            self.message(lambda: mf.QKClip(model, 0.0)),
            """Invalid tau: 0.0 (expected a finite value > 0)""",
        )
        self.assertExpectedInline(
            self.message(lambda: mf.QKClip(model, "100"), TypeError),
            """tau must be a float or a 0-d tensor, got str""",
        )

    def test_layout(self):
        attn = FusedGQA()
        heads = attn.qk_clip_heads()
        self.assertExpectedInline(
            self.message(lambda: mf.QKClip([heads._replace(n_kv_head=4)], TAU)),
            """QKClip layer 0 (FusedGQA): n_kv_head=4 does not divide n_head=6""",
        )
        self.assertExpectedInline(
            self.message(lambda: mf.QKClip([heads._replace(head_dim=6)], TAU)),
            """QKClip layer 0 (FusedGQA): parameter 'qkv.weight' of shape (40, 24) cannot hold 2 heads of 6 rows from row 36 (needs a matrix of at least 48 rows)""",  # noqa: E501
        )
        self.assertExpectedInline(
            self.message(lambda: mf.QKClip([heads._replace(q="query.weight")], TAU)),
            """QKClip layer 0 (FusedGQA): FusedGQA has no parameter 'query.weight'""",
        )
        self.assertExpectedInline(
            self.message(lambda: mf.QKClip([heads._replace(n_head=0)], TAU)),
            """Invalid n_head: 0 (expected an integer >= 1)""",
        )
        self.assertExpectedInline(
            self.message(lambda: mf.QKClip(nn.Linear(2, 2), TAU)),
            """QKClip found no attention layers in Linear: define qk_clip_heads() on its attention modules, or pass AttentionHeads(...)""",  # noqa: E501
        )
        attn.max_logits = torch.zeros(3)
        self.assertExpectedInline(
            self.message(lambda: mf.QKClip(attn, TAU)),
            """FusedGQA.max_logits has shape (3,), expected (6,) (one per query head)""",
        )

    def test_optimizer(self):
        model = forced_gpt(n_layer=1)
        clip = mf.QKClip(model, TAU)
        matrices = [
            p for p in model.parameters() if p.ndim == 2 and p is not model.blocks[0].attn.k.weight
        ]
        self.assertExpectedInline(
            self.message(lambda: mf.MuonOptimizer(matrices, qk_clip=clip)),
            """qk_clip: CausalSelfAttention.k.weight is not a parameter of this MuonOptimizer (QKClip must see the parameters the optimizer updates; build it after fully_shard)""",  # noqa: E501
        )
        self.assertExpectedInline(
            self.message(lambda: mf.MuonOptimizer(model.parameters(), qk_clip=100.0), TypeError),
            """qk_clip must be a muon_fn.QKClip or None, got float""",
        )


# ---------------------------------------------------------------------------- FSDP2, W = 2
class TwoAttentions(nn.Module):
    """A separate-Q/K layer with 3 heads of 4 rows (12 rows: at W = 2 head 1 is split 2 + 2 across
    the ranks) and a fused [Q; K; V] layer with 3 query heads over 1 key head of 4 rows (20 rows:
    query head 2 split), plus an output projection and a bias."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Module()
        self.a.q, self.a.k = nn.Linear(6, 12, bias=False), nn.Linear(6, 12, bias=False)
        self.b = nn.Module()
        self.b.qkv = nn.Linear(6, 20, bias=False)
        self.proj = nn.Linear(12, 6)

    def layers(self):
        return [
            mf.AttentionHeads(self.a, "q.weight", "k.weight", 3, 4),
            mf.AttentionHeads(self.b, "qkv.weight", "qkv.weight", 3, 4, n_kv_head=1),
        ]


def rank_logits(step: int, rank: int) -> list[torch.Tensor]:
    """What each rank's forward recorded: per layer, some heads above τ on one rank only."""
    g = torch.Generator().manual_seed(100 * step + rank)
    return [torch.rand(3, generator=g) * 4 * TAU for _ in range(2)]


def _set_grads(model, step):
    from torch.distributed.tensor import DTensor

    for i, p in enumerate(model.parameters()):
        g = torch.randn(tuple(p.shape), generator=torch.Generator().manual_seed(1000 * step + i))
        if isinstance(p, DTensor):
            from torch.distributed.tensor import distribute_tensor

            g = distribute_tensor(g, p.device_mesh, p.placements)
        p.grad = g


def _run_fsdp(w: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from muon_fn.fsdp import FSDPMuonOptimizer

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = TwoAttentions()
    ref = copy.deepcopy(model)
    for child in (model.a, model.b, model.proj):
        fully_shard(child)
    fully_shard(model)
    opt = FSDPMuonOptimizer(
        model, lr=0.05, weight_decay=0.01, compile=False, qk_clip=mf.QKClip(model.layers(), TAU)
    )
    ref_opt = mf.MuonOptimizer(
        ref.parameters(),
        lr=0.05,
        weight_decay=0.01,
        compile=False,
        qk_clip=mf.QKClip(ref.layers(), TAU),
    )
    clipped = 0
    for step in range(3):
        mine = rank_logits(step, rank)
        for layer, s in zip(opt.qk_clip.layers, mine):
            layer.module.max_logits.copy_(s)
        for layer, ranks in zip(
            ref_opt.qk_clip.layers, zip(*[rank_logits(step, r) for r in range(w)])
        ):
            layer.module.max_logits.copy_(torch.stack(ranks).amax(0))
        _set_grads(model, step)
        _set_grads(ref, step)
        opt.step()
        ref_opt.step()
        for a, b in zip(opt.qk_clip.last_max_logits, ref_opt.qk_clip.last_max_logits):
            assert torch.equal(a, b)
        clipped += sum(int((s > TAU).sum()) for s in ref_opt.qk_clip.last_max_logits)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.full_tensor(), q.detach()), name
    local = {name: tuple(p.to_local().shape) for name, p in model.named_parameters()}
    return {"clipped_heads": clipped, "local_shapes": local}


def _worker(rank: int, w: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=w, timeout=timedelta(seconds=60))
    try:
        result = {"ok": True, "value": _run_fsdp(w)}
    except Exception:  # reported to pytest
        result = {"ok": False, "error": traceback.format_exc(limit=8)}
    gathered = [None] * w
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered, default=str))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.distributed
def test_fsdp_w2_bit_exact(tmp_path):
    """FSDPMuonOptimizer(qk_clip=...) at W = 2 equals single-device MuonOptimizer bit for bit over
    3 steps, with heads split across the ranks and each rank recording other logits (the clip
    uses their max, as one device seeing both batches would)."""
    w, out = 2, tmp_path / "result.json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(w), str(r), str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for r in range(w)
    ]
    logs = []
    for proc in procs:
        try:
            logs.append(proc.communicate(timeout=120)[0].decode())
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            logs.append(proc.communicate()[0].decode() + "\nTIMEOUT")
    assert out.exists(), "\n".join(logs)[-4000:]
    results = json.loads(out.read_text())
    for r, result in enumerate(results):
        assert result["ok"], f"rank {r}: {result['error']}"
    value = results[0]["value"]
    assert value["clipped_heads"] > 0
    assert value["local_shapes"]["a.q.weight"] == [6, 6] and value["local_shapes"][
        "b.qkv.weight"
    ] == [10, 6]


if __name__ == "__main__":
    _worker(int(sys.argv[2]), int(sys.argv[1]), sys.argv[3])
    sys.stdout.flush()
    os._exit(0)
