"""METAOPT_DUMP writes the program after every pass, in the golden format."""

from __future__ import annotations

import metaopt
import programs
from metaopt.ir import parse_program


def test_dump_after_every_pass(tmp_path, monkeypatch):
    monkeypatch.setenv("METAOPT_DUMP", str(tmp_path))
    mlp = programs.get("mlp")
    main = metaopt.export(mlp.build("tiny", dropout=0.1), mlp.example_inputs("tiny", 4), name="mlp")
    metaopt.optimizer.SGD(learning_rate=0.1).minimize(main.loss)
    files = sorted(p.name for p in tmp_path.iterdir())
    steps = [f.split("_", 2)[2].removesuffix(".txt") for f in files]
    assert steps == [
        "import",
        "repair_training",
        "fold_constants",
        "dead_code",
        "fuse",
        "channels_last",
        "readable_names",
        "sort_vars",
        "append_backward",
        "apply_optimizer",
    ]
    last = (tmp_path / files[-1]).read_text()
    assert last == str(main)
    assert str(parse_program(last)) == last


def test_no_dump_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv("METAOPT_DUMP", raising=False)
    monkeypatch.chdir(tmp_path)
    mlp = programs.get("mlp")
    metaopt.export(mlp.build("tiny"), mlp.example_inputs("tiny", 4))
    assert list(tmp_path.iterdir()) == []
