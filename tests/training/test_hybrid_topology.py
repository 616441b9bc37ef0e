"""Hybrid parallel topology on 4 gloo workers (issue 16, item 1): fleet.init's process groups,
Fleet's accessors, the groups' all_reduce, a pipeline laid out by hybrid_configs, the refusals."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from workers import start_workers

from metaopt.layout.topology import Topology

HERE = Path(__file__).parent
WORLD = 4
# dp x pp (with a pipeline run), then dp x mp (minimize: no tensor_parallel, refused), then dp x mp
# with Paddle's order putting the model axis outermost; re-initialised each time
LAYOUTS = ["2,1,2", "2,2,1", "2,2,1,mp-first"]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("hybrid")
    procs = start_workers(
        WORLD, [str(HERE / "hybrid_worker.py"), str(out), *LAYOUTS], {"METAOPT_COMM_TIMEOUT": "60"}
    )
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=180)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("hybrid workers did not finish in 180 s")
    failed = [
        (r, p.returncode, log) for r, (p, log) in enumerate(zip(procs, logs, strict=True)) if p.returncode
    ]
    assert not failed, "\n".join(f"worker {r} exited {rc}:\n{log[-4000:]}" for r, rc, log in failed)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


# dp=2 x pp=2 by Paddle's order (model innermost, then pipe, data outermost): rank -> (data, pipe)
DP2_PP2 = {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1)}
# the axes whose groups fleet.init makes in these layouts (no sep group at sep_degree 1)
MADE = ("data", "pipe", "sharding", "model")
# dp=2 x mp=2: rank -> (data, model); model peers adjacent
DP2_MP2 = {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1)}


def test_dp2_x_pp2_accessors_and_groups(results):
    for rank, res in enumerate(results):
        r = res["2,1,2"]
        data, pipe = DP2_PP2[rank]
        assert r["global_rank"] == rank
        assert r["dp"] == [data, 2] and r["pp"] == [pipe, 2] and r["mp"] == [0, 1] and r["sharding"] == [0, 1]
        assert r["groups"]["data"] == [pipe, 2 + pipe]  # the replicas of this stage
        assert r["groups"]["pipe"] == [2 * data, 2 * data + 1]  # this replica's stages
        assert r["groups"]["model"] == [rank] == r["groups"]["sharding"]
        assert r["src"] == [pipe, rank]
        for axis in MADE:  # the all_reduce over each group sums exactly its members' ranks
            members = r["groups"][axis]
            assert r["sums"][axis] == [sum(members), len(members)], (rank, axis)


def test_dp2_x_mp2_accessors_groups_and_the_tensor_parallel_refusal(results):
    for rank, res in enumerate(results):
        r = res["2,2,1"]
        data, model = DP2_MP2[rank]
        assert r["dp"] == [data, 2] and r["mp"] == [model, 2] and r["pp"] == [0, 1]
        assert r["groups"]["model"] == [2 * data, 2 * data + 1]  # adjacent ranks
        assert r["groups"]["data"] == [model, 2 + model]
        for axis in MADE:
            members = r["groups"][axis]
            assert r["sums"][axis] == [sum(members), len(members)], (rank, axis)
        # fleet.init's strategy sets mp_degree but not tensor_parallel: nothing names layers to split
        assert r["refused"].startswith("hybrid_configs mp_degree=2 needs strategy.tensor_parallel=True")


def test_an_order_with_the_model_axis_outermost_makes_its_groups_two_ranks_apart(results):
    topo = Topology(dp_degree=2, mp_degree=2, order=("model", "pipe", "sharding", "data"))
    for rank, res in enumerate(results):
        r = res["2,2,1,mp-first"]
        model, data = divmod(rank, 2)  # rank = model x dp_degree + data
        assert r["dp"] == [data, 2] and r["mp"] == [model, 2]
        assert r["groups"]["model"] == [data, 2 + data] and r["groups"]["data"] == [2 * model, 2 * model + 1]
        assert r["groups"] == {a: topo.group_ranks(a, rank) for a in ("data", "model", "pipe", "sharding")}
        for axis in MADE:  # the process groups fleet.init made are these
            members = r["groups"][axis]
            assert r["sums"][axis] == [sum(members), len(members)], (rank, axis)


def test_the_groups_agree_with_the_pure_layout(results):
    topo = Topology(dp_degree=2, pp_degree=2)
    for rank, res in enumerate(results):
        assert res["2,1,2"]["groups"] == {
            a: topo.group_ranks(a, rank) for a in ("data", "model", "pipe", "sharding")
        }


def test_a_pipeline_laid_out_by_hybrid_configs_trains_with_replicas_in_step(results):
    runs = [res["2,1,2"]["pipeline"] for res in results]
    for rank, run in enumerate(runs):
        assert (run["stage"], run["num_stages"], run["dp_degree"]) == (DP2_PP2[rank][1], 2, 2)
        last = run["stage"] == 1
        assert all((loss is not None) == last for loss in run["losses"])  # the loss on the last stage
    # each stage's replicas (ranks s and 2 + s) saw other data yet hold identical params: grads averaged
    for stage in range(2):
        assert runs[stage]["params"] == runs[2 + stage]["params"]
    assert runs[1]["losses"] != runs[3]["losses"]  # ... and they did see other data


def test_a_world_size_other_than_the_degrees_product_is_refused_at_init(results):
    for res in results:
        msg = res["wrong_world"]
        assert "dp_degree=2 x mp_degree=2 x pp_degree=2 = 8 workers, but the world size is 4" in msg
