"""Shared by the benchmark scripts: timing, machine description, the reference cases."""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

# "Realistic sizes" that fit a 2-core CPU run; GPU gets the full configs.
CPU_CASES = [
    ("mlp", "base", 256, {}),
    ("bert", "base", 8, {"seq_len": 128, "num_layers": 4}),
    ("gpt", "gpt2", 4, {"seq_len": 128, "num_layers": 4}),
    ("resnet", "resnet50", 8, {"image_size": 64}),
]
GPU_CASES = [
    ("mlp", "base", 4096, {}),
    ("bert", "large", 8, {"seq_len": 512}),
    ("gpt", "gpt2", 8, {"seq_len": 1024}),
    ("resnet", "resnet50", 64, {}),
]


def cases(device: torch.device, quick: bool) -> list[tuple]:
    chosen = CPU_CASES if device.type == "cpu" else GPU_CASES
    return [(n, "tiny", 4, {}) for n, *_ in chosen] if quick else chosen


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn, device: torch.device, reps: int, warmup: int = 2) -> float:
    """Median wall time of fn() in seconds, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def machine(device: torch.device) -> dict:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {
        "device": name,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
