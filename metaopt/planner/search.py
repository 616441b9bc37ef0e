"""``fleet.plan``: the layouts of a job, each worker's memory predicted exactly, ranked (issue 45).

    plans = fleet.plan(program, devices=8, memory_per_device="16GiB", global_batch=32)
    print(plans)              # every layout that fits, best first, and what pruned the others
    plans[0].strategy         # a ready DistributedStrategy
    plans[0].peak_bytes       # the worst worker's predicted device peak

Nothing runs and no worker starts. For each layout of the grid stage 0's first worker is rewritten
in this process (`fleet.simulate`: that worker's program, exactly; a pipeline's minimize makes
every stage's program), and each stage's peak predicted by `estimate_memory`
(`estimate_pipeline_memory` for a pipeline stage, which replays the schedule): live bytes as the
executor counts them, without kernels' own workspace. A layout whose worst worker's peak exceeds
`memory_per_device` is pruned, as is one the rewrite refuses (the refusal is the reason shown).
Identical layers are solved once (`_Job.evaluate`, planner/blocks.py): a layout is first rewritten
at 2 and 3 blocks per stage (its time exact, its peak a lower bound), and only those that fit by
that bound are rewritten whole, fastest first; before any rewrite, a layout whose params and
optimizer state alone exceed the budget is pruned (`_Job.floor`). A pipeline of more than 3 stages
over identical blocks is rewritten as 3 (first, middle, last: `_Job._figures`), its middle stages'
peaks from the one middle program replayed at each place of the schedule.

The grid: every split of `devices` into data-side x model x pipe degrees; the data side as data
parallel or as ZeRO (sharding) at stages 1, 2 and 3, and on a MoE model also as expert parallel
over each divisor splitting its experts (tp and pp 1), without an expert capacity (the rows a
worker's experts receive are data: its peak is predicted at their bound, every row of the group)
and with each of the `capacity_factors` the caller allows (fixed slots: exact, but rows past an
expert's capacity are dropped, which changes what is trained: none unless asked); tensor
parallel with the column and row layers found by ``"auto"``; pipelines of 1F1B with as many and
twice as many micro-batches as stages, cut between repeated blocks (as many each); recompute
none, selective or full (`Layout`).

The time (`Plan.step_seconds`) is the time model of planner/calibrate.py over the worker's own
program, every op of its step (forward, backward, recompute, optimizer): each op costs a fixed
`op_seconds` (dispatch) + its FLOPs / `device_flops` + the bytes it touches / `device_bytes_per_s`,
its FLOPs by its row's rule (ops/costs.py: MatMul, Gemm, Linear, Conv, attention and their grads,
which are ops of the program too); each collective takes `link_latency_s` + its bytes over the
ring (2 (n-1)/n of them for an all-reduce) / `link_bytes_per_s`; a pipeline stage's step is
(micro-batches + stages - 1) times its forward and backward phases' seconds for one micro-batch
(1F1B's bubble), plus its optimizer phase's (the update and the grads' all-reduce) once. The rates are
`metaopt.planner.calibrate.calibrate`'s, measured on the device (``rates=``), or declared (a roofline's
guesses). For a layout without a pipeline, `Plan.layers` holds what one repeated block keeps for
the backward beside Korthikanti et al. 2022's count for its shape (the table prints the best
plan's). Not built yet: the search over offload, interleaved / zero-bubble schedules, expert
parallel beside tp or pp, AMP and per-stage recompute; overlap of communication with compute in
the time model (docs/planning.md, "Not yet").
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from metaopt.fleet import env
from metaopt.fleet.strategy import DistributedStrategy
from metaopt.ir import Program, roles
from metaopt.ir.gc_pause import without_gc
from metaopt.layout.topology import AXES, Topology
from metaopt.ops import costs, registry
from metaopt.planner.blocks import Blocks, find_blocks, with_blocks, within
from metaopt.planner.calibrate import Rates, op_cost
from metaopt.planner.workers import Pool, evaluated

MAX_DEVICES = 1 << 20  # a job of a million workers: beyond it a figure is surely a typo
MAX_BYTES = 1 << 60  # 1 EiB per device
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40})
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


class PlanError(ValueError):
    pass


def parse_bytes(value: Any, what: str = "memory_per_device") -> int:
    """Bytes from an int or a string such as "80GiB" / "512 MB"; refused by name otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise PlanError(
            f"fleet.plan: {what} must be bytes (an int) or a string such as '80GiB', got {value!r}"
        )
    if isinstance(value, str):
        m = _SIZE.match(value)
        unit = m[2].upper() if m else None
        if m is None or unit not in _UNITS:
            raise PlanError(
                f"fleet.plan: {what}={value!r} is not a size: write bytes or a number and a unit "
                f"({', '.join(u for u in ('B', 'KiB', 'MiB', 'GiB', 'TiB', 'KB', 'MB', 'GB', 'TB'))})"
            )
        value = int(float(m[1]) * _UNITS[unit])
    if not 1 <= value <= MAX_BYTES:
        raise PlanError(f"fleet.plan: {what}={value} bytes is outside 1 .. 2^60 (1 EiB)")
    return value


