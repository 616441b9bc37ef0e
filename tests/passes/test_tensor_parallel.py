"""Tensor parallel (passes/tensor_parallel.py): the plan, the refusals, and MP=2 on 2 gloo workers
equal to single-process training of the same program (gpt and bert tiny, and the zoo's Hugging
Face GPT-2, whose Conv1D layers are Gemms with [in, out] weights; dropout 0)."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch
from conftest import exported

import metaopt
from metaopt.ir import verify
from metaopt.ir.printer import fmt_op
from metaopt.ops import registry
from metaopt.passes.tensor_parallel import (
    TensorParallelError,
    plan_tensor_parallel,
    shard_tensor,
    tensor_parallel,
    unshard,
)

TRAINING = Path(__file__).resolve().parent.parent / "training"
sys.path.insert(0, str(TRAINING))
import tp_worker  # noqa: E402  (beside the other workers, started as a script there)
from workers import start_workers, wait_workers  # noqa: E402

# hf-gpt2: the zoo's Hugging Face GPT-2 (Conv1D layers = Gemm); hf-llama: rotary, GQA, SwiGLU
NAMES = ["gpt", "bert", "hf-gpt2", "hf-llama"]


def _plan(name: str, rank: int = 0, mp: int = 2, program=None, **kw):
    if program is None:
        program = _hf(name) if name.startswith("hf-") else exported(name)[2]
    args = {"column": tp_worker.COLUMN[name], "row": tp_worker.ROW[name], **kw}
    return plan_tensor_parallel(program, mp_degree=mp, mp_rank=rank, group=list(range(mp)), **args)


@functools.cache
def _hf(name: str) -> metaopt.Program:
    return tp_worker.export(name)


@pytest.mark.parametrize("name", NAMES)
def test_plan_text(name, golden):
    golden(f"tensor_parallel/{name}", str(_plan(name)) + "\n")


def test_rewritten_program_verifies_and_holds_each_ranks_heads_of_q_k_and_v():
    program = exported("gpt")[2]
    full = program.values["transformer.h.0.attn.c_attn.weight"]  # [3H, H] = q, k, v blocks of H rows
    parts = []
    for rank in range(2):
        q = tensor_parallel(program, plan=_plan("gpt", rank))
        verify(q)
        w = q.values["transformer.h.0.attn.c_attn.weight"]
        assert q.vars["transformer.h.0.attn.c_attn.weight"].shape == (48, 32)
        # rank r: rows [16r, 16r+16) of each of q, k, v (its one head of each, head size 16)
        want = torch.cat([full[b * 32 + rank * 16 : b * 32 + rank * 16 + 16] for b in range(3)])
        assert torch.equal(w, want)
        assert q.vars["transformer.h.0.attn/reshape"].shape == ("batch", 16, 1, 16)
        parts.append(w)
    assert torch.equal(unshard(parts, 0, (32, 32, 32)), full)
    assert program.vars["transformer.h.0.attn.c_attn.weight"].shape == (96, 32)  # the input untouched


def test_shard_and_unshard_are_inverse():
    t = torch.arange(24.0).reshape(2, 12)
    blocks = (4, 8)
    parts = [shard_tensor(t, 1, blocks, 2, r) for r in range(2)]
    assert parts[0].tolist() == [[0, 1, 4, 5, 6, 7], [12, 13, 16, 17, 18, 19]]
    assert torch.equal(unshard(parts, 1, blocks), t)


def test_split_that_cannot_propagate_is_refused_naming_the_op():
    program = exported("gpt")[2]
    # c_fc split, but c_proj not named row-parallel: the split Gelu output reaches a plain Linear
    with pytest.raises(TensorParallelError) as e:
        _plan("gpt", column=["transformer.h.*.mlp.c_fc"], row=[])
    c_proj = next(op for op in program.ops if op.outputs == ["transformer.h.0.mlp.c_proj"])
    assert fmt_op(c_proj) in str(e.value)
    assert "no split rule for Linear" in str(e.value)


def test_row_layer_with_a_replicated_input_is_refused_naming_it():
    program = exported("gpt")[2]
    with pytest.raises(TensorParallelError) as e:
        _plan("gpt", column=[], row=["transformer.h.*.mlp.c_proj"])
    c_proj = next(op for op in program.ops if op.outputs == ["transformer.h.0.mlp.c_proj"])
    assert fmt_op(c_proj) in str(e.value) and "is replicated" in str(e.value)


def test_unknown_layer_pattern_is_refused_with_a_suggestion():
    with pytest.raises(TensorParallelError, match="did you mean"):
        _plan("gpt", column=["transformer.h.0.mlp.c_fcc"], row=[])


def test_dropout_in_the_split_region_draws_from_the_ranks_stream():
    """MP-aware RNG (tests/training/test_tp_rng.py runs it): the attention dropout over split heads
    gets rank r's model-parallel stream, the dropouts on replicated values the shared one."""
    program = exported("gpt", dropout=0.1)[2]
    plan = _plan("gpt", rank=1, program=program)
    attention = "transformer.h.0.attn/scaleddotproductattention"
    sdpa = next(i for i, op in enumerate(program.ops) if op.outputs[0] == attention)
    assert plan.rng[sdpa] == {"rng": "model_parallel", "group": [0, 1]}
    drop = next(i for i, op in enumerate(program.ops) if op.outputs[0] == "transformer.drop")
    assert plan.rng[drop] == {"rng": "shared"}


