"""Context parallel (issue 46's cp; metaopt/passes/context_parallel.py):
``hybrid_configs["cp_degree"]``, the local queries attending over the whole sequence as k/v blocks
go round a ring, each rank holding two zig-zag runs of every sequence.

One process: the rewritten program of a rank at cp 2 (golden), its local shapes and refusals. Two
gloo workers (cp 2, one launch): Hugging Face GPT-2 and LLaMA with every dropout at 0.1 (one
process's masks: the regions' from the shared stream, the ring's rows of attention's), 3 SGD steps
through fleet, against one process training the same module on the same batches (rtol 1e-5, atol
4e-5: DESIGN's bar for parallel against one process; the ring's online softmax and the sums over the
group add the same numbers in another order), the eval program on a held-out batch (rtol 1e-5),
recompute bitwise against the same run without it (the recomputed ring replays its mask), bfloat16
AMP within 1e-3 of float32, each worker's memory as predicted, and misfed ranks refused. Four
workers (--slow): cp 2 x mp 2 (tensor parallel's heads beside the ring, attention dropout one
process's mask over every head), the same checks; cp 2 beside ZeRO (stages 1 and 3, sharding 2) and
beside a pipeline (pp 2, 1F1B), LLaMA without dropout (data-side replicas and micro-batches draw
their own masks, which one process does not). The kernels' float64 exactness against torch is
tests/ops/test_ring_attention.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import export_cache
import pytest
import torch

import metaopt
from metaopt.ir import verify
from metaopt.passes.context_parallel import context_parallel, plan_context_parallel
from metaopt.passes.segment_parallel import SegmentParallelError, plan_segment_parallel

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "training"))
import sp_worker  # noqa: E402

from metaopt.passes.tensor_parallel import unshard  # noqa: E402

CASES = ["hf-gpt2", "hf-llama", "hf-gpt2:rc", "hf-gpt2:amp", "hf-llama:misfed"]
TRAINED = CASES[:4]


@pytest.fixture(scope="module")
def gpt2() -> metaopt.Program:
    module, inputs, kwargs = sp_worker.build("hf-gpt2")
    return export_cache.export(module, inputs, **kwargs)


def test_plan_and_rewritten_program_golden(gpt2, golden):
    plan = plan_context_parallel(gpt2, degree=2, group=[0, 1])
    q = context_parallel(gpt2, plan=plan)
    verify(q)
    golden("context_parallel/hf-gpt2.plan", str(plan) + "\n")
    golden("context_parallel/hf-gpt2", str(q))


def test_attention_rings_over_the_local_queries_with_its_masks_rows(gpt2):
    plan = plan_context_parallel(gpt2, degree=2, group=[0, 1])
    q = context_parallel(gpt2, plan=plan)
    assert plan.length == 12 and plan.layout == "zigzag" and not plan.gathers
    rings = [op for op in q.ops if op.type == "RingAttention"]
    assert len(rings) == len(plan.exchanges) == 2
    assert not any(op.type in ("SepAllToAll", "ScaledDotProductAttention") for op in q.ops)
    producers = q.producers()
    for op in rings:
        assert op.attrs["layout"] == "zigzag" and op.attrs["length"] == 12 and op.attrs["rng"] == "shared"
        for x in op.inputs[:3]:  # the local queries, keys and values: 6 of 12 positions, every head
            assert q.vars[x].shape[1:] == (4, 6, 8)
        mask = q.ops[producers[op.inputs[3]]]
        assert mask.type == "SPScatter" and mask.attrs == {"axis": 2, "group": [0, 1], "layout": "zigzag"}
        assert q.vars[op.inputs[3]].shape[-2:] == (6, 12)  # the local queries' rows, every key
    # every op placing positions places the zig-zag runs
    placing = [op for op in q.ops if op.type == "SPScatter" or op.attrs.get("slice_axis") is not None]
    assert placing and all(op.attrs.get("layout", op.attrs.get("slice_layout")) == "zigzag" for op in placing)


def test_refusals_name_the_cause(gpt2):
    with pytest.raises(SegmentParallelError, match=r"12 is not divisible by 2 x cp_degree = 8 \(the zigzag"):
        plan_context_parallel(gpt2, degree=4, group=[0, 1, 2, 3])
    # any head count rings (4 heads over 3 ranks would not exchange); the sequence is what splits
    plan = plan_context_parallel(gpt2, degree=3, group=[0, 1, 2], layout="contiguous")
    assert len(plan.exchanges) == 2
    with pytest.raises(SegmentParallelError, match="cannot be exchanged"):
        plan_segment_parallel(gpt2, degree=3, group=[0, 1, 2])
    unknown = gpt2.clone()  # a mask whose rows the IR does not know: which are the local queries'?
    mask = next(op.inputs[3] for op in unknown.ops if op.type == "ScaledDotProductAttention")
    unknown.vars[mask].shape = None
    with pytest.raises(
        NotImplementedError, match=r"mask .* has None rows, neither one nor the sequence's 12"
    ):
        plan_context_parallel(unknown, degree=2, group=[0, 1])
    with pytest.raises(ValueError, match="make it with plan_context_parallel"):
        context_parallel(gpt2, plan=plan_segment_parallel(gpt2, degree=2, group=[0, 1]))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    return sp_worker.launch("sep_worker.py", tmp_path_factory.mktemp("cp"), 2, ["1", "cp2"], CASES)


@pytest.mark.parametrize("name", ["hf-gpt2", "hf-llama"])
def test_cp2_trains_as_one_process(runs, name):
    losses, params, evals = sp_worker.one_process(name)
    for r in runs[name]:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(losses), rtol=1e-5, atol=0)
        assert r["eval"][0] == r["eval"][1]  # issue 49: clone(for_test=True), twice the same bits
        torch.testing.assert_close(torch.tensor(r["eval"][0]), torch.tensor(evals[0]), rtol=1e-5, atol=0)
        assert r["params"].keys() == params.keys()
        for n, t in params.items():
            torch.testing.assert_close(r["params"][n], t, rtol=1e-5, atol=4e-5, msg=n)
        assert r["plan"].startswith("context_parallel: degree=2")
    program = runs[name][0]["program"]
    assert "RingAttention(" in program and "RingAttentionGrad(" in program and "SepAllToAll" not in program
    assert " = AllReduce(" not in program  # at dp 1 the grads are summed over the cp group only


def test_each_workers_memory_is_as_predicted(runs):
    sp_worker.assert_memory_as_predicted(runs, TRAINED)


def test_recompute_beside_context_parallel_is_bitwise(runs):
    """The recomputed ring replays its forward's dropout mask (RngReplayCollective) and meets its
    peers again: the same bits as without recompute."""
    for plain, rc in zip(runs["hf-gpt2"], runs["hf-gpt2:rc"], strict=True):
        assert "RngReplayCollective(" in rc["program"]
        assert plain["losses"] == rc["losses"]
        for n, t in plain["params"].items():
            assert torch.equal(t, rc["params"][n]), n


def test_beside_bf16_amp_the_losses_stay_within_bf16s_reach_of_float32(runs):
    """bfloat16 AMP on the local sequence (the ring moves bfloat16 k and v, accumulating in
    float32): each worker's losses within 1e-3 (relative) of the float32 cp run's, as segment
    parallel's AMP test."""
    for amp, fp32 in zip(runs["hf-gpt2:amp"], runs["hf-gpt2"], strict=True):
        assert "RingAttention(" in amp["program"] and "bfloat16" in amp["program"]
        torch.testing.assert_close(
            torch.tensor(amp["losses"]), torch.tensor(fp32["losses"]), rtol=1e-3, atol=0
        )


