"""The worker's place in the job: ``fleet.init`` and ``worker_index`` / ``worker_num`` / ...

Read from the environment the launcher sets (``metaoptrun``, ``torchrun`` or
``fleetrun``): torch's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT`` first, then Fleet's ``PADDLE_TRAINER_ID``, ``PADDLE_TRAINERS_NUM``,
``PADDLE_TRAINER_ENDPOINTS``, ``PADDLE_CURRENT_ENDPOINT``. Where both are set they
must agree. With nothing set the job is one worker (rank 0 of 1, endpoint
``127.0.0.1:6170`` as in Fleet) and no process group is created.

With more than one worker ``init`` creates the default ``torch.distributed`` process
group: NCCL when CUDA is visible, else gloo, with a timeout of
``METAOPT_COMM_TIMEOUT`` seconds (default 300) so a lost peer is an error, not a hang.

Given a strategy whose ``hybrid_configs`` are set, ``init`` also lays the workers out
(``topology.py``: dp x mp x pp, model-parallel peers adjacent), refuses a world size other
than the degrees' product, and makes one process group per group of every axis, as Fleet
does; ``get_hybrid_communicate_group()`` returns this worker's view of them.
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from metaopt.layout.groups import timeout as comm_timeout  # fleet.init's group waits as every collective
from metaopt.layout.topology import AXES, DEGREE_KEYS, HybridCommunicateGroup, Topology

logger = logging.getLogger("metaopt.fleet")

DEFAULT_ENDPOINT = "127.0.0.1:6170"  # Fleet's endpoint of a non-distributed job


@dataclass(frozen=True)
class WorkerEnv:
    """This worker's rank and the job's shape, as read from the environment."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    endpoints: tuple[str, ...] | None = (DEFAULT_ENDPOINT,)  # None: not known (torchrun sets none)
    current_endpoint: str | None = DEFAULT_ENDPOINT
    master_addr: str | None = None
    master_port: int | None = None


@dataclass
class _State:
    initialized: bool = False
    env: WorkerEnv = field(default_factory=WorkerEnv)
    strategy: object = None  # the DistributedStrategy given to init, if any
    created_group: bool = False  # whether init created the torch.distributed default group
    hcg: HybridCommunicateGroup | None = None  # built by init from its strategy's hybrid_configs
    simulated: bool = False  # `simulate`: one rank of a job, in a process that joined no group


_STATE = _State()


def _int(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def _agree(environ: Mapping[str, str], torch_name: str, paddle_name: str) -> int | None:
    a, b = _int(environ, torch_name), _int(environ, paddle_name)
    if a is not None and b is not None and a != b:
        raise ValueError(f"environment variables disagree: {torch_name}={a} but {paddle_name}={b}")
    return a if a is not None else b


def read_env(environ: Mapping[str, str] | None = None) -> WorkerEnv:
    """This worker's WorkerEnv from `environ` (default ``os.environ``); errors name the variable."""
    environ = os.environ if environ is None else environ
    raw_eps = environ.get("PADDLE_TRAINER_ENDPOINTS", "").strip()
    endpoints = tuple(e.strip() for e in raw_eps.split(",") if e.strip()) if raw_eps else None

    world = _agree(environ, "WORLD_SIZE", "PADDLE_TRAINERS_NUM")
    if world is None:
        world = len(endpoints) if endpoints else 1
    if world < 1:
        raise ValueError(f"the world size must be >= 1, got {world} (WORLD_SIZE / PADDLE_TRAINERS_NUM)")
    rank = _agree(environ, "RANK", "PADDLE_TRAINER_ID")
    if rank is None:
        if world > 1:
            raise ValueError(
                f"the world size is {world} but this worker's rank is not set (RANK or PADDLE_TRAINER_ID)"
            )
        rank = 0
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} (RANK / PADDLE_TRAINER_ID) is outside 0..{world - 1}")
    local_rank = _int(environ, "LOCAL_RANK")
    if local_rank is None:
        local_rank = rank  # one node (torchrun and metaoptrun always set LOCAL_RANK)
    if local_rank < 0:
        raise ValueError(f"LOCAL_RANK must be >= 0, got {local_rank}")

    if endpoints is not None and len(endpoints) != world:
        raise ValueError(
            f"PADDLE_TRAINER_ENDPOINTS lists {len(endpoints)} endpoints but the world size is {world}"
        )
    if endpoints is None and world == 1:
        endpoints = (DEFAULT_ENDPOINT,)
    current = environ.get("PADDLE_CURRENT_ENDPOINT") or (endpoints[rank] if endpoints else None)

    addr = environ.get("MASTER_ADDR") or None
    port = _int(environ, "MASTER_PORT")
    if (addr is None or port is None) and endpoints and world > 1:
        first_addr, _, first_port = endpoints[0].rpartition(":")
        addr = addr or first_addr
        if port is None:
            try:
                port = int(first_port)
            except ValueError:
                raise ValueError(f"PADDLE_TRAINER_ENDPOINTS: {endpoints[0]!r} is not host:port") from None
    return WorkerEnv(rank, world, local_rank, endpoints, current, addr, port)


