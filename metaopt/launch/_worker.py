"""What each worker process runs first: ``python -u _worker.py [-m] SCRIPT ARGS...``.

The launcher starts this file by path, not as ``-m metaopt.launch._worker``, so a worker
does not import the metaopt package (and torch with it) before the user's script asks
for it. Standard library only, for the same reason.

It (1) sends stderr into stdout, which torch's agent has already pointed at
``workerlog.N``, so the log holds both streams in the order written; (1b) joins the job's
cgroup where the launcher made one, so everything the script starts is born in it; (2) asks Linux to
SIGTERM this worker if the launcher dies without ending it (SIGKILL, OOM killer; the
worker's own children are then ended by the launcher's guardian, see ``_reaper.py``);
(3) selects the worker's GPU when the launcher gave one; (4) runs the script as
``__main__`` with ``sys.argv`` and ``sys.path[0]`` as ``python SCRIPT ARGS`` would;
(5) when the script succeeds, destroys the torch.distributed group it left open: with
torch 2.13's gloo a process that exits with the group alive sometimes aborts in
teardown ("terminate called without an active exception", SIGABRT), which would fail
a job whose every worker finished its work.
The environment (RANK, PADDLE_TRAINER_ID, ...) is already complete: the launcher set it.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys

LAUNCHER_PID_ENV = "METAOPT_LAUNCHER_PID"
CGROUP_ENV = "METAOPT_CGROUP"  # = _reaper.CGROUP_ENV (this file imports nothing of metaopt)


def _join_job_cgroup() -> None:
    cgroup = os.environ.get(CGROUP_ENV)
    if not cgroup:
        return
    try:
        with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    except OSError as e:  # the job still ends by environment, session and ancestry
        print(f"metaoptrun worker: warning: not in the job's cgroup {cgroup} ({e})", flush=True)


def _die_with_launcher() -> None:
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if not sys.platform.startswith("linux") or not launcher:
        return
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != int(launcher):  # it died before prctl took effect
        sys.exit(f"metaoptrun worker: the launcher (pid {launcher}) is gone; not starting")


def _select_gpu() -> None:
    selected = os.environ.get("FLAGS_selected_gpus", "").strip()
    if not selected:
        return
    import torch

    if torch.cuda.is_available():
        torch.cuda.set_device(int(selected.split(",")[0]))


def main(argv: list[str]) -> None:
    module = bool(argv) and argv[0] == "-m"
    if module:
        argv = argv[1:]
    if not argv:
        sys.exit("usage: _worker.py [-m] SCRIPT [ARGS...]")
    os.dup2(sys.stdout.fileno(), sys.stderr.fileno())
    _join_job_cgroup()
    _die_with_launcher()
    _select_gpu()
    try:
        _run(argv[0], argv[1:], module)
    except SystemExit as e:
        if e.code in (None, 0):
            _close_process_group()
        raise
    _close_process_group()


def _close_process_group() -> None:
    dist = sys.modules.get("torch.distributed")  # the script imported it, if it made a group
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _run(target: str, args: list[str], module: bool) -> None:
    if module:
        sys.argv = [target, *args]  # runpy sets argv[0] to the module's file
        sys.path[0] = os.getcwd()
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [target, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
