"""Pipeline x tensor parallel (issue 16): MP=2 x PP=2 on 4 gloo workers and DP=2 x MP=2 x PP=2 on 8
train the tiny GPT (dropout 0) as one process does on the full batch: 3 SGD steps, params and
losses; 3 Adam steps, losses. The 1F1B schedule, 2 micro-batches per replica; the tied wte
(embedding on stage 0, LM head on stage 1) shared across the stages. Also: each worker's pipeline
peers and data-parallel group are the topology's; workers whose fleet.init got different
hybrid_configs fail at fleet.init with a named error, not a timeout."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch
from workers import start_workers, wait_workers

import metaopt
from metaopt import fleet
from metaopt.fleet import env
from metaopt.frontend.onnx_save import save
from metaopt.layout.topology import HybridCommunicateGroup, Topology
from metaopt.passes.tensor_parallel import plan_tensor_parallel, unshard

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import hybrid_pp_worker  # noqa: E402
import tp_worker  # noqa: E402

NAME = hybrid_pp_worker.NAME
# SGD params and losses: the MP all-reduces sum partial products in another order than one
# matmul, and micro-batch grads are summed (scaled by 1/M) instead of one batch's: float32 sums
# in another order, a few ulps per step (the repo's bar for DP / PP / TP vs one process).
TOL = {"rtol": 1e-5, "atol": 4e-5}
# Adam losses (the bar, 1e-5): after 3 steps the updates of grads that differ by ulps
# are still lr-sized alike; Adam-updated params are no judge (it amplifies that float noise).
ADAM_LOSS_TOL = {"rtol": 1e-5, "atol": 1e-5}
WORKER_TIMEOUT_S = 300  # 8 processes on a 2-core machine: generous, yet a hang fails the test


def _run_workers(out: Path, dp: int, mp: int, pp: int, opts: list[str]) -> dict[str, list[dict]]:
    """Start dp x mp x pp workers, wait (bounded), load each optimizer's results by rank."""
    world = dp * mp * pp
    program = out / f"{NAME}.onnx"
    save(_exported(), program)  # the workers load it: an export per worker would take long
    args = [str(HERE / "hybrid_pp_worker.py"), str(out), str(program), str(dp), str(mp), str(pp), *opts]
    procs = start_workers(world, args, {"METAOPT_COMM_TIMEOUT": "120"})
    wait_workers(procs, "hybrid pipeline", WORKER_TIMEOUT_S)
    return {
        opt: [torch.load(out / f"{opt}.rank{r}.pt", weights_only=False) for r in range(world)] for opt in opts
    }


@functools.cache
def _exported() -> metaopt.Program:
    return tp_worker.export(NAME)


@functools.cache
def _reference(opt: str) -> dict:
    """One process, the full batch, the same export and 3 steps of the same optimizer."""
    program = _exported().clone()
    hybrid_pp_worker.optimizer(opt).minimize(program.loss)
    exe = metaopt.Executor("cpu")
    losses = []
    for step in range(tp_worker.STEPS):
        (loss,) = exe.run(program, feed=tp_worker.batch(NAME, step), fetch_list=[program.loss])
        losses.append(float(loss))
    return {"losses": losses, "params": {v.name: exe.scope[v.name].clone() for v in program.params()}}


@functools.cache
def _split(mp: int) -> dict:
    plan = plan_tensor_parallel(
        _exported(),
        mp_degree=mp,
        mp_rank=0,
        group=list(range(mp)),
        column=tp_worker.COLUMN[NAME],
        row=tp_worker.ROW[NAME],
    )
    return {sp.name: sp for sp in plan.params}


def _rank(topo: Topology, data: int, pipe: int, model: int) -> int:
    return topo.get_rank(data=data, pipe=pipe, sharding=0, model=model)


def _check_layout(ranks: list[dict], topo: Topology) -> None:
    """Each worker's coordinate is the topology's; its pipeline talks to the ranks of its own
    data and model coordinate (each MP rank of stage s to the same MP rank of stage s+1) and
    averages grads over its data group (same pipe and model coordinate)."""
    for r, res in enumerate(ranks):
        c = topo.get_coord(r)
        assert res["coord"] == [c.data, c.pipe, c.model] and res["stage"] == c.pipe, r
        assert res["pipe_peers"] == topo.group_ranks("pipe", r), r
        kept = [(topo.get_coord(q).data, topo.get_coord(q).model) for q in res["pipe_peers"]]
        assert all(k == (c.data, c.model) for k in kept), r  # (data, model) kept
        assert res["dp_ranks"] == topo.group_ranks("data", r), r
        assert res["sends"] > 0, r  # a stage program with sends and receives


def _check_losses(ranks: list[dict], topo: Topology, opt: str) -> None:
    opt = opt.split("-")[0]  # "sgd-zbh1": SGD under the ZB-H1 schedule
    ref = _reference(opt)["losses"]
    last = topo.pp_degree - 1
    per_replica = []
    for d in range(topo.dp_degree):
        at = [
            ranks[topo.get_rank(data=d, pipe=last, sharding=0, model=m)]["losses"]
            for m in range(topo.mp_degree)
        ]
        assert all(losses == at[0] for losses in at), "the MP ranks of the last stage see one loss"
        per_replica.append(at[0])
    for r, res in enumerate(ranks):  # the loss lives on the last stage
        assert all((loss is None) == (topo.get_coord(r).pipe != last) for loss in res["losses"]), r
    # each replica's loss is its share's mean; their mean is the full batch's
    mean = torch.tensor(per_replica).mean(0)
    torch.testing.assert_close(mean, torch.tensor(ref), **(TOL if opt == "sgd" else ADAM_LOSS_TOL))
    if topo.dp_degree > 1:
        assert per_replica[0] != per_replica[1], "the replicas were fed other data"


