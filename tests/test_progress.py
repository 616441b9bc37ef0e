"""Issue 32: export and minimize said nothing for ~20 s on BERT-base. Each phase and step now
logs its seconds at INFO (``metaopt.export``, ``metaopt.passes``): quiet by default, one line
each when the user turns INFO on."""

from __future__ import annotations

import logging
import re

import metaopt
import programs


def test_export_and_minimize_log_each_phase_with_its_seconds_at_info(caplog):
    mod = programs.get("mlp")
    with caplog.at_level(logging.INFO, logger="metaopt"):
        p = metaopt.export(mod.build("tiny", seed=0), mod.example_inputs("tiny", 4, seed=1), name="mlp")
        metaopt.optimizer.SGD(learning_rate=0.1).minimize(p.loss)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("metaopt")]
    for what in (
        "export: torch.export capture",
        "export: torch.onnx decomposition",
        "export: import as a program",
        "import step fold_constants",
        "minimize step append_backward",
        "minimize step apply_optimizer",
    ):
        assert any(re.fullmatch(rf"{what}: \d+\.\d s", line) for line in lines), (what, lines)
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name.startswith("metaopt."))
