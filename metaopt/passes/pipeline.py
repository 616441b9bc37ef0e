"""Pipeline parallel: split one training program into a stage program per worker.

    plan = plan_pipeline(program, num_stages=2, cuts=["fc2"], micro_batches=4, grads=grads, loss_grad=seed)
    programs = apply_pipeline(program, plan)   # one per worker

(`grads`, `seed`: what append_backward made: each param's grad, the loss grad's seed; the
training driver hands them on through its context.)

The input is the finished single-process training program (forward, backward with any
recompute/offload, optimizer). With ``chunks`` = v > 1 the model is cut into
``num_stages * v`` virtual stages, placed on the workers by the schedule's `StagePlacement`:
in a loop (interleaved: worker w holds virtual stages w, w + num_stages, ...) or in a V (ZB-V:
worker w holds w and 2*num_stages-1-w, so the hand-off between stages num_stages-1 and
num_stages stays on one worker and needs no Send/Recv).

* **Stages of the forward**: ``cuts`` are module paths or var names where a new virtual
  stage begins (a module's first op, or a var's producer), or ``"auto"``: boundaries at
  module starts that balance the ops' estimated costs (`registry.op_cost`: the op table's
  cost rows; by default 2 x params read + bytes produced, per sample, views free). Forward
  ops then have non-decreasing stages in program order.
* **Everything else follows its origin**: a backward / recompute / offload / prefetch op
  runs where the forward var it stems from (``origin``) was made; an update runs where its
  param is read; ``lr-sched`` ops run on every worker (each keeps its own step and LR).
  A param read in several stages (tied, e.g. GPT's embedding and LM head) is held by each;
  its grad is made per holding stage, accumulated over the micro-batches per stage, summed on
  each worker holding it in several chunks (ZB-V's worker 0 holds both the embedding and the
  head) and all-reduced among exactly the holders' workers before the update, so the copies
  stay identical. Recompute partition's slice and gather of a
  checkpoint (and offload's copies of the slice) run in the stage(s) whose backward reads the
  gathered value: a checkpoint received across a cut is sliced by the receiver.
* **Transfers**: a var made in virtual stage s and read in t != s is sent by var name,
  ``Send(x, peer=k+1)`` / ``x = Recv(peer=k)``, between neighbours, relayed through the
  stages between (activations forward, grads backward). Receives come first in a stage's
  phase, in the order the neighbour sends, so both sides agree without tags.
* **Micro-batches**: the executor runs each worker's forward and backward once per
  micro-batch and the optimizer once per step. The loss grad is scaled by 1/M, and every
  param grad is accumulated by ``g@MERGED@NEW = GradMerge(g@MERGED, g, micro_batch)``
  (a copy at micro-batch 0, then in-place adds) that the update reads.

The pass is pure; the plans' and programs' meaning lives in op fields (``stage``,
``role``, ``origin``) and in ``Program.pipeline``.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import torch

from metaopt.ir import Op, PipelineInfo, Program, Var, did_you_mean, names, roles, torch_dtype
from metaopt.ir.printer import fmt_op
from metaopt.ir.program import StagePlacement
from metaopt.ops import registry
from metaopt.passes.data_parallel import reduce_ops, reduced_var
from metaopt.passes.one_call import one_call

MICRO_BATCH = names.micro_batch()


class PipelineError(ValueError):
    pass


def phase_of(op: Op) -> str:
    """forward (once per micro-batch, first), backward (per micro-batch) or optimize (per step)."""
    phase = roles.phase(op.role)
    if phase is None:  # data parallel's comm ops: a pipeline replicates itself (dp_degree)
        raise PipelineError(f"pipeline: op role {op.role!r} has no pipeline phase: {op.type} -> {op.outputs}")
    return phase


@dataclass
class PipelinePlan:
    num_stages: int
    chunks: int
    micro_batches: int
    schedule: str
    cuts: list[tuple[str, int]]  # (cut, index of the op that begins its virtual stage)
    op_stages: list[tuple[int, ...]]  # virtual stages running each op of the input program
    costs: list[float]  # estimated forward cost per virtual stage
    holders: dict[str, tuple[int, ...]]  # param -> virtual stages reading it
    grads: dict[str, str]  # param -> its grad as the backward made it
    transfers: list[tuple[str, int, int]] = field(default_factory=list)  # (var, from, to) neighbours
    # stage -> {recomputed copy made in another stage: the forward value it equals}: a
    # recompute segment crossing a cut reads, in the later stage, the received original
    substitute: dict[int, dict[str, str]] = field(default_factory=dict)
    sends: dict[tuple[int, str], list[str]] = field(default_factory=dict)  # (stage, phase) -> vars
    recvs: dict[tuple[int, str], list[str]] = field(default_factory=dict)  # (stage, phase) -> vars
    # recompute partition: checkpoint -> the virtual stages that slice and gather it
    partitioned: dict[str, tuple[int, ...]] = field(default_factory=dict)
    loss_grad: str | None = None  # the backward's seed: the split scales it by 1/M
    dp_degree: int = 1  # replicas of the whole pipeline: each update reads its grad averaged over them
    micro_batch_size: int | None = None  # Fleet's: the fed batch must be it x micro_batches (runtime)
    # ZeRO stage 1 (sharding x pipeline): the merged grads are reduce-scattered over the sharding
    # group, each worker keeping its 1/N for the sharding step's updates on slices
    scatter_parts: int | None = None

    @property
    def virtual_stages(self) -> int:
        return self.num_stages * self.chunks

    @property
    def placement(self) -> StagePlacement:
        """Which worker runs each virtual stage (the schedule's: a loop, or ZB-V's V)."""
        return StagePlacement.of(self.schedule, self.num_stages, self.chunks)

    @property
    def shared(self) -> dict[str, tuple[int, ...]]:
        """Params held by more than one worker -> those workers."""
        out = {}
        for w, stages in self.holders.items():
            workers = tuple(sorted({self.worker(k) for k in stages}))
            if len(workers) > 1:
                out[w] = workers
        return out

    @property
    def multi_stage(self) -> dict[str, tuple[int, ...]]:
        """Params read by more than one virtual stage -> those stages: each makes its own part
        of the grad (on one worker or several)."""
        return {w: stages for w, stages in self.holders.items() if len(stages) > 1}

    def worker(self, stage: int) -> int:
        return self.placement.worker(stage)

    def __str__(self) -> str:
        lines = [
            f"pipeline: {self.num_stages} workers x {self.chunks} chunk(s), {self.micro_batches} "
            f"micro-batches{'' if self.micro_batch_size is None else f' of {self.micro_batch_size}'}, "
            f"schedule {self.schedule}"
        ]
        total = sum(self.costs) or 1.0
        begins = ["<start>", *[c for c, _ in self.cuts]]
        for k in range(self.virtual_stages):
            n = sum(1 for s in self.op_stages if k in s)
            lines.append(
                f"  stage {k} (worker {self.worker(k)}): begins at {begins[k]}, {n} ops, "
                f"{100 * self.costs[k] / total:.0f}% of the forward cost"
            )
        if self.scatter_parts:
            lines.append(
                f"  merged grads reduce-scattered over the {self.scatter_parts} workers of each sharding "
                "group (ZeRO), each keeping its 1/N"
                + (f", then all-reduced over {self.dp_degree} replicas" if self.dp_degree > 1 else "")
            )
        for w, workers in self.shared.items():
            lines.append(f"  shared {w}: workers {list(workers)} (grads all-reduced among them)")
        for c, stages in self.partitioned.items():
            lines.append(f"  recompute partition of {c}: sliced and gathered in stage(s) {list(stages)}")
        lines.append(f"  transfers: {len(self.transfers)} sends between neighbours")
        return "\n".join(lines)


# --- planning ------------------------------------------------------------------------------


def plan_pipeline(
    p: Program,
    *,
    num_stages: int,
    cuts: list[str] | str = "auto",
    micro_batches: int = 1,
    schedule: str = "1F1B",
    chunks: int = 1,
    grads: Mapping[str, str],
    loss_grad: str | None = None,
    dp_degree: int = 1,
    micro_batch_size: int | None = None,
    scatter_parts: int | None = None,
) -> PipelinePlan:
    """Assign every op of `p` to its virtual stage(s) and list the transfers (see module doc).

    `grads`: each param's grad as the backward made it (append_backward's pairs); `loss_grad`:
    the backward's seed; `dp_degree`: replicas of the whole pipeline (data parallel) beside the
    `scatter_parts` workers of a sharding group (ZeRO), over which the merged grads are
    reduce-scattered."""
    if dp_degree < 1:
        raise PipelineError(f"pipeline: dp_degree must be >= 1, got {dp_degree}")
    if num_stages < 1 or chunks < 1 or micro_batches < 1:
        raise PipelineError(
            f"pipeline: num_stages={num_stages}, chunks={chunks}, micro_batches={micro_batches} must be >= 1"
        )
    n_virtual = num_stages * chunks
    for op in p.ops:
        phase_of(op)  # refuses roles it cannot place (e.g. data parallel's comm ops)
    fwd = [i for i, op in enumerate(p.ops) if roles.is_forward(op.role)]
    costs_per_op = {i: registry.op_cost(p, p.ops[i]) for i in fwd}
    if cuts == "auto" or cuts == ["auto"]:
        resolved = _auto_cuts(p, fwd, costs_per_op, n_virtual)
    else:
        if isinstance(cuts, str):
            cuts = [cuts]
        resolved = _resolve_cuts(p, list(cuts), fwd, n_virtual)
    positions = [i for _, i in resolved]

    op_stages: list[tuple[int, ...]] = [()] * len(p.ops)
    made: dict[str, int] = {}  # forward var -> its virtual stage
    costs = [0.0] * n_virtual
    for i in fwd:
        k = bisect.bisect_right(positions, i)
        op_stages[i] = (k,)
        costs[k] += costs_per_op[i]
        made.update((o, k) for o in p.ops[i].outputs if o)
    holders = _holders(p, op_stages)
    placement = StagePlacement.of(schedule, num_stages, chunks)
    params = {v.name for v in p.params(trainable_only=False)}
    first_chunk = tuple(range(num_stages))  # lr-sched: one copy per worker
    producers: dict[str, set[int]] = {}
    chains: dict[str | None, list[int]] = {}  # offload/prefetch ops by the checkpoint they move
    partition = _partition_groups(p)  # recompute partition's slice + gather, by checkpoint
    in_partition = {i for idx in partition.values() for i in idx}
    for i, op in enumerate(p.ops):
        if roles.is_host_copy(op.role):
            chains.setdefault(op.origin, []).append(i)
            continue
        if i in in_partition:
            continue  # placed with their readers, below
        if op_stages[i]:
            pass
        elif op.role == "lr-sched":
            op_stages[i] = first_chunk
        elif op.role == "optimize":
            if op.origin not in holders:
                raise PipelineError(
                    f"pipeline: optimizer op {op.type} -> {op.outputs} updates no param read by the forward "
                    "(grad clipping over all stages is not implemented with a pipeline)"
                )
            op_stages[i] = holders[op.origin]
        elif op.origin in made:
            op_stages[i] = (made[op.origin],)
        elif op.origin in params and op.origin in holders:
            op_stages[i] = holders[op.origin]  # the grad sum of a (maybe tied) param: split later
        else:
            stages = {k for x in op.inputs if x in producers for k in producers[x]}
            if not stages:
                raise PipelineError(
                    f"pipeline: cannot place op {op.type} -> {op.outputs} (role {op.role}, origin "
                    f"{op.origin}): it reads nothing made in a stage"
                )
            op_stages[i] = (min(stages),)
        for o in op.outputs:
            if o:
                producers.setdefault(o, set()).update(op_stages[i])
    placed_partition = _place_partition(p, partition, op_stages, made, placement)
    _place_offload_chains(p, chains, op_stages, made)
    plan = PipelinePlan(
        num_stages, chunks, micro_batches, schedule, resolved, op_stages, costs, holders, dict(grads)
    )
    plan.partitioned = placed_partition
    plan.loss_grad, plan.dp_degree, plan.micro_batch_size = loss_grad, dp_degree, micro_batch_size
    if scatter_parts is not None and scatter_parts < 1:
        raise PipelineError(f"pipeline: scatter_parts must be >= 1, got {scatter_parts}")
    plan.scatter_parts = scatter_parts if scatter_parts != 1 else None
    plan.substitute = _cross_stage_recomputes(p, op_stages, skip=in_partition)
    _plan_transfers(p, plan)
    return plan


def check_replicated_cuts(p: Program, plan: PipelinePlan, *, split_params: Collection[str]) -> None:
    """Refuse a cut inside a tensor-parallel split region: every activation a stage sends on
    must be replicated across the model-parallel group, so each MP rank of stage s hands the
    same MP rank of stage s+1 the whole value (Megatron cuts between transformer layers).

    `split_params`: the params tensor parallel sliced. A forward value is split (or a partial
    sum) when its op reads a split param or a split value, and replicated again after a
    collective (the row-parallel layer's all-reduce, a ``collective`` row of the op table).
    A PipelineError names the first such value crossing a cut, the op making it and the stages."""
    split_params = set(split_params)
    if not split_params:
        return
    split: set[str] = set()
    made_by: dict[str, Op] = {}
    for op in p.ops:
        if not roles.is_forward(op.role):
            continue
        row = registry.get(op.type)
        reads_split = any(x in split or x in split_params for x in op.inputs if x)
        for o in op.outputs:
            if o:
                made_by[o] = op
                if reads_split and not (row is not None and row.collective):
                    split.add(o)
    for x, src, dst in plan.transfers:
        if x in split:
            raise PipelineError(
                f"pipeline: the cut between virtual stages {src} and {dst} falls inside a tensor-parallel "
                f"split region: {x!r}, made by `{fmt_op(made_by[x])}`, is split (or a partial sum) across "
                "the model-parallel group, but a stage hands the next only values every MP rank holds "
                "whole; cut at a module outside the column..row span (e.g. a transformer block's start)"
            )


def _place_offload_chains(
    p: Program, chains: dict[str | None, list[int]], op_stages: list[tuple[int, ...]], made: dict[str, int]
) -> None:
    """A checkpoint's offload, prefetch and wait go where its fetched copy is read: a
    checkpoint at a cut is made by one stage but read (received) by the next, whose
    backward is what needs it back."""
    for x, idx in chains.items():
        outs = {o for i in idx for o in p.ops[i].outputs if o}
        stages = {
            k
            for j, op in enumerate(p.ops)
            if not roles.is_host_copy(op.role) and outs.intersection(op.inputs)
            for k in op_stages[j]
        }
        if not stages:
            if x not in made:
                raise PipelineError(f"pipeline: cannot place the offload of {x!r}: nothing reads it back")
            stages = {made[x]}
        for i in idx:
            op_stages[i] = tuple(sorted(stages))


def _partition_groups(p: Program) -> dict[str, list[int]]:
    """Recompute partition's ops (passes/recompute_partition.py) by the checkpoint they hold:
    its slice (role ``partition``, origin the checkpoint) and the op reading the slice back
    (the gather), directly or through offload's host copies of the slice (which stay chains)."""
    groups: dict[str, list[int]] = {}
    derived: dict[str, str] = {}  # a slice, or a host copy of one -> its checkpoint
    for i, op in enumerate(p.ops):
        if op.role == "partition":
            groups.setdefault(op.origin, []).append(i)
            derived.update((o, op.origin) for o in op.outputs if o)
            continue
        held = {derived[x] for x in op.inputs if x in derived}
        if roles.is_host_copy(op.role):
            derived.update((o, c) for c in held for o in op.outputs if o)
            continue
        for c in held:
            groups[c].append(i)
    return groups


def _place_partition(
    p: Program,
    groups: dict[str, list[int]],
    op_stages: list[tuple[int, ...]],
    made: dict[str, int],
    placement: StagePlacement,
) -> dict[str, tuple[int, ...]]:
    """Each partitioned checkpoint's slice and gather run in every stage that reads the
    gathered value (its recompute, or a grad op reading it): that stage slices its own copy
    of the checkpoint after the forward and gathers it back there. For a checkpoint at a cut
    that is the stage that received it, not the one that made it (which only sends it and
    frees it), as Paddle slices the input of each recomputed layer wherever that layer runs.
    A stage reading it in the backward always has the whole value in its forward (made or
    received), so the slice reads what the forward already holds. Returns checkpoint -> the
    stages holding its slice."""
    out: dict[str, tuple[int, ...]] = {}
    for c, idx in groups.items():
        own = set(idx)
        gathered = {o for i in idx if p.ops[i].role != "partition" for o in p.ops[i].outputs if o}
        readers = [j for j, op in enumerate(p.ops) if j not in own and gathered.intersection(op.inputs)]
        stages = sorted({k for j in readers for k in op_stages[j]})
        if not stages:
            if c not in made:
                raise PipelineError(
                    f"pipeline: cannot place the recompute partition of {c!r}: nothing reads it back"
                )
            stages = [made[c]]
        workers = [placement.worker(k) for k in stages]
        if len(set(workers)) < len(workers):
            # one worker would make the slice and the gathered var twice (one producer each)
            raise NotImplementedError(
                f"pipeline: recompute partition of {c!r} is read back by virtual stages {stages}, two "
                "of them on one worker (chunks > 1): slicing it once per worker is not implemented; "
                "choose other cuts or leave recompute_configs['enable_partition'] False"
            )
        for i in idx:
            op_stages[i] = tuple(stages)
        out[c] = tuple(stages)
    return out


def _cross_stage_recomputes(
    p: Program, op_stages: list[tuple[int, ...]], *, skip: Collection[int] = ()
) -> dict[int, dict[str, str]]:
    """Recompute is bit-identical to the forward (RNG replay), so a stage reading a copy
    recomputed in an earlier stage reads the forward original instead (it has it: its own
    forward received it) — grads flow down the pipeline, recomputed activations never up.
    `skip`: ops that are no recomputed copy of their origin's producer (recompute partition's
    gathers, placed with their readers: `_place_partition`)."""
    producers = p.producers()
    equals: dict[str, str] = {}
    made_in: dict[str, tuple[int, ...]] = {}
    for i, op in enumerate(p.ops):
        for o in op.outputs:
            if o:
                made_in[o] = op_stages[i]
        if op.role == "recompute" and op.origin in producers and i not in skip:
            original = p.ops[producers[op.origin]]
            equals.update((r, x) for r, x in zip(op.outputs, original.outputs) if r and x and r != x)
    out: dict[int, dict[str, str]] = {}
    for i, op in enumerate(p.ops):
        for k in op_stages[i]:
            for x in op.inputs:
                if x in equals and k not in made_in[x]:
                    out.setdefault(k, {})[x] = equals[x]
    return out


def _plan_transfers(p: Program, plan: PipelinePlan) -> None:
    """Which vars each virtual stage sends to / receives from its neighbour, per phase:
    every var read in a stage that did not make it, relayed stage by stage (a worker that
    already holds the var, for an earlier chunk, passes it on without receiving it)."""
    made: dict[str, set[int]] = {}
    phase_made: dict[str, str] = {}
    for i, op in enumerate(p.ops):
        for o in op.outputs:
            if o:
                made.setdefault(o, set()).update(plan.op_stages[i])
                phase_made[o] = phase_of(op)
    local = {v.name for v in p.vars.values() if v.persistable or v.kind == "input"}
    multi = plan.multi_stage
    needs: dict[str, set[int]] = {}
    for i, op in enumerate(p.ops):
        if phase_of(op) == "optimize":
            continue  # updates read their own stage's (merged) grads
        if op.origin in multi and plan.grads.get(op.origin) in op.outputs:
            continue  # a tied param's grad sum: each holding stage sums its own parts
        for k in plan.op_stages[i]:
            for x in op.inputs:
                x = plan.substitute.get(k, {}).get(x, x)
                if x and x not in local and k not in made[x]:
                    needs.setdefault(x, set()).add(k)
    held = {x: {plan.worker(k) for k in ks} for x, ks in made.items()}
    for x in sorted(needs, key=lambda x: (min(made[x]), x)):
        phase = phase_made[x]
        src = min(made[x]) if phase == "forward" else max(made[x])
        for t in sorted(needs[x]):
            if (phase == "forward" and t < src) or (phase == "backward" and t > src) or phase == "optimize":
                raise PipelineError(
                    f"pipeline: virtual stage {t} reads {x!r}, made in the {phase} of stage {src}: only "
                    "activations flow to later stages and grads to earlier ones"
                )
        far = max(needs[x]) if phase == "forward" else min(needs[x])
        step = 1 if phase == "forward" else -1
        for k in range(src + step, far + step, step):
            w = plan.worker(k)
            if w in held[x]:
                continue
            held[x].add(w)
            plan.sends.setdefault((k - step, phase), []).append(x)
            plan.recvs.setdefault((k, phase), []).append(x)
            plan.transfers.append((x, k - step, k))


def _module_starts(p: Program, fwd: list[int]) -> dict[str, int]:
    starts: dict[str, int] = {}
    for i in fwd:
        scope = p.ops[i].scope
        parts = scope.split(".") if scope else []
        for n in range(1, len(parts) + 1):
            starts.setdefault(".".join(parts[:n]), i)
    return starts


def _resolve_cuts(p: Program, cuts: list[str], fwd: list[int], n_virtual: int) -> list[tuple[str, int]]:
    if len(cuts) != n_virtual - 1:
        raise PipelineError(
            f"pipeline_configs['cuts'] names {len(cuts)} cut(s) but {n_virtual} (virtual) stages need "
            f"{n_virtual - 1}: {cuts}"
        )
    starts = _module_starts(p, fwd)
    producers = p.producers()
    fwd_set = set(fwd)
    out = []
    for c in cuts:
        if c in starts:
            out.append((c, starts[c]))
        elif c in producers and producers[c] in fwd_set:
            out.append((c, producers[c]))
        elif c in p.vars:
            # A real var that no forward op produces: say what it is instead of a did-you-mean.
            v = p.vars[c]
            made_by = "produced by no op"
            if c in producers:
                made_by = f"produced by a {p.ops[producers[c]].role} op"
            raise PipelineError(
                f"pipeline_configs['cuts']: {c!r} is a {v.kind} var {made_by}; a cut is a module path "
                "or an activation the forward produces (the first op of the new stage is its producer)"
            )
        else:
            hint = did_you_mean(c, [*starts, *p.vars])
            raise PipelineError(
                f"pipeline_configs['cuts']: {c!r} is neither a module path nor a forward var{hint}"
            )
    for (a, i), (b, j) in zip(out, out[1:]):
        if j <= i:
            raise PipelineError(
                f"pipeline_configs['cuts']: {b!r} begins at op {j}, not after {a!r} (op {i}): "
                "cuts must follow the forward's order, each making a non-empty stage"
            )
    if out and out[0][1] <= fwd[0]:
        raise PipelineError(f"pipeline_configs['cuts']: {out[0][0]!r} leaves stage 0 empty")
    return out


def _auto_cuts(p: Program, fwd: list[int], costs: dict[int, float], n_virtual: int) -> list[tuple[str, int]]:
    starts = _module_starts(p, fwd)
    candidates: dict[int, str] = {}
    for name, i in sorted(starts.items(), key=lambda kv: (kv[1], kv[0].count("."))):
        candidates.setdefault(i, name)  # the outermost module beginning at op i names the cut
    positions = sorted(i for i in candidates if i > fwd[0])
    if len(positions) < n_virtual - 1:
        raise PipelineError(
            f"pipeline cuts='auto': {n_virtual} stages need {n_virtual - 1} module boundaries, "
            f"the forward has {len(positions)}"
        )
    prefix, acc = {}, 0.0
    for i in fwd:
        prefix[i] = acc  # cost before op i
        acc += costs[i]
    chosen: list[int] = []
    for k in range(1, n_virtual):
        target = acc * k / n_virtual
        left = n_virtual - 1 - k  # boundaries still to place after this one
        pool = [i for i in positions if (not chosen or i > chosen[-1])]
        pool = pool[: len(pool) - left] if left else pool
        chosen.append(min(pool, key=lambda i: abs(prefix[i] - target)))
    return [(candidates[i], i) for i in chosen]


def _holders(p: Program, op_stages: list[tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    out: dict[str, set[int]] = {}
    for i, op in enumerate(p.ops):
        if roles.is_forward(op.role):
            for x in op.inputs:
                if x and p.vars[x].kind == "param":
                    out.setdefault(x, set()).update(op_stages[i])
    return {w: tuple(sorted(s)) for w, s in out.items()}


# --- rewriting -----------------------------------------------------------------------------


def apply_pipeline(p: Program, plan: PipelinePlan) -> list[Program]:
    """One stage program per pipeline worker, as `plan` places the ops; ``Program.pipeline``
    set on each. With ``plan.dp_degree`` > 1 every replica of the pipeline runs the same stage
    programs, and each update reads its grad averaged over the stage's replicas (accumulated
    over micro-batches)."""
    return _Splitter(p, plan, plan.dp_degree, plan.loss_grad).programs()


pipeline = one_call(plan_pipeline, apply_pipeline)


@dataclass
class _StageOps:
    forward: list[Op] = field(default_factory=list)
    backward: list[Op] = field(default_factory=list)


class _Splitter:
    def __init__(self, p: Program, plan: PipelinePlan, dp_degree: int, loss_grad: str | None) -> None:
        self.p, self.plan = p, plan
        self.grads, self.loss_grad = plan.grads, loss_grad
        self.dp_degree = dp_degree
        self.V = plan.virtual_stages
        self.shared = plan.shared  # params held by several workers: grads all-reduced among them
        self.multi = plan.multi_stage  # params read by several virtual stages: grads made per stage
        self.extra_vars: dict[str, Var] = {}
        self.extra_values: dict[str, torch.Tensor] = {}
        self.extra_fills: dict[str, float] = {}  # Program.fills of the extra values
        self.extra_updates: dict[int, dict[str, str]] = {}  # worker -> updates it adds
        self.renames: dict[int, dict[str, str]] = {}  # worker -> {grad read by O: merged/reduced}

    # the stage ops per phase, before transfers: (virtual stage -> ops)
    def _assign(self) -> tuple[list[_StageOps], dict[int, list[Op]]]:
        stages = [_StageOps() for _ in range(self.V)]
        optimize: dict[int, list[Op]] = {}
        seed = self._loss_seed()
        for i, op in enumerate(self.p.ops):
            updated: set[int] = set()  # workers holding this op's update (once each)
            for k in self.plan.op_stages[i]:
                phase = phase_of(op)
                if phase == "optimize" and self.plan.worker(k) in updated:
                    continue  # a param two chunks of one worker read (ZB-V's tied embedding)
                updated.add(self.plan.worker(k))
                sub = self.plan.substitute.get(k, {})
                placed = _with(op, stage=k, inputs=[sub.get(x, x) for x in op.inputs])
                if i == seed:
                    placed = self._scaled_seed(placed)
                if phase == "optimize":
                    optimize.setdefault(self.plan.worker(k), []).append(placed)
                elif op.origin in self.multi and self.grads.get(op.origin) in op.outputs:
                    stages[k].backward.append(self._local_grad_sum(placed, k, i))
                else:
                    getattr(stages[k], phase).append(placed)
        for st in stages:
            st.backward = _drop_unread_recomputes(st.backward)
        return stages, optimize

    def _loss_seed(self) -> int | None:
        """The op making the loss grad from constants (append_backward's seed)."""
        target = self.loss_grad
        if target is None:
            return None
        consts = {v.name for v in self.p.vars.values() if v.kind == "constant"}
        for i, op in enumerate(self.p.ops):
            if target in op.outputs and all(x in consts for x in op.inputs if x):
                return i
        return None

    def _scaled_seed(self, op: Op) -> Op:
        m = self.plan.micro_batches
        if m == 1:
            return op
        const = op.inputs[0]
        name = names.fresh(names.divided(const, m), {**self.p.vars, **self.extra_vars})
        v = self.p.vars[const]
        self.extra_vars[name] = Var(name, v.dtype, v.shape, "constant")
        self.extra_values[name] = self.p.values[const] / m  # the loss grad of a mean over M micro-batches
        return _with(op, inputs=[name, *op.inputs[1:]])

    def _local_grad_sum(self, op: Op, k: int, i: int) -> Op:
        """A tied param's grad sum, restricted to the parts made in virtual stage k."""
        producers = self.p.producers()
        local = [x for x in op.inputs if x and k in self.plan.op_stages[producers[x]]] if op.inputs else []
        out = names.stage_part(op.outputs[0], k)
        v = self.p.vars[op.outputs[0]]
        self.extra_vars[out] = Var(out, v.dtype, v.shape, "grad")
        if len(local) == 1:
            return Op("Identity", local, [out], role=op.role, stage=k, scope=op.scope, origin=op.origin)
        return Op("GradSum", local, [out], role=op.role, stage=k, scope=op.scope, origin=op.origin)

    def programs(self) -> list[Program]:
        stages, optimize = self._assign()
        self._merge_grads(stages, optimize)
        self._place(stages, self.plan.sends, self.plan.recvs)
        return [self._program(w, stages, optimize.get(w, [])) for w in range(self.plan.num_stages)]

    # --- grad accumulation over micro-batches (and tied params' all-reduce) ---------------
    def _merge_grads(self, stages: list[_StageOps], optimize: dict[int, list[Op]]) -> None:
        for w, ops in optimize.items():
            reads: dict[str, str] = {}
            optimize_sums: list[Op] = []  # a param's parts summed on this worker, before any comm
            for op in ops:
                if op.role != "optimize" or op.origin is None:
                    continue
                g = self.grads.get(op.origin)
                if g is None or g not in op.inputs:
                    continue
                reads[g] = self._merge_parts(stages, optimize_sums, op.origin, g, w)
            comm = list(optimize_sums)
            if reads and (self.dp_degree > 1 or self.plan.scatter_parts):
                reads = self._average(reads, comm, w)
            renamed = []
            for op in ops:
                renamed.append(_with(op, inputs=[reads.get(x, x) for x in op.inputs]))
            # tied params: sum the holders' merged grads before their updates
            for param, workers in self.shared.items():
                g = self.grads.get(param)
                if w in workers and g in reads:
                    out = names.reduced(g)  # like what it sums: whole, or a ZeRO slice
                    self.extra_vars[out] = self.extra_vars[reads[g]].copy(name=out)
                    comm.append(
                        Op(
                            "AllReduce",
                            [reads[g]],
                            [out],
                            {"reduce": "sum", "ranks": list(workers)},
                            role="optimize",
                            stage=w,
                            origin=param,
                        )
                    )
                    renamed = [
                        _with(op, inputs=[out if x == reads[g] else x for x in op.inputs]) for op in renamed
                    ]
            optimize[w] = comm + renamed

    def _average(self, reads: dict[str, str], comm: list[Op], w: int) -> dict[str, str]:
        """Data parallel over pipeline replicas: this stage's merged grads averaged over the
        stage's replicas (`comm` gets the collectives); beside sharding (ZeRO stage 1), reduce-
        scattered over the sharding group first, each worker keeping its 1/N slice, which the
        sharding step's updates read (then all-reduced over the data group, if any)."""
        parts = self.plan.scatter_parts
        avg = {}
        for g, merged in reads.items():
            avg[g] = names.reduced(merged)
            self.extra_vars[avg[g]] = reduced_var(avg[g], self.extra_vars[merged], parts)
        ops = reduce_ops(
            self.extra_vars,
            list(reads.values()),
            list(avg.values()),
            scatter_parts=parts,
            replicas=self.dp_degree > 1,
            group="data_parallel",
            role="optimize",
        )
        comm += [_with(op, stage=w) for op in ops]
        return avg

    def _merge_parts(self, stages: list[_StageOps], sums: list[Op], param: str, g: str, w: int) -> str:
        """The grad `g` of `param` accumulated over the micro-batches on worker `w`: each virtual
        stage of `w` reading `param` accumulates its own part (no stage waits for another's W),
        and the parts are summed once per step, before the update (and any all-reduce)."""
        if param not in self.multi:
            (k,) = (s for s in self.plan.holders[param] if self.plan.worker(s) == w)
            return self._merge(stages[k], g, g, w, k, param)
        parts = [
            self._merge(stages[k], names.stage_part(g, k), g, w, k, param)
            for k in self.plan.holders[param]
            if self.plan.worker(k) == w
        ]
        if len(parts) == 1:
            return parts[0]
        out = names.merged(g)  # free: a multi-stage param's accumulators are its parts'
        self.extra_vars[out] = Var(out, self.p.vars[g].dtype, self.p.vars[g].shape, "grad")
        sums.append(Op("GradSum", parts, [out], role="optimize", stage=w, origin=param))
        return out

    def _merge(self, st: _StageOps, grad: str, param_grad: str, w: int, k: int, param: str) -> str:
        acc = names.merged(grad)
        new = names.new_state(acc)
        v = self.p.vars[param_grad]
        self.extra_vars[acc] = Var(acc, v.dtype, v.shape, "opt_state")
        if self.p.is_meta(param):  # a param of an export on meta: its accumulator filled at first use
            self.extra_values[acc] = torch.empty(v.shape, dtype=torch_dtype(v.dtype), device="meta")
            self.extra_fills[acc] = 0.0
        else:
            self.extra_values[acc] = torch.zeros(v.shape, dtype=torch_dtype(v.dtype))
        self.extra_vars[new] = Var(new, v.dtype, v.shape, "grad")
        self.extra_updates.setdefault(w, {})[acc] = new
        self.extra_vars.setdefault(MICRO_BATCH, Var(MICRO_BATCH, "int64", (), "input"))
        merge = Op("GradMerge", [acc, grad, MICRO_BATCH], [new], role="backward", stage=k, origin=param_grad)
        # right after the grad is final, so it is freed early
        at = next((j for j, op in enumerate(st.backward) if grad in op.outputs), len(st.backward) - 1)
        st.backward.insert(at + 1, merge)
        return new

    def _place(self, stages, sends, recvs) -> None:
        order = {"forward": range(self.V), "backward": range(self.V - 1, -1, -1)}
        for phase, ks in order.items():
            step = 1 if phase == "forward" else -1
            emitted: dict[int, list[str]] = {}  # stage -> vars sent to its neighbour, in send order
            for k in ks:
                in_vars = recvs.get((k, phase), [])
                if in_vars:
                    in_vars = sorted(in_vars, key=emitted.get(k - step, []).index)
                ops, sent = self._stage_phase(
                    getattr(stages[k], phase), in_vars, sends.get((k, phase), []), k, step, phase
                )
                emitted[k] = sent
                setattr(stages[k], phase, ops)

    def _stage_phase(
        self, ops: list[Op], in_vars: list[str], out_vars: list[str], k: int, step: int, phase: str
    ) -> tuple[list[Op], list[str]]:
        """Receives first (in the neighbour's send order), then the ops, each send right
        after the op making its var (or at once, for a var already on this worker)."""
        var = {**self.p.vars, **self.extra_vars}
        new = [_recv(x, var[x], k, k - step, phase) for x in in_vars]
        made_here = {o for op in ops for o in op.outputs if o}
        pending = list(out_vars)
        sent: list[str] = []
        for i in range(-1, len(ops)):
            if i >= 0:
                new.append(ops[i])
            for x in list(pending):
                if (i < 0 and x not in made_here) or (i >= 0 and x in ops[i].outputs):
                    new.append(_send(x, var[x], k, k + step, phase))
                    sent.append(x)
                    pending.remove(x)
        if pending:
            raise PipelineError(f"pipeline: stage {k} cannot send {pending} in its {phase}")
        return new, sent

    # --- one worker's program ----------------------------------------------------------------
    def _program(self, w: int, stages: list[_StageOps], optimize: list[Op]) -> Program:
        p, plan = self.p, self.plan
        mine = [k for k in range(self.V) if plan.worker(k) == w]
        ops = [op for k in mine for op in stages[k].forward]
        ops += [op for k in reversed(mine) for op in stages[k].backward]
        ops += optimize
        q = Program(p.name)
        q.pipeline = PipelineInfo(
            stage=w,
            num_stages=plan.num_stages,
            micro_batches=plan.micro_batches,
            schedule=plan.schedule,
            chunks=plan.chunks,
            groups=tuple(dict.fromkeys(self.shared.values())),
            dp_degree=self.dp_degree,
            loss=p.loss_name,
            micro_batch_size=plan.micro_batch_size,
        )
        allvars = {**p.vars, **self.extra_vars}
        values = {**p.values, **self.extra_values}
        fills = {**p.fills, **self.extra_fills}
        used = dict.fromkeys(x for op in ops for x in (*op.inputs, *op.outputs) if x)
        produced = {o for op in ops for o in op.outputs if o}
        for name in allvars:  # the input program's order, then the pass's vars
            if name in used:
                q.add_var(allvars[name].copy(), values.get(name), fill=fills.get(name))
        q.ops = ops
        q.inputs = [x for x in [*p.inputs, MICRO_BATCH] if x in used and x not in produced]
        q.outputs = [x for x in p.outputs if x in produced]
        q.loss_name = p.loss_name if p.loss_name in produced else None
        q.updates = {t: n for t, n in p.updates.items() if n in produced}
        q.updates.update(self.extra_updates.get(w, {}))
        q.modules = {m: outs for m, outs in p.modules.items() if all(o in produced for o in outs)}
        q.derived = frozenset(x for x in p.derived if x in q.vars)
        q.sort_vars()
        return q


def _drop_unread_recomputes(ops: list[Op]) -> list[Op]:
    """Recompute ops whose copies this stage no longer reads (a later stage reads the
    original instead): dropped, last first, so chains of them go too."""
    ops = list(ops)
    while True:
        read = {x for op in ops for x in op.inputs if x}
        dead = [i for i, op in enumerate(ops) if op.role == "recompute" and not read.intersection(op.outputs)]
        if not dead:
            return ops
        for i in reversed(dead):
            del ops[i]


def _with(op: Op, **changes) -> Op:
    fields = {
        "type": op.type,
        "inputs": list(op.inputs),
        "outputs": list(op.outputs),
        "attrs": dict(op.attrs),
        "role": op.role,
        "stage": op.stage,
        "scope": op.scope,
        "origin": op.origin,
    }
    fields.update(changes)
    return Op(**fields)


def _send(x: str, v: Var, k: int, to: int, phase: str) -> Op:
    return Op("Send", [x], [], {"peer": to, "shape": list(v.shape or [])}, role=phase, stage=k, origin=x)


def _recv(x: str, v: Var, k: int, frm: int, phase: str) -> Op:
    attrs = {"peer": frm, "shape": list(v.shape or []), "dtype": v.dtype}
    return Op("Recv", [], [x], attrs, role=phase, stage=k, origin=x)
