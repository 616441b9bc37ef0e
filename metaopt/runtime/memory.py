"""The executor's own accounting of live bytes (so memory savings are measurable on CPU).

Bytes are counted per storage, not per tensor: a view (Reshape, Transpose,
slices) shares its base's storage and adds nothing; a storage is released when
the last var holding it is freed.

`TimelineTracker` (``Executor(record_timeline=True)``) also keeps the live bytes at every
`mark`, i.e. after each op's outputs exist: the measured line of the memory picture. It is a
subclass swapped in at construction, so an executor that does not record runs the plain
`MemoryTracker.mark` and pays nothing for the feature.
"""

from __future__ import annotations

import time

import torch


class MemoryTracker:
    __slots__ = ("refs", "live", "peak", "host_live", "host_peak", "run_peak")

    def __init__(self) -> None:
        self.refs: dict[int, list[int]] = {}  # storage ptr -> [refcount, nbytes, is_host]
        self.live = 0
        self.peak = 0
        self.run_peak = 0
        self.host_live = 0
        self.host_peak = 0

    def acquire(self, t: torch.Tensor | None, host: bool = False) -> None:
        if t is None:
            return
        s = t.untyped_storage()
        key = s.data_ptr()
        r = self.refs.get(key)
        if r is not None:
            r[0] += 1
            return
        n = s.nbytes()
        self.refs[key] = [1, n, host]
        if host:
            self.host_live += n
            if self.host_live > self.host_peak:
                self.host_peak = self.host_live
        else:
            self.live += n

    def mark(self) -> None:
        """Record the peak: called after an op's outputs exist, before its dead inputs go."""
        if self.live > self.run_peak:
            self.run_peak = self.live

    def release(self, t: torch.Tensor | None) -> None:
        if t is None:
            return
        key = t.untyped_storage().data_ptr()
        r = self.refs[key]
        r[0] -= 1
        if r[0] == 0:
            del self.refs[key]
            if r[2]:
                self.host_live -= r[1]
            else:
                self.live -= r[1]

    def start_run(self) -> None:
        self.run_peak = self.live

    def end_run(self) -> None:
        self.peak = max(self.peak, self.run_peak)

    def timeline(self) -> list[int]:
        raise ValueError(
            "this executor does not record a memory timeline: create it with "
            "Executor(..., record_timeline=True)"
        )


class TimelineTracker(MemoryTracker):
    """A `MemoryTracker` that also records the live bytes at each `mark` (one per op run) of
    the current step; `start_run` (once per step) starts a new record, so memory stays bounded
    by the ops of one step however long the executor trains."""

    __slots__ = ("marks",)

    def __init__(self) -> None:
        super().__init__()
        self.marks: list[int] = []

    def mark(self) -> None:
        self.marks.append(self.live)
        if self.live > self.run_peak:
            self.run_peak = self.live

    def start_run(self) -> None:
        super().start_run()
        self.marks = []

    def timeline(self) -> list[int]:
        """Live bytes after each op run in the last step, in the order they ran."""
        return list(self.marks)


class TimingTracker(TimelineTracker):
    """A `TimelineTracker` that also records when each `mark` came: each op's seconds, from the
    previous op's mark (the step's start for the first), for the planner's calibration
    (planner/calibrate.py). On CUDA the clock is the host's: a kernel's time shows only where the
    host waits for it."""

    __slots__ = ("times",)

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []

    def mark(self) -> None:
        self.times.append(time.perf_counter())
        super().mark()

    def start_run(self) -> None:
        super().start_run()
        self.times = [time.perf_counter()]

    def op_seconds(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:])]
