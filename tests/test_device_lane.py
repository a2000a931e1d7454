"""The device lane: what must hold on every device torch runs on, run on the CPU always and on CUDA
where a GPU is present (``device`` fixture, tests/conftest.py; ``.ci/gpu-lane`` runs it on a GPU).

Tolerances are per device (``TOL``), and say why:

- ``cpu``: the suites' tolerances. fp32 against torch's own fp32 formulas: 1e-6 (the same ops in
  the same order; what differs is GEMM blocking of batched against single matrices).
- ``cuda``: fp32 GEMMs on a GPU reduce in another order than the CPU reference's (TF32 stays off,
  torch's default for matmul), and the first Newton–Schulz iterations amplify rounding near
  σ = 0 (slope 3.4 per quintic step): 2e-5 on parameters after a few lr = 0.02 steps.
bf16 iterations are compared by their singular-value band, not elementwise: two faithful bf16
implementations differ by 2–4e-3 after 20 steps.
"""

from __future__ import annotations

import io

import _torch_muon
import pytest
import torch
import torch.nn as nn

import muon_fn as mf
from muon_fn.tools.train.model import GPT, GPTConfig

fp32_torch_muon = pytest.fixture(_torch_muon.fp32_torch_muon)  # torch.optim.Muon's math in fp32

TOL = {"cpu": dict(rtol=0, atol=1e-6), "cuda": dict(rtol=0, atol=2e-5)}
TAU = 5.0


def tol(device: torch.device) -> dict:
    return TOL[device.type]


class Net(nn.Module):
    """Two hidden matrices (one tall, one wide), biases, a norm, an embedding and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 24)
        self.fc1 = nn.Linear(24, 40)
        self.fc2 = nn.Linear(40, 24)
        self.norm = nn.LayerNorm(24)
        self.head = nn.Linear(24, 16, bias=False)

    def forward(self, x):
        return self.head(self.norm(self.fc2(torch.tanh(self.fc1(self.emb(x))))))


def net(device: torch.device, seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net().to(device)


def set_grads(model: nn.Module, step: int, scale: float = 1.0) -> None:
    """The same gradients on every device: drawn on the CPU, then moved."""
    g = torch.Generator().manual_seed(step)
    for p in model.parameters():
        p.grad = (scale * torch.randn(p.shape, generator=g)).to(p.device)


def run(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 3, start: int = 0) -> None:
    for step in range(start, start + steps):
        set_grads(model, step)
        opt.step()


def assert_params_close(a: nn.Module, b: nn.Module, **kw) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach().cpu(), msg=name, **kw)


def torch_reference(model: Net, lr=0.02, wd=0.01, adamw_lr=3e-3):
    """torch.optim.Muon on the hidden matrices, torch.optim.AdamW on the rest, no decay there."""
    hidden = [model.fc1.weight, model.fc2.weight]
    rest = [p for p in model.parameters() if all(p is not q for q in hidden)]
    muon = torch.optim.Muon(hidden, lr=lr, weight_decay=wd, momentum=0.95, nesterov=True)
    adamw = torch.optim.AdamW(rest, lr=adamw_lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    return muon, adamw


# ---------------------------------------------------------------------------- the math
@pytest.mark.parametrize(
    "method,band",
    [
        ("quintic", (0.6, 1.25)),
        ("polar_express", (0.75, 1.25)),
        ("aol9", (0.75, 1.25)),
        ("gram", (0.75, 1.25)),
    ],
)
def test_newton_schulz_lands_in_its_band(device, method, band):
    """The device's default iteration dtype (bf16; Gram NS: fp16 on GPUs, fp32 on the CPU) lands
    every singular value of a full-rank Gaussian in the method's band, tall, wide and batched."""
    g = torch.Generator().manual_seed(0)
    for shape in [(48, 80), (80, 48), (3, 32, 64)]:
        x = torch.randn(shape, generator=g).to(device)
        tx = mf.orthogonalize(method=method, view="experts")  # a 3-D input: a stack of matrices
        (o,), _ = tx.update((x,), tx.init((x,)))
        assert o.shape == x.shape and o.device == x.device and o.dtype == x.dtype
        s = torch.linalg.svdvals(o.double().cpu())
        assert band[0] <= s.min() and s.max() <= band[1], (shape, s.min().item(), s.max().item())
        zero = torch.zeros(shape, device=device)
        (z,), _ = tx.update((zero,), tx.init((zero,)))
        assert torch.equal(z, zero)  # zero in, zero out, never NaN


