"""Damaged files a fuzzer made from metaopt's own saves: every one is refused with a load error
naming the file (ModelLoadError, or ImportError_ naming the op too), never a raw TypeError,
UnicodeDecodeError or NotImplementedError from deep inside the importer.

The cases below are the ones a 10,000-file run (random node types, attributes, inputs,
initializer dims and element types, value infos, byte flips) found before the fix; the seeded
sweep keeps the net under them honest."""

from __future__ import annotations

import random

import onnx
import pytest
from conftest import exported

import metaopt
from metaopt import fleet
from metaopt.frontend.onnx_import import ImportError_
from metaopt.frontend.onnx_save import save
from metaopt.frontend.safe_load import ModelLoadError, ModelNotSupported


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> onnx.ModelProto:
    """The mlp's training program (backward, Adam, AMP: most kinds of op and metadata)."""
    main = exported("mlp")[2].clone()
    strategy = fleet.DistributedStrategy()
    strategy.amp = True
    fleet.init(is_collective=True)
    fleet.distributed_optimizer(metaopt.optimizer.Adam(learning_rate=1e-3), strategy).minimize(main.loss)
    path = tmp_path_factory.mktemp("fuzz") / "mlp_train.onnx"
    save(main, path)
    return onnx.load(path)


def _copy(m: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(m)
    return out


def test_an_unsupported_element_type_is_a_load_error_and_not_implemented(saved):
    m = _copy(saved)
    t = next(t for t in m.graph.initializer if t.data_type == onnx.TensorProto.FLOAT)
    t.data_type = onnx.TensorProto.FLOAT8E5M2
    t.raw_data = t.raw_data[: len(t.raw_data) // 4]  # one byte an element: well-formed otherwise
    unsupported = rf"<ModelProto>: tensor '{t.name}': .*FLOAT8E5M2 is not supported"
    with pytest.raises(ModelNotSupported, match=unsupported) as e:
        metaopt.load(m)
    assert isinstance(e.value, NotImplementedError) and isinstance(e.value, ModelLoadError)


def test_an_attribute_that_is_not_utf8_names_the_op(saved):
    m = _copy(saved)
    node = next(n for n in m.graph.node if any(a.type == onnx.AttributeProto.STRING for a in n.attribute))
    a = next(a for a in node.attribute if a.type == onnx.AttributeProto.STRING)
    a.s = b"\xff\xfe"
    with pytest.raises(ImportError_, match=rf"op {node.op_type} .*attribute '{a.name}' is not UTF-8 text"):
        metaopt.load(m)


def test_metadata_that_is_not_utf8_is_an_import_error(saved):
    m = _copy(saved)
    data = bytearray(m.SerializeToString())
    key = saved.metadata_props[0].key.encode()
    at = data.rindex(key)
    data[at] = 0xFF  # the model's first metadata key: invalid UTF-8 (protobuf then hands bytes)
    m = onnx.load_from_string(bytes(data))
    with pytest.raises(ImportError_, match=r"the model: metadata key .* is not UTF-8 text"):
        metaopt.load(m)


def _mutate(m: onnx.ModelProto, rng: random.Random) -> onnx.ModelProto | None:
    kind = rng.randrange(4)
    nodes = m.graph.node
    if kind == 0:
        rng.choice(nodes).op_type = rng.choice(["Foo", "Loop", "Gemm", "Reshape", "Slice", "TopK", "NonZero"])
    elif kind == 1:
        node = rng.choice([n for n in nodes if n.attribute])
        a = rng.choice(node.attribute)
        a.type = rng.randrange(0, 15)
    elif kind == 2:
        t = rng.choice(m.graph.initializer)
        if t.dims:
            t.dims[rng.randrange(len(t.dims))] = rng.choice([0, -1, 3, 2**31])
        else:
            t.data_type = rng.randrange(0, 25)
    else:
        data = bytearray(m.SerializeToString())
        for _ in range(rng.randrange(1, 5)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            return onnx.load_from_string(bytes(data))
        except Exception:  # noqa: BLE001 - not even protobuf: nothing for metaopt to refuse
            return None
    return m


def test_a_seeded_sweep_of_damaged_files_raises_only_load_errors(saved):
    rng = random.Random(0)
    failures = 0
    for _ in range(300):
        m = _mutate(_copy(saved), rng)
        if m is None:
            continue
        try:
            metaopt.load(m)
        except (ModelLoadError, ImportError_):
            failures += 1
    assert failures > 200  # the sweep does damage: most files are refused
