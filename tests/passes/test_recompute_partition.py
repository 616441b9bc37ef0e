"""Recompute partition as a pure pass, in one process: the plan and its skipped reasons, the
printed program (golden), the memory it declares, offload moving the slice, the refusals, and
the slice / gather kernels with a stand-in communicator. Running it over 2 gloo workers, bit for
bit against recompute alone: tests/fleet/test_fleet_recompute_partition.py."""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import metaopt
from metaopt.ir import eval_dim, names, parse_program, print_program, roles, verify
from metaopt.ops import registry
from metaopt.ops.kernels.partition import join_slices, slice_length, take_slice
from metaopt.passes.memory_estimate import estimate_memory, where_alive
from metaopt.passes.offload import offload, offloaded_bytes
from metaopt.passes.recompute import apply_recompute, plan_recompute
from metaopt.passes.recompute_partition import (
    RecomputePartitionError,
    _slice_dim,
    plan_recompute_partition,
    recompute_partition,
)
from metaopt.passes.tensor_parallel import tensor_parallel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "training"))
import fleet_tp_recompute_worker as worker  # noqa: E402
import tp_worker  # noqa: E402

NAME = "gpt"
SPLIT_CKPT = "transformer.h.0.attn/reshape_3"  # the attention output, split over the heads


@functools.cache
def _training() -> tuple[metaopt.Program, object]:
    """Rank 0 of MP=2 on gpt tiny, trained by SGD (not recomputed yet), and its TP plan."""
    program = tp_worker.export(NAME)
    tp = tp_worker.plan(program, NAME, 0, 2)
    q = tensor_parallel(program, plan=tp)
    metaopt.optimizer.SGD(learning_rate=0.1).minimize(q.loss)
    return q, tp


def _recomputed(checkpoints: list[str]) -> tuple[metaopt.Program, list[str], object]:
    q, tp = _training()
    plan = plan_recompute(q, checkpoints=checkpoints)
    return apply_recompute(q, plan), plan.checkpoints, tp


def _partitioned(checkpoints: list[str] = worker.CHECKPOINTS):
    r, ckpts, tp = _recomputed(checkpoints)
    plan = plan_recompute_partition(r, checkpoints=ckpts, mp_degree=2, group=[0, 1], split=tp.sharded)
    return r, plan, recompute_partition(r, plan=plan)


def test_printed_program(golden):
    _, plan, q = _partitioned()
    verify(q)
    golden("recompute_partition/gpt", print_program(q))


def test_plan_says_what_is_sliced_and_why_the_rest_is_not():
    _, plan, _ = _partitioned([SPLIT_CKPT, *worker.CHECKPOINTS])
    assert [c.checkpoint for c in plan.partitioned] == ["transformer.drop", "transformer.h.0"]
    why = dict(plan.skipped)
    assert why[SPLIT_CKPT].startswith("split over the model-parallel group by tensor parallel already")
    assert why["transformer.h.1"].startswith("the last checkpoint opens no recomputed segment")
    text = str(plan)
    assert text.splitlines()[0] == (
        "recompute partition: 2 checkpoint(s) held as 1/2 slices over the model-parallel group ([0, 1])"
    )
    assert "  transformer.h.0: transformer.h.0@MP_SLICE ['256*batch'], gathered before `" in text
    assert f"  skipped {SPLIT_CKPT}: split over the model-parallel group" in text


