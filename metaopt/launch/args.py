"""metaoptrun's flags (fleetrun's and torchrun's spellings) and the LaunchPlan they resolve to.

Nothing here starts a process or imports torch: the device count and the environment
are parameters, so the rules (``--gpus`` against ``CUDA_VISIBLE_DEVICES``, ``--ips`` to
a node rank, ...) are unit-tested with fake machines.
"""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

DEFAULT_LOG_DIR = "log"  # fleetrun's
DEFAULT_MULTI_NODE_PORT = 29500  # torchrun's, for the static rendezvous of a multi-node job
DEFAULT_SHUTDOWN_TIMEOUT_S = 30  # torch elastic's SIGTERM -> SIGKILL grace


class LaunchError(ValueError):
    """A bad flag or flag combination; the message names the flag."""


@dataclass(frozen=True)
class LaunchPlan:
    """What to start on this node, with every default resolved."""

    script: str
    script_args: tuple[str, ...]
    module: bool  # run `script` as a module (python -m)
    nproc_per_node: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int | None  # None: one node; the rendezvous store binds a free port
    node_ip: str | None  # this node's address in PADDLE_TRAINER_ENDPOINTS; None: find it out
    gpus: tuple[str, ...] | None  # CUDA_VISIBLE_DEVICES entries, one per local worker; None: CPU
    log_dir: str
    max_restarts: int
    shutdown_timeout: int


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="metaoptrun",
        description="Start a metaopt training job: N workers per node under torch's elastic agent, "
        "with torch's (RANK, WORLD_SIZE, ...) and Fleet's (PADDLE_TRAINER_ID, ...) environment.",
        # a prefix of a flag must not silently become that flag (`--nproc 2`)
        allow_abbrev=False,
    )
    fleet = p.add_argument_group("fleetrun flags")
    fleet.add_argument(
        "--gpus", default=None, help="comma list of GPUs (as named in CUDA_VISIBLE_DEVICES), one worker each"
    )
    fleet.add_argument("--devices", default=None, help="the same as --gpus (Paddle 2.x spelling)")
    fleet.add_argument(
        "--ips",
        default=None,
        help="comma list of the nodes' IPs, the first is the master (default 127.0.0.1)",
    )
    fleet.add_argument(
        "--log_dir",
        "--log-dir",
        dest="log_dir",
        default=DEFAULT_LOG_DIR,
        help="where workerlog.N (worker N's stdout and stderr) go (default: log)",
    )
    torchrun = p.add_argument_group("torchrun flags")
    torchrun.add_argument(
        "--nproc_per_node",
        "--nproc-per-node",
        dest="nproc_per_node",
        default=None,
        help="workers on this node (default: one per visible GPU, else 1)",
    )
    torchrun.add_argument(
        "--nnodes", default=None, help="number of nodes (default: the number of --ips, else 1)"
    )
    torchrun.add_argument(
        "--node_rank",
        "--node-rank",
        dest="node_rank",
        default=None,
        help="this node's rank (default: found from --ips, else 0)",
    )
    torchrun.add_argument(
        "--master_addr",
        "--master-addr",
        dest="master_addr",
        default=None,
        help="the master node's address (default: the first of --ips, else 127.0.0.1)",
    )
    torchrun.add_argument(
        "--master_port",
        "--master-port",
        dest="master_port",
        default=None,
        help=f"the master's port (default: a free port on one node, {DEFAULT_MULTI_NODE_PORT} on several)",
    )
    torchrun.add_argument(
        "--max_restarts",
        "--max-restarts",
        dest="max_restarts",
        default="0",
        help="restart the whole worker group up to this many times when a worker fails (default 0)",
    )
    torchrun.add_argument(
        "--shutdown_timeout",
        "--shutdown-timeout",
        dest="shutdown_timeout",
        default=None,
        help="seconds between SIGTERM and SIGKILL when ending workers "
        f"(default: TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else {DEFAULT_SHUTDOWN_TIMEOUT_S})",
    )
    torchrun.add_argument(
        "--standalone", action="store_true", help="one node on a free port (the default; for torchrun users)"
    )
    torchrun.add_argument(
        "-m", "--module", action="store_true", help="run the script as a module (python -m)"
    )
    p.add_argument("training_script", help="the training script (or module, with -m)")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER, help="its arguments")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse metaoptrun's command line (argparse's usage error and exit 2 on bad syntax)."""
    return build_parser().parse_args(argv)


MAX_NPROC_ENV = "METAOPT_MAX_NPROC_PER_NODE"


def max_nproc_per_node(environ: Mapping[str, str]) -> int:
    """The most workers one node starts: 4 per core (at least 8), or `MAX_NPROC_ENV`. A mistyped
    10000 would otherwise start until the machine gives out (1000 workers: 7 GB in 15 s)."""
    raw = environ.get(MAX_NPROC_ENV, "").strip()
    if raw.isdigit() and int(raw) > 0:
        return int(raw)
    return max(8, 4 * (os.cpu_count() or 1))


def _int_flag(flag: str, raw: str | None, lo: int, hi: int | None = None) -> int | None:
    if raw is None:
        return None
    try:
        value = int(str(raw).strip())
    except ValueError:
        raise LaunchError(f"{flag}={raw!r}: expected an integer") from None
    if value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"in {lo}..{hi}"
        raise LaunchError(f"{flag}={raw!r}: must be {bound}")
    return value


def _comma_list(flag: str, raw: str) -> tuple[str, ...]:
    items = tuple(x.strip() for x in raw.split(","))
    if not raw.strip() or any(not x for x in items):
        raise LaunchError(f"{flag}={raw!r}: expected a comma list with no empty entries")
    if len(set(items)) != len(items):
        raise LaunchError(f"{flag}={raw!r}: lists an entry twice")
    return items


def visible_gpus(environ: Mapping[str, str], device_count: int) -> tuple[str, ...]:
    """The GPUs torch can use, named as in CUDA_VISIBLE_DEVICES (indices when it is unset)."""
    cvd = environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is None:
        return tuple(str(i) for i in range(device_count))
    # CUDA enumerates the listed devices in order; torch's count says how many of them exist
    return tuple(x.strip() for x in cvd.split(",") if x.strip())[:device_count]


def resolve_gpus(flag: str, raw: str, environ: Mapping[str, str], device_count: int) -> tuple[str, ...]:
    """`--gpus` entries, checked against what CUDA exposes (errors name `flag` and the device)."""
    wanted = _comma_list(flag, raw)
    if device_count == 0:
        raise LaunchError(
            f"{flag}={raw}: no CUDA device is visible to torch (torch.cuda.device_count() is 0); "
            "start CPU workers with --nproc_per_node=N instead"
        )
    visible = visible_gpus(environ, device_count)
    cvd = environ.get("CUDA_VISIBLE_DEVICES")
    for gpu in wanted:
        if gpu in visible:
            continue
        if cvd is None:
            raise LaunchError(
                f"{flag}={raw}: there is no GPU {gpu}; torch sees {device_count} (0..{device_count - 1})"
            )
        listed = [x.strip() for x in cvd.split(",")]
        if gpu in listed:
            raise LaunchError(
                f"{flag}={raw}: GPU {gpu} is in CUDA_VISIBLE_DEVICES={cvd} but torch sees only "
                f"{device_count} device(s): {','.join(visible)}"
            )
        raise LaunchError(f"{flag}={raw}: GPU {gpu} is not in CUDA_VISIBLE_DEVICES={cvd}")
    return wanted


def is_local_address(host: str) -> bool:
    """Whether `host` is an address of this machine (binding to it works only then)."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    for family, _, _, _, addr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((addr[0], 0))
            return True
        except OSError:
            continue
    return False


