"""DESIGN.md, Layout: imports go one way, ir <- ops <- passes <- fleet, with layout/ below passes,
fleet and runtime: ir/ imports nothing else of metaopt; ops/ never imports the frontend, passes,
fleet or runtime; passes never import the frontend, runtime or fleet; the runtime never imports
fleet or passes; fleet never imports the runtime; layout/ imports only ir; the planner is above
fleet, so nothing below it imports it (fleet/__init__.py names `fleet.plan`, Fleet's namespace,
from it: the one exception). Checked on every import statement of the source (function-level and
TYPE_CHECKING ones included)."""

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
    "ops": ("metaopt.frontend", "metaopt.passes", "metaopt.fleet", "metaopt.runtime", "metaopt.planner"),
    "passes": ("metaopt.frontend", "metaopt.runtime", "metaopt.fleet", "metaopt.planner"),
    "runtime": ("metaopt.fleet", "metaopt.passes", "metaopt.planner"),
    "fleet": ("metaopt.runtime", "metaopt.planner"),
    "layout": ("metaopt.ops", "metaopt.passes", "metaopt.fleet", "metaopt.runtime", "metaopt.frontend"),
}
# fleet.plan: the planner's entry point under Fleet's namespace, where users look for it
ALLOWED = {("fleet/__init__.py", "metaopt.planner.search")}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_layering(package):
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for line, name in _imports(path):
            if name.startswith("metaopt.ir") and package == "ir":
                continue
            where = str(path.relative_to(ROOT))
            if name.startswith(FORBIDDEN[package]) and not any(
                where == w and name.startswith(n) for w, n in ALLOWED
            ):
                bad.append(f"{path.relative_to(ROOT.parent)}:{line} imports {name}")
    assert not bad, "\n".join(bad)


DEVICE_TYPES = {"cpu", "cuda", "meta", "mps"}


def _type_comparisons(path: Path) -> list[tuple[int, str]]:
    """`<x>.type ==/!=/in <string literal(s)>` comparisons of `path` (device types excepted)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Compare):
            continue
        if not (isinstance(node.left, ast.Attribute) and node.left.attr == "type"):
            continue
        strings = []
        for c in node.comparators:
            elts = c.elts if isinstance(c, (ast.Tuple, ast.List, ast.Set)) else [c]
            strings += [e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
        if strings and not set(strings) <= DEVICE_TYPES:
            out.append((node.lineno, ast.unparse(node)))
    return out


def test_no_op_type_switches_outside_the_op_table():
    """Issue 13: per-op knowledge lives in metaopt/ops (rows, patterns); passes, fleet, runtime and
    frontend ask the rows instead of comparing op types to strings."""
    bad = [
        f"{path.relative_to(ROOT)}:{line}: {text}"
        for path in sorted(ROOT.rglob("*.py"))
        if "ops" not in path.relative_to(ROOT).parts[:1]
        for line, text in _type_comparisons(path)
    ]
    assert not bad, "\n".join(bad)
