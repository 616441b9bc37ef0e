"""DESIGN.md, Layout: ir/ imports nothing else of metaopt; ops/ and passes/ never import the
frontend; ops/ never imports passes/; passes never import the runtime. Checked on every import
statement of the source (function-level and TYPE_CHECKING ones included)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import metaopt

ROOT = Path(metaopt.__file__).parent


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [(node.lineno, node.module)]
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


FORBIDDEN = {
    "ir": ("metaopt.",),  # but metaopt.ir itself
    "ops": ("metaopt.frontend", "metaopt.passes", "metaopt.fleet", "metaopt.runtime.executor"),
    "passes": ("metaopt.frontend", "metaopt.runtime", "metaopt.fleet"),
}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_layering(package):
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for line, name in _imports(path):
            if name.startswith("metaopt.ir") and package == "ir":
                continue
            if name.startswith(FORBIDDEN[package]):
                bad.append(f"{path.relative_to(ROOT.parent)}:{line} imports {name}")
    assert not bad, "\n".join(bad)
