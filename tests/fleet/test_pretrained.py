"""fleet.load_pretrained in one process: a program exported on the meta device filled from a
safetensors file or Hugging Face folder, each layout's share read alone, and every bad source
named. On workers (ZeRO-3, a pipeline, tensor parallel beside sharding):
tests/training/test_sharding_workers.py and tests/fleet/test_fleet_tensor_parallel.py."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import metaopt
from metaopt import fleet
from metaopt.fleet import env, pretrained, sharded_io
from metaopt.ir import Split, Var, ZeroShard
from metaopt.ops.kernels.partition import take_slice

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "training"))
from training_cases import _module, batch, pretrained_path, save_pretrained_files  # noqa: E402

pytestmark = pytest.mark.usefixtures("clean_env")  # tests/conftest.py


def _minimized(name: str, *, meta: bool) -> metaopt.Program:
    env.reset()
    fleet.init()
    module, inputs, kwargs = _module(name, meta=meta)
    main = metaopt.export(module, inputs, **kwargs)
    opt = fleet.distributed_optimizer(metaopt.optimizer.Adam(learning_rate=1e-2), fleet.DistributedStrategy())
    opt.minimize(main.loss)
    return main


def _losses(exe: metaopt.Executor, main: metaopt.Program, name: str) -> list[float]:
    return [float(exe.run(main, feed=batch(name, s), fetch_list=[main.loss])[0]) for s in range(2)]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("pretrained")
    save_pretrained_files(folder, ["hf-gpt2"])
    return folder


def test_a_program_exported_on_meta_and_filled_from_an_hf_folder_trains_as_one_exported_with_values(files):
    """The same program, the same values: losses and Adam state bit for bit."""
    meta = _minimized("hf-gpt2", meta=True)
    assert all(
        t.is_meta for n, t in meta.values.items() if meta.vars[n].kind in ("param", "opt_state") and t.dim()
    )
    exe = metaopt.Executor("cpu")
    loaded = fleet.load_pretrained(exe, meta, pretrained_path(files, "hf-gpt2"), prefix="m.")
    assert set(loaded) == {v.name for v in meta.vars.values() if v.kind in ("param", "buffer")}
    got = _losses(exe, meta, "hf-gpt2")
    ref = _minimized("hf-gpt2", meta=False)
    ref_exe = metaopt.Executor("cpu")
    assert got == _losses(ref_exe, ref, "hf-gpt2")
    for v in ref.vars.values():
        if v.kind in ("param", "buffer", "opt_state"):
            assert torch.equal(exe.scope[v.name], ref_exe.scope[v.name]), v.name


def test_running_a_meta_program_without_values_is_refused_naming_the_param_and_the_sources():
    meta = _minimized("hf-gpt2", meta=True)
    with pytest.raises(
        ValueError,
        match=r"param var 'm\.transformer\..*' of program .* has no value: .*meta device"
        r".*fleet\.load_pretrained.*fleet\.load_persistables",
    ):
        metaopt.Executor("cpu").run(meta, feed=batch("hf-gpt2", 0), fetch_list=[meta.loss])


def test_the_executor_refuses_values_changed_in_place_after_the_export():
    """The program holds the module's tensors by reference (no copy): an eager step on the module
    between the export and the first run would silently change the program's start."""
    module, inputs, kwargs = _module("mlp")
    main = metaopt.export(module, inputs, **kwargs)
    assert any(t.data_ptr() == p.data_ptr() for t in main.values.values() for p in module.parameters())
    with torch.no_grad():
        next(module.parameters()).add_(1.0)
    with pytest.raises(ValueError, match=r"was changed in place after metaopt\.export took it"):
        metaopt.Executor("cpu").run(
            main, feed=dict(zip(["x", "y"], inputs, strict=False)), fetch_list=[main.loss]
        )


# --- the share each layout reads --------------------------------------------------------------


