"""The sharded checkpoint format (metaopt.fleet.sharded_io) in one process: folders, pointer,
pruning, and every damaged or hostile checkpoint refused by name before anything changes.
Multi-worker saves and loads: tests/training/test_checkpoints.py."""

from __future__ import annotations

import json
import os
import pickle
import shutil

import pytest
import torch

import metaopt
from metaopt import fleet
from metaopt.fleet import sharded_io
from metaopt.ir import Program, Var


def _program(n: int = 6) -> Program:
    p = Program("tiny")
    p.add_var(Var("w", "float32", (n, 3), "param", trainable=True), torch.randn(n, 3))
    p.add_var(Var("m", "float64", (n, 3), "opt_state"), torch.zeros(n, 3, dtype=torch.float64))
    p.add_var(Var("count", "int64", (), "buffer"), torch.tensor(7))
    p.add_var(Var("half", "float32", (), "constant"), torch.tensor(0.5))
    return p


def _save(tmp, step: int, fill: float, **kw) -> str:
    p, exe = _program(), metaopt.Executor("cpu")
    for v in sharded_io.saved_vars(p):
        exe.scope[v.name] = torch.full(v.shape, fill).to(p.values[v.name].dtype)
    return sharded_io.save_sharded(exe, tmp / "ckpt", p, step=step, **kw)


def test_folders_pointer_and_pruning(tmp_path):
    for step in range(1, 6):
        _save(tmp_path, step, float(step), keep_last=2)
    ckpt = tmp_path / "ckpt"
    assert sharded_io.complete_steps(ckpt) == [4, 5]
    assert (ckpt / "latest").read_text() == "step-00000005\n"
    info = json.loads((ckpt / "step-00000005" / "metaopt.json").read_text())
    assert info["step"] == 5 and info["world_size"] == 1
    assert info["vars"]["w"] == {"kind": "param", "dtype": "float32", "shape": [6, 3]}
    assert "half" not in info["vars"]  # constants are the program's own
    p, exe = _program(), metaopt.Executor("cpu")
    assert sorted(fleet.load_persistables(exe, ckpt, p)) == ["count", "m", "w"]
    assert torch.equal(exe.scope["w"], torch.full((6, 3), 5.0))
    # one step folder can be loaded by its own path, whatever 'latest' says
    fleet.load_persistables(exe, ckpt / "step-00000004", p)
    assert torch.equal(exe.scope["w"], torch.full((6, 3), 4.0))


def test_saving_a_step_again_replaces_it_and_leftovers_go(tmp_path):
    _save(tmp_path, 3, 1.0)
    ckpt = tmp_path / "ckpt"
    (ckpt / ".step-00000009.partial").mkdir()  # what a killed save leaves
    (ckpt / ".step-00000009.partial" / "__0_0.distcp").write_bytes(b"half")
    (ckpt / ".latest.abc.tmp").write_text("step-00000009")
    _save(tmp_path, 3, 2.0)
    assert sorted(os.listdir(ckpt)) == ["latest", "step-00000003"]
    p, exe = _program(), metaopt.Executor("cpu")
    fleet.load_persistables(exe, ckpt, p)
    assert torch.equal(exe.scope["w"], torch.full((6, 3), 2.0))


def test_bad_keep_last_is_refused(tmp_path):
    with pytest.raises(ValueError, match="keep_last must be an int >= 1, got 0"):
        _save(tmp_path, 1, 1.0, keep_last=0)


def test_a_shape_mismatch_names_the_var_and_changes_nothing(tmp_path):
    _save(tmp_path, 1, 1.0)
    exe = metaopt.Executor("cpu")
    exe.scope["m"] = torch.zeros(8, 3, dtype=torch.float64)
    with pytest.raises(
        sharded_io.CheckpointError, match=r"var 'w' is float32 \[6, 3\] .* but float32 \[8, 3\]"
    ):
        fleet.load_persistables(exe, tmp_path / "ckpt", _program(8))
    assert torch.equal(exe.scope["m"], torch.zeros(8, 3, dtype=torch.float64))
    assert "w" not in exe.scope


def test_extra_vars_are_refused_in_the_same_layout_unless_not_strict(tmp_path):
    _save(tmp_path, 1, 1.0)
    p = _program()
    del p.vars["count"]
    with pytest.raises(
        sharded_io.CheckpointError, match=r"holds 1 var\(s\) no worker's program has: \['count'\]"
    ):
        fleet.load_persistables(metaopt.Executor("cpu"), tmp_path / "ckpt", p)
    assert sorted(fleet.load_persistables(metaopt.Executor("cpu"), tmp_path / "ckpt", p, strict=False)) == [
        "m",
        "w",
    ]


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > pwned.txt",))


