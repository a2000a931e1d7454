"""Tests of the stateful adapter: muon_fn.Optimizer, MuonOptimizer, create_hybrid_optimizer.

Every numerical check compares against an independent reference: torch.optim.Muon,
torch.optim.AdamW, or a by-hand formula. Nothing is compared to output of the adapter itself
except where the property *is* self-consistency (resume equals uninterrupted, scheduler equals the
same lr set by hand).

Tolerances:
  * fp32 vs torch.optim (Muon with its NS function swapped for an fp32 twin, AdamW): atol 1e-5
    over 20 steps. The two sides run the same fp32 formulas in a slightly different order
    (muon_fn: ``p + (-lr)·(s·O + wd·p)`` with lr/momentum as fp32 0-d tensors and norm+eps;
    torch: ``p·(1 − lr·wd) − lr·s·O`` with Python-double scalars and clamp(norm, eps)), so they
    differ by a few fp32 ulps per step, amplified a little through the loss; measured
    max |Δ| after 20 steps on the GPT's hidden matrices: 1.3e-6 (original), 1.5e-6 (match_rms_adamw).
  * bf16 Newton–Schulz vs torch.optim.Muon's bf16 NS: atol 1e-2 after 20 steps. muon_fn normalizes
    in fp32 and then casts to bf16, torch casts to bf16 first and normalizes in bf16; every NS
    product then rounds to bf16 (8 mantissa bits, relative step 2^-8 ≈ 4e-3) at different points,
    so two faithful bf16 implementations drift apart by 2–4e-3 per parameter after 20 steps
    (lr 0.02, each step moves an element by ~lr·s/√n); measured 3.2e-3 (original), 3.8e-3
    (match_rms_adamw). 1e-2 is ~3× the measured drift and ~20× smaller than the distance travelled
    (0.20–0.22; ≥ 0.1 asserted), so a wrong formula fails; the fp32 tests pin the formulas tightly.
  * bit-exact (torch.equal): resume, accumulation "no change" steps, skip steps, the
    scheduler-vs-by-hand comparison and grads before/after step.

The device lane (tests/conftest.py): a test taking ``device`` builds its model there, draws its
data on the CPU and moves it, runs torch.optim.Muon / AdamW on the same device and compares on the
CPU. Tolerances per device (``TOL``):
  * ``cpu``: the ones above.
  * ``cuda``: fp32 parity 1e-4. fp32 GEMMs on a GPU reduce in another order, and muon_fn's
    "batched" policy runs batched GEMMs where torch runs one matrix at a time (TF32 stays off);
    the first Newton–Schulz iterations amplify that rounding near σ = 0 (slope ≈ 3.4 per quintic
    step): about 2e-5 on parameters after a few lr = 0.02 steps, which 10–20 steps add up like a
    random walk (×√(20/3) ≈ 2.6), with a 2× margin; optimizer state (AdamW's moments, momentum
    buffers) follows the parameters through the loss: 1e-4 too. The bf16 band (1e-2) is the same
    on every device: two faithful bf16 implementations differ by 2–4e-3 after 20 steps wherever
    the GEMMs run. Elementwise AdamW against torch.optim.AdamW on the same gradients stays at 1e-6
    (IEEE-rounded elementwise arithmetic on both). Bit-exact checks (resume, skip steps, grads
    untouched) stay bit-exact: the same kernels on the same inputs; the test model's attention
    runs torch's math backend off the CPU, whose backward (unlike the fused GPU kernels', which
    add with atomics) is reproducible.
"""

from __future__ import annotations

import copy
import io

import _torch_muon
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch.nn.attention import SDPBackend, sdpa_kernel

import muon_fn as mf

fp32_torch_muon = pytest.fixture(_torch_muon.fp32_torch_muon)  # torch.optim.Muon's math in fp32

CPU = torch.device("cpu")
# Per device (module docstring): fp32 parity with torch.optim on parameters ("fp32"), optimizer
# state the CPU pins tighter ("state": AdamW's moments, a momentum buffer), and the bf16 band.
TOL = {
    "cpu": dict(fp32=1e-5, state=1e-6, bf16=1e-2),
    "cuda": dict(fp32=1e-4, state=1e-4, bf16=1e-2),
}


def tol(device: torch.device, kind: str = "fp32") -> float:
    return TOL[device.type][kind]


# --------------------------------------------------------------------------- models and data

VOCAB, D, CTX = 61, 32, 16  # vocab differs from every hidden out_features (32, 96, 128)


def causal_attention(q, k, v):
    """SDPA; off the CPU with torch's math backend, whose backward is bitwise reproducible (the
    fused GPU kernels' backward adds with atomics), so bit-exact resume checks hold there too."""
    if q.device.type == "cpu":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Block(nn.Module):
    def __init__(self, d: int, n_head: int = 2) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = causal_attention(q, k, v)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, tied: bool = False, n_layer: int = 2) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, D)
        self.wpe = nn.Embedding(CTX, D)
        self.blocks = nn.ModuleList(Block(D) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        if tied:
            self.head.weight = self.wte.weight

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def make_gpt(tied: bool = False, seed: int = 0, dtype=torch.float32, device=CPU) -> GPT:
    torch.manual_seed(seed)
    return GPT(tied=tied).to(
        device=device, dtype=dtype
    )  # initialized on the CPU: the same on every device


def batch(step: int, bsz: int = 4):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (bsz, CTX + 1), generator=g)


def gpt_loss(model: nn.Module, step: int, **kw) -> torch.Tensor:
    tok = batch(step, **kw).to(model.wte.weight.device)
    logits = model(tok[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), tok[:, 1:].reshape(-1))


def backward(model: nn.Module, step: int, **kw) -> torch.Tensor:
    loss = gpt_loss(model, step, **kw)
    loss.backward()
    return loss


def hidden_names(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("blocks.")]


def freeze_all_but(model: nn.Module, names: list[str]) -> list[nn.Parameter]:
    keep = set(names)
    for n, p in model.named_parameters():
        p.requires_grad_(n in keep)
    return [p for n, p in model.named_parameters() if n in keep]


def snapshot_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def snapshot_state(opt: torch.optim.Optimizer) -> list[dict[str, torch.Tensor]]:
    return [
        {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state[p].items()}
        for g in opt.param_groups
        for p in g["params"]
    ]


def assert_states_equal(a, b) -> None:
    assert len(a) == len(b)
    for sa, sb in zip(a, b):
        assert sorted(sa) == sorted(sb)
        for k in sa:
            assert sa[k].dtype == sb[k].dtype, k
            assert torch.equal(sa[k], sb[k]), k


def assert_models_equal(m1: nn.Module, m2: nn.Module) -> None:
    for (n, p), (_, q) in zip(m1.named_parameters(), m2.named_parameters()):
        assert p.dtype == q.dtype, n
        assert torch.equal(p, q), n


def max_abs_diff(m1: nn.Module, m2: nn.Module, names=None) -> float:
    p2 = dict(m2.named_parameters())
    return max(
        (p - p2[n]).abs().max().item()
        for n, p in m1.named_parameters()
        if names is None or n in names
    )


def roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


# The MuonOptimizer configuration that is torch.optim.Muon's algorithm.
TORCH_LIKE = dict(method="quintic", momentum_kind="ema", eps=1e-7)


# --------------------------------------------------------------------------- the headline example


def test_linear_steps_and_momentum_buffer_survives_save_load(device):
    torch.manual_seed(0)
    lin = nn.Linear(100, 100).to(device)
    opt = mf.MuonOptimizer(lin.parameters(), lr=0.02)
    w0 = lin.weight.detach().clone()
    lin(torch.randn(8, 100).to(device)).square().mean().backward()
    opt.step()
    assert not torch.equal(lin.weight, w0)
    # One Muon step is lr·msign(G) with G of rank ≤ 8 (a batch of 8): about 8 singular values near
    # 1 spread over 100² entries, so the update's RMS is about lr·√8/100 ≈ 5.7e-4.
    rms = (lin.weight - w0).pow(2).mean().sqrt().item()
    assert 2e-4 < rms < 2e-3
    buf = opt.state[lin.weight]["momentum_buffer"]
    assert buf.shape == lin.weight.shape and buf.abs().sum() > 0

    loaded = roundtrip(opt.state_dict())
    opt2 = mf.MuonOptimizer(lin.parameters(), lr=0.02)
    opt2.load_state_dict(loaded)
    assert torch.equal(opt2.state[lin.weight]["momentum_buffer"], buf)
    assert opt2.state[lin.weight]["momentum_buffer"] is not buf
    assert set(opt2.state[lin.weight]) == {"momentum_buffer"}
    assert float(opt2.state[lin.bias]["step"]) == 1.0


def test_muon_params_keep_only_the_momentum_buffer_like_torch():
    """Persistent state of a Muon matrix is torch.optim.Muon's: the momentum buffer, no step."""
    lin = nn.Linear(4, 3)
    opt = mf.MuonOptimizer(lin.parameters())
    ref = torch.optim.Muon([lin.weight], adjust_lr_fn="original")
    for _ in range(2):
        lin.weight.grad, lin.bias.grad = torch.randn(3, 4), torch.randn(3)
        opt.step()
        ref.step()
    assert float(opt.state[lin.bias]["step"]) == 2.0  # AdamW keeps torch.optim.AdamW's count
    assert set(opt.state[lin.weight]) == set(ref.state[lin.weight]) == {"momentum_buffer"}
    nbytes = lambda st: sum(v.numel() * v.element_size() for v in st.values())  # noqa: E731
    assert nbytes(opt.state[lin.weight]) == nbytes(ref.state[lin.weight])


