"""Context parallel's ring attention (passes/context_parallel.py puts it in place of attention).

Each of the `degree` ranks of a cp group holds 1/degree of every sequence (its positions by
`layout`: "zigzag" pairs run r with run 2*degree-1-r, kernels/sequence_parallel.py `runs`, so that
under a causal mask every rank has as much to compute as every other), and q, k and v of its own
positions only. ``y, LSE[, KEEP] = RingAttention(q, k, v[, mask])`` is
softmax(scale * q k^T + mask) v over the *whole* sequence for the local queries:

* **Forward** (Liu et al. 2023, ring attention; the online softmax of FlashAttention): the key and
  value blocks go round the ring, degree - 1 hops, each rank sending its current block to the next
  rank of the group and receiving the previous rank's. Each block updates the running row max,
  the row sum of exponentials and the unnormalised output; the output is divided once at the end.
  A pair of (query run, key run) whose mask is -inf everywhere is skipped: with the zig-zag layout
  and a causal mask, each rank skips as many as the others.
* **mask**: the rows of the local queries (in local order) over the *global* key positions
  ([.., s/degree, s]; the pass scatters its rows), or broadcast over rows ([.., 1, s]).
* **Saved**: LSE (b, h, s/degree; float32 at least), the row log-sum-exp; with dropout, KEEP, the
  local rows of one process's keep mask ([b, h, s/degree, s], bool): drawn whole from the stream
  every rank shares, as one process's ScaledDotProductAttention draws it (`attention.keep_mask`),
  this rank's rows kept. The normaliser counts every probability (dropped or not), so
  y = sum(exp(s - m) * keep / (1 - p) v) / sum(exp(s - m)): one process's value.
* **Backward** (``RingAttentionGrad``): FlashAttention's backward block by block, the row term
  D = rowsum(dy * y) computed once; the key and value blocks go round again, and each block's
  dk and dv accumulate as they travel with it, one more hop bringing them home.

Dead rows (every key masked) give zeros, as attention does. A group of one runs every block here.
"""

from __future__ import annotations

import dataclasses

import torch

from metaopt.ops.kernels.attention import _mask4, keep_mask
from metaopt.ops.kernels.partition import group_ranks
from metaopt.ops.kernels.sequence_parallel import group_members, runs, take
from metaopt.ops.registry import register_collective
from metaopt.ops.rng_streams import drawn, mp_rank

_RING = "RingAttention"


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _members(group: list[int] | str, rt) -> tuple[list[int], int]:  # noqa: ANN001
    """(the cp group's ranks, this worker's index); a group of one runs without a communicator."""
    members = group_members(group, rt, _RING)
    return members if members is not None else (group_ranks(group, _RING), 0)


def _shift(tensors: list[torch.Tensor], ranks: list[int], me: int, rt, what: str) -> list[torch.Tensor]:  # noqa: ANN001
    """One hop of the ring: `tensors` (flattened into one message) to the next rank of the group,
    the previous rank's received in their place."""
    n = len(ranks)
    flat = torch.cat([t.reshape(-1) for t in tensors]).unsqueeze(0)
    send = [1 if j == (me + 1) % n else 0 for j in range(n)]
    recv = [1 if j == (me - 1) % n else 0 for j in range(n)]
    got = rt.comm.all_to_all(flat, send, recv, f"{what} (ring over cp group {ranks})", ranks)[0]
    out, at = [], 0
    for t in tensors:
        out.append(got[at : at + t.numel()].view(t.shape))
        at += t.numel()
    return out


def _blocks(mask: torch.Tensor | None, q_runs, k_runs):  # noqa: ANN001, ANN202
    """(local query offset, query count, key offset in the block, key count, mask block or None)
    for each pair of runs that has a key to attend to."""
    q_at = 0
    for _, qn in q_runs:
        k_at = 0
        for ka, kn in k_runs:
            m = None
            if mask is not None:
                rows = mask if mask.shape[-2] == 1 else mask.narrow(-2, q_at, qn)
                m = rows if mask.shape[-1] == 1 else rows.narrow(-1, ka, kn)
            if m is None or not bool(torch.isneginf(m).all()):
                yield q_at, qn, k_at, kn, ka, m
            k_at += kn
        q_at += qn


