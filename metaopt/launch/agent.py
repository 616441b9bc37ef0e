"""Run a LaunchPlan under torch's LocalElasticAgent (the agent torchrun uses).

torch does the process management: it rendezvous the nodes, sets RANK / LOCAL_RANK /
WORLD_SIZE / MASTER_ADDR / MASTER_PORT, starts each worker in its own session, polls
them, and when one fails ends the others (SIGTERM to each worker's process group, then
SIGKILL) and restarts the group while ``--max_restarts`` allows. We add three things:

* Fleet's environment. torch builds each worker's env inside ``_start_workers`` and hands
  it to ``LogsSpecs.reify`` just before starting the processes (torch's own
  ``DefaultLogsSpecs`` adds TORCHELASTIC_ERROR_FILE there), so ``WorkerFiles.reify`` adds
  PADDLE_* there, derived from torch's values, so the two always agree.
* Endpoints. PADDLE_TRAINER_ENDPOINTS must be the same list on every node, so after
  torch's rendezvous each agent publishes its workers' ``ip:port`` in the rendezvous
  store under their global ranks and reads everyone's back (``_rendezvous``).
* Logs. ``workerlog.N`` is torch's stdout redirect for local rank N; the worker
  bootstrap (``_worker.py``) sends stderr into it too. torch's tee (a tail of the file)
  echoes local rank 0 to the launcher's stdout.
* Ending. torch signals the process groups of the workers still running; the workers'
  children outside those (a failed worker's, daemons, everything after the launcher's own
  death) are found and ended by ``_reaper.JobProcesses``, which takes over torch's close.
"""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence

from torch.distributed.elastic import metrics
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerSpec
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import LogsDest, LogsSpecs, Std
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry

from metaopt.launch._reaper import JobProcesses
from metaopt.launch._worker import LAUNCHER_PID_ENV
from metaopt.launch.args import LaunchPlan, restart_backoff

WORKER_PY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_worker.py")
RDZV_TIMEOUT_S = 900  # torchrun's default join timeout
# torch's tee needs a non-empty prefix; "[rankN]:" is taken by torch's own traceback hook
ECHO_PREFIX = "[worker${rank}] "
_ENDPOINT_KEY = "metaopt/endpoints"


def worker_log(log_dir: str, local_rank: int) -> str:
    """Worker `local_rank`'s stdout+stderr of the current attempt (fleetrun's name)."""
    return os.path.join(log_dir, f"workerlog.{local_rank}")


def fleet_env(
    torch_env: Mapping[str, str], endpoints: Sequence[str], gpus: Sequence[str] | None
) -> dict[str, str]:
    """Fleet's variables for the worker whose torch variables are `torch_env`.

    `endpoints` is every worker's ``ip:port`` by global rank; `gpus` the CUDA_VISIBLE_DEVICES
    entries of this node's workers by local rank (None: CPU workers).
    """
    rank, world = int(torch_env["RANK"]), int(torch_env["WORLD_SIZE"])
    local_rank = int(torch_env["LOCAL_RANK"])
    if len(endpoints) != world:
        raise RuntimeError(f"metaoptrun: {len(endpoints)} endpoints for a world of {world} workers")
    env = {
        "PADDLE_TRAINER_ID": str(rank),
        "PADDLE_TRAINERS_NUM": str(world),
        "PADDLE_TRAINER_ENDPOINTS": ",".join(endpoints),
        "PADDLE_CURRENT_ENDPOINT": endpoints[rank],
        "PADDLE_RANK_IN_NODE": str(local_rank),
    }
    if gpus is not None:
        # the workers see exactly the selected GPUs, so device index == LOCAL_RANK (what
        # fleet.init passes to torch.cuda.set_device) == FLAGS_selected_gpus
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        env["FLAGS_selected_gpus"] = str(local_rank)
    return env


def free_ports(host: str, n: int) -> list[int]:
    """`n` distinct ports free on `host` now (held together while choosing, so distinct)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            try:
                s.bind((host, 0))
            except OSError:  # `host` names another machine's address or a name: any local one
                s.bind(("", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def address_towards(host: str) -> str:
    """This machine's address on the route to `host`, else its host name's."""
    from metaopt.layout.groups import address_towards as routed

    return routed(host) or socket.gethostbyname(socket.gethostname())


def socket_interfaces(host: str, gpus: Sequence[str] | None) -> dict[str, str]:
    """GLOO_SOCKET_IFNAME (and, for GPU workers, NCCL_SOCKET_IFNAME): the interface holding
    this node's address `host`; empty where it cannot be told."""
    from metaopt.layout.groups import GLOO_IFNAME, interface_towards

    name = interface_towards(host)
    if name is None:
        return {}
    return {GLOO_IFNAME: name, **({"NCCL_SOCKET_IFNAME": name} if gpus is not None else {})}


