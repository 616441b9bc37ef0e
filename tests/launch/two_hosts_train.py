"""The training script of test_two_hosts.py, one worker per host: fleet.init, then an
all-reduce of rank + 1 over the two hosts (3.0 when they reached each other). With argv[1] =
N, N steps of an all-reduce each (every step printed), for the test that cuts the link."""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

from metaopt import fleet

fleet.init(is_collective=True)
t = torch.tensor([float(fleet.worker_index() + 1)])
dist.all_reduce(t)
print(f"rank {fleet.worker_index()} sum {t.item()} on {os.environ.get('GLOO_SOCKET_IFNAME')}", flush=True)
for step in range(int(sys.argv[1]) if len(sys.argv) > 1 else 0):
    dist.all_reduce(torch.ones(4))
    print(f"rank {fleet.worker_index()} step {step}", flush=True)
    time.sleep(0.1)
