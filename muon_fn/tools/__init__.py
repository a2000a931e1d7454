"""Tools apart from the library: the ``muon-fn`` command (cli), benchmarks, demo trainer, planner.
They use only muon_fn's public API (no ``_module``, no ``_name``); the library never imports them."""
