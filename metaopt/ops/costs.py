"""Per-op work for time models (fleet.plan's, planner/calibrate.py): each matmul-class row's `flops`,
what a collective moves, an attention op's heads. Set on the rows here, beside each other, as
ops/sharding.py sets the split rules: an op's time is a per-op cost + its FLOPs / a device's FLOP/s
+ the bytes it touches / its bytes/s, so only the ops whose FLOPs matter beside their bytes need a
rule (the others' time is their dispatch and their bytes).
"""

from __future__ import annotations

import math
from typing import Any

from metaopt.ops import registry


def _dim(d: Any, dims: dict) -> int:
    """`d` under `dims` (a composite such as "6*batch" evaluated; an unbound one counts 1)."""
    from metaopt.ir.program import eval_dim

    got = eval_dim(d, dims)
    return 1 if got is None else int(got)


def _numel(p: Any, name: str, dims: dict) -> int:
    v = p.vars.get(name) if name else None
    if v is None or v.shape is None:
        return 0
    return math.prod(_dim(d, dims) for d in v.shape)


def _shape(p: Any, name: str) -> tuple:
    v = p.vars.get(name) if name else None
    return tuple(v.shape) if v is not None and v.shape is not None else ()


def _matmul(p: Any, op: Any, dims: dict) -> float:
    """2 x the output's elements x the reduced size (A's last dim; Gemm's transA: its first)."""
    a = _shape(p, op.inputs[0])
    if not a:
        return 0.0
    k = a[0] if op.attrs.get("transA", 0) else a[-1]
    return 2.0 * sum(_numel(p, o, dims) for o in op.outputs[:1]) * _dim(k, dims)


def _keys(p: Any, op: Any, k: str, dims: dict) -> int:
    """The keys each query attends to: k's sequence, or the whole one a ring's `length` attr names."""
    if "length" in op.attrs:
        return int(op.attrs["length"])
    shape = _shape(p, k)
    return _dim(shape[-2], dims) if shape else 0


def _attention(p: Any, op: Any, dims: dict) -> float:
    """Q K^T and P V: 4 x q's elements x the keys (q, k, v first)."""
    return 4.0 * _numel(p, op.inputs[0], dims) * _keys(p, op, op.inputs[1], dims)


def _attention_grad(p: Any, op: Any, dims: dict) -> float:
    """2.5x the forward (dy first, then q, k, v): FlashAttention's backward, S recomputed."""
    return 10.0 * _numel(p, op.inputs[1], dims) * _keys(p, op, op.inputs[2], dims)


def _conv(p: Any, op: Any, dims: dict) -> float:
    """2 x the output's elements x the weight's elements per output channel."""
    w = _shape(p, op.inputs[1]) if len(op.inputs) > 1 else ()
    return 2.0 * _numel(p, op.outputs[0], dims) * math.prod(_dim(d, dims) for d in w[1:]) if w else 0.0


def _conv_grad(p: Any, op: Any, dims: dict) -> float:
    """The input's and the weight's grads: twice the forward (dy, x, w first)."""
    w = _shape(p, op.inputs[2]) if len(op.inputs) > 2 else ()
    return 4.0 * _numel(p, op.inputs[0], dims) * math.prod(_dim(d, dims) for d in w[1:]) if w else 0.0


def _wanted(op: Any, n: int) -> list[int]:
    """Which of the first `n` grads a grad op's `mask` asks for (all without one)."""
    mask = list(op.attrs.get("mask") or [1] * n)
    return (mask + [0] * n)[:n]


def _matmul_grad(p: Any, op: Any, dims: dict) -> float:
    """The wanted operand grads (`mask`), each as many FLOPs as the forward: 2 x dy's elements x
    the reduced size (a's last dim; LinearGrad: x's). dy, then a / x first."""
    a = _shape(p, op.inputs[1]) if len(op.inputs) > 1 else ()
    if not a:
        return 0.0
    return 2.0 * _numel(p, op.inputs[0], dims) * _dim(a[-1], dims) * sum(_wanted(op, 2))


