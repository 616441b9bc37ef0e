"""Attention (opset 23-25) and RotaryEmbedding (opset 23), following the ONNX reference.

Attention is written out (scaled QK^T, bias, softmax, PV) rather than routed through
``F.scaled_dot_product_attention``: ONNX fixes details SDPA does not share (scale split
between Q and K, softcap, a fully masked row giving zeros instead of NaN, the optional
``qk_matmul_output``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F

from metaopt.ir.dtypes import torch_dtype_from_onnx
from metaopt.ir.program import device_form
from metaopt.ops import onnx_bodies, patterns, rng_streams
from metaopt.ops.kernels.partition import group_ranks
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


# --------------------------------------------------------------------------- fused attention
#
# `ScaledDotProductAttention` (ours) is softmax(scale * Q K^T + mask) V with dropout on the
# probabilities, one op in place of the exporter's decomposition (MatMul, scale, mask Add, Softmax,
# the safe-softmax IsNaN/Where, Dropout, MatMul) and of simple ONNX `Attention` ops. What it saves
# for its backward depends on dropout, the same choice `F.scaled_dot_product_attention` makes:
#
# * dropout_p == 0: the flash form. The forward keeps only the row log-sum-exp (LSE, b x h x sq);
#   the backward recomputes the probabilities from Q, K and LSE (on CPU torch's fused flash
#   kernels, `_scaled_dot_product_flash_attention_for_cpu[_backward]`, which SDPA itself picks
#   there). No b x h x sq x sk tensor outlives the op.
# * dropout_p > 0: torch has no fused CPU kernel with dropout (SDPA falls back to its math path),
#   so the op runs that math once, in place where it can, and saves the probabilities before and
#   after dropout (P and P', 2 x b*h*sq*sk; eager SDPA's math path holds those plus the mask). The
#   backward is FlashAttention's rowsum form on them (`_dropout_backward`) and never reads the
#   mask. The mask is drawn from 32 random bits per entry (`_dropout`), two entries per int64
#   draw: 4x cheaper than `native_dropout`'s bernoulli on the CPU, where the b*h*sq*sk mask was
#   the op's largest cost after its matmuls. So a fused program does not draw the unfused
#   program's masks (nor eager's): same distribution, other numbers.
#
# RNG: the row is `random=True`, so recompute records the generator state before the op
# (RngState) and replays it around the recomputed copy (RngReplay, ops/kernels/rng.py): the mask is
# bit-identical on CPU. On CUDA RngReplay restores the whole CUDA generator state, from which
# `_scaled_dot_product_efficient_attention` takes its philox seed and offset, so the replay
# covers the CUDA form's dropout too.
#
# Per device (`Var.device`): the forms above are the CPU's. On CUDA (and on the meta device,
# which stands in for one) the op runs torch's memory-efficient kernel forward and backward,
# dropout inside, as eager SDPA does there: it saves the logsumexp (float32, rows padded to a
# multiple of 32 by the kernel) and the philox seed and offset its dropout drew from, plus, with
# dropout, its output (the backward reads it; the CPU's dropout form does not, so the CPU does
# not keep it). The op declares both sets of saved outputs; the program prints each with
# ``on cpu`` / ``on cuda``, and the kernel on one device leaves the other's None:
#     y, PROBS, DROPPED (cpu), OUT, LSE32, SEED, OFFSET (cuda)   dropout_p > 0
#     y, LSE (cpu), LSE32, SEED, OFFSET (cuda)                   dropout_p == 0
# The kernel wants its bias's rows aligned (a batch stride a multiple of 16 bytes): the mask is
# padded to a multiple of 16 keys and sliced back, as SDPA does (`_aligned_bias`).

_SDPA = "ScaledDotProductAttention"


def _mask4(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """An attention mask as the additive 4-D float mask the kernels take (bool: True attends)."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        mask = _bias_mask(mask, dtype)
    elif mask.dtype != dtype:
        mask = mask.to(dtype)
    while mask.dim() < 4:  # right-aligned broadcasting, as ONNX Add does
        mask = mask.unsqueeze(0)
    return mask


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """scale * Q K^T + mask as one BLAS call with the mask as its addend (baddbmm on 3-D views)."""
    b, h, sq, d = q.shape
    sk = k.shape[2]
    q3, k3 = q.reshape(b * h, sq, d), k.reshape(b * h, sk, d)
    if mask is None:
        return torch.bmm(q3, k3.transpose(1, 2)).mul_(scale).reshape(b, h, sq, sk)
    m3 = mask.expand(b, h, sq, sk).reshape(b * h, sq, sk)
    return torch.baddbmm(m3, q3, k3.transpose(1, 2), alpha=scale).reshape(b, h, sq, sk)


