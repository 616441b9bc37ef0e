"""Forward time of metaopt's executor vs the torch module in eager mode, same inputs.

    python benchmarks/executor_overhead.py [--device cpu|cuda] [--quick] [--json out.json]

One run, one table: per reference program, eager ms, ours ms, ratio (ours / eager)
with and without the executor's memory accounting; then the per-op dispatch
overhead in µs (a chain of tiny ops, minus calling the same torch kernels directly).
Both sides run the forward only (torch under no_grad: our forward builds no graph
either) in train mode with dropout 0. Timing: median of N runs after warm-up.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from common import RESULTS, cases, machine, median_time

import metaopt
import programs
from metaopt.ir import Op, Program, Var


def _case(name: str, config: str, batch: int, overrides: dict, device: torch.device, reps: int) -> dict:
    mod = programs.get(name)
    try:
        overrides = {k: v for k, v in overrides.items() if k in mod.Config.__dataclass_fields__}
    except AttributeError:
        pass
    module = mod.build(config, seed=0, dropout=0.0, **overrides)
    inputs = mod.example_inputs(config, batch, seed=1, **overrides)
    program = metaopt.export(module, mod.example_inputs(config, 2, seed=1, **overrides), name=name)
    module = module.to(device)
    dev_inputs = [x.to(device) for x in inputs]
    feed = dict(zip(mod.INPUT_NAMES, dev_inputs, strict=True))

    def eager():
        with torch.no_grad():
            module(*dev_inputs)

    row = {"program": name, "config": config, "batch": batch, **overrides, "ops": len(program.ops)}
    row["eager_ms"] = median_time(eager, device, reps) * 1e3
    for track in (True, False):
        exe = metaopt.Executor(device, track_memory=track)
        ms = (
            median_time(
                lambda exe=exe: exe.run(program, feed=feed, fetch_list=[program.loss], return_numpy=False),
                device,
                reps,
            )
            * 1e3
        )
        key = "ours_ms" if track else "ours_untracked_ms"
        row[key] = ms
    row["ratio"] = row["ours_ms"] / row["eager_ms"]
    row["ratio_untracked"] = row["ours_untracked_ms"] / row["eager_ms"]
    return row


def _dispatch_overhead(device: torch.device, n: int = 2000) -> dict:
    p = Program("chain")
    p.add_var(Var("x", "float32", (1,), kind="input"))
    prev = "x"
    for i in range(n):
        p.add_var(Var(f"h{i}", "float32", (1,)))
        p.ops.append(Op("Relu", [prev], [f"h{i}"]))
        prev = f"h{i}"
    p.inputs, p.outputs = ["x"], [prev]
    x = torch.ones(1, device=device)

    def direct():
        h = x
        for _ in range(n):
            h = torch.relu(h)
        return h

    base = median_time(direct, device, 20)
    out = {"direct_us_per_op": base / n * 1e6}
    for track in (True, False):
        exe = metaopt.Executor(device, track_memory=track)
        t = median_time(
            lambda exe=exe: exe.run(p, feed={"x": x}, fetch_list=[prev], return_numpy=False), device, 20
        )
        out["overhead_us_per_op" + ("" if track else "_untracked")] = (t - base) / n * 1e6
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="tiny configs, few reps (smoke test)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", default=os.path.join(RESULTS, "executor_overhead.json"))
    args = ap.parse_args()
    device = torch.device(args.device)
    rows = [_case(*c, device=device, reps=2 if args.quick else args.reps) for c in cases(device, args.quick)]
    over = _dispatch_overhead(device)
    info = machine(device)
    print(f"executor overhead on {device} ({info['device']}, {info['threads']} threads)")
    print(
        f"{'program':8} {'config':9} {'batch':>5} {'ops':>5} {'eager ms':>9} {'ours ms':>9} {'ratio':>6} "
        f"{'untracked':>9} {'ratio':>6}"
    )
    for r in rows:
        print(
            f"{r['program']:8} {r['config']:9} {r['batch']:5d} {r['ops']:5d} {r['eager_ms']:9.2f} "
            f"{r['ours_ms']:9.2f} {r['ratio']:6.3f} {r['ours_untracked_ms']:9.2f} {r['ratio_untracked']:6.3f}"
        )
    print(
        f"per-op dispatch: torch direct {over['direct_us_per_op']:.2f} µs/op; executor overhead "
        f"+{over['overhead_us_per_op']:.2f} µs/op (memory accounting on), "
        f"+{over['overhead_us_per_op_untracked']:.2f} µs/op (off)"
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"machine": info, "device": str(device), "rows": rows, "dispatch": over}, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
