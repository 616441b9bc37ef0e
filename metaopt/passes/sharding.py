"""ZeRO sharding, stages 1 to 3: each worker keeps and updates 1/N of the optimizer state
(stage 2: of the grads too; stage 3: of the params too).

    plan = plan_sharding(program, degree=2, stage=1, bucket_bytes=32 << 20, index=rank_in_group)
    program = apply_sharding(program, plan)

Every param update the optimizer pass appended runs on flat slices (`metaopt.ir.ZeroShard`:
the tensor flattened, zero-padded to N equal chunks, worker i of the sharding group holding
chunk i). For each bucket of params (at most `bucket_bytes`, Fleet's ``segment_broadcast_MB``,
in update order)::

    w@SHARD, w@GRAD@REDUCED@SHARD = ShardSlice(w, w@GRAD@REDUCED, group=sharding, parts=2)  # role=optimize
    w@SHARD@NEW, w@MOMENT1@NEW, w@MOMENT2@NEW = AdamUpdate(w@SHARD, w@GRAD@REDUCED@SHARD, ...,
                                                           w@MOMENT1, w@MOMENT2)  # state: 1/N
    w@NEW = ShardGather(w@SHARD@NEW, group=sharding, parts=2, ndims=[2], dims=[16, 32])  # role=optimize

so the state vars (``w@MOMENT1`` ...) are declared ``zero_shard(parts=N, full=[...])``: 1/N of
their bytes on every worker, in the executor's accounting and in `estimate_memory` alike.

* **Stage 1**: data parallel reduce-scatters the grads after the backward (its buckets moved to
  the update phase), so whole grads live through the backward and each worker updates its
  slice. Communication: data parallel's volume (reduce-scatter + all-gather = one all-reduce).
  Beside dp_degree > 1, data parallel reduce-scatters over the sharding group and all-reduces
  the slices over the data axis. A program whose grads reach the updates whole (this pass
  used without data parallel's reduce-scatter) gets its slices cut by `ShardSlice`, said in
  the plan.
* **Stage 2**: data parallel reduce-scatters the grads as they are made
  (``passes/data_parallel.py`` with ``scatter_parts``), so a worker holds only its 1/N of each
  grad from its bucket's reduce on; the updates read those slices directly. Communication:
  data parallel's volume (reduce-scatter + all-gather = one all-reduce).
* **Stage 3**: the params too are held as this worker's flat slices (``w: float32[n/N] param
  zero_shard(...)``, initial values cut by the plan's `index`), and updated in place as slices
  (no gather after the update). Before its first read in the forward a bucket of params is
  all-gathered whole (``w@GATHERED = ShardGather(w, ...)  # role=forward``), and freed after its
  last forward read like any activation; before its first read in the backward (a grad rule's,
  or a recompute segment's: the step runs after recompute) it is gathered again
  (``w@GATHERED@BWD``). Grads are reduce-scattered as they are made (stage 2's). Broadcast_init's
  startup op leaves the sliced params out: fleet cuts them from worker 0's initial values.
  Communication: 1.5x data parallel's (a second all-gather of the params per step).

Beside a pipeline (stage 1), fleet runs this pass after the split, on each stage program: the
split reduce-scatters each merged grad (``PipelinePlan.scatter_parts``), so the updates find
their grads sliced, as after data parallel's reduce-scatter; a collective that makes slices
from slices (a tied param's grad halves summed between its stages) is left as it is.

An op that reads every grad whole before the updates (global-norm clipping) is swapped for its
row's ``sharded_form`` where the grads are slices (``ShardedClipByGlobalNorm``: one all-reduce
of the squared norm); one without such a form is refused naming it.

Exact: the updates this pass may slice are elementwise (``OpDef.sliceable``: SGD, Momentum,
Adam, AdamW), so each element gets the very operations it gets unsharded; the all-gather puts
the same bits back. Beside tensor parallel a split param's state (and at stage 3 the param)
is the flat 1/N of this worker's tensor-parallel part (``split(...) zero_shard(...)``), over the
sharding group of workers holding the same part. An update that reads whole tensors and a
param whose optimizer state is not at its initial zeros are refused by name. Pure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from metaopt.ir import Op, Program, Var, ZeroShard, names, roles, torch_dtype
from metaopt.ir.printer import fmt_op
from metaopt.ops import registry
from metaopt.ops.kernels.partition import take_slice
from metaopt.ops.kernels.zero import flatten_shapes

GROUP = "sharding"  # the kernels look this worker's sharding group up at run time (ops/kernels/zero.py)


class ShardingError(ValueError):
    pass


@dataclass
class ShardedParam:
    param: str
    grad: str  # the grad its update reads: whole (all-reduced) or already a slice (reduce-scattered)
    states: list[str]  # the update's state inputs, in its output order
    update: int  # index of its update op
    nbytes: int  # the param's bytes
    state_bytes: int  # its state's bytes, unsharded
    state_slice_bytes: int  # its state's bytes as each worker holds them (padded 1/N per tensor)
    grad_sliced: bool = False  # its grad is this worker's slice already: no ShardSlice of it
    slice_bytes: int = 0  # the param's bytes as each worker holds them in stage 3 (padded 1/N)


@dataclass
class GatherBucket:
    params: list[str]
    nbytes: int
    first: int  # index of the bucket's first update op: its ShardSlice goes right before it
    after: int  # index of its last update op: its ShardGather goes right after it


@dataclass
class ParamGather:
    """Stage 3: params all-gathered whole right before op `before`, their first reader in the
    forward (or, `backward`, in the backward and its recomputes)."""

    params: list[str]
    nbytes: int
    before: int
    backward: bool


@dataclass
class ShardingPlan:
    degree: int
    stage: int
    bucket_bytes: int
    index: int = 0  # this worker's chunk (stage 3 slices the params' initial values by it)
    params: list[ShardedParam] = field(default_factory=list)
    buckets: list[GatherBucket] = field(default_factory=list)
    # stage 3: the gathers, and each param's readers in the forward and the backward (op indices)
    gathers: list[ParamGather] = field(default_factory=list)
    forward_reads: dict[str, list[int]] = field(default_factory=dict)
    backward_reads: dict[str, list[int]] = field(default_factory=dict)
    scattered: bool = False  # the grads the updates read are slices already (data parallel's reduce-scatter)
    # ops reading every grad whole (clipping) swapped for their row's form on slices: index -> type
    sharded_forms: dict[int, str] = field(default_factory=dict)
    kept: list[str] = field(default_factory=list)  # params updated whole (`keep`: expert parallel's)

    @property
    def state_bytes(self) -> int:
        return sum(sp.state_bytes for sp in self.params)

    @property
    def state_bytes_per_worker(self) -> int:
        return sum(sp.state_slice_bytes for sp in self.params)

    def __str__(self) -> str:
        cap = f"{self.bucket_bytes / 2**20:g} MB" if self.bucket_bytes else "one param per"
        grads = (
            "grads reduce-scattered by data parallel, each worker keeping its 1/N"
            + (" as they are made" if self.stage >= 2 else " after the backward")
            if self.scattered
            else "grads whole at the updates (no reduce-scatter before them), each worker slicing and "
            "updating its 1/N"
        )
        lines = [
            f"sharding stage {self.stage} over {self.degree} workers: {len(self.params)} params, "
            f"optimizer state {self.state_bytes:,} -> {self.state_bytes_per_worker:,} bytes per worker",
        ]
        if self.kept:
            lines.append(
                f"  updated whole (expert params, each worker its own experts): {len(self.kept)} params"
            )
        if self.stage == 3:
            whole = sum(sp.nbytes for sp in self.params)
            held = sum(sp.slice_bytes for sp in self.params)
            lines += [
                f"  params held as slices: {whole:,} -> {held:,} bytes per worker; {grads}",
                f"  params all-gathered before their first read in the forward, again in the backward, "
                f"in {len(self.gathers)} bucket(s) ({cap} buckets), each freed after its last read",
            ]
            for g in self.gathers:
                lines.append(
                    f"  {'backward' if g.backward else 'forward'} gather before op {g.before}: "
                    f"{len(g.params)} params, {g.nbytes:,} bytes"
                )
            return "\n".join(lines)
        lines.append(f"  {grads}; params all-gathered in {len(self.buckets)} bucket(s) ({cap} buckets)")
        for k, b in enumerate(self.buckets):
            lines.append(
                f"  bucket {k}: {len(b.params)} params, {b.nbytes:,} bytes, ops {b.first}..{b.after}"
            )
        return "\n".join(lines)


def plan_sharding(
    p: Program,
    *,
    degree: int,
    stage: int = 1,
    bucket_bytes: int = 32 << 20,
    index: int = 0,
    keep: Sequence[str] = (),
) -> ShardingPlan:
    """Which params' updates run sharded, and the buckets their params are gathered in (stage
    3: before their reads; `index`, this worker's chunk, slices their initial values). `keep`:
    params whose updates (state, and at stage 3 the param) stay whole: expert parallel's, which
    each worker of a sharding group holds a different part of (Paddle's moe_sharding_degree 1)."""
    if stage not in (1, 2, 3):
        raise ShardingError(f"sharding: stage must be 1, 2 or 3, got {stage!r}")
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
        raise ShardingError(f"sharding: degree must be an int >= 1, got {degree!r}")
    if bucket_bytes < 0:
        raise ShardingError(f"sharding: bucket_bytes must be >= 0, got {bucket_bytes}")
    if not 0 <= index < degree:
        raise ShardingError(f"sharding: index (this worker's chunk) must be in 0..{degree - 1}, got {index}")
    plan = ShardingPlan(degree, stage, bucket_bytes, index)
    producers = p.producers()
    sliced = {n for n, v in p.vars.items() if v.zero is not None}  # grads reduce-scattered
    for i, op in enumerate(p.ops):
        row = registry.get(op.type)
        if row is None or not row.update:
            # an update-phase op reading the slices (clipping: every grad whole); the collectives
            # before it (data parallel's) reduce the slices elementwise and declare their outputs
            outs = [o for o in op.outputs if o]
            if row is not None and roles.is_update(op.role) and sliced.intersection(op.inputs):
                if outs and sliced.issuperset(outs):
                    continue  # makes slices already (a pipeline's sum of a tied param's grad slices)
                plan.sharded_forms[i] = _sharded_form(op, row)
                sliced.update(op.outputs)
            continue
        if op.inputs[0] in keep:
            plan.kept.append(op.inputs[0])
            continue
        sp = _sharded_param(p, i, op, row, op.inputs[1] in sliced, degree)
        if producers.get(sp.grad, -1) > i:
            raise ShardingError(
                f"sharding: the update `{fmt_op(op)}` runs before its grad {sp.grad!r} is made"
            )
        plan.params.append(sp)
    plan.scattered = any(sp.grad_sliced for sp in plan.params)
    if stage == 3:
        _plan_param_gathers(p, plan)
        return plan
    current: GatherBucket | None = None
    for sp in plan.params:
        fits = current is not None and bucket_bytes > 0 and current.nbytes + sp.nbytes <= bucket_bytes
        if fits and p.vars[current.params[0]].dtype == p.vars[sp.param].dtype:
            current.params.append(sp.param)
            current.nbytes += sp.nbytes
            current.after = sp.update
        else:
            current = GatherBucket([sp.param], sp.nbytes, sp.update, sp.update)
            plan.buckets.append(current)
    return plan


def _plan_param_gathers(p: Program, plan: ShardingPlan) -> None:
    """Stage 3: each sharded param's readers, by phase, and the buckets it is gathered in."""
    info = {sp.param: sp for sp in plan.params}
    fwd: dict[str, list[int]] = {x: [] for x in info}
    bwd: dict[str, list[int]] = {x: [] for x in info}
    for i, op in enumerate(p.ops):
        if roles.is_startup(op.role):
            continue  # broadcast_init's: the sliced params leave it (their values are rank 0's)
        for x in dict.fromkeys(op.inputs):
            if x not in info or i == info[x].update:
                continue
            phase = roles.phase(op.role)
            if phase == roles.FORWARD:
                fwd[x].append(i)
            elif phase == roles.BACKWARD:
                bwd[x].append(i)
            else:
                raise NotImplementedError(
                    f"sharding stage 3: `{fmt_op(op)}` (role {op.role}) reads param {x!r} whole outside "
                    "the forward and backward: gathering it there is not implemented"
                )
    plan.forward_reads, plan.backward_reads = fwd, bwd
    plan.gathers = _gather_buckets(p, plan, fwd, False) + _gather_buckets(p, plan, bwd, True)


def _gather_buckets(
    p: Program, plan: ShardingPlan, reads: dict[str, list[int]], backward: bool
) -> list[ParamGather]:
    """Params in the order of their first read, grouped up to `bucket_bytes` of one dtype; a
    bucket is gathered before its first param's first read."""
    info = {sp.param: sp for sp in plan.params}
    out: list[ParamGather] = []
    for first, x in sorted((r[0], x) for x, r in reads.items() if r):
        g = out[-1] if out else None
        n = info[x].nbytes
        if (
            g is not None
            and plan.bucket_bytes
            and g.nbytes + n <= plan.bucket_bytes
            and (p.vars[g.params[0]].dtype == p.vars[x].dtype)
        ):
            g.params.append(x)
            g.nbytes += n
        else:
            out.append(ParamGather([x], n, first, backward))
    return out


def _sharded_form(op: Op, row: Any) -> str:
    """The op type that does `op`'s work on slices (its row's `sharded_form`), else refused."""
    if row.sharded_form is None:
        raise NotImplementedError(
            f"sharding: `{fmt_op(op)}` reads grads that are each worker's 1/N slices (reduce-scattered), "
            f"and {op.type} has no form for slices"
        )
    return row.sharded_form


def _sharded_param(p: Program, i: int, op: Op, row: Any, grad_sliced: bool, degree: int) -> ShardedParam:
    param, grad = op.inputs[0], op.inputs[1]
    pv = p.vars[param]
    if pv.zero is not None:
        raise ShardingError(
            f"sharding: `{fmt_op(op)}` updates a slice already: is the program sharded twice?"
        )
    if not row.sliceable:
        raise NotImplementedError(
            f"sharding: `{fmt_op(op)}` reads whole tensors ({op.type} is not elementwise): running it "
            "on 1/N slices is not implemented"
        )
    n = pv.nbytes({})
    if n is None:
        raise ShardingError(
            f"sharding: param {param!r} has shape {list(pv.shape or [])}: it needs a static one"
        )
    new_of = {p.updates[x]: x for x in op.inputs if x in p.updates}
    states = [new_of[o] for o in op.outputs[1:]]
    for s in states:
        value = p.values.get(s)
        # a meta placeholder (a program exported on meta) starts at its fill, made at first use
        if p.is_meta(s):
            started = p.fills.get(s, 0) != 0
        else:
            started = value is not None and bool(value.count_nonzero())
        if started:
            raise ShardingError(
                f"sharding: optimizer state {s!r} is not at its initial zeros: shard a program before "
                "it trains (load a checkpoint into the sharded program instead)"
            )
    gv = p.vars[grad]
    if gv.zero is not None and gv.zero.parts != 1 and gv.zero.full != tuple(pv.shape):
        raise ShardingError(
            f"sharding: grad {grad!r} is {gv.zero}, not a slice of {param!r} {list(pv.shape)}"
        )
    whole = sum(p.vars[s].nbytes({}) or 0 for s in states)
    held = sum(
        ZeroShard(degree, tuple(pv.shape)).local_numel * torch_dtype(p.vars[s].dtype).itemsize for s in states
    )
    own = ZeroShard(degree, tuple(pv.shape)).local_numel * torch_dtype(pv.dtype).itemsize
    return ShardedParam(param, grad, states, i, n, whole, held, grad_sliced, own)


def sharding(p: Program, **config: Any) -> Program:
    """The one-call form: ``apply_sharding(p, plan_sharding(p, **config))``."""
    return apply_sharding(p, plan_sharding(p, **config))


def apply_sharding(p: Program, plan: ShardingPlan) -> Program:
    """A clone of `p` whose planned updates run on this worker's slices (see the module doc)."""
    q = p.clone()
    by_op = {sp.update: sp for sp in plan.params}
    starts = {b.first: b for b in plan.buckets}
    ends = {b.after: b for b in plan.buckets}
    info = {sp.param: sp for sp in plan.params}
    attrs = {"group": GROUP, "parts": plan.degree}
    held = plan.stage == 3
    gathers_at: dict[int, list[ParamGather]] = {}
    for g in plan.gathers:
        gathers_at.setdefault(g.before, []).append(g)
    renames = _stage3_renames(plan) if held else {}
    if held:
        _hold_params(q, p, plan)
    ops: list[Op] = []
    for i, op in enumerate(p.ops):
        if held and roles.is_startup(op.role):
            op = dataclasses.replace(op, inputs=[x for x in op.inputs if x not in info])
            if not op.inputs:
                continue
        if i in plan.sharded_forms:
            op = _on_slices(q, p, op, plan.sharded_forms[i], attrs)
        for g in gathers_at.get(i, []):
            ops.append(_param_gather_op(q, p, g, attrs))
        if i in renames:
            op = dataclasses.replace(op, inputs=[renames[i].get(x, x) for x in op.inputs])
        # a bucket's slice and gather run where its updates do (a pipeline stage program's)
        at = {"stage": op.stage}
        if held and i in by_op and not by_op[i].grad_sliced:
            ops.append(_slice_op(q, [by_op[i]], attrs, params_too=False, **at))
        elif i in starts:
            ops.append(_slice_op(q, [info[x] for x in starts[i].params], attrs, **at))
        if i in by_op:
            op = _sliced_update(q, op, by_op[i], plan.degree, held)
        ops.append(op)
        if i in ends:
            ops.append(_gather_op(q, p, [info[x] for x in ends[i].params], attrs, **at))
    q.ops = ops
    return q


def _stage3_renames(plan: ShardingPlan) -> dict[int, dict[str, str]]:
    """Op index -> {param: the gathered copy it reads}: the forward's, or the backward's."""
    out: dict[int, dict[str, str]] = {}
    for reads, name in (
        (plan.forward_reads, names.zero_gathered),
        (plan.backward_reads, names.zero_regathered),
    ):
        for x, idx in reads.items():
            for i in idx:
                out.setdefault(i, {})[x] = name(x)
    return out


def _hold_params(q: Program, p: Program, plan: ShardingPlan) -> None:
    """Stage 3: each sharded param declared, and valued, as this worker's flat slice."""
    for sp in plan.params:
        v = p.vars[sp.param]
        zs = ZeroShard(plan.degree, tuple(v.shape))
        q.vars[sp.param] = dataclasses.replace(v, shape=(zs.local_numel,), zero=zs)
        q.vars[sp.param].program = q
        q.values[sp.param] = take_slice(p.values[sp.param], plan.degree, plan.index)


def _param_gather_op(q: Program, p: Program, g: ParamGather, attrs: dict) -> Op:
    """Stage 3: ``ShardGather`` of a bucket's param slices into whole copies for their readers."""
    made = names.zero_regathered if g.backward else names.zero_gathered
    outs = []
    for x in g.params:
        v = p.vars[x]
        outs.append(_fresh(q, made(x)))
        q.add_var(Var(outs[-1], v.dtype, tuple(v.shape), "activation"))
    shapes = [list(p.vars[x].shape) for x in g.params]
    role = roles.BACKWARD if g.backward else roles.FORWARD
    return Op("ShardGather", list(g.params), outs, {**attrs, **flatten_shapes(shapes)}, role=role)


def _shard_var(q: Program, name: str, full: Var, degree: int, kind: str) -> str:
    """Declare `name` as a flat 1/degree slice of a tensor like `full` (of this worker's tensor-
    parallel part, where `full` is split: the slice keeps that layout, for checkpoints)."""
    zs = ZeroShard(degree, tuple(full.shape))
    q.vars[name] = Var(name, full.dtype, (zs.local_numel,), kind, zero=zs, split=full.split)
    return name


def _on_slices(q: Program, p: Program, op: Op, form: str, attrs: dict) -> Op:
    """`op` as its form on slices: its outputs declared as the slices of its inputs'."""
    for x, o in zip(op.inputs, op.outputs, strict=False):
        zero = p.vars[x].zero
        if zero is not None:
            v = q.vars[o]
            q.vars[o] = Var(o, v.dtype, (zero.local_numel,), v.kind, zero=zero)
    return dataclasses.replace(op, type=form, attrs={**op.attrs, **attrs})


def _slice_op(
    q: Program, params: list[ShardedParam], attrs: dict, *, params_too: bool = True, stage: int | None = None
) -> Op:
    """``ShardSlice`` of each param of a bucket (stage 3 holds them sliced: not theirs) and of its
    whole grads (those data parallel did not reduce-scatter)."""
    ins, outs = [], []
    for sp in params:
        if params_too:
            ins.append(sp.param)
            outs.append(
                _shard_var(
                    q, _fresh(q, names.zero_shard(sp.param)), q.vars[sp.param], attrs["parts"], "activation"
                )
            )
        if not sp.grad_sliced:
            ins.append(sp.grad)
            outs.append(
                _shard_var(q, _fresh(q, names.zero_shard(sp.grad)), q.vars[sp.grad], attrs["parts"], "grad")
            )
    return Op("ShardSlice", ins, outs, dict(attrs), role="optimize", stage=stage)


def _fresh(q: Program, name: str) -> str:
    if name in q.vars:
        raise ShardingError(f"sharding: {name!r} exists already: is the program sharded twice?")
    return name


def _sliced_update(q: Program, op: Op, sp: ShardedParam, degree: int, held: bool = False) -> Op:
    """The update on this worker's slices: its param and grad inputs are the slices, its state
    vars (and their new values) are declared as slices, initial zeros of the slice's length.
    Stage 3 (`held`): the param is a slice already and its new value stays one."""
    grad = sp.grad if sp.grad_sliced else names.zero_shard(sp.grad)
    if held:
        new = op.outputs[0]
        _shard_var(q, new, q.vars[new], degree, q.vars[new].kind)
        for s, out in zip(sp.states, op.outputs[1:], strict=True):
            _shard_var(q, s, q.vars[s], degree, "opt_state")
            _shard_var(q, out, q.vars[out], degree, q.vars[out].kind)
            q.set_filled(s, 0.0, meta=q.is_meta(s))
        return dataclasses.replace(op, inputs=[sp.param, grad, *op.inputs[2:]], attrs=dict(op.attrs))
    param_slice = names.zero_shard(sp.param)
    full = q.vars[sp.param]
    for s, new in zip(sp.states, op.outputs[1:], strict=True):
        _shard_var(q, s, q.vars[s], degree, "opt_state")
        _shard_var(q, new, q.vars[new], degree, q.vars[new].kind)
        q.set_filled(s, 0.0, meta=q.is_meta(s))
    new_param = _shard_var(q, _fresh(q, names.new_state(param_slice)), full, degree, "activation")
    inputs = [param_slice, grad, *op.inputs[2:]]
    return dataclasses.replace(op, inputs=inputs, outputs=[new_param, *op.outputs[1:]], attrs=dict(op.attrs))


def _gather_op(
    q: Program, p: Program, params: list[ShardedParam], attrs: dict, stage: int | None = None
) -> Op:
    """``ShardGather`` of a bucket's updated slices into the new params the updates made."""
    slices = [names.new_state(names.zero_shard(sp.param)) for sp in params]
    news = [p.ops[sp.update].outputs[0] for sp in params]
    shapes = [list(p.vars[sp.param].shape) for sp in params]
    return Op("ShardGather", slices, news, {**attrs, **flatten_shapes(shapes)}, role="optimize", stage=stage)
