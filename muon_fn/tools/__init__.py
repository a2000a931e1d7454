"""Tools apart from the library: the ``muon-fn`` command (:mod:`.cli`), its benchmarks (:mod:`.bench`),
demo trainer (:mod:`.train`) and planner table (:mod:`.plan`).

They import only muon_fn's public API (no ``muon_fn._x`` module, no ``_name``), and nothing in the
library imports them (``tests/test_layering.py``)."""
