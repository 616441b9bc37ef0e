"""ResNet-50 (v1.5: stride on the 3x3 conv) with PaddlePaddle's block names.

Bottleneck blocks are top-level attributes named as in Paddle's ResNet: ``res2a, res2b, res2c,
res3a .. res3d, res4a .. res4f, res5a .. res5c``, so their outputs are the checkpoint names a Fleet
user knows. Inside a block, Paddle's branch names: ``branch2a`` (1x1), ``branch2b`` (3x3),
``branch2c`` (1x1) and the projection shortcut ``branch1`` where shape changes; each is a
``ConvBN`` with ``conv`` and ``bn`` children. BatchNorm runs in training mode (batch statistics,
running-stat updates).
"""

from __future__ import annotations

import dataclasses
import string

import torch
import torch.nn.functional as F
from torch import nn

from programs import resolve_config, seeded


@dataclasses.dataclass(frozen=True)
class Config:
    depths: tuple[int, ...] = (3, 4, 6, 3)  # blocks per stage res2 .. res5
    width: int = 64  # stem channels = first stage's bottleneck width; stages double it
    num_classes: int = 1000
    image_size: int = 224
    # ResNet-50 has no dropout; the field exists so callers can pass dropout=0.0 to every program.
    # Above 0 it applies before fc.
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if max(self.depths) > len(string.ascii_lowercase):
            raise ValueError(f"at most 26 blocks per stage are nameable res<N>a..z, got depths {self.depths}")


CONFIGS: dict[str, Config] = {
    "tiny": Config(depths=(1, 1, 1, 1), width=4, num_classes=10, image_size=32),
    "resnet50": Config(),
}

INPUT_NAMES: tuple[str, ...] = ("image", "label")

# Each bottleneck block's output (``*`` is one path component: res2a, ..., not res2a.branch2a).
DEFAULT_CHECKPOINTS: list[str] = ["res*"]

_EXPANSION = 4  # bottleneck output channels = 4 x its width


class ConvBN(nn.Module):
    """Conv (no bias) + BatchNorm, optionally followed by ReLU."""

    def __init__(
        self, in_channels: int, out_channels: int, kernel: int, stride: int = 1, *, relu: bool
    ) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel, stride, padding=kernel // 2, bias=False)
        self.bn = nn.BatchNorm2d(out_channels)
        self.relu = relu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(self.conv(x))
        return F.relu(y) if self.relu else y


class Bottleneck(nn.Module):
    def __init__(self, in_channels: int, width: int, stride: int) -> None:
        super().__init__()
        out_channels = width * _EXPANSION
        self.branch2a = ConvBN(in_channels, width, 1, relu=True)
        self.branch2b = ConvBN(width, width, 3, stride, relu=True)
        self.branch2c = ConvBN(width, out_channels, 1, relu=False)
        # Projection shortcut only where the identity would not fit (first block of a stage).
        needs_projection = stride != 1 or in_channels != out_channels
        self.branch1 = ConvBN(in_channels, out_channels, 1, stride, relu=False) if needs_projection else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.branch1 is None else self.branch1(x)
        return F.relu(self.branch2c(self.branch2b(self.branch2a(x))) + shortcut)


class ResNet(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.conv1 = ConvBN(3, config.width, 7, 2, relu=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.block_names: list[str] = []
        in_channels = config.width
        for stage, depth in enumerate(config.depths):
            width = config.width * 2**stage
            for i in range(depth):
                name = f"res{stage + 2}{string.ascii_lowercase[i]}"
                stride = 2 if i == 0 and stage > 0 else 1  # res2 keeps the maxpool's resolution
                setattr(self, name, Bottleneck(in_channels, width, stride))
                self.block_names.append(name)
                in_channels = width * _EXPANSION
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(config.dropout) if config.dropout > 0 else nn.Identity()
        self.fc = nn.Linear(in_channels, config.num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        # torchvision's init: He-normal convs (fan_out), unit BatchNorm; fc keeps Linear's default.
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, image: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.conv1(image))
        for name in self.block_names:
            x = getattr(self, name)(x)
        logits = self.fc(self.dropout(self.avgpool(x).flatten(1)))
        return F.cross_entropy(logits, label)


def build(config: str | Config = "tiny", *, seed: int = 0, **overrides: object) -> ResNet:
    """A ``ResNet`` in train mode (BatchNorm uses batch statistics: feed batches of 2 or more)."""
    cfg = resolve_config(CONFIGS, config, overrides)
    with seeded(seed):
        model = ResNet(cfg)
    return model.train()


def example_inputs(
    config: str | Config, batch: int, *, seed: int = 0, **overrides: object
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(image [B, 3, H, W] float32, label [B] int64)`` on CPU, drawn from a private generator."""
    cfg = resolve_config(CONFIGS, config, overrides)
    with torch.device("cpu"):  # the private generator is a CPU one, whatever the default device
        g = torch.Generator().manual_seed(seed)
        image = torch.randn(batch, 3, cfg.image_size, cfg.image_size, generator=g)
        label = torch.randint(0, cfg.num_classes, (batch,), generator=g)
        return image, label
