"""Run one worker's pipeline stage program: micro-batches through a schedule.

``Executor.run(stage_program, feed=whole_batch, fetch_list=[loss])`` lands here when
``program.pipeline`` is set. The stage program (passes/pipeline.py) comes cut into
sub-programs by (virtual stage, phase): the forward and the backward of each chunk this
worker holds, run once per micro-batch, and the optimizer, run once per step. What one
sub-program makes and a later one reads for the same micro-batch (activations the
backward needs) is fetched, held until then and fed back; the updates' reads of
accumulated grads come from the scope. The actions come from `runtime.schedules`;
Send/Recv ops talk to the neighbours through the executor's communicator (gloo on CPU,
NCCL on CUDA), every receive with the communicator's timeout.

Held activations are counted in the executor's memory accounting, so
``exe.memory_stats()`` shows what a schedule keeps in flight.

Each step starts with the communicator's handshake with the neighbours (this step's
micro-batch dims; see `runtime.comm` for the protocol: headers on an edge's first use,
data alone after), and is timed (`last_step_profile`): each action's compute (its wall time
less its waits on communication), the waits, and the work before the first action (feed
split) and after the last (optimizer), from which `schedules.simulate` gives the step's
ideal time with free communication.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from metaopt.ir import PipelineInfo, Program, did_you_mean, names, roles
from metaopt.ir.program import WEIGHT_PHASE, Phase
from metaopt.layout import groups as comm_groups
from metaopt.layout.topology import Topology
from metaopt.ops import registry
from metaopt.runtime import schedules


class PipelineState:
    """What the Send/Recv kernels see of the step in progress (``Runtime.pipeline``), and where
    this worker's peers are: `topology` (``layout.topology.Topology``) places every worker, and this
    worker is `rank` in it. Its neighbours are the ranks of its pipe group (the same data and
    model coordinate: each model-parallel rank of stage s talks to the same model-parallel rank of
    stage s+1), its replicas the ranks of its data group (the same pipe and model coordinate)."""

    def __init__(self, info: PipelineInfo, topology: Topology | None = None, rank: int | None = None) -> None:
        self.info = info
        self.topology = topology or Topology(dp_degree=info.dp_degree, pp_degree=info.num_stages)
        if self.topology.pp_degree != info.num_stages or self.topology.dp_degree != info.dp_degree:
            raise ValueError(
                f"pipeline stage program {info.stage} of {info.num_stages} (dp_degree={info.dp_degree}) "
                f"cannot run in the layout {self.topology.describe()}: num_stages must equal pp_degree and "
                "dp_degree the layout's"
            )
        if rank is None:  # one process: the layout's rank running this stage in replica 0
            rank = self.topology.get_rank(data=0, pipe=info.stage, sharding=0, model=0)
        coord = self.topology.get_coord(rank)
        if coord.pipe != info.stage:
            raise ValueError(
                f"rank {rank} runs pipeline stage {coord.pipe} in the layout {self.topology.describe()}, "
                f"but this program is stage {info.stage}"
            )
        self.rank = rank
        self.replica = coord.data  # which copy of the pipeline (data parallel over pipelines)
        self._pipe = self.topology.group_ranks("pipe", rank)  # by stage
        self._data = self.topology.group_ranks("data", rank)  # by replica
        self.stage = info.stage
        self.micro_batch = 0
        self.dims: dict[str, int] = {}

    def where(self) -> str:
        rep = f", replica {self.replica}" if self.info.dp_degree > 1 else ""
        if self.topology.mp_degree > 1:
            rep += f", model-parallel rank {self.topology.get_coord(self.rank).model}"
        return f"pipeline stage {self.stage} (worker {self.info.stage}{rep}), micro-batch {self.micro_batch}"

    def rank_of(self, stage: int) -> int:
        """The torch.distributed rank running (virtual) pipeline stage `stage` with this worker's
        data and model coordinates (its pipe group's member at that stage)."""
        return self._pipe[self.info.placement.worker(stage)]

    def dp_ranks(self) -> list[int]:
        """The ranks running this worker's stage, model-parallel slice included, in every replica
        (its data group)."""
        return list(self._data)


@dataclass
class StepProfile:
    """One pipeline step on this worker, timed on the host (on CUDA: without a device sync,
    so launch times, not kernel times). `actions` holds (action as printed, "F3" or "B0.c1",
    its compute seconds: wall time less its waits on communication)."""

    step_s: float = 0.0  # the whole step, wall time
    comm_s: float = 0.0  # waits on communication (receives, send completions, all-reduces)
    before_s: float = 0.0  # before the first action: feed split, the handshake's start
    after_s: float = 0.0  # after the last action, less waits: the optimizer
    actions: list[tuple[str, float]] = field(default_factory=list)
    # (action, start, end, seconds of it spent waiting on communication), from the step's start:
    # what the schedule picture draws (report/schedule_picture.py); a few floats per action
    intervals: list[tuple[str, float, float, float]] = field(default_factory=list)
    messages: int = 0  # pipeline messages sent and received
    headers: int = 0  # of them with a header (first use of an edge, a new shape, the switch)

    def mean_compute(self, kind: str) -> float:
        """Mean compute seconds of this worker's "F" (or "B", "W") actions."""
        times = [t for a, t in self.actions if a.startswith(kind)]
        return sum(times) / len(times) if times else 0.0


class PipelineRunner:
    def __init__(self, executor: Any, program: Program) -> None:
        info = program.pipeline
        if info is None:
            raise ValueError(f"program {program.name!r} is not a pipeline stage program")
        self.exe = executor
        self.info = info
        self.program = program
        self.state = PipelineState(info, *_layout(info))
        self.parts = _phases(program)
        self._actions: list | None = None
        self.peers = _peers(program, self.state)
        self.profile: StepProfile | None = None  # the last step's (`last_step_profile`)
        self._started = False

    @property
    def actions(self) -> list:
        """This worker's schedule, built at the first step, after the fed batch has been checked
        against the micro-batch count: a schedule is a few actions per micro-batch, and an
        `accumulate_steps` no batch can split (10**7) must be refused before it is built."""
        if self._actions is None:
            info = self.info
            self._actions = schedules.schedule(
                info.schedule,
                num_stages=info.num_stages,
                stage=info.stage,
                micro_batches=info.micro_batches,
                chunks=info.chunks,
            )
            if info.forward_only:  # an evaluation program: its forwards, in the schedule's order
                self._actions = [a for a in self._actions if a.kind == "F"]
        return self._actions

    # --- one step --------------------------------------------------------------------
    def run(self, feed: Mapping[str, Any], fetches: list[str]) -> list[Any]:
        t_step = time.perf_counter()
        rt = self.exe.runtime
        # one stage (gradient accumulation over micro-batches) talks to nobody
        comm = rt.comm if self.info.num_stages > 1 else None  # fails clearly without a group
        if not self._started and comm is not None:
            self._start(comm)
        m = self.info.micro_batches
        needed = {x for part in self.parts.values() for x in part.feeds}
        missing = sorted(needed - set(feed))
        if missing:
            raise KeyError(
                f"pipeline stage {self.info.stage} of program {self.program.name!r} needs feed "
                f"{missing[0]!r} (feed the whole batch on every worker)"
            )
        # every worker is fed the whole batch: its batch size gives the micro-batch size even
        # on a stage that reads no feed (shapes of what it receives are checked against it)
        micro = _split_feed(self.program, feed, m, keep=needed, size=self.info.micro_batch_size)
        if comm is not None:  # every worker knows the micro-batch dims: agree on them
            comm.start_pipeline_step(self.peers, {"batch": micro[0]["__batch__"]}, m)
        rt.pipeline = self.state
        held: dict[int, dict[str, torch.Tensor]] = {i: {} for i in range(m)}
        losses: list[torch.Tensor] = []
        outputs = self._forward_outputs(fetches)
        profile = StepProfile(before_s=time.perf_counter() - t_step)
        last = _last_action_of(self.actions)
        try:
            for n, action in enumerate(self.actions):
                t0, c0 = time.perf_counter(), _comm_seconds(comm)
                self._run_action(action, micro, held, losses, outputs)
                if last[action.micro_batch] == n:  # what phases of two chunks read (pipeline_phases)
                    self._release(held[action.micro_batch])
                waited, t1 = _comm_seconds(comm) - c0, time.perf_counter()
                profile.actions.append((str(action), t1 - t0 - waited))
                profile.intervals.append((str(action), t0 - t_step, t1 - t_step, waited))
            if comm is not None:
                comm.finish_sends()
            opt = self.parts.get((-1, roles.OPTIMIZE))
            if opt is not None:
                self.exe._run_part(opt.program, {}, [])
        finally:
            rt.pipeline = None
            for values in held.values():
                for t in values.values():
                    self.exe._tracker.release(t)
        self.profile = _finish_profile(profile, t_step, comm)
        return [torch.cat(outputs[f]) if f in outputs else self._fetch(f, losses) for f in fetches]

    def _forward_outputs(self, fetches: list[str]) -> dict[str, list[torch.Tensor]]:
        """An evaluation program's fetched forward vars (logits), each micro-batch's, put together
        along the batch after the step; a var this stage does not make is `_fetch`'s error."""
        if not self.info.forward_only:
            return {}
        made = {x for part in self.parts.values() for x in part.produced}
        out = {}
        for f in fetches:
            var = self.program.vars.get(f)
            if f == self.info.loss or f not in made or var is None or var.persistable:
                continue
            if not var.shape or not isinstance(var.shape[0], str):
                raise NotImplementedError(
                    f"fetch {f!r} from pipeline stage {self.info.stage}: its shape {list(var.shape or ())} "
                    "does not start with the batch, so its micro-batches' values cannot be put together"
                )
            out[f] = []
        return out

    def _run_action(
        self,
        action: schedules.Action,
        micro: list[dict[str, Any]],
        held: dict[int, dict[str, torch.Tensor]],
        losses: list[torch.Tensor],
        outputs: dict[str, list[torch.Tensor]],
    ) -> None:
        """One F, B or W of a micro-batch: its part's program, fed the micro-batch's slice and
        what earlier parts made for it; what later parts read is held (and counted); fetched
        forward vars of an evaluation program (`outputs`) are kept per micro-batch."""
        tracker, loss = self.exe._tracker, self.program.loss_name
        k = self.info.placement.vstage(self.info.stage, action.chunk)
        part = self.parts[(k, PHASE_OF[action.kind])]
        i = action.micro_batch
        self.state.stage, self.state.micro_batch = k, i
        self.state.dims = {"batch": micro[i]["__batch__"]}
        feed_i = {x: micro[i][x] for x in part.feeds}
        if names.micro_batch() in part.program.inputs:
            feed_i[names.micro_batch()] = torch.tensor(i, dtype=torch.int64)
        carried = {x: held[i].pop(x) if x in part.last_use else held[i][x] for x in part.carried_in}
        want = list(part.carried_out) + ([loss] if loss in part.produced else [])
        want += [x for x in outputs if x in part.produced and x not in want]
        out = self.exe._run_part(part.program, feed_i, want, carried)
        for x in part.last_use:
            tracker.release(carried[x])
        for x, t in zip(want, out, strict=True):
            if x == loss:
                losses.append(t.detach())
            if x in outputs:
                outputs[x].append(t.detach())
            if x in part.carried_out:
                held[i][x] = t
                tracker.acquire(t, x in part.host_out)  # offloaded copies: host bytes

    def _release(self, values: dict[str, torch.Tensor]) -> None:
        for t in values.values():
            self.exe._tracker.release(t)
        values.clear()

    def _fetch(self, name: str, losses: list[torch.Tensor]) -> Any:
        if name == self.info.loss:
            # the mean over the micro-batches: the full batch's loss (equal micro-batches);
            # the loss lives on the last stage
            return torch.stack(losses).mean() if self.program.loss_name == name else None
        var = self.program.vars.get(name)
        if var is None:
            hint = did_you_mean(name, [*self.program.vars, *([self.info.loss] if self.info.loss else [])])
            raise KeyError(
                f"fetch {name!r}: not a var of pipeline stage {self.info.stage} of {self.program.name!r} "
                f"(the loss is {self.info.loss!r}){hint}"
            )
        if var.persistable:
            return self.exe.scope[name].clone()
        raise NotImplementedError(
            f"fetch {name!r} from a pipeline stage program: only the loss and persistables "
            "(params, optimizer state) can be fetched from a pipelined training step; forward vars "
            "from its evaluation program (main.clone(for_test=True))"
        )

    def _start(self, comm) -> None:
        """First run: make the tied params' groups (every worker makes every group, in the same
        order, as torch requires: one per tied group in each pipe group of the layout), give each
        tied group's copies the value of its first worker, and each stage's replicas the values
        of replica 0. The data and pipe groups are the layout's (`_layout`), made once."""
        topo = self.state.topology
        for pipe in topo.get_comm_list("pipe"):
            for group in self.info.groups:
                comm.group([pipe[r] for r in group])
        # a stage's copies: its replicas (data axis) and, beside ZeRO, its sharding group's workers,
        # which are data-parallel replicas too (each updates its slice, from equal params)
        for axis in ("sharding", "data"):
            copies = self.state.topology.group_ranks(axis, self.state.rank)
            if len(copies) == 1:
                continue
            persist = [v.name for v in self.program.vars.values() if v.kind in ("param", "buffer")]
            self.exe._materialise(self.program, persist)
            for name in persist:
                comm.broadcast(self.exe.scope[name], copies[0], f"{name!r} ({axis} rank 0's)", copies)
        tied: list[tuple[str, tuple[int, ...]]] = []
        for op in self.program.ops:  # the collectives over the copies of a tied param
            row = registry.get(op.type)
            if row is not None and row.collective and op.attrs.get("ranks") is not None and op.origin:
                tied.append((op.origin, tuple(op.attrs["ranks"])))
        self.exe._materialise(self.program, [name for name, _ in tied])
        for name, ranks in sorted(tied):
            comm.broadcast(
                self.exe.scope[name],
                self.state.rank_of(min(ranks)),
                f"the tied param {name!r}",
                [self.state.rank_of(r) for r in ranks],
            )
        self._started = True


def last_step_profile(executor: Any, program: Program) -> StepProfile | None:
    """The timing of `executor`'s last step of pipeline stage program `program` (None
    before its first step): per-action compute, communication waits, the rest."""
    return executor._pipeline_runner(program).profile


def _last_action_of(actions: list) -> dict[int, int]:
    """micro-batch -> the index of its last action in this worker's list."""
    return {a.micro_batch: n for n, a in enumerate(actions)}


def _comm_seconds(comm) -> float:
    return comm.seconds if comm is not None else 0.0


def _finish_profile(profile: StepProfile, t_step: float, comm) -> StepProfile:
    profile.step_s = time.perf_counter() - t_step
    profile.comm_s = _comm_seconds(comm)  # the communicator's count starts with the step
    rest = profile.step_s - profile.comm_s - sum(t for _, t in profile.actions) - profile.before_s
    profile.after_s = max(0.0, rest)
    if comm is not None:
        profile.messages, profile.headers = comm.messages, comm.headers
    return profile


def _peers(program: Program, state: PipelineState) -> list[int]:
    """The ranks this worker sends to or receives from (its neighbours' in this replica)."""
    stages = {op.attrs["peer"] for op in program.ops if "peer" in op.attrs}  # Send and Recv
    return sorted({state.rank_of(k) for k in stages})


_MADE_HERE: list[Topology] = []  # the layout `_layout` made groups for (no hybrid_configs)


def _layout(info: PipelineInfo) -> tuple[Topology | None, int | None]:
    """(the job's layout, this worker's rank in it); (None, None) in one process (the layout
    dp_degree x num_stages then; a step that needs a peer fails at its first message, naming
    fleet.init, as every collective does without a process group).

    The layout is the one whose groups fleet.init made for hybrid_configs (dp x pp x mp), else,
    for a pipeline laid out by pipeline_configs alone, dp_degree x num_stages, whose groups are
    made here, by every worker at its first run (the same function fleet.init uses:
    ``layout.groups.make_topology_groups``), so no group is made twice, nor placed by a second
    formula."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None, None
    rank, topo = dist.get_rank(), comm_groups.topology()
    fits = topo is not None and (topo.pp_degree, topo.dp_degree) == (info.num_stages, info.dp_degree)
    if topo is not None and not fits and not (_MADE_HERE and topo is _MADE_HERE[0]):
        raise ValueError(
            f"this pipeline stage program has num_stages={info.num_stages}, dp_degree={info.dp_degree}, "
            f"but fleet.init laid the workers out as {topo.describe()} (hybrid_configs): minimize "
            "with the strategy fleet.init was given"
        )
    if not fits:
        topo = Topology(dp_degree=info.dp_degree, pp_degree=info.num_stages)
        if topo.world_size() != dist.get_world_size():
            raise ValueError(
                f"a pipeline of {info.num_stages} stages x dp_degree={info.dp_degree} needs "
                f"{topo.world_size()} workers, the job has {dist.get_world_size()}"
            )
        comm_groups.make_topology_groups(topo, rank, topo.group_axes())
        _MADE_HERE[:] = [topo]
    return topo, rank


PHASE_OF = {"F": roles.FORWARD, "B": roles.BACKWARD, "W": WEIGHT_PHASE}  # an action's phase


def _phases(p: Program) -> dict[tuple[int, str], Phase]:
    """The stage program's sub-programs (passes/pipeline_phases.py), keyed (virtual stage,
    phase); the optimizer is (-1, "optimize")."""
    if p.phases is None or not p.phases.matches(p):
        state = "has no phases" if p.phases is None else "was changed after its phases were cut"
        raise ValueError(
            f"pipeline stage program {p.name!r} {state}: the executor runs the sub-programs "
            "passes.pipeline_phases cuts (fleet's minimize does it last; for a program split by "
            "passes.pipeline.pipeline directly, call passes.pipeline_phases.pipeline_phases on each stage)"
        )
    return {part.key: part for part in p.phases.parts}


def _split_feed(
    p: Program, feed: Mapping[str, Any], m: int, keep: set[str], size: int | None = None
) -> list[dict[str, Any]]:
    """The `keep` feeds cut into `m` equal micro-batches along dim 0 (every feed is checked:
    the micro-batch size comes from the whole batch, whichever feeds this stage reads; with
    `size`, Fleet's micro_batch_size, the batch must be `size` x `m`). Every feed is checked
    before anything is allocated per micro-batch."""
    batch = None
    tensors = {}
    for name, value in feed.items():
        t = torch.as_tensor(value)
        n = t.shape[0] if t.dim() else None
        if size is not None and n != size * m:
            raise ValueError(
                f"pipeline: feed {name!r} has batch {n} ({list(t.shape)}), but pipeline_configs asks "
                f"for micro_batch_size={size} x accumulate_steps={m} = {size * m}: feed batches of "
                f"{size * m}, or set micro_batch_size to None (any batch accumulate_steps divides)"
            )
        if n is None or n % m or n == 0:
            raise ValueError(
                f"pipeline: feed {name!r} has batch {n} ({list(t.shape)}), which does not split into "
                f"{m} equal non-empty micro-batches (pipeline_configs['accumulate_steps'])"
            )
        if batch is not None and n != batch:
            raise ValueError(f"pipeline: feed {name!r} has batch {n}, other feeds have {batch}")
        batch = n
        tensors[name] = t
    out: list[dict[str, Any]] = [{} for _ in range(m)]
    for name, t in tensors.items():
        if name in keep:  # a stage holds only what it reads (labels: the last stage)
            for i, piece in enumerate(t.chunk(m)):
                # its own storage: a value a later phase holds may be a view of the feed (the
                # ids an embedding's grad reads), and must hold its micro-batch, not the batch
                out[i][name] = piece.clone()
    for i in range(m):
        out[i]["__batch__"] = (batch or 0) // m
    return out
