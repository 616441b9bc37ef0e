"""Step-time ratios from paired steps: torch and metaopt alternate inside one process.

    python benchmarks/paired_step.py [--models gpt2,bert,llama,resnet50] [--processes 2] [--steps 10]
                                     [--warm 2] [--pairs time,recompute] [--quick] [--device cpu|cuda]

hf_models_step.py runs each configuration in its own process and compares medians across
processes. On a shared, noisy machine the processes' speeds differ by more than the gaps being
measured (ResNet-50's step: 1.18x and then 0.99x eager, back to back, the same code). Here one
process builds both sides of a pair from the same model (same init, same data) and times them in
turn, step after step: torch, metaopt, then metaopt, torch, and so on (the order alternates so
neither side always runs right after the other). Every pair of neighbouring steps gives one ratio
metaopt / torch, measured under the same machine conditions; the table gives the median of all
those ratios over `--processes` fresh processes, with their quartiles and extremes. Beside it, the
median ratio of the process's CPU time (user + system, every thread) per step: less moved by other
tenants taking the cores (a descheduled thread accrues none), but it counts OpenMP's spin-waits and
the kernel's page-fault time, so it is a second view, not the bar's figure.

Pairs (the models and configurations of hf_models_step.py, the same builders):
  time       torch eager + torch.optim.Adam   vs  metaopt (export + fleet minimize + Executor)
  recompute  torch.utils.checkpoint per block  vs  metaopt fleet recompute, the same placement

Memory is not measured here (two sides share the process): hf_models_step.py measures it, each
configuration in a fresh process.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import hf_models_step as hf  # noqa: E402  (after the path set-up above)

PAIRS = {"time": ("eager", "metaopt"), "recompute": ("torch_ckpt", "metaopt_recompute")}


def _side(model_name: str, config: str, shape: hf.Shape, dev: torch.device, fused: bool = False):
    """One configuration's step function, built from a fresh copy of the model."""
    model, feed, patterns, blocks = hf.build(model_name, shape)
    feed = {k: v.to(dev) for k, v in feed.items()}
    if config.startswith("metaopt"):
        step, _ = hf._metaopt_step(model, feed, patterns, config == "metaopt_recompute", dev, {}, fused)
        return step
    if config == "torch_ckpt":
        hf._checkpoint_each(blocks)
    return hf._eager_step(model.to(dev), feed, fused)


def _timed(step, dev: torch.device) -> tuple[float, float]:
    """(wall s, this process's CPU s: every thread's user + system time) of one step."""
    t, c = time.perf_counter(), time.process_time()
    step()  # returns the loss as a Python float: the step has ended on either side
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter() - t, time.process_time() - c


def worker(
    model_name: str, pair: str, shape: hf.Shape, steps: int, warm: int, device: str, fused: bool = False
) -> dict:
    dev = torch.device(device)
    torch_config, ours_config = PAIRS[pair]
    theirs = _side(model_name, torch_config, shape, dev, fused)
    ours = _side(model_name, ours_config, shape, dev, fused)
    gc.collect()
    for _ in range(warm):
        theirs()
        ours()
    t_theirs, t_ours = [], []
    for i in range(steps):
        if i % 2 == 0:
            t_theirs.append(_timed(theirs, dev))
            t_ours.append(_timed(ours, dev))
        else:
            t_ours.append(_timed(ours, dev))
            t_theirs.append(_timed(theirs, dev))
    return {
        "model": model_name, "pair": pair,
        "torch_s": [w for w, _ in t_theirs], "metaopt_s": [w for w, _ in t_ours],
        "torch_cpu_s": [c for _, c in t_theirs], "metaopt_cpu_s": [c for _, c in t_ours],
        "ratios": [o[0] / t[0] for o, t in zip(t_ours, t_theirs)],
        "cpu_ratios": [o[1] / t[1] for o, t in zip(t_ours, t_theirs)],
    }  # fmt: skip


