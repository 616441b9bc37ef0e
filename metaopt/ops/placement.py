"""Which values an executor on an accelerator computes on the host: shape arithmetic.

Here rather than in runtime/ because passes need it too: offload must not copy a host value
to pinned memory and back to the device (it is not on the device, and the copy back would make
a reader that wants it on the host wait for the device).
"""

from __future__ import annotations

import math

from metaopt.ir import Program
from metaopt.ops import registry

# The most elements a value computed on the host may have: shape arithmetic (a shape, a scalar)
# is tiny; a value as big as a mask built from shapes (batch x 1 x seq x seq) is computed on the
# device from its small host inputs instead, so it is neither made by the host each step nor
# copied up to every op that reads it.
HOST_MAX_NUMEL = 64


def _small(p: Program, name: str) -> bool:
    shape = p.vars[name].shape if name in p.vars else None
    return shape is not None and all(isinstance(d, int) for d in shape) and math.prod(shape) <= HOST_MAX_NUMEL


def host_placement(p: Program) -> tuple[set[str], set[tuple[int, int]], dict[int, tuple[int, ...]]]:
    """(vars computed on the host, (op index, input index) pairs that read a host copy, op index
    -> the input positions where a device op reads a host-computed value, to copy up).

    Shape arithmetic stays on the CPU: Shape/Size outputs are host values, an op whose
    run-time inputs are all host values and whose outputs are small (`HOST_MAX_NUMEL`)
    computes on the host, and a constant read by such an op or at a row's `host_inputs`
    position is read from the host mirror. Everything else lives on the executor's device,
    and reads a host-computed value (other than at a `host_inputs` position) as a device copy.
    """
    consts = {v.name for v in p.vars.values() if v.kind == "constant"}
    host: set[str] = set()
    reads: set[tuple[int, int]] = set()
    uploads: dict[int, tuple[int, ...]] = {}
    for i, op in enumerate(p.ops):
        row = registry.get(op.type)
        runtime = [x for x in op.inputs if x and x not in consts]
        # Ops that create tensors on the executor's device (`needs_device`, copies and
        # collectives) never compute on the host, whatever their inputs.
        on_device = row is not None and (row.needs_device or row.needs_runtime)
        on_host = row is not None and (
            row.host_outputs
            or (
                not on_device
                and runtime
                and all(x in host for x in runtime)
                and all(_small(p, o) for o in op.outputs if o)
            )
        )
        if on_host:
            host.update(o for o in op.outputs if o)
        host_at = registry.host_inputs(op, p)
        for j, x in enumerate(op.inputs):
            if x in consts and (on_host or j in host_at):
                reads.add((i, j))
        if not on_host:
            up = tuple(j for j, x in enumerate(op.inputs) if x in host and j not in host_at)
            if up:
                uploads[i] = up
    return host, reads, uploads
