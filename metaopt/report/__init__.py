"""Reports that combine the program-level passes with the runtime's measurements.

A package of its own because it needs both `metaopt.passes` (the memory estimate) and
`metaopt.runtime` (the executor's accounting), and passes may not import the runtime. Drawing
(`report.plot`) needs matplotlib, the optional extra ``metaopt[plot]``; the data and its text
summary do not.
"""

from __future__ import annotations

from metaopt.report.memory_picture import MemoryPicture, measure_timeline, memory_picture, random_feed
from metaopt.report.pipeline_memory import PipelineMemory, estimate_pipeline_memory

__all__ = [
    "MemoryPicture",
    "PipelineMemory",
    "estimate_pipeline_memory",
    "measure_timeline",
    "memory_picture",
    "random_feed",
]