def test_old_checkpoint_with_muon_step_loads():
    """Checkpoints from before the Muon ``step`` was dropped still load (the key is ignored)."""
    lin = nn.Linear(4, 3)
    opt = mf.MuonOptimizer(lin.parameters())
    lin.weight.grad, lin.bias.grad = torch.randn(3, 4), torch.randn(3)
    opt.step()
    sd = roundtrip(opt.state_dict())
    sd["state"][0]["step"] = torch.tensor(1.0)  # what older versions saved for the weight
    opt2 = mf.MuonOptimizer(lin.parameters())
    opt2.load_state_dict(sd)
    assert set(opt2.state[lin.weight]) == {"momentum_buffer"}
    assert torch.equal(
        opt2.state[lin.weight]["momentum_buffer"], opt.state[lin.weight]["momentum_buffer"]
    )
    opt2.step()
    assert set(opt2.state[lin.weight]) == {"momentum_buffer"}


def test_state_is_torch_format():
    model = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5))
    opt = mf.MuonOptimizer(model.parameters())
    model(torch.randn(3, 6)).sum().backward()
    opt.step()
    sd = opt.state_dict()
    assert set(sd) == {"state", "param_groups"}
    assert sorted(sd["state"]) == [0, 1, 2, 3]
    assert sorted(sd["state"][0]) == ["momentum_buffer"]  # the weight: Muon, as torch.optim.Muon
    for i in (1, 2, 3):  # bias, LN weight, LN bias: AdamW, torch.optim.AdamW's key names
        assert sorted(sd["state"][i]) == ["exp_avg", "exp_avg_sq", "step"]
    assert sd["param_groups"][0]["params"] == [0, 1, 2, 3]
    for st in sd["state"].values():
        for v in st.values():
            assert (
                type(v) is torch.Tensor
            )  # plain tensors in torch's format, no NamedTuples (muon_fn.Optimizer's docstring, "State")


# --------------------------------------------------------------------------- parity: torch.optim.Muon


def _muon_parity_run(adjust_lr_fn, ns_dtype, nesterov=True, steps=20, wd=0.1, lr=0.02, device=CPU):
    ref, ours = make_gpt(device=device), make_gpt(device=device)
    names = hidden_names(ref)
    ref_params, our_params = freeze_all_but(ref, names), freeze_all_but(ours, names)
    topt = torch.optim.Muon(
        ref_params,
        lr=lr,
        weight_decay=wd,
        momentum=0.95,
        nesterov=nesterov,
        adjust_lr_fn=adjust_lr_fn,
    )
    opt = mf.MuonOptimizer(
        our_params,
        lr=lr,
        weight_decay=wd,
        momentum=0.95,
        nesterov=nesterov,
        adjust_lr_fn=adjust_lr_fn,
        ns_dtype=ns_dtype,
        **TORCH_LIKE,
    )
    start = snapshot_params(ref)
    for step in range(steps):
        for model, o in ((ref, topt), (ours, opt)):
            o.zero_grad()
            backward(model, step)
            o.step()
    travelled = max(
        (p - start[n]).abs().max().item() for n, p in ref.named_parameters() if n in names
    )
    return ref, ours, names, travelled, topt, opt


@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw"])
def test_parity_with_torch_muon_fp32(device, fp32_torch_muon, adjust_lr_fn):
    ref, ours, names, travelled, topt, opt = _muon_parity_run(
        adjust_lr_fn, torch.float32, device=device
    )
    diff = max_abs_diff(ref, ours, names)
    assert diff <= tol(device), diff
    assert travelled > 1e-2  # the check is not vacuous
    for n, p in ref.named_parameters():
        if n in names:
            q = dict(ours.named_parameters())[n]
            torch.testing.assert_close(
                opt.state[q]["momentum_buffer"].cpu(),
                topt.state[p]["momentum_buffer"].cpu(),
                atol=tol(device),
                rtol=0,
            )
            assert set(opt.state[q]) == set(topt.state[p]) == {"momentum_buffer"}


def test_parity_with_torch_muon_fp32_no_nesterov(device, fp32_torch_muon):
    ref, ours, names, travelled, _, _ = _muon_parity_run(
        "original", torch.float32, nesterov=False, steps=10, device=device
    )
    assert max_abs_diff(ref, ours, names) <= tol(device)


@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw"])
def test_parity_with_torch_muon_bf16(device, adjust_lr_fn):
    # torch.optim.Muon as shipped (bf16 NS) vs MuonOptimizer with ns_dtype=bf16: see module docstring.
    ref, ours, names, travelled, _, _ = _muon_parity_run(
        adjust_lr_fn, torch.bfloat16, device=device
    )
    diff = max_abs_diff(ref, ours, names)
    assert diff <= tol(device, "bf16"), (
        diff
    )  # measured (CPU): 3.2e-3 (original), 3.8e-3 (match_rms_adamw)
    assert travelled > 10 * 1e-2, travelled  # measured: 0.195, 0.224


# --------------------------------------------------------------------------- parity: torch.optim.AdamW


def test_auto_group_adamw_half_matches_torch_adamw(device, fp32_torch_muon):
    """In an algorithm="auto" group, matrices follow torch.optim.Muon and 0-/1-D params follow
    torch.optim.AdamW(lr=adamw_lr, betas=adamw_betas, eps=adamw_eps, weight_decay=adamw_weight_decay)
    when 0-/1-D parameters decay too (adamw_decay_1d=True; without it they get no decay)."""
    ref, ours = make_gpt(device=device), make_gpt(device=device)
    names = [n for n, p in ref.named_parameters() if n.startswith(("blocks.", "ln_f"))]
    ref_params, our_params = freeze_all_but(ref, names), freeze_all_but(ours, names)
    mats = [p for p in ref_params if p.ndim >= 2]
    vecs = [p for p in ref_params if p.ndim < 2]
    assert mats and vecs
    topts = [
        torch.optim.Muon(mats, lr=0.02, weight_decay=0.05, momentum=0.95, adjust_lr_fn="original"),
        torch.optim.AdamW(vecs, lr=3e-3, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1),
    ]
    opt = mf.MuonOptimizer(
        our_params,
        lr=0.02,
        weight_decay=0.05,
        adjust_lr_fn="original",
        ns_dtype=torch.float32,
        adamw_lr=3e-3,
        adamw_betas=(0.8, 0.9),
        adamw_eps=1e-6,
        adamw_weight_decay=0.1,
        adamw_decay_1d=True,
        **TORCH_LIKE,
    )
    for step in range(20):
        for o in topts:
            o.zero_grad()
        backward(ref, step)
        for o in topts:
            o.step()
        opt.zero_grad()
        backward(ours, step)
        opt.step()
    assert max_abs_diff(ref, ours, names) <= tol(device)
    ours_p = dict(ours.named_parameters())
    for n, p in ref.named_parameters():
        if n in names and p.ndim < 2:
            for key in (
                "exp_avg",
                "exp_avg_sq",
                "step",
            ):  # torch keeps a non-capturable step on the CPU
                torch.testing.assert_close(
                    opt.state[ours_p[n]][key].cpu(),
                    topts[1].state[p][key].cpu(),
                    atol=tol(device, "state"),
                    rtol=1e-5,
                )


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_hybrid_matches_torch_muon_plus_adamw(device, fp32_torch_muon, tied):
    """create_hybrid_optimizer == torch.optim.Muon on hidden matrices + torch.optim.AdamW on the rest
    (one AdamW group, which decays every parameter: adamw_decay_1d=True; the default's no-decay
    groups are tests/test_muon_reference.py::test_hybrid_matches_torch_muon_and_adamw_fp32)."""
    ref, ours = make_gpt(tied, device=device), make_gpt(tied, device=device)
    opt = mf.create_hybrid_optimizer(
        ours,
        muon_lr=0.02,
        adamw_lr=2e-3,
        adamw_weight_decay=0.01,
        muon_weight_decay=0.1,
        adamw_betas=(0.9, 0.999),
        adamw_eps=1e-8,
        adamw_decay_1d=True,
        adjust_lr_fn="original",
        ns_dtype=torch.float32,
        beta2=None,
        **TORCH_LIKE,
    )
    hidden = set(hidden_names(ref))
    topt_m = torch.optim.Muon(
        [p for n, p in ref.named_parameters() if n in hidden],
        lr=0.02,
        weight_decay=0.1,
        momentum=0.95,
        adjust_lr_fn="original",
    )
    topt_a = torch.optim.AdamW(
        [p for n, p in ref.named_parameters() if n not in hidden],
        lr=2e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.01,
    )
    for step in range(20):
        topt_m.zero_grad()
        topt_a.zero_grad()
        backward(ref, step)
        topt_m.step()
        topt_a.step()
        opt.zero_grad()
        backward(ours, step)
        opt.step()
    assert max_abs_diff(ref, ours) <= tol(device)


# --------------------------------------------------------------------------- schedulers


