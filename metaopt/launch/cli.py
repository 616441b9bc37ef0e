"""``metaoptrun`` / ``python -m metaopt.launch``: parse, print the configuration, run, report."""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence

from metaopt.launch.args import LaunchError, LaunchPlan, parse_args, plan_launch
from metaopt.launch.report import failure_summary, format_configuration, format_envs


def _print(text: str, err: bool = False) -> None:
    stream = sys.stderr if err else sys.stdout
    print(text, file=stream, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the job described by `argv` (default ``sys.argv[1:]``); the launcher's exit code.

    0: every worker succeeded. 2: bad flags. A failed worker's exit code (128+N for
    signal N) when the job fails, 128+N when the launcher itself gets signal N.
    """
    # the echo of rank 0 must reach a pipe (`metaoptrun ... | tee`) line by line
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)
    ns = parse_args(argv)
    try:
        plan = plan_launch(ns)
    except LaunchError as e:
        _print(f"metaoptrun: error: {e}", err=True)
        return 2
    _print(format_configuration(ns))
    return _run(plan)


def _run(plan: LaunchPlan) -> int:
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.rendezvous import RendezvousError

    from metaopt.launch.agent import run_job
    from metaopt.launch.args import restart_backoff

    def on_start(envs: dict[int, dict[str, str]], attempt: int) -> None:
        title = "Distributed Envs" if attempt == 0 else f"Distributed Envs (restart {attempt})"
        _print(format_envs(envs[0], title))
        if attempt == 0 and plan.nnodes == 1 and plan.master_port is None:
            _print(f"metaoptrun: master port {envs[0]['MASTER_PORT']} (a free port)")
        _print(f"metaoptrun: {len(envs)} worker(s); logs in {plan.log_dir}/workerlog.N")

    def on_restart(result, restart: int, max_restarts: int) -> None:
        text, _ = failure_summary(result.failures, plan.log_dir, "worker group failed")
        wait = restart_backoff(restart)
        _print(
            f"{text}\nmetaoptrun: restarting the worker group (restart {restart} of {max_restarts}) "
            f"in {wait:g} s",
            err=True,
        )

    try:
        result = run_job(plan, on_start, on_restart)
    except SignalException as e:
        _print(f"metaoptrun: got {e.sigval.name}; the workers and their children were ended", err=True)
        return 128 + int(e.sigval)
    except (DistError, RendezvousError) as e:  # a port in use, a node that never came, ...
        where = f"{plan.master_addr}:{plan.master_port}" if plan.master_port else "the local store"
        _print(
            f"metaoptrun: error: the rendezvous at {where} failed (check --master_addr / --master_port "
            f"and that every node was started): {type(e).__name__}: {e}",
            err=True,
        )
        return 1
    except KeyboardInterrupt:  # before torch's handlers were installed: no worker started yet
        _print("metaoptrun: interrupted", err=True)
        return 128 + int(signal.SIGINT)
    if result.is_failed():
        what = "the job failed" + (f" after {plan.max_restarts} restart(s)" if plan.max_restarts else "")
        text, code = failure_summary(result.failures, plan.log_dir, what)
        _print(text, err=True)
        return code
    _print(f"metaoptrun: all {plan.nproc_per_node} worker(s) on this node finished")
    return 0
