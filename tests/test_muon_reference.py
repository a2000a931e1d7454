"""The ``muon`` recipe configured like ``torch.optim.Muon`` reproduces its parameters.

torch.optim.Muon (torch 2.13, ``torch/optim/_muon.py``): EMA momentum ``buf.lerp_(g, 1 − μ)``,
Nesterov ``g.lerp(buf, μ)``, Keller's quintic (3.4445, −4.7750, 2.0315) × 5 in **bf16**,
``adjust_lr_fn`` "original" (√max(1, A/B)) or "match_rms_adamw" (0.2·√max(A, B)), and decoupled
weight decay ``p ← p(1 − lr·wd)`` with the unadjusted lr.

Two tolerances, for two different questions:

1. **bf16, as shipped** (``test_matches_torch_muon_bf16``). Both sides iterate in bf16, but they do
   not round identically: torch casts G to bf16 *before* taking its norm and divides by
   ``max(‖G‖, eps)`` computed in bf16, muon_fn takes the norm in fp32 and divides by ``‖G‖ + eps``
   before casting. Each step's msign therefore differs at bf16 rounding level (notes §4: 1–2 % in
   relative Frobenius norm; test_orthogonalize measures up to ~2.4 % for Keller's quintic on small
   matrices), and that difference is not systematic, so it does not add up linearly over steps.
   Tolerance: ‖p_mf − p_torch‖_F ≤ 0.03 · ‖p_torch − p_0‖_F (the path travelled in 20 steps) and
   max-abs ≤ 1e-2. Measured: 0.004–0.013 and 3.9e-3. A wrong scaling rule (e.g. "spectral" for a
   wide matrix) or dropping weight decay gives 0.10–0.34, far outside.
2. **fp32 parity** (``test_matches_torch_muon_fp32``). torch's module-level
   ``_zeropower_via_newtonschulz`` is monkeypatched with an fp32 twin (the same code with
   ``grad.float()`` instead of ``grad.bfloat16()``; checked to be bit-identical to torch's function
   when run in bf16). Now the only differences are ``max(‖G‖, eps)`` vs ``‖G‖ + eps`` (a relative
   1e-7/‖G‖ in the normalization) and fp32 operation order (mul_/add_ vs one fused update), i.e. a
   few ulps per step. Tolerance: 1e-5 absolute on parameters of size ~1 (measured 1.2e-6 after
   20 steps), and the momentum buffers to 1e-6. This one catches small semantic slips (momentum
   0.9 vs 0.95, weight decay with the adjusted lr, …) that bf16 noise could hide.

Every test taking ``device`` runs on each device of the lane (tests/conftest.py): the problem is
drawn on the CPU and moved, torch.optim.Muon / AdamW run on the same device, results are compared
on the CPU. The fp32 tolerances are per device (``TOL``):

- ``cpu``: the ones above (1e-5 on parameters, 1e-6 on momentum buffers).
- ``cuda``: 1e-4 on both. fp32 GEMMs on a GPU reduce in another order, and muon_fn's "batched"
  policy (stacked batches, batched GEMMs) may run other kernels than torch's one-matrix code (TF32
  stays off); the first Newton–Schulz iterations amplify that rounding near σ = 0 (slope ≈ 3.4 per
  quintic step), about 2e-5 on parameters after a few lr = 0.02 steps, and 10–20 steps add it up
  like a random walk (×√(20/3) ≈ 2.6), with a 2× margin. Buffers follow the parameters through
  the least-squares gradient (on the CPU they stay below the parameters' difference). The CPU
  lane pins the formulas at 1e-5; the CUDA lane checks the same algorithm on the device.

The bf16 band (relative 0.03 of the path travelled, max-abs 1e-2) is the same on every device: two
faithful bf16 implementations differ by 2–4e-3 after 20 steps wherever the GEMMs run (8 mantissa
bits), a wrong rule by 0.10–0.34.
"""

from __future__ import annotations

import pytest
import torch
import torch.optim._muon as torch_muon

import muon_fn as mf
from muon_fn.tools.train.optimizers import torch_zeropower

SHAPES = [(32, 16), (16, 48), (24, 24), (64, 8), (8, 64)]
STEPS = 20
# fp32 parity on parameters and momentum buffers, per device (module docstring).
TOL = {"cpu": dict(param=1e-5, buffer=1e-6), "cuda": dict(param=1e-4, buffer=1e-4)}
CPU = torch.device("cpu")