def _scheduled_run(make_sched, *, by_hand=None, steps=12, compile_backend=None):
    model = make_gpt()
    params = freeze_all_but(model, hidden_names(model))
    opt = mf.MuonOptimizer(
        params,
        lr=0.02,
        weight_decay=0.1,
        adjust_lr_fn="original",
        ns_dtype=torch.float32,
        compile={"backend": compile_backend} if compile_backend else False,
        **TORCH_LIKE,
    )
    sched = make_sched(opt) if make_sched else None
    seen = []
    for step in range(steps):
        if by_hand is not None:
            for key, values in by_hand.items():
                opt.param_groups[0][key] = values[step]
        seen.append({k: opt.param_groups[0][k] for k in ("lr", "momentum")})
        opt.zero_grad()
        backward(model, step)
        opt.step()
        if step == 0 and compile_backend is not None:
            compile_backend.after_first_step = compile_backend.frame_count
        if sched is not None:
            sched.step()
    return model, seen


def wide_shapes(params):
    """compile=...: one graph per distinct bucket signature (the shapes of up to BUCKET_SIZE
    parameters of one shape updated together), none after step 1."""
    return graph_count(params)


def graph_count(params):
    params = list(params)
    return len(
        {
            tuple(tuple(params[i].shape) for i in b)
            for b in mf.engine.buckets(params, mf.optim.BUCKET_SIZE)
        }
    )


def _torch_scheduled_run(make_sched, steps=12):
    model = make_gpt()
    params = freeze_all_but(model, hidden_names(model))
    opt = torch.optim.Muon(
        params, lr=0.02, weight_decay=0.1, momentum=0.95, adjust_lr_fn="original"
    )
    sched = make_sched(opt)
    for step in range(steps):
        opt.zero_grad()
        backward(model, step)
        opt.step()
        sched.step()
    return model


SCHEDULERS = {
    "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.3),
    "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(
        o,
        max_lr=0.05,
        total_steps=12,
        pct_start=0.3,
        cycle_momentum=True,
        base_momentum=0.8,
        max_momentum=0.95,
    ),
}


@pytest.mark.parametrize("name", list(SCHEDULERS))
@pytest.mark.slow
def test_scheduler_changes_lr_without_recompiling(fp32_torch_muon, name):
    cnt = CompileCounterWithBackend("eager")
    model, seen = _scheduled_run(SCHEDULERS[name], compile_backend=cnt)
    assert (
        cnt.frame_count
        == cnt.after_first_step
        == wide_shapes([p for n, p in model.named_parameters() if n in hidden_names(model)])
    ), cnt.frame_count
    lrs = [s["lr"] for s in seen]
    assert len(set(lrs)) >= 4  # the lr really changed
    if name == "OneCycleLR":
        moms = [s["momentum"] for s in seen]
        assert len(set(moms)) >= 4 and min(moms) == pytest.approx(0.8, abs=1e-3)

    # Same lr (and momentum) written into the group by hand, no scheduler: bit-identical.
    cnt2 = CompileCounterWithBackend("eager")
    by_hand = {"lr": lrs, "momentum": [s["momentum"] for s in seen]}
    model2, _ = _scheduled_run(None, by_hand=by_hand, compile_backend=cnt2)
    assert_models_equal(model, model2)
    assert cnt2.frame_count == cnt2.after_first_step

    # Constant lr gives a different result (the schedule had an effect) ...
    model3, _ = _scheduled_run(None)
    assert max_abs_diff(model, model3) > 1e-3
    # ... and torch.optim.Muon under the same scheduler agrees.
    ref = _torch_scheduled_run(SCHEDULERS[name])
    assert max_abs_diff(ref, model) <= 1e-5


@pytest.mark.slow
def test_tensor_lr_scheduler_no_recompile():
    cnt = CompileCounterWithBackend("eager")
    model = make_gpt()
    params = freeze_all_but(model, hidden_names(model))
    opt = mf.MuonOptimizer(params, lr=torch.tensor(0.02), compile={"backend": cnt})
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
    for step in range(4):
        opt.zero_grad()
        backward(model, step)
        opt.step()
        sched.step()
    assert cnt.frame_count == wide_shapes(params)


def test_scheduler_scales_adamw_half_of_auto_group():
    """Documented: in an "auto" group the AdamW lr is adamw_lr · lr / base_lr."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 3)
    ref_b = lin.bias.detach().clone().requires_grad_()
    opt = mf.MuonOptimizer(lin.parameters(), lr=0.02, adamw_lr=1e-2, adamw_betas=(0.9, 0.99))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    topt = torch.optim.AdamW([ref_b], lr=1e-2, betas=(0.9, 0.99), weight_decay=0.0)
    tsched = torch.optim.lr_scheduler.StepLR(topt, step_size=1, gamma=0.5)
    for step in range(4):
        g = torch.randn(3, generator=torch.Generator().manual_seed(step))
        lin.weight.grad = torch.randn(3, 4)
        lin.bias.grad = g.clone()
        ref_b.grad = g.clone()
        opt.step()
        topt.step()
        sched.step()
        tsched.step()
    torch.testing.assert_close(lin.bias.detach(), ref_b.detach(), atol=1e-6, rtol=0)


# --------------------------------------------------------------------------- resume


def _train(model, opt, steps, start=0):
    for step in range(start, start + steps):
        opt.zero_grad()
        backward(model, step)
        opt.step()


@pytest.mark.parametrize("kind", ["muon_auto", "hybrid", "normuon"])
def test_resume_is_bit_exact_fp32(device, kind):
    def build(model):
        if kind == "hybrid":
            return mf.create_hybrid_optimizer(model, muon_weight_decay=0.1)
        if kind == "normuon":  # compiled resume: test_compiled_matches_eager_and_survives_load...
            return mf.MuonOptimizer(model.parameters(), beta2=0.95, weight_decay=0.01)
        return mf.MuonOptimizer(model.parameters(), weight_decay=0.01, adamw_weight_decay=0.01)

    full = make_gpt(device=device)
    opt = build(full)
    _train(full, opt, 20)

    first = make_gpt(device=device)
    opt1 = build(first)
    _train(first, opt1, 10)
    ckpt = roundtrip({"model": first.state_dict(), "opt": opt1.state_dict()})

    second = make_gpt(
        seed=123, device=device
    )  # different init: everything must come from the checkpoint
    second.load_state_dict(ckpt["model"])
    opt2 = build(second)
    opt2.load_state_dict(ckpt["opt"])
    assert_states_equal(snapshot_state(opt2), snapshot_state(opt1))
    _train(second, opt2, 10, start=10)
    assert_models_equal(full, second)
    assert_states_equal(snapshot_state(opt2), snapshot_state(opt))


def test_resume_bf16_params_fp32_state():
    def build(model):
        return mf.MuonOptimizer(model.parameters(), momentum_dtype=torch.float32, weight_decay=0.01)

    full = make_gpt(dtype=torch.bfloat16)
    opt = build(full)
    _train(full, opt, 20)
    w = full.blocks[0].fc.weight
    assert w.dtype == torch.bfloat16
    assert opt.state[w]["momentum_buffer"].dtype == torch.float32

    first = make_gpt(dtype=torch.bfloat16)
    opt1 = build(first)
    _train(first, opt1, 10)
    ckpt = roundtrip({"model": first.state_dict(), "opt": opt1.state_dict()})
    assert ckpt["opt"]["state"][0]["momentum_buffer"].dtype in (torch.float32, torch.bfloat16)

    second = make_gpt(seed=5, dtype=torch.bfloat16)
    second.load_state_dict(ckpt["model"])
    opt2 = build(second)
    opt2.load_state_dict(ckpt["opt"])
    # torch.optim.Optimizer.load_state_dict would cast the fp32 buffers to bf16 (docs/faq.md, state_dict):
    # the adapter must restore the saved dtypes, bit for bit.
    w2 = second.blocks[0].fc.weight
    assert opt2.state[w2]["momentum_buffer"].dtype == torch.float32
    assert_states_equal(snapshot_state(opt2), snapshot_state(opt1))
    _train(second, opt2, 10, start=10)
    assert_models_equal(full, second)
    assert_states_equal(snapshot_state(opt2), snapshot_state(opt))


def test_load_before_first_step_then_train(device):
    """A checkpoint loaded into an optimizer that never stepped (the usual resume order)."""
    a = make_gpt(device=device)
    opt_a = mf.MuonOptimizer(a.parameters())
    _train(a, opt_a, 3)
    sd = roundtrip(opt_a.state_dict())
    b = copy.deepcopy(a)
    opt_b = mf.MuonOptimizer(b.parameters())
    opt_b.load_state_dict(sd)
    _train(a, opt_a, 2, start=3)
    _train(b, opt_b, 2, start=3)
    assert_models_equal(a, b)


# --------------------------------------------------------------------------- grads, closure, groups, hooks

GRAD_CASES = {
    "default": dict(),
    "nesterov_off": dict(nesterov=False),
    "nesterov_sgd": dict(momentum_kind="sgd"),
    "accumulation": dict(gradient_accumulation_steps=2),
    "skip": dict(nonfinite="skip"),
    "normuon": dict(beta2=0.95),
    "compiled": dict(compile={"backend": "eager"}),
}


@pytest.mark.parametrize("case", list(GRAD_CASES))
def test_step_never_modifies_grads(device, case):
    model = make_gpt(device=device)
    opt = mf.MuonOptimizer(
        model.parameters(), weight_decay=0.1, adamw_weight_decay=0.1, **GRAD_CASES[case]
    )
    for step in range(3):
        opt.zero_grad()
        backward(model, step)
        if case == "skip" and step == 1:
            model.blocks[0].fc.weight.grad[0, 0] = float("inf")
        before = {n: p.grad.clone() for n, p in model.named_parameters()}
        ids = {n: id(p.grad) for n, p in model.named_parameters()}
        opt.step()
        for n, p in model.named_parameters():
            assert id(p.grad) == ids[n]
            assert torch.equal(p.grad, before[n]), (case, n)


def test_closure(device, fp32_torch_muon):
    ref, ours = make_gpt(device=device), make_gpt(device=device)
    names = hidden_names(ref)
    topt = torch.optim.Muon(
        freeze_all_but(ref, names), lr=0.02, weight_decay=0.0, adjust_lr_fn="original"
    )
    opt = mf.MuonOptimizer(
        freeze_all_but(ours, names), ns_dtype=torch.float32, weight_decay=0.0, **TORCH_LIKE
    )
    calls = []

    def closure_for(model, o, step):
        def closure():
            calls.append(torch.is_grad_enabled())
            o.zero_grad()
            return backward(model, step)

        return closure

    for step in range(3):
        with torch.no_grad():  # step() must enable grad for the closure itself
            loss = opt.step(closure_for(ours, opt, step))
        assert isinstance(loss, torch.Tensor) and loss.ndim == 0
        topt.step(closure_for(ref, topt, step))
    assert calls == [True] * 6
    assert max_abs_diff(ref, ours, names) <= tol(device)
    assert opt.step() is None


def test_add_param_group(device, fp32_torch_muon):
    torch.manual_seed(0)
    w1, w2 = torch.randn(8, 6).to(device), torch.randn(5, 7).to(device)
    ours = [nn.Parameter(w1.clone()), nn.Parameter(w2.clone())]
    ref = [nn.Parameter(w1.clone()), nn.Parameter(w2.clone())]
    opt = mf.MuonOptimizer(
        [ours[0]],
        lr=0.02,
        ns_dtype=torch.float32,
        adjust_lr_fn="original",
        weight_decay=0.0,
        **TORCH_LIKE,
    )
    topt = torch.optim.Muon([ref[0]], lr=0.02, weight_decay=0.0, adjust_lr_fn="original")
    opt.add_param_group({"params": [ours[1]], "lr": 0.05, "weight_decay": 0.1})
    topt.add_param_group({"params": [ref[1]], "lr": 0.05, "weight_decay": 0.1})
    g = opt.param_groups[1]
    # missing keys come from the defaults
    assert (
        g["momentum"] == 0.95
        and g["ns_steps"] is None
        and g["method"] == "quintic"
        and g["lr"] == 0.05
    )
    for step in range(5):
        gen = torch.Generator().manual_seed(step)
        for a, b in zip(ours, ref):
            a.grad = torch.randn(a.shape, generator=gen).to(device)
            b.grad = a.grad.clone()
        opt.step()
        topt.step()
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.detach().cpu(), b.detach().cpu(), atol=tol(device), rtol=0)
    assert len(opt.state_dict()["param_groups"]) == 2
    # A group added later is validated like the constructor's.
    with pytest.raises(ValueError, match="Invalid learning rate"):
        opt.add_param_group(
            {"params": [nn.Parameter(torch.randn(3, 3, device=device))], "lr": -1.0}
        )


def _optimizer_of(kind: str):
    """A small model and a ``kind`` optimizer over it (eager)."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4))
    if kind == "hybrid":
        return model, mf.create_hybrid_optimizer(model, compile=False)
    cls = {"muon": mf.MuonOptimizer, "sso": mf.SpectralSphereOptimizer, "tritonw": mf.TritonMuonW}[
        kind
    ]
    return model, cls(model.named_parameters(), lr=0.02, compile=False)


