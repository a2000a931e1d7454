"""The Spectral Sphere Optimizer (SSO) on a small GPT, with its per-step solver statistics.

SSO keeps every hidden weight on the spectral sphere ‖W‖₂ = R = c·√(out/in) and moves it along
the steepest spectral-norm direction tangent to that sphere: Φ = msign(M̂ + λΘ), where Θ = u₁v₁ᵀ
is W's top singular pair and λ solves ⟨Θ, Φ(λ)⟩ = 0 (arXiv:2601.08393; docs/sso.md).
``SpectralSphereOptimizer.from_model`` gives the hidden matrices SSO and embeddings, the head and
1-D parameters AdamW, like ``create_hybrid_optimizer``.

    python examples/train_sso.py             # 50 steps
    python examples/train_sso.py --steps 3   # what the tests run
"""

import argparse
import sys
from pathlib import Path

import torch

try:
    import muon_fn as mf
except ImportError:  # a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import muon_fn as mf
from muon_fn.tools.train.data import Batcher, load_corpus
from muon_fn.tools.train.model import GPT, config_for


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    model = GPT(config_for("tiny", n_layer=2))
    opt = mf.SpectralSphereOptimizer.from_model(
        model, lr=0.02, adamw_lr=3e-3, adamw_weight_decay=0.0
    )
    print(f"SSO on {len(opt.split.muon)} matrices, AdamW on {len(opt.split.adamw)} tensors")
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)

    data = load_corpus(max_bytes=1_000_000)
    batches = Batcher(data.train, batch_size=8, seq_len=64, seed=0)
    for step in range(args.steps):
        x, y = batches.next()
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        stats = opt.last_step_stats().summary()  # msign calls of the λ solver, |h(λ)|, fallbacks
        print(
            f"step {step + 1:3d}  loss {loss.item():.4f}  solver iterations mean "
            f"{stats['iterations_mean']:.1f} max {stats['iterations_max']:.0f}  "
            f"max |h(λ)| {stats['residual_max']:.1e}  fallbacks {stats['fallbacks_total']}"
        )

    # The radius: σ(W) before this step's retraction, against R = radius_scale·√(out/in).
    report = opt.last_step_stats()
    radius_scale = opt.defaults["radius_scale"]
    print("\nσ(W) vs target radius R (before the last retraction):")
    for name, sigma in zip(report.names, report.sigma.tolist()):
        w = dict(model.named_parameters())[name]
        R = radius_scale * (w.shape[0] / w.shape[1]) ** 0.5
        print(f"  {name:<28} {tuple(w.shape)!s:<12} σ {sigma:.4f}  R {R:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
