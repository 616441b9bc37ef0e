"""Fleet's recompute example (train_fleet_recompute.py in the Fleet docs) in metaopt's API.

    metaoptrun --nproc_per_node=2 examples/train_fleet_recompute.py        # 2 CPU workers, gloo
    metaoptrun --gpus=0,1 examples/train_fleet_recompute.py --device cuda  # one worker per GPU, NCCL
    python examples/train_fleet_recompute.py                               # one worker

ResNet with the doc's recompute checkpoints res2a ... res5c (ResNet-50's 16 bottleneck
blocks: ``--depths 3,4,6,3``; ``--config resnet50`` is the real model), synthetic
ImageNet-like data (each worker draws its own batches), Momentum as in the doc, and the
doc's log lines: ``[Epoch 0, batch 10] loss: 2.30259, acc1: 0.12500, acc5: 0.50000``.
With more than one worker the data-parallel meta optimizer averages the grads.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import metaopt  # noqa: E402
import programs  # noqa: E402
from metaopt import fleet  # noqa: E402

# The doc's checkpoints: every bottleneck block's output of ResNet-50.
STAGE_DEPTHS = (3, 4, 6, 3)
CHECKPOINTS = [f"res{2 + s}{chr(ord('a') + k)}" for s, n in enumerate(STAGE_DEPTHS) for k in range(n)]


def accuracy(logits: np.ndarray, label: np.ndarray, k: int) -> float:
    topk = np.argsort(-logits, axis=1)[:, :k]
    return float((topk == label[:, None]).any(axis=1).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="tiny", help="tiny (CPU-sized) or resnet50")
    ap.add_argument("--depths", default="3,4,6,3", help="blocks per stage (ResNet-50's by default)")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batches", type=int, default=10, help="batches per epoch")
    ap.add_argument("--batch_size", type=int, default=8, help="per worker")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (each worker uses its LOCAL_RANK's GPU)")
    ap.add_argument("--offload", action="store_true", help="recompute_configs['enable_offload'] = True")
    ap.add_argument("--log_every", type=int, default=1)
    args = ap.parse_args()

    fleet.init(is_collective=True)
    rank, world = fleet.worker_index(), fleet.worker_num()
    resnet = programs.get("resnet")
    depths = tuple(int(d) for d in args.depths.split(","))
    model = resnet.build(args.config, seed=0, depths=depths)
    main_program = metaopt.export(model, resnet.example_inputs(args.config, 2, depths=depths), name="resnet")
    logits = main_program.modules["fc"][0]

    strategy = fleet.DistributedStrategy()
    strategy.recompute = True
    known = [c for c in CHECKPOINTS if c in main_program.modules]  # fewer with smaller --depths
    strategy.recompute_configs = {"checkpoints": known, "enable_offload": args.offload}
    optimizer = metaopt.optimizer.Momentum(learning_rate=args.lr, momentum=0.9)
    optimizer = fleet.distributed_optimizer(optimizer, strategy)
    optimizer.minimize(main_program.loss)
    if rank == 0:
        print(f"applied meta optimizers: {optimizer.applied_meta_list}")
        print(optimizer.recompute_plan)
        if world > 1:
            print(optimizer.data_parallel_plan)

    device = f"cuda:{fleet.local_rank()}" if args.device == "cuda" else args.device
    exe = metaopt.Executor(device)
    metaopt.seed(rank)
    for epoch in range(args.epochs):
        t0 = time.perf_counter()
        for batch_id in range(args.batches):
            seed = (epoch * args.batches + batch_id) * world + rank  # each worker its own data
            image, label = resnet.example_inputs(args.config, args.batch_size, seed=seed, depths=depths)
            loss, out = exe.run(
                main_program, feed={"image": image, "label": label}, fetch_list=[main_program.loss, logits]
            )
            if batch_id % args.log_every == 0:
                acc1, acc5 = accuracy(out, label.numpy(), 1), accuracy(out, label.numpy(), 5)
                print(
                    f"[Epoch {epoch}, batch {batch_id}] loss: {float(loss):.5f}, "
                    f"acc1: {acc1:.5f}, acc5: {acc5:.5f}",
                    flush=True,
                )
        elapsed = time.perf_counter() - t0
        speed = args.batches * args.batch_size * world / elapsed
        print(f"epoch {epoch} done: {speed:.1f} images/s over {world} worker(s)", flush=True)
    stats = exe.memory_stats()
    print(f"rank {rank}: peak {stats['peak_bytes'] / 2**20:.1f} MiB, final loss {float(loss):.5f}")


if __name__ == "__main__":
    main()
