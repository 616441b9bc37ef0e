"""Recompute on the bert program: memory and step time, ours and torch's, one run, one table.

    python benchmarks/recompute.py [--device cpu|cuda] [--quick] [--amp-dtype bfloat16] [--json out.json]

Rows: no recompute / full recompute (one checkpoint per encoder layer) / selective
(same checkpoints, matmul outputs kept) / amp (fleet's AMP meta optimizer: bfloat16 on
CPU, float16 with dynamic loss scaling on CUDA, or --amp-dtype) / amp + recompute (the
same checkpoints, now held in the low dtype) / torch eager / torch eager with
torch.utils.checkpoint on each layer (the same placement) / torch eager under
torch.autocast (the same dtype). Columns: peak bytes
(ours: the executor's accounting of live bytes, activations = peak - persistables;
torch on CUDA: max_memory_allocated; torch on CPU has no allocator statistics: n/a),
ratio to none, step time (forward + backward + SGD), ratio to none, the largest batch
whose measured peak fits a budget (the no-recompute peak at the base batch; bisection
on measured peaks; a real OOM on GPU), sentences per second at the base batch, and our
predicted vs measured peak.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from common import RESULTS, machine, median_time
from torch.utils.checkpoint import checkpoint

import metaopt
import programs
from metaopt import fleet
from metaopt.passes.memory_estimate import estimate_memory
from metaopt.passes.recompute import recompute

CPU = {"config": "base", "num_layers": 12, "seq_len": 128, "batch": 8}
GPU = {"config": "large", "num_layers": 24, "seq_len": 512, "batch": 8}
QUICK = {"config": "tiny", "num_layers": 8, "seq_len": 16, "batch": 4}
CHECKPOINTS = ["bert.encoder.layer.*"]


def _programs(shape: dict, amp_dtype: str) -> dict[str, metaopt.Program]:
    bert = programs.get("bert")
    over = {"num_layers": shape["num_layers"], "seq_len": shape["seq_len"]}
    module = bert.build(shape["config"], seed=0, dropout=0.1, **over)
    forward = metaopt.export(module, bert.example_inputs(shape["config"], 2, **over), name="bert")
    base = forward.clone()
    metaopt.optimizer.SGD(learning_rate=1e-4).minimize(base.loss)
    return {
        "none": base,
        "full": recompute(base, checkpoints=CHECKPOINTS),
        "selective": recompute(base, checkpoints=CHECKPOINTS, policy="selective"),
        "amp": _amp(forward, amp_dtype, recompute=False),
        "amp + recompute": _amp(forward, amp_dtype, recompute=True),
    }


def _amp(forward: metaopt.Program, dtype: str, recompute: bool) -> metaopt.Program:
    """The user's path: fleet's AMP meta optimizer (and recompute) around SGD."""
    fleet.init(is_collective=True)
    main = forward.clone()
    strategy = fleet.DistributedStrategy()
    strategy.amp = True
    strategy.amp_configs = {"dtype": dtype}
    if recompute:
        strategy.recompute = True
        strategy.recompute_configs = {"checkpoints": CHECKPOINTS}
    fleet.distributed_optimizer(metaopt.optimizer.SGD(learning_rate=1e-4), strategy).minimize(main.loss)
    return main


def _feed(shape: dict, batch: int, device: torch.device) -> dict[str, torch.Tensor]:
    bert = programs.get("bert")
    over = {"num_layers": shape["num_layers"], "seq_len": shape["seq_len"]}
    inputs = bert.example_inputs(shape["config"], batch, seed=1, **over)
    return {k: v.to(device) for k, v in zip(bert.INPUT_NAMES, inputs, strict=True)}


def _ours(program: metaopt.Program, shape: dict, batch: int, device: torch.device, reps: int) -> dict:
    exe = metaopt.Executor(device)
    feed = _feed(shape, batch, device)
    ms = (
        median_time(
            lambda: exe.run(program, feed=feed, fetch_list=[program.loss], return_numpy=False), device, reps
        )
        * 1e3
    )
    stats = exe.memory_stats()
    est = estimate_memory(program, dims={"batch": batch})
    row = {
        "step_ms": ms,
        "peak_bytes": stats["peak_bytes"],
        "activation_bytes": stats["peak_bytes"] - stats["persistable_bytes"],
        "predicted_activation_bytes": est.activation_peak_bytes,
    }
    if device.type == "cuda":
        row["cuda_max_allocated"] = stats["cuda_max_allocated"]
    return row


def _measured_peak(program: metaopt.Program, shape: dict, batch: int, device: torch.device) -> int | None:
    exe = metaopt.Executor(device)
    try:
        exe.run(program, feed=_feed(shape, batch, device), fetch_list=[program.loss], return_numpy=False)
    except torch.OutOfMemoryError:
        return None
    stats = exe.memory_stats()
    return stats["cuda_max_allocated"] if device.type == "cuda" else stats["peak_bytes"]


def _max_batch(program, shape, device, budget: int, start: int) -> int:
    """Largest batch whose measured peak fits `budget` (doubling, then bisection)."""
    lo, hi = 0, start
    while (peak := _measured_peak(program, shape, hi, device)) is not None and peak <= budget:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        peak = _measured_peak(program, shape, mid, device)
        lo, hi = (mid, hi) if peak is not None and peak <= budget else (lo, mid)
    return lo


def _torch_rows(shape: dict, device: torch.device, reps: int, amp_dtype: str) -> dict[str, dict]:
    bert = programs.get("bert")
    over = {"num_layers": shape["num_layers"], "seq_len": shape["seq_len"]}
    rows = {}
    cases = (("torch eager", False, None), ("torch eager + checkpoint", True, None))
    cases += ((f"torch eager autocast {amp_dtype}", False, getattr(torch, amp_dtype)),)
    for name, per_layer, autocast in cases:
        module = bert.build(shape["config"], seed=0, dropout=0.1, **over).to(device)
        if per_layer:
            for layer in module.bert.encoder.layer:
                layer.forward = _checkpointed(layer.forward)
        opt = torch.optim.SGD(module.parameters(), lr=1e-4)
        inputs = list(_feed(shape, shape["batch"], device).values())
        # float16 on CUDA needs loss scaling (torch's GradScaler), as our amp row has
        scaler = torch.amp.GradScaler(device.type, enabled=autocast == torch.float16)

        def step(module=module, opt=opt, inputs=inputs, autocast=autocast, scaler=scaler):
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
                loss = module(*inputs)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        ms = median_time(step, device, reps) * 1e3
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        rows[name] = {"step_ms": ms, "peak_bytes": peak}
    return rows


def _checkpointed(forward):
    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--amp-dtype", choices=("float16", "bfloat16"), help="default: bf16 on CPU, fp16 on CUDA")
    ap.add_argument("--json", default=os.path.join(RESULTS, "recompute.json"))
    args = ap.parse_args()
    device = torch.device(args.device)
    shape = QUICK if args.quick else (GPU if device.type == "cuda" else CPU)
    reps = 1 if args.quick else args.reps
    amp_dtype = args.amp_dtype or ("float16" if device.type == "cuda" else "bfloat16")
    progs = _programs(shape, amp_dtype)
    rows = {name: _ours(p, shape, shape["batch"], device, reps) for name, p in progs.items()}
    budget = rows["none"]["cuda_max_allocated" if device.type == "cuda" else "peak_bytes"]
    for name, p in progs.items():
        rows[name]["max_batch"] = _max_batch(p, shape, device, budget, shape["batch"])
    rows.update(_torch_rows(shape, device, reps, amp_dtype))
    for r in rows.values():
        r["sents_per_s"] = shape["batch"] / (r["step_ms"] / 1e3)

    base = rows["none"]
    info = machine(device)
    print(
        f"recompute on bert ({shape}) on {device} ({info['device']}, {info['threads']} threads), "
        f"amp in {amp_dtype}; "
        f"budget for max batch: {budget / 2**20:.1f} MiB"
    )
    print(
        f"{'':30} {'peak MiB':>9} {'ratio':>6} {'act MiB':>8} {'ratio':>6} {'step ms':>9} {'ratio':>6} "
        f"{'sents/s':>8} {'max batch':>9} {'pred act MiB':>12}"
    )
    for name, r in rows.items():
        peak = r.get("peak_bytes")
        act = r.get("activation_bytes")
        cells = [
            f"{peak / 2**20:9.1f}" if peak else f"{'n/a':>9}",
            f"{peak / base['peak_bytes']:6.2f}" if peak else f"{'':>6}",
            f"{act / 2**20:8.2f}" if act else f"{'n/a':>8}",
            f"{act / base['activation_bytes']:6.2f}" if act else f"{'':>6}",
            f"{r['step_ms']:9.1f}",
            f"{r['step_ms'] / base['step_ms']:6.2f}",
            f"{r['sents_per_s']:8.1f}",
            f"{r['max_batch']:9d}" if "max_batch" in r else f"{'':>9}",
            f"{r['predicted_activation_bytes'] / 2**20:12.2f}" if "predicted_activation_bytes" in r else "",
        ]
        print(f"{name:30} " + " ".join(cells))
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(
            {
                "machine": info,
                "device": str(device),
                "shape": shape,
                "amp_dtype": amp_dtype,
                "budget": budget,
                "rows": rows,
            },
            f,
            indent=2,
        )
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
