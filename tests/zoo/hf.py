"""Hugging Face transformers architectures, built tiny from configs with random weights.

Every model is wrapped so forward takes plain tensors and returns the loss HF computes
from `labels` (the wrapper's attribute `m` prefixes param names: `m.bert.embeddings...`).
Token inputs hold padding tokens, so a lost `padding_idx` shows as a wrong pad-row grad.
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 96
SEQ = 12
IMAGE = 32


class LMLoss(nn.Module):
    """input_ids, labels -> loss (masked LM, causal LM, seq2seq, sequence classification)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.m(input_ids=input_ids, labels=labels).loss


class ImageLoss(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.m(pixel_values=pixel_values, labels=labels).loss


class AudioLoss(nn.Module):
    def __init__(self, model: nn.Module, key: str) -> None:
        super().__init__()
        self.m = model
        self.key = key

    def forward(self, audio: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.m(**{self.key: audio}, labels=labels).loss


class ClipLoss(nn.Module):
    """CLIP's contrastive loss: its labels are arange(batch), so the batch is in the graph."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.m(input_ids=input_ids, pixel_values=pixel_values, return_loss=True).loss


def _tokens(batch: int, seed: int, pad: int, *, seq: int = SEQ, vocab: int = VOCAB) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    ids[ids == pad] = (pad + 1) % vocab
    ids[::2, :3] = (
        pad  # left padding on every other row: later tokens read the pad rows, whose grad must be 0
    )
    return ids


SEQS = (16, 7)  # a multiple of 16 and an odd length beside the default 12


def _shaped(inputs, again, seq: int):
    """Let `Entry.at(seq)` rebuild `inputs` for another sequence length (`again(seq)`)."""
    inputs.at = again
    inputs.shapes = SEQS if seq == SEQ else ()
    return inputs


def _mlm(pad: int, seq: int = SEQ):
    def inputs(batch: int, seed: int):
        ids = _tokens(batch, seed, pad, seq=seq)
        g = torch.Generator().manual_seed(seed + 7)
        labels = torch.randint(0, VOCAB, (batch, seq), generator=g)
        labels[torch.rand(batch, seq, generator=g) < 0.5] = -100
        labels[:, 0] = ids[:, 0]  # at least one target per row
        return ids, labels

    return _shaped(inputs, lambda s: _mlm(pad, s), seq)


def _clm(pad: int, seq: int = SEQ):
    def inputs(batch: int, seed: int):
        ids = _tokens(batch, seed, pad, seq=seq)
        labels = ids.clone()
        labels[ids == pad] = -100
        return ids, labels

    return _shaped(inputs, lambda s: _clm(pad, s), seq)


def _classify(pad: int, labels: int = 3, seq: int = SEQ):
    def inputs(batch: int, seed: int):
        ids = _tokens(batch, seed, pad, seq=seq)
        return ids, torch.randint(0, labels, (batch,), generator=torch.Generator().manual_seed(seed + 3))

    return _shaped(inputs, lambda s: _classify(pad, labels, s), seq)


def _images(labels: int = 3, size: int = IMAGE, channels: int = 3):
    def inputs(batch: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(batch, channels, size, size, generator=g), torch.randint(
            0, labels, (batch,), generator=g
        )

    return inputs


def _fill(config: dict, dropout: float) -> dict:
    def one(v):
        if isinstance(v, dict):
            return _fill(v, dropout)
        return dropout if isinstance(v, str) and v == D else v

    return {k: one(v) for k, v in config.items()}


def _build(cls_name: str, config_name: str, wrap=LMLoss, **config):
    def build(dropout: float) -> nn.Module:
        import transformers

        cfg_cls = getattr(transformers, config_name)
        cfg = cfg_cls(**_fill(config, dropout))
        torch.manual_seed(0)
        model = getattr(transformers, cls_name)(cfg)
        return wrap(model).train()

    return build


D = "DROPOUT"  # placeholder for the build's dropout probability
BERTISH = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=64,
    hidden_dropout_prob=D,
    attention_probs_dropout_prob=D,
)
LLAMAISH = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    attention_dropout=D,
)
MOEISH = dict(
    LLAMAISH,
    num_experts_per_tok=2,
    output_router_logits=True,  # the load-balancing aux loss joins the LM loss
    experts_implementation="eager",
)
BARTISH = dict(
    vocab_size=VOCAB,
    d_model=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    max_position_embeddings=64,
    dropout=D,
    attention_dropout=D,
    activation_dropout=D,
)
VITISH = dict(
    image_size=IMAGE,
    patch_size=8,
    num_channels=3,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    hidden_dropout_prob=D,
    attention_probs_dropout_prob=D,
    num_labels=3,
)


def entries(Entry) -> list:  # noqa: N803 (the dataclass, passed in to avoid an import cycle)
    e = Entry
    return [
        # encoders
        e(
            "hf-bert",
            "encoder",
            _build("BertForMaskedLM", "BertConfig", pad_token_id=0, **BERTISH),
            _mlm(0),
            ("m.bert.encoder.layer.*",),
            fast=True,
            why="padding_idx, tied MLM head",
        ),
        e(
            "hf-funnel",
            "encoder",
            _build(
                "FunnelForMaskedLM",
                "FunnelConfig",
                vocab_size=VOCAB,
                block_sizes=[1, 1],
                num_decoder_layers=2,
                d_model=32,
                n_head=4,
                d_head=8,
                d_inner=64,
                hidden_dropout=D,
                attention_dropout=D,
                activation_dropout=D,
            ),
            _mlm(0),
            ("m.funnel.encoder.blocks.*.0",),
            why="relative attention: one positional tensor into every layer's einsum with its param",
        ),
        e(
            "hf-squeezebert",
            "encoder",
            _build(
                "SqueezeBertForMaskedLM",
                "SqueezeBertConfig",
                vocab_size=VOCAB,
                hidden_size=32,
                embedding_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=64,
                q_groups=2,
                k_groups=2,
                v_groups=2,
                post_attention_groups=2,
                intermediate_groups=2,
                output_groups=2,
                hidden_dropout_prob=D,
                attention_probs_dropout_prob=D,
                pad_token_id=0,
            ),
            _mlm(0),
            ("m.transformer.encoder.layers.*",),
            why="layers called by .forward and returning dicts; grouped 1-D convolutions",
        ),
        e(
            "hf-roberta",
            "encoder",
            _build("RobertaForMaskedLM", "RobertaConfig", pad_token_id=1, **BERTISH),
            _mlm(1),
            ("m.roberta.encoder.layer.*",),
            why="padding_idx 1, position ids from padding",
        ),
        e(
            "hf-distilbert",
            "encoder",
            _build(
                "DistilBertForMaskedLM",
                "DistilBertConfig",
                vocab_size=VOCAB,
                dim=32,
                n_layers=2,
                n_heads=4,
                hidden_dim=64,
                max_position_embeddings=64,
                dropout=D,
                attention_dropout=D,
                pad_token_id=0,
            ),
            _mlm(0),
            ("m.distilbert.transformer.layer.*",),
        ),
        e(
            "hf-albert",
            "encoder",
            _build(
                "AlbertForMaskedLM",
                "AlbertConfig",
                embedding_size=16,
                pad_token_id=0,
                **{**BERTISH, "num_hidden_layers": 4},
            ),
            _mlm(0),
            ("m.albert.encoder.albert_layer_groups.0.albert_layers.0",),
            why="one layer called 4 times: per-call checkpoints",
        ),
        e(
            "hf-electra",
            "encoder",
            _build("ElectraForMaskedLM", "ElectraConfig", embedding_size=16, pad_token_id=0, **BERTISH),
            _mlm(0),
            ("m.electra.encoder.layer.*",),
        ),
        e(
            "hf-deberta-v2",
            "encoder",
            _build(
                "DebertaV2ForMaskedLM",
                "DebertaV2Config",
                pad_token_id=0,
                relative_attention=True,
                position_buckets=8,
                max_relative_positions=16,
                pos_att_type=["p2c", "c2p"],
                **BERTISH,
            ),
            _mlm(0),
            ("m.deberta.encoder.layer.*",),
            why="disentangled relative attention",
        ),
        e(
            "hf-bert-classify",
            "encoder",
            _build("BertForSequenceClassification", "BertConfig", pad_token_id=0, num_labels=3, **BERTISH),
            _classify(0),
            ("m.bert.encoder.layer.*",),
            why="pooler + classification head",
        ),
        # decoders
        e(
            "hf-gpt2",
            "decoder",
            _build(
                "GPT2LMHeadModel",
                "GPT2Config",
                vocab_size=VOCAB,
                n_embd=32,
                n_layer=2,
                n_head=4,
                n_positions=64,
                resid_pdrop=D,
                embd_pdrop=D,
                attn_pdrop=D,
            ),
            _clm(0),
            ("m.transformer.h.*",),
            fast=True,
            why="tied LM head, Conv1D, tanh GELU",
        ),
        e(
            "hf-opt",
            "decoder",
            _build(
                "OPTForCausalLM",
                "OPTConfig",
                vocab_size=VOCAB,
                hidden_size=32,
                num_hidden_layers=2,
                ffn_dim=64,
                num_attention_heads=4,
                max_position_embeddings=64,
                word_embed_proj_dim=32,
                dropout=D,
                attention_dropout=D,
                pad_token_id=1,
            ),
            _clm(1),
            ("m.model.decoder.layers.*",),
            why="padding_idx 1 tied to the LM head",
        ),
        e(
            "hf-llama",
            "decoder",
            _build("LlamaForCausalLM", "LlamaConfig", **LLAMAISH),
            _clm(0),
            ("m.model.layers.*",),
            fast=True,
            why="RMSNorm, RoPE, SwiGLU, GQA",
        ),
        e(
            "hf-gemma",
            "decoder",
            _build("GemmaForCausalLM", "GemmaConfig", head_dim=8, pad_token_id=0, **LLAMAISH),
            _clm(0),
            ("m.model.layers.*",),
            why="padding_idx 0 tied to the LM head, scaled embedding",
        ),
        e(
            "hf-mistral",
            "decoder",
            _build("MistralForCausalLM", "MistralConfig", sliding_window=8, **LLAMAISH),
            _clm(0),
            ("m.model.layers.*",),
            why="sliding-window mask",
        ),
        e(
            "hf-qwen2",
            "decoder",
            _build("Qwen2ForCausalLM", "Qwen2Config", **LLAMAISH),
            _clm(0),
            ("m.model.layers.*",),
            why="qkv biases",
        ),
        # mixtures of experts: HF's per-expert loop ("eager") is the torch reference; the export
        # runs the same layers as one grouped matmul over every expert (frontend/experts.py)
        e(
            "hf-mixtral",
            "decoder",
            _build(
                "MixtralForCausalLM", "MixtralConfig", **MOEISH, num_local_experts=4, router_aux_loss_coef=0.1
            ),
            _clm(0),
            ("m.model.layers.*",),
            fast=True,
            why="top-2 softmax routing over 4 experts, load-balancing aux loss",
        ),
        e(
            "hf-qwen2-moe",
            "decoder",
            _build(
                "Qwen2MoeForCausalLM",
                "Qwen2MoeConfig",
                **MOEISH,
                num_experts=4,
                moe_intermediate_size=16,
                shared_expert_intermediate_size=32,
                router_aux_loss_coef=0.1,
            ),
            _clm(0),
            ("m.model.layers.*",),
            why="shared expert with a sigmoid gate beside top-2 routing, aux loss",
        ),
        e(
            "hf-olmoe",
            "decoder",
            _build("OlmoeForCausalLM", "OlmoeConfig", **MOEISH, num_experts=4, moe_intermediate_size=16),
            _clm(0),
            ("m.model.layers.*",),
            why="q/k norms, unnormalised top-2 probabilities",
        ),
        e(
            "hf-deepseek-v3",
            "decoder",
            _build(
                "DeepseekV3ForCausalLM",
                "DeepseekV3Config",
                **dict(MOEISH, num_key_value_heads=4),  # MLA: one latent, every head its own k/v
                n_routed_experts=8,
                moe_intermediate_size=16,
                n_group=2,
                topk_group=1,
                n_shared_experts=1,
                first_k_dense_replace=1,
                kv_lora_rank=16,
                q_lora_rank=16,
                qk_rope_head_dim=4,
                qk_nope_head_dim=8,
                v_head_dim=8,
            ),
            _clm(0),
            ("m.model.layers.*",),
            why="MLA, sigmoid group-limited routing with a bias, shared expert, a dense first layer",
        ),
        e(
            "hf-gpt-oss",
            "decoder",
            _build(
                "GptOssForCausalLM",
                "GptOssConfig",
                **MOEISH,
                num_local_experts=4,
                head_dim=8,
                sliding_window=8,
                layer_types=["sliding_attention", "full_attention"],
                router_aux_loss_coef=0.1,
            ),
            _clm(0),
            ("m.model.layers.*",),
            why="clamped SwiGLU experts with biases, attention sinks, sliding window",
        ),
        e(
            "hf-gpt-neox",
            "decoder",
            _build(
                "GPTNeoXForCausalLM",
                "GPTNeoXConfig",
                vocab_size=VOCAB,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=64,
                max_position_embeddings=64,
                rotary_pct=0.5,
                hidden_dropout=D,
                attention_dropout=D,
            ),
            _clm(0),
            ("m.gpt_neox.layers.*",),
            why="parallel residual, partial rotary",
        ),
        e(
            "hf-phi",
            "decoder",
            _build(
                "PhiForCausalLM",
                "PhiConfig",
                vocab_size=VOCAB,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=64,
                max_position_embeddings=64,
                partial_rotary_factor=0.5,
                resid_pdrop=D,
                embd_pdrop=D,
                attention_dropout=D,
            ),
            _clm(0),
            ("m.model.layers.*",),
        ),
        e(
            "hf-bloom",
            "decoder",
            _build(
                "BloomForCausalLM",
                "BloomConfig",
                vocab_size=VOCAB,
                hidden_size=32,
                n_layer=2,
                n_head=4,
                hidden_dropout=D,
                attention_dropout=D,
            ),
            _clm(0),
            ("m.transformer.h.*",),
            why="ALiBi",
        ),
        # encoder-decoders
        e(
            "hf-bart",
            "encoder-decoder",
            _build("BartForConditionalGeneration", "BartConfig", pad_token_id=1, **BARTISH),
            _clm(1),
            ("m.model.encoder.layers.*", "m.model.decoder.layers.*"),
            fast=True,
            why="padding_idx 1 shared by encoder, decoder and LM head",
        ),
        e(
            "hf-t5",
            "encoder-decoder",
            _build(
                "T5ForConditionalGeneration",
                "T5Config",
                vocab_size=VOCAB,
                d_model=32,
                d_kv=8,
                d_ff=64,
                num_layers=2,
                num_heads=4,
                dropout_rate=D,
                pad_token_id=0,
                decoder_start_token_id=0,
            ),
            _clm(0),
            ("m.encoder.block.*", "m.decoder.block.*"),
            why="relative position bias",
        ),
        e(
            "hf-marian",
            "encoder-decoder",
            _build("MarianMTModel", "MarianConfig", decoder_start_token_id=1, pad_token_id=1, **BARTISH),
            _clm(1),
            ("m.model.encoder.layers.*", "m.model.decoder.layers.*"),
            why="sinusoidal positions",
        ),
        # vision transformers
        e(
            "hf-vit",
            "vision",
            _build("ViTForImageClassification", "ViTConfig", wrap=ImageLoss, **VITISH),
            _images(),
            ("m.vit.layers.*",),
            fast=True,
            why="cls token + position embeddings",
        ),
        e(
            "hf-deit",
            "vision",
            _build("DeiTForImageClassification", "DeiTConfig", wrap=ImageLoss, **VITISH),
            _images(),
            ("m.deit.layers.*",),
        ),
        e(
            "hf-swin",
            "vision",
            _build(
                "SwinForImageClassification",
                "SwinConfig",
                wrap=ImageLoss,
                image_size=IMAGE,
                patch_size=4,
                embed_dim=16,
                depths=[1, 1],
                num_heads=[2, 4],
                window_size=4,
                hidden_dropout_prob=D,
                attention_probs_dropout_prob=D,
                drop_path_rate=0.0,
                num_labels=3,
            ),
            _images(),
            ("m.swin.encoder.layers.*",),
            why="window attention, shifted windows",
        ),
        e(
            "hf-convnext",
            "cnn",
            _build(
                "ConvNextForImageClassification",
                "ConvNextConfig",
                wrap=ImageLoss,
                hidden_sizes=[8, 16],
                depths=[1, 1],
                num_stages=2,
                num_labels=3,
                drop_path_rate=0.0,
            ),
            _images(),
            ("m.convnext.encoder.stages.*",),
            why="depthwise conv, channels-last LayerNorm",
        ),
        e(
            "hf-resnet",
            "cnn",
            _build(
                "ResNetForImageClassification",
                "ResNetConfig",
                wrap=ImageLoss,
                embedding_size=8,
                hidden_sizes=[8, 16],
                depths=[1, 1],
                layer_type="bottleneck",
                num_labels=3,
            ),
            _images(),
            ("m.resnet.encoder.stages.*",),
            why="BatchNorm buffers",
        ),
        # audio
        e(
            "hf-wav2vec2",
            "audio",
            _build(
                "Wav2Vec2ForSequenceClassification",
                "Wav2Vec2Config",
                wrap=lambda m: AudioLoss(m, "input_values"),
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=64,
                conv_dim=(16, 16),
                conv_stride=(5, 2),
                conv_kernel=(10, 3),
                num_conv_pos_embeddings=16,
                num_conv_pos_embedding_groups=4,
                num_labels=3,
                hidden_dropout=D,
                attention_dropout=D,
                activation_dropout=D,
                feat_proj_dropout=D,
                final_dropout=D,
                mask_time_prob=0.0,
                do_stable_layer_norm=True,
                layerdrop=0.0,
            ),
            lambda b, s: (
                torch.randn(b, 400, generator=torch.Generator().manual_seed(s)),
                torch.randint(0, 3, (b,), generator=torch.Generator().manual_seed(s + 1)),
            ),
            ("m.wav2vec2.encoder.layers.*",),
            why="conv feature encoder, GroupNorm, weight-norm conv",
        ),
        e(
            "hf-whisper",
            "audio",
            _build(
                "WhisperForConditionalGeneration",
                "WhisperConfig",
                wrap=lambda m: AudioLoss(m, "input_features"),
                vocab_size=VOCAB,
                num_mel_bins=8,
                d_model=32,
                encoder_layers=1,
                decoder_layers=1,
                encoder_attention_heads=4,
                decoder_attention_heads=4,
                encoder_ffn_dim=64,
                decoder_ffn_dim=64,
                max_source_positions=16,
                max_target_positions=32,
                dropout=D,
                attention_dropout=D,
                activation_dropout=D,
                pad_token_id=0,
                decoder_start_token_id=1,
            ),
            lambda b, s: (
                torch.randn(b, 8, 32, generator=torch.Generator().manual_seed(s)),
                _clm(0)(b, s)[1],
            ),
            ("m.model.encoder.layers.*", "m.model.decoder.layers.*"),
            why="conv front end, encoder-decoder",
        ),
        # multimodal
        e(
            "hf-clip",
            "multimodal",
            _build(
                "CLIPModel",
                "CLIPConfig",
                wrap=ClipLoss,
                text_config=dict(
                    vocab_size=VOCAB,
                    hidden_size=32,
                    intermediate_size=64,
                    num_hidden_layers=2,
                    num_attention_heads=4,
                    max_position_embeddings=SEQ,
                    attention_dropout=D,
                ),
                vision_config=dict(
                    hidden_size=32,
                    intermediate_size=64,
                    num_hidden_layers=2,
                    num_attention_heads=4,
                    image_size=IMAGE,
                    patch_size=8,
                    attention_dropout=D,
                ),
                projection_dim=16,
            ),
            lambda b, s: (_tokens(b, s, 1), _images()(b, s)[0]),
            ("m.text_model.encoder.layers.*", "m.vision_model.encoder.layers.*"),
            export_kwargs={"dynamic_batch": False},
            why="contrastive loss: arange(batch) labels fix the batch",
        ),
    ]
