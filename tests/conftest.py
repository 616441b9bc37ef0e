"""Shared test fixtures: golden-file comparison and cached exports of the reference programs."""

from __future__ import annotations

import difflib
import functools
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `programs/` is beside the package, not installed
    sys.path.insert(0, str(ROOT))

GOLDEN = Path(__file__).resolve().parent / "golden"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-golden",
        action="store_true",
        default=False,
        help="rewrite tests/golden/ files from the current output (say why in the commit)",
    )


@pytest.fixture
def golden(request: pytest.FixtureRequest):
    """golden("pass/case", text): compare with tests/golden/pass/case.txt (unified diff)."""
    update = request.config.getoption("--update-golden")

    def check(case: str, text: str) -> None:
        path = GOLDEN / f"{case}.txt"
        if update:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            return
        if not path.exists():
            pytest.fail(f"no golden file {path.relative_to(ROOT)}; run pytest --update-golden to create it")
        want = path.read_text()
        if text != want:
            diff = "".join(
                difflib.unified_diff(
                    want.splitlines(True), text.splitlines(True), f"golden/{case}.txt", "actual", n=2
                )
            )
            pytest.fail(f"program differs from golden/{case}.txt:\n{diff[:20000]}")

    return check


@functools.cache
def exported(name: str, config: str = "tiny", dropout: float = 0.0, batch: int = 4):
    """(module, inputs, program) for a reference program; cached: exports take seconds."""
    import metaopt
    import programs

    mod = programs.get(name)
    overrides = {"dropout": dropout} if dropout is not None else {}
    module = mod.build(config, seed=0, **overrides)
    inputs = mod.example_inputs(config, batch, seed=1)
    program = metaopt.export(module, inputs, name=name)
    return module, inputs, program
