"""Pipeline parallel: what each schedule keeps in flight, and what a pipelined step costs.

    python benchmarks/pipeline.py [--quick] [--device cpu|cuda] [--json out.json]

One run, one table. For p in {2, 4} workers (started with metaoptrun) and m in
{4, 8, 16} micro-batches, stage 0's activation peak (executor accounting: peak live
bytes minus persistables, held micro-batch activations included) under F-then-B and
1F1B, their ratio against the bound 1F1B promises (p/m + 0.1), and the step time
against single-process gradient accumulation over the same m micro-batches (a
1-stage pipeline). The model is a BERT of `--layers` tiny-width layers cut into equal
stages. `--gpt117m` adds Paddle's published shape (GPT-2 117M, seq `--gpt-seq`, default
1024, 2 stages 1F1B): each stage's peak memory and tokens/s, plain, with recompute and
with offload (`--skip-schedules` runs only those rows).

The communication overhead rows (`--overhead-only` runs only them): 2 stages, 1F1B, 8
micro-batches of a BERT whose compute is not negligible (width `--ovh-hidden`, `--ovh-layers`
layers, seq `--ovh-seq`, a 1000-token vocabulary so the last stage's head does not dwarf the
layers). Each worker times every action's compute (its wall time less its waits on
communication: `runtime.pipeline.last_step_profile`); the schedule simulator turns the
per-stage means into the step's ideal time with free communication (plus each worker's
work outside the actions: feed split, optimizer), and the overhead is the actual
step time (the slower worker's) over that ideal, the median over the timed steps. Rows: the
steady-state protocol (headers on a step's first use of an edge only, data alone after) and
``METAOPT_PIPELINE_CHECK=1`` (a header before every message: the protocol before the change).
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
from common import RESULTS, bert_config, machine

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import metaopt  # noqa: E402
import programs  # noqa: E402
from metaopt import fleet  # noqa: E402
from metaopt.runtime.comm import CHECK_ENV  # noqa: E402
from metaopt.runtime.pipeline import last_step_profile  # noqa: E402
from metaopt.runtime.schedules import simulate  # noqa: E402

OVERHEAD_MODES = {"data only": "0", "header every message": "1"}  # value of METAOPT_PIPELINE_CHECK


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


def overhead_worker(args: argparse.Namespace) -> dict:
    """This worker's step profiles (2 stages, 1F1B, `--ovh-m` micro-batches) under each
    protocol mode: per step its wall time, per-action compute, waits and the rest."""
    bert, cfg = programs.get("bert"), bert_config(args.ovh_hidden, args.ovh_layers, args.ovh_seq, 1000)
    model = bert.build("base", seed=0, **cfg)
    base = metaopt.export(model, bert.example_inputs("base", 2, **cfg), name="bert")
    out = {}
    for mode, switch in OVERHEAD_MODES.items():
        main = base.clone()
        strategy = fleet.DistributedStrategy()
        strategy.pipeline = True
        cut = f"bert.encoder.layer.{args.ovh_layers // 2}"
        strategy.pipeline_configs = {"accumulate_steps": args.ovh_m, "schedule_mode": "1F1B", "cuts": [cut]}
        fleet.distributed_optimizer(metaopt.optimizer.Adam(learning_rate=1e-4), strategy).minimize(main.loss)
        exe = metaopt.Executor(args.device)
        os.environ[CHECK_ENV] = switch  # every worker alike (else every message keeps a header)
        steps = []
        for step in range(args.ovh_steps + 1):
            inputs = bert.example_inputs("base", args.ovh_m * args.ovh_mbs, seed=step, **cfg)
            fleet.barrier_worker()
            exe.run(main, feed=dict(zip(bert.INPUT_NAMES, inputs, strict=True)), fetch_list=["loss"])
            prof = last_step_profile(exe, main)
            if step:  # the first step verifies every edge (and builds the plans)
                steps.append(
                    {
                        "step_s": prof.step_s,
                        "comm_s": prof.comm_s,
                        "before_s": prof.before_s,
                        "after_s": prof.after_s,
                        "f_s": prof.mean_compute("F"),
                        "b_s": prof.mean_compute("B"),
                        "messages": prof.messages,
                        "headers": prof.headers,
                    }
                )
        del os.environ[CHECK_ENV]
        out[f"overhead:{mode}"] = steps
    return out


def overhead_rows(ranks: list[dict], m: int) -> list[dict]:
    """Per protocol mode: the median over steps of actual / ideal step time. Ideal: each
    worker's end in the 1F1B simulation from every stage's mean F and B compute, plus its
    work after the actions (optimizer), the latest of those, plus the longer of the
    workers' work before the first action (feed split)."""
    rows = []
    for mode in OVERHEAD_MODES:
        per_step = list(zip(*[r[f"overhead:{mode}"] for r in ranks], strict=True))  # [step][rank]
        figures = []
        for workers in per_step:
            sim = simulate(
                "1F1B",
                num_stages=len(workers),
                micro_batches=m,
                f_cost=[w["f_s"] for w in workers],
                b_cost=[w["b_s"] for w in workers],
            )
            ends = [tl[-1][1] + w["after_s"] for tl, w in zip(sim.timeline, workers, strict=True)]
            ideal = max(w["before_s"] for w in workers) + max(ends)
            actual = max(w["step_s"] for w in workers)
            figures.append((actual / ideal, actual, ideal, workers))
        ratio, actual, ideal, workers = sorted(figures, key=lambda f: f[0])[len(figures) // 2]
        rows.append(
            {
                "mode": mode,
                "ratio": ratio,
                "actual_s": actual,
                "ideal_s": ideal,
                "f_ms": [1e3 * w["f_s"] for w in workers],
                "b_ms": [1e3 * w["b_s"] for w in workers],
                "comm_ms": [1e3 * w["comm_s"] for w in workers],
                "messages": workers[0]["messages"],
                "headers": workers[0]["headers"],
                "ratios": [f[0] for f in figures],
            }
        )
    return rows


def print_overhead(rows: list[dict], args: argparse.Namespace) -> None:
    c = bert_config(args.ovh_hidden, args.ovh_layers, args.ovh_seq, 1000)
    print(
        f"\ncommunication overhead: bert width {c['hidden_size']}, {c['num_layers']} layers, seq "
        f"{c['seq_len']}, 2 stages 1F1B, {args.ovh_m} micro-batches of {args.ovh_mbs}, {args.device}; "
        f"median of {args.ovh_steps} steps"
    )
    print(
        f"{'protocol':<22} {'F ms s0/s1':>12} {'B ms s0/s1':>12} {'ideal ms':>9} {'actual ms':>10} "
        f"{'actual/ideal':>12} {'waits ms s0/s1':>15} {'headers/msgs':>13}"
    )
    for r in rows:
        f, b, w = r["f_ms"], r["b_ms"], r["comm_ms"]
        print(
            f"{r['mode']:<22} {f[0]:>5.1f}/{f[1]:<6.1f} {b[0]:>5.1f}/{b[1]:<6.1f} {1e3 * r['ideal_s']:>9.1f} "
            f"{1e3 * r['actual_s']:>10.1f} {r['ratio']:>12.3f} {w[0]:>7.1f}/{w[1]:<7.1f} "
            f"{r['headers']:>6}/{r['messages']:<6}"
        )
    verdict = "pass" if rows[0]["ratio"] <= 1.25 else "FAIL"
    print(f"overhead (actual / ideal) <= 1.25 at 2 stages x {args.ovh_m} micro-batches: {verdict}")


def worker(args: argparse.Namespace) -> None:
    fleet.init(is_collective=True)
    cfg = {"num_layers": args.layers, "seq_len": args.seq}
    out = {}
    if args.run_overhead:
        out.update(overhead_worker(args))
    for schedule in () if args.skip_schedules else ("F-then-B", "1F1B"):
        for m in args.micro_batches:
            out[f"{schedule}:{m}"] = run_one(cfg, schedule, m, args.mbs, args.steps, args.device, {})
    if args.gpt117m:
        out.update(_gpt117m(args))
    with open(os.path.join(args.out, f"rank{fleet.worker_index()}.json"), "w") as f:
        json.dump(out, f)


def _gpt117m(args) -> dict:
    """Paddle's table: GPT-2 117M (12 layers, hidden 768), 1F1B over the workers, micro-batches
    of `--gpt-mbs` sequences of `--gpt-seq` tokens: this worker's peak memory and the
    step's tokens/s, plain, with recompute (one checkpoint per block), and with offload."""
    gpt = programs.get("gpt")
    cfg = {"seq_len": args.gpt_seq}
    model = gpt.build("gpt2", seed=0, dropout=0.0, **cfg)
    base = metaopt.export(model, gpt.example_inputs("gpt2", 2, **cfg), name="gpt")
    per = 12 // fleet.worker_num()
    cuts = [f"transformer.h.{k * per}" for k in range(1, fleet.worker_num())]
    out = {}
    for variant in ("plain", "recompute", "offload"):
        main = base.clone()
        strategy = fleet.DistributedStrategy()
        strategy.pipeline = True
        strategy.pipeline_configs = {"accumulate_steps": args.gpt_m, "schedule_mode": "1F1B", "cuts": cuts}
        if variant != "plain":
            strategy.recompute = True
            strategy.recompute_configs = {
                "checkpoints": ["transformer.h.*"],
                "enable_offload": variant == "offload",
            }
        opt = metaopt.optimizer.AdamW(learning_rate=1e-4)
        fleet.distributed_optimizer(opt, strategy).minimize(main.loss)
        exe = metaopt.Executor(args.device)
        batch = args.gpt_m * args.gpt_mbs
        times = []
        for step in range(args.steps + 1):
            inputs = gpt.example_inputs("gpt2", batch, seed=step, **cfg)
            feed = dict(zip(gpt.INPUT_NAMES, inputs, strict=True))
            fleet.barrier_worker()
            t0 = time.perf_counter()
            exe.run(main, feed=feed, fetch_list=["loss"])
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            if step:
                times.append(time.perf_counter() - t0)
        stats = exe.memory_stats()
        out[f"gpt117m:{variant}"] = {
            "peak_bytes": stats["peak_bytes"],
            "activation_peak": stats["peak_bytes"] - stats["persistable_bytes"],
            "host_peak_bytes": stats["host_peak_bytes"],
            "cuda_max_allocated": stats.get("cuda_max_allocated"),
            "tokens_per_s": batch * args.gpt_seq / statistics.median(times),
        }
    return out


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
        f"--gpt-seq={args.gpt_seq}",
        f"--gpt-m={args.gpt_m}",
        f"--gpt-mbs={args.gpt_mbs}",
        *(["--gpt117m"] if args.gpt117m else []),
        *(["--skip-schedules"] if args.skip_schedules else []),
        *(["--run-overhead"] if args.run_overhead else []),
        f"--ovh-hidden={args.ovh_hidden}",
        f"--ovh-layers={args.ovh_layers}",
        f"--ovh-seq={args.ovh_seq}",
        f"--ovh-mbs={args.ovh_mbs}",
        f"--ovh-m={args.ovh_m}",
        f"--ovh-steps={args.ovh_steps}",
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
    ap.add_argument("--gpt117m", action="store_true", help="add Paddle's GPT-117M rows (p=2)")
    ap.add_argument("--gpt-seq", type=int, default=1024, help="GPT-117M sequence length")
    ap.add_argument("--gpt-m", type=int, default=4, help="GPT-117M micro-batches per step")
    ap.add_argument("--gpt-mbs", type=int, default=1, help="GPT-117M sequences per micro-batch")
    ap.add_argument("--skip-schedules", action="store_true", help="only the GPT-117M rows")
    ap.add_argument("--overhead-only", action="store_true", help="only the communication overhead rows")
    ap.add_argument("--no-overhead", dest="overhead", action="store_false", help="skip those rows")
    ap.add_argument("--ovh-hidden", type=int, default=256, help="overhead rows: BERT width")
    ap.add_argument("--ovh-layers", type=int, default=4, help="overhead rows: BERT layers")
    ap.add_argument("--ovh-seq", type=int, default=128, help="overhead rows: sequence length")
    ap.add_argument("--ovh-mbs", type=int, default=2, help="overhead rows: samples per micro-batch")
    ap.add_argument("--ovh-m", type=int, default=8, help="overhead rows: micro-batches per step")
    ap.add_argument("--ovh-steps", type=int, default=5, help="overhead rows: timed steps")
    ap.add_argument("--run-overhead", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", default=os.path.join(RESULTS, "pipeline.json"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.quick:
        args.layers, args.seq, args.steps, args.micro_batches = 4, 16, 1, [4, 8]
        args.ovh_steps = 3
    if args.overhead_only:
        args.skip_schedules, args.gpt117m, args.overhead, args.stages = True, False, True, [2]
    t_start = time.perf_counter()
    rows = []
    gpt_rows: dict[str, list[dict]] = {}
    ovh_rows: list[dict] = []
    base = {} if args.skip_schedules else single_process(args)
    for p in args.stages:
        gpt = args.gpt117m and p == 2
        ovh = args.overhead and p == 2
        if args.skip_schedules and not gpt and not ovh:
            continue
        run_args = argparse.Namespace(**{**vars(args), "gpt117m": gpt, "run_overhead": ovh})
        with tempfile.TemporaryDirectory() as out:
            launch(p, run_args, out)
            ranks = []
            for r in range(p):
                with open(os.path.join(out, f"rank{r}.json")) as f:
                    ranks.append(json.load(f))
        r0 = ranks[0]
        if ovh:
            ovh_rows = overhead_rows(ranks, args.ovh_m)
        if gpt:
            for key in ("plain", "recompute", "offload"):
                gpt_rows[key] = [rk[f"gpt117m:{key}"] for rk in ranks]
        if args.skip_schedules:
            continue
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
    if rows:
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
    if rows:
        print(f"1F1B stage-0 peak <= (p/m + 0.1) x F-then-B's (m >= p): {'pass' if ok else 'FAIL'}")
    if gpt_rows:
        print(
            f"\nGPT-2 117M, seq {args.gpt_seq}, 2 stages 1F1B, {args.gpt_m} micro-batches of {args.gpt_mbs}, "
            f"{args.device} (memory per stage: executor accounting)"
        )
        print(
            f"{'':<10} {'stage0 MiB':>11} {'stage1 MiB':>11} {'host MiB':>9} {'tokens/s':>9} {'vs plain':>9}"
        )
        plain_tps = gpt_rows["plain"][0]["tokens_per_s"]
        for key, per_rank in gpt_rows.items():
            mib = [r["peak_bytes"] / 2**20 for r in per_rank]
            host = max(r["host_peak_bytes"] for r in per_rank) / 2**20
            tps = per_rank[0]["tokens_per_s"]
            print(
                f"{key:<10} {mib[0]:>11.0f} {mib[1]:>11.0f} {host:>9.0f} {tps:>9.1f} {tps / plain_tps:>9.2f}"
            )
    if ovh_rows:
        print_overhead(ovh_rows, args)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        report = {"machine": machine(torch.device(args.device)), "args": vars(args), "rows": rows}
        json.dump({**report, "gpt117m": gpt_rows, "overhead": ovh_rows}, f, indent=1)
    print(f"wrote {args.json} ({time.perf_counter() - t_start:.0f} s)")


if __name__ == "__main__":
    main()
