"""fleet.plan against measured runs (issue 45): a grid of layouts of HF GPT-2 on 4 gloo workers,
each predicted (peak and step time, the time model calibrated on this machine first) and run.

    python benchmarks/planner.py [--width 256] [--layers 4] [--seq 128] [--global-batch 32]
                                 [--steps 3] [--json results/planner.json]

1. Calibration, 4 workers: worker 0 alone times every op of the model's one-process training
   step (`metaopt.planner.calibrate.time_ops`) at three batch sizes while the others wait; then all four
   all-reduce buffers of growing sizes (`measure_links`); worker 0 fits the `Rates`.
2. Prediction: `fleet.plan` over the whole grid with those rates and `compute_units` = the
   machine's cores (its 4 workers take turns on 2), no memory cap: every layout.
3. Measurement: every layout of LAYOUTS and the planner's pick, one launch of 4 fresh workers
   each: a warm-up step, then `--steps` steps, each timed between barriers; a step's time is the
   slowest worker's, a layout's the median step. Each worker's measured peak (the executor's
   count) beside its own `estimate_memory`.
4. Checks printed: every measured peak equals its prediction; Spearman's rank correlation of
   predicted and measured step times; the pick's measured time against the fastest measured; and
   under a budget that rules out data parallel without recompute, the pick against data parallel
   with full recompute (what a user without a planner writes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time

from common import RESULTS, LMLoss, launch_workers, machine, worker_flags

# (data, model, pipe, stage, recompute, micro_batches): dp / ZeRO 1-3 / tp / pp / their mixes,
# without recompute, with it (full: each block's output kept) and selective, pipelines at two
# micro-batch counts; each run as the planner made it (its checkpoints' pattern, its stages' cuts)
LAYOUTS = [
    (4, 1, 1, 0, "none", 1),
    (4, 1, 1, 0, "full", 1),
    (4, 1, 1, 1, "none", 1),
    (4, 1, 1, 2, "none", 1),
    (4, 1, 1, 3, "none", 1),
    (4, 1, 1, 3, "full", 1),
    (2, 2, 1, 0, "none", 1),
    (2, 2, 1, 0, "full", 1),
    (2, 2, 1, 0, "selective", 1),
    (1, 4, 1, 0, "none", 1),
    (2, 1, 2, 0, "none", 2),
    (2, 1, 2, 0, "none", 4),
    (1, 1, 4, 0, "none", 4),
    (1, 2, 2, 0, "none", 2),
    (2, 2, 1, 3, "none", 1),
]
WORLD = 4


def _key(lay) -> tuple:
    """A layout's grid point: its degrees, data-side form, recompute and micro-batches."""
    return (lay.data, lay.model, lay.pipe, lay.stage, lay.recompute, lay.micro_batches)


def build(args):
    import torch

    import metaopt  # noqa: F401 - before transformers: it makes a mismatched torchvision importable

    transformers = __import__("transformers")
    cfg = transformers.GPT2Config(
        n_embd=args.width,
        n_layer=args.layers,
        n_head=args.width // 64,
        n_positions=args.seq,
        vocab_size=args.vocab,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    module = LMLoss(transformers.GPT2LMHeadModel(cfg)).train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.global_batch, args.seq), generator=g)
    return module, ids


def export(args):
    import metaopt

    module, ids = build(args)
    return metaopt.export(module, (ids[:2], ids[:2])), ids