def init(is_collective: bool = True, strategy=None) -> None:
    """Fleet's ``fleet.init``: read this worker's env; with >1 worker, join the process group.

    ``is_collective=False`` (parameter-server mode) is not implemented. `strategy` is
    the default for ``fleet.distributed_optimizer(opt)`` (Fleet 2.x). Calling ``init``
    again re-reads the environment (it must not change the size of a group already joined).
    """
    if not isinstance(is_collective, bool):
        raise TypeError(
            f"fleet.init: is_collective must be a bool, got {type(is_collective).__name__} "
            "(metaopt has no role makers: they describe parameter-server jobs)"
        )
    if not is_collective:
        raise NotImplementedError(
            "fleet.init(is_collective=False): parameter-server mode is not implemented in metaopt; "
            "use collective mode, fleet.init(is_collective=True)"
        )
    if strategy is not None:
        from metaopt.fleet.strategy import DistributedStrategy

        if not isinstance(strategy, DistributedStrategy):
            raise TypeError(
                f"fleet.init: strategy must be a DistributedStrategy, got {type(strategy).__name__}"
            )
        strategy = strategy.copy()
    env = read_env()
    # a wrong world size is refused before joining: every worker raises alike, none waits
    topo = _hybrid_topology(strategy, env.world_size)
    if env.world_size > 1:
        _STATE.created_group = _join_process_group(env) or _STATE.created_group
    elif _STATE.created_group:
        raise RuntimeError(
            "fleet.init: this process already joined a multi-worker group; the env now says 1 worker"
        )
    if env.world_size > 1:
        _check_same_layout(topo)  # every worker, hybrid_configs or not: one named error, no hang
    hcg = None if topo is None else _hybrid_group(topo, env)
    if hcg is None:
        from metaopt.layout.groups import forget_topology

        forget_topology()  # a hybrid layout of an earlier init no longer places anything
    _STATE.env = env
    _STATE.strategy = strategy
    _STATE.hcg = hcg
    _STATE.simulated = False
    _STATE.initialized = True
    logger.info("fleet.init: worker %d of %d (local rank %d)", env.rank, env.world_size, env.local_rank)
    if hcg is not None:
        logger.info("fleet.init: %r", hcg)


def simulate(world_size: int, rank: int = 0, strategy=None) -> None:
    """``fleet.init`` as worker `rank` of a `world_size`-worker job would see it, in this one
    process, joining no process group: then ``minimize`` rewrites exactly that worker's program
    (its shard of every split, its pipeline stage, its collectives by group) and
    ``estimate_memory`` predicts that worker's memory, for a layout of any size checked on one
    machine (a plan for 1024 workers on a laptop). Running a program that communicates is refused
    by its first collective (no peers); checks that compare workers are skipped (there is one).
    `strategy` as init's (its hybrid_configs lay out the `world_size` workers). `reset` (or
    ``fleet.init``) leaves it."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"fleet.simulate: world_size must be an int >= 1, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"fleet.simulate: rank must be one of 0..{world_size - 1}, got {rank!r}")
    if strategy is not None:
        from metaopt.fleet.strategy import DistributedStrategy

        if not isinstance(strategy, DistributedStrategy):
            raise TypeError(
                f"fleet.simulate: strategy must be a DistributedStrategy, got {type(strategy).__name__}"
            )
        strategy = strategy.copy()
    topo = _hybrid_topology(strategy, world_size)
    _STATE.env = WorkerEnv(
        rank=rank, world_size=world_size, local_rank=0, endpoints=None, current_endpoint=None
    )
    _STATE.strategy = strategy
    _STATE.hcg = None if topo is None else HybridCommunicateGroup(topo, rank)
    _STATE.simulated = True
    _STATE.initialized = True
    logger.info("fleet.simulate: worker %d of %d, no process group", rank, world_size)


def snapshot() -> _State:
    """Fleet's state as it is (`restore` puts it back): `fleet.plan` simulates workers in turn."""
    return dataclasses.replace(_STATE)


