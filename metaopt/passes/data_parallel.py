"""Data parallel: average every gradient over the workers before the optimizer reads it.

    plan = plan_data_parallel(program, grads=[...], world_size=2, bucket_bytes=32 << 20)
    program = data_parallel(program, grads=[...], world_size=2, bucket_bytes=32 << 20)

Grads are grouped into buckets in the order the backward finishes them (the last
layer's first, as in DDP and Fleet's fuse_all_reduce pass): a bucket closes before it
would exceed `bucket_bytes` (a grad larger than that is a bucket alone), and grads of
different dtypes never share one. One fused op per bucket, right after the op that
finishes its last grad, so on CUDA the all-reduce of early buckets overlaps the rest of
the backward::

    fc3.weight@GRAD@REDUCED, fc3.bias@GRAD@REDUCED = AllReduce(fc3.weight@GRAD, fc3.bias@GRAD, reduce=avg)
                                                                         # role=comm

Every later reader of a grad (clipping, the optimizer's updates) reads its reduced
copy. ``scatter_parts=N`` (ZeRO, passes/sharding.py) makes each bucket a ``ReduceScatter``
over the sharding group instead: a reduced grad is then this worker's flat 1/N of the average
(declared ``zero_shard``), and the whole grad dies at its bucket. With more workers than the
sharding group (hybrid dp x sharding: N divides `world_size`) the slices are then all-reduced
over this worker's data-parallel group (``group=data_parallel``, the workers holding the same
slice): ``w@GRAD@SHARD = ReduceScatter(w@GRAD)``, ``w@GRAD@REDUCED = AllReduce(w@GRAD@SHARD)``.
``bucket_bytes=0`` gives one op per grad (Fleet's ``fuse_all_reduce_ops=False``).
With ``at_update=True`` (grads summed over several runs first: gradient merge) every
bucket goes right before the first update-phase op instead, where the grads are final,
so the all-reduce runs with the updates: once per k runs. ``group="data_parallel"`` (beside
tensor parallel: dp x mp workers) reduces over this worker's data-parallel group of the hybrid
layout only (the ranks holding the same slices), averaging by its size, `world_size` being the
dp degree; without it, over every worker. Initial values are made equal by
passes/broadcast_init.py (a startup op run before the first step), not here. The pass is
pure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from metaopt.ir import Op, Program, Var, ZeroShard, did_you_mean, names, roles, torch_dtype
from metaopt.passes.driver import plan_text


class DataParallelError(ValueError):
    pass


@dataclass
class Bucket:
    grads: list[str]
    nbytes: int
    after: int  # index of the op finishing its last grad; the AllReduce goes right after it
    expert: bool = False  # expert parallel's grads: summed over their replicas, / world_size


@dataclass
class DataParallelPlan:
    world_size: int
    bucket_bytes: int
    group: str | None = None  # "data_parallel": this worker's data-parallel group; None: all workers
    scatter_parts: int | None = None  # ZeRO stage 2: reduce-scatter into 1/parts slices
    expert_replicas: int = 1  # workers holding the same experts (expert parallel's replica group)
    buckets: list[Bucket] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (grad, why it is not reduced)

    @property
    def num_grads(self) -> int:
        return sum(len(b.grads) for b in self.buckets)

    def __str__(self) -> str:
        cap = f"{self.bucket_bytes / 2**20:g} MB buckets" if self.bucket_bytes else "unfused"
        who = f"{self.world_size} workers"
        if self.group:
            who = f"the {who} of each data-parallel group"
        kind = "all_reduce" if self.scatter_parts is None else f"reduce_scatter (1/{self.scatter_parts} kept)"
        return plan_text(
            f"data parallel over {who} ({cap}): {kind} ops: {self.num_grads}, "
            f"after fusion: {len(self.buckets)}",
            [
                f"bucket {k}: {len(b.grads)} grads, {b.nbytes:,} bytes, after op {b.after}"
                + (
                    f" (expert grads: summed over {self.expert_replicas} replica(s), / {self.world_size})"
                    if b.expert
                    else ""
                )
                for k, b in enumerate(self.buckets)
            ],
            self.skipped,
        )


def plan_data_parallel(
    p: Program,
    *,
    grads: list[str],
    world_size: int,
    bucket_bytes: int,
    at_update: bool = False,
    group: str | None = None,
    scatter_parts: int | None = None,
    experts: Sequence[str] = (),
    expert_replicas: int = 1,
) -> DataParallelPlan:
    """Which grads go into which bucket, and where each bucket's AllReduce goes. `experts`:
    expert parallel's grads (this worker's experts, from every token of its expert group),
    bucketed apart: summed over the `expert_replicas` workers holding the same experts and
    divided by `world_size`, which makes them data parallel's average."""
    if world_size < 1:
        raise DataParallelError(f"data parallel: world_size must be >= 1, got {world_size}")
    if group not in (None, "data_parallel"):
        raise DataParallelError(f"data parallel: group must be 'data_parallel' or None, got {group!r}")
    if bucket_bytes < 0:
        raise DataParallelError(f"data parallel: bucket_bytes must be >= 0, got {bucket_bytes}")
    if scatter_parts is not None and world_size % scatter_parts:
        raise DataParallelError(
            f"data parallel: reduce-scatter over {scatter_parts} workers needs sharding groups that divide "
            f"every data-parallel worker ({world_size}{', of each group' if group else ''})"
        )
    if experts and (group is not None or world_size % expert_replicas):
        raise DataParallelError(
            f"data parallel: expert grads beside tensor parallel's groups, or over {expert_replicas} "
            f"replicas that do not divide the {world_size} workers: not yet"
        )
    producers = p.producers()
    plan = DataParallelPlan(world_size, bucket_bytes, group, scatter_parts, expert_replicas)
    expert = set(experts)
    ready: list[tuple[int, str]] = []
    for g in dict.fromkeys(grads):
        if g not in p.vars:
            raise DataParallelError(
                f"data parallel: grad {g!r} is not a var of {p.name!r}{did_you_mean(g, p.vars)}"
            )
        if g not in producers:
            plan.skipped.append(
                (g, "no op produces it (a constant or input grad is the same on every worker)")
            )
            continue
        ready.append((producers[g], g))
    ready.sort()
    current: Bucket | None = None
    for at, g in ready:
        n = _nbytes(p.vars[g])
        fits = (
            current is not None
            and current.expert == (g in expert)
            and bucket_bytes > 0
            and current.nbytes + n <= bucket_bytes
            and p.vars[current.grads[0]].dtype == p.vars[g].dtype
        )
        if fits:
            current.grads.append(g)
            current.nbytes += n
            current.after = at
        else:
            current = Bucket([g], n, at, g in expert)
            plan.buckets.append(current)
    if at_update:
        first = next((i for i, op in enumerate(p.ops) if roles.is_update(op.role)), len(p.ops))
        for b in plan.buckets:
            b.after = first - 1
    return plan


