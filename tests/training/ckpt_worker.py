"""A worker of the checkpoint tests (test_checkpoints.py), started with RANK/WORLD_SIZE/MASTER_*.

argv: out_dir ckpt_dir layout phase
  layout: dp2 (data parallel: mlp, dropout 0.3, rank-seeded) | pp2 | pp4 (pipeline: gpt with its
          tied embedding across the first and last stage, dropout 0.1, rank-seeded)
          or, with phase loop, the number of saves
  phase:  straight  train STEPS steps, save, train STEPS more
          resume    load, train STEPS more (steps STEPS .. 2*STEPS-1)
          loop      (the kill tests) a hand-built program saved again and again, values = the step

Writes `<out>/<layout>.<phase>.rank<r>.pt`: the losses, the saved vars after training
("state") and the saved vars at the save ("at_save", straight) or right after the load
("loaded", resume).
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from dp_worker import full_batch  # noqa: E402

import metaopt  # noqa: E402
import programs  # noqa: E402
from metaopt import fleet  # noqa: E402
from metaopt.fleet import sharded_io  # noqa: E402

STEPS = 2
CUTS = {"pp2": ["transformer.h.1"], "pp4": ["transformer.h.0", "transformer.h.1", "transformer.ln_f"]}
LOOP_ELEMENTS = 1 << 20  # 4 MiB per worker and save: long enough for a kill to land mid-save


def build(layout: str) -> tuple[metaopt.Program, str]:
    name = "mlp" if layout in ("dp2", "single_mlp") else "gpt"
    mod = programs.get(name)
    dropout = 0.3 if name == "mlp" else 0.1
    model = mod.build("tiny", seed=0, dropout=dropout)
    main = metaopt.export(model, mod.example_inputs("tiny", 4, seed=1), name=name)
    strategy = fleet.DistributedStrategy()
    if layout in CUTS:
        strategy.pipeline = True
        strategy.pipeline_configs = {"accumulate_steps": 2, "schedule_mode": "1F1B", "cuts": CUTS[layout]}
    opt = fleet.distributed_optimizer(metaopt.optimizer.Adam(learning_rate=1e-2), strategy)
    opt.minimize(main.loss)
    return main, name


def feed(name: str, layout: str, step: int, rank: int, world: int) -> dict[str, torch.Tensor]:
    batch = full_batch(name, step)
    if layout == "dp2":  # each worker its share
        share = batch[0].shape[0] // world
        batch = tuple(x[rank * share : (rank + 1) * share] for x in batch)
    return dict(zip(programs.get(name).INPUT_NAMES, batch, strict=True))


def saved_state(exe: metaopt.Executor, main: metaopt.Program) -> dict[str, torch.Tensor]:
    return {v.name: exe.scope[v.name].clone() for v in sharded_io.saved_vars(main)}


def train(exe, main, name, layout, steps, rank, world) -> list[float | None]:
    losses = []
    for step in steps:
        (loss,) = exe.run(main, feed=feed(name, layout, step, rank, world), fetch_list=["loss"])
        losses.append(None if loss is None else float(loss))
    return losses


def run(out: str, ckpt: str, layout: str, phase: str, rank: int, world: int) -> None:
    metaopt.seed(1234 + rank)
    main, name = build(layout)
    exe = metaopt.Executor("cpu")
    result: dict = {}
    if phase == "straight":
        first = train(exe, main, name, layout, range(STEPS), rank, world)
        result["at_save"] = saved_state(exe, main)
        result["path"] = fleet.save_persistables(exe, ckpt, main)
        result["losses"] = first + train(exe, main, name, layout, range(STEPS, 2 * STEPS), rank, world)
    else:
        fleet.load_persistables(exe, ckpt, main)
        result["loaded"] = saved_state(exe, main)
        result["losses"] = train(exe, main, name, layout, range(STEPS, 2 * STEPS), rank, world)
    result["state"] = saved_state(exe, main)
    torch.save(result, f"{out}/{layout}.{phase}.rank{rank}.pt")


def loop_program() -> metaopt.Program:
    """Two params, no ops: all a save needs."""
    p = metaopt.Program("loop")
    n = LOOP_ELEMENTS
    p.add_var(metaopt.Var("w", "float32", (n,), "param", trainable=True), torch.zeros(n))
    p.add_var(metaopt.Var("b", "float32", (4,), "param", trainable=True), torch.zeros(4))
    return p


def loop(ckpt: str, rank: int, saves: int) -> None:
    """Save steps n+1, n+2, ... (`saves` times, or until killed); every value equals its step.
    One worker: the single-file format, else the sharded one."""
    main = loop_program()
    exe = metaopt.Executor("cpu")
    try:  # go on from the checkpoint there (either format), as a resumed job does
        fleet.load_persistables(exe, ckpt, main)
        start = int(exe.scope["w"][0]) + 1
    except FileNotFoundError:
        start = 1
    start = max(start, 1 + max(sharded_io.complete_steps(Path(ckpt)), default=0))
    for step in range(start, start + saves):
        for v in main.params():
            exe.scope[v.name] = torch.full(v.shape, float(step))
        fleet.save_persistables(exe, ckpt, main, step=step, keep_last=2)
        if rank == 0:
            print(f"saved {step}", flush=True)


def main() -> None:
    out, ckpt, layout, phase = sys.argv[1:5]
    fleet.init(is_collective=True)
    rank, world = fleet.worker_index(), fleet.worker_num()
    if phase == "loop":
        loop(ckpt, rank, int(layout))
    else:
        run(out, ckpt, layout, phase, rank, world)
    fleet.barrier_worker()


if __name__ == "__main__":
    main()
