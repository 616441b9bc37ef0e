"""Checkpoints of a multi-worker job on ``torch.distributed.checkpoint`` (DCP).

``fleet.save_persistables(exe, dirname, program)`` called on every worker of a job with more
than one (data parallel, pipeline, both) writes one checkpoint that every worker contributes
its own vars to, by var name and full shape, so it loads into any layout whose programs hold
the same vars: a 2-stage pipeline into one process or into 4 stages, a data-parallel job into
one process (``fleet.load_persistables``, again called on every worker of the new layout).

Layout of ``dirname``::

    latest                     "step-00000012": the newest complete checkpoint (replaced atomically)
    step-00000012/             DCP's files (.metadata, __<rank>_0.distcp) + metaopt.json
    step-00000008/             older complete checkpoints, the newest `keep_last` kept
    .step-00000016.partial/    a save in progress; a killed save's leftover, removed by the next save

A checkpoint becomes visible only when complete: every worker writes into the ``.partial``
folder, DCP writes its metadata once all data is written and synced, worker 0 then writes
``metaopt.json`` (the vars, the layout, the step), renames the folder to ``step-N`` and
replaces ``latest``. A save killed at any point leaves the previous checkpoint and ``latest``
as they were.

What is saved: every param, buffer and optimizer-state var of each worker's program (a var
several workers hold — replicas, tied params — once: they are equal), and each worker's RNG
states. A pipeline's per-step gradient accumulators are not saved: every step starts them
afresh, and another layout has other ones. RNG states are restored only into the same
number of workers (another layout draws other masks whatever is restored).

Loading reads DCP's ``.metadata`` with an unpickler that admits only DCP's own metadata
classes, and refuses storage paths outside the checkpoint folder; tensors are read with
``torch.load(weights_only=True)`` by DCP itself. Every worker validates what it needs (present,
same dtype and shape) and the workers agree before any of them changes its scope: a
problem on one worker is an error on all of them, naming the worker and the var.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_meta
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter

from metaopt.atomic import atomic_write, fsync_dir
from metaopt.ir import Program, Var, did_you_mean, dtype_name, eval_dim, names

logger = logging.getLogger("metaopt.fleet")

FORMAT = "metaopt.sharded-persistables"
VERSION = 1
LATEST = "latest"
INFO = "metaopt.json"
SAVED_KINDS = ("param", "buffer", "opt_state")
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_PARTIAL_DIR = re.compile(r"^\.step-(\d{8,})\.(partial|old)$")
_RNG = "__rng__"


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved or loaded: names the folder, the worker and the var."""


# --- which vars -------------------------------------------------------------------------------


def transient_vars(program: Program) -> set[str]:
    """A pipeline stage's gradient accumulators: reset at micro-batch 0 of every step, so
    their value between steps means nothing, and another layout has other ones."""
    if program.pipeline is None:
        return set()
    mb = names.micro_batch()
    readers = [op for op in program.ops if mb in op.inputs]
    return {x for op in readers for x in op.inputs if x in program.updates and x != mb}


def refuse_tensor_parallel(program: Program, what: str) -> None:
    """Under tensor parallel a split param holds this rank's slice under the param's own name:
    DCP would take the slices for replicas and keep one. Saving and loading them by full shape
    is issue 16's item 5; until then, refuse rather than lose a slice."""
    if any(op.attrs.get("group") == "model_parallel" for op in program.ops):
        raise NotImplementedError(
            f"{what}: program {program.name!r} is tensor parallel (it has model-parallel "
            "collectives); checkpoints of split params are not implemented yet"
        )


def saved_vars(program: Program) -> list[Var]:
    skip = transient_vars(program)
    return [v for v in program.vars.values() if v.kind in SAVED_KINDS and v.name not in skip]


def _dtype(t: torch.Tensor) -> str:
    try:
        return dtype_name(t.dtype)
    except KeyError:
        return str(t.dtype).removeprefix("torch.")


