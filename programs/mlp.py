"""A three-layer perceptron classifier: the smallest program with dropout in it.

fc1 -> ReLU -> Dropout -> fc2 -> ReLU -> Dropout -> fc3 -> cross-entropy.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from programs import resolve_config, seeded


@dataclasses.dataclass(frozen=True)
class Config:
    in_features: int = 784
    hidden_size: int = 1024
    num_classes: int = 10
    dropout: float = 0.1


CONFIGS: dict[str, Config] = {
    "tiny": Config(in_features=16, hidden_size=32, num_classes=4),
    "base": Config(),
}

INPUT_NAMES: tuple[str, ...] = ("x", "label")

# The fc outputs: recomputing from them re-runs ReLU and Dropout, which exercises mask replay.
DEFAULT_CHECKPOINTS: list[str] = ["fc1", "fc2"]


class MLP(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.fc1 = nn.Linear(config.in_features, config.hidden_size)
        self.relu1 = nn.ReLU()
        self.dropout1 = nn.Dropout(config.dropout)
        self.fc2 = nn.Linear(config.hidden_size, config.hidden_size)
        self.relu2 = nn.ReLU()
        self.dropout2 = nn.Dropout(config.dropout)
        self.fc3 = nn.Linear(config.hidden_size, config.num_classes)

    def forward(self, x: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        h = self.dropout1(self.relu1(self.fc1(x)))
        h = self.dropout2(self.relu2(self.fc2(h)))
        return F.cross_entropy(self.fc3(h), label)


def build(config: str | Config = "tiny", *, seed: int = 0, **overrides: object) -> MLP:
    """An ``MLP`` in train mode with weights drawn from ``seed`` (torch's default Linear init)."""
    cfg = resolve_config(CONFIGS, config, overrides)
    with seeded(seed):
        model = MLP(cfg)
    return model.train()


def example_inputs(
    config: str | Config, batch: int, *, seed: int = 0, **overrides: object
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x [B, in_features] float32, label [B] int64)`` on CPU, drawn from a private generator."""
    cfg = resolve_config(CONFIGS, config, overrides)
    with torch.device("cpu"):  # the private generator is a CPU one, whatever the default device
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(batch, cfg.in_features, generator=g)
        label = torch.randint(0, cfg.num_classes, (batch,), generator=g)
        return x, label
