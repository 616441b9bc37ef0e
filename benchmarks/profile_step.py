"""Where one training step's time goes, eager torch beside metaopt, on the same model.

    python benchmarks/profile_step.py [--models gpt2,llama] [--device cpu|cuda] [--quick] [--json F]

The models and shapes are hf_models_step.py's (Hugging Face GPT-2 / BERT / LLaMA, torchvision
ResNet-50; Adam). Each side runs its warm-up steps, then `--steps` steps under torch.profiler.
Printed per model: the wall time per step of each side and their ratio, then each side's top ops
by self time (CUDA time on a GPU, CPU time otherwise) with their call counts, and the launch
counts (kernels on CUDA, aten ops on the CPU). A step whose device time is well under its wall
time is bound by the host (Python and dispatch per op), which is what the first H200 run's
1.26-2.16x against eager at these shapes asked to find out (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from common import RESULTS, machine, sync
from hf_models_step import FULL, MODELS, QUICK, _eager_step, _metaopt_step, build

TOP = 15


def _profile(step, dev: torch.device, steps: int, warm: int) -> dict:
    for _ in range(warm):
        step()
    sync(dev)
    cuda = dev.type == "cuda"
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    t = time.perf_counter()
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        sync(dev)
    wall = (time.perf_counter() - t) / steps
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, attr, 0) > 0]
    events.sort(key=lambda e: getattr(e, attr), reverse=True)
    total = sum(getattr(e, attr) for e in events) / steps / 1e6  # s per step
    top = [
        {"op": e.key, "ms_per_step": getattr(e, attr) / steps / 1e3, "calls_per_step": e.count / steps}
        for e in events[:TOP]
    ]
    launches = sum(e.count for e in events) / steps
    return {"wall_s": wall, "busy_s": total, "launches_per_step": launches, "top": top}


def _run(name: str, side: str, shape, dev: torch.device, steps: int, warm: int) -> dict:
    model, feed, _, _ = build(name, shape)
    feed = {k: v.to(dev) for k, v in feed.items()}
    if side == "metaopt":
        step, _ = _metaopt_step(model, feed, [], False, dev, {})
    else:
        model.to(dev)
        step = _eager_step(model, feed)
    return _profile(step, dev, steps, warm)


def _print(name: str, res: dict, cuda: bool) -> None:
    e, m = res["eager"], res["metaopt"]
    what = "device" if cuda else "CPU"
    ratio = m["wall_s"] / e["wall_s"]
    steps = f"{e['wall_s'] * 1e3:.1f} ms eager, {m['wall_s'] * 1e3:.1f} ms metaopt"
    print(f"\n{name}: step {steps} (ratio {ratio:.2f})")
    busy = f"{e['busy_s'] * 1e3:.1f} / {m['busy_s'] * 1e3:.1f} ms"
    print(f"  {what} busy {busy}; launches {e['launches_per_step']:.0f} / {m['launches_per_step']:.0f}")
    for side in ("eager", "metaopt"):
        print(f"  {side:8s} top ops by self {what} time (ms per step, calls per step)")
        for row in res[side]["top"]:
            print(f"    {row['ms_per_step']:8.2f} {row['calls_per_step']:6.0f}  {row['op'][:70]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gpt2,llama")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warm", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="hf_models_step's small shapes")
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device(args.device)
    shape = QUICK if args.quick else FULL
    out: dict = {"machine": machine(dev), "shape": vars(shape), "steps": args.steps, "models": {}}
    for name in args.models.split(","):
        if name not in MODELS:
            raise SystemExit(f"--models: unknown model {name!r}; the models are {', '.join(MODELS)}")
        res = {side: _run(name, side, shape, dev, args.steps, args.warm) for side in ("eager", "metaopt")}
        out["models"][name] = res
        _print(name, res, dev.type == "cuda")
    default = Path(RESULTS) / f"profile_step{'_quick' if args.quick else ''}_{dev.type}.json"
    path = Path(args.json) if args.json else default
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
