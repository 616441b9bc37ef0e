"""The evaluation form of a program: ``Program.clone(for_test=True)``, Paddle's
``main.clone(for_test=True)``.

    plan = plan_for_test(program)        # printable: what becomes its inference form, what is dropped
    test_program = for_test(program)     # a new program; `program` is not touched

Taken before minimize, it is the exported forward with every train/eval-dependent op in its
inference form; taken after, at any layout, it is the rewritten program's forward-only form. It
shares the training scope by var name: run it on the same executor and it reads the trained
params (ZeRO-3's slices, tensor parallel's splits, a pipeline stage's own).

* **Kept**: the model's forward and loss (roles ``forward``, ``loss``), what the layout put in the
  forward (ZeRO-3's gathers, tensor and sequence parallel's collectives, AMP's casts, a
  pipeline's forward sends and receives), and ``startup`` ops (data parallel's first broadcast:
  every replica evaluates the same values even when it runs before any training).
* **Inference forms** come from the op rows (``OpDef.for_test``, ops/registry.py): Dropout
  becomes Identity, torch's training batch norm runs on the running stats and updates nothing,
  attention's dropout is off. A row without one runs as it is.
* **Dropped**: every op of the backward and optimizer phases (grads, updates, the step counter,
  recompute's copies, offload's fetches back), offload's copies to host and recompute
  partition's slices, collectives over values no longer made (data parallel's grad sums), and
  ops a pass derived from a forward value that nothing of the eval program reads any more
  (recompute's RNG state records, AMP's scaled loss, the masks a backward read). The model's own
  ops always stay, so any forward var (logits, a module's output) can be fetched by name.
* **State**: ``updates`` is emptied (evaluating leaves every running stat as it is); a gradient
  merge's step counter is gone; vars nothing refers to are dropped (grads, optimizer state).
* **A pipeline stage program** is cut into its forward phases again and runs a forward-only
  schedule (the training schedule's forwards, in its order: ``PipelineInfo.forward_only``); the
  loss is the micro-batches' mean on the last stage, as in training.

Random ops a model calls itself (``torch.randn`` in its forward) stay: ``model.eval()`` draws
them too.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass

from metaopt.ir import Op, Program, roles, verify
from metaopt.ir.program import register_for_test
from metaopt.ops import registry


@dataclass(frozen=True)
class ForTestPlan:
    """What `for_test` does to `program`: `inference` (op index, printed change) in program
    order, `dropped` (op index -> why), and the counts of the kept ops."""

    program: str
    kept: int
    inference: tuple[tuple[int, str], ...]
    dropped: dict[int, str]
    forward_only_pipeline: bool

    def __str__(self) -> str:
        lines = [f"for_test plan for {self.program!r}: {self.kept} ops kept"]
        lines += [f"  op {i}: {change}" for i, change in self.inference]
        for why, n in sorted(Counter(self.dropped.values()).items()):
            lines.append(f"  dropped {n} op{'s' if n != 1 else ''}: {why}")
        if self.forward_only_pipeline:
            lines.append("  pipeline: forward-only schedule (the training schedule's forwards)")
        return "\n".join(lines)


def _kept_by_role(op: Op) -> bool:
    """The forward's ops, and the startup broadcast: everything else runs after the forward or
    exists for the backward (offload's host copies, recompute partition's slices)."""
    return roles.is_forward(op.role) or roles.is_startup(op.role) or op.role == "comm"


def plan_for_test(p: Program) -> ForTestPlan:
    dropped: dict[int, str] = {}
    made = set(p.inputs) | {v.name for v in p.persistables()}
    for i, op in enumerate(p.ops):
        if not _kept_by_role(op):
            dropped[i] = f"role {op.role} (not part of a forward)"
        elif op.role == "comm" and not all(x in made for x in op.inputs if x):
            dropped[i] = "a collective over values the forward does not make (grads)"
        else:
            made.update(o for o in op.outputs if o)
    replaced = {i: _inference_form(op) for i, op in enumerate(p.ops) if i not in dropped}
    inference = tuple((i, _describe(p.ops[i], new)) for i, new in replaced.items() if new is not p.ops[i])
    for i, new in replaced.items():
        if new is None:
            dropped[i] = "no inference form (its row's for_test drops it)"
    live = set(p.outputs) | ({p.loss_name} if p.loss_name else set())
    for i in range(len(p.ops) - 1, -1, -1):
        op = replaced.get(i)
        if op is None:
            continue
        if _unread_derived(op, live):
            dropped[i] = "derived by a pass for the backward, read by nothing of the forward"
            inference = tuple((j, c) for j, c in inference if j != i)
            continue
        live.update(x for x in op.inputs if x)
    return ForTestPlan(
        program=p.name,
        kept=len(p.ops) - len(dropped),
        inference=inference,
        dropped=dropped,
        forward_only_pipeline=p.pipeline is not None,
    )


def _inference_form(op: Op) -> Op | None:
    row = registry.get(op.type)
    if row is None or row.for_test is None:
        return op
    return row.for_test(op)


def _describe(old: Op, new: Op | None) -> str:
    where = f" ({old.scope})" if old.scope else ""
    if new is None:
        return f"{old.type}{where} dropped"
    if new.type != old.type:
        return f"{old.type}{where} -> {new.type}"
    changed = sorted(k for k in {*old.attrs, *new.attrs} if old.attrs.get(k) != new.attrs.get(k))
    outs = (
        "" if len(new.outputs) == len(old.outputs) else f", outputs {len(old.outputs)} -> {len(new.outputs)}"
    )
    return f"{old.type}{where}: " + ", ".join(f"{k}={new.attrs.get(k)}" for k in changed) + outs


def _unread_derived(op: Op, live: set[str]) -> bool:
    """An op a pass derived from a forward value (its `origin` is set; the model's own ops have
    none) whose outputs nothing reads: a record or copy the backward needed. An op without
    outputs is there for its effect (a Send) and stays."""
    if op.origin is None or roles.is_startup(op.role) or not op.outputs:
        return False
    return not any(o and o in live for o in op.outputs)


def for_test(p: Program, *, plan: ForTestPlan | None = None) -> Program:
    """`p`'s evaluation program (module doc); `p` is left as it is."""
    plan = plan or plan_for_test(p)
    q = p.clone()
    ops = []
    for i, op in enumerate(q.ops):
        if i in plan.dropped:
            continue
        new = _inference_form(op)
        ops.append(new)
    q.ops = ops
    q.updates = {}
    q.gradient_merge = None
    q.phases = None
    q.donated = frozenset()
    _drop_unreferenced(q)
    if q.pipeline is not None:
        q.pipeline = dataclasses.replace(q.pipeline, forward_only=True)
        from metaopt.passes.pipeline_phases import pipeline_phases

        q = pipeline_phases(q)
    verify(q)
    return q


def _drop_unreferenced(q: Program) -> None:
    """Vars no op reads or makes (grads, optimizer state, masks): an eval program declares only
    what it holds, so the scope's other entries (the training program's) are not its business."""
    # the inputs stay: an eval program takes the training program's feeds (labels it may not read)
    used = {x for op in q.ops for x in (*op.inputs, *op.outputs) if x} | set(q.inputs)
    q.outputs = [x for x in q.outputs if x in used]
    if q.loss_name is not None and q.loss_name not in used:
        q.loss_name = None
    for name in [n for n in q.vars if n not in used]:
        del q.vars[name]
        q.values.pop(name, None)
        q.fills.pop(name, None)
        q.referenced.pop(name, None)
    q.modules = {m: [x for x in outs if x in used] for m, outs in q.modules.items()}
    q.derived = frozenset(x for x in q.derived if x in used)


register_for_test(for_test)  # Program.clone(for_test=True)
