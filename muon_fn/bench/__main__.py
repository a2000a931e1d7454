"""``python -m muon_fn.bench [muon|sso|fsdp] ...``: the same as ``muon-fn bench``."""

import sys

from muon_fn.bench import main

sys.exit(main(prog="python -m muon_fn.bench"))