def calibrate_worker(args) -> None:
    """Worker 0 times the one-process step's ops alone, the others waiting (the rates of one
    worker on one core: the planner adds the sharing of cores, `compute_units`), at a quarter,
    half and all of the global batch; then all four time the links; worker 0 fits and saves."""
    import torch

    import metaopt
    from metaopt import fleet
    from metaopt.planner import calibrate as cal

    torch.set_num_threads(1)
    fleet.init(is_collective=True)
    program, ids = export(args)
    metaopt.optimizer.Adam(learning_rate=1e-3).minimize(program.loss)
    samples = []
    fleet.barrier_worker()
    if fleet.worker_index() == 0:
        exe = metaopt.Executor("cpu", record_op_times=True)
        for batch in (args.global_batch // 4, args.global_batch // 2, args.global_batch):
            feed = {"input_ids": ids[:batch].clone(), "labels": ids[:batch].clone()}
            for op, s in cal.time_ops(exe, program, feed, runs=3):
                samples.append((*cal.op_cost(program, op, {"batch": batch}), s))
    fleet.barrier_worker()
    links = cal.measure_links()
    if fleet.worker_index() == 0:
        c, flops, bps = cal.fit_compute(samples)
        rates = cal.Rates(
            device_flops=flops,
            device_bytes_per_s=bps,
            op_seconds=c,
            link_latency_s=links[0],
            link_bytes_per_s=links[1],
            measured=f"{len(samples)} op times of one worker alone; all-reduces over {WORLD} gloo workers",
        )
        rates.save(os.path.join(args.out, "rates.json"))
    fleet.barrier_worker()


def run_worker(args) -> None:
    """One layout: warm-up, then `steps` steps between barriers; this worker's times and peaks."""
    import torch

    import metaopt
    from metaopt import fleet
    from metaopt.passes.memory_estimate import estimate_memory
    from metaopt.planner.search import Layout
    from metaopt.report.pipeline_memory import estimate_pipeline_memory

    torch.set_num_threads(1)
    layout = Layout(**json.loads(args.layout))
    strategy = layout.strategy()
    fleet.init(is_collective=True, strategy=strategy)
    program, ids = export(args)
    fleet.distributed_optimizer(metaopt.optimizer.Adam(learning_rate=1e-3), strategy).minimize(program.loss)
    hcg = fleet.get_hybrid_communicate_group()
    side = (
        hcg.get_data_parallel_rank() * hcg.get_sharding_parallel_world_size()
        + hcg.get_sharding_parallel_rank()
    )
    share = args.global_batch // layout.data
    feed = {k: ids[side * share : (side + 1) * share].clone() for k in ("input_ids", "labels")}
    exe = metaopt.Executor("cpu")
    last = layout.pipe == 1 or hcg.get_stage_id() == layout.pipe - 1
    fetch = [program.loss] if last else []  # as the prediction counts the loss: fetched, kept
    exe.run(program, feed=feed, fetch_list=fetch)  # warm-up (its startup ops run once)
    times = []
    for _ in range(args.steps):
        fleet.barrier_worker()
        t0 = time.perf_counter()
        exe.run(program, feed=feed, fetch_list=fetch)
        fleet.barrier_worker()
        times.append(time.perf_counter() - t0)
    if layout.pipe > 1:
        predicted = estimate_pipeline_memory(program, batch=share).peak_bytes
    else:
        predicted = estimate_memory(program, dims={"batch": share}, workspace=False).peak_bytes
    rank = fleet.worker_index()
    result = {
        "rank": rank,
        "times": times,
        "measured_peak": exe.memory_stats()["last_run_peak_bytes"],  # one step's, as predicted
        "predicted_peak": predicted,
    }
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    fleet.barrier_worker()


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        for k, i in enumerate(order):
            r[i] = float(k)
        return r

    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry, strict=True)) / (n * (n * n - 1))


