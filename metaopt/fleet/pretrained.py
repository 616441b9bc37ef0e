"""Pretrained values in and out of a rewritten program, each worker touching only its share.

``fleet.load_pretrained(exe, program, path, prefix="")`` fills the executor's scope from a
``.safetensors`` file or a Hugging Face folder (``model.safetensors``, or
``model.safetensors.index.json`` and its shards). Call it after ``minimize``, on every worker:
each reads, through safetensors' memory-mapped slices, only the elements its program holds (a
tensor-parallel part: the rows or columns of each block; a ZeRO slice: its flat run of the
tensor, as boxes; a pipeline stage: its stage's params), never the whole tensor unless it holds
the whole tensor. A program exported from a module on the meta device (no values) gets its
params and buffers this way; its optimizer state is made by the executor, zeros at its share.

`prefix` is what the program's names have before the file's keys (a loss-returning wrapper's
``m.``): program param ``m.transformer.wte.weight`` is the file's ``transformer.wte.weight``
under ``prefix="m."``. A param the file lacks, a key no worker's program has (``strict``) and a
shape other than the program's are errors naming them (with a did-you-mean); another dtype is
converted, as ``torch.nn.Module.load_state_dict`` does.
"""

from __future__ import annotations

import json
import math
import os
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from metaopt.fleet import sharded_io
from metaopt.ir import Program, Var, did_you_mean, names, torch_dtype

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
LOADED_KINDS = ("param", "buffer")
INDEX_MAX_BYTES = 64 << 20  # a weight map: a line per tensor


class PretrainedError(ValueError):
    """A safetensors file or folder that cannot fill the program: names the file and the key."""


# --- the source: which file holds each key ------------------------------------------------------


def _files(path: str | os.PathLike) -> dict[str, Path]:
    """key -> the safetensors file holding it, for a file, an HF folder or an index json. Shard
    names in an index must be plain files inside the folder (no ``..``, no absolute path, no
    link leading out)."""
    path = Path(os.fspath(path))
    if path.is_dir():
        if (path / INDEX).is_file():
            return _from_index(path / INDEX)
        if (path / SINGLE).is_file():
            return _keys_of(path / SINGLE)
        raise PretrainedError(f"{path} holds neither {SINGLE} nor {INDEX}")
    if path.name.endswith(".index.json"):
        return _from_index(path)
    if not path.is_file():
        raise PretrainedError(f"{path}: no such file or folder")
    return _keys_of(path)


def _keys_of(file: Path) -> dict[str, Path]:
    from safetensors import safe_open

    try:
        with safe_open(file, framework="pt") as f:
            return dict.fromkeys(f.keys(), file)
    except Exception as e:  # safetensors raises its own errors on a bad header
        raise PretrainedError(
            f"{file} is not a readable safetensors file ({type(e).__name__}: {e})"
        ) from None


def _from_index(index: Path) -> dict[str, Path]:
    folder = index.parent.resolve()
    with open(index, "rb") as f:
        raw = f.read(INDEX_MAX_BYTES + 1)
    if len(raw) > INDEX_MAX_BYTES:
        raise PretrainedError(f"{index} is larger than {INDEX_MAX_BYTES} bytes: not a weight map")
    try:
        weight_map = json.loads(raw)["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map is not an object of file names")
    except (ValueError, KeyError, TypeError) as e:
        raise PretrainedError(f"{index} is not a safetensors index ({type(e).__name__}: {e})") from None
    out: dict[str, Path] = {}
    shards: dict[str, dict[str, Path]] = {}
    for key, shard in weight_map.items():
        if shard not in shards:
            target = (folder / shard).resolve()
            if os.path.isabs(shard) or target.parent != folder or not target.is_file():
                raise PretrainedError(
                    f"{index}: key {key!r} is in shard {shard!r}, which is not a file of {folder}"
                )
            shards[shard] = _keys_of(target)
        if key not in shards[shard]:
            raise PretrainedError(f"{index}: key {key!r} is not in its shard {shard!r}")
        out[key] = shards[shard][key]
    return out


# --- what this worker holds of each var ---------------------------------------------------------


@dataclass(frozen=True)
class Share:
    """Where this worker sits: its part of split vars (tensor parallel) and of ZeRO slices."""

    mp_index: int
    zero_index: int


Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def _in_full(v: Var, share: Share, off: tuple[int, ...], size: tuple[int, ...]) -> list[Box]:
    """The boxes of the full tensor that a box of this worker's tensor-parallel part (`off`,
    `size` in the part) is made of: cut where the split's blocks end, in order along the axis."""
    if v.split is None:
        return [(off, size)]
    axis, out = v.split.axis, []
    a, length = off[axis], size[axis]
    for full_at, local_at, m in v.split.pieces(share.mp_index):
        lo, hi = max(a, local_at), min(a + length, local_at + m)
        if lo < hi:
            o, s = list(off), list(size)
            o[axis], s[axis] = full_at + lo - local_at, hi - lo
            out.append((tuple(o), tuple(s)))
    return out


def share_boxes(v: Var, share: Share) -> list[Box] | None:
    """Every box of the full tensor this worker reads for `v`; None: the whole tensor."""
    if v.zero is None and v.split is None:
        return None
    return [box for part in _part_boxes(v, share) for box in _in_full(v, share, *part)]


