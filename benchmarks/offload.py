"""Offload on the bert program: recompute-only vs recompute + offload, one run, one table.

    python benchmarks/offload.py [--device cpu|cuda] [--quick] [--layers 24] [--batch B] [--seq S]
                                 [--config tiny|base|large] [--steps N] [--budget-mb M]
                                 [--max-batch-by measured|predicted] [--json out.json]

Both programs come from Fleet's path: ``strategy.recompute = True`` with one checkpoint
per encoder layer (``bert.encoder.layer.*``), SGD, dropout 0.1; the second adds
``"enable_offload": True``. Rows (columns: recompute-only, + offload, ratio offload /
recompute):

* device peak = the executor's ``peak_bytes``; activation peak = peak - persistables;
  on CUDA also ``torch.cuda.max_memory_allocated`` of a run with only that program's
  executor alive; the activation peak ``estimate_memory`` predicts;
* host peak (``host_peak_bytes``), bytes offloaded / fetched per step;
* step time: median (and min) of N timed steps after warm-up, the two programs' steps
  interleaved so that load from other processes on a shared machine falls on both alike;
* the executor's per-run copy counters ``copy_seconds`` / ``copy_wait_seconds`` (median
  over the timed steps; "n/a" on an executor without them);
* max batch: the largest batch whose activation peak fits the budget (default: the
  recompute-only activation peak at --batch), found by doubling then bisection on
  measured peaks (the executor's accounting; on CUDA an out-of-memory also counts as
  not fitting) or, with ``--max-batch-by predicted``, on ``estimate_memory``'s.

Below the table: host<->device bandwidth (CUDA: pinned host->device and device->host
copies timed with CUDA events; CPU: the bandwidth of ``torch.clone``, which is what the
CPU Memcpy kernel does), of one --bandwidth-mb copy and of one step's copies (one per
offloaded checkpoint, its size); the predicted overhead floor = bytes moved per step /
bandwidth of either, against the executor's copy time and the measured step-time
difference; on CUDA the issue's targets as pass/fail lines.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
from common import RESULTS, machine, median_time, sync

import metaopt
import programs
from metaopt import fleet
from metaopt.passes.memory_estimate import estimate_memory

# CPU: BERT's 24 layers at tiny width, as tests/passes/test_offload.py measures it: at this
# width activations, not the gradients, set the peak, and a step is cheap enough for a
# measured max-batch search on 2 cores. GPU: BERT-Large at seq 512, as recompute.py.
CPU = {"config": "tiny", "num_layers": 24, "seq_len": 16, "batch": 64}
GPU = {"config": "large", "num_layers": 24, "seq_len": 512, "batch": 8}
QUICK = {"config": "tiny", "num_layers": 8, "seq_len": 16, "batch": 64}
CHECKPOINTS = ["bert.encoder.layer.*"]  # one per encoder layer
NAMES = ("recompute", "recompute+offload")
TARGET_STEP_RATIO = 1.05  # the GPU targets
TARGET_BATCH_RATIO = 1.5
MiB = 2**20


# --- programs and feeds ----------------------------------------------------------
def _programs(shape: dict) -> dict[str, metaopt.Program]:
    """The two training programs, rewritten by fleet.distributed_optimizer as a user would."""
    bert = programs.get("bert")
    over = {"num_layers": shape["num_layers"], "seq_len": shape["seq_len"]}
    module = bert.build(shape["config"], seed=0, dropout=0.1, **over)
    base = metaopt.export(module, bert.example_inputs(shape["config"], 2, **over), name="bert")
    fleet.init(is_collective=True)
    out = {}
    for name, enable_offload in zip(NAMES, (False, True)):
        main = base.clone()
        strategy = fleet.DistributedStrategy()
        strategy.recompute = True
        strategy.recompute_configs = {"checkpoints": CHECKPOINTS, "enable_offload": enable_offload}
        opt = fleet.distributed_optimizer(metaopt.optimizer.SGD(learning_rate=1e-4), strategy)
        opt.minimize(main.loss)
        out[name] = main
    return out


def _feed(shape: dict, batch: int, device: torch.device) -> dict[str, torch.Tensor]:
    bert = programs.get("bert")
    over = {"num_layers": shape["num_layers"], "seq_len": shape["seq_len"]}
    inputs = bert.example_inputs(shape["config"], batch, seed=1, **over)
    return {k: v.to(device) for k, v in zip(bert.INPUT_NAMES, inputs, strict=True)}


def _step(exe: metaopt.Executor, program: metaopt.Program, feed: dict) -> None:
    exe.run(program, feed=feed, fetch_list=[program.loss], return_numpy=False)


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --- memory at the base batch ------------------------------------------------------
def _memory(program: metaopt.Program, shape: dict, device: torch.device) -> dict:
    """Executor accounting of one step, with only this program's executor alive (so that
    cuda_max_allocated is this program's alone)."""
    batch = shape["batch"]
    exe = metaopt.Executor(device)
    feed = _feed(shape, batch, device)
    metaopt.seed(0)
    _step(exe, program, feed)  # builds the plan and materialises the params
    if device.type == "cuda":
        sync(device)
        exe.reset_memory_stats()
    _step(exe, program, feed)
    sync(device)
    stats = exe.memory_stats()
    row = {
        "peak_bytes": stats["peak_bytes"],
        "activation_bytes": stats["peak_bytes"] - stats["persistable_bytes"],
        "predicted_activation_bytes": estimate_memory(program, dims={"batch": batch}).activation_peak_bytes,
        "host_peak_bytes": stats.get("host_peak_bytes"),
        "pinned_buffer_bytes": stats.get("pinned_buffer_bytes"),
        "offloaded_bytes": stats.get("offloaded_bytes"),
        "fetched_bytes": stats.get("fetched_bytes"),
    }
    if device.type == "cuda":
        row["cuda_max_allocated"] = stats["cuda_max_allocated"]
    del exe, feed
    _release(device)
    return row


