"""Pipeline parallel: what each schedule keeps in flight, and what a pipelined step costs.

    python benchmarks/pipeline.py [--quick] [--device cpu|cuda] [--json out.json]

One run, one table. For p in {2, 4} workers (started with metaoptrun) and m in
{4, 8, 16} micro-batches, stage 0's activation peak (executor accounting: peak live
bytes minus persistables, held micro-batch activations included) under F-then-B and
1F1B, their ratio against the bound 1F1B promises (p/m + 0.1), and the step time
against single-process gradient accumulation over the same m micro-batches (a
1-stage pipeline). The model is a BERT of `--layers` tiny-width layers cut into equal
stages. On CUDA add `--gpt117m` for Paddle's published shape (GPT-2 117M, seq 1024):
memory and tokens/s with and without recompute, and with offload.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from common import RESULTS, machine

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import metaopt  # noqa: E402
import programs  # noqa: E402
from metaopt import fleet  # noqa: E402


def _cuts(layers: int, stages: int) -> list[str]:
    per = layers // stages
    return [f"bert.encoder.layer.{k * per}" for k in range(1, stages)]


def _feed(cfg: dict, batch: int, seed: int) -> dict[str, torch.Tensor]:
    bert = programs.get("bert")
    inputs = bert.example_inputs("tiny", batch, seed=seed, **cfg)
    return dict(zip(bert.INPUT_NAMES, inputs, strict=True))


def run_one(cfg: dict, schedule: str, m: int, mbs: int, steps: int, device: str, extra: dict) -> dict:
    """This worker's figures for one configuration (every worker of the job calls it)."""
    bert = programs.get("bert")
    model = bert.build("tiny", seed=0, dropout=0.0, **cfg)
    main = metaopt.export(model, bert.example_inputs("tiny", 2, **cfg), name="bert")
    strategy = fleet.DistributedStrategy()
    strategy.pipeline = True
    world = fleet.worker_num()
    strategy.pipeline_configs = {
        "accumulate_steps": m,
        "schedule_mode": schedule,
        "cuts": _cuts(cfg["num_layers"], world),
    }
    if extra.get("recompute"):
        strategy.recompute = True
        strategy.recompute_configs = {
            "checkpoints": ["bert.encoder.layer.*"],
            "enable_offload": bool(extra.get("offload")),
        }
    fleet.distributed_optimizer(metaopt.optimizer.Adam(learning_rate=1e-4), strategy).minimize(main.loss)
    exe = metaopt.Executor(device)
    times = []
    for step in range(steps + 1):
        feed = _feed(cfg, m * mbs, seed=step)
        fleet.barrier_worker()
        t0 = time.perf_counter()
        exe.run(main, feed=feed, fetch_list=["loss"])
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        if step:  # the first step builds the plans
            times.append(time.perf_counter() - t0)
    stats = exe.memory_stats()
    return {
        "activation_peak": stats["peak_bytes"] - stats["persistable_bytes"],
        "step_s": statistics.median(times),
        "cuda_max_allocated": stats.get("cuda_max_allocated"),
    }


def worker(args: argparse.Namespace) -> None:
    fleet.init(is_collective=True)
    cfg = {"num_layers": args.layers, "seq_len": args.seq}
    out = {}
    for schedule in ("F-then-B", "1F1B"):
        for m in args.micro_batches:
            out[f"{schedule}:{m}"] = run_one(cfg, schedule, m, args.mbs, args.steps, args.device, {})
    if args.gpt117m:
        out.update(_gpt117m(args))
    with open(os.path.join(args.out, f"rank{fleet.worker_index()}.json"), "w") as f:
        json.dump(out, f)


def _gpt117m(args) -> dict:
    """Paddle's table: GPT-2 117M, seq 1024, 1F1B over the workers (GPU only)."""
    raise NotImplementedError(
        "--gpt117m: the GPT-117M rows need a GPU run (no GPU was lent when this was written)"
    )


