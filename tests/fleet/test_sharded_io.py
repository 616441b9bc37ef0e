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
from metaopt.fleet import dcp_glue, sharded_io
from metaopt.ir import Op, Program, Split, Var, parse_program, torch_dtype
from metaopt.passes.tensor_parallel import shard_tensor


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


def test_metadata_cannot_change_a_class(tmp_path):
    """BUILD on an allowed class object (not an instance) would set class attributes: a crafted
    `.metadata` replaced PosixPath's methods so that every path looked inside the folder."""
    import pathlib

    _save(tmp_path, 1, 1.0)
    folder = tmp_path / "ckpt" / "step-00000001"
    # GLOBAL pathlib.PosixPath, state (None, {"is_file": 1}), BUILD: plain pickle setattr()s the
    # slot state on the class itself.
    (folder / ".metadata").write_bytes(b"cpathlib\nPosixPath\n(N(dVis_file\nI1\nstb.")
    with pytest.raises(sharded_io.CheckpointError, match=r"refused to set the state of class PosixPath"):
        fleet.load_persistables(metaopt.Executor("cpu"), tmp_path / "ckpt", _program())
    assert callable(pathlib.PosixPath.is_file)
    assert pathlib.PosixPath.is_file is pathlib.Path.is_file


def test_transformed_storage_is_refused(tmp_path):
    """A storage entry with transform descriptors (DCP's compressed storage) would be
    decompressed whole; metaopt writes none and reads none."""
    _save(tmp_path, 1, 1.0)
    folder = tmp_path / "ckpt" / "step-00000001"
    md = dcp_glue.SafeReader(folder).read_metadata()
    for where in md.storage_data.values():
        where.transform_descriptors = ["stream.zstd/1"]
    md.storage_meta = None
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(sharded_io.CheckpointError, match=r"transforms \['stream.zstd/1'\].*refused"):
        fleet.load_persistables(metaopt.Executor("cpu"), tmp_path / "ckpt", _program())


def test_storage_paths_must_stay_in_the_folder(tmp_path):
    _save(tmp_path, 1, 1.0)
    folder = tmp_path / "ckpt" / "step-00000001"
    md = dcp_glue.SafeReader(folder).read_metadata()
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


# --- tensor parallel, in one process: a worker's part of each split var ------------------------


def _full() -> Program:
    """What one process holds (MP=1): every var whole."""
    p = Program("tp")
    p.add_var(Var("w", "float32", (6, 3), "param", trainable=True), torch.arange(18.0).reshape(6, 3))
    p.add_var(Var("qkv", "float32", (12, 2), "param", trainable=True), torch.arange(24.0).reshape(12, 2))
    p.add_var(Var("m", "float64", (6, 4), "opt_state"), torch.arange(24, dtype=torch.float64).reshape(6, 4))
    p.add_var(Var("count", "int64", (), "buffer"), torch.tensor(7))
    return p


LAYOUTS = {"w": Split(0, 2, (6,)), "qkv": Split(0, 2, (4, 4, 4)), "m": Split(1, 2, (4,))}


def _part_program(group: list[int], rows: int = 6) -> Program:
    """A worker of an MP=2 job: its part of each var, and a model-parallel collective naming the
    group (this process is worker 0: group [1, 0] makes it the group's second, part 1)."""
    p = Program("tp")
    for v in _full().vars.values():
        sp = LAYOUTS.get(v.name)
        shape = (rows, 3) if v.name == "w" else v.shape
        sp = Split(0, 2, (rows,)) if v.name == "w" else sp
        local = sp.local_shape(shape) if sp else shape
        p.add_var(
            Var(v.name, v.dtype, local, v.kind, v.trainable, split=sp),
            torch.zeros(local, dtype=torch_dtype(v.dtype)),
        )
    p.add_var(Var("y", "float32", (3, 3)))
    p.ops.append(Op("TPCopy", ["w"], ["y"], {"group": group}))
    return p


def _save_full(tmp, how: str) -> None:
    p, exe = _full(), metaopt.Executor("cpu")
    if how == "sharded":
        sharded_io.save_sharded(exe, tmp / "ckpt", p, step=1)
    else:
        fleet.save_persistables(exe, tmp / "ckpt", p)  # one process: the one file


