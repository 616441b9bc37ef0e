"""Identical layers solved once (issue 45): a forward program's repeated blocks, whether they are
the same computation, and the same program with fewer of them.

The planner rewrites and estimates a model at 2 and 3 blocks per stage, not at its whole depth.
With identical blocks each block adds its ops, so a step's time is a line in the count of blocks
and two points extend it exactly. A peak is the largest of several such lines (one per place in
the step), so the same extension is a lower bound of it: enough to rule layouts out, and the
planner rewrites the rest whole (search.py, `_Job.evaluate`).

    blocks = find_blocks(program)        # None: no repeated blocks
    blocks.why_not                       # None: blocks first.. are one computation; else the first difference
    blocks.first                         # where that run begins (1; 3 for DeepSeek-V3's dense first layers)
    small = with_blocks(program, blocks, 2)   # the first 2 blocks, the rest of the model as it was
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from metaopt.ir import Op, Program
from metaopt.ir.printer import fmt_op
from metaopt.passes.recompute import block_outputs

SMALL = 64  # a constant of at most this many elements is compared by its values in the signature
RUN = 4  # identical blocks ending the chain, after others, that are solved once (2 + 2 to extend over)


@dataclass(frozen=True)
class Blocks:
    """The model's repeated blocks: module paths, output vars and forward op spans, in order."""

    modules: tuple[str, ...]
    outputs: tuple[str, ...]
    spans: tuple[tuple[int, int], ...]  # each block's ops: [start, end) in the forward program
    why_not: str | None  # None: blocks first.. compute the same thing; else what differs, named
    first: int = 1  # the identical run's first block (those before it always kept, as they are)

    @property
    def count(self) -> int:
        return len(self.modules)

    @property
    def pattern(self) -> str:
        """The family as a module pattern (``model.layers.*``): checkpoints name every block by it."""
        parent, _, _ = self.modules[0].rpartition(".")
        return f"{parent}.*" if parent else "*"


def find_blocks(p: Program) -> Blocks | None:
    """The repeated blocks of forward program `p` (`passes.recompute.block_outputs`' family of
    numbered sibling modules), or None where it has none or their ops are not one contiguous run
    each. `why_not` says whether blocks `first`.. are identical (block 0 reads the model's input,
    not a block's output, and may differ: it is always kept; so are the blocks before a run of at
    least `RUN` identical ones that ends the chain: DeepSeek-V3's 3 dense layers before its 58 MoE
    ones), that each block begins where the one before it ends (ops between blocks would stay
    behind when blocks are cut off), and that only the chain reads what a block makes (`_leak`)."""
    from metaopt.passes.fold_constants import shape_values

    outs, shaped = block_outputs(p), shape_values(p)
    owner: dict[str, str] = {}  # a var leaving nested modules (a Sequential, its last child): the outer
    for m, o in p.modules.items():
        o = [x for x in o if x not in shaped]  # a shape expression later blocks read: not an output
        if len(o) == 1 and (o[0] not in owner or m.count(".") < owner[o[0]].count(".")):
            owner[o[0]] = m
    mods = [owner.get(o) for o in outs]
    if len(outs) < 2 or None in mods or any("@" in m for m in mods):
        return None  # a shared module's calls (ALBERT): one set of params, nothing to drop
    spans = []
    for m in mods:
        inside = [i for i, op in enumerate(p.ops) if within(op.scope, m)]
        if not inside or inside[-1] - inside[0] + 1 != len(inside):
            return None
        spans.append((inside[0], inside[-1] + 1))
    if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
        return None
    blocks = Blocks(tuple(mods), tuple(outs), tuple(spans), None)
    why = _gap(p, blocks) or _leak(p, blocks, shaped)
    if why is not None:
        return dataclasses.replace(blocks, why_not=why)
    first, why = _identical_run(p, blocks)
    return dataclasses.replace(blocks, why_not=why, first=first)


