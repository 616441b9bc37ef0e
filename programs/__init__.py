"""Reference models shared by examples, benchmarks and golden tests.

Every program module (``mlp``, ``bert``, ``gpt``, ``resnet``) has the same surface:

- ``CONFIGS``: named, frozen ``Config`` dataclasses ("tiny" plus the full-size one).
- ``build(config="tiny", *, seed=0, **overrides)``: a ``torch.nn.Module`` in train mode whose
  ``forward(*inputs)`` returns the scalar training loss (labels are forward arguments).
  Weights depend only on ``seed`` (and on the device type they are created on: build on CPU
  and ``.to(device)`` for identical weights everywhere); the caller's RNG state is untouched.
- ``example_inputs(config, batch, *, seed=0, **overrides)``: synthetic inputs in forward's order.
- ``INPUT_NAMES``: forward's argument names, in order; they become the exported feed names.
- ``DEFAULT_CHECKPOINTS``: module-path patterns a user would recompute on. ``*`` stands for one
  path component, so ``"bert.encoder.layer.*"`` means each encoder layer's output, not the
  modules inside the layers.

The models are written for ``torch.onnx.export(..., dynamo=True, optimize=False)`` with a
symbolic batch dimension (see ``batch_dynamic_shapes``): no data-dependent control flow, no
in-place ops on activations, no ``.item()``.

This package is not part of the installed ``metaopt`` distribution.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import types
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch

_C = TypeVar("_C")


def resolve_config(configs: Mapping[str, _C], config: str | _C, overrides: Mapping[str, Any]) -> _C:
    """Look ``config`` up by name (or take it as is) and apply ``overrides`` to a copy."""
    if isinstance(config, str):
        try:
            config = configs[config]
        except KeyError:
            raise KeyError(f"unknown config {config!r}; known: {sorted(configs)}") from None
    # dataclasses.replace raises TypeError naming any unknown field, which is the message we want.
    return dataclasses.replace(config, **overrides) if overrides else config


def channels_last(inputs: Sequence[Any]) -> tuple:
    """`inputs` with every 4-D floating tensor laid out channels-last, the layout an exported
    program runs its 2-D convolutions in (metaopt/passes/channels_last.py): eager torch given
    these runs the same kernels as the program, so a reference can be held to bit equality."""
    return tuple(
        x.contiguous(memory_format=torch.channels_last)
        if isinstance(x, torch.Tensor) and x.dim() == 4 and x.is_floating_point()
        else x
        for x in inputs
    )


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Seed the generator that weight init draws from, restoring the caller's state afterwards.

    Only the generator of the current default device type is forked and seeded: seeding every
    device (``torch.manual_seed``) would queue a CUDA reseed that leaks out of the fork.
    Meta tensors draw nothing, so building on ``torch.device("meta")`` is free.
    """
    device = torch.get_default_device()
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        with torch.random.fork_rng(devices=[index], device_type="cuda"):
            torch.default_generator.manual_seed(seed)
            with torch.cuda.device(index):
                torch.cuda.manual_seed(seed)
            yield
    else:
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            yield


def batch_dynamic_shapes(input_names: Sequence[str]) -> dict[str, dict[int, torch.export.Dim]]:
    """``dynamic_shapes`` for ``torch.onnx.export``: one symbolic ``batch`` dim on dim 0 of every input.

    Keyed by forward's argument names, so a mismatch between ``INPUT_NAMES`` and the signature
    fails at export rather than silently mislabelling feeds.
    """
    batch = torch.export.Dim("batch")
    return {name: {0: batch} for name in input_names}


# Imported after the helpers above, which the program modules use (import_module rather than a
# late ``import`` statement keeps linters' import-position rules quiet without a noqa).
REGISTRY: dict[str, types.ModuleType] = {
    name: importlib.import_module(f"programs.{name}") for name in ("mlp", "bert", "gpt", "resnet")
}


def get(name: str) -> types.ModuleType:
    """The program module called ``name`` (one of ``REGISTRY``)."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown program {name!r}; known: {sorted(REGISTRY)}") from None


def export(name: str, config: str = "tiny", *, batch: int = 4, seed: int = 0, **overrides: Any):
    """Build program `name` and export it with metaopt (the CLI's ``programs:export('bert')``)."""
    import metaopt

    mod = get(name)
    module = mod.build(config, seed=seed, **overrides)
    inputs = mod.example_inputs(config, batch, seed=seed, **overrides)
    return metaopt.export(module, inputs, name=name)
