"""Hand-built edge cases: the things real models do that the reference programs do not."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 40
SEQ = 8
WIDTH = 16


def _tokens(batch: int, seed: int, pad: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
    ids[:, -2:] = pad
    return ids


def _tokens_and_targets(pad: int):
    def inputs(batch: int, seed: int):
        ids = _tokens(batch, seed, pad)
        return ids, torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(seed + 1))

    return inputs


class Block(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.drop(F.gelu(self.fc(x))))


class TiedPadded(nn.Module):
    """Embedding with padding_idx tied to the output projection: only the lookup's pad-row
    contribution is dropped, the projection's reaches the shared weight."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH, padding_idx=3)
        self.blocks = nn.ModuleList([Block(p) for _ in range(2)])
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for b in self.blocks:
            h = b(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


class Padded(nn.Module):
    """Two embeddings with padding indices (one not 0), as in token + segment embeddings."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH, padding_idx=VOCAB - 1)
        self.pos = nn.Embedding(SEQ + 1, WIDTH, padding_idx=0)
        self.blocks = nn.ModuleList([Block(p) for _ in range(2)])
        self.out = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(1, ids.shape[1] + 1).masked_fill(ids[0] == VOCAB - 1, 0)
        h = self.tok(ids) + self.pos(positions)
        for b in self.blocks:
            h = b(h)
        return F.cross_entropy(self.out(h).flatten(0, 1), targets.flatten())


class Shared(nn.Module):
    """One block called three times (ALBERT-style weight sharing): each call is a checkpoint."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.layer = Block(p)
        self.out = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for _ in range(3):
            h = self.layer(h)
        return F.cross_entropy(self.out(h).flatten(0, 1), targets.flatten())


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, rank: int = 2) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(rank, base.in_features) * 0.1)
        self.b = nn.Parameter(torch.randn(base.out_features, rank) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.a.t()) @ self.b.t()


class LoRA(nn.Module):
    """Frozen base weights with trainable low-rank adapters and a frozen embedding."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH).requires_grad_(False)
        self.blocks = nn.ModuleList([Block(p) for _ in range(2)])
        for b in self.blocks:
            b.fc = LoRALinear(b.fc)
            b.norm.requires_grad_(False)
        self.out = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for b in self.blocks:
            h = b(h)
        return F.cross_entropy(self.out(h).flatten(0, 1), targets.flatten())


class InPlace(nn.Module):
    """In-place ops as users write them: relu_, add_, masked_fill_, slice assignment, mul_."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.fc1 = nn.Linear(WIDTH, WIDTH)
        self.fc2 = nn.Linear(WIDTH, WIDTH)
        self.drop = nn.Dropout(p, inplace=True)
        self.out = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        a = self.fc1(h)
        a.add_(h)  # (each write is one torch's autograd accepts: nothing it saved is overwritten)
        a.relu_()
        c = a * 1.5
        c[:, 0] = c[:, 0] * 2.0
        c.masked_fill_(ids.unsqueeze(-1) == 0, 0.0)
        b = self.drop(self.fc2(c))
        b.mul_(0.5)
        return F.cross_entropy(self.out(b + c).flatten(0, 1), targets.flatten())


class Norms(nn.Module):
    """BatchNorm1d/2d buffers in train mode, GroupNorm, InstanceNorm: stats and running buffers."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.gn = nn.GroupNorm(2, 8)
        self.inorm = nn.InstanceNorm2d(8, affine=True)
        self.drop = nn.Dropout2d(p)
        self.fc = nn.Linear(8, 16)
        self.bn2 = nn.BatchNorm1d(16)
        self.out = nn.Linear(16, 3)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(images)))
        h = self.drop(F.relu(self.inorm(self.gn(self.conv2(h)))))
        h = F.relu(self.bn2(self.fc(h.mean((2, 3)))))
        return F.cross_entropy(self.out(h), labels)


class Contrastive(nn.Module):
    """A CLIP-style loss: labels are arange(batch), so the batch size is part of the graph."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.a = nn.Linear(12, WIDTH)
        self.b = nn.Linear(10, WIDTH)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        za = F.normalize(self.drop(self.a(x)), dim=-1)
        zb = F.normalize(self.b(y), dim=-1)
        logits = za @ zb.t() * 10.0
        labels = torch.arange(x.shape[0])
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


def _images(batch: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, 8, 8, generator=g), torch.randint(0, 3, (batch,), generator=g)


def _pairs(batch: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 12, generator=g), torch.randn(batch, 10, generator=g)


def _build(cls):
    def build(dropout: float) -> nn.Module:
        torch.manual_seed(0)
        return cls(dropout).train()

    return build


def entries(Entry) -> list:  # noqa: N803
    e = Entry
    return [
        e(
            "edge-tied-padding",
            "edge",
            _build(TiedPadded),
            _tokens_and_targets(3),
            ("blocks.*",),
            fast=True,
            why="padding_idx on an embedding tied to the output projection",
        ),
        e(
            "edge-padding",
            "edge",
            _build(Padded),
            _tokens_and_targets(VOCAB - 1),
            ("blocks.*",),
            fast=True,
            why="padding_idx not 0, two embeddings",
        ),
        e(
            "edge-shared-layer",
            "edge",
            _build(Shared),
            _tokens_and_targets(0),
            ("layer",),
            fast=True,
            why="one module called 3 times",
        ),
        e(
            "edge-lora",
            "edge",
            _build(LoRA),
            _tokens_and_targets(0),
            ("blocks.*",),
            fast=True,
            why="frozen base weights, trainable adapters",
        ),
        e(
            "edge-inplace",
            "edge",
            _build(InPlace),
            _tokens_and_targets(0),
            ("fc1", "fc2"),
            fast=True,
            why="relu_, add_, slice assignment, masked_fill_, in-place dropout",
        ),
        e(
            "edge-norms",
            "edge",
            _build(Norms),
            _images,
            ("conv2", "fc"),
            fast=True,
            why="BatchNorm1d/2d buffers, GroupNorm, InstanceNorm, Dropout2d",
        ),
        e(
            "edge-contrastive",
            "edge",
            _build(Contrastive),
            _pairs,
            ("a", "b"),
            fast=True,
            export_kwargs={"dynamic_batch": False},
            why="arange(batch) labels fix the batch",
        ),
    ]
