"""Hugging Face mixture-of-experts layers export as one grouped matmul per projection.

transformers >= 5 runs an MoE layer's experts by ``config._experts_implementation``:
``"grouped_mm"`` (the default: tokens sorted by expert, one grouped matmul over all experts),
``"batched_mm"`` (each token's expert weights gathered, then a batched matmul), ``"eager"`` (a
Python loop over the experts the batch routed to) or GPU kernels (``"deepgemm"``, ``"sonicmoe"``).

The loop cannot be captured: the experts it runs depend on the data (torch.export stops at
``for expert_idx in expert_hit``), and a trace that got past it would keep only the experts the
example input routed to. GPU kernels do not run on an exporter's fake tensors. So for the capture
every such layer runs ``"grouped_mm"``, the same math, which becomes our ``GroupedMatMul`` holding
every expert (frontend/translations.py); ``"batched_mm"`` is kept, it exports as plain ops. The
user's module is left as it was.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

CAPTURED = ("grouped_mm", "batched_mm")  # implementations that export as they are
_LOG = logging.getLogger("metaopt.export")


def _configs(module: torch.nn.Module) -> list:
    """Every distinct HF config below `module` that chooses an experts implementation."""
    seen: dict[int, object] = {}
    for sub in module.modules():
        cfg = getattr(sub, "config", None)
        if cfg is not None and hasattr(type(cfg), "_experts_implementation"):
            seen.setdefault(id(cfg), cfg)
    return list(seen.values())


@contextlib.contextmanager
def grouped_experts(module: torch.nn.Module) -> Iterator[list[str]]:
    """While open, every HF experts layer below `module` runs ``"grouped_mm"`` unless it already
    runs an implementation that exports (`CAPTURED`); yields the implementations replaced."""
    changed = []
    for cfg in _configs(module):
        impl = cfg._experts_implementation
        if impl is not None and impl not in CAPTURED:
            changed.append((cfg, impl))
    try:
        for cfg, impl in changed:
            cfg._experts_implementation_internal = "grouped_mm"
            _LOG.info("export: %s experts run grouped_mm for the capture (was %r)", type(cfg).__name__, impl)
        yield [impl for _, impl in changed]
    finally:
        for cfg, impl in changed:
            cfg._experts_implementation_internal = impl
