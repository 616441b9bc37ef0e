"""One expert-parallel worker (started by tests/passes/test_expert_parallel.py with RANK/
WORLD_SIZE/MASTER_*).

argv: out_dir mode=name,name... ...  (each mode with the MoE zoo entries it runs, in order)

mode "pass" (ep_degree = the world size, group = every worker). For each, in float64 (dropout
0): the entry exported, rewritten by the expert-parallel pass for this worker, and its param
grads on this worker's own batch (seed 1 + rank: ep here overlaps data parallel, as Paddle's
ep_degree does). Data parallel's reduction, done here by hand: a dense param's grad averaged
over the workers, an expert param's (this worker's experts, every worker's tokens) divided by
the world size. The truth: float64 torch's grads of the module on each worker's batch, averaged
(what data parallel on one process per batch computes: the router's aux loss is each batch's
own, as on every peer).

Writes `<out>/<name>.rank<r>.pt`: the worst relative error (`harness.float64_worst`, which raises
past its bar), the printed program, and the expert params' local shapes.

modes "<kind>:<workers>x<ep>" (`train_fleet`: hybrid_configs dp_degree or sharding_degree, and
ep_degree; fleet.init with them): float64, dropout 0, fleet.distributed_optimizer(SGD).minimize,
STEPS steps, worker r fed batch ``seed 10 + step * world + r``. Writes
`<out>/<name>.<kind>.rank<r>.pt`: its losses, its params
(expert params: its slice), which params are expert ones, its persistable bytes measured by
the executor and predicted by estimate_memory, and the bytes its last step's all-to-alls sent
beside their bound."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from workers import gathered_params
from zoo import harness, models

import metaopt
from metaopt import fleet
from metaopt.ir import eval_dim, names
from metaopt.passes.expert_parallel import expert_parallel, plan_expert_parallel
from metaopt.passes.memory_estimate import estimate_memory

BATCH = 3
STEPS = 3
LR = 0.05
HELD_OUT = 99  # fleet_batch's step of the evaluation batch


def fleet_batch(entry, step: int, rank: int, world: int) -> tuple:
    return tuple(harness._double(x) for x in entry.inputs(BATCH, 10 + step * world + rank))


def hybrid(kind: str, degree: int, ep: int) -> dict:
    """The layout of a fleet mode: `degree` data-parallel (``dp``) or sharding (``zero*``) workers."""
    return (
        {"dp_degree": degree, "ep_degree": ep}
        if kind.startswith("dp")
        else {"dp_degree": 1, "sharding_degree": degree, "ep_degree": ep}
    )


def train_fleet(out: str, name: str, mode: str) -> None:
    """`mode`: ``<kind>:<workers>x<ep>``, kind ``dp`` (data parallel), ``dp-rc`` (with recompute
    of every decoder layer), ``dp-amp`` (float32, AMP float16), ``dp-cap`` (expert capacity's
    fixed slots, none dropped, exchanged with static splits) or ``zero1`` / ``zero2`` /
    ``zero3`` (sharding at that stage)."""
    rank = fleet.worker_index()
    kind, layout = mode.split(":")
    degree, ep = (int(v) for v in layout.split("x"))
    entry = models.get(name)
    module, program = harness.export(entry, 0.0) if kind == "dp-amp" else harness.export64(entry)
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = hybrid(kind, degree, ep)
    if kind == "dp-amp":  # float32 model, float16 white ops, dynamic loss scaling
        strategy.amp = True
        strategy.amp_configs = {"dtype": "float16", "use_dynamic_loss_scaling": True}
    if kind == "dp-cap":  # a slot for every row (capacity_factor = experts): nothing dropped
        strategy.moe_configs = {"capacity_factor": 4.0}
    if kind == "dp-rc":
        strategy.recompute = True
        strategy.recompute_configs = {"checkpoints": ["m.model.layers.*"]}
    if kind.startswith("zero"):
        strategy.sharding = True
        strategy.sharding_configs = {"stage": int(kind.removeprefix("zero"))}
    opt = fleet.distributed_optimizer(metaopt.optimizer.SGD(learning_rate=LR), strategy)
    opt.minimize(program.loss)
    exe = metaopt.Executor("cpu")
    losses, scales = [], []
    for step in range(STEPS):
        batch = fleet_batch(entry, step, rank, degree)
        if kind == "dp-amp":
            batch = tuple(x.float() if x.is_floating_point() else x for x in batch)
        (loss,) = exe.run(program, feed=harness._feed(module, batch), fetch_list=[program.loss])
        losses.append(float(loss))
        if names.loss_scaling() in exe.scope:
            scales.append(float(exe.scope[names.loss_scaling()]))
    sent = exe.memory_stats()["all_to_all_bytes"]  # the last training step's (the evals run later)
    experts = {v.name for v in program.params() if v.split is not None and v.split.group == "expert"}
    try:  # a checkpoint of expert-split params is refused, never written with the wrong parts
        fleet.save_persistables(exe, f"{out}/ckpt.{kind}.{name}", program)
        refused = ""
    except NotImplementedError as e:
        refused = str(e)
    predicted = estimate_memory(program, dims={"batch": BATCH})
    held = fleet_batch(entry, HELD_OUT, 0, 1)  # every worker the same held-out batch
    if kind == "dp-amp":
        held = tuple(x.float() if x.is_floating_point() else x for x in held)
    test = program.clone(for_test=True)  # issue 49: the eval program of this layout, run twice
    evals = [
        float(exe.run(test, feed=harness._feed(module, held), fetch_list=[test.loss])[0]) for _ in range(2)
    ]
    torch.save(
        {
            "losses": losses,
            "eval": evals,
            "loss_scales": scales,
            # AMP: every worker's overflow check summed, so all skip the same steps
            "found_inf_reduced": any(
                names.found_inf() in op.inputs and op.attrs.get("reduce") == "sum" for op in program.ops
            ),
            "params": gathered_params(exe, program),
            "experts": sorted(experts),
            "applied": opt.applied_meta_list,
            "save_refused": refused,
            "measured_persistable": exe.memory_stats()["persistable_bytes"],
            "all_to_all_bytes": sent,
            # the plan's bound on what may travel per step
            "all_to_all_bound": eval_dim(opt.expert_parallel_plan.all_to_all_bytes, {"batch": BATCH}),
            "predicted_persistable": predicted.persistable_bytes,
            "measured_peak": exe.memory_stats()["peak_bytes"],
            "predicted_peak": predicted.peak_bytes,
        },
        f"{out}/{name}.{kind}.rank{rank}.pt",
    )


def main() -> None:
    out, jobs = sys.argv[1], [a.split("=", 1) for a in sys.argv[2:]]
    fleet.init(is_collective=True)  # the pass mode's groups are explicit ranks: it runs under any
    for mode, entries in jobs:
        if mode == "pass":
            check_pass(out, entries.split(","))
            continue
        kind, degrees = mode.split(":")
        strategy = fleet.DistributedStrategy()
        strategy.hybrid_configs = hybrid(kind, *(int(v) for v in degrees.split("x")))
        fleet.init(is_collective=True, strategy=strategy)  # its layout's groups (kept when unchanged)
        for name in entries.split(","):
            train_fleet(out, name, mode)
    fleet.barrier_worker()


def check_pass(out: str, names: list[str]) -> None:
    rank, world = fleet.worker_index(), fleet.worker_num()
    for name in names:
        entry = models.get(name)
        module, program = harness.export64(entry)
        batches = [tuple(harness._double(x) for x in entry.inputs(BATCH, 1 + r)) for r in range(world)]
        truth = [harness.torch_grads(module, b, double=True) for b in batches]
        ref = {k: sum(t[k] for t in truth) / world for k in truth[0]}
        plan = plan_expert_parallel(program, ep_degree=world, ep_rank=rank, group=list(range(world)))
        q = expert_parallel(program, plan=plan)
        grads = harness.metaopt_grads(q, module, batches[rank])
        ours, mine = {}, {}
        for k, g in grads.items():
            if k in plan.params:
                n = plan.params[k] // world
                ours[k], mine[k] = g / world, ref[k][rank * n : (rank + 1) * n]
            else:
                dist.all_reduce(g)
                ours[k], mine[k] = g / world, ref[k]
        worst = harness.float64_worst(entry, ours, mine, "expert-parallel grads", island=True)
        shapes = {k: tuple(q.vars[k].shape) for k in plan.params}
        torch.save(
            {"worst": worst, "program": str(q), "plan": str(plan), "shapes": shapes},
            f"{out}/{name}.rank{rank}.pt",
        )


if __name__ == "__main__":
    main()
