"""One pipeline worker (started by test_pipeline.py with RANK/WORLD_SIZE/MASTER_*).

argv: out dir, then cases "name:schedule:micro_batches:mode" (mode: plain | recompute |
offload | tied | check: METAOPT_PIPELINE_CHECK=1 on every worker | check1: on worker 0 only |
shrink: the second step's batch is half the others', as an epoch's smaller last batch). For
each case: export the model (same seed on every worker), split it into
stages with fleet's pipeline meta optimizer, train STEPS Adam steps on the full batch
(each worker is fed the whole batch; micro-batches are cut by the runtime) and write the
losses (last stage), this worker's params and each step's pipeline traffic (messages,
those with a header) to `<out>/<case>.rank<r>.pt`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys

import export_cache
import torch
from dp_worker import BATCH, full_batch

import metaopt
import programs
from metaopt import fleet
from metaopt.runtime.comm import CHECK_ENV
from metaopt.runtime.pipeline import last_step_profile

STEPS = 3
CUTS = {  # where stage k begins, for 2 and 4 stages
    ("mlp", 2): ["fc2"],
    ("mlp", 4): ["relu1", "fc2", "fc3"],
    ("mlp", 8): ["relu1", "dropout1", "fc2", "relu2", "dropout2", "fc3", "loss"],
    ("bert", 2): ["bert.encoder.layer.1"],
    ("bert", 4): ["bert.encoder.layer.0", "bert.encoder.layer.1", "cls"],
    ("gpt", 2): ["transformer.h.1"],
    ("gpt", 4): ["transformer.h.0", "transformer.h.1", "transformer.ln_f"],
}
# mode "tied": two layers' query weights declared one param (pipeline_configs["shared"])
TIED_QUERY = [
    "bert.encoder.layer.0.attention.self.query.weight",
    "bert.encoder.layer.1.attention.self.query.weight",
]
CHECKPOINTS = {"mlp": ["fc1", "fc2"], "bert": ["bert.encoder.layer.*"], "gpt": ["transformer.h.*"]}
# the model's output the last stage's evaluation fetches beside the loss (issue 49)
LOGITS = {"mlp": "fc3", "bert": "cls.predictions", "gpt": "lm_head"}
HELD_OUT = 100  # full_batch's seed of the evaluation batch


def evaluate(exe: metaopt.Executor, main: metaopt.Program, name: str, last: bool) -> dict:
    """Issue 49: the stage program's `clone(for_test=True)` (a forward-only schedule), fed the
    whole held-out batch: its loss twice and, on the stage holding it, the model's logits (every
    micro-batch's, put together), None elsewhere."""
    test = main.clone(for_test=True)
    feed = dict(zip(programs.get(name).INPUT_NAMES, full_batch(name, HELD_OUT), strict=True))
    fetch = ["loss", LOGITS[name]] if last else ["loss"]
    first, *logits = exe.run(test, feed=feed, fetch_list=fetch)
    (second,) = exe.run(test, feed=feed, fetch_list=["loss"])
    return {
        "losses": [None if x is None else float(x) for x in (first, second)],
        "logits": torch.as_tensor(logits[0]) if logits else None,
    }


def step_batch(name: str, step: int, mode: str) -> tuple[torch.Tensor, ...]:
    """The step's whole batch; mode "shrink" halves the second step's (every worker alike)."""
    batch = full_batch(name, step)
    return tuple(x[: x.shape[0] // 2] for x in batch) if mode == "shrink" and step == 1 else batch


@contextlib.contextmanager
def check_switch(mode: str, rank: int):
    """METAOPT_PIPELINE_CHECK=1 while the case runs: on every worker ("check") or on worker
    0 only ("check1": the workers' step signatures differ, so all messages keep headers)."""
    on = mode == "check" or (mode == "check1" and rank == 0)
    old = os.environ.get(CHECK_ENV)
    if on:
        os.environ[CHECK_ENV] = "1"
    try:
        yield
    finally:
        if on and old is None:
            del os.environ[CHECK_ENV]
        elif on:
            os.environ[CHECK_ENV] = old


@functools.cache
def exported(name: str) -> metaopt.Program:
    mod = programs.get(name)
    model = mod.build("tiny", seed=0, dropout=0.0)
    return export_cache.export(model, mod.example_inputs("tiny", 4, seed=1), name=name)


def train_case(case: str, rank: int, world: int) -> dict:
    """case = name:schedule:micro_batches:mode[:chunks[:steps[:dp_degree]]]"""
    name, schedule, m, mode, *rest = case.split(":")
    chunks = int(rest[0]) if rest else 1
    steps = int(rest[1]) if len(rest) > 1 else STEPS
    dp = int(rest[2]) if len(rest) > 2 else 1
    stages = world // dp
    mod = programs.get(name)
    main = exported(name).clone()
    strategy = fleet.DistributedStrategy()
    strategy.pipeline = True
    strategy.pipeline_configs = {
        "accumulate_steps": int(m),
        "schedule_mode": schedule,
        "cuts": CUTS[(name, stages * chunks)],
        "chunks": chunks,
        "dp_degree": dp,
        "shared": [TIED_QUERY] if mode == "tied" else [],
        # Fleet's micro_batch_size where every step feeds the whole batch alike (checked at each run)
        "micro_batch_size": BATCH // int(m) if mode != "shrink" and dp == 1 and BATCH % int(m) == 0 else None,
    }
    if mode in ("recompute", "offload"):
        strategy.recompute = True
        strategy.recompute_configs = {"checkpoints": CHECKPOINTS[name], "enable_offload": mode == "offload"}
    opt = fleet.distributed_optimizer(metaopt.optimizer.Adam(learning_rate=1e-2), strategy)
    opt.minimize(main.loss)
    exe = metaopt.Executor("cpu")
    losses, traffic = [], []
    for step in range(steps):
        batch = step_batch(name, step, mode)
        replica, share = rank // stages, batch[0].shape[0] // dp
        part = [x[replica * share : (replica + 1) * share] for x in batch]
        feed = dict(zip(mod.INPUT_NAMES, part, strict=True))
        with check_switch(mode, rank):
            (loss,) = exe.run(main, feed=feed, fetch_list=["loss"])
        losses.append(None if loss is None else float(loss))
        prof = last_step_profile(exe, main)
        traffic.append((prof.messages, prof.headers, len(prof.actions)))
    params = {v.name: exe.scope[v.name].clone() for v in main.params()}
    evals = evaluate(exe, main, name, last=main.loss_name is not None)
    return {"losses": losses, "eval": evals, "params": params, "program": str(main), "traffic": traffic}


def main() -> None:
    out, cases = sys.argv[1], sys.argv[2:]
    fleet.init(is_collective=True)
    rank, world = fleet.worker_index(), fleet.worker_num()
    for case in cases:
        torch.save(train_case(case, rank, world), f"{out}/{case}.rank{rank}.pt")
    fleet.barrier_worker()


if __name__ == "__main__":
    main()
