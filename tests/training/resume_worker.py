"""Run by test_resume in a fresh process: load a checkpoint, train 5 more steps, save params."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import metaopt  # noqa: E402
from metaopt import fleet  # noqa: E402
from tests.training.test_resume import STEPS, batch, build  # noqa: E402


def main(ckpt: str, out: str) -> None:
    main_program = build()
    exe = metaopt.Executor("cpu")
    fleet.load_persistables(exe, ckpt, main_program)
    losses = [
        float(exe.run(main_program, feed=batch(s), fetch_list=[main_program.loss])[0])
        for s in range(STEPS, 2 * STEPS)
    ]
    state = {n: t.clone() for n, t in exe.scope.items()}
    torch.save({"losses": torch.tensor(losses, dtype=torch.float64), "state": state}, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
