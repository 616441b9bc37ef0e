"""The one place derived var names are made.

Derived names follow Fleet's spelling so goldens read like Fleet's logs, but no
code ever reads meaning back out of a name: an op's role and origin fields say
what it is. Passes call these functions and `fresh` instead of formatting names.
"""

from __future__ import annotations

from collections.abc import Container


def grad(name: str) -> str:
    """Gradient of `name` (Fleet: ``x@GRAD``)."""
    return f"{name}@GRAD"


def recompute(name: str) -> str:
    """The recomputed copy of activation `name`."""
    return f"{name}@RECOMPUTE"


def pinned(name: str) -> str:
    """Host (pinned memory) copy of an offloaded checkpoint."""
    return f"{name}@PINNED"


def fetch(name: str) -> str:
    """Device copy fetched back from the host for the backward."""
    return f"{name}@FETCH"


def merged(name: str) -> str:
    """Accumulator of `name` across micro-batches."""
    return f"{name}@MERGED"


def new_state(name: str) -> str:
    """The value that replaces persistable `name` after a step (Program.updates)."""
    return f"{name}@NEW"


def fresh(base: str, taken: Container[str]) -> str:
    """`base`, or `base_1`, `base_2`, ... : the first not in `taken`."""
    if base not in taken:
        return base
    k = 1
    while f"{base}_{k}" in taken:
        k += 1
    return f"{base}_{k}"
