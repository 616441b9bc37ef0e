"""One tensor-parallel worker with dropout 0.1 (started by tests/training/test_tp_rng.py with
RANK/WORLD_SIZE/MASTER_*): ``python tp_rng_worker.py OUT``.

Exports gpt tiny with dropout 0.1 (the same init on every rank), applies the tensor-parallel
pass for its rank (mp_degree = world size, tp_worker's layers), appends SGD, and trains STEPS
steps on tp_worker's full batches (every MP rank fed the same) in several runs, each on a fresh
executor from the same initial params:

* ``unseeded``: first, before anything seeds the process (the fresh-process default);
* ``seeded``: after ``metaopt.seed(0)`` (what the default must equal);
* ``main`` and ``again``: after ``metaopt.seed(SEED)``, twice (same process, same seed);
* ``recompute``: the same program through the recompute pass (checkpoints transformer.h.*), after
  ``metaopt.seed(SEED)``;
* ``recompute_wrong_stream``: as recompute, but its RngState ops stripped of their stream attrs, so
  they record the shared generator's state instead of the model-parallel one's (the mistake the
  stream attrs prevent: it must change the result, or the recompute check could not fail);
* ``other_seed``: after ``metaopt.seed(SEED + 1)``;
* ``fleet`` and ``fleet_recompute``: the user's path, the same export through
  ``fleet.distributed_optimizer`` with hybrid_configs mp_degree=2 (fleet_tp_worker's strategy),
  without and with ``strategy.recompute`` (checkpoints transformer.h.*), after
  ``metaopt.seed(SEED)`` each; a refusal is recorded as its message.

Each run records per step the loss, the replicated activations in REPLICATED and which
attention probabilities each attention op dropped (its heads of this rank: the probabilities
before and after its dropout, outputs 1 and 2 of a ScaledDotProductAttention the backward reads,
nonzero before and zero after), and the params at the end. Writes ``OUT/rank<r>.pt``."""

from __future__ import annotations

import sys

import export_cache
import fleet_tp_worker
import torch
import tp_worker

import metaopt
import programs
from metaopt import fleet
from metaopt.ops import rng_streams
from metaopt.passes.recompute import recompute
from metaopt.passes.tensor_parallel import plan_tensor_parallel, tensor_parallel

NAME = "gpt"
STEPS = 10
SEED = 1234
DROPOUT = 0.1
# Values replicated over the MP group, each right after a dropout on a replicated value (the
# embedding dropout, a block's residual-branch dropouts) and the block outputs.
REPLICATED = [
    "transformer.drop",
    "transformer.h.0.attn",
    "transformer.h.0.mlp",
    "transformer.h.0",
    "transformer.h.1",
]


def export() -> metaopt.Program:
    mod = programs.get(NAME)
    model = mod.build("tiny", seed=tp_worker.SEED, dropout=DROPOUT)
    return export_cache.export(model, mod.example_inputs("tiny", 4, seed=1), name=NAME)


def split_program(rank: int, world: int) -> metaopt.Program:
    program = export()
    plan = plan_tensor_parallel(
        program,
        mp_degree=world,
        mp_rank=rank,
        column=tp_worker.COLUMN[NAME],
        row=tp_worker.ROW[NAME],
        group=list(range(world)),
    )
    q = tensor_parallel(program, plan=plan)
    metaopt.optimizer.SGD(learning_rate=tp_worker.LR).minimize(q.loss)
    return q


def masks_of(program: metaopt.Program) -> dict[str, tuple[str, str]]:
    """Each attention op drawing per rank (by its stream attr): its output -> (probabilities before
    dropout, after dropout), the outputs the backward reads."""
    return {
        op.outputs[0]: (op.outputs[1], op.outputs[2])
        for op in program.ops
        if op.attrs.get(rng_streams.STREAM_ATTR) == rng_streams.MODEL_PARALLEL and len(op.outputs) > 2
    }


def train(program: metaopt.Program, masks: dict[str, tuple[str, str]]) -> dict:
    exe = metaopt.Executor("cpu")
    pairs = [x for pair in masks.values() for x in pair]
    fetch = [program.loss_name, *REPLICATED, *pairs]
    steps = []
    for step in range(STEPS):
        out = exe.run(program, feed=tp_worker.batch(NAME, step), fetch_list=fetch, return_numpy=False)
        got = dict(zip(fetch, out, strict=True))
        rec = {name: got[name].clone() for name in [program.loss_name, *REPLICATED]}
        for name, (before, after) in masks.items():  # dropped: a probability made zero
            rec[name] = (got[before] != 0) & (got[after] == 0)
            rec[f"{name}:live"] = got[before] != 0
        steps.append(rec)
    params = {v.name: exe.scope[v.name].clone() for v in program.params()}
    return {"steps": steps, "params": params}


def through_fleet(recompute_on: bool) -> dict:
    """A fresh export through fleet's tensor_parallel step (and recompute), trained after
    metaopt.seed(SEED); a refusal comes back as {"refused": message}."""
    program = export()
    s = fleet_tp_worker.strategy(1, fleet.worker_num())
    if recompute_on:
        s.recompute = True
        s.recompute_configs = {"checkpoints": ["transformer.h.*"]}
    try:
        opt = fleet.distributed_optimizer(metaopt.optimizer.SGD(learning_rate=tp_worker.LR), s)
        opt.minimize(program.loss)
    except NotImplementedError as e:
        return {"refused": str(e)}
    metaopt.seed(SEED)
    return {**train(program, masks_of(program)), "rng_ops": ops_text(program, ("RngState",))}


def ops_text(program: metaopt.Program, types: tuple[str, ...]) -> list[str]:
    return [f"{op.type} {sorted(op.attrs.items())}" for op in program.ops if op.type in types]


def main() -> None:
    out = sys.argv[1]
    fleet.init(is_collective=True, strategy=fleet_tp_worker.strategy(1, 2))  # MP=2 groups for fleet runs
    rank, world = fleet.worker_index(), fleet.worker_num()
    program = split_program(rank, world)
    masks = masks_of(program)
    runs = {"unseeded": train(program, masks)}  # nothing has seeded this process yet
    metaopt.seed(0)
    runs["seeded"] = train(program, masks)
    for name in ("main", "again"):
        metaopt.seed(SEED)
        runs[name] = train(program, masks)
    rc = recompute(program, checkpoints=["transformer.h.*"])
    metaopt.seed(SEED)
    runs["recompute"] = train(rc, masks)
    wrong = rc.clone()
    for op in wrong.ops:
        if op.type == "RngState":
            op.attrs.clear()  # records the shared generator: the wrong stream for attention dropout
    metaopt.seed(SEED)
    runs["recompute_wrong_stream"] = train(wrong, masks)
    metaopt.seed(SEED + 1)
    runs["other_seed"] = train(program, masks)
    runs["fleet"] = through_fleet(False)
    runs["fleet_recompute"] = through_fleet(True)
    result = {
        "runs": runs,
        "masks": list(masks),
        "rng_ops": ops_text(rc, ("RngState", "RngReplay")),
    }
    torch.save(result, f"{out}/rank{rank}.pt")
    fleet.barrier_worker()


if __name__ == "__main__":
    main()