def _scores_fresh(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """`_scores` into one fresh contiguous buffer: the mask broadcast into it, then Q K^T added in
    place (``baddbmm_``), so a mask shared by the heads (b, 1, sq, sk) is not first expanded into
    a copy of its own. Same arithmetic as `_scores` (beta = 1, alpha = scale)."""
    b, h, sq, d = q.shape
    sk = k.shape[2]
    q3, k3 = q.reshape(b * h, sq, d), k.reshape(b * h, sk, d)
    if mask is None:
        return torch.bmm(q3, k3.transpose(1, 2)).mul_(scale).view(b, h, sq, sk)
    s = torch.empty((b, h, sq, sk), dtype=q.dtype, device=q.device)
    s.copy_(mask.expand(b, h, sq, sk))
    s.view(b * h, sq, sk).baddbmm_(q3, k3.transpose(1, 2), alpha=scale)
    return s


_HALF_RANGE = 1 << 31


def keep_mask(shape: list[int], p: float, device: torch.device) -> torch.Tensor | None:
    """The keep mask (bool, `shape`) of attention dropout `p`, drawn as 32 uniform bits per entry
    from the default generator (`_dropout`); None when p is below 2^-33 (nothing is dropped)."""
    n = math.prod(shape)
    bits = torch.empty((n + 1) // 2, dtype=torch.int64, device=device).random_(-(1 << 63), None)
    threshold = round((1.0 - p) * (1 << 32)) - _HALF_RANGE  # P(int32 < t) = (t + 2^31) / 2^32
    if threshold >= _HALF_RANGE:
        return None
    return bits.view(torch.int32)[:n].view(shape) < threshold


def _dropout(x: torch.Tensor, p: float, whole: tuple[int, int, int] | None = None) -> torch.Tensor:
    """`x` with each entry zeroed with probability `p` and the others scaled by 1 / (1 - p), as
    ``native_dropout(x, p, True)[0]`` computes it (``x * keep * scale``), the mask drawn as 32
    uniform bits per entry: keep where the bits, read as int32, fall below the threshold that
    leaves a 1 - p share (exact to 2^-32; torch's float bernoulli is exact to 2^-24). The bits come
    from the default generator (``random_`` over the whole int64 range), so a recorded generator
    state replays the mask bit for bit (recompute) and tensor parallel's stream swap covers it.

    `whole` = (axis, parts, index): `x` is chunk `index` of `parts` along `axis` of a value one
    process holds whole (tensor parallel's heads, with one process's dropout): the bits are drawn
    for the whole value, as one process draws them, and this chunk's are kept."""
    if p >= 1.0:
        return torch.zeros_like(x)
    shape = list(x.shape)
    if whole is not None:
        shape[whole[0]] *= whole[1]
    keep = keep_mask(shape, p, x.device)
    if keep is None:
        return x.clone()  # p below 2^-33: nothing is dropped
    if whole is not None:
        axis, _, index = whole
        keep = keep.narrow(axis, index * x.shape[axis], x.shape[axis])
    return x.mul(keep).mul_(1.0 / (1.0 - p))


def _efficient_backward(dy, q, k, v, y, m4, lse, seed, offset, scale, dropout_p, want, dmask_wanted):  # noqa: ANN001, ANN202
    """The CUDA form's backward: torch's memory-efficient kernel (its dropout mask again from the
    saved philox seed and offset). The bias grad, when wanted, at the full (b, h, sq, sk)."""
    b, h, sq, _ = q.shape
    sk = k.shape[2]
    bias = _aligned_bias(m4, b, h, sq, sk)
    wanted = [want[0], want[1], want[2], bool(dmask_wanted)]
    dq, dk, dv, db = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dy.contiguous(), q, k, v, bias, y, lse, seed, offset, dropout_p, wanted, False, scale=scale
    )
    return dq, dk, dv, (db[..., :sk] if db is not None and dmask_wanted else None)


def _wide(s: torch.Tensor) -> torch.Tensor:
    """Scores for the log-sum-exp: float32 for half types (as the flash kernels accumulate)."""
    return s.float() if s.dtype in (torch.float16, torch.bfloat16) else s


def _dead_rows(mask: torch.Tensor | None) -> torch.Tensor | None:
    """Rows whose every key is masked out (-inf): SDPA's safe softmax gives them zeros, not NaN."""
    if mask is None or mask.dtype == torch.bool or not mask.is_floating_point():
        return None
    dead = torch.isneginf(mask).all(-1, keepdim=True)
    # On the CPU the check is free to read; on an accelerator masking unconditionally avoids a sync.
    return dead if dead.device.type != "cpu" or bool(dead.any()) else None


_LSE_ROWS = 32  # the memory-efficient kernel pads its logsumexp's rows to a multiple of this
_BIAS_ALIGN = 16  # and wants its bias's rows aligned: keys padded to a multiple of this


def _padded(dim, to: int):
    """`dim` rounded up to a multiple of `to` (an int, or a dim expression for a symbolic one)."""
    return -(-dim // to) * to if isinstance(dim, int) else f"({dim}+{to - 1})//{to}*{to}"


def saved_forms(q_shape: tuple, k_shape: tuple, dtype: str, v_shape: tuple, dropout_p: float) -> list[tuple]:
    """(tag, shape, dtype, device) of each saved output of the op, after y, in output order:
    the CPU form's, then the CUDA form's (see the notes above)."""
    b, h, sq, _ = q_shape
    sk = k_shape[2]
    if dropout_p > 0.0:
        cpu = [("PROBS", (b, h, sq, sk), dtype, "cpu"), ("DROPPED", (b, h, sq, sk), dtype, "cpu")]
        out = [("OUT", (b, h, sq, v_shape[3]), dtype, "cuda")]
    else:
        lse_dtype = "float32" if dtype in ("float16", "bfloat16") else dtype
        cpu, out = [("LSE", (b, h, sq), lse_dtype, "cpu")], []
    cuda = [("LSE32", (b, h, _padded(sq, _LSE_ROWS)), "float32", "cuda")]
    cuda += [("SEED", (), "int64", "cuda"), ("OFFSET", (), "int64", "cuda")]
    return cpu + out + cuda


def _sdpa_grad_rule(g, op, dy):
    """The fused backward: one `ScaledDotProductAttentionGrad` from the forward's saved outputs
    (per device: see the notes above), never a re-run of the forward."""
    q, k, v = op.inputs[:3]
    m = op.inputs[3] if len(op.inputs) > 3 and op.inputs[3] else ""
    dropout_p = op.attrs.get("dropout_p", 0.0)
    forms = saved_forms(g.shape(q), g.shape(k), g.dtype(q), g.shape(v), dropout_p)
    saved = g.saved_outputs(op, forms, count=1 + len(forms))
    y = "" if dropout_p > 0.0 else op.outputs[0]  # the dropout forms read their own saved output
    outs, mask = g.contribs(4 if m else 3)
    attrs = {"scale": op.attrs.get("scale", 1.0), "dropout_p": dropout_p}
    g.emit(_SDPA + "Grad", [dy[0], q, k, v, y, m, *saved], outs, mask=mask, **attrs)
    return [o or None for o in outs]


def _sdpa_for_test(op):  # noqa: ANN001, ANN202
    """Evaluation: no dropout, and none of the outputs saved for a backward."""
    return dataclasses.replace(op, outputs=op.outputs[:1], attrs={**op.attrs, "dropout_p": 0.0})


@register(
    _SDPA,
    domain="metaopt",
    for_test=_sdpa_for_test,
    needs_outputs=True,
    random=True,  # dropout inside: recompute replays its generator state (RngState/RngReplay)
    expensive=True,
    amp="white",  # matmul-class, as torch autocast lists SDPA (the flash kernels accumulate in float32)
    fresh_outputs=True,
    grad=_sdpa_grad_rule,
    onnx_function=onnx_bodies.scaled_dot_product_attention,
    onnx_overload=onnx_bodies.attention_overload,
)
@rng_streams.drawn  # tensor parallel: draws from the stream its `rng` attr names (ops/rng_streams.py)
def scaled_dot_product_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    scale: float = 1.0,
    dropout_p: float = 0.0,
    slice_axis: int | None = None,
    slice_group: list[int] | str | None = None,
    _nout: int = 1,
):
    """softmax(scale * q k^T + attn_mask) v, dropout `dropout_p` on the probabilities; q, k, v
    are (batch, heads, seq, size). `slice_axis` / `slice_group`: q, k and v are this rank's chunk
    of the heads (tensor parallel), and the dropout mask is one process's: drawn whole, this
    rank's heads kept (`_dropout`). Outputs: y, then what the backward reads (see above):
    (y, LSE) when dropout_p == 0, (y, PROBS, DROPPED) when dropout_p > 0: the probabilities
    before and after dropout (see `_dropout_backward` for why not the mask). Those are the
    CPU's; `_nout` > 1 asks for every saved output of both devices (`saved_forms`), the other
    device's left None."""
    mask = _mask4(attn_mask, q.dtype)
    whole = _whole(slice_axis, slice_group) if dropout_p > 0.0 else None
    if device_form(q.device) == "cuda":  # the saved outputs marked `on cuda`
        if whole is not None:
            raise NotImplementedError(
                "ScaledDotProductAttention: one process's dropout mask over a rank's heads (slice_axis) "
                "on CUDA: the fused kernel draws its own mask; not built"
            )
        return _efficient(q, k, v, mask, scale, dropout_p, _nout)
    cuda_none = (None,) * max(0, _nout - (3 if dropout_p > 0.0 else 2))
    if dropout_p > 0.0:
        b, h, sq, _ = q.shape
        probs = torch.softmax(_scores_fresh(q, k, mask, scale), -1)
        dead = _dead_rows(mask)
        if dead is not None:
            probs = probs.masked_fill_(dead, 0.0)
        dropped = _dropout(probs, dropout_p, whole)
        sk = k.shape[2]
        y = torch.bmm(dropped.view(b * h, sq, sk), v.reshape(b * h, sk, v.shape[3]))
        y = y.view(b, h, sq, v.shape[3])
        return (y, probs, dropped, *cuda_none)[:_nout] if _nout > 1 else y
    if _nout == 1:  # no backward reads this op: SDPA's own choice of kernel
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    qp, kp, vp = _one_head_size(q, k, v)
    y, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qp, kp, vp, 0.0, False, attn_mask=mask, scale=scale
    )
    return (y[..., : v.shape[-1]], lse, *cuda_none)[:_nout]


