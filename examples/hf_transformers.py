"""muon_fn with the Hugging Face ``Trainer``: ``optimizer_cls_and_kwargs=(HybridFactory, kwargs)``.

The Trainer builds the optimizer through :class:`muon_fn.integrations.hf.HybridFactory`:
:func:`muon_fn.create_hybrid_optimizer` on its model, so the embeddings, the tied head and the
LayerNorms get AdamW and the hidden matrices Muon; its own scheduler (``lr_scheduler_type``)
scales each group's rate. Checkpoints are the Trainer's: ``--save-steps`` writes them under
``--out``, ``--resume`` continues from the last one (the same run, bit for bit).

A ``GPT2LMHeadModel`` built from a small ``GPT2Config`` (random init, nothing is downloaded),
trained byte-level on the Python standard library's sources. Needs the ``hf`` extra:
``pip install "muon-fn[hf]"``.

Note on GPT-2's layout: Hugging Face's GPT-2 uses ``Conv1D`` layers whose weights are stored
(in, out), transposed against ``nn.Linear``'s (out, in). Orthogonalization does not care
(msign(Gᵀ) = msign(G)ᵀ), but the "keller" scale √max(1, out/in) would read the dims swapped, so
this example uses ``adjust_lr_fn="match_rms_adamw"`` (0.2·√max(out, in), symmetric in the two
dims) with an AdamW-sized learning rate, as Moonlight does.

    python examples/hf_transformers.py                                  # 30 steps
    python examples/hf_transformers.py --steps 4 --out ck --save-steps 2
    python examples/hf_transformers.py --steps 4 --out ck --resume      # from ck's last checkpoint

``--fsdp2`` trains under FSDP2 (accelerate shards each GPT2Block after the Trainer built the
optimizer, then swaps the DTensors into it; checkpoints go through torch.distributed.checkpoint).
accelerate runs FSDP on GPUs only: ``torchrun --nproc_per_node=N examples/hf_transformers.py
--fsdp2 ...``.
"""

import argparse
import sys
import tempfile
from pathlib import Path

import torch

try:
    import muon_fn  # noqa: F401
except ImportError:  # a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from muon_fn.tools.train.data import WindowDataset, load_corpus

try:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from muon_fn.integrations.hf import HybridFactory
except ImportError as e:  # pragma: no cover - depends on the environment
    raise SystemExit(f"this example needs transformers: pip install 'muon-fn[hf]' ({e})") from e


class LMDataset(torch.utils.data.Dataset):
    """Byte windows as the dicts Trainer expects (GPT2LMHeadModel shifts the labels itself)."""

    def __init__(self, windows: WindowDataset):
        self.windows = windows

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict:
        x, y = self.windows[i]
        ids = torch.cat([x, y[-1:]])
        return {"input_ids": ids, "labels": ids}


def full(p: torch.Tensor) -> torch.Tensor:
    """A parameter whole (an FSDP2 shard gathered from every rank)."""
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach()


OPTIMIZER = {
    "muon_lr": 3e-3,
    "adamw_lr": 3e-3,
    "adamw_weight_decay": 0.0,
    "adjust_lr_fn": "match_rms_adamw",
}  # Conv1D stores (in, out); this rule is symmetric


FSDP2 = {
    "fsdp": "full_shard",
    "fsdp_config": {
        "version": 2,
        "transformer_layer_cls_to_wrap": ["GPT2Block"],
        "state_dict_type": "SHARDED_STATE_DICT",
    },
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument(
        "--out", help="where the Trainer writes its checkpoints (default: a temporary directory)"
    )
    ap.add_argument(
        "--save-steps", type=int, default=0, help="save a checkpoint every N steps (0: none)"
    )
    ap.add_argument(
        "--resume", action="store_true", help="continue from the last checkpoint in --out"
    )
    ap.add_argument("--fsdp2", action="store_true", help="FSDP2 on the GPUs (under torchrun)")
    args = ap.parse_args(argv)
    if args.resume and not args.out:
        ap.error("--resume needs --out")

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=256,
        n_positions=128,
        n_embd=64,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)  # random init from the config: no download
    corpus = load_corpus(max_bytes=1_000_000)
    train = LMDataset(WindowDataset(corpus.train, seq_len=config.n_positions - 1, n=8 * args.steps))
    with tempfile.TemporaryDirectory() as scratch:
        targs = TrainingArguments(
            output_dir=args.out or scratch,
            max_steps=args.steps,
            per_device_train_batch_size=8,
            lr_scheduler_type="cosine",
            warmup_steps=max(1, args.steps // 10),
            logging_steps=max(1, args.steps // 10),
            report_to="none",
            use_cpu=not args.fsdp2,
            dataloader_num_workers=0,
            disable_tqdm=True,
            save_strategy="steps" if args.save_steps else "no",
            save_steps=args.save_steps or 500,
            **(FSDP2 if args.fsdp2 else {}),
        )
        trainer = Trainer(
            model=model,
            args=targs,
            train_dataset=train,
            optimizer_cls_and_kwargs=(HybridFactory, OPTIMIZER),
        )
        result = trainer.train(resume_from_checkpoint=True if args.resume else None)
    print(
        trainer.optimizer.optimizer.split
    )  # wte/wpe (tied to lm_head), LayerNorms -> AdamW; Conv1D -> Muon
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print(
        f"first logged loss {losses[0]:.4f}, last {losses[-1]:.4f}; final training loss {result.training_loss:.4f}"
    )
    total = sum(full(p).double().sum().item() for p in trainer.model.parameters())
    print(f"parameters: sum {total!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
