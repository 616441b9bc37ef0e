"""Collectives over torch.distributed for the comm ops (AllReduce, the startup Broadcast of
data parallel's initial values, the pipeline's Send/Recv): gloo on CPU, NCCL on CUDA.

Every collective waits with a timeout (``METAOPT_COMM_TIMEOUT`` seconds, default 300,
the same that ``fleet.init`` gives the process group), and a failure — a peer that died,
or never reached the same collective — becomes an error naming the op, this rank and
the timeout, never a hang.
"""

from __future__ import annotations

import datetime
import os
import time
import zlib
from collections.abc import Sequence

import torch

DEFAULT_TIMEOUT_S = 300.0
_GROUPS: dict[tuple[int, ...], object] = {}  # sub-groups by their ranks (made once per process)
_REDUCTIONS = ("avg", "sum")


class CommError(RuntimeError):
    pass


class PipelineCommError(CommError):
    """A pipeline send/recv whose two sides disagree (shape, dtype, var)."""


_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool)
_MAX_DIMS = 8
_REJECTED = -1  # the dtype code of a header refusing the peer's last send
_REJECT_WAIT_S = 10.0
_HEADER_LEN = 3 + _MAX_DIMS  # name hash, dtype code, ndim, dims


def _hash(name: str) -> int:
    return zlib.crc32(name.encode())


