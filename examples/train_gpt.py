"""Train a small byte-level GPT from scratch with muon_fn — the script behind ``muon-fn train``.

    python examples/train_gpt.py --quick                       # Muon vs AdamW, a few minutes on a CPU
    python examples/train_gpt.py --optimizer muon --steps 1000 --model small
    python examples/train_gpt.py --data my_corpus.txt --compare "muon,muon[beta2=none],adamw"  # NorMuon, Muon, AdamW
    python examples/train_gpt.py --optimizer muon --steps 200 --checkpoint-interval 50   # then --resume
    torchrun --nproc_per_node=2 examples/train_gpt.py --fsdp --steps 20                   # FSDP2, gloo on CPU

Default corpus: every ``*.py`` file of this Python's standard library (no download), byte-level,
split into train/validation by a hash of each file's path. Outputs in ``--out`` (default
``runs/train_gpt``): ``metrics.json`` (loss curves, tokens/s, settings), ``loss.png`` and a
checkpoint per optimizer (``torch.distributed.checkpoint`` under ``--fsdp``).

The pieces are importable for your own loop (private module, names may change):
``muon_fn.tools.train.model.GPT`` (the model), ``muon_fn.tools.train.data`` (corpus and batches) and
``muon_fn.tools.train.train`` (this loop: model → ``muon_fn.create_hybrid_optimizer`` → LambdaLR
warmup+cosine → forward/backward/step → validation → checkpoint).
"""

import sys
from pathlib import Path

try:
    import muon_fn  # noqa: F401
except ImportError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from muon_fn.tools.train.train import main

if __name__ == "__main__":
    sys.exit(main(prog="train_gpt.py"))
