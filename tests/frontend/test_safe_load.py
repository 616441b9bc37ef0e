"""Tests for metaopt.frontend.safe_load: untrusted ONNX files never read outside their folder."""

from __future__ import annotations

import builtins
import io
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx import external_data_helper as edh

from metaopt.frontend.safe_load import ModelLoadError, load_model_proto

WEIGHT = np.arange(6, dtype=np.float32).reshape(2, 3)
BIAS = np.array([0.5, -1.0, 2.0], dtype=np.float32)
needs_symlinks = pytest.mark.skipif(not hasattr(os, "symlink"), reason="no symlink support")


# --------------------------------------------------------------------------- builders


def _tiny_model() -> onnx.ModelProto:
    """Y = X + weight + bias, with two initializers so multi-tensor paths get exercised."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["X", "weight"], ["t"]), helper.make_node("Add", ["t", "bias"], ["Y"])],
        "tiny",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2, 3])],
        [numpy_helper.from_array(WEIGHT, "weight"), numpy_helper.from_array(BIAS, "bias")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _point_external(tensor: TensorProto, location: str, offset: int = 0, length: int | None = None) -> None:
    """Turn an inline tensor into an external reference, whatever the location says."""
    nbytes = len(tensor.raw_data) if length is None else length
    edh.set_external_data(tensor, location, offset=offset, length=nbytes)
    tensor.data_location = TensorProto.EXTERNAL
    tensor.ClearField("raw_data")


def _write(model: onnx.ModelProto, path: Path) -> Path:
    # Raw serialization: onnx.save_model would try to (re)write external data itself.
    path.write_bytes(model.SerializeToString())
    return path


@pytest.fixture
def layout(tmp_path: Path) -> dict[str, Path]:
    """model/ (the trusted folder) next to outside/secret.bin holding valid-looking data.

    The secret has exactly the bytes the tensor expects, so if the loader ever followed a
    reference there, the load would *succeed*: a rejection proves the path was refused.
    """
    model_dir = tmp_path / "model"
    outside = tmp_path / "outside"
    model_dir.mkdir()
    outside.mkdir()
    (outside / "secret.bin").write_bytes(WEIGHT.tobytes())
    return {"model_dir": model_dir, "outside": outside, "secret": outside / "secret.bin"}


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record every path opened or stat'ed through Python or onnx's external-data opener."""
    seen: list[str] = []

    def wrap(func: Callable, arg_index: int = 0) -> Callable:
        def recorder(*args, **kwargs):
            target = args[arg_index] if len(args) > arg_index else None
            if isinstance(target, (str, bytes, os.PathLike)):
                seen.append(os.fsdecode(target))
            return func(*args, **kwargs)

        return recorder

    monkeypatch.setattr(os, "open", wrap(os.open))
    monkeypatch.setattr(os, "stat", wrap(os.stat))
    monkeypatch.setattr(builtins, "open", wrap(builtins.open))
    monkeypatch.setattr(io, "open", wrap(io.open))
    # onnx >= 1.21 opens external data in C++ through this hook; (base_dir, location, ...).
    monkeypatch.setattr(edh, "_open_external_data_fd", wrap(edh._open_external_data_fd, 1))
    return seen


def _assert_never_touched(seen: list[str], outside: Path) -> None:
    hits = [p for p in seen if str(outside) in p or "secret" in p]
    assert not hits, f"loader touched paths outside the model folder: {hits}"


def _assert_clean_message(message: str) -> None:
    # The caller must see our wording, not protobuf internals.
    assert "DecodeError" not in message
    assert "protobuf" not in message.lower()


# --------------------------------------------------------------------------- valid inputs


def test_valid_file_loads(tmp_path: Path) -> None:
    path = tmp_path / "m.onnx"
    onnx.save_model(_tiny_model(), path)
    model = load_model_proto(path)
    assert numpy_helper.to_array(model.graph.initializer[0]).tolist() == WEIGHT.tolist()
    assert load_model_proto(str(path)) == model


