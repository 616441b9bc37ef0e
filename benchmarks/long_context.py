"""A sequence one process cannot hold under a byte cap, trained by context parallel's workers under
it (issue 46: cp 4 at sequence 8192, tiny width).

    python benchmarks/long_context.py [--seq 8192] [--cp 4] [--cap-mib 1024] [--json out.json]

The model: Hugging Face GPT-2, 2 layers, width 64, 2 heads, vocab 128, every dropout 0.1 (attention
dropout included), float32 on the CPU, batch 1. Exported once by this process and saved; the cp
workers (gloo, ``hybrid_configs["cp_degree"]``) and the one-process run load that program, train one
SGD step on the same batch, and report the executor's own peak of live bytes (the measure DESIGN
gives memory on the CPU: every var, no kernel temporaries) beside `estimate_memory`'s prediction of
it. The cap is a byte count both sides are held to: the run "fits" when its peak is under it.

What makes one process large here is attention with dropout: the CPU's fused attention saves the
probabilities before and after dropout for the backward (2 x b x h x s x s floats per layer). The
ring saves, per worker, the log-sum-exp of its queries and a bool keep mask of its rows (b x h x
s/cp x s bytes). Not 1/cp: the causal mask each layer builds whole (b x s x s floats, as one process
builds it) before its rows are scattered, and the whole-mask draw of attention dropout inside the
kernel (a temporary, counted by neither side).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import LMLoss  # (common puts the repo on sys.path)

import metaopt  # before transformers (DESIGN: import order)
from metaopt import fleet
from metaopt.passes.memory_estimate import estimate_memory

MIB = 1 << 20


def build(a) -> tuple[torch.nn.Module, tuple]:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=128, n_embd=64, n_layer=2, n_head=2, n_positions=a.seq,
        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
    )  # fmt: skip
    module = LMLoss(transformers.GPT2LMHeadModel(cfg)).train()
    ids = torch.randint(0, 128, (1, a.seq), generator=torch.Generator().manual_seed(1))
    return module, (ids, ids)


def strategy(cp: int) -> fleet.DistributedStrategy:
    s = fleet.DistributedStrategy()
    if cp > 1:
        s.hybrid_configs = {"dp_degree": 1, "cp_degree": cp}
    return s


def step(a, program_path: str, cp: int) -> dict:
    """One SGD step of the saved program at degree `cp` (1: one process): peaks, measured and
    predicted, and the loss."""
    p = metaopt.load(program_path)
    opt = fleet.distributed_optimizer(metaopt.optimizer.SGD(learning_rate=1e-3), strategy(cp))
    opt.minimize(p.loss)
    _, inputs = build(a)
    exe = metaopt.Executor("cpu")
    metaopt.seed(0)
    start = time.perf_counter()
    (loss,) = exe.run(p, feed={"input_ids": inputs[0], "labels": inputs[1]}, fetch_list=[p.loss])
    seconds = time.perf_counter() - start
    est = estimate_memory(p, dims={"batch": 1}, workspace=False)
    return {
        "measured": exe.memory_stats()["last_run_peak_bytes"],
        "predicted": est.peak_bytes,
        "loss": float(loss),
        "seconds": seconds,
    }


def worker(a) -> None:
    rank = int(os.environ["RANK"])
    fleet.init(is_collective=True, strategy=strategy(a.cp))
    out = step(a, a.program, a.cp)
    Path(a.worker, f"rank{rank}.json").write_text(json.dumps(out))


def run_workers(a) -> list[dict]:
    out = tempfile.mkdtemp(prefix="long_context_")
    env0 = {**os.environ, "WORLD_SIZE": str(a.cp), "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1"}
    env0["MASTER_PORT"] = "29841"
    args = [f"--seq={a.seq}", f"--cp={a.cp}", f"--program={a.program}", "--worker", out]
    procs = [
        subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), *args],
            env={**env0, "RANK": str(r), "LOCAL_RANK": str(r)},
        )
        for r in range(a.cp)
    ]
    for p in procs:
        if p.wait(timeout=1800) != 0:
            raise SystemExit("a cp worker failed")
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(a.cp)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--cp", type=int, default=4)
    ap.add_argument("--cap-mib", type=int, default=1024)
    ap.add_argument("--program", help=argparse.SUPPRESS)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return 0
    from metaopt.frontend.onnx_save import save

    module, inputs = build(a)
    start = time.perf_counter()
    program = metaopt.export(module, inputs, name="gpt2_long", dynamic_batch=False)
    export_s = time.perf_counter() - start
    a.program = str(Path(tempfile.mkdtemp(prefix="long_context_")) / "gpt2_long.onnx")
    save(program, a.program)
    del program, module
    workers = run_workers(a)
    fleet.init(is_collective=True)  # one process: a world of one
    one = step(a, a.program, 1)
    cap = a.cap_mib * MIB
    rows = [{"run": "one process", **one}]
    rows += [{"run": f"cp {a.cp} rank {r}", **w} for r, w in enumerate(workers)]
    print(
        f"one SGD step of HF GPT-2 (2 layers, width 64, 2 heads, dropout 0.1) at sequence {a.seq}, batch 1, "
        f"float32, CPU; cap {a.cap_mib} MiB (export {export_s:.0f} s)"
    )
    print(f"{'run':>14} {'predicted MiB':>14} {'measured MiB':>13} {'fits':>5} {'loss':>9} {'step s':>7}")
    for r in rows:
        fits = "yes" if r["measured"] <= cap else "no"
        print(
            f"{r['run']:>14} {r['predicted'] / MIB:>14.1f} {r['measured'] / MIB:>13.1f} {fits:>5} "
            f"{r['loss']:>9.5f} {r['seconds']:>7.1f}"
        )
    worst = max(w["measured"] for w in workers)
    print(f"cp {a.cp} worker peak / one process peak: {worst / one['measured']:.3f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "cap_bytes": cap, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
