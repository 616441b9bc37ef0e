"""Pipeline parallel: gloo workers running stage programs == one process on the full batch."""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import pipeline_split
from workers import start_workers

import metaopt
import programs
from metaopt.fleet import env

HERE = Path(__file__).parent
STEPS = 3


@functools.cache
def reference(name: str, tied: bool = False, mode: str = "plain") -> dict:
    """One process, the full batch, Adam: losses and params after each of STEPS steps."""
    sys.path.insert(0, str(HERE))
    import pp_worker

    from metaopt.passes.tie import tie_params

    env.reset()
    mod = programs.get(name)
    main = pp_worker.exported(name).clone()
    if tied:
        main = tie_params(main, groups=[pp_worker.TIED_QUERY])
    metaopt.optimizer.Adam(learning_rate=1e-2).minimize(main.loss)
    exe = metaopt.Executor("cpu")
    losses = []
    for step in range(STEPS):
        feed = dict(zip(mod.INPUT_NAMES, pp_worker.step_batch(name, step, mode), strict=True))
        (loss,) = exe.run(main, feed=feed, fetch_list=[main.loss])
        losses.append(float(loss))
    held = dict(zip(mod.INPUT_NAMES, pp_worker.full_batch(name, pp_worker.HELD_OUT), strict=True))
    test = main.clone(for_test=True)
    evals = exe.run(test, feed=held, fetch_list=["loss", pp_worker.LOGITS[name]], return_numpy=False)
    return {
        "losses": losses,
        "eval": [float(evals[0]), evals[1]],
        "params": {v.name: exe.scope[v.name].clone() for v in main.params()},
    }


def run_workers(tmp: Path, world: int, cases: list[str]) -> None:
    procs = start_workers(
        world, [str(HERE / "pp_worker.py"), str(tmp), *cases], {"METAOPT_COMM_TIMEOUT": "60"}
    )
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=600)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("pipeline workers did not finish in 600 s")
    failed = [
        (r, p.returncode, log) for r, (p, log) in enumerate(zip(procs, logs, strict=True)) if p.returncode
    ]
    # the first failure is the cause (the others see a closed connection): show it first
    failed.sort(key=lambda f: "Connection closed by peer" in f[2] or "Connection reset" in f[2])
    assert not failed, "\n".join(f"worker {r} exited {rc}:\n{log[-4000:]}" for r, rc, log in failed)


def check_case(tmp: Path, world: int, case: str, dp: int = 1) -> None:
    from metaopt.ir.program import StagePlacement

    name, schedule, _, mode, *rest = case.split(":")
    ranks = [torch.load(tmp / f"{case}.rank{r}.pt", weights_only=True) for r in range(world)]
    ref = reference(name, tied=mode == "tied", mode="shrink" if mode == "shrink" else "plain")
    # Micro-batch grads are summed (scaled by 1/M) instead of one batch's: float32 sums in
    # another order, the bar rtol 1e-5, atol 4e-5 after STEPS Adam steps. With dp
    # replicas (rank = replica x stages + stage) each saw its share: their mean loss.
    p = world // dp
    chunks = int(rest[0]) if rest else 1
    holder = StagePlacement.of(schedule, p, chunks).worker(p * chunks - 1)  # the last chunk's worker
    lasts = [ranks[d * p + holder]["losses"] for d in range(dp)]
    mean = [sum(step) / dp for step in zip(*lasts, strict=True)]
    torch.testing.assert_close(torch.tensor(mean), torch.tensor(ref["losses"]), rtol=1e-5, atol=4e-5)
    not_last = [r for i, r in enumerate(ranks) if i % p != holder]
    assert all(loss is None for r in not_last for loss in r["losses"])  # the loss lives on the last stage
    # issue 49: clone(for_test=True) of every stage program, run on its forward-only schedule on the
    # whole held-out batch: one process's evaluation (the same bar), the same bits twice
    for r in not_last:
        assert r["eval"]["losses"] == [None, None] and r["eval"]["logits"] is None
    for d in range(dp):
        got = ranks[d * p + holder]["eval"]
        assert got["losses"][0] == got["losses"][1]
        torch.testing.assert_close(got["losses"][0], ref["eval"][0], rtol=1e-5, atol=4e-5)
        torch.testing.assert_close(got["logits"], ref["eval"][1], rtol=1e-5, atol=4e-5)
    seen = set()
    for r in ranks:
        for k, v in r["params"].items():
            torch.testing.assert_close(v, ref["params"][k], rtol=1e-5, atol=4e-5, msg=f"{case} {k}")
            seen.add(k)
    assert seen == set(ref["params"])  # every param lives on some stage
    for r, rank in enumerate(ranks):
        check_traffic(case, r, rank["traffic"])


