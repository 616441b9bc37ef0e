"""Device <-> host copies for offload (the Memcpy and CopyWait rows call into this).

On CUDA (what DESIGN.md's Executor section asks for):

* a device->host copy runs on a dedicated ``d2h`` stream, after the compute stream has
  produced the tensor (``wait_stream``), into a pinned host buffer owned by the engine
  and reused every step (keyed by the offloaded var's name, grown when a larger batch
  needs more), so no step allocates pinned memory once the first has run;
  ``record_stream`` keeps the device tensor's block from being reused until the copy is
  done, so the program may free it right after the Memcpy op;
* a host->device prefetch runs on a second ``h2d`` stream, after that buffer's
  offload copy finished (an event) and after the compute stream reached the prefetch
  (its output block may have been freed by compute just before);
* ``CopyWait`` makes the compute stream wait on the prefetch's event — a device-side
  wait, the host is never blocked.

Per run the engine reports the copies' own time (CUDA events on the copy streams) and
how long the compute stream stalled at CopyWaits (events around the wait). On CPU the
copies are plain clones timed with ``perf_counter`` and nothing ever waits.
"""

from __future__ import annotations

import time

import torch

from metaopt.ops.kernels.nn import is_channels_last


class CopyEngine:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._buffers: dict[object, torch.Tensor] = {}  # var (, micro-batch) -> flat pinned buffer
        self._offloaded: dict[int, torch.cuda.Event] = {}  # pinned storage ptr -> copy done
        self._fetched: dict[int, torch.cuda.Event] = {}  # device storage ptr -> prefetch done
        self._copy_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._wait_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._copy_s = 0.0
        self.offloaded_bytes = 0  # copied to host memory since start_run
        self.fetched_bytes = 0  # copied back to the device since start_run
        if self.cuda:
            self.d2h = torch.cuda.Stream(device)
            self.h2d = torch.cuda.Stream(device)

    # --- per run ----------------------------------------------------------------
    def start_run(self) -> None:
        """Reset the counters (once per executor run, or per pipeline step). The events of
        copies in flight are kept: a pipeline's backward part waits on its forward's."""
        self._copy_s = 0.0
        self.offloaded_bytes = self.fetched_bytes = 0
        self._copy_events.clear()
        self._wait_events.clear()

    def seconds(self) -> tuple[float, float]:
        """(time the last run's copies took, time compute waited on them), in seconds."""
        if not self.cuda:
            return self._copy_s, 0.0
        torch.cuda.synchronize(self.device)  # events must have completed to be read
        copy = sum(a.elapsed_time(b) for a, b in self._copy_events) / 1e3
        wait = sum(a.elapsed_time(b) for a, b in self._wait_events) / 1e3
        return copy, wait

    @property
    def pinned_bytes(self) -> int:
        """Pinned host memory the engine holds for reuse (CUDA; 0 on CPU)."""
        return sum(b.untyped_storage().nbytes() for b in self._buffers.values())

    # --- the ops ----------------------------------------------------------------
    def to_host(self, x: torch.Tensor, key: object) -> torch.Tensor:
        """`key` names the buffer reused every step: the var, and the micro-batch when a
        pipeline holds several micro-batches' copies at once."""
        self.offloaded_bytes += x.numel() * x.element_size()
        if not self.cuda:
            t0 = time.perf_counter()
            out = x.clone()
            self._copy_s += time.perf_counter() - t0
            return out
        buf = self._buffer(key, x)
        compute = torch.cuda.current_stream(self.device)
        self.d2h.wait_stream(compute)  # x has been produced
        start, end = _timed_events()
        with torch.cuda.stream(self.d2h):
            start.record()
            buf.copy_(x, non_blocking=True)
            end.record()
        x.record_stream(self.d2h)  # its block is not reused before the copy is done
        self._offloaded[buf.untyped_storage().data_ptr()] = end
        self._copy_events.append((start, end))
        return buf

    def to_device(self, xh: torch.Tensor) -> torch.Tensor:
        self.fetched_bytes += xh.numel() * xh.element_size()
        if not self.cuda:
            t0 = time.perf_counter()
            out = xh.to(self.device, copy=True)
            self._copy_s += time.perf_counter() - t0
            return out
        compute = torch.cuda.current_stream(self.device)
        out = torch.empty_like(xh, device=self.device)  # on compute; xh's layout (channels-last too)
        self.h2d.wait_stream(compute)  # out's block may have been in use by compute until now
        offloaded = self._offloaded.pop(xh.untyped_storage().data_ptr(), None)
        if offloaded is not None:
            self.h2d.wait_event(offloaded)
        start, end = _timed_events()
        with torch.cuda.stream(self.h2d):
            start.record()
            out.copy_(xh, non_blocking=True)
            end.record()
        out.record_stream(self.h2d)
        if xh.is_cuda:  # not expected (Memcpy reads the pinned copy), but then keep it alive too
            xh.record_stream(self.h2d)
        self._fetched[out.untyped_storage().data_ptr()] = end
        self._copy_events.append((start, end))
        return out

    def wait(self, x: torch.Tensor) -> None:
        """The compute stream needs `x` (a prefetched tensor) from here on."""
        if not self.cuda:
            return
        done = self._fetched.pop(x.untyped_storage().data_ptr(), None)
        if done is None:
            return
        compute = torch.cuda.current_stream(self.device)
        before, after = _timed_events()
        before.record(compute)
        compute.wait_event(done)
        after.record(compute)
        self._wait_events.append((before, after))

    def _buffer(self, key: object, x: torch.Tensor) -> torch.Tensor:
        n = x.numel()
        buf = self._buffers.get(key)
        if buf is None or buf.dtype != x.dtype or buf.numel() < n:
            buf = torch.empty(n, dtype=x.dtype, pin_memory=True)
            self._buffers[key] = buf
        if is_channels_last(x):
            # keep a channels-last checkpoint channels-last: what reads it back runs as before
            return buf[:n].as_strided(x.shape, x.stride())
        return buf[:n].view(x.shape)


def _timed_events() -> tuple[torch.cuda.Event, torch.cuda.Event]:
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
