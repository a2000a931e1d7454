"""muon_fn in PyTorch Lightning: return the optimizer (and a per-step scheduler) from
``configure_optimizers``.

Needs the ``lightning`` extra: ``pip install "muon-fn[lightning]"``. Lightning's gradient
clipping, accumulation and checkpointing work unchanged: the optimizer is a real
``torch.optim.Optimizer`` that never modifies ``.grad`` and has a torch-format ``state_dict``.

    python examples/lightning.py             # 30 steps
    python examples/lightning.py --steps 3   # what the tests run
"""

import argparse
import math
import sys
from pathlib import Path

import torch

try:
    import muon_fn as mf
except ImportError:  # a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import muon_fn as mf
from muon_fn._train.data import WindowDataset, load_corpus
from muon_fn._train.model import GPT, config_for

try:
    import lightning.pytorch as pl
except ImportError:
    try:
        import pytorch_lightning as pl
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise SystemExit(f"this example needs Lightning: pip install 'muon-fn[lightning]' ({e})")


class LitGPT(pl.LightningModule):
    def __init__(self, total_steps: int):
        super().__init__()
        self.model = GPT(config_for("tiny", n_layer=2))
        self.total_steps = total_steps

    def training_step(self, batch, batch_idx):
        x, y = batch
        _, loss = self.model(x, y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        optimizer = mf.create_hybrid_optimizer(self.model, muon_lr=0.02, adamw_lr=3e-3,
                                               adamw_weight_decay=0.0)
        warmup = max(1, self.total_steps // 10)

        def schedule(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, self.total_steps - warmup))))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    corpus = load_corpus(max_bytes=1_000_000)
    loader = torch.utils.data.DataLoader(WindowDataset(corpus.train, seq_len=64, n=8 * args.steps),
                                         batch_size=8, shuffle=True)
    lit = LitGPT(args.steps)
    trainer = pl.Trainer(max_steps=args.steps, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         gradient_clip_val=1.0, log_every_n_steps=1)
    trainer.fit(lit, loader)
    print(f"trained {trainer.global_step} steps; last train_loss {float(trainer.callback_metrics['train_loss']):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