def _endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class WorkerFiles(LogsSpecs):
    """Where each worker's output goes, and Fleet's part of its environment.

    torch calls ``reify(envs)`` right before it starts each worker group (again after a
    restart) with the env it built for each local rank; the endpoints come from the agent.
    """

    def __init__(
        self,
        plan: LaunchPlan,
        on_start: Callable[[dict[int, dict[str, str]], int], None] | None = None,
        job_env: Mapping[str, str] | None = None,
    ) -> None:
        os.makedirs(plan.log_dir, exist_ok=True)
        super().__init__(log_dir=plan.log_dir, redirects=Std.OUT, tee={0: Std.OUT})
        self._plan = plan
        self._on_start = on_start
        self._job_env = dict(job_env or {})
        self.endpoints: list[str] | None = None
        # several nodes: gloo's and NCCL's interface, the one holding this node's address (set by
        # the agent at the rendezvous), unless the user set them; else the host name's address,
        # the loopback on most hosts, which the other nodes cannot reach
        self.interfaces: dict[str, str] = {}

    @property
    def root_log_dir(self) -> str:
        return self._plan.log_dir

    @property
    def plan(self) -> LaunchPlan:
        return self._plan

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        if self.endpoints is None:
            raise RuntimeError("metaoptrun: workers started before the endpoints were exchanged")
        attempt = int(envs[0].get("TORCHELASTIC_RESTART_COUNT", "0")) if envs else 0
        for local_rank, env in envs.items():
            env.update(fleet_env(env, self.endpoints, self._plan.gpus))
            env[LAUNCHER_PID_ENV] = str(os.getpid())
            env.update({k: v for k, v in self.interfaces.items() if not os.environ.get(k)})
            env.update(self._job_env)  # the mark by which the workers' children are found
            if "OMP_NUM_THREADS" not in os.environ and len(envs) > 1:
                env["OMP_NUM_THREADS"] = "1"  # as torchrun: N workers x all cores oversubscribes
            self._keep_earlier_log(local_rank, attempt)
        if self._on_start is not None:
            self._on_start(envs, attempt)
        logs = {i: worker_log(self._plan.log_dir, i) for i in envs}
        return LogsDest(
            stdouts=logs,
            stderrs=dict.fromkeys(envs, ""),  # "": inherited; the bootstrap dup2s it onto stdout
            tee_stdouts={0: logs[0]} if 0 in logs else {},
            tee_stderrs={},
            error_files=dict.fromkeys(envs, os.devnull),  # the log tail is the report
        )

    def _keep_earlier_log(self, local_rank: int, attempt: int) -> None:
        # torch opens workerlog.N with "w"; move a failed attempt's log aside first
        path = worker_log(self._plan.log_dir, local_rank)
        if attempt == 0:
            for stale in glob.glob(glob.escape(path) + ".attempt*"):  # from an earlier job
                os.remove(stale)
        elif os.path.exists(path):
            os.replace(path, f"{path}.attempt{attempt - 1}")
            # the first failed attempt and the last KEPT_ATTEMPT_LOGS - 1: a job restarting for
            # hours must not fill the disk with logs (issue 47: 164 files in 40 s)
            old = attempt - KEPT_ATTEMPT_LOGS
            if old >= 1:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(f"{path}.attempt{old}")


KEPT_ATTEMPT_LOGS = 5  # per worker: attempt 0's log and the latest four failed ones


