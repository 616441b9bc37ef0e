"""Activation bytes per transformer layer with tensor parallel, with and without sequence parallel,
with segment parallel (Ulysses: hybrid_configs["sep_degree"]) and with context parallel (ring
attention: hybrid_configs["cp_degree"]), with and without recompute:
predicted (`estimate_memory`), measured (the executor's own count on gloo workers at t = 2 and
in one process at t = 1), beside Korthikanti et al. 2022's formula.

    python benchmarks/long_seq.py [--width 256] [--heads 8] [--seq 512] [--batch 2] [--json out.json]

The layer: Hugging Face GPT-2 (GPT-3's layer: LayerNorm, fused QKV, attention, projection,
dropout, residual; LayerNorm, 4h GELU MLP, dropout, residual), 2 layers, float32 on the CPU,
hidden and embedding dropout 0.1, attention dropout 0 (on split heads it would draw each rank's own
mask). Tensor parallel splits c_attn / c_fc by columns and the projections by rows over t ranks.

"Activation bytes per layer" is what layer 1 adds to the live bytes and keeps to the end of its
forward: live(after layer 1's last forward op) - live(after layer 0's last one), as the executor
counts them (its timeline) and as `estimate_memory` predicts them (its timeline, the same points),
on rank 0's program. Rows:
  t          the model-parallel degree (1: one process), or the sep / cp degree on those rows
  sp         sequence parallel (tensor_parallel_configs["sequence_parallel"]), or "sep": segment
             parallel at degree t (no tensor parallel; every sequence split over t workers, q/k/v
             exchanged around attention), whose formula is sequence parallel's, sbh/t (66 + 9as/h),
             or "cp": context parallel at degree t (every sequence split over t workers in zig-zag
             runs, k/v round a ring in attention), the same formula
  recompute  none, or a checkpoint per block with the "selective" policy (matmul outputs kept)
Korthikanti's formula is for 16-bit activations with 1-byte dropout masks; here in float32 (4-byte
activations, 1-byte masks): per layer sbh(66 + 9as/h) without parallelism, sbh(18 + 48/t + 9as/(ht))
with tensor parallel, sbh/t (66 + 9as/h) with sequence parallel and sbh/t 66 with their selective
recompute (the attention's softmax and dropout recomputed). The 9as/h term is the attention
probabilities, their dropout mask and dropped output: with attention dropout 0 only the
probabilities (4as/h) exist, and our CPU attention keeps them.
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
from common import LMLoss  # (common puts the repo on sys.path)

import metaopt  # before transformers (DESIGN: import order)
from metaopt import fleet
from metaopt.passes.context_parallel import context_parallel, plan_context_parallel
from metaopt.passes.memory_estimate import estimate_memory
from metaopt.passes.segment_parallel import plan_segment_parallel, segment_parallel
from metaopt.passes.sequence_parallel import plan_sequence_parallel, sequence_parallel
from metaopt.passes.sequence_regather import plan_regather, regather
from metaopt.passes.tensor_parallel import plan_tensor_parallel, tensor_parallel

COLUMN = ["m.transformer.h.*.attn.c_attn", "m.transformer.h.*.mlp.c_fc"]
ROW = ["m.transformer.h.*.attn.c_proj", "m.transformer.h.*.mlp.c_proj"]
CHECKPOINTS = ["m.transformer.h.*"]


def build(a) -> tuple[torch.nn.Module, tuple]:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=1024,
        n_embd=a.width,
        n_layer=2,
        n_head=a.heads,
        n_positions=a.seq,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.0,
    )
    module = LMLoss(transformers.GPT2LMHeadModel(cfg)).train()
    ids = torch.randint(0, 1024, (a.batch, a.seq), generator=torch.Generator().manual_seed(1))
    return module, (ids, ids)


def korthikanti(a, t: int, sp: bool, recompute: bool) -> float:
    s, b, h, heads = a.seq, a.batch, a.width, a.heads
    sbh, attn = s * b * h, 9 * heads * s / h
    if t == 1 and not sp:
        return sbh * (66 + attn)
    if not sp:
        return sbh * (18 + 48 / t + attn / t)
    return sbh / t * (66 if recompute else 66 + attn)  # sequence parallel's, and segment parallel's


def strategy(t: int, sp: bool | str, recompute: bool, hybrid: bool) -> fleet.DistributedStrategy:
    s = fleet.DistributedStrategy()
    if hybrid and sp in ("sep", "cp"):  # the workers: fleet rewrites for segment / context parallel
        s.hybrid_configs = {"dp_degree": 1, f"{sp}_degree": t}
    elif hybrid:  # the workers: fleet rewrites for tensor parallel itself
        s.hybrid_configs = {"dp_degree": 1, "mp_degree": t}
        s.tensor_parallel = True
        s.tensor_parallel_configs = {"column": COLUMN, "row": ROW, "sequence_parallel": sp}
    if recompute:
        s.recompute = True
        s.recompute_configs = {"checkpoints": CHECKPOINTS, "policy": "selective"}
    return s


def layer_bytes(p: metaopt.Program, timeline: list[int]) -> int:
    """What layer 1 adds to the live bytes and keeps to the end of its forward (module doc)."""
    ends = []
    for k in (0, 1):
        scope = f"m.transformer.h.{k}"
        ends.append(
            max(
                i for i, op in enumerate(p.ops) if op.role == "forward" and (op.scope or "").startswith(scope)
            )
        )
    return timeline[ends[1]] - timeline[ends[0]]


def predicted(a, t: int, sp: bool | str, recompute: bool) -> tuple[int, metaopt.Program]:
    """Rank 0's program at degree t, rewritten in this one process (no worker), and its layer bytes."""
    module, inputs = build(a)
    p = metaopt.export(module, inputs, name="gpt2")
    if sp == "sep":
        p = segment_parallel(p, plan=plan_segment_parallel(p, degree=t, group=list(range(t))))
    elif sp == "cp":
        p = context_parallel(p, plan=plan_context_parallel(p, degree=t, group=list(range(t))))
    elif t > 1:
        p = tensor_parallel(
            p,
            plan=plan_tensor_parallel(
                p, mp_degree=t, mp_rank=0, column=COLUMN, row=ROW, group=list(range(t))
            ),
        )
        if sp:
            p = sequence_parallel(p, plan=plan_sequence_parallel(p, degree=t, group=list(range(t))))
    opt = fleet.distributed_optimizer(
        metaopt.optimizer.SGD(learning_rate=1e-3), strategy(t, sp, recompute, False)
    )
    opt.minimize(p.loss)
    if sp is True:  # what fleet's sequence_regather step does after recompute
        p = regather(p, plan=plan_regather(p))
    est = estimate_memory(p, dims={"batch": a.batch})
    return layer_bytes(p, est.timeline), p


