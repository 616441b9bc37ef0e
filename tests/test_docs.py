"""Every ```python block of the guides (docs/*.md) and of README.md runs, so no example rots.

The blocks of one page run in order, in one namespace, in a fresh temp folder (a page is one
session a reader would type). A block that cannot run on a CPU-only machine inside a test (a
GPU, several workers under `metaoptrun`, several hosts) is preceded by an HTML comment
`<!-- norun: reason -->` (invisible on the site and on GitHub): it is still compiled, and it is
reported as a skipped test with its reason (`pytest -ra` lists them). Blocks of any other info
string (```bash, ```text) are not run.

`metaopt.export` goes through tests/export_cache.py here: the pages export the same tiny models
many times, and the subject is what the pages do with the program, not the exporter (whose
own tests hold the cached program equal to a fresh export).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import metaopt

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
NORUN = re.compile(r"<!--\s*norun:\s*(.*?)\s*-->\s*$", re.S)
# Blocks marked norun in all pages together: kept small on purpose (raise it only with a reason).
MAX_NORUN = 12


def _blocks(page: Path) -> list[tuple[int, str, str | None]]:
    """(line, code, norun reason or None) of every ```python block of `page`, in order."""
    text = page.read_text()
    out = []
    for m in FENCE.finditer(text):
        if m.group(1) != "python":
            continue
        before = text[: m.start()].rstrip()
        last = before[before.rfind("\n") + 1 :]
        reason = NORUN.search(last)
        out.append((text.count("\n", 0, m.start()) + 1, m.group(2), reason.group(1) if reason else None))
    return out


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


NORUN_BLOCKS = [(p, line, why) for p in PAGES for line, _, why in _blocks(p) if why is not None]


@pytest.fixture
def cached_export(monkeypatch):
    import export_cache

    real = metaopt.export

    def export(*args, **kwargs):
        if kwargs.get("channels_last") is False:  # export_cache loads its file with the default
            return real(*args, **kwargs)
        monkeypatch.setattr(metaopt, "export", real)  # export_cache calls metaopt.export itself
        try:
            return export_cache.export(*args, **kwargs)
        finally:
            monkeypatch.setattr(metaopt, "export", export)

    monkeypatch.setattr(metaopt, "export", export)


@pytest.mark.parametrize("page", [p for p in PAGES if _blocks(p)], ids=_name)
def test_the_python_blocks_of_a_page_run_in_order(page, tmp_path, monkeypatch, cached_export):
    from metaopt.fleet import env

    monkeypatch.chdir(tmp_path)
    env.reset()
    namespace: dict = {"__name__": "__docs__"}
    ran = skipped = 0
    try:
        for line, code, why in _blocks(page):
            compiled = compile(code, f"{_name(page)}:{line}", "exec")
            if why is not None:
                skipped += 1
                continue
            try:
                exec(compiled, namespace)
            except Exception as e:
                raise AssertionError(f"{_name(page)}: the block at line {line} failed: {e!r}") from e
            ran += 1
    finally:
        env.reset()
    print(f"{_name(page)}: {ran} blocks ran, {skipped} marked norun")


@pytest.mark.parametrize(
    "page,line,why", NORUN_BLOCKS, ids=[f"{_name(p)}:{line}" for p, line, _ in NORUN_BLOCKS]
)
def test_norun_block(page, line, why):
    """One skip per block not run, with its reason, so the set stays visible."""
    assert why, f"{_name(page)}:{line}: a norun block must say why"
    pytest.skip(f"{_name(page)}:{line} not run: {why}")


def test_the_norun_set_stays_small():
    assert len(NORUN_BLOCKS) <= MAX_NORUN, [f"{_name(p)}:{line}" for p, line, _ in NORUN_BLOCKS]


def test_every_page_is_in_the_site_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    missing = [p.name for p in PAGES if p.parent == ROOT / "docs" and p.name not in nav]
    assert not missing, f"pages not in mkdocs.yml's nav: {missing}"
