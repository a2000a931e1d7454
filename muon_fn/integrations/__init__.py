"""Callbacks and hooks for training frameworks (Lightning, Hugging Face, torchtitan), one module
per framework; they import muon_fn's public names only, and their framework when imported.

Callbacks that log ``optimizer.metrics()``:

- :mod:`muon_fn.integrations.lightning`: ``MuonMetricsCallback``, a ``lightning.pytorch.Callback``
  (extra ``lightning``);
- :mod:`muon_fn.integrations.hf`: ``MuonMetricsCallback``, a ``transformers.TrainerCallback``
  (extra ``hf``).

A loop of one's own reads the same figures with :class:`MetricsReader` (each measured step's
``optimizer.metrics()`` once, filtered by name). Importing this package (or ``muon_fn``) imports
neither framework; each module imports its own
when imported, and its callback raises ``ImportError`` naming the extra when the framework is
missing.
"""

from ._common import Reader as MetricsReader

__all__ = ["MetricsReader"]
