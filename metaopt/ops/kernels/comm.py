"""Collective ops (data parallel's all-reduce), run through the executor's communicator."""

from __future__ import annotations

import torch

from metaopt.ir import torch_dtype
from metaopt.ops.registry import register, register_collective


@register_collective(
    "AllReduce",
    fresh_outputs=True,
    recomputable=False,
    wait_op="CommWait",
    notes="outputs = inputs reduced over every worker, one fused buffer per op (a bucket)",
)
def all_reduce(
    *xs: torch.Tensor,
    reduce: str = "avg",
    ranks: list[int] | None = None,
    group: str | None = None,
    comm_dtype: str | None = None,
    overlap: int = 0,
    _rt,
    _key: str,
) -> tuple[torch.Tensor, ...]:
    """`ranks`: pipeline workers sharing a tied param, in this worker's pipeline replica;
    ``group="data_parallel"``: in a pipeline stage, this stage in every replica; else this
    worker's data-parallel group of fleet.init's hybrid layout (dp x mp); neither: every worker.
    ``avg`` divides by the group's size. `comm_dtype` ("float16", Fleet's fp16_allreduce): the
    grads travel in that dtype (runtime/comm.py: divided first, cast back after). ``overlap=1``
    (passes/overlap_comm.py): the outputs are in flight until the ``CommWait`` of them."""
    if group not in (None, "data_parallel", "expert_replica"):
        raise ValueError(
            f"AllReduce: group must be 'data_parallel', 'expert_replica' or absent, got {group!r}"
        )
    if ranks is not None and _rt.pipeline is None:
        raise ValueError("AllReduce with ranks runs in a pipeline stage program only")
    if group == "expert_replica":  # expert parallel's grads: over the workers holding the same experts
        ranks = hybrid_ranks("expert_replica", "AllReduce")
    elif group == "data_parallel":
        ranks = _rt.pipeline.dp_ranks() if _rt.pipeline is not None else hybrid_ranks("data", "AllReduce")
    elif ranks is not None:
        ranks = [_rt.pipeline.rank_of(r) for r in ranks]
    if ranks is not None and len(ranks) == 1:
        outs = tuple(x.clone() for x in xs)  # a group of one: nothing to reduce (fresh outputs)
        if overlap:
            _rt.comm.done_without_comm(outs)
        return outs
    dtype = None if comm_dtype is None else torch_dtype(comm_dtype)
    what = f"{len(xs)} tensor(s) ({_key}, ...)"
    return tuple(_rt.comm.all_reduce(xs, reduce, what, ranks, dtype, overlap=bool(overlap)))


@register("CommWait", domain="metaopt", needs_runtime=True, recomputable=False)
def comm_wait(*xs: torch.Tensor, _rt, _key: str) -> None:
    """The collective left in flight (``overlap=1``: an AllReduce) that makes `xs` is
    finished here, right before their first reader: the ops since it started ran while its data
    travelled (on CUDA the compute stream waits for NCCL's; on gloo the host waits for its
    thread). It writes the results into `xs` (the average's division, a cast back), which nothing
    read before."""
    _rt.comm.finish(xs, f"CommWait of {_key}")


# The groups a rewritten program names by their hybrid axis, so that every worker's reads the same
# (fleet names them after its rewrite; the kernels look this worker's up in fleet.init's layout)
NAMED_GROUPS = {"model_parallel": "model", "sep_parallel": "sep"}


def named_group_ranks(group: list[int] | str, op: str) -> list[int]:
    """The global ranks of `group`, ascending: a list of ranks, or a `NAMED_GROUPS` name (this
    worker's group on that axis of fleet.init's layout)."""
    if not isinstance(group, str):
        return sorted(group)
    axis = NAMED_GROUPS.get(group)
    if axis is None:
        raise ValueError(f"{op}: group must be a list of ranks or one of {list(NAMED_GROUPS)}, got {group!r}")
    return hybrid_ranks(axis, op)


def hybrid_ranks(axis: str, op: str) -> list[int]:
    """This worker's group on hybrid `axis` as fleet.init laid the workers out (its groups are
    the only ones every worker made); refused, naming `op`, when fleet.init made none."""
    from metaopt.layout.groups import axis_ranks

    ranks = axis_ranks(axis)
    if ranks is None:
        raise RuntimeError(
            f"{op} over this worker's {axis!r} group of the hybrid layout, but fleet.init made no hybrid "
            "groups: give fleet.init a strategy with hybrid_configs (dp_degree, mp_degree)"
        )
    return ranks


