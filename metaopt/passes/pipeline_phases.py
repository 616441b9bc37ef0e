"""Cut a pipeline stage program into the sub-programs its schedule runs.

    plan = plan_phases(stage_program)          # printable: each phase's ops, feeds, carried values
    stage_program = apply_phases(stage_program, plan)   # a copy with ``.phases`` set

The executor runs a stage program (``Program.pipeline`` set, passes/pipeline.py) phase by phase:
the forward and the backward of each virtual stage this worker holds once per micro-batch, the
optimizer once per step (runtime/pipeline.py). This pass makes those sub-programs, so what runs
is a verified program made by a pass, not a cut made at run time. It is the last step of a
pipelined minimize; a stage program changed after its cut no longer matches it
(``Phases.matches``) and the executor refuses it.

* **Phases** come from each op's role (``roles.phase``) and virtual stage (``Op.stage``); the
  optimizer's phase is one, whatever stages its ops carry. Phases keep program order: forwards
  by chunk, backwards, then the optimizer.
* **Carried values**: what a phase makes and a later phase of the same micro-batch reads
  (activations the backward needs) leaves it as an output and enters the later one as an input;
  the runner holds it between them and gives it up (`donated`) at its last reader, unless a
  Send may still be reading it. Offloaded copies (a row with ``host_memory``) are counted as
  host bytes.
* **A split backward** (a zero-bubble schedule, ``PipelineInfo.splits_backward``): each chunk's
  backward is cut in two, B (its receives and sends and every op they depend on: the grads
  the previous stage waits for, sent or, across ZB-V's hand-off, read by this worker's other
  chunk) and W (the rest: the weight grads, their accumulation, and what only they read), run
  as separate actions; what W reads of F's and B's values is carried to it. A value phases of
  two chunks read (ZB-V: worker 0's forward of the first chunk makes what the last chunk reads
  too) is never given up by a phase, since a schedule may run the W actions of the two chunks in
  either order: the runner drops it after the micro-batch's last action.
* **The optimizer** reads the accumulated grads from the scope: its reads of a grad the
  backward accumulates (``GradMerge``'s result) are renamed to the persistable accumulator.
"""

from __future__ import annotations

from dataclasses import dataclass

from metaopt.ir import Op, Program, Var, names, roles, verify
from metaopt.ir.program import WEIGHT_PHASE, Phase, Phases, ops_signature
from metaopt.ops import registry
from metaopt.passes.one_call import one_call

Key = tuple[int, str]


class PhaseError(ValueError):
    """A stage program no schedule can run phase by phase (the message names the value)."""


@dataclass(frozen=True)
class PhasePlan:
    """Where each op of one stage program runs: `keys` in program order, `ops[k]` the indices
    of key k's ops; what each phase is fed, carries in and out, gives up at its last read."""

    program: str
    keys: tuple[Key, ...]
    ops: dict[Key, tuple[int, ...]]
    feeds: dict[Key, tuple[str, ...]]
    carried_in: dict[Key, tuple[str, ...]]
    carried_out: dict[Key, tuple[str, ...]]
    last_use: dict[Key, frozenset[str]]
    host_out: dict[Key, frozenset[str]]
    donated: dict[Key, frozenset[str]]
    renames: dict[str, str]  # the optimizer's reads of accumulated grads -> their accumulator

    def __str__(self) -> str:
        lines = [f"pipeline phases of {self.program!r}:"]
        for k in self.keys:
            what = "optimizer" if k[0] < 0 else f"chunk {k[0]} {k[1]}"
            lines.append(
                f"  {what}: {len(self.ops[k])} ops, feeds {list(self.feeds[k])}, "
                f"carries in {len(self.carried_in[k])}, out {len(self.carried_out[k])}"
                + (f" ({len(self.host_out[k])} in host memory)" if self.host_out[k] else "")
            )
        return "\n".join(lines)


def _key(op: Op) -> Key:
    phase = roles.phase(op.role)
    if phase is None:
        raise PhaseError(f"pipeline: op role {op.role!r} has no phase ({op.type} -> {op.outputs})")
    return (-1, phase) if phase == roles.OPTIMIZE else (op.stage, phase)


