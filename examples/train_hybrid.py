"""Hybrid parallel: data parallel x tensor (model) parallel x pipeline on the gpt reference program.

    metaoptrun --nproc_per_node=4 examples/train_hybrid.py [--dp 2] [--mp 2] [--steps 5]
    metaoptrun --nproc_per_node=2 examples/train_hybrid.py --dp 1 --mp 2
    metaoptrun --nproc_per_node=8 examples/train_hybrid.py --dp 2 --mp 2 --pp 2

With --pp 2 the program is also cut into two pipeline stages at ``transformer.h.1`` (1F1B over
--micro micro-batches): each MP rank of stage 0 sends to the same MP rank of stage 1, and the
loss is printed by the last stage's workers.

fleet.init lays the workers out from hybrid_configs (model-parallel peers adjacent, as Paddle's
CommunicateTopology and Megatron place them) and makes every group; the optimizer's strategy
splits the attention and MLP Linears Megatron's way (column: c_attn, c_fc; row: c_proj) by a
rewrite of the exported program, so each worker holds 1/mp of those weights. Every worker of a
data-parallel replica is fed the same batch; the replicas get different batches. Dropout is 0:
model-parallel-aware dropout is not implemented yet (issue 16, refused by name).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import metaopt  # noqa: E402
import programs  # noqa: E402
from metaopt import fleet  # noqa: E402

COLUMN = ["transformer.h.*.attn.c_attn", "transformer.h.*.mlp.c_fc"]
ROW = ["transformer.h.*.attn.c_proj", "transformer.h.*.mlp.c_proj"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--mp", type=int, default=2)
    ap.add_argument("--pp", type=int, choices=(1, 2), default=1, help="pipeline stages (tiny gpt: 2 blocks)")
    ap.add_argument("--micro", type=int, default=2, help="micro-batches per step with --pp 2")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8, help="per data-parallel replica")
    args = ap.parse_args()

    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": args.dp, "mp_degree": args.mp, "pp_degree": args.pp}
    strategy.tensor_parallel = True
    strategy.tensor_parallel_configs = {"column": COLUMN, "row": ROW}
    if args.pp > 1:  # cut where the residual stream is replicated over the MP group
        strategy.pipeline = True
        strategy.pipeline_configs = {"cuts": ["transformer.h.1"], "accumulate_steps": args.micro}
    fleet.init(is_collective=True, strategy=strategy)
    hcg = fleet.get_hybrid_communicate_group()

    gpt = programs.get("gpt")
    model = gpt.build("tiny", seed=0, dropout=0.0)  # the same seed on every worker
    main_program = metaopt.export(model, gpt.example_inputs("tiny", 2, seed=1), name="gpt")
    opt = fleet.distributed_optimizer(metaopt.optimizer.Adam(learning_rate=1e-3), strategy)
    opt.minimize(main_program.loss)
    if fleet.worker_index() == 0:
        print(opt.plan())
        print(opt.tensor_parallel_plan)

    exe = metaopt.Executor("cpu")
    dp_rank = hcg.get_data_parallel_rank()
    for step in range(args.steps):
        # each replica its own batch; the model-parallel ranks of a replica the same one
        inputs = gpt.example_inputs("tiny", args.batch, seed=1000 * step + dp_rank)
        (loss,) = exe.run(
            main_program, feed=dict(zip(gpt.INPUT_NAMES, inputs, strict=True)), fetch_list=["loss"]
        )
        if loss is None:  # a pipeline stage before the last: the loss lives on the last one
            continue
        where = f"dp {dp_rank}, mp {hcg.get_model_parallel_rank()}"
        where += f", pp {hcg.get_stage_id()}" if args.pp > 1 else ""
        print(f"worker {fleet.worker_index()} ({where}) step {step}: loss {float(loss):.6f}", flush=True)
    fleet.barrier_worker()


if __name__ == "__main__":
    main()