def within(scope: str | None, module: str) -> bool:
    """Is an op of `scope` inside module `module` (the module itself or one nested in it)?"""
    return scope is not None and (scope == module or scope.startswith(module + "."))


def _gap(p: Program, blocks: Blocks) -> str | None:
    """The first op between two blocks (a residual add outside them): cutting blocks off would
    leave it, so such blocks are not cut (None: each block begins where the previous one ends)."""
    for a, b in zip(blocks.spans, blocks.spans[1:]):
        if a[1] != b[0]:
            return f"`{fmt_op(p.ops[a[1]])}` lies between two blocks, in neither"
    return None


def _leak(p: Program, blocks: Blocks, shaped: set[str]) -> str | None:
    """The first read of a value made inside a block from anywhere but where the chain reads it (a
    block's output by the next block, the last one's by the rest of the model): an auxiliary loss
    over every layer's router, hidden states handed out, a skip across blocks. Cutting blocks off
    would leave that reader without its value (None: the blocks are a plain chain). A shape
    expression a block makes and later blocks read is no leak (`shaped`: `shape_values`; the
    exporter makes one once for every layer): cutting blocks off drops a suffix, its later readers
    with it."""
    inside = {i: k for k, (a, b) in enumerate(blocks.spans) for i in range(a, b)}
    made = {o: k for i, k in inside.items() for o in p.ops[i].outputs if o}
    last = blocks.count - 1
    for i, op in enumerate(p.ops):
        reader = inside.get(i)
        for x in op.inputs:
            k = made.get(x)
            if k is None or k == reader or (x in shaped and reader is not None and reader > k):
                continue
            chained = x == blocks.outputs[k] and (reader == k + 1 or (k == last and reader is None))
            if not chained:
                return f"`{fmt_op(op)}` reads {x!r}, made inside block {blocks.modules[k]!r}"
    out = next((x for x in p.outputs if x in made and x != blocks.outputs[last]), None)
    return None if out is None else f"the program's output {out!r} is made inside a block"


def _identical_run(p: Program, blocks: Blocks) -> tuple[int, str | None]:
    """(where the run of identical blocks that ends the chain begins, None) where it is blocks 1..
    or at least `RUN` blocks long; else (1, the first op of a block that differs from block 1)."""
    readers: dict[str, set[int]] = {}  # a param or buffer -> the blocks whose ops read it (-1: outside)
    inside = {i: k for k, (a, b) in enumerate(blocks.spans) for i in range(a, b)}
    for i, op in enumerate(p.ops):
        for x in op.inputs:
            if x and x in p.vars and p.vars[x].kind in ("param", "buffer"):
                readers.setdefault(x, set()).add(inside.get(i, -1))
    sigs = [_signature(p, blocks, k, readers) if k else [] for k in range(blocks.count)]
    first = blocks.count - 1
    while first > 1 and sigs[first - 1] == sigs[-1]:
        first -= 1
    if first == 1 or blocks.count - first >= RUN:
        return first, None
    ref = sigs[1]
    for k in range(2, blocks.count):
        if len(sigs[k]) != len(ref):
            return 1, f"block {blocks.modules[k]!r} has {len(sigs[k])} ops, {blocks.modules[1]!r} {len(ref)}"
        for j, (a, b) in enumerate(zip(sigs[k], ref)):
            if a != b:
                op = p.ops[blocks.spans[k][0] + j]
                return 1, f"block {blocks.modules[k]!r} differs from {blocks.modules[1]!r} at `{fmt_op(op)}`"
    raise AssertionError("unreachable: blocks 1.. equal block 1 but the run from the end is shorter")


