"""Pause Python's cyclic garbage collector while a program is built in bulk.

Loading, cloning and compiling a program allocate several container objects (an op, its
input and output lists, ...) per op, none of them garbage. CPython runs a collection every
few hundred container allocations, and every so often a full one that walks the whole
heap: for a 100k-op program those full walks took 7.5 s of a 12.7 s load and most of a
clone (`benchmarks/load_100k.py`). Mercurial pauses the collector around its bulk parsers
for the same reason (`util.nogc`). Reference counting still frees everything that is not
in a cycle; cycles made meanwhile are collected once the collector runs again.
"""

from __future__ import annotations

import functools
import gc
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ParamSpec, TypeVar

_P = ParamSpec("_P")
_R = TypeVar("_R")

# Net allocations (the youngest generation's count) above which leaving a pause collects the
# young generations at once (see gc_paused): a bulk build, not a small clone.
_BULK = 50_000

_lock = threading.Lock()
_depth = 0  # nesting of gc_paused blocks, over all threads: the outermost one restores
_was_enabled = False


@contextmanager
def gc_paused() -> Iterator[None]:
    """Within the block the collector does not run; on leaving the outermost block it is
    enabled again if it was before (a caller that disabled it keeps it disabled)."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
                if gc.get_count()[0] > _BULK:
                    # What the block made is still in the youngest generation, which the next
                    # allocation would collect anyway; collecting the two young generations now
                    # moves it to the oldest at once, sparing it a pass through the middle one
                    # (for a 100k-op plan: one traversal of ~500k objects fewer, ~0.1 s).
                    gc.collect(1)


def without_gc(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Decorator: run `fn` inside `gc_paused()`."""

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with gc_paused():
            return fn(*args, **kwargs)

    return wrapper