def _whole(axis: int | None, group: list[int] | str | None) -> tuple[int, int, int] | None:
    """(axis, parts, this rank's index) of a sliced draw, None without one."""
    if axis is None:
        return None
    if group is None:
        raise ValueError(f"{_SDPA}: slice_axis needs slice_group (the model-parallel group it is split over)")
    ranks = group_ranks(group, _SDPA)
    return axis, len(ranks), rng_streams.mp_rank(group if isinstance(group, str) else sorted(group))


def _one_head_size(*qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v zero-padded to one head size, which torch's flash CPU kernels require (DeepSeek's
    multi-head latent attention has a value head narrower than the query/key head). Zero columns
    add exact zeros to Q K^T and give zero output columns, sliced off after: the same values."""
    size = max(t.shape[-1] for t in qkv)
    return tuple(t if t.shape[-1] == size else F.pad(t, (0, size - t.shape[-1])) for t in qkv)


def _aligned_bias(mask: torch.Tensor | None, b: int, h: int, sq: int, sk: int) -> torch.Tensor | None:
    """The 4-D additive mask as the memory-efficient kernel takes it: (b, h, sq, sk), broadcast
    by strides, its rows `_BIAS_ALIGN`-aligned (padded, then sliced back, as SDPA does)."""
    if mask is None:
        return None
    pad = (-mask.shape[-1]) % _BIAS_ALIGN
    if pad:
        mask = F.pad(mask, (0, pad))[..., : mask.shape[-1]]
    return mask.expand(b, h, sq, sk)


def _efficient(q, k, v, mask, scale: float, dropout_p: float, _nout: int):  # noqa: ANN001
    """The CUDA form: torch's memory-efficient kernel, dropout inside (its philox seed and offset
    from the CUDA generator). Outputs as `scaled_dot_product_attention`'s, the CPU's None."""
    b, h, sq, _ = q.shape
    bias = _aligned_bias(mask, b, h, sq, k.shape[2])
    y, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, bias, _nout > 1, dropout_p, False, scale=scale
    )
    if _nout == 1:
        return y
    cpu_none = (None, None) if dropout_p > 0.0 else (None,)
    out = (y.clone(),) if dropout_p > 0.0 else ()  # kept for the backward while y is used and freed
    return (y, *cpu_none, *out, lse, seed, offset)[:_nout]


@register(_SDPA + "Grad", domain="metaopt", needs_outputs=True, fresh_outputs=True)
def scaled_dot_product_attention_grad(
    dy: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    y: torch.Tensor | None,
    attn_mask: torch.Tensor | None,
    *saved: torch.Tensor,
    scale: float = 1.0,
    dropout_p: float = 0.0,
    mask: list[int] | None = None,
    _nout: int = 4,
):
    """(dq, dk, dv, dmask) of `ScaledDotProductAttention` from its saved outputs (`saved_forms`:
    the CPU's (LSE) when dropout_p == 0, (PROBS, DROPPED) when dropout_p > 0, then the CUDA's,
    None on the other device). `mask` says which are wanted; the mask's grad (a learned
    position bias) is summed back to the mask's shape."""
    want = [bool(m) for m in (mask or [1] * _nout)] + [False] * 4
    m4 = _mask4(attn_mask, q.dtype)
    dmask_wanted = want[3] and attn_mask is not None
    n_cpu = 2 if dropout_p > 0.0 else 1
    if device_form(q.device) == "cuda":  # the saved outputs marked `on cuda`
        if len(saved) < n_cpu + 3:
            raise NotImplementedError(
                f"{_SDPA}Grad on {q.device.type}: the program saves only the CPU's outputs (made before "
                "attention saved its outputs per device): minimize the forward program again"
            )
        *out, lse, seed, offset = saved[n_cpu:]
        y = out[0] if out else y
        grads = _efficient_backward(
            dy, q, k, v, y, m4, lse, seed, offset, scale, dropout_p, want, dmask_wanted
        )
        dmask = grads[3].sum_to_size(attn_mask.shape) if dmask_wanted else None
        return (*grads[:3], dmask)[:_nout]
    saved = saved[:n_cpu]
    if dropout_p == 0.0 and not dmask_wanted:
        (lse,) = saved
        qp, kp, vp, dyp, yp = _one_head_size(q, k, v, dy, y)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dyp, qp, kp, vp, yp, lse, 0.0, False, attn_mask=m4, scale=scale
        )
        d_qk, d_v = q.shape[-1], v.shape[-1]
        return (dq[..., :d_qk], dk[..., :d_qk], dv[..., :d_v], None)[:_nout]
    if dropout_p > 0.0:
        probs, dropped = saved
        return _dropout_backward(dy, q, k, v, attn_mask, probs, dropped, scale, want, dmask_wanted)[:_nout]
    # a learned bias's grad: the flash backward in torch ops, the probabilities again from Q, K, LSE
    (lse,) = saved
    s = _wide(_scores(q, k, m4, scale))
    probs = torch.exp(s - lse.unsqueeze(-1)).to(q.dtype)
    dv = torch.matmul(probs.transpose(-1, -2), dy) if want[2] else None
    dprobs = torch.matmul(dy, v.transpose(-1, -2))
    delta = (dy * y).sum(-1, keepdim=True)
    ds = probs * (dprobs - delta)
    dq = torch.matmul(ds, k).mul_(scale) if want[0] else None
    dk = torch.matmul(ds.transpose(-1, -2), q).mul_(scale) if want[1] else None
    dmask = ds.sum_to_size(attn_mask.shape) if dmask_wanted else None
    return (dq, dk, dv, dmask)[:_nout]


