"""The peak of live bytes of one pipeline worker's step, predicted from its schedule.

`estimate_memory` replays one program once; a pipeline stage program runs as its phases
(passes/pipeline_phases.py), one action at a time in the order its schedule gives (1F1B,
ZB-H1, ...), with what a later phase of the same micro-batch reads held between them. This
replays that, as runtime/pipeline.py's runner does it: the worker's persistables (every phase's
state, each constant once) are live throughout; each action runs its phase program, whose own
bytes are `estimate_memory`'s of it (the values it is handed and hands on live through its run);
after it, the values it hands on are held and those no later phase reads are let go; a micro-
batch's held values go after its last action; the optimizer runs last. The executor measures
the same (`exe.memory_stats()["peak_bytes"]`).

    est = estimate_pipeline_memory(stage_program, batch=8)
    est.peak_bytes, est.peak_action, est.held_peak_bytes
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from metaopt.ir import Program, roles
from metaopt.ir.program import PipelineInfo
from metaopt.passes.memory_estimate import estimate_memory, persistable_bytes
from metaopt.runtime.pipeline import PHASE_OF
from metaopt.runtime.plan import check_inplace
from metaopt.runtime.schedules import schedule


@dataclass(frozen=True)
class PipelineMemory:
    peak_bytes: int  # the worker's peak of live device bytes in a step
    persistable_bytes: int
    peak_action: str  # the action at the peak ("F3", "B0.c1", ...; "optimizer")
    held_peak_bytes: int  # the most bytes held between actions (activations in flight)
    actions: tuple[tuple[str, int], ...] = ()  # each action and its peak, in run order


def estimate_pipeline_memory(p: Program, *, batch: int, device: str = "cpu") -> PipelineMemory:
    """The peak bytes of a step of pipeline stage program `p` (cut into its phases) fed a
    batch of `batch` samples (the whole batch, as every worker is fed: `batch` / micro-batches
    per micro-batch) on `device` (`estimate_memory`'s: what only another device makes counts
    nothing)."""
    info = _info(p)
    return estimate_pipeline_memories(
        p, batch=batch, stages=(info.stage,), num_stages=info.num_stages, device=device
    )[0]


def estimate_pipeline_memories(
    p: Program,
    *,
    batch: int,
    stages: Sequence[int],
    num_stages: int,
    micro_batches: int | None = None,
    device: str = "cpu",
) -> list[PipelineMemory]:
    """`estimate_pipeline_memory` of `p` run at each place `stages` of a pipeline of `num_stages`
    (the schedule's actions of that place) instead of its own: the planner's figures for the
    identical middle stages of a deep pipeline from one of them (planner/search.py). The phases'
    own bytes are estimated once, each place's schedule replayed over them. One chunk per worker
    only (an interleaved placement names its virtual stages by place). `micro_batches`: the
    schedule's count instead of the program's (a stage program differs between counts only in
    the loss grad's 1/M, a value: the planner rewrites once for both of its counts)."""
    info = _info(p)
    if info.chunks != 1 and (tuple(stages), num_stages) != ((info.stage,), info.num_stages):
        raise ValueError(
            f"estimate_pipeline_memories: program {p.name!r} holds {info.chunks} chunks a worker: "
            "its phases belong to its own place in the pipeline"
        )
    m = micro_batches or info.micro_batches
    if batch % m:
        raise ValueError(f"estimate_pipeline_memory: batch {batch} does not split into {m} micro-batches")
    dims = {"batch": batch // m}
    parts = {part.key: part for part in p.phases.parts}
    persist = persistable_bytes(p, dims=dims, device=device)
    own = {key: _own(part, dims, device) for key, part in parts.items()}
    return [_replay(p, parts, own, persist, stage, num_stages, m) for stage in stages]


def _info(p: Program) -> PipelineInfo:
    """`p`'s pipeline info, where `p` is a stage program cut into its current phases."""
    info = p.pipeline
    if info is None or p.phases is None or not p.phases.matches(p):
        raise ValueError(
            f"estimate_pipeline_memory: program {p.name!r} is not a pipeline stage program cut into "
            "its phases (fleet's minimize with strategy.pipeline makes one)"
        )
    return info


def _replay(
    p: Program, parts: dict, own: dict, persist: int, stage: int, num_stages: int, m: int
) -> PipelineMemory:
    """One worker's step at place `stage` of `num_stages`: its schedule's actions over the phases
    of `p` (their own bytes `own`) for `m` micro-batches, what each hands on held until its
    micro-batch's last action."""
    info = p.pipeline
    acts = schedule(info.schedule, num_stages=num_stages, stage=stage, micro_batches=m, chunks=info.chunks)
    last = {a.micro_batch: n for n, a in enumerate(acts)}
    # per micro-batch: each held value -> the value whose storage it is on (views share one)
    held: dict[int, dict[str, str]] = {i: {} for i in range(m)}
    sizes: dict[str, int] = {}
    each = [0] * m  # per micro-batch: its held values' bytes (kept as they change, not re-summed)
    peak, at, held_peak, rows = persist, "", 0, []
    for n, a in enumerate(acts):
        part = parts[(info.placement.vstage(info.stage, a.chunk), PHASE_OF[a.kind])]
        extra, made = own[part.key]
        i = a.micro_batch
        here = persist + sum(each) + extra  # its carried-in values are held already
        rows.append((str(a), here))
        if here > peak:
            peak, at = here, str(a)
        for x, (owner, nbytes) in made.items():  # an input's view is on what that input is on
            held[i][x] = held[i].get(owner, owner) if owner in part.carried_in else owner
            sizes.setdefault(held[i][x], nbytes)
        for x in part.last_use:  # after: a value made above may be a view of one let go here
            held[i].pop(x, None)
        each[i] = _held_bytes(held[i], sizes)
        held_peak = max(held_peak, sum(each))
        if last[i] == n:
            held[i], each[i] = {}, 0
    opt = parts.get((-1, roles.OPTIMIZE))
    if opt is not None:
        here = persist + own[opt.key][0]
        rows.append(("optimizer", here))
        if here > peak:
            peak, at = here, "optimizer"
    return PipelineMemory(peak, persist, at, held_peak, tuple(rows))


def _held_bytes(held: dict[str, str | None], sizes: dict[str, int]) -> int:
    """The device bytes of one micro-batch's held values: each storage once (None: a persistable's)."""
    return sum(sizes[o] for o in set(held.values()) if o is not None)


def _own(part, dims: dict[str, int], device: str) -> tuple[int, dict[str, tuple[str | None, int]]]:  # noqa: ANN001
    """(the most bytes the phase's run adds to what the worker holds, each value it hands on ->
    (the value whose storage it is on, that storage's bytes)): its estimate with the values it is
    handed and hands on live through the run, less its persistables and the handed values
    (held by the worker already)."""
    q = part.program
    loss = [q.loss_name] if q.loss_name else []
    kept = tuple(dict.fromkeys((*part.carried_in, *part.carried_out, *loss)))
    est = estimate_memory(q, dims=dims, fetches=kept, workspace=False, device=device)

    def nbytes(x: str | None) -> int:  # a var only another device makes is None here: no bytes
        v = q.vars[x] if x is not None else None
        return 0 if v is None or v.device not in (None, device) else v.nbytes(dims) or 0

    handed = sum(nbytes(o) for o in {est.storage_of[x] for x in part.carried_in if x not in part.host_out})
    # what may share a persistable's or a constant's storage is handed on as a copy (the plan's
    # epilogue), held in storage of its own
    aliases, _ = check_inplace(q, set(kept))
    fixed = {aliases.find(x) for x, v in q.vars.items() if v.persistable or v.kind == "constant"}
    made = {}
    for x in part.carried_out:
        if x in part.host_out:
            continue  # an offloaded copy: host bytes
        owner = x if aliases.find(x) in fixed else est.storage_of[x]
        made[x] = (owner, nbytes(owner))
    return max(est.timeline, default=est.persistable_bytes) - est.persistable_bytes - handed, made
