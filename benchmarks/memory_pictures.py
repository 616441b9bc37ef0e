"""Memory pictures of one BERT training step: no recompute / recompute / recompute + offload /
recompute with the grads freed early (optimizer_in_backward).

    python benchmarks/memory_pictures.py [--device cpu|cuda] [--quick] [--config base] [--layers 12]
                                         [--seq 128] [--batch 8] [--out benchmarks/results]

Each program goes through the user's path (fleet.distributed_optimizer around Adam, one
checkpoint per encoder layer, "enable_offload" for the third; the LM-head fusion is on, as by
default), dropout 0.1. For each, `metaopt.memory_picture` runs one step and writes
``memory_bert_<strategy>.png`` (committed, shown in benchmarks/README.md), ``.html`` (the
same chart as SVG with a tooltip per op) and ``.txt`` (the peak and what is alive there),
and the script prints one table: measured and predicted peak, the peak op, the activation
peak and the largest storage there. `--quick`: tiny width, 4 layers, seq 16 (seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import warnings

import torch
from common import RESULTS, machine

import metaopt
import programs
from metaopt import fleet

# "early": recompute + optimizer_in_backward (each grad freed once its update has run)
STRATEGIES = ("none", "recompute", "offload", "early")
CHECKPOINTS = ["bert.encoder.layer.*"]


def build(strategy: str, config: str, layers: int, seq: int) -> metaopt.Program:
    bert = programs.get("bert")
    over = {"num_layers": layers, "seq_len": seq}
    module = bert.build(config, seed=0, dropout=0.1, **over)
    main = metaopt.export(module, bert.example_inputs(config, 2, **over), name=f"bert_{strategy}")
    fleet.init(is_collective=True)
    s = fleet.DistributedStrategy()
    if strategy != "none":
        s.recompute = True
        s.recompute_configs = {"checkpoints": CHECKPOINTS, "enable_offload": strategy == "offload"}
    s.optimizer_in_backward = strategy == "early"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        fleet.distributed_optimizer(metaopt.optimizer.Adam(learning_rate=1e-4), s).minimize(main.loss)
    return main


def feed(config: str, layers: int, seq: int, batch: int) -> dict[str, torch.Tensor]:
    bert = programs.get("bert")
    inputs = bert.example_inputs(config, batch, seed=1, num_layers=layers, seq_len=seq)
    return dict(zip(bert.INPUT_NAMES, inputs, strict=True))


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--config", default="base")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args()
    if args.quick:
        args.config, args.layers, args.seq, args.batch = "tiny", 4, 16, 4
    rows = []
    for strategy in STRATEGIES:
        program = build(strategy, args.config, args.layers, args.seq)
        pic = metaopt.memory_picture(
            program, feed(args.config, args.layers, args.seq, args.batch), device=args.device
        )
        files = pic.write(args.out, stem=f"memory_bert_{strategy}")
        op, peak = pic.peak
        top = pic.where.vars[0]
        rows.append({
            "strategy": strategy,
            "ops": len(program.ops),
            "measured_peak_bytes": pic.measured_peak_bytes,
            "predicted_peak_bytes": pic.predicted_peak[1],
            "peak_op": op,
            "peak_op_type": pic.labels[op].split(" = ", 1)[-1].split("(", 1)[0],
            "peak_op_role": pic.roles[op],
            "persistable_bytes": pic.persistable_bytes,
            "activation_peak_bytes": peak - pic.persistable_bytes,
            "largest_at_peak": f"{top.name} ({top.role}, {_mib(top.nbytes)} MiB)",
            "png_bytes": os.path.getsize(files[0]),
            "files": [os.path.basename(f) for f in files],
        })  # fmt: skip
        print(f"# {strategy}: wrote {', '.join(files)}", flush=True)
    shape = f"{args.config}, {args.layers} layers, seq {args.seq}, batch {args.batch}, Adam, {args.device}"
    print(f"\nbert ({shape}):\n")
    print("| | ops | measured peak MiB | predicted peak MiB | activations MiB | peak op | largest there |")
    print("|---|---:|---:|---:|---:|---|---|")
    for r in rows:
        measured = _mib(r["measured_peak_bytes"]) if r["measured_peak_bytes"] is not None else "n/a"
        where = f"{r['peak_op']} {r['peak_op_type']} ({r['peak_op_role']})"
        print(
            f"| {r['strategy']} | {r['ops']} | {measured} | {_mib(r['predicted_peak_bytes'])} "
            f"| {_mib(r['activation_peak_bytes'])} | {where} | {r['largest_at_peak']} |"
        )
    path = os.path.join(args.out, "memory_pictures.json")
    with open(path, "w") as f:
        json.dump({"machine": machine(torch.device(args.device)), "shape": shape, "rows": rows}, f, indent=1)
    print(f"\n# wrote {path}")


if __name__ == "__main__":
    main()
