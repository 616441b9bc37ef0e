"""The training script of test_two_hosts.py, one worker per host: fleet.init, then an
all-reduce of rank + 1 over the two hosts (3.0 when they reached each other)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from metaopt import fleet

fleet.init(is_collective=True)
t = torch.tensor([float(fleet.worker_index() + 1)])
dist.all_reduce(t)
print(f"rank {fleet.worker_index()} sum {t.item()} on {os.environ.get('GLOO_SOCKET_IFNAME')}", flush=True)