def problem(seed=0, device=CPU):
    """Parameters and a gradient function of the parameters (a least-squares loss per matrix),
    drawn on the CPU and moved to ``device``."""
    g = torch.Generator().manual_seed(seed)
    params = [(0.5 * torch.randn(s, generator=g)).to(device) for s in SHAPES]
    xs = [torch.randn(s[1], 20, generator=g).to(device) for s in SHAPES]
    ys = [torch.randn(s[0], 20, generator=g).to(device) for s in SHAPES]

    def grads(ps):
        return [(p @ x - y) @ x.T / 20 for p, x, y in zip(ps, xs, ys)]

    return params, grads


def run_torch(*, lr, weight_decay, momentum, nesterov, adjust_lr_fn, steps=STEPS, device=CPU):
    params, grads = problem(device=device)
    ps = [p.clone() for p in params]
    opt = torch.optim.Muon(
        ps,
        lr=lr,
        weight_decay=weight_decay,
        momentum=momentum,
        nesterov=nesterov,
        adjust_lr_fn=adjust_lr_fn,
    )
    for _ in range(steps):
        for p, g in zip(ps, grads(ps)):
            p.grad = g
        opt.step()
    return params, ps, [opt.state[p]["momentum_buffer"] for p in ps]


def run_muon_fn(
    *,
    lr,
    weight_decay,
    momentum,
    nesterov,
    adjust_lr_fn,
    ns_dtype,
    steps=STEPS,
    kind="ema",
    device=CPU,
):
    params, grads = problem(device=device)
    tree = {f"w{i}": p.clone() for i, p in enumerate(params)}
    tx = mf.muon(
        lr,
        momentum,
        nesterov=nesterov,
        kind=kind,
        method="quintic",
        ns_steps=5,
        ns_dtype=ns_dtype,
        adjust_lr_fn=adjust_lr_fn,
        weight_decay=weight_decay,
    )
    state = tx.init(tree)
    for _ in range(steps):
        gs = grads([tree[f"w{i}"] for i in range(len(SHAPES))])
        updates, state = tx.update({f"w{i}": g for i, g in enumerate(gs)}, state, tree)
        tree = mf.apply_updates(tree, updates)
    mu = state[0].mu
    return [tree[f"w{i}"] for i in range(len(SHAPES))], [mu[f"w{i}"] for i in range(len(SHAPES))]


def _fp32_twin(dtype):
    """torch.optim._muon._zeropower_via_newtonschulz with the bf16 cast replaced by ``dtype``
    (``muon_fn.tools.train.optimizers.torch_zeropower``, what ``torch-muon[ns_dtype=...]`` runs),
    recording the shapes it is called with."""
    calls = []
    inner = torch_zeropower(dtype)

    def zeropower(grad, ns_coefficients, ns_steps, eps):
        calls.append(tuple(grad.shape))
        return inner(grad, ns_coefficients, ns_steps, eps)

    zeropower.calls = calls
    return zeropower


