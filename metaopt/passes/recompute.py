"""Recompute (Fleet's RecomputeOptimizer semantics) on a training program.

    plan = plan_recompute(program, checkpoints=["bert.encoder.layer.*"])
    print(plan)                       # segments, held values, skipped names
    program = recompute(program, checkpoints=["bert.encoder.layer.*"])

* Checkpoints are var names, module paths, or module-path patterns where ``*``
  stands for one path component (``"encoder.layer.*"`` = each layer's output); a module
  called several times has one output per call (``layer``, ``layer@1``, ``layer@2``: the
  export numbers repeated calls as torch.export does), and its path names every call; or
  ``"auto"``: every sqrt(n)-th of the model's n repeated blocks, or with a memory
  budget the fewest evenly spaced blocks whose predicted activation peak fits it;
  order does not matter, duplicates are ignored; an unknown name is an error with a
  did-you-mean; a checkpoint the backward never needs is reported in `skipped`.
* Segments run from one checkpoint to the next (the head before the first
  checkpoint included, as Fleet does; ``recompute_head=False`` holds the head's values
  instead, as torch.utils.checkpoint around each block does: the right call when the head
  is costly and small, a CNN's stem); ops after the last checkpoint are not recomputed. Before the
  first backward op that reads a value of a segment, the forward ops of that segment
  that the backward needs are re-emitted (role ``recompute``, outputs ``x@RECOMPUTE``,
  origin = the forward var), and the backward reads the copies. So between the end of
  the forward and its segment's backward, no non-checkpoint activation of a
  recomputed segment is alive. A value one segment computes and a later segment
  reads is held (listed in the plan) rather than recomputed across segments.
* Random ops are replayed exactly: an ``RngState`` op right before each recomputed
  random op records the generator state, and the recomputed copy
  (``RngReplay``) restores it around the op's own kernel, so its mask is
  bit-identical to the forward's (``seed_random_ops=False`` turns this off, to show
  the difference). The forward ops themselves are unchanged, so a recomputed program
  computes exactly what the program without recompute computes.
* Per-channel statistics an op's row lists in `recompute_holds` (BatchNorm's saved mean and
  inverse std) are held from the forward, not recomputed: a block's last BatchNorm, whose
  output only the residual add reads (its grad reads nothing), is then not re-run at all.

The pass is pure and runs after the backward (it is a rewrite of the training
program: forward, backward, optimizer).
"""

from __future__ import annotations

import difflib
import fnmatch
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from metaopt.ir import Op, Program, Var, did_you_mean, names, roles
from metaopt.ops import registry, rng_streams
from metaopt.passes.driver import plan_text
from metaopt.passes.one_call import one_call

# The CPU generator's state (what RngState records on CPU; a CUDA state is 16 bytes):
# declared so memory estimates count the states held from forward to recompute.
RNG_STATE_BYTES = torch.get_rng_state().numel()


class RecomputeError(ValueError):
    pass


@dataclass
class Segment:
    start: str | None  # the checkpoint opening it; None for the head
    end: str  # the checkpoint closing it
    ops: list[int] = field(default_factory=list)  # forward ops re-emitted, in order


@dataclass
class RecomputePlan:
    checkpoints: list[str]
    segments: list[Segment]
    held: list[str]  # non-checkpoint values kept because a later segment reads them
    skipped: list[tuple[str, str]]  # (name, why it is not used)
    kept_by_policy: list[str] = field(default_factory=list)  # selective: matmul-class outputs kept
    head_held: bool = False  # recompute_head=False: the ops before the first checkpoint are not re-run
    stats: list[str] = field(default_factory=list)  # per-channel statistics held (rows' recompute_holds)
    # random ops re-emitted with their forward's generator state (RngState/RngReplay): bit-identical
    seed_random_ops: bool = True

    def not_recomputed(self) -> set[str]:
        """Every value the backward reads from the forward rather than from a recompute."""
        return set(self.checkpoints) | set(self.held) | set(self.kept_by_policy) | set(self.stats)

    def __str__(self) -> str:
        items = []
        if self.head_held and self.checkpoints:
            items.append(f"<head> -> {self.checkpoints[0]}: held, not recomputed (recompute_head=False)")
        for s in self.segments:
            items.append(f"segment {s.start or '<head>'} -> {s.end}: {len(s.ops)} ops recomputed")
        if self.held:
            items.append(f"held (read across segments): {', '.join(self.held)}")
        if self.kept_by_policy:
            items.append(f"kept by the selective policy: {len(self.kept_by_policy)} values")
        if self.stats:
            items.append(
                f"statistics held (BatchNorm's saved mean and inverse std): {len(self.stats)} values"
            )
        head = f"recompute plan: {len(self.checkpoints)} checkpoints, {len(self.segments)} segments"
        return plan_text(head, items, self.skipped)


