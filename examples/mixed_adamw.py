"""Muon for hidden matrices, AdamW for the rest — one optimizer, one state_dict.

``muon_fn.create_hybrid_optimizer`` sorts a model's parameters: hidden 2-D (and conv) weights get
Muon; embeddings, the output head (tied to an embedding, or producing the vocabulary) and 0-/1-D
parameters (biases, norm gains) get AdamW. This script builds a small GPT with a tied
embedding/head, prints the split, trains a few steps under an LR scheduler and round-trips the
checkpoint.

    python examples/mixed_adamw.py            # 20 steps
    python examples/mixed_adamw.py --steps 3  # what the tests run
"""

import argparse
import io
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
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    model = GPT(config_for("tiny", n_layer=2, tie_weights=True))

    # Muon lr 0.02 (Keller's scale: update RMS ≈ AdamW's at lr ~1e-3..3e-3);
    # AdamW for embeddings, head, norms. `verbose=True` prints the split.
    opt = mf.create_hybrid_optimizer(
        model, muon_lr=0.02, adamw_lr=3e-3, adamw_weight_decay=0.0, verbose=True
    )
    # Overrides: adamw_names=["blocks.0.attn.q.weight"] or adamw_predicate=lambda name, p: ...
    print(
        "\nparam groups:", [(g["algorithm"], len(g["params"]), g["lr"]) for g in opt.param_groups]
    )
    # Any torch scheduler works; it scales each group's lr (floats reach the update as 0-d
    # tensors, so a compiled update never recompiles).
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)

    data = load_corpus(max_bytes=1_000_000)
    batches = Batcher(data.train, batch_size=8, seq_len=64, seed=0)
    for step in range(args.steps):
        x, y = batches.next()
        _, loss = model(x, y)
        loss.backward()
        opt.step()  # never modifies .grad: clip or log gradients before or after freely
        sched.step()
        opt.zero_grad(set_to_none=True)
        print(
            f"step {step + 1:3d}  loss {loss.item():.4f}  muon lr {opt.param_groups[0]['lr']:.5f}"
            f"  adamw lr {opt.param_groups[1]['lr']:.6f}"
        )

    # One state_dict for both halves, torch's format: state[p]["momentum_buffer"] for Muon,
    # "exp_avg"/"exp_avg_sq" for AdamW, "step" for both.
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=False)
    model2 = GPT(config_for("tiny", n_layer=2, tie_weights=True))
    model2.load_state_dict(ckpt["model"])
    opt2 = mf.create_hybrid_optimizer(model2, muon_lr=0.02, adamw_lr=3e-3, adamw_weight_decay=0.0)
    opt2.load_state_dict(ckpt["optimizer"])
    q = model.blocks[0].attn.q.weight
    keys = sorted(opt.state[q])
    print(
        f"\ncheckpoint round trip OK; state keys of a Muon matrix: {keys}; "
        f"of the tied embedding/head: {sorted(opt.state[model.tok_emb.weight])}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
