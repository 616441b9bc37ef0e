"""One worker of sequence parallel beside tensor parallel through fleet (started by
tests/passes/test_sequence_parallel.py with RANK/WORLD_SIZE/MASTER_*):
``python sp_worker.py OUT DP MP CASE ...``, CASE = ``<model>[:rc|:nodrop|:amp]`` (rc: recompute, a
checkpoint per block; nodrop: every dropout off, else 0.1; amp: bfloat16 AMP).

fleet.init lays the DP x MP workers out; the strategy turns on tensor parallel with tp_worker's
column/row layers and ``sequence_parallel``. Each data-parallel replica is fed its share of the
step's batch, every MP rank of a replica the same share. 3 SGD steps from `metaopt.seed(SEED)`;
writes the losses, this worker's params, how its split params are split, the plans and the
program to ``OUT/<case>.rank<r>.pt``.

``SP_LAYOUT`` (4 workers, MP 2): "zero1" / "zero3" add sharding_degree 2 at that ZeRO stage (the
sharding ranks are the data-parallel replicas, each fed its half of the batch); "pp" adds
pp_degree 2 (2 micro-batches, every worker fed the whole batch, the loss fetched on the last
stage). These write the losses only (ZeRO-3's params are flat slices).
"""

from __future__ import annotations

import os
import sys

import export_cache
import torch
import tp_worker
from training_cases import CHECKPOINTS, HELD_OUT, _module, batch, evaluate

import metaopt
from metaopt import fleet
from metaopt.ir import roles
from metaopt.passes.memory_estimate import estimate_memory

SEED = 0
DROPOUT = 0.1


def build(name: str, dropout: float = DROPOUT) -> tuple[torch.nn.Module, tuple, dict]:
    """The zoo's model with every dropout at `dropout` (GPT-2: embeddings, residuals and attention;
    LLaMA: attention only)."""
    torch.manual_seed(0)
    return _module(name, dropout)


def strategy(name: str, dp: int, mp: int, recompute: bool, amp: bool = False) -> fleet.DistributedStrategy:
    s = fleet.DistributedStrategy()
    s.hybrid_configs = {"dp_degree": dp, "mp_degree": mp}
    s.tensor_parallel = True
    s.tensor_parallel_configs = {
        "column": tp_worker.COLUMN[name],
        "row": tp_worker.ROW[name],
        "sequence_parallel": True,
        # attention dropout over a rank's heads draws one process's mask: the run equals one process
        "one_process_dropout": True,
    }
    return with_amp_and_recompute(s, name, amp, recompute)


def with_amp_and_recompute(
    s: fleet.DistributedStrategy, name: str, amp: bool, recompute: bool
) -> fleet.DistributedStrategy:
    """`s` unfused (an all-reduce per grad), with bfloat16 AMP and a checkpoint per block if asked."""
    s.fuse_all_reduce_ops = False
    if amp:
        s.amp = True
        s.amp_configs = {"dtype": "bfloat16"}
    if recompute:
        s.recompute = True
        s.recompute_configs = {"checkpoints": CHECKPOINTS[name]}
    return s


def with_layout(s: fleet.DistributedStrategy, layout: str) -> fleet.DistributedStrategy:
    """`s` with SP_LAYOUT's axis beside MP 2 (module doc)."""
    if layout.startswith("zero"):
        s.hybrid_configs = {"dp_degree": 1, "mp_degree": 2, "sharding_degree": 2}
        s.sharding = True
        s.sharding_configs = {"stage": int(layout[-1])}
    elif layout == "pp":
        s.hybrid_configs = {"dp_degree": 1, "mp_degree": 2, "pp_degree": 2}
        s.pipeline = True
        s.pipeline_configs = {"accumulate_steps": 2, "micro_batch_size": None}
    return s


def train_layout(case: str, layout: str) -> dict:
    name, _, mode = case.partition(":")
    module, inputs, kwargs = build(name, 0.0 if mode == "nodrop" else DROPOUT)
    program = export_cache.export(module, inputs, **kwargs)
    s = with_layout(strategy(name, 1, 2, mode == "rc"), layout)
    fleet.distributed_optimizer(metaopt.optimizer.SGD(learning_rate=tp_worker.LR), s).minimize(program.loss)
    hcg = fleet.get_hybrid_communicate_group()
    last = layout != "pp" or hcg.get_stage_id() == hcg.get_pipe_parallel_world_size() - 1
    metaopt.seed(SEED)
    exe, losses = metaopt.Executor("cpu"), []
    for step in range(tp_worker.STEPS):
        if layout == "pp":
            feed = batch(name, step)
        else:
            feed = replica_batch(name, step, hcg.get_sharding_parallel_rank(), 2)
        got = exe.run(program, feed=feed, fetch_list=[program.loss] if last else [])
        losses.append(float(got[0]) if last else None)
    return {"losses": losses, "replica": hcg.get_sharding_parallel_rank() if layout != "pp" else 0}


def data_side_rank(hcg) -> int:  # noqa: ANN001
    """This worker's share of the step's batch: its place on the data-side axes (data, sharding)."""
    return (
        hcg.get_data_parallel_rank() * hcg.get_sharding_parallel_world_size()
        + hcg.get_sharding_parallel_rank()
    )


def replica_batch(name: str, step: int, dp_rank: int, dp: int) -> dict[str, torch.Tensor]:
    full = batch(name, step)
    n = next(iter(full.values())).shape[0] // dp
    # clones: a view would hold the whole batch's storage, which the executor counts (its memory
    # as measured is then more than estimate_memory's, which counts the feed at its own shape)
    return {k: v[dp_rank * n : (dp_rank + 1) * n].clone() for k, v in full.items()}


