"""METAOPT_DUMP=dir: write the program after every pass, in the golden text format.

Passes never read the environment; the drivers that run them (import, the
optimizers' minimize, the training driver passes/driver.py) call `dump` after each step. Files
are numbered in the order they are written in this process:
``dir/000_<program>_<step>.txt``.
"""

from __future__ import annotations

import itertools
import os
import re

from metaopt.atomic import atomic_write
from metaopt.ir import Program

ENV = "METAOPT_DUMP"
_COUNTER = itertools.count()


def dump(program: Program, step: str) -> str | None:
    """Write `program` as it is after `step` when METAOPT_DUMP is set; returns the path."""
    folder = os.environ.get(ENV)
    if not folder:
        return None
    os.makedirs(folder, exist_ok=True)
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{program.name}_{step}")
    path = os.path.join(folder, f"{next(_COUNTER):03d}_{safe}.txt")
    return atomic_write(path, lambda f: f.write(str(program)), binary=False)