def test_mp_degree_one_trains_as_the_unsplit_program():
    """One rank: TPReduce of a group of one is the identity; the row layer's bias after it."""
    ref = tp_worker.train(tp_worker.export("gpt"), "gpt")
    program = tp_worker.export("gpt")
    one = tp_worker.train(tensor_parallel(program, plan=_plan("gpt", mp=1, program=program)), "gpt")
    assert one["losses"] == pytest.approx(ref["losses"], rel=1e-6)
    for k, v in ref["params"].items():
        torch.testing.assert_close(one["params"][k], v, rtol=1e-5, atol=1e-6)


# --- MP=2 on 2 gloo workers ------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp")
    procs = start_workers(2, [str(TRAINING / "tp_worker.py"), str(out), *NAMES])
    wait_workers(procs, "tensor-parallel", 240)
    return out


@functools.cache
def _single_process(name: str) -> dict:
    return tp_worker.train(tp_worker.export(name), name)


@pytest.mark.parametrize("name", NAMES)
def test_two_mp_ranks_equal_one_process(two_workers, name):
    ranks = [torch.load(two_workers / f"{name}.rank{r}.pt", weights_only=True) for r in range(2)]
    ref = _single_process(name)
    split = {sp.name: sp for sp in _plan(name).params}
    assert split, "nothing was split"
    # The all-reduce sums the ranks' partial products (and the replicated input's grads) in
    # another order than one matmul does: float32 rounding differs by a few ulps per step.
    tol = {"rtol": 1e-5, "atol": 4e-5}
    for r in ranks:
        assert r["losses"] == pytest.approx(ref["losses"], rel=1e-5, abs=4e-5)
    for k, want in ref["params"].items():
        got = [r["params"][k] for r in ranks]
        if k in split:  # each rank its slice (q/k/v blocks: its 1/2 of each), put back together
            sp = split[k]
            assert got[0].shape == sp.local_shape
            torch.testing.assert_close(unshard(got, sp.axis, sp.blocks), want, **tol)
        else:  # replicated: the same update on every rank, from the same all-reduced values
            assert torch.equal(got[0], got[1]), k
            torch.testing.assert_close(got[0], want, **tol)


@pytest.mark.parametrize("name", NAMES)
def test_two_mp_ranks_adam_losses_equal_one_process(two_workers, name):
    """3 Adam steps: the losses (Adam-updated params are no judge: it turns the float noise of a
    different reduction order into lr-sized updates, DESIGN.md)."""
    ranks = [torch.load(two_workers / f"{name}.adam.rank{r}.pt", weights_only=True) for r in range(2)]
    ref = tp_worker.train(tp_worker.export(name), name, "adam")
    for r in ranks:
        assert r["losses"] == pytest.approx(ref["losses"], rel=1e-5, abs=1e-5)
    assert ranks[0]["losses"] == ranks[1]["losses"]  # the MP ranks compute one loss


def test_backward_all_reduces_the_grad_of_each_tp_copy():
    """Megatron's f and g from the gradient rules: TPCopy's grad is a TPReduce (all-reduce sum),
    TPReduce's an Identity; TPReduce is a collective the recompute pass re-runs (every MP rank
    runs the same program, so the group recomputes in lockstep)."""
    program = tp_worker.export("gpt")
    q = tensor_parallel(program, plan=_plan("gpt", program=program))
    metaopt.optimizer.SGD(learning_rate=0.1).minimize(q.loss)
    verify(q)
    copies = [op for op in q.ops if op.type == "TPCopy"]
    backward_reduces = [op for op in q.ops if op.type == "TPReduce" and op.role == "backward"]
    assert len(copies) == len(backward_reduces) == 4
    assert all(op.attrs["group"] == [0, 1] for op in backward_reduces)
    row = registry.get("TPReduce")
    assert row.collective and row.needs_runtime and row.recomputable


def test_dropout_op_on_a_split_value_draws_unless_p_is_zero():
    from metaopt.ir import Op
    from metaopt.ops import sharding

    s = sharding.Shard(2, (128,))
    consts = {"p": [0.1], "zero": [0.0], "train": [True]}

    def args(ratio: str) -> sharding.ShardArgs:
        op = Op("Dropout", ["h", ratio, "train"], ["y"])
        shapes = [("batch", 16, 128), (), ()]
        return sharding.ShardArgs(op, [s, None, None], shapes, [shapes[0]], 2, consts.get)

    drawing = sharding.rule("Dropout").propagate(args("p"))
    assert drawing.outputs == [s] and drawing.draws  # the pass gives it the rank's stream
    zero = sharding.rule("Dropout").propagate(args("zero"))
    assert zero.outputs == [s] and not zero.draws