def launch(p: int, args: argparse.Namespace, out: str) -> None:
    cmd = [
        sys.executable,
        "-m",
        "metaopt.launch",
        f"--nproc_per_node={p}",
        f"--log_dir={os.path.join(out, 'log')}",
        os.path.abspath(__file__),
        "--worker",
        f"--out={out}",
        f"--layers={args.layers}",
        f"--seq={args.seq}",
        f"--mbs={args.mbs}",
        f"--steps={args.steps}",
        f"--device={args.device}",
        "--micro-batches",
        *[str(m) for m in args.micro_batches],
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
        env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"metaoptrun --nproc_per_node={p} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def single_process(args: argparse.Namespace) -> dict[int, float]:
    """Gradient accumulation over m micro-batches in one process (a 1-stage pipeline)."""
    fleet.init(is_collective=True)
    cfg = {"num_layers": args.layers, "seq_len": args.seq}
    torch.set_num_threads(1)  # as each pipeline worker (OMP_NUM_THREADS=1)
    return {
        m: run_one(cfg, "1F1B", m, args.mbs, args.steps, args.device, {})["step_s"]
        for m in args.micro_batches
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--mbs", type=int, default=2, help="samples per micro-batch")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--gpt117m", action="store_true")
    ap.add_argument("--json", default=os.path.join(RESULTS, "pipeline.json"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.quick:
        args.layers, args.seq, args.steps, args.micro_batches = 4, 16, 1, [4, 8]
    t_start = time.perf_counter()
    rows = []
    base = single_process(args)
    for p in args.stages:
        with tempfile.TemporaryDirectory() as out:
            launch(p, args, out)
            with open(os.path.join(out, "rank0.json")) as f:
                r0 = json.load(f)
        for m in args.micro_batches:
            gpipe, ofob = r0[f"F-then-B:{m}"], r0[f"1F1B:{m}"]
            rows.append(
                {
                    "p": p,
                    "m": m,
                    "stage0_act_fthenb": gpipe["activation_peak"],
                    "stage0_act_1f1b": ofob["activation_peak"],
                    "ratio": ofob["activation_peak"] / gpipe["activation_peak"],
                    "bound": p / m + 0.1,
                    "step_1f1b_s": ofob["step_s"],
                    "step_fthenb_s": gpipe["step_s"],
                    "single_process_s": base[m],
                }
            )
    print(
        f"bert {args.layers} layers (tiny width), seq {args.seq}, {args.mbs} samples per micro-batch, "
        f"{args.device}; stage 0 activation peak from the executor's accounting"
    )
    head = (
        f"{'p':>2} {'m':>3} {'F-then-B KiB':>13} {'1F1B KiB':>9} {'1F1B/FtB':>9} {'bound':>6} "
        f"{'1F1B ms':>8} {'FtB ms':>7} {'1-proc ms':>9} {'1F1B/1-proc':>11}"
    )
    print(head)
    for r in rows:
        print(
            f"{r['p']:>2} {r['m']:>3} {r['stage0_act_fthenb'] / 1024:>13.1f} "
            f"{r['stage0_act_1f1b'] / 1024:>9.1f} "
            f"{r['ratio']:>9.2f} {r['bound']:>6.2f} {1e3 * r['step_1f1b_s']:>8.1f} "
            f"{1e3 * r['step_fthenb_s']:>7.1f} {1e3 * r['single_process_s']:>9.1f} "
            f"{r['step_1f1b_s'] / r['single_process_s']:>11.2f}"
        )
    ok = all(r["ratio"] <= r["bound"] for r in rows if r["m"] >= r["p"])
    print(f"1F1B stage-0 peak <= (p/m + 0.1) x F-then-B's (m >= p): {'pass' if ok else 'FAIL'}")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(
            {"machine": machine(torch.device(args.device)), "args": vars(args), "rows": rows}, f, indent=1
        )
    print(f"wrote {args.json} ({time.perf_counter() - t_start:.0f} s)")


if __name__ == "__main__":
    main()
