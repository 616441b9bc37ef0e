"""One tensor-parallel worker (started by tests/passes/test_tensor_parallel.py with RANK/WORLD_SIZE/
MASTER_*): for each reference program named on the command line, exports it (same seed on every
rank), applies the tensor-parallel pass for its rank (mp_degree = world size, group = every
rank), trains 3 SGD steps on the same full batch as every other rank, and writes its losses and
(local) params to `<out>/<name>.rank<r>.pt`."""

from __future__ import annotations

import sys

import torch
from training_cases import HELD_OUT, batch, evaluate, export  # noqa: F401 - this module's API, shared

import metaopt
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
    evals = evaluate(exe, program, batch(name, HELD_OUT), program.loss_name)  # issue 49
    return {
        "losses": losses,
        "eval": evals,
        "params": {v.name: exe.scope[v.name].clone() for v in program.params()},
    }


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