def test_after_the_forward_only_the_slice_is_held_and_everything_reads_the_gathered_copy():
    r, plan, q = _partitioned()
    first_after = next(i for i, op in enumerate(q.ops) if roles.after_forward(op.role))
    producers = q.producers()
    for c in plan.partitioned:
        slice_op = q.ops[producers[c.slice]]
        assert producers[c.slice] == producers[c.checkpoint] + 1  # right after the checkpoint
        assert (slice_op.role, slice_op.origin, slice_op.attrs) == (
            "partition",
            c.checkpoint,
            {"group": [0, 1], "parts": 2},
        )
        gather = q.ops[producers[c.gathered]]
        assert (gather.role, gather.origin, gather.inputs) == ("recompute", c.checkpoint, [c.slice])
        assert gather.attrs["shape"] == [-1, 16, 32]
        readers = [i for i, op in enumerate(q.ops) if c.checkpoint in op.inputs]
        assert readers and max(readers) < first_after  # the forward's readers only: freed there
        assert producers[c.gathered] + 1 == min(i for i, op in enumerate(q.ops) if c.gathered in op.inputs)
        # 1/mp of the bytes, declared: float32 [batch, 16, 32] -> [256*batch]
        assert q.vars[c.slice].nbytes({"batch": 8}) * 2 == q.vars[c.checkpoint].nbytes({"batch": 8})
    # nothing else changed: without the new ops and renamed reads it is the recomputed program
    back = q.clone()
    back.ops = [op for op in back.ops if op.type not in ("PartitionSlice", "PartitionGather")]
    undo = {c.gathered: c.checkpoint for c in plan.partitioned}
    for op in back.ops:
        op.inputs = [undo.get(x, x) for x in op.inputs]
    assert [str(op) for op in back.ops] == [str(op) for op in r.ops]


