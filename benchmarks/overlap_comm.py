"""Data parallel's all-reduces overlapped with the backward (passes/overlap_comm.py) against the
same program waiting for each where it starts; gloo workers, one table.

    python benchmarks/overlap_comm.py [--steps 20] [--bucket-mb 1] [--json out.json]

Two workers (metaoptrun --nproc_per_node=2, one thread each), a BERT of `--layers` layers of
width `--hidden` (seq `--seq`, `--batch` samples per worker), Adam, grads in buckets of
`--bucket-mb` MB. One export, minimized once (overlap on, the default); the other program is the
same with every CommWait dropped and `overlap` off, so each all-reduce is waited for where it
starts (what the executor did before the overlap_comm step). Their steps run interleaved (after a
barrier each), the first two not timed. Per mode: the median step time (the slower worker's per
step), its ratio to the waiting program's, and the median time the workers spent waiting in
collectives per step (`exe.runtime.comm.seconds`: with overlap, only what the backward did not
hide). Both programs' losses are checked equal bit for bit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch
from common import RESULTS, bert_config, launch_workers, machine, worker_flags, worker_results

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import metaopt  # noqa: E402
import programs  # noqa: E402
from metaopt import fleet  # noqa: E402

MODES = ("wait at start", "overlapped")
FLAGS = ("layers", "hidden", "seq", "batch", "steps", "bucket-mb")  # what the workers are given


def _waiting_at_start(p: metaopt.Program) -> metaopt.Program:
    """`p` with each overlapped all-reduce waited for where it starts."""
    q = p.clone()
    q.ops = [
        dataclasses.replace(op, attrs={k: v for k, v in op.attrs.items() if k != "overlap"})
        for op in p.ops
        if op.type != "CommWait"
    ]
    return q


def worker(args: argparse.Namespace) -> None:
    bert, cfg = programs.get("bert"), bert_config(args.hidden, args.layers, args.seq)
    fleet.init(is_collective=True)
    rank = fleet.worker_index()
    main = metaopt.export(
        bert.build("base", seed=0, **cfg), bert.example_inputs("base", 2, **cfg), name="bert"
    )
    s = fleet.DistributedStrategy()
    s.fuse_grad_size_in_MB = args.bucket_mb
    opt = fleet.distributed_optimizer(metaopt.optimizer.Adam(learning_rate=1e-4), s)
    opt.minimize(main.loss)
    overlapped = sum(bool(op.attrs.get("overlap")) for op in main.ops)
    progs = {"overlapped": main, "wait at start": _waiting_at_start(main)}
    runs = {mode: (progs[mode], metaopt.Executor("cpu"), []) for mode in MODES}
    for step in range(args.steps + 2):
        inputs = bert.example_inputs("base", args.batch, seed=1000 * rank + step, **cfg)
        feed = dict(zip(bert.INPUT_NAMES, inputs, strict=True))
        for mode in MODES if step % 2 else MODES[::-1]:
            prog, exe, steps = runs[mode]
            fleet.barrier_worker()
            t0 = time.perf_counter()
            (loss,) = exe.run(prog, feed=feed, fetch_list=[prog.loss])
            wall = time.perf_counter() - t0
            if step >= 2:
                steps.append({"step_s": wall, "comm_s": exe.runtime.comm.seconds, "loss": float(loss)})
    out = {
        "buckets": len(opt.data_parallel_plan.buckets),
        "overlapped_ops": overlapped,
        **{mode: steps for mode, (_, _, steps) in runs.items()},
    }
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    fleet.barrier_worker()


def launch(args: argparse.Namespace, out: str) -> None:
    flags = [f"--{k}={getattr(args, k.replace('-', '_'))}" for k in FLAGS]
    launch_workers(__file__, 2, out, flags)


def rows(ranks: list[dict]) -> list[dict]:
    out = []
    for mode in MODES:
        per = [r[mode] for r in ranks]
        n = len(per[0])
        out.append(
            {
                "mode": mode,
                "step_s": statistics.median(max(w[i]["step_s"] for w in per) for i in range(n)),
                "comm_s": [statistics.median(s["comm_s"] for s in w) for w in per],
            }
        )
    base = out[0]["step_s"]
    for r in out:
        r["vs_waiting"] = r["step_s"] / base
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per mode")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="samples per worker")
    ap.add_argument("--bucket-mb", type=int, default=1, help="strategy.fuse_grad_size_in_MB")
    ap.add_argument("--json", default=os.path.join(RESULTS, "overlap_comm.json"))
    worker_flags(ap)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    _, ranks = worker_results(launch, args, "overlap_comm_")
    for r in ranks:  # the same bits: the overlap moves only where the host waits
        assert [s["loss"] for s in r["overlapped"]] == [s["loss"] for s in r["wait at start"]]
    table = rows(ranks)
    print(
        f"BERT {args.layers} x {args.hidden}, seq {args.seq}, batch {args.batch} per worker, 2 gloo workers: "
        f"{ranks[0]['buckets']} buckets of {args.bucket_mb:g} MB, {ranks[0]['overlapped_ops']} overlapped"
    )
    print(f"{'mode':14} {'step ms':>8} {'vs waiting':>10} {'comm wait ms w0':>16} {'comm wait ms w1':>16}")
    for r in table:
        w0, w1 = (1e3 * c for c in r["comm_s"])
        print(f"{r['mode']:14} {1e3 * r['step_s']:8.1f} {r['vs_waiting']:10.3f} {w0:16.1f} {w1:16.1f}")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(
            {
                "machine": machine(torch.device("cpu")),
                "args": vars(args),
                "buckets": ranks[0]["buckets"],
                "rows": table,
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