@register_collective(
    "Broadcast",
    recomputable=False,
    writes_inputs=True,
    notes="startup op: every input (a persistable) overwritten in place with worker `src`'s value",
)
def broadcast(*xs: torch.Tensor, src: int = 0, group: str | None = None, _rt, _key: str) -> None:
    """Data parallel's start (as DDP's constructor): every worker takes worker `src`'s initial
    params and buffers. ``group="data_parallel"`` (``"sharding"``): only within this worker's
    data-parallel (sharding) group of the hybrid layout, from its `src`-th rank (tensor parallel's
    split params: each model-parallel rank holds its own slice); ``"expert_replica"``: within the
    workers holding the same experts (expert parallel's params). A startup op: the executor runs
    it once, on the program's first run, and it writes the scope's tensors themselves (the
    program's `values` are never touched)."""
    axes = {"data_parallel": "data", "sharding": "sharding", "expert_replica": "expert_replica"}
    if group is not None and group not in axes:
        raise ValueError(
            f"Broadcast: group must be 'data_parallel', 'sharding', 'expert_replica' or absent, got {group!r}"
        )
    ranks = None
    if group is not None:
        ranks = hybrid_ranks(axes[group], "Broadcast")
        if len(ranks) == 1:
            return  # a replica of one: its values are the ones
        src = ranks[src]
    for k, x in enumerate(xs):  # an error names the op's printed line, so its vars too
        _rt.comm.broadcast(x, src, f"initial value {k + 1} of {len(xs)}", ranks)


# --- pipeline -----------------------------------------------------------------------------
# Send/Recv move one var between neighbouring pipeline workers; the executor's pipeline
# runtime sets `_rt.pipeline` (virtual stage, micro-batch, symbolic dims) before each
# action, which the kernels use to check shapes and to name the place in errors.


def _expected(shape: list, dims: dict[str, int]) -> tuple[int | None, ...]:
    from metaopt.ir import eval_dim

    return tuple(d if isinstance(d, int) else eval_dim(d, dims) for d in shape)


@register("Send", domain="metaopt", needs_runtime=True, recomputable=False)
def send(x: torch.Tensor, peer: int, shape: list, _rt, _key: str) -> None:
    """Send `x` to pipeline worker `peer` (asynchronous: done by the end of the step)."""
    where = _rt.pipeline.where()
    _rt.comm.send(x, _rt.pipeline.rank_of(peer), _key, _expected(shape, _rt.pipeline.dims), where)


@register("Recv", domain="metaopt", needs_runtime=True, recomputable=False, fresh_outputs=True)
def recv(peer: int, shape: list, dtype: str, _rt, _key: str) -> torch.Tensor:
    """The var this op produces, as pipeline worker `peer` sent it."""
    from metaopt.ir import torch_dtype

    where = _rt.pipeline.where()
    expected = _expected(shape, _rt.pipeline.dims)
    return _rt.comm.recv(_rt.pipeline.rank_of(peer), _key, expected, torch_dtype(dtype), where)


@register(
    "GradMerge",
    domain="metaopt",
    inplace=((0, 0),),
    host_inputs=(2,),
    recomputable=False,
    notes="acc = grad at run 0, acc + grad after: pipeline micro-batches' and gradient merge's accumulator",
)
def grad_merge(acc: torch.Tensor, grad: torch.Tensor, micro_batch: torch.Tensor) -> torch.Tensor:
    if int(micro_batch) == 0:
        return acc.copy_(grad)
    return acc.add_(grad)


# --- local SGD ----------------------------------------------------------------------------
# passes/local_sgd.py: one LocalSGDAverage per param, right after the updates, and LocalSGDStep
# after them; both read the step number and the step of the last average (host values: the
# schedule is a branch).


def local_sgd_due(step: torch.Tensor, last: torch.Tensor, k_steps: int, begin_step: int) -> bool:
    """Fleet's rule: average every step up to `begin_step`, then every `k_steps` steps after
    the last average."""
    s = int(step.item())
    return s <= begin_step or s - int(last.item()) >= k_steps


@register_collective(
    "LocalSGDAverage",
    host_inputs=(1, 2),
    inplace=((0, 0),),
    recomputable=False,
    notes="local SGD: the updated param averaged over every worker in place, on the schedule's steps",
)
def local_sgd_average(
    x: torch.Tensor,
    step: torch.Tensor,
    last: torch.Tensor,
    k_steps: int = 1,
    begin_step: int = 1,
    *,
    _rt,
    _key: str,
) -> torch.Tensor:
    """The param as the update left it, averaged over the workers where the schedule says so,
    written into its own storage (the param's: the update wrote there in place)."""
    if local_sgd_due(step, last, k_steps, begin_step):
        (averaged,) = _rt.comm.all_reduce([x], "avg", f"param {_key}")
        x.copy_(averaged)
    return x


@register(
    "LocalSGDStep",
    domain="metaopt",
    host_inputs=(0, 1),
    recomputable=False,
    notes="local SGD: the step of the last average, moved to this step when it averaged",
)
def local_sgd_step(
    step: torch.Tensor, last: torch.Tensor, k_steps: int = 1, begin_step: int = 1
) -> torch.Tensor:
    return step.clone() if local_sgd_due(step, last, k_steps, begin_step) else last.clone()