def test_valid_external_data_loads_and_weights_equal(tmp_path: Path) -> None:
    path = tmp_path / "m.onnx"
    onnx.save_model(
        _tiny_model(),
        path,
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="w.bin",
        size_threshold=0,
    )
    assert (tmp_path / "w.bin").exists()
    model = load_model_proto(path)
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    np.testing.assert_array_equal(weights["weight"], WEIGHT)
    np.testing.assert_array_equal(weights["bias"], BIAS)
    for tensor in model.graph.initializer:
        assert tensor.data_location == TensorProto.DEFAULT and not tensor.external_data


def test_external_data_in_subfolder_loads(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    path = tmp_path / "m.onnx"
    onnx.save_model(_tiny_model(), path, save_as_external_data=True, location="data/w.bin", size_threshold=0)
    model = load_model_proto(path)
    np.testing.assert_array_equal(numpy_helper.to_array(model.graph.initializer[0]), WEIGHT)


def test_bytes_source_loads() -> None:
    model = load_model_proto(_tiny_model().SerializeToString())
    assert model.graph.name == "tiny"


def test_modelproto_source_is_copied_not_mutated(tmp_path: Path) -> None:
    onnx.save_model(
        _tiny_model(), tmp_path / "m.onnx", save_as_external_data=True, location="w.bin", size_threshold=0
    )
    source = onnx.load_model(tmp_path / "m.onnx", load_external_data=False)
    before = source.SerializeToString()
    model = load_model_proto(source, base_dir=tmp_path)
    np.testing.assert_array_equal(numpy_helper.to_array(model.graph.initializer[1]), BIAS)
    assert source.SerializeToString() == before


@pytest.mark.parametrize("as_bytes", [False, True])
def test_in_memory_source_with_external_data_needs_base_dir(tmp_path: Path, as_bytes: bool) -> None:
    onnx.save_model(
        _tiny_model(), tmp_path / "m.onnx", save_as_external_data=True, location="w.bin", size_threshold=0
    )
    source = onnx.load_model(tmp_path / "m.onnx", load_external_data=False)
    with pytest.raises(ModelLoadError, match=r"'weight'.*'w\.bin'.*no base folder"):
        load_model_proto(source.SerializeToString() if as_bytes else source)


# --------------------------------------------------------------------------- torch exports


@pytest.fixture(scope="module")
def torch_export():
    torch = pytest.importorskip("torch")
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).eval()
    program = torch.onnx.export(module, (torch.randn(2, 4),), dynamo=True, optimize=False)
    return module, program


@pytest.mark.parametrize("external", [False, True])
def test_torch_export_passes_checker(tmp_path: Path, torch_export, external: bool) -> None:
    module, program = torch_export
    path = tmp_path / "torch.onnx"
    program.save(path, external_data=external)
    model = load_model_proto(path)  # includes onnx.checker.check_model
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for name, value in module.state_dict().items():
        np.testing.assert_array_equal(weights[name], value.numpy())


def test_torch_model_proto_saved_as_external_data(tmp_path: Path, torch_export) -> None:
    module, program = torch_export
    path = tmp_path / "torch.onnx"
    onnx.save_model(
        program.model_proto,
        path,
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="w.bin",
        size_threshold=0,
    )
    weights = {t.name: numpy_helper.to_array(t) for t in load_model_proto(path).graph.initializer}
    np.testing.assert_array_equal(weights["0.weight"], module.state_dict()["0.weight"].numpy())


# --------------------------------------------------------------------------- hostile external data


def _model_pointing_at(model_dir: Path, location: str, **kwargs: int) -> Path:
    model = _tiny_model()
    _point_external(model.graph.initializer[0], location, **kwargs)
    return _write(model, model_dir / "m.onnx")


def test_absolute_location_rejected(layout, opened) -> None:
    path = _model_pointing_at(layout["model_dir"], str(layout["secret"]))
    with pytest.raises(ModelLoadError, match=r"'weight'.*absolute") as info:
        load_model_proto(path)
    assert str(layout["secret"]) in str(info.value)
    _assert_never_touched(opened, layout["outside"])


