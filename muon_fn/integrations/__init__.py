"""Callbacks that log ``optimizer.metrics()`` in training frameworks, one module per framework:

- :mod:`muon_fn.integrations.lightning`: ``MuonMetricsCallback``, a ``lightning.pytorch.Callback``
  (extra ``lightning``);
- :mod:`muon_fn.integrations.hf`: ``MuonMetricsCallback``, a ``transformers.TrainerCallback``
  (extra ``hf``).

Importing this package (or ``muon_fn``) imports neither framework; each module imports its own
when imported, and its callback raises ``ImportError`` naming the extra when the framework is
missing.
"""