@pytest.mark.parametrize(
    "full, split, zero_parts",
    [
        ((6, 4), None, 4),  # ZeRO: flat slices (4 does not divide 24: padding)
        ((12, 5), Split(0, 2, (4, 4, 4)), None),  # tensor parallel: a fused q, k, v's rows
        ((5, 12), Split(1, 3, (6, 6)), None),
        ((12, 5), Split(0, 2, (4, 4, 4)), 3),  # ZeRO slices of a tensor-parallel part
        ((5, 12), Split(1, 2, (6, 6)), 2),
        ((7,), None, 3),
    ],
)
def test_each_layout_reads_exactly_its_share(tmp_path, full, split, zero_parts):
    """Every worker's value equals its share cut from the whole tensor (sharded_io's cutting, the
    checkpoints' reference), and it reads only its own elements from the file."""
    whole = torch.arange(math.prod(full), dtype=torch.float32).view(full)
    save_file({"w": whole}, tmp_path / "w.safetensors")
    from safetensors import safe_open

    mp = split.parts if split else 1
    for m in range(mp):
        part = sharded_io.local_part(whole, split, m) if split else whole
        for z in range(zero_parts or 1):
            local = tuple(split.local_shape(full)) if split else full
            zero = ZeroShard(zero_parts, local) if zero_parts else None
            shape = (zero.local_numel,) if zero else local
            v = Var("w", "float32", shape, "param", split=split, zero=zero)
            share = pretrained.Share(m, z)
            want = take_slice(part, zero_parts, z) if zero else part
            read_elements = []
            with safe_open(tmp_path / "w.safetensors", framework="pt") as f:
                reader = pretrained._reader(f, "w")

                def counting(box, reader=reader, read_elements=read_elements):
                    t = reader(box)
                    read_elements.append(t.numel())
                    return t

                got = pretrained._local(v, share, counting)
            assert torch.equal(got, want), (m, z)
            own = zero.piece(z)[1] if zero else want.numel()
            assert sum(read_elements) == own, (m, z)  # nothing but this worker's elements


# --- bad sources, named ------------------------------------------------------------------------


@pytest.fixture
def tiny(tmp_path) -> tuple[metaopt.Program, Path]:
    from metaopt.ir import Program

    p = Program("tiny")
    p.add_var(Var("w", "float32", (4, 3), "param", trainable=True), torch.empty(4, 3, device="meta"))
    p.add_var(Var("b", "float32", (3,), "param", trainable=True), torch.empty(3, device="meta"))
    save_file({"w": torch.ones(4, 3), "b": torch.zeros(3)}, tmp_path / "model.safetensors")
    return p, tmp_path


def test_missing_unexpected_and_misshapen_keys_are_named(tiny):
    p, folder = tiny
    with pytest.raises(
        pretrained.PretrainedError, match=r"param 'w' of program 'tiny' does not start with prefix 'x\.'"
    ):
        fleet.load_pretrained(metaopt.Executor("cpu"), p, folder, prefix="x.")
    save_file({"w": torch.ones(4, 3), "b": torch.zeros(3), "c": torch.ones(1)}, folder / "model.safetensors")
    with pytest.raises(
        pretrained.PretrainedError, match=r"holds 1 key\(s\) no worker's program has .*\['c'\]"
    ):
        fleet.load_pretrained(metaopt.Executor("cpu"), p, folder)
    assert sorted(fleet.load_pretrained(metaopt.Executor("cpu"), p, folder, strict=False)) == ["b", "w"]
    save_file({"w": torch.ones(3, 4), "b": torch.zeros(3)}, folder / "model.safetensors")
    with pytest.raises(pretrained.PretrainedError, match=r"param 'w' is \[4, 3\] .* but key 'w' is \[3, 4\]"):
        fleet.load_pretrained(metaopt.Executor("cpu"), p, folder)
    save_file({"wq": torch.ones(4, 3), "b": torch.zeros(3)}, folder / "model.safetensors")
    with pytest.raises(pretrained.PretrainedError, match=r"has no key 'w' \(did you mean 'wq'\?\)"):
        fleet.load_pretrained(metaopt.Executor("cpu"), p, folder)


def test_another_dtype_is_converted_as_load_state_dict_does(tiny):
    p, folder = tiny
    save_file(
        {"w": torch.full((4, 3), 1.5, dtype=torch.bfloat16), "b": torch.zeros(3)},
        folder / "model.safetensors",
    )
    exe = metaopt.Executor("cpu")
    fleet.load_pretrained(exe, p, folder)
    assert exe.scope["w"].dtype == torch.float32 and torch.equal(exe.scope["w"], torch.full((4, 3), 1.5))