def _dropout_backward(
    dy, q, k, v, attn_mask, probs, dropped, scale: float, want: list[bool], dmask_wanted: bool
):
    """(dq, dk, dv, dmask) of the dropout form from the saved probabilities P and dropped
    probabilities P' = P * keep / (1 - p), in FlashAttention's D = rowsum form:

        U = dY V^T                      (the grad of P')
        dP * P = U * keep / (1 - p) * P = U * P'
        dS = P * (dP - rowsum(dP * P)) = U * P' - P * D,   D = rowsum(U * P')

    so the mask itself is never read (where P' = 0 because P = 0 the mask does not matter, and
    where it was dropped P' is 0), and U becomes dS in place: one b*h x sq x sk buffer made,
    against four (dropped P again, U, dP, dS) for dropout's then softmax's backward. Every
    product runs on 3-D views, transposed operands as BLAS transposes, not copies."""
    b, h, sq, sk = probs.shape
    d, dv_size = q.shape[3], v.shape[3]
    p3, d3 = probs.view(b * h, sq, sk), dropped.view(b * h, sq, sk)
    dy3 = dy.reshape(b * h, sq, dv_size)
    dv = torch.bmm(d3.transpose(1, 2), dy3).view(b, h, sk, dv_size) if want[2] else None
    u = torch.bmm(dy3, v.reshape(b * h, sk, dv_size).transpose(1, 2)).mul_(d3)
    ds = u.addcmul_(p3, u.sum(-1, keepdim=True), value=-1.0)
    dq = torch.bmm(ds, k.reshape(b * h, sk, d)).mul_(scale).view(b, h, sq, d) if want[0] else None
    dk = (
        torch.bmm(ds.transpose(1, 2), q.reshape(b * h, sq, d)).mul_(scale).view(b, h, sk, d)
        if want[1]
        else None
    )
    dmask = ds.view(b, h, sq, sk).sum_to_size(attn_mask.shape) if dmask_wanted else None
    return dq, dk, dv, dmask