def _hint(p: Program, name: str) -> str:
    """did-you-mean for a checkpoint, plus, when the closest module is one of a numbered family
    (``bert.encoder.layer.0``), the pattern naming every one (``bert.encoder.layer.*``): what a
    checkpoint list usually wants."""
    hint = did_you_mean(name, [*p.modules, *p.vars])
    close = difflib.get_close_matches(name, list(p.modules), n=1, cutoff=0.6)
    parts = close[0].split(".") if close else []
    at = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    if at is None:
        return hint
    return f"{hint}; every block of that family: {'.'.join([*parts[:at], '*', *parts[at + 1 :]])!r}"


def resolve_checkpoints(p: Program, checkpoints: list, **auto: Any) -> list[str]:
    """Var names for the given names, module paths and patterns (deduplicated, in order given);
    "auto" is `auto_checkpoints` (which needs the training program), `auto` its keywords."""
    out: list[str] = []
    for entry in checkpoints:
        name = entry.name if isinstance(entry, Var) else entry
        if not isinstance(name, str):
            raise RecomputeError(f"checkpoint {entry!r} is not a var name or module pattern")
        if name == "auto":
            found = auto_checkpoints(p, **auto)
        else:  # a module first: its path names every call's output, not just the first's var
            found = [v for m in _match_modules(p, name) for v in p.modules[m]]
            if not found and name in p.vars:
                found = [name]
        if not found:
            raise RecomputeError(
                f"checkpoint {name!r} is neither a var nor a module of {p.name!r}{_hint(p, name)}"
            )
        out.extend(v for v in found if v not in out)
    return out


def block_outputs(p: Program) -> list[str]:
    """The outputs of the model's repeated blocks, in program order: the largest family of
    sibling modules with numbered names (``encoder.layer.0``, ``.1`` ...), or of the calls of
    one module called several times (ALBERT's shared ``layer``, ``layer@1`` ...). A shape
    expression a module makes for later ones (`shape_values`) is not one of its outputs here."""
    from metaopt.passes.fold_constants import shape_values

    shaped = shape_values(p)
    families: dict[str, list[str]] = {}
    for m, outs in p.modules.items():
        base = _call_base(m)
        parent, _, last = base.rpartition(".")
        outs = [o for o in outs if o not in shaped]
        if len(outs) != 1:
            continue
        if last.isdigit() and base == m:
            families.setdefault(parent, []).append(outs[0])
        if base != m or f"{m}@1" in p.modules:  # a module called more than once: each call
            families.setdefault(f"{base}@", []).append(outs[0])
    if not families or max(map(len, families.values())) < 2:
        return []
    # The largest family; among equals the outermost (a shared layer's calls, not its sublayers').
    best = families[max(families, key=lambda k: (len(families[k]), -k.count(".")))]
    order = {o: i for i, op in enumerate(p.ops) for o in op.outputs if o}
    return sorted(dict.fromkeys(best), key=lambda v: order.get(v, -1))


