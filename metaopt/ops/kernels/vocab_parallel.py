"""Vocab-parallel kernels: an embedding table and an LM head split by vocab rows over the
model-parallel group (Megatron's VocabParallelEmbedding and vocab_parallel_cross_entropy;
Paddle's VocabParallelEmbedding / ParallelCrossEntropy). passes/tensor_parallel.py inserts them.

The r-th rank of the model-parallel ``group`` holds rows ``[r V/mp, (r + 1) V/mp)`` of the [V, H]
table (``vocab_size`` is V). The kernels find r at run time (this worker's place in ``group``),
so every rank's program reads the same: fleet compares the workers' programs line by line.

``VocabParallelEmbedding(weight, ids)`` looks up the ids this rank owns and writes zeros for the
others: a partial result that the TPReduce after it sums over the group (each token's row comes
from exactly one rank, so the sum is exact: the others add zeros). Its grad is this rank's rows
only (`VocabParallelEmbeddingGrad`); the TPReduce's backward is the identity.

``VocabParallelLinearCrossEntropy(x, weight, labels, bias?)`` is LinearCrossEntropy (ops/kernels/
loss.py) over this rank's vocab slice: chunk by chunk it computes this rank's logits
``x @ W_r^T`` (never the [N, V] ones, nor even [N, V/mp] at once), their logsumexp ``lse_r`` [N]
and the target logit where this rank owns the label (0 elsewhere). ONE all-reduce then combines
the ranks: a [mp + 1, N] buffer, zero but for row r (this rank's ``lse_r``) and row mp (its target
logits), summed over the group, gives every rank every ``lse_r`` and every target logit exactly
(adding zeros rounds nothing), and ``lse = logsumexp_r(lse_r)`` is the full-vocab logsumexp.
Megatron does this with three all-reduces of [N] (max of the logits, sum of exp, the target
logit); the gathered per-rank logsumexps are as stable (the final logsumexp subtracts the max
over the ranks) and need one collective, through the communicator's sum, which has timeouts and
names the op. The loss is then replicated on every rank, as the single-process one.

The op also outputs that ``lse`` [N] (the backward's saved output): the grad kernel recomputes
each chunk's local logits, ``softmax = exp(z - lse)``, subtracts the one-hot where this rank owns
the label, and gives ``dx`` (a partial sum over this rank's vocab: the TPCopy before the op
all-reduces it in the backward, Megatron's f), ``dW_r`` and ``db_r``: no communication.
"""

from __future__ import annotations

import torch

from metaopt.ops.kernels.loss import (
    _NO_IGNORE,
    DEFAULT_CHUNK_TOKENS,
    _acc_dtype,
    _check_reduction,
    _lce_grad_workspace,
    _lce_workspace,
    lce_grad_chunks,
    lce_grad_outputs,
    lce_grad_start,
)
from metaopt.ops.kernels.tensor_parallel import _ranks
from metaopt.ops.registry import register, register_collective


def _local_rows(weight: torch.Tensor, vocab_size: int, group: list[int] | str, _rt) -> tuple[int, int, list]:
    """(rows held, the first row's global index, the group's global ranks) of this rank's table."""
    rows, ranks = weight.shape[0], _ranks(group)
    if rows < 1 or rows * len(ranks) != vocab_size:
        raise ValueError(
            f"vocab parallel: {len(ranks)} ranks ({ranks}) holding {rows} rows each do not make a vocab of "
            f"{vocab_size}"
        )
    if len(ranks) == 1:
        return rows, 0, ranks  # a group of one: no torch.distributed needed
    me = _rt.comm.rank
    if me not in ranks:
        raise ValueError(
            f"vocab parallel: this worker (rank {me}) is not in the model-parallel group {ranks}"
        )
    return rows, ranks.index(me) * rows, ranks


def _check_ids(ids: torch.Tensor, vocab_size: int, what: str) -> None:
    # Single-process torch raises on an id outside the table; split, such an id would be looked
    # up by no rank and silently read zeros.
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        bad = ids[(ids < 0) | (ids >= vocab_size)].reshape(-1)[0]
        raise IndexError(f"{what}: id {int(bad)} is out of range [0, {vocab_size})")