def _copied(opt, how: str, kind: str):
    if how == "deepcopy":
        return copy.deepcopy(opt)
    if how == "pickle":
        import pickle

        return pickle.loads(pickle.dumps(opt))
    _, fresh = _optimizer_of(kind)
    fresh.load_state_dict(opt.state_dict())
    return fresh


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "load_state_dict"])
@pytest.mark.parametrize("kind", ["muon", "hybrid", "sso", "tritonw"])
def test_add_param_group_after_copy_or_load(kind, how):
    """torch's ``__setstate__`` (run by deepcopy, pickle and load_state_dict) adds
    ``differentiable`` to the defaults; a group added afterwards must not inherit it as a
    refused key, and it steps exactly as the same group added to the original optimizer."""
    torch.manual_seed(0)
    model, opt = _optimizer_of(kind)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    other = _copied(opt, how, kind)
    w = torch.randn(8, 6)
    new, ref = nn.Parameter(w.clone()), nn.Parameter(w.clone())
    other.add_param_group({"params": [("extra.weight", new)], "lr": 0.03})
    opt.add_param_group({"params": [("extra.weight", ref)], "lr": 0.03})
    assert other.param_groups[-1].keys() == opt.param_groups[-1].keys()
    for step in range(2):
        new.grad = torch.randn(8, 6, generator=torch.Generator().manual_seed(step))
        ref.grad = new.grad.clone()
        other.step()
        opt.step()
    assert not torch.equal(new.detach(), w)
    torch.testing.assert_close(new.detach(), ref.detach(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copy_refuses_a_misspelled_matrix_view_as_the_original(how):
    """A copy keeps the checks across groups (it is built, as the original): add_param_group with
    a matrix_view mapping that names no parameter of the group is refused with the same message,
    and the group is not added."""
    _, opt = _optimizer_of("muon")
    messages = []
    for o in (opt, _copied(opt, how, "muon")):
        extra = nn.Parameter(torch.randn(8, 6))
        group = {"params": [("extra.weight", extra)], "matrix_view": {"extra.wieght": "flatten"}}
        with pytest.raises(ValueError) as refused:
            o.add_param_group(group)
        messages.append(str(refused.value))
        assert len(o.param_groups) == 1
    assert (
        messages[0]
        == messages[1]
        == (
            "Invalid matrix_view: key 'extra.wieght' matches no parameter of its groups; they are: 'extra.weight'"
        )
    )


def test_use_muon_groups():
    """``use_muon`` (as in KellerJordan's MuonWithAuxAdam) picks the group's algorithm: False is
    AdamW at the group's adamw_lr and adamw_weight_decay, also for a 2-D weight; True is Muon."""
    emb, hidden = nn.Parameter(torch.randn(6, 4)), nn.Parameter(torch.randn(5, 4))
    opt = mf.MuonOptimizer(
        [{"params": [emb], "use_muon": False}, {"params": [hidden], "use_muon": True}],
        lr=0.02,
        adamw_lr=3e-3,
        adamw_weight_decay=0.1,
        weight_decay=0.01,
    )
    adam, muon = opt.param_groups
    assert (adam["algorithm"], adam["lr"], adam["weight_decay"]) == ("adamw", 3e-3, 0.1)
    assert (muon["algorithm"], muon["lr"], muon["weight_decay"]) == ("muon", 0.02, 0.01)
    assert "use_muon" not in adam and "use_muon" not in muon
    emb.grad, hidden.grad = torch.randn(6, 4), torch.randn(5, 4)
    opt.step()
    assert set(opt.state[emb]) == {"step", "exp_avg", "exp_avg_sq"}
    assert set(opt.state[hidden]) == {"momentum_buffer"}


def test_step_hooks_fire_in_order():
    lin = nn.Linear(4, 4)
    opt = mf.MuonOptimizer(lin.parameters())
    events = []
    h1 = opt.register_step_pre_hook(lambda o, args, kwargs: events.append(("pre", o is opt)))
    h2 = opt.register_step_post_hook(lambda o, args, kwargs: events.append(("post", o is opt)))
    lin(torch.randn(2, 4)).sum().backward()
    opt.step()
    assert events == [("pre", True), ("post", True)]
    h1.remove()
    h2.remove()
    opt.step()
    assert len(events) == 2
    # the global hooks of torch.optim fire too
    seen = []
    from torch.optim.optimizer import register_optimizer_step_post_hook

    handle = register_optimizer_step_post_hook(lambda o, a, k: seen.append(type(o)))
    try:
        opt.step()
    finally:
        handle.remove()
    assert seen == [mf.MuonOptimizer]


def test_zero_grad():
    lin = nn.Linear(4, 4)
    opt = mf.MuonOptimizer(lin.parameters())
    lin(torch.randn(2, 4)).sum().backward()
    opt.zero_grad(set_to_none=False)
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in lin.parameters())
    opt.zero_grad()
    assert all(p.grad is None for p in lin.parameters())
    before = snapshot_params(lin)
    opt.step()  # no grads: nothing happens, no state is created
    assert all(torch.equal(p, before[n]) for n, p in lin.named_parameters())
    assert len(opt.state) == 0


def test_missing_grads_leave_params_untouched(device):
    model = make_gpt(device=device)
    opt = mf.MuonOptimizer(model.parameters())
    _train(model, opt, 2)
    before = snapshot_params(model)
    st_before = snapshot_state(opt)
    opt.zero_grad()
    backward(model, 5)
    model.blocks[1].fc.weight.grad = None
    model.blocks[1].fc.bias.grad = None
    opt.step()
    fc_w, fc_b = model.blocks[1].fc.weight, model.blocks[1].fc.bias
    assert torch.equal(fc_w, before["blocks.1.fc.weight"]) and torch.equal(
        fc_b, before["blocks.1.fc.bias"]
    )
    assert not torch.equal(model.blocks[0].fc.weight, before["blocks.0.fc.weight"])
    idx = next(
        i for i, p in enumerate(p for g in opt.param_groups for p in g["params"]) if p is fc_w
    )
    assert torch.equal(opt.state[fc_w]["momentum_buffer"], st_before[idx]["momentum_buffer"])


def test_named_parameters_are_accepted_and_kept():
    model = make_gpt()
    opt = mf.MuonOptimizer(model.named_parameters())
    assert opt.param_groups[0]["param_names"] == [n for n, _ in model.named_parameters()]
    _train(model, opt, 1)
    assert opt.state_dict()["param_groups"][0]["param_names"][0] == "wte.weight"


def test_nonfinite_error_names_the_parameters():
    model = make_gpt()
    opt = mf.MuonOptimizer(model.named_parameters(), nonfinite="error")
    _train(model, opt, 1)
    opt.zero_grad()
    backward(model, 1)
    model.blocks[1].proj.weight.grad[0, 0] = float("nan")
    model.ln_f.bias.grad[0] = float("-inf")
    before, st = snapshot_params(model), snapshot_state(opt)
    with pytest.raises(RuntimeError) as info:
        opt.step()
    assert str(info.value) == (
        "non-finite gradient (inf or nan) in 'blocks.1.proj.weight', 'ln_f.bias'; parameters and "
        "optimizer state were left unchanged. Pass nonfinite='skip' to skip such steps, or use "
        "torch.amp.GradScaler."
    )
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert_states_equal(snapshot_state(opt), st)
    assert opt.nonfinite_steps == 1


# --------------------------------------------------------------------------- gradient accumulation


@pytest.mark.parametrize("k", [2, 3])
def test_gradient_accumulation_equals_mean_gradient_step(device, fp32_torch_muon, k):
    ours, ref = make_gpt(device=device), make_gpt(device=device)
    opt = mf.MuonOptimizer(
        ours.parameters(),
        lr=0.02,
        weight_decay=0.1,
        adjust_lr_fn="original",
        ns_dtype=torch.float32,
        adamw_lr=1e-3,
        adamw_weight_decay=0.01,
        adamw_betas=(0.9, 0.999),
        adamw_decay_1d=True,
        gradient_accumulation_steps=k,
        **TORCH_LIKE,
    )
    ref_mats = [p for p in ref.parameters() if p.ndim >= 2]
    ref_vecs = [p for p in ref.parameters() if p.ndim < 2]
    topt = [
        torch.optim.Muon(ref_mats, lr=0.02, weight_decay=0.1, adjust_lr_fn="original"),
        torch.optim.AdamW(ref_vecs, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01),
    ]
    for outer in range(3):
        # ours: step() after every micro-batch, zero_grad in between (an ordinary loop)
        for micro in range(k):
            before = snapshot_params(ours)
            opt.zero_grad()
            backward(ours, 10 * outer + micro, bsz=2)
            opt.step()
            if micro < k - 1:
                assert opt.last_step is not None and not opt.last_step.applied
                for n, p in ours.named_parameters():
                    assert torch.equal(p, before[n]), (micro, n)
            else:
                assert opt.last_step.applied
        # reference: one step on the mean gradient of the k micro-batches, summed by hand
        total = None
        for micro in range(k):
            for o in topt:
                o.zero_grad()
            backward(ref, 10 * outer + micro, bsz=2)
            gs = [p.grad.clone() for p in ref.parameters()]
            total = gs if total is None else [t + g for t, g in zip(total, gs)]
        for p, t in zip(ref.parameters(), total):
            p.grad = t / k
        for o in topt:
            o.step()
        assert max_abs_diff(ref, ours) <= tol(device)
    b = ours.blocks[0].fc.bias
    assert float(opt.state[b]["step"]) == 3.0  # counts applied steps, not micro-batches


# --------------------------------------------------------------------------- mixed precision


def test_bf16_params_one_step_matches_fp32_reference(device, fp32_torch_muon):
    torch.manual_seed(0)
    w = torch.randn(24, 16).bfloat16().to(device)
    g = torch.randn(24, 16).bfloat16().to(device)
    p = nn.Parameter(w.clone())
    p.grad = g.clone()
    opt = mf.MuonOptimizer(
        [p],
        lr=0.02,
        weight_decay=0.1,
        adjust_lr_fn="original",
        ns_dtype=torch.float32,
        momentum_dtype=torch.float32,
        **TORCH_LIKE,
    )
    opt.step()
    assert p.dtype == torch.bfloat16
    assert opt.state[p]["momentum_buffer"].dtype == torch.float32
    q = nn.Parameter(w.float())
    q.grad = g.float()
    torch.optim.Muon([q], lr=0.02, weight_decay=0.1, adjust_lr_fn="original").step()
    # the fp32 result rounded to bf16, within one bf16 rounding of the update (|w| < 5: ulp ≤ 2^-6)
    diff = (p.detach().float() - q.detach()).abs().cpu()
    ulp = torch.finfo(torch.bfloat16).eps * q.detach().abs().clamp_min(1e-3).cpu()
    assert bool((diff <= ulp).all()), diff.max()
    assert not torch.equal(p.detach(), w)


def test_bf16_model_trains_and_keeps_dtypes(device):
    model = make_gpt(dtype=torch.bfloat16, device=device)
    opt = mf.MuonOptimizer(model.parameters())
    losses = []
    for _ in range(8):
        opt.zero_grad()
        losses.append(backward(model, 0).item())  # same batch: the loss must go down
        opt.step()
    assert losses[-1] < losses[0] - 0.2, losses
    for p in model.parameters():
        assert p.dtype == torch.bfloat16
        for k, v in opt.state[p].items():
            assert v.dtype == (torch.float32 if k == "step" else torch.bfloat16), k


def test_autocast_bf16_matches_torch_reference(fp32_torch_muon):
    ref, ours = make_gpt(), make_gpt()
    opt = mf.create_hybrid_optimizer(
        ours, adjust_lr_fn="original", ns_dtype=torch.float32, beta2=None, **TORCH_LIKE
    )
    hidden = set(hidden_names(ref))
    rest = [(n, p) for n, p in ref.named_parameters() if n not in hidden]
    # the hybrid's defaults spelled out in torch: Muon wd 0.01; AdamW β (0.9, 0.95), wd 0.01 on ndim ≥ 2 only
    topt = [
        torch.optim.Muon(
            [p for n, p in ref.named_parameters() if n in hidden],
            lr=0.02,
            weight_decay=0.01,
            adjust_lr_fn="original",
        ),
        torch.optim.AdamW(
            [
                {"params": [p for _, p in rest if p.ndim >= 2]},
                {"params": [p for _, p in rest if p.ndim < 2], "weight_decay": 0.0},
            ],
            lr=1e-3,
            betas=(0.9, 0.95),
            weight_decay=0.01,
        ),
    ]
    for step in range(5):
        for model, opts in ((ref, topt), (ours, [opt])):
            for o in opts:
                o.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = gpt_loss(model, step)
            assert loss.dtype == torch.float32
            loss.backward()
            for o in opts:
                o.step()
        if step == 0:  # identical params -> identical bf16 forward -> identical grads
            assert max_abs_diff(ref, ours) <= 1e-6
    assert all(p.dtype == torch.float32 for p in ours.parameters())
    # Later steps: the ~1e-7 fp32 differences flip bf16 roundings of the autocast forward, so
    # gradients differ by ~2^-8 relative; AdamW turns that into O(lr) = 1e-3 moves on entries
    # whose gradients are near 0. Measured 1.1e-3 after 5 steps; distance travelled ~1e-2.
    assert max_abs_diff(ref, ours) <= 3e-3


def test_fp16_grad_scaler_skips_inf_step_and_backs_off(device):
    model = make_gpt(device=device)
    opt = mf.MuonOptimizer(model.parameters())
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**10, growth_interval=1000)

    def scaled_backward(step, poison=False):
        opt.zero_grad()
        with torch.autocast(device.type, dtype=torch.float16):
            loss = gpt_loss(model, step)
        scaler.scale(loss).backward()
        if poison:
            model.blocks[0].qkv.weight.grad[0, 0] = float("inf")

    for step in range(2):
        scaled_backward(step)
        scaler.step(opt)
        scaler.update()
    assert scaler.get_scale() == 2.0**10
    before, st = snapshot_params(model), snapshot_state(opt)
    scaled_backward(2, poison=True)
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**9  # reduced by backoff_factor
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert_states_equal(snapshot_state(opt), st)
    # and training continues
    scaled_backward(3)
    scaler.step(opt)
    scaler.update()
    assert not torch.equal(model.blocks[0].qkv.weight, before["blocks.0.qkv.weight"])
    assert float(opt.state[model.blocks[0].fc.bias]["step"]) == 3.0