def test_functional_muon_matches_torch_muon(device, fp32_torch_muon):
    """The functional core (mf.muon, fp32 iteration) against torch.optim.Muon's formulas in fp32."""
    w = torch.randn(40, 24, generator=torch.Generator().manual_seed(1)).to(device)
    ref = nn.Parameter(w.clone())
    torch_opt = torch.optim.Muon([ref], lr=0.02, weight_decay=0.01, momentum=0.95, nesterov=True)
    tx = mf.muon(
        0.02,
        momentum=0.95,
        nesterov=True,
        weight_decay=0.01,
        method="quintic",
        ns_dtype=torch.float32,
        kind="ema",
    )
    params = (w.clone(),)
    state = tx.init(params)
    for step in range(3):
        g = torch.randn(40, 24, generator=torch.Generator().manual_seed(10 + step)).to(device)
        ref.grad = g
        torch_opt.step()
        updates, state = tx.update((g,), state, params)
        params = mf.apply_updates(params, updates)
    torch.testing.assert_close(params[0], ref.detach(), **tol(device))


# ---------------------------------------------------------------------------- the adapters
def test_muon_optimizer_matches_torch_muon_and_adamw(device, fp32_torch_muon):
    """MuonOptimizer at torch's settings (fp32 iteration, no decay on the AdamW side) against
    torch.optim.Muon + torch.optim.AdamW, step for step."""
    a, b = net(device), net(device)
    hidden = [a.fc1.weight, a.fc2.weight]
    rest = [p for p in a.parameters() if all(p is not q for q in hidden)]
    opt = mf.MuonOptimizer(
        [{"params": hidden}, {"params": rest, "use_muon": False}],
        lr=0.02,
        weight_decay=0.01,
        ns_dtype=torch.float32,
        adamw_lr=3e-3,
        adamw_betas=(0.9, 0.95),
        adamw_weight_decay=0.0,
        compile=False,
    )
    refs = torch_reference(b)
    for step in range(3):
        set_grads(a, step)
        set_grads(b, step)
        opt.step()
        for r in refs:
            r.step()
    assert_params_close(a, b, **tol(device))


def test_hybrid_split_and_step(device):
    """create_hybrid_optimizer: hidden matrices get Muon, embedding, head and 1-D params AdamW;
    its steps on the device equal its steps on the CPU."""
    results = []
    for dev in (device, torch.device("cpu")):
        model = net(dev)
        opt = mf.create_hybrid_optimizer(model, ns_dtype=torch.float32, compile=False)
        run(model, opt)
        results.append(model)
    assert_params_close(*results, **tol(device))
    opt = mf.create_hybrid_optimizer(net(device), compile=False)
    muon = {n for g in opt.param_groups if g["algorithm"] != "adamw" for n in g["param_names"]}
    assert muon == {"fc1.weight", "fc2.weight"}


@pytest.mark.parametrize("name", ["sso", "triton_muon", "triton_muon_w", "normuon"])
def test_optimizer_classes_equal_their_cpu_steps(device, name):
    """SSO, the elementwise family and NorMuon step on the device as on the CPU (fp32)."""
    build = {
        "sso": lambda m: mf.SpectralSphereOptimizer([m.fc1.weight, m.fc2.weight]),
        "triton_muon": lambda m: mf.TritonMuon(m.parameters(), weight_decay=0.01),
        "triton_muon_w": lambda m: mf.TritonMuonW(m.parameters(), weight_decay=0.01),
        "normuon": lambda m: mf.MuonOptimizer(m.parameters(), beta2=0.95, ns_dtype=torch.float32),
    }[name]
    results = []
    for dev in (device, torch.device("cpu")):
        model = net(dev)
        opt = build(model)
        run(model, opt)
        assert all(torch.isfinite(p).all() for p in model.parameters())
        results.append(model)
    kw = (
        tol(device) if name != "sso" else dict(rtol=0, atol=1e-4 if device.type == "cuda" else 1e-6)
    )
    assert_params_close(*results, **kw)  # SSO on CUDA: its bisection on λ amplifies rounding