def data_parallel(p: Program, **config: Any) -> Program:
    """The one-call form: ``apply_data_parallel(p, plan_data_parallel(p, **config))``, the config being
    `plan_data_parallel`'s keywords."""
    return apply_data_parallel(p, plan_data_parallel(p, **config))


def apply_data_parallel(p: Program, plan: DataParallelPlan) -> Program:
    """A clone of `p` with the AllReduce of each of `plan`'s buckets after its last grad."""
    q = p.clone()
    after: dict[int, list[Bucket]] = {}
    for b in plan.buckets:
        after.setdefault(b.after, []).append(b)
    renamed: dict[str, str] = {}
    ops: list[Op] = []
    for i, op in enumerate(p.ops):
        if renamed and any(x in renamed for x in op.inputs):
            op = dataclasses.replace(op, inputs=[renamed.get(x, x) for x in op.inputs])
        ops.append(op)
        for b in after.get(i, []):
            outs = []
            for g in b.grads:
                r = names.reduced(g)
                if r in q.vars:
                    raise DataParallelError(
                        f"data parallel: {r!r} exists already: is the program reduced twice?"
                    )
                q.vars[r] = reduced_var(r, q.vars[g], None if b.expert else plan.scatter_parts)
                outs.append(r)
            if b.expert:
                ops += _expert_reduce_ops(q, list(b.grads), outs, plan)
            else:
                ops += reduce_ops(
                    q.vars,
                    list(b.grads),
                    outs,
                    scatter_parts=plan.scatter_parts,
                    replicas=plan.scatter_parts is not None and plan.scatter_parts != plan.world_size,
                    group=plan.group,
                )
            renamed.update(zip(b.grads, outs, strict=True))
    q.ops = ops
    q.outputs = [renamed.get(x, x) for x in q.outputs]
    return q


