"""The models, batches and strategies of the sharding tests, shared by the workers
(sharding_worker.py) and the one-process reference (test_sharding_workers.py): the Hugging Face models
of the zoo built tiny (tests/zoo), and the reference MLP (programs/)."""

from __future__ import annotations

import contextlib
import functools
import sys
from pathlib import Path

import export_cache
import torch

import metaopt
import programs
from metaopt import fleet

STEPS = 3
BATCH = 8
MERGE = 2  # "merge": runs per step under gradient merge
SEED = 0
# one checkpoint per block: recompute re-runs each block before its grads
CHECKPOINTS = {
    "mlp": ["fc1", "fc2"],
    "hf-gpt2": ["m.transformer.h.*"],
    "hf-llama": ["m.model.layers.*"],
    "hf-bert": ["m.bert.encoder.layer.*"],
}


def _zoo(name: str):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from zoo import harness, models

    return harness, models.get(name)


@functools.cache
def _feed_names(name: str) -> list[str]:
    """The model's feed names, found by building it once: under its own RNG state, so the
    first `batch()` of a process draws nothing from torch's stream (a worker that seeds and then
    makes its first feed draws the same dropout masks as one whose feed names were cached)."""
    harness, entry = _zoo(name)
    with torch.random.fork_rng(devices=[]):
        return harness.feed_names(entry.build(0.0), 8)


def export(name: str, dropout: float = 0.0, *, meta: bool = False) -> metaopt.Program:
    """The forward program, the same initial values in every process (`dropout`: the Hugging
    Face models' dropout probability). `meta`: the module built on the meta device and exported
    so (no values: fleet.load_pretrained gives them, from `save_pretrained_files`)."""
    if meta:
        module, inputs, kwargs = _module(name, dropout, meta=True)
        return export_cache.export(module, inputs, **kwargs)
    if name.startswith("hf-"):
        harness, entry = _zoo(name)
        torch.manual_seed(SEED)
        return harness.export(entry, dropout)[1]
    mod = programs.get(name)
    model = mod.build("tiny", seed=SEED, dropout=0.0)
    return export_cache.export(model, mod.example_inputs("tiny", 4, seed=1), name=name)


def _module(name: str, dropout: float = 0.0, *, meta: bool = False) -> tuple[torch.nn.Module, tuple, dict]:
    """The module `export` exports (on the meta device: `meta`), its example inputs, export options."""
    with torch.device("meta") if meta else contextlib.nullcontext():
        if name.startswith("hf-"):
            harness, entry = _zoo(name)
            module = entry.build(dropout)
        else:
            mod = programs.get(name)
            module = mod.build("tiny", seed=SEED, dropout=0.0)
    if name.startswith("hf-"):
        return (
            module,
            entry.inputs(harness.EXPORT_BATCH, 0),
            {"name": entry.name, **dict(entry.export_kwargs)},
        )
    return module, mod.example_inputs("tiny", 4, seed=1), {"name": name}


HELD_OUT = 100  # `batch(name, HELD_OUT)`: the evaluation batch, never trained on


def evaluate(
    exe: metaopt.Executor, main: metaopt.Program, feed: dict, loss: str | None
) -> list[float | None]:
    """Issue 49: `main.clone(for_test=True)` of the trained (rewritten) program, run twice on
    `exe` (its scope: the trained values) on the held-out `feed`: its two losses, None on a
    worker holding no loss (a pipeline's first stage)."""
    test = main.clone(for_test=True)
    out = []
    for _ in range(2):
        (value,) = exe.run(test, feed=feed, fetch_list=[loss])
        out.append(None if value is None else float(value))
    return out


INIT_SEED = 5  # the "init" cases' fleet.init_from_module seed
PRETRAINED_PREFIX = {"hf-gpt2": "m.", "hf-llama": "m.", "hf-bert": "m."}  # the loss wrapper's module


def save_pretrained_files(folder: Path, names: list[str]) -> None:
    """Each model's initial values (those `export` gives) as the file `fleet.load_pretrained` reads:
    a Hugging Face folder (`save_pretrained`) for the zoo's models, one safetensors file else."""
    from safetensors.torch import save_file

    for name in names:
        module = _module(name)[0]
        if name.startswith("hf-"):
            module.m.save_pretrained(folder / name)
        else:
            tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
            save_file(
                {k: t.detach().contiguous() for k, t in tensors.items()}, folder / f"{name}.safetensors"
            )


def seeded_values(name: str) -> dict[str, torch.Tensor]:
    """The values fleet.init_from_module gives `name`'s meta-built program in one process
    (seed INIT_SEED), by the file key save_pretrained writes (PRETRAINED_PREFIX taken off)."""
    module, inputs, kwargs = _module(name, meta=True)
    main = export_cache.export(module, inputs, **kwargs)
    exe = metaopt.Executor("cpu")
    filled = fleet.init_from_module(exe, main, module, seed=INIT_SEED)
    prefix = PRETRAINED_PREFIX.get(name, "")
    return {n.removeprefix(prefix): exe.scope[n].clone() for n in filled}


def pretrained_path(folder: Path, name: str) -> Path:
    return folder / name if name.startswith("hf-") else folder / f"{name}.safetensors"


def batch(name: str, step: int) -> dict[str, torch.Tensor]:
    """The step's whole batch."""
    if name.startswith("hf-"):
        inputs = _zoo(name)[1].inputs(BATCH, 10 + step)
        return dict(zip(_feed_names(name)[: len(inputs)], inputs, strict=True))
    mod = programs.get(name)
    return dict(zip(mod.INPUT_NAMES, mod.example_inputs("tiny", BATCH, seed=10 + step), strict=True))


def runs(feed: dict[str, torch.Tensor], extra: list[str]) -> list[dict[str, torch.Tensor]]:
    """One step's feeds: the batch whole, or in MERGE equal parts under gradient merge."""
    k = MERGE if "merge" in extra else 1
    n = next(iter(feed.values())).shape[0]
    return [{name: t[j * n // k : (j + 1) * n // k] for name, t in feed.items()} for j in range(k)]


def build_strategy(name: str, extra: list[str]) -> fleet.DistributedStrategy:
    s = fleet.DistributedStrategy()
    s.fuse_grad_size_in_MB = 1
    if "recompute" in extra:
        s.recompute = True
        s.recompute_configs = {"checkpoints": CHECKPOINTS[name]}
    s.fp16_allreduce = "fp16ar" in extra  # data parallel's grads sent in float16
    if "merge" in extra:  # each step's batch in MERGE runs, one update per step
        s.gradient_merge = True
        s.gradient_merge_configs = {"k_steps": MERGE, "avg": True}
    if "localsgd" in extra:  # steps 1 (<= begin_step) and 3 (2 after it) average the params
        s.localsgd = True
        s.localsgd_configs = {"k_steps": 2, "begin_step": 1}
    s.optimizer_in_backward = "uib" in extra  # each update right after its grad is final
    for kind in ("lamb", "lars"):  # Fleet's meta optimizers around Adam / Momentum
        setattr(s, kind, kind in extra)
    if "bf16" in extra or "fp16" in extra:  # fp16: dynamic loss scaling, overflowed steps skipped
        s.amp = True
        s.amp_configs = {"dtype": "bfloat16" if "bf16" in extra else "float16"}
    return s