def _quartiles(xs: list[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def _summary(runs: list[dict]) -> dict:
    out: dict = {}
    for r in runs:
        cell = out.setdefault(r["model"], {}).setdefault(r["pair"], {"ratios": [], "failed": []})
        if "error" in r:
            cell["failed"].append(r)
            continue
        for key in ("ratios", "cpu_ratios", "torch_s", "metaopt_s"):
            cell.setdefault(key, []).extend(r[key])
    for by_pair in out.values():
        for cell in by_pair.values():
            xs = cell["ratios"]
            if not xs:
                continue
            q1, q3 = _quartiles(xs)
            cell.update(median=statistics.median(xs), q1=q1, q3=q3, min=min(xs), max=max(xs), n=len(xs),
                        torch_median_s=statistics.median(cell["torch_s"]),
                        metaopt_median_s=statistics.median(cell["metaopt_s"]),
                        cpu_median=statistics.median(cell["cpu_ratios"]))  # fmt: skip
    return out


def _print(summary: dict) -> None:
    print(f"\n{'model':9} {'pair':10} {'ratio metaopt/torch':>20} {'q1':>6} {'q3':>6} {'min':>6} {'max':>6} "
          f"{'pairs':>5} {'torch s':>8} {'metaopt s':>9} {'CPU-time ratio':>14}")  # fmt: skip
    for model, by_pair in summary.items():
        for pair, c in by_pair.items():
            if "median" not in c:
                print(f"{model:9} {pair:10} FAILED: {c['failed'][0]['error']}")
                continue
            spread = " ".join(f"{c[k]:6.3f}" for k in ("q1", "q3", "min", "max"))
            times = f"{c['torch_median_s']:8.3f} {c['metaopt_median_s']:9.3f} {c['cpu_median']:14.3f}"
            print(f"{model:9} {pair:10} {c['median']:20.3f} {spread} {c['n']:5d} {times}")


def _run_worker(model: str, pair: str, args) -> dict:
    return hf.run_worker(__file__, {"model": model, "pair": pair}, args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    known = ",".join(hf.MODELS)
    ap.add_argument("--models", default=known, help=f"comma-separated, of {known}")
    ap.add_argument("--pairs", default=",".join(PAIRS), help=f"comma-separated, of {','.join(PAIRS)}")
    ap.add_argument("--processes", type=int, help="fresh processes per model and pair (default 2; --quick 1)")
    ap.add_argument("--steps", type=int, help="timed steps per side and process (default 10; --quick 3)")
    ap.add_argument("--warm", type=int, help="untimed steps per side first (default 2; --quick 1)")
    ap.add_argument("--quick", action="store_true", help="small shapes: a dry run")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads in every worker")
    ap.add_argument("--worker-timeout", type=int, default=3600, help="seconds per worker process")
    ap.add_argument("--fused-adam", action="store_true", help="Adam(fused=True) on both sides")
    ap.add_argument("--json", help="default benchmarks/results/paired_step[_quick][_cuda].json")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.processes = args.processes or (1 if args.quick else 2)
    args.steps = args.steps or (3 if args.quick else 10)
    args.warm = args.warm if args.warm is not None else (1 if args.quick else 2)
    shape = hf.QUICK if args.quick else hf.FULL
    if args.worker:
        torch.set_num_threads(args.threads)
        model, pair = args.worker.split(":")
        print(json.dumps(worker(model, pair, shape, args.steps, args.warm, args.device, args.fused_adam)))
        return

    models = hf._choose(args.models, hf.MODELS, "--models")
    pairs = hf._choose(args.pairs, tuple(PAIRS), "--pairs")
    from common import machine

    runs, t0 = [], time.perf_counter()
    for p in range(args.processes):
        for model in models:
            for pair in pairs:
                r = _run_worker(model, pair, args)
                runs.append(r)
                status = r.get("error") or f"median ratio {statistics.median(r['ratios']):.3f}"
                print(f"process {p + 1}/{args.processes} {model:9} {pair:10} {status}", flush=True)
    summary = _summary(runs)
    _print(summary)
    print(f"\n{shape}; {args.processes} processes x {args.steps} paired steps "
          f"(+{args.warm} warm-up each side); {time.perf_counter() - t0:.0f} s in all")  # fmt: skip
    for r in runs:
        if "error" in r:
            tail = "\n  ".join(r.get("log_tail", []))
            print(f"\n{r['model']} {r['pair']} FAILED ({r['error']}):\n  {tail}")
    cuda = args.device.startswith("cuda")
    suffix = ("_quick" if args.quick else "") + ("_cuda" if cuda else "")
    path = Path(args.json or HERE / "results" / f"paired_step{suffix}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"shape": asdict(shape), "processes": args.processes, "steps": args.steps, "warm": args.warm,
            "fused_adam": args.fused_adam,
            "threads": args.threads, "date": time.strftime("%Y-%m-%d %H:%M"),
            "machine": machine(torch.device(args.device)), "load_average": os.getloadavg()}  # fmt: skip
    path.write_text(json.dumps({"meta": meta, "summary": summary, "runs": runs}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