@pytest.mark.parametrize("how", ["sharded", "file"])
@pytest.mark.parametrize("group, part", [([0, 1], 0), ([1, 0], 1)])
def test_a_worker_loads_its_part_of_each_split_var(tmp_path, how, group, part):
    _save_full(tmp_path, how)
    exe = metaopt.Executor("cpu")
    assert sorted(fleet.load_persistables(exe, tmp_path / "ckpt", _part_program(group))) == [
        "count",
        "m",
        "qkv",
        "w",
    ]
    full = _full().values
    for name, sp in LAYOUTS.items():  # the tensor-parallel pass's own slicing is the reference
        want = shard_tensor(full[name], sp.axis, sp.blocks, sp.parts, part)
        assert torch.equal(exe.scope[name], want), name
    assert torch.equal(exe.scope["qkv"][:2], full["qkv"][2 * part : 2 * part + 2])  # 1/2 of q, k and v
    assert torch.equal(exe.scope["count"], torch.tensor(7))


@pytest.mark.parametrize("how", ["sharded", "file"])
def test_a_split_var_of_another_full_shape_is_refused_naming_both_shapes(tmp_path, how):
    _save_full(tmp_path, how)
    exe = metaopt.Executor("cpu")
    error = sharded_io.CheckpointError if how == "sharded" else ValueError
    with pytest.raises(
        error,
        match=r"var 'w' is float32 \[6, 3\] in .* but float32 \[8, 3\] \(this worker holds \[4, 3\]: "
        r"split\(axis=0, parts=2, blocks=\[8\]\)\)",
    ):
        fleet.load_persistables(exe, tmp_path / "ckpt", _part_program([0, 1], rows=8))
    assert not exe.scope  # nothing loaded


def test_one_process_cannot_save_one_part(tmp_path):
    p, exe = _part_program([0, 1]), metaopt.Executor("cpu")
    alone = r"tensor parallel over workers \[0, 1\] and this process is alone"
    with pytest.raises(sharded_io.CheckpointError, match=alone):
        fleet.save_persistables(exe, tmp_path / "ckpt", p)
    with pytest.raises(
        sharded_io.CheckpointError, match=r"split over the model-parallel group \[0, 1\], but this job has 1"
    ):
        sharded_io.save_sharded(exe, tmp_path / "ckpt", p, step=1)
    p.ops = []  # a part without the group's collectives: refused by the var
    with pytest.raises(
        sharded_io.CheckpointError, match=r"var 'w' .* one of 2 parts .* this process is alone"
    ):
        fleet.save_persistables(exe, tmp_path / "ckpt", p)
    assert not [x for x in (tmp_path / "ckpt").rglob("*") if x.is_file()]


def test_a_split_var_without_a_model_parallel_group_is_refused(tmp_path):
    _save_full(tmp_path, "sharded")
    p = _part_program([0, 1])
    p.ops = []
    with pytest.raises(
        sharded_io.CheckpointError, match=r"var 'w' holds a part .* which part this worker holds"
    ):
        fleet.load_persistables(metaopt.Executor("cpu"), tmp_path / "ckpt", p)


@pytest.mark.parametrize("how", ["sharded", "file"])
def test_a_registered_rng_stream_is_saved_and_restored(tmp_path, monkeypatch, how):
    """The hook for generators beside torch's own (tensor parallel's per-MP-rank stream)."""
    monkeypatch.setattr(sharded_io, "_RNG_STREAMS", {})
    gen = torch.Generator().manual_seed(5)
    sharded_io.register_rng_states(
        "mp", lambda: {"rank0.cpu": gen.get_state()}, lambda d: gen.set_state(d["rank0.cpu"])
    )
    p, exe = _program(), metaopt.Executor("cpu")
    if how == "sharded":
        sharded_io.save_sharded(exe, tmp_path / "ckpt", p, step=1)
    else:
        fleet.save_persistables(exe, tmp_path / "ckpt", p)
    want = torch.rand(4, generator=gen)
    fleet.load_persistables(metaopt.Executor("cpu"), tmp_path / "ckpt", p)
    assert torch.equal(torch.rand(4, generator=gen), want)  # the stream is back where it was saved