@pytest.mark.parametrize(
    "location", ["../outside/secret.bin", "sub/../../outside/secret.bin", "./../outside/secret.bin"]
)
def test_dotdot_location_rejected(layout, opened, location: str) -> None:
    path = _model_pointing_at(layout["model_dir"], location)
    with pytest.raises(ModelLoadError, match=r"'weight'.*'\.\.'") as info:
        load_model_proto(path)
    assert location in str(info.value)
    _assert_never_touched(opened, layout["outside"])


@pytest.mark.parametrize("location", ["C:/secret.bin", "c:secret.bin", "..\\outside\\secret.bin", ""])
def test_windows_style_or_empty_location_rejected(layout, opened, location: str) -> None:
    path = _model_pointing_at(layout["model_dir"], location)
    with pytest.raises(ModelLoadError, match=r"'weight'"):
        load_model_proto(path)
    _assert_never_touched(opened, layout["outside"])


@needs_symlinks
def test_symlink_file_pointing_outside_rejected(layout, opened) -> None:
    (layout["model_dir"] / "w.bin").symlink_to(layout["secret"])
    path = _model_pointing_at(layout["model_dir"], "w.bin")
    with pytest.raises(ModelLoadError, match=r"'weight'.*'w\.bin'.*symlink"):
        load_model_proto(path)
    _assert_never_touched(opened, layout["outside"])


@needs_symlinks
def test_symlinked_subfolder_rejected(layout, opened) -> None:
    (layout["model_dir"] / "sub").symlink_to(layout["outside"], target_is_directory=True)
    path = _model_pointing_at(layout["model_dir"], "sub/secret.bin")
    with pytest.raises(ModelLoadError, match=r"'weight'.*'sub/secret\.bin'.*symlink"):
        load_model_proto(path)
    _assert_never_touched(opened, layout["outside"])


@needs_symlinks
def test_symlink_inside_folder_pointing_inside_is_still_rejected(layout) -> None:
    # Even harmless-looking links are refused: one rule is easier to trust than two.
    (layout["model_dir"] / "real.bin").write_bytes(WEIGHT.tobytes())
    (layout["model_dir"] / "w.bin").symlink_to(layout["model_dir"] / "real.bin")
    with pytest.raises(ModelLoadError, match="symlink"):
        load_model_proto(_model_pointing_at(layout["model_dir"], "w.bin"))


@needs_symlinks
def test_symlinked_model_path_is_allowed_but_references_stay_in_its_folder(layout) -> None:
    # The model path itself may be a link; its references resolve against the link's folder.
    real = layout["outside"] / "real.onnx"
    onnx.save_model(_tiny_model(), real, save_as_external_data=True, location="w.bin", size_threshold=0)
    (layout["model_dir"] / "m.onnx").symlink_to(real)
    with pytest.raises(ModelLoadError, match=r"'weight'.*does not exist"):
        load_model_proto(layout["model_dir"] / "m.onnx")
    onnx.save_model(_tiny_model(), layout["outside"] / "inline.onnx")
    (layout["model_dir"] / "inline.onnx").symlink_to(layout["outside"] / "inline.onnx")
    assert load_model_proto(layout["model_dir"] / "inline.onnx").graph.name == "tiny"


def test_offset_plus_length_beyond_file_rejected(layout, opened) -> None:
    (layout["model_dir"] / "w.bin").write_bytes(WEIGHT.tobytes())
    path = _model_pointing_at(layout["model_dir"], "w.bin", offset=8, length=24)
    opened.clear()  # forget the test's own writes
    with pytest.raises(ModelLoadError, match=r"'weight'.*'w\.bin'.*past the end"):
        load_model_proto(path)
    # Bounds are checked from metadata, before the data file is ever opened.
    assert not [p for p in opened if p.endswith("w.bin")]


def test_offset_beyond_file_rejected(layout) -> None:
    (layout["model_dir"] / "w.bin").write_bytes(WEIGHT.tobytes())
    with pytest.raises(ModelLoadError, match=r"'weight'.*offset 1000"):
        load_model_proto(_model_pointing_at(layout["model_dir"], "w.bin", offset=1000))