def test_grad_scaler_step_equals_unscaled_step(device, fp32_torch_muon):
    """scaler.step(opt) applies the unscaled gradient: same as torch.optim.Muon on grad / scale."""
    torch.manual_seed(0)
    w = torch.randn(12, 10).to(device)
    p, q = nn.Parameter(w.clone()), nn.Parameter(w.clone())
    opt = mf.MuonOptimizer(
        [p], ns_dtype=torch.float32, adjust_lr_fn="original", weight_decay=0.0, **TORCH_LIKE
    )
    topt = torch.optim.Muon([q], lr=0.02, weight_decay=0.0, adjust_lr_fn="original")
    scaler = torch.amp.GradScaler(device.type, init_scale=256.0)
    x = torch.randn(5, 10).to(device)
    for _ in range(3):
        opt.zero_grad()
        scaler.scale((x @ p.T).square().mean()).backward()
        scaler.step(opt)
        scaler.update()
        topt.zero_grad()
        (x @ q.T).square().mean().backward()
        topt.step()
    torch.testing.assert_close(p.detach().cpu(), q.detach().cpu(), atol=tol(device), rtol=0)


def test_nonfinite_skip_leaves_everything_unchanged_and_counts(device):
    model = make_gpt(device=device)
    opt = mf.MuonOptimizer(
        model.parameters(), nonfinite="skip", weight_decay=0.1, adamw_weight_decay=0.1
    )
    _train(model, opt, 2)
    assert opt.nonfinite_steps == 0
    for poison in ("nan", "inf"):
        before, st = snapshot_params(model), snapshot_state(opt)
        opt.zero_grad()
        backward(model, 7)
        model.ln_f.weight.grad[3] = float(poison)  # one bad entry in one (AdamW) parameter
        opt.step()
        assert not bool(opt.last_step.finite)
        for n, p in model.named_parameters():
            assert torch.equal(p, before[n]), n  # every parameter, not only the bad one
        assert_states_equal(snapshot_state(opt), st)
    assert opt.nonfinite_steps == 2
    _train(model, opt, 1, start=8)
    assert bool(opt.last_step.finite) and opt.nonfinite_steps == 2
    assert float(opt.state[model.ln_f.weight]["step"]) == 3.0