@pytest.mark.parametrize("how", ["sharded", "file"])
def test_the_model_parallel_dropout_stream_is_saved_and_restored(tmp_path, how):
    """fleet registers tensor parallel's per-MP-rank stream (metaopt/ops/rng_streams.py): a resumed
    run draws the split-region masks it would have drawn, and the shared stream as well."""
    from metaopt.ops import rng_streams

    metaopt.seed(3)
    attrs = {"rng": "model_parallel", "group": [0]}  # this worker is MP rank 0 of a group of one
    with rng_streams.drawing_from(attrs, torch.device("cpu")):
        torch.rand(2)  # the stream exists (made at its first draw) and has moved
    p, exe = _program(), metaopt.Executor("cpu")
    if how == "sharded":
        sharded_io.save_sharded(exe, tmp_path / "ckpt", p, step=1)
    else:
        fleet.save_persistables(exe, tmp_path / "ckpt", p)
    with rng_streams.drawing_from(attrs, torch.device("cpu")):
        want_mp = torch.rand(4)
    want_shared = torch.rand(4)
    metaopt.seed(99)  # both streams elsewhere
    fleet.load_persistables(metaopt.Executor("cpu"), tmp_path / "ckpt", p)
    with rng_streams.drawing_from(attrs, torch.device("cpu")):
        assert torch.equal(torch.rand(4), want_mp)
    assert torch.equal(torch.rand(4), want_shared)


