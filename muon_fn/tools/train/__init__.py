"""The demo trainer: the model, corpus and training loop behind ``muon-fn train`` and ``examples/``.

A tool, not part of the library's API (names may change); like every tool it uses muon_fn through
its public API only. ``examples/train_gpt.py`` is the readable entry.
"""

from .args import UsageError, build_parser
from .data import Corpus, load_corpus
from .model import GPT, PRESETS, GPTConfig, config_for
from .train import main

__all__ = ["GPT", "GPTConfig", "PRESETS", "config_for", "Corpus", "load_corpus", "build_parser", "main", "UsageError"]