def restore(state: _State) -> None:
    _STATE.__dict__.update(vars(state))


def is_simulated() -> bool:
    """Whether this process stands in for one worker of a larger job (`simulate`)."""
    return _STATE.initialized and _STATE.simulated


# --- multi-process path (kept small; exercised through metaoptrun's tests) -----------------


def _join_process_group(env: WorkerEnv) -> bool:
    """Create torch.distributed's default group for `env`; False if one exists (and matches)."""
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != env.world_size or dist.get_rank() != env.rank:
            raise RuntimeError(
                f"fleet.init: a process group already exists as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, the env says rank {env.rank} of {env.world_size}"
            )
        return False
    if env.master_addr is None or env.master_port is None:
        raise ValueError(
            f"fleet.init: {env.world_size} workers need MASTER_ADDR and MASTER_PORT "
            "(or PADDLE_TRAINER_ENDPOINTS); start the job with metaoptrun"
        )
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0
    if use_cuda:
        if env.local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"fleet.init: LOCAL_RANK={env.local_rank} but only {torch.cuda.device_count()} GPU(s) visible"
            )
        torch.cuda.set_device(env.local_rank)
    from metaopt.layout.groups import choose_gloo_interface

    # gloo (the CPU group, and a NCCL job's host group) on the interface towards the master,
    # not the host name's address (the loopback on most hosts): else two hosts cannot connect
    choose_gloo_interface(env.master_addr)
    dist.init_process_group(
        backend="nccl" if use_cuda else "gloo",
        **_rendezvous(env),
        rank=env.rank,
        world_size=env.world_size,
        timeout=comm_timeout(),
    )
    # torch 2.13's gloo group aborts the process (SIGABRT, "terminate called without an
    # active exception") at interpreter exit if it was never destroyed: a finished job
    # would look failed.
    atexit.register(_destroy_at_exit)
    return True


def _rendezvous(env: WorkerEnv) -> dict:
    """How the workers find each other: the master's TCP store. Under a launcher that restarts
    workers (metaoptrun --max_restarts, torchrun) every attempt gets its own key prefix: the
    store lives on in the agent across restarts (torch's c10d rendezvous), and without a prefix a
    restarted worker read the last attempt's gloo addresses and failed to connect to a dead
    port ("connectFullMesh failed ... Connection refused")."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        return {"init_method": f"tcp://{env.master_addr}:{env.master_port}"}
    import torch.distributed as dist

    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # else rank 0 hosts it, as tcp://
    store = dist.TCPStore(
        env.master_addr,
        env.master_port,
        env.world_size,
        is_master=not agent and env.rank == 0,
        timeout=comm_timeout(),
        multi_tenant=True,
    )
    return {"store": dist.PrefixStore(f"metaopt/attempt-{attempt}", store)}


def _destroy_at_exit() -> None:
    import torch.distributed as dist

    from metaopt.layout.groups import forget_groups

    forget_groups()
    if dist.is_initialized():
        dist.destroy_process_group()


# --- hybrid parallel's groups ------------------------------------------------------------------


def _hybrid_topology(strategy, world_size: int) -> Topology | None:
    """The layout `strategy`'s hybrid_configs give the job (None when they are not set)."""
    from metaopt.fleet.topology import from_hybrid_configs, hybrid_is_set

    if strategy is None or not hybrid_is_set(strategy.hybrid_configs):
        return None
    return from_hybrid_configs(strategy.hybrid_configs, world_size, "fleet.init: strategy.hybrid_configs")