def test_the_layout_the_pass_records_reaches_the_optimizer_state_and_round_trips():
    """The tensor-parallel pass sets Var.split on each param it slices; the optimizer pass gives
    the param's state the same; the printed program carries both (what checkpoints read)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "training"))
    import tp_worker

    from metaopt.passes.tensor_parallel import tensor_parallel

    program = tp_worker.export("gpt")
    plan = tp_worker.plan(program, "gpt", 0, 2)
    program = tensor_parallel(program, plan=plan)
    metaopt.optimizer.Adam(learning_rate=0.1).minimize(program.loss)
    split = {sp.name: sp for sp in plan.params}
    assert split
    for v in program.vars.values():
        owner = v.name.split("@")[0] if v.kind == "opt_state" else v.name
        sp = split.get(owner)
        if v.kind in ("param", "opt_state") and sp is not None and v.shape == sp.local_shape:
            assert v.split == Split(sp.axis, 2, tuple(sp.blocks)), v.name
            assert v.full_shape == tuple(sp.full_shape), v.name
        elif v.kind in ("param", "opt_state"):
            assert v.split is None, v.name
    moments = [v for v in program.vars.values() if v.kind == "opt_state" and v.split is not None]
    assert len(moments) == 2 * len(split)  # MOMENT1 and MOMENT2 of each
    assert parse_program(str(program)).vars == program.vars


def test_a_latest_pointing_at_another_file_never_echoes_it(tmp_path):
    _save(tmp_path, 1, 1.0)
    latest = tmp_path / "ckpt" / "latest"
    latest.unlink()
    secret = tmp_path / "secret"
    secret.write_text("TOKEN=hunter2\n")
    latest.symlink_to(secret)
    with pytest.raises(sharded_io.CheckpointError, match=r"does not name a checkpoint folder") as e:
        fleet.load_persistables(metaopt.Executor("cpu"), tmp_path / "ckpt", _program())
    assert "hunter2" not in str(e.value)


@pytest.mark.parametrize("name", ["latest", "metaopt.json"])
def test_a_huge_sparse_pointer_or_description_is_refused_unread(tmp_path, name):
    _save(tmp_path, 1, 1.0)
    path = tmp_path / "ckpt" / (name if name == "latest" else f"step-00000001/{name}")
    with open(path, "r+b") as f:
        f.truncate(1 << 30)  # 1 GiB that takes no disk
    with pytest.raises(sharded_io.CheckpointError, match=r"is larger than \d+ bytes"):
        fleet.load_persistables(metaopt.Executor("cpu"), tmp_path / "ckpt", _program())


def test_a_deeply_nested_description_is_a_checkpoint_error(tmp_path):
    _save(tmp_path, 1, 1.0)
    (tmp_path / "ckpt" / "step-00000001" / "metaopt.json").write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(sharded_io.CheckpointError, match=r"nested too deeply"):
        fleet.load_persistables(metaopt.Executor("cpu"), tmp_path / "ckpt", _program())


def test_a_step_folder_that_is_a_symlink_out_of_the_checkpoint_is_refused(tmp_path):
    _save(tmp_path, 1, 1.0)
    ckpt = tmp_path / "ckpt"
    elsewhere = tmp_path / "elsewhere"
    (ckpt / "step-00000001").rename(elsewhere)
    (ckpt / "step-00000001").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(sharded_io.CheckpointError, match=r"is a symbolic link"):
        fleet.load_persistables(metaopt.Executor("cpu"), ckpt, _program())


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.int64])
def test_a_stored_dtype_other_than_the_description_is_refused(tmp_path, dtype):
    _save(tmp_path, 1, 1.0)
    folder = tmp_path / "ckpt" / "step-00000001"
    md = dcp_glue.SafeReader(folder).read_metadata()
    md.state_dict_metadata["w"].properties.dtype = dtype
    md.storage_meta = None
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(sharded_io.CheckpointError, match=rf"'w' is stored as {dtype}.*says float32"):
        fleet.load_persistables(metaopt.Executor("cpu"), tmp_path / "ckpt", _program())


def test_a_second_job_saving_into_the_same_folder_is_refused_by_name(tmp_path):
    """The lock file names its owner (pid, host); a live owner refuses the second save before it
    touches anything (before, it removed the first job's partial folder and died with a raw
    FileNotFoundError), a dead one is taken over (a killed save left it)."""
    import socket
    import subprocess
    import sys

    _save(tmp_path, 1, 1.0)
    ckpt = tmp_path / "ckpt"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (ckpt / sharded_io.LOCK).write_text(f"{other.pid} {socket.gethostname()}\n")
        (ckpt / ".step-00000002.partial").mkdir()  # the other job's save in progress
        with pytest.raises(sharded_io.CheckpointError, match=rf"another job \(pid {other.pid} on host"):
            _save(tmp_path, 2, 2.0)
        assert (ckpt / ".step-00000002.partial").is_dir()  # untouched
    finally:
        other.kill()
        other.wait()
    (ckpt / ".step-00000002.partial").rmdir()
    assert _save(tmp_path, 2, 2.0).endswith("step-00000002")  # its owner is gone: taken over
    assert not (ckpt / sharded_io.LOCK).exists()


def test_a_huge_rng_state_is_refused_before_it_is_allocated(tmp_path):
    _save(tmp_path, 1, 1.0)
    folder = tmp_path / "ckpt" / "step-00000001"
    md = dcp_glue.SafeReader(folder).read_metadata()
    key = next(k for k in md.state_dict_metadata if k.startswith("__rng__/0/"))
    md.state_dict_metadata[key].size = torch.Size([1 << 40])
    md.storage_meta = None
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(sharded_io.CheckpointError, match=r"RNG state '__rng__/0/.*not a generator state"):
        fleet.load_persistables(metaopt.Executor("cpu"), tmp_path / "ckpt", _program())


def _replace_stored(folder, fqn: str, stored) -> None:
    """Point `fqn`'s storage at a file holding `stored` (what a crafted shard would hold), the
    metadata otherwise untouched."""
    md = dcp_glue.SafeReader(folder).read_metadata()
    blob = folder / "crafted.distcp"
    torch.save(stored, blob)
    for index in [i for i in md.storage_data if i.fqn == fqn]:
        md.storage_data[index] = dcp_glue._StorageInfo("crafted.distcp", 0, blob.stat().st_size)
    md.storage_meta = None
    (folder / ".metadata").write_bytes(pickle.dumps(md))


@pytest.mark.parametrize(
    "stored",
    [
        torch.zeros(6, 3, dtype=torch.float64),
        torch.zeros(6, 3, dtype=torch.bfloat16),
        torch.zeros(6, 3, dtype=torch.int64),
        torch.zeros(18),  # before: narrowed to the piece DCP asked for, silently
        torch.zeros(8, 3),
    ],
    ids=["float64", "bf16", "int64", "flat", "larger"],
)
def test_a_shard_holding_another_dtype_or_size_than_declared_is_refused(tmp_path, stored):
    """DCP's own read loop copies what the shard holds into the var with ``copy_``, which
    casts and (after narrowing) accepts a larger tensor. Before: every case here loaded."""
    _save(tmp_path, 1, 1.0)
    _replace_stored(tmp_path / "ckpt" / "step-00000001", "w", stored)
    p, exe = _program(), metaopt.Executor("cpu")
    exe.scope["w"] = torch.full((6, 3), -1.0)
    with pytest.raises(sharded_io.CheckpointError, match=r"'w' at \[0, 0\] holds .* the metadata declares"):
        fleet.load_persistables(exe, tmp_path / "ckpt", p)
    assert torch.equal(exe.scope["w"], torch.full((6, 3), -1.0))


def test_a_shard_declared_beyond_its_file_is_refused(tmp_path):
    _save(tmp_path, 1, 1.0)
    folder = tmp_path / "ckpt" / "step-00000001"
    md = dcp_glue.SafeReader(folder).read_metadata()
    index = next(i for i in md.storage_data if i.fqn == "w")
    where = md.storage_data[index]
    md.storage_data[index] = dcp_glue._StorageInfo(where.relative_path, where.offset, 1 << 40)
    md.storage_meta = None
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    beyond = r"'w' is declared at bytes \d+\.\.\d+ of a \d+-byte"
    with pytest.raises(sharded_io.CheckpointError, match=beyond):
        fleet.load_persistables(metaopt.Executor("cpu"), tmp_path / "ckpt", _program())


@pytest.mark.parametrize(
    "full, axis, blocks, mp",
    [((6, 4), 0, (6,), 2), ((6, 4), 1, (4,), 2), ((12, 5), 0, (4, 4, 4), 2), ((5, 12), 1, (6, 6), 3)],
)
def test_the_zero_slices_of_tensor_parallel_parts_tile_the_full_tensor_once(full, axis, blocks, mp):
    """Sharding beside tensor parallel: every worker's checkpoint pieces (`Pieces.of_zero_split`:
    the boxes its flat run of its tensor-parallel part covers, cut at the split's blocks) land
    where the full tensor has those values, and together they cover it exactly once, at every
    sharding degree (3 does not divide the parts evenly: padding holds nothing)."""
    import math

    from metaopt.fleet.dcp_glue import Pieces, flat_boxes
    from metaopt.fleet.sharded_io import local_part
    from metaopt.ir import Split, ZeroShard
    from metaopt.ops.kernels.partition import take_slice

    for shape, (a, b) in (((2, 3, 4), (5, 19)), ((3, 4), (4, 8)), ((5,), (1, 4))):
        idx = torch.arange(math.prod(shape)).view(shape)
        runs = [
            idx[tuple(slice(o, o + s) for o, s in zip(off, sz))].reshape(-1)
            for off, sz, _ in flat_boxes(shape, a, b)
        ]
        assert torch.cat(runs).tolist() == list(range(a, b))  # in order, each box one contiguous run
    sp = Split(axis, mp, blocks)
    whole = torch.arange(math.prod(full), dtype=torch.float32).view(full)
    for n in (1, 2, 3, 4):
        out = torch.full(full, -1.0)
        for m in range(mp):
            part = local_part(whole, sp, m)
            zs = ZeroShard(n, tuple(part.shape))
            for i in range(n):
                pieces = Pieces.of_zero_split(take_slice(part, n, i), zs, i, sp, m)
                assert pieces.size() == torch.Size(full)
                for off, t in pieces.parts.items():
                    region = tuple(slice(o, o + s) for o, s in zip(off, t.shape))
                    assert (out[region] == -1).all()  # nothing written twice
                    out[region] = t
        assert torch.equal(out, whole), n


# --- the pieces must tile every var exactly (issue 47's BAD) ---------------------------------


def _rewrite(folder, change) -> None:
    md = dcp_glue.SafeReader(folder).read_metadata()
    change(md)
    md.storage_meta = None
    (folder / ".metadata").write_bytes(pickle.dumps(md))


def _in_two_pieces(folder, fqn: str, whole: torch.Tensor) -> None:
    """Store `fqn` as two row blocks, each its own file: what two workers write of a var split
    over rows. A good checkpoint still (it loads `whole`)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    def change(md) -> None:
        tm = md.state_dict_metadata[fqn]
        half = whole.shape[0] // 2
        tm.chunks = []
        for i, (at, rows) in enumerate(((0, half), (half, whole.shape[0] - half))):
            blob = folder / f"{fqn}.{i}.distcp"
            torch.save(whole[at : at + rows].clone(), blob)
            offsets = torch.Size([at] + [0] * (whole.dim() - 1))
            tm.chunks.append(ChunkStorageMetadata(offsets, torch.Size([rows, *whole.shape[1:]])))
            md.storage_data[MetadataIndex(fqn, offsets)] = dcp_glue._StorageInfo(
                blob.name, 0, blob.stat().st_size
            )

    _rewrite(folder, change)