def plan_phases(p: Program) -> PhasePlan:
    """The cut of stage program `p`; raises PhaseError naming a value no phase can get."""
    if p.pipeline is None:
        raise PhaseError(f"program {p.name!r} is not a pipeline stage program (passes/pipeline.py)")
    groups: dict[Key, list[int]] = {}
    for i, op in enumerate(p.ops):
        groups.setdefault(_key(op), []).append(i)
    if p.pipeline.splits_backward:
        groups = _split_backwards(p, groups)
    keys = tuple(groups)
    made_in = {o: k for k in keys for i in groups[k] for o in p.ops[i].outputs if o}
    produced = {k: {o for i in groups[k] for o in p.ops[i].outputs if o} for k in keys}
    reads = {k: {x for i in groups[k] for x in p.ops[i].inputs if x} for k in keys}
    update_of = {new: target for target, new in p.updates.items()}
    order = {x: n for n, x in enumerate(p.vars)}
    renames: dict[str, str] = {}
    feeds: dict[Key, tuple[str, ...]] = {}
    carried_in: dict[Key, tuple[str, ...]] = {}
    carried_out: dict[Key, tuple[str, ...]] = {}
    host_out: dict[Key, frozenset[str]] = {}
    for n, k in enumerate(keys):
        later = [k2 for k2 in keys[n + 1 :] if k2[1] != roles.OPTIMIZE]  # B, then W, per micro-batch
        carried_out[k] = tuple(sorted({x for k2 in later for x in reads[k2] & produced[k]}, key=order.get))
        host_out[k] = frozenset(
            o for i in groups[k] if _in_host_memory(p.ops[i]) for o in p.ops[i].outputs if o in carried_out[k]
        )
        if k[1] == roles.OPTIMIZE:
            # the updates read the accumulated grads: from the scope, where the backward put them
            renames.update({x: update_of[x] for x in reads[k] if x in update_of and x not in produced[k]})
        feeds[k], carried_in[k] = _inputs(p, k, groups[k], produced[k], made_in, renames)
    last_reader = {x: k for k in keys for x in carried_in[k]}  # keys in the order one micro-batch runs
    sent = {x for i, op in enumerate(p.ops) if "peer" in op.attrs for x in op.inputs}
    floating = _read_by_chunks_in_any_order(p, keys, carried_in)
    last_use = {
        k: frozenset(x for x in carried_in[k] if last_reader[x] == k and x not in floating) for k in keys
    }
    return PhasePlan(
        program=p.name,
        keys=keys,
        ops={k: tuple(v) for k, v in groups.items()},
        feeds=feeds,
        carried_in=carried_in,
        carried_out=carried_out,
        last_use=last_use,
        host_out=host_out,
        # given up before the phase runs: an op may write one in place (ScaleGrads on
        # LinearCrossEntropy's unit grads), unless a Send may still be reading it
        donated={k: last_use[k] - sent for k in keys},
        renames=renames,
    )


def _read_by_chunks_in_any_order(
    p: Program, keys: tuple[Key, ...], carried_in: dict[Key, tuple[str, ...]]
) -> set[str]:
    """Carried values read by phases of more than one chunk of a split backward: a schedule
    orders each chunk's F, B and W and the chunks' F and B actions (the data flow does), but
    not the W actions of two chunks, so no phase is known to read such a value last."""
    assert p.pipeline is not None  # plan_phases checked it
    if not p.pipeline.splits_backward or p.pipeline.chunks == 1:
        return set()
    chunks: dict[str, set[int]] = {}
    for k in keys:
        for x in carried_in[k]:
            chunks.setdefault(x, set()).add(k[0])
    return {x for x, cs in chunks.items() if len(cs) > 1}


def _split_backwards(p: Program, groups: dict[Key, list[int]]) -> dict[Key, list[int]]:
    """Each chunk's backward as B, the ops the grads it sends to the previous stage need (its
    receives and sends and what they depend on), then W, the rest: the weight grads and what
    only they read (a zero-bubble schedule runs W later). Order kept within each."""
    out: dict[Key, list[int]] = {}
    for key, idx in groups.items():
        if key[1] != roles.BACKWARD:
            out[key] = idx
            continue
        b = needed_by_sends(p, idx)[0]
        out[key] = [i for i in idx if i in b]
        out[(key[0], WEIGHT_PHASE)] = [i for i in idx if i not in b]
    return out


