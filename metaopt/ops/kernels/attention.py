"""Attention (opset 23-25) and RotaryEmbedding (opset 23), following the ONNX reference.

Attention is written out (scaled QK^T, bias, softmax, PV) rather than routed through
``F.scaled_dot_product_attention``: ONNX fixes details SDPA does not share (scale split
between Q and K, softcap, a fully masked row giving zeros instead of NaN, the optional
``qk_matmul_output``).
"""

from __future__ import annotations

import math

import torch

from metaopt.ir.dtypes import torch_dtype_from_onnx
from metaopt.ops.registry import register

_MODE_WITH_BIAS = 2
_MODE_AFTER_SOFTMAX = 3


def _heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(batch, seq, heads * size) -> (batch, heads, seq, size)."""
    b, s, hidden = x.shape
    return x.reshape(b, s, num_heads, hidden // num_heads).transpose(1, 2)


def _bias_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """True (attend) -> 0, False -> -inf, as ONNX's Where(allowed, 0, -inf)."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.full((), -math.inf, dtype=dtype, device=allowed.device))


def _offset_diff(q_len: int, kv_len: int, offset, device) -> torch.Tensor:
    """(query position + offset) - key position; per batch when `offset` is a tensor."""
    i = torch.arange(q_len, device=device).reshape(q_len, 1)
    j = torch.arange(kv_len, device=device).reshape(1, kv_len)
    if isinstance(offset, torch.Tensor):
        return (i + offset.reshape(-1, 1, 1).to(device)) - j  # (batch, q, kv)
    return (i + offset) - j


def _per_batch(bias: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
    # A per-batch (batch, q, kv) bias gets its head axis so masks keep right-aligned broadcasting.
    return bias + (extra.unsqueeze(1) if extra.dim() == 3 else extra)


# aliases: the present key/value are K, V when there is no past
@register("Attention", needs_outputs=True, aliases=((1, 1), (2, 2)), amp="white")
def attention(
    Q: torch.Tensor,
    K: torch.Tensor,
    V: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    past_key: torch.Tensor | None = None,
    past_value: torch.Tensor | None = None,
    nonpad_kv_seqlen: torch.Tensor | None = None,
    is_causal: int = 0,
    kv_num_heads: int | None = None,
    q_num_heads: int | None = None,
    qk_matmul_output_mode: int = 0,
    scale: float | None = None,
    softcap: float = 0.0,
    softmax_precision: int | None = None,
    left_window_size: int = -1,
    right_window_size: int = -1,
    _nout: int = 1,
):
    three_d = Q.dim() == 3
    if three_d:
        Q, K, V = _heads(Q, q_num_heads), _heads(K, kv_num_heads), _heads(V, kv_num_heads)
    dtype = Q.dtype
    # The scale is split as sqrt(scale) on both Q and K, rounded to Q's type, as ONNX does.
    root = math.sqrt(scale if scale is not None else 1.0 / math.sqrt(Q.shape[3]))
    root = torch.tensor(root, dtype=dtype, device=Q.device)
    if past_key is not None:
        K = torch.cat((past_key, K), 2)
    if past_value is not None:
        V = torch.cat((past_value, V), 2)
    present_key, present_value = K, V
    q_len, kv_len = Q.shape[2], K.shape[2]

    if attn_mask is not None and attn_mask.shape[-1] < kv_len:
        # A short mask covers the first keys; the rest are masked out.
        fill = False if attn_mask.dtype == torch.bool else -math.inf
        pad = [0, kv_len - attn_mask.shape[-1]]
        attn_mask = torch.nn.functional.pad(attn_mask, pad, value=fill)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = _bias_mask(attn_mask, dtype)

    if past_key is None and nonpad_kv_seqlen is not None:
        offset = nonpad_kv_seqlen.reshape(-1) - q_len  # external cache: per-batch frontier
    else:
        offset = past_key.shape[2] if past_key is not None else 0
    windowed = left_window_size >= 0 or right_window_size >= 0
    bias = torch.zeros((q_len, kv_len), dtype=dtype, device=Q.device)
    if is_causal:
        if attn_mask is not None:
            bias = bias + attn_mask if windowed else attn_mask
        bias = _per_batch(bias, _bias_mask(_offset_diff(q_len, kv_len, offset, Q.device) >= 0, dtype))
    elif attn_mask is not None:
        bias = bias + attn_mask
    if windowed:
        diff = _offset_diff(q_len, kv_len, offset, Q.device)
        allowed = torch.ones_like(diff, dtype=torch.bool)
        if left_window_size >= 0:
            allowed &= diff <= left_window_size
        if right_window_size >= 0:
            allowed &= -diff <= right_window_size
        bias = _per_batch(bias, _bias_mask(allowed, dtype))
    if nonpad_kv_seqlen is not None:
        keep = torch.arange(kv_len, device=Q.device) < nonpad_kv_seqlen.to(Q.device).reshape(-1, 1)
        bias = bias + _bias_mask(keep, dtype).reshape(-1, 1, 1, kv_len)

    if K.shape[1] != Q.shape[1]:  # grouped-query attention: repeat each kv head
        reps = Q.shape[1] // K.shape[1]
        K, V = K.repeat_interleave(reps, 1), V.repeat_interleave(reps, 1)

    qk = torch.matmul(Q * root, K.transpose(2, 3) * root)
    if softcap > 0:
        qk = torch.tanh(qk / softcap) * softcap
    scores = qk + bias
    qk_out = scores if qk_matmul_output_mode == _MODE_WITH_BIAS else qk
    if softmax_precision is not None:
        scores = scores.to(torch_dtype_from_onnx(softmax_precision, what="Attention softmax_precision"))
    # Rows with every key masked have no attendable key: ONNX gives them zeros, not NaN.
    dead = torch.isneginf(bias.amax(-1, keepdim=True))
    probs = torch.softmax(scores, -1)
    probs = torch.where(dead, torch.zeros((), dtype=probs.dtype, device=probs.device), probs)
    if qk_matmul_output_mode == _MODE_AFTER_SOFTMAX:
        qk_out = probs
    y = torch.matmul(probs.to(dtype), V)
    if three_d:
        y = y.transpose(1, 2).reshape(y.shape[0], y.shape[2], -1)
    if _nout == 1:
        return y
    return (y, present_key, present_value, qk_out.to(dtype))[:_nout]


@register("RotaryEmbedding")
def rotary_embedding(
    X: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    interleaved: int = 0,
    num_heads: int | None = None,
    rotary_embedding_dim: int = 0,
) -> torch.Tensor:
    shape = X.shape
    # Work in (batch, seq, heads, head_size).
    x = X.transpose(1, 2) if X.dim() == 4 else X.reshape(shape[0], shape[1], num_heads, -1)
    dim = rotary_embedding_dim or x.shape[3]
    rot, rest = x[..., :dim], x[..., dim:]
    if position_ids is not None:
        cos_cache = cos_cache[position_ids.to(device=cos_cache.device, dtype=torch.int64)]
        sin_cache = sin_cache[position_ids.to(device=sin_cache.device, dtype=torch.int64)]
    cos, sin = cos_cache.unsqueeze(2), sin_cache.unsqueeze(2)
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    else:
        x1, x2 = rot.chunk(2, -1)
    real = cos * x1 - sin * x2
    imag = sin * x1 + cos * x2
    if interleaved:
        rot = torch.stack((real, imag), -1).reshape(rot.shape)
    else:
        rot = torch.cat((real, imag), -1)
    out = torch.cat((rot, rest), -1)
    return out.reshape(shape) if X.dim() == 3 else out.transpose(1, 2)
