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

import contextlib
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from metaopt.fleet import sharded_io
from metaopt.host_memory import return_freed_host_memory
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
    with _opened(file) as f:
        return dict.fromkeys(f.keys(), file)


@contextlib.contextmanager
def _opened(file: Path, when: str = "") -> Iterator[Any]:
    """`file` opened by safetensors (its header parsed, the data mapped); a file safetensors
    refuses is a PretrainedError naming it (`when`: what the message adds, e.g. that the file
    changed after its header was checked)."""
    from safetensors import SafetensorError, safe_open

    try:
        f = safe_open(file, framework="pt")
    except Exception as e:  # safetensors raises its own errors on a bad header
        raise PretrainedError(
            f"{file} is not a readable safetensors file{when} ({type(e).__name__}: {e})"
        ) from None
    with f:
        try:
            yield f
        except SafetensorError as e:  # a read of it: a key gone, a slice out of a changed file
            raise PretrainedError(f"{file}: {e}{when}") from None


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
            target = _shard_file(folder, shard)
            if target is None:
                raise PretrainedError(
                    f"{index}: key {key!r} is in shard {shard!r}, which is not a file of {folder}"
                )
            shards[shard] = _keys_of(target)
        if key not in shards[shard]:
            raise PretrainedError(f"{index}: key {key!r} is not in its shard {shard!r}")
        out[key] = shards[shard][key]
    return out


def _shard_file(folder: Path, shard: str) -> Path | None:
    """The file an index's shard name stands for, or None where it is not the folder's own: a
    plain name (no folder, not absolute) of a file in `folder`, or, in a Hugging Face cache
    snapshot (``models--<org>--<name>/snapshots/<revision>/``), a link into that repo's
    ``blobs/``, where the cache keeps the files its snapshots link to. Nothing else outside the
    folder is read."""
    if os.path.isabs(shard) or Path(shard).name != shard:
        return None
    target = (folder / shard).resolve()
    if not target.is_file():
        return None
    if target.parent == folder:
        return target
    repo = folder.parent.parent
    hub = repo.name.startswith(("models--", "datasets--", "spaces--"))  # the hub client's repo folders
    if hub and folder.parent.name == "snapshots" and target.parent == repo / "blobs":
        return target
    return None


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
    v.split.require_model()
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


def _index(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[slice, ...]:
    """A box as an index: a tensor's, or safetensors' slice of a mapped file."""
    return tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))


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
        share = _share(program, "load_pretrained")
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
    loaded = []
    for v in want:
        key = _key(v.name, prefix)
        if key not in files:
            continue  # a buffer with a value of its own (checked above)
        # one var at a time into the scope, its file mapped only while it is read: the pages of
        # the slices read count in the process's RSS for as long as the mapping lives
        with _opened(files[key], " (it changed while loading?)") as f:
            # the file may have changed since `_check` read its header: the same check again
            # on the header this mapping holds, so a slice is never cut at a stale shape
            info = f.get_slice(key)
            problem = _disagrees(v, key, list(info.get_shape()), info.get_dtype(), program, files[key])
            if problem is not None:
                raise PretrainedError(f"load_pretrained: {problem} (the file changed while loading?)")
            loaded += _fill(exe, program, share, v, _reader(f, key))
    # each var's whole tensor or slice read went through host memory the allocator keeps: given
    # back, a ZeRO-3 worker of a 1.26B LLaMA peaked 0.28 GB lower in training
    # with glibc's defaults (2.95 -> 2.67 GB, benchmarks/bigger_model.py)
    return_freed_host_memory(sum(v.nbytes() or 0 for v in want))
    return sorted(loaded)