def needed_by_sends(p: Program, idx: list[int]) -> tuple[set[int], set[str]]:
    """Of the backward ops `idx` (program order), those a zero-bubble schedule's B runs: the
    receives and sends, the ops making what another chunk's backward on this worker reads (ZB-V's
    hand-off between virtual stages p-1 and p, which is no message), and every op whose outputs
    they need; and the vars B needs."""
    own = set(idx)
    handed_on = {
        x
        for i, op in enumerate(p.ops)
        if i not in own and roles.phase(op.role) == roles.BACKWARD
        for x in op.inputs
        if x
    }
    needed: set[str] = set()
    b: set[int] = set()
    for i in reversed(idx):
        op = p.ops[i]
        outs = [o for o in op.outputs if o]
        if "peer" in op.attrs or needed.intersection(outs) or handed_on.intersection(outs):
            b.add(i)
            needed.update(x for x in op.inputs if x)
    return b, needed


def _in_host_memory(op: Op) -> bool:
    row = registry.get(op.type)
    return row is not None and row.host_memory is not None and bool(row.host_memory(op.attrs))


def _inputs(
    p: Program, k: Key, idx: list[int], produced: set[str], made_in: dict[str, Key], renames: dict[str, str]
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(feeds, carried in) of phase `k`, in first-read order; the micro-batch index is neither
    (the runner feeds it)."""
    feeds, carried = [], []
    for x in dict.fromkeys(x for i in idx for x in p.ops[i].inputs if x):
        v = p.vars[renames.get(x, x)]
        if v.persistable or x in produced or x == names.micro_batch():
            continue
        if k[1] == roles.OPTIMIZE:
            raise PhaseError(f"pipeline: the optimizer reads {x!r}, made once per micro-batch")
        if v.kind != "input" and x not in made_in:
            raise PhaseError(f"pipeline: {x!r} is read by {_name(p, k)} but made by no phase")
        (feeds if v.kind == "input" else carried).append(x)
    return tuple(feeds), tuple(carried)


def _name(p: Program, k: Key) -> str:
    return f"{p.name}.{'optimizer' if k[0] < 0 else f'stage{k[0]}.{k[1]}'}"


def apply_phases(p: Program, plan: PhasePlan) -> Program:
    """A copy of `p` with ``phases`` set to the sub-programs of `plan`, each verified (a
    PhaseError names the phase and the broken invariant; the driver verifies `p` itself)."""
    if plan.program != p.name:
        raise PhaseError(f"a phase plan of {plan.program!r} applied to {p.name!r}")
    out = p.clone()
    parts = []
    for k in plan.keys:
        produced = frozenset(o for i in plan.ops[k] for o in p.ops[i].outputs if o)
        parts.append(
            Phase(
                chunk=k[0],
                phase=k[1],
                program=_subprogram(p, k, plan, produced),
                feeds=plan.feeds[k],
                carried_in=plan.carried_in[k],
                carried_out=plan.carried_out[k],
                last_use=plan.last_use[k],
                produced=produced,
                host_out=plan.host_out[k],
            )
        )
    for part in parts:
        try:
            verify(part.program)
        except ValueError as e:
            raise PhaseError(f"pipeline: phase {part.program.name!r} is not a valid program: {e}") from e
    out.phases = Phases(tuple(parts), ops_signature(out))
    return out


def _subprogram(p: Program, k: Key, plan: PhasePlan, produced: frozenset[str]) -> Program:
    q = Program(_name(p, k))
    renames = plan.renames if k[1] == roles.OPTIMIZE else {}
    # A phase runs on one worker: the virtual stages of its ops (chunks) need no transfers.
    ops = [
        Op(
            op.type,
            [renames.get(x, x) for x in op.inputs],
            list(op.outputs),
            dict(op.attrs),
            op.role,
            None,
            op.scope,
            op.origin,
        )
        for op in (p.ops[i] for i in plan.ops[k])
    ]
    for x in dict.fromkeys(x for op in ops for x in (*op.inputs, *op.outputs) if x):
        v = p.vars[x]
        if v.persistable or x in produced:
            q.add_var(_copy(v), p.values.get(x), fill=p.fills.get(x))
        else:
            q.add_var(_copy(v, kind="input"))
    mb = [names.micro_batch()] if names.micro_batch() in q.vars else []
    q.inputs = [*plan.feeds[k], *plan.carried_in[k], *mb]
    q.ops = ops
    q.updates = {t: n for t, n in p.updates.items() if n in produced}
    q.loss_name = p.loss_name if p.loss_name in produced else None
    q.outputs = [q.loss_name] if q.loss_name else []
    q.donated = plan.donated[k]
    return q


def _copy(v: Var, kind: str | None = None) -> Var:
    # a tensor-parallel param (and its state) keeps its split layout: checkpoints save it by part
    return v.copy() if kind is None else v.copy(kind=kind, split=None)


pipeline_phases = one_call(plan_phases, apply_phases)
