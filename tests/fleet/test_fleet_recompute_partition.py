"""Recompute beside tensor parallel, and recompute partition, through fleet: MP=2 on 2 gloo
workers (tests/training/fleet_tp_recompute_worker.py) on gpt tiny, dropout 0, 3 SGD steps; and
what minimize refuses of recompute_configs['enable_partition'], in one process."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

import metaopt
from metaopt import fleet
from metaopt.passes.tensor_parallel import plan_tensor_parallel, unshard

TRAINING = Path(__file__).resolve().parent.parent / "training"
sys.path.insert(0, str(TRAINING))
import fleet_tp_recompute_worker as worker  # noqa: E402  (beside the other workers, started as a script)
import tp_worker  # noqa: E402
from test_fleet_tensor_parallel import _fake_job, _refused, _tp_strategy  # noqa: E402
from workers import start_workers, wait_workers  # noqa: E402

NAME = worker.NAME
CASES = list(worker.CASES)
MP = 2
# Against one process: the all-reduces sum partial products in another order than one matmul,
# a few ulps per step (the bar for tensor parallel). Between the MP=2 runs: bitwise.
TOL = {"rtol": 1e-5, "atol": 4e-5}

pytestmark = pytest.mark.usefixtures("clean_env")  # tests/conftest.py


def _run_workers(out: Path, dropout: float, cases: list[str]) -> dict[str, list[dict]]:
    """Every case on the same 2 workers (one export each), loaded per case and rank; bounded: a
    hang is a failure, never a stuck suite."""
    args = [str(TRAINING / "fleet_tp_recompute_worker.py"), str(out), str(dropout), *cases]
    procs = start_workers(MP, args, {"METAOPT_COMM_TIMEOUT": "60"})
    wait_workers(procs, "tensor-parallel recompute", 400)
    return {c: [torch.load(out / f"{c}.rank{r}.pt", weights_only=False) for r in range(MP)] for c in cases}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    return _run_workers(tmp_path_factory.mktemp("tp_recompute"), 0.0, CASES)


@pytest.fixture(scope="module")
def dropout_runs(tmp_path_factory) -> dict[str, list[dict]]:
    """Dropout 0.1 (MP-aware RNG: split-region masks per rank, replicated ones shared)."""
    return _run_workers(
        tmp_path_factory.mktemp("tp_recompute_dropout"), 0.1, ["tp", "rc", "part", "off_part"]
    )


@functools.cache
def _single_process() -> dict:
    """The reference: one process, the full batch, the same export and SGD steps, no recompute."""
    return tp_worker.train(tp_worker.export(NAME), NAME)


def _assert_bitwise(a: dict, b: dict, what: str) -> None:
    assert a["losses"] == b["losses"], what
    assert a["params"].keys() == b["params"].keys()
    for k, t in a["params"].items():
        assert torch.equal(t, b["params"][k]), f"{what}: {k}"


def test_recompute_beside_tensor_parallel_is_bitwise_the_run_without_it(runs):
    """The re-emitted forward (TPReduce included: every MP rank re-runs it in the same order)
    recomputes the forward's bits, so the steps are those of MP=2 without recompute, and so
    within the tensor-parallel bar of one process."""
    assert any(o == "TPReduce recompute" for o in runs["rc"][0]["ops"])  # the all-reduce re-runs
    for r in range(MP):
        _assert_bitwise(runs["rc"][r], runs["tp"][r], f"rank {r}: recompute vs none")
        assert "recompute        run   strategy.recompute=True" in runs["rc"][r]["plan"]
    ref = _single_process()
    assert runs["rc"][0]["losses"] == pytest.approx(ref["losses"], rel=TOL["rtol"], abs=TOL["atol"])
    program = tp_worker.export(NAME)
    plan = plan_tensor_parallel(
        program, mp_degree=MP, mp_rank=0, group=[0, 1], column=tp_worker.COLUMN[NAME], row=tp_worker.ROW[NAME]
    )
    split = {sp.name: sp for sp in plan.params}
    for k, want in ref["params"].items():
        got = [runs["rc"][r]["params"][k] for r in range(MP)]
        full = unshard(got, split[k].axis, split[k].blocks) if k in split else got[0]
        torch.testing.assert_close(full, want, **TOL, msg=k)


@pytest.mark.parametrize("case", ["part", "off_part"])
def test_partition_is_bit_identical_to_recompute_without_it(runs, case):
    """The gathered checkpoint is the forward's, bit for bit: the same losses and params."""
    for r in range(MP):
        _assert_bitwise(runs[case][r], runs["rc"][r], f"rank {r}: {case} vs recompute alone")
        ops = runs[case][r]["ops"]
        assert ops.count("PartitionSlice partition") == ops.count("PartitionGather recompute") == 2
        assert (
            "partition        run   recompute_configs['enable_partition']=True (mp_degree=2)"
            in (runs[case][r]["plan"])
        )
    text = runs[case][0]["partition_plan"]
    assert "2 checkpoint(s) held as 1/2 slices over the model-parallel group (model_parallel)" in text
    assert "skipped transformer.h.1: the last checkpoint opens no recomputed segment" in text


