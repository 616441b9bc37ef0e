"""The planner's worker processes (metaopt/planner/workers.py): a worker that dies, or answers
nothing in time, is an error naming the layouts it held; nothing hangs. (That they give the same
plans as one process: tests/planner/test_blocks.py.)"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from metaopt.planner.workers import Pool, WorkerError


class Named:
    def __init__(self, name: str) -> None:
        self.name = name

    def describe(self) -> str:
        return self.name


class Job:
    """Pickled to the workers, which import this module by name (PYTHONPATH below)."""

    def evaluate(self, lay: Named, *, whole: bool) -> str:
        if lay.name == "dies":
            os._exit(3)
        if lay.name == "hangs":
            time.sleep(120)
        if lay.name == "refused":
            raise ValueError("not this one\nsecond line")
        return f"{lay.name} whole={whole}"


@pytest.fixture
def importable(monkeypatch):
    """The workers import `Job`'s module by the name this process gave it, from this folder."""
    here = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    assert Job.__module__ in sys.modules


def test_a_dead_or_silent_worker_is_an_error_naming_its_layouts(importable):
    job = Job()
    start = time.monotonic()
    with Pool(job, 2) as pool, Pool(job, 1, timeout=2) as silent:  # their workers start together
        got = pool.map([[Named("a"), Named("refused")], [Named("b")]], whole=True)
        assert got == [["a whole=True", "not this one"], ["b whole=True"]]  # in order; a refusal's first line
        with pytest.raises(WorkerError, match=r"planner worker \d exited \(3\) while rewriting dies"):
            pool.map([[Named("dies")]], whole=False)
        with pytest.raises(WorkerError, match=r"answered nothing in 2 s rewriting hangs"):
            silent.map([[Named("hangs")]], whole=False)
    assert time.monotonic() - start < 30  # the hung worker killed, not waited for
    assert all(p.poll() is not None for p in (*pool.procs, *silent.procs))
