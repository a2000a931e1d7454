"""``python -m muon_fn <command> ...``: the ``muon-fn`` command (:mod:`muon_fn.tools.cli`), run
without the console script. An entry point, as the console script is: the library never imports it."""

import sys

from muon_fn.tools.cli import main

sys.exit(main())
