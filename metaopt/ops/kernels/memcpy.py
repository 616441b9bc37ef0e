"""Copies between device and host memory (the offload pass's ops).

``Memcpy(x, dst=pinned)`` copies a device tensor to (pinned, on CUDA) host memory;
``Memcpy(x, dst=device)`` copies it back. On CPU both are real copies, so the
executor's separate host account shows what offload moves. On CUDA the copies are
issued non-blocking from pinned memory; ``CopyWait`` marks where the program needs a
copy finished (the executor synchronises there). Overlapping the copies with compute on
dedicated streams is not done yet: the copies run on the current stream.
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
    needs_device=True,
    fresh_outputs=True,
    recomputable=False,
    host_memory=_on_host,
)
def memcpy(x: torch.Tensor, dst: str, _device: torch.device) -> torch.Tensor:
    if dst not in _DSTS:
        raise ValueError(f"Memcpy: dst must be one of {_DSTS}, got {dst!r}")
    if dst == "pinned":
        if x.device.type == "cuda":
            out = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            return out.copy_(x, non_blocking=True)
        return x.clone()
    return x.to(_device, copy=True, non_blocking=True)


@register("CopyWait", domain="metaopt", needs_device=True, recomputable=False)
def copy_wait(x: torch.Tensor, _device: torch.device) -> None:
    """The program needs `x`'s copy finished here."""
    if _device.type == "cuda":
        torch.cuda.current_stream(_device).synchronize()
    return None