def _checked_mask(mask: torch.Tensor | None, sq: int, length: int) -> torch.Tensor | None:
    """The mask must hold the local queries' rows (or one row for all) over the global keys: a
    whole [.., s, s] mask read with local row offsets would apply other queries' rows, silently."""
    if mask is not None and (mask.shape[-2] not in (1, sq) or mask.shape[-1] not in (1, length)):
        raise ValueError(
            f"{_RING}: its mask of shape {list(mask.shape)} is not the rows of the {sq} local queries "
            f"(or one row) over the {length} keys; context parallel's pass scatters a mask's rows"
        )
    return mask


def _keep_rows(
    shape: tuple,
    length: int,
    parts: int,
    me: int,
    layout: str,
    p: float,
    device: torch.device,
    heads_group: list[int] | str | None,
) -> torch.Tensor:
    """This rank's rows of one process's keep mask over the whole (b, H, length, length) scores;
    with `heads_group` (tensor parallel's), its heads are this model-parallel rank's chunk of H."""
    b, h = shape[0], shape[1]
    whole_h, first = h, 0
    if heads_group is not None:
        mp = group_ranks(heads_group, _RING)
        whole_h, first = h * len(mp), h * mp_rank(heads_group if isinstance(heads_group, str) else mp)
    keep = keep_mask([b, whole_h, length, length], p, device)
    if keep is None:
        return torch.ones((b, h, shape[2], length), dtype=torch.bool, device=device)
    return take(keep.narrow(1, first, h), 2, parts, me, layout).contiguous()


def saved_forms(q_shape: tuple, length, dtype: str, dropout_p: float) -> list[tuple]:  # noqa: ANN001
    """(tag, shape, dtype) of each saved output after y: LSE, then KEEP with dropout."""
    b, h, sq, _ = q_shape
    lse_dtype = "float32" if dtype in ("float16", "bfloat16") else dtype
    forms = [("LSE", (b, h, sq), lse_dtype)]
    if dropout_p > 0.0:
        forms.append(("KEEP", (b, h, sq, length), "bool"))
    return forms


def _ring_grad_rule(g, op, dy):  # noqa: ANN001, ANN202
    q, k, v = op.inputs[:3]
    m = op.inputs[3] if len(op.inputs) > 3 and op.inputs[3] else ""
    if m and g.needs(3):
        raise NotImplementedError(
            f"{_RING}: the grad of its mask {m!r} (a learned attention bias) is not built; a mask made "
            "from feeds and constants is"
        )
    dropout_p = op.attrs.get("dropout_p", 0.0)
    length = op.attrs["length"]
    forms = saved_forms(g.shape(q), length, g.dtype(q), dropout_p)
    saved = g.saved_outputs(op, forms, count=1 + len(forms))
    outs, mask = g.contribs(3)
    attrs = {k_: op.attrs[k_] for k_ in ("scale", "dropout_p", "group", "layout", "length") if k_ in op.attrs}
    g.emit(_RING + "Grad", [dy[0], q, k, v, op.outputs[0], m, *saved], outs, mask=mask, **attrs)
    return [*(o or None for o in outs), None]


def _ring_for_test(op):  # noqa: ANN001, ANN202
    """Evaluation: no dropout (and no stream to draw from), none of the outputs saved for a backward."""
    attrs = {k: v for k, v in op.attrs.items() if k != "rng"}
    return dataclasses.replace(op, outputs=op.outputs[:1], attrs={**attrs, "dropout_p": 0.0})


