"""One of 2 gloo workers of test_gloo_release.py: after each collective metaopt runs returns,
gloo's thread holds none of its tensors (their Python reference counts are back to what they
were), so a process that ends right after one exits with its own status. Then, with
argv[1] == "raise", raises right after a collective, as a worker whose programs differ does."""

from __future__ import annotations

import sys

import torch

from metaopt import fleet
from metaopt.layout import groups
from metaopt.runtime.comm import Communicator

ROUNDS = 50  # gloo's thread lets go within microseconds: a check that races it must see it many times


def main() -> None:
    fleet.init(is_collective=True)
    dist = groups.initialized_dist()
    comm = Communicator(torch.device("cpu"))
    held = []
    for i in range(ROUNDS):
        t = torch.full((64,), float(dist.get_rank() + i))
        comm.broadcast(t, src=0, what="t")
        held.append(("broadcast", sys.getrefcount(t), 2))  # t, the call's argument
        outs = comm.all_gather(t, what="t")
        held.append(("Communicator.all_gather", sys.getrefcount(outs[1]), 2))  # the list, the argument
        buf, outs = torch.ones(8), [torch.empty(8) for _ in range(2)]
        groups.run_gloo(lambda: dist.all_gather(outs, buf, async_op=True), [buf, *outs], "x")  # noqa: B023
        held.append(("run_gloo", sys.getrefcount(buf), 2))
    wrong = [(what, got, want) for what, got, want in held if got != want]
    assert not wrong, f"gloo still held tensors after {len(wrong)} of {len(held)} collectives: {wrong[:5]}"
    print(f"rank {dist.get_rank()} checked {len(held)} collectives", flush=True)
    if sys.argv[1:] == ["raise"]:
        groups.all_gather_bytes(b"last", "the last exchange")
        raise RuntimeError("raised right after a collective")


if __name__ == "__main__":
    main()