def test_a_piece_dropped_doubled_or_shifted_is_refused_naming_the_var_and_the_element(tmp_path):
    """Before: each piece was only checked to lie inside its tensor; a dropped one left
    torch.empty's garbage, a doubled or shifted one made the last read win, silently."""
    from ckpt_tamper import check_refusals, refusals, tamper_all

    _save(tmp_path, 1, 1.0)
    folder = tmp_path / "ckpt" / "step-00000001"
    _in_two_pieces(folder, "w", torch.arange(18.0).view(6, 3))
    _in_two_pieces(folder, "m", torch.arange(18.0, dtype=torch.float64).view(6, 3))
    p, exe = _program(), metaopt.Executor("cpu")
    fleet.load_persistables(exe, folder, p)  # the pieces tile both: it loads, as it should
    assert torch.equal(exe.scope["w"], torch.arange(18.0).view(6, 3))
    cases = tamper_all(folder, tmp_path / "tampered")
    assert {c["var"] for c in cases.values()} == {"w", "m"}
    exe = metaopt.Executor("cpu")
    exe.scope["w"] = torch.full((6, 3), -1.0)
    got = refusals(exe, p, tmp_path / "tampered")
    check_refusals(got, tmp_path / "tampered")
    assert got["drop-param"].endswith("do not tile it: element [3, 0] is uncovered")
    assert got["shift-param"].endswith("do not tile it: element [3, 0] is covered twice")
    assert torch.equal(exe.scope["w"], torch.full((6, 3), -1.0)) and "m" not in exe.scope