def test_nonfinite_skip_on_first_step(device):
    lin = nn.Linear(5, 4).to(device)
    opt = mf.MuonOptimizer(lin.parameters(), nonfinite="skip")
    before = snapshot_params(lin)
    lin.weight.grad = torch.full((4, 5), float("nan"), device=device)
    lin.bias.grad = torch.ones(4, device=device)
    opt.step()
    assert all(torch.equal(p, before[n]) for n, p in lin.named_parameters())
    assert opt.nonfinite_steps == 1
    for p in lin.parameters():  # state, if created, is the fresh init
        for k, v in opt.state[p].items():
            assert torch.equal(v, torch.zeros_like(v)), k


def test_nonfinite_error_leaves_params_and_state_unchanged(device):
    model = make_gpt(device=device)
    opt = mf.MuonOptimizer(model.parameters(), nonfinite="error")
    _train(model, opt, 2)
    before, st = snapshot_params(model), snapshot_state(opt)
    opt.zero_grad()
    backward(model, 3)
    model.blocks[0].fc.weight.grad.fill_(float("inf"))
    with pytest.raises(RuntimeError, match="non-finite gradient"):
        opt.step()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert_states_equal(snapshot_state(opt), st)


# --------------------------------------------------------------------------- create_hybrid_optimizer


def _where(opt) -> dict[str, str]:
    out = {}
    for g in opt.param_groups:
        for n in g["param_names"]:
            out[n] = g["algorithm"]
    return out


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_hybrid_puts_each_parameter_where_documented(tied):
    model = make_gpt(tied)
    opt = mf.create_hybrid_optimizer(model)
    where = _where(opt)
    names = [n for n, _ in model.named_parameters()]
    assert sorted(where) == sorted(names)  # every parameter exactly once
    assert ("head.weight" in names) is (not tied)  # tied: one tensor, listed once
    for n, p in model.named_parameters():
        if n in ("wte.weight", "wpe.weight", "head.weight") or p.ndim < 2:
            assert where[n] == "adamw", n
        else:
            assert where[n] == "muon", n
    assert sorted(n for n, a in where.items() if a == "muon") == sorted(hidden_names(model))
    groups = {g["algorithm"]: g for g in opt.param_groups}
    assert groups["muon"]["lr"] == 0.02 and groups["adamw"]["lr"] == 1e-3
    assert groups["adamw"]["weight_decay"] == 0.01 and groups["muon"]["weight_decay"] == 0.01
    assert (
        groups["adamw"]["adamw_betas"] == (0.9, 0.95) and groups["adamw"]["adamw_decay_1d"] is False
    )
    # one optimizer, one state_dict covering every parameter
    _train(model, opt, 1)
    sd = opt.state_dict()
    assert len(sd["param_groups"]) == 2
    assert sorted(sd["state"]) == list(range(len(names)))


def test_hybrid_split_is_printed(capsys):
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("emb", nn.Embedding(10, 4))
    model.add_module("conv", nn.Conv2d(4, 6, 3))
    model.add_module("hidden", nn.Linear(4, 8))
    model.add_module("norm", nn.LayerNorm(8))
    model.add_module("out", nn.Linear(8, 10, bias=False))
    opt = mf.create_hybrid_optimizer(model, verbose=True)
    printed = capsys.readouterr().out
    assert printed.strip() == str(opt.split)
    text = str(opt.split)
    assert text.startswith("NorMuon: 2 tensors, 248 parameters")
    assert "AdamW: 6 tensors, 150 parameters" in text
    for name, reason in [
        ("conv.weight", "flattened"),
        ("hidden.weight", "hidden matrix"),
        ("emb.weight", "embedding"),
        ("out.weight", "output head"),
        ("norm.bias", "1-D"),
    ]:
        line = next(line for line in text.splitlines() if line.strip().startswith(name + " "))
        assert reason in line, line


def _decay_only_step(model, opt):
    """One step with zero gradients: Adam's and Muon's directions are 0, so only decay moves a
    parameter. Returns each parameter's factor p_after / p_before (mean over its elements)."""
    before = snapshot_params(model)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    return {n: (p.detach() / before[n]).mean().item() for n, p in model.named_parameters()}


@pytest.mark.parametrize("decay_1d", [False, True])
def test_hybrid_decays_1d_parameters_only_when_asked(decay_1d):
    """Default: AdamW's weight decay reaches embeddings and the head (ndim ≥ 2), never norm gains
    and biases; adamw_decay_1d=True restores decay on every AdamW parameter."""
    model = make_gpt()
    with torch.no_grad():  # non-zero everywhere, so a factor is defined
        for p in model.parameters():
            p.add_(0.5)
    kw = {} if not decay_1d else {"adamw_decay_1d": True}
    opt = mf.create_hybrid_optimizer(
        model,
        muon_lr=0.02,
        adamw_lr=0.01,
        adamw_weight_decay=0.1,
        muon_weight_decay=0.05,
        compile=False,
        **kw,
    )
    assert all(g["adamw_decay_1d"] is decay_1d for g in opt.param_groups)
    factors = _decay_only_step(model, opt)
    where = _where(opt)
    for n, p in model.named_parameters():
        if where[n] == "muon":
            expected = 1 - 0.02 * 0.05
        else:
            expected = 1 - 0.01 * 0.1 if (decay_1d or p.ndim >= 2) else 1.0
        assert factors[n] == pytest.approx(expected, abs=1e-6), n
    assert any(p.ndim < 2 for p in model.parameters())


@pytest.mark.parametrize("decay_1d", [False, True])
def test_muon_optimizer_adamw_half_decays_1d_only_when_asked(decay_1d):
    """MuonOptimizer's "auto" group: its AdamW half (0-/1-D) decays only with adamw_decay_1d;
    an "adamw" group follows the same rule for its own weight_decay."""
    model = make_gpt()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    hidden = set(hidden_names(model))
    named = dict(model.named_parameters())
    groups = [
        {
            "params": [
                p for n, p in named.items() if n not in ("wte.weight", "wpe.weight", "head.weight")
            ]
        },
        {
            "params": [named["wte.weight"], named["wpe.weight"]],
            "algorithm": "adamw",
            "lr": 0.01,
            "weight_decay": 0.2,
        },
    ]
    opt = mf.MuonOptimizer(
        groups,
        lr=0.02,
        weight_decay=0.05,
        adamw_lr=0.01,
        adamw_weight_decay=0.1,
        adamw_decay_1d=decay_1d,
        compile=False,
    )
    factors = _decay_only_step(model, opt)
    for n, p in named.items():
        if n == "head.weight":
            assert factors[n] == 1.0  # not in the optimizer
        elif n in hidden:
            assert factors[n] == pytest.approx(1 - 0.02 * 0.05, abs=1e-6), n
        elif p.ndim >= 2:
            assert factors[n] == pytest.approx(1 - 0.01 * 0.2, abs=1e-6), n
        else:
            assert factors[n] == pytest.approx(1 - 0.01 * 0.1 if decay_1d else 1.0, abs=1e-6), n


def test_adamw_decay_1d_must_be_a_bool():
    with pytest.raises(TypeError, match="Invalid adamw_decay_1d: 1 "):
        mf.MuonOptimizer(make_gpt().parameters(), adamw_decay_1d=1)


def test_checkpoint_from_before_adamw_decay_1d_keeps_decaying_every_parameter():
    """A state_dict saved before the key existed loads with adamw_decay_1d=True: what it ran."""
    model = make_gpt()
    opt = mf.create_hybrid_optimizer(model, compile=False)
    _train(model, opt, 1)
    sd = opt.state_dict()
    for g in sd["param_groups"]:
        del g["adamw_decay_1d"]
    opt.load_state_dict(sd)
    assert all(g["adamw_decay_1d"] is True for g in opt.param_groups)


