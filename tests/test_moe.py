"""The demo GPT's mixture-of-experts MLP (``muon_fn/_train/moe.py``) and the ``moe-tiny`` preset.

Routing against a plain loop over tokens (hypothesis), the layer against a per-token reference,
causality and batch independence, gradients, the parameter layout, the balancing term, and the
optimizers the trainer builds for the model (expert stacks per expert, routers in Muon).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from muon_fn.tools.train.model import GPT, GPTConfig, config_for
from muon_fn.tools.train.moe import MoE, capacity, route

SMALL = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16, n_experts=4)


def layer(e: int = 4, k: int = 1, factor: float = 1.25, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(8, 12, e, top_k=k, capacity_factor=factor)
    with torch.no_grad():  # a router strong enough that routing is uneven and experts overflow
        moe.router.weight.normal_()
        moe.fc.normal_(std=0.3)
        moe.proj.normal_(std=0.3)
    return moe


def route_loop(expert: torch.Tensor, num_experts: int, cap: int) -> torch.Tensor:
    """Slots by a plain loop: per sequence, each token's choices in order take the next free
    row of their expert, or E·cap when it is full."""
    b, t, k = expert.shape
    slot = torch.empty(b, t * k, dtype=torch.long)
    for s in range(b):
        used = [0] * num_experts
        for i, x in enumerate(expert[s].reshape(-1).tolist()):
            slot[s, i] = x * cap + used[x] if used[x] < cap else num_experts * cap
            used[x] += 1
    return slot


@given(
    b=st.integers(1, 3),
    t=st.integers(1, 12),
    e=st.integers(1, 6),
    k=st.integers(1, 3),
    factor=st.sampled_from([0.25, 0.5, 1.0, 1.25, 2.0]),
    seed=st.integers(0, 2**16),
)
def test_route_matches_a_loop_over_tokens(b, t, e, k, factor, seed):
    k = min(k, e)
    logits = torch.randn(b, t, e, generator=torch.Generator().manual_seed(seed))
    cap = capacity(t, e, k, factor)
    r = route(logits, k, cap)
    assert r.slot.shape == (b, t * k) and r.gate.shape == (b, t, k) and r.expert.shape == (b, t, k)
    assert r.probs.shape == (b, t, e)
    assert cap == max(1, math.ceil(factor * k * t / e))
    assert torch.equal(r.slot, route_loop(r.expert, e, cap))
    assert torch.equal(r.expert, logits.topk(k, dim=-1).indices)
    if k == 1:
        torch.testing.assert_close(r.gate, logits.softmax(-1).max(-1, keepdim=True).values)
    else:
        torch.testing.assert_close(r.gate.sum(-1), torch.ones(b, t))


def moe_loop(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The layer token by token: each kept choice adds gate · expert MLP(token)."""
    b, t, _ = x.shape
    e = moe.num_experts
    cap = capacity(t, e, moe.top_k, moe.capacity_factor)
    r = route(moe.router(x), moe.top_k, cap)
    out = torch.zeros_like(x)
    for s in range(b):
        for i in range(t):
            for j in range(moe.top_k):
                if r.slot[s, i * moe.top_k + j] == e * cap:
                    continue  # the expert was full
                w = int(r.expert[s, i, j])
                out[s, i] += r.gate[s, i, j] * (moe.proj[w] @ F.gelu(moe.fc[w] @ x[s, i]))
    return out


