"""A mixture-of-experts training step: metaopt against torch eager on the same HF Mixtral.

    python benchmarks/moe.py [--width 256] [--layers 4] [--experts 8] [--seq 128] [--batch 4]
                             [--steps 5] [--rounds 3] [--ep 2] [--json out.json]

The model: HF MixtralForCausalLM from a config (vocab 8192, GQA 8/4 heads, top-2 of `--experts`
experts, the load-balancing aux loss on), wrapped to return the loss, float32 on the CPU. One
training step is forward + backward + SGD (lr 1e-3), the same batch every step. Sides, timed
round by round in this one process (each round: one untimed step, then `--steps` timed):
  eager-grouped  torch eager, HF's default experts: torch.nn.functional.grouped_mm (torch's CPU
                 kernel), torch.optim.SGD
  eager-loop     torch eager, HF's "eager" experts (a Python loop over the experts hit)
  metaopt        metaopt.export + fleet minimize (SGD), metaopt.Executor: one GroupedMatMul per
                 projection over every expert
The table gives each side's median step and its ratio to eager-grouped.

With ``--ep N`` a second table: N gloo worker processes of this script (one thread each), fleet's
hybrid_configs {dp_degree: N, ep_degree: N}, each worker its own batch of `--batch` x `--seq`:
each worker's median step, the bytes its all-to-alls send to other workers per step (the
executor's count), and its persistable bytes (measured; its experts are 1/N of them) beside one
process's (same model, measured the same way).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import LMLoss  # (common puts the repo on sys.path)

import metaopt  # before transformers (DESIGN: import order)


def build(a, impl: str) -> torch.nn.Module:
    import transformers

    cfg = transformers.MixtralConfig(
        vocab_size=8192,
        hidden_size=a.width,
        intermediate_size=2 * a.width,
        num_hidden_layers=a.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_local_experts=a.experts,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=0.02,
        max_position_embeddings=a.seq,
        experts_implementation=impl,
    )
    torch.manual_seed(0)
    return LMLoss(transformers.MixtralForCausalLM(cfg)).train()


def eager_step(module):
    opt = torch.optim.SGD(module.parameters(), lr=1e-3)

    def step(ids, labels):
        opt.zero_grad(set_to_none=True)
        loss = module(ids, labels)
        loss.backward()
        opt.step()
        return loss.item()

    return step


def metaopt_step(module, ids, labels, strategy=None):
    program = metaopt.export(copy.deepcopy(module), (ids, labels))
    metaopt.fleet.init(is_collective=True, strategy=strategy)
    opt = metaopt.fleet.distributed_optimizer(metaopt.optimizer.SGD(learning_rate=1e-3), strategy)
    opt.minimize(program.loss)
    exe = metaopt.Executor("cpu")

    def step(ids_, labels_):
        feed = {"input_ids": ids_, "labels": labels_}
        (loss,) = exe.run(program, feed=feed, fetch_list=[program.loss_name])
        return float(loss)

    step.exe = exe
    return step


def ep_worker(a) -> None:
    """One worker of `--ep`: its step times, all-to-all bytes and persistable bytes, as JSON."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    strategy = metaopt.fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": world, "ep_degree": world}
    g = torch.Generator().manual_seed(1 + rank)
    ids = torch.randint(0, 8192, (a.batch, a.seq), generator=g)
    step = metaopt_step(build(a, "grouped_mm"), ids, ids, strategy)
    step(ids, ids)
    times = []
    for _ in range(a.rounds * a.steps):
        t = time.perf_counter()
        step(ids, ids)
        times.append(time.perf_counter() - t)
    stats = step.exe.memory_stats()
    out = {
        "median_s": statistics.median(times),
        "all_to_all_bytes": stats["all_to_all_bytes"],
        "persistable_bytes": stats["persistable_bytes"],
    }
    Path(a.worker, f"rank{rank}.json").write_text(json.dumps(out))


def run_ep(a) -> list[dict]:
    out = tempfile.mkdtemp(prefix="moe_ep_")
    here = Path(__file__).resolve()
    env0 = {**os.environ, "WORLD_SIZE": str(a.ep), "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1"}
    env0["MASTER_PORT"] = str(29700 + a.ep)
    args = [
        f"--{k}={v}"
        for k, v in vars(a).items()
        if k in ("width", "layers", "experts", "seq", "batch", "steps", "rounds")
    ]
    procs = [
        subprocess.Popen(
            [sys.executable, str(here), *args, "--worker", out],
            env={**env0, "RANK": str(r), "LOCAL_RANK": str(r)},
        )
        for r in range(a.ep)
    ]
    for p in procs:
        if p.wait(timeout=1800) != 0:
            raise SystemExit("an expert-parallel worker failed")
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(a.ep)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ep", type=int, default=0, help="also run expert parallel on this many gloo workers")
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # an --ep worker: its JSON goes to this folder
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.worker:
        ep_worker(a)
        return 0
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 8192, (a.batch, a.seq), generator=g)
    base = build(a, "grouped_mm")
    sides = {
        "eager-grouped": eager_step(base),
        "eager-loop": eager_step(build(a, "eager")),
        "metaopt": metaopt_step(build(a, "grouped_mm"), ids, ids),
    }
    params = sum(p.numel() for p in base.parameters())
    times: dict[str, list[float]] = {k: [] for k in sides}
    first: dict[str, float] = {}
    for _ in range(a.rounds):
        for name, step in sides.items():
            loss = step(ids, ids)
            first.setdefault(name, loss)
            for _ in range(a.steps):
                t = time.perf_counter()
                step(ids, ids)
                times[name].append(time.perf_counter() - t)
    ref = statistics.median(times["eager-grouped"])
    print(
        f"HF Mixtral {a.layers} layers, width {a.width}, {a.experts} experts top-2, "
        f"{params / 1e6:.1f}M params, "
        f"batch {a.batch} x {a.seq}, torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(f"{'side':<14} {'median step s':>14} {'x eager-grouped':>16} {'first loss':>11}")
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        rows.append({"side": name, "median_s": med, "ratio": med / ref, "first_loss": first[name]})
        print(f"{name:<14} {med:>14.4f} {med / ref:>16.2f} {first[name]:>11.5f}")
    ep_rows = []
    if a.ep:
        one = sides["metaopt"].exe.memory_stats()["persistable_bytes"]
        ep_rows = run_ep(a)
        print(
            f"\nexpert parallel: dp_degree={a.ep} x ep_degree={a.ep} on {a.ep} gloo workers (1 thread each)"
        )
        head = ("worker", "median step s", "all-to-all MB/step", "persistable MB", "x 1 process")
        print(f"{head[0]:<8} {head[1]:>14} {head[2]:>19} {head[3]:>15} {head[4]:>12}")
        for r, w in enumerate(ep_rows):
            mb, held = w["all_to_all_bytes"] / 2**20, w["persistable_bytes"]
            print(f"{r:<8} {w['median_s']:>14.4f} {mb:>19.3f} {held / 2**20:>15.2f} {held / one:>12.2f}")
        print(f"{'1 proc':<8} {'':>14} {'':>19} {one / 2**20:>15.2f} {1.0:>12.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "params": params, "rows": rows, "ep": ep_rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