def value_of(exe: Any, program: Program, v: Var) -> torch.Tensor:
    """The value a save takes: the executor's scope, else the program's initial value."""
    t = exe.scope.get(v.name)
    if t is None:
        t = program.values.get(v.name)
    if t is None:
        raise CheckpointError(
            f"save_persistables: {v.kind} var {v.name!r} has no value in the executor's scope "
            f"or in program {program.name!r}"
        )
    return t


# --- the job ---------------------------------------------------------------------------------


def world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather(obj: Any) -> list[Any]:
    """Every worker's `obj` (small, picklable), in rank order; one worker: [obj]."""
    rank, size = world()
    if size == 1:
        return [obj]
    out: list[Any] = [None] * size
    dist.all_gather_object(out, obj)
    return out


def _agree_or_raise(problem: str | None, what: str) -> None:
    """Raise on every worker if any worker found a problem, naming each such worker, so no
    worker goes on into a collective the others will never join."""
    found = [(r, p) for r, p in enumerate(_gather(problem)) if p]
    if found and world()[1] == 1:
        raise CheckpointError(f"{what}: {found[0][1]}")
    if found:
        detail = "; ".join(f"worker {r}: {p}" for r, p in found)
        raise CheckpointError(f"{what} refused on every worker: {detail}")


def _layout(program: Program) -> dict[str, Any]:
    rank, size = world()
    pl = program.pipeline
    return {
        "world_size": size,
        "pipeline_stages": pl.num_stages if pl else 1,
        "dp_degree": pl.dp_degree if pl else size,
    }


# --- the folder --------------------------------------------------------------------------------


def _step_dir(step: int) -> str:
    return f"step-{step:08d}"


def _read_latest(root: Path) -> str | None:
    path = root / LATEST
    if not path.is_file():
        return None
    text = path.read_text(encoding="utf-8", errors="replace").strip()
    if not _STEP_DIR.match(text):
        raise CheckpointError(f"{path} does not name a checkpoint folder (step-NNNNNNNN): {text[:80]!r}")
    return text


def complete_steps(root: Path) -> list[int]:
    """Step numbers of the complete checkpoints under `root`, ascending."""
    if not root.is_dir():
        return []
    steps = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir() and not p.is_symlink() and (p / INFO).is_file():
            steps.append(int(m.group(1)))
    return sorted(steps)


def _clean_leftovers(root: Path) -> list[str]:
    """Remove what killed saves left: partial folders, and temp files of `latest`. A step
    folder set aside while the same step was saved again (``.step-N.old``) goes back in place
    if the new one never arrived."""
    removed = []
    for p in root.iterdir():
        m = _PARTIAL_DIR.match(p.name)
        if m and m.group(2) == "old" and not (root / _step_dir(int(m.group(1)))).exists():
            p.rename(root / _step_dir(int(m.group(1))))
            continue
        if m or (p.name.startswith(f".{LATEST}.") and p.name.endswith(".tmp")):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(p.name)
    if removed:
        logger.info("save_persistables: removed %d leftover(s) of killed saves in %s", len(removed), root)
    return removed


def _prune(root: Path, keep_last: int, latest: str) -> None:
    steps = complete_steps(root)
    for s in steps[: max(0, len(steps) - keep_last)]:
        if _step_dir(s) != latest:
            shutil.rmtree(root / _step_dir(s), ignore_errors=True)


# --- save --------------------------------------------------------------------------------------


def _next_step(exe: Any, program: Program, root: Path, step: int | None) -> int:
    if step is not None:
        return int(step)
    from metaopt.passes.optimize import STEP

    if STEP in program.vars:
        return int(value_of(exe, program, program.vars[STEP]))
    done = complete_steps(root)
    return done[-1] + 1 if done else 0


