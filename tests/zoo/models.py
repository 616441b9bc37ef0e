"""The model zoo: common architectures built tiny from configs (no downloads), plus edge cases.

Each `Entry` builds a module whose forward returns the loss and example inputs for any
batch size. Hugging Face models come from `transformers` configs with random weights,
torchvision's from its model classes (see `torchvision_shim`), the rest are hand-built
edge cases (frozen params / LoRA, tied weights, BatchNorm buffers, padding indices,
shared layers, in-place ops).

`dropout` is the probability every dropout of the model gets: the gradient checks build
with 0.0 (masks cannot match torch's), the recompute checks with a positive one.

Shapes: an entry runs at its default input shape (32x32 images, 12 tokens); `shapes` lists the
others `table.py` tries (`Entry.at`), chosen to reach other code paths: CNN feature maps that
end at 2x2 (64) and pass odd sizes on the way (72: 9, 5, 3), sequence lengths that are a
multiple of 16 (16) and odd (7). An inputs function that can change shape carries `at(shape)`.
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
    shape: object = None  # the input shape `at` chose (None: the default)

    @property
    def shapes(self) -> tuple:
        """The other input shapes this entry runs at (none where its inputs cannot change)."""
        return tuple(getattr(self.inputs, "shapes", ())) if self.shape is None else ()

    def at(self, shape) -> Entry:
        """This entry at another input shape (an image side, a sequence length)."""
        make = getattr(self.inputs, "at", None)
        if make is None:
            raise ValueError(f"{self.name}: its inputs have one shape")
        return dataclasses.replace(self, name=f"{self.name}@{shape}", inputs=make(shape), shape=shape)

    def variants(self) -> list[Entry]:
        """This entry at its default shape, then at each of `shapes`."""
        return [self, *(self.at(s) for s in self.shapes)]


def entries() -> list[Entry]:
    return [*hf.entries(Entry), *tv.entries(Entry), *hand.entries(Entry)]


def get(name: str) -> Entry:
    """An entry by name; `NAME@SHAPE` is the entry at that input shape (`Entry.at`)."""
    base, _, shape = name.partition("@")
    for e in entries():
        if e.name == base:
            return e.at(int(shape)) if shape else e
    raise KeyError(name)