def _fill(exe: Any, program: Program, share: Share, v: Var, read: Any) -> list[str]:
    """Put this worker's share of `v` (from `read`, boxes of the full tensor) into `exe`'s scope,
    and of AMP's float32 master copy of it (use_pure_fp16) if the program has one."""
    value = _local(v, share, read).to(torch_dtype(v.dtype))
    sharded_io.into_scope(exe, {v.name: value})
    master = program.vars.get(names.master(v.name))
    if master is None:
        return [v.name]
    # the low-precision value widened, as master_weights makes a master from a program's own
    # value (passes/master_weights.py): a meta program and one exported with the values run alike
    if (master.split, master.zero) == (v.split, v.zero):
        widened = value.to(torch.float32)
    else:  # its own layout: its share read, then rounded as the param's value was
        widened = _local(master, share, read).to(torch_dtype(v.dtype)).to(torch.float32)
    sharded_io.into_scope(exe, {master.name: widened})
    return [v.name, master.name]


def _share(program: Program, what: str) -> Share:
    place = sharded_io.mp_place(program, what)
    zi = sharded_io.zero_index(program, what)
    return Share(place.index if place else 0, zi or 0)


# --- seeded init: the module's own initializers, one submodule at a time --------------------------


def init_from_module(
    exe: Any,
    program: Program,
    module: torch.nn.Module,
    *,
    seed: int,
    prefix: str = "",
    init: Any = None,
) -> list[str]:
    """Fill `exe`'s scope with this worker's share of every param and buffer of `program` made by
    `module`'s own initializers (Hugging Face's ``_init_weights``, else ``reset_parameters()``;
    `init(submodule)` of yours first when given), each submodule from a generator seeded by `seed`
    and its path (``metaopt.frontend.module_init``). `module` is the one `program` was exported
    from, typically built on the meta device; it is not changed. Every worker of the job calls it
    after ``minimize``: each makes only the submodules whose tensors its program holds, one at a
    time, and keeps its share, so the values are the same bitwise at every layout (one process,
    ZeRO, tensor or pipeline parallel) and no worker holds the whole model. `prefix` is what the
    program's names have before the module's. Returns the names filled here."""
    from metaopt.frontend.module_init import ModuleInitError, module_values

    want = {v.name: v for v in _wanted(program)}
    problem = None
    try:
        share = _share(program, "init_from_module")
        problem = _check_module(program, module, prefix)
    except (PretrainedError, sharded_io.CheckpointError) as e:
        problem = str(e)
    sharded_io._agree_or_raise(problem, "init_from_module", PretrainedError)

    def held(name: str) -> bool:  # a param or persistent buffer this worker's program has
        return prefix + name in want

    filled: list[str] = []
    try:
        for made in module_values(module, seed=seed, wanted=held, init=init):
            name = next((prefix + n for n in made.names if held(n)), None)
            if name is None:
                continue
            value = made.value

            def read(box: Box | None, value: torch.Tensor = value) -> torch.Tensor:
                if box is None:
                    return value
                return value[_index(*box)]

            filled += _fill(exe, program, share, want[name], read)
    except ModuleInitError as e:
        raise PretrainedError(f"init_from_module: {e}") from None
    return sorted(filled)


def _check_module(program: Program, module: torch.nn.Module, prefix: str) -> str | None:
    """A param of the program the module lacks, or has at another shape; None: none."""
    tensors = {
        **{prefix + n: t for n, t in module.named_parameters(remove_duplicate=False)},
        **{prefix + n: t for n, t in module.named_buffers(remove_duplicate=False)},
    }
    for v in _wanted(program):
        t = tensors.get(v.name)
        if t is None:
            if v.kind == "buffer" and not program.is_meta(v.name):
                continue
            hint = did_you_mean(v.name, tensors)
            return (
                f"{v.kind} {v.name!r} of program {program.name!r} is not in the module "
                f"(prefix {prefix!r}){hint}"
            )
        if list(t.shape) != list(v.full_shape or ()):
            full = list(v.full_shape or ())
            return f"{v.kind} {v.name!r} is {full} in program {program.name!r}, {list(t.shape)} in the module"
    return None


def _reader(f: Any, key: str) -> Any:
    """Boxes of the file's tensor `key`, each read from the mapped file alone."""

    def read(box: Box | None) -> torch.Tensor:
        if box is None:
            return f.get_tensor(key)
        return f.get_slice(key)[_index(*box)]

    return read