# --- step time ---------------------------------------------------------------------
def _timed(
    progs: dict[str, metaopt.Program], shape: dict, device: torch.device, steps: int, warmup: int
) -> tuple[dict[str, dict], dict[str, metaopt.Executor]]:
    """Median step time and copy counters per program, steps interleaved across programs."""
    feed = _feed(shape, shape["batch"], device)
    exes = {name: metaopt.Executor(device) for name in progs}
    for _ in range(warmup):
        for name, p in progs.items():
            _step(exes[name], p, feed)
    sync(device)
    times: dict[str, list[float]] = {name: [] for name in progs}
    copy: dict[str, list[float | None]] = {name: [] for name in progs}
    wait: dict[str, list[float | None]] = {name: [] for name in progs}
    for _ in range(steps):
        for name, p in progs.items():
            t0 = time.perf_counter()
            _step(exes[name], p, feed)
            sync(device)
            times[name].append(time.perf_counter() - t0)
            # Read after the clock stopped: on CUDA reading the copy events synchronises.
            stats = exes[name].memory_stats()
            copy[name].append(stats.get("copy_seconds"))
            wait[name].append(stats.get("copy_wait_seconds"))
    rows = {
        name: {
            "step_ms": statistics.median(times[name]) * 1e3,
            # The least disturbed step: on a shared machine, the closest to the uncontended time.
            "step_ms_min": min(times[name]) * 1e3,
            "step_ms_all": [t * 1e3 for t in times[name]],
            "copy_seconds": _median_or_none(copy[name]),
            "copy_wait_seconds": _median_or_none(wait[name]),
        }
        for name in progs
    }
    return rows, exes


def _median_or_none(xs: list[float | None]) -> float | None:
    got = [x for x in xs if x is not None]
    return statistics.median(got) if got and len(got) == len(xs) else None


# --- max batch under a budget ------------------------------------------------------
class _Prober:
    """Activation peak of one step at a given batch: measured on a kept executor (the plan is
    shape-generic, so one executor serves every batch), or predicted by estimate_memory."""

    def __init__(
        self, program: metaopt.Program, shape: dict, device: torch.device, exe: metaopt.Executor, how: str
    ) -> None:
        self.program, self.shape, self.device, self.exe, self.how = program, shape, device, exe, how

    def peak(self, batch: int) -> int | None:
        """None: the step does not run at this batch (out of memory)."""
        if self.how == "predicted":
            return estimate_memory(self.program, dims={"batch": batch}).activation_peak_bytes
        try:
            _step(self.exe, self.program, _feed(self.shape, batch, self.device))
        except torch.OutOfMemoryError:
            # A run cut short leaves the executor's accounting holding its live values: start afresh.
            self.exe = metaopt.Executor(self.device)
            _release(self.device)
            return None
        stats = self.exe.memory_stats()
        return stats["last_run_peak_bytes"] - stats["persistable_bytes"]


def _max_batch(fits: Callable[[int], bool], start: int, cap: int) -> int:
    """Largest batch b <= cap with fits(b) (doubling from `start`, then bisection)."""
    lo, hi = 0, start
    while hi <= cap and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, cap + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


