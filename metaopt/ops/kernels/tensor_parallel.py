"""Megatron's two tensor-parallel collectives (passes/tensor_parallel.py inserts them).

``TPCopy`` is Megatron's f (copy_to_tensor_model_parallel_region): identity forward, all-reduce
sum of the grad over the model-parallel group backward; it sits before a column-parallel layer,
whose input every rank holds whole. ``TPReduce`` is g (reduce_from_tensor_model_parallel_region):
all-reduce sum forward, identity backward; it sums a row-parallel layer's partial products.

``group`` is the list of GLOBAL ranks of this worker's model-parallel group, always (in a
pipeline stage program too: unlike AllReduce's ``ranks``, which are pipeline-stage indices the
pipeline runtime maps to ranks, the hybrid topology hands TP its global ranks directly), or
``"model_parallel"``: this worker's model-parallel group of fleet.init's hybrid layout, as fleet's
tensor_parallel step writes it so that every worker's program reads the same (they are compared
at minimize). A group of one rank is the identity, so an mp_degree=1 program runs without
torch.distributed.
"""

from __future__ import annotations

import torch

from metaopt.ops.registry import SAME, register, register_collective


def _tp_copy_grad(g, op, dy):
    # f's backward is g: the grads of the replicated input, summed over the group.
    group = op.attrs["group"]  # a list of ranks or "model_parallel": kept as it is
    group = group if isinstance(group, str) else list(group)
    return [g.emit1("TPReduce", [dy[0]], like=op.inputs[0], group=group)]


def _tp_reduce_grad(g, op, dy):
    # g's backward is the identity: every rank already holds the whole output grad.
    return [g.emit1("Identity", [dy[0]], like=op.inputs[0])]


@register(
    "TPCopy",
    domain="metaopt",
    aliases=SAME,
    view=True,
    grad=_tp_copy_grad,
    notes="tensor parallel f: identity forward, all-reduce sum over `group` backward",
)
def tp_copy(x: torch.Tensor, group: list[int] | str) -> torch.Tensor:
    return x


@register_collective(
    "TPReduce",
    fresh_outputs=True,
    # Recompute re-runs it: every rank of the group runs the same program (minimize compares
    # them), so the re-emitted TPReduce meets its peers' in the same order, and a sum of the
    # same partial products over the same group gives the forward's bits again.
    recomputable=True,
    grad=_tp_reduce_grad,
    notes="tensor parallel g: all-reduce sum over `group` forward, identity backward",
)
def tp_reduce(x: torch.Tensor, group: list[int] | str, _rt, _key: str) -> torch.Tensor:
    group = _ranks(group)
    if len(group) == 1:
        return x.clone()  # fresh storage, as the row promises
    (y,) = _rt.comm.all_reduce([x], "sum", f"{_key} over model-parallel group {list(group)}", list(group))
    return y


def _ranks(group: list[int] | str) -> list[int]:
    """The global ranks of `group` (a name: this worker's group of fleet.init's layout, as
    `comm.NAMED_GROUPS` says)."""
    if not isinstance(group, str):
        return list(group)
    from metaopt.ops.kernels.comm import named_group_ranks

    return named_group_ranks(group, "TPReduce")
