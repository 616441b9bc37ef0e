"""Collectives over torch.distributed for the comm ops (AllReduce, the startup Broadcast of
data parallel's initial values, the pipeline's Send/Recv): gloo on CPU, NCCL on CUDA.

Every collective waits with a timeout (``METAOPT_COMM_TIMEOUT`` seconds, default 300,
the same that ``fleet.init`` gives the process group), and a failure — a peer that died,
or never reached the same collective — becomes an error naming the op, this rank and
the timeout, never a hang.

Pipeline point to point (`Communicator.send` / `recv`) is a protocol, because shapes
and dtypes are static and a header per message costs a round trip and a host read:

- A step begins with a handshake (`start_pipeline_step`): each worker sends each
  neighbour its step signature, the micro-batch dims (every worker is fed the whole batch,
  so it knows them) and the check switch, and reads the neighbour's at its first message
  with it (sent before the step's first compute, so it is normally there already).
- An edge (peer, var, direction) sends a header (name hash, dtype, shape; the receiver
  checks it against the program's shape with the micro-batch dim bound, and refuses a
  mismatch on both sides, naming stage, micro-batch, var and both shapes) the first time
  it is used and whenever its expected shape changes (a smaller last batch of an epoch):
  both sides see the same change, so both expect the header.
- After that the data goes alone, into a receive buffer of the known shape: no header,
  no host read. Its tag is made from the var, shape and dtype, so a message the receiver
  did not expect can never land in its buffer (gloo would fill a larger buffer partly
  without a word, or abort the process on a smaller one): it waits and times out naming
  the var instead. On gloo the receive of an edge's next message of the step is posted
  as soon as this one arrived, so the data is written while the worker computes; NCCL
  (which pairs messages by order, not tag) receives each in turn.
- Receive buffers are reused within a step once nothing references them (the executor
  frees a var after its last use); one still held, such as an activation kept for the
  backward, is never overwritten: the next message gets a fresh buffer. The executor's
  memory accounting counts a buffer from its receive on; one posted ahead (one per edge)
  is not counted until then, and none is kept between steps.
- Where the two signatures differ (feeds of different batch sizes, or the switch on
  one side only), every message of the step with that neighbour carries its header, so
  the first one names the mismatch on both sides. A dim the batch does not give (None)
  also keeps the header on every message.
- ``METAOPT_PIPELINE_CHECK=1`` (the debug switch) keeps the header on every message.

Headers (and a refusal, sent back in a header's place) travel on one tag per link, in
send order: every schedule keeps each link first-in first-out (`schedules.simulate`
checks it), so headers meet in order. A step that failed leaves messages in flight:
the job must be restarted.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from metaopt.layout.groups import (  # noqa: F401 - CommError and DEFAULT_TIMEOUT_S: this module's API too
    DEFAULT_TIMEOUT_S,
    CommError,
    await_release,
    failure_message,
    group_of,
    host_group,
    initialized_dist,
    references,
    timeout,
)

logger = logging.getLogger("metaopt.runtime")

_REDUCTIONS = ("avg", "sum")


class PipelineCommError(CommError):
    """A pipeline send/recv whose two sides disagree (shape, dtype, var)."""


_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool)
_MAX_DIMS = 8
_REJECTED = -1  # the dtype code of a header refusing the peer's last send
_REJECT_WAIT_S = 10.0
_HEADER_LEN = 3 + _MAX_DIMS  # name hash, dtype code, ndim, dims
CHECK_ENV = "METAOPT_PIPELINE_CHECK"
_HEADER_TAG = 0  # headers and refusals: one first-in first-out stream per link
_SIGNATURE_TAG = 2  # step signatures; data tags are odd (`_data_tag`)
_SIG_LEN = 3 + _MAX_DIMS  # check switch, names' hash, number of dims, dims


def check_every_message() -> bool:
    """Whether ``METAOPT_PIPELINE_CHECK`` asks for a header before every pipeline message."""
    return os.environ.get(CHECK_ENV, "").strip() not in ("", "0")


def _signature(check_all: bool, dims: Mapping[str, int]) -> list[int]:
    names = sorted(dims)
    if len(names) > _MAX_DIMS:
        raise PipelineCommError(f"a pipeline step binds {len(names)} dims, at most {_MAX_DIMS} are supported")
    values = [int(dims[n]) for n in names]
    return [int(check_all), _hash(",".join(names)), len(names), *values, *[0] * (_MAX_DIMS - len(names))]


def _dims_text(signature: list[int], names: list[str]) -> str:
    """A signature as "batch=4" (the names are this worker's: the hash says they match)."""
    values = signature[3 : 3 + signature[2]]
    if signature[1] != _hash(",".join(names)) or len(names) != len(values):
        return f"dims {values}"
    return ", ".join(f"{n}={v}" for n, v in zip(names, values, strict=True))


def _data_tag(var: str, shape: tuple[int, ...], dtype: torch.dtype) -> int:
    # odd (control tags are even), and different for another var, shape or dtype: a message
    # the receiver does not expect waits for the timeout instead of filling its buffer
    return (zlib.crc32(f"{var}|{list(shape)}|{dtype}".encode()) & 0x3FFFFFFF) * 2 + 1


_use_count = getattr(torch._C, "_storage_Use_Count", None)


_POOL = 3  # receive buffers kept per edge: 1F1B needs two (one in use, one posted into)


def _counts(t: torch.Tensor) -> tuple[int, int]:
    """(Python references to `t`, tensors sharing its storage), including this call's own
    references: compare only with `_FREE`, measured by the same loop `_free_buffer` runs."""
    return sys.getrefcount(t), _use_count(t.untyped_storage()._cdata) if _use_count is not None else -1


def _calibrate() -> tuple[int, int] | None:
    # a buffer held by a pool list and the loop's variable, as in `_free_buffer`, and by
    # nothing else: measured, so interpreter differences cannot make a held buffer look free
    if _use_count is None:
        return None  # never reuse a buffer
    for buf in [torch.empty(1)]:
        return _counts(buf)
    return None


_FREE = _calibrate()


def _free_buffer(pool: list[torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """A buffer of `pool` of this shape and dtype that nothing outside the pool references."""
    for buf in pool:
        if buf.shape == shape and buf.dtype == dtype and _counts(buf) == _FREE:
            return buf
    return None


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


@dataclass
class _InFlight:
    """A collective left in flight: what it is (for errors), the tensors it holds (each a tensor
    of its own over its buffer's storage: the results are views of the buffer, and a view holds a
    reference to its base's Python object, so gloo's hold is counted apart), the group's size,
    and what `finish` does after the wait: divide ``sent[divide]`` by `n`, or cast ``sent[0]``
    into `into` (fp16_allreduce's wide result)."""

    what: str
    sent: list[torch.Tensor]
    n: int
    divide: int | None = None
    into: torch.Tensor | None = None
    work: object = None
    references: list[int] | None = None


def _land(row: torch.Tensor, dests: Sequence[torch.Tensor], lengths: Sequence[int]) -> None:
    """`row` (runs of `lengths`, one after another) copied into `dests`, each taking the first
    ``numel()`` elements of its run."""
    at = 0
    for d, n in zip(dests, lengths, strict=True):
        d.copy_(row[at : at + d.numel()].view(d.shape))
        at += n


def _views(flat: torch.Tensor, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """`flat`'s consecutive runs in `xs`' shapes."""
    out, at = [], 0
    for x in xs:
        out.append(flat[at : at + x.numel()].view(x.shape))
        at += x.numel()
    return out


class Communicator:
    """The default process group, seen by the executor's comm ops."""

    def __init__(self, device: torch.device) -> None:
        dist = initialized_dist()
        self.device = device
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.backend = dist.get_backend()
        if self.backend == "nccl" and device.type != "cuda":
            raise CommError(
                f"the process group uses NCCL but the executor runs on {device}: use a CUDA place"
            )
        self.timeout = timeout()
        self.seconds = 0.0  # time the last run waited for collectives (an overlapped one: at its wait)
        self.bytes = 0  # bytes all-reduced in the last run
        self.all_to_all_bytes = 0  # bytes the last run's all-to-alls sent to other workers
        self.messages = 0  # pipeline messages sent and received in the last run
        self.headers = 0  # of them with a header
        self._pending: list = []  # (work, what, tensor) of sends not yet known to be done
        self._sent_names: dict[int, str] = {}  # name hash -> var, for a peer's rejection
        # pipeline P2P: the (expected shape, dtype) each edge (peer, var, "send"/"recv") last
        # verified with a header; this step's signature, the peers' (pending, then read), and
        # whether each peer's equals this worker's; the receive buffers by (peer, var)
        self._verified: dict[tuple[int, str, str], tuple[tuple[int, ...], torch.dtype]] = {}
        self._check_all = True
        self._signature: list[int] = []
        self._dim_names: list[str] = []
        self._signatures: dict[int, tuple[object, torch.Tensor]] = {}
        self._peer_signature: dict[int, list[int]] = {}
        self._agreed: dict[int, bool] = {}
        self._buffers: dict[tuple[int, str], list[torch.Tensor]] = {}
        self._per_step = 0  # messages per edge in a pipeline step (one per micro-batch)
        self._received: dict[tuple[int, str], int] = {}  # this step's, per (peer, var)
        self._posted: dict[tuple[int, str], tuple[object, torch.Tensor, int]] = {}  # work, buffer, tag
        self._in_flight: dict[int, _InFlight] = {}  # collectives left in flight, by their results' storage

    def start_run(self) -> None:
        if self._in_flight:  # the executor abandons them when a run raises; anything else left
            self.abandon()
        self.seconds = 0.0
        self.bytes = 0
        self.all_to_all_bytes = 0
        self.messages = 0
        self.headers = 0

    def all_reduce(
        self,
        xs: Sequence[torch.Tensor],
        reduce: str,
        what: str,
        ranks: Sequence[int] | None = None,
        comm_dtype: torch.dtype | None = None,
        overlap: bool = False,
    ) -> list[torch.Tensor]:
        """`xs` summed (``avg``: and divided by the world size) over every worker, as one
        fused buffer; returns new tensors (views of that buffer) of `xs`' shapes.

        `comm_dtype` (Fleet's fp16_allreduce): the buffer travels in that dtype, half the bytes
        of float32; ``avg`` then divides before the cast (torch's fp16 compress hook: the sum of
        the scaled values stays in the narrow type's range) and the result is cast back.

        `overlap`: returns as soon as the collective is started; the tensors returned hold their
        values only after `finish` of them (the CommWait op before their first
        reader), so the ops in between run while the workers exchange the bucket."""
        if reduce not in _REDUCTIONS:
            raise ValueError(f"AllReduce: reduce must be one of {_REDUCTIONS}, got {reduce!r}")
        flat = torch.cat([x.reshape(-1) for x in xs]) if len(xs) > 1 else xs[0].reshape(-1).clone()
        n = self.world_size if ranks is None else len(ranks)
        wide = None
        if comm_dtype is not None and comm_dtype != flat.dtype:
            wide = flat.dtype
            flat = (flat.div_(n) if reduce == "avg" else flat).to(comm_dtype)
        group = self.group(ranks)
        what = f"AllReduce of {what}"
        if not overlap:
            self._run(lambda dist: dist.all_reduce(flat, group=group, async_op=True), what, [flat])
            if wide is not None:
                flat = flat.to(wide)
            elif reduce == "avg":
                flat.div_(n)
            return _views(flat, xs)
        # What travels is a tensor of its own over `flat`'s storage (`_InFlight.sent`)
        into = None if wide is None else torch.empty(flat.shape, dtype=wide, device=flat.device)
        flight = _InFlight(what, [flat.detach()], n, divide=0 if reduce == "avg" and wide is None else None)
        flight.into = into
        self._start(flight, lambda dist, sent: dist.all_reduce(sent[0], group=group, async_op=True))
        out = flat if into is None else into
        self._in_flight[out.untyped_storage().data_ptr()] = flight
        return _views(out, xs)

    def finish(self, outs: Sequence[torch.Tensor], what: str) -> None:
        """Wait for the collective left in flight whose results `outs` are (``overlap``)."""
        flight = self._in_flight.pop(outs[0].untyped_storage().data_ptr(), None) if outs else None
        if flight is None:
            raise CommError(f"{what}: no collective making these values is in flight")
        if flight.work is None:
            return  # a group of one (`done_without_comm`)
        work, flight.work = flight.work, None  # the work holds the buffers too: let go before the count
        self._wait(work, flight.what, flight.sent[0])
        del work
        if flight.references is not None:
            await_release(flight.sent, flight.references)
        if flight.into is not None:
            flight.into.copy_(flight.sent[0])  # the narrow type's values, exactly, in the wide one
        elif flight.divide is not None:
            flight.sent[flight.divide].div_(flight.n)

    @property
    def in_flight(self) -> int:
        """How many collectives are left in flight (``overlap``), waiting for their CommWait."""
        return len(self._in_flight)

    def abandon(self) -> None:
        """A run raised between collectives' starts and their waits: wait for each left in
        flight (the peers start it too, or it fails within the timeout), so that gloo's thread
        lets go of its buffers before the process may exit (its abort otherwise:
        layout/groups.py), then forget them. Errors here would hide the run's own: ignored."""
        flights, self._in_flight = list(self._in_flight.values()), {}
        for f in flights:
            if f.work is None:
                continue
            work, f.work = f.work, None
            try:
                if self.backend == "gloo":
                    work.wait(self.timeout)
                else:
                    work.wait()
            except Exception:  # noqa: BLE001 - the run's own error is the one to see
                pass
            del work
            if f.references is not None:
                await_release(f.sent, f.references)
        if flights:
            logger.warning("a run raised with %d collective(s) in flight: waited for them", len(flights))

    def done_without_comm(self, outs: Sequence[torch.Tensor]) -> None:
        """`outs` (an overlapped collective's, over a group of one) are final already: their
        CommWait has nothing to wait for."""
        self._in_flight[outs[0].untyped_storage().data_ptr()] = _InFlight("", [], 1)

    def _start(self, flight: _InFlight, start) -> None:
        """Start `flight`'s collective (`start(dist, flight.sent)` returns its work). On gloo,
        the references its tensors have now are what `finish` waits to see again: the flight's
        list is their one holder, here as at the wait."""
        if self.backend == "gloo":
            flight.references = references(flight.sent)
        flight.work = start(initialized_dist(), flight.sent)

    def reduce_scatter(
        self,
        flat: torch.Tensor,
        reduce: str,
        what: str,
        ranks: Sequence[int] | None = None,
        overlap: bool = False,
    ) -> torch.Tensor:
        """`flat` (equal chunks, one per worker of `ranks`, None: all) summed (``avg``: and
        divided by the group's size) over the group; returns this worker's chunk (new storage).
        `overlap`: as `all_reduce`'s; the caller holds `flat` until the wait (it is sent from)."""
        if reduce not in _REDUCTIONS:
            raise ValueError(f"ReduceScatter: reduce must be one of {_REDUCTIONS}, got {reduce!r}")
        n = self.world_size if ranks is None else len(ranks)
        buf = (flat if self.backend != "nccl" else flat.to(self.device)).contiguous()
        out = torch.empty(buf.numel() // n, dtype=buf.dtype, device=buf.device)
        group = self.group(ranks)
        if overlap:
            if buf.data_ptr() != flat.data_ptr():
                raise CommError(f"ReduceScatter of {what}: left in flight, it must send from its own rows")
            divide = 1 if reduce == "avg" else None
            flight = _InFlight(f"ReduceScatter of {what}", [buf.detach(), out.detach()], n, divide=divide)
            self._start(
                flight,
                lambda dist, sent: dist.reduce_scatter_single(sent[1], sent[0], group=group, async_op=True),
            )
            self._in_flight[out.untyped_storage().data_ptr()] = flight
            return out
        self._run(
            lambda dist: dist.reduce_scatter_single(out, buf, group=group, async_op=True),
            f"ReduceScatter of {what}",
            [buf, out],
        )
        if reduce == "avg":
            out.div_(n)
        return out if out.device == self.device else out.to(self.device)

    def reduce_scatter_rows(
        self,
        row: Callable[[int], torch.Tensor],
        reduce: str,
        what: str,
        ranks: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """`reduce_scatter` of the buffer whose row j (what member j of `ranks`, None: all,
        keeps) `row(j)` makes, as new storage the caller gives up: this worker's row summed
        (``avg``: divided by the group's size) over the group.

        On gloo the rows are made and reduced one at a time, each to its member: gloo's
        reduce-scatter stages another copy of the whole buffer while it runs (measured on
        torch 2.13: 403 MB above the start for a 256 MB buffer over 2 workers), and the whole
        buffer itself is one more copy of every grad it carries. Elsewhere the rows are stacked
        and reduce-scattered at once."""
        if reduce not in _REDUCTIONS:
            raise ValueError(f"ReduceScatter: reduce must be one of {_REDUCTIONS}, got {reduce!r}")
        members = list(ranks) if ranks is not None else list(range(self.world_size))
        if self.backend != "gloo":
            return self.reduce_scatter(
                torch.stack([row(j) for j in range(len(members))]).view(-1), reduce, what, ranks
            )
        group = self.group(ranks)
        mine = None
        for j, dst in enumerate(members):
            buf = row(j)  # a reduce leaves partial sums in the senders' buffers: each row is its own
            self._run(
                lambda dist, buf=buf, dst=dst: dist.reduce(buf, dst=dst, group=group, async_op=True),
                f"ReduceScatter of {what} (worker {dst}'s part)",
                [buf],
            )
            if dst == self.rank:
                mine = buf
            del buf  # before the next row is made: one row at a time beside this worker's
        if reduce == "avg":
            mine.div_(len(members))
        return mine

    # --- point to point (pipeline) ----------------------------------------------------------
    # The protocol (see the module docstring): a step starts with each neighbour's dims
    # signature; an edge (peer, var, direction) exchanges a header the first time it is used
    # and whenever its expected shape changes, and otherwise sends the data alone.
    def start_pipeline_step(self, peers: Sequence[int], dims: Mapping[str, int], micro_batches: int) -> None:
        """Begin a pipeline step with the neighbouring workers `peers` (ranks): send each this
        step's micro-batch `dims` and the check switch, and post the receive of theirs (read
        at the first message with that peer, so the exchange overlaps the first compute).
        Each edge carries one message per micro-batch (`micro_batches` in the step)."""
        if self._posted:  # each edge's m-th message posts nothing: only a failed step leaves some
            left = sorted(self._posted)
            raise CommError(f"receives posted in the last step were never used ({left}): did it fail?")
        self._per_step = micro_batches
        self._received.clear()
        self._check_all = check_every_message()
        self._signature = _signature(self._check_all, dims)
        self._dim_names = sorted(dims)
        self._agreed.clear()
        dist = initialized_dist()
        group = host_group(dist)  # host ints: gloo even in a NCCL job
        for peer in peers:
            mine = torch.tensor(self._signature, dtype=torch.int64)
            theirs = torch.empty(_SIG_LEN, dtype=torch.int64)
            what = f"the step handshake with worker {peer}"
            self._pending.append((dist.isend(mine, dst=peer, group=group, tag=_SIGNATURE_TAG), what, mine))
            work = dist.irecv(theirs, src=peer, group=group, tag=_SIGNATURE_TAG)
            self._signatures[peer] = (work, theirs)

    def send(
        self, t: torch.Tensor, peer: int, var: str, expected: tuple[int | None, ...], where: str
    ) -> None:
        """Send `t` (var `var`) to `peer` asynchronously (done by `finish_sends`). A verified
        edge sends the data alone; otherwise a header with its name, shape and dtype goes
        first, so a mismatch is reported on both sides. Raises (after sending the header) if
        `t` is not of the `expected` shape (None: any size in that dim)."""
        what = f"Send of {var!r} to worker {peer} ({where})"
        self.messages += 1
        if self._needs_header(peer, var, "send", expected, where):
            self.headers += 1
            self._send_header(t, peer, var, expected, where, what)
        else:
            self._check_steady(t, peer, var, expected, where)
        data = t.to(self._p2p_device()).contiguous()
        self._isend(data, peer, what, _data_tag(var, tuple(t.shape), t.dtype))

    def recv(
        self, peer: int, var: str, expected: tuple[int | None, ...], dtype: torch.dtype, where: str
    ) -> torch.Tensor:
        """Var `var` as `peer` sent it, checked against the `expected` shape and `dtype`: by
        its header on a new edge, by the step's handshake on a verified one (no header, no
        host read: the data lands in a buffer of the expected shape)."""
        what = f"Recv of {var!r} from worker {peer} ({where})"
        self.messages += 1
        if self._needs_header(peer, var, "recv", expected, where):
            self.headers += 1
            shape = self._recv_header(peer, var, expected, dtype, what, where)
            if None not in expected:
                self._verified[(peer, var, "recv")] = (expected, dtype)
        else:
            shape = expected  # type: ignore[assignment]  # verified: no None in it
        tag = _data_tag(var, shape, dtype)
        work, out = self._posted_recv(peer, var, tag)
        if work is None:
            out = self._recv_buffer(peer, var, shape, dtype)
            work = initialized_dist().irecv(out, src=peer, tag=tag)
        self._wait(work, what, out)
        self._post_next(peer, var, expected, dtype, tag)
        return out if out.device == self.device else out.to(self.device)

    def _posted_recv(self, peer: int, var: str, tag: int) -> tuple[object, torch.Tensor | None]:
        """The receive of this message posted ahead (`_post_next`), or (None, None)."""
        posted = self._posted.pop((peer, var), None)
        if posted is None:
            return None, None
        work, buf, posted_tag = posted
        if posted_tag != tag:  # both are derived from the same step state: a bug if they differ
            raise CommError(f"internal: a receive of {var!r} was posted for another shape or dtype")
        return work, buf

    def _post_next(
        self, peer: int, var: str, expected: tuple[int | None, ...], dtype: torch.dtype, tag: int
    ) -> None:
        """Post the receive of the edge's next message of this step now, if it will come
        without a header (same step: same shape, tag and buffer size): gloo then writes it
        into its buffer as soon as it is sent, while this worker computes, instead of waiting
        for this worker to ask (a round trip) when it needs it."""
        key = (peer, var)
        self._received[key] = n = self._received.get(key, 0) + 1
        steady = not self._check_all and self._agreed.get(peer, False)
        if n >= self._per_step or not steady or self._verified.get((*key, "recv")) != (expected, dtype):
            return
        if self.backend == "nccl":  # NCCL pairs messages by order, not tag: no receive out of turn
            return
        buf = self._recv_buffer(peer, var, expected, dtype)  # type: ignore[arg-type]  # verified: no None
        self._posted[key] = (initialized_dist().irecv(buf, src=peer, tag=tag), buf, tag)

    def _needs_header(
        self, peer: int, var: str, direction: str, expected: tuple[int | None, ...], where: str
    ) -> bool:
        """Whether this message carries a header. Both sides decide alike from what both
        know: the agreed step signature, the program's expected shape, the edge's history."""
        agreed = self._agrees(peer, where)
        if self._check_all or not agreed or None in expected:
            return True
        return self._verified.get((peer, var, direction), (None,))[0] != expected

    def _agrees(self, peer: int, where: str) -> bool:
        """Whether `peer` runs this step with this worker's dims and switch (waits, once
        per step, for its signature; False outside a step started by `start_pipeline_step`)."""
        pending = self._signatures.pop(peer, None)
        if pending is not None:
            work, theirs = pending
            self._wait(work, f"the step handshake with worker {peer} ({where})", theirs)
            self._peer_signature[peer] = theirs.tolist()
            self._agreed[peer] = self._peer_signature[peer] == self._signature
        return self._agreed.get(peer, False)

    def _send_header(
        self, t: torch.Tensor, peer: int, var: str, expected: tuple[int | None, ...], where: str, what: str
    ) -> None:
        header = _header(var, t.shape, t.dtype, self._p2p_device())
        self._sent_names[_hash(var)] = var
        self._isend(header, peer, what, _HEADER_TAG)
        if not _fits(tuple(t.shape), expected):
            raise PipelineCommError(
                f"{where}: Send of {var!r}: its shape is {list(t.shape)} but the program expects "
                f"{_fmt(expected)} (the receiving worker {peer} reports it too){self._feeds_note(peer)}"
            )
        if None not in expected:
            self._verified[(peer, var, "send")] = (expected, t.dtype)

    def _check_steady(
        self, t: torch.Tensor, peer: int, var: str, expected: tuple[int | None, ...], where: str
    ) -> None:
        """A data-only send must be what the receiver's buffer expects: the verified shape
        and dtype (from the program, so a failure here is a kernel's bug; the receiver then
        waits for data that never comes and times out naming the var)."""
        _, dtype = self._verified[(peer, var, "send")]
        if tuple(t.shape) != expected or t.dtype != dtype:
            raise PipelineCommError(
                f"{where}: Send of {var!r}: it is {list(t.shape)} {t.dtype} but the program expects "
                f"{_fmt(expected)} {dtype}, verified with worker {peer}; nothing was sent"
            )

    def _recv_header(
        self, peer: int, var: str, expected: tuple[int | None, ...], dtype: torch.dtype, what: str, where: str
    ) -> tuple[int, ...]:
        """Read and check `peer`'s header for `var`; the shape it announces."""
        header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self._p2p_device())
        self._wait(initialized_dist().irecv(header, src=peer, tag=_HEADER_TAG), what, header)
        name_hash, code, ndim, *dims = header.tolist()
        shape = tuple(dims[:ndim])
        if code == _REJECTED:
            rejected = self._sent_names.get(name_hash, "a var this worker sent")
            raise PipelineCommError(
                f"{where}: worker {peer} rejected {rejected!r}, which this worker sent: it expects shape "
                f"{_fmt(tuple(None if d < 0 else d for d in shape))} (see worker {peer}'s error)"
                f"{self._feeds_note(peer)}"
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
                f"{_fmt(expected)} {dtype}{self._feeds_note(peer)}"
            )
        return shape

    def _feeds_note(self, peer: int) -> str:
        """Why the two sides disagree, when the step's signatures already say so."""
        theirs = self._peer_signature.get(peer)
        if theirs is None or self._agreed.get(peer, True):
            return ""
        mine, names = self._signature, self._dim_names
        if theirs[0] != mine[0]:
            return f"; {CHECK_ENV} is {mine[0]} on this worker, {theirs[0]} on worker {peer}"
        return (
            f"; this step's micro-batches differ: {_dims_text(mine, names)} on this worker, "
            f"{_dims_text(theirs, names)} on worker {peer} (feed the same whole batch to every worker)"
        )

    def _recv_buffer(self, peer: int, var: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A buffer for `var`'s data: one of the edge's last few that nothing references any
        more (the executor dropped it after its last use), else a fresh one. A buffer still
        held (an activation kept for the backward, one a receive is posted into) is never
        overwritten; an edge keeps at most `_POOL` buffers."""
        pool = self._buffers.setdefault((peer, var), [])
        buf = _free_buffer(pool, shape, dtype)
        if buf is None:
            buf = torch.empty(shape, dtype=dtype, device=self._p2p_device())
            pool.append(buf)
            del pool[:-_POOL]
        return buf

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
            sent = initialized_dist().isend(header, dst=peer, tag=_HEADER_TAG)
            sent.wait(datetime.timedelta(seconds=_REJECT_WAIT_S))
        except Exception:  # noqa: BLE001 - best effort: this worker is failing anyway
            pass

    def finish_sends(self) -> None:
        """Wait for every send still in flight, and every step signature not read yet (end
        of a pipeline step: nothing of it is left pending)."""
        for peer in list(self._signatures):
            self._agrees(peer, "end of the step")
        self._buffers.clear()  # between steps the communicator holds no receive buffer
        pending, self._pending = self._pending, []
        for work, what, t in pending:
            self._wait(work, what, t)

    def _isend(self, t: torch.Tensor, peer: int, what: str, tag: int) -> None:
        dist = initialized_dist()
        self._pending.append((dist.isend(t, dst=peer, tag=tag), what, t))  # t held until the send is done

    def _p2p_device(self) -> torch.device:
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def group(self, ranks: Sequence[int] | None):
        """The process group of `ranks` (None: every worker): one fleet.init made for a hybrid
        axis (`register_topology_group`), else made on first use, which torch requires of every
        worker in the same order: pipelines create theirs together at their first run
        (`PipelineInfo.groups`)."""
        if ranks is None or len(ranks) == self.world_size:
            return None
        return group_of(ranks, self.timeout)

    def broadcast(self, t: torch.Tensor, src: int, what: str, ranks: Sequence[int] | None = None) -> None:
        """Overwrite `t` with worker `src`'s `t` (in place), among `ranks` (None: all)."""
        buf = t if self.backend != "nccl" else t.to(self.device)
        group = self.group(ranks)
        self._run(
            lambda dist: dist.broadcast(buf, src=src, group=group, async_op=True),
            f"broadcast of {what}",
            [buf],
        )
        if buf is not t:
            t.copy_(buf)

    def all_gather(
        self, t: torch.Tensor, what: str, ranks: Sequence[int] | None = None
    ) -> list[torch.Tensor]:
        """Every worker's `t` among `ranks` (None: all), in ascending rank order (this
        worker's included): new tensors of `t`'s shape on this executor's device. Every worker
        of the group must call it with a tensor of the same shape and dtype (recompute
        partition's slices are). Waits at most the timeout, then a `CommError` naming `what`."""
        buf = (t if self.backend != "nccl" else t.to(self.device)).contiguous()
        n = self.world_size if ranks is None else len(ranks)
        outs = [torch.empty_like(buf) for _ in range(n)]
        if self.backend == "gloo":
            self.all_gather_pieces([buf.view(-1)], [[o.view(-1)] for o in outs], what, ranks)
            return outs
        group = self.group(ranks)
        self._run(
            lambda dist: dist.all_gather(outs, buf, group=group, async_op=True),
            f"all-gather of {what}",
            [buf, *outs],
        )
        return outs if outs[0].device == self.device else [o.to(self.device) for o in outs]

    def all_gather_pieces(
        self,
        mine: Sequence[torch.Tensor],
        dests: Sequence[Sequence[torch.Tensor]],
        what: str,
        ranks: Sequence[int] | None = None,
    ) -> None:
        """Every worker's `mine` (1-D tensors of the same lengths on every worker of `ranks`,
        None: all) written where the caller wants it: member j's ``mine[i]`` lands in
        ``dests[j][i]``, which takes its first ``dests[j][i].numel()`` elements (a destination
        may be shorter: ZeRO's last chunks carry padding the whole tensor drops).

        On gloo this is one broadcast per member, straight into the destination where one
        tensor of full length is gathered, else through one staging row: gloo's all-gather
        holds a second copy of the whole result while it runs (measured on torch 2.13: 1076 MB
        above the start to gather 2 x 256 MB), which at ZeRO-3 is a second gathered layer in
        every worker's host memory. Elsewhere one all-gather of the rows, then copies."""
        members = list(ranks) if ranks is not None else list(range(self.world_size))
        if len(dests) != len(members) or any(len(d) != len(mine) for d in dests):
            raise CommError(
                f"all-gather of {what}: destinations for {len(dests)} workers, the group has {len(members)}"
            )
        lengths = [m.numel() for m in mine]
        if self.backend != "gloo":
            flat = torch.cat([m.reshape(-1) for m in mine]) if len(mine) > 1 else mine[0].reshape(-1)
            rows = self.all_gather(flat, what, ranks)
            for row, dest in zip(rows, dests, strict=True):
                _land(row, dest, lengths)
            return
        group = self.group(ranks)
        stage = None
        for src, dest in zip(members, dests, strict=True):
            direct = len(mine) == 1 and dest[0].numel() == lengths[0] and dest[0].is_contiguous()
            if direct:
                buf = dest[0]
            else:
                if stage is None:
                    stage = torch.empty(sum(lengths), dtype=mine[0].dtype, device=mine[0].device)
                buf = stage
            if src == self.rank:
                torch.cat([m.reshape(-1) for m in mine], out=buf) if len(mine) > 1 else buf.copy_(mine[0])
            self._run(
                lambda dist, buf=buf, src=src: dist.broadcast(buf, src=src, group=group, async_op=True),
                f"all-gather of {what} (worker {src}'s part)",
                [buf],
                sent=src == self.rank,
            )
            if not direct:
                _land(buf, dest, lengths)

    def all_to_all(
        self,
        t: torch.Tensor,
        send: Sequence[int],
        recv: Sequence[int],
        what: str,
        ranks: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Rows of `t` sent by dim 0 to each worker of `ranks` (None: all) in group order:
        `send[j]` rows to the j-th, and `recv[j]` rows from it (what it sends this worker); returns
        the received rows, in group order, on this executor's device (new storage). The counts
        must agree pairwise (an expert-parallel layout exchanges them first): a worker expecting
        more rows than its peer sends waits, at most the timeout, then a `CommError` naming `what`."""
        n = self.world_size if ranks is None else len(ranks)
        if len(send) != n or len(recv) != n or sum(send) != t.shape[0]:
            raise CommError(
                f"all-to-all of {what}: {len(send)} send and {len(recv)} recv counts for a group of {n}, "
                f"sending {sum(send)} of {t.shape[0]} rows"
            )
        buf = (t if self.backend != "nccl" else t.to(self.device)).contiguous()
        out = torch.empty((sum(recv), *buf.shape[1:]), dtype=buf.dtype, device=buf.device)
        group = self.group(ranks)
        self._run(
            lambda dist: dist.all_to_all_single(
                out,
                buf,
                output_split_sizes=list(recv),
                input_split_sizes=list(send),
                group=group,
                async_op=True,
            ),
            f"all-to-all of {what}",
            [buf, out],
        )
        me = (list(ranks) if ranks is not None else list(range(self.world_size))).index(self.rank)
        row = buf[0].numel() * buf.element_size() if buf.shape[0] else 0
        self.all_to_all_bytes += (sum(send) - send[me]) * row  # what travels: rows kept here do not
        return out if out.device == self.device else out.to(self.device)

    def _run(self, start, what: str, tensors: list[torch.Tensor], sent: bool = True) -> None:
        """A collective on `tensors` (the first: what this worker sends); on gloo, returns
        once gloo's thread has let go of them (`await_release`: else a process ending right
        after it can abort at exit)."""
        before = references(tensors) if self.backend == "gloo" else None
        self._wait(start(initialized_dist()), what, tensors[0], sent)
        if before is not None:
            await_release(tensors, before)

    def _wait(self, work, what: str, t: torch.Tensor, sent: bool = True) -> None:
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
            raise CommError(failure_message(what, self.rank, self.world_size, t0, self.timeout, e)) from e
        self.seconds += time.perf_counter() - t0
        if sent:  # a broadcast's receivers send nothing
            self.bytes += t.numel() * t.element_size()
