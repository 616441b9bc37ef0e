"""torchvision architectures, built small from their model classes (random weights).

torchvision comes with the `zoo` extra (`pip install -e ".[test,zoo]"`, as CI installs); without
it these entries skip. Its PyPI wheel is a CUDA build whose C extension does not load beside a
CPU torch; `import metaopt` makes it importable anyway (metaopt/compat.py), as the classification
models here are pure Python.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from metaopt.compat import make_torchvision_importable

IMAGE = 32


def import_torchvision():
    """torchvision, importable beside this torch; the calling test skips when it is not installed
    (the `test` extra leaves it out: see pyproject.toml's `zoo` extra)."""
    if not make_torchvision_importable():
        pytest.skip("torchvision is not installed (pip install -e '.[zoo]')")
    import torchvision

    return torchvision


class ClassifyLoss(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.m(images), labels)


SIZES = (64, 72)  # feature maps that end at 2x2; odd on the way (72: 9, 5, 3)


def images_at(size: int, classes: int = 3, sizes: tuple = ()):
    """(batch, seed) -> random images of `size` x `size` and labels; `at(size)` for another size."""

    def inputs(batch: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        images = torch.randn(batch, 3, size, size, generator=g)
        return images, torch.randint(0, classes, (batch,), generator=g)

    inputs.at = lambda s: images_at(s, classes)
    inputs.shapes = sizes
    return inputs


_images = images_at(IMAGE, sizes=SIZES)
_fixed_images = images_at(IMAGE)  # models built for one image size (ViT's position embeddings)


def _build(make):
    def build(dropout: float) -> nn.Module:
        tv = import_torchvision()
        torch.manual_seed(0)
        return ClassifyLoss(make(tv.models, dropout)).train()

    return build


def _vit(models, p):
    from torchvision.models.vision_transformer import VisionTransformer

    return VisionTransformer(
        image_size=IMAGE,
        patch_size=8,
        num_layers=2,
        num_heads=4,
        hidden_dim=32,
        mlp_dim=64,
        dropout=p,
        attention_dropout=p,
        num_classes=3,
    )


def _swin(models, p):
    from torchvision.models.swin_transformer import SwinTransformer

    return SwinTransformer(
        patch_size=[4, 4],
        embed_dim=16,
        depths=[1, 1],
        num_heads=[2, 4],
        window_size=[4, 4],
        dropout=p,
        attention_dropout=p,
        stochastic_depth_prob=0.0,
        num_classes=3,
    )


def _convnext(models, p):
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    return ConvNeXt(
        [CNBlockConfig(8, 16, 1), CNBlockConfig(16, None, 1)], stochastic_depth_prob=0.0, num_classes=3
    )


def _densenet(models, p):
    from torchvision.models.densenet import DenseNet

    return DenseNet(
        growth_rate=8, block_config=(2, 2), num_init_features=16, bn_size=2, drop_rate=p, num_classes=3
    )


def entries(Entry) -> list:  # noqa: N803
    e = Entry
    return [
        e(
            "tv-resnet18",
            "cnn",
            _build(lambda m, p: m.resnet18(num_classes=3)),
            _images,
            ("m.layer1", "m.layer2", "m.layer3"),
            why="BasicBlock, BatchNorm buffers, in-place ReLU",
        ),
        e(
            "tv-vit",
            "vision",
            _build(_vit),
            _fixed_images,
            ("m.encoder.layers.*",),
            fast=True,
            why="nn.MultiheadAttention, class token",
        ),
        e("tv-swin", "vision", _build(_swin), _images, ("m.features.*",), why="shifted windows, roll"),
        e(
            "tv-mobilenet-v2",
            "cnn",
            _build(lambda m, p: m.mobilenet_v2(width_mult=0.25, dropout=p, num_classes=3)),
            _images,
            ("m.features.*",),
            why="ReLU6, depthwise conv",
        ),
        e(
            "tv-mobilenet-v3",
            "cnn",
            _build(lambda m, p: m.mobilenet_v3_small(width_mult=0.25, dropout=p, num_classes=3)),
            _images,
            ("m.features.*",),
            why="hardswish, squeeze-excitation",
        ),
        e(
            "tv-efficientnet",
            "cnn",
            _build(lambda m, p: m.efficientnet_b0(dropout=p, stochastic_depth_prob=0.0, num_classes=3)),
            _images,
            ("m.features.*",),
            why="SiLU, squeeze-excitation",
        ),
        e("tv-convnext", "cnn", _build(_convnext), _images, ("m.features.*",), why="layer scale, permutes"),
        e(
            "tv-densenet",
            "cnn",
            _build(_densenet),
            _images,
            ("m.features.denseblock1", "m.features.denseblock2"),
            why="concatenations, BatchNorm",
        ),
        e(
            "tv-shufflenet",
            "cnn",
            _build(lambda m, p: m.shufflenet_v2_x0_5(num_classes=3)),
            _images,
            ("m.stage2", "m.stage3", "m.stage4"),
            why="channel shuffle",
        ),
        e(
            "tv-mnasnet",
            "cnn",
            _build(lambda m, p: m.mnasnet0_5(num_classes=3, dropout=p)),
            _images,
            ("m.layers.8", "m.layers.10", "m.layers.12"),
            why="inverted residuals, BatchNorm momentum 3e-4",
        ),
        e(
            "tv-squeezenet",
            "cnn",
            _build(lambda m, p: m.squeezenet1_1(dropout=p, num_classes=3)),
            _images,
            ("m.features.*",),
            why="fire modules, ceil-mode pooling",
        ),
    ]
