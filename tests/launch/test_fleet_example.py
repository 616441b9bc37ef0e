"""Fleet's recompute example end to end under the launcher: 2 CPU workers, data parallel."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from test_launcher import ROOT, _env


def test_train_fleet_recompute_runs_under_metaoptrun(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "metaopt.launch",
        "--nproc_per_node=2",
        f"--log_dir={tmp_path / 'log'}",
        str(ROOT / "examples" / "train_fleet_recompute.py"),
        "--batches=3",
        "--batch_size=4",
        "--depths=2,2,2,2",  # ResNet-50's layout at half depth: the suite's time
    ]
    done = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "applied meta optimizers: ['recompute', 'data_parallel']" in out
    assert "recompute plan: 8 checkpoints" in out  # res2a, res2b ... res5a, res5b
    assert re.search(r"all_reduce ops: \d+, after fusion: 1", out)
    lines = re.findall(r"\[Epoch 0, batch (\d)\] loss: ([0-9.]+), acc1: [0-9.]+, acc5: [0-9.]+", out)
    assert [b for b, _ in lines] == ["0", "1", "2"]
    assert all(float(loss) > 0 for _, loss in lines)
    log1 = (tmp_path / "log" / "workerlog.1").read_text()  # the other worker trained too
    assert "[Epoch 0, batch 2]" in log1


# --slow (30 s): hybrid layouts train in the suite (tests/training/test_hybrid_pipeline.py)
@pytest.mark.slow
def test_train_hybrid_runs_under_metaoptrun(tmp_path):
    """examples/train_hybrid.py at dp=2 x mp=2 on 4 CPU workers: the model-parallel ranks of a
    replica compute one model (the same losses, bit for bit: replicated values are all-reduced
    alike), the two replicas see different batches."""
    cmd = [
        sys.executable,
        "-m",
        "metaopt.launch",
        "--nproc_per_node=4",
        f"--log_dir={tmp_path / 'log'}",
        str(ROOT / "examples" / "train_hybrid.py"),
        "--steps=2",
    ]
    done = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "tensor_parallel  run" in done.stdout
    losses = {}
    for r in range(4):
        log = (tmp_path / "log" / f"workerlog.{r}").read_text()
        found = re.findall(r"worker (\d) \(dp (\d), mp (\d)\) step (\d): loss ([0-9.]+)", log)
        assert [s for *_, s, _ in found] == ["0", "1"], log[-2000:]
        losses[r] = [loss for *_, loss in found]
    assert losses[0] == losses[1] and losses[2] == losses[3]  # MP peers: one model
    assert losses[0] != losses[2]  # DP replicas: other data
