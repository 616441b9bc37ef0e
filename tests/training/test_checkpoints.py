"""Checkpoints of multi-worker jobs (metaopt.fleet.sharded_io): every worker saves its part
under one folder, a resumed job continues bit for bit, and the checkpoint loads into other
layouts (one process, a differently cut pipeline, MP=2 <-> MP=1) by var name and full shape."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import ckpt_tamper
import pytest
import torch
from workers import start_workers

import metaopt
from metaopt import fleet
from metaopt.fleet import env, sharded_io
from metaopt.passes.tensor_parallel import shard_tensor, unshard

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

# Tensor parallel against one process: the all-reduces sum partial products in another order
# than one matmul, a few ulps per step (the bar of tests/fleet/test_fleet_tensor_parallel.py).
TP_TOL = {"rtol": 1e-5, "atol": 4e-5}


def _job(tmp: Path, world: int, layout: str, phase: str, ckpt: Path) -> list[dict]:
    procs = start_workers(
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
    single = {"dp2": "single_mlp", "mp2": "single_mp"}.get(layout, "single_gpt")
    main, _ = ckpt_worker.build(single)
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


# --- tensor parallel: MP=2 <-> MP=1 ---------------------------------------------------------------


def _one_process_mp_twin(steps: range, exe=None, main=None):
    """The one-process twin of the mp2 job (same export, Momentum, whole batches): `steps` trained
    on a fresh program, or on `exe`/`main` as they are; returns (exe, main, losses)."""
    import ckpt_worker

    if main is None:
        env.reset()
        fleet.init()
        main, _ = ckpt_worker.build("single_mp")
        exe = metaopt.Executor("cpu")
    losses = ckpt_worker.train(exe, main, "gpt", "single_mp", steps, 0, 1)
    return exe, main, losses


def _whole(ranks: list[dict], key: str) -> dict[str, torch.Tensor]:
    """The MP ranks' `key` state as one process holds it: split vars put back together."""
    out = {}
    for name, t in ranks[0][key].items():
        layout = ranks[0]["splits"].get(name)
        if layout is None:  # replicated: the same on every MP rank
            assert all(torch.equal(r[key][name], t) for r in ranks), name
            out[name] = t
        else:
            axis, parts, blocks = layout
            assert parts == len(ranks)
            out[name] = unshard([r[key][name] for r in ranks], axis, blocks)
    return out


def _ckpt_worker():
    import ckpt_worker

    return ckpt_worker


def test_tensor_parallel_checkpoint_resumes_bitwise_and_loads_into_one_process(tmp_path):
    w = _ckpt_worker()
    ckpt = tmp_path / "ckpt"
    straight = _job(tmp_path, 2, "mp2", "straight", ckpt)
    # a piece of a split param and of its velocity dropped, doubled or shifted: refused by the
    # resuming MP=2 workers (before their load) and by one process, naming the var and the element
    tampered = tmp_path / "ckpt_tampered"
    ckpt_tamper.tamper_all(ckpt / "step-00000002", tampered)
    resumed = _job(tmp_path, 2, "mp2", "resume", ckpt)
    for r in range(2):  # MP=2 -> MP=2: every loss and every var bit for bit
        _assert_bitwise(resumed[r], straight[r], f"mp rank {r}")
        ckpt_tamper.check_refusals(resumed[r]["refusals"], tampered)
        assert resumed[r]["untouched"]
    env.reset()
    fleet.init()
    exe = metaopt.Executor("cpu")
    ckpt_tamper.check_refusals(ckpt_tamper.refusals(exe, w.build("single_mp")[0], tampered), tampered)
    assert not exe.scope

    splits = straight[0]["splits"]
    c_attn, velocity = "transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_attn.weight@VELOCITY"
    assert splits[c_attn] == (0, 2, (32, 32, 32)) and splits[velocity] == splits[c_attn]  # q, k, v blocks
    info = json.loads((ckpt / "step-00000002" / "metaopt.json").read_text())
    assert info["mp_degree"] == 2 and info["vars"][c_attn]["shape"] == [96, 32]  # the full shape
    assert info["vars"][velocity]["saved_split"] == {"axis": 0, "parts": 2, "blocks": [32, 32, 32]}

    # MP=2 -> MP=1: one process gets the whole of every var, exactly what the two parts were
    env.reset()
    fleet.init()
    main, _ = w.build("single_mp")
    exe = metaopt.Executor("cpu")
    fleet.load_persistables(exe, ckpt, main)
    one = w.saved_state(exe, main)
    whole = _whole(straight, "at_save")
    assert set(one) == set(whole) and velocity in one
    for name, t in whole.items():
        assert torch.equal(one[name], t), name
    # ... and goes on from there as the MP=2 job did
    after = w.train(exe, main, "gpt", "single_mp", range(w.STEPS, 2 * w.STEPS), 0, 1)
    assert after == pytest.approx(straight[0]["losses"][w.STEPS :], rel=1e-5, abs=4e-5)
    _assert_close(w.saved_state(exe, main), _whole(straight, "state"), "MP=1 resumed vs MP=2")

    # the MP=2 job itself is one process's training, within tensor parallel's tolerance
    ref_exe, ref_main, ref_losses = _one_process_mp_twin(range(w.STEPS))
    _assert_close(whole, w.saved_state(ref_exe, ref_main), "MP=2 at the save vs one process")
    ref_losses += _one_process_mp_twin(range(w.STEPS, 2 * w.STEPS), ref_exe, ref_main)[2]
    assert straight[0]["losses"] == pytest.approx(ref_losses, rel=1e-5, abs=4e-5)


