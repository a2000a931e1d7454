"""muon_fn's one logger, ``logging.getLogger("muon_fn")``, and :func:`notice` for the few lines it
prints by itself (the first compile).

A notice goes to that logger at INFO where logging is configured (a handler on it or on the root:
the application decides what shows); where it is not, to stderr as one ``muon_fn: ...`` line,
unless the logger's level was raised above INFO. Silence them the usual way:
``logging.getLogger("muon_fn").setLevel(logging.WARNING)``.
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("muon_fn")


def notice(message: str) -> None:
    """Tell the user ``message`` (one line) through the ``muon_fn`` logger, see the module doc."""
    if logger.disabled:
        return
    if logger.hasHandlers():
        logger.info(message)
    elif logger.level <= logging.INFO:  # NOTSET unless the user set it
        print(f"muon_fn: {message}", file=sys.stderr, flush=True)
