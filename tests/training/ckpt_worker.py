"""A worker of the checkpoint tests (test_checkpoints.py), started with RANK/WORLD_SIZE/MASTER_*.

argv: out_dir ckpt_dir layout phase
  layout: dp2 (data parallel: mlp, dropout 0.3, rank-seeded) | pp2 | pp4 (pipeline: gpt with its
          tied embedding across the first and last stage, dropout 0.1, rank-seeded)
          | mp2 (tensor parallel: gpt, MP=2 with tp_worker's column/row layers, dropout 0,
          Momentum, every worker fed the whole batch)
          or, with phase loop, the number of saves
  phase:  straight  train STEPS steps, save, train STEPS more
          resume    load, train STEPS more (steps STEPS .. 2*STEPS-1); first, where <ckpt>_tampered
                    exists, each damaged copy there ("refusals", tests/ckpt_tamper.py)
          from_one  (mp2) load what one process saved after STEPS steps: first a checkpoint of
                    the wrong shape (<ckpt>_bad, refused), then the sharded one (<ckpt>_sharded),
                    then the one file (<ckpt>); train STEPS more; then drop one split param's
                    layout and save (<ckpt>_unmarked: refused, "unmarked")
          loop      (the kill tests) a hand-built program saved again and again, values = the step

Writes `<out>/<layout>.<phase>.rank<r>.pt`: the losses, the saved vars after training
("state") and the saved vars at the save ("at_save", straight) or right after the load
("loaded", resume), each split var's layout ("splits": name -> (axis, parts, blocks)).
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

import ckpt_tamper  # noqa: E402
import export_cache  # noqa: E402
import torch  # noqa: E402
import tp_worker  # noqa: E402
from dp_worker import full_batch  # noqa: E402

import metaopt  # noqa: E402
import programs  # noqa: E402
from metaopt import fleet  # noqa: E402
from metaopt.fleet import sharded_io  # noqa: E402

STEPS = 2
MP_LAYOUTS = ("mp2", "single_mp")  # tensor parallel and its one-process twin: same model, optimizer
CUTS = {"pp2": ["transformer.h.1"], "pp4": ["transformer.h.0", "transformer.h.1", "transformer.ln_f"]}
LOOP_ELEMENTS = 1 << 20  # 4 MiB per worker and save: long enough for a kill to land mid-save


def strategy(layout: str) -> fleet.DistributedStrategy:
    s = fleet.DistributedStrategy()
    if layout in CUTS:
        s.pipeline = True
        s.pipeline_configs = {"accumulate_steps": 2, "schedule_mode": "1F1B", "cuts": CUTS[layout]}
    if layout == "mp2":  # fleet.init lays the two workers out as one model-parallel group
        s.hybrid_configs = {"mp_degree": 2}
        s.tensor_parallel = True
        s.tensor_parallel_configs = {"column": tp_worker.COLUMN["gpt"], "row": tp_worker.ROW["gpt"]}
    return s


def build(layout: str) -> tuple[metaopt.Program, str]:
    name = "mlp" if layout in ("dp2", "single_mlp") else "gpt"
    mod = programs.get(name)
    # tensor parallel refuses dropout in its split regions (no MP-aware RNG yet): 0 there
    dropout = 0.3 if name == "mlp" else 0.0 if layout in MP_LAYOUTS else 0.1
    model = mod.build("tiny", seed=0, dropout=dropout)
    main = export_cache.export(model, mod.example_inputs("tiny", 4, seed=1), name=name)
    # Momentum under tensor parallel: state to split, and params after its steps are a fair judge
    # of MP=2 against one process (Adam's are not: it turns float noise into lr-sized updates)
    opt = metaopt.optimizer.Momentum(learning_rate=0.1) if layout in MP_LAYOUTS else None
    opt = opt or metaopt.optimizer.Adam(learning_rate=1e-2)
    fleet.distributed_optimizer(opt, strategy(layout)).minimize(main.loss)
    return main, name


def splits(main: metaopt.Program) -> dict[str, tuple]:
    """name -> (axis, parts, blocks) of every saved var that holds one worker's part."""
    return {
        v.name: (v.split.axis, v.split.parts, v.split.blocks)
        for v in sharded_io.saved_vars(main)
        if v.split is not None
    }


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
    result["splits"] = splits(main)
    if phase == "straight":
        first = train(exe, main, name, layout, range(STEPS), rank, world)
        result["at_save"] = saved_state(exe, main)
        result["path"] = fleet.save_persistables(exe, ckpt, main)
        result["losses"] = first + train(exe, main, name, layout, range(STEPS, 2 * STEPS), rank, world)
    elif phase == "from_one":
        try:
            fleet.load_persistables(exe, f"{ckpt}_bad", main)
        except sharded_io.CheckpointError as e:
            result["refused"] = str(e)
        result["untouched"] = not exe.scope  # the refusal changed nothing (no value was there yet)
        fleet.load_persistables(exe, f"{ckpt}_sharded", main)
        result["loaded_sharded"] = saved_state(exe, main)
        fleet.load_persistables(exe, ckpt, main)
        result["loaded"] = saved_state(exe, main)
        result["losses"] = train(exe, main, name, layout, range(STEPS, 2 * STEPS), rank, world)
        # a split param whose layout a pass forgot: its parts differ, so the save must refuse it
        main.vars["transformer.h.0.attn.c_attn.weight"].split = None
        try:
            fleet.save_persistables(exe, f"{ckpt}_unmarked", main)
        except NotImplementedError as e:
            result["unmarked"] = str(e)
    else:
        tampered = Path(f"{ckpt}_tampered")  # damaged copies (tests/ckpt_tamper.py): each refused first
        if tampered.is_dir():
            result["refusals"] = ckpt_tamper.refusals(exe, main, tampered)
            result["untouched"] = not exe.scope
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
    fleet.init(is_collective=True, strategy=strategy(layout) if layout == "mp2" else None)
    rank, world = fleet.worker_index(), fleet.worker_num()
    if phase == "loop":
        loop(ckpt, rank, int(layout))
    else:
        run(out, ckpt, layout, phase, rank, world)
    fleet.barrier_worker()


if __name__ == "__main__":
    main()
