"""fleet.save_persistables / fleet.load_persistables: checkpoints that resume bit for bit.

One file, ``<dirname>/persistables.pt``, written with ``torch.save`` and read with
``torch.load(..., weights_only=True)`` (no code runs when loading), holding only plain
containers::

    {"meta": {"format": "metaopt.persistables", "version": 1, "program": name,
              "torch": version, "vars": {name: {"kind", "dtype", "shape"}}},
     "tensors": {name: CPU tensor},          # every param, buffer and opt_state var
     "rng": {"cpu": torch.get_rng_state(), "cuda": [state per visible GPU],
             "streams": {name: {key: state}}}}  # sharded_io.register_rng_states

Constants are not saved (they are the program's own). Saving is atomic: the file is
written to a temp file in the same folder, synced, then ``os.replace``d over the old
one, so a crash mid-save leaves the previous checkpoint intact. Loading validates
everything before it changes anything: a var of the program missing from the file, a
shape or dtype mismatch, or (unless ``strict=False``) a var in the file the program does
not have is an error naming the var. The RNG state is restored too, so a resumed run
draws the same dropout masks as the uninterrupted one.

In a job of several workers (data parallel, pipeline) every worker calls the same two
functions with the same folder; they then write and read one sharded checkpoint on
``torch.distributed.checkpoint`` (`metaopt.fleet.sharded_io`: step-numbered folders, an
atomically replaced ``latest``, loadable into another layout). ``load_persistables`` reads
whichever of the two formats the folder holds (the newer, if both).

Tensor parallel: the file holds every var whole, so workers of a tensor-parallel job reading
it (MP=1 saved, MP=2 loading) each take their part of every split var (``Var.split``), after
checking the full shape. A one-process save of a program whose vars are split over several
workers is refused: it would hold one part.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

import torch

from metaopt.atomic import atomic_write
from metaopt.fleet import sharded_io
from metaopt.ir import Program, Var, did_you_mean, dtype_name, eval_dim
from metaopt.ops import rng_streams

logger = logging.getLogger("metaopt.fleet")

FILENAME = "persistables.pt"
FORMAT = "metaopt.persistables"
VERSION = 1
SAVED_KINDS = ("param", "buffer", "opt_state")


def _saved_vars(program: Program) -> list[Var]:
    return sharded_io.saved_vars(program)


def _dtype(t: torch.Tensor) -> str:
    try:
        return dtype_name(t.dtype)
    except KeyError:
        return str(t.dtype).removeprefix("torch.")


def save_persistables(
    exe: Any,
    dirname: str | os.PathLike,
    program: Program,
    *,
    filename: str = FILENAME,
    step: int | None = None,
    keep_last: int = 3,
) -> str:
    """Save `program`'s params, buffers and optimizer state (from ``exe.scope``, else the
    program's initial values) and the RNG state; returns the path written.

    One worker: the file ``dirname/filename``. Several workers (every one calls this): one
    sharded checkpoint ``dirname/step-N`` (N = `step`, else the program's global step), the
    newest `keep_last` kept (`metaopt.fleet.sharded_io`)."""
    if sharded_io.world()[1] > 1:
        return sharded_io.save_sharded(exe, dirname, program, step=step, keep_last=keep_last)
    dirname = os.fspath(dirname)
    _refuse_parts(program)
    tensors: dict[str, torch.Tensor] = {}
    info: dict[str, dict[str, Any]] = {}
    for v in _saved_vars(program):
        t = sharded_io.value_of(exe, program, v)
        t = sharded_io.whole_value(v, t.detach().to("cpu")).clone()
        tensors[v.name] = t
        info[v.name] = {"kind": v.kind, "dtype": _dtype(t), "shape": list(t.shape)}
    states = sharded_io.rng_states()
    rng = {
        "cpu": states["cpu"],
        "cuda": list(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() else [],
        "streams": {name: sharded_io.stream_states(states, name) for name in sharded_io._RNG_STREAMS},
    }
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "program": program.name,
        "torch": str(torch.__version__),
        "vars": info,
    }
    os.makedirs(dirname, exist_ok=True)
    path = os.path.join(dirname, filename)
    _clean_leftovers(dirname, filename)
    return atomic_write(path, lambda f: torch.save({"meta": meta, "tensors": tensors, "rng": rng}, f))


def _refuse_parts(program: Program) -> None:
    """One process cannot save a var split over several workers: it holds one part."""
    group = sharded_io.model_parallel_group(program, "save_persistables")
    if group is not None and len(group) > 1:
        raise sharded_io.CheckpointError(
            f"save_persistables: program {program.name!r} is tensor parallel over workers {list(group)} and "
            "this process is alone: call save_persistables on every worker of the tensor-parallel job"
        )
    for v in _saved_vars(program):
        if v.zero is not None and v.zero.parts > 1:
            raise sharded_io.CheckpointError(
                f"save_persistables: var {v.name!r} of program {program.name!r} is one worker's part "
                f"({v.zero}) and this process is alone: call save_persistables on every worker of the "
                "sharded job"
            )
        if v.split is not None and v.split.group != "model":
            v.split.require_model()
        if v.split is not None and v.split.parts > 1:
            raise sharded_io.CheckpointError(
                f"save_persistables: var {v.name!r} of program {program.name!r} is one of "
                f"{v.split.parts} parts ({v.split}) and this process is alone: call save_persistables on "
                "every worker of the tensor-parallel job"
            )


def _clean_leftovers(dirname: str, filename: str) -> None:
    """Temp files of saves killed before their rename (atomic_write's ``.<name>.*.tmp``)."""
    for entry in os.scandir(dirname):
        if entry.name.startswith(f".{filename}.") and entry.name.endswith(".tmp") and entry.is_file():
            try:
                os.unlink(entry.path)
            except OSError:
                pass


def _read(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"load_persistables: no checkpoint file {path} (nor a '{sharded_io.LATEST}' pointer to a "
            "sharded checkpoint beside it)"
        )
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # any unpickling failure means "not our file"
        raise ValueError(
            f"load_persistables: {path} is not a readable metaopt checkpoint ({_why(e)})"
        ) from None
    ok = (
        isinstance(obj, dict)
        and isinstance(obj.get("meta"), dict)
        and obj["meta"].get("format") == FORMAT
        and isinstance(obj.get("tensors"), dict)
        and all(isinstance(k, str) and isinstance(t, torch.Tensor) for k, t in obj["tensors"].items())
        and isinstance(obj.get("rng"), dict)
    )
    if not ok:
        raise ValueError(f"load_persistables: {path} is not a metaopt checkpoint (format {FORMAT!r})")
    version = obj["meta"].get("version")
    if not isinstance(version, int) or version > VERSION:
        raise ValueError(
            f"load_persistables: {path} has format version {version!r}; this metaopt reads <= {VERSION}"
        )
    return obj


def _why(e: Exception) -> str:
    """torch.load's reason, whole: a weights-only refusal is a page of boilerplate around one
    paragraph that says why ("Trying to load unsupported GLOBAL posix.system ..."); keep that
    paragraph and drop the boilerplate, never cut a sentence."""
    text = str(e).strip()
    if not text:
        return type(e).__name__
    if text.startswith("Weights only load failed"):
        paragraphs = [p.strip() for p in re.split(r"\n\s*\n", text)[1:]]
        # The reason may also follow "... WeightsUnpickler error:" at the end of a paragraph.
        reasons = [p.split("WeightsUnpickler error:", 1)[-1].strip() for p in paragraphs]
        reasons = [r for r in reasons if r and not r.startswith("Check the documentation")]
        if reasons:
            return "refused by torch.load(weights_only=True): " + " ".join(" ".join(reasons).split())
    return " ".join(text.split())


def _shape_ok(got: tuple[int, ...], want: tuple | None) -> bool:
    if want is None:
        return True
    if len(got) != len(want):
        return False
    for g, w in zip(got, want, strict=True):
        v = eval_dim(w, {})
        if v is not None and v != g:
            return False
    return True


def load_persistables(
    exe: Any,
    dirname: str | os.PathLike,
    program: Program,
    *,
    strict: bool = True,
    filename: str = FILENAME,
) -> list[str]:
    """Load a checkpoint of `dirname` into ``exe.scope`` (on the executor's device) and
    restore the RNG state; returns the names loaded. Validates all before changing anything.

    Reads the sharded checkpoint ``latest`` names (or `dirname` itself when it is one step
    folder) or the single file ``dirname/filename``, the newer where both exist. Several
    workers: every one calls this and takes its own vars."""
    path = os.path.join(os.fspath(dirname), filename)
    folder = sharded_io.find_checkpoint(dirname)
    if folder is not None and not (os.path.isfile(path) and _newer(path, folder)):
        return sharded_io.load_sharded(exe, folder, program, strict=strict)
    rank, size = sharded_io.world()
    if size > 1:
        # One process's file read by every worker of a job: each takes its own vars; the
        # RNG state is one process's, not restored into several.
        return _load_file(exe, path, program, strict=False, rng=False)
    return _load_file(exe, path, program, strict=strict, rng=True)


def _newer(path: str, folder: Path) -> bool:
    return os.path.getmtime(path) > os.path.getmtime(folder / sharded_io.INFO)


def _load_file(exe: Any, path: str, program: Program, *, strict: bool, rng: bool) -> list[str]:
    obj = _read(path)
    tensors: dict[str, torch.Tensor] = obj["tensors"]
    want = _saved_vars(program)
    names = {v.name for v in want}
    place = sharded_io.mp_place(program, "load_persistables")
    zi = sharded_io.zero_index(program, "load_persistables")

    missing = [v.name for v in want if v.name not in tensors]
    if missing:
        hint = did_you_mean(missing[0], [k for k in tensors if k not in names])
        more = f" (and {len(missing) - 1} more: {missing[1:6]})" if len(missing) > 1 else ""
        raise ValueError(
            f"load_persistables: {path} has no var {missing[0]!r}{hint}{more}, "
            f"which program {program.name!r} needs"
        )
    for v in want:
        t = tensors[v.name]
        shape = v.full_shape  # a split var: the whole tensor's, which the file holds
        if shape is None:
            known = exe.scope.get(v.name)
            known = known if known is not None else program.values.get(v.name)
            shape = tuple(known.shape) if known is not None else None
        if _dtype(t) != v.dtype or not _shape_ok(tuple(t.shape), shape):
            want_shape = sharded_io.describe(v) if shape is not None else f"{v.dtype} ?"
            raise ValueError(
                f"load_persistables: var {v.name!r} is {_dtype(t)} {list(t.shape)} in {path} "
                f"but {want_shape} in program {program.name!r}"
            )
    extra = [k for k in tensors if k not in names]
    if extra and strict:
        raise ValueError(
            f"load_persistables: {path} holds {len(extra)} var(s) program {program.name!r} does not have: "
            f"{extra[:10]}; pass strict=False to ignore them"
        )
    rng = obj["rng"]
    cpu_rng = rng.get("cpu")
    if not (isinstance(cpu_rng, torch.Tensor) and cpu_rng.dtype == torch.uint8):
        raise ValueError(f"load_persistables: {path} has no valid CPU RNG state")
    streams = rng.get("streams", {})
    if not isinstance(streams, dict):
        raise ValueError(f"load_persistables: {path} has RNG streams that are not a dict")
    flat = {f"stream.{n}.{k}": t for n, d in streams.items() if isinstance(d, dict) for k, t in d.items()}
    problem = sharded_io.check_rng({"cpu": cpu_rng, **flat})
    if problem:
        raise ValueError(f"load_persistables: {path}: {problem}")

    sharded_io.into_scope(exe, {v.name: _part(v, tensors[v.name], place, zi) for v in want})
    if rng:
        _restore_rng(path, obj["rng"], program)
    return [v.name for v in want]


def _part(v: Var, t: torch.Tensor, place: sharded_io.MPPlace | None, zi: int | None) -> torch.Tensor:
    """What this worker holds of `v` whose whole value is `t`."""
    if v.zero is not None:
        return sharded_io.zero_part(v, t, zi)
    if v.split is None:
        return t
    assert place is not None  # mp_place found the group of every split var
    return sharded_io.local_part(t, v.split, place.index)


def _restore_rng(path: str, rng: dict[str, Any], program: Program) -> None:
    torch.set_rng_state(rng["cpu"])
    streams = dict(rng.get("streams", {}))
    used = {op.attrs.get(rng_streams.STREAM_ATTR) for op in program.ops}
    for name, (_, set_states) in sharded_io._RNG_STREAMS.items():
        if streams.get(name):
            set_states(dict(streams[name]))
        elif name in used:  # a stream the program draws from, which the save never had
            logger.warning("load_persistables: %s has no state of RNG stream %r: left as it is", path, name)
    cuda = [s for s in rng.get("cuda", []) if isinstance(s, torch.Tensor)]
    if cuda:
        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            if n != len(cuda):
                logger.warning(
                    "load_persistables: %s has RNG states of %d GPU(s), %d visible: restoring the first %d",
                    path,
                    len(cuda),
                    n,
                    min(n, len(cuda)),
                )
            for i, state in enumerate(cuda[:n]):
                torch.cuda.set_rng_state(state, i)
        else:
            logger.warning("load_persistables: %s has CUDA RNG states but no GPU is visible", path)