def save_sharded(
    exe: Any, dirname: str | os.PathLike, program: Program, *, step: int | None = None, keep_last: int = 3
) -> str:
    """Every worker calls this with the same `dirname`; returns the complete checkpoint's folder."""
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"save_persistables: keep_last must be an int >= 1, got {keep_last!r}")
    refuse_tensor_parallel(program, "save_persistables")
    rank, size = world()
    root = Path(os.fspath(dirname))
    # What this worker saves, before any collective: a worker that cannot (a var without a
    # value) must fail every worker now, not leave them waiting in DCP until the timeout.
    state: dict[str, torch.Tensor] = {}
    info: dict[str, dict[str, Any]] = {}
    mine, problem = -1, None
    try:
        mine = _next_step(exe, program, root, step)
        for v in saved_vars(program):
            t = value_of(exe, program, v).detach().to("cpu")
            state[v.name] = t
            info[v.name] = {"kind": v.kind, "dtype": _dtype(t), "shape": list(t.shape)}
    except (CheckpointError, OSError) as e:
        problem = str(e)
    _agree_or_raise(problem, f"save_persistables into {root}")
    steps = _gather(mine)
    if len(set(steps)) != 1:
        raise CheckpointError(
            f"save_persistables: the workers are at different steps {steps} (by rank): "
            "pass step=... or save from the same point of training on every worker"
        )
    name = _step_dir(steps[0])
    partial = root / f".{name}.partial"
    problem = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            _clean_leftovers(root)
            partial.mkdir()
        except OSError as e:
            problem = f"cannot prepare {partial}: {e}"
    _agree_or_raise(problem, f"save_persistables into {root}")
    for key, t in _rng_states().items():
        state[f"{_RNG}/{rank}/{key}"] = t
    with warnings.catch_warnings():  # one worker (tests, tools) saving this format is meant
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.save(state, storage_writer=FileSystemWriter(partial, sync_files=True), no_dist=size == 1)

    all_info = _gather(info)
    problem = None
    if rank == 0:
        try:
            _commit(root, partial, name, _merge_info(all_info), _layout(program), steps[0], keep_last)
        except (OSError, CheckpointError) as e:
            problem = f"cannot complete {root / name}: {e}"
    _agree_or_raise(problem, f"save_persistables into {root}")
    return str(root / name)