# --------------------------------------------------------------------------- fusion rules


def _scaled_by(q: Any, name: str, reader: int, producer: dict[str, int], consumers: dict[str, list[int]]):
    """(x, factor, op index) when `name` is Mul(x, c) / Div(x, c) by a scalar constant c read
    only by `reader`; (name, 1.0, None) otherwise."""
    j = producer.get(name)
    op = q.ops[j] if j is not None else None
    if op is None or op.type not in ("Mul", "Div") or consumers.get(name) != [reader] or len(op.inputs) != 2:
        return name, 1.0, None
    a, b = op.inputs
    cb = patterns.scalar_constant(q, b)
    if op.type == "Mul" and cb is None:
        a, b, cb = b, a, patterns.scalar_constant(q, a)
    if cb is None or cb == 0.0:
        return name, 1.0, None
    return a, (cb if op.type == "Mul" else 1.0 / cb), j


def _untransposed(q: Any, name: str, reader: int, producer: dict[str, int], consumers: dict[str, list[int]]):
    """(k, absorbed ops) when `name` is K^T of a 4-D K, read only by `reader`: a Transpose swapping
    the last two axes, or the exporter's Reshape(Transpose(Reshape(K, [b*h, s, d]), [0, 2, 1]),
    [b, h, d, s]); None otherwise."""
    chain: list[int] = []
    cur, at = name, reader
    for want in ("Reshape", "Transpose", "Reshape"):
        j = producer.get(cur)
        if j is None or consumers.get(cur) != [at] or q.ops[j].type not in ("Reshape", "Transpose"):
            return None
        op = q.ops[j]
        if op.type == "Transpose":
            perm = op.attrs.get("perm")
            if perm == [0, 1, 3, 2] and not chain:
                return op.inputs[0], [j]
            if want != "Transpose" or perm != [0, 2, 1]:
                return None
        elif want != "Reshape":
            return None
        chain.append(j)
        cur, at = op.inputs[0], j
    k = cur
    ks, kt = q.vars[k].shape or (), q.vars[name].shape or ()
    mid = q.vars[q.ops[chain[1]].outputs[0]].shape or ()
    # The inner Reshape merged exactly (b, h) when its last two dims are K's (s, d); the outer one
    # splits them back when the result is (b, h, d, s).
    if (
        len(ks) != 4
        or len(mid) != 3
        or tuple(mid[1:]) != (ks[3], ks[2])
        or tuple(kt) != (*ks[:2], ks[3], ks[2])
    ):
        return None
    return k, chain


