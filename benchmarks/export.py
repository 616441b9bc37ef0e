"""What an export costs: time and peak host memory of `metaopt.export` beside torch's own exporters
(torch.export.export, then torch.onnx.export of its program: the same two steps metaopt's export
starts with), on Hugging Face GPT-2 at three sizes, each side in a fresh process.

    python benchmarks/export.py [--sizes 256x4,512x8,1024x12] [--reps 2] [--json out.json]

Peak RSS is the process's peak (getrusage) above its RSS before the model is built (after every
import), as a multiple of the params' bytes: building the model is 1x of it. `metaopt.export` on
the meta device (the module built under ``torch.device("meta")``: no values) is the third row.
Each figure is the minimum over `--reps` fresh processes (a quiet machine's figure).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

from common import RESULTS, LMLoss, machine

SIDES = ("torch", "metaopt", "metaopt-meta")


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def child(side: str, width: int, layers: int) -> dict:
    import torch

    import metaopt  # before transformers: it makes a mismatched torchvision importable

    transformers = __import__("transformers")
    # what the build and both exporters would import on first use: modules, not copies of values,
    # and the same on both sides (they were counted in the peak before: 2026-12-06's table)
    __import__("transformers.models.gpt2.modeling_gpt2")
    __import__("torch.onnx._internal.exporter._core")
    __import__("onnxscript")

    torch.set_num_threads(2)
    cfg = transformers.GPT2Config(n_embd=width, n_layer=layers, n_head=width // 64, n_positions=128)

    ids = torch.randint(0, cfg.vocab_size, (2, 64))
    base = _rss_bytes()
    device = "meta" if side == "metaopt-meta" else "cpu"
    with torch.device(device):
        model = LMLoss(transformers.GPT2LMHeadModel(cfg)).train()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    t0 = time.perf_counter()
    if side == "torch":
        dims = {"input_ids": {0: torch.export.Dim("batch")}, "labels": {0: torch.export.Dim("batch")}}
        ep = torch.export.export(model, (ids, ids), dynamic_shapes=dims)
        torch.onnx.export(ep, (ids, ids), dynamo=True, optimize=False, verbose=False, report=False)
    else:
        metaopt.export(model, (ids, ids))
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": seconds, "peak_above_bytes": peak - base, "param_bytes": params}


def run_child(side: str, width: int, layers: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", side, f"{width}x{layers}"]
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        sys.exit(f"{side} {width}x{layers} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="256x4,512x8,1024x12", help="WIDTHxLAYERS of GPT-2, comma-separated")
    ap.add_argument("--reps", type=int, default=2, help="fresh processes per side and size (the minimum)")
    ap.add_argument("--json", default=os.path.join(RESULTS, "export.json"))
    ap.add_argument("--child", nargs=2, metavar=("SIDE", "SIZE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        width, layers = map(int, args.child[1].split("x"))
        print(json.dumps(child(args.child[0], width, layers)))
        return
    rows = []
    for size in args.sizes.split(","):
        width, layers = map(int, size.split("x"))
        runs = {side: [run_child(side, width, layers) for _ in range(args.reps)] for side in SIDES}
        best = {
            side: {
                "seconds": min(r["seconds"] for r in rs),
                "peak_above_bytes": min(r["peak_above_bytes"] for r in rs),
            }
            for side, rs in runs.items()
        }
        params = runs["torch"][0]["param_bytes"]
        rows.append({"size": size, "param_bytes": params, "sides": best, "runs": runs})
    print(
        "HF GPT-2 export, each side in fresh processes (min of reps); peak RSS above the RSS before the build"
    )
    print(f"{'size':>9} {'params MB':>9} | {'side':>13} {'s':>7} {'x torch s':>9} {'peak/params':>11}")
    for r in rows:
        torch_s = r["sides"]["torch"]["seconds"]
        for side in SIDES:
            b = r["sides"][side]
            ratio = b["peak_above_bytes"] / r["param_bytes"]
            print(
                f"{r['size']:>9} {r['param_bytes'] / 1e6:9.0f} | {side:>13} {b['seconds']:7.2f} "
                f"{b['seconds'] / torch_s:9.2f} {ratio:11.2f}"
            )
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        import torch

        json.dump({"machine": machine(torch.device("cpu")), "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
