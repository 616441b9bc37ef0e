"""Zero-bubble pipelines: ZB-H1 and ZB-V against 1F1B, measured on gloo workers, one table.

    python benchmarks/zero_bubble.py [--m 4 8] [--steps 15] [--json out.json]

Two workers (metaoptrun --nproc_per_node=2, one thread each), a BERT of `--layers` layers of
width `--hidden` (seq `--seq`, a 1000-token vocabulary so the last stage's head does not dwarf
the layers), `--mbs` samples per micro-batch, Adam. 1F1B and ZB-H1 cut it into 2 equal stages
(at the middle layer); ZB-V into 4 chunks (at layers L/4, L/2, 3L/4: 1, 2, 3 of 4), two per
worker in a V (worker 0: chunks 0 and 3, worker 1: chunks 1 and 2). For each m the three
schedules are minimized from one export and their steps run interleaved (1F1B, ZB-H1, ZB-V,
then rotated by one each step, after a barrier each), so the machine's drift falls on all
alike; the first two steps of each (plans built, edges verified) are not timed. Per schedule
and m: the median step time (the slower worker's), its ratio to 1F1B's, each worker's measured
bubble (1 - its actions' compute over the step) beside the simulator's ideal from the measured
per-action means (F, B, W; for 1F1B B is the whole backward; for ZB-V a worker's cost is 2 x
its mean per-chunk action, the simulator's per-worker share, which it splits evenly over the
two chunks), and each worker's peak bytes (executor accounting). A second table simulates
F-then-B, 1F1B, ZB-H1 and ZB-V at p = 2, 4 and m = 4, 8, 16 (4 workers do not fit 2 cores:
simulated only). ZB-V needs m to be a multiple of the workers (2). The last step of each
schedule and m is drawn (`metaopt.schedule_picture`) under results/zero_bubble_pictures/.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
from metaopt.runtime.pipeline import last_step_profile  # noqa: E402
from metaopt.runtime.schedules import V_CHUNKS, simulate  # noqa: E402

SCHEDULES = ("1F1B", "ZBH1", "ZBV")


def cuts(schedule: str, layers: int) -> list[str]:
    """Where each (virtual) stage begins: 2 stages at the middle layer; ZB-V 4 chunks at L/4, L/2, 3L/4."""
    n = 2 * V_CHUNKS if schedule == "ZBV" else 2
    return [f"bert.encoder.layer.{layers * k // n}" for k in range(1, n)]


def worker(args: argparse.Namespace) -> None:
    bert, cfg = programs.get("bert"), bert_config(args.hidden, args.layers, args.seq, vocab_size=1000)
    fleet.init(is_collective=True)
    rank = fleet.worker_index()
    base = metaopt.export(
        bert.build("base", seed=0, **cfg), bert.example_inputs("base", 2, **cfg), name="bert"
    )
    out: dict = {}
    for m in args.m:
        runs = {}
        for schedule in SCHEDULES:
            main = base.clone()
            s = fleet.DistributedStrategy()
            s.pipeline = True
            s.pipeline_configs = {
                "accumulate_steps": m,
                "schedule_mode": schedule,
                "cuts": cuts(schedule, args.layers),
            }
            fleet.distributed_optimizer(metaopt.optimizer.Adam(learning_rate=1e-4), s).minimize(main.loss)
            runs[schedule] = (main, metaopt.Executor("cpu"), [])
        for step in range(args.steps + 2):
            inputs = bert.example_inputs("base", m * args.mbs, seed=step, **cfg)
            feed = dict(zip(bert.INPUT_NAMES, inputs, strict=True))
            k = step % len(SCHEDULES)  # rotated: each schedule runs first, middle and last alike
            for schedule in SCHEDULES[k:] + SCHEDULES[:k]:
                main, exe, steps = runs[schedule]
                fleet.barrier_worker()
                t0 = time.perf_counter()
                exe.run(main, feed=feed, fetch_list=["loss"])
                wall = time.perf_counter() - t0
                prof = last_step_profile(exe, main)
                if step >= 2:
                    means = {k: prof.mean_compute(k) for k in "FBW"}
                    compute = sum(t for _, t in prof.actions)
                    steps.append({"step_s": wall, "compute_s": compute, **means})
        for schedule, (main, exe, steps) in runs.items():
            out[f"{schedule}:{m}"] = {"steps": steps, "peak": exe.memory_stats()["peak_bytes"]}
            # the last step of each, drawn (worker 0 writes it; every worker takes part)
            metaopt.schedule_picture(
                exe, main, out=os.path.join(args.out, "pictures"), name=f"{schedule}_m{m}"
            )
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    fleet.barrier_worker()


def launch(args: argparse.Namespace, out: str) -> None:
    flags = [f"--layers={args.layers}", f"--hidden={args.hidden}", f"--seq={args.seq}"]
    flags += [f"--mbs={args.mbs}", f"--steps={args.steps}", "--m", *[str(m) for m in args.m]]
    launch_workers(__file__, 2, out, flags)


def rows(ranks: list[dict], m: int) -> list[dict]:
    """Per schedule: median step time (the slower worker's per step), measured and ideal bubble."""
    out = []
    for schedule in SCHEDULES:
        per = [r[f"{schedule}:{m}"] for r in ranks]
        n = len(per[0]["steps"])
        step_s = statistics.median(max(w["steps"][i]["step_s"] for w in per) for i in range(n))
        measured = [statistics.median(1 - s["compute_s"] / s["step_s"] for s in w["steps"]) for w in per]
        # the simulator's costs are a worker's whole share of a micro-batch: ZB-V's actions are one
        # chunk's (of 2 per worker), so its per-action means count twice
        chunks = V_CHUNKS if schedule == "ZBV" else 1
        mean = {k: [chunks * statistics.mean(s[k] for s in w["steps"]) for w in per] for k in "FBW"}
        w_cost = mean["W"] if schedule in ("ZBH1", "ZBV") else None
        b_cost = [b + w for b, w in zip(mean["B"], mean["W"], strict=True)]
        ideal = simulate(
            schedule,
            num_stages=2,
            micro_batches=m,
            chunks=chunks,
            f_cost=mean["F"],
            b_cost=b_cost,
            w_cost=w_cost,
        ).bubble_fraction
        out.append(
            {
                "schedule": schedule,
                "m": m,
                "step_s": step_s,
                "measured_bubble": measured,
                "ideal_bubble": ideal,
            }
        )
        out[-1]["peak"] = [w["peak"] for w in per]
    base = out[0]["step_s"]
    for r in out:
        r["vs_1f1b"] = r["step_s"] / base
    return out


def simulated_rows() -> list[dict]:
    """F-then-B, 1F1B, ZB-H1 and ZB-V at p = 2, 4 and m = 4, 8, 16 in the simulator: bubble,
    makespan against 1F1B's, and the most values held on each worker (micro-batches; for ZB-V
    chunk-units, two to a micro-batch)."""
    out = []
    for p in (2, 4):
        for m in (4, 8, 16):
            base = simulate("1F1B", num_stages=p, micro_batches=m).makespan
            for schedule in ("F-then-B", "1F1B", "ZBH1", "ZBV"):
                chunks = 2 if schedule == "ZBV" else 1
                r = simulate(schedule, num_stages=p, micro_batches=m, chunks=chunks)
                out.append(
                    {
                        "p": p,
                        "m": m,
                        "schedule": schedule,
                        "bubble": r.bubble_fraction,
                        "vs_1f1b": r.makespan / base,
                        "max_held": list(r.max_held),
                    }
                )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, nargs="+", default=[4, 8, 16], help="micro-batches per step")
    ap.add_argument("--steps", type=int, default=15, help="timed steps per schedule and m")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--mbs", type=int, default=4, help="samples per micro-batch")
    ap.add_argument("--json", default=os.path.join(RESULTS, "zero_bubble.json"))
    worker_flags(ap)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    out, ranks = worker_results(launch, args, "zero_bubble_")
    table = [row for m in args.m for row in rows(ranks, m)]
    where = machine(torch.device("cpu"))["device"]
    print(
        f"ZB-H1 and ZB-V vs 1F1B, 2 gloo workers, BERT {args.layers} x {args.hidden} seq {args.seq}, "
        f"{args.mbs} samples per micro-batch, {args.steps} steps interleaved, {where}"
    )
    head = (
        "m",
        "schedule",
        "step ms",
        "vs 1F1B",
        "bubble w0",
        "bubble w1",
        "ideal",
        "peak MB w0",
        "peak MB w1",
    )
    print("{:>3} {:>8} {:>8} {:>8} {:>9} {:>9} {:>6} {:>10} {:>10}".format(*head))
    for r in table:
        print(
            f"{r['m']:>3} {r['schedule']:>8} {r['step_s'] * 1e3:>8.1f} {r['vs_1f1b']:>8.3f} "
            f"{r['measured_bubble'][0]:>9.3f} {r['measured_bubble'][1]:>9.3f} {r['ideal_bubble']:>6.3f} "
            f"{r['peak'][0] / 2**20:>10.2f} {r['peak'][1] / 2**20:>10.2f}"
        )
    pictures = os.path.join(os.path.dirname(args.json) or ".", "zero_bubble_pictures")
    shutil.rmtree(pictures, ignore_errors=True)
    shutil.copytree(os.path.join(out, "pictures"), pictures)
    print(f"schedule pictures of each schedule's last step: {pictures}/")
    sim = simulated_rows()
    print("\nsimulated (F = 1, B + W = 2, W = 1 where split): bubble fraction and step time vs 1F1B")
    print(
        "{:>3} {:>3} {:>9} {:>8} {:>8} {:>12}".format("p", "m", "schedule", "bubble", "vs 1F1B", "max held")
    )
    for r in sim:
        print(
            f"{r['p']:>3} {r['m']:>3} {r['schedule']:>9} {r['bubble']:>8.3f} {r['vs_1f1b']:>8.3f} "
            f"{str(r['max_held']):>12}"
        )
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        out = {"machine": machine(torch.device("cpu")), "args": vars(args), "rows": table, "simulated": sim}
        json.dump(out, f, indent=1)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
