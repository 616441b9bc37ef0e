"""ZeRO sharding: per-worker model-state bytes and bytes sent per step, one table.

    python benchmarks/sharding.py [--quick] [--json out.json]

Model states (ZeRO paper, with metaopt's float32 Adam: 4 bytes of param, 4 of grad, 8 of
optimizer state per parameter, Psi parameters):

* formula: stage 0 (data parallel) 16 Psi; stage 1 8 Psi + 8 Psi/N; stage 2 4 Psi + 12 Psi/N;
  stage 3 16 Psi/N.
* predicted: the bytes the rewritten program declares on one worker, from its vars: params
  (whole; stage 3: padded 1/N slices plus the largest gathered bucket in flight), optimizer
  state (``zero_shard`` slices: padded 1/N per tensor), grads at the peak (stage 0 and 1: every
  grad whole at the end of the backward; stages 2 and 3: every grad's 1/N slice plus the
  largest reduce-scatter bucket still whole). GPT-2 124M: Hugging Face's GPT2Config
  exported and rewritten at each N (`data_parallel` + `sharding`, what fleet runs). LLaMA-7B:
  its parameter shapes (built on the meta device, no weights) under the same slice rule
  (`ZeroShard.local_numel`), as exporting 7B parameters does not fit this machine.
* measured: gloo workers at N = 2 and 4 (GPT-2 at 4 layers x 256 wide, 2 steps each): the
  executor's persistable bytes and peak beside `estimate_memory`'s, and the payload of each
  collective per step (all-reduce: the grads; reduce-scatter: the grads; all-gather: this
  worker's param slices), turned into bytes sent per worker with the ring algorithm's counts
  (all-reduce 2(N-1)/N of its payload, reduce-scatter (N-1)/N, all-gather (N-1) x the slice).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from common import RESULTS, machine

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MB = 2**20
STAGES = (0, 1, 2, 3)
DEGREES = (1, 2, 4, 8)
SMALL = {"n_embd": 256, "n_layer": 4, "n_head": 4, "vocab_size": 8192, "n_positions": 64}


def _transformers():
    sys.path.insert(0, str(ROOT / "tests"))
    from zoo.tv import make_torchvision_importable

    make_torchvision_importable()
    import transformers

    return transformers


def formula(psi: int, stage: int, n: int) -> int:
    return {0: 16 * psi, 1: 8 * psi + 8 * psi // n, 2: 4 * psi + 12 * psi // n, 3: 16 * psi // n}[stage]


# --- predicted from the rewritten program ------------------------------------------------------


def gpt2_forward(config: dict, batch: int = 2, seq: int = 16):
    """Hugging Face GPT-2 with `config`, exported (the forward program)."""
    import metaopt

    tf = _transformers()

    class LM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = tf.GPT2LMHeadModel(tf.GPT2Config(**config, attn_implementation="sdpa"))

        def forward(self, input_ids, labels):
            return self.m(input_ids=input_ids, labels=labels).loss

    torch.manual_seed(0)
    ids = torch.randint(0, config.get("vocab_size", 50257), (batch, seq))
    return metaopt.export(LM().train(), (ids, ids))


def predicted_from_program(p, stage: int, n: int, bucket_mb: int = 32) -> dict:
    """Per-worker model-state bytes of `p` rewritten as fleet does at sharding `n`, stage `stage`."""
    from metaopt.passes.data_parallel import data_parallel, plan_data_parallel
    from metaopt.passes.optimize import update_grads
    from metaopt.passes.sharding import apply_sharding, plan_sharding

    grads = update_grads(p)
    q = p
    scatter = n if stage >= 1 and n > 1 else None
    if n > 1:
        how = {
            "world_size": n,
            "bucket_bytes": bucket_mb * MB,
            "scatter_parts": scatter,
            "at_update": stage == 1,
        }
        dp_plan = plan_data_parallel(p, grads=grads, **how)
        q = data_parallel(p, grads=grads, **how)
    gathered = 0
    if stage >= 1:
        plan = plan_sharding(q, degree=n, stage=stage, bucket_bytes=bucket_mb * MB)
        gathered = max((g.nbytes for g in plan.gathers), default=0) if n > 1 else 0
        q = apply_sharding(q, plan)
    params = sum(v.nbytes({}) for v in q.vars.values() if v.kind == "param") + gathered
    state = sum(v.nbytes({}) for v in q.vars.values() if v.kind == "opt_state" and v.shape)
    whole_grads = sum(p.vars[g].nbytes({}) for g in grads)
    if stage >= 2 and n > 1:
        from metaopt.ir import names

        sliced = sum(q.vars[names.reduced(g)].nbytes({}) for g in grads)
        grad_bytes = sliced + max(b.nbytes for b in dp_plan.buckets)
    else:
        grad_bytes = whole_grads
    return {"params": params, "grads": grad_bytes, "state": state, "total": params + grad_bytes + state}


def llama7b_predicted(stage: int, n: int) -> tuple[int, dict]:
    """LLaMA-7B's parameter shapes on the meta device under the slice rule of `ZeroShard`."""
    from metaopt.ir import ZeroShard

    tf = _transformers()
    cfg = tf.LlamaConfig(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
    )
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(cfg)
    shapes = [tuple(t.shape) for t in model.parameters()]
    psi = sum(torch.Size(s).numel() for s in shapes)
    sliced = sum(ZeroShard(n, s).local_numel for s in shapes)
    state = 8 * (sliced if stage >= 1 else psi)
    grads = 4 * (sliced if stage >= 2 else psi)  # stages 2, 3: plus one bucket in flight (32 MB)
    params = 4 * (sliced if stage == 3 else psi)  # stage 3: plus one gathered bucket (32 MB)
    if stage >= 2 and n > 1:
        grads += 32 * MB
    if stage == 3 and n > 1:
        params += 32 * MB
    return psi, {"params": params, "grads": grads, "state": state, "total": params + grads + state}


