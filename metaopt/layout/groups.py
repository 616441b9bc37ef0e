"""torch.distributed process groups of a job and the host-side agreement between its workers,
shared by fleet (``fleet.init`` makes the hybrid axes' groups, ``minimize`` compares programs)
and the runtime (the comm ops find their groups here). Below both: it imports neither.

Every wait is bounded by ``METAOPT_COMM_TIMEOUT`` seconds (default 300, the same that
``fleet.init`` gives the process group): a peer that died or never reached the same call is a
`CommError` naming what and this rank, never a hang.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import time
from collections.abc import Mapping, Sequence

import torch

DEFAULT_TIMEOUT_S = 300.0
_GROUPS: dict[tuple[int, ...], object] = {}  # sub-groups by their ranks (made once per process)


class CommError(RuntimeError):
    pass


def timeout(environ: Mapping[str, str] | None = None) -> datetime.timedelta:
    """Every collective's and group's timeout: ``METAOPT_COMM_TIMEOUT`` seconds, default 300; a
    value that is not a number of seconds > 0 is a ValueError naming it."""
    environ = os.environ if environ is None else environ
    raw = environ.get("METAOPT_COMM_TIMEOUT")
    if raw is None or raw.strip() == "":
        return datetime.timedelta(seconds=DEFAULT_TIMEOUT_S)
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"METAOPT_COMM_TIMEOUT={raw!r}: expected a number of seconds > 0")
    return datetime.timedelta(seconds=seconds)


def forget_groups() -> None:
    """Drop the sub-groups made so far (their default group is being destroyed)."""
    _GROUPS.clear()
    _CPU_GROUP.clear()
    forget_topology()


# --- groups of the hybrid topology (fleet.init) -------------------------------------------------
# fleet.init makes every group of every hybrid axis on every worker, in one order (torch's rule
# for new_group); a group only some workers would ask for (a model-parallel group [0, 1] of 4)
# must come from there, never be made lazily by its members alone, which would hang.
# `make_topology_groups` is the one place that makes them: fleet.init calls it for hybrid_configs,
# the pipeline runtime for a pipeline laid out by pipeline_configs alone (the same layout,
# dp x pp), so no group of an axis is ever made twice.
_TOPOLOGY_GROUPS: dict[tuple[int, ...], object] = {}  # this worker's groups, by their ranks
_AXIS_RANKS: dict[str, tuple[int, ...]] = {}  # axis ("data", "model", ...) -> this worker's group
_TOPOLOGY: list = []  # [the topology whose groups these are] (a layout.topology.Topology)


def register_topology_group(axis: str, ranks: Sequence[int], group: object) -> None:
    """Record `group` (made on every worker) as this worker's group on `axis`."""
    key = tuple(sorted(ranks))
    _TOPOLOGY_GROUPS[key] = group
    _AXIS_RANKS[axis] = key


def make_topology_groups(topo, rank: int, axes: Sequence[str]) -> dict[str, object]:
    """Make one process group per group of every axis of `topo` (a ``layout.topology.Topology``),
    on every worker alike: axis by axis in `axes` order, groups in ``topo.get_comm_list`` order,
    as torch requires of ``new_group``. Registers this worker's (`axis_ranks`, `Communicator.group`)
    and `topo` itself (`topology`); returns this worker's group per axis. Every worker must call
    it at the same point with the same `topo`."""
    dist = initialized_dist()
    forget_topology()
    mine: dict[str, object] = {}
    for axis in axes:
        for ranks in topo.get_comm_list(axis):
            group = dist.new_group(ranks, timeout=timeout())
            if rank in ranks:
                mine[axis] = group
                register_topology_group(axis, ranks, group)
    _TOPOLOGY[:] = [topo]
    return mine


def forget_topology() -> None:
    """Forget the topology and its registered groups (the process groups themselves stay)."""
    _TOPOLOGY_GROUPS.clear()
    _AXIS_RANKS.clear()
    _TOPOLOGY.clear()


def topology():
    """The topology whose groups `make_topology_groups` made (None before): every worker's
    coordinate, for the pipeline runtime's placement of stages and replicas."""
    return _TOPOLOGY[0] if _TOPOLOGY else None


def axis_ranks(axis: str) -> list[int] | None:
    """This worker's group on hybrid `axis` (global ranks, ascending); None if fleet.init made none."""
    ranks = _AXIS_RANKS.get(axis)
    return None if ranks is None else list(ranks)


_CPU_GROUP: dict[str, object] = {}  # "gloo": a gloo group of every worker, for a NCCL job's host data


