"""Export a torch model, let fleet rewrite it for training, print the program, train a few steps.

    python examples/quickstart.py [--program bert] [--steps 5] [--batch 8] [--full]

What it shows: the training program in the golden text format (forward, backward,
optimizer ops), the module outputs a user can pick as recompute checkpoints, the loss
of each step, and the executor's memory figures (peak of live bytes, persistables).
The first step is checked against torch (same module, same batch, dropout off).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import metaopt  # noqa: E402
import programs  # noqa: E402
from metaopt import fleet  # noqa: E402
from metaopt.cli import summary  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--program", default="bert", choices=sorted(programs.REGISTRY))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--full", action="store_true", help="print every line of the program, not just its head")
    args = ap.parse_args()

    fleet.init(is_collective=True)
    mod = programs.get(args.program)
    model = mod.build("tiny", seed=0, dropout=0.0)  # train mode; dropout off for the torch check
    main_program = metaopt.export(model, mod.example_inputs("tiny", 2), name=args.program)
    loss = main_program.loss

    strategy = fleet.DistributedStrategy()
    opt = fleet.distributed_optimizer(metaopt.optimizer.Adam(learning_rate=1e-3), strategy)
    optimize_ops, params_grads = opt.minimize(loss)  # rewrites main_program in place

    text = str(main_program)
    lines = text.splitlines()
    print(text if args.full or len(lines) <= 80 else "\n".join([*lines[:40], "  ...", *lines[-30:]]))
    print(summary(main_program, args.batch))
    print(f"{len(params_grads)} (param, grad) pairs, {len(optimize_ops)} optimize ops\n")

    exe = metaopt.Executor(args.device)
    reference = mod.build("tiny", seed=0, dropout=0.0)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-3)
    for step in range(args.steps):
        batch = mod.example_inputs("tiny", args.batch, seed=100 + step)
        (loss_value,) = exe.run(
            main_program, feed=dict(zip(mod.INPUT_NAMES, batch, strict=True)), fetch_list=[loss]
        )
        ref_opt.zero_grad()
        ref_loss = reference(*batch)
        ref_loss.backward()
        ref_opt.step()
        print(
            f"step {step}: loss {float(loss_value):.6f}   (torch eager + torch.optim: {ref_loss.item():.6f})"
        )
    stats = exe.memory_stats()
    act = stats["peak_bytes"] - stats["persistable_bytes"]
    print(
        f"memory: peak {stats['peak_bytes']:,} B = persistables {stats['persistable_bytes']:,} B "
        f"+ activations/grads {act:,} B; host peak {stats['host_peak_bytes']:,} B"
    )


if __name__ == "__main__":
    main()