BACKOFF_ENV = "METAOPT_RESTART_BACKOFF"  # seconds before the first restart; doubled each time
BACKOFF_MAX_S = 60.0


def restart_backoff(restart: int, environ: Mapping[str, str] | None = None) -> float:
    """Seconds to wait before restart number `restart` (1, 2, ...): METAOPT_RESTART_BACKOFF
    (default 1) doubled each restart, at most a minute, so a job failing at once does not spin
    (issue 47: 81 restarts in 40 s); 0 turns it off."""
    raw = (os.environ if environ is None else environ).get(BACKOFF_ENV, "1")
    try:
        base = float(raw)
    except ValueError:
        raise ValueError(f"{BACKOFF_ENV}={raw!r} is not a number of seconds") from None
    if not base >= 0 or base == float("inf"):
        raise ValueError(f"{BACKOFF_ENV}={raw!r} must be a finite number of seconds >= 0")
    # the exponent capped: --max_restarts may be huge, and 2.0 ** 1024 overflows a float
    return min(base * 2.0 ** min(max(restart - 1, 0), 64), BACKOFF_MAX_S)


def _resolve(flag: str, host: str, resolve: Callable[[str], object] | None) -> None:
    """Refuse a host name that does not resolve, naming it, before anything waits on it."""
    try:
        (resolve or (lambda h: socket.getaddrinfo(h, None)))(host)
    except (OSError, UnicodeError) as e:
        raise LaunchError(
            f"{flag}: {host!r} does not resolve to an address ({type(e).__name__}: {e}); "
            "give each node's IP address or a host name this machine can resolve"
        ) from None