def all_gather_bytes(data: bytes, what: str) -> list[bytes]:
    """Every worker's `data`, by rank (this worker's included), over gloo on the host.

    For small host-side agreements between workers before any program runs (fleet's
    ``minimize`` compares the workers' programs): plain bytes, so nothing is unpickled. Each
    wait is bounded by ``METAOPT_COMM_TIMEOUT``: a peer that died, or never calls this, is a
    `CommError` naming `what` and this rank, never a hang. Every worker must call it at the
    same point (a NCCL job's gloo group is made by the first call, on every worker)."""
    dist = initialized_dist()
    group = host_group(dist)
    world = dist.get_world_size()
    mine = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    run_gloo(
        lambda: dist.all_gather(sizes, mine, group=group, async_op=True), [mine, *sizes], f"{what} (sizes)"
    )
    width = max(int(n) for n in sizes)
    buf = torch.zeros(width, dtype=torch.uint8)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    outs = [torch.empty(width, dtype=torch.uint8) for _ in range(world)]
    run_gloo(lambda: dist.all_gather(outs, buf, group=group, async_op=True), [buf, *outs], what)
    return [bytes(o[: int(n)].numpy()) for o, n in zip(outs, sizes, strict=True)]


def all_gather_json(obj: object, what: str) -> list:
    """Every worker's `obj` (JSON-able: tuples come back as lists), by rank; `all_gather_bytes`."""
    import json

    return [json.loads(b) for b in all_gather_bytes(json.dumps(obj).encode(), what)]


def broadcast_from_first(
    tensors: dict[str, torch.Tensor], what: str, axes: Sequence[str] = ()
) -> dict[str, torch.Tensor]:
    """Worker 0's `tensors` on every worker (new tensors; the given ones are left alone), over
    gloo on the host, flattened into one message per dtype; each wait bounded as in
    `all_gather_bytes`. Every worker must call it at the same point with the same names, shapes
    and dtypes (fleet's minimize has checked the programs agree). With `axes` (hybrid axes of
    fleet.init's layout, e.g. ("sharding", "data")): from the first rank of this worker's group
    on each axis in turn, so a worker gets the value of the first worker with its coordinates on
    the other axes (tensor parallel's split params: each model-parallel rank its own part)."""
    if axes:
        out = dict(tensors)
        for axis in axes:
            ranks = axis_ranks(axis)
            if ranks is not None and len(ranks) > 1:
                out = _broadcast(out, what, group_of(ranks, timeout()), ranks[0])
        return out
    dist = initialized_dist()
    return _broadcast(tensors, what, host_group(dist), 0)


def _broadcast(tensors: dict[str, torch.Tensor], what: str, group, src: int) -> dict[str, torch.Tensor]:
    dist = initialized_dist()
    out: dict[str, torch.Tensor] = {}
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name, t in tensors.items():
        by_dtype.setdefault(t.dtype, []).append(name)
    for dtype, keys in by_dtype.items():
        flat = torch.cat([tensors[k].detach().reshape(-1).cpu() for k in keys])
        if dist.get_backend(group) == "nccl":  # a hybrid axis's group of a NCCL job: device tensors
            flat = flat.cuda()
        run_gloo(
            lambda flat=flat: dist.broadcast(flat, src, group=group, async_op=True),
            [flat],
            f"{what} ({dtype})",
        )
        at = 0
        for k in keys:
            n = tensors[k].numel()
            out[k] = flat[at : at + n].reshape(tensors[k].shape).cpu().clone()
            at += n
    return out


def host_group(dist):
    """The default group if it is gloo, else (NCCL: device tensors only) a gloo group of all."""
    if dist.get_backend() == "gloo":
        return None
    if "gloo" not in _CPU_GROUP:
        _CPU_GROUP["gloo"] = dist.new_group(backend="gloo", timeout=timeout())
    return _CPU_GROUP["gloo"]


def run_gloo(start, tensors: Sequence[torch.Tensor], what: str) -> None:
    """Start a gloo collective (`start()` returns its work) on `tensors` (every tensor it reads
    or writes), wait for it at most ``METAOPT_COMM_TIMEOUT`` (its failure a CommError naming
    `what`), then wait until gloo's thread has let go of the tensors (`await_release`)."""
    dist, limit, t0 = initialized_dist(), timeout(), time.perf_counter()
    before = references(tensors)
    try:
        start().wait(limit)
    except Exception as e:  # gloo raises RuntimeError subclasses with their own text
        raise CommError(failure_message(what, dist.get_rank(), dist.get_world_size(), t0, limit, e)) from e
    await_release(tensors, before)


