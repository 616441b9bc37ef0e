"""BERT pre-training (masked LM + next-sentence prediction) with Hugging Face module paths.

Module paths follow ``transformers.BertForPreTraining`` (``bert.encoder.layer.3.attention.self.query``
and so on) so checkpoint names read as users know them. The MLM decoder's weight is tied to the
word embeddings (one parameter, listed once) and has a bias of its own.

Attention goes through ``F.scaled_dot_product_attention`` with an additive padding mask, and each
encoder layer returns one tensor, so ``bert.encoder.layer.N`` is addressable as a checkpoint.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from programs import resolve_config, seeded


@dataclasses.dataclass(frozen=True)
class Config:
    vocab_size: int = 30522
    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    intermediate_size: int = 3072
    seq_len: int = 512  # length of example_inputs; at most max_position
    max_position: int = 512
    type_vocab_size: int = 2
    dropout: float = 0.1  # hidden and attention-probability dropout alike, as in BERT's release
    layer_norm_eps: float = 1e-12
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}"
            )
        if self.seq_len > self.max_position:
            raise ValueError(f"seq_len {self.seq_len} exceeds max_position {self.max_position}")


CONFIGS: dict[str, Config] = {
    "tiny": Config(
        vocab_size=100,
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        intermediate_size=64,
        seq_len=16,
        max_position=64,
    ),
    "base": Config(),
    "large": Config(hidden_size=1024, num_layers=24, num_heads=16, intermediate_size=4096),
}

INPUT_NAMES: tuple[str, ...] = (
    "input_ids",
    "token_type_ids",
    "attention_mask",
    "mlm_labels",
    "next_sentence_label",
)

DEFAULT_CHECKPOINTS: list[str] = ["bert.encoder.layer.*"]

# Added to the attention scores of padding keys. Finite (unlike finfo.min) so that adding it to a
# score cannot overflow to -inf, and representable in float16 for mixed precision.
_MASK_VALUE = -10000.0
_MLM_PROBABILITY = 0.15


class BertEmbeddings(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        # The sequence length is static under a batch-only dynamic export, so this is a constant.
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(position_ids)
            + self.token_type_embeddings(token_type_ids)
        )
        return self.dropout(self.LayerNorm(x))


class BertSelfAttention(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.dropout_p = config.dropout
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        # [B, S, H*D] -> [B, H, S, D]; unflatten avoids naming the (symbolic) batch size.
        return x.unflatten(-1, (self.num_heads, -1)).transpose(1, 2)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        context = F.scaled_dot_product_attention(
            self._heads(self.query(hidden)),
            self._heads(self.key(hidden)),
            self._heads(self.value(hidden)),
            attn_mask=mask,
            dropout_p=self.dropout_p if self.training else 0.0,
        )
        return context.transpose(1, 2).flatten(2)


class BertSelfOutput(nn.Module):
    """Projection + dropout + residual + LayerNorm; HF calls it ``attention.output``."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dropout(self.dense(hidden)) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(hidden, mask), hidden)


class BertIntermediate(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(hidden))  # exact (erf) GELU, as BERT


class BertOutput(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dropout(self.dense(hidden)) + residual)


class BertLayer(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        attended = self.attention(hidden, mask)
        return self.output(self.intermediate(attended), attended)


class BertEncoder(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_layers))

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            hidden = layer(hidden, mask)
        return hidden


class BertPooler(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(hidden[:, 0]))  # the [CLS] position


class BertModel(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config)

    def forward(
        self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.embeddings(input_ids, token_type_ids)
        # [B, S] keep-mask -> [B, 1, 1, S] additive mask, broadcast over heads and query positions.
        keep = attention_mask[:, None, None, :].to(hidden.dtype)
        mask = (1.0 - keep) * _MASK_VALUE
        sequence = self.encoder(hidden, mask)
        return sequence, self.pooler(sequence)


class BertPredictionHeadTransform(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(F.gelu(self.dense(hidden)))


class BertLMPredictionHead(nn.Module):
    def __init__(self, config: Config, word_embeddings: nn.Embedding) -> None:
        super().__init__()
        self.transform = BertPredictionHeadTransform(config)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)
        self.decoder.weight = word_embeddings.weight  # tied: one parameter, its own bias

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.transform(hidden))


class BertPreTrainingHeads(nn.Module):
    def __init__(self, config: Config, word_embeddings: nn.Embedding) -> None:
        super().__init__()
        self.predictions = BertLMPredictionHead(config, word_embeddings)
        self.seq_relationship = nn.Linear(config.hidden_size, 2)

    def forward(self, sequence: torch.Tensor, pooled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.predictions(sequence), self.seq_relationship(pooled)


class BertForPreTraining(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.bert = BertModel(config)
        self.cls = BertPreTrainingHeads(config, self.bert.embeddings.word_embeddings)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        # BERT's init: N(0, 0.02) weights, zero biases, unit LayerNorm. The tied decoder weight is
        # the embedding tensor, drawn once more when the decoder is visited; harmless.
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        mlm_labels: torch.Tensor,
        next_sentence_label: torch.Tensor,
    ) -> torch.Tensor:
        sequence, pooled = self.bert(input_ids, token_type_ids, attention_mask)
        prediction_scores, seq_relationship_score = self.cls(sequence, pooled)
        mlm_loss = F.cross_entropy(prediction_scores.flatten(0, 1), mlm_labels.flatten(), ignore_index=-100)
        nsp_loss = F.cross_entropy(seq_relationship_score, next_sentence_label)
        return mlm_loss + nsp_loss


def build(config: str | Config = "tiny", *, seed: int = 0, **overrides: object) -> BertForPreTraining:
    """A ``BertForPreTraining`` in train mode; overrides such as ``num_layers=24, seq_len=128`` apply."""
    cfg = resolve_config(CONFIGS, config, overrides)
    with seeded(seed):
        model = BertForPreTraining(cfg)
    return model.train()


def example_inputs(
    config: str | Config, batch: int, *, seed: int = 0, **overrides: object
) -> tuple[torch.Tensor, ...]:
    """Synthetic pre-training batch on CPU, in ``INPUT_NAMES`` order.

    Each sequence has a random length in [seq_len/2, seq_len] (the rest is padding, masked out),
    two segments (token type 0 then 1), ~15% of its real tokens as MLM targets (-100 elsewhere;
    position 1 always, so the MLM loss is defined) and a random next-sentence label.
    """
    cfg = resolve_config(CONFIGS, config, overrides)
    with torch.device("cpu"):  # the private generator is a CPU one, whatever the default device
        g = torch.Generator().manual_seed(seed)
        seq = cfg.seq_len
        positions = torch.arange(seq)
        lengths = torch.randint(max(seq // 2, 2), seq + 1, (batch, 1), generator=g)
        attention_mask = (positions < lengths).long()
        split = torch.randint(1, seq, (batch, 1), generator=g)
        token_type_ids = ((positions >= split) & attention_mask.bool()).long()
        input_ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g) * attention_mask
        targets = (torch.rand(batch, seq, generator=g) < _MLM_PROBABILITY) | (positions == 1)
        mlm_labels = torch.where(targets & attention_mask.bool(), input_ids, torch.full_like(input_ids, -100))
        next_sentence_label = torch.randint(0, 2, (batch,), generator=g)
        return input_ids, token_type_ids, attention_mask, mlm_labels, next_sentence_label
