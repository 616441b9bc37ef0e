"""Writing safetensors files one tensor at a time.

A safetensors file is an 8-byte little-endian header length, a JSON header (each tensor's dtype,
shape and byte range; ``__metadata__``), then the tensors' bytes in that order. The header needs
only dtypes and shapes, which a program knows before any value exists, so the file can be
written as each tensor arrives: ``safetensors.torch.save_file`` would need every tensor of a
shard in memory at once (a Hugging Face shard is up to 5 GB), here a writer holds one tensor.
Files are written under a temporary name and renamed when complete (a killed save leaves no
file a loader would take for a whole one).
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Sequence
from pathlib import Path

import torch

DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class Writer:
    """One safetensors file whose tensors (name, dtype, shape, in order) are known up front;
    `write` them in that order, then `close` (atomic: the file appears whole or not at all)."""

    def __init__(
        self,
        path: str | os.PathLike,
        tensors: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
        metadata: dict[str, str] | None = None,
    ) -> None:
        self.path = Path(os.fspath(path))
        self._order = [name for name, _, _ in tensors]
        self._spec = {name: (dtype, tuple(shape)) for name, dtype, shape in tensors}
        header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
        at = 0
        for name, dtype, shape in tensors:
            if dtype not in DTYPES:
                raise NotImplementedError(
                    f"safetensors output of {name!r}: dtype {dtype} has no safetensors name"
                )
            n = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [at, at + n]}
            at += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self._tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        self._f = open(self._tmp, "wb")  # noqa: SIM115 - closed by close() or abort()
        self._f.write(struct.pack("<Q", len(raw)) + raw)
        self._next = 0

    def write(self, name: str, t: torch.Tensor) -> None:
        want = self._order[self._next] if self._next < len(self._order) else None
        if name != want:
            raise ValueError(f"{self.path}: {name!r} written where {want!r} comes next")
        dtype, shape = self._spec[name]
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise ValueError(
                f"{self.path}: {name!r} is {t.dtype} {list(t.shape)}, declared {dtype} {list(shape)}"
            )
        data = t.detach().to("cpu").contiguous()
        self._f.write(data.view(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b"")
        self._next += 1

    def close(self) -> None:
        if self._next != len(self._order):
            raise ValueError(f"{self.path}: {len(self._order) - self._next} declared tensor(s) never written")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        self._f.close()
        self._tmp.unlink(missing_ok=True)