def _part_boxes(v: Var, share: Share) -> list[Box]:
    """This worker's elements of its tensor-parallel part (the whole tensor without one) as
    boxes of that part: the part itself, or its ZeRO run, each box a contiguous piece of it."""
    from metaopt.fleet.dcp_glue import flat_boxes

    if v.zero is None:
        part = tuple(v.split.local_shape(tuple(v.full_shape or ())))
        return [((0,) * len(part), part)]
    start, n = v.zero.piece(share.zero_index)
    return [(tuple(o), tuple(s)) for o, s, _ in flat_boxes(tuple(v.zero.full), start, start + n)]


def _local(v: Var, share: Share, read: Any) -> torch.Tensor:
    """`v`'s value on this worker, from `read(box)` (a box of the full tensor; None: all of it)."""
    if v.zero is None and v.split is None:
        return read(None)

    def part_box(off: tuple[int, ...], size: tuple[int, ...]) -> torch.Tensor:
        pieces = [read(box) for box in _in_full(v, share, off, size)]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, v.split.axis)

    if v.zero is None:
        return part_box(*_part_boxes(v, share)[0])
    out = torch.zeros(v.zero.local_numel, dtype=torch_dtype(v.dtype))
    at = 0
    for off, size in _part_boxes(v, share):  # the run in order; the last slices' padding stays 0
        n = math.prod(size)
        out[at : at + n] = part_box(off, size).reshape(-1)
        at += n
    return out


# --- load ---------------------------------------------------------------------------------------


def _wanted(program: Program) -> list[Var]:
    return [v for v in program.vars.values() if v.kind in LOADED_KINDS]


def _key(name: str, prefix: str) -> str | None:
    return name[len(prefix) :] if name.startswith(prefix) else None


def load_pretrained(
    exe: Any, program: Program, path: str | os.PathLike, *, prefix: str = "", strict: bool = True
) -> list[str]:
    """Fill `exe`'s scope with this worker's share of every param and buffer of `program` from
    the safetensors file or Hugging Face folder `path` (module doc). Every worker of the job
    calls it; returns the names loaded here. Nothing is changed unless every worker can load
    everything it needs."""
    problem = None
    files: dict[str, Path] = {}
    want = _wanted(program)
    try:
        files = _files(path)
        place = sharded_io.mp_place(program, "load_pretrained")
        zi = sharded_io.zero_index(program, "load_pretrained")
        share = Share(place.index if place else 0, zi or 0)
        problem = _check(program, want, files, prefix, path)
    except (PretrainedError, sharded_io.CheckpointError, OSError) as e:
        problem = str(e)
    sharded_io._agree_or_raise(problem, f"load_pretrained from {path}", PretrainedError)
    needed = set().union(
        *sharded_io._gather([_key(v.name, prefix) for v in want], "the keys each worker loads")
    )
    unexpected = sorted(set(files) - needed)
    if unexpected and strict:
        raise PretrainedError(
            f"load_pretrained: {path} holds {len(unexpected)} key(s) no worker's program has "
            f"(prefix {prefix!r}): {unexpected[:10]}; pass strict=False to ignore them"
        )
    from safetensors import safe_open

    loaded = []
    with ExitStack() as stack:
        opened: dict[Path, Any] = {}
        for v in want:
            key = _key(v.name, prefix)
            if key not in files:
                continue  # a buffer with a value of its own (checked above)
            if files[key] not in opened:
                opened[files[key]] = stack.enter_context(safe_open(files[key], framework="pt"))
            # one var at a time into the scope: this worker holds its share and one var's
            read = _reader(opened[files[key]], key)
            sharded_io.into_scope(exe, {v.name: _local(v, share, read).to(torch_dtype(v.dtype))})
            loaded.append(v.name)
            master = program.vars.get(names.master(v.name))
            if master is not None:  # AMP's float32 master copy of the param (use_pure_fp16), its own layout
                sharded_io.into_scope(exe, {master.name: _local(master, share, read).to(torch.float32)})
                loaded.append(master.name)
    return sorted(loaded)


def _reader(f: Any, key: str) -> Any:
    """Boxes of the file's tensor `key`, each read from the mapped file alone."""

    def read(box: Box | None) -> torch.Tensor:
        if box is None:
            return f.get_tensor(key)
        offsets, sizes = box
        return f.get_slice(key)[tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))]

    return read


def _check(program: Program, want: list[Var], files: dict[str, Path], prefix: str, path: Any) -> str | None:
    """This worker's problem with the source, or None: a missing param (or a buffer with no value
    of its own), a shape other than the program's full shape."""
    from safetensors import safe_open

    shapes: dict[str, list[int]] = {}
    by_file: dict[Path, list[str]] = {}
    for v in want:
        key = _key(v.name, prefix)
        if key in files:
            by_file.setdefault(files[key], []).append(key)
    for file, keys in by_file.items():
        with safe_open(file, framework="pt") as f:
            for key in keys:
                shapes[key] = list(f.get_slice(key).get_shape())
    for v in want:
        key = _key(v.name, prefix)
        if key not in files:
            if v.kind == "buffer" and not program.is_meta(v.name):
                continue  # e.g. a non-persistent buffer: the program's own value stands
            if key is None:
                return (
                    f"{v.kind} {v.name!r} of program {program.name!r} does not start with prefix "
                    f"{prefix!r} (what the program's names have before the file's keys)"
                )
            hint = did_you_mean(key, files)
            return f"{v.kind} {v.name!r} of program {program.name!r}: {path} has no key {key!r}{hint}"
        full = list(v.full_shape or ())
        if shapes[key] != full:
            return (
                f"{v.kind} {v.name!r} is {full} in program {program.name!r} but key {key!r} is "
                f"{shapes[key]} in {files[key]}"
            )
    return None
