"""Data parallel's start: every worker takes worker `src`'s initial params and buffers.

Workers build their models on their own (own seeds, own init), so before the first step they
must agree on the values, as DDP's constructor and Paddle's startup-program ``c_broadcast``
ops make them. This pass puts one ``Broadcast`` op of every param and buffer first in the
program, with role ``startup`` (ir/roles.py): the executor runs it once, on its first run of the
program, writing the broadcast values into its scope; later runs leave it out. The rewrite is
therefore visible in the printed program and nothing communicates at ``minimize``: the
collective runs where every other one does, through the executor's communicator (timeouts,
errors naming the op).

Beside tensor parallel, `split` names the params each model-parallel rank holds its own slice
of: a second op broadcasts those within this worker's data-parallel group only
(``group="data_parallel"``, from its first rank), the first op everything else from `src`, so
replicated params stay equal across the model-parallel group too. Beside sharding (ZeRO), whose
workers are data-parallel replicas too, `split_groups` is ("data_parallel", "sharding"): a third
op then broadcasts the split params within this worker's sharding group (from its first rank,
which holds the data group's first value by then). Expert parallel's `experts` (each worker
holds its own experts) are broadcast only within the workers holding the same experts
(``group="expert_replica"``, from its first rank).
"""

from __future__ import annotations

from collections.abc import Sequence

from metaopt.ir import Op, Program, did_you_mean, roles


class BroadcastInitError(ValueError):
    pass


def startup_vars(p: Program) -> list[str]:
    """The vars a worker must take from `src`: params and buffers (optimizer state starts
    equal on every worker: zeros, or a copy of the param it shadows)."""
    return [v.name for v in p.vars.values() if v.kind in ("param", "buffer")]


def broadcast_init(
    p: Program,
    *,
    src: int = 0,
    split: Sequence[str] = (),
    split_groups: Sequence[str] = ("data_parallel",),
    experts: Sequence[str] = (),
) -> Program:
    """`p` with ``Broadcast(params and buffers, src=src)  # role=startup`` first, and the
    `split` ones in ``Broadcast(..., src=0, group=g)`` after it, for each of `split_groups` in
    order (module doc)."""
    bad = [g for g in split_groups if g not in ("data_parallel", "sharding")]
    if bad or not split_groups:
        raise BroadcastInitError(
            "broadcast_init: split_groups must be 'data_parallel' and/or 'sharding', got "
            f"{list(split_groups)}"
        )
    if not isinstance(src, int) or isinstance(src, bool) or src < 0:
        raise BroadcastInitError(f"broadcast_init: src must be a worker rank >= 0, got {src!r}")
    xs = startup_vars(p)
    unknown = [x for x in [*split, *experts] if x not in xs]
    if unknown:
        raise BroadcastInitError(
            f"broadcast_init: split param {unknown[0]!r} is not a param of {p.name!r}"
            f"{did_you_mean(unknown[0], xs)}"
        )
    done = {x for op in p.ops if roles.is_startup(op.role) for x in op.inputs}
    again = [x for x in xs if x in done]
    if again:
        raise BroadcastInitError(
            f"program {p.name!r} already has a startup op setting {again[0]!r} (broadcast_init was applied)"
        )
    q = p.clone()
    local, own = set(split), set(experts)
    whole = [x for x in xs if x not in local and x not in own]
    ops = [Op("Broadcast", whole, [], {"src": src}, role="startup")] if whole else []
    if split:
        group = [x for x in xs if x in local]  # program order, as the first op's
        ops += [Op("Broadcast", group, [], {"src": 0, "group": g}, role="startup") for g in split_groups]
    if experts:
        group = [x for x in xs if x in own]
        ops.append(Op("Broadcast", group, [], {"src": 0, "group": "expert_replica"}, role="startup"))
    q.ops = [*ops, *q.ops]
    return q