def _node_rank_from_ips(ips: tuple[str, ...], is_local: Callable[[str], bool]) -> int:
    mine = [i for i, ip in enumerate(ips) if is_local(ip)]
    if len(mine) == 1:
        return mine[0]
    what = "none of them is" if not mine else f"{len(mine)} of them are"
    raise LaunchError(
        f"--ips={','.join(ips)}: cannot tell which node this is ({what} an address of this machine); "
        "pass --node_rank"
    )


def plan_launch(
    ns: argparse.Namespace,
    environ: Mapping[str, str] | None = None,
    device_count: int | None = None,
    is_local: Callable[[str], bool] = is_local_address,
    resolve: Callable[[str], object] | None = None,
) -> LaunchPlan:
    """Resolve parsed flags into a LaunchPlan; LaunchError names the bad flag.

    `device_count` defaults to ``torch.cuda.device_count()``; `is_local` decides which of
    ``--ips`` is this machine when ``--node_rank`` is not given; `resolve(host)` (default
    ``socket.getaddrinfo``) must not raise for any ``--ips`` entry or ``--master_addr``.
    """
    environ = os.environ if environ is None else environ
    if device_count is None:
        import torch

        device_count = torch.cuda.device_count() if torch.cuda.is_available() else 0

    # --- devices and workers per node ---
    if ns.gpus is not None and ns.devices is not None and ns.gpus != ns.devices:
        raise LaunchError(f"--gpus={ns.gpus} and --devices={ns.devices} disagree (they are the same flag)")
    gpu_flag, gpu_raw = ("--gpus", ns.gpus) if ns.gpus is not None else ("--devices", ns.devices)
    nproc = _int_flag("--nproc_per_node", ns.nproc_per_node, 1)
    limit = max_nproc_per_node(environ)
    if nproc is not None and nproc > limit:
        raise LaunchError(
            f"--nproc_per_node={nproc} is more than {limit} workers on one node "
            f"(4 per CPU core, at least 8); set {MAX_NPROC_ENV}=N to allow more"
        )
    gpus: tuple[str, ...] | None
    if gpu_raw is not None:
        gpus = resolve_gpus(gpu_flag, gpu_raw, environ, device_count)
        if nproc is not None and nproc != len(gpus):
            raise LaunchError(
                f"--nproc_per_node={nproc} but {gpu_flag}={gpu_raw} names {len(gpus)} GPU(s); "
                "give one of them, or make them agree"
            )
        nproc = len(gpus)
    elif device_count > 0:
        visible = visible_gpus(environ, device_count)
        if nproc is None:
            nproc = len(visible)  # fleetrun: every visible GPU
        elif nproc > len(visible):
            raise LaunchError(
                f"--nproc_per_node={nproc} but only {len(visible)} CUDA device(s) are visible; "
                "each worker needs its own GPU (hide them with CUDA_VISIBLE_DEVICES= for CPU workers)"
            )
        gpus = visible[:nproc]
    else:
        gpus = None
        nproc = 1 if nproc is None else nproc

    # --- nodes ---
    ips = _comma_list("--ips", ns.ips) if ns.ips is not None else None
    for host in ips or ():  # an entry that never resolves would hang the rendezvous ("gai error")
        _resolve("--ips", host, resolve)
    if ns.master_addr is not None:
        _resolve("--master_addr", ns.master_addr, resolve)
    nnodes = _parse_nnodes(ns.nnodes)
    if ips is not None and nnodes is not None and nnodes != len(ips):
        raise LaunchError(f"--nnodes={nnodes} but --ips={ns.ips} lists {len(ips)} node(s)")
    nnodes = nnodes if nnodes is not None else (len(ips) if ips else 1)
    if ns.standalone and nnodes > 1:
        raise LaunchError(f"--standalone is one node, but --nnodes={nnodes} / --ips ask for {nnodes}")
    node_rank = _int_flag("--node_rank", ns.node_rank, 0, nnodes - 1)
    if node_rank is None:
        if nnodes == 1:
            node_rank = 0
        elif ips is not None:
            node_rank = _node_rank_from_ips(ips, is_local)
        else:
            raise LaunchError(f"--nnodes={nnodes} needs --node_rank (or --ips, to find it)")
    if ns.master_addr is not None and ips is not None and ns.master_addr != ips[0]:
        raise LaunchError(
            f"--master_addr={ns.master_addr} but --ips={ns.ips} starts with {ips[0]} "
            "(the first ip is the master)"
        )
    master_addr = ns.master_addr or (ips[0] if ips else "127.0.0.1")
    master_port = _int_flag("--master_port", ns.master_port, 1, 65535)
    if master_port is None and nnodes > 1:
        master_port = DEFAULT_MULTI_NODE_PORT  # every node must know it in advance
    if ips is not None:
        node_ip: str | None = ips[node_rank]
    elif nnodes == 1:
        node_ip = master_addr
    else:
        node_ip = None  # the address this node reaches the master from, found at start

    max_restarts = _int_flag("--max_restarts", ns.max_restarts, 0)
    assert max_restarts is not None  # the flag has a default
    if max_restarts:
        try:
            restart_backoff(1, environ)  # a bad METAOPT_RESTART_BACKOFF named now, not at a failure
        except ValueError as e:
            raise LaunchError(str(e)) from None
    raw_timeout = ns.shutdown_timeout
    flag = "--shutdown_timeout"
    if raw_timeout is None:
        raw_timeout = environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(DEFAULT_SHUTDOWN_TIMEOUT_S))
        flag = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
    shutdown_timeout = _int_flag(flag, raw_timeout, 0)
    assert shutdown_timeout is not None

    if not ns.module and not os.path.isfile(ns.training_script):
        raise LaunchError(f"training script {ns.training_script!r} not found (for a module, pass -m)")
    if not ns.log_dir:
        raise LaunchError("--log_dir: must not be empty")
    if os.path.exists(ns.log_dir) and not os.path.isdir(ns.log_dir):
        raise LaunchError(f"--log_dir={ns.log_dir}: exists and is not a directory")
    parent = os.path.dirname(os.path.abspath(ns.log_dir))
    while parent and not os.path.exists(parent):  # the nearest existing ancestor must be a folder
        parent = os.path.dirname(parent) if os.path.dirname(parent) != parent else ""
    if parent and not os.path.isdir(parent):
        raise LaunchError(f"--log_dir={ns.log_dir}: {parent} is not a directory")

    return LaunchPlan(
        script=ns.training_script,
        script_args=tuple(ns.training_script_args),
        module=ns.module,
        nproc_per_node=nproc,
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        node_ip=node_ip,
        gpus=gpus,
        log_dir=ns.log_dir,
        max_restarts=max_restarts,
        shutdown_timeout=shutdown_timeout,
    )


def _parse_nnodes(raw: str | None) -> int | None:
    if raw is not None and ":" in str(raw):
        raise LaunchError(
            f"--nnodes={raw}: elastic node ranges (MIN:MAX) are not supported by metaoptrun; give a number"
        )
    return _int_flag("--nnodes", raw, 1)
