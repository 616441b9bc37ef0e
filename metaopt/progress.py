"""Progress of the long steps (export, import, minimize) through the ``metaopt`` loggers at
INFO: quiet by default (Python logs WARNING and above), one line per step with its seconds when
a user asks, e.g. ``logging.basicConfig(level=logging.INFO)``. Exporting and minimizing BERT-base
takes ~20 s on 2 cores, and silence that long reads as a hang."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator


@contextlib.contextmanager
def timed(logger: logging.Logger, what: str) -> Iterator[None]:
    """Log ``what: N.N s`` at INFO when the block ends (also when it raises: the last line
    then says which step was running)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        logger.info("%s: %.1f s", what, time.perf_counter() - t0)
