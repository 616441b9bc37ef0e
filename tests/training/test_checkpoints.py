"""Checkpoints of multi-worker jobs (metaopt.fleet.sharded_io): every worker saves its part
under one folder, a resumed job continues bit for bit, and the checkpoint loads into other
layouts (one process, a differently cut pipeline) by var name and full shape."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_data_parallel import _start_workers

import metaopt
from metaopt import fleet
from metaopt.fleet import env, sharded_io

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))


def _job(tmp: Path, world: int, layout: str, phase: str, ckpt: Path) -> list[dict]:
    procs = _start_workers(
        world,
        [str(HERE / "ckpt_worker.py"), str(tmp), str(ckpt), layout, phase],
        {"METAOPT_COMM_TIMEOUT": "60"},
    )
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{layout} {phase}: workers did not finish in 300 s")
    failed = [(r, log) for r, (p, log) in enumerate(zip(procs, logs, strict=True)) if p.returncode]
    assert not failed, "\n".join(f"worker {r}:\n{log[-3000:]}" for r, log in failed)
    return [torch.load(tmp / f"{layout}.{phase}.rank{r}.pt", weights_only=True) for r in range(world)]


def _assert_bitwise(got: dict, want: dict, what: str) -> None:
    assert got["losses"] == want["losses"][len(want["losses"]) // 2 :], what
    assert set(got["state"]) == set(want["state"]), what
    for name, t in want["state"].items():
        assert torch.equal(got["state"][name], t), f"{what}: {name}"


def _load_in_one_process(ckpt: Path, layout: str) -> dict[str, torch.Tensor]:
    """Load the checkpoint into the one-process program of the same model; its saved vars."""
    import ckpt_worker

    env.reset()
    fleet.init()
    metaopt.seed(0)
    main, _ = ckpt_worker.build("single_mlp" if layout == "dp2" else "single_gpt")
    exe = metaopt.Executor("cpu")
    fleet.load_persistables(exe, ckpt, main)
    return ckpt_worker.saved_state(exe, main)


def test_data_parallel_saves_one_checkpoint_and_resumes_bitwise(tmp_path):
    ckpt = tmp_path / "ckpt"
    straight = _job(tmp_path, 2, "dp2", "straight", ckpt)
    assert Path(straight[0]["path"]) == ckpt / "step-00000002" == ckpt / (ckpt / "latest").read_text().strip()
    resumed = _job(tmp_path, 2, "dp2", "resume", ckpt)
    for r in range(2):  # dropout 0.3 draws from each worker's restored generator
        _assert_bitwise(resumed[r], straight[r], f"dp worker {r}")
    # into one process: every var as the job held it at the save (replicas are equal)
    state = _load_in_one_process(ckpt, "dp2")
    assert set(state) == set(straight[0]["at_save"])
    for name, t in straight[0]["at_save"].items():
        assert torch.equal(state[name], t), name
    assert not [p.name for p in ckpt.iterdir() if p.name.startswith(".")]


def test_pipeline_checkpoint_loads_into_the_same_one_process_and_other_cuts(tmp_path):
    ckpt = tmp_path / "ckpt"
    straight = _job(tmp_path, 2, "pp2", "straight", ckpt)
    at_save = {k: t for r in straight for k, t in r["at_save"].items()}
    # a tied param is held by the stages reading it, equal on both
    for k in set(straight[0]["at_save"]) & set(straight[1]["at_save"]):
        assert torch.equal(straight[0]["at_save"][k], straight[1]["at_save"][k]), k
    resumed = _job(tmp_path, 2, "pp2", "resume", ckpt)
    for r in range(2):
        _assert_bitwise(resumed[r], straight[r], f"pipeline stage {r}")

    one = _load_in_one_process(ckpt, "pp2")
    assert set(one) == set(at_save)
    for name, t in at_save.items():
        assert torch.equal(one[name], t), name

    four = _job(tmp_path, 4, "pp4", "resume", ckpt)  # loads, then trains STEPS steps
    assert {k for r in four for k in r["loaded"]} == set(at_save)
    for r, result in enumerate(four):
        for name, t in result["loaded"].items():
            assert torch.equal(t, at_save[name]), f"4-stage worker {r}: {name}"
    assert all(torch.isfinite(torch.tensor(four[3]["losses"])))


def test_a_checkpoint_of_another_layout_must_hold_every_var(tmp_path):
    """The mlp checkpoint of a dp job does not fit gpt: named refusal, nothing loaded."""
    ckpt = tmp_path / "ckpt"
    _job(tmp_path, 2, "dp2", "straight", ckpt)
    import ckpt_worker

    env.reset()
    fleet.init()
    main, _ = ckpt_worker.build("single_gpt")
    exe = metaopt.Executor("cpu")
    with pytest.raises(sharded_io.CheckpointError, match=r"has no var 'transformer\..*which program needs"):
        fleet.load_persistables(exe, ckpt, main)
    assert not exe.scope
