"""Recompute for hybrid parallel: Paddle's table, five rows, on a GPT-2 shaped program.

    python benchmarks/hybrid.py [--quick] [--mp 2] [--pp 2] [--predict] [--json PATH]

Paddle's "recompute for hybrid parallel" table (GPT-117M, MP=4, PP=2) compares, per card:
w/o recompute, recompute, recompute + offload, recompute + MP partition, recompute + offload +
MP partition. This script builds the same five strategies with fleet (tensor parallel with
``tensor_parallel_configs={"column": "auto"}``, a 1F1B pipeline cut into equal halves, AdamW,
dropout 0.1, one checkpoint per block: ``transformer.h.*``) and, for each row:

* measured (default; CPU, gloo, ``metaoptrun`` with mp x pp workers, a reduced-width GPT-2 from
  programs/gpt.py): every worker trains ``--steps`` steps; the table shows the executor's
  accounting of worker 0 (stage 0, MP rank 0: under 1F1B the first stage holds the most
  micro-batches in flight) — peak live bytes, the part that is not params / optimizer state,
  bytes on the host — and tokens/s of the step (the slowest worker's median), with ratios to the
  first row;
* predicted (``--predict``; GPT-117M: 12 layers, width 768, 12 heads, seq 1024, vocab 50257, at
  MP=4, PP=2 unless told otherwise): every worker only minimizes (nothing runs) and asks
  `estimate_memory` for its stage program's peak with one micro-batch, plus what one more
  micro-batch in flight holds (the live bytes at the end of its forward) for each extra one
  1F1B keeps at that stage (pp - stage). The workers load one ONNX export (made once here).

Memory is the executor's own accounting on CPU; on a GPU (``--device cuda``) the JSON also gets
``torch.cuda.max_memory_allocated``. The partition rows hold each replicated checkpoint as this
MP rank's 1/mp slice and all-gather it before its recompute (``recompute_configs
["enable_partition"]``); with offload only the slice goes to the host.
"""

from __future__ import annotations

import argparse
import gc
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
from metaopt.frontend.onnx_save import save  # noqa: E402

MiB = 2**20
ROWS = {
    "w/o recompute": {},
    "recompute": {"recompute": True},
    "recompute + offload": {"recompute": True, "offload": True},
    "recompute + MP partition": {"recompute": True, "partition": True},
    "recompute + offload + MP partition": {"recompute": True, "offload": True, "partition": True},
}
PREDICT = {"num_layers": 12, "hidden_size": 768, "num_heads": 12, "seq_len": 1024, "vocab_size": 50257}


def model_cfg(args: argparse.Namespace) -> dict:
    if args.predict and not args.quick:
        return dict(PREDICT, max_position=PREDICT["seq_len"])
    return {
        "num_layers": args.layers,
        "hidden_size": args.hidden,
        "num_heads": args.heads,
        "seq_len": args.seq,
        "max_position": args.seq,
        "vocab_size": args.vocab,
    }


def strategy(args: argparse.Namespace, mode: dict) -> fleet.DistributedStrategy:
    s = fleet.DistributedStrategy()
    s.hybrid_configs = {"dp_degree": 1, "mp_degree": args.mp, "pp_degree": args.pp}
    s.tensor_parallel = True
    s.tensor_parallel_configs = {"column": "auto"}
    if args.pp > 1:
        layers = model_cfg(args)["num_layers"]
        per = layers // args.pp
        s.pipeline = True
        s.pipeline_configs = {
            "cuts": [f"transformer.h.{k * per}" for k in range(1, args.pp)],
            "accumulate_steps": args.micro,
            "schedule_mode": "1F1B",
        }
    if mode.get("recompute"):
        s.recompute = True
        s.recompute_configs = {
            "checkpoints": ["transformer.h.*"],
            "enable_offload": bool(mode.get("offload")),
            "enable_partition": bool(mode.get("partition")),
        }
    return s


def _feed(args: argparse.Namespace, step: int) -> dict[str, torch.Tensor]:
    gpt = programs.get("gpt")
    cfg = model_cfg(args)
    inputs = gpt.example_inputs("tiny", args.micro * args.mbs, seed=100 + step, **cfg)
    return dict(zip(gpt.INPUT_NAMES, inputs, strict=True))


