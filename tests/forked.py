"""Worker processes forked from a warm server instead of started cold (tests/workers.py).

A cold ``python worker.py`` spends 3-5 s of CPU importing torch, metaopt, onnxscript and
transformers' model code before it does anything; the suite starts about a hundred such workers
on a 2-core machine. Here each test process keeps one multiprocessing *forkserver* that imported
those once (`PRELOAD`), and every worker is a fork of it that runs its script as ``__main__``
with its own argv, environment, working folder and log, as a fresh interpreter would:

* the server never ran a torch op, started a thread or a process group, so a fork starts as clean
  as a new process (torch's default generator at its fixed initial seed included);
* the environment a library reads at import time is the server's: it starts with
  ``OMP_NUM_THREADS=1`` (OpenMP reads it when torch loads), what every worker asks for; a worker
  asking for another thread count gets it through ``torch.set_num_threads``;
* ``PYTHONPATH`` is not read again by a fork: its entries (and the script's folder, as Python
  puts it first) go on ``sys.path`` by hand;
* a fork ends in ``os._exit``: the script's ``atexit`` handlers run, but the interpreter is not
  finalized. A test of what happens at a worker's exit starts cold workers (`start_workers(...,
  cold=True)`).

`Forked` is the part of ``subprocess.Popen`` the tests use (communicate, kill, poll, wait, pid,
returncode): a signal's death reads as ``-signum``, as Popen's does.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence

# Imported once by the server: what a worker's first seconds went to (metaopt before transformers:
# metaopt.compat makes torchvision importable first).
PRELOAD = [
    "torch",
    "torch.distributed",
    "metaopt",
    "metaopt.frontend.translations",
    "onnx",
    "safetensors.torch",
    "transformers",
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.llama.modeling_llama",
    "transformers.models.bert.modeling_bert",
]

_CONTEXT: list = []


def _context():  # noqa: ANN202
    if not _CONTEXT:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        old = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"  # the server's: read when torch loads OpenMP
        try:
            from multiprocessing import forkserver

            forkserver.ensure_running()
        finally:
            if old is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = old
        _CONTEXT.append(ctx)
    return _CONTEXT[0]


def _main(args: list[str], env: dict[str, str], cwd: str, log: str) -> None:
    """In the fork: the script as ``__main__``, its output (stdout and stderr) into `log`."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    script = os.path.abspath(args[0])
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:0] = [os.path.dirname(script), *paths]
    sys.argv = [script, *args[1:]]
    threads = env.get("OMP_NUM_THREADS")
    if threads and threads != "1":
        import torch

        torch.set_num_threads(int(threads))
    try:
        runpy.run_path(script, run_name="__main__")
    finally:  # a fork ends in os._exit: the script's exit handlers run here, as at a normal exit
        atexit._run_exitfuncs()


class Forked:
    """One forked worker, as much of ``subprocess.Popen`` as the tests use (module doc)."""

    def __init__(self, args: Sequence[str], env: Mapping[str, str]) -> None:
        self.args = list(args)
        handle, self._log = tempfile.mkstemp(prefix="metaopt-worker-", suffix=".log")
        os.close(handle)
        self._proc = _context().Process(target=_main, args=(self.args, dict(env), os.getcwd(), self._log))
        self._proc.start()
        self.pid = self._proc.pid
        self._output: str | None = None

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._proc.exitcode

    def kill(self) -> None:
        self._proc.kill()

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        self.wait(timeout)
        if self._output is None:
            with open(self._log, errors="replace") as f:
                self._output = f.read()
            os.unlink(self._log)
        return self._output, None