def auto_checkpoints(
    p: Program,
    *,
    memory_budget: int | None = None,
    batch: int = 8,
    policy: str = "full",
    keep_op_types: tuple[str, ...] = (),
) -> list[str]:
    """Checkpoints chosen among the block outputs: every round(sqrt(n))-th block by default;
    with `memory_budget` (bytes of activations at `batch`), the fewest evenly spaced blocks
    whose predicted activation peak fits it."""
    import math

    from metaopt.passes.memory_estimate import estimate_memory

    blocks = block_outputs(p)
    if not blocks:
        raise RecomputeError(
            f"checkpoints 'auto': {p.name!r} has no repeated blocks (sibling modules named 0, 1, ...); "
            "name the checkpoints"
        )
    if memory_budget is None:
        stride = max(1, round(math.sqrt(len(blocks))))
        return blocks[stride - 1 :: stride]
    best = None
    for stride in range(len(blocks), 0, -1):  # fewest checkpoints first
        chosen = blocks[stride - 1 :: stride]
        q = recompute(p, checkpoints=chosen, policy=policy, keep_op_types=keep_op_types)
        peak = estimate_memory(q, dims={"batch": batch}).activation_peak_bytes
        if peak <= memory_budget:
            return chosen
        best = peak if best is None else min(best, peak)
    raise RecomputeError(
        f"checkpoints 'auto': no choice of block checkpoints fits memory_budget={memory_budget:,} bytes of "
        f"activations at batch {batch} (the best predicted is {best:,}); lower the batch or raise the budget"
    )


def _call_base(m: str) -> str:
    """The module path of a call: ``layer@2`` (its third call, torch.export's numbering) -> ``layer``."""
    return re.sub(r"@\d+$", "", m)


def _match_modules(p: Program, pattern: str) -> list[str]:
    # One path component per "*": "encoder.layer.*" is each layer, not what is inside it.
    # A path names every call of its module ("layer" = layer, layer@1, ...); "layer@1" one call.
    if not any(c in pattern for c in "*?[@") and pattern in p.modules and f"{pattern}@1" not in p.modules:
        return [pattern]  # a module called once, named as it is: tensor parallel names thousands
    parts = pattern.split(".")
    return [
        m
        for m in p.modules
        if len((path := (m if "@" in parts[-1] else _call_base(m))).split(".")) == len(parts)
        and all(fnmatch.fnmatchcase(a, b) for a, b in zip(path.split("."), parts))
    ]


POLICIES = ("full", "selective")


def plan_recompute(
    p: Program,
    *,
    checkpoints: list,
    policy: str = "full",
    keep_op_types: tuple[str, ...] = (),
    memory_budget: int | None = None,
    batch: int = 8,
    recompute_head: bool = True,
    seed_random_ops: bool = True,
) -> RecomputePlan:
    """Which forward ops each segment re-emits, and what is held; nothing is rewritten.

    ``policy="selective"`` also keeps the outputs of matmul-class ops (rows marked
    `expensive`) that multiply by a param (Linear, Gemm, Conv, MatMul with a weight),
    and of `keep_op_types`, recomputing the rest (attention's scores and softmax too).
    """
    if policy not in POLICIES:
        raise RecomputeError(f"unknown recompute policy {policy!r}{did_you_mean(policy, POLICIES)}")
    table = registry.table()
    for t in keep_op_types:
        if t not in table:
            raise RecomputeError(f"keep_op_types: unknown op type {t!r}{did_you_mean(t, table)}")
    resolved = resolve_checkpoints(
        p, checkpoints, memory_budget=memory_budget, batch=batch, policy=policy, keep_op_types=keep_op_types
    )
    first_bw = next((i for i, op in enumerate(p.ops) if roles.is_backward(op.role)), None)
    if first_bw is None:
        raise RecomputeError(f"program {p.name!r} has no backward ops: recompute rewrites a training program")
    fwd = p.ops[:first_bw]
    prod = {o: i for i, op in enumerate(fwd) for o in op.outputs if o}
    on_path = _loss_depends_on(p, fwd, prod)
    skipped, ckpts = [], []
    for n in resolved:
        if n not in prod:
            skipped.append((n, "not computed by the forward (a param, input or constant)"))
        elif n not in on_path:
            skipped.append((n, "not on the path to the loss"))
        else:
            ckpts.append(n)
    ckpts.sort(key=lambda n: prod[n])
    if not ckpts:
        return RecomputePlan([], [], [], skipped, seed_random_ops=seed_random_ops)
    bounds = [prod[c] for c in ckpts]
    first = 0 if recompute_head else 1  # the first segment recomputed

    def seg_of(i: int) -> int | None:  # the segment of op i; None: held (head, after the last checkpoint)
        j = next((j for j, b in enumerate(bounds) if i <= b), None)
        return None if j is None or j < first else j

    bw_reads = {x for op in p.ops[first_bw:] for x in op.inputs if x}
    kept = set(ckpts) | set(p.inputs) | {v.name for v in p.vars.values() if v.kind != "activation"}
    keep_types = set(keep_op_types)
    params = {v.name for v in p.vars.values() if v.kind == "param"}
    for op in fwd:  # a param read through a view (segment parallel's TPCopy) is still a weight
        if table[op.type].view and op.inputs and op.inputs[0] in params:
            params.update(o for o in op.outputs if o)

    def keep(op: Op) -> bool:
        # Selective (Megatron-style): keep what multiplies by a weight; recompute the
        # rest, attention's activation-by-activation products and softmax included.
        weighted = table[op.type].expensive and any(x in params for x in op.inputs)
        return op.type in keep_types or (policy == "selective" and weighted)

    by_policy = [
        o
        for i, op in enumerate(fwd)
        if seg_of(i) is not None and keep(op)
        for o in op.outputs
        if o and o not in kept
    ]
    kept.update(by_policy)
    # Ops whose rows say they must not run twice (RngState, copies, step counters): their
    # outputs are held from the forward, never recomputed.
    fixed = [o for i, op in enumerate(fwd) if not table[op.type].recomputable for o in op.outputs if o]
    kept.update(fixed)
    # Per-channel statistics (rows' `recompute_holds`) are held too: an op the backward needs
    # only for them (a residual block's last BatchNorm) is then not re-run at all.
    stats = [
        op.outputs[k]
        for i, op in enumerate(fwd)
        if seg_of(i) is not None
        for k in table[op.type].recompute_holds
        if k < len(op.outputs) and op.outputs[k]
    ]
    kept.update(stats)
    held: list[str] = []
    while True:  # grow `held` until no segment's recompute reads another segment's value
        needed: dict[int, set[int]] = {}
        work = [prod[x] for x in bw_reads if x in prod and x not in kept and seg_of(prod[x]) is not None]
        new_held = []
        while work:
            i = work.pop()
            j = seg_of(i)
            if i in needed.setdefault(j, set()):
                continue
            needed[j].add(i)
            for x in fwd[i].inputs:
                if x and x in prod and x not in kept:
                    if seg_of(prod[x]) == j:
                        work.append(prod[x])
                    elif x not in new_held:
                        new_held.append(x)
        if not new_held:
            break
        held.extend(new_held)
        kept.update(new_held)
    segments = [
        Segment(ckpts[j - 1] if j else None, ckpts[j], sorted(needed.get(j, ())))
        for j in range(first, len(ckpts))
    ]
    return RecomputePlan(
        ckpts, segments, held, skipped, by_policy, not recompute_head, stats, seed_random_ops=seed_random_ops
    )