def _heads_known(q: Any, *names: str) -> bool:
    """4-D (batch, heads, seq, size) values with known heads, seq and size."""
    shapes = [q.vars[n].shape or () for n in names]
    return all(len(s) == 4 and all(isinstance(d, int) for d in s[1:]) for s in shapes)


def fuse_attention(q: Any, i: int, producer: dict[str, int], consumers: dict[str, list[int]]):
    """Softmax's `fuse` rule: the exporter's decomposed attention is one `ScaledDotProductAttention`.

    Matched around the Softmax (last axis): before it ``[Add(., mask) | Where-free] [Mul/Div by c]
    MatMul([Mul(Q, c)], [Mul(K^T, c)])`` with K^T a transposed 4-D K; after it the optional
    safe-softmax guard ``Where(IsNaN(p), 0, p)``, Identity ops, an optional Dropout with constant ratio and
    training flag, and ``MatMul(., V)``. Every intermediate must have this chain as its only reader,
    Q, K, V must be 4-D with known heads, and every input of the fused op must exist before the
    Softmax (the fused op takes its place); otherwise the ops are left alone."""
    from metaopt.ir import Op

    sm = q.ops[i]
    absorbed: list[int] = []
    x = sm.inputs[0]
    xs = q.vars[x].shape or ()
    if len(xs) != 4 or sm.attrs.get("axis", -1) not in (-1, 3):
        return None
    # --- after the softmax: [safe-softmax guard] [Dropout] MatMul(., V)
    cur, at = sm.outputs[0], i
    readers = consumers.get(cur, [])
    if len(readers) == 2:  # Where(IsNaN(p), 0, p): p read by both
        nan_i, where_i = sorted(readers, key=lambda j: q.ops[j].type != "IsNaN")
        nan, where = q.ops[nan_i], q.ops[where_i]
        if (
            nan.type != "IsNaN"
            or where.type != "Where"
            or consumers.get(nan.outputs[0]) != [where_i]
            or where.inputs[0] != nan.outputs[0]
            or where.inputs[2] != cur
            or patterns.scalar_constant(q, where.inputs[1]) != 0.0
        ):
            return None
        absorbed += [nan_i, where_i]
        cur, at = where.outputs[0], where_i
    nxt = patterns.one_reader(consumers, cur)
    while nxt is not None and q.ops[nxt].type == "Identity":  # an nn.Dropout(0.0) exports as one
        absorbed.append(nxt)
        cur, at = q.ops[nxt].outputs[0], nxt
        nxt = patterns.one_reader(consumers, cur)
    if nxt is None:
        return None
    dropout_p = 0.0
    if q.ops[nxt].type == "Dropout":
        drop = q.ops[nxt]
        if any(consumers.get(o) for o in drop.outputs[1:] if o):
            return None  # its mask is read: a value the fused op does not make
        ratio = (
            patterns.scalar_constant(q, drop.inputs[1]) if len(drop.inputs) > 1 and drop.inputs[1] else 0.5
        )
        train = drop.inputs[2] if len(drop.inputs) > 2 and drop.inputs[2] else ""
        on = patterns.scalar_constant(q, train) if train else 0.0
        if ratio is None or on is None:
            return None  # a run-time ratio or training flag
        dropout_p = ratio if on else 0.0
        absorbed.append(nxt)
        cur, at = drop.outputs[0], nxt
        nxt = patterns.one_reader(consumers, cur)
        if nxt is None:
            return None
    pv = q.ops[nxt]
    if pv.type != "MatMul" or pv.inputs[0] != cur:
        return None
    v = pv.inputs[1]
    absorbed.append(nxt)
    # --- before the softmax: [Add(., mask)] [Mul/Div by c] MatMul(Q', K^T')
    mask = ""
    j = producer.get(x)
    if j is not None and q.ops[j].type == "Add" and consumers.get(x) == [i]:
        a, b = q.ops[j].inputs
        for s_, m_ in ((a, b), (b, a)):
            p_ = producer.get(s_)
            if p_ is not None and q.ops[p_].type in ("MatMul", "Mul", "Div") and consumers.get(s_) == [j]:
                x, mask = s_, m_
                absorbed.append(j)
                break
        else:
            return None
        at = j
    else:
        at = i
    x, scale, sj = _scaled_by(q, x, at, producer, consumers)
    if sj is not None:
        absorbed.append(sj)
        at = sj
    qk_i = producer.get(x)
    if qk_i is None or q.ops[qk_i].type != "MatMul" or consumers.get(x) != [at]:
        return None
    absorbed.append(qk_i)
    qs, kts = q.ops[qk_i].inputs
    qx, cq, qj = _scaled_by(q, qs, qk_i, producer, consumers)
    ktx, ck, kj = _scaled_by(q, kts, qk_i, producer, consumers)
    absorbed += [j for j in (qj, kj) if j is not None]
    found = _untransposed(q, ktx, kj if kj is not None else qk_i, producer, consumers)
    if found is None:
        return None
    k, chain = found
    absorbed += chain
    scale *= cq * ck
    # --- the fused op's contract: shapes, mask layout, inputs defined before the anchor
    if not _heads_known(q, qx, k, v):
        return None
    qsh, ksh, vsh = (q.vars[n].shape for n in (qx, k, v))
    # one batch for Q, K and V: the kernels fold (batch, heads) into one BLAS batch dim
    if qsh[1] != ksh[1] or ksh[1:3] != vsh[1:3] or qsh[3] != ksh[3] or not qsh[0] == ksh[0] == vsh[0]:
        return None
    if mask:
        ms = q.vars[mask].shape or ()
        if not 2 <= len(ms) <= 4 or ms[-1] != ksh[2] or q.vars[mask].dtype not in patterns.FLOAT_DTYPES:
            return None
    if any(producer.get(n, -1) >= i for n in (qx, k, v, mask) if n):
        return None
    fused = Op(
        _SDPA,
        [qx, k, v] + ([mask] if mask else []),
        [pv.outputs[0]],
        {"scale": scale, "dropout_p": dropout_p},
        role=sm.role,
        scope=sm.scope,
    )
    return absorbed, fused


