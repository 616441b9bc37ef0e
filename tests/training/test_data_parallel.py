"""Data parallel: 2 gloo workers on half batches each == one process on the full batch."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch
from workers import start_workers, wait_workers

import metaopt
import programs
from metaopt.passes.data_parallel import data_parallel, plan_data_parallel

HERE = Path(__file__).parent
CASES = [
    "mlp:plain",
    "mlp:recompute",
    "mlp:merge",
    "mlp:sync",
    "bert:plain",
    "bert:recompute",
    "bert:offload",
    "bert:merge",
    "bert:early",
]


@functools.cache
def _single_process(name: str) -> dict:
    """The reference: one process, the full batch, no recompute (which is bit-identical)."""
    sys.path.insert(0, str(HERE))
    import dp_worker

    return dp_worker.single_process(name)


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp")
    procs = start_workers(2, [str(HERE / "dp_worker.py"), str(out), *CASES])
    wait_workers(procs, "data-parallel", 300)
    return out


@pytest.mark.filterwarnings("ignore:recompute with checkpoints")  # tiny mlp: nothing to save
@pytest.mark.parametrize("case", CASES)
def test_two_workers_on_half_batches_equal_one_process_on_the_full_batch(two_workers, case):
    name, rc = case.split(":")
    ranks = [torch.load(two_workers / f"{case}.rank{r}.pt", weights_only=True) for r in range(2)]
    ref = _single_process(name)
    if rc == "offload":  # the offloaded checkpoints really moved
        assert ranks[0]["copies"] > 0 and ranks[0]["offloaded_bytes"] > 0
    if rc == "sync":  # the overlapped run (passes/overlap_comm.py) is the same bits as this one
        plain = [torch.load(two_workers / f"{name}:plain.rank{r}.pt", weights_only=True) for r in range(2)]
        assert ranks[0]["overlapped"] == 0 and plain[0]["overlapped"] >= ranks[0]["buckets"] - 1
        for mine, theirs in zip(ranks, plain, strict=True):
            assert mine["losses"] == theirs["losses"]
            for k, t in mine["params"].items():
                assert torch.equal(t, theirs["params"][k]), k
    if rc == "early":  # optimizer_in_backward, one all-reduce per grad: updates inside the backward
        assert ranks[0]["early_updates"] > ranks[0]["buckets"] // 2 > 1
    # mlp: unfused, one AllReduce per grad; bert tiny (0.1 MB of grads): one 1 MB bucket
    assert ranks[0]["buckets"] == (6 if name == "mlp" else 1) or rc == "early"
    # one all-reduce per bucket and update: with gradient merge (k runs a step), once per k runs
    import dp_worker

    assert ranks[0]["all_reduce_calls"] == dp_worker.STEPS * ranks[0]["buckets"]
    # The mean of the two half-batch losses is the full batch's loss; grads are averaged
    # over two halves instead of summed over one batch, so float32 sums round differently:
    # the bar rtol 1e-5, atol 4e-5 over 5 Adam steps.
    mean_loss = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[1]["losses"], strict=True)]
    torch.testing.assert_close(torch.tensor(mean_loss), torch.tensor(ref["losses"]), rtol=1e-5, atol=4e-5)
    for k, want in ref["params"].items():
        torch.testing.assert_close(ranks[0]["params"][k], want, rtol=1e-5, atol=4e-5, msg=k)
        # every worker applies the same averaged update to the same broadcast start: identical
        assert torch.equal(ranks[0]["params"][k], ranks[1]["params"][k]), k


def _adam_mlp() -> tuple[metaopt.Program, list[str]]:
    mod = programs.get("mlp")
    main = metaopt.export(mod.build("tiny", seed=0), mod.example_inputs("tiny", 4, seed=1), name="mlp")
    _, pg = metaopt.optimizer.Adam(learning_rate=1e-3).minimize(main.loss)
    return main, [g.name if hasattr(g, "name") else g for _, g in pg]


def test_buckets_follow_the_backward_and_respect_the_size():
    main, grads = _adam_mlp()
    sizes = {g: main.vars[g].nbytes() for g in grads}
    for cap in (0, 600, 1 << 20):
        plan = plan_data_parallel(main, grads=grads, world_size=2, bucket_bytes=cap)
        assert sorted(g for b in plan.buckets for g in b.grads) == sorted(grads)
        produced = main.producers()
        order = [g for b in plan.buckets for g in b.grads]
        assert order == sorted(grads, key=lambda g: produced[g])  # the order the backward finishes them
        for b in plan.buckets:
            assert len(b.grads) == 1 or b.nbytes <= cap
            assert b.nbytes == sum(sizes[g] for g in b.grads)
        if cap == 0:
            assert len(plan.buckets) == len(grads)
        if cap == 1 << 20:
            assert len(plan.buckets) == 1
    text = str(plan_data_parallel(main, grads=grads, world_size=2, bucket_bytes=600))
    assert f"all_reduce ops: {len(grads)}, after fusion: " in text


def test_optimizer_reads_only_reduced_grads():
    main, grads = _adam_mlp()
    q = data_parallel(main, grads=grads, world_size=2, bucket_bytes=600)
    metaopt.verify(q)
    producers = q.producers()
    for op in q.ops:
        if op.role == "optimize":
            read = [x for x in op.inputs if x in grads]
            assert not read, (op.type, read)
    for op in q.ops:
        if op.type == "AllReduce":
            assert op.role == "comm" and op.attrs == {"reduce": "avg"}
            # right after the op finishing its last grad
            assert q.ops.index(op) - 1 <= max(producers[g] for g in op.inputs) + len(grads)
    with pytest.raises(ValueError, match="reduced twice"):
        data_parallel(q, grads=grads, world_size=2, bucket_bytes=600)
    with pytest.raises(ValueError, match="did you mean"):
        data_parallel(main, grads=["fc1.weight@GRADS"], world_size=2, bucket_bytes=600)


def test_data_parallel_golden(golden):
    main, grads = _adam_mlp()
    golden("data_parallel/mlp", str(data_parallel(main, grads=grads, world_size=2, bucket_bytes=600)))


def test_a_run_raising_with_all_reduces_in_flight_waits_for_them_and_training_goes_on():
    """Both workers run a copy of the program that raises right after an all-reduce left in
    flight: the executor waits for it (logged), nothing stays in flight, the next two steps of
    the real program equal two steps without the failed run, and both exit 0 (no gloo abort)."""
    procs = start_workers(2, [str(HERE / "dp_fault_worker.py"), "raise"], {"METAOPT_COMM_TIMEOUT": "20"})
    logs = wait_workers(procs, "data-parallel", 120)
    for rank, log in enumerate(logs):
        assert "a run raised with 1 collective(s) in flight: waited for them" in log, log[-2000:]
        assert f"rank {rank} raised mid-flight, then trained as without it" in log, log[-2000:]


@pytest.mark.parametrize("mode", ["die", "stall"])
def test_a_lost_peer_fails_the_all_reduce_within_the_timeout(mode):
    """Rank 1 exits (or stalls) before step 1; rank 0's AllReduce must raise the
    communicator's error (naming the op, the rank and the timeout) within the 5 s
    METAOPT_COMM_TIMEOUT plus start-up, never hang."""
    procs = start_workers(2, [str(HERE / "dp_fault_worker.py"), mode], {"METAOPT_COMM_TIMEOUT": "5"})
    try:
        out0, _ = procs[0].communicate(timeout=90)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert procs[0].returncode != 0
    assert "rank 0 step 0 done" in out0 and "rank 0 step 1 done" not in out0
    assert "CommError: AllReduce of" in out0 and "failed on rank 0 of 2" in out0, out0[-3000:]
    assert "METAOPT_COMM_TIMEOUT" in out0