def _linear_loss(p: Any, op: Any, dims: dict) -> float:
    """The fused head + loss: its logits (2 x tokens x hidden x vocab), and with the grads made in
    the same pass (more outputs) their two matmuls too. x, then the [vocab, hidden] weight first."""
    w = _shape(p, op.inputs[1]) if len(op.inputs) > 1 else ()
    if not w:
        return 0.0
    vocab = _dim(w[0] if op.attrs.get("transB", 1) else w[-1], dims)
    logits = 2.0 * _numel(p, op.inputs[0], dims) * vocab
    return logits * (1 + (len([o for o in op.outputs if o]) > 1) * 2)


def _linear_loss_grad(p: Any, op: Any, dims: dict) -> float:
    """The logits recomputed, then dx and dW: three matmuls of the forward's size (dloss, x, w)."""
    w = _shape(p, op.inputs[2]) if len(op.inputs) > 2 else ()
    if not w:
        return 0.0
    vocab = _dim(w[0] if op.attrs.get("transB", 1) else w[-1], dims)
    return 6.0 * _numel(p, op.inputs[1], dims) * vocab


_ATTENTIONS = frozenset({"ScaledDotProductAttention", "RingAttention"})  # q [b, heads, s, d] first


def attention_heads(p: Any, op: Any) -> int | None:
    """The heads of an attention op (its q's dim 1); None for any other op or an unknown shape."""
    q = _shape(p, op.inputs[0]) if op.type in _ATTENTIONS and op.inputs else ()
    return int(q[1]) if len(q) == 4 and isinstance(q[1], int) else None


_FLOPS = {
    "MatMul": _matmul,
    "MatMulGrad": _matmul_grad,
    "LinearGrad": _matmul_grad,
    "LinearCrossEntropy": _linear_loss,
    "LinearCrossEntropyGrad": _linear_loss_grad,
    "Gemm": _matmul,
    "Linear": _matmul,
    "ScaledDotProductAttention": _attention,
    "ScaledDotProductAttentionGrad": _attention_grad,
    "RingAttention": _attention,
    "RingAttentionGrad": _attention_grad,
    "Conv": _conv,
    "ConvGrad": _conv_grad,
}
for _type, _rule in _FLOPS.items():
    registry.extend(_type, flops=_rule)
del _type, _rule

# what a ring collective moves per worker, as a share of its largest tensor x (n - 1) / n: an
# all-reduce sends and receives its data twice (reduce-scatter, then all-gather), the others once
_ALL_REDUCES = frozenset({"AllReduce", "TPReduce"})


def _own_side(op: Any, nbytes: Any) -> int:
    # An expert exchange's received side is written at its bound (every row of the group: the
    # routing is data); priced at a balanced routing's, each worker receiving the rows it sends
    # (its own side, the smaller known one; exact beside an expert capacity: both sides equal).
    sides = [b for b in (nbytes(op.inputs[0]), nbytes(op.outputs[0])) if b]
    return min(sides, default=0)


def _counts(op: Any, nbytes: Any) -> int:
    # ExpertRoute trades each expert's row count, not the rows it reads for their number
    return nbytes(op.inputs[0])


# collectives whose largest tensor is not what they send: what they send, from (op, nbytes)
for _type, _rule in {"ExpertExchange": _own_side, "ExpertRoute": _counts}.items():
    registry.extend(_type, sends=_rule)
del _type, _rule


def op_flops(p: Any, op: Any, dims: dict) -> float:
    """The op's FLOPs by its row's rule; 0 for a row without one."""
    row = registry.get(op.type)
    return 0.0 if row is None or row.flops is None else float(row.flops(p, op, dims))


def comm_bytes(p: Any, op: Any, dims: dict, nbytes: Any) -> float:
    """Bytes a collective op sends and receives per worker over a ring of its group (`nbytes`:
    name -> bytes under `dims`); a named group counts its op's ``parts`` (ZeRO's), else 2 workers;
    what a row's `sends` says where it has one (an expert exchange at a balanced routing)."""
    row = registry.get(op.type)
    if row is not None and row.sends is not None:
        data = row.sends(op, nbytes)
    else:
        data = max((nbytes(x) for x in [*op.inputs, *op.outputs] if x), default=0)
    group = op.attrs.get("group") or op.attrs.get("ranks")
    n = len(group) if isinstance(group, (list, tuple)) else int(op.attrs.get("parts") or 2)
    return data * (n - 1) / max(n, 1) * (2.0 if op.type in _ALL_REDUCES else 1.0)
