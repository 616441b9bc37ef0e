"""Segment parallel (issue 46's sep; metaopt/passes/segment_parallel.py): Paddle's sep_degree,
DeepSpeed-Ulysses' exchange of q, k and v around attention.

One process: the rewritten program of a rank at sep 2 (golden), its local shapes, its exchanges
and its refusals. Two gloo workers (sep 2, one launch): Hugging Face GPT-2 and LLaMA with every
dropout at 0.1 (one process's masks: the regions' from the shared stream, attention's over a
rank's heads after the exchange), 3 SGD steps through fleet with ``hybrid_configs["sep_degree"]``,
against one process training the same module on the same batches (rtol 1e-5, atol 4e-5: DESIGN's
bar for parallel against one process; the loss and the param grads are sums over the group, which
add the same numbers in another order), recompute bitwise against the same run without it, and
each worker's memory as predicted. The 4-worker dp 2 x sep 2 run is --slow.
"""

from __future__ import annotations

import sys
from pathlib import Path

import export_cache
import pytest
import torch

import metaopt
from metaopt.ir import verify
from metaopt.passes.segment_parallel import (
    SegmentParallelError,
    plan_segment_parallel,
    segment_parallel,
)

HERE = Path(__file__).resolve().parent
TRAINING = HERE.parent / "training"
sys.path.insert(0, str(TRAINING))
import sp_worker  # noqa: E402
import tp_worker  # noqa: E402

CASES = ["hf-gpt2", "hf-llama", "hf-gpt2:rc", "hf-gpt2:amp", "hf-llama:misfed"]
TRAINED = CASES[:4]


def _forward(name: str) -> metaopt.Program:
    module, inputs, kwargs = sp_worker.build(name)
    return export_cache.export(module, inputs, **kwargs)


@pytest.fixture(scope="module")
def gpt2() -> metaopt.Program:
    return _forward("hf-gpt2")


@pytest.fixture(scope="module")
def llama() -> metaopt.Program:
    return _forward("hf-llama")


def test_plan_and_rewritten_program_golden(gpt2, golden):
    plan = plan_segment_parallel(gpt2, degree=2, group=[0, 1])
    q = segment_parallel(gpt2, plan=plan)
    verify(q)
    golden("segment_parallel/hf-gpt2.plan", str(plan) + "\n")
    golden("segment_parallel/hf-gpt2", str(q))


@pytest.mark.parametrize("name", ["hf-gpt2", "hf-llama"])
def test_every_block_runs_on_the_local_sequence_and_attention_on_whole_ones(request, name):
    p = request.getfixturevalue(name.removeprefix("hf-"))
    plan = plan_segment_parallel(p, degree=2, group=[0, 1])
    q = segment_parallel(p, plan=plan)
    assert plan.length == 12 and not plan.gathers
    producers = q.producers()
    attention = [op for op in q.ops if op.type == "ScaledDotProductAttention"]
    assert len(attention) == len(plan.exchanges) == 2
    for op in attention:
        for x in op.inputs[:3]:  # whole sequences over half the heads
            assert q.ops[producers[x]].type == "SepAllToAll"
            b, h, s, d = q.vars[x].shape
            assert s == 12
        assert q.vars[op.outputs[0]].shape[2] == 12
    # the norms and the MLPs hold 6 tokens of every sequence; every param's grad is summed
    norms = [op for op in q.ops if op.type in ("LayerNormalization", "RMSNorm")]
    assert norms and all(q.vars[op.outputs[0]].shape[1] == 6 for op in norms)
    params = {v.name for v in p.params()}
    assert set(plan.copies) == params
    assert q.vars[q.loss_name].shape == p.vars[p.loss_name].shape
    assert q.ops[producers[q.loss_name]].type == "TPReduce"


def test_refusals_name_the_cause(gpt2):
    with pytest.raises(SegmentParallelError, match="sequence length 12 is not divisible by sep_degree 5"):
        plan_segment_parallel(gpt2, degree=5, group=[0, 1, 2, 3, 4])
    with pytest.raises(SegmentParallelError, match=r"must list the 2 global ranks"):
        plan_segment_parallel(gpt2, degree=2, group=[1, 0])
    heads = r"cannot be exchanged .* its heads \[4, 4, 4\] are not divisible by 3"
    with pytest.raises(SegmentParallelError, match=heads):
        plan_segment_parallel(gpt2, degree=3, group=[0, 1, 2])  # 4 heads over 3 ranks


def _launch(out: Path, dp: int, sep: int, cases: list[str]) -> dict[str, list[dict]]:
    return sp_worker.launch("sep_worker.py", out, dp * sep, [str(dp), str(sep)], cases)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    return _launch(tmp_path_factory.mktemp("sep"), 1, 2, CASES)


_one_process = sp_worker.one_process


