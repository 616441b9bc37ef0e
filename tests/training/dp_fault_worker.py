"""A 2-worker data-parallel job whose rank 1 dies (or stalls) before step 1's all-reduce.

argv: mode ("die" | "stall"). Rank 0 must fail with the communicator's error, not hang.
Mode "raise": both workers run a copy of the program with an op that raises right after the
first all-reduce left in flight (overlap_comm); the executor must finish what is in flight (no
collective left behind), so the next steps of the real program still pair up, and the process
exits cleanly.
"""

from __future__ import annotations

import os
import sys
import time

import export_cache
import torch

import metaopt
import programs
from metaopt import fleet
from metaopt.ir import Op, Var


def _raising_copy(main: metaopt.Program) -> metaopt.Program:
    """`main` with a Reshape to an impossible shape right after its first overlapped all-reduce."""
    q = main.clone()
    i = next(k for k, op in enumerate(q.ops) if op.attrs.get("overlap"))
    q.add_var(Var("bad_shape", "int64", (1,), "constant"), torch.tensor([7]))
    q.add_var(Var("boom", "float32", None, "activation"))
    q.ops.insert(i + 1, Op("Reshape", [q.ops[i].inputs[0], "bad_shape"], ["boom"], {}, role="backward"))
    q.outputs = [*q.outputs, "boom"]
    return q


def raise_mid_flight(rank: int) -> None:
    mod = programs.get("mlp")
    main = export_cache.export(mod.build("tiny", seed=0), mod.example_inputs("tiny", 4, seed=1), name="mlp")
    strategy = fleet.DistributedStrategy()
    strategy.fuse_all_reduce_ops = False  # an all-reduce per grad: several in flight at once
    fleet.distributed_optimizer(metaopt.optimizer.SGD(learning_rate=0.1), strategy).minimize(main.loss)
    feed = dict(zip(mod.INPUT_NAMES, mod.example_inputs("tiny", 4, seed=0), strict=True))
    ref = metaopt.Executor("cpu")  # what two steps give without the broken run before them
    torch.manual_seed(5)  # the mlp's dropout: the same masks in both
    want = [float(ref.run(main, feed=feed, fetch_list=[main.loss])[0]) for _ in range(2)]
    exe = metaopt.Executor("cpu")
    try:
        exe.run(_raising_copy(main), feed=feed, fetch_list=["boom"])
        raise AssertionError("the broken copy ran")
    except RuntimeError as e:
        assert "Reshape" in str(e), e
    assert exe.runtime.comm.in_flight == 0
    torch.manual_seed(5)
    losses = [float(exe.run(main, feed=feed, fetch_list=[main.loss])[0]) for _ in range(2)]
    assert losses == want, (losses, want)  # the collectives still pair up: the same two steps
    print(f"rank {rank} raised mid-flight, then trained as without it: {losses}", flush=True)


def main() -> None:
    mode = sys.argv[1]
    fleet.init(is_collective=True)
    rank = fleet.worker_index()
    if mode == "raise":
        raise_mid_flight(rank)
        return
    mod = programs.get("mlp")
    main = export_cache.export(mod.build("tiny", seed=0), mod.example_inputs("tiny", 4, seed=1), name="mlp")
    fleet.distributed_optimizer(metaopt.optimizer.SGD(learning_rate=0.1)).minimize(main.loss)
    exe = metaopt.Executor("cpu")
    for step in range(3):
        if rank == 1 and step == 1:
            if mode == "die":
                os._exit(3)
            time.sleep(120)  # alive but never reaches the collective
        feed = dict(zip(mod.INPUT_NAMES, mod.example_inputs("tiny", 4, seed=step), strict=True))
        exe.run(main, feed=feed, fetch_list=[main.loss])
        print(f"rank {rank} step {step} done", flush=True)


if __name__ == "__main__":
    main()