def test_cp_ranks_fed_different_batches_are_refused_on_the_first_run(runs):
    for r in runs["hf-llama:misfed"]:
        assert r["refused"] is not None
        assert "FeedsAgree: feed 'input_ids' differs between ranks 0 and 1" in r["refused"]


@pytest.mark.slow
def test_cp2_beside_mp2_trains_as_one_process(tmp_path):
    """Tensor parallel splits the heads (and the layers) over mp, the ring the sequence over cp:
    the four workers' params, unsplit per cp rank, are one process's; every worker's losses and
    eval too, and each one's memory as predicted."""
    cases = ["hf-gpt2", "hf-llama"]
    runs = sp_worker.launch("sep_worker.py", tmp_path, 4, ["1", "cp2xmp2"], cases)
    for name in cases:
        losses, params, evals = sp_worker.one_process(name)
        ranks = runs[name]
        for r in ranks:
            torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(losses), rtol=1e-5, atol=0)
            assert r["eval"][0] == r["eval"][1]
            torch.testing.assert_close(torch.tensor(r["eval"][0]), torch.tensor(evals[0]), rtol=1e-5, atol=0)
            assert r["measured"] == r["predicted"], name
            assert r["splits"]  # tensor parallel split its layers
        by = {(r["sep_rank"], r["mp_rank"]): r for r in ranks}
        for cp_rank in (0, 1):
            group = [by[(cp_rank, 0)], by[(cp_rank, 1)]]
            for n, t in params.items():
                got = group[0]["params"][n]
                if n in group[0]["splits"]:
                    axis, blocks = group[0]["splits"][n]
                    got = unshard([g["params"][n] for g in group], axis, blocks)
                torch.testing.assert_close(got, t, rtol=1e-5, atol=4e-5, msg=n)
        program = ranks[0]["program"]
        assert "RingAttention(" in program and "heads_group=model_parallel" in program


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["cp2xzero1", "cp2xzero3", "cp2xpp2"])
def test_cp2_beside_zero_and_a_pipeline_trains_as_one_process(tmp_path, layout):
    """Four workers: the ring over cp 2, and ZeRO over 2 sharding ranks (each fed half the batch:
    their mean loss is one process's) or a pipeline of 2 stages (every worker fed the whole batch,
    the loss on the last stage). LLaMA without dropout (module doc)."""
    case = "hf-llama:nodrop"
    ranks = sp_worker.launch("sep_worker.py", tmp_path, 4, ["1", layout], [case])[case]
    losses, params, evals = sp_worker.one_process("hf-llama", 0.0)
    if layout == "cp2xpp2":
        last = [r for r in ranks if r["stage"] == 1]
        assert len(last) == 2 and all(r["losses"] == last[0]["losses"] for r in last)
        torch.testing.assert_close(torch.tensor(last[0]["losses"]), torch.tensor(losses), rtol=1e-5, atol=0)
        return
    halves = {}
    for r in ranks:
        halves.setdefault(tuple(r["losses"]), []).append(r)
        torch.testing.assert_close(torch.tensor(r["eval"][0]), torch.tensor(evals[0]), rtol=1e-5, atol=0)
        assert r["measured"] == r["predicted"], layout
        if layout == "cp2xzero1":  # every param whole on every worker (stage 3 holds its shards)
            for n, t in params.items():
                torch.testing.assert_close(r["params"][n], t, rtol=1e-5, atol=4e-5, msg=n)
    assert len(halves) == 2  # each sharding rank's half batch, the same on both cp ranks
    mean = torch.tensor(list(halves)).mean(0)
    torch.testing.assert_close(mean, torch.tensor(losses), rtol=1e-5, atol=0)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_simulated_worker_rewrites_and_predicts_as_the_real_one(runs, rank):
    """fleet.simulate (issue 45's simulation at scale): this one process, standing in for worker
    `rank` of the cp 2 job, joins no group, yet its minimize gives the program the real worker
    printed, line for line, and estimate_memory that worker's peak and timeline."""
    import sep_worker

    from metaopt import fleet
    from metaopt.fleet import env
    from metaopt.ir import roles
    from metaopt.passes.memory_estimate import estimate_memory

    module, inputs, kwargs = sp_worker.build("hf-gpt2")
    program = export_cache.export(module, inputs, **kwargs)
    strategy = sep_worker.strategy(1, "cp2", "hf-gpt2")
    try:
        fleet.simulate(2, rank, strategy)
        assert env.is_simulated() and fleet.worker_index() == rank and fleet.worker_num() == 2
        fleet.distributed_optimizer(
            metaopt.optimizer.SGD(learning_rate=sp_worker.tp_worker.LR), strategy
        ).minimize(program.loss)
    finally:
        env.reset()
    real = runs["hf-gpt2"][rank]
    assert str(program) == real["program"]
    batch = sp_worker.batch("hf-gpt2", 0)["labels"].shape[0]
    est = estimate_memory(program, dims={"batch": batch}, workspace=False)
    timeline = [b for b, op in zip(est.timeline, program.ops, strict=True) if not roles.is_startup(op.role)]
    assert (est.peak_bytes, timeline) == real["predicted"]