def _loss_depends_on(p: Program, fwd: list[Op], prod: dict[str, int]) -> set[str]:
    """Forward values the loss depends on."""
    if p.loss_name is None or p.loss_name not in prod:
        raise RecomputeError(f"program {p.name!r} has no loss computed by its forward")
    seen, work = {p.loss_name}, [p.loss_name]
    while work:
        x = work.pop()
        if x in prod:
            for y in fwd[prod[x]].inputs:
                if y and y not in seen:
                    seen.add(y)
                    work.append(y)
    return seen


def apply_recompute(p: Program, plan: RecomputePlan) -> Program:
    """A copy of `p` in which each of `plan`'s segments is re-emitted before its backward."""
    q = p.clone()
    if not plan.checkpoints:
        return q
    first_bw = next(i for i, op in enumerate(q.ops) if roles.is_backward(op.role))
    kept = plan.not_recomputed()
    seg_of_value = {
        o: j
        for j, s in enumerate(plan.segments)
        for i in s.ops
        for o in q.ops[i].outputs
        if o and o not in kept
    }
    copies: dict[str, str] = {}  # forward value -> its recomputed copy
    rng_state: dict[int, str] = {}  # forward op index -> var holding the RNG state before it

    fwd: list[Op] = []
    replay = {i for s in plan.segments for i in s.ops if _random(q.ops[i])} if plan.seed_random_ops else set()
    for i, op in enumerate(q.ops[:first_bw]):
        if i in replay:
            state = names.fresh(names.saved(op.outputs[0], "RNG_STATE"), q.vars)
            q.add_var(Var(state, "uint8", (RNG_STATE_BYTES,)))
            # the stream the op draws from (MP-aware RNG): RngState records that generator's state
            attrs = rng_streams.stream_attrs(op.attrs)
            fwd.append(Op("RngState", [], [state], attrs, role=op.role, scope=op.scope, origin=op.outputs[0]))
            rng_state[i] = state
        fwd.append(op)

    emitted: set[int] = set()
    rest: list[Op] = []
    for op in q.ops[first_bw:]:
        for x in op.inputs:
            j = seg_of_value.get(x)
            if j is not None and j not in emitted:
                emitted.add(j)
                rest.extend(_reemit(q, plan.segments[j], copies, rng_state, kept))
        op.inputs = [copies.get(x, x) for x in op.inputs]
        rest.append(op)
    q.ops = [*fwd, *rest]
    return q