def test_a_flat_var_s_element_is_named_in_its_own_shape_too(tmp_path):
    """A ZeRO var is stored flat: the first wrong element by its flat index and by its index in
    the var's shape."""
    p = Program("flat")
    p.add_var(Var("w", "float32", (4, 5), "param", trainable=True), torch.arange(20.0).view(4, 5))
    sharded_io.save_sharded(metaopt.Executor("cpu"), tmp_path / "ckpt", p, step=1)
    folder = tmp_path / "ckpt" / "step-00000001"
    info = json.loads((folder / "metaopt.json").read_text())
    info["vars"]["w"].update(shape=[4, 5], flat=True)
    (folder / "metaopt.json").write_text(json.dumps(info))

    def flat(md) -> None:
        tm = md.state_dict_metadata["w"]
        tm.size = torch.Size([20])
        tm.chunks = [dcp_glue.dcp_meta.ChunkStorageMetadata(torch.Size([0]), torch.Size([12]))]  # 12.. not
        key = next(i for i in md.storage_data if i.fqn == "w")
        md.storage_data[dcp_glue.dcp_meta.MetadataIndex("w", [0])] = md.storage_data.pop(key)

    _rewrite(folder, flat)
    with pytest.raises(
        sharded_io.CheckpointError,
        match=r"element \[12\] is uncovered \(index \[2, 2\] of its shape \[4, 5\]",
    ):
        fleet.load_persistables(metaopt.Executor("cpu"), folder, p)


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda md: md.storage_data.pop(next(i for i in md.storage_data if i.fqn == "w")),
            r"var 'w': the piece at \[0, 0\] in .* has no stored data",
        ),
        (
            lambda md: md.storage_data.__setitem__(
                dcp_glue.dcp_meta.MetadataIndex("w", [5, 2]), next(iter(md.storage_data.values()))
            ),
            r"stores 1 blob\(s\) that belong to no piece",
        ),
        (
            lambda md: md.state_dict_metadata.__setitem__("ghost", md.state_dict_metadata["w"]),
            r"holds 'ghost', which metaopt.json does not describe",
        ),
        (
            lambda md: md.state_dict_metadata["w"].chunks.extend(
                dcp_glue.dcp_meta.ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([0, 0]))
                for _ in range(40)
            ),
            r"var 'w' has 41 pieces in .*; a save of 1 worker\(s\) writes at most 26",
        ),
        (
            lambda md: setattr(md.state_dict_metadata["w"].chunks[0], "offsets", ["0", 0]),
            r"var 'w': a stored piece in .* lies outside its shape \[6, 3\]",
        ),
    ],
    ids=[
        "piece-without-data",
        "data-without-piece",
        "undescribed-entry",
        "too-many-pieces",
        "offset-not-int",
    ],
)
def test_the_metadata_s_pieces_and_blobs_must_match(tmp_path, change, message):
    """Before: a piece without its blob was a raw KeyError inside DCP's read; the others loaded."""
    _save(tmp_path, 1, 1.0)
    _rewrite(tmp_path / "ckpt" / "step-00000001", change)
    exe = metaopt.Executor("cpu")
    with pytest.raises(sharded_io.CheckpointError, match=message):
        fleet.load_persistables(exe, tmp_path / "ckpt", _program())
    assert not exe.scope


