"""The engine's interface under its earlier name: :mod:`muon_fn.engine`, re-exported."""

from ..engine import *  # noqa: F403  the package's __all__
from ..engine import __all__  # noqa: F401