def test_a_one_process_checkpoint_loads_into_tensor_parallel_workers(tmp_path):
    """MP=1 -> MP=2, from the one file and from a one-process sharded checkpoint: each worker
    takes its part of every split var; a checkpoint of another shape is refused naming the var."""
    w = _ckpt_worker()
    exe, main, _ = _one_process_mp_twin(range(w.STEPS))
    at_save = w.saved_state(exe, main)
    fleet.save_persistables(exe, tmp_path / "one", main)  # one process: the one file
    sharded_io.save_sharded(exe, tmp_path / "one_sharded", main)
    c_fc = "transformer.h.0.mlp.c_fc.weight"
    good, exe.scope[c_fc] = exe.scope[c_fc], torch.zeros(130, 32)  # [128, 32] in the program
    sharded_io.save_sharded(exe, tmp_path / "one_bad", main)
    exe.scope[c_fc] = good
    _, _, ref_losses = _one_process_mp_twin(range(w.STEPS, 2 * w.STEPS), exe, main)

    ranks = _job(tmp_path, 2, "mp2", "from_one", tmp_path / "one")
    for r, got in enumerate(ranks):
        assert f"var {c_fc!r} is float32 [130, 32] in" in got["refused"]
        assert "but float32 [128, 32] (this worker holds [64, 32]: split(axis=0, parts=2" in got["refused"]
        assert got["untouched"]
        assert set(got["loaded"]) == set(at_save) == set(got["loaded_sharded"])
        for name, t in at_save.items():
            layout = got["splits"].get(name)
            want = t if layout is None else shard_tensor(t, layout[0], layout[2], layout[1], r)
            assert torch.equal(got["loaded"][name], want), (r, name)
            assert torch.equal(got["loaded_sharded"][name], want), (r, name)
        assert got["losses"] == pytest.approx(ref_losses, rel=1e-5, abs=4e-5)
    _assert_close(_whole(ranks, "state"), w.saved_state(exe, main), "MP=2 from MP=1 vs one process")
    # a part saved as if it were whole would keep one worker's part: refused by name, nothing written
    for got in ranks:
        assert (
            "var 'transformer.h.0.attn.c_attn.weight' differs between workers 0 and 1 of model-parallel "
            "group [0, 1] but has no split layout" in got["unmarked"]
        )
    assert not (tmp_path / "one_unmarked").exists()


def _assert_close(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), what
    for name, t in want.items():
        torch.testing.assert_close(got[name], t, **TP_TOL, msg=f"{what}: {name}")
