"""examples/train_static.py's --resume continues (issue 32): 4 steps, save, then a fresh
process resuming to 8, ends with the params and optimizer state of 8 steps straight, bitwise
(CPU: the checkpoint holds the params, the optimizer state and step, and the RNG state; the
data follows the step). It used to start over at step 0 on the old data. The straight run
evaluates with --eval-every (issue 49), which must not change a bit of training."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "examples" / "train_static.py")
ENV = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "OMP_NUM_THREADS": "1"}
ENV.pop("MASTER_ADDR", None)


def _train(*args: str) -> str:
    cmd = [sys.executable, SCRIPT, "--program", "mlp", "--log-every", "4", *args]
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout + done.stderr


def _last_loss(out: str) -> str:
    return re.findall(r"step 8: loss ([0-9.]+)", out)[-1]


def _saved(folder: Path) -> dict[str, torch.Tensor]:
    return torch.load(folder / "persistables.pt", weights_only=True)["tensors"]


def test_resume_continues_where_the_checkpoint_left_off(tmp_path):
    # the straight run evaluates a held-out batch at steps 4 and 8 (issue 49), the others never:
    # evaluating changes nothing of training (no RNG drawn, no state), so the bits still agree
    straight = _train("--steps", "8", "--save", str(tmp_path / "straight"), "--eval-every", "4")
    evals = re.findall(r"step (\d): train loss ([0-9.]+), eval loss ([0-9.]+)", straight)
    assert [e[0] for e in evals] == ["4", "8"] and evals[0][2] != evals[1][2], evals
    _train("--steps", "4", "--save", str(tmp_path / "half"))
    resumed = _train("--steps", "8", "--resume", str(tmp_path / "half"), "--save", str(tmp_path / "resumed"))
    assert "resumed from" in resumed and "at step 4" in resumed
    assert "step 4: loss" not in resumed  # it did not start over
    assert _last_loss(resumed) == _last_loss(straight)
    want, got = _saved(tmp_path / "straight"), _saved(tmp_path / "resumed")
    assert want.keys() == got.keys() and int(got["global_step"]) == 8
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--batch", "-4", "-4 is not >= 1"),
        ("--log-every", "0", "0 is not >= 1"),
        ("--steps", "-1", "-1 is not >= 1"),
    ],
)
def test_train_static_refuses_bad_flags_by_name(monkeypatch, capsys, flag, value, message):
    """Before (issue 47): --batch -4 was a raw torch error, --log-every 0 a ZeroDivisionError,
    --steps -1 exited 0 after 0 steps."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_static", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(sys, "argv", ["train_static.py", flag, value])
    with pytest.raises(SystemExit) as e:
        script.main()
    assert e.value.code == 2
    assert f"argument {flag}: {message}" in capsys.readouterr().err