def test_malformed_offset_rejected(layout) -> None:
    (layout["model_dir"] / "w.bin").write_bytes(WEIGHT.tobytes())
    model = _tiny_model()
    _point_external(model.graph.initializer[0], "w.bin")
    model.graph.initializer[0].external_data[1].value = "-4"  # the offset entry
    with pytest.raises(ModelLoadError, match=r"'weight'.*offset '-4'"):
        load_model_proto(_write(model, layout["model_dir"] / "m.onnx"))


def test_missing_data_file_rejected(layout) -> None:
    with pytest.raises(ModelLoadError, match=r"'weight'.*'w\.bin'.*does not exist"):
        load_model_proto(_model_pointing_at(layout["model_dir"], "w.bin"))


def test_data_location_is_a_directory_rejected(layout) -> None:
    (layout["model_dir"] / "w.bin").mkdir()
    with pytest.raises(ModelLoadError, match=r"'weight'.*not a regular file"):
        load_model_proto(_model_pointing_at(layout["model_dir"], "w.bin"))


def test_every_reference_validated_before_any_read(layout, opened) -> None:
    # First tensor is fine, second escapes: nothing at all may be read.
    (layout["model_dir"] / "w.bin").write_bytes(WEIGHT.tobytes())
    model = _tiny_model()
    _point_external(model.graph.initializer[0], "w.bin")
    _point_external(model.graph.initializer[1], "../outside/secret.bin")
    path = _write(model, layout["model_dir"] / "m.onnx")
    opened.clear()  # forget the test's own writes
    with pytest.raises(ModelLoadError, match=r"'bias'"):
        load_model_proto(path)
    assert not [p for p in opened if p.endswith("w.bin")]
    _assert_never_touched(opened, layout["outside"])


# --------------------------------------------------------------------------- tensors in odd places


def _constant_node(name: str) -> onnx.NodeProto:
    value = numpy_helper.from_array(WEIGHT, name)
    return helper.make_node("Constant", [], ["c"], name="const_node", value=value)


def _place_in_constant(model: onnx.ModelProto) -> TensorProto:
    model.graph.node.insert(0, _constant_node("hidden"))
    return model.graph.node[0].attribute[0].t


def _place_in_sparse_initializer(model: onnx.ModelProto) -> TensorProto:
    values = numpy_helper.from_array(np.array([1.0], dtype=np.float32), "hidden")
    indices = numpy_helper.from_array(np.array([0], dtype=np.int64), "hidden_idx")
    model.graph.sparse_initializer.append(helper.make_sparse_tensor(values, indices, [4]))
    return model.graph.sparse_initializer[0].values


def _place_in_subgraph(model: onnx.ModelProto) -> TensorProto:
    branch = helper.make_graph(
        [helper.make_node("Identity", ["hidden"], ["o"])],
        "branch",
        [],
        [helper.make_tensor_value_info("o", TensorProto.FLOAT, [2, 3])],
        [numpy_helper.from_array(WEIGHT, "hidden")],
    )
    node = helper.make_node("If", ["cond"], ["r"], then_branch=branch, else_branch=branch)
    model.graph.node.append(node)
    return model.graph.node[-1].attribute[0].g.initializer[0]


def _place_in_function(model: onnx.ModelProto) -> TensorProto:
    function = helper.make_function(
        "custom", "F", [], ["c"], [_constant_node("hidden")], [helper.make_opsetid("", 17)]
    )
    model.functions.append(function)
    return model.functions[0].node[0].attribute[0].t


def _place_in_training_info(model: onnx.ModelProto) -> TensorProto:
    info = model.training_info.add()
    info.algorithm.name = "algo"
    info.algorithm.initializer.append(numpy_helper.from_array(WEIGHT, "hidden"))
    return info.algorithm.initializer[0]