@pytest.mark.parametrize(
    "k, factor, drops", [(1, 1.25, True), (1, 0.5, True), (2, 1.0, True), (3, 4.0, False)]
)
def test_layer_matches_a_loop_over_tokens(k, factor, drops):
    moe = layer(k=k, factor=factor)
    x = torch.randn(3, 10, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = moe(x)
        expected = moe_loop(moe, x)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    cap = capacity(10, 4, k, factor)
    dropped = route(moe.router(x), k, cap).slot == 4 * cap
    assert (
        bool(dropped.any()) == drops
    )  # the dropping path is exercised (capacity 30 ≥ t never drops)


def test_layer_is_causal_and_batch_independent():
    """A token's output depends on no later token (routing is first come, first served in token
    order) and on no other sequence, even when experts overflow."""
    moe = layer(factor=0.5)
    x = torch.randn(2, 12, 8, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = moe(x)
        changed = x.clone()
        changed[:, 6:] = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(3))
        assert torch.equal(moe(changed)[:, :6], out[:, :6])
        assert torch.equal(moe(x[1:]), out[1:])


def test_gradient_reaches_every_expert_used():
    moe = layer(e=6, factor=0.5)
    x = torch.randn(2, 12, 8, generator=torch.Generator().manual_seed(4))
    moe(x).square().sum().backward()
    cap = capacity(12, 6, 1, 0.5)
    slot = route(moe.router(x), 1, cap).slot
    used = torch.zeros(6, dtype=torch.bool)
    used[slot[slot < 6 * cap] // cap] = True
    assert 1 < int(used.sum()) < 6  # some experts used, one unused: the check means something
    for w in (moe.fc, moe.proj):
        reached = w.grad.flatten(1).abs().sum(1) > 0
        assert torch.equal(reached, used)
    assert moe.router.weight.grad.abs().sum() > 0


def test_expert_weights_are_one_3d_parameter_per_projection():
    model = GPT(config_for("moe-tiny"))
    names = {n: tuple(p.shape) for n, p in model.named_parameters() if ".mlp." in n}
    assert names == {
        f"blocks.{i}.mlp.{n}": s
        for i in range(4)
        for n, s in (("fc", (4, 512, 128)), ("proj", (4, 128, 512)), ("router.weight", (4, 128)))
    }
    assert sum(p.numel() for p in model.parameters()) == 2_461_952


def test_balance_term_adds_gradient_not_value():
    """In training the loss's value is the cross-entropy alone; the balancing loss (1 when
    routing is uniform) changes only the router's gradient. Eval adds nothing."""
    losses, grads = [], []
    for coef in (0.0, 0.01):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**SMALL, moe_aux_coef=coef))
        x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(5))
        _, loss = model(x, x)
        loss.backward()
        losses.append(loss)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        aux = [float(b.mlp.aux_loss.detach()) for b in model.blocks]
        assert all(1.0 <= a < 1.5 for a in aux), aux  # ≥ 1 (Cauchy–Schwarz), near-uniform at init
    assert torch.equal(losses[0], losses[1])
    differs = {n for n in grads[0] if not torch.equal(grads[0][n], grads[1][n])}
    assert {n for n in differs if "router" in n} == {
        "blocks.0.mlp.router.weight",
        "blocks.1.mlp.router.weight",
    }
    model.eval()
    with torch.no_grad():
        logits, loss = model(x, x)
    assert torch.equal(loss, F.cross_entropy(logits.flatten(0, 1), x.flatten()))


def test_trainer_optimizer_steps_each_expert_as_its_own_matrix():
    """The trainer's muon row (the hybrid's default, NorMuon): expert stacks read as E matrices
    (one step of an expert equals MuonOptimizer(beta2=0.95) on that expert alone as a 2-D weight,
    fp32 bit for bit), routers in Muon."""
    import muon_fn as mf
    from muon_fn.tools.train.optimizers import build_single

    torch.manual_seed(0)
    model = GPT(GPTConfig(**SMALL))
    opt, _ = build_single("muon", {}, model, 0.02, 3e-3, 0.0, compile=False)
    muon, adamw = opt.param_groups
    assert muon["matrix_view"] == {
        f"blocks.{i}.mlp.{n}": "experts" for i in range(2) for n in ("fc", "proj")
    }
    assert [n for n in muon["param_names"] if "router" in n] == [
        f"blocks.{i}.mlp.router.weight" for i in range(2)
    ]
    assert not [n for n in adamw["param_names"] if "router" in n]
    fc = model.blocks[0].mlp.fc
    before = fc.detach().clone()
    grad = torch.randn(fc.shape, generator=torch.Generator().manual_seed(6))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    fc.grad = grad.clone()
    opt.step()
    for e in range(fc.shape[0]):
        alone = torch.nn.Parameter(before[e].clone())
        alone.grad = grad[e].clone()
        mf.MuonOptimizer([alone], lr=0.02, weight_decay=0.0, beta2=0.95, compile=False).step()
        assert torch.equal(fc[e].detach(), alone.detach()), e


def test_trainer_router_option():
    from muon_fn.tools.train.optimizers import build_single

    model = GPT(GPTConfig(**SMALL))
    opt, _ = build_single("muon", {"router": "adamw"}, model, 0.02, 3e-3, 0.0, compile=False)
    assert "blocks.0.mlp.router.weight" in opt.param_groups[1]["param_names"]
    assert opt.param_groups[1]["algorithm"] == "adamw"
    with pytest.raises(ValueError, match="router='sgd'"):
        build_single("muon", {"router": "sgd"}, model, 0.02, 3e-3, 0.0, compile=False)


def test_bad_moe_settings():
    with pytest.raises(ValueError, match="top_k=5 must be between 1 and num_experts=4"):
        MoE(8, 12, 4, top_k=5)
    with pytest.raises(ValueError, match="capacity_factor must be > 0, got 0"):
        MoE(8, 12, 4, capacity_factor=0)