def _held_per_micro_batch(p: metaopt.Program, e) -> int:
    """Live bytes (not persistable) right after the last forward op: what one more micro-batch in
    flight holds until its backward."""
    last_fwd = max((i for i, op in enumerate(p.ops) if op.role == "forward"), default=-1)
    return max(0, e.timeline[last_fwd] - e.persistable_bytes) if last_fwd >= 0 else 0


def run_row(args: argparse.Namespace, base: metaopt.Program, mode: dict) -> dict:
    """This worker's figures for one row (every worker of the job calls it, rows in order)."""
    from metaopt.passes.memory_estimate import estimate_memory

    p = base.clone()
    loss_name = p.loss.name  # only the last stage has it: fetch by name
    opt = fleet.distributed_optimizer(metaopt.optimizer.AdamW(learning_rate=1e-4), strategy(args, mode))
    opt.minimize(p.loss)
    stage = p.pipeline.stage if p.pipeline is not None else 0
    if args.predict:
        e = estimate_memory(p, dims={"batch": args.mbs})
        in_flight = args.pp - stage  # 1F1B: the first stage keeps pp micro-batches' activations
        held = _held_per_micro_batch(p, e)
        return {
            "stage": stage,
            "peak_bytes": e.peak_bytes + (in_flight - 1) * held,
            "persistable_bytes": e.persistable_bytes,
            "one_micro_batch_peak": e.peak_bytes,
            "held_per_micro_batch": held,
            "in_flight": in_flight,
        }
    exe = metaopt.Executor(args.device)
    times = []
    for step in range(args.steps + 1):
        feed = _feed(args, step)
        fleet.barrier_worker()
        t0 = time.perf_counter()
        exe.run(p, feed=feed, fetch_list=[loss_name])
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        if step:  # the first run plans and compiles
            times.append(time.perf_counter() - t0)
    stats = exe.memory_stats()
    return {
        "stage": stage,
        "peak_bytes": stats["peak_bytes"],
        "persistable_bytes": stats["persistable_bytes"],
        "host_peak_bytes": stats.get("host_peak_bytes", 0),
        "cuda_max_allocated": stats.get("cuda_max_allocated"),
        "step_s": statistics.median(times),
    }


def worker(args: argparse.Namespace) -> None:
    init = fleet.DistributedStrategy()
    init.hybrid_configs = {"dp_degree": 1, "mp_degree": args.mp, "pp_degree": args.pp}
    fleet.init(is_collective=True, strategy=init)
    metaopt.seed(0)
    base = metaopt.load(args.program)
    if args.predict:  # nothing runs: hold the params as stride-0 views (8 workers x GPT-117M fit)
        params = {v.name for v in base.params()}
        for k in params & set(base.values):
            t = base.values[k]
            base.values[k] = torch.zeros((), dtype=t.dtype).expand(t.shape)
        gc.collect()
    out = {name: run_row(args, base, mode) for name, mode in ROWS.items()}
    with open(os.path.join(args.out, f"rank{fleet.worker_index()}.json"), "w") as f:
        json.dump(out, f)
    fleet.barrier_worker()


def export(args: argparse.Namespace, path: str) -> None:
    gpt = programs.get("gpt")
    cfg = model_cfg(args)
    model = gpt.build("tiny", seed=0, dropout=0.1, **cfg)
    save(metaopt.export(model, gpt.example_inputs("tiny", 2, seed=1, **cfg), name="gpt"), path)


