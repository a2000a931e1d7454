"""muon_fn in PyTorch Lightning: return the optimizer (and a per-step scheduler) from
``configure_optimizers``, on one process, under DDP or under FSDP2.

Needs the ``lightning`` extra: ``pip install "muon-fn[lightning]"``. Lightning's gradient
clipping, accumulation and checkpointing work unchanged: the optimizer is a real
``torch.optim.Optimizer`` that never modifies ``.grad`` and has a torch-format ``state_dict``.
Under FSDP2 (Lightning's ``ModelParallelStrategy``) ``configure_model`` shards the model and
``configure_optimizers`` builds the optimizer on the sharded (DTensor) parameters: each matrix is
orthogonalized whole on one rank, and the step equals the single-process one bit for bit.

    python examples/lightning.py                     # 30 steps, one process
    python examples/lightning.py --steps 3           # a quick check
    python examples/lightning.py --strategy fsdp2 --devices 2   # FSDP2, on CPU with gloo
    python examples/lightning.py --strategy ddp --devices 2
    python examples/lightning.py --optimizer muon    # MuonOptimizer(self.parameters()), torch.optim.Muon's call

Checkpoints are Lightning's own (under FSDP2 a folder of shards per checkpoint):

    python examples/lightning.py --steps 4 --epochs 2 --ckpt-dir ckpt     # one per epoch
    python examples/lightning.py --steps 4 --epochs 2 --resume "ckpt/epoch=0-step=2.ckpt"

Each rank trains on its own slice of the data (the sampler Lightning puts in) and the gradients
are averaged, so with ``--batch-size 1`` a run on W devices ends on the parameters of one device
with ``--accumulate W``, bit for bit (under FSDP2 with ``--grad-clip 0``: clipping sums the norms
of shards there, a few ulps off). ``--save-params FILE`` writes the final parameters to compare
runs; tests/test_lightning.py does.
"""

import argparse
import math
import sys
from pathlib import Path

import torch
from torch.utils.data.distributed import DistributedSampler

try:
    import muon_fn as mf
except ImportError:  # a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import muon_fn as mf
from muon_fn.tools.train.data import WindowDataset, load_corpus
from muon_fn.tools.train.model import GPT, config_for

try:
    import lightning.pytorch as pl
except ImportError:
    try:
        import pytorch_lightning as pl
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise SystemExit(
            f"this example needs Lightning: pip install 'muon-fn[lightning]' ({e})"
        ) from e


class LitGPT(pl.LightningModule):
    def __init__(
        self, data, batch_size: int, total_steps: int, optimizer: str = "hybrid", ns_dtype=None
    ):
        super().__init__()
        self.model = GPT(config_for("tiny", n_layer=2))
        self.data, self.batch_size = data, batch_size
        self.total_steps, self.optimizer_name = total_steps, optimizer
        self.ns_dtype = ns_dtype  # the Newton–Schulz iteration's dtype (None: the default)

    def configure_model(self):
        if self.device_mesh is None:  # not under ModelParallelStrategy
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def train_dataloader(self):
        # the sampler Lightning puts in on W devices, used on one device too: rank r of W gets
        # every W-th window of one shuffled order, so W devices see the windows that one device
        # sees with --accumulate W, micro-batch r of each step on rank r
        sampler = DistributedSampler(
            self.data, self.trainer.world_size, self.trainer.global_rank, seed=0
        )
        return torch.utils.data.DataLoader(self.data, batch_size=self.batch_size, sampler=sampler)

    def training_step(self, batch, batch_idx):
        x, y = batch
        _, loss = self.model(x, y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        if self.optimizer_name == "muon":  # torch.optim.Muon's call with the class changed
            optimizer = mf.MuonOptimizer(self.parameters(), lr=0.02, ns_dtype=self.ns_dtype)
        else:
            optimizer = mf.create_hybrid_optimizer(
                self.model,
                muon_lr=0.02,
                adamw_lr=3e-3,
                adamw_weight_decay=0.0,
                ns_dtype=self.ns_dtype,
            )
        warmup = max(1, self.total_steps // 10)

        def schedule(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            return 0.5 * (
                1
                + math.cos(math.pi * min(1.0, (step - warmup) / max(1, self.total_steps - warmup)))
            )

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


def full_parameters(model: torch.nn.Module) -> dict:
    """The whole parameters on every rank (a collective under FSDP2: every rank calls it)."""
    return {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()
        for name, p in model.named_parameters()
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--epochs", type=int, default=1, help="passes over the data in --steps")
    ap.add_argument("--batch-size", type=int, default=8, help="per device")
    ap.add_argument("--accumulate", type=int, default=1, help="micro-batches per step")
    ap.add_argument("--grad-clip", type=float, default=1.0, help="gradient norm clipping (0: off)")
    ap.add_argument("--strategy", choices=["auto", "ddp", "fsdp2"], default="auto")
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--optimizer", choices=["hybrid", "muon"], default="hybrid")
    ap.add_argument(
        "--ns-dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="the Newton–Schulz iteration's dtype (auto: the optimizer's default)",
    )
    ap.add_argument("--ckpt-dir", help="save a checkpoint at the end of every epoch here")
    ap.add_argument("--resume", help="a checkpoint to continue from")
    ap.add_argument("--save-params", help="write the final full parameters here (rank 0)")
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    corpus = load_corpus(max_bytes=1_000_000)
    # one epoch is steps/epochs optimizer steps, on any number of devices
    epoch_steps = math.ceil(args.steps / args.epochs)
    windows = epoch_steps * args.batch_size * args.accumulate * args.devices
    lit = LitGPT(
        WindowDataset(corpus.train, seq_len=64, n=windows),
        args.batch_size,
        args.steps,
        args.optimizer,
        None if args.ns_dtype == "auto" else getattr(torch, args.ns_dtype),
    )
    if args.strategy == "fsdp2":  # its default mesh on one machine is all tensor-parallel: say FSDP
        strategy = pl.strategies.ModelParallelStrategy(
            data_parallel_size=args.devices, tensor_parallel_size=1
        )
    else:
        strategy = args.strategy
    # saved after each epoch's last step: a resumed run starts the next epoch (a checkpoint saved
    # by every_n_epochs, at on_train_epoch_end, resumes with a stray batch of the old epoch)
    callbacks = (
        [
            pl.callbacks.ModelCheckpoint(
                args.ckpt_dir, "{epoch}-{step}", every_n_train_steps=epoch_steps, save_top_k=-1
            )
        ]
        if args.ckpt_dir
        else []
    )
    trainer = pl.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        accumulate_grad_batches=args.accumulate,
        gradient_clip_val=args.grad_clip or None,
        use_distributed_sampler=False,  # train_dataloader brings its sampler
        callbacks=callbacks,
        enable_checkpointing=bool(args.ckpt_dir),
        logger=False,
        enable_progress_bar=False,
        log_every_n_steps=1,
    )
    trainer.fit(lit, ckpt_path=args.resume)
    params = full_parameters(lit.model)
    if trainer.is_global_zero:
        loss, total = (
            float(trainer.callback_metrics["train_loss"]),
            sum(p.double().sum() for p in params.values()),
        )
        print(
            f"trained {trainer.global_step} steps; last train_loss {loss:.4f}; parameter sum {float(total):.17g}"
        )
        if args.save_params:
            torch.save(params, args.save_params)
    return 0


if __name__ == "__main__":
    sys.exit(main())