def _check(program: Program, want: list[Var], files: dict[str, Path], prefix: str, path: Any) -> str | None:
    """This worker's problem with the source, or None: a missing param (or a buffer with no value
    of its own), a shape other than the program's full shape."""
    shapes: dict[str, list[int]] = {}
    dtypes: dict[str, str] = {}
    by_file: dict[Path, list[str]] = {}
    for v in want:
        key = _key(v.name, prefix)
        if key in files:
            by_file.setdefault(files[key], []).append(key)
    for file, keys in by_file.items():
        with _opened(file, " (it changed since the keys were listed?)") as f:
            for key in keys:
                info = f.get_slice(key)
                shapes[key], dtypes[key] = list(info.get_shape()), info.get_dtype()
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
        problem = _disagrees(v, key, shapes[key], dtypes[key], program, files[key])
        if problem is not None:
            return problem
    return None


# safetensors' dtype names by kind: a float converts to another float (load_state_dict does);
# a float stored for an integer or a bool var, or the reverse, is another tensor, not a precision
_SAFETENSORS_FLOATS = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}


def _disagrees(v: Var, key: str, shape: list[int], dtype: str, program: Program, file: Path) -> str | None:
    full = list(v.full_shape or ())
    if shape != full:
        return (
            f"{v.kind} {v.name!r} is {full} in program {program.name!r} but key {key!r} is {shape} in {file}"
        )
    if (dtype in _SAFETENSORS_FLOATS) != torch_dtype(v.dtype).is_floating_point:
        return (
            f"{v.kind} {v.name!r} is {v.dtype} in program {program.name!r} but key {key!r} is {dtype} in "
            f"{file}: not a precision to convert (a float for an integer var, or the reverse)"
        )
    return None


# --- save: trained values back into a Hugging Face folder -----------------------------------------


def _put(v: Var, share: Share, local: torch.Tensor, whole: torch.Tensor) -> None:
    """Write this worker's `local` value of `v` into `whole` (the full tensor): `_local` backwards."""

    def part_box(off: tuple[int, ...], size: tuple[int, ...], t: torch.Tensor) -> None:
        at = 0
        for o, s in _in_full(v, share, off, size):
            piece = t if v.split is None else t.narrow(v.split.axis, at, s[v.split.axis])
            whole[_index(o, s)] = piece
            at += s[v.split.axis] if v.split is not None else 0

    if v.zero is None and v.split is None:
        whole.copy_(local)
    elif v.zero is None:
        part_box(*_part_boxes(v, share)[0], local)
    else:
        at, flat = 0, local.reshape(-1)
        for off, size in _part_boxes(v, share):
            n = math.prod(size)
            part_box(off, size, flat[at : at + n].view(size))
            at += n


def _layout(v: Var, share: Share) -> dict[str, Any]:
    """What another worker needs to place this worker's value of `v` (JSON)."""
    return {
        "dtype": v.dtype,
        "full": list(v.full_shape or ()),
        "local": list(v.shape or ()),
        "split": [v.split.axis, v.split.parts, list(v.split.blocks)] if v.split else None,
        "zero": [v.zero.parts, list(v.zero.full)] if v.zero else None,
        "share": [share.mp_index, share.zero_index],
    }


def _var_of(name: str, lay: dict[str, Any]) -> tuple[Var, Share]:
    from metaopt.ir import Split, ZeroShard

    split = Split(lay["split"][0], lay["split"][1], tuple(lay["split"][2])) if lay["split"] else None
    zero = ZeroShard(lay["zero"][0], tuple(lay["zero"][1])) if lay["zero"] else None
    return Var(name, lay["dtype"], tuple(lay["local"]), "param", split=split, zero=zero), Share(*lay["share"])