def _signature(p: Program, blocks: Blocks, k: int, readers: dict[str, set[int]]) -> list[tuple]:
    """Block k's ops as tokens free of its names: a var it makes by the order it made it, the
    previous block's output as "prev", a param or buffer only it reads by the order it first read it
    (with shape, dtype, trainable), small constants by value, anything else read from outside (a mask,
    rotary tables, a param shared with other blocks) by name. A buffer only it reads (DeepSeek-V3's
    router bias) is its own as a param is."""
    module, (start, end) = blocks.modules[k], blocks.spans[k]
    made: dict[str, int] = {}
    own: dict[str, int] = {}
    out = []
    for op in p.ops[start:end]:
        ins = []
        for x in op.inputs:
            if x and readers.get(x) == {k}:
                ins.append(("own", own.setdefault(x, len(own)), *_var_token(p, x), p.vars[x].trainable))
            else:
                ins.append(_token(p, x, made, blocks.outputs[k - 1]))
        for o in op.outputs:
            if o:
                made[o] = len(made)
        shapes = tuple(_var_token(p, o) for o in op.outputs)
        scope = (op.scope or "")[len(module) :]
        out.append((op.type, op.role, scope, _attrs(op), tuple(ins), shapes))
    return out


def _token(p: Program, x: str, made: dict[str, int], prev: str) -> tuple:
    if not x:
        return ("none",)
    if x in made:
        return ("made", made[x])
    if x == prev:
        return ("prev",)
    v, value = p.vars.get(x), p.values.get(x)
    if v is not None and v.kind == "constant" and value is not None:
        return ("const", *_var_token(p, x), _value_token(value))
    return ("outside", x)


def _var_token(p: Program, name: str) -> tuple:
    v = p.vars.get(name)
    return (None,) if v is None else (v.kind, v.dtype, tuple(v.shape) if v.shape is not None else None)


def _value_token(t: torch.Tensor) -> Any:
    if t.is_meta:
        return ("meta", tuple(t.shape), str(t.dtype))
    t = t.detach().cpu().contiguous()
    if t.numel() <= SMALL:
        return (str(t.dtype), tuple(t.shape), tuple(t.flatten().tolist()))
    return (str(t.dtype), tuple(t.shape), hashlib.sha1(t.view(torch.uint8).numpy().tobytes()).hexdigest())


def _attrs(op: Op) -> tuple:
    return tuple(
        sorted((k, _value_token(a) if isinstance(a, torch.Tensor) else repr(a)) for k, a in op.attrs.items())
    )


def with_blocks(p: Program, blocks: Blocks, keep: int) -> Program:
    """`p` with only its first `keep` blocks: the rest of the model (embedding, head, loss) reads
    block keep-1's output where it read the last block's; what only the dropped blocks referred to
    (their params, constants, activations) is gone. `p` itself is unchanged."""
    if not 1 <= keep <= blocks.count:
        raise ValueError(f"with_blocks: keep={keep} is not in 1 .. {blocks.count} blocks")
    if keep == blocks.count:
        return p
    q = p.clone()
    start, end = blocks.spans[keep][0], blocks.spans[-1][1]
    last, now = blocks.outputs[-1], blocks.outputs[keep - 1]
    q.ops = q.ops[:start] + q.ops[end:]
    for op in q.ops[start:]:
        op.inputs = [now if x == last else x for x in op.inputs]
    q.outputs = [now if x == last else x for x in q.outputs]
    dropped = blocks.modules[keep:]
    q.modules = {
        m: [now if o == last else o for o in outs]
        for m, outs in q.modules.items()
        if not any(within(m, d) for d in dropped)
    }
    used = _referred(q)
    gone = _referred(p) - used  # what only the dropped ops referred to (an unused param stays)
    q.updates = {k: v for k, v in q.updates.items() if k not in gone and v not in gone}
    for name in [n for n in q.vars if n in gone]:
        del q.vars[name]
        for table in (q.values, q.referenced, q.fills):
            table.pop(name, None)
    q.derived = q.derived - gone
    return q


def _referred(p: Program) -> set[str]:
    names = {x for op in p.ops for x in (*op.inputs, *op.outputs) if x}
    return names | set(p.inputs) | set(p.outputs) | ({p.loss_name} if p.loss_name else set())