recompute = one_call(plan_recompute, apply_recompute)


def _reemit(
    q: Program, seg: Segment, copies: dict[str, str], rng_state: dict[int, str], kept: set[str]
) -> list[Op]:
    out = []
    ops = q.ops  # still the forward ops at these indices: recompute() rebuilds q.ops afterwards
    for i in seg.ops:
        op = ops[i]
        outs = []
        for o in op.outputs:
            if not o or o in kept:  # checkpoints and held values are read from the forward
                outs.append("")
                continue
            c = names.fresh(names.recompute(o), q.vars)
            v = q.vars[o]
            q.add_var(Var(c, v.dtype, v.shape, device=v.device))  # a per-device saved output stays one
            copies[o] = c
            outs.append(c)
        ins = [copies.get(x, x) for x in op.inputs]
        if i in rng_state:
            attrs = {"op": op.type, "n_out": len(op.outputs), **{f"f_{k}": v for k, v in op.attrs.items()}}
            # a random op that communicates (RingAttention) replays with the executor's runtime
            replay = "RngReplayCollective" if registry.get(op.type).needs_runtime else "RngReplay"
            new = Op(replay, [rng_state[i], *ins], outs, attrs)
        else:
            new = Op(op.type, ins, outs, dict(op.attrs))
        new.role, new.scope, new.origin = "recompute", op.scope, op.outputs[0]
        out.append(new)
    return out


def _random(op: Op) -> bool:
    row = registry.get(op.type)
    return row is not None and row.random


@dataclass
class MemoryReport:
    """What a recompute plan buys at one batch size (bytes, from `estimate_memory`)."""

    batch: int
    checkpoint_bytes: dict[str, int]  # held from the forward to the backward
    largest_segment: tuple[str, int]  # (its closing checkpoint, bytes its recompute allocates)
    peak_before: int  # predicted activation peak without recompute
    peak_after: int  # ... and with it

    @property
    def saves_memory(self) -> bool:
        return self.peak_after < self.peak_before

    def __str__(self) -> str:
        mib = 2**20
        lines = [
            f"recompute memory at batch {self.batch}: predicted activation peak "
            f"{self.peak_before / mib:.2f} MiB -> {self.peak_after / mib:.2f} MiB"
        ]
        lines += [f"  checkpoint {n}: {b / mib:.3f} MiB" for n, b in self.checkpoint_bytes.items()]
        lines.append(
            f"  largest segment: ends at {self.largest_segment[0]}, {self.largest_segment[1] / mib:.3f} MiB"
        )
        return "\n".join(lines)


def memory_report(before: Program, plan: RecomputePlan, after: Program, *, batch: int) -> MemoryReport:
    """Bytes per checkpoint, the largest segment and predicted peaks, at `batch`."""
    from metaopt.passes.memory_estimate import estimate_memory

    dims = {"batch": batch}
    ckpt = {c: before.vars[c].nbytes(dims) or 0 for c in plan.checkpoints}
    not_recomputed = plan.not_recomputed()
    seg_bytes = [
        (
            s.end,
            sum(
                before.vars[o].nbytes(dims) or 0
                for i in s.ops
                for o in before.ops[i].outputs
                if o and o not in not_recomputed
            ),
        )
        for s in plan.segments
    ]
    largest = max(seg_bytes, key=lambda t: t[1]) if seg_bytes else ("", 0)
    return MemoryReport(
        batch,
        ckpt,
        largest,
        estimate_memory(before, dims=dims).activation_peak_bytes,
        estimate_memory(after, dims=dims).activation_peak_bytes,
    )