def _sources(name: str, holders: dict[int, dict[str, Any]]) -> list[int]:
    """The fewest workers whose values of `name` together make the whole tensor: one per distinct
    share (replicas hold equal ones: the lowest rank of each), each element from exactly one."""
    from metaopt.fleet.tiling import tiling_fault

    chosen: dict[str, int] = {}
    for r in sorted(holders):
        lay = holders[r]
        # replicas hold equal values: a worker's place counts only on the axes its value is cut on
        # (a row-parallel bias is whole on every model-parallel rank, sliced by ZeRO alone)
        mp_index, zero_index = lay["share"]
        key = json.dumps([lay["split"], lay["zero"], lay["split"] and mp_index, lay["zero"] and zero_index])
        chosen.setdefault(key, r)
    ranks = sorted(chosen.values())
    whole = next((r for r in ranks if holders[r]["split"] is None and holders[r]["zero"] is None), None)
    if whole is not None:
        return [whole]
    boxes = []
    for r in ranks:
        v, share = _var_of(name, holders[r])
        boxes += share_boxes(v, share) or []
    fault = tiling_fault(holders[ranks[0]]["full"], boxes)
    if fault is not None:
        raise PretrainedError(
            f"save_pretrained: the workers' shares of {name!r} do not make it whole: {fault}"
        )
    return ranks


def save_pretrained(
    exe: Any,
    program: Program,
    path: str | os.PathLike,
    *,
    prefix: str = "",
    config: Any = None,
    max_shard_bytes: int = 5 << 30,
) -> str:
    """Write the params and buffers of `program` (as `exe` holds them) as safetensors shards and
    their index json in the folder `path`, the layout Hugging Face's ``from_pretrained`` loads.
    Every worker of the job calls it: each tensor is put together on worker 0 from the fewest
    workers whose shares make it whole, one tensor at a time, so no worker holds more than its
    share and the largest tensor. `prefix` is taken off the program's names (the loss wrapper's
    ``m.``); `config` (a ``transformers`` config) is saved beside them. Returns the folder."""
    from metaopt.atomic import atomic_write
    from metaopt.fleet.safetensors_out import Writer

    rank = sharded_io.world()[0]
    share = _share(program, "save_pretrained")
    kept = [v for v in _wanted(program) if v.name not in program.derived]  # as a state_dict
    mine = {v.name: v for v in kept if _key(v.name, prefix) is not None}
    everyone = sharded_io._gather({n: _layout(v, share) for n, v in mine.items()}, "the params to save")
    holders: dict[str, dict[int, dict[str, Any]]] = {}
    for r, lays in enumerate(everyone):
        for name, lay in lays.items():
            holders.setdefault(name, {})[r] = lay
    names = sorted(holders)
    plan = {name: _sources(name, holders[name]) for name in names}
    folder = Path(os.fspath(path))
    shards = _shards(names, holders, prefix, max_shard_bytes)
    writers: dict[str, Writer] = {}
    try:
        if rank == 0:
            folder.mkdir(parents=True, exist_ok=True)
            for file, members in shards.items():
                specs = [
                    (
                        _key(n, prefix),
                        torch_dtype(holders[n][plan[n][0]]["dtype"]),
                        tuple(holders[n][plan[n][0]]["full"]),
                    )
                    for n in members
                ]
                writers[file] = Writer(folder / file, specs)
        for file, members in shards.items():
            for name in members:
                whole = _assemble(exe, program, name, holders[name], plan[name], mine.get(name), share, rank)
                if rank == 0:
                    writers[file].write(_key(name, prefix), whole)
        for w in writers.values():
            w.close()
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    if rank == 0:
        if len(shards) > 1:
            index = {
                "metadata": {"total_size": sum(_nbytes(holders[n][plan[n][0]]) for n in names)},
                "weight_map": {_key(n, prefix): f for f, members in shards.items() for n in members},
            }
            atomic_write(
                folder / INDEX, lambda f: json.dump(index, f, indent=2, sort_keys=True), binary=False
            )
        if config is not None:
            config.save_pretrained(folder)
    return str(folder)


def _nbytes(lay: dict[str, Any]) -> int:
    return math.prod(lay["full"]) * torch_dtype(lay["dtype"]).itemsize


