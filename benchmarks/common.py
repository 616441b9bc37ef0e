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


def bert_config(hidden: int, layers: int, seq: int, vocab_size: int | None = None) -> dict:
    """The gloo benchmarks' BERT: `layers` layers of width `hidden` (heads of 64, a 4x FFN),
    sequence `seq`, no dropout; `vocab_size` None keeps the program's own."""
    cfg = {
        "hidden_size": hidden,
        "num_layers": layers,
        "num_heads": max(1, hidden // 64),
        "intermediate_size": 4 * hidden,
        "seq_len": seq,
        "dropout": 0.0,
    }
    return cfg if vocab_size is None else {**cfg, "vocab_size": vocab_size}


def launch_workers(script: str, nproc: int, out: str, flags: list[str]) -> None:
    """`script --worker --out=OUT FLAGS...` on `nproc` CPU workers under metaoptrun (one thread
    each, logs under OUT/log); exits naming the launcher's output when it fails."""
    import subprocess

    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    cmd = [
        sys.executable,
        "-m",
        "metaopt.launch",
        f"--nproc_per_node={nproc}",
        f"--log_dir={os.path.join(out, 'log')}",
        os.path.abspath(script),
        "--worker",
        f"--out={out}",
        *flags,
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    env["CUDA_VISIBLE_DEVICES"], env["OMP_NUM_THREADS"] = "", "1"
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"metaoptrun --nproc_per_node={nproc} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def worker_flags(ap) -> None:
    """The flags `launch_workers` gives a worker (hidden from --help)."""
    import argparse

    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)


def worker_results(launch, args, prefix: str, nproc: int = 2) -> tuple[str, list[dict]]:
    """`launch(args, out)` into a fresh folder: (that folder, each rank's `rank<r>.json` from it)."""
    import json
    import tempfile

    out = tempfile.mkdtemp(prefix=prefix)
    launch(args, out)
    results = []
    for r in range(nproc):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            results.append(json.load(f))
    return out, results


class LMLoss(torch.nn.Module):
    """A Hugging Face causal LM that returns its loss (what metaopt.export and eager both run)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.m(input_ids=input_ids, labels=labels).loss
