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
afresh, and another layout has other ones. RNG states are restored only into the same layout
(workers, stages, dp and mp degrees: another layout draws other masks whatever is restored).

Tensor parallel: a split var (``Var.split``, recorded by the tensor-parallel pass on each split
param and carried by the optimizer pass to its state) holds this worker's part of a larger
tensor, and is saved as that part of the FULL tensor: each worker writes only its own pieces,
as DCP chunks at their offsets in the full tensor (`dcp_glue.Pieces`: one chunk per block, since a
fused projection's part is 1/mp of each of q, k, v, no contiguous chunk), nothing is gathered.
The checkpoint then holds every var by name and full shape, whatever the layout: it loads
into MP=1 (one process, DCP assembles the chunks), into MP=2 again, or from an MP=1
checkpoint into MP=2 (each worker reads the chunks overlapping its pieces). Which part a
worker holds is its index in its model-parallel group (the group the program's model-parallel
collectives name). Before anything is written, the workers of each model-parallel group
compare digests of every var they save whole: one that differs between them (a var some pass
made from a split param without recording its layout) would be kept from one worker only,
and is refused by name (NotImplementedError) instead.

Loading reads DCP's ``.metadata`` (bounded in size by what metaopt.json says was saved) with an
unpickler that admits only DCP's own metadata classes, and refuses storage paths outside the
checkpoint folder; tensors are read with ``torch.load(weights_only=True)``. Every var's pieces
must tile it exactly (metaopt/fleet/tiling.py): a piece dropped, doubled or shifted is refused
naming the var and its first wrong element, whatever degree loads it. Every worker validates
what it needs (present, same dtype and shape) and the workers agree before any of them changes
its scope: a problem on one worker is an error on all of them, naming the worker and the var.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
import socket
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from metaopt.atomic import atomic_write, fsync_dir
from metaopt.ir import Program, Split, Var, did_you_mean, dtype_name, eval_dim, names
from metaopt.ops import rng_streams

if TYPE_CHECKING:  # DCP itself is imported where a save or load runs (dcp_glue.py says why)
    from torch.distributed.checkpoint.metadata import Metadata

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


# --- tensor parallel: split vars ---------------------------------------------------------------


@dataclass(frozen=True)
class MPPlace:
    """This worker's place in its model-parallel group: which part of each split var it holds."""

    index: int
    group: tuple[int, ...]  # the group's global ranks, in part order


def model_parallel_group(program: Program, what: str) -> tuple[int, ...] | None:
    """The global ranks of this worker's model-parallel group, as `program`'s model-parallel
    collectives name it (``group``: a list of global ranks, or "model_parallel", this worker's
    group of fleet.init's hybrid layout); None when the program has no such collective."""
    groups = {_group_key(g) for op in program.ops if _is_mp_group(g := op.attrs.get("group"))}
    if not groups:
        return None
    if len(groups) > 1:
        raise CheckpointError(
            f"{what}: program {program.name!r} names several model-parallel groups {sorted(map(str, groups))}"
        )
    group = _resolve_group(next(iter(groups)), what)
    rank = world()[0]
    if rank not in group:
        raise CheckpointError(
            f"{what}: worker {rank} is not in model-parallel group {list(group)} of program {program.name!r}"
        )
    return group


def mp_place(program: Program, what: str) -> MPPlace | None:
    """Where this worker sits in the model-parallel group of `program`'s split vars; None when
    no saved var is split. The worker's part is its index in the group (`model_parallel_group`),
    as the tensor-parallel pass callers lay it out (fleet: the group in model-rank order; a
    list of ranks: ``mp_rank`` is the index)."""
    split = [v for v in saved_vars(program) if v.split is not None]
    if not split:
        return None
    for v in split:  # expert parallel's parts: placed by another group's index (not yet)
        try:
            v.split.require_model()
        except NotImplementedError as e:
            raise NotImplementedError(f"{what}: var {v.name!r} of program {program.name!r}: {e}") from None
    group = model_parallel_group(program, what)
    if group is None:
        if all(v.split.parts == 1 for v in split):
            return MPPlace(0, (world()[0],))
        v = next(v for v in split if v.split.parts > 1)
        raise CheckpointError(
            f"{what}: var {v.name!r} holds a part ({v.split}) but program {program.name!r} has no "
            "model-parallel collective naming the group: which part this worker holds is unknown"
        )
    for v in split:
        if v.split.parts != len(group):
            raise CheckpointError(
                f"{what}: var {v.name!r} is split in {v.split.parts} parts ({v.split}) but the "
                f"model-parallel group {list(group)} has {len(group)} workers"
            )
    return MPPlace(group.index(world()[0]), group)


def _is_mp_group(g: Any) -> bool:
    # data parallel's collectives say group="data_parallel"; tensor parallel's a rank list or this
    if g == "model_parallel":
        return True
    return isinstance(g, (list, tuple)) and bool(g) and all(isinstance(r, int) for r in g)


def _group_key(g: Any) -> tuple[int, ...] | str:
    return g if isinstance(g, str) else tuple(g)


def _resolve_group(g: tuple[int, ...] | str, what: str) -> tuple[int, ...]:
    if not isinstance(g, str):
        return g
    from metaopt.fleet import env

    if env._STATE.hcg is None:
        raise CheckpointError(
            f"{what}: the program's collectives run over this worker's 'model_parallel' group, but "
            "fleet.init made no hybrid layout (give fleet.init the strategy with hybrid_configs)"
        )
    return tuple(env._STATE.hcg.group_ranks("model"))


def local_part(full: torch.Tensor, split: Split, index: int) -> torch.Tensor:
    """Part `index` of `full` as `split` lays it out (a fresh tensor)."""
    split.require_model()
    return torch.cat([full.narrow(split.axis, at, n) for at, _, n in split.pieces(index)], split.axis)


# --- ZeRO sharding: flat slices (Var.zero) ----------------------------------------------------
# A checkpoint holds a sharded var whole: DCP stores it flat (1-D, its padding left out; a flat
# slice of a 2-D tensor is no rectangle of it), metaopt.json says so ("flat") beside its full
# shape. Loading takes whatever this worker's layout holds of it: its own slice, or all of it.


def zero_index(program: Program, what: str) -> int | None:
    """This worker's index in its sharding group (the part of each ``Var.zero`` it holds); None
    when no saved var is sharded over more than one worker."""
    zeros = [v for v in saved_vars(program) if v.zero is not None and v.zero.parts > 1]
    if not zeros:
        return None
    from metaopt.layout.groups import axis_ranks

    rank, size = world()
    ranks = axis_ranks("sharding") or list(range(size))
    bad = next((v for v in zeros if v.zero.parts != len(ranks)), zeros[0] if rank not in ranks else None)
    if bad is not None:
        raise CheckpointError(
            f"{what}: var {bad.name!r} is {bad.zero} but this worker's sharding group is {ranks}: the "
            "program was sharded for another layout"
        )
    return ranks.index(rank)


def whole_value(v: Var, t: torch.Tensor) -> torch.Tensor:
    """The value a one-file checkpoint holds of `v` (of which this process holds `t`): a sharded
    var of a group of one is its slice without the padding, in its full shape."""
    if v.zero is None:
        return t
    if v.zero.parts != 1:
        raise CheckpointError(f"var {v.name!r} is {v.zero}: one worker holds only its part")
    return t.reshape(-1)[: v.zero.full_numel].reshape(v.zero.full)


def zero_part(v: Var, whole: torch.Tensor, index: int | None) -> torch.Tensor:
    """What this worker holds of sharded var `v` whose whole value is `whole`."""
    from metaopt.ops.kernels.partition import take_slice

    return take_slice(whole, v.zero.parts, index or 0)


def _digest(t: torch.Tensor) -> str:
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.blake2b(flat.numpy(), digest_size=16).hexdigest()


def _replicas_differ(group: tuple[int, ...] | None, state: dict[str, Any]) -> str | None:
    """Every worker's digests of the vars it saves whole, compared within each model-parallel
    group (a collective: every worker calls it). DCP keeps one copy of a var several workers
    save whole, so one that differs between them must be split (and say so) or be refused."""
    mine = {k: _digest(t) for k, t in state.items() if isinstance(t, torch.Tensor)}
    gathered = _gather((group or (world()[0],), mine), "the digests of the vars saved whole")
    everyone = [(tuple(g), d) for g, d in gathered]
    for group in sorted({g for g, _ in everyone}):
        members = [(r, d) for r, (g, d) in enumerate(everyone) if g == group]
        (first, ref), *rest = members
        for r, d in rest:
            for name in sorted(set(ref) & set(d)):
                if ref[name] != d[name]:
                    return (
                        f"var {name!r} differs between workers {first} and {r} of model-parallel group "
                        f"{list(group)} but has no split layout (Var.split): saving it would keep one "
                        "worker's value. Checkpoints of it are not implemented: the pass that made it "
                        "from a split param must record the layout"
                    )
    return None


# --- the job ---------------------------------------------------------------------------------


def world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather(obj: Any, what: str) -> list[Any]:
    """Every worker's `obj` (small, JSON-able: tuples come back as lists), in rank order; one
    worker: [obj]. Over `all_gather_bytes`: bounded by METAOPT_COMM_TIMEOUT, nothing unpickled."""
    if world()[1] == 1:
        return [obj]
    from metaopt.layout.groups import all_gather_json

    return all_gather_json(obj, what)


def _agree_or_raise(problem: str | None, what: str, error: type[Exception] = CheckpointError) -> None:
    """Raise `error` on every worker if any worker found a problem, naming each such worker, so
    no worker goes on into a collective the others will never join."""
    found = [(r, p) for r, p in enumerate(_gather(problem, f"{what}: the workers' problems")) if p]
    if found and world()[1] == 1:
        raise error(f"{what}: {found[0][1]}")
    if found:
        detail = "; ".join(f"worker {r}: {p}" for r, p in found)
        raise error(f"{what} refused on every worker: {detail}")


def _layout(program: Program, group: tuple[int, ...] | None) -> dict[str, Any]:
    """What must match for RNG states to be restored (and extra vars to be an error)."""
    rank, size = world()
    pl = program.pipeline
    mp = len(group) if group is not None else 1
    return {
        "world_size": size,
        "pipeline_stages": pl.num_stages if pl else 1,
        "dp_degree": pl.dp_degree if pl else size // mp,
        "mp_degree": mp,
    }


_LAYOUT_DEFAULTS = {"mp_degree": 1}  # keys older checkpoints do not write


# --- the folder --------------------------------------------------------------------------------


def _step_dir(step: int) -> str:
    return f"step-{step:08d}"


LATEST_MAX_BYTES = 64  # "step-NNNNNNNN" and a newline
INFO_MAX_BYTES = 256 << 20  # metaopt.json: a few hundred bytes per var


def _read_bounded(path: Path, limit: int) -> bytes:
    """`path`'s bytes, refused past `limit` without reading further (a sparse file can claim
    a terabyte while holding nothing): a CheckpointError that names the file, never its content."""
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise CheckpointError(f"{path} is not readable: {e.strerror or e}") from None
    if len(data) > limit:
        raise CheckpointError(f"{path} is larger than {limit} bytes: not a file metaopt wrote")
    return data


def _read_latest(root: Path) -> str | None:
    path = root / LATEST
    if not path.is_file():
        return None
    text = _read_bounded(path, LATEST_MAX_BYTES).decode("utf-8", errors="replace").strip()
    if not _STEP_DIR.match(text):
        raise CheckpointError(f"{path} does not name a checkpoint folder (step-NNNNNNNN)")
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
    rank, size = world()
    root = Path(os.fspath(dirname))
    # What this worker saves, before any collective: a worker that cannot (a var without a
    # value) must fail every worker now, not leave them waiting in DCP until the timeout.
    state: dict[str, Any] = {}
    info: dict[str, dict[str, Any]] = {}
    mine, problem, place, group = -1, None, None, None
    try:
        mine = _next_step(exe, program, root, step)
        group = model_parallel_group(program, "save_persistables")
        place = mp_place(program, "save_persistables")
        zi = zero_index(program, "save_persistables")
        if group is not None and max(group) >= size:
            raise CheckpointError(
                f"program {program.name!r} is split over the model-parallel group {list(group)}, "
                f"but this job has {size} worker(s): every worker of the group must save its part"
            )
        for v in saved_vars(program):
            t = value_of(exe, program, v).detach().to("cpu")
            state[v.name], info[v.name] = _entry(v, t, place, zi)
    except (CheckpointError, OSError) as e:
        problem = str(e)
    _agree_or_raise(problem, f"save_persistables into {root}")
    steps = _gather((mine, group is not None), "the workers' steps")
    if len({m for m, _ in steps}) != 1:
        raise CheckpointError(
            f"save_persistables: the workers are at different steps {[m for m, _ in steps]} (by rank): "
            "pass step=... or save from the same point of training on every worker"
        )
    if any(tp for _, tp in steps):  # tensor parallel: what DCP keeps once must be equal
        differ = _replicas_differ(group, state)
        if differ is not None:
            raise NotImplementedError(f"save_persistables into {root}: {differ}")
    steps = [m for m, _ in steps]
    name = _step_dir(steps[0])
    partial = root / f".{name}.partial"
    problem = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            problem = _take_lock(root)
            if problem is None:
                _clean_leftovers(root)
                partial.mkdir()
        except OSError as e:
            problem = f"cannot prepare {partial}: {e}"
    _agree_or_raise(problem, f"save_persistables into {root}")
    try:
        return _write_and_commit(
            state, info, root, partial, name, program, group, steps[0], keep_last, rank, size
        )
    finally:
        if rank == 0:
            _release_lock(root)


def _write_and_commit(  # noqa: PLR0913 - the save's state, handed on from save_sharded
    state: dict[str, Any],
    info: dict[str, dict[str, Any]],
    root: Path,
    partial: Path,
    name: str,
    program: Program,
    group: Any,
    step: int,
    keep_last: int,
    rank: int,
    size: int,
) -> str:
    """Every worker writes its part into `partial`; worker 0 commits it as `root/name`."""
    import torch.distributed.checkpoint as dcp

    from metaopt.fleet import dcp_glue

    for key, t in rng_states().items():
        state[f"{_RNG}/{rank}/{key}"] = t
    with warnings.catch_warnings():  # one worker (tests, tools) saving this format is meant
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.save(
            state,
            storage_writer=dcp.FileSystemWriter(partial, sync_files=True),
            planner=dcp_glue.SavePlanner(),
            no_dist=size == 1,
        )

    all_info = _gather(info, "the saved vars' metaopt.json lines")
    problem = None
    if rank == 0:
        try:
            _commit(root, partial, name, _merge_info(all_info), _layout(program, group), step, keep_last)
        except (OSError, CheckpointError) as e:
            problem = f"cannot complete {root / name}: {e}"
    _agree_or_raise(problem, f"save_persistables into {root}")
    return str(root / name)


LOCK = ".saving"  # "pid host": the job saving into the folder now


def _take_lock(root: Path) -> str | None:
    """Claim `root` for this job's save (worker 0 only), or say which job has it. A lock whose
    owner is gone (same host, no such process) is taken over: a killed save leaves one."""
    path = root / LOCK
    mine = f"{os.getpid()} {socket.gethostname()}\n".encode()
    for _ in range(2):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            owner = _read_bounded(path, 256).decode("utf-8", errors="replace").split()
            pid, host = (int(owner[0]) if owner and owner[0].isdigit() else None), (owner[1:2] or ["?"])[0]
            if pid is not None and host == socket.gethostname() and not _alive(pid):
                path.unlink(missing_ok=True)  # its owner died mid-save
                continue
            return (
                f"another job (pid {pid} on host {host}) is saving into {root} now ({path}); save "
                f"into another folder, or remove {path} if that job is gone"
            )
        with os.fdopen(fd, "wb") as f:
            f.write(mine)
        return None
    return f"cannot claim {root} for saving ({path} keeps coming back)"


def _release_lock(root: Path) -> None:
    path = root / LOCK
    try:
        owner = _read_bounded(path, 256).decode("utf-8", errors="replace").split()
    except CheckpointError:
        return
    if owner[:1] == [str(os.getpid())]:
        path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _entry(v: Var, t: torch.Tensor, place: MPPlace | None, zi: int | None) -> tuple[Any, dict[str, Any]]:
    """What DCP saves of `v` (its value `t`) and its line in metaopt.json: a split var as this
    worker's pieces of the full tensor, described by the full shape (and the saving layout); a
    sharded var (ZeRO) as its chunk of the full tensor stored flat."""
    from metaopt.fleet import dcp_glue

    if v.zero is not None and v.split is not None:  # ZeRO slices of a tensor-parallel part: n-d boxes
        assert place is not None  # mp_place found the group of every split var
        entry = {"kind": v.kind, "dtype": _dtype(t), "shape": list(v.full_shape)}
        return dcp_glue.Pieces.of_zero_split(t, v.zero, zi or 0, v.split, place.index), entry
    if v.zero is not None:
        entry = {"kind": v.kind, "dtype": _dtype(t), "shape": list(v.zero.full), "flat": True}
        return dcp_glue.Pieces.of_zero(t, v.zero, zi or 0), entry
    if v.split is None:
        return t, {"kind": v.kind, "dtype": _dtype(t), "shape": list(t.shape)}
    assert place is not None  # mp_place found the group of every split var
    sp = v.split
    if tuple(t.shape) != tuple(v.shape or ()):
        raise CheckpointError(
            f"var {v.name!r} holds {list(t.shape)} in the executor's scope but the program says "
            f"{list(v.shape or ())} ({sp}): not this worker's part"
        )
    layout = {"axis": sp.axis, "parts": sp.parts, "blocks": list(sp.blocks)}
    full = list(sp.full_shape(tuple(t.shape)))
    entry = {"kind": v.kind, "dtype": _dtype(t), "shape": full, "saved_split": layout}
    return dcp_glue.Pieces.of_split(t, sp, place.index), entry


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


# Generators beside torch's default ones whose states a checkpoint carries: name -> (get, set).
_RNG_STREAMS: dict[
    str, tuple[Callable[[], Mapping[str, torch.Tensor]], Callable[[dict[str, torch.Tensor]], None]]
] = {}


def register_rng_states(
    name: str,
    get_states: Callable[[], Mapping[str, torch.Tensor]],
    set_states: Callable[[dict[str, torch.Tensor]], None],
) -> None:
    """Have checkpoints carry more generator states (e.g. tensor parallel's per-model-parallel-
    rank dropout streams): `get_states()` returns them by key (no "/" in a key), `set_states(d)`
    gets back exactly that dict as it was saved. Saved by every worker (sharded: under
    ``__rng__/<rank>/stream.<name>.<key>``; the one file: ``rng["streams"][name]``) and, as
    torch's own generators, restored only into the same layout. Before anything is loaded, a
    saved state whose key the process has now must match its dtype and shape. Registering a
    name again replaces it."""
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]+", name):
        raise ValueError(f"register_rng_states: name must be letters, digits, '_' or '-', got {name!r}")
    _RNG_STREAMS[name] = (get_states, set_states)