@pytest.mark.parametrize("name", ["hf-gpt2", "hf-llama"])
def test_sep2_trains_as_one_process(runs, name):
    losses, params, evals = _one_process(name)
    for r in runs[name]:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(losses), rtol=1e-5, atol=0)
        # issue 49: the sep program's clone(for_test=True) on the held-out batch, twice the same bits
        assert r["eval"][0] == r["eval"][1]
        torch.testing.assert_close(torch.tensor(r["eval"][0]), torch.tensor(evals[0]), rtol=1e-5, atol=0)
        assert r["params"].keys() == params.keys()
        for n, t in params.items():
            torch.testing.assert_close(r["params"][n], t, rtol=1e-5, atol=4e-5, msg=n)
    assert "SepAllToAll" in runs[name][0]["program"]
    # the grads are summed over the sep group in the backward; at dp 1 nothing else reduces them
    assert " = AllReduce(" not in runs[name][0]["program"]


def test_each_workers_memory_is_as_predicted(runs):
    sp_worker.assert_memory_as_predicted(runs, TRAINED)


def test_recompute_beside_segment_parallel_is_bitwise(runs):
    """Bitwise, and the forward holds less: with a checkpoint per block of two, the first block's
    activations are held either way (Fleet: ops before the first checkpoint are not recomputed),
    so the step's peak, in the last block's backward, is the same; the forward's is lower."""
    for plain, rc in zip(runs["hf-gpt2"], runs["hf-gpt2:rc"]):
        assert plain["losses"] == rc["losses"]
        for n, t in plain["params"].items():
            assert torch.equal(t, rc["params"][n]), n

        def forward_peak(r: dict) -> int:
            return max(r["measured"][1][: r["forward_ops"]])

        assert forward_peak(rc) < forward_peak(plain)


def test_beside_bf16_amp_the_losses_stay_within_bf16s_reach_of_float32(runs):
    """bfloat16 AMP on the local sequence (the exchanges move bfloat16 q, k, v): each worker's
    losses within 1e-3 (relative) of the float32 sep run's, as sequence parallel's AMP test (the
    loss and the norms' statistics are float32; bfloat16's own step, 2^-8, would be 4e-3 per op)."""
    for amp, fp32 in zip(runs["hf-gpt2:amp"], runs["hf-gpt2"]):
        assert "SepAllToAll" in amp["program"] and "bfloat16" in amp["program"]
        torch.testing.assert_close(
            torch.tensor(amp["losses"]), torch.tensor(fp32["losses"]), rtol=1e-3, atol=0
        )


@pytest.mark.slow
def test_dp2_sep2_trains_as_one_process(tmp_path):
    """LLaMA without dropout: data-parallel replicas draw their own masks for their half of the
    batch, which one process does not."""
    ranks = _launch(tmp_path, 2, 2, ["hf-llama:nodrop"])["hf-llama:nodrop"]
    losses, params, evals = _one_process("hf-llama", 0.0)
    for r in ranks:
        for n, t in params.items():
            torch.testing.assert_close(r["params"][n], t, rtol=1e-5, atol=4e-5, msg=n)
    # data parallel averages over the data axis only (the sep group summed its part already)
    assert all("AllReduce(" in r["program"] and "group=data_parallel" in r["program"] for r in ranks)
    replicas = {r["dp_rank"]: r["losses"] for r in ranks}
    mean = [sum(ls[s] for ls in replicas.values()) / 2 for s in range(tp_worker.STEPS)]
    torch.testing.assert_close(torch.tensor(mean), torch.tensor(losses), rtol=1e-5, atol=0)


def test_sep_ranks_fed_different_batches_are_refused_on_the_first_run(runs):
    """A sep rank fed its own batch would train on no batch at all: every rank raises alike,
    naming the feed."""
    for r in runs["hf-llama:misfed"]:
        assert r["refused"] is not None
        assert (
            "FeedsAgree: feed 'input_ids' differs between ranks 0 and 1 of sep group [0, 1]" in r["refused"]
        )
        assert "must be fed the same batch" in r["refused"]


class _ScaledLoss(torch.nn.Module):
    """An LM loss read by another op (scaled by 0.5): the cross-entropy is not the program's loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 16)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.emb(ids))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 16), labels.reshape(-1)) * 0.5


def test_a_loss_read_by_another_op_is_summed_over_the_group_where_it_is_made():
    """The cross-entropy over the local tokens is summed where it is made, so the scale (or an
    auxiliary loss added) reads one process's value: else each rank would scale its own mean and
    the params' grads, summed over the group, would be twice one process's."""
    ids = torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(1))
    p = metaopt.export(_ScaledLoss(), (ids, ids), name="scaled")
    plan = plan_segment_parallel(p, degree=2, group=[0, 1])
    q = segment_parallel(p, plan=plan)
    verify(q)
    assert len(plan.losses) == 1
    (reduce_op,) = [op for op in q.ops if op.type == "TPReduce"]
    producers, consumers = q.producers(), q.consumers()
    assert q.ops[producers[q.loss_name]].type == "Mul"  # the scale, after the sum over the group
    assert [q.ops[i].type for i in consumers[reduce_op.outputs[0]]] == ["Mul"]