def _hybrid_group(topo: Topology, env: WorkerEnv) -> HybridCommunicateGroup:
    """This worker's HybridCommunicateGroup, with a process group per group of every axis.

    torch requires every worker to call ``new_group`` for every group, members or not, in the
    same order: here, axis by axis in ``AXES`` order, groups in ``get_comm_list`` order. The
    workers first check that they all hold the same topology (a worker given other degrees
    would pair its groups with the wrong peers). A re-``init`` with the same topology keeps the
    groups already made."""
    old = _STATE.hcg
    if old is not None and not _STATE.simulated and old.topology() == topo and old.global_rank == env.rank:
        return old
    if env.world_size == 1:
        return HybridCommunicateGroup(topo, env.rank)  # no process group, so no groups
    from metaopt.layout.groups import make_topology_groups

    # the collectives of tensor parallel, of data parallel beside it, of a pipeline and of expert
    # parallel look their groups up there (by axis, by ranks): only these exist on every worker
    axes = (*topo.group_axes(), *topo.expert_axes())
    return HybridCommunicateGroup(topo, env.rank, make_topology_groups(topo, env.rank, axes))


def _check_same_layout(topo: Topology | None) -> None:
    """Every worker's fleet.init exchanges its hybrid degrees (or that it has none) before any
    group is made: workers given other degrees, or hybrid_configs on some workers only, would
    pair their groups with the wrong peers, or wait in a collective the others never join
    (a timeout naming nothing). Raises WorkersDisagreeError on every worker alike, naming the
    first rank that differs from rank 0 and both layouts."""
    mine = None if topo is None else [*topo.dims, topo.ep_degree]  # AXES order, then ep
    dims = _gather(mine, "fleet.init: the exchange of hybrid_configs")
    differ = [r for r, d in enumerate(dims) if d != dims[0]]
    if differ:

        def text(d: list | None) -> str:
            if d is None:
                return "no hybrid_configs (fleet.init got none)"
            degrees = dict(zip((DEGREE_KEYS[a] for a in AXES), d, strict=False))
            return Topology(**degrees, ep_degree=d[-1]).describe()

        raise WorkersDisagreeError(
            f"fleet.init: the workers' hybrid_configs differ: rank 0 has {text(dims[0])}, "
            f"rank {differ[0]} has {text(dims[differ[0]])}; give every worker's fleet.init the same strategy"
        )


def get_hybrid_communicate_group() -> HybridCommunicateGroup:
    """Fleet's ``fleet.get_hybrid_communicate_group()``: this worker's ranks, degrees and process
    groups on the data, pipe, sharding and model axes (``topology.HybridCommunicateGroup``)."""
    _env()
    if _STATE.hcg is None:
        raise RuntimeError(
            "fleet.get_hybrid_communicate_group(): fleet.init was given no hybrid_configs; set "
            "strategy.hybrid_configs = {'dp_degree': d, 'mp_degree': m, 'pp_degree': p} (d x m x p = the "
            "world size) and call fleet.init(is_collective=True, strategy=strategy)"
        )
    return _STATE.hcg


def hybrid_topology() -> Topology | None:
    """The layout ``fleet.init`` built from its strategy's hybrid_configs (None if none)."""
    return None if _STATE.hcg is None else _STATE.hcg.topology()


# --- queries -------------------------------------------------------------------------------


def _env() -> WorkerEnv:
    if not _STATE.initialized:
        raise RuntimeError("fleet is not initialised: call fleet.init(is_collective=True) first")
    return _STATE.env


def require_process_group(what: str) -> None:
    """Raise unless torch.distributed's default group exists: `what` (data parallel, a
    pipeline with replicas) runs collectives, which need one. Checked at minimize, before any
    rewrite, rather than at the first collective of the first run."""
    import torch.distributed as dist

    if is_simulated():  # rewriting one worker's program: its collectives are never run here
        return
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{what} needs torch.distributed: call fleet.init(is_collective=True) in a job "
            "started by metaoptrun (or torchrun)"
        )


def is_initialized() -> bool:
    return _STATE.initialized


def worker_index() -> int:
    """This worker's rank, 0..worker_num()-1."""
    return _env().rank


def worker_num() -> int:
    """How many workers the job has."""
    return _env().world_size


def local_rank() -> int:
    """This worker's rank on its node (its GPU index)."""
    return _env().local_rank


def is_first_worker() -> bool:
    return _env().rank == 0


def worker_endpoints(to_string: bool = False) -> list[str] | str:
    """Every worker's "ip:port" (``PADDLE_TRAINER_ENDPOINTS``), as a list or comma-joined."""
    env = _env()
    if env.endpoints is None:
        raise RuntimeError(
            "fleet.worker_endpoints(): PADDLE_TRAINER_ENDPOINTS is not set "
            "(metaoptrun sets it, torchrun does not)"
        )
    return ",".join(env.endpoints) if to_string else list(env.endpoints)


