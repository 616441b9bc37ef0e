"""Copies between device and host memory (the offload pass's ops).

``Memcpy(x, dst=pinned)`` copies a device tensor to (pinned, on CUDA) host memory;
``Memcpy(x, dst=device)`` copies it back; ``CopyWait(x)`` marks where the program needs
a copy finished. The kernels hand the work to the executor's copy engine
(`metaopt.runtime.copies`): on CUDA, dedicated copy streams, reused pinned buffers and
event waits, so the copies overlap compute; on CPU, real copies into the executor's
separate host account.
"""

from __future__ import annotations

import torch

from metaopt.ops.registry import register

_DSTS = ("pinned", "device")


def _on_host(attrs: dict) -> bool:
    return attrs.get("dst") == "pinned"


@register(
    "Memcpy",
    domain="metaopt",
    needs_runtime=True,
    fresh_outputs=True,
    recomputable=False,
    host_memory=_on_host,
    # a copy of an update's output (ZeRO-Offload's state back to the host): on a step AMP skips,
    # of the values the update kept
    state_from_updates=True,
)
def memcpy(x: torch.Tensor, dst: str, _rt, _key: str) -> torch.Tensor:
    if dst not in _DSTS:
        raise ValueError(f"Memcpy: dst must be one of {_DSTS}, got {dst!r}")
    if dst == "pinned":
        # a pipeline holds one copy per micro-batch in flight: each its own buffer
        key = _key if _rt.pipeline is None else (_key, _rt.pipeline.micro_batch)
        return _rt.copies.to_host(x, key)
    return _rt.copies.to_device(x)


@register("CopyWait", domain="metaopt", needs_runtime=True, recomputable=False)
def copy_wait(x: torch.Tensor, _rt, _key: str) -> None:
    """The program needs `x`'s copy finished here (a device-side wait on CUDA)."""
    _rt.copies.wait(x)
    return None