def _merge_info(per_rank: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    merged: dict[str, dict[str, Any]] = {}
    for r, info in enumerate(per_rank):
        for k, v in info.items():
            if k in merged and merged[k] != v:
                raise CheckpointError(f"var {k!r} differs between workers: {merged[k]} vs {v} (worker {r})")
            merged[k] = v
    return merged


def _commit(
    root: Path, partial: Path, name: str, info: dict, layout: dict, step: int, keep_last: int
) -> None:
    meta = {"format": FORMAT, "version": VERSION, "step": step, "torch": str(torch.__version__), **layout}
    meta["vars"] = info
    atomic_write(partial / INFO, lambda f: json.dump(meta, f, indent=1, sort_keys=True), binary=False)
    final = root / name
    old = root / f".{name}.old"
    if final.exists():  # saving the same step again: the new one replaces it whole
        final.rename(old)
    partial.rename(final)
    fsync_dir(str(root))
    atomic_write(root / LATEST, lambda f: f.write(name + "\n"), binary=False)
    shutil.rmtree(old, ignore_errors=True)
    _prune(root, keep_last, name)


def _rng_states() -> dict[str, torch.Tensor]:
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            states[f"cuda{i}"] = s
    return states


# --- load --------------------------------------------------------------------------------------


def find_checkpoint(dirname: str | os.PathLike) -> Path | None:
    """The folder of the newest complete checkpoint under `dirname` (its ``latest``), or
    `dirname` itself when it is one; None when there is no sharded checkpoint there."""
    root = Path(os.fspath(dirname))
    if (root / INFO).is_file():
        return root
    latest = _read_latest(root)
    if latest is None:
        return None
    folder = root / latest
    if not folder.exists() and (root / f".{latest}.old" / INFO).is_file():
        folder = root / f".{latest}.old"  # a save of the same step killed between its renames
    if not (folder / INFO).is_file():
        raise CheckpointError(f"{root / LATEST} names {latest}, which is not a complete checkpoint in {root}")
    return folder


def _read_info(folder: Path) -> dict[str, Any]:
    path = folder / INFO
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not readable: {e}") from None
    ok = (
        isinstance(meta, dict)
        and meta.get("format") == FORMAT
        and isinstance(meta.get("vars"), dict)
        and all(isinstance(i, dict) and isinstance(i.get("shape"), list) for i in meta["vars"].values())
        and isinstance(meta.get("world_size"), int)
    )
    if not ok:
        raise CheckpointError(f"{path} is not a metaopt checkpoint description (format {FORMAT!r})")
    if not isinstance(meta.get("version"), int) or meta["version"] > VERSION:
        raise CheckpointError(
            f"{path} has format version {meta.get('version')!r}; this metaopt reads <= {VERSION}"
        )
    return meta


def _shape_ok(got: list[int], want: tuple | None) -> bool:
    if want is None:
        return True
    if len(got) != len(want):
        return False
    return all(eval_dim(w, {}) in (None, g) for g, w in zip(got, want, strict=True))


def _check_vars(folder: Path, meta: dict, want: list[Var], md: dcp_meta.Metadata) -> str | None:
    """This worker's problem with the checkpoint, or None."""
    saved = meta["vars"]
    for v in want:
        if v.name not in saved or v.name not in md.state_dict_metadata:
            hint = did_you_mean(v.name, saved)
            return f"{folder} has no var {v.name!r}{hint}, which program needs"
        s = saved[v.name]
        if s.get("dtype") != v.dtype or not _shape_ok(s["shape"], v.shape):
            want_shape = list(v.shape) if v.shape is not None else "?"
            return (
                f"var {v.name!r} is {s.get('dtype')} {s['shape']} in {folder} "
                f"but {v.dtype} {want_shape} in the program"
            )
        tm = md.state_dict_metadata[v.name]
        if not isinstance(tm, dcp_meta.TensorStorageMetadata) or list(tm.size) != list(s["shape"]):
            return f"var {v.name!r}: DCP's metadata in {folder} disagrees with {INFO}"
    return None


def load_sharded(exe: Any, folder: Path, program: Program, *, strict: bool = True) -> list[str]:
    """Every worker of the new layout calls this; returns the names loaded on this worker."""
    refuse_tensor_parallel(program, "load_persistables")
    rank, size = world()
    problem, meta, md = None, None, None
    want = saved_vars(program)
    try:
        meta = _read_info(folder)
        md = SafeReader(folder).read_metadata()
        problem = _check_vars(folder, meta, want, md)
    except CheckpointError as e:
        problem = str(e)
    _agree_or_raise(problem, f"load_persistables from {folder}")
    assert meta is not None and md is not None

    needed = set().union(*_gather([v.name for v in want]))
    extra = sorted(set(meta["vars"]) - needed)
    same_layout = {k: meta.get(k) for k in _layout(program)} == _layout(program)
    if extra and strict and same_layout:
        raise CheckpointError(
            f"load_persistables: {folder} holds {len(extra)} var(s) no worker's program has: "
            f"{extra[:10]}; pass strict=False to ignore them"
        )
    if extra:
        logger.info(
            "load_persistables: %d var(s) of %s are not in this layout: %s", len(extra), folder, extra[:10]
        )

    into: dict[str, torch.Tensor] = {}
    for v in want:
        s = meta["vars"][v.name]
        into[v.name] = torch.empty(s["shape"], dtype=_torch_dtype(s["dtype"]))
    rng_keys = {k for k in md.state_dict_metadata if k.startswith(f"{_RNG}/{rank}/")}
    restore_rng = meta["world_size"] == size and f"{_RNG}/{rank}/cpu" in rng_keys
    if restore_rng:
        for k in rng_keys:
            tm = md.state_dict_metadata[k]
            into[k] = torch.empty(list(tm.size), dtype=tm.properties.dtype)
    elif rank == 0:
        logger.warning(
            "load_persistables: %s was saved by %d worker(s), this job has %d: RNG states not restored "
            "(dropout masks differ from an uninterrupted run)",
            folder,
            meta["world_size"],
            size,
        )
    with warnings.catch_warnings():  # one process loading is what we mean: DCP warns all the same
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        try:
            dcp.load(into, storage_reader=SafeReader(folder), no_dist=size == 1)
        except (Exception, CheckpointException) as e:  # damaged data: nothing was changed yet
            raise CheckpointError(f"load_persistables: reading {folder} failed: {_short(e)}") from e
    into_scope(exe, {v.name: into[v.name] for v in want})
    if restore_rng:
        _set_rng({k.rsplit("/", 1)[1]: into[k] for k in rng_keys})
    return [v.name for v in want]


def _short(e: BaseException) -> str:
    """One line per failure; DCP's own exception wraps each worker's with its traceback."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        # each failure is (exception, its traceback's frames)
        return "; ".join(
            f"worker {r}: {_short(f[0] if isinstance(f, tuple) else f)}" for r, f in sorted(failures.items())
        )
    first = next((line for line in str(e).splitlines() if line.strip()), "")
    return f"{type(e).__name__}: {first.strip()[:300]}" if first else f"{type(e).__name__} (data cut short?)"


def _torch_dtype(name: str) -> torch.dtype:
    from metaopt.ir import torch_dtype

    return torch_dtype(name)


def into_scope(exe: Any, tensors: dict[str, torch.Tensor]) -> None:
    tracker = getattr(exe, "_tracker", None) if getattr(exe, "track_memory", False) else None
    for name, t in tensors.items():
        old = exe.scope.get(name)
        if old is not None and old.shape == t.shape and old.dtype == t.dtype and old.device == exe.device:
            with torch.no_grad():
                old.copy_(t)  # in place: plans and memory accounting keep their tensor
            continue
        new = t.to(exe.device, copy=True)
        if tracker is not None:
            if old is not None and old.untyped_storage().data_ptr() in tracker.refs:
                tracker.release(old)
            tracker.acquire(new)
        exe.scope[name] = new


def _set_rng(states: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(states["cpu"])
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            if f"cuda{i}" in states:
                torch.cuda.set_rng_state(states[f"cuda{i}"], i)


# --- reading DCP's metadata without running code ---------------------------------------------

_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", n)
    for n in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "StorageMeta",
        "MetadataIndex",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refused global {module}.{name} in a checkpoint's metadata")


class SafeReader(FileSystemReader):
    """DCP's file reader, reading ``.metadata`` through an allow-list and refusing any storage
    path that leaves the folder."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self._folder = Path(os.fspath(path)).resolve()

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_meta.Metadata:
        path = self._folder / ".metadata"
        try:
            with open(path, "rb") as f:
                md = _MetadataUnpickler(f).load()
        except FileNotFoundError:
            raise CheckpointError(
                f"{self._folder} has no DCP metadata (.metadata): not a complete checkpoint"
            ) from None
        except Exception as e:  # any unpickling failure: not a checkpoint we can trust
            raise CheckpointError(f"{path} is not readable DCP metadata ({type(e).__name__}: {e})") from None
        if not isinstance(md, dcp_meta.Metadata) or not isinstance(md.state_dict_metadata, dict):
            raise CheckpointError(f"{path} is not DCP metadata")
        for index, where in (md.storage_data or {}).items():
            rel = getattr(where, "relative_path", None)
            if not isinstance(rel, str) or not self._inside(rel):
                raise CheckpointError(
                    f"{path}: {getattr(index, 'fqn', index)!r} points outside the folder ({rel!r})"
                )
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = dcp_meta.StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def _inside(self, rel: str) -> bool:
        target = (self._folder / rel).resolve()
        return target.parent == self._folder and target.is_file()
