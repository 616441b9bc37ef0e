"""Which ops may read a vocab-split table, and what each becomes (op knowledge for
passes/tensor_parallel.py, which switches on no op type; the kernels are in
ops/kernels/vocab_parallel.py).

A table [V, H] split by vocab rows over the model-parallel group may be read by

* a lookup: ``Gather(table, ids, axis=0)`` (torch's nn.Embedding as exported) or metaopt's
  ``Embedding`` -> ``VocabParallelEmbedding`` (this rank's rows, zeros elsewhere) then TPReduce;
* the fused LM head + loss: ``LinearCrossEntropy(x, table, labels, bias?)`` with ``transB=1``
  (F.linear's [V, H] layout; a tied head is exactly this) -> ``VocabParallelLinearCrossEntropy``
  over this rank's rows, its input x through TPCopy.

Any other reader (the unfused head's MatMul / Transpose, a [H, V] head) is refused by the pass
naming its printed line: the full-vocab logits would have to exist on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

EMBEDDING_OP = "VocabParallelEmbedding"
LOSS_OP = "VocabParallelLinearCrossEntropy"


class NotVocabParallel(ValueError):
    """The op reads the table but cannot read its vocab slice (the message says why)."""


@dataclass(frozen=True)
class Lookup:
    table: str
    ids: str
    attrs: dict  # carried onto VocabParallelEmbedding (padding_idx)


@dataclass(frozen=True)
class HeadLoss:
    x: str
    weight: str
    labels: str
    bias: str  # "" when none
    attrs: dict  # carried onto VocabParallelLinearCrossEntropy


def lookup(op: Any) -> Lookup | None:
    """The table lookup `op` is (raising NotVocabParallel for a lookup this split cannot do),
    else None."""
    if op.type == "Gather" and op.attrs.get("axis", 0) == 0:
        return Lookup(op.inputs[0], op.inputs[1], {})
    if op.type == "Embedding":
        if op.attrs.get("scale_grad_by_freq", 0):
            raise NotVocabParallel("scale_grad_by_freq=1 is not supported with a vocab-split table")
        pad = int(op.attrs.get("padding_idx", -1))
        return Lookup(op.inputs[0], op.inputs[1], {"padding_idx": pad} if pad >= 0 else {})
    return None


def head_loss(op: Any) -> HeadLoss | None:
    """The fused LM head + loss `op` is (NotVocabParallel when its layout does not split by rows),
    else None."""
    if op.type != "LinearCrossEntropy":
        return None
    if int(op.attrs.get("transB", 1)) != 1:
        raise NotVocabParallel("its weight is [H, V] (transB=0): the vocab is not the rows of the table")
    x, w, labels = op.inputs[:3]
    bias = op.inputs[3] if len(op.inputs) > 3 else ""
    keys = ("ignore_index", "reduction", "chunk_size")
    return HeadLoss(x, w, labels, bias, {k: op.attrs[k] for k in keys if k in op.attrs})
