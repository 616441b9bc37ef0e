"""The tests' shared export cache (tests/export_cache.py) hands out what metaopt.export makes.

Workers and references load a saved export instead of exporting again; that is only sound if a
saved forward program loads back exactly: the same printed program, module map, feeds, loss and
values (bit for bit, same dtypes). These also check the cache's key: a model that differs in
anything the export depends on is exported again, an equal one is not."""

from __future__ import annotations

import export_cache
import pytest

import metaopt
import programs
from metaopt.frontend.onnx_save import save


def _same_program(got: metaopt.Program, want: metaopt.Program) -> None:
    assert export_cache.differences(got, want) is None, export_cache.differences(got, want)


@pytest.mark.parametrize(("name", "dropout"), [("gpt", 0.1), ("resnet", None)])
def test_a_saved_export_loads_back_as_the_same_program(tmp_path, name, dropout):
    mod = programs.get(name)
    model = mod.build("tiny", seed=0, **({} if dropout is None else {"dropout": dropout}))
    exported = metaopt.export(model, mod.example_inputs("tiny", 4, seed=1), name=name)
    save(exported, tmp_path / "p.onnx")
    _same_program(metaopt.load(tmp_path / "p.onnx"), exported)


def test_the_cache_exports_once_per_distinct_model(tmp_path, monkeypatch):
    monkeypatch.setenv(export_cache.ENV, str(tmp_path))
    calls = []
    real = metaopt.export
    monkeypatch.setattr(metaopt, "export", lambda *a, **k: calls.append(1) or real(*a, **k))
    mod = programs.get("mlp")
    inputs = mod.example_inputs("tiny", 4, seed=1)

    first = export_cache.export(mod.build("tiny", seed=0), inputs, name="mlp")
    again = export_cache.export(mod.build("tiny", seed=0), inputs, name="mlp")  # an equal model
    assert len(calls) == 1
    _same_program(again, first)
    _same_program(first, real(mod.build("tiny", seed=0), inputs, name="mlp"))

    # Each model below differs from the first in one thing, so each must miss the cache. What the
    # export returns does not matter here (the round trip above is the check of that): a copy of
    # the first program stands in for the ~5 s export each would cost.
    monkeypatch.setattr(metaopt, "export", lambda *a, **k: calls.append(1) or first.clone())
    export_cache.export(mod.build("tiny", seed=1), inputs, name="mlp")  # other values
    export_cache.export(mod.build("tiny", seed=0).eval(), inputs, name="mlp")  # eval mode
    export_cache.export(mod.build("tiny", seed=0), inputs, name="other")  # another program name
    export_cache.export(mod.build("tiny", seed=0), mod.example_inputs("tiny", 2, seed=1), name="mlp")
    assert len(calls) == 5
    assert len(list(tmp_path.glob("*.onnx"))) == 5


def test_without_the_variable_it_is_metaopt_export(monkeypatch):
    monkeypatch.delenv(export_cache.ENV, raising=False)
    calls = []
    monkeypatch.setattr(metaopt, "export", lambda *a, **k: calls.append(1) or "exported")
    mod = programs.get("mlp")
    assert export_cache.export(mod.build("tiny", seed=0), mod.example_inputs("tiny", 4, seed=1)) == "exported"
    assert export_cache.export(mod.build("tiny", seed=0), mod.example_inputs("tiny", 4, seed=1)) == "exported"
    assert len(calls) == 2


def test_differences_names_what_differs():
    mod = programs.get("mlp")
    want = metaopt.export(mod.build("tiny", seed=0), mod.example_inputs("tiny", 4, seed=1), name="mlp")
    got = want.clone()
    param = next(iter(got.params())).name
    got.values[param] = got.values[param].clone()
    got.values[param].view(-1)[0] += 1
    assert export_cache.differences(got, want) == f"value {param!r}"
    got.values[param] = want.values[param].double()
    assert export_cache.differences(got, want) == f"value {param!r}"
    got = want.clone()
    got.ops[0].attrs["extra"] = 1
    assert "exported" in export_cache.differences(got, want)


def test_a_meta_export_loads_back_on_meta_and_keys_apart_from_the_valued_one(tmp_path, monkeypatch):
    """The workers' meta exports are cached too: saved with zeros for their meta values, loaded
    with those values back on the meta device (the export's own constants kept as made)."""
    import torch

    monkeypatch.setenv(export_cache.ENV, str(tmp_path))
    mod = programs.get("mlp")
    inputs = mod.example_inputs("tiny", 4, seed=1)
    with torch.device("meta"):
        module = mod.build("tiny", seed=0)
    exported = metaopt.export(module, inputs, name="mlp")
    assert any(v.is_meta for v in exported.values.values())
    first = export_cache.export(module, inputs, name="mlp")
    again = export_cache.export(module, inputs, name="mlp")
    for got in (first, again):
        _same_program(got, exported)
        assert {k for k, v in got.values.items() if v.is_meta} == {
            k for k, v in exported.values.items() if v.is_meta
        }
    export_cache.export(mod.build("tiny", seed=0), inputs, name="mlp")  # the same shapes, with values
    assert len(list(tmp_path.glob("*.onnx"))) == 2
    assert len(list(tmp_path.glob("*.meta.json"))) == 1
