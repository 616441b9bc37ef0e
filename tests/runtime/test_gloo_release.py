"""A gloo collective returns only once gloo's thread has let go of its tensors
(layout.groups.await_release). Before, a worker that raised right after one (fleet's minimize
on workers whose programs differ) sometimes aborted at exit (SIGABRT, "terminate called without
an active exception") instead of exiting 1: gloo's thread took the GIL during interpreter
finalization to hand the tensors back. Under load that was 2 runs in 30; the worker checks the
cause directly, on every collective, which fails on the old code at once."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import torch
from workers import start_workers, wait_workers

from metaopt.layout import groups

WORKER = str(Path(__file__).parent / "gloo_release_worker.py")


def test_every_collective_returns_with_its_tensors_let_go():
    logs = wait_workers(start_workers(2, [WORKER], cold=True), "gloo release", timeout=120)
    for r, log in enumerate(logs):
        assert f"rank {r} checked 150 collectives" in log, log[-2000:]


def test_a_worker_raising_right_after_a_collective_exits_1_not_sigabrt():
    procs = start_workers(2, [WORKER, "raise"], cold=True)  # the interpreter's exit is the subject
    outs = [p.communicate(timeout=120)[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 1, out[-3000:]
        assert "raised right after a collective" in out and "terminate called" not in out, out[-3000:]


def test_await_release_waits_for_another_thread_to_let_go():
    t = torch.ones(3)
    before = groups.references([t])
    holder = [t]  # another thread's reference, as gloo's holds one
    threading.Thread(target=lambda: (time.sleep(0.2), holder.clear())).start()
    t0 = time.monotonic()
    groups.await_release([t], before)
    assert 0.15 < time.monotonic() - t0 < groups.RELEASE_WAIT_S
    assert sys.getrefcount(t) == 2  # t, the argument


def test_await_release_gives_up_on_a_reference_never_let_go(monkeypatch):
    monkeypatch.setattr(groups, "RELEASE_WAIT_S", 0.1)
    t = torch.ones(3)
    before = groups.references([t])
    kept = [t]  # never let go
    t0 = time.monotonic()
    groups.await_release([t], before)
    assert time.monotonic() - t0 < 1.0 and kept
