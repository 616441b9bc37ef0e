"""Start and wait for the worker processes of a multi-process test (gloo on this machine's
loopback): one helper for every such test, so each bounds its wait and shows a failing
worker's log the same way. Multi-host behaviour (real addresses) is tested by
tests/launch through the launcher, not here."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the rendezvous port of one test's job)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_workers(
    world: int, args: Sequence[str], extra_env: Mapping[str, str] | None = None, *, cold: bool = False
) -> list[subprocess.Popen]:
    """`world` processes ``python ARGS...`` with torch's rank variables (one thread each),
    the repository and tests/ on their path; stdout and stderr together, as text. Each is forked
    from a server that imported torch, metaopt and transformers once (tests/forked.py), unless
    `cold` (a test of the interpreter's own exit) or METAOPT_TEST_COLD_WORKERS=1 asks for cold
    interpreters."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1",
            **(extra_env or {}),
        }
        if cold or os.environ.get("METAOPT_TEST_COLD_WORKERS") == "1":
            procs.append(
                subprocess.Popen(
                    [sys.executable, *args],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        else:
            from forked import Forked

            procs.append(Forked(args, env))
    return procs


def wait_workers(procs: Sequence[subprocess.Popen], what: str, timeout: float) -> list[str]:
    """Wait for every worker (bounded: a hang is a failure, never a stuck suite; all are killed),
    then fail unless each exited 0, the first failure (the cause: the others see a closed
    connection) shown first. Returns their logs, in rank order."""
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{len(procs)} {what} workers did not finish in {timeout} s")
    failed = [
        (r, p.returncode, log) for r, (p, log) in enumerate(zip(procs, logs, strict=True)) if p.returncode
    ]
    failed.sort(key=lambda f: "Connection closed by peer" in f[2] or "Connection reset" in f[2])
    assert not failed, "\n".join(f"worker {r} exited {rc}:\n{log[-4000:]}" for r, rc, log in failed)
    return logs


def gathered_params(exe, program) -> dict:  # noqa: ANN001 - an Executor and a Program
    """Inside a worker: each param as this worker's program means it, whole (its tensor-parallel
    part, where split): a ZeRO stage-3 param (this worker's flat slice) all-gathered over its
    sharding group (every worker, without hybrid groups)."""
    import torch
    import torch.distributed as dist

    from metaopt.layout.groups import axis_ranks, group_of, timeout
    from metaopt.ops.kernels.partition import join_slices

    out = {}
    for v in program.params():
        t = exe.scope[v.name]
        if v.zero is not None:
            ranks = axis_ranks("sharding") or list(range(dist.get_world_size()))
            rows = [torch.empty_like(t) for _ in ranks]
            dist.all_gather(rows, t, group=group_of(ranks, timeout()))
            t = join_slices(rows, v.zero.full)
        out[v.name] = t.clone()
    return out