def test_hybrid_overrides_by_name_and_predicate():
    model = make_gpt()
    opt = mf.create_hybrid_optimizer(
        model,
        adamw_names=["blocks.0.qkv.weight"],
        adamw_predicate=lambda n, p: n.endswith("fc2.weight"),
    )
    where = _where(opt)
    assert where["blocks.0.qkv.weight"] == "adamw"
    assert where["blocks.1.qkv.weight"] == "muon"
    assert where["blocks.0.fc2.weight"] == where["blocks.1.fc2.weight"] == "adamw"
    assert where["blocks.0.fc.weight"] == "muon"


class _Frozen(nn.Module):
    """Two hidden matrices of one shape (one bucket), so a frozen one shares a bucket with a trained one."""

    def __init__(self):
        super().__init__()
        self.emb, self.a, self.b, self.head = (
            nn.Embedding(16, 8),
            nn.Linear(8, 8),
            nn.Linear(8, 8),
            nn.Linear(8, 16),
        )

    def forward(self, x):
        return self.head(self.b(self.a(self.emb(x)).relu()))


def test_hybrid_keeps_frozen_parameters_and_trains_them_once_unfrozen():
    """As torch.optim: a frozen parameter stays in the optimizer (in the half its shape and module
    give it, marked in the split); while it has no gradient a step leaves it as it was, decay
    included, and its state, if it has any, at its fresh value; unfrozen, its first update is bit
    for bit that of an optimizer built on the unfrozen model (fresh state)."""
    torch.manual_seed(0)
    model = _Frozen()
    model.b.requires_grad_(False)
    kw = {
        "compile": False,
        "muon_weight_decay": 0.1,
        "adamw_weight_decay": 0.1,
        "adamw_decay_1d": True,
    }
    opt = mf.create_hybrid_optimizer(model, **kw)
    assert _where(opt) == {
        "a.weight": "muon",
        "b.weight": "muon",
        "emb.weight": "adamw",
        "a.bias": "adamw",
        "b.bias": "adamw",
        "head.weight": "adamw",
        "head.bias": "adamw",
    }
    assert opt.split.frozen == {"b.weight", "b.bias"}
    shown = {line.split()[0]: line for line in str(opt.split).splitlines() if line.startswith("  ")}
    assert shown["b.weight"].endswith("hidden matrix, frozen") and shown["b.bias"].endswith(
        "1-D, frozen"
    )
    assert not shown["a.weight"].endswith("frozen")
    x = torch.randint(0, 16, (4, 5))
    frozen = {n: p.detach().clone() for n, p in model.b.named_parameters()}
    for _ in range(3):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    assert all(
        torch.equal(p, frozen[n]) for n, p in model.b.named_parameters()
    )  # no update, no decay
    for p in model.b.parameters():  # (state made for its bucket, never advanced)
        assert all(not v.any() for v in opt.state.get(p, {}).values())
    model.b.requires_grad_(True)
    ref = copy.deepcopy(model)
    ref_opt = mf.create_hybrid_optimizer(ref, **kw)
    for m, o in ((model, opt), (ref, ref_opt)):
        o.zero_grad()
        m(x).pow(2).mean().backward()
        o.step()
    for (n, p), q in zip(model.b.named_parameters(), ref.b.parameters()):
        assert not torch.equal(p, frozen[n]) and torch.equal(p, q), n
        assert set(opt.state[p]) == set(ref_opt.state[q])
        assert all(torch.equal(v, ref_opt.state[q][k]) for k, v in opt.state[p].items())


def test_hybrid_frozen_parameters_without_a_bucket_mate_get_no_state():
    """A frozen parameter alone in its bucket gets no state, as in torch.optim."""
    model = make_gpt()
    model.wpe.weight.requires_grad_(False)
    opt = mf.create_hybrid_optimizer(model, compile=False)
    assert _where(opt)["wpe.weight"] == "adamw"
    before = model.wpe.weight.detach().clone()
    _train(model, opt, 2)
    assert torch.equal(model.wpe.weight, before) and model.wpe.weight not in opt.state


def test_muon_optimizer_on_any_model_routes_by_ndim():
    """MuonOptimizer(model.parameters()) is safe on any model: 0-/1-D params go to AdamW."""
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 4 * 4, 5)
    )
    scalar = nn.Parameter(torch.tensor(1.0))
    opt = mf.MuonOptimizer([*model.parameters(), scalar])
    out = model(torch.randn(2, 3, 6, 6)).sum() * scalar
    out.backward()
    opt.step()
    for p in [*model.parameters(), scalar]:
        keys = set(opt.state[p])
        assert keys == (
            {"momentum_buffer"} if p.ndim >= 2 else {"exp_avg", "exp_avg_sq", "step"}
        ), p.shape


def test_conv_weight_is_flattened_for_muon(device, fp32_torch_muon):
    """A 4-D conv weight gets Muon on its (out, in·kh·kw) view, like torch.optim.Muon on the flat matrix."""
    torch.manual_seed(0)
    w = torch.randn(6, 3, 3, 3).to(device)
    p = nn.Parameter(w.clone())
    q = nn.Parameter(w.reshape(6, 27).clone())
    opt = mf.MuonOptimizer(
        [p], ns_dtype=torch.float32, adjust_lr_fn="original", weight_decay=0.1, **TORCH_LIKE
    )
    topt = torch.optim.Muon([q], lr=0.02, weight_decay=0.1, adjust_lr_fn="original")
    for step in range(3):
        g = torch.randn(6, 3, 3, 3, generator=torch.Generator().manual_seed(step)).to(device)
        p.grad, q.grad = g.clone(), g.reshape(6, 27).clone()
        opt.step()
        topt.step()
    torch.testing.assert_close(
        p.detach().reshape(6, 27).cpu(), q.detach().cpu(), atol=tol(device), rtol=0
    )


# --------------------------------------------------------------------------- muon_fn.Optimizer with a custom transform