def run_steps(
    program, feeds: list[dict[str, torch.Tensor]], held: dict | None = None
) -> tuple[metaopt.Executor, dict]:  # noqa: ANN001
    """3 steps from `metaopt.seed(SEED)` on a recording executor: (the executor, the losses, the
    last step's measured and predicted memory, the params and the program), what the long-sequence
    tests read of every worker (the sep worker's too); with `held`, the eval program's losses on it
    after training (issue 49: `training_cases.evaluate`)."""
    exe = metaopt.Executor("cpu", record_timeline=True)
    metaopt.seed(SEED)
    losses = []
    for feed in feeds:
        (loss,) = exe.run(program, feed=feed, fetch_list=[program.loss])
        losses.append(float(loss))
    # workspace=False: the executor counts vars, not a kernel's temporaries (memory_estimate doc)
    est = estimate_memory(program, dims={"batch": feeds[-1]["labels"].shape[0]}, workspace=False)
    return exe, {
        "losses": losses,
        "measured": (exe.memory_stats()["last_run_peak_bytes"], exe.memory_timeline()),
        # the last step's timeline has no startup op (they run on the first step only)
        "predicted": (
            est.peak_bytes,
            [b for b, op in zip(est.timeline, program.ops) if not roles.is_startup(op.role)],
        ),
        "forward_ops": sum(roles.is_forward(op.role) for op in program.ops if not roles.is_startup(op.role)),
        "params": {v.name: exe.scope[v.name].clone() for v in program.params()},
        "program": str(program),
        "peak": exe.memory_stats()["peak_bytes"],
        "eval": evaluate(exe, program, held, program.loss_name) if held is not None else None,
    }


def assert_memory_as_predicted(runs: dict[str, list[dict]], cases: list[str]) -> None:
    """Every worker's measured peak and timeline (the executor's count after every op of the last
    step) equal estimate_memory's replay of its program, for each of `cases`."""
    for case in cases:
        for r in runs[case]:
            (peak, timeline), (peak_est, timeline_est) = r["measured"], r["predicted"]
            assert peak == peak_est, case
            assert timeline == timeline_est, case


def one_process(name: str, dropout: float = DROPOUT) -> tuple[list[float], dict[str, torch.Tensor], list]:
    """The reference: one process training the same module on the whole batches (losses, params,
    and its eval program's two losses on the held-out batch)."""
    module, inputs, kwargs = build(name, dropout)
    p = export_cache.export(module, inputs, **kwargs)
    metaopt.optimizer.SGD(learning_rate=tp_worker.LR).minimize(p.loss)
    exe = metaopt.Executor("cpu")
    feeds = [batch(name, s) for s in range(tp_worker.STEPS)]
    metaopt.seed(SEED)
    losses = [float(exe.run(p, feed=f, fetch_list=[p.loss])[0]) for f in feeds]
    evals = evaluate(exe, p, batch(name, HELD_OUT), p.loss_name)
    return losses, {v.name: exe.scope[v.name].clone() for v in p.params()}, evals


def launch(script: str, out, world: int, args: list[str], cases: list[str], env: dict | None = None) -> dict:  # noqa: ANN001
    """`world` workers of `script` (in tests/training) on `cases`; each case's results, by rank."""
    from pathlib import Path

    from workers import start_workers, wait_workers

    here = Path(__file__).resolve().parent
    procs = start_workers(
        world, [str(here / script), str(out), *args, *cases], {"METAOPT_COMM_TIMEOUT": "60", **(env or {})}
    )
    wait_workers(procs, script, 600)
    return {
        c: [
            torch.load(Path(out) / f"{c.replace(':', '.')}.rank{r}.pt", weights_only=False)
            for r in range(world)
        ]
        for c in cases
    }


def train(case: str, dp: int, mp: int) -> dict:
    name, _, mode = case.partition(":")
    module, inputs, kwargs = build(name, 0.0 if mode == "nodrop" else DROPOUT)
    program = export_cache.export(module, inputs, **kwargs)
    opt = fleet.distributed_optimizer(
        metaopt.optimizer.SGD(learning_rate=tp_worker.LR), strategy(name, dp, mp, mode == "rc", mode == "amp")
    )
    opt.minimize(program.loss)
    hcg = fleet.get_hybrid_communicate_group()
    feeds = [replica_batch(name, step, hcg.get_data_parallel_rank(), dp) for step in range(tp_worker.STEPS)]
    _, got = run_steps(program, feeds, batch(name, HELD_OUT))
    return {
        **got,
        "splits": {sp.name: (sp.axis, sp.blocks) for sp in opt.tensor_parallel_plan.params},
        "sp_plan": str(opt.sequence_parallel_plan),
        "mp_rank": hcg.get_model_parallel_rank(),
        "dp_rank": hcg.get_data_parallel_rank(),
    }


def main() -> None:
    out, dp, mp, cases = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
    layout = os.environ.get("SP_LAYOUT", "")
    fleet.init(is_collective=True, strategy=with_layout(strategy("hf-gpt2", dp, mp, False), layout))
    for case in cases:
        got = train_layout(case, layout) if layout else train(case, dp, mp)
        torch.save(got, f"{out}/{case.replace(':', '.')}.rank{fleet.worker_index()}.pt")
    fleet.barrier_worker()


if __name__ == "__main__":
    main()