@pytest.mark.parametrize(
    "place",
    [
        _place_in_constant,
        _place_in_sparse_initializer,
        _place_in_subgraph,
        _place_in_function,
        _place_in_training_info,
    ],
)
def test_external_tensors_everywhere_are_validated(layout, opened, place) -> None:
    model = _tiny_model()
    _point_external(place(model), "../outside/secret.bin")
    with pytest.raises(ModelLoadError, match=r"'hidden'.*'\.\./outside/secret\.bin'"):
        load_model_proto(_write(model, layout["model_dir"] / "m.onnx"))
    _assert_never_touched(opened, layout["outside"])


def test_constant_with_external_data_inside_folder_loads(tmp_path: Path) -> None:
    model = _tiny_model()
    model.graph.node.insert(0, _constant_node("const_w"))
    (tmp_path / "c.bin").write_bytes(b"\0" * 4 + WEIGHT.tobytes())
    _point_external(model.graph.node[0].attribute[0].t, "c.bin", offset=4, length=WEIGHT.nbytes)
    loaded = load_model_proto(_write(model, tmp_path / "m.onnx"))
    np.testing.assert_array_equal(numpy_helper.to_array(loaded.graph.node[0].attribute[0].t), WEIGHT)


# --------------------------------------------------------------------------- malformed files


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(os.urandom(256), id="random"),
        pytest.param(b"", id="empty"),
        pytest.param(b"this is a text file, not a model\n" * 4, id="text"),
        pytest.param(None, id="truncated"),
    ],
)
def test_malformed_file_names_the_path(tmp_path: Path, content: bytes | None) -> None:
    path = tmp_path / "bad.onnx"
    if content is None:
        full = _tiny_model().SerializeToString()
        content = full[: len(full) // 2]
    path.write_bytes(content)
    with pytest.raises(ModelLoadError, match="not a valid ONNX model") as info:
        load_model_proto(path)
    assert str(path) in str(info.value)
    _assert_clean_message(str(info.value))


def test_random_bytes_source(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"<bytes>: not a valid ONNX model") as info:
        load_model_proto(b"\xff\xff\xff\xff\xff")
    _assert_clean_message(str(info.value))


def test_directory_path_rejected(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="directory") as info:
        load_model_proto(tmp_path)
    assert str(tmp_path) in str(info.value)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs")
def test_fifo_path_rejected_without_blocking(tmp_path: Path) -> None:
    path = tmp_path / "pipe.onnx"
    os.mkfifo(path)
    with pytest.raises(ModelLoadError, match="not a regular file"):
        load_model_proto(path)


def test_missing_path_rejected(tmp_path: Path) -> None:
    path = tmp_path / "nope.onnx"
    with pytest.raises(ModelLoadError, match="no such file") as info:
        load_model_proto(path)
    assert str(path) in str(info.value)


def test_model_without_graph_rejected(tmp_path: Path) -> None:
    model = _tiny_model()
    model.ClearField("graph")
    with pytest.raises(ModelLoadError, match="no graph"):
        load_model_proto(_write(model, tmp_path / "m.onnx"))


def test_model_without_ir_version_rejected() -> None:
    model = _tiny_model()
    model.ir_version = 0
    with pytest.raises(ModelLoadError, match="ir_version"):
        load_model_proto(model)


def test_checker_failure_is_wrapped(tmp_path: Path) -> None:
    # (A truncated initializer used to be the example here; it is now refused earlier, by the
    # declared-size check: test_truncated_raw_data_is_refused_before_conversion.)
    model = _tiny_model()
    model.graph.node[1].input[0] = "nowhere"
    with pytest.raises(ModelLoadError, match=r"m\.onnx: not a valid ONNX model \(.*nowhere"):
        load_model_proto(_write(model, tmp_path / "m.onnx"))


def test_file_over_2gib_rejected_without_reading(tmp_path: Path, opened) -> None:
    path = tmp_path / "huge.onnx"
    with open(path, "wb") as handle:  # sparse file: no disk space, never read
        handle.truncate(2**31 + 16)
    with pytest.raises(ModelLoadError, match="external data") as info:
        load_model_proto(path)
    assert str(path) in str(info.value)


def test_wrong_source_type() -> None:
    with pytest.raises(TypeError):
        load_model_proto(12)  # type: ignore[arg-type]
