"""How much memory an ONNX file may make `metaopt.load` allocate: the documented load limits.

A model file is small; what it *describes* can be huge. A 150-byte file can declare a
``ConstantOfShape([28000, 28000])`` that constant folding would compute at import (3 GB),
an initializer whose dims promise 10^12 elements, or a ``Range(0, 4e8)`` that makes onnx's
shape-inference data propagation build 4e8 protobuf dims. Every such size is computed from
the file's shapes and values *before* anything of that size is allocated, and checked here.

The defaults admit every model the zoo exports (the largest tensor a real checkpoint holds is
an embedding table, a few GiB at most) and refuse the decompression bombs. Raise them for
one call with ``metaopt.load(path, limits=LoadLimits(max_constant_bytes=2**31))``, or for the
process by assigning to ``metaopt.limits.LIMITS`` (or its fields).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass

GiB = 1 << 30
MiB = 1 << 20


@dataclass
class LoadLimits:
    """Upper bounds on what loading one ONNX file may allocate (bytes unless said otherwise)."""

    # One tensor stored in the file: an initializer, a tensor attribute (a Constant's value),
    # external data. Inline tensors cannot exceed protobuf's 2 GiB anyway; this bounds external
    # data (a sparse file can claim terabytes while taking no disk) and dims that promise more
    # elements than the data holds.
    max_tensor_bytes: int = 16 * GiB
    # All stored tensors together.
    max_total_bytes: int = 64 * GiB
    # One value computed at import from constants alone (constant folding): such a value does not
    # depend on any input, so a large one is the file decompressing itself. 256 MiB holds any
    # causal mask or position table a real model builds from constants (2048 x 2048 float32 is
    # 16 MiB) and refuses the 3 GB ConstantOfShape bomb.
    max_constant_bytes: int = 256 * MiB
    # Elements of rank-0/1 values that onnx's shape inference with data propagation may turn
    # into protobuf dims (about 140 bytes each, measured on onnx 1.23): above it, or when a length
    # cannot be known before propagation, shape inference runs without data propagation (the
    # load still succeeds; some dims stay symbolic).
    max_shape_data: int = 1 << 20
    # The predicted peak of a step that a tool runs on a file's behalf (`python -m metaopt
    # memory` measures by running it): a 195-byte file can describe a 7.6 GiB step (a Tile of a
    # constant), which `load` accepts (nothing is allocated at load) and running would exhaust
    # the machine. `--max-bytes` raises it on the command line.
    max_run_bytes: int = 4 * GiB

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"LoadLimits.{name} must be a non-negative int, got {value!r}")


# A measured run is refused when its predicted peak is over this fraction of `max_run_bytes`:
# the prediction counts the executor's vars, the process holds more (kernel temporaries, the
# allocator's slack): a OneHot file predicted at 3.4 GiB peaked at 4.5 GB of RSS.
RUN_MARGIN = 0.5


class RunTooLarge(RuntimeError):
    """A run refused before it starts: its predicted peak is over the limit for a run a tool
    makes on a file's behalf (not an out-of-memory: nothing was allocated)."""


# The process-wide limits `metaopt.load` uses when no `limits=` is given.
LIMITS = LoadLimits()

# `max_shape_data` of `metaopt.export`: the file is torch's export of the caller's own module, not
# one from elsewhere, so only its size bounds data propagation (~140 bytes an element: 2.3 GB at
# most). Llama-3-70B's 80 layers hold ~1.3M elements of rank-1 values (two 8192-wide norm weights
# a layer), DeepSeek-V3's 61 over 1M too: at the load default their reshapes' dims stayed
# symbolic and their attentions unfused (the planner then counted every layer's S x S scores).
EXPORT_SHAPE_DATA = 1 << 24


def how_to_raise(field: str) -> str:
    """The sentence every limit error ends with: which knob, and both ways to turn it."""
    return (
        f"if the file is trusted, raise the limit: metaopt.load(..., limits=LoadLimits({field}=...)) "
        f"or metaopt.limits.LIMITS.{field} = ..."
    )


def fmt_bytes(n: int) -> str:
    """'3.1 GiB (3136000000 bytes)': readable and exact."""
    for unit, size in (("TiB", 1 << 40), ("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit} ({n} bytes)"
    return f"{n} bytes"


_ACTIVE: contextvars.ContextVar[LoadLimits | None] = contextvars.ContextVar("load_limits", default=None)


def active() -> LoadLimits:
    """The limits of the load in progress (`metaopt.load(limits=...)`), else `LIMITS`.

    A context variable rather than a parameter threaded through every import step: the
    steps (constant folding among them) keep the `Program -> Program` signature the import
    pipeline calls them with."""
    return _ACTIVE.get() or LIMITS


@contextlib.contextmanager
def using(limits: LoadLimits | None) -> Iterator[LoadLimits]:
    """Make `limits` (None: `LIMITS`) the active ones for the block."""
    chosen = limits or LIMITS
    token = _ACTIVE.set(chosen)
    try:
        yield chosen
    finally:
        _ACTIVE.reset(token)
