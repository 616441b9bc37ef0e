"""Data parallel's start: every worker takes worker `src`'s initial params and buffers.

Workers build their models on their own (own seeds, own init), so before the first step they
must agree on the values, as DDP's constructor and Paddle's startup-program ``c_broadcast``
ops make them. This pass puts one ``Broadcast`` op of every param and buffer first in the
program, with role ``startup`` (ir/roles.py): the executor runs it once, on its first run of the
program, writing the broadcast values into its scope; later runs leave it out. The rewrite is
therefore visible in the printed program and nothing communicates at ``minimize``: the
collective runs where every other one does, through the executor's communicator (timeouts,
errors naming the op).
"""

from __future__ import annotations

from metaopt.ir import Op, Program, roles


class BroadcastInitError(ValueError):
    pass


def startup_vars(p: Program) -> list[str]:
    """The vars a worker must take from `src`: params and buffers (optimizer state starts
    equal on every worker: zeros, or a copy of the param it shadows)."""
    return [v.name for v in p.vars.values() if v.kind in ("param", "buffer")]


def broadcast_init(p: Program, *, src: int = 0) -> Program:
    """`p` with ``Broadcast(params and buffers, src=src)  # role=startup`` first (module doc)."""
    if not isinstance(src, int) or isinstance(src, bool) or src < 0:
        raise BroadcastInitError(f"broadcast_init: src must be a worker rank >= 0, got {src!r}")
    xs = startup_vars(p)
    done = {x for op in p.ops if roles.is_startup(op.role) for x in op.inputs}
    again = [x for x in xs if x in done]
    if again:
        raise BroadcastInitError(
            f"program {p.name!r} already has a startup op setting {again[0]!r} (broadcast_init was applied)"
        )
    q = p.clone()
    if xs:
        q.ops = [Op("Broadcast", xs, [], {"src": src}, role="startup"), *q.ops]
    return q
