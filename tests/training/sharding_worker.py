"""One ZeRO sharding worker (started by test_sharding_workers.py through tests/workers.py).

Each case "model:stage:optimizer[:extra]" exports its model (the same seed on every worker),
minimizes it with fleet's strategy.sharding at sharding_degree = the world size, trains STEPS
steps and writes `<out>/<case>.rank<r>.pt`: losses, params (whole: stage 3's slices gathered),
and the executor's measured bytes
beside `estimate_memory`'s prediction. Every worker is fed the whole batch (the same data):
data parallel then averages equal grads, which is exact, so a sharded run must equal one
process bit for bit and any difference is sharding's. The "mlp" cases feed each worker its own
share instead, as a data-parallel user does.

extra: "fp16ar" (strategy.fp16_allreduce; the last step's grads before and after the
all-reduce recorded), "recompute" (each block a checkpoint), "bf16" / "fp16" (AMP; float16 with dynamic loss
scaling), "clip" (global-norm clipping), "save" (save_persistables into $SHARDING_CKPT after
training), "load" (load $SHARDING_CKPT instead of training: what this worker then holds; first each
damaged copy in ${SHARDING_CKPT}_tampered, "refusals"), a stage-3 "save" also writes those copies
(tests/ckpt_tamper.py) and loads them at its own degree,
"optoffload" (sharding_configs["optimize_offload"]: the optimizer state in host memory); a stage-3
hf-gpt2 case on 2 workers saves the values its last step starts from with fleet.save_pretrained
(into <out>/<case>.hf); "meta"
(the module built and exported on the meta device, this worker's share of its values read from
$PRETRAINED by fleet.load_pretrained after minimize), "init" (built on meta, this worker's share
made by fleet.init_from_module, seed INIT_SEED; the values it starts from saved by
fleet.save_pretrained into <out>/<case>.init), "pp"
(a 1F1B pipeline of 2 micro-batches, cuts "auto", over fleet.init's pp_degree: the last stage
reports the losses, the others None).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import ckpt_tamper
import export_cache
import torch
from training_cases import (
    BATCH,
    HELD_OUT,
    INIT_SEED,
    PRETRAINED_PREFIX,
    STEPS,
    _module,
    batch,
    build_strategy,
    evaluate,
    export,
    pretrained_path,
    runs,
)
from workers import gathered_params

import metaopt
from metaopt import fleet
from metaopt.passes.memory_estimate import estimate_memory
from metaopt.report.pipeline_memory import estimate_pipeline_memory


def train_case(case: str, rank: int, world: int, out: str) -> dict:
    name, stage, opt, *extra = case.split(":")
    module = None
    if "init" in extra:  # built on meta, the values made from the module's own initializers
        module, inputs, kwargs = _module(name, meta=True)
        main = export_cache.export(module, inputs, **kwargs)
    else:
        main = export(name, meta="meta" in extra)
    strategy = build_strategy(name, [opt, *extra])
    strategy.sharding = stage != "0"  # "0": data parallel alone, the same otherwise
    if strategy.sharding:
        strategy.sharding_configs = {
            "sharding_degree": fleet.get_hybrid_communicate_group().get_sharding_parallel_world_size()
            if os.environ.get("SHARDING_HYBRID")
            else world,
            "stage": int(stage),
            "segment_broadcast_MB": 0.01,
            "optimize_offload": "optoffload" in extra,
        }
    if "unfused" in extra:  # a reduce-scatter per grad: all but the last left in flight (overlap_comm)
        strategy.fuse_all_reduce_ops = False
    if "pp" in extra:
        strategy.pipeline = True
        strategy.pipeline_configs = {"accumulate_steps": 2, "schedule_mode": "1F1B"}
    loss_name = main.loss.name  # a pipeline stage other than the last has no loss var
    optimizer = fleet.distributed_optimizer(make_optimizer(opt, "clip" in extra), strategy)
    optimizer.minimize(main.loss)
    exe = metaopt.Executor("cpu")
    if "meta" in extra:  # no values until this worker reads its share of the pretrained files
        path = pretrained_path(Path(os.environ["PRETRAINED"]), name)
        fleet.load_pretrained(exe, main, path, prefix=PRETRAINED_PREFIX.get(name, ""))
    if module is not None:  # this worker's share, made a submodule at a time; then the whole
        # values, put together by save_pretrained, for the test to hold against one process's
        fleet.init_from_module(exe, main, module, seed=INIT_SEED)
        fleet.save_pretrained(exe, main, f"{out}/{case}.init", prefix=PRETRAINED_PREFIX.get(name, ""))
    if "load" in extra:  # the damaged copies of the checkpoint first: each refused, nothing loaded
        got = ckpt_tamper.refusals(exe, main, Path(os.environ["SHARDING_CKPT"] + "_tampered"))
        untouched = not exe.scope
        fleet.load_persistables(exe, os.environ["SHARDING_CKPT"], main)
        return {
            "held": {n: exe.scope[n].clone() for n in _saved(main)},
            "refusals": got,
            "untouched": untouched,
        }
    losses = []
    for step in range(STEPS):
        feed = batch(name, step)
        if name == "mlp":  # this worker's share of the full batch
            share = BATCH // world
            # each its own storage: the executor counts a fed view's whole storage (the full
            # batch), the estimate the share, and the peak must be where both see the same
            feed = {k: v[rank * share : (rank + 1) * share].clone() for k, v in feed.items()}
        grads = _sent_grads(main) if "fp16ar" in extra and step == STEPS - 1 else []
        if stage == "3" and name == "hf-gpt2" and step == STEPS - 1 and world == 2:
            # the values the last step starts from, put together into an HF folder by worker 0
            fleet.save_pretrained(exe, main, f"{out}/{case}.hf", prefix="m.")
        step_losses = []
        for part in runs(feed, extra):  # gradient merge: the step in several runs
            loss, *sent = exe.run(main, feed=part, fetch_list=[loss_name, *grads])
            step_losses.append(None if loss is None else float(loss))
        losses.append(None if None in step_losses else sum(step_losses) / len(step_losses))
    refused = {}
    if "save" in extra:
        path = Path(fleet.save_persistables(exe, os.environ["SHARDING_CKPT"], main))
        if stage == "3":  # damaged copies (a piece of a param and of a moment dropped, doubled,
            # shifted), loaded at this degree here, at 2 by the "load" case, in one process by the test
            if rank == 0:
                ckpt_tamper.tamper_all(path, Path(os.environ["SHARDING_CKPT"] + "_tampered"))
            fleet.barrier_worker()
            before = {n: exe.scope[n].clone() for n in _saved(main)}
            refused = ckpt_tamper.refusals(exe, main, Path(os.environ["SHARDING_CKPT"] + "_tampered"))
            refused["untouched"] = all(torch.equal(exe.scope[n], t) for n, t in before.items())
    stats = exe.memory_stats()
    # issue 49: the eval program of this layout, on the whole held-out batch on every worker
    evals = evaluate(exe, main, batch(name, HELD_OUT), loss_name)
    rows = next(iter(part.values())).shape[0]
    predicted = estimate_memory(main, dims={"batch": rows})
    if main.pipeline is not None:  # a pipeline step: its schedule's actions (report/pipeline_memory.py)
        predicted = estimate_pipeline_memory(main, batch=rows)
    state = {v.name: v for v in main.vars.values() if v.kind == "opt_state" and v.zero is not None}
    return {
        "losses": losses,
        "eval": evals,
        "params": gathered_params(exe, main),
        "param_bytes": sum(
            exe.scope[v.name].numel() * exe.scope[v.name].element_size() for v in main.params()
        ),
        "measured_persistable": stats["persistable_bytes"],
        "measured_host_persistable": stats["host_persistable_bytes"],
        "predicted_persistable": predicted.persistable_bytes,
        "measured_peak": stats["peak_bytes"],
        "predicted_peak": predicted.peak_bytes,
        "host": dict(getattr(predicted, "host", {})),  # estimate_memory's host account
        "state_bytes": sum(exe.scope[n].numel() * exe.scope[n].element_size() for n in state),
        "state_full_numel": {n: v.zero.full_numel for n, v in state.items()},
        "scattered": sum(op.type == "ReduceScatter" for op in main.ops),
        "program": str(main),
        "held": {n: exe.scope[n].clone() for n in _saved(main)},
        "sent": {g: torch.as_tensor(t) for g, t in zip(grads, sent, strict=True)},
        "refusals": refused,
    }


def _sent_grads(main: metaopt.Program) -> list[str]:
    """Each param's grad before and after data parallel's all-reduce (fp16_allreduce's check)."""
    from metaopt.ir import names

    return [x for v in main.params() for x in (names.grad(v.name), names.reduced(names.grad(v.name)))]


def _saved(main: metaopt.Program) -> list[str]:
    """The params and optimizer state a checkpoint holds (the shaped ones: not the step counter)."""
    return [v.name for v in main.vars.values() if v.kind in ("param", "opt_state") and v.shape]


def make_optimizer(opt: str, clip: bool) -> metaopt.optimizer.Optimizer:
    kw = {"grad_clip": metaopt.optimizer.ClipGradByGlobalNorm(1.0)} if clip else {}
    if opt == "sgd":
        return metaopt.optimizer.SGD(learning_rate=0.05, **kw)
    if opt in ("momentum", "lars"):  # lars: strategy.lars wraps it (training_cases.build_strategy)
        return metaopt.optimizer.Momentum(learning_rate=0.05, momentum=0.9, **kw)
    if opt == "adamw":
        return metaopt.optimizer.AdamW(learning_rate=1e-2, **kw)
    return metaopt.optimizer.Adam(learning_rate=1e-2, **kw)  # adam, and lamb (strategy.lamb)


COLLECTIVE_PEAKS = "collectives-host-peak"
SLICE = 4 * 2**20  # float32 elements of each worker's part: 16 MB


def collective_peaks(rank: int, world: int) -> dict:
    """ZeRO's two collectives on gloo, as ShardGather and ReduceScatter call them, with this
    process's peak RSS (VmHWM, reset through /proc/self/clear_refs) measured around each: the
    bytes each held at once beyond what it started with. {} where the kernel refuses the reset.
    glibc is told to map every block of 64 KiB or more on its own (what MALLOC_MMAP_THRESHOLD_
    does for a whole process): by default it keeps freed 16 MB blocks for reuse after the first,
    and the peak would count its cache, not what the collective holds."""
    import ctypes

    from metaopt.runtime.comm import Communicator

    ctypes.CDLL("libc.so.6").mallopt(-3, 65536)  # M_MMAP_THRESHOLD

    comm = Communicator(torch.device("cpu"))
    mine = torch.full((SLICE,), float(rank + 1))
    base = torch.arange(world * SLICE).remainder_(1000).float()  # small integers: sums exact in any order
    grad = base * (rank + 1)  # each worker's own

    def measured(fn):
        fleet.barrier_worker()
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            return None, None
        before = _rss("VmRSS")
        got = fn()
        return got, _rss("VmHWM") - before

    whole = torch.empty(world * SLICE)  # made before: the destination is the caller's
    whole.zero_()
    _, gather_peak = measured(
        lambda: comm.all_gather_pieces(
            [mine], [[whole[j * SLICE : (j + 1) * SLICE]] for j in range(world)], "x"
        )
    )
    if gather_peak is None:
        return {}
    rows = lambda j: grad[j * SLICE : (j + 1) * SLICE].clone()  # noqa: E731 - the kernel's row maker
    reduced, scatter_peak = measured(lambda: comm.reduce_scatter_rows(rows, "avg", "g"))
    return {
        "gather_peak": gather_peak,
        "scatter_peak": scatter_peak,
        "gathered_ok": all(bool((whole[j * SLICE : (j + 1) * SLICE] == j + 1).all()) for j in range(world)),
        "reduced": reduced,
        "want_reduced": base[rank * SLICE : (rank + 1) * SLICE] * (sum(range(1, world + 1)) / world),
    }


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def main() -> None:
    out, cases = sys.argv[1], sys.argv[2:]
    init = None
    if os.environ.get("SHARDING_HYBRID"):  # "dp,sharding[,pp]": fleet.init lays the workers out
        dp, sh, pp = (*map(int, os.environ["SHARDING_HYBRID"].split(",")), 1)[:3]
        init = fleet.DistributedStrategy()
        init.hybrid_configs = {"dp_degree": dp, "sharding_degree": sh, "pp_degree": pp}
    fleet.init(is_collective=True, strategy=init)
    rank, world = fleet.worker_index(), fleet.worker_num()
    for case in cases:
        got = (
            collective_peaks(rank, world) if case == COLLECTIVE_PEAKS else train_case(case, rank, world, out)
        )
        torch.save(got, f"{out}/{case}.rank{rank}.pt")
    fleet.barrier_worker()


if __name__ == "__main__":
    main()