def test_partition_holds_one_mp_th_of_the_checkpoint_bytes(runs):
    """Held per rank after the forward: each partitioned checkpoint's slice, 1/mp of its bytes,
    in the memory report, in estimate_memory and in the executor's own count (its per-op
    timeline: the same drop, measured and predicted, at the first backward op)."""
    rc, part = runs["rc"][0], runs["part"][0]
    slices = part["slices"]
    assert sorted(slices) == ["transformer.drop", "transformer.h.0"]
    assert rc["report_batch"] == part["report_batch"] == tp_worker.BATCH  # the fed batch: comparable
    saved = 0
    for c, b in rc["report"].items():
        want = b // MP if c in slices else b  # float32 [8, 16, 32]: divisible, no padding
        assert part["report"][c] == want, c
        saved += b - want
        if c in slices:  # what estimate_memory has alive at the first backward op: the slice
            assert part["held"][slices[c]] == want
            assert c not in part["held"]
    assert saved == 2 * (tp_worker.BATCH * 16 * 32 * 4) // MP
    at_rc, at_part = rc["first_backward"], part["first_backward"]
    measured = rc["timeline"][at_rc] - part["timeline"][at_part]
    predicted = rc["estimate"][at_rc] - part["estimate"][at_part]
    assert measured == predicted == saved


def test_offload_with_partition_moves_only_the_slice(runs):
    """With enable_offload the slices go to host and back: half the bytes of offload alone."""
    off, both = runs["off"][0]["stats"], runs["off_part"][0]["stats"]
    assert off["offloaded_bytes"] == off["fetched_bytes"] > 0
    assert both["offloaded_bytes"] == both["fetched_bytes"] == off["offloaded_bytes"] // MP
    assert both["host_peak_bytes"] == off["host_peak_bytes"] // MP
    ops = runs["off_part"][0]["ops"]
    assert ops.count("Memcpy offload") == ops.count("Memcpy prefetch") == 2


def test_with_dropout_recompute_and_partition_are_bit_identical_to_neither(dropout_runs, runs):
    """Dropout 0.1: recompute replays each mask from the stream it drew from (RngState /
    RngReplay), so recompute, partition and offload + partition train bitwise as MP=2 alone."""
    for r in range(MP):
        assert dropout_runs["tp"][r]["losses"] != runs["tp"][r]["losses"]  # the masks are drawn
        assert dropout_runs["rc"][r]["ops"].count("RngState forward") > 0
        for case in ("rc", "part", "off_part"):
            _assert_bitwise(dropout_runs[case][r], dropout_runs["tp"][r], f"rank {r}: {case}, dropout 0.1")


# --- refusals, in one process (every one before anything is rewritten) --------------------------


def _partition_strategy(**configs) -> fleet.DistributedStrategy:
    s = _tp_strategy()
    s.recompute = True
    s.recompute_configs = {"checkpoints": ["transformer.h.*"], "enable_partition": True, **configs}
    return s


def test_partition_without_tensor_parallel_is_refused(monkeypatch):
    _fake_job(monkeypatch, 0, dp=1, mp=2)
    s = _partition_strategy()
    s.tensor_parallel = False
    _refused(
        s, ValueError, r"recompute_configs\['enable_partition'\]=True needs strategy\.tensor_parallel=True"
    )


def test_partition_without_recompute_is_refused(monkeypatch):
    _fake_job(monkeypatch, 0, dp=1, mp=2)
    s = _partition_strategy()
    s.recompute = False
    _refused(s, ValueError, r"enable_partition'\]=True needs strategy\.recompute=True")


def test_partition_with_mp_degree_1_is_refused(monkeypatch):
    _fake_job(monkeypatch, 0, dp=2, mp=1)
    _refused(_partition_strategy(), ValueError, r"enable_partition'\]=True slices .* but mp_degree=1")


def test_the_plan_lists_the_partition_step(monkeypatch):
    _fake_job(monkeypatch, 1, dp=1, mp=2)
    opt = fleet.distributed_optimizer(metaopt.optimizer.SGD(learning_rate=0.1), _partition_strategy())
    text = str(opt.plan())
    assert "recompute        run   strategy.recompute=True" in text
    assert "partition        run   recompute_configs['enable_partition']=True (mp_degree=2)" in text
    assert "refused" not in text