@pytest.mark.parametrize("edited_world", [None, 1 << 20], ids=["as-saved", "metaopt.json-says-2^20-workers"])
def test_a_bloated_metadata_is_refused_unread(tmp_path, monkeypatch, edited_world):
    """A 6 MB `.metadata` (200k extra pieces in the audit: 13 s and +375 MB, then a raw KeyError)
    is more than this checkpoint's 3 vars and 1 worker can need: refused before unpickling. Also
    when metaopt.json is edited to claim 2^20 workers (the audit: 4.9 s and +167 MB, its budgets
    grown with that count): the budgets count the workers whose data files are there."""
    _save(tmp_path, 1, 1.0)
    folder = tmp_path / "ckpt" / "step-00000001"
    if edited_world is not None:
        info = json.loads((folder / "metaopt.json").read_text())
        info["world_size"] = edited_world
        (folder / "metaopt.json").write_text(json.dumps(info))
    good = (folder / ".metadata").read_bytes()
    (folder / ".metadata").write_bytes(good + b"\0" * (6 << 20))
    monkeypatch.setattr(dcp_glue, "_MetadataUnpickler", None)  # never reached
    with pytest.raises(sharded_io.CheckpointError, match=r"\.metadata is \d+ bytes, more than the \d+ its"):
        fleet.load_persistables(metaopt.Executor("cpu"), tmp_path / "ckpt", _program())


@pytest.mark.parametrize("world", [0, -1, True, 1 << 40])
def test_a_description_with_an_impossible_worker_count_is_refused(tmp_path, world):
    _save(tmp_path, 1, 1.0)
    path = tmp_path / "ckpt" / "step-00000001" / "metaopt.json"
    info = json.loads(path.read_text())
    info["world_size"] = world
    path.write_text(json.dumps(info))
    with pytest.raises(sharded_io.CheckpointError, match=r"not a metaopt checkpoint description"):
        fleet.load_persistables(metaopt.Executor("cpu"), tmp_path / "ckpt", _program())


def test_a_nul_byte_in_a_storage_path_is_named(tmp_path):
    """Before (issue 47): a raw ValueError from os.path ("embedded null byte")."""
    _save(tmp_path, 1, 1.0)
    folder = tmp_path / "ckpt" / "step-00000001"

    def nul(md) -> None:
        for where in md.storage_data.values():
            where.relative_path = "__0_0.distcp\0.x"

    _rewrite(folder, nul)
    with pytest.raises(
        sharded_io.CheckpointError, match=r"storage path '__0_0\.distcp\\x00\.x' holds a NUL byte"
    ):
        fleet.load_persistables(metaopt.Executor("cpu"), tmp_path / "ckpt", _program())