@register_collective(
    _RING,
    for_test=_ring_for_test,
    needs_outputs=True,
    random=True,  # dropout inside: recompute replays its generator state (RngState/RngReplay)
    amp="white",  # attention's matmuls, as ScaledDotProductAttention (the ring accumulates in float32)
    recomputable=True,  # every rank of the group runs the same program: a recomputed ring meets its peers'
    fresh_outputs=True,
    grad=_ring_grad_rule,
    notes="context parallel: attention over the whole sequence for the local queries, k/v round the ring",
)
@drawn
def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    scale: float = 1.0,
    dropout_p: float = 0.0,
    group: list[int] | str,
    layout: str = "zigzag",
    length: int | None = None,
    heads_group: list[int] | str | None = None,
    _rt,
    _key: str,
    _nout: int = 1,
):
    ranks, me = _members(group, _rt)
    n = len(ranks)
    b, h, sq, _ = q.shape
    if length is not None and length != sq * n:
        raise ValueError(f"{_RING}: {sq} local queries on each of {n} ranks are not the sequence of {length}")
    length = sq * n
    mask = _checked_mask(_mask4(attn_mask, q.dtype), sq, length)
    wide = _wide(q.dtype)
    keep = None
    if dropout_p >= 1.0:  # everything dropped, nothing drawn (one process's attention draws none)
        keep = torch.zeros((b, h, sq, length), dtype=torch.bool, device=q.device)
    elif dropout_p > 0.0:
        keep = _keep_rows(q.shape, length, n, me, layout, dropout_p, q.device, heads_group)
    drop = 1.0 / (1.0 - dropout_p) if dropout_p < 1.0 else 0.0
    q_runs = runs(length, n, me, layout)
    m = torch.full((b, h, sq, 1), -torch.inf, dtype=wide, device=q.device)
    l = torch.zeros((b, h, sq, 1), dtype=wide, device=q.device)  # noqa: E741
    acc = torch.zeros((b, h, sq, v.shape[3]), dtype=wide, device=q.device)
    qw = q.to(wide)
    for step in range(n):
        src = (me - step) % n
        k_runs = runs(length, n, src, layout)
        kw, vw = k.to(wide), v.to(wide)
        for qa, qn, kb, kn, ka, mb in _blocks(mask, q_runs, k_runs):
            s = torch.matmul(qw[:, :, qa : qa + qn], kw[:, :, kb : kb + kn].transpose(2, 3)).mul_(scale)
            if mb is not None:
                s = s + mb.to(wide)
            m_old = m[:, :, qa : qa + qn]
            m_new = torch.maximum(m_old, s.amax(-1, keepdim=True))
            shift = torch.where(torch.isneginf(m_new), torch.zeros((), dtype=wide), m_new)
            alpha = torch.exp(m_old - shift)
            e = torch.exp(s - shift)
            l[:, :, qa : qa + qn] = l[:, :, qa : qa + qn] * alpha + e.sum(-1, keepdim=True)
            if keep is not None:
                e = e * keep[:, :, qa : qa + qn, ka : ka + kn] * drop
            pv = torch.matmul(e, vw[:, :, kb : kb + kn])
            acc[:, :, qa : qa + qn] = acc[:, :, qa : qa + qn] * alpha + pv
            m[:, :, qa : qa + qn] = m_new
        if step < n - 1:
            k, v = _shift([k, v], ranks, me, _rt, f"{_key}: k and v")
    live = l > 0
    y = torch.where(live, acc / torch.where(live, l, torch.ones((), dtype=wide)), torch.zeros((), dtype=wide))
    lse = torch.where(live, m + torch.log(torch.where(live, l, torch.ones((), dtype=wide))), -torch.inf)
    y = y.to(q.dtype)
    outs = (y, lse.squeeze(-1), keep)
    return outs[:_nout] if _nout > 1 else y


