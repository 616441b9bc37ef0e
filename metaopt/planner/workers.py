"""Rewriting a plan's layouts in worker processes (`fleet.plan(..., workers=N)`).

Each worker is a fresh interpreter (`COMMAND`: `main` of this module), not a fork: a fork of
a process with threads (torch's, gloo's) can inherit a lock another thread held, and wait on it
forever; a fresh interpreter imports only metaopt, never the user's script. The job (the program,
its blocks, what the planner measured on it so far) goes to each worker once, pickled over its
stdin; then groups of layouts, one group at a time per worker, each answered with their figures
(or the refusal's first line) over its stdout. Messages are length-prefixed pickles.

A worker that exits or stays silent past `timeout` seconds on one group is an error naming the
layouts it held (nothing hangs), and every worker of the pool is killed; otherwise they end when
the pool closes.
"""

from __future__ import annotations

import os
import pickle
import selectors
import struct
import subprocess
import sys
import time
from typing import IO, Any

_HEADER = struct.Struct("<Q")
# `-c`, not `-m metaopt.planner.workers`: runpy would run this module a second time beside the
# copy `import metaopt.planner` already made, and warn so on every worker's stderr
COMMAND = "import metaopt; from metaopt.planner.workers import main; main()"


def send(stream: IO[bytes], obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def receive(stream: IO[bytes]) -> Any:
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        raise EOFError("the other side closed the pipe")
    (n,) = _HEADER.unpack(head)
    data = stream.read(n)
    if len(data) < n:
        raise EOFError("the other side closed the pipe mid-message")
    return pickle.loads(data)


class WorkerError(RuntimeError):
    """A planner worker exited, or answered nothing in time."""


class Pool:
    """`count` worker processes holding `job` (a picklable object with an `evaluate(layout, whole=)`
    method); `map` spreads groups of layouts over them."""

    def __init__(self, job: Any, count: int, timeout: float = 600.0) -> None:
        self.timeout = timeout
        payload = pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-c", COMMAND]
        self.procs = [
            subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
            for _ in range(count)
        ]
        try:
            for p in self.procs:
                p.stdin.write(_HEADER.pack(len(payload)) + payload)
                p.stdin.flush()
        except OSError as e:  # a worker that died starting (its traceback is on stderr)
            self.close(kill=True)
            raise WorkerError(f"fleet.plan: a planner worker exited before taking the job ({e})") from None

    def map(self, groups: list[list[Any]], *, whole: bool) -> list[list[Any]]:
        """Each group's results, in order: a group's layouts are evaluated in one worker, in turn."""
        results: list[list[Any] | None] = [None] * len(groups)
        pending = list(range(len(groups)))[::-1]
        busy: dict[int, tuple[int, float]] = {}  # worker -> (group, since)
        sel = selectors.DefaultSelector()
        try:
            for w, p in enumerate(self.procs):
                sel.register(p.stdout, selectors.EVENT_READ, w)
                if pending:
                    self._give(w, pending.pop(), groups, whole, busy)
            while busy:
                ready = sel.select(timeout=1.0)
                for key, _ in ready:
                    w = key.data
                    g, _ = busy.pop(w)
                    try:
                        results[g] = receive(self.procs[w].stdout)
                    except EOFError:
                        code = self.procs[w].wait()
                        self.close(kill=True)  # the pool is broken: its other workers go too
                        what = f"exited ({code}) while rewriting {_names(groups[g])}"
                        raise WorkerError(f"fleet.plan: planner worker {w} {what}") from None
                    if pending:
                        self._give(w, pending.pop(), groups, whole, busy)
                now = time.monotonic()
                for w, (g, since) in busy.items():
                    if now - since > self.timeout:
                        self.close(kill=True)
                        raise WorkerError(
                            f"fleet.plan: planner worker {w} answered nothing in {self.timeout:.0f} s "
                            f"rewriting {_names(groups[g])}"
                        )
        finally:
            sel.close()
        return results  # type: ignore[return-value]

    def _give(self, w: int, g: int, groups: list, whole: bool, busy: dict) -> None:
        send(self.procs[w].stdin, (groups[g], whole))
        busy[w] = (g, time.monotonic())

    def close(self, *, kill: bool = False) -> None:
        """End the workers: at the end of their input (`kill`: at once, their work abandoned)."""
        for p in self.procs:
            if kill:
                p.kill()
            try:
                p.stdin.close()  # end of input: the worker returns
            except OSError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, kind: type | None, *exc: object) -> None:
        self.close(kill=kind is not None)


def _names(group: list[Any]) -> str:
    return "; ".join(lay.describe() for lay in group)


def main() -> None:
    """A worker: the job from stdin, then (layouts, whole) groups until stdin ends."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # anything printed goes to stderr, never into the answers
    job = receive(stdin)
    while True:
        try:
            group, whole = receive(stdin)
        except EOFError:
            return
        send(stdout, [evaluated(job, lay, whole) for lay in group])


def evaluated(job: Any, lay: Any, whole: bool) -> Any:
    """The layout's figures, or the first line of why its rewrite was refused."""
    try:
        return job.evaluate(lay, whole=whole)
    except (ValueError, NotImplementedError, RuntimeError) as e:
        return str(e).splitlines()[0][:200]