def test_estimate_counts_the_slice_from_the_forward_to_the_gather():
    r, plan, q = _partitioned()
    dims = {"batch": 8}
    at = [next(i for i, op in enumerate(p.ops) if roles.is_backward(op.role)) for p in (r, q)]
    held_r = where_alive(r, at[0], dims=dims, workspace=False)
    held_q = where_alive(q, at[1], dims=dims, workspace=False)
    full = 8 * 16 * 32 * 4
    slices = {v.name: v.nbytes for v in held_q.vars if v.name in plan.slices.values()}
    assert slices == {c.slice: full // 2 for c in plan.partitioned}
    assert held_r.total_bytes - held_q.total_bytes == len(plan.partitioned) * full // 2
    assert estimate_memory(q, dims=dims).peak_bytes <= estimate_memory(r, dims=dims).peak_bytes


def test_offload_moves_the_slice_not_the_checkpoint():
    r, plan, q = _partitioned()
    ckpts = plan_recompute(_training()[0], checkpoints=worker.CHECKPOINTS).checkpoints
    both = offload(q, checkpoints=ckpts, moved=plan.slices)
    verify(both)
    alone = offload(r, checkpoints=ckpts)
    assert offloaded_bytes(both, batch=8) * 2 == offloaded_bytes(alone, batch=8) > 0
    producers = both.producers()
    for c in plan.partitioned:
        pinned = both.ops[producers[names.pinned(c.slice)]]
        assert pinned.inputs == [c.slice] and pinned.role == "offload"
        gather = both.ops[producers[c.gathered]]
        assert gather.inputs == [names.fetch(c.slice)]  # the gather reads the copy fetched back


def test_nothing_to_partition_leaves_the_program_as_it_is():
    r, plan, q = _partitioned(["transformer.h.1"])  # the last checkpoint only
    assert plan.partitioned == [] and [n for n, _ in plan.skipped] == ["transformer.h.1"]
    assert print_program(q) == print_program(r)


def test_refusals_name_what_is_wrong():
    r, ckpts, tp = _recomputed(worker.CHECKPOINTS)
    with pytest.raises(RecomputePartitionError, match="mp_degree=1 has nothing to slice over"):
        plan_recompute_partition(r, checkpoints=ckpts, mp_degree=1, group=[0])
    with pytest.raises(RecomputePartitionError, match=r"'transformer\.h\.9' is not a var .*did you mean"):
        plan_recompute_partition(r, checkpoints=["transformer.h.9"], mp_degree=2, group=[0, 1])
    with pytest.raises(RecomputePartitionError, match="must list the 2 ranks"):
        plan_recompute_partition(r, checkpoints=ckpts, mp_degree=2, group=[0, 1, 2])
    forward = tp_worker.export(NAME)
    with pytest.raises(RecomputePartitionError, match="has no backward"):
        plan_recompute_partition(forward, checkpoints=["transformer.h.0"], mp_degree=2, group=[0, 1])


# --- the slice and its gather ---------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(8, 16, 32), (3, 5), (7,), (2, 3, 1)])
@pytest.mark.parametrize("parts", [2, 3, 4])
def test_slices_put_back_together_are_the_value_bit_for_bit(shape, parts):
    x = torch.randn(shape, dtype=torch.float64)
    pieces = [take_slice(x, parts, k) for k in range(parts)]
    n = slice_length(x.numel(), parts)
    assert all(p.shape == (n,) for p in pieces)
    assert all(p.untyped_storage().data_ptr() != x.untyped_storage().data_ptr() for p in pieces)
    template = [-1, *shape[1:]] if len(shape) > 1 and parts <= x[0].numel() else list(shape)
    y = join_slices(pieces, template)
    assert y.shape == x.shape and torch.equal(y, x)
    assert y.untyped_storage().nbytes() == x.untyped_storage().nbytes()  # padding dropped


@pytest.mark.parametrize("shape", [("batch", 16, 32), ("batch", 5), ("4*batch", 3), (6, 5)])
def test_the_declared_slice_length_is_the_kernels(shape):
    for batch in (1, 2, 3, 7):
        dims = [eval_dim(d, {"batch": batch}) for d in shape]
        want = slice_length(torch.Size(dims).numel(), 2)
        assert eval_dim(_slice_dim(shape, 2), {"batch": batch}) == want, (shape, batch)


def test_a_padded_slice_length_prints_and_parses_back():
    p = metaopt.Program("padded")
    p.add_var(metaopt.Var("x@MP_SLICE", "float32", (_slice_dim(("batch", 5), 2),)))
    assert p.vars["x@MP_SLICE"].shape == ("(5*batch+1)//2",)
    assert print_program(parse_program(print_program(p))) == print_program(p)


class _Comm:
    """A stand-in for the communicator: this worker is `rank`; all_gather hands back every
    rank's slice of `values` (what the other workers would send)."""

    def __init__(self, rank: int, x: torch.Tensor, parts: int) -> None:
        self.rank, self.x, self.parts, self.calls = rank, x, parts, []

    def all_gather(self, t, what, ranks):
        self.calls.append((what, list(ranks)))
        assert torch.equal(t, take_slice(self.x, self.parts, ranks.index(self.rank)))
        return [take_slice(self.x, self.parts, k) for k in range(len(ranks))]


def test_the_kernels_cut_this_ranks_slice_and_gather_the_value_back():
    x = torch.randn(3, 5)
    slice_row, gather_row = registry.get("PartitionSlice"), registry.get("PartitionGather")
    assert gather_row.collective and gather_row.needs_runtime and not gather_row.recomputable
    for rank in (4, 6):  # the global ranks of a model-parallel group [4, 6]
        rt = SimpleNamespace(comm=_Comm(rank, x, 2))
        s = slice_row.kernel(x, group=[6, 4], parts=2, _rt=rt, _key="x@MP_SLICE")
        assert torch.equal(s, take_slice(x, 2, [4, 6].index(rank)))
        y = gather_row.kernel(s, group=[6, 4], parts=2, shape=[-1, 5], _rt=rt, _key="x@MP_GATHERED")
        assert torch.equal(y, x)
        assert rt.comm.calls == [("x@MP_GATHERED over model-parallel group [4, 6]", [4, 6])]


def test_a_kernel_run_by_a_worker_outside_its_group_is_refused():
    rt = SimpleNamespace(comm=_Comm(5, torch.zeros(4), 2))
    with pytest.raises(
        ValueError, match=r"rank 5\) with parts=2 is not one of 2 ranks of its model-parallel group \[0, 1\]"
    ):
        registry.get("PartitionSlice").kernel(torch.zeros(4), group=[0, 1], parts=2, _rt=rt, _key="x")