class FleetAgent(LocalElasticAgent):
    """torch's local agent, plus the endpoint exchange and a report before each restart."""

    def __init__(
        self,
        spec: WorkerSpec,
        files: WorkerFiles,
        node_ip: str | None,
        shutdown_timeout: int,
        on_restart: Callable[[RunResult, int, int], None] | None = None,
        job: JobProcesses | None = None,
    ) -> None:
        super().__init__(
            spec=spec,
            logs_specs=files,
            start_method="spawn",
            log_line_prefix_template=ECHO_PREFIX,
            shutdown_timeout=shutdown_timeout,
        )
        self._files = files
        self._node_ip = node_ip
        self._on_restart = on_restart
        self._job = job
        self._last_result: RunResult | None = None

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        super()._rendezvous(worker_group)
        spec = worker_group.spec
        attempt = spec.max_restarts - self._remaining_restarts
        host = self._node_ip or address_towards(str(worker_group.master_addr))
        store = worker_group.store
        assert store is not None  # set by the rendezvous
        if self._files.plan.nnodes > 1:
            self._files.interfaces = socket_interfaces(host, self._files.plan.gpus)
        ports = free_ports(host, len(worker_group.workers))
        for worker, port in zip(worker_group.workers, ports):
            store.set(f"{_ENDPOINT_KEY}/{attempt}/{worker.global_rank}", _endpoint(host, port))
        world = worker_group.workers[0].world_size
        keys = [f"{_ENDPOINT_KEY}/{attempt}/{r}" for r in range(world)]
        self._files.endpoints = [v.decode() for v in store.multi_get(keys)]  # waits for every node

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        self._last_result = super()._monitor_workers(worker_group)
        return self._last_result

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        spec = worker_group.spec
        restart = spec.max_restarts - self._remaining_restarts
        if self._on_restart is not None and self._last_result is not None:
            self._on_restart(self._last_result, restart, spec.max_restarts)
        time.sleep(restart_backoff(restart))
        super()._restart_workers(worker_group)

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        # torch's default here is a fixed 30 s before SIGKILL; honour --shutdown_timeout
        self._shutdown(timeout=self._shutdown_timeout)

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, int]:
        pids = super()._start_workers(worker_group)
        if self._job is not None:
            self._job.workers_started(pids.values())
            self._end_whole_job_on_close()
        return pids

    def _end_whole_job_on_close(self) -> None:
        """Route every close of the worker processes (torch's on the first failure or the last
        exit, and ``_shutdown``'s on a signal, a restart or the end) through ``JobProcesses.end``:
        one signal to each worker *and* each of their children, SIGKILL after
        --shutdown_timeout (torch's close after a failure waits a fixed 30 s)."""
        pcontext, job = self._pcontext, self._job
        assert pcontext is not None and job is not None
        torch_close = pcontext.close

        def close(death_sig: signal.Signals | None = None, timeout: float | None = None) -> None:
            sig = death_sig or signal.SIGTERM
            timeout = self._shutdown_timeout if timeout is None else timeout
            if job.end(sig, timeout):
                timeout = 0  # all gone: torch's close only reaps the workers and stops its log tails
            torch_close(sig, timeout)

        pcontext.close = close  # type: ignore[method-assign]


def worker_command(plan: LaunchPlan) -> tuple[str, tuple[str, ...]]:
    """The executable and arguments torch starts for each worker."""
    args = ["-u", WORKER_PY]
    if plan.module:
        args.append("-m")
    return sys.executable, (*args, plan.script, *plan.script_args)


def run_job(
    plan: LaunchPlan,
    on_start: Callable[[dict[int, dict[str, str]], int], None] | None = None,
    on_restart: Callable[[RunResult, int, int], None] | None = None,
) -> RunResult:
    """Run `plan` on this node until the job succeeds or fails; the agent's result.

    Raises torch's SignalException when the launcher gets SIGINT/SIGTERM (the workers
    and their children have been ended by then). When it returns or raises, no process
    the job started on this node is left (see ``_reaper``: this process becomes a child
    subreaper for the while, and its children started before are left alone).
    `on_start(envs, attempt)` runs before each group starts;
    `on_restart(failed_result, restart, max_restarts)` before each restart.
    """
    if plan.nnodes == 1 and plan.master_port is None:
        # as torchrun --standalone: the store binds port 0 and keeps it, so two jobs on one
        # machine cannot pick the same port (a probe-then-bind free port could race)
        backend, endpoint, run_id = "c10d", "127.0.0.1:0", uuid.uuid4().hex
        configs: dict[str, object] = {"timeout": RDZV_TIMEOUT_S}
        master_addr, master_port, local_addr = None, None, plan.master_addr
    else:
        backend, endpoint, run_id = "static", _endpoint(plan.master_addr, plan.master_port or 0), "metaopt"
        configs = {"timeout": RDZV_TIMEOUT_S, "rank": plan.node_rank}
        master_addr, master_port, local_addr = plan.master_addr, plan.master_port, None
    params = RendezvousParameters(
        backend=backend,
        endpoint=endpoint,
        run_id=run_id,
        min_nodes=plan.nnodes,
        max_nodes=plan.nnodes,
        local_addr=local_addr,
        **configs,
    )
    entrypoint, args = worker_command(plan)
    spec = WorkerSpec(
        role="worker",
        local_world_size=plan.nproc_per_node,
        entrypoint=entrypoint,
        args=args,
        rdzv_handler=rdzv_registry.get_rendezvous_handler(params),
        max_restarts=plan.max_restarts,
        monitor_interval=0.1,
        master_addr=master_addr,
        master_port=master_port,
        local_addr=local_addr,
    )
    metrics.initialize_metrics(metrics.MetricsConfig())
    from torch.distributed.elastic.multiprocessing import SignalException

    shutdown_rdzv = True
    with JobProcesses(plan.shutdown_timeout) as job:
        files = WorkerFiles(plan, on_start, job.env)
        agent = FleetAgent(spec, files, plan.node_ip, plan.shutdown_timeout, on_restart, job)
        try:
            return agent.run()
        except SignalException:
            shutdown_rdzv = False  # as torch's launch_agent: a signal must not close the rendezvous
            raise
        finally:
            if shutdown_rdzv:
                spec.rdzv_handler.shutdown()
