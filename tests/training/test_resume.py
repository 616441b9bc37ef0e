"""Resume: 10 straight steps == 5 steps + save + fresh process + load + 5 steps, bitwise (CPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

import metaopt
from metaopt import fleet

ROOT = Path(__file__).resolve().parents[2]
STEPS = 5


def build() -> metaopt.Program:
    """The tiny mlp with dropout 0.3 (so the RNG state matters), Adam with warmup."""
    sys.path.insert(0, str(ROOT))
    import programs

    mod = programs.get("mlp")
    p = metaopt.export(mod.build("tiny", seed=0, dropout=0.3), mod.example_inputs("tiny", 4), name="mlp")
    schedule = metaopt.optimizer.lr.LinearWarmupDecay(1e-2, warmup_steps=3, total_steps=20)
    metaopt.optimizer.Adam(learning_rate=schedule).minimize(p.loss)
    return p


def batch(step: int) -> dict[str, torch.Tensor]:
    import programs

    mod = programs.get("mlp")
    return dict(zip(mod.INPUT_NAMES, mod.example_inputs("tiny", 8, seed=step), strict=True))


def test_resume_in_a_fresh_process_is_bitwise(tmp_path):
    metaopt.seed(1234)
    straight = build()
    exe = metaopt.Executor("cpu")
    losses = [
        float(exe.run(straight, feed=batch(s), fetch_list=[straight.loss])[0]) for s in range(2 * STEPS)
    ]

    metaopt.seed(1234)
    first = build()
    exe2 = metaopt.Executor("cpu")
    for s in range(STEPS):
        exe2.run(first, feed=batch(s), fetch_list=[first.loss])
    fleet.save_persistables(exe2, tmp_path / "ckpt", first)
    out = tmp_path / "resumed.pt"
    subprocess.run(
        [sys.executable, str(Path(__file__).with_name("resume_worker.py")), str(tmp_path / "ckpt"), str(out)],
        check=True,
        timeout=300,
        cwd=ROOT,
    )
    resumed = torch.load(out, weights_only=True)

    assert resumed["losses"].tolist() == losses[STEPS:]
    assert set(resumed["state"]) == set(exe.scope)
    for name, t in exe.scope.items():
        assert torch.equal(resumed["state"][name], t), name
    assert int(exe.scope["global_step"]) == 2 * STEPS
