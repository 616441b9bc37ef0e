"""Recompute partition in a pipeline (issue 16): MP=2 x PP=2 on 4 gloo workers
(tests/training/hybrid_pp_recompute_worker.py) on the tiny GPT, 3 SGD steps, 1F1B, 2
micro-batches. Recompute + partition (and + offload) trains bit for bit as recompute alone, with
dropout 0 and 0.1 and with automatic cuts; each stage slices and gathers the checkpoints its own
backward reads (``transformer.h.0``, sent across the cut, by the stage that receives it); the
bytes a stage holds from the forward to the backward fall by half of each sliced checkpoint,
measured and predicted alike; offload moves only the slices. In one process: the stage program
(golden), where the ops go, and the plan."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import metaopt
import programs
from metaopt import fleet
from metaopt.fleet import env
from metaopt.frontend.onnx_save import save
from metaopt.ir import verify
from metaopt.layout.topology import HybridCommunicateGroup, Topology

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import hybrid_pp_recompute_worker as worker  # noqa: E402
import tp_worker  # noqa: E402
from test_hybrid_pipeline import _exported, _reference  # noqa: E402
from workers import start_workers, wait_workers  # noqa: E402

NAME = worker.NAME
WORLD = 4  # MP=2 x PP=2
MP = 2
MICRO = tp_worker.BATCH // worker.hybrid_pp_worker.MICRO_BATCHES  # the batch each part runs
# rc vs one process: the MP all-reduces and the micro-batch sums add in another order than one
# process's matmul and batch mean: a few ulps per step (the repo's bar for DP / PP / TP).
TOL = {"rtol": 1e-5, "atol": 4e-5}
WORKER_TIMEOUT_S = 600  # 4 processes x 9 minimizes on a 2-core machine shared with others
RUNS = {
    # dropout 0: every case, and automatic cuts (a segment spanning both stages)
    "d0": ["rc", "part", "off", "off_part", "rc_auto", "part_auto"],
    # dropout 0.1: the masks come from the MP-aware streams, replayed by recompute
    "d1": ["rc", "part", "off_part"],
}


def _export(dropout: float) -> metaopt.Program:
    mod = programs.get(NAME)
    model = mod.build("tiny", seed=tp_worker.SEED, dropout=dropout)
    return metaopt.export(model, mod.example_inputs("tiny", 4, seed=1), name=NAME)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict[str, list[dict]]]:
    """Every case of RUNS on the same 4 workers, loaded per tag, case and rank; bounded: a hang is
    a failure, never a stuck suite."""
    out = tmp_path_factory.mktemp("pp_partition")
    specs = []
    for tag, dropout in (("d0", 0.0), ("d1", 0.1)):
        path = out / f"{tag}.onnx"
        save(_exported() if dropout == 0 else _export(dropout), path)  # the workers load it
        specs.append(f"{tag}:{path}:{','.join(RUNS[tag])}")
    procs = start_workers(WORLD, [str(HERE / "hybrid_pp_recompute_worker.py"), str(out), *specs])
    wait_workers(procs, "hybrid pipeline partition", WORKER_TIMEOUT_S)
    return {
        tag: {
            c: [torch.load(out / f"{tag}.{c}.rank{r}.pt", weights_only=False) for r in range(WORLD)]
            for c in cases
        }
        for tag, cases in RUNS.items()
    }


def _assert_bitwise(a: dict, b: dict, what: str) -> None:
    assert a["losses"] == b["losses"], what
    assert a["params"].keys() == b["params"].keys(), what
    for k, t in a["params"].items():
        assert torch.equal(t, b["params"][k]), f"{what}: {k}"


def _stage(rank: int) -> int:
    return Topology(mp_degree=MP, pp_degree=2).get_coord(rank).pipe


# --- 4 workers ---------------------------------------------------------------------------------


def test_recompute_in_the_hybrid_pipeline_trains_as_one_process(runs):
    """The baseline the partition is held to: recompute alone in MP=2 x PP=2 (named and automatic
    cuts) is within the hybrid bar of one process (losses on the last stage, None on the first)."""
    ref = _reference("sgd")["losses"]
    for case in ("rc", "rc_auto"):
        for r in range(WORLD):
            losses = runs["d0"][case][r]["losses"]
            if _stage(r) == 0:
                assert losses == [None] * tp_worker.STEPS, (case, r)
            else:
                torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), **TOL)


@pytest.mark.parametrize(
    "tag, case, base",
    [
        ("d0", "part", "rc"),
        ("d0", "off", "rc"),
        ("d0", "off_part", "rc"),
        ("d0", "part_auto", "rc_auto"),
        ("d1", "part", "rc"),
        ("d1", "off_part", "rc"),
    ],
)
def test_partition_in_a_pipeline_is_bit_identical_to_recompute_alone(runs, tag, case, base):
    """The gathered checkpoint is the forward's (or the received value's) bit for bit, on every
    stage: bitwise the same losses and (local) params on all 4 workers, CPU (no tolerance)."""
    for r in range(WORLD):
        _assert_bitwise(runs[tag][case][r], runs[tag][base][r], f"rank {r}: {tag} {case} vs {base}")


def test_dropout_draws_masks(runs):
    """The dropout 0.1 runs are not dropout 0 in disguise (their bitwise match means something)."""
    last = [r for r in range(WORLD) if _stage(r) == 1]
    for r in last:
        assert runs["d1"]["rc"][r]["losses"] != runs["d0"]["rc"][r]["losses"], r
    assert any(o.startswith("RngState") for o in runs["d1"]["part"][0]["ops"])


# Where each checkpoint is sliced and gathered: with the cut at transformer.h.1 ("part"), and
# where the automatic cut falls on the tiny GPT ("part_auto"): inside block 1, at its attention,
# so the segment opened by transformer.h.0 spans both stages and each slices and gathers its own
# copy of h.0 (stage 0 recomputes ln_1 from it, stage 1 the rest of the block).
PARTITIONED = {
    "part": {"transformer.drop": [0], "transformer.h.0": [1]},
    "part_auto": {"transformer.drop": [0], "transformer.h.0": [0, 1]},
}


@pytest.mark.parametrize("case", ["part", "part_auto"])
def test_each_stage_slices_and_gathers_what_its_backward_reads(runs, case):
    """Cut at transformer.h.1: stage 0 slices transformer.drop (its own segment's input), stage 1
    the h.0 it receives. Automatic cuts: see PARTITIONED."""
    for r in range(WORLD):
        res = runs["d0"][case][r]
        stage = _stage(r)
        assert res["stage"] == stage
        mine = [c for c, stages in PARTITIONED[case].items() if stage in stages]
        assert res["ops"].count("PartitionSlice partition") == len(mine), r
        assert res["ops"].count("PartitionGather recompute") == len(mine), r
        for c in PARTITIONED[case]:
            assert (res["slices"][c] in res["var_bytes"]) == (c in mine), (r, c)
        plan = res["pipeline_plan"]
        for c, stages in PARTITIONED[case].items():
            assert f"  recompute partition of {c}: sliced and gathered in stage(s) {stages}" in plan
        assert (
            "skipped transformer.h.1: the last checkpoint opens no recomputed segment"
            in res["partition_plan"]
        )


def test_a_stage_holds_one_mp_th_of_its_checkpoint_from_the_forward_to_the_backward(runs):
    """After micro-batch 0's forward (the first action of both stages under 1F1B) a stage holds
    its checkpoint's slice instead of the checkpoint: the executor's count and estimate_memory
    of the stage program at the micro-batch size fall by the same bytes, half the checkpoint's
    (float32 [4, 16, 32]: divisible by mp, no padding). Exact integers: no tolerance."""
    for r in range(WORLD):
        rc, part = runs["d0"]["rc"][r], runs["d0"]["part"][r]
        checkpoint = {0: "transformer.drop", 1: "transformer.h.0"}[_stage(r)]
        whole = rc["var_bytes"][checkpoint]
        assert whole == MICRO * 16 * 32 * 4
        assert part["var_bytes"][part["slices"][checkpoint]] == whole // MP
        measured = rc["timeline"][rc["end_forward"]] - part["timeline"][part["end_forward"]]
        predicted = rc["estimate"][rc["end_forward"]] - part["estimate"][part["end_forward"]]
        assert measured == predicted == whole // MP, r


def test_offload_with_partition_moves_only_the_slice_per_stage(runs):
    """With enable_offload each stage copies its slice to host and back: half the bytes of offload
    alone, per micro-batch and at the host peak (1F1B: two micro-batches in flight on stage 0,
    one on stage 1)."""
    for r in range(WORLD):
        off, both = runs["d0"]["off"][r]["stats"], runs["d0"]["off_part"][r]["stats"]
        assert off["offloaded_bytes"] == off["fetched_bytes"] > 0, r
        assert both["offloaded_bytes"] == both["fetched_bytes"] == off["offloaded_bytes"] // MP, r
        assert both["host_peak_bytes"] == off["host_peak_bytes"] // MP, r
        ops = runs["d0"]["off_part"][r]["ops"]
        assert ops.count("Memcpy offload") == ops.count("Memcpy prefetch") == 1, r


# --- one process: the stage programs as MP rank 0 builds them -------------------------------------


def _minimize(monkeypatch, cuts: list[str], offload: bool = False) -> fleet.DistributedOptimizer:
    """Rank 0 of MP=2 x PP=2 as fleet.init would leave it (no collective runs at minimize)."""
    fleet.init()
    topo = Topology(mp_degree=MP, pp_degree=2)
    monkeypatch.setattr(env._STATE, "env", env.WorkerEnv(rank=0, world_size=WORLD))
    monkeypatch.setattr(env._STATE, "hcg", HybridCommunicateGroup(topo, 0))
    s = worker.strategy("off_part" if offload else "part")
    s.pipeline_configs = {**s.pipeline_configs, "cuts": cuts}
    monkeypatch.setattr(env._STATE, "strategy", s)
    program = _exported().clone()
    opt = fleet.distributed_optimizer(metaopt.optimizer.SGD(learning_rate=tp_worker.LR), s)
    opt.minimize(program.loss)
    return opt


@pytest.mark.usefixtures("clean_env")  # tests/conftest.py
def test_stage_program_golden(monkeypatch, golden):
    """Stage 1 of MP rank 0: Recv of transformer.h.0 (the cut), its PartitionSlice right after,
    the forward's readers on the received value, and in the backward the PartitionGather just
    before the recompute of block 1, which reads the gathered copy."""
    opt = _minimize(monkeypatch, worker.hybrid_pp_worker.CUTS)
    for q in opt.stage_programs:
        verify(q)
    golden("recompute_partition/gpt_mp2_pp2_stage1", str(opt.stage_programs[1]))


@pytest.mark.usefixtures("clean_env")
@pytest.mark.parametrize("cuts", [["transformer.h.1"], []])
def test_slice_gather_and_offload_follow_the_backward_that_reads_them(monkeypatch, cuts):
    """Every op of a checkpoint's partition (slice, host copies of the slice, gather) lands in the
    one stage whose backward reads the gathered value, and the gathered value is read there only
    (nothing falls back to the whole received checkpoint); opt.partition_plan is the step's."""
    opt = _minimize(monkeypatch, cuts, offload=True)
    for q in opt.stage_programs:
        verify(q)
    assert opt.partition_plan is opt.context.plans["partition"]
    parts = opt.partition_plan.partitioned
    assert [c.checkpoint for c in parts] == ["transformer.drop", "transformer.h.0"]
    want = PARTITIONED["part" if cuts else "part_auto"]
    assert {c: list(st) for c, st in opt.pipeline_plan.partitioned.items()} == want
    for c in parts:
        for q in opt.stage_programs:
            mine = q.pipeline.stage in want[c.checkpoint]
            made = {o for op in q.ops for o in op.outputs}
            read = {x for op in q.ops for x in op.inputs}
            assert (c.slice in made) == (c.gathered in made) == (c.gathered in read) == mine, c
            if mine:  # the backward reads the gathered copy, never the checkpoint itself
                after = [op for op in q.ops if op.role not in ("forward", "loss", "partition", "offload")]
                assert not any(c.checkpoint in op.inputs for op in after), c.checkpoint
                copies = [op for op in q.ops if op.role in ("offload", "prefetch") and op.origin == c.slice]
                assert len(copies) == 3, copies  # to host, back, its wait


@pytest.mark.usefixtures("clean_env")
def test_the_plan_runs_partition_with_a_pipeline(monkeypatch):
    """enable_partition with strategy.pipeline is no longer refused: opt.plan() runs both steps."""
    fleet.init()
    topo = Topology(mp_degree=MP, pp_degree=2)
    monkeypatch.setattr(env._STATE, "env", env.WorkerEnv(rank=1, world_size=WORLD))
    monkeypatch.setattr(env._STATE, "hcg", HybridCommunicateGroup(topo, 1))
    s = worker.strategy("part")
    monkeypatch.setattr(env._STATE, "strategy", s)
    text = str(fleet.distributed_optimizer(metaopt.optimizer.SGD(learning_rate=0.1), s).plan())
    assert "partition        run   recompute_configs['enable_partition']=True (mp_degree=2)" in text
    assert "pipeline_split   run   strategy.pipeline=True" in text
    assert "refused" not in text