# A gloo collective runs on the group's own thread, which lets go of its tensors just after the
# waiting thread wakes, and letting go needs the GIL (torch hands each tensor's Python object back).
# If the process exits in between, that thread takes the GIL during interpreter finalization and
# the process aborts ("terminate called without an active exception", SIGABRT) instead of exiting
# with the script's status: seen when a worker raised right after a collective. destroy_process_group
# cannot prevent it: a torch module imported after init (torch.export imports torch.distributed.nn)
# keeps the group alive in its functions' default arguments, so its threads outlive the destroy.
# While the thread holds a tensor, the tensor's Python refcount carries one reference for it.
RELEASE_WAIT_S = 5.0  # gloo's thread lets go within microseconds of the wake, when it is scheduled


def references(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Each tensor's Python reference count (compared by `await_release`)."""
    return [sys.getrefcount(t) for t in tensors]


def await_release(tensors: Sequence[torch.Tensor], before: list[int]) -> None:
    """Return once no tensor of `tensors` holds more references than `before` (taken, by
    `references`, before the collective started), i.e. gloo's thread has let go of them;
    sleeping gives it the GIL. Gives up after RELEASE_WAIT_S (a thread starved that long)."""
    delay, deadline = 0.0, time.monotonic() + RELEASE_WAIT_S
    while any(n > b for n, b in zip(references(tensors), before, strict=True)):
        if time.monotonic() > deadline:
            return
        time.sleep(delay)
        delay = min(2 * delay or 1e-5, 1e-3)


def failure_message(
    what: str, rank: int, world: int, t0: float, limit: datetime.timedelta, e: Exception
) -> str:
    cause = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return (
        f"{what} failed on rank {rank} of {world} after {time.perf_counter() - t0:.1f}s (timeout "
        f"{limit.total_seconds():g}s, METAOPT_COMM_TIMEOUT): a peer died or did not reach this "
        f"collective. Cause: {type(e).__name__}: {cause}"
    )


def initialized_dist():
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise CommError(
            "a collective op needs torch.distributed: call fleet.init(is_collective=True) in a job "
            "started by metaoptrun (or torchrun)"
        )
    return dist


def group_of(ranks: Sequence[int], limit: datetime.timedelta) -> object:
    """The process group of `ranks` (sorted or not): the one fleet.init made for a hybrid axis
    (`register_topology_group`), else one made on first use, which torch requires of every
    worker in the same order (pipelines create theirs together at their first run)."""
    key = tuple(sorted(ranks))
    if key in _TOPOLOGY_GROUPS:  # made by fleet.init on every worker (hybrid axes)
        return _TOPOLOGY_GROUPS[key]
    if key not in _GROUPS:
        _GROUPS[key] = initialized_dist().new_group(list(key), timeout=limit)
    return _GROUPS[key]


# --- which network interface gloo listens on ----------------------------------------------------
# Without GLOO_SOCKET_IFNAME gloo listens on, and tells its peers, the address this machine's host
# name resolves to: the loopback on most hosts (/etc/hosts), so two real hosts never connect
# ("connectFullMesh failed ... remote=[127.0.0.1]"). fleet.init names the interface that holds
# this machine's address on the route to the master instead, as a user of two hosts had to.
GLOO_IFNAME = "GLOO_SOCKET_IFNAME"
_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def address_towards(host: str) -> str | None:
    """This machine's IPv4 address on the route to `host` (a UDP connect sends nothing); None
    when there is no route or `host` is not IPv4."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return None


def _ipv4_of(ifname: str) -> str | None:
    import struct

    try:
        import fcntl  # Unix only: elsewhere gloo keeps its own choice

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", ifname.encode()[:15]))
    except (OSError, ImportError):  # no IPv4 address, the interface is gone, not Unix
        return None
    return socket.inet_ntoa(packed[20:24])


def interface_towards(host: str) -> str | None:
    """The network interface holding this machine's address on the route to `host` (the
    master): what gloo must listen on for the workers of other hosts to reach this one. None
    where it cannot be told (no route, IPv6, a secondary address, not Linux)."""
    mine = address_towards(host)
    if mine is None or not hasattr(socket, "if_nameindex"):
        return None
    return next((name for _, name in socket.if_nameindex() if _ipv4_of(name) == mine), None)


def choose_gloo_interface(master_addr: str, environ: dict | None = None) -> str | None:
    """Set ``GLOO_SOCKET_IFNAME`` to `interface_towards(master_addr)` unless the user set it;
    returns what it is now (None: unset, gloo's own choice)."""
    environ = os.environ if environ is None else environ
    if not environ.get(GLOO_IFNAME):
        name = interface_towards(master_addr)
        if name is not None:
            environ[GLOO_IFNAME] = name
    return environ.get(GLOO_IFNAME)
