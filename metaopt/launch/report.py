"""What metaoptrun prints: fleetrun's "Configuration Arguments" and "Distributed Envs"
blocks, and the summary of a failed worker group (rank, exit code or signal, log tail)."""

from __future__ import annotations

import argparse
import os
import signal
from collections.abc import Mapping

from metaopt.launch.agent import worker_log

TAIL_LINES = 20
_WIDTH = 48

# the rows of "Distributed Envs" (the first worker's values, as fleetrun shows)
ENV_ROWS = (
    "PADDLE_TRAINER_ID",
    "PADDLE_TRAINERS_NUM",
    "PADDLE_CURRENT_ENDPOINT",
    "PADDLE_TRAINER_ENDPOINTS",
    "FLAGS_selected_gpus",
    "CUDA_VISIBLE_DEVICES",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GLOO_SOCKET_IFNAME",
    "NCCL_SOCKET_IFNAME",
    "OMP_NUM_THREADS",
)


def _rule(title: str = "") -> str:
    if not title:
        return "-" * _WIDTH
    side = max(2, (_WIDTH - len(title) - 4) // 2)
    return f"{'-' * side}  {title}  {'-' * side}"


def format_configuration(ns: argparse.Namespace) -> str:
    """fleetrun's block: one ``name: value`` line per flag, sorted."""
    lines = [_rule("Configuration Arguments")]
    lines += [f"{k}: {v}" for k, v in sorted(vars(ns).items())]
    lines.append(_rule())
    return "\n".join(lines)


def format_envs(env: Mapping[str, str], title: str = "Distributed Envs") -> str:
    """fleetrun's table: a dashed header line, then ``key value`` rows."""
    rows = [(k, env[k]) for k in ENV_ROWS if k in env]
    width = max(len(k) for k, _ in rows) + 2
    return "\n".join([_rule(title), *(f"{k:<{width}}{v}" for k, v in rows), _rule()])


def describe_exit(exitcode: int) -> str:
    """'exit code 1' or 'signal SIGKILL' (Popen reports a signal as -signum)."""
    if exitcode >= 0:
        return f"exit code {exitcode}"
    try:
        return f"signal {signal.Signals(-exitcode).name}"
    except ValueError:
        return f"signal {-exitcode}"


def launcher_exit_code(exitcode: int) -> int:
    """The launcher's exit code for a worker's: the same, or 128+signal as a shell reports."""
    if exitcode > 0:
        return min(exitcode, 255)
    return 128 + (-exitcode) if exitcode < 0 else 1


def log_tail(path: str, lines: int = TAIL_LINES) -> str:
    """The last `lines` lines of `path` ('' if it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            data = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-lines:])


def failure_summary(failures: Mapping[int, object], log_dir: str, what: str) -> tuple[str, int]:
    """The report of a failed group and the launcher's exit code.

    `failures` maps global rank -> torch's ProcessFailure in the order torch saw them:
    the first is the worker that failed; workers the agent then ended show up after it
    (SIGTERM/SIGKILL) and are named as such.
    """
    if not failures:
        return f"metaoptrun: {what}: the worker group failed (torch reported no failed rank)", 1
    items = list(failures.items())
    rank, first = items[0]
    ended_by_us = {-signal.SIGTERM, -signal.SIGKILL, -signal.SIGINT}
    others = [(r, f) for r, f in items[1:] if getattr(f, "exitcode", 0) not in ended_by_us]
    ended = [r for r, f in items[1:] if getattr(f, "exitcode", 0) in ended_by_us]
    local_rank, pid, exitcode = first.local_rank, first.pid, first.exitcode  # type: ignore[attr-defined]
    log = worker_log(log_dir, local_rank)
    lines = [
        f"metaoptrun: {what}: rank {rank} (local rank {local_rank}, pid {pid}) failed with "
        f"{describe_exit(exitcode)}."
    ]
    for r, f in others:
        lines.append(f"metaoptrun: rank {r} also failed with {describe_exit(f.exitcode)}.")  # type: ignore[attr-defined]
    if ended:
        lines.append(f"metaoptrun: ended the other workers (rank {', '.join(map(str, sorted(ended)))}).")
    tail = log_tail(log)
    lines.append(_rule(f"last {TAIL_LINES} lines of {log}"))
    lines.append(tail if tail else "(the log is empty)")
    lines.append(_rule())
    return "\n".join(lines), launcher_exit_code(exitcode)