def test_qk_clip_bounds_the_steps_own_logits(device):
    """QK-Clip's guarantee on the device: after the clip, the logits of the step's own inputs are
    ≤ τ (lr = 0, so only the clip moves the weights)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=4, n_embd=32, block_size=16)).to(device)
    with torch.no_grad():
        model.blocks[0].attn.q.weight.mul_(
            torch.tensor([100.0, 1.0, 100.0, 1.0], device=device).repeat_interleave(8)[:, None]
        )
        model.blocks[0].attn.k.weight.mul_(10.0)  # heads 0 and 2 far above τ
    opt = mf.create_hybrid_optimizer(
        model, muon_lr=0.0, adamw_lr=0.0, qk_clip=mf.QKClip(model, TAU)
    )
    tokens = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1)).to(device)
    _, loss = model(tokens, tokens)
    loss.backward()
    opt.step()
    assert (opt.qk_clip.max_logit() > 5 * TAU).item()
    with torch.no_grad():
        model(tokens)
    fresh = model.blocks[0].attn.max_logits
    assert fresh.device.type == device.type and (fresh <= TAU * (1 + 1e-5)).all(), fresh


def test_checkpoint_moves_between_devices(device):
    """A state_dict saved on the device loads on the CPU (and back) and continues as an
    uninterrupted run would."""
    model, ref = net(device), net(torch.device("cpu"))
    opt = mf.MuonOptimizer(model.parameters(), ns_dtype=torch.float32, compile=False)
    ref_opt = mf.MuonOptimizer(ref.parameters(), ns_dtype=torch.float32, compile=False)
    run(model, opt, 2)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, map_location="cpu", weights_only=True)
    cpu_model = net(torch.device("cpu"), seed=1)
    cpu_model.load_state_dict(saved["model"])
    cpu_opt = mf.MuonOptimizer(cpu_model.parameters(), ns_dtype=torch.float32, compile=False)
    cpu_opt.load_state_dict(saved["opt"])
    back = net(device, seed=2)
    back.load_state_dict(cpu_model.state_dict())
    back_opt = mf.MuonOptimizer(back.parameters(), ns_dtype=torch.float32, compile=False)
    back_opt.load_state_dict(cpu_opt.state_dict())
    assert all(
        t.device.type == device.type
        for s in back_opt.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor)
    )
    run(ref, ref_opt, 3)
    run(back, back_opt, 1, start=2)
    assert_params_close(back, ref, **tol(device))


@pytest.mark.slow
def test_compile_of_opt_step(device):
    """torch.compile(opt.step) runs the optimizer's own compiled graphs (inductor on GPUs; the
    eager backend on the CPU, where inductor is tested by the compile suite) and gives the eager
    step's results."""
    compile = True if device.type == "cuda" else {"backend": "eager"}
    a, b = net(device), net(device)
    opt_a = mf.MuonOptimizer(a.parameters(), ns_dtype=torch.float32, compile=False)
    opt_b = mf.MuonOptimizer(b.parameters(), ns_dtype=torch.float32, compile=compile)
    step_b = torch.compile(opt_b.step, backend="eager")
    for step in range(3):
        set_grads(a, step)
        set_grads(b, step)
        opt_a.step()
        step_b()
    assert_params_close(a, b, **(tol(device) if device.type == "cuda" else dict(rtol=0, atol=0)))


