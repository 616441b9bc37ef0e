"""One training step (forward + backward + Adam) of our executor vs the torch module with torch.optim.

    python benchmarks/train_step.py [--device cpu|cuda] [--quick] [--json out.json]

Same model, same batch, train mode with dropout 0 (so both sides do the same work),
torch.optim.Adam (single-tensor, as on CPU by default; foreach on CUDA) against our
AdamUpdate ops. One run, one table: ms per step and the ratio ours / eager, plus our
executor's peak live bytes per step. Median of N steps after warm-up.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from common import RESULTS, cases, machine, median_time

import metaopt
import programs


def _case(name: str, config: str, batch: int, overrides: dict, device: torch.device, reps: int) -> dict:
    mod = programs.get(name)
    overrides = {k: v for k, v in overrides.items() if k in mod.Config.__dataclass_fields__}
    inputs = [x.to(device) for x in mod.example_inputs(config, batch, seed=1, **overrides)]

    module = mod.build(config, seed=0, dropout=0.0, **overrides).to(device)
    opt = torch.optim.Adam(module.parameters(), lr=1e-4)

    def eager_step():
        opt.zero_grad(set_to_none=True)
        module(*inputs).backward()
        opt.step()

    main = metaopt.export(
        mod.build(config, seed=0, dropout=0.0, **overrides),
        mod.example_inputs(config, 2, seed=1, **overrides),
        name=name,
    )
    metaopt.optimizer.Adam(learning_rate=1e-4).minimize(main.loss)
    exe = metaopt.Executor(device)
    feed = dict(zip(mod.INPUT_NAMES, inputs, strict=True))

    def our_step():
        exe.run(main, feed=feed, fetch_list=[main.loss], return_numpy=False)

    row = {"program": name, "config": config, "batch": batch, **overrides, "ops": len(main.ops)}
    cuda = device.type == "cuda"
    if cuda:  # the process-wide peak: reset per side, and the eager side's state freed before ours
        torch.cuda.reset_peak_memory_stats(device)
    row["eager_ms"] = median_time(eager_step, device, reps) * 1e3
    if cuda:
        row["eager_cuda_max_allocated"] = torch.cuda.max_memory_allocated(device)
        del eager_step, module, opt
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    row["ours_ms"] = median_time(our_step, device, reps) * 1e3
    row["ratio"] = row["ours_ms"] / row["eager_ms"]
    stats = exe.memory_stats()
    row["peak_bytes"] = stats["peak_bytes"]
    row["persistable_bytes"] = stats["persistable_bytes"]
    if cuda:
        row["cuda_max_allocated"] = stats["cuda_max_allocated"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="tiny configs, few reps (smoke test)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=os.path.join(RESULTS, "train_step.json"))
    args = ap.parse_args()
    device = torch.device(args.device)
    rows = [_case(*c, device=device, reps=2 if args.quick else args.reps) for c in cases(device, args.quick)]
    info = machine(device)
    print(f"training step (fwd + bwd + Adam) on {device} ({info['device']}, {info['threads']} threads)")
    print(
        f"{'program':8} {'config':9} {'batch':>5} {'ops':>5} {'eager ms':>9} {'ours ms':>9} {'ratio':>6} "
        f"{'peak MiB':>9} {'params+state MiB':>17}"
    )
    for r in rows:
        print(
            f"{r['program']:8} {r['config']:9} {r['batch']:5d} {r['ops']:5d} {r['eager_ms']:9.1f} "
            f"{r['ours_ms']:9.1f} {r['ratio']:6.3f} {r['peak_bytes'] / 2**20:9.1f} "
            f"{r['persistable_bytes'] / 2**20:17.1f}"
        )
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"machine": info, "device": str(device), "rows": rows}, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