def check_traffic(case: str, rank: int, traffic: list[tuple[int, int, int]]) -> None:
    """The P2P protocol, seen from one worker: each edge (peer, var, direction) is used once
    per micro-batch, with a header on its first use and data alone after; a step whose
    expected shapes changed (mode shrink) verifies every edge again; the switch keeps a
    header on every message (check; check1: on one worker, so every worker's step
    signatures differ and all messages keep their headers)."""
    _, schedule, m, mode, *rest = case.split(":")
    m, chunks = int(m), int(rest[0]) if rest else 1
    per = 3 if schedule in ("ZBH1", "ZBV") else 2  # F, B (and W) of each micro-batch
    for step, (messages, headers, actions) in enumerate(traffic):
        where = f"{case} worker {rank} step {step}"
        assert actions == per * m * chunks, where  # every action timed
        assert messages > 0 and messages % m == 0, where
        if mode in ("check", "check1"):
            assert headers == messages, where
        elif step == 0 or mode == "shrink":
            assert headers * m == messages, where  # first use (or new shape) of each edge
        else:
            assert headers == 0, where  # steady state: data only


# The matrix, cut to what a 2-core CI machine runs in about a minute per world
# size: every schedule, M in {1, 2, 4, 8}, recompute off/on/offload, on mlp, bert and gpt
# (gpt's embedding is tied to its LM head: held by the first and the last stage).
CASES_2 = [
    "mlp:F-then-B:1:plain",
    "mlp:1F1B:2:plain",
    "mlp:1F1B:8:recompute",
    "bert:F-then-B:4:plain",
    "bert:1F1B:4:recompute",
    "bert:1F1B:2:offload",
    "gpt:1F1B:4:plain",
    "gpt:F-then-B:2:recompute",
    "mlp:interleaved:4:plain:2",
    "bert:interleaved:2:recompute:2",
    "gpt:interleaved:4:offload:2",
    "bert:1F1B:2:tied",  # two layers' query weights declared one param, across the cut
    "bert:1F1B:4:shrink",  # a smaller batch in step 2: every edge verified again, twice
    "gpt:1F1B:2:check",  # METAOPT_PIPELINE_CHECK=1: a header on every message
    "mlp:F-then-B:2:check1",  # the switch on one worker only: headers on every message, no error
    "bert:ZBH1:4:offload",  # zero bubble: W after B, offloaded checkpoints fetched for both
    "gpt:ZBH1:4:recompute",  # zero bubble with recompute, the tied embedding on both stages
    "bert:ZBV:4:offload:2",  # the V: chunks 0 and 3 on worker 0, offloaded checkpoints for B and W
]
CASES_4 = [
    "mlp:1F1B:8:plain",
    "mlp:F-then-B:4:recompute",
    "bert:1F1B:4:offload",
    "gpt:1F1B:8:recompute",
    "mlp:interleaved:8:plain:2",
    "mlp:1F1B:4:shrink",
    "mlp:ZBH1:8:plain",  # zero bubble over 4 stages
]
TIED = "gpt:1F1B:2:plain:1:20"
# 2 stages x 2 replicas on 4 workers, each replica half the batch (tied gpt too)
CASES_DP = [
    "mlp:1F1B:2:plain:1:3:2",
    "bert:F-then-B:2:recompute:1:3:2",
    "gpt:1F1B:2:plain:1:3:2",
    "gpt:ZBH1:4:plain:1:3:2",  # zero bubble: the grads all-reduced over the replicas after the last W
    "gpt:ZBV:4:plain:2:3:2",  # the V: the tied embedding's two chunks summed, then averaged over replicas
]


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pp2")
    run_workers(tmp, 2, [*CASES_2, TIED])
    return tmp