def test_grad_scaler_with_fp16_autocast(device):
    """torch.amp.GradScaler with fp16 autocast: scaled steps equal unscaled ones, and a step whose
    scaled gradients overflow is skipped by the scaler (parameters and state unchanged)."""
    model, ref = net(device), net(device)
    opt = mf.MuonOptimizer(model.parameters(), ns_dtype=torch.float32, compile=False)
    ref_opt = mf.MuonOptimizer(ref.parameters(), ns_dtype=torch.float32, compile=False)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**10)
    x = torch.randint(0, 16, (4, 8), generator=torch.Generator().manual_seed(0)).to(device)
    for m, o, scaled in ((model, opt, True), (ref, ref_opt, False)):
        with torch.autocast(device.type, dtype=torch.float16):
            loss = m(x).float().square().mean()
        if scaled:
            scaler.scale(loss).backward()
            scaler.unscale_(o)
            grads = [p.grad.clone() for p in m.parameters()]
            scaler.step(o)
            scaler.update()
        else:
            loss.backward()
            for g, p in zip(grads, m.parameters()):  # unscaled by the scaler, to fp16 rounding
                torch.testing.assert_close(g, p.grad, rtol=1e-2, atol=1e-5)
            o.step()
    # fp16 autocast gradients round differently scaled and unscaled; the update is scale-free
    assert_params_close(model, ref, rtol=0, atol=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    with torch.autocast(device.type, dtype=torch.float16):
        loss = model(x).float().square().mean() * 1e30  # overflows once scaled
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert scaler.get_scale() < 2.0**10


@pytest.mark.parametrize("policy", ["skip", "error"])
def test_nonfinite_gradients(device, policy):
    """A NaN gradient: "skip" leaves every parameter and state unchanged and counts the step;
    "error" raises naming the parameter. .grad is never modified."""
    model = net(device)
    opt = mf.MuonOptimizer(model.parameters(), nonfinite=policy, compile=False)
    run(model, opt, 1)
    before = [p.detach().clone() for p in model.parameters()]
    state = [
        t.clone() for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)
    ]
    set_grads(model, 5)
    model.fc1.weight.grad[0, 0] = float("nan")
    grads = [p.grad.clone() for p in model.parameters()]
    if policy == "error":
        with pytest.raises(RuntimeError, match="non-finite gradient"):
            opt.step()
    else:
        opt.step()
        assert opt.nonfinite_steps == 1
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    after = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    assert all(torch.equal(a, b) for a, b in zip(after, state))
    assert all(
        torch.equal(
            p.grad,
            g,
        )
        or (p.grad.isnan() == g.isnan()).all()
        for p, g in zip(model.parameters(), grads)
    )


# ---------------------------------------------------------------------------- GPU only
def test_cuda_graphs_capture_the_compiled_step(device):
    """compile={"mode": "reduce-overhead"}: the step is captured as CUDA graphs (no skip for its
    in-place writes), and replays give the eager step's results."""
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    from torch._dynamo.utils import counters

    counters.clear()
    a, b = net(device), net(device)
    opt_a = mf.MuonOptimizer(a.parameters(), ns_dtype=torch.float32, compile=False)
    opt_b = mf.MuonOptimizer(
        b.parameters(), ns_dtype=torch.float32, compile={"mode": "reduce-overhead"}
    )
    for step in range(5):
        for m, o in ((a, opt_a), (b, opt_b)):
            set_grads(m, step)
            o.step()
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    assert_params_close(a, b, **tol(device))


@pytest.mark.slow
def test_gpu_lane_script_keeps_to_its_budget(tmp_path):
    """``.ci/gpu-lane`` with a spent budget skips every step, names each one in OUT/summary.txt
    (to run next with MUON_FN_LANE_STEPS), exits 1 and leaves only the summary and the packed logs:
    what a GPU lease that ran out returns. On the CPU, so this runs without a GPU."""
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    env = dict(
        os.environ,
        MUON_FN_LANE_DEVICE="cpu",
        MUON_FN_LANE_BUDGET_S="1",
        MUON_FN_LANE_PACK="1",
        PYTHON=sys.executable,
    )
    done = subprocess.run(
        ["bash", str(root / ".ci" / "gpu-lane"), str(tmp_path)],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    assert summary[0].startswith("gpu-lane: CPU") and "| torch " in summary[0]
    steps = [
        "lane",
        "lane-execution",
        "bench-gpt2",
        "memory-gpt2",
        "bench-llama3-8b",
        "bench-llama3-1b",
        "bench-deepseek-moe",
        "compile-time",
        "train",
        "fsdp",
        "trainers",
        "lane-compile-cache",
        "gram-compare",
    ]
    assert [line.split(":")[0] for line in summary[1:]] == steps
    assert all("skipped" in line for line in summary[1:])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs.tar.gz", "summary.txt"]