def _check_params(ranks: list[dict], topo: Topology, opt: str) -> None:
    """Replicas bitwise equal; replicated params bitwise equal across MP ranks; after SGD the
    split params put back together (and the replicated ones) equal one process's."""
    split = _split(topo.mp_degree)
    assert split, "nothing was split"
    for r, res in enumerate(ranks):  # the data-parallel replicas of this (pipe, model) slot
        for q in topo.group_ranks("data", r):
            for k, t in res["params"].items():
                assert torch.equal(t, ranks[q]["params"][k]), (r, q, k)
    opt = opt.split("-")[0]
    ref = _reference(opt)["params"]
    seen = set()
    for stage in range(topo.pp_degree):
        mp_ranks = [
            ranks[topo.get_rank(data=0, pipe=stage, sharding=0, model=m)] for m in range(topo.mp_degree)
        ]
        for k in mp_ranks[0]["params"]:
            seen.add(k)
            got = [res["params"][k] for res in mp_ranks]
            if k in split:
                sp = split[k]
                assert got[0].shape == sp.local_shape, k
                full = unshard(got, sp.axis, sp.blocks)
            else:
                assert all(torch.equal(g, got[0]) for g in got), k  # identical on every MP rank
                full = got[0]
            if opt == "sgd":
                torch.testing.assert_close(full, ref[k], **TOL, msg=lambda m, k=k: f"{k}: {m}")
    assert seen == set(ref), sorted(set(ref) ^ seen)  # every param lives on some stage
    wte = "transformer.wte.weight"  # tied: the embedding's (stage 0) and the LM head's (stage 1)
    holders = [res["params"][wte] for res in ranks if wte in res["params"]]
    assert len(holders) == len(ranks) and all(torch.equal(h, holders[0]) for h in holders)


def _check(results: dict[str, list[dict]], topo: Topology) -> None:
    for opt, ranks in results.items():
        _check_layout(ranks, topo)
        _check_losses(ranks, topo, opt)
        _check_params(ranks, topo, opt)


def test_mp2_x_pp2_equals_one_process(tmp_path):
    # "sgd-zbh1": the zero-bubble schedule beside tensor parallel
    results = _run_workers(tmp_path, 1, 2, 2, ["sgd", "adam", "sgd-zbh1"])
    _check(results, Topology(dp_degree=1, mp_degree=2, pp_degree=2))
    for a, b in zip(results["sgd"], results["sgd-zbh1"], strict=True):  # ZB-H1 is 1F1B bit for bit
        assert a["losses"] == b["losses"] and all(
            torch.equal(a["params"][k], b["params"][k]) for k in a["params"]
        )


# --slow (17 s): the suite runs mp2 x pp2 here, dp2 x mp2 and dp2 x pp2 in their own files
@pytest.mark.slow
def test_dp2_x_mp2_x_pp2_on_8_workers_equals_one_process(tmp_path):
    _check(_run_workers(tmp_path, 2, 2, 2, ["sgd", "adam"]), Topology(dp_degree=2, mp_degree=2, pp_degree=2))


def test_hybrid_configs_on_some_workers_only_fail_fleet_init_by_name():
    """Rank 0's fleet.init has hybrid_configs, rank 1's none: both fail at fleet.init's exchange of
    the layouts, naming both, well before METAOPT_COMM_TIMEOUT (120 s: a timeout would show as a
    CommError, and the communicate bound below is shorter)."""
    procs = start_workers(2, [str(HERE / "hybrid_pp_worker.py"), "mismatch"], {"METAOPT_COMM_TIMEOUT": "120"})
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=90)[0])
    finally:
        for p in procs:
            p.kill()
            p.wait()
    want = (
        "WorkersDisagreeError: fleet.init: the workers' hybrid_configs differ: rank 0 has dp_degree=1, "
        "mp_degree=2, pp_degree=1, rank 1 has no hybrid_configs (fleet.init got none)"
    )
    for r, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 1, f"worker {r} exited {p.returncode}:\n{out[-3000:]}"
        assert want in out, out[-3000:]
        assert "CommError" not in out


# --- in one process: the stage programs of MP rank 0 -----------------------------------------


@pytest.mark.usefixtures("clean_env")  # tests/conftest.py
def test_stage_programs_golden(monkeypatch, golden):
    """Rank 0 of MP=2 x PP=2 as fleet.init would leave it (no collective runs at minimize): both
    stage programs, as every worker builds them. Shows the TPCopy/TPReduce over the model-parallel
    group inside each stage, the Send/Recv of the replicated block output only, the tied wte's
    all-reduce among the stages (ranks=[0, 1]: stage indices, mapped by the runtime to this MP
    rank's pipe group)."""
    fleet.init()
    topo = Topology(mp_degree=2, pp_degree=2)
    monkeypatch.setattr(env._STATE, "env", env.WorkerEnv(rank=0, world_size=4))
    monkeypatch.setattr(env._STATE, "hcg", HybridCommunicateGroup(topo, 0))
    s = hybrid_pp_worker.strategy(1, 2, 2)
    monkeypatch.setattr(env._STATE, "strategy", s)
    program = _exported().clone()
    opt = fleet.distributed_optimizer(hybrid_pp_worker.optimizer("sgd"), s)
    opt.minimize(program.loss)
    assert str(program) == str(opt.stage_programs[0])  # rank 0 runs stage 0
    golden("pipeline/gpt_mp2_rank0", "".join(str(q) for q in opt.stage_programs))