@pytest.fixture(scope="module")
def four_workers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pp4")
    run_workers(tmp, 4, [*CASES_4, *CASES_DP])
    return tmp


@pytest.mark.parametrize("case", CASES_2)
def test_two_stages_equal_single_process_training(two_workers, case):
    check_case(two_workers, 2, case)


@pytest.mark.parametrize("case", CASES_4)
def test_four_stages_equal_single_process_training(four_workers, case):
    check_case(four_workers, 4, case)


@pytest.mark.parametrize("case", CASES_DP)
def test_two_pipeline_replicas_equal_single_process_training(four_workers, case):
    check_case(four_workers, 4, case, dp=2)
    ranks = [torch.load(four_workers / f"{case}.rank{r}.pt", weights_only=True) for r in range(4)]
    for stage in range(2):  # replicas of a stage stay bit-identical (averaged grads, rank 0's start)
        a, b = ranks[stage]["params"], ranks[2 + stage]["params"]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_tied_copies_stay_bit_identical_over_20_steps(two_workers):
    ranks = [torch.load(two_workers / f"{TIED}.rank{r}.pt", weights_only=True) for r in range(2)]
    tied = "transformer.wte.weight"
    assert tied in ranks[0]["params"] and tied in ranks[1]["params"]  # embedding (stage 0), LM head (1)
    assert torch.equal(ranks[0]["params"][tied], ranks[1]["params"][tied])
    assert "AllReduce(transformer.wte.weight@GRAD@STAGE" in ranks[0]["program"]


@pytest.mark.parametrize("when", ["first", "late"])
def test_a_micro_batch_shape_mismatch_fails_both_workers_naming_the_var(when):
    """Workers fed different batch sizes fail on the step where they first disagree, both
    naming the var and both shapes: on the first step by the edges' first headers; on a
    later one (steady state, data alone) because the step signatures differ, which puts
    the header back on every message of that step."""
    procs = start_workers(2, [str(HERE / "pp_fault_worker.py"), when], {"METAOPT_COMM_TIMEOUT": "25"})
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=30 + 30)[0])  # start-up, then at most 30 s
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for r, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode != 0, f"worker {r} did not fail:\n{out[-2000:]}"
        assert "PipelineCommError" in out and "'dropout1'" in out, f"worker {r}:\n{out[-3000:]}"
        assert "did not reach this collective" not in out, f"worker {r} timed out:\n{out[-3000:]}"
        # the failing step is the first that disagrees
        assert (f"rank {r} finished step 0" in out) == (when == "late")
        assert f"rank {r} finished step 1" not in out
    assert "expects [3, 32]" in outs[1] and "sent shape [4, 32]" in outs[1]
    assert "worker 1 rejected 'dropout1'" in outs[0]
    if when == "late":  # the handshake saw the feeds differ: both errors say how
        assert "micro-batches differ: batch=4 on this worker, batch=3 on worker 1" in outs[0]
        assert "micro-batches differ: batch=3 on this worker, batch=4 on worker 0" in outs[1]