def _owned(ids: torch.Tensor, start: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(local row of each id, clamped to a valid row; whether this rank owns it)."""
    local = ids.to(torch.int64) - start
    mine = (local >= 0) & (local < rows)
    return torch.where(mine, local, 0), mine


def _vpe_grad(g, op, dy):
    weight, ids = op.inputs
    attrs = {k: op.attrs[k] for k in ("vocab_size", "group", "padding_idx") if k in op.attrs}
    return [g.emit1("VocabParallelEmbeddingGrad", [dy[0], ids, weight], like=weight, **attrs), None]


@register(
    "VocabParallelEmbedding",
    grad=_vpe_grad,
    domain="metaopt",
    needs_runtime=True,  # for this worker's place in the group
    fresh_outputs=True,
    notes="tensor parallel: lookup in this rank's vocab rows, zeros for the others (TPReduce sums)",
)
def vocab_parallel_embedding(
    weight: torch.Tensor,
    ids: torch.Tensor,
    vocab_size: int = 0,
    group: list[int] | str = "model_parallel",
    padding_idx: int = -1,
    _rt=None,
    _key: str = "",
) -> torch.Tensor:
    """This rank's part of ``weight_full[ids]``: the rows it holds, zeros elsewhere (module doc).
    `padding_idx` (a global row, -1: none) shapes only the grad, as in nn.Embedding."""
    rows, start, _ = _local_rows(weight, vocab_size, group, _rt)
    ids = ids.to(device=weight.device)
    _check_ids(ids, vocab_size, "VocabParallelEmbedding")
    local, mine = _owned(ids, start, rows)
    return weight[local] * mine.unsqueeze(-1).to(weight.dtype)


@register("VocabParallelEmbeddingGrad", domain="metaopt", fresh_outputs=True, needs_runtime=True)
def vocab_parallel_embedding_grad(
    dy: torch.Tensor,
    ids: torch.Tensor,
    weight: torch.Tensor,
    vocab_size: int = 0,
    group: list[int] | str = "model_parallel",
    padding_idx: int = -1,
    _rt=None,
    _key: str = "",
) -> torch.Tensor:
    """The grad of this rank's rows: each owned id's output grad added into its row (the
    padding_idx row left zero, as nn.Embedding's backward); `weight` is read for its shape."""
    rows, start, _ = _local_rows(weight, vocab_size, group, _rt)
    ids = ids.to(device=dy.device)
    local, mine = _owned(ids, start, rows)
    if padding_idx >= 0:
        mine = mine & (ids != padding_idx)
    dw = torch.zeros(weight.shape, dtype=dy.dtype, device=dy.device)
    # index_put_ with accumulate is deterministic (sorted on CUDA), as EmbeddingGrad's
    dw.index_put_((local[mine],), dy[mine].reshape(-1, weight.shape[1]), accumulate=True)
    return dw


# --- the LM head + cross-entropy over this rank's vocab slice ---------------------------------


def _operands(x, weight, labels, bias):
    """x as [N, H], labels as [N] int64, bias as [V/mp] or None (weight is [V/mp, H])."""
    x2 = x.reshape(-1, x.shape[-1])
    y = labels.reshape(-1).to(device=x.device, dtype=torch.int64)
    if y.numel() != x2.shape[0]:
        raise ValueError(
            f"VocabParallelLinearCrossEntropy: {x2.shape[0]} tokens in x {tuple(x.shape)} but {y.numel()} "
            f"labels {tuple(labels.shape)}"
        )
    return x2, y, None if bias is None else bias.reshape(-1)


def _chunk(x2, weight, b, y, s, e, start, rows, ignore_index):
    """One chunk's local logits in the accumulation dtype, its labels' validity and ownership."""
    z = torch.nn.functional.linear(x2[s:e], weight, b)
    z = z.to(_acc_dtype(z.dtype))  # no copy for float32 / float64
    t = y[s:e]
    valid = t != ignore_index
    local, mine = _owned(t, start, rows)
    return z, valid, local, mine & valid


def _check_labels(y: torch.Tensor, ignore_index: int, vocab_size: int) -> None:
    kept = y[y != ignore_index]
    _check_ids(kept, vocab_size, "VocabParallelLinearCrossEntropy: label")


def _vplce_grad(g, op, dy):
    # The forward's full-vocab logsumexp is saved (one float per token); the grad recomputes this
    # rank's logits chunk by chunk, so nothing [N, V/mp] lives between forward and backward.
    x, w, labels = op.inputs[:3]
    bias = op.inputs[3] if len(op.inputs) > 3 and op.inputs[3] else ""
    dtype = "float64" if g.dtype(x) == "float64" else "float32"  # the accumulation dtype
    (lse,) = g.saved_outputs(op, [("LSE", g.shape(labels), dtype)], count=2)
    keys = ("ignore_index", "reduction", "chunk_size", "vocab_size", "group")
    attrs = {k: op.attrs[k] for k in keys if k in op.attrs}
    outs = [g.contrib(x) if g.needs(0) else "", g.contrib(w) if g.needs(1) else ""]
    if bias:
        outs.append(g.contrib(bias) if g.needs(3) else "")
    mask = [int(bool(o)) for o in outs]
    g.emit(
        "VocabParallelLinearCrossEntropyGrad",
        [dy[0], x, w, labels, lse] + ([bias] if bias else []),
        outs,
        mask=mask,
        **attrs,
    )
    return [outs[0] or None, outs[1] or None, None] + ([outs[2] or None] if bias else [])


@register_collective(
    "VocabParallelLinearCrossEntropy",
    grad=_vplce_grad,
    needs_outputs=True,
    fresh_outputs=True,
    # its all-reduce needs every rank of the group to re-run it in lockstep (as TPReduce)
    recomputable=False,
    expensive=True,
    amp="white",
    amp_float32_outputs=(0,),  # as LinearCrossEntropy's; the saved lse is declared by the grad rule
    workspace=_lce_workspace,
    notes="tensor parallel: LinearCrossEntropy over this rank's vocab rows, one all-reduce (module doc)",
)
def vocab_parallel_linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = _NO_IGNORE,
    reduction: str = "mean",
    chunk_size: int = DEFAULT_CHUNK_TOKENS,
    vocab_size: int = 0,
    group: list[int] | str = "model_parallel",
    _nout: int = 1,
    _rt=None,
    _key: str = "",
):
    """(loss, lse): F.cross_entropy(x @ W_full^T + b_full, labels) from this rank's rows W_r, b_r
    (module doc); `lse` [labels' shape] is the full-vocab logsumexp of each token's logits."""
    _check_reduction(reduction)
    rows, start, ranks = _local_rows(weight, vocab_size, group, _rt)
    rank, mp = start // rows, len(ranks)
    x2, y, b = _operands(x, weight, labels, bias)
    _check_labels(y, ignore_index, vocab_size)
    acc, n = _acc_dtype(x2.dtype), x2.shape[0]
    buf = torch.zeros(mp + 1, n, dtype=acc, device=x.device)  # row r: lse_r; row mp: target logits
    for s in range(0, n, chunk_size):
        e = min(n, s + chunk_size)
        z, _, local, mine = _chunk(x2, weight, b, y, s, e, start, rows, ignore_index)
        buf[rank, s:e] = torch.logsumexp(z, 1)
        buf[mp, s:e] = torch.where(mine, z.gather(1, local.unsqueeze(1)).squeeze(1), 0)
        del z  # one chunk alive at a time
    if mp > 1:
        (buf,) = _rt.comm.all_reduce([buf], "sum", f"{_key} over model-parallel group {ranks}", ranks)
    lse = torch.logsumexp(buf[:mp], 0)
    valid = y != ignore_index
    total = torch.where(valid, lse - buf[mp], 0).sum()
    loss = total / valid.sum() if reduction == "mean" else total
    return (loss, lse.reshape(labels.shape)) if _nout > 1 else loss


@register(
    "VocabParallelLinearCrossEntropyGrad",
    domain="metaopt",
    needs_outputs=True,
    needs_runtime=True,  # for this worker's place in the group
    fresh_outputs=True,
    workspace=_lce_grad_workspace,
)
def vocab_parallel_linear_cross_entropy_grad(
    dloss: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = _NO_IGNORE,
    reduction: str = "mean",
    chunk_size: int = DEFAULT_CHUNK_TOKENS,
    vocab_size: int = 0,
    group: list[int] | str = "model_parallel",
    mask: list[int] | None = None,
    _nout: int = 3,
    _rt=None,
    _key: str = "",
):
    """(dx partial, dW_r, db_r) of VocabParallelLinearCrossEntropy, chunk by chunk with this rank's
    logits recomputed: (exp(z - lse) - onehot where this rank owns the label) * dloss / count on
    the non-ignored rows, then the linear's two matmuls (as LinearCrossEntropyGrad). No
    communication: dx sums over this rank's vocab only; the TPCopy's grad all-reduces it."""
    _check_reduction(reduction)
    rows, start, _ = _local_rows(weight, vocab_size, group, _rt)
    x2, y, b = _operands(x, weight, labels, bias)
    lse = lse.reshape(-1).to(_acc_dtype(x2.dtype))
    scale, dx, dw, db = lce_grad_start(dloss, x2, weight, y, bias, mask, _nout, ignore_index, reduction)

    def probs(s: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        z, valid, local, mine = _chunk(x2, weight, b, y, s, e, start, rows, ignore_index)
        p = torch.exp(z - lse[s:e].unsqueeze(1))
        del z
        p[torch.arange(e - s, device=x.device), local] -= mine.to(p.dtype)  # the one-hot, where owned
        return p, valid

    lce_grad_chunks(probs, chunk_size, scale, weight, x2, dx, dw, db)
    return lce_grad_outputs(dx, dw, db, x, weight, bias, _nout)
