"""One tensor-parallel worker (started by tests/passes/test_tensor_parallel.py with RANK/WORLD_SIZE/
MASTER_*): for each reference program named on the command line, exports it (same seed on every
rank), applies the tensor-parallel pass for its rank (mp_degree = world size, group = every
rank), trains 3 SGD steps on the same full batch as every other rank, and writes its losses and
(local) params to `<out>/<name>.rank<r>.pt`."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import export_cache
import torch

import metaopt
import programs
from metaopt import fleet
from metaopt.passes.tensor_parallel import plan_tensor_parallel, tensor_parallel

STEPS = 3
BATCH = 8
LR = 0.1
SEED = 0
COLUMN = {
    "gpt": ["transformer.h.*.attn.c_attn", "transformer.h.*.mlp.c_fc"],
    # Hugging Face GPT-2 from the zoo: Conv1D layers (Gemm with an [in, out] weight between Reshapes)
    "hf-gpt2": ["m.transformer.h.*.attn.c_attn", "m.transformer.h.*.mlp.c_fc"],
    # LLaMA: bias-free projections (fused into Linear), rotary q and k (Rotary), 2 KV heads
    # repeated over 4 query heads (repeat_kv's Slice, Unsqueeze, Expand), SwiGLU
    "hf-llama": [
        f"m.model.layers.*.{n}" for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    ]
    + ["m.model.layers.*.mlp.gate_proj", "m.model.layers.*.mlp.up_proj"],
    "bert": [
        "bert.encoder.layer.*.attention.self.query",
        "bert.encoder.layer.*.attention.self.key",
        "bert.encoder.layer.*.attention.self.value",
        "bert.encoder.layer.*.intermediate.dense",
    ],
}
ROW = {
    "gpt": ["transformer.h.*.attn.c_proj", "transformer.h.*.mlp.c_proj"],
    "hf-gpt2": ["m.transformer.h.*.attn.c_proj", "m.transformer.h.*.mlp.c_proj"],
    "hf-llama": ["m.model.layers.*.self_attn.o_proj", "m.model.layers.*.mlp.down_proj"],
    "bert": ["bert.encoder.layer.*.attention.output.dense", "bert.encoder.layer.*.output.dense"],
}


def _zoo(name: str):
    """A zoo entry (tests/zoo) for a "hf-..." name: the Hugging Face models built tiny."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from zoo import harness, models

    return harness, models.get(name)


@functools.cache
def _feed_names(name: str) -> list[str]:
    harness, entry = _zoo(name)
    return harness.feed_names(entry.build(0.0), 8)


def export(name: str) -> metaopt.Program:
    if name.startswith("hf-"):
        harness, entry = _zoo(name)
        torch.manual_seed(SEED)
        return harness.export(entry, 0.0)[1]
    mod = programs.get(name)
    model = mod.build("tiny", seed=SEED, dropout=0.0)
    return export_cache.export(model, mod.example_inputs("tiny", 4, seed=1), name=name)


def batch(name: str, step: int) -> dict[str, torch.Tensor]:
    """The step's full batch (every MP rank is fed all of it)."""
    if name.startswith("hf-"):
        inputs = _zoo(name)[1].inputs(BATCH, 10 + step)
        return dict(zip(_feed_names(name)[: len(inputs)], inputs, strict=True))
    mod = programs.get(name)
    return dict(zip(mod.INPUT_NAMES, mod.example_inputs("tiny", BATCH, seed=10 + step), strict=True))


def plan(program: metaopt.Program, name: str, rank: int, world: int):
    return plan_tensor_parallel(
        program, mp_degree=world, mp_rank=rank, column=COLUMN[name], row=ROW[name], group=list(range(world))
    )


def train(program: metaopt.Program, name: str, opt: str = "sgd") -> dict:
    """3 SGD (or Adam) steps; the losses and the final params (as this process holds them)."""
    optimizer = (
        metaopt.optimizer.SGD(learning_rate=LR)
        if opt == "sgd"
        else metaopt.optimizer.Adam(learning_rate=1e-2)
    )
    optimizer.minimize(program.loss)
    exe = metaopt.Executor("cpu")
    losses = []
    for step in range(STEPS):
        (loss,) = exe.run(program, feed=batch(name, step), fetch_list=[program.loss])
        losses.append(float(loss))
    return {"losses": losses, "params": {v.name: exe.scope[v.name].clone() for v in program.params()}}


def main() -> None:
    out, names = sys.argv[1], sys.argv[2:]
    fleet.init(is_collective=True)
    rank, world = fleet.worker_index(), fleet.worker_num()
    for name in names:
        exported = export(name)
        for opt in ("sgd", "adam"):
            program = tensor_parallel(exported, plan=plan(exported, name, rank, world))
            suffix = "" if opt == "sgd" else ".adam"
            torch.save(train(program, name, opt), f"{out}/{name}{suffix}.rank{rank}.pt")
    fleet.barrier_worker()


if __name__ == "__main__":
    main()
