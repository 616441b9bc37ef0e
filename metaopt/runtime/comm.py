"""Collectives over torch.distributed for the comm ops (AllReduce) and for data
parallel's start (broadcast of initial values): gloo on CPU, NCCL on CUDA.

Every collective waits with a timeout (``METAOPT_COMM_TIMEOUT`` seconds, default 300,
the same that ``fleet.init`` gives the process group), and a failure — a peer that died,
or never reached the same collective — becomes an error naming the op, this rank and
the timeout, never a hang.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Sequence

import torch

DEFAULT_TIMEOUT_S = 300.0
_REDUCTIONS = ("avg", "sum")


class CommError(RuntimeError):
    pass


def timeout() -> datetime.timedelta:
    raw = os.environ.get("METAOPT_COMM_TIMEOUT", "").strip()
    return datetime.timedelta(seconds=float(raw) if raw else DEFAULT_TIMEOUT_S)


def require_process_group() -> None:
    """Raise CommError unless torch.distributed's default group exists."""
    _dist()


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

    def start_run(self) -> None:
        self.seconds = 0.0
        self.bytes = 0

    def all_reduce(self, xs: Sequence[torch.Tensor], reduce: str, what: str) -> list[torch.Tensor]:
        """`xs` summed (``avg``: and divided by the world size) over every worker, as one
        fused buffer; returns new tensors (views of that buffer) of `xs`' shapes."""
        if reduce not in _REDUCTIONS:
            raise ValueError(f"AllReduce: reduce must be one of {_REDUCTIONS}, got {reduce!r}")
        flat = torch.cat([x.reshape(-1) for x in xs]) if len(xs) > 1 else xs[0].reshape(-1).clone()
        self._run(lambda dist: dist.all_reduce(flat, async_op=True), f"AllReduce of {what}", flat)
        if reduce == "avg":
            flat.div_(self.world_size)
        out, at = [], 0
        for x in xs:
            out.append(flat[at : at + x.numel()].view(x.shape))
            at += x.numel()
        return out

    def broadcast(self, t: torch.Tensor, src: int, what: str) -> None:
        """Overwrite `t` with worker `src`'s `t` (in place)."""
        buf = t if self.backend != "nccl" else t.to(self.device)
        self._run(lambda dist: dist.broadcast(buf, src=src, async_op=True), f"broadcast of {what}", buf)
        if buf is not t:
            t.copy_(buf)

    def _run(self, start, what: str, t: torch.Tensor) -> None:
        dist = _dist()
        t0 = time.perf_counter()
        try:
            work = start(dist)
            work.wait(self.timeout)
        except Exception as e:  # gloo/NCCL raise RuntimeError subclasses with their own text
            raise CommError(
                f"{what} failed on rank {self.rank} of {self.world_size} after "
                f"{time.perf_counter() - t0:.1f}s (timeout {self.timeout.total_seconds():g}s, "
                f"METAOPT_COMM_TIMEOUT): a peer died or did not reach this collective. Cause: "
                f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            ) from e
        self.seconds += time.perf_counter() - t0
        self.bytes += t.numel() * t.element_size()