def _header(var: str, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if len(shape) > _MAX_DIMS or dtype not in _DTYPES:
        raise PipelineCommError(f"cannot send {var!r}: {dtype} with {len(shape)} dims is not supported")
    dims = list(shape) + [0] * (_MAX_DIMS - len(shape))
    return torch.tensor(
        [_hash(var), _DTYPES.index(dtype), len(shape), *dims], dtype=torch.int64, device=device
    )


def _fits(shape: tuple[int, ...], expected: tuple[int | None, ...]) -> bool:
    return len(shape) == len(expected) and all(e is None or e == d for d, e in zip(shape, expected))


def _fmt(expected: tuple[int | None, ...]) -> str:
    return "[" + ", ".join("?" if e is None else str(e) for e in expected) + "]"


def timeout() -> datetime.timedelta:
    raw = os.environ.get("METAOPT_COMM_TIMEOUT", "").strip()
    return datetime.timedelta(seconds=float(raw) if raw else DEFAULT_TIMEOUT_S)


def forget_groups() -> None:
    """Drop the sub-groups made so far (their default group is being destroyed)."""
    _GROUPS.clear()
    _CPU_GROUP.clear()


_CPU_GROUP: dict[str, object] = {}  # "gloo": a gloo group of every worker, for a NCCL job's host data


def all_gather_bytes(data: bytes, what: str) -> list[bytes]:
    """Every worker's `data`, by rank (this worker's included), over gloo on the host.

    For small host-side agreements between workers before any program runs (fleet's
    ``minimize`` compares the workers' programs): plain bytes, so nothing is unpickled. Each
    wait is bounded by ``METAOPT_COMM_TIMEOUT``: a peer that died, or never calls this, is a
    `CommError` naming `what` and this rank, never a hang. Every worker must call it at the
    same point (a NCCL job's gloo group is made by the first call, on every worker)."""
    dist = _dist()
    group = _cpu_group(dist)
    world = dist.get_world_size()
    mine = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    _wait_work(dist.all_gather(sizes, mine, group=group, async_op=True), f"{what} (sizes)")
    width = max(int(n) for n in sizes)
    buf = torch.zeros(width, dtype=torch.uint8)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    outs = [torch.empty(width, dtype=torch.uint8) for _ in range(world)]
    _wait_work(dist.all_gather(outs, buf, group=group, async_op=True), what)
    return [bytes(o[: int(n)].numpy()) for o, n in zip(outs, sizes, strict=True)]


def _cpu_group(dist):
    """The default group if it is gloo, else (NCCL: device tensors only) a gloo group of all."""
    if dist.get_backend() == "gloo":
        return None
    if "gloo" not in _CPU_GROUP:
        _CPU_GROUP["gloo"] = dist.new_group(backend="gloo", timeout=timeout())
    return _CPU_GROUP["gloo"]


def _wait_work(work, what: str) -> None:
    """Wait for a gloo `work` at most ``METAOPT_COMM_TIMEOUT``; its failure as a CommError."""
    dist, limit, t0 = _dist(), timeout(), time.perf_counter()
    try:
        work.wait(limit)
    except Exception as e:  # gloo raises RuntimeError subclasses with their own text
        raise CommError(_failure(what, dist.get_rank(), dist.get_world_size(), t0, limit, e)) from e


def _failure(what: str, rank: int, world: int, t0: float, limit: datetime.timedelta, e: Exception) -> str:
    cause = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return (
        f"{what} failed on rank {rank} of {world} after {time.perf_counter() - t0:.1f}s (timeout "
        f"{limit.total_seconds():g}s, METAOPT_COMM_TIMEOUT): a peer died or did not reach this "
        f"collective. Cause: {type(e).__name__}: {cause}"
    )


def _dist():
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise CommError(
            "a collective op needs torch.distributed: call fleet.init(is_collective=True) in a job "
            "started by metaoptrun (or torchrun)"
        )
    return dist


class Communicator:
    """The default process group, seen by the executor's comm ops."""

    def __init__(self, device: torch.device) -> None:
        dist = _dist()
        self.device = device
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.backend = dist.get_backend()
        if self.backend == "nccl" and device.type != "cuda":
            raise CommError(
                f"the process group uses NCCL but the executor runs on {device}: use a CUDA place"
            )
        self.timeout = timeout()
        self.seconds = 0.0  # time spent in collectives in the last run
        self.bytes = 0  # bytes all-reduced in the last run
        self._pending: list = []  # (work, what, tensor) of sends not yet known to be done
        self._sent_names: dict[int, str] = {}  # name hash -> var, for a peer's rejection

    def start_run(self) -> None:
        self.seconds = 0.0
        self.bytes = 0

    def all_reduce(
        self, xs: Sequence[torch.Tensor], reduce: str, what: str, ranks: Sequence[int] | None = None
    ) -> list[torch.Tensor]:
        """`xs` summed (``avg``: and divided by the world size) over every worker, as one
        fused buffer; returns new tensors (views of that buffer) of `xs`' shapes."""
        if reduce not in _REDUCTIONS:
            raise ValueError(f"AllReduce: reduce must be one of {_REDUCTIONS}, got {reduce!r}")
        flat = torch.cat([x.reshape(-1) for x in xs]) if len(xs) > 1 else xs[0].reshape(-1).clone()
        group = self.group(ranks)
        self._run(
            lambda dist: dist.all_reduce(flat, group=group, async_op=True), f"AllReduce of {what}", flat
        )
        if reduce == "avg":
            flat.div_(self.world_size if ranks is None else len(ranks))
        out, at = [], 0
        for x in xs:
            out.append(flat[at : at + x.numel()].view(x.shape))
            at += x.numel()
        return out

    # --- point to point (pipeline): a header, then the data ------------------------------
    def send(
        self, t: torch.Tensor, peer: int, var: str, expected: tuple[int | None, ...], where: str
    ) -> None:
        """Send `t` (var `var`) to `peer` asynchronously; a header with its name, shape and
        dtype goes first, so a mismatch is reported on both sides. Raises (after sending
        the header) if `t` is not of the `expected` shape (None: any size in that dim)."""
        header = _header(var, t.shape, t.dtype, self._p2p_device())
        self._sent_names[_hash(var)] = var
        self._isend(header, peer, f"Send of {var!r} to worker {peer} ({where})")
        if not _fits(tuple(t.shape), expected):
            raise PipelineCommError(
                f"{where}: Send of {var!r}: its shape is {list(t.shape)} but the program expects "
                f"{_fmt(expected)} (the receiving worker {peer} reports it too)"
            )
        data = t.to(self._p2p_device()).contiguous()
        self._isend(data, peer, f"Send of {var!r} to worker {peer} ({where})")

    def recv(
        self, peer: int, var: str, expected: tuple[int | None, ...], dtype: torch.dtype, where: str
    ) -> torch.Tensor:
        header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self._p2p_device())
        what = f"Recv of {var!r} from worker {peer} ({where})"
        self._run(lambda dist: dist.irecv(header, src=peer), what, header)
        name_hash, code, ndim, *dims = header.tolist()
        shape = tuple(dims[:ndim])
        if code == _REJECTED:
            rejected = self._sent_names.get(name_hash, "a var this worker sent")
            raise PipelineCommError(
                f"{where}: worker {peer} rejected {rejected!r}, which this worker sent: it expects shape "
                f"{_fmt(tuple(None if d < 0 else d for d in shape))} (see worker {peer}'s error)"
            )
        if name_hash != _hash(var):
            self._reject(peer, var, expected)
            raise PipelineCommError(
                f"{what}: worker {peer} sent another var (shape {list(shape)}): the two programs' "
                "send/recv orders disagree"
            )
        got_dtype = _DTYPES[code] if 0 <= code < len(_DTYPES) else None
        if got_dtype != dtype or not _fits(shape, expected):
            self._reject(peer, var, expected)
            raise PipelineCommError(
                f"{what}: worker {peer} sent shape {list(shape)} {got_dtype}, this program expects "
                f"{_fmt(expected)} {dtype}"
            )
        out = torch.empty(shape, dtype=dtype, device=self._p2p_device())
        self._run(lambda dist: dist.irecv(out, src=peer), what, out)
        return out if out.device == self.device else out.to(self.device)

    def _reject(self, peer: int, var: str, expected: tuple[int | None, ...]) -> None:
        """Tell `peer` its send of `var` is refused: the next header it reads from this
        worker says so (it is waiting for one: the grads or activations that follow), so
        both sides fail naming the var instead of the sender timing out elsewhere."""
        dims = [-1 if e is None else e for e in expected]
        header = torch.tensor(
            [_hash(var), _REJECTED, len(dims), *dims, *[0] * (_MAX_DIMS - len(dims))],
            dtype=torch.int64,
            device=self._p2p_device(),
        )
        try:
            _dist().isend(header, dst=peer).wait(datetime.timedelta(seconds=_REJECT_WAIT_S))
        except Exception:  # noqa: BLE001 - best effort: this worker is failing anyway
            pass

    def finish_sends(self) -> None:
        """Wait for every send still in flight (end of a pipeline step)."""
        pending, self._pending = self._pending, []
        for work, what, t in pending:
            self._wait(work, what, t)

    def _isend(self, t: torch.Tensor, peer: int, what: str) -> None:
        dist = _dist()
        self._pending.append((dist.isend(t, dst=peer), what, t))  # t held until the send is done

    def _p2p_device(self) -> torch.device:
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def group(self, ranks: Sequence[int] | None):
        """The process group of `ranks` (None: every worker). Groups are made on first use,
        which torch requires of every worker in the same order: pipelines create theirs
        together at their first run (`PipelineInfo.groups`)."""
        if ranks is None or len(ranks) == self.world_size:
            return None
        key = tuple(sorted(ranks))
        if key not in _GROUPS:
            _GROUPS[key] = _dist().new_group(list(key), timeout=self.timeout)
        return _GROUPS[key]

    def broadcast(self, t: torch.Tensor, src: int, what: str, ranks: Sequence[int] | None = None) -> None:
        """Overwrite `t` with worker `src`'s `t` (in place), among `ranks` (None: all)."""
        buf = t if self.backend != "nccl" else t.to(self.device)
        group = self.group(ranks)
        self._run(
            lambda dist: dist.broadcast(buf, src=src, group=group, async_op=True), f"broadcast of {what}", buf
        )
        if buf is not t:
            t.copy_(buf)

    def _run(self, start, what: str, t: torch.Tensor) -> None:
        self._wait(start(_dist()), what, t)

    def _wait(self, work, what: str, t: torch.Tensor) -> None:
        t0 = time.perf_counter()
        try:
            if self.backend == "nccl":
                # NCCL: a wait with a timeout blocks the host until the kernel is done; a
                # plain wait orders the compute stream after it, and the group's own timeout
                # (fleet.init gives it METAOPT_COMM_TIMEOUT) ends a hang in its watchdog.
                work.wait()
            else:
                work.wait(self.timeout)
        except Exception as e:  # gloo/NCCL raise RuntimeError subclasses with their own text
            raise CommError(_failure(what, self.rank, self.world_size, t0, self.timeout, e)) from e
        self.seconds += time.perf_counter() - t0
        self.bytes += t.numel() * t.element_size()