def _fuse_onnx_attention(q: Any, i: int, producer: dict[str, int], consumers: dict[str, list[int]]):
    """Attention's `fuse` rule: an ONNX Attention on 4-D Q, K, V with no cache, softcap, window,
    causal flag, GQA or extra outputs is `ScaledDotProductAttention` (then its backward is the
    fused one rather than autograd on the reference kernel)."""
    from metaopt.ir import Op

    op = q.ops[i]
    a = op.attrs
    plain = (
        len(op.outputs) == 1
        and len(op.inputs) >= 3
        and not any(op.inputs[4:])  # no past key / value, no nonpad_kv_seqlen
        and not a.get("is_causal", 0)
        and not a.get("softcap", 0.0)
        and a.get("qk_matmul_output_mode", 0) == 0
        and a.get("softmax_precision") is None
        and a.get("left_window_size", -1) < 0
        and a.get("right_window_size", -1) < 0
    )
    if not plain:
        return None
    qn, kn, vn = op.inputs[:3]
    mask = op.inputs[3] if len(op.inputs) > 3 else ""
    if q.vars[qn].dtype in ("float16", "bfloat16"):
        # A file that asks for half-precision attention gets ONNX's rounding (the reference
        # kernel); SDPA accumulates in float32 and lands a few half ulps elsewhere.
        return None
    if not _heads_known(q, qn, kn, vn):
        return None
    qsh, ksh, vsh = (q.vars[n].shape for n in (qn, kn, vn))
    if qsh[1] != ksh[1] or ksh[1:3] != vsh[1:3] or qsh[3] != ksh[3]:
        return None
    if mask and ((q.vars[mask].shape or ())[-1:] != (ksh[2],) or len(q.vars[mask].shape) > 4):
        return None  # a short mask (ONNX pads it) or a mask of another rank
    scale = a.get("scale")
    scale = 1.0 / math.sqrt(qsh[3]) if scale is None else scale
    fused = Op(
        _SDPA, [qn, kn, vn] + ([mask] if mask else []), list(op.outputs), {"scale": scale, "dropout_p": 0.0}
    )
    fused.role, fused.scope, fused.origin = op.role, op.scope, op.origin
    return [], fused


# aliases: the present key/value are K, V when there is no past
register("Attention", needs_outputs=True, aliases=((1, 1), (2, 2)), amp="white", fuse=_fuse_onnx_attention)(
    attention
)
