"""torchvision architectures, built small from their model classes (random weights).

The torchvision wheels here are CUDA builds whose C extension (detection ops: nms,
roi_align ...) does not load with torch 2.13 CPU, while the model code is pure Python.
`import_torchvision` loads the extension when it can; when it cannot, it declares the two
op schemas torchvision's import registers fake kernels for (`nms`, `qnms`), so the import
succeeds and the classification models work. Calling a detection op then fails loudly in
torch ("no kernel"): nothing is faked beyond the schema.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

IMAGE = 32


@functools.cache
def make_torchvision_importable() -> bool:
    """Load torchvision's C extension, or declare the schemas its import needs; False when
    torchvision is not installed. Run before anything imports torchvision (transformers does)."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return False
    for lib in sorted(Path(spec.origin).parent.glob("_C*.so")):
        try:
            torch.ops.load_library(str(lib))
            return True
        except OSError:
            continue
    global _SCHEMAS
    _SCHEMAS = torch.library.Library("torchvision", "FRAGMENT")  # kept alive: it owns the schemas
    _SCHEMAS.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _SCHEMAS.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    return True


_SCHEMAS = None


def import_torchvision():
    if not make_torchvision_importable():
        raise ImportError("torchvision is not installed (pip install -e '.[zoo]')")
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