def _index(folder: Path, weight_map: dict) -> None:
    (folder / "model.safetensors").unlink()
    (folder / pretrained.INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize(
    "shard, message",
    [
        ("../outside.safetensors", r"is in shard '\.\./outside\.safetensors', which is not a file of"),
        ("/etc/passwd", r"is in shard '/etc/passwd', which is not a file of"),
        ("gone.safetensors", r"is in shard 'gone\.safetensors', which is not a file of"),
        ("link.safetensors", r"is in shard 'link\.safetensors', which is not a file of"),
    ],
)
def test_an_index_naming_shards_outside_the_folder_or_missing_is_refused(tiny, shard, message):
    p, folder = tiny
    save_file({"w": torch.ones(4, 3), "b": torch.zeros(3)}, folder.parent / "outside.safetensors")
    os.symlink(folder.parent / "outside.safetensors", folder / "link.safetensors")
    _index(folder, {"w": shard, "b": shard})
    exe = metaopt.Executor("cpu")
    with pytest.raises(pretrained.PretrainedError, match=message):
        fleet.load_pretrained(exe, p, folder)
    assert not exe.scope


def test_a_sharded_hf_folder_loads(tiny):
    p, folder = tiny
    save_file({"w": torch.ones(4, 3)}, folder / "model-00001-of-00002.safetensors")
    save_file({"b": torch.full((3,), 2.0)}, folder / "model-00002-of-00002.safetensors")
    _index(folder, {"w": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"})
    exe = metaopt.Executor("cpu")
    fleet.load_pretrained(exe, p, folder)
    assert torch.equal(exe.scope["b"], torch.full((3,), 2.0)) and torch.equal(
        exe.scope["w"], torch.ones(4, 3)
    )


# --- and back --------------------------------------------------------------------------------------


@pytest.mark.parametrize("shard_bytes", [5 << 30, 40_000])
def test_trained_values_go_back_to_transformers_and_to_the_module(tmp_path, shard_bytes):
    """save_pretrained writes what from_pretrained loads (one file, or shards and their index when
    `max_shard_bytes` is small); load_into copies the same values into the user's module."""
    import transformers

    main = _minimized("hf-gpt2", meta=False)
    exe = metaopt.Executor("cpu")
    _losses(exe, main, "hf-gpt2")
    module = _module("hf-gpt2")[0]
    fleet.save_pretrained(
        exe, main, tmp_path / "out", prefix="m.", config=module.m.config, max_shard_bytes=shard_bytes
    )
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    if shard_bytes < 1 << 20:
        assert pretrained.INDEX in files and len([f for f in files if f.endswith(".safetensors")]) > 1
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out").train()
    loaded = metaopt.load_into(module, exe, main)
    assert "m.transformer.wte.weight" in loaded
    mine = dict(module.m.named_parameters())
    for n, t in back.named_parameters():
        assert torch.equal(t, mine[n]), n
    feed = batch("hf-gpt2", 5)
    with torch.no_grad():  # the HF model and the user's wrapped module: the same values, the same loss
        assert torch.equal(back(**feed).loss, module(**feed))


def _raw_safetensors(path: Path, header: dict | bytes, data: bytes, length: int | None = None) -> None:
    """A safetensors file written by hand: an 8-byte header length (`length`, else the header's
    own), the header, the data."""
    import struct

    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)


@pytest.mark.parametrize(
    "header, data, length",
    [
        ({}, b"", 2**63),  # a header-length field of 2^63
        (  # offsets past the end of the file
            {
                "w": {"dtype": "F32", "shape": [4, 3], "data_offsets": [0, 48]},
                "b": {"dtype": "F32", "shape": [3], "data_offsets": [48, 60]},
            },
            bytes(20),
            None,
        ),
        (  # overlapping offsets
            {
                "w": {"dtype": "F32", "shape": [4, 3], "data_offsets": [0, 48]},
                "b": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]},
            },
            bytes(48),
            None,
        ),
        (b"{not json", b"", None),
    ],
    ids=["header-length-2^63", "offsets-past-the-file", "overlapping-offsets", "header-not-json"],
)
def test_a_hostile_safetensors_file_is_refused_by_name(tiny, header, data, length):
    """Issue 47, item 3: each a PretrainedError naming the file, in well under a second, nothing
    allocated at the sizes the file claims (safetensors validates the header before mapping)."""
    p, folder = tiny
    _raw_safetensors(folder / "model.safetensors", header, data, length)
    exe = metaopt.Executor("cpu")
    with pytest.raises(
        pretrained.PretrainedError, match=r"model\.safetensors is not a readable safetensors file"
    ):
        fleet.load_pretrained(exe, p, folder)
    assert not exe.scope


def test_a_tensor_of_another_kind_than_the_programs_is_refused(tiny):
    """bfloat16 into float32 converts (previous test); int64 into a float32 param is another
    tensor, not a precision: named with both dtypes."""
    p, folder = tiny
    save_file({"w": torch.ones(4, 3, dtype=torch.int64), "b": torch.zeros(3)}, folder / "model.safetensors")
    with pytest.raises(
        pretrained.PretrainedError, match=r"param 'w' is float32 .* key 'w' is I64 .*not a precision"
    ):
        fleet.load_pretrained(metaopt.Executor("cpu"), p, folder)


def test_a_file_changed_after_its_header_was_checked_is_refused_not_sliced_stale(tiny, monkeypatch):
    """The header is read again by the mapping each var is read from: a file replaced between the
    checks and the read (another shape under the same key) is named, not cut at the old shape."""
    p, folder = tiny
    check = pretrained._check

    def check_then_replace(*args, **kwargs):
        problem = check(*args, **kwargs)
        save_file({"w": torch.ones(3, 4), "b": torch.zeros(3)}, folder / "model.safetensors")
        return problem

    monkeypatch.setattr(pretrained, "_check", check_then_replace)
    with pytest.raises(pretrained.PretrainedError, match=r"key 'w' is \[3, 4\] .*changed while loading"):
        fleet.load_pretrained(metaopt.Executor("cpu"), p, folder)


