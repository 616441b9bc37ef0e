"""Where an executor runs: "cpu", "cuda", "cuda:N", CPUPlace(), CUDAPlace(n); and "meta" (shapes
and dtypes only: the proof that a step reads no device value on the host, runtime/hostsync.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CPUPlace:
    def device(self) -> torch.device:
        return torch.device("cpu")


@dataclass(frozen=True)
class CUDAPlace:
    index: int = 0

    def device(self) -> torch.device:
        return torch.device("cuda", self.index)


Place = str | torch.device | CPUPlace | CUDAPlace


def resolve(place: Place) -> torch.device:
    """The torch device of `place`; a CUDA place without CUDA is a clear error."""
    if isinstance(place, (CPUPlace, CUDAPlace)):
        dev = place.device()
    else:
        try:
            dev = torch.device(place)
        except (RuntimeError, TypeError) as e:
            raise ValueError(
                f"unknown place {place!r}: use 'cpu', 'cuda', 'cuda:N', CPUPlace() or CUDAPlace(n)"
            ) from e
    if dev.type not in ("cpu", "cuda", "meta"):
        raise ValueError(f"place {place!r}: only cpu, cuda and meta are supported")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"place {place!r}: CUDA is not available on this machine")
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ValueError(f"place {place!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
        dev = torch.device("cuda", index)
    return dev