def test_twin_is_faithful_in_bf16(device):
    """The twin, run in bf16, is bit-identical to torch's function on every device: the same ops
    on the same device, only the dtype differs."""
    twin = _fp32_twin(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    for shape in SHAPES:
        x = torch.randn(shape, generator=g).to(device)
        ref = torch_muon._zeropower_via_newtonschulz(x, (3.4445, -4.7750, 2.0315), 5, 1e-7)
        assert torch.equal(twin(x, (3.4445, -4.7750, 2.0315), 5, 1e-7), ref)


@pytest.mark.parametrize("adjust_lr_fn", ["keller", "original"])
def test_matches_torch_muon_bf16(device, adjust_lr_fn):
    p0, p_torch, _ = run_torch(
        lr=0.02,
        weight_decay=0.1,
        momentum=0.95,
        nesterov=True,
        adjust_lr_fn="original",
        device=device,
    )
    p_mf, _ = run_muon_fn(
        lr=0.02,
        weight_decay=0.1,
        momentum=0.95,
        nesterov=True,
        adjust_lr_fn=adjust_lr_fn,
        ns_dtype=torch.bfloat16,
        device=device,
    )
    for start, a, b in zip(p0, p_torch, p_mf):
        assert b.dtype == torch.float32 and b.shape == a.shape and b.device == a.device
        start, a, b = start.cpu(), a.cpu(), b.cpu()
        travelled = torch.linalg.matrix_norm(a - start)
        assert travelled > 0.1  # the trajectory really moved
        rel = (torch.linalg.matrix_norm(b - a) / travelled).item()
        assert rel < 0.03, (tuple(a.shape), rel)
        assert (b - a).abs().max() < 1e-2


@pytest.fixture
def torch_muon_fp32(monkeypatch):
    twin = _fp32_twin(torch.float32)
    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", twin)
    return twin


@pytest.mark.parametrize(
    ("adjust_torch", "adjust_mf"),
    [("original", "keller"), (None, "original"), ("match_rms_adamw", "match_rms_adamw")],
)
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_matches_torch_muon_fp32(
    device, torch_muon_fp32, adjust_torch, adjust_mf, nesterov, weight_decay
):
    lr, tol = 0.01 if adjust_mf == "match_rms_adamw" else 0.02, TOL[device.type]
    p0, p_torch, buf_torch = run_torch(
        lr=lr,
        weight_decay=weight_decay,
        momentum=0.95,
        nesterov=nesterov,
        adjust_lr_fn=adjust_torch,
        device=device,
    )
    assert len(torch_muon_fp32.calls) == STEPS * len(SHAPES)  # the patch was really used
    p_mf, buf_mf = run_muon_fn(
        lr=lr,
        weight_decay=weight_decay,
        momentum=0.95,
        nesterov=nesterov,
        adjust_lr_fn=adjust_mf,
        ns_dtype=torch.float32,
        device=device,
    )
    for start, a, b in zip(p0, p_torch, p_mf):
        assert torch.linalg.matrix_norm(a.cpu() - start.cpu()) > 0.1
        torch.testing.assert_close(b.cpu(), a.cpu(), atol=tol["param"], rtol=0)
    for a, b in zip(buf_torch, buf_mf):  # momentum_buffer: the EMA buffer, same convention
        torch.testing.assert_close(b.cpu(), a.cpu(), atol=tol["buffer"], rtol=0)


def test_sgd_momentum_kind_matches_torch_after_orthogonalization(device, torch_muon_fp32):
    """kind="sgd" buffers are 1/(1−μ) larger, but msign is scale-invariant: same parameters."""
    tol = TOL[device.type]
    p0, p_torch, buf_torch = run_torch(
        lr=0.02,
        weight_decay=0.1,
        momentum=0.95,
        nesterov=True,
        adjust_lr_fn="original",
        device=device,
    )
    p_mf, buf_mf = run_muon_fn(
        lr=0.02,
        weight_decay=0.1,
        momentum=0.95,
        nesterov=True,
        adjust_lr_fn="keller",
        ns_dtype=torch.float32,
        kind="sgd",
        device=device,
    )
    for a, b in zip(p_torch, p_mf):
        torch.testing.assert_close(b.cpu(), a.cpu(), atol=tol["param"], rtol=0)
    for a, b in zip(buf_torch, buf_mf):
        torch.testing.assert_close((1 - 0.95) * b.cpu(), a.cpu(), atol=tol["buffer"], rtol=1e-5)


def test_fp32_parity_detects_a_wrong_momentum(torch_muon_fp32):
    """Negative control: the fp32 comparison sees momentum 0.94 vs 0.95 (7e-5 ≫ 1e-5 after 10 steps).
    CPU only: it is the control of the CPU's tolerance; CUDA's (1e-4, ``TOL``) is wider than 7e-5."""
    _, p_torch, _ = run_torch(
        lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr_fn="original", steps=10
    )
    p_mf, _ = run_muon_fn(
        lr=0.02,
        weight_decay=0.1,
        momentum=0.94,
        nesterov=True,
        adjust_lr_fn="keller",
        ns_dtype=torch.float32,
        steps=10,
    )
    assert max((a - b).abs().max().item() for a, b in zip(p_torch, p_mf)) > 3e-5


# --------------------------------------------------------------------------- the hybrid, fp32
class _Net(torch.nn.Module):
    """Embedding → Linear (bias) → LayerNorm → Linear → head: every kind the hybrid splits."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16)
        self.fc = torch.nn.Linear(16, 48)
        self.norm = torch.nn.LayerNorm(48)
        self.proj = torch.nn.Linear(48, 16, bias=False)
        self.head = torch.nn.Linear(16, 32, bias=False)

    def forward(self, x):
        return self.head(self.proj(self.norm(torch.relu(self.fc(self.emb(x))))))


def _nets(device):
    """The reference and ours: the same ``_Net`` (seed 0) on ``device``."""
    torch.manual_seed(0)
    ref = _Net()
    ours = _Net()
    ours.load_state_dict(ref.state_dict())
    return ref.to(device), ours.to(device)


def _train(model, step_fns, steps):
    """``steps`` steps on fixed batches (drawn on the CPU, moved to the model's device); the
    parameters after each step, on the CPU."""
    g = torch.Generator().manual_seed(7)
    device = next(model.parameters()).device
    trajectory = []
    for _ in range(steps):
        x, y = torch.randint(0, 32, (8, 6), generator=g), torch.randint(0, 32, (8, 6), generator=g)
        x, y = x.to(device), y.to(device)
        model.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        for fn in step_fns:
            fn()
        trajectory.append([p.detach().cpu() for p in model.parameters()])
    return trajectory


@pytest.mark.parametrize("decay_1d", [False, True])
def test_hybrid_matches_torch_muon_and_adamw_fp32(device, torch_muon_fp32, decay_1d):
    """create_hybrid_optimizer at torch's settings (Muon wd 0.01, AdamW β = (0.9, 0.95), AdamW wd
    0.1 on ndim ≥ 2 only, or on every parameter with adamw_decay_1d) equals torch.optim.Muon on
    the same matrices plus torch.optim.AdamW with the matching decay / no-decay groups, step for
    step. Measured: max |Δ| 1.7e-6 (no decay on 1-D) and 9.5e-7 (decay on every parameter) over
    10 steps: fp32 rounding order only."""
    ref, ours = _nets(device)
    muon_params, adamw_params = mf.split_parameters(ref)
    assert [n for n, _, _ in muon_params] == ["fc.weight", "proj.weight"]
    decay = [p for _, p, _ in adamw_params if decay_1d or p.ndim >= 2]
    no_decay = [p for _, p, _ in adamw_params if not (decay_1d or p.ndim >= 2)]
    assert len(decay) == (5 if decay_1d else 2)
    torch_muon_opt = torch.optim.Muon(
        [p for _, p, _ in muon_params], lr=0.04, weight_decay=0.01, adjust_lr_fn="original"
    )
    torch_adamw = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=3e-3,
        betas=(0.9, 0.95),
    )
    opt = mf.create_hybrid_optimizer(
        ours,
        muon_lr=0.04,
        adamw_lr=3e-3,
        adamw_weight_decay=0.1,
        muon_weight_decay=0.01,
        adamw_betas=(0.9, 0.95),
        adamw_decay_1d=decay_1d,
        ns_dtype=torch.float32,
        beta2=None,
        compile=False,
    )
    expected = _train(ref, [torch_muon_opt.step, torch_adamw.step], 10)
    got = _train(ours, [opt.step], 10)
    assert len(torch_muon_fp32.calls) == 2 * 10
    start = dict(_Net().named_parameters())  # a fresh init: the run really moved every tensor
    for step, (a, b) in enumerate(zip(expected, got)):
        for name, pa, pb in zip(dict(ref.named_parameters()), a, b):
            torch.testing.assert_close(
                pb, pa, atol=TOL[device.type]["param"], rtol=0, msg=f"{name} after step {step + 1}"
            )
    for (name, _), final in zip(ref.named_parameters(), expected[-1]):
        assert not torch.equal(final, start[name].detach()), name


def test_hybrid_parity_detects_decay_on_1d(device, torch_muon_fp32):
    """Negative control: decaying 1-D parameters (the rule before adamw_decay_1d) moves the norm
    gain and biases away from torch's no-decay group by far more than the tolerance of every
    device (measured: 3.3e-3 on the norm gain after 10 steps, the decay itself:
    10 · lr · wd = 3e-3)."""
    ref, ours = _nets(device)
    muon_params, adamw_params = mf.split_parameters(ref)
    torch_muon_opt = torch.optim.Muon(
        [p for _, p, _ in muon_params], lr=0.04, adjust_lr_fn="original"
    )
    torch_adamw = torch.optim.AdamW(
        [
            {"params": [p for _, p, _ in adamw_params if p.ndim >= 2]},
            {"params": [p for _, p, _ in adamw_params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=3e-3,
        betas=(0.9, 0.95),
        weight_decay=0.1,
    )
    opt = mf.create_hybrid_optimizer(
        ours,
        muon_lr=0.04,
        adamw_lr=3e-3,
        adamw_weight_decay=0.1,
        adamw_betas=(0.9, 0.95),
        adamw_decay_1d=True,
        ns_dtype=torch.float32,
        beta2=None,
        compile=False,
    )
    a = _train(ref, [torch_muon_opt.step, torch_adamw.step], 10)[-1]
    b = _train(ours, [opt.step], 10)[-1]
    names = [n for n, _ in ref.named_parameters()]
    assert (b[names.index("norm.weight")] - a[names.index("norm.weight")]).abs().max() > 1e-3
