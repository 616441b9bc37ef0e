"""The founding Fleet table, predicted: the largest BERT-Large batch that fits a device.

    python benchmarks/paddle_table.py [--budget-gib 32] [--seq 512] [--layers 24] [--json PATH]

Paddle's recompute document (BERT-Large, seq 512, AMP, a 32 GB V100): no recompute fits 18
sequences, recompute 180 (10x), recompute + offload 258 (1.43x more). This builds the same
model (programs/bert.py "large": 24 layers, width 1024, 16 heads, vocab 30522), minimizes it
with fleet (float16 AMP with dynamic loss scaling, Adam, a checkpoint per encoder layer, Fleet's
defaults otherwise) and asks `estimate_memory` for the largest batch whose predicted device
peak fits the budget (bisection over the batch; the estimate counts params, Adam state, the
float16 copies AMP makes, activations, and the chunked kernels' workspace; host copies of
offloaded checkpoints are not device bytes). The estimate equals the executor's own
accounting on the reference programs (tests/passes/test_recompute.py); nothing is run here.

Rows: none / recompute / recompute + offload, each
  * as Fleet had it: the LM head and its loss unfused (``fuse_linear_cross_entropy=False``),
  * with metaopt's defaults (the fused, chunked LM head + cross-entropy: issue 15 item 1),
  * and with the grads freed early too (``optimizer_in_backward``, item 2). That needs every
    update free to run before the last grad is made, which float16's dynamic loss scaling
    forbids (its overflow check reads every grad first), so this column is bfloat16 AMP (no
    loss scaling, as on A100/H100).
Each row names its peak op and the largest activations / grads alive there (`.where`).
On a GPU (--measure) it also runs each row's batch once and records
``torch.cuda.max_memory_allocated`` and the executor's peak beside the prediction (in the JSON
and the log; unrun so far: no GPU was lent). Run it with a budget the device has room for
(params, Adam state and the allocator's fragmentation are on top of the prediction).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import metaopt  # noqa: E402
import programs  # noqa: E402
from metaopt import fleet  # noqa: E402
from metaopt.passes.memory_estimate import estimate_memory  # noqa: E402

GiB = 2**30
PADDLE = {"none": 18, "recompute": 180, "recompute+offload": 258}
MODES = {
    "none": {},
    "recompute": {"recompute": True},
    "recompute+offload": {"recompute": True, "offload": True},
}
VARIANTS = {  # column -> (amp dtype, fuse_linear_cross_entropy, optimizer_in_backward)
    "fleet (unfused head)": ("float16", False, False),
    "metaopt defaults": ("float16", True, False),
    "+ grads freed early (bf16)": ("bfloat16", True, True),
}


def export(seq: int, layers: int) -> metaopt.Program:
    mod = programs.get("bert")
    over = {"seq_len": seq, "num_layers": layers, "dropout": 0.1}
    model = mod.build("large", seed=0, **over)
    return metaopt.export(model, mod.example_inputs("large", 2, seed=1, **over), name="bert_large")


def train_program(base: metaopt.Program, mode: dict, variant: tuple) -> metaopt.Program:
    dtype, fuse, early = variant
    main = base.clone()
    s = fleet.DistributedStrategy()
    s.amp = True
    s.amp_configs = {"dtype": dtype}
    s.fuse_linear_cross_entropy = fuse
    s.optimizer_in_backward = early
    if mode.get("recompute"):
        s.recompute = True
        s.recompute_configs = {
            "checkpoints": programs.get("bert").DEFAULT_CHECKPOINTS,
            "enable_offload": bool(mode.get("offload")),
        }
    fleet.distributed_optimizer(metaopt.optimizer.Adam(learning_rate=1e-4), s).minimize(main.loss)
    return main


def largest_batch(p: metaopt.Program, budget: int, cap: int = 1 << 14) -> tuple[int, object]:
    """The largest batch whose predicted peak fits `budget` (0 if none), and its estimate."""

    def est(b: int):
        return estimate_memory(p, dims={"batch": b})

    lo, hi = 0, 1
    while hi <= cap and est(hi).peak_bytes <= budget:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if est(mid).peak_bytes <= budget else (lo, mid)
    return lo, est(max(lo, 1))


def _peak_op(p: metaopt.Program, e) -> str:
    if e.peak_op < 0:
        return "(before the first op)"
    op = p.ops[e.peak_op]
    return f"op {e.peak_op} {op.type} ({op.role}, {op.scope or op.origin or '-'})"


def _where(e, n: int = 3) -> str:
    """The largest storages alive at the peak that are not params or optimizer state."""
    live = [v for v in e.where.vars if v.kind not in ("param", "opt_state")] if e.where else []
    return ", ".join(f"{v.name} ({v.role}, {v.nbytes / GiB:.2f} GiB)" for v in live[:n])


def measure(p: metaopt.Program, batch: int, seq: int, layers: int) -> dict:
    """One step of `p` at `batch` on CUDA: torch's peak beside the executor's (GPU only)."""
    mod = programs.get("bert")
    inputs = mod.example_inputs("large", batch, seed=2, seq_len=seq, num_layers=layers)
    exe = metaopt.Executor("cuda")
    torch.cuda.reset_peak_memory_stats()
    try:
        exe.run(p, feed=dict(zip(mod.INPUT_NAMES, inputs, strict=True)), fetch_list=[p.loss])
    except torch.cuda.OutOfMemoryError as e:
        return {"error": f"out of memory: {str(e).splitlines()[0]}"}
    stats = exe.memory_stats()
    return {
        "cuda_max_allocated_gib": stats["cuda_max_allocated"] / GiB,
        "executor_peak_gib": stats["peak_bytes"] / GiB,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-gib", type=float, default=32.0)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--measure", action="store_true", help="also run each row's batch once on CUDA")
    ap.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results", "paddle_table.json"))
    args = ap.parse_args()
    budget = int(args.budget_gib * GiB)
    if args.measure and not torch.cuda.is_available():
        raise SystemExit("--measure runs the rows on a GPU; none is visible here")
    fleet.init()
    t0 = time.perf_counter()
    base = export(args.seq, args.layers)
    print(f"exported BERT-Large ({args.layers} layers, seq {args.seq}) in {time.perf_counter() - t0:.0f} s")
    rows = []
    for variant_name, variant in VARIANTS.items():
        for mode_name, mode in MODES.items():
            p = train_program(base, mode, variant)
            batch, e = largest_batch(p, budget)
            rows.append(
                {
                    "variant": variant_name,
                    "mode": mode_name,
                    "max_batch": batch,
                    "peak_gib": e.peak_bytes / GiB,
                    "persistable_gib": e.persistable_bytes / GiB,
                    "peak_op": _peak_op(p, e),
                    "where": _where(e),
                }
            )
            print(f"  {variant_name:28s} {mode_name:18s} batch {batch:5d}  {_peak_op(p, e)}", flush=True)
            print(f"    alive there: {_where(e)}", flush=True)
            if args.measure:
                rows[-1]["measured"] = measure(p, batch, args.seq, args.layers)
                print(f"    measured: {rows[-1]['measured']}", flush=True)
    _print(rows, args)
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(
            {"budget_gib": args.budget_gib, "seq": args.seq, "layers": args.layers, "rows": rows}, f, indent=1
        )


def _print(rows: list[dict], args) -> None:
    print(f"\nLargest batch predicted to fit {args.budget_gib:g} GiB (BERT-Large, seq {args.seq}, AMP, Adam)")
    head = f"| {'':28s} | {'mode':18s} | batch | x none | x prev | Paddle | Paddle x | peak op |"
    print(head)
    print("|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|")
    by = {(r["variant"], r["mode"]): r for r in rows}
    for r in rows:
        none = by[(r["variant"], "none")]["max_batch"]
        order = list(MODES)
        prev = by[(r["variant"], order[max(0, order.index(r["mode"]) - 1)])]["max_batch"]
        paddle = PADDLE[r["mode"]]
        pprev = PADDLE[order[max(0, order.index(r["mode"]) - 1)]]
        b = r["max_batch"]
        print(
            f"| {r['variant']:28s} | {r['mode']:18s} | {b:5d} | {b / max(none, 1):6.2f} "
            f"| {b / max(prev, 1):6.2f} | {paddle:6d} | {paddle / pprev:8.2f} | {r['peak_op']} |"
        )


if __name__ == "__main__":
    main()