def _count(value: Any, what: str, most: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
        raise PlanError(f"fleet.plan: {what} must be an int in 1 .. {most}, got {value!r}")
    return value


RECOMPUTE = ("none", "selective", "full")
POINTS = (2, 3)  # blocks per stage a layout is rewritten at where its figures are extended
STAND_IN = 3  # a deeper pipeline over identical blocks is rewritten as one of this many stages
MANY = 64  # layouts to rewrite from which `workers` defaults to the machine's cores


@dataclass(frozen=True)
class Layout:
    """One point of the grid: the degrees, the data side's form, recompute and micro-batches.

    `recompute`: "none"; "full" (each repeated block's output kept, the rest of a block recomputed
    in the backward: Megatron's full recompute); "selective" (the same segments, their matmul-class
    outputs kept too). `blocks`: the repeated blocks' module pattern those checkpoints name
    (``model.layers.*``); None where the model has none (checkpoints "auto"). `cuts`: the module
    paths where pipeline stages begin (the blocks split evenly); () = balanced by estimated cost."""

    data: int
    model: int
    pipe: int
    stage: int  # 0: data parallel over the data side; 1-3: ZeRO (sharding) at that stage
    recompute: str
    micro_batches: int
    blocks: str | None = None
    cuts: tuple[str, ...] = ()
    expert: int = 1  # ep_degree: each MoE layer's experts split over this many data-side workers
    capacity: float = 0.0  # moe_configs capacity_factor of an ep layout (0: no capacity)
    amp: str = ""  # amp_configs dtype ("bfloat16", "float16"; "": float32 throughout)

    def describe(self) -> str:
        side = f"dp={self.data}" if self.stage == 0 else f"sharding={self.data} (ZeRO-{self.stage})"
        ep = f" ep={self.expert}" if self.expert > 1 else ""
        ep += f" capacity={self.capacity:g}" if self.capacity else ""
        pipe = f" pp={self.pipe} ({self.micro_batches} micro-batches, 1F1B)" if self.pipe > 1 else ""
        amp = f" amp={self.amp}" if self.amp else ""
        return f"{side}{ep} mp={self.model}{pipe} recompute={self.recompute}{amp}"

    def strategy(self) -> DistributedStrategy:
        s = DistributedStrategy()
        dp, sh = (self.data, 1) if self.stage == 0 else (1, self.data)
        s.hybrid_configs = {
            "dp_degree": dp,
            "mp_degree": self.model,
            "pp_degree": self.pipe,
            "sharding_degree": sh,
            **({"ep_degree": self.expert} if self.expert > 1 else {}),
        }
        if self.model > 1:
            s.tensor_parallel = True
            s.tensor_parallel_configs = {"column": "auto", "row": "auto"}
        if self.pipe > 1:
            s.pipeline = True
            s.pipeline_configs = {
                "accumulate_steps": self.micro_batches,
                "micro_batch_size": None,
                "cuts": list(self.cuts),
            }
        if self.stage:
            s.sharding = True
            s.sharding_configs = {"stage": self.stage}
        if self.capacity:
            s.moe_configs = {"capacity_factor": self.capacity}
        if self.amp:  # O1: white ops in the low dtype, float32 params; bf16 needs no loss scaling
            s.amp = True
            s.amp_configs = {"dtype": self.amp, "use_dynamic_loss_scaling": self.amp == "float16"}
        if self.recompute != "none":
            s.recompute = True
            s.recompute_configs = {
                "checkpoints": [self.blocks] if self.blocks else "auto",
                "policy": "selective" if self.recompute == "selective" else "full",
            }
        return s


@dataclass
class Plan:
    """A layout that fits: its strategy, the worst worker's predicted peak and step time."""

    layout: Layout
    strategy: DistributedStrategy
    peak_bytes: int
    step_seconds: float
    stage_peaks: list[int] = field(default_factory=list)  # per pipeline stage's first worker
    layers: LayerActivations | None = None  # a layout without a pipeline, on repeated blocks

    def describe(self) -> str:
        return (
            f"{self.layout.describe()}: peak {_gib(self.peak_bytes)} (worst worker), "
            f"step {self.step_seconds:.4g} s (predicted)"
        )


@dataclass(frozen=True)
class LayerActivations:
    """What one repeated block (a transformer layer) keeps for the backward on a worker, beside
    Korthikanti et al. 2022's count for its shape: ``sbh(34 + 5as/h)`` bytes without recompute,
    ``34sbh`` with their selective recompute (the attention's softmax, its dropout and the scores'
    matmuls recomputed; ours keeps the matmul-class outputs and recomputes the rest, a different
    choice of what to keep), ``2sbh`` with full recompute (16-bit activations, 1-byte dropout
    masks; s the sequence, b the micro-batch, h the hidden size, a the heads)."""

    bytes_per_layer: float  # ours: the blocks' activations alive where the backward starts, per block
    s: int
    b: int
    h: int
    a: int
    recompute: str  # Layout.recompute: "none", "selective", "full"

    def korthikanti(self) -> float:
        sbh = self.s * self.b * self.h
        return {"full": 2.0, "selective": 34.0}.get(self.recompute, 34 + 5 * self.a * self.s / self.h) * sbh

    def describe(self) -> str:
        formula = {"full": "2sbh (full recompute)", "selective": "34sbh (selective recompute)"}.get(
            self.recompute, "sbh(34 + 5as/h)"
        )
        return (
            f"activations per layer (s={self.s}, b={self.b}, h={self.h}, a={self.a}): "
            f"{_gib(self.bytes_per_layer)} predicted; Korthikanti et al. 2022: "
            f"{_gib(self.korthikanti())} = {formula}, for 16-bit activations"
        )


class Plans(list):
    """The plans that fit, best (fastest, then smallest) first; `pruned`: (layout, why) of the rest."""

    def __init__(self, plans: Iterable[Plan], pruned: list[tuple[Layout, str]], header: str) -> None:
        super().__init__(plans)
        self.pruned = pruned
        self.header = header

    def __str__(self) -> str:
        lines = [self.header, f"{len(self)} plans fit, best first:"]
        lines += [f"  {k + 1:>3}. {p.describe()}" for k, p in enumerate(self)]
        if self and self[0].layers is not None:
            lines.append(f"the best plan's {self[0].layers.describe()}")
        lines.append(f"{len(self.pruned)} pruned:")
        lines += [f"       {lay.describe()}: {why}" for lay, why in self.pruned]
        return "\n".join(lines)


def _gib(n: float) -> str:
    from metaopt.passes.memory_estimate import human_bytes

    return human_bytes(n)


def grid(
    devices: int,
    global_batch: int,
    blocks: Blocks | None = None,
    experts: int = 0,
    capacities: tuple[float, ...] = (),
    amp: str = "",
) -> tuple[list[Layout], list[tuple[Layout, str]]]:
    """Every layout of `devices` (module doc), and those the batch or the blocks rule out, with why.
    `experts`: the MoE layers' expert count (their gcd; 0: none): the data side also as expert
    parallel over each of its divisors that splits them, where neither tp nor pp is above 1
    (the rewrite refuses ep beside them); each such layout without a capacity and with each of
    `capacities`. `amp`: every layout's AMP dtype (not searched: the caller's precision)."""
    out, pruned = [], []
    pattern = blocks.pattern if blocks is not None else None
    for data in _divisors(devices):
        for model in _divisors(devices // data):
            pipe = devices // data // model
            micro = (1,) if pipe == 1 else (pipe, 2 * pipe)
            stages = (0,) if data == 1 else (0, 1, 2, 3)
            cuts = _cuts(blocks.modules, pipe, blocks.count // pipe) if blocks and pipe > 1 else ()
            alone = experts and model == pipe == 1
            eps = [1, *(e for e in _divisors(data) if e > 1 and experts % e == 0)] if alone else [1]
            variants = [(1, 0.0), *((e, c) for e in eps if e > 1 for c in (0.0, *capacities))]
            for stage, m, recompute, (ep, cap) in itertools.product(stages, micro, RECOMPUTE, variants):
                lay = Layout(data, model, pipe, stage, recompute, m, pattern, cuts, ep, cap, amp)
                if global_batch % (data * m):
                    why = f"global_batch {global_batch} does not split into {data} x {m}"
                elif blocks is not None and blocks.count % pipe:
                    why = f"{blocks.count} blocks of {pattern!r} do not split into {pipe} stages"
                else:
                    out.append(lay)
                    continue
                pruned.append((lay, why))
    return out, pruned


def _capacities(factors: Iterable[float]) -> tuple[float, ...]:
    if isinstance(factors, (str, bytes)) or not isinstance(factors, Iterable):
        raise PlanError(f"fleet.plan: capacity_factors must be a list of numbers > 0, got {factors!r}")
    out = tuple(factors)
    for f in out:
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f < math.inf:
            raise PlanError(f"fleet.plan: capacity_factors must be numbers > 0, got {f!r}")
    return tuple(sorted({float(f) for f in out}))


def _cuts(modules: tuple[str, ...], pipe: int, per_stage: int) -> tuple[str, ...]:
    """Where stages 1 .. pipe-1 begin: every `per_stage`-th block (the first stage also holds
    what comes before the blocks, the last what comes after: the embedding, the head)."""
    return tuple(modules[k * per_stage] for k in range(1, pipe))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def plan(
    program_or_module: Any,
    example_args: tuple | None = None,
    *,
    devices: int,
    memory_per_device: int | str,
    global_batch: int,
    optimizer: Any = None,
    device_flops: float = 1e12,
    device_bytes_per_s: float = 1e11,
    link_bytes_per_s: float = 1e10,
    link_latency_s: float = 1e-5,
    rates: Rates | None = None,
    compute_units: int | None = None,
    top: int | None = None,
    blocks_once: bool = True,
    workers: int | None = None,
    capacity_factors: Iterable[float] = (),
    amp: str | None = None,
) -> Plans:
    """The layouts of a `devices`-worker job that fit `memory_per_device` each, best first
    (module doc). `program_or_module`: an exported forward program (its loss set), or a torch
    module exported here with `example_args`. `optimizer`: what minimize applies (default Adam).
    The time model's figures: `rates` (`metaopt.planner.calibrate`: measured on the device), else the four
    declared ones (a roofline without a per-op cost). `compute_units`: how many compute units the
    workers share where they outnumber them (a CPU's cores; default: one per device, as GPUs).
    `top`: how many plans to return, fastest first (default: every one that fits); each returned
    plan's peaks are its whole program's, so a smaller `top` rewrites fewer whole programs.
    `blocks_once=False`: every layout rewritten whole, never from fewer blocks (slower; the same
    plans, the same figures: tests/planner check it). `workers`: how many processes rewrite
    layouts at once (planner/workers.py: fresh interpreters, each sent the job once; default:
    this machine's cores where at least `MANY` layouts are to be rewritten, which repays their
    start, else 1: all in this process). The figures do not depend on it. `capacity_factors`: on a
    MoE model, the expert capacities (moe_configs capacity_factor) its expert-parallel layouts may
    also take: fixed slots make their peaks exact where routed rows otherwise take their bound,
    but drop the rows past an expert's capacity (default: none; 1.25 is GShard's). `amp`: the
    training's precision, on every layout ("bfloat16" or "float16": strategy.amp at that dtype,
    float32 params; default None: float32 throughout)."""
    devices = _count(devices, "devices", MAX_DEVICES)
    budget = parse_bytes(memory_per_device)
    global_batch = _count(global_batch, "global_batch", 1 << 40)
    if rates is None:
        declared = (device_flops, device_bytes_per_s, link_bytes_per_s, link_latency_s)
        names = ("device_flops", "device_bytes_per_s", "link_bytes_per_s", "link_latency_s")
        for name, rate in zip(names, declared, strict=True):
            if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate < math.inf:
                raise PlanError(f"fleet.plan: {name} must be a positive finite number, got {rate!r}")
        rates = Rates(device_flops, device_bytes_per_s, 0.0, link_bytes_per_s, link_latency_s)
    if compute_units is not None:
        compute_units = _count(compute_units, "compute_units", MAX_DEVICES)
    if top is not None:
        top = _count(top, "top", 1 << 20)
    if workers is not None:
        workers = _count(workers, "workers", 1 << 10)
    if not isinstance(rates, Rates):
        raise PlanError(
            f"fleet.plan: rates must be a metaopt.planner.calibrate.Rates, got {type(rates).__name__}"
        )
    capacities = _capacities(capacity_factors)
    if amp not in (None, "bfloat16", "float16"):
        raise PlanError(f"fleet.plan: amp must be None, 'bfloat16' or 'float16', got {amp!r}")
    program = _program(program_or_module, example_args)
    blocks = find_blocks(program)
    experts = _experts(program)
    layouts, pruned = grid(devices, global_batch, blocks, experts, capacities, amp or "")
    job = _Job(program, blocks, devices, global_batch, optimizer, rates, compute_units, blocks_once)
    job.budget = budget
    # every layout's time (exact) and peaks (exact, or a lower bound from fewer blocks): those over
    # the budget even so are out; the rest, fastest first, have their peaks made exact
    todo = []
    for lay in layouts:
        floor = job.floor(lay)
        if floor > budget:  # no rewrite needed: what its workers hold all step is already too much
            pruned.append((lay, f"params and optimizer state alone at least {_gib(floor)} > {_gib(budget)}"))
            continue
        held = job.held(lay)
        if held > budget:  # no rewrite either: stage 0's blocks' share and what they keep exceed it
            why = f"stage 0's blocks' params, state and activations alone at least {_gib(held)}"
            pruned.append((lay, f"{why} > {_gib(budget)}"))
            continue
        todo.append(lay)
    todo.sort(key=dataclasses.astuple)  # a pipeline's micro-batch counts side by side: one rewrite
    if workers is None:  # a worker's start (an interpreter importing metaopt) repaid by many layouts
        workers = len(os.sched_getaffinity(0)) if len(todo) >= MANY else 1
    with Pool(job, workers) if workers > 1 and len(todo) > 1 else contextlib.nullcontext() as pool:
        plans = _ranked(job, todo, pool, budget, top, pruned)
    plans.sort(key=lambda p: (p.step_seconds, p.peak_bytes))
    counted = len(layouts) + len([1 for _, w in pruned if " split into " in w])  # the grid's own
    header = (
        f"fleet.plan: {program.name!r} on {devices} devices x {_gib(budget)}, global batch {global_batch}; "
        f"{counted} layouts; {_blocks_line(blocks)}"
    )
    if capacities and not experts:  # asked for, and nothing to give one: said, not dropped
        header += f"; capacity_factors {list(capacities)} unused: the model has no expert layers"
    return Plans(plans, pruned, header)


def _each(job: _Job, lays: list[Layout], pool: Pool | None, *, whole: bool) -> list[Figures | str]:
    """Each layout's figures (`_Job.evaluate`), or the first line of why its rewrite was refused:
    over `pool`'s worker processes, or in this one. The layouts one rewrite serves (a pipeline at
    its micro-batch counts: `_Job._figures`) go to one worker, one after the other."""
    if pool is None:
        return [evaluated(job, lay, whole) for lay in lays]
    groups: list[list[Layout]] = []
    for lay in lays:
        if groups and _shared(groups[-1][0]) == _shared(lay):
            groups[-1].append(lay)
        else:
            groups.append([lay])
    return [fig for figs in pool.map(groups, whole=whole) for fig in figs]


def _shared(lay: Layout) -> Layout:
    """What a pipeline's rewrite depends on: its layout at any micro-batch count (only the loss
    grad's 1/M differs, a value)."""
    return dataclasses.replace(lay, micro_batches=1)


def _unreferenced(p: Program) -> Program:
    """`p` for pickling: without its weak references to a module's tensors (`Program.referenced`,
    the export's check of a later in-place change; the planner runs nothing): a clone, whose
    vars name it as their program."""
    q = p.clone()
    q.referenced = {}
    return q


def _ranked(
    job: _Job, todo: list[Layout], pool: Pool | None, budget: int, top: int | None, pruned: list
) -> list[Plan]:
    """The plans of `todo` that fit `budget`, fastest first: every layout screened
    (`_Job.evaluate`), then the fastest that fit by it made exact, as many at a time as `pool` has
    workers, until `top`; each layout that fails goes to `pruned` with why."""
    screened = []
    for lay, fig in zip(todo, _each(job, todo, pool, whole=False), strict=True):
        if isinstance(fig, str):
            pruned.append((lay, f"refused: {fig}"))
        elif max(fig.peaks) > budget:
            bound = "" if fig.exact else "at least "
            pruned.append((lay, f"peak {bound}{_gib(max(fig.peaks))} > {_gib(budget)}"))
        else:
            screened.append((fig.seconds, lay, fig))
    plans: list[Plan] = []
    screened.sort(key=lambda t: t[0])
    slower = f"slower than the {top} fastest plans that fit (top={top}): not made exact"
    at_once = len(pool.procs) if pool is not None else 1
    while screened:
        if top is not None and len(plans) >= top:
            pruned += [(lay, slower) for _, lay, _ in screened]
            break
        chunk, screened = screened[:at_once], screened[at_once:]
        lays = [lay for _, lay, fig in chunk if not fig.exact]
        made = dict(zip(lays, _each(job, lays, pool, whole=True), strict=True))
        for _, lay, fig in chunk:
            if top is not None and len(plans) >= top:
                pruned.append((lay, slower))
                continue
            fig = made.get(lay, fig)
            if isinstance(fig, str):
                pruned.append((lay, f"refused: {fig}"))
            elif max(fig.peaks) > budget:
                pruned.append((lay, f"peak {_gib(max(fig.peaks))} > {_gib(budget)}"))
            else:
                plans.append(Plan(lay, lay.strategy(), max(fig.peaks), fig.seconds, fig.peaks, fig.layers))
    return plans


def _blocks_line(blocks: Blocks | None) -> str:
    if blocks is None:
        return "no repeated blocks: each layout rewritten whole"
    if blocks.why_not is not None:
        return (
            f"{blocks.count} blocks of {blocks.pattern!r}, not identical ({blocks.why_not}): rewritten whole"
        )
    if blocks.first > 1:
        run = blocks.count - blocks.first
        return (
            f"{run} identical blocks of {blocks.pattern!r} after {blocks.first} others solved once: each "
            f"layout without a pipeline rewritten at the {blocks.first} and 1 and 2 of them and extended "
            "to the whole depth, pipelines rewritten whole, the plans that fit then rewritten whole"
        )
    return (
        f"{blocks.count} identical blocks of {blocks.pattern!r} solved once: each layout rewritten at "
        f"{' and '.join(map(str, POINTS))} blocks per stage and extended to the whole depth, the plans "
        "that fit then rewritten whole"
    )


def _program(program_or_module: Any, example_args: tuple | None) -> Program:
    if isinstance(program_or_module, Program):
        program = program_or_module
    elif isinstance(program_or_module, torch.nn.Module):
        if example_args is None:
            raise PlanError("fleet.plan: a module needs example_args (the inputs to export it with)")
        import metaopt

        program = metaopt.export(program_or_module, tuple(example_args))
    else:
        raise PlanError(
            "fleet.plan: expected an exported Program or a torch module, got "
            f"{type(program_or_module).__name__}"
        )
    if not program.loss_name:
        raise PlanError(f"fleet.plan: program {program.name!r} has no loss: export a module that returns one")
    if not any(True for _ in program.params()):
        raise PlanError(f"fleet.plan: program {program.name!r} has no params: there is nothing to lay out")
    return program


@dataclass
class _Stages:
    """One rewrite's figures: per pipeline stage (one entry without a pipeline) its first worker's
    predicted peak, the compute and communication seconds it spends per micro-batch (`compute`,
    `comm`: its forward and backward phases; without a pipeline, the whole step) and once a step
    (`once`: the optimizer phase, with the grads' all-reduce, after the last micro-batch); `kept`:
    the blocks' activations alive where the backward starts (no pipeline). The seconds and `kept`
    are lines in the blocks per stage from 2 blocks on (each block adds its ops; at 1 block
    recompute's head is that block). A peak is the largest of several such lines, one per place in
    the step (the backward's start, the last reduce-scatter): the largest of lines is convex, so
    the line through 2 and 3 blocks, extended, is a lower bound of the whole depth's, and another
    place may overtake (measured: ZeRO-3's reduce-scatter at 7 of 12 blocks)."""

    peaks: list[int]
    compute: list[float]
    comm: list[float]
    kept: int
    once: list[tuple[float, float]] = field(default_factory=list)  # (compute, comm); [] = none

    def _lists(self) -> tuple[list, ...]:
        once = self.once or [(0.0, 0.0)] * len(self.peaks)
        return self.peaks, self.compute, self.comm, [c for c, _ in once], [m for _, m in once]

    def _made(self, lists: list[list], kept: int) -> _Stages:
        peaks, compute, comm, oc, om = lists
        return _Stages(peaks, compute, comm, kept, list(zip(oc, om, strict=True)))

    def minus(self, other: _Stages) -> _Stages:
        pairs = zip(self._lists(), other._lists(), strict=True)
        lists = [[a - b for a, b in zip(x, y, strict=True)] for x, y in pairs]
        return self._made(lists, self.kept - other.kept)

    def plus(self, step: _Stages, times: int) -> _Stages:
        pairs = zip(self._lists(), step._lists(), strict=True)
        lists = [[a + b * times for a, b in zip(x, y, strict=True)] for x, y in pairs]
        return self._made(lists, self.kept + step.kept * times)

    def step_seconds(self, micro_batches: int) -> list[float]:
        """Each stage's step: 1F1B's (micro-batches + stages - 1) micro-batch slots (the bubble),
        then its once-a-step work."""
        slots = micro_batches + len(self.peaks) - 1
        _, compute, comm, oc, om = self._lists()
        return [(c + m) * slots + a + b for c, m, a, b in zip(compute, comm, oc, om, strict=True)]

    def work(self, micro_batches: int) -> float:
        """The compute seconds of one worker of each stage, summed."""
        _, compute, _, oc, _ = self._lists()
        return sum(c * micro_batches + a for c, a in zip(compute, oc, strict=True))


@dataclass(frozen=True)
class Figures:
    """A layout's predicted figures: each pipeline stage's first worker's peak (one entry without
    a pipeline), the step's seconds, the activations per block (no pipeline) and whether the peaks
    are exact (the whole program's) or a lower bound (extended from fewer blocks, `_Job.evaluate`)."""

    peaks: list[int]
    seconds: float
    layers: LayerActivations | None
    exact: bool


@dataclass
class _Job:
    """What every layout of one `plan` call shares: the program, its blocks, the job's figures,
    and the programs cut to fewer blocks (made once, rewritten by every layout)."""

    program: Program
    blocks: Blocks | None
    devices: int
    global_batch: int
    optimizer: Any
    rates: Rates
    compute_units: int | None
    blocks_once: bool = True
    fewer: dict[int, Program] = field(default_factory=dict)
    state_per_param: float | None = None  # `floor`'s: measured once, on the smallest program
    param_bytes: tuple[int, int] = (0, 0)  # `floor`'s: params some op reads, those the loss needs
    expert_bytes: tuple[int, int] = (0, 0)  # `floor`'s: the same of the expert params
    per_sample: dict[tuple[str, str], int] = field(default_factory=dict)  # `held`'s: (recompute, amp)
    block_params: tuple[int, int] | None = None  # `held`'s: one block's (read, trained) param bytes
    staged: dict[tuple, list[Program]] = field(default_factory=dict)  # `_figures`' stage programs
    budget: int | None = None  # the plan's memory_per_device: `evaluate` stops at 2 blocks above it

    def __getstate__(self) -> dict:
        """For the planner's workers (planner/workers.py): the programs without their weak
        references (`_unreferenced`), no stage programs cached."""
        state = dict(self.__dict__)
        state["program"] = _unreferenced(self.program)
        state["fewer"] = {k: _unreferenced(p) for k, p in self.fewer.items()}
        state["staged"] = {}
        return state

    @without_gc
    def evaluate(self, lay: Layout, *, whole: bool = False) -> Figures:
        """The layout's figures (`Figures`): from its rewrites at 2 and 3 blocks per stage extended to
        the whole depth where the blocks are identical and a stage has more than 3 (the time exact,
        the peaks a lower bound: `Figures.exact` False); else, or with `whole`, the whole
        program's. Where the peaks at 2 blocks per stage already exceed `budget`, those are the
        figures (a block adds its params and what it keeps to every place of the step, so more
        blocks never lower a peak; the time is then a lower bound too): the layout is out without
        its rewrite at 3. The cyclic collector waits meanwhile: its full passes walk the whole model's
        program, held all along, over and over (Llama-3-70B's pipeline layouts: 1.6x faster
        without them); what the rewrites leave is collected when it runs again."""
        b = self.blocks
        n = b.count // lay.pipe if b is not None else 0
        whole_depth = True  # the figures are the whole depth's (exact or extended to it)
        points = None if whole else self._points(lay)
        if points is not None:
            fig, exact = self._figures(lay, points[0]), False
            whole_depth = self.budget is None or max(fig.peaks) <= self.budget
            if whole_depth:
                hi = self._figures(lay, points[1])
                fig = hi.plus(hi.minus(fig), n - points[1])
        else:
            fig, exact = self._figures(lay, n), True
        times = fig.step_seconds(lay.micro_batches)
        work = fig.work(lay.micro_batches) * (self.devices // lay.pipe)  # each stage's workers'
        # workers that share compute units (a CPU's cores) take turns: the step is at least all the
        # workers' compute over the units, whatever the pipeline's bubbles leave idle
        seconds = max(max(times), work / (self.compute_units or self.devices))
        layers = None
        if lay.pipe == 1 and whole_depth:
            shape = _block_shape(self.program, self.blocks, self.global_batch // lay.data)
            count = b.count if b is not None else 0
            if shape is not None and count:
                layers = LayerActivations(fig.kept / count, *shape, lay.recompute)
        return Figures(fig.peaks, seconds, layers, exact)

    def floor(self, lay: Layout) -> int:
        """A lower bound of the layout's worst peak, before any rewrite: the params and the
        optimizer state shaped like them (alive all step) that the model x pipe workers of a data
        replica hold between them, so the worst holds at least its even share; ZeRO-3 splits the
        params over the data side too, ZeRO 1-3 the state. With expert parallel the expert params
        and their state are split over `expert` workers instead (each updates its own experts
        whole, docs/moe.md). The state per param byte is the least any update of one minimized
        worker reads (Adam: 2), so a mixed optimizer stays below."""
        if self.state_per_param is None:
            self.state_per_param = _state_per_param(self._smallest(), self.optimizer)
            self.param_bytes = _held_params(self.program)
            self.expert_bytes = _held_params(self.program, _expert_params(self.program))
        params, trained = self.param_bytes
        ep_read, ep_trained = self.expert_bytes if lay.expert > 1 else (0, 0)
        share = lay.model * lay.pipe
        held = (params - ep_read) // (share * (lay.data if lay.stage == 3 else 1)) + ep_read // lay.expert
        state = int((trained - ep_trained) * self.state_per_param) // (share * (lay.data if lay.stage else 1))
        return held + state + int(ep_trained * self.state_per_param) // lay.expert

    def _identical(self) -> bool:
        """Whether the figures may come from fewer blocks (blocks_once, and the blocks identical)."""
        b = self.blocks
        return self.blocks_once and b is not None and b.why_not is None

    def _points(self, lay: Layout) -> tuple[int, int] | None:
        """The blocks per stage `lay` is rewritten at, its figures extended from (`evaluate`), or
        None: rewritten whole. 2 and 3; without a pipeline, where identical blocks begin later
        (`Blocks.first`), the blocks before them and 1 and 2 of them. A pipeline's stages are
        extended only where every block but the first is the same."""
        if not self._identical():
            return None
        b = self.blocks
        if lay.pipe == 1:
            lo = b.first + 1
        elif b.first == 1:
            lo = POINTS[0]
        else:
            return None
        return (lo, lo + 1) if lay.pipe * (lo + 1) < b.count else None

    def _smallest(self) -> Program:
        usable = self._identical() and self.blocks.count > self.blocks.first + 1
        return self._fewer(self.blocks.first + 1) if usable else self.program

    def _fewer(self, keep: int) -> Program:
        if self.blocks is None or keep >= self.blocks.count:
            return self.program
        if keep not in self.fewer:
            self.fewer[keep] = with_blocks(self.program, self.blocks, keep)
        return self.fewer[keep]

    def _figures(self, lay: Layout, per_stage: int) -> _Stages:
        """`lay` rewritten for stage 0's first worker (`fleet.simulate`; a pipeline's minimize makes
        every stage's program, each estimated) on the program cut to `per_stage` blocks a stage
        (the whole program where that is all of them), its pipeline cut every `per_stage` blocks.

        A pipeline of more than 3 stages over identical blocks is rewritten as one of 3 (`STAND_IN`):
        its middle stages' programs are one program (the same ops on the same shapes, only the
        blocks' names and the ranks of their sends differ), so stage 1's stands for each, at that
        stage's place in the schedule (`estimate_pipeline_memories`: the micro-batches it holds);
        stage 2's for the last. Each peak and time is then the deep pipeline's own (tested against
        its rewrite)."""
        from metaopt.passes.memory_estimate import estimate_memory

        deep = self._identical() and self.blocks.first == 1 and lay.pipe > STAND_IN
        pipe = STAND_IN if deep else lay.pipe
        p = self._fewer(pipe * per_stage)
        run = lay
        if pipe > 1 and self.blocks is not None:
            run = dataclasses.replace(lay, pipe=pipe, cuts=_cuts(self.blocks.modules, pipe, per_stage))
        devices = self.devices // lay.pipe * pipe
        batch = self.global_batch // lay.data  # each data-side replica's; a pipeline's workers get it whole
        if lay.pipe > 1:  # its stage programs serve its other micro-batch counts (`_shared`)
            key = (_shared(run), per_stage)
            if key not in self.staged:
                if any(k[0] != key[0] for k in self.staged):
                    self.staged.clear()  # those of one layout at a time (its 2 and 3 blocks a stage)
                self.staged[key] = self._minimized(p, run, devices)[1].stage_programs
            return _pipeline_figures(self.staged[key], lay, batch, self.rates)
        q, _ = self._minimized(p, run, devices)
        at = _backward_start(q)
        est = estimate_memory(q, dims={"batch": batch}, workspace=False, at=max(at, 0))
        compute, comm = _seconds(q, {"batch": batch}, self.rates)
        kept = _kept(q, est.where, self._scopes(q)) if at >= 0 else 0
        return _Stages([est.peak_bytes], [compute], [comm], kept)

    def _minimized(self, p: Program, lay: Layout, devices: int) -> tuple[Program, Any]:
        """A copy of `p` minimized with `lay`'s strategy for stage 0's first worker of `devices`
        (`fleet.simulate`), and the distributed optimizer (its `stage_programs`)."""
        from metaopt.fleet.distributed_optimizer import distributed_optimizer
        from metaopt.fleet.topology import from_hybrid_configs

        strategy = lay.strategy()
        topo = from_hybrid_configs(strategy.hybrid_configs, devices, "fleet.plan")
        saved = env.snapshot()
        try:
            env.simulate(devices, _first_rank(topo, 0), strategy)
            q = p.clone()
            dist = distributed_optimizer(_fresh(self.optimizer), strategy)
            dist.memory_reports = False  # recompute's report: estimates this planner makes itself
            dist.minimize(q.loss)
        finally:
            env.restore(saved)
        return q, dist

    def held(self, lay: Layout) -> int:
        """A lower bound of the layout's worst peak, before its rewrite, above `floor`: what stage
        0's first worker holds where its backward starts: its blocks' params and optimizer state
        (its even share of them over the model degree; ZeRO's over the data side too) and the
        activations its blocks keep for the backward, per sample as one worker keeps them with the
        layout's recompute (`_kept_per_sample`: their even share over the model degree, a value
        without a batch dimension left out), for the micro-batches 1F1B's first stage holds
        (as many as stages). Where the blocks are not identical: `floor`. Tested against every
        kind of layout's exact peak (tests/planner)."""
        floor = self.floor(lay)
        b = self.blocks
        if not self._identical() or b.count < b.first + 2 or lay.expert > 1:  # ep: `floor`'s split
            return floor
        # stage 0's identical blocks (where they begin later, those before them counted as none)
        n = b.count // lay.pipe if b.first == 1 else max(b.count // lay.pipe - b.first, 0)
        if self.block_params is None:  # one block's: first+2 blocks' less first+1 blocks'
            pairs = zip(*(_held_params(self._fewer(b.first + k)) for k in (2, 1)), strict=True)
            self.block_params = tuple(x - y for x, y in pairs)
        read, trained = self.block_params
        params = n * read // (lay.model * (lay.data if lay.stage == 3 else 1))
        state = int(n * trained * self.state_per_param) // (lay.model * (lay.data if lay.stage else 1))
        inflight = min(lay.pipe, lay.micro_batches) if lay.pipe > 1 else 1
        micro = self.global_batch // (lay.data * lay.micro_batches)
        acts = self._kept_per_sample(lay.recompute, lay.amp) * n * inflight * micro // lay.model
        return max(floor, params + state + acts)

    @without_gc
    def _kept_per_sample(self, recompute: str, amp: str = "") -> int:
        """The activations one block keeps for the backward per sample on one worker with
        `recompute` and `amp`: the slope in the batch of what 3 blocks keep less what 2 do (measured
        once per recompute form and precision)."""
        from metaopt.passes.memory_estimate import estimate_memory

        if (recompute, amp) not in self.per_sample:
            kept = {}
            two, three = self.blocks.first + 1, self.blocks.first + 2  # 1 and 2 identical blocks
            for k in (two, three):
                one = Layout(1, 1, 1, 0, recompute, 1, self.blocks.pattern, amp=amp)
                try:
                    q, _ = self._minimized(self._fewer(k), one, 1)
                except (ValueError, NotImplementedError, RuntimeError):
                    self.per_sample[recompute, amp] = 0  # no bound from activations: the rewrites say why
                    return 0
                at = max(_backward_start(q), 0)
                for batch in (1, 2):
                    est = estimate_memory(q, dims={"batch": batch}, workspace=False, at=at)
                    kept[k, batch] = _kept(q, est.where, self._scopes(q))
            slope = (kept[three, 2] - kept[two, 2]) - (kept[three, 1] - kept[two, 1])
            self.per_sample[recompute, amp] = max(slope, 0)
        return self.per_sample[recompute, amp]

    def _scopes(self, p: Program) -> list[str]:
        """The module paths of `p`'s blocks (those of the blocks it was cut to keep)."""
        return [m for m in self.blocks.modules if m in p.modules] if self.blocks is not None else []


def _pipeline_figures(parts: list[Program], lay: Layout, batch: int, rates: Rates) -> _Stages:
    """Each of `lay`'s stages' peak and seconds from its stage programs `parts`: one a stage, or
    the 3 of a stand-in (`_Job._figures`): the first, the middle stages', the last. A stage's
    seconds are its phases': the forward and backward per micro-batch, the optimizer once."""
    from metaopt.report.pipeline_memory import estimate_pipeline_memories

    pipe = lay.pipe
    places = [[s] for s in range(pipe)] if len(parts) == pipe else [[0], list(range(1, pipe - 1)), [pipe - 1]]
    micro = {"batch": batch // lay.micro_batches}
    fig = _Stages([], [], [], 0, [])
    for part, stages in zip(parts, places, strict=True):
        est = estimate_pipeline_memories(
            part, batch=batch, stages=stages, num_stages=pipe, micro_batches=lay.micro_batches
        )
        each, once = [0.0, 0.0], [0.0, 0.0]
        for phase in part.phases.parts:
            secs = _seconds(phase.program, micro, rates)
            into = once if phase.phase == roles.OPTIMIZE else each
            into[0], into[1] = into[0] + secs[0], into[1] + secs[1]
        fig.peaks += [e.peak_bytes for e in est]
        fig.compute += [each[0]] * len(stages)
        fig.comm += [each[1]] * len(stages)
        fig.once += [tuple(once)] * len(stages)
    return fig


def _held_params(p: Program, among: set[str] | None = None) -> tuple[int, int]:
    """(bytes of the trainable params some op reads, of those on a path to the loss), of those
    named `among` (default: all): a param no op reads is held by no pipeline stage, one the loss
    does not need gets no update and no state."""
    read = {x for op in p.ops for x in op.inputs if x}
    needed = {p.loss_name}
    for op in reversed(p.ops):
        if any(o in needed for o in op.outputs if o):
            needed.update(x for x in op.inputs if x)
    params = [v for v in p.params() if v.name in read and (among is None or v.name in among)]
    return sum(v.nbytes({}) or 0 for v in params), sum(v.nbytes({}) or 0 for v in params if v.name in needed)


def _expert_params(p: Program) -> dict[str, int]:
    """The MoE layers' expert params -> their expert count (expert parallel's plan, which splits
    them); {} where the program has no expert layer."""
    from metaopt.passes.expert_parallel import ExpertParallelError, plan_expert_parallel

    try:
        return plan_expert_parallel(p, ep_degree=1, ep_rank=0, group=[0]).params
    except ExpertParallelError:
        return {}  # experts it cannot split: no ep in the grid (a layout's rewrite would say why)


def _experts(p: Program) -> int:
    """The expert count every MoE layer's experts split by (their gcd; 0: no expert layer)."""
    return math.gcd(*_expert_params(p).values())  # gcd() of nothing: 0


def _fresh(optimizer: Any) -> Any:
    """A copy of the user's optimizer (default Adam) for one minimize: minimize may bind an
    optimizer (and its schedule) to a program."""
    from metaopt.optimizer import Adam

    return copy.deepcopy(optimizer) if optimizer is not None else Adam(learning_rate=1e-3)


@without_gc
def _state_per_param(p: Program, optimizer: Any) -> float:
    """The least optimizer-state bytes per param byte any update of `p` reads (states shaped like
    their param; scalars such as the step count left out), `p` minimized on one worker."""
    q = p.clone()
    saved = env.snapshot()
    try:
        env.simulate(1, 0)
        _fresh(optimizer).minimize(q.loss)
    except (ValueError, NotImplementedError, RuntimeError):
        return 0.0  # the floor is then the params alone; the layouts' own rewrites say what fails
    finally:
        env.restore(saved)
    ratios = []
    for op in q.ops:
        param = q.vars.get(op.inputs[0]) if op.role == "optimize" and op.inputs else None
        if param is None or param.kind != "param" or not param.nbytes({}):
            continue
        states = {
            x for x in op.inputs if x and q.vars[x].kind == "opt_state" and q.vars[x].shape == param.shape
        }
        ratios.append(sum(q.vars[x].nbytes({}) or 0 for x in states) / param.nbytes({}))
    return min(ratios, default=0.0)


def _backward_start(p: Program) -> int:
    """The last op before the backward (-1: none): what is alive there is what the forward keeps."""
    first = next(
        (i for i, op in enumerate(p.ops) if op.role == "loss" or roles.after_forward(op.role)), len(p.ops)
    )
    return first - 1


def _kept(p: Program, where: Any, scopes: list[str]) -> int:
    """The activations alive at `where` made by the ops of the modules `scopes` (the blocks)."""
    kept = 0
    for v in where.vars:
        scope = p.ops[v.op].scope or "" if v.op >= 0 and v.kind == "activation" else None
        if scope is not None and any(within(scope, m) for m in scopes):
            kept += v.nbytes
    return kept


def _block_shape(p: Program, blocks: Blocks | None, batch: int) -> tuple[int, int, int, int] | None:
    """(s, b, h, a) of the repeated blocks: the first one's output [b, s, h], the heads of the first
    attention. None where the program has no blocks of that form."""
    from metaopt.ir.program import eval_dim

    outs = list(blocks.outputs) if blocks is not None else []
    out = p.vars.get(outs[0]) if outs else None
    heads = next((a for op in p.ops if (a := costs.attention_heads(p, op)) is not None), None)
    if out is None or out.shape is None or len(out.shape) != 3 or heads is None:
        return None
    b, s, h = (eval_dim(d, {"batch": batch}) for d in out.shape)
    if None in (b, s, h):
        return None
    return int(s), int(b), int(h), heads


def _first_rank(topo: Topology, stage: int) -> int:
    return topo.get_rank(**{a: (stage if a == "pipe" else 0) for a in AXES})


def _seconds(p: Program, dims: dict[str, int], rates: Rates) -> tuple[float, float]:
    """(compute, communication) seconds of one step of `p` by the time model (module doc): each
    op's per-op cost, FLOPs and bytes (planner/calibrate.py's `op_cost`); each collective's
    latency and ring bytes (its own compute, a ring's attention, is compute)."""

    def nbytes(name: str) -> int:
        v = p.vars.get(name)
        return 0 if v is None else (v.nbytes(dims) or 0)

    compute = comm = 0.0
    for op in p.ops:
        row = registry.get(op.type)
        flops, moved = op_cost(p, op, dims)
        if row is not None and row.collective:
            comm += rates.link_latency_s + costs.comm_bytes(p, op, dims, nbytes) / rates.link_bytes_per_s
            compute += flops / rates.device_flops
        else:  # a view too: it costs the executor its dispatch (op_cost gives it nothing else)
            compute += rates.op_seconds + flops / rates.device_flops + moved / rates.device_bytes_per_s
    return compute, comm
