"""Export a torch model to a metaopt Program, print it, run it and show the memory figures.

    python examples/quickstart.py [--program bert] [--steps 3] [--batch 8]

The forward runs on metaopt's executor and is checked against the torch module
each step. (Training steps — append_backward and the optimizers — are the next
capability; see the README's status section.)
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import metaopt  # noqa: E402
import programs  # noqa: E402
from metaopt.cli import summary  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--program", default="bert", choices=sorted(programs.REGISTRY))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    mod = programs.get(args.program)
    model = mod.build("tiny", seed=0, dropout=0.1)  # train mode: Dropout stays random
    main_program = metaopt.export(model, mod.example_inputs("tiny", 4), name=args.program)
    loss = main_program.loss
    print(main_program)
    print(summary(main_program, args.batch))

    exe = metaopt.Executor(args.device)
    for step in range(args.steps):
        batch = mod.example_inputs("tiny", args.batch, seed=100 + step)
        feed = dict(zip(mod.INPUT_NAMES, batch, strict=True))
        metaopt.seed(step)
        (loss_value,) = exe.run(main_program, feed=feed, fetch_list=[loss])
        print(f"step {step}: loss {float(loss_value):.6f}")
    stats = exe.memory_stats()
    act = stats["peak_bytes"] - stats["persistable_bytes"]
    print(
        f"memory: peak {stats['peak_bytes']:,} B (persistables {stats['persistable_bytes']:,} B, "
        f"activations {act:,} B), host peak {stats['host_peak_bytes']:,} B"
    )
    # Dropout masks come from the same RNG but in another order than torch's, so the
    # check against torch runs with dropout off.
    check = mod.build("tiny", seed=0, dropout=0.0)
    ref = metaopt.export(check, mod.example_inputs("tiny", 4), name=args.program)
    feed = dict(zip(mod.INPUT_NAMES, mod.example_inputs("tiny", args.batch, seed=7), strict=True))
    (ours,) = metaopt.Executor(args.device).run(ref, feed=feed, fetch_list=[ref.loss])
    with torch.no_grad():
        theirs = check(*feed.values()).item()
    print(f"dropout off: metaopt {float(ours):.7f} vs torch {theirs:.7f}")


if __name__ == "__main__":
    main()