# --- bandwidth ---------------------------------------------------------------------
def _bandwidth(device: torch.device, nbytes: int, count: int, reps: int = 10) -> dict:
    """Bytes per second of `count` host<->device copies of `nbytes` each, measured on this machine
    (median of `reps` rounds): many small copies pay a per-copy cost that one big copy hides."""
    n = max(1, nbytes // 4)
    if device.type != "cuda":
        x = torch.ones(n)

        def clones() -> None:
            # clone = allocate + copy, exactly what the CPU Memcpy kernel does per offloaded var;
            # the copies stay alive together, as offloaded checkpoints do until their prefetch.
            outs = [x.clone() for _ in range(count)]
            del outs

        bw = nbytes * count / median_time(clones, device, reps)
        return {"h2d": bw, "d2h": bw, "bytes": nbytes, "count": count, "method": "CPU memcpy (torch clone)"}
    host = torch.ones(n, pin_memory=True)  # touched, so page faults are not timed
    dev = torch.empty(n, device=device)

    def timed(dst: torch.Tensor, src: torch.Tensor) -> float:
        seconds = []
        for i in range(reps + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(count):
                dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            if i:  # the first round is a warm-up
                seconds.append(start.elapsed_time(end) / 1e3)
        return nbytes * count / statistics.median(seconds)

    return {
        "h2d": timed(dev, host),
        "d2h": timed(host, dev),
        "bytes": nbytes,
        "count": count,
        "method": "pinned host<->device copy, CUDA events",
    }


# --- the table ---------------------------------------------------------------------
def _mib(v: float | None) -> str:
    return "n/a" if v is None else f"{v / MiB:.2f}"


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v * 1e3:.2f}"


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or not a:
        return ""
    return f"{b / a:.2f}"


def _print_table(rows: dict[str, dict], device: torch.device, how: str, budget: int) -> None:
    rc, of = (rows[n] for n in NAMES)
    lines: list[tuple[str, str, Callable]] = [
        ("device peak MiB (executor peak_bytes)", "peak_bytes", _mib),
        ("activation peak MiB (peak - persistables)", "activation_bytes", _mib),
    ]
    if device.type == "cuda":
        lines.append(("cuda_max_allocated MiB", "cuda_max_allocated", _mib))
    lines += [
        ("predicted act. peak MiB (estimate_memory)", "predicted_activation_bytes", _mib),
        ("host peak MiB (host_peak_bytes)", "host_peak_bytes", _mib),
        ("pinned buffers MiB (pinned_buffer_bytes)", "pinned_buffer_bytes", _mib),
        ("offloaded MiB / step", "offloaded_bytes", _mib),
        ("fetched MiB / step", "fetched_bytes", _mib),
        ("step ms (median)", "step_ms", lambda v: f"{v:.1f}"),
        ("step ms (min)", "step_ms_min", lambda v: f"{v:.1f}"),
        ("copy ms / step (copy_seconds)", "copy_seconds", _ms),
        ("copy wait ms / step (copy_wait_seconds)", "copy_wait_seconds", _ms),
        (f"max batch ({how}, act. peak <= {budget / MiB:.2f} MiB)", "max_batch", str),
    ]
    width = max(len(label) for label, *_ in lines)
    print(f"{'':{width}} {'recompute':>12} {'+ offload':>12} {'ratio':>6}")
    for label, key, fmt in lines:
        a, b = rc.get(key), of.get(key)
        cells = [fmt(x) if x is not None else "n/a" for x in (a, b)]
        print(f"{label:{width}} {cells[0]:>12} {cells[1]:>12} {_ratio(a, b):>6}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="tiny, 8 layers: under a minute on a 2-core CPU")
    ap.add_argument("--config", choices=("tiny", "base", "large"), help="bert width (CPU: tiny, GPU: large)")
    ap.add_argument("--layers", type=int, help="encoder layers (default 24; 8 with --quick)")
    ap.add_argument("--batch", type=int, help="batch of the timed steps and the default budget")
    ap.add_argument("--seq", type=int, help="sequence length")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per program (median reported)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--budget-mb", type=float, help="activation budget for max batch (default: see doc)")
    ap.add_argument("--max-batch-by", choices=("measured", "predicted"), default="measured")
    ap.add_argument("--bandwidth-mb", type=int, default=256, help="size of the one big bandwidth copy")
    ap.add_argument("--json", default=os.path.join(RESULTS, "offload.json"))
    args = ap.parse_args()
    t_start = time.perf_counter()
    load_start = os.getloadavg()
    device = torch.device(args.device)
    shape = dict(QUICK if args.quick else (GPU if device.type == "cuda" else CPU))
    for key, value in (("config", args.config), ("num_layers", args.layers), ("batch", args.batch)):
        if value is not None:
            shape[key] = value
    if args.seq is not None:
        shape["seq_len"] = args.seq
    steps, warmup = (2, 1) if args.quick else (args.steps, args.warmup)
    bw_bytes = (64 if args.quick else args.bandwidth_mb) * MiB

    progs = _programs(shape)
    rows = {name: _memory(p, shape, device) for name, p in progs.items()}
    timed, exes = _timed(progs, shape, device, steps, warmup)
    for name in NAMES:
        rows[name].update(timed[name])
    budget = int(args.budget_mb * MiB) if args.budget_mb else rows["recompute"]["activation_bytes"]
    for name, p in progs.items():
        prober = _Prober(p, shape, device, exes[name], args.max_batch_by)

        def fits(b: int, prober: _Prober = prober) -> bool:
            peak = prober.peak(b)
            return peak is not None and peak <= budget

        # cap: a bound on the search, far beyond what offloading checkpoints can buy
        rows[name]["max_batch"] = _max_batch(fits, shape["batch"], cap=shape["batch"] * 64)
    del exes
    _release(device)
    rc, of = (rows[n] for n in NAMES)
    moved = (of["offloaded_bytes"] or 0, of["fetched_bytes"] or 0)
    n_ckpt = sum(op.role == "offload" for op in progs["recompute+offload"].ops)
    # Bandwidth of one big copy (the measure), and of the copies one step makes (n_ckpt of
    # one checkpoint's size each: small copies pay per-copy costs, and hit caches, a big one does not).
    bw = {"big": _bandwidth(device, bw_bytes, 1)}
    if n_ckpt and moved[0]:
        bw["checkpoint"] = _bandwidth(device, moved[0] // n_ckpt, n_ckpt)
    floor_s = {k: moved[0] / b["d2h"] + moved[1] / b["h2d"] for k, b in bw.items()}
    diff_s = (of["step_ms"] - rc["step_ms"]) / 1e3
    info = machine(device)
    print(
        f"offload on bert ({shape}) on {device} ({info['device']}, {info['threads']} threads), "
        f"{len(progs['recompute'].ops)} / {len(progs['recompute+offload'].ops)} ops, "
        f"{n_ckpt} checkpoints offloaded; steps {steps} after {warmup} warm-up; "
        f"load average at start {load_start[0]:.2f}"
    )
    _print_table(rows, device, args.max_batch_by, budget)
    for b in bw.values():
        print(
            f"bandwidth, {b['method']}, {b['count']} x {b['bytes'] / MiB:.3f} MiB: "
            f"host->device {b['h2d'] / 1e9:.2f} GB/s, device->host {b['d2h'] / 1e9:.2f} GB/s"
        )
    copy_s = of.get("copy_seconds")
    print(
        f"overhead floor = ({moved[0] / MiB:.2f} + {moved[1] / MiB:.2f} MiB moved) / bandwidth: "
        + ", ".join(f"{floor_s[k] * 1e3:.2f} ms at the {k} copies' bandwidth" for k in floor_s)
        + f"; executor's copy_seconds {_ms(copy_s)} ms; measured step difference {diff_s * 1e3:+.2f} ms "
        f"({diff_s / rc['step_ms'] * 1e5:+.1f}% of recompute-only)"
    )
    targets = {
        "step_ratio": of["step_ms"] / rc["step_ms"],
        "max_batch_ratio": of["max_batch"] / rc["max_batch"] if rc["max_batch"] else None,
    }
    if device.type == "cuda":
        ok_step = targets["step_ratio"] <= TARGET_STEP_RATIO
        ok_batch = targets["max_batch_ratio"] is not None and targets["max_batch_ratio"] >= TARGET_BATCH_RATIO
        print(
            f"target: offload step time <= {TARGET_STEP_RATIO}x recompute-only at equal batch: "
            f"{targets['step_ratio']:.3f}x {'PASS' if ok_step else 'FAIL'}"
        )
        print(
            f"target: max batch >= {TARGET_BATCH_RATIO}x recompute-only: "
            f"{rc['max_batch']} -> {of['max_batch']} {'PASS' if ok_batch else 'FAIL'}"
        )
    else:
        print("targets (step <= 1.05x, max batch >= 1.5x) are the issue's GPU targets: not judged on cpu")
    wall = time.perf_counter() - t_start
    load_end = os.getloadavg()
    print(f"total {wall:.0f} s; load average at end {load_end[0]:.2f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(
            {
                "machine": info,
                "device": str(device),
                "shape": shape,
                "steps": steps,
                "warmup": warmup,
                "budget": budget,
                "max_batch_by": args.max_batch_by,
                "rows": rows,
                "bandwidth": bw,
                "overhead_floor_s": floor_s,
                "step_difference_s": diff_s,
                "targets": targets,
                "wall_s": wall,
                "loadavg": [load_start, load_end],
            },
            f,
            indent=2,
        )
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
