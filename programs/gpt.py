"""GPT-2 (117M/124M) language model with Hugging Face module paths.

``transformer.h.N.attn.c_attn`` etc. as in ``transformers.GPT2LMHeadModel``, but with ``nn.Linear``
instead of GPT-2's transposed ``Conv1D`` (same parameter count, ordinary MatMul+Add in the graph).
``lm_head`` has no bias and its weight is tied to ``transformer.wte`` (one parameter, listed once).
Attention is causal ``F.scaled_dot_product_attention``; each block returns one tensor, so
``transformer.h.N`` is addressable as a checkpoint.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from programs import resolve_config, seeded


@dataclasses.dataclass(frozen=True)
class Config:
    vocab_size: int = 50257
    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    seq_len: int = 1024  # length of example_inputs; at most max_position
    max_position: int = 1024
    dropout: float = 0.1  # embedding, attention-probability and residual dropout, as GPT-2's 0.1 each
    layer_norm_eps: float = 1e-5
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}"
            )
        if self.seq_len > self.max_position:
            raise ValueError(f"seq_len {self.seq_len} exceeds max_position {self.max_position}")


CONFIGS: dict[str, Config] = {
    "tiny": Config(vocab_size=100, hidden_size=32, num_layers=2, num_heads=2, seq_len=16, max_position=16),
    "gpt2": Config(),
}

INPUT_NAMES: tuple[str, ...] = ("input_ids", "labels")

DEFAULT_CHECKPOINTS: list[str] = ["transformer.h.*"]


class Attention(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.hidden_size = config.hidden_size
        self.dropout_p = config.dropout
        self.c_attn = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.c_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.resid_dropout = nn.Dropout(config.dropout)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        # [B, S, H*D] -> [B, H, S, D]; unflatten avoids naming the (symbolic) batch size.
        return x.unflatten(-1, (self.num_heads, -1)).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(x).split(self.hidden_size, dim=-1)
        context = F.scaled_dot_product_attention(
            self._heads(q),
            self._heads(k),
            self._heads(v),
            dropout_p=self.dropout_p if self.training else 0.0,
            is_causal=True,
        )
        return self.resid_dropout(self.c_proj(context.transpose(1, 2).flatten(2)))


class MLP(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.hidden_size, 4 * config.hidden_size)
        self.c_proj = nn.Linear(4 * config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))  # GPT-2's gelu_new


class Block(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attn = Attention(config)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Transformer(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_position, config.hidden_size)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # The sequence length is static under a batch-only dynamic export, so this is a constant.
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.drop(self.wte(input_ids) + self.wpe(position_ids))
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


class GPT2LMHeadModel(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.transformer = Transformer(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied: one parameter
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2's init: N(0, 0.02) weights, zero biases, unit LayerNorm; the projections that write
        # into the residual stream are scaled by 1/sqrt(2 * num_layers) (GPT-2 paper, section 2.3).
        std = self.config.initializer_range
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)) and module is not self.lm_head:
                scale = 1 / math.sqrt(2 * self.config.num_layers) if name.endswith("c_proj") else 1.0
                nn.init.normal_(module.weight, mean=0.0, std=std * scale)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.transformer(input_ids))
        # Position t predicts token t+1; -100 labels are ignored, as in Hugging Face.
        shift_logits = logits[:, :-1].flatten(0, 1)
        shift_labels = labels[:, 1:].flatten()
        return F.cross_entropy(shift_logits, shift_labels, ignore_index=-100)


def build(config: str | Config = "tiny", *, seed: int = 0, **overrides: object) -> GPT2LMHeadModel:
    """A ``GPT2LMHeadModel`` in train mode; overrides such as ``num_layers=4, seq_len=128`` apply."""
    cfg = resolve_config(CONFIGS, config, overrides)
    with seeded(seed):
        model = GPT2LMHeadModel(cfg)
    return model.train()


def example_inputs(
    config: str | Config, batch: int, *, seed: int = 0, **overrides: object
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids [B, S] int64, labels [B, S] int64)`` on CPU; labels are the ids (shifted in forward)."""
    cfg = resolve_config(CONFIGS, config, overrides)
    with torch.device("cpu"):  # the private generator is a CPU one, whatever the default device
        g = torch.Generator().manual_seed(seed)
        input_ids = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g)
        return input_ids, input_ids.clone()
