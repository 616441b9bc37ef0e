"""The executor's state that outlives one run and that some kernels reach (rows with
``needs_runtime``): the copy engine of offload and the communicator of the collectives."""

from __future__ import annotations

import torch

from metaopt.runtime.copies import CopyEngine


class Runtime:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.copies = CopyEngine(device)
        self._comm = None
        self.pipeline = None  # the PipelineState of the pipeline step being run, if any
        # counts kernels keep across this executor's runs (rate limits of their warnings)
        self.counters: dict[str, int] = {}

    @property
    def comm(self):
        """The communicator over torch.distributed's default group (made on first use)."""
        if self._comm is None:
            from metaopt.runtime.comm import Communicator

            self._comm = Communicator(self.device)
        return self._comm

    def all_to_all_bytes(self) -> int:
        """Bytes the last run's all-to-alls (expert parallel's) sent to other workers."""
        return 0 if self._comm is None else self._comm.all_to_all_bytes

    def start_run(self) -> None:
        self.copies.start_run()
        if self._comm is not None:
            self._comm.start_run()

    def abandon_collectives(self) -> None:
        """A run raised: finish what it left in flight (`Communicator.abandon`)."""
        if self._comm is not None and self._comm.in_flight:
            self._comm.abandon()
