"""The process's host memory beside what the executor counts: what glibc keeps after a phase that
made and dropped many objects (every layer may call it: it imports nothing of metaopt)."""

from __future__ import annotations

# Below this many bytes of values the phase's garbage is small and the trim not worth its time
# (a collection of a process holding torch and transformers: 0.1-0.2 s, which hundreds of small
# exports, a test suite's, would pay for nothing).
WORTH_BYTES = 64 << 20


def return_freed_host_memory(value_bytes: int = WORTH_BYTES) -> None:
    """Collect garbage and give the process's freed heap back to the OS (glibc's `malloc_trim`;
    elsewhere only the collection). glibc keeps small freed blocks in its arenas for reuse, so a
    phase that made and dropped many objects leaves the process's RSS that much higher for the
    rest of its life: after the export of a 22-layer 1.26B LLaMA (its traces: about a million
    Python objects), 63 MB of every worker's host memory until the end of training.
    `value_bytes`: the values the phase handled (a model's params): below `WORTH_BYTES`, nothing."""
    if value_bytes < WORTH_BYTES:
        return
    import ctypes
    import gc

    gc.collect()
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl, macOS): nothing to trim
        return
    libc.malloc_trim(0)