def rng_states() -> dict[str, torch.Tensor]:
    """This process's generator states, by key: ``cpu``, ``cuda<i>``, ``stream.<name>.<key>``."""
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            states[f"cuda{i}"] = s
    for name, (get, _) in _RNG_STREAMS.items():
        for key, t in get().items():
            if "/" in key:
                raise ValueError(f"RNG states {name!r}: key {key!r} has a '/'")
            states[f"stream.{name}.{key}"] = t.detach().to("cpu").clone()
    return states


def stream_states(states: Mapping[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    """The states of registered `name` among `states` (keys as its `get_states` gave them)."""
    prefix = f"stream.{name}."
    return {k.removeprefix(prefix): t for k, t in states.items() if k.startswith(prefix)}


def check_rng(states: dict[str, torch.Tensor]) -> str | None:
    """What is wrong with `states` as this process's generator states (before any is set)."""
    now = rng_states()
    for k, t in states.items():
        if not isinstance(t, torch.Tensor):
            return f"RNG state {k!r} is a {type(t).__name__}, not a tensor"
        if k not in now:
            if k.startswith("stream."):  # a stream state this process has not made yet, or none
                continue
            if k.startswith("cuda"):
                continue  # a GPU this process does not have: set_rng skips it, as before
            return f"unknown RNG state {k!r}"
        if not isinstance(t, torch.Tensor) or t.dtype != now[k].dtype or t.shape != now[k].shape:
            got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            return f"RNG state {k!r} is {got}, expected {now[k].dtype} {list(now[k].shape)}"
    if "cpu" not in states:
        return "no CPU RNG state"
    return None


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
    if folder.is_symlink():  # metaopt never makes one: it would load another folder's files
        raise CheckpointError(f"{folder} is a symbolic link: a checkpoint's step folder must be a folder")
    if not (folder / INFO).is_file():
        raise CheckpointError(f"{root / LATEST} names {latest}, which is not a complete checkpoint in {root}")
    return folder


def _read_info(folder: Path) -> dict[str, Any]:
    path = folder / INFO
    try:
        meta = json.loads(_read_bounded(path, INFO_MAX_BYTES).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        what = f"{type(e).__name__} at byte {_where(e)}"
        raise CheckpointError(f"{path} is not readable JSON ({what})") from None
    except RecursionError:
        raise CheckpointError(f"{path} is nested too deeply to be a checkpoint description") from None
    ok = (
        isinstance(meta, dict)
        and meta.get("format") == FORMAT
        and isinstance(meta.get("vars"), dict)
        and all(isinstance(i, dict) and _is_shape(i.get("shape")) for i in meta["vars"].values())
        and _is_int(meta.get("world_size"))
        and 1 <= meta["world_size"] <= MAX_WORKERS
    )
    if not ok:
        raise CheckpointError(f"{path} is not a metaopt checkpoint description (format {FORMAT!r})")
    if not isinstance(meta.get("version"), int) or meta["version"] > VERSION:
        raise CheckpointError(
            f"{path} has format version {meta.get('version')!r}; this metaopt reads <= {VERSION}"
        )
    return meta


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_shape(x: object) -> bool:
    return isinstance(x, list) and all(_is_int(d) and d >= 0 for d in x)


def _where(e: Exception) -> object:
    return getattr(e, "pos", None) if isinstance(e, json.JSONDecodeError) else getattr(e, "start", None)


def _shape_ok(got: list[int], want: tuple | None) -> bool:
    if want is None:
        return True
    if len(got) != len(want):
        return False
    return all(eval_dim(w, {}) in (None, g) for g, w in zip(got, want, strict=True))


def _check_vars(folder: Path, meta: dict, want: list[Var], md: Metadata) -> str | None:
    """This worker's problem with the checkpoint, or None. Shapes are compared whole: a split
    var by its full shape (the checkpoint holds every var whole, whatever layout saved it)."""
    from torch.distributed.checkpoint import metadata as dcp_meta

    saved = meta["vars"]
    for v in want:
        if v.name not in saved or v.name not in md.state_dict_metadata:
            hint = did_you_mean(v.name, saved)
            return f"{folder} has no var {v.name!r}{hint}, which program needs"
        s = saved[v.name]
        if s.get("dtype") != v.dtype or not _shape_ok(s["shape"], v.full_shape):
            have = f"{s.get('dtype')} {s['shape']}"
            return f"var {v.name!r} is {have} in {folder} but {describe(v)} in the program"
        tm = md.state_dict_metadata[v.name]
        stored = [math.prod(s["shape"])] if s.get("flat") else list(s["shape"])
        if not isinstance(tm, dcp_meta.TensorStorageMetadata) or list(tm.size) != stored:
            return f"var {v.name!r}: DCP's metadata in {folder} disagrees with {INFO}"
        if getattr(tm.properties, "dtype", None) != _torch_dtype(v.dtype):
            got = getattr(tm.properties, "dtype", None)
            return f"var {v.name!r} is stored as {got} in {folder}'s DCP metadata, but {INFO} says {v.dtype}"
    return None


# --- the pieces: bounded, each with its storage, tiling its tensor exactly -------------------
# A save writes per var at most (2 ndim + 1) boxes per block of its part per worker (ZeRO's
# flat run of a tensor-parallel part: dcp_glue.flat_boxes), and a part has a few blocks (a
# fused q, k, v: 3); per worker a few RNG states. `.metadata` is read with pickle's pure-Python
# unpickler (~0.5 MB/s): its size is bounded by what metaopt.json says was saved before a byte
# of it is unpickled, and its piece count after.

MAX_WORKERS = 1 << 20
MAX_BLOCKS = 8
MAX_RNG_KEYS = 64
PIECE_BYTES = 256  # a pickled chunk, its index and its storage entry, the names aside
METADATA_BASE_BYTES = 1 << 20


def piece_budget(info: dict[str, Any], world: int) -> int:
    """The most pieces a save of `world` workers writes of a var described by `info`: no more
    than its elements either (pieces that tile it hold one at least; empty ones, a block per
    worker at most, aside), whatever metaopt.json's world size says."""
    numel = math.prod(info["shape"])
    return min(world * (2 * len(info["shape"]) + 1) * MAX_BLOCKS, numel + world * MAX_BLOCKS)


def saving_world(folder: Path, meta: dict[str, Any]) -> int:
    """The workers that wrote the checkpoint `folder`: metaopt.json's world size, but no more
    than the data files there (DCP writes one per worker), so an edited metaopt.json cannot
    raise the metadata's budgets."""
    files = sum(1 for _ in folder.glob("*.distcp"))
    return max(1, min(meta["world_size"], files))


def metadata_budget(meta: dict[str, Any], world: int | None = None) -> int:
    """The most bytes the `.metadata` of the checkpoint `meta` (its metaopt.json) written by
    `world` workers (default: its world size) can need."""
    world = meta["world_size"] if world is None else world
    per_var = sum(
        piece_budget(info, world) * (PIECE_BYTES + 2 * len(name)) for name, info in meta["vars"].items()
    )
    return METADATA_BASE_BYTES + per_var + world * MAX_RNG_KEYS * (PIECE_BYTES + 2 * len(_RNG) + 64)


def check_pieces(folder: Path, meta: dict[str, Any], md: Metadata) -> str | None:
    """The problem with DCP's pieces in `folder`, or None: every tensor entry is a var of
    metaopt.json or an RNG state, has at most its budget of pieces, each inside the tensor and
    with a stored blob, no blob belongs to no piece, and the pieces tile the tensor exactly (a
    piece dropped, doubled or shifted: the first element uncovered or covered twice)."""
    from torch.distributed.checkpoint import metadata as dcp_meta

    from metaopt.fleet.tiling import tiling_fault

    world, described = saving_world(folder, meta), meta["vars"]
    stored: set[tuple[str, tuple[int, ...]]] = set()
    for index in md.storage_data or {}:
        offset = getattr(index, "offset", None)
        stored.add((getattr(index, "fqn", None), tuple(offset) if offset is not None else ()))
    pieces = 0
    for fqn, tm in md.state_dict_metadata.items():
        rng = isinstance(fqn, str) and fqn.startswith(f"{_RNG}/")
        if not isinstance(tm, dcp_meta.TensorStorageMetadata) or not (rng or fqn in described):
            return f"{folder}'s DCP metadata holds {str(fqn)[:200]!r}, which {INFO} does not describe"
        name = "RNG state" if rng else "var"
        size = list(tm.size) if isinstance(tm.size, (list, tuple)) else None
        if size is None or not _is_shape(size) or not isinstance(tm.chunks, list):
            return f"{name} {fqn!r}: DCP's metadata in {folder} gives no valid shape and piece list"
        budget = 1 if rng else piece_budget(described[fqn], world)
        if len(tm.chunks) > budget:
            return (
                f"{name} {fqn!r} has {len(tm.chunks)} pieces in {folder}'s DCP metadata; a save of "
                f"{world} worker(s) writes at most {budget}"
            )
        pieces += len(tm.chunks)
        boxes = []
        for chunk in tm.chunks:
            box = _box(chunk, size)
            if box is None:
                return f"{name} {fqn!r}: a stored piece in {folder} lies outside its shape {size}"
            if (fqn, box[0]) not in stored:
                return f"{name} {fqn!r}: the piece at {list(box[0])} in {folder} has no stored data"
            boxes.append(box)
        fault = tiling_fault(size, boxes)
        if fault is not None:
            fault_text = _fault_text(fault, size, described.get(fqn))
            return f"{name} {fqn!r}: its pieces in {folder} do not tile it: {fault_text}"
    if len(stored) > pieces:
        return f"{folder}'s DCP metadata stores {len(stored) - pieces} blob(s) that belong to no piece"
    return None


def _box(chunk: Any, size: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """A piece's (offsets, sizes) when they are ints that place it inside `size`."""
    offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
    if not isinstance(offsets, (list, tuple)) or not isinstance(sizes, (list, tuple)):
        return None
    if len(offsets) != len(size) or len(sizes) != len(size):
        return None
    if not all(_is_int(x) and x >= 0 for x in (*offsets, *sizes)):
        return None
    if any(o + n > d for o, n, d in zip(offsets, sizes, size, strict=True)):
        return None
    return tuple(offsets), tuple(sizes)


def _fault_text(fault: Any, size: list[int], info: dict[str, Any] | None) -> str:
    """A flat-stored var's element also by its index in the var's own shape."""
    if info is None or not info.get("flat") or len(size) != 1 or len(info["shape"]) < 2:
        return str(fault)
    at = fault.index[0]
    index = []
    for d in reversed(info["shape"]):
        at, i = divmod(at, d)
        index.append(i)
    return f"{fault} (index {index[::-1]} of its shape {info['shape']}, stored flat)"


RNG_MAX_BYTES = 1 << 20  # a generator's state is a few kB (CPU: 5056 bytes; CUDA: 16)


def _check_rng_sizes(folder: Path, md: Metadata, rank: int) -> str | None:
    """This worker's RNG entries must be small uint8 tensors before anything is allocated for
    them: a crafted size was a raw RuntimeError (or an allocation of its size)."""
    for k, tm in md.state_dict_metadata.items():
        if not k.startswith(f"{_RNG}/{rank}/"):
            continue
        size = getattr(tm, "size", None)
        dtype = getattr(getattr(tm, "properties", None), "dtype", None)
        n = math.prod(size) if size is not None and all(isinstance(d, int) and d >= 0 for d in size) else -1
        if dtype != torch.uint8 or not 0 <= n <= RNG_MAX_BYTES:
            return f"RNG state {k!r} in {folder} is {dtype} {list(size or [])}: not a generator state"
    return None


def describe(v: Var) -> str:
    """``float32 [96, 32]``; a split var's full shape and the part this worker holds."""
    full = list(v.full_shape) if v.shape is not None else "?"
    layout = " ".join(str(x) for x in (v.split, v.zero) if x is not None)
    if not layout:
        return f"{v.dtype} {full}"
    return f"{v.dtype} {full} (this worker holds {list(v.shape or ())}: {layout})"


def load_sharded(exe: Any, folder: Path, program: Program, *, strict: bool = True) -> list[str]:
    """Every worker of the new layout calls this; returns the names loaded on this worker."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from metaopt.fleet import dcp_glue

    rank, size = world()
    problem, meta, md, place, group, zi = None, None, None, None, None, None
    want = saved_vars(program)
    try:
        group = model_parallel_group(program, "load_persistables")
        place = mp_place(program, "load_persistables")
        zi = zero_index(program, "load_persistables")
        meta = _read_info(folder)
        md = dcp_glue.SafeReader(
            folder, max_bytes=metadata_budget(meta, saving_world(folder, meta))
        ).read_metadata()
        problem = (
            _check_vars(folder, meta, want, md)
            or _check_rng_sizes(folder, md, rank)
            or check_pieces(folder, meta, md)
        )
    except CheckpointError as e:
        problem = str(e)
    _agree_or_raise(problem, f"load_persistables from {folder}")
    assert meta is not None and md is not None

    needed = set().union(*_gather([v.name for v in want], "the vars each worker loads"))
    extra = sorted(set(meta["vars"]) - needed)
    layout = _layout(program, group)
    same_layout = {k: meta.get(k, _LAYOUT_DEFAULTS.get(k)) for k in layout} == layout
    if extra and strict and same_layout:
        raise CheckpointError(
            f"load_persistables: {folder} holds {len(extra)} var(s) no worker's program has: "
            f"{extra[:10]}; pass strict=False to ignore them"
        )
    if extra:
        logger.info(
            "load_persistables: %d var(s) of %s are not in this layout: %s", len(extra), folder, extra[:10]
        )

    into: dict[str, Any] = {}
    for v in want:
        flat = bool(meta["vars"][v.name].get("flat"))
        if v.zero is not None and v.split is not None:  # its tensor-parallel part read whole, cut below
            assert place is not None
            into[v.name] = dcp_glue.Pieces.of_split(
                torch.empty(v.zero.full, dtype=_torch_dtype(v.dtype)), v.split, place.index
            )
            if flat:  # saved flat (ZeRO without tensor parallel): the whole tensor, cut below
                into[v.name] = torch.empty([math.prod(v.full_shape)], dtype=_torch_dtype(v.dtype))
        elif v.zero is not None and flat:  # this worker's chunk, read straight into its slice
            into[v.name] = dcp_glue.Pieces.of_zero(
                torch.zeros(v.shape, dtype=_torch_dtype(v.dtype)), v.zero, zi or 0
            )
        elif v.split is None:  # whole (flat where it was saved so); a sharded var cut below
            shape = meta["vars"][v.name]["shape"]
            into[v.name] = torch.empty([math.prod(shape)] if flat else shape, dtype=_torch_dtype(v.dtype))
        else:  # this worker's pieces of the full tensor, read straight into its local tensor
            assert place is not None  # mp_place found the group of every split var
            into[v.name] = dcp_glue.Pieces.of_split(
                torch.empty(v.shape, dtype=_torch_dtype(v.dtype)), v.split, place.index
            )
    rng_keys = {k for k in md.state_dict_metadata if k.startswith(f"{_RNG}/{rank}/")}
    restore_rng = same_layout and f"{_RNG}/{rank}/cpu" in rng_keys
    if restore_rng:
        for k in rng_keys:
            tm = md.state_dict_metadata[k]
            into[k] = torch.empty(list(tm.size), dtype=tm.properties.dtype)
    elif rank == 0:
        saved = {k: meta.get(k, _LAYOUT_DEFAULTS.get(k)) for k in layout}
        logger.warning(
            "load_persistables: %s was saved by another layout (%s), this job is %s: RNG states not restored "
            "(dropout masks differ from an uninterrupted run)",
            folder,
            saved,
            layout,
        )
    with warnings.catch_warnings():  # one process loading is what we mean: DCP warns all the same
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        try:
            dcp.load(
                into,
                storage_reader=dcp_glue.SafeReader(folder, metadata=md),  # read and checked above
                planner=dcp_glue.LoadPlanner(),
                no_dist=size == 1,
            )
        except (Exception, CheckpointException) as e:  # damaged data: nothing was changed yet
            raise CheckpointError(f"load_persistables: reading {folder} failed: {_short(e)}") from e
    rng = {k.rsplit("/", 1)[1]: into[k] for k in rng_keys} if restore_rng else {}
    problem = check_rng(rng) if restore_rng else None
    _agree_or_raise(problem and f"{folder}: {problem}", "load_persistables")
    held = {v.name: _held(v, into[v.name], meta["vars"][v.name], zi, place) for v in want}
    into_scope(exe, held)
    if restore_rng:
        set_rng(rng)
    return [v.name for v in want]


def _held(v: Var, x: Any, saved: dict[str, Any], zi: int | None, place: MPPlace | None) -> torch.Tensor:
    """What this worker keeps of `v` from what DCP read into `x`: a ZeRO slice beside tensor
    parallel is cut from its tensor-parallel part (read whole, or cut from the whole tensor)."""
    from metaopt.fleet import dcp_glue

    split_zero = v.zero is not None and v.split is not None
    if isinstance(x, dcp_glue.Pieces):
        return zero_part(v, x.local, zi) if split_zero else x.local
    whole = x.view(saved["shape"]) if saved.get("flat") else x
    if split_zero:
        assert place is not None
        whole = local_part(whole, v.split, place.index)
    return zero_part(v, whole, zi) if v.zero is not None else whole


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


def set_rng(states: dict[str, torch.Tensor]) -> None:
    """Set the generators `states` holds (checked by `check_rng` first)."""
    torch.set_rng_state(states["cpu"])
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            if f"cuda{i}" in states:
                torch.cuda.set_rng_state(states[f"cuda{i}"], i)
    for name, (_, set_states) in _RNG_STREAMS.items():
        mine = stream_states(states, name)
        if mine:
            set_states(mine)
        else:
            logger.warning(
                "load_persistables: the checkpoint has no state of RNG stream %r: left as is", name
            )


def _model_parallel_streams() -> dict[str, torch.Tensor]:
    mp = rng_streams.MODEL_PARALLEL + "."
    return {k: t for k, t in rng_streams.state_dict().items() if k.startswith(mp)}


def _set_model_parallel_streams(states: dict[str, torch.Tensor]) -> None:
    # torch's default generators (the shared stream) are restored by the caller: keep them as they are
    default = {k: t for k, t in rng_streams.state_dict().items() if "." not in k}
    rng_streams.load_state_dict({**default, **states})


# Tensor parallel's per-model-parallel-rank dropout streams (metaopt/ops/rng_streams.py): a resumed
# run with dropout in split regions draws the masks it would have drawn.
register_rng_states("model_parallel", _model_parallel_streams, _set_model_parallel_streams)
