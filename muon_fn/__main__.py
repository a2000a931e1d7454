"""``python -m muon_fn <command> ...``: the ``muon-fn`` command (:mod:`muon_fn.cli`)."""

import sys

from muon_fn.cli import main

sys.exit(main())