def test_one_stage_pipeline_offload_counts_host_bytes_and_matches_recompute():
    """Gradient accumulation over 4 micro-batches in one process (a 1-stage pipeline):
    offload moves every micro-batch's checkpoints to the host account and back, and
    changes no bit of the result."""
    from metaopt.passes.offload import offload
    from metaopt.passes.recompute import plan_recompute, recompute

    sys.path.insert(0, str(HERE))
    import dp_worker
    import pp_worker

    base = pp_worker.exported("bert").clone()
    metaopt.optimizer.Adam(learning_rate=1e-2).minimize(base.loss)
    ck = ["bert.encoder.layer.*"]
    rc = recompute(base, checkpoints=ck)
    of = offload(rc, checkpoints=plan_recompute(base, checkpoints=ck).checkpoints)
    mod = programs.get("bert")
    results = []
    for prog in (rc, of):
        (stage,) = pipeline_split(prog, num_stages=1, cuts=[], micro_batches=4)
        exe = metaopt.Executor("cpu")
        losses = []
        for step in range(2):
            feed = dict(zip(mod.INPUT_NAMES, dp_worker.full_batch("bert", step), strict=True))
            (loss,) = exe.run(stage, feed=feed, fetch_list=["loss"], return_numpy=False)
            losses.append(loss)
        results.append((losses, {v.name: exe.scope[v.name] for v in stage.params()}, exe.memory_stats()))
    (l_rc, p_rc, s_rc), (l_of, p_of, s_of) = results
    assert all(torch.equal(a, b) for a, b in zip(l_rc, l_of, strict=True))
    assert all(torch.equal(p_rc[k], p_of[k]) for k in p_rc)
    moved = sum(of.vars[op.inputs[0]].nbytes({"batch": 2}) for op in of.ops if op.role == "offload")
    assert moved > 0
    assert s_of["offloaded_bytes"] == s_of["fetched_bytes"] == 4 * moved  # every micro-batch, one step
    assert s_of["host_peak_bytes"] >= moved and s_rc["host_peak_bytes"] == 0


def test_declared_ties_are_checked():
    from metaopt.passes.tie import tie_params

    sys.path.insert(0, str(HERE))
    import pp_worker

    p = pp_worker.exported("bert").clone()
    with pytest.raises(
        ValueError, match=r"'bert.encoder.layer.0.attention.self.querry.weight' is not a param.*did you"
    ):
        tie_params(p, groups=[["bert.encoder.layer.0.attention.self.querry.weight"]])
    with pytest.raises(ValueError, match="tied params must agree"):
        tie_params(
            p,
            groups=[
                ["bert.encoder.layer.0.attention.self.query.weight", "bert.embeddings.word_embeddings.weight"]
            ],
        )
    p = tie_params(p, groups=[pp_worker.TIED_QUERY])
    assert pp_worker.TIED_QUERY[1] not in p.vars
    readers = [op for op in p.ops if pp_worker.TIED_QUERY[0] in op.inputs]
    assert len(readers) == 2  # both layers read the one param


def test_fleets_micro_batch_size_is_honoured_and_a_batch_of_another_size_is_named():
    """pipeline_configs["micro_batch_size"] (what every Fleet pipeline script sets): the fed
    batch must be micro_batch_size x accumulate_steps; it trains as without it when it is, and
    another batch is an error naming both keys before anything runs."""
    sys.path.insert(0, str(HERE))
    import dp_worker
    import pp_worker

    base = pp_worker.exported("mlp").clone()
    metaopt.optimizer.SGD(learning_rate=0.1).minimize(base.loss)
    mod = programs.get("mlp")
    feed = dict(zip(mod.INPUT_NAMES, dp_worker.full_batch("mlp", 0), strict=True))  # batch 8
    results = []
    for size in (None, 4):
        (stage,) = pipeline_split(base, num_stages=1, cuts=[], micro_batches=2, micro_batch_size=size)
        assert ("micro_batch_size=4" in str(stage)) == (size == 4)  # printed in the program's header
        exe = metaopt.Executor("cpu")
        (loss,) = exe.run(stage, feed=feed, fetch_list=["loss"], return_numpy=False)
        results.append((loss, {v.name: exe.scope[v.name].clone() for v in stage.params()}))
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(results[0][1][k], results[1][1][k]) for k in results[0][1])
    half = {k: v[:6] for k, v in feed.items()}
    with pytest.raises(ValueError, match=r"batch 6 .* micro_batch_size=4 x accumulate_steps=2 = 8"):
        exe.run(stage, feed=half, fetch_list=["loss"])
