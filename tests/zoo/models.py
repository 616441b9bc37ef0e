"""The model zoo: common architectures built tiny from configs (no downloads), plus edge cases.

Each `Entry` builds a module whose forward returns the loss and example inputs for any
batch size. Hugging Face models come from `transformers` configs with random weights,
torchvision's from its model classes (see `torchvision_shim`), the rest are hand-built
edge cases (frozen params / LoRA, tied weights, BatchNorm buffers, padding indices,
shared layers, in-place ops).

`dropout` is the probability every dropout of the model gets: the gradient checks build
with 0.0 (masks cannot match torch's), the recompute checks with a positive one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from zoo import hand, hf, tv


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str
    family: str  # encoder, decoder, encoder-decoder, vision, cnn, audio, multimodal, edge
    build: Callable[[float], nn.Module]  # dropout -> module in train mode
    inputs: Callable[[int, int], tuple[torch.Tensor, ...]]  # (batch, seed) -> forward args
    checkpoints: tuple[str, ...] = ("auto",)  # recompute checkpoints (names / patterns)
    fast: bool = False  # in the CI subset
    export_kwargs: dict = dataclasses.field(default_factory=dict)
    why: str = ""  # what this entry exercises


def entries() -> list[Entry]:
    return [*hf.entries(Entry), *tv.entries(Entry), *hand.entries(Entry)]


def get(name: str) -> Entry:
    for e in entries():
        if e.name == name:
            return e
    raise KeyError(name)