# --- measured on gloo workers --------------------------------------------------------------------


def measured(world: int, quick: bool) -> dict:
    """Run `world` gloo workers of this file's --worker mode; their results by stage."""
    out = Path(tempfile.mkdtemp(prefix="sharding_bench_"))
    port = 29600 + world
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")]),
        }
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(out)] + (
            ["--quick"] if quick else []
        )
        procs.append(subprocess.Popen(cmd, env=env))
    for p in procs:
        if p.wait(timeout=1800) != 0:
            raise SystemExit(f"a sharding worker of {world} failed")
    return json.loads((out / "rank0.json").read_text())


def worker(out: str, quick: bool) -> None:
    """One gloo worker: GPT-2 (SMALL) at stages 0 to 3; rank 0 writes the results."""
    import metaopt
    from metaopt import fleet
    from metaopt.passes.memory_estimate import estimate_memory

    fleet.init(is_collective=True)
    rank, world = fleet.worker_index(), fleet.worker_num()
    config = {**SMALL, "n_layer": 2} if quick else SMALL
    results = {}
    for stage in STAGES:
        main = gpt2_forward(config)
        s = fleet.DistributedStrategy()
        if stage:
            s.sharding = True
            s.sharding_configs = {"sharding_degree": world, "stage": stage}
        fleet.distributed_optimizer(metaopt.optimizer.Adam(learning_rate=1e-4), s).minimize(main.loss)
        exe = metaopt.Executor("cpu")
        payload = _count_collectives(exe)
        ids = torch.randint(0, config["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(rank))
        feed = dict(zip(main.inputs, (ids, ids), strict=True))
        for _ in range(2):  # the second step's traffic
            payload.clear()
            exe.run(main, feed=feed, fetch_list=[main.loss])
        stats = exe.memory_stats()
        est = estimate_memory(main, dims={"batch": 2})
        results[stage] = {
            "persistable": stats["persistable_bytes"],
            "predicted_persistable": est.persistable_bytes,
            "peak": stats["peak_bytes"],
            "predicted_peak": est.peak_bytes,
            "payload": dict(payload),
        }
    if rank == 0:
        Path(out, "rank0.json").write_text(json.dumps(results))
    fleet.barrier_worker()


def _count_collectives(exe) -> dict[str, int]:
    """Tally each collective's payload bytes (what this worker hands it) per kind."""
    comm = exe.runtime.comm
    payload: dict[str, int] = {}

    def counted(kind: str, real, size):
        def call(*args, **kwargs):
            payload[kind] = payload.get(kind, 0) + size(*args)
            return real(*args, **kwargs)

        return call

    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    comm.all_reduce = counted("all_reduce", comm.all_reduce, lambda xs, *a: sum(nbytes(x) for x in xs))
    comm.reduce_scatter = counted("reduce_scatter", comm.reduce_scatter, lambda flat, *a: nbytes(flat))
    comm.all_gather = counted("all_gather", comm.all_gather, lambda t, *a: nbytes(t))
    return payload


def sent(payload: dict[str, int], n: int) -> int:
    """Bytes one worker sends for these payloads under the ring algorithm."""
    return int(
        payload.get("all_reduce", 0) * 2 * (n - 1) / n
        + payload.get("reduce_scatter", 0) * (n - 1) / n
        + payload.get("all_gather", 0) * (n - 1)
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--quick", action="store_true", help="a 2-layer GPT-2 instead of 124M for the predicted rows"
    )
    ap.add_argument("--json", default=os.path.join(RESULTS, "sharding.json"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.quick)
        return
    rows = []
    gpt2 = gpt2_forward({**SMALL, "n_layer": 2} if args.quick else {})
    import metaopt

    metaopt.optimizer.Adam(learning_rate=1e-4).minimize(gpt2.loss)
    psi_gpt2 = sum(v.nbytes({}) // 4 for v in gpt2.vars.values() if v.kind == "param")
    cases = [(stage, n) for stage in STAGES for n in DEGREES if not (stage and n == 1)]
    name = "gpt2-124M" if not args.quick else "gpt2-2L"
    for stage, n in cases:
        rows.append((name, stage, n, formula(psi_gpt2, stage, n), predicted_from_program(gpt2, stage, n)))
    for stage, n in cases:
        psi, pred7 = llama7b_predicted(stage, n)
        rows.append(("llama-7B", stage, n, formula(psi, stage, n), pred7))
    measured_rows = {n: measured(n, args.quick) for n in (2, 4)}
    where = machine(torch.device("cpu"))["device"]
    print(f"per-worker model states (MB; float32 Adam: 16 bytes per parameter unsharded), {where}")
    head = ("model", "stage", "N", "formula", "predicted", "pred/formula", "state", "grads")
    print("{:10} {:>5} {:>3} {:>10} {:>10} {:>12} {:>9} {:>9}".format(*head))
    for model, stage, n, f, pred in rows:
        print(
            f"{model:10} {stage:>5} {n:>3} {f / MB:>10.1f} {pred['total'] / MB:>10.1f} "
            f"{pred['total'] / f:>12.3f} {pred['state'] / MB:>9.1f} {pred['grads'] / MB:>9.1f}"
        )
    print()
    print("measured on gloo workers: GPT-2 4 x 256 (MB), bytes sent per worker per step (ring counts)")
    head = ("N", "stage", "persistable", "predicted", "peak", "predicted", "sent", "sent/DP")
    print("{:>3} {:>5} {:>11} {:>9} {:>8} {:>9} {:>8} {:>8}".format(*head))
    for n, res in measured_rows.items():
        base = sent(res["0"]["payload"], n)
        for stage in STAGES:
            r = res[str(stage)]
            s = sent(r["payload"], n)
            print(
                f"{n:>3} {stage:>5} {r['persistable'] / MB:>11.3f} {r['predicted_persistable'] / MB:>9.3f} "
                f"{r['peak'] / MB:>8.3f} {r['predicted_peak'] / MB:>9.3f} {s / MB:>8.3f} {s / base:>8.2f}"
            )
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(
            {
                "machine": machine(torch.device("cpu")),
                "predicted": [
                    {"model": m, "stage": st, "n": n, "formula": fo, **pred} for m, st, n, fo, pred in rows
                ],
                "measured": measured_rows,
            },
            f,
            indent=1,
        )
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