def launch(args: argparse.Namespace, out: str, program: str) -> None:
    world = args.mp * args.pp
    cmd = [
        sys.executable,
        "-m",
        "metaopt.launch",
        f"--nproc_per_node={world}",
        f"--log_dir={os.path.join(out, 'log')}",
        os.path.abspath(__file__),
        "--worker",
        f"--out={out}",
        f"--program={program}",
        *_passed(args),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
        env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"metaoptrun --nproc_per_node={world} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def _passed(args: argparse.Namespace) -> list[str]:
    keys = ("mp", "pp", "layers", "hidden", "heads", "seq", "vocab", "micro", "mbs", "steps", "device")
    flags = [f for f in ("predict", "quick") if getattr(args, f)]
    return [f"--{k}={getattr(args, k)}" for k in keys] + [f"--{f}" for f in flags]


def table(args: argparse.Namespace, ranks: list[dict]) -> list[dict]:
    rows = []
    first = None
    for name in ROWS:
        r0 = ranks[0][name]
        row = {
            "row": name,
            "rank0_stage": r0["stage"],
            "rank0_peak_mib": r0["peak_bytes"] / MiB,
            "rank0_activations_mib": (r0["peak_bytes"] - r0["persistable_bytes"]) / MiB,
            "max_peak_mib": max(r[name]["peak_bytes"] for r in ranks) / MiB,
        }
        if args.predict:
            row["held_per_micro_batch_mib"] = r0["held_per_micro_batch"] / MiB
        else:
            step = max(r[name]["step_s"] for r in ranks)
            tokens = args.micro * args.mbs * model_cfg(args)["seq_len"]
            row["rank0_host_mib"] = r0["host_peak_bytes"] / MiB
            row["tokens_per_s"] = tokens / step
        first = first or row
        row["peak_vs_first"] = row["rank0_peak_mib"] / first["rank0_peak_mib"]
        if not args.predict:
            row["tokens_vs_first"] = row["tokens_per_s"] / first["tokens_per_s"]
        rows.append(row)
    return rows


def show(args: argparse.Namespace, rows: list[dict]) -> None:
    cfg = model_cfg(args)
    what = "predicted (estimate_memory)" if args.predict else f"measured on {args.device}"
    print(
        f"\nGPT-2 shape: {cfg['num_layers']} layers, width {cfg['hidden_size']}, {cfg['num_heads']} heads, "
        f"seq {cfg['seq_len']}, vocab {cfg['vocab_size']}; MP={args.mp} PP={args.pp}, "
        + (
            f"1F1B, {args.micro} micro-batches of {args.mbs}"
            if args.pp > 1
            else f"batch {args.micro * args.mbs}"
        )
        + f"; {what}; worker 0 = stage 0, MP rank 0"
    )
    if args.predict:
        print(
            "| row | peak MiB | activations MiB | x first | held / extra micro-batch MiB | max over workers |"
        )
        print("|---|---:|---:|---:|---:|---:|")
        for r in rows:
            print(
                f"| {r['row']} | {r['rank0_peak_mib']:.0f} | {r['rank0_activations_mib']:.0f} | "
                f"{r['peak_vs_first']:.2f} | {r['held_per_micro_batch_mib']:.0f} | {r['max_peak_mib']:.0f} |"
            )
        return
    print("| row | peak MiB | activations MiB | host MiB | x first | tokens/s | x first |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['row']} | {r['rank0_peak_mib']:.1f} | {r['rank0_activations_mib']:.1f} | "
            f"{r['rank0_host_mib']:.1f} | {r['peak_vs_first']:.2f} | {r['tokens_per_s']:.0f} | "
            f"{r['tokens_vs_first']:.2f} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a tiny shape, 1 step: checks the script runs")
    ap.add_argument("--predict", action="store_true", help="GPT-117M rows by estimate_memory (nothing runs)")
    ap.add_argument("--mp", type=int, default=None, help="default 2 measured, 4 predicted")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--micro", type=int, default=4, help="micro-batches per step")
    ap.add_argument("--mbs", type=int, default=2, help="sequences per micro-batch")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--program", help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.mp is None:
        args.mp = 4 if args.predict else 2
    if args.quick:
        args.layers, args.hidden, args.heads, args.seq, args.vocab, args.steps = 2, 64, 4, 16, 128, 1
    if args.worker:
        worker(args)
        return
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        program = os.path.join(out, "gpt.onnx")
        export(args, program)
        print(f"exported in {time.perf_counter() - t0:.0f} s; {args.mp * args.pp} workers ...", flush=True)
        launch(args, out, program)
        ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(args.mp * args.pp)]
    rows = table(args, ranks)
    show(args, rows)
    suffix = ("_predict" if args.predict else "") + ("_quick" if args.quick else "")
    path = args.json or os.path.join(RESULTS, f"hybrid{suffix}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(
            {"machine": machine(torch.device(args.device)), "args": vars(args), "rows": rows, "ranks": ranks},
            f,
        )
    print(f"wrote {path} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