def _expert_reduce_ops(q: Program, grads: list[str], outs: list[str], plan: DataParallelPlan) -> list[Op]:
    """Expert grads summed over the workers holding the same experts (none to sum with when
    each expert has one owner), then divided by the data-parallel world: every worker's tokens
    reached some owner of each expert, so the sum over its replicas is the sum over all batches."""
    ops, sums = [], grads
    if plan.expert_replicas > 1:
        sums = [names.fresh(names.ep_summed(g), q.vars) for g in grads]
        for g, s in zip(grads, sums, strict=True):
            q.vars[s] = q.vars[g].copy(name=s)
        ops.append(Op("AllReduce", grads, sums, {"reduce": "sum", "group": "expert_replica"}, role="comm"))
    scale: dict[str, str] = {}  # dtype -> its constant
    for s, r in zip(sums, outs, strict=True):
        dtype = q.vars[s].dtype
        if dtype not in scale:
            scale[dtype] = names.fresh(names.ep_grad_scale(), q.vars)
            value = torch.tensor(1.0 / plan.world_size, dtype=torch_dtype(dtype))
            q.add_var(Var(scale[dtype], dtype, (), kind="constant"), value)
        ops.append(Op("Mul", [s, scale[dtype]], [r], role="comm"))
    return ops


def reduced_var(name: str, grad: Var, scatter_parts: int | None) -> Var:
    """The var a reduce of `grad` makes: like it, or its flat 1/`scatter_parts` slice (ZeRO)."""
    if scatter_parts is None:
        return Var(name, grad.dtype, grad.shape, grad.kind)
    zs = ZeroShard(scatter_parts, tuple(grad.shape))
    return Var(name, grad.dtype, (zs.local_numel,), grad.kind, zero=zs)


def reduce_ops(
    declared: dict[str, Var],
    grads: list[str],
    outs: list[str],
    *,
    scatter_parts: int | None,
    replicas: bool,
    group: str | None = None,
    role: str = "comm",
) -> list[Op]:
    """The collectives averaging `grads` into `outs` (declared already in `declared`, where any
    var between them is declared too): one ``AllReduce`` over `group` (None: every worker); with
    `scatter_parts` (ZeRO) a ``ReduceScatter`` over the sharding group, each worker keeping its
    1/N, then, where the workers holding the same slice are several (`replicas`: a data axis
    beside the sharding one), an ``AllReduce`` of the slices over the data-parallel group. Data
    parallel's buckets and a pipeline's merged grads (passes/pipeline.py) use it alike."""
    if scatter_parts is None:
        attrs = {"reduce": "avg", **({"group": group} if group else {})}
        return [Op("AllReduce", grads, outs, attrs, role=role)]
    # the kernel finds the sharding group as ShardGather does
    attrs = {"reduce": "avg", "group": "sharding", "parts": scatter_parts}
    if not replicas:
        return [Op("ReduceScatter", grads, outs, attrs, role=role)]
    parts = []  # each worker's slice averaged over its sharding group, then over the data axis
    for g, r in zip(grads, outs, strict=True):
        s = names.zero_shard(g)
        declared[s] = declared[r].copy(name=s)
        parts.append(s)
    return [
        Op("ReduceScatter", grads, parts, attrs, role=role),
        Op("AllReduce", parts, outs, {"reduce": "avg", "group": "data_parallel"}, role=role),
    ]


def _nbytes(v: Var) -> int:
    n = v.nbytes({})
    if n is None:
        raise DataParallelError(
            f"data parallel: grad {v.name!r} has shape {list(v.shape or [])}: "
            "a param grad needs a static shape"
        )
    return n