def measured_worker(a) -> None:
    """One gloo worker at t = world size: its measured and predicted layer bytes, as JSON."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = {}
    modes = (a.worker_mode,) if a.worker_mode in ("sep", "cp") else (False, True)
    fleet.init(is_collective=True, strategy=strategy(world, modes[0], False, True))
    for sp in modes:
        for rc in (False, True):
            module, inputs = build(a)
            p = metaopt.export(module, inputs, name="gpt2")
            opt = fleet.distributed_optimizer(
                metaopt.optimizer.SGD(learning_rate=1e-3), strategy(world, sp, rc, True)
            )
            opt.minimize(p.loss)
            exe = metaopt.Executor("cpu", record_timeline=True)
            exe.run(p, feed={"input_ids": inputs[0], "labels": inputs[1]}, fetch_list=[p.loss])
            est = estimate_memory(p, dims={"batch": a.batch})
            out[f"{sp}:{rc}"] = {
                "measured": layer_bytes(p, exe.memory_timeline()),
                "predicted": layer_bytes(p, est.timeline),
            }
    Path(a.worker, f"rank{rank}.json").write_text(json.dumps(out))


def measured_one_process(a, recompute: bool) -> int:
    module, inputs = build(a)
    p = metaopt.export(module, inputs, name="gpt2")
    fleet.distributed_optimizer(
        metaopt.optimizer.SGD(learning_rate=1e-3), strategy(1, False, recompute, False)
    ).minimize(p.loss)
    exe = metaopt.Executor("cpu", record_timeline=True)
    exe.run(p, feed={"input_ids": inputs[0], "labels": inputs[1]}, fetch_list=[p.loss])
    return layer_bytes(p, exe.memory_timeline())


def run_workers(a, world: int, mode: str = "tp") -> list[dict]:
    out = tempfile.mkdtemp(prefix="long_seq_")
    env0 = {**os.environ, "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1"}
    env0["MASTER_PORT"] = str(29800 + world + {"tp": 0, "sep": 10, "cp": 20}[mode])
    args = [f"--{k}={v}" for k, v in vars(a).items() if k in ("width", "heads", "seq", "batch")]
    procs = [
        subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), *args, "--worker", out, "--worker-mode", mode],
            env={**env0, "RANK": str(r), "LOCAL_RANK": str(r)},
        )
        for r in range(world)
    ]
    for p in procs:
        if p.wait(timeout=1800) != 0:
            raise SystemExit(f"a {mode} worker failed")
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--worker-mode", default="tp", help=argparse.SUPPRESS)
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.worker:
        measured_worker(a)
        return 0
    fleet.init(is_collective=True)
    workers = run_workers(a, 2)
    seq_workers = {mode: run_workers(a, 2, mode) for mode in ("sep", "cp")}
    rows = []
    for t in (1, 2, 4):
        for sp in (False,) if t == 1 else (False, True, "sep", "cp"):
            for rc in (False, True):
                pred, _ = predicted(a, t, sp, rc)
                meas = None
                if t == 1:
                    meas = measured_one_process(a, rc)
                elif t == 2:
                    w = (seq_workers[sp] if sp in ("sep", "cp") else workers)[0][f"{sp}:{rc}"]
                    meas = w["measured"]
                    assert w["predicted"] == pred, "the worker's estimate is rank 0's here"
                rows.append(
                    {
                        "t": t,
                        "sp": sp,
                        "recompute": "selective" if rc else "none",
                        "predicted": pred,
                        "measured": meas,
                        "korthikanti": korthikanti(a, t, sp, rc),
                    }
                )
    base = rows[0]["predicted"]
    print(
        f"activation bytes per layer: GPT-2 layer h={a.width} a={a.heads} s={a.seq} b={a.batch}, float32, CPU"
    )
    print(
        f"{'t':>2} {'sp':>5} {'recompute':>10} {'predicted':>12} {'measured':>12} {'Korthikanti':>12} "
        f"{'pred/K':>7} {'pred/t1':>8}"
    )
    for r in rows:
        meas = f"{r['measured']:>12,}" if r["measured"] is not None else f"{'-':>12}"
        k, pred = r["korthikanti"], r["predicted"]
        print(
            f"{r['t']:>2} {str(r['sp']):>5} {r['recompute']:>10} {pred:>12,} {meas} "
            f"{int(k):>12,} {pred / k:>7.2f} {pred / base:>8.2f}"
        )
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
