"""kill -9 in the middle of saves, again and again: the last complete checkpoint always loads
whole (every value from one save), and the next save leaves no temp files behind."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from workers import start_workers

import metaopt
from metaopt import fleet
from metaopt.fleet import sharded_io

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
# Each kill starts fresh workers (torch import, export): ~8 s on 2 cores. The suite kills 4 times
# (6 took 78 s of it), --slow 12 times.
KILLS, SLOW_KILLS = 4, 12
FOREVER = "1000000"


def _wait_for(cond, what: str, procs, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            pytest.fail(f"{what}: a worker exited {dead[0].returncode}:\n{dead[0].communicate()[0][-3000:]}")
        if time.monotonic() > end:
            for p in procs:
                p.kill()
            pytest.fail(f"{what}: not within {timeout} s")
        time.sleep(0.005)


def _kill(procs) -> None:
    for p in procs:
        os.kill(p.pid, signal.SIGKILL)
    for p in procs:
        p.communicate(timeout=30)


def _loaded_values(ckpt: Path) -> tuple[float, int]:
    """Load the checkpoint into a fresh program: (the value every element has, step)."""
    import ckpt_worker

    main = ckpt_worker.loop_program()
    exe = metaopt.Executor("cpu")
    fleet.load_persistables(exe, ckpt, main)
    values = torch.cat([exe.scope["w"], exe.scope["b"]])
    assert torch.all(values == values[0]), "a checkpoint mixes values of two saves"
    return float(values[0]), len(values)


def _leftovers(ckpt: Path) -> list[str]:
    return sorted(p.name for p in ckpt.iterdir() if p.name.startswith("."))


def _job(tmp: Path, ckpt: Path, world: int, saves: str):
    args = [str(HERE / "ckpt_worker.py"), str(tmp), str(ckpt), saves, "loop"]
    if world > 1:
        return start_workers(world, args, {"METAOPT_COMM_TIMEOUT": "30"})
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parents[1]), str(HERE.parent), env.get("PYTHONPATH", "")])
    return [
        subprocess.Popen(
            [sys.executable, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
    ]


@pytest.mark.parametrize("world", [2, 1], ids=["sharded-2-workers", "one-file"])
def test_kill_9_during_saves_never_loses_the_last_checkpoint(tmp_path, world, request):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    rng = random.Random(world)
    newest, mid_save = 0.0, 0
    kills = SLOW_KILLS if request.config.getoption("--slow") else KILLS
    need = max(1, kills // 4)
    # `kills` kills, more (up to 3x) while too few of them have landed mid-save: where one lands
    # is chance (a save's share of the loop's time), and only those test the atomic write
    for i in range(3 * kills):
        if i >= kills and mid_save >= need:
            break
        before = _mtime(ckpt, world)
        procs = _job(tmp_path, ckpt, world, FOREVER)
        # wait for this job's first complete save, then kill at a random moment of later ones
        _wait_for(lambda b=before: _mtime(ckpt, world) > b, f"kill {i}: first save", procs)
        time.sleep(rng.uniform(0.0, 0.15))
        _kill(procs)
        mid_save += bool(_leftovers(ckpt))
        value, _ = _loaded_values(ckpt)
        assert value >= newest, f"kill {i}: the checkpoint went back from step {newest} to {value}"
        newest = value
        if world > 1:  # 'latest' names the step loaded; a kill may have come after a folder
            # was complete but before 'latest' named it: that one is newer, unnamed, harmless
            assert (ckpt / "latest").read_text().strip() == f"step-{int(value):08d}"
            assert sharded_io.complete_steps(ckpt)[-1] in (int(value), int(value) + 1)
    # The kills must have hit saves in progress, or this tested nothing.
    assert mid_save >= need, f"only {mid_save} of {i + 1} kills landed mid-save"
    procs = _job(tmp_path, ckpt, world, "1")  # one clean save: it removes every leftover
    for p in procs:
        out = p.communicate(timeout=120)[0]
        assert p.returncode == 0, out[-3000:]
    assert _leftovers(ckpt) == []
    assert _loaded_values(ckpt)[0] > newest or world == 1


def _mtime(ckpt: Path, world: int) -> float:
    target = ckpt / ("latest" if world > 1 else "persistables.pt")
    try:
        return target.stat().st_mtime_ns
    except FileNotFoundError:
        return 0