def test_hostile_metadata_never_runs_code(tmp_path, monkeypatch):
    _save(tmp_path, 1, 1.0)
    folder = tmp_path / "ckpt" / "step-00000001"
    (folder / ".metadata").write_bytes(pickle.dumps(_Evil()))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(sharded_io.CheckpointError, match=r"refused global posix\.system"):
        fleet.load_persistables(metaopt.Executor("cpu"), tmp_path / "ckpt", _program())
    assert not (tmp_path / "pwned.txt").exists()


def test_storage_paths_must_stay_in_the_folder(tmp_path):
    _save(tmp_path, 1, 1.0)
    folder = tmp_path / "ckpt" / "step-00000001"
    md = sharded_io.SafeReader(folder).read_metadata()
    (tmp_path / "outside.distcp").write_bytes((folder / "__0_0.distcp").read_bytes())
    for where in md.storage_data.values():
        where.relative_path = "../../outside.distcp"
    md.storage_meta = None
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(
        sharded_io.CheckpointError, match=r"points outside the folder \('../../outside.distcp'\)"
    ):
        fleet.load_persistables(metaopt.Executor("cpu"), tmp_path / "ckpt", _program())


def test_truncated_data_is_an_error_naming_the_folder_and_changes_nothing(tmp_path):
    _save(tmp_path, 1, 1.0)
    data = tmp_path / "ckpt" / "step-00000001" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    exe = metaopt.Executor("cpu")
    exe.scope["w"] = torch.zeros(6, 3)
    with pytest.raises(sharded_io.CheckpointError, match=r"reading .*step-00000001 failed"):
        fleet.load_persistables(exe, tmp_path / "ckpt", _program())
    assert torch.equal(exe.scope["w"], torch.zeros(6, 3)) and "m" not in exe.scope


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda f: (f / "metaopt.json").write_text("{"), r"metaopt.json is not readable"),
        (
            lambda f: (f / "metaopt.json").write_text('{"format": "x"}'),
            r"not a metaopt checkpoint description",
        ),
        (
            lambda f: (f / ".metadata").write_bytes(b"\x80\x04garbage"),
            r"\.metadata is not readable DCP metadata",
        ),
        (lambda f: (f / ".metadata").unlink(), r"has no DCP metadata \(\.metadata\)"),
        (lambda f: (f.parent / "latest").write_text("../../etc"), r"does not name a checkpoint folder"),
        (lambda f: shutil.rmtree(f), r"latest names step-00000001, which is not a complete checkpoint"),
    ],
    ids=[
        "json-cut",
        "json-foreign",
        "metadata-garbage",
        "metadata-gone",
        "pointer-escapes",
        "pointer-dangles",
    ],
)
def test_damaged_checkpoints_are_named_errors(tmp_path, damage, message):
    _save(tmp_path, 1, 1.0)
    damage(tmp_path / "ckpt" / "step-00000001")
    exe = metaopt.Executor("cpu")
    with pytest.raises(sharded_io.CheckpointError, match=message):
        fleet.load_persistables(exe, tmp_path / "ckpt", _program())
    assert not exe.scope


def test_a_save_of_the_same_step_killed_between_its_renames_loses_nothing(tmp_path):
    """Saving step N again sets the old step-N aside (.step-N.old) for a moment: a kill then
    leaves 'latest' naming a missing folder. Loading takes the set-aside one; the next save
    puts it back before anything else."""
    _save(tmp_path, 3, 1.0)
    ckpt = tmp_path / "ckpt"
    (ckpt / "step-00000003").rename(ckpt / ".step-00000003.old")  # the moment of the kill
    p, exe = _program(), metaopt.Executor("cpu")
    fleet.load_persistables(exe, ckpt, p)
    assert torch.equal(exe.scope["w"], torch.full((6, 3), 1.0))
    _save(tmp_path, 4, 2.0)
    assert sharded_io.complete_steps(ckpt) == [3, 4]
    assert not [n for n in os.listdir(ckpt) if n.startswith(".")]


def test_a_worker_without_a_value_fails_before_any_collective(tmp_path):
    p = _program()
    del p.values["m"]
    with pytest.raises(sharded_io.CheckpointError, match=r"opt_state var 'm' has no value"):
        sharded_io.save_sharded(metaopt.Executor("cpu"), tmp_path / "ckpt", p, step=1)
    assert not (tmp_path / "ckpt").exists()


def test_a_tensor_parallel_program_is_refused_not_half_saved(tmp_path):
    """Split params hold a slice under the param's name: DCP would keep one rank's slice."""
    from metaopt.ir import Op

    p = _program()
    p.add_var(Var("y", "float32", (6, 3)))
    p.ops.append(Op("TPReduce", ["w"], ["y"], {"group": "model_parallel"}))
    for call in (
        lambda: sharded_io.save_sharded(metaopt.Executor("cpu"), tmp_path / "ckpt", p, step=1),
        lambda: sharded_io.load_sharded(metaopt.Executor("cpu"), tmp_path, p),
    ):
        with pytest.raises(NotImplementedError, match="tensor parallel .* split params are not implemented"):
            call()
    assert not (tmp_path / "ckpt").exists()