def _launch(args, role: str, out: str, extra: list[str]) -> None:
    flags = [
        f"--role={role}",
        f"--width={args.width}",
        f"--layers={args.layers}",
        f"--seq={args.seq}",
        f"--vocab={args.vocab}",
        f"--global-batch={args.global_batch}",
        f"--steps={args.steps}",
        *extra,
    ]
    launch_workers(os.path.abspath(__file__), WORLD, out, flags)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", default=os.path.join(RESULTS, "planner.json"))
    ap.add_argument("--role", default="", help=argparse.SUPPRESS)
    ap.add_argument("--layout", default="", help=argparse.SUPPRESS)
    worker_flags(ap)
    args = ap.parse_args()
    if args.worker:
        (calibrate_worker if args.role == "calibrate" else run_worker)(args)
        return

    import torch

    from metaopt import fleet
    from metaopt.planner.calibrate import Rates

    work = tempfile.mkdtemp(prefix="planner_")
    t0 = time.perf_counter()
    _launch(args, "calibrate", os.path.join(work, "calibrate"), [])
    rates = Rates.load(os.path.join(work, "calibrate", "rates.json"))
    calibrate_s = time.perf_counter() - t0
    program, _ = export(args)
    t0 = time.perf_counter()
    units = min(WORLD, os.cpu_count() or WORLD)  # the cores the 4 workers share
    plans = fleet.plan(
        program,
        devices=WORLD,
        memory_per_device=1 << 50,
        global_batch=args.global_batch,
        rates=rates,
        compute_units=units,
    )
    plan_s = time.perf_counter() - t0
    by_layout = {p.layout: p for p in plans}
    made = {_key(lay): lay for lay in [*by_layout, *(lay for lay, _ in plans.pruned)]}
    chosen = [made[t] for t in LAYOUTS]
    pick = plans[0].layout
    if pick not in chosen:
        chosen.append(pick)
    rows = []
    for lay in chosen:
        if lay not in by_layout:
            rows.append({"layout": lay.describe(), "refused": True})
            continue
        out = os.path.join(work, "run", "_".join(map(str, _key(lay))))
        layout_json = json.dumps(dataclasses.asdict(lay))
        _launch(args, "run", out, [f"--layout={layout_json}"])
        ranks = []
        for r in range(WORLD):
            with open(os.path.join(out, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
        steps = [max(r["times"][i] for r in ranks) for i in range(args.steps)]
        rows.append(
            {
                "layout": lay.describe(),
                "fields": list(_key(lay)),
                "predicted_s": by_layout[lay].step_seconds,
                "measured_s": statistics.median(steps),
                "steps_s": steps,
                "predicted_peak": max(r["predicted_peak"] for r in ranks),
                "measured_peak": max(r["measured_peak"] for r in ranks),
                "peaks_equal": all(r["predicted_peak"] == r["measured_peak"] for r in ranks),
                "planner_peak": by_layout[lay].peak_bytes,
            }
        )
    ok = [r for r in rows if not r.get("refused")]
    rho = spearman([r["predicted_s"] for r in ok], [r["measured_s"] for r in ok])
    best = min(ok, key=lambda r: r["measured_s"])
    picked = next(r for r in ok if r["fields"] == list(_key(pick)))
    # the budget: below data parallel's peak without recompute, at or above it with full recompute
    dp_none = next(r for r in ok if r["fields"] == [4, 1, 1, 0, "none", 1])
    dp_full = next(r for r in ok if r["fields"] == [4, 1, 1, 0, "full", 1])
    budget = dp_none["planner_peak"] - 1
    capped = fleet.plan(
        program,
        devices=WORLD,
        memory_per_device=budget,
        global_batch=args.global_batch,
        rates=rates,
        compute_units=units,
    )
    capped_pick = next((r for r in ok if capped and r["fields"] == list(_key(capped[0].layout))), None)

    print(
        f"\nHF GPT-2 {args.width} x {args.layers}, seq {args.seq}, global batch {args.global_batch}, "
        f"{WORLD} gloo workers"
    )
    print(
        f"rates ({rates.measured}): {rates.op_seconds * 1e6:.1f} us/op, "
        f"{rates.device_flops / 1e9:.2f} GFLOP/s, {rates.device_bytes_per_s / 1e9:.2f} GB/s; "
        f"links {rates.link_latency_s * 1e6:.0f} us + {rates.link_bytes_per_s / 1e9:.2f} GB/s"
    )
    print(
        f"calibration {calibrate_s:.0f} s (its worker launch included); "
        f"plan of {len(plans)} layouts {plan_s:.1f} s"
    )
    print(f"{'layout':58} {'pred s':>8} {'meas s':>8} {'meas/pred':>9} {'peak MiB':>9} {'= pred':>6}")
    for r in rows:
        if r.get("refused"):
            print(f"{r['layout']:58} refused by the planner's rewrite")
            continue
        print(
            f"{r['layout']:58} {r['predicted_s']:8.4f} {r['measured_s']:8.4f} "
            f"{r['measured_s'] / r['predicted_s']:9.2f} "
            f"{r['measured_peak'] / 2**20:9.2f} {'yes' if r['peaks_equal'] else 'NO':>6}"
        )
    print(f"Spearman (predicted vs measured step time, {len(ok)} layouts): {rho:.3f}")
    print(
        f"pick: {picked['layout']}: measured {picked['measured_s']:.4f} s, "
        f"{picked['measured_s'] / best['measured_s']:.3f}x the fastest measured ({best['layout']})"
    )
    if dp_full["planner_peak"] > budget:
        print("recompute does not lower dp=4's peak at this size: no budget rules out only no-recompute")
    elif capped_pick is not None:
        print(
            f"budget {budget / 2**20:.1f} MiB (rules out dp=4 without recompute): "
            f"pick {capped_pick['layout']} measured "
            f"{capped_pick['measured_s']:.4f} s vs dp=4 full recompute {dp_full['measured_s']:.4f} s: "
            f"{dp_full['measured_s'] / capped_pick['measured_s']:.3f}x faster"
        )
    else:
        print(f"budget {budget / 2**20:.1f} MiB: the capped pick is not among the measured layouts")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(
            {
                "machine": machine(torch.device("cpu")),
                "args": {k: v for k, v in vars(args).items() if k not in ("worker", "out", "role", "layout")},
                "rates": rates.__dict__,
                "rows": rows,
                "spearman": rho,
                "pick": picked["layout"],
                "pick_over_best": picked["measured_s"] / best["measured_s"],
                "budget": budget,
                "capped_pick": capped[0].describe() if capped else None,
                "capped_pick_measured_s": capped_pick["measured_s"] if capped_pick else None,
                "dp_full_recompute_s": dp_full["measured_s"],
                "calibrate_s": calibrate_s,
                "plan_s": plan_s,
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