def test_generic_optimizer_with_factory_and_scheduler():
    """mf.Optimizer(params, factory, defaults): lr reaches the transform as a 0-d tensor."""
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(5))
    opt = mf.Optimizer(
        [p],
        lambda h: mf.chain(mf.scale_by_learning_rate(h["lr"])),
        {"lr": 0.5},
        compile={"backend": "eager"},
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    expected = p.detach().clone()
    for step in range(4):
        p.grad = torch.ones(5)
        opt.step()
        expected -= 0.5 * 0.5**step  # plain SGD by hand
        sched.step()
    torch.testing.assert_close(p.detach(), expected, atol=1e-6, rtol=0)


def test_generic_optimizer_adamw_recipe_matches_torch_adamw(device):
    torch.manual_seed(0)
    w = torch.randn(7, 3).to(device)
    p, q = nn.Parameter(w.clone()), nn.Parameter(w.clone())
    opt = mf.Optimizer(
        [p],
        lambda h: mf.adamw(h["lr"], (0.9, 0.999), 1e-8, h["weight_decay"]),
        {"lr": 1e-2, "weight_decay": 0.05},
    )
    topt = torch.optim.AdamW([q], lr=1e-2, weight_decay=0.05)
    for step in range(10):
        g = torch.randn(7, 3, generator=torch.Generator().manual_seed(step)).to(device)
        p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        topt.step()
    # elementwise arithmetic on the same gradients: 1e-6 on every device
    torch.testing.assert_close(p.detach().cpu(), q.detach().cpu(), atol=1e-6, rtol=0)
    assert sorted(opt.state[p]) == ["exp_avg", "exp_avg_sq", "step"]
    torch.testing.assert_close(opt.state[p]["exp_avg_sq"].cpu(), topt.state[q]["exp_avg_sq"].cpu())


@pytest.mark.inductor
def test_inductor_smoke(device, fp32_torch_muon):
    torch.manual_seed(0)
    w = torch.randn(16, 8).to(device)
    p, q = nn.Parameter(w.clone()), nn.Parameter(w.clone())
    opt = mf.MuonOptimizer(
        [p],
        ns_dtype=torch.float32,
        adjust_lr_fn="original",
        compile=True,
        weight_decay=0.0,
        **TORCH_LIKE,
    )
    topt = torch.optim.Muon([q], lr=0.02, weight_decay=0.0, adjust_lr_fn="original")
    for step in range(3):
        g = torch.randn(16, 8, generator=torch.Generator().manual_seed(step)).to(device)
        p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        topt.step()
    torch.testing.assert_close(p.detach().cpu(), q.detach().cpu(), atol=tol(device), rtol=0)


# --------------------------------------------------------------------------- more edge cases


def test_static_and_scalar_hyperparameters_changed_mid_training(device, fp32_torch_muon):
    """Changing ns_steps (static: the transform is rebuilt) and weight_decay (a 0-d tensor) keeps
    the momentum state and follows torch.optim.Muon with the same edits."""
    torch.manual_seed(0)
    w = torch.randn(6, 5).to(device)
    p, q = nn.Parameter(w.clone()), nn.Parameter(w.clone())
    opt = mf.MuonOptimizer(
        [p], ns_dtype=torch.float32, adjust_lr_fn="original", weight_decay=0.0, **TORCH_LIKE
    )
    topt = torch.optim.Muon([q], lr=0.02, weight_decay=0.0, adjust_lr_fn="original")
    for step in range(6):
        if step == 3:
            for o in (opt, topt):
                o.param_groups[0]["ns_steps"] = 7
                o.param_groups[0]["weight_decay"] = 0.2
        g = torch.randn(6, 5, generator=torch.Generator().manual_seed(step)).to(device)
        p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        topt.step()
    torch.testing.assert_close(p.detach().cpu(), q.detach().cpu(), atol=tol(device), rtol=0)
    torch.testing.assert_close(
        opt.state[p]["momentum_buffer"].cpu(),
        topt.state[q]["momentum_buffer"].cpu(),
        atol=tol(device, "state"),
        rtol=0,
    )


def test_resume_in_the_middle_of_accumulation():
    def build(m):
        return mf.MuonOptimizer(m.parameters(), gradient_accumulation_steps=2)

    full = make_gpt()
    opt = build(full)
    _train(full, opt, 6)
    a = make_gpt()
    opt_a = build(a)
    _train(a, opt_a, 3)  # one and a half optimizer steps
    ckpt = roundtrip({"model": a.state_dict(), "opt": opt_a.state_dict()})
    b = make_gpt(seed=9)
    b.load_state_dict(ckpt["model"])
    opt_b = build(b)
    opt_b.load_state_dict(ckpt["opt"])
    _train(b, opt_b, 3, start=3)
    assert_models_equal(full, b)


def test_accumulation_resumes_through_distributed_checkpoint():
    """With gradient accumulation the state exists from construction, so the state-initializing
    step of torch.distributed.checkpoint (zero gradients, lr = 0) never enters the window: its
    template of a fresh optimizer has the momentum to load into, and a run resumed through it at a
    window boundary continues bit for bit. A checkpoint taken inside a window carries no
    accumulated gradients there, and its load is refused, saying so."""
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    def build(m):
        return mf.MuonOptimizer(m.named_parameters(), gradient_accumulation_steps=2, compile=False)

    full = make_gpt()
    _train(full, build(full), 6)
    a = make_gpt()
    opt_a = build(a)
    assert sorted(get_optimizer_state_dict(a, opt_a)["state"]["blocks.0.qkv.weight"]) == [
        "momentum_buffer"
    ]
    assert opt_a.param_groups[0]["micro_step"] == 0
    _train(a, opt_a, 4)  # two optimizer steps
    saved = copy.deepcopy(get_optimizer_state_dict(a, opt_a))
    b = make_gpt(seed=9)
    b.load_state_dict(a.state_dict())
    opt_b = build(b)
    template = get_optimizer_state_dict(b, opt_b)  # what dcp.load fills in
    assert (
        b.blocks[0].qkv.weight.equal(a.blocks[0].qkv.weight)
        and opt_b.param_groups[0]["micro_step"] == 0
    )
    assert sorted(template["state"]) == sorted(saved["state"])
    set_optimizer_state_dict(b, opt_b, saved)
    _train(b, opt_b, 2, start=4)
    assert_models_equal(full, b)
    _train(a, opt_a, 1, start=4)  # inside the next window
    mid = get_optimizer_state_dict(a, opt_a)
    for st in mid["state"].values():
        st.pop("grad_accumulator", None)  # what a fresh optimizer's template would load
    with pytest.raises(
        ValueError,
        match=r"inside a gradient accumulation window \(micro_step 1 of 2\) but the "
        r"state_dict holds no 'grad_accumulator'",
    ):
        set_optimizer_state_dict(b, opt_b, mid)


@pytest.mark.slow
def test_nonfinite_skip_compiled(device):
    model = make_gpt(device=device)
    opt = mf.MuonOptimizer(model.parameters(), nonfinite="skip", compile={"backend": "eager"})
    _train(model, opt, 1)
    before, st = snapshot_params(model), snapshot_state(opt)
    opt.zero_grad()
    backward(model, 4)
    model.blocks[1].qkv.weight.grad[2, 3] = float("nan")
    opt.step()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert_states_equal(snapshot_state(opt), st)
    assert opt.nonfinite_steps == 1


def test_nonfinite_error_under_accumulation_refuses_the_micro_batch():
    """Under "error" a micro-batch with a non-finite gradient raises at once, naming the
    parameter, and is never accumulated: the window goes on as if the call had not happened, and
    the optimizer is not stuck (it used to accumulate the NaN and raise at every later step)."""

    def run(batches):
        torch.manual_seed(0)
        lin = nn.Linear(4, 3)
        opt = mf.MuonOptimizer(
            lin.named_parameters(), gradient_accumulation_steps=3, nonfinite="error", compile=False
        )
        for w, b in batches:
            lin.weight.grad, lin.bias.grad = w, b
            try:
                opt.step()
            except RuntimeError as e:  # a middle micro-batch, then the window's last
                assert "in 'weight'" in str(e), e
                step = opt.param_groups[0]["micro_step"]
                assert step in (1, 2) and ("not accumulated" in str(e)) == (step == 1), (step, e)
                assert torch.equal(
                    opt.state[lin.weight]["grad_accumulator"], torch.full((3, 4), 0.5 * step)
                )
        return [p.detach().clone() for p in lin.parameters()], opt

    good = [(torch.full((3, 4), 0.5), torch.ones(3))] * 3
    bad = (torch.full((3, 4), float("inf")), torch.ones(3))
    with_bad, opt = run([good[0], bad, good[1], bad, good[2]])
    without, _ = run(good)
    assert all(torch.equal(a, b) for a, b in zip(with_bad, without))
    assert opt.nonfinite_steps == 2 and opt.param_groups[0]["micro_step"] == 0


@pytest.mark.slow
def test_auto_group_scheduler_no_recompile_and_adamw_follows():
    """A mixed "auto" group (Muon + AdamW halves, derived AdamW lr) under StepLR: no recompiles
    (one graph per bucket: the 8×8 and 2×8 matrices, the three 8-vectors, the 2-vector)."""
    cnt = CompileCounterWithBackend("eager")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    ref_bias = model[2].bias.detach().clone().requires_grad_()
    opt = mf.MuonOptimizer(
        model.parameters(), adamw_lr=1e-2, adamw_betas=(0.9, 0.999), compile={"backend": cnt}
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    topt = torch.optim.AdamW([ref_bias], lr=1e-2, betas=(0.9, 0.999), weight_decay=0.0)
    tsched = torch.optim.lr_scheduler.StepLR(topt, step_size=2, gamma=0.5)
    for step in range(6):
        opt.zero_grad()
        model(
            torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        ).square().sum().backward()
        ref_bias.grad = model[2].bias.grad.clone()
        opt.step()
        topt.step()
        sched.step()
        tsched.step()
    assert cnt.frame_count == graph_count(model.parameters()) == 4, cnt.frame_count
    assert opt.param_groups[0]["lr"] == pytest.approx(0.02 * 0.125)
    torch.testing.assert_close(model[2].bias.detach(), ref_bias.detach(), atol=1e-6, rtol=0)


@pytest.mark.slow
def test_compiled_matches_eager_and_survives_load_without_recompiling():
    cnt = CompileCounterWithBackend("eager")
    torch.manual_seed(0)
    m1 = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    m2 = copy.deepcopy(m1)
    eager = mf.MuonOptimizer(m1.parameters(), weight_decay=0.1, beta2=0.9)
    compiled = mf.MuonOptimizer(
        m2.parameters(), weight_decay=0.1, beta2=0.9, compile={"backend": cnt}
    )

    def run(model, opt, steps, start):
        for step in range(start, start + steps):
            opt.zero_grad()
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            model(x).square().mean().backward()
            opt.step()

    run(m1, eager, 3, 0)
    run(m2, compiled, 3, 0)
    compiled.load_state_dict(roundtrip(compiled.state_dict()))  # fresh state tensors, same layout
    run(m1, eager, 3, 3)
    run(m2, compiled, 3, 3)
    assert cnt.frame_count == graph_count(m2.parameters()), cnt.frame_count
    for p, q in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)


# --------------------------------------------------------------------------- copies
@pytest.mark.parametrize(
    "make",
    [
        lambda m: mf.MuonOptimizer(m.parameters(), weight_decay=0.01, nonfinite="error"),
        lambda m: mf.MuonOptimizer(m.parameters(), beta2=0.95, compile={"backend": "eager"}),
        lambda m: mf.create_hybrid_optimizer(m),
        lambda m: mf.SpectralSphereOptimizer(m.parameters()),
    ],
    ids=["muon", "normuon-compiled", "hybrid", "sso"],
)
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copied_optimizer_steps_like_the_original(make, how):
    """copy.deepcopy / pickle (EMA and SWA helpers, Lightning, evaluation copies): the copy carries
    the configuration (not only torch's defaults/state/param_groups) and steps identically."""
    import pickle

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 3))
    opt = make(model)
    for step in range(2):
        opt.zero_grad()
        model(
            torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        ).square().mean().backward()
        opt.step()
    clone = copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))
    assert clone.nonfinite == opt.nonfinite and clone._bucket_size == opt._bucket_size
    params = [p for g in clone.param_groups for p in g["params"]]
    originals = [p for g in opt.param_groups for p in g["params"]]
    assert len(params) == len(originals) == len(list(model.parameters()))
    for p, q in zip(params, originals):
        assert torch.equal(p, q) and p is not q
        p.grad = torch.full_like(p, 0.1)
        q.grad = torch.full_like(q, 0.1)
    clone.step()
    opt.step()
    for p, q in zip(params, originals):
        assert torch.equal(p, q)
    if hasattr(opt, "split"):
        assert str(clone.split) == str(opt.split)