def _hf_cache(
    tmp_path: Path, shards: dict[str, dict[str, torch.Tensor]], repo: str = "models--org--tiny"
) -> Path:
    """A Hugging Face cache repo as the hub client lays it out: the files in ``blobs/`` under
    their hashes, ``snapshots/<revision>/`` linking to them by relative links; the snapshot."""
    repo = tmp_path / repo
    snapshot = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    weight_map = {}
    for i, (name, tensors) in enumerate(shards.items()):
        save_file(tensors, repo / "blobs" / f"blob{i}")
        os.symlink(f"../../blobs/blob{i}", snapshot / name)
        weight_map.update(dict.fromkeys(tensors, name))
    (repo / "blobs" / "index").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    os.symlink("../../blobs/index", snapshot / pretrained.INDEX)
    return snapshot


def test_a_sharded_snapshot_of_the_hugging_face_cache_loads_through_its_blob_links(tiny, tmp_path):
    """The hub client's cache links a snapshot's files into the repo's blobs/: those links are
    followed (and only those: a link into another repo's blobs is refused as any link out)."""
    p, _ = tiny
    snapshot = _hf_cache(
        tmp_path / "cache",
        {"a.safetensors": {"w": torch.ones(4, 3)}, "b.safetensors": {"b": torch.full((3,), 2.0)}},
    )
    exe = metaopt.Executor("cpu")
    assert sorted(fleet.load_pretrained(exe, p, snapshot)) == ["b", "w"]
    assert torch.equal(exe.scope["w"], torch.ones(4, 3)) and torch.equal(
        exe.scope["b"], torch.full((3,), 2.0)
    )
    other = _hf_cache(
        tmp_path / "other", {"a.safetensors": {"w": torch.ones(4, 3)}, "b.safetensors": {"b": torch.zeros(3)}}
    )
    (snapshot / "b.safetensors").unlink()
    os.symlink(other.parent.parent / "blobs" / "blob1", snapshot / "b.safetensors")
    with pytest.raises(
        pretrained.PretrainedError, match=r"is in shard 'b\.safetensors', which is not a file of"
    ):
        fleet.load_pretrained(metaopt.Executor("cpu"), p, snapshot)
    # the same layout under a folder the hub client would not name: its links are links out
    shards = {"a.safetensors": {"w": torch.ones(4, 3), "b": torch.zeros(3)}}
    lookalike = _hf_cache(tmp_path / "x", shards, "mine")
    with pytest.raises(
        pretrained.PretrainedError, match=r"is in shard 'a\.safetensors', which is not a file of"
    ):
        fleet.load_pretrained(metaopt.Executor("cpu"), p, lookalike)


@pytest.mark.parametrize("when", ["before the check", "after the check"])
def test_a_file_turned_to_garbage_while_loading_is_refused_by_name(tiny, monkeypatch, when):
    """A file rewritten between the listing of its keys and the reads (another process saving into
    the folder): a PretrainedError naming the file, never safetensors' own error."""
    p, folder = tiny
    file = folder / "model.safetensors"
    name = "_share" if when == "before the check" else "_check"  # _share runs before _check
    real = getattr(pretrained, name)

    def then_garbage(*args, **kwargs):
        if when == "before the check":
            file.write_bytes(b"\xff" * 64)
        out = real(*args, **kwargs)
        if when == "after the check":
            file.write_bytes(b"\xff" * 64)
        return out

    monkeypatch.setattr(pretrained, name, then_garbage)
    exe = metaopt.Executor("cpu")
    with pytest.raises(
        pretrained.PretrainedError,
        match=r"model\.safetensors is not a readable safetensors file \(it changed",
    ):
        fleet.load_pretrained(exe, p, folder)
    assert not exe.scope


def test_a_key_gone_from_a_file_after_the_check_is_refused_by_name(tiny, monkeypatch):
    """The file replaced after the check by a valid one without the key: safetensors' error on the
    read becomes a PretrainedError naming the file (it was raw, after earlier vars were filled)."""
    p, folder = tiny
    check = pretrained._check

    def check_then_drop(*args, **kwargs):
        problem = check(*args, **kwargs)
        save_file({"b": torch.zeros(3)}, folder / "model.safetensors")
        return problem

    monkeypatch.setattr(pretrained, "_check", check_then_drop)
    with pytest.raises(
        pretrained.PretrainedError, match=r"model\.safetensors: .*\(it changed while loading\?\)"
    ):
        fleet.load_pretrained(metaopt.Executor("cpu"), p, folder)