def _shards(
    names: list[str], holders: dict[str, dict[int, dict[str, Any]]], prefix: str, limit: int
) -> dict[str, list[str]]:
    """Shard file -> its tensors, in name order, a new shard where the next tensor would pass
    `limit` bytes (HF's naming: model.safetensors alone, else model-0000i-of-0000n.safetensors)."""
    groups: list[list[str]] = [[]]
    total = 0
    for name in names:
        n = _nbytes(next(iter(holders[name].values())))
        if groups[-1] and total + n > limit:
            groups.append([])
            total = 0
        groups[-1].append(name)
        total += n
    if len(groups) == 1:
        return {SINGLE: groups[0]}
    k = len(groups)
    return {f"model-{i + 1:05d}-of-{k:05d}.safetensors": g for i, g in enumerate(groups)}


def _assemble(
    exe: Any,
    program: Program,
    name: str,
    holders: dict[int, dict[str, Any]],
    sources: list[int],
    v: Var | None,
    share: Share,
    rank: int,
) -> torch.Tensor | None:
    """The whole tensor `name` on worker 0 (None elsewhere): each source sends its value."""
    import torch.distributed as dist

    from metaopt.layout.groups import host_group, timeout

    if sources == [0]:  # worker 0 holds it whole, or all of it in its own shares
        return _whole_local(exe, program, name, v, share) if rank == 0 else None
    lay0 = holders[sources[0]]
    whole = torch.empty(lay0["full"], dtype=torch_dtype(lay0["dtype"])) if rank == 0 else None
    for src in sources:
        lay = holders[src]
        sv, sshare = _var_of(name, lay)
        if src == rank == 0:
            local = _held(exe, program, name)
        elif rank == 0:
            local = torch.empty(lay["local"], dtype=torch_dtype(lay["dtype"]))
            dist.irecv(local, src=src, group=host_group(dist)).wait(timeout())
        elif rank == src:
            dist.isend(_held(exe, program, name).contiguous(), dst=0, group=host_group(dist)).wait(timeout())
            continue
        else:
            continue
        if whole is not None:
            _put(sv, sshare, local, whole)
    return whole


def _held(exe: Any, program: Program, name: str) -> torch.Tensor:
    """`name`'s value as `exe` holds it, or the program's own before a first run moved it there."""
    t = exe.scope.get(name)
    if t is None:
        t = program.values.get(name)
    if t is None or t.is_meta:
        raise PretrainedError(
            f"{program.vars[name].kind} {name!r} of program {program.name!r} has no value yet: "
            "give it one first (fleet.load_pretrained, fleet.init_from_module, a run)"
        )
    return t.detach().to("cpu")


def _whole_local(exe: Any, program: Program, name: str, v: Var | None, share: Share) -> torch.Tensor:
    assert v is not None
    local = _held(exe, program, name)
    whole = torch.empty(tuple(v.full_shape or ()), dtype=local.dtype)
    _put(v, share, local, whole)
    return whole


def load_into(module: torch.nn.Module, exe: Any, program: Program, *, prefix: str = "") -> list[str]:
    """Copy the values `exe` holds of `program`'s params and buffers into `module` (its
    parameters and buffers by name, `prefix` put before the module's names), in one process.
    A var held as one worker's part (tensor parallel, ZeRO over several workers) is refused:
    save it with `fleet.save_pretrained` on every worker instead."""
    targets = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    done = []
    with torch.no_grad():
        for v in _wanted(program):
            key = _key(v.name, prefix)
            if key not in targets:
                continue
            if (v.split is not None and v.split.parts > 1) or (v.zero is not None and v.zero.parts > 1):
                raise PretrainedError(
                    f"load_into: {v.name!r} is held as this worker's part ({v.split or ''} {v.zero or ''}); "
                    "in a job of several workers use fleet.save_pretrained"
                )
            whole = _whole_local(exe, program, v.name, v, Share(0, 0))
            target = targets[key]
            if tuple(target.shape) != tuple(whole.shape):
                raise PretrainedError(
                    f"load_into: {key!r} is {list(target.shape)} in the module, "
                    f"{list(whole.shape)} in the program"
                )
            target.copy_(whole)
            done.append(key)
    return done