@register_collective(
    _RING + "Grad",
    needs_outputs=True,
    fresh_outputs=True,
    recomputable=True,
    notes="context parallel: ring attention's backward, dk/dv travelling with their blocks",
)
def ring_attention_grad(
    dy: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    y: torch.Tensor,
    attn_mask: torch.Tensor | None,
    lse: torch.Tensor,
    keep: torch.Tensor | None = None,
    *,
    scale: float = 1.0,
    dropout_p: float = 0.0,
    group: list[int] | str,
    layout: str = "zigzag",
    length: int | None = None,
    mask: list[int] | None = None,
    _rt,
    _key: str,
    _nout: int = 3,
):
    """(dq, dk, dv) of `RingAttention` from its saved LSE (and KEEP with dropout)."""
    ranks, me = _members(group, _rt)
    n = len(ranks)
    sq = q.shape[2]
    total = sq * n
    m4 = _checked_mask(_mask4(attn_mask, q.dtype), sq, total)
    wide = _wide(q.dtype)
    qw, dyw = q.to(wide), dy.to(wide)
    delta = (dyw * y.to(wide)).sum(-1, keepdim=True)
    # dead rows (lse -inf) have no probability anywhere: exp(s - inf) = 0
    lse4 = torch.where(torch.isneginf(lse), torch.inf, lse.to(wide)).unsqueeze(-1)
    # contiguous accumulators (zeros_like would copy a transposed q's strides): outputs are
    # contiguous, as the memory estimate takes every fresh output to be
    fresh = {"dtype": wide, "device": q.device, "memory_format": torch.contiguous_format}
    dq = torch.zeros_like(qw, **fresh)
    kw, vw = k.to(wide), v.to(wide)
    dk, dv = torch.zeros_like(kw, **fresh), torch.zeros_like(vw, **fresh)
    q_runs = runs(total, n, me, layout)
    drop = 1.0 / (1.0 - dropout_p) if 0.0 < dropout_p < 1.0 else 0.0
    for step in range(n):
        src = (me - step) % n
        for qa, qn, kb, kn, ka, mb in _blocks(m4, q_runs, runs(total, n, src, layout)):
            qs, ks, vs = qw[:, :, qa : qa + qn], kw[:, :, kb : kb + kn], vw[:, :, kb : kb + kn]
            s = torch.matmul(qs, ks.transpose(2, 3)).mul_(scale)
            if mb is not None:
                s = s + mb.to(wide)
            p = torch.exp(s - lse4[:, :, qa : qa + qn])
            dys = dyw[:, :, qa : qa + qn]
            dp = torch.matmul(dys, vs.transpose(2, 3))
            if keep is not None:
                kp = keep[:, :, qa : qa + qn, ka : ka + kn].to(wide) * drop
                dv[:, :, kb : kb + kn] += torch.matmul((p * kp).transpose(2, 3), dys)
                dp = dp * kp
            else:
                dv[:, :, kb : kb + kn] += torch.matmul(p.transpose(2, 3), dys)
            ds = p * (dp - delta[:, :, qa : qa + qn]) * scale
            dq[:, :, qa : qa + qn] += torch.matmul(ds, ks)
            dk[:, :, kb : kb + kn] += torch.matmul(ds.transpose(2, 3), qs)
        if n > 1:  # the block moves on with its grads; after the last block, the grads go home
            if step < n - 1:
                kw, vw, dk, dv = _shift([kw, vw, dk, dv], ranks, me, _rt, f"{_key}: k, v and their grads")
            else:  # home: each its own storage (a hop's pieces share the message's)
                home = _shift([dk, dv], ranks, me, _rt, f"{_key}: the grads of k and v")
                dk, dv = (t.clone() for t in home)
    want = [bool(x) for x in (mask or [1, 1, 1])]
    grads = [t.to(x.dtype) if w else None for t, x, w in zip((dq, dk, dv), (q, k, v), want, strict=True)]
    return tuple(grads)[:_nout]