def user_strategy():
    """The DistributedStrategy given to ``fleet.init`` (None if none)."""
    return _STATE.strategy


def barrier_worker() -> None:
    """Wait for every worker; a no-op with one worker (or one simulated: `simulate`)."""
    env = _env()
    if env.world_size == 1 or _STATE.simulated:
        return
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[env.local_rank])
    else:
        dist.barrier()


# --- workers agree ------------------------------------------------------------------------------


class WorkersDisagreeError(RuntimeError):
    """Workers that must hold the same thing (fleet's minimize: the training program) do not."""


MAX_RANKS_SHOWN = 4  # in a disagreement's message: the first ranks that differ from rank 0


def check_workers_agree(lines: Sequence[tuple[str, str]], what: str, hint: str = "") -> None:
    """Raise WorkersDisagreeError, on every worker alike, unless every worker's `lines` equal
    rank 0's. `lines`: (label, text) pairs, e.g. ("var 'fc1.weight'", its printed line); the
    error says "`what` differ", names for each differing rank the first line that differs
    (label and both texts), and ends with `hint`.

    Cheap when they agree: one exchange of a digest. Only on a mismatch do the workers exchange
    a short hash per line, then the texts at the first differing lines. Every exchange waits at
    most ``METAOPT_COMM_TIMEOUT`` (`layout.groups.all_gather_bytes`). A no-op with one worker."""
    if _env().world_size == 1:
        return
    texts = [text for _, text in lines]
    digest = hashlib.sha256("\n".join(texts).encode()).hexdigest()
    digests = _gather([digest, len(texts)], f"the exchange of {what}")
    if all(d == digests[0] for d in digests):
        return
    hashes = _gather([_line_hash(t) for t in texts], f"the exchange of {what} (line hashes)")
    firsts = {
        r: _first_difference(hashes[0], hashes[r]) for r in range(len(digests)) if digests[r] != digests[0]
    }
    at = sorted(set(firsts.values()))
    mine = {str(i): list(lines[i]) if i < len(lines) else None for i in at}
    shown = _gather(mine, f"the exchange of {what} (differing lines)")
    raise WorkersDisagreeError(_disagreement(what, firsts, shown) + hint)


def broadcast_from_first(tensors: dict, what: str, axes: tuple[str, ...] = ()) -> dict:
    """Worker 0's `tensors` (name -> tensor) on every worker; `tensors` itself with one worker.
    `axes`: from the first worker of this worker's group on each hybrid axis in turn
    (``layout.groups.broadcast_from_first``). A simulated worker (`simulate`) keeps its own."""
    if _env().world_size == 1 or _STATE.simulated:
        return dict(tensors)
    from metaopt.layout.groups import broadcast_from_first as broadcast

    return broadcast(tensors, what, axes)


def _gather(obj, what: str) -> list:
    """`obj` (JSON-able) of every worker, by rank."""
    from metaopt.layout.groups import all_gather_json

    return all_gather_json(obj, what)


def _line_hash(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def _first_difference(a: list[str], b: list[str]) -> int:
    """The first index where `a` and `b` differ (the shorter one's length if one is a prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _disagreement(what: str, firsts: dict[int, int], shown: list[dict]) -> str:
    """The message: for each rank that differs from rank 0, where and how."""
    parts = []
    for r, i in list(firsts.items())[:MAX_RANKS_SHOWN]:
        ref, other = shown[0].get(str(i)), shown[r].get(str(i))
        label = (other or ref or [f"line {i}"])[0]  # both None only if 64-bit line hashes collide
        if ref is not None and other is not None and ref[0] != other[0]:
            label += f" (rank 0 has {ref[0]} there)"
        how = f"rank 0 has {_quoted(ref)}, rank {r} has {_quoted(other)}"
        parts.append(f"rank {r} differs from rank 0 first at {label}: {how}")
    more = len(firsts) - MAX_RANKS_SHOWN
    tail = f"; and {more} more rank(s)" if more > 0 else ""
    return f"{what} differ: {'; '.join(parts)}{tail}"


def _quoted(line: list | None) -> str:
    return "nothing (its list ends before)" if line is None else f"`{line[1].strip()}`"


def reset() -> None:
    """Forget ``init`` (for tests and notebooks); destroys the process group ``init`` created."""
    if _STATE.created_group:
        _destroy_at_exit()
    _STATE.__init__()
