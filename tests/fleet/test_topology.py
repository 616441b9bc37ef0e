"""Hybrid parallel's rank layout (metaopt/layout/topology.py) and how fleet uses it (issue 16,
item 1): pure layout tables, fleet.init's refusals, minimize's glue with the pipeline."""

from __future__ import annotations

import itertools

import pytest
import torch

import metaopt
from metaopt import fleet
from metaopt.fleet import env
from metaopt.fleet.topology import from_hybrid_configs, job_topology
from metaopt.ir import Op, Program, Var
from metaopt.ir.program import PipelineInfo
from metaopt.layout.topology import AXES, HybridCommunicateGroup, ParallelMode, Topology
from metaopt.runtime.pipeline import PipelineState

pytestmark = pytest.mark.usefixtures("clean_env")  # tests/conftest.py


# --- the layout, against tables derived by hand from Paddle's documented ordering ---------------
#
# Paddle's CommunicateTopology(hybrid_group_names=["data", "pipe", "model"], dims) numbers the
# coordinates of itertools.product(range(dp), range(pp), range(mp)) 0, 1, 2, ...: "model" varies
# fastest. So with dp=2, pp=2, mp=2, rank 5 = (data 1, pipe 0, model 1).

# rank -> (data, pipe, model)
TABLE_D2_M2_P2 = {
    0: (0, 0, 0),
    1: (0, 0, 1),
    2: (0, 1, 0),
    3: (0, 1, 1),
    4: (1, 0, 0),
    5: (1, 0, 1),
    6: (1, 1, 0),
    7: (1, 1, 1),
}
GROUPS_D2_M2_P2 = {
    "model": [[0, 1], [2, 3], [4, 5], [6, 7]],  # adjacent ranks: one node
    "pipe": [[0, 2], [1, 3], [4, 6], [5, 7]],
    "data": [[0, 4], [1, 5], [2, 6], [3, 7]],
    "sharding": [[r] for r in range(8)],
}
TABLE_D1_M4_P2 = {r: (0, r // 4, r % 4) for r in range(8)}
GROUPS_D1_M4_P2 = {
    "model": [[0, 1, 2, 3], [4, 5, 6, 7]],
    "pipe": [[0, 4], [1, 5], [2, 6], [3, 7]],
    "data": [[r] for r in range(8)],
    "sharding": [[r] for r in range(8)],
}


@pytest.mark.parametrize(
    "topo, table, groups",
    [
        (Topology(dp_degree=2, mp_degree=2, pp_degree=2), TABLE_D2_M2_P2, GROUPS_D2_M2_P2),
        (Topology(dp_degree=1, mp_degree=4, pp_degree=2), TABLE_D1_M4_P2, GROUPS_D1_M4_P2),
    ],
)
def test_ranks_coordinates_and_groups_follow_paddles_order(topo, table, groups):
    assert topo.world_size() == 8
    assert topo.get_hybrid_group_names() == ["data", "pipe", "sharding", "sep", "model"]
    for rank, (d, p, m) in table.items():
        c = topo.get_coord(rank)
        assert (c.data, c.pipe, c.sharding, c.sep, c.model) == (d, p, 0, 0, m), rank
        assert topo.get_rank(data=d, pipe=p, sharding=0, model=m) == rank
    for axis, expected in groups.items():
        assert topo.get_comm_list(axis) == expected, axis
        for group in expected:
            for r in group:
                assert topo.group_ranks(axis, r) == group
    # every rank in exactly one group per axis
    for axis in AXES:
        assert sorted(r for g in topo.get_comm_list(axis) for r in g) == list(range(8))


def _paddle_reference(dims: dict[str, int]) -> dict[int, tuple[int, ...]]:
    """Paddle's construction, written out: enumerate the product of the axes' ranges in order."""
    coords = itertools.product(*(range(dims[a]) for a in AXES))
    return dict(enumerate(coords))


@pytest.mark.parametrize(
    "dp, pp, sh, mp", [(1, 1, 1, 1), (3, 1, 1, 2), (2, 3, 1, 1), (1, 2, 2, 2), (2, 2, 1, 3)]
)
def test_every_layout_equals_paddles_product_enumeration(dp, pp, sh, mp):
    topo = Topology(dp_degree=dp, pp_degree=pp, sharding_degree=sh, mp_degree=mp)
    ref = _paddle_reference({"data": dp, "pipe": pp, "sharding": sh, "sep": 1, "model": mp})
    assert {r: tuple(topo.get_coord(r)) for r in range(topo.world_size())} == ref
    for axis in AXES:  # Paddle's get_comm_list: for each coordinate of the other axes, in order
        others = [a for a in AXES if a != axis]
        expected = []
        for rest in itertools.product(*(range(topo.get_dim(a)) for a in others)):
            fixed = dict(zip(others, rest, strict=True))
            expected.append([topo.get_rank(**fixed, **{axis: i}) for i in range(topo.get_dim(axis))])
        assert topo.get_comm_list(axis) == expected
        for i in range(topo.get_dim(axis)):
            assert topo.get_axis_list(axis, i) == sorted(
                r for r, c in ref.items() if c[AXES.index(axis)] == i
            )


@pytest.mark.parametrize("dp, stages", [(1, 2), (2, 2), (2, 3), (3, 2)])
def test_with_mp_1_the_layout_is_the_pipelines_own_placement(dp, stages):
    """rank = replica x num_stages + stage is the topology's (data, pipe), and the pipeline
    runtime's placement (runtime/pipeline.py) without hybrid_configs."""
    for rank in range(dp * stages):
        replica, stage = divmod(rank, stages)
        info = PipelineInfo(stage=stage, num_stages=stages, micro_batches=1, schedule="1F1B", dp_degree=dp)
        state = PipelineState(info, None, rank)  # the layout pipeline_configs give: dp x stages
        c = state.topology.get_coord(rank)
        assert (c.data, c.pipe, state.replica) == (replica, stage, replica)
        assert state.dp_ranks() == [d * stages + stage for d in range(dp)]  # the replicas' all-reduce group
        assert [state.rank_of(s) for s in range(stages)] == [replica * stages + s for s in range(stages)]


@pytest.mark.parametrize("dp, mp, stages", [(1, 2, 2), (2, 2, 2), (2, 2, 3), (1, 4, 2)])
def test_with_mp_the_pipeline_talks_within_its_data_and_model_coordinate(dp, mp, stages):
    """Each MP rank of stage s sends to the same MP rank of stage s+1 (its pipe group); grads are
    averaged over the replicas of the same (pipe, model) slot (its data group)."""
    topo = Topology(dp_degree=dp, mp_degree=mp, pp_degree=stages)
    for rank in range(topo.world_size()):
        c = topo.get_coord(rank)
        info = PipelineInfo(stage=c.pipe, num_stages=stages, micro_batches=1, schedule="1F1B", dp_degree=dp)
        state = PipelineState(info, topo, rank)
        peers = [state.rank_of(s) for s in range(stages)]
        assert peers == topo.group_ranks("pipe", rank) and peers[c.pipe] == rank
        assert all(topo.get_coord(q)[::4] == (c.data, c.model) for q in peers)  # (data, model) kept
        assert state.dp_ranks() == topo.group_ranks("data", rank)
        assert all(topo.get_coord(q)[1:] == c[1:] for q in state.dp_ranks())  # (pipe, sharding, sep, model)


def test_a_stage_program_in_another_layout_is_refused_naming_both():
    topo = Topology(dp_degree=1, mp_degree=2, pp_degree=2)
    info = PipelineInfo(stage=1, num_stages=2, micro_batches=1, schedule="1F1B", dp_degree=1)
    with pytest.raises(ValueError, match=r"rank 0 runs pipeline stage 0 .*but this program is stage 1"):
        PipelineState(info, topo, 0)
    three = PipelineInfo(stage=0, num_stages=3, micro_batches=1, schedule="1F1B", dp_degree=1)
    with pytest.raises(ValueError, match=r"stage program 0 of 3 .* cannot run in the layout dp_degree=1, mp"):
        PipelineState(three, topo, 0)


def test_bad_coordinates_and_axes_are_named():
    topo = Topology(dp_degree=2, pp_degree=2)
    with pytest.raises(ValueError, match=r"rank 4 is outside 0\.\.3"):
        topo.get_coord(4)
    with pytest.raises(ValueError, match=r"pipe=2 is outside 0\.\.1 \(pp_degree=2\)"):
        topo.get_rank(data=0, pipe=2, sharding=0, model=0)
    with pytest.raises(ValueError, match=r"unknown axis 'mdoel' \(did you mean 'model'"):
        topo.get_rank(data=0, pipe=0, sharding=0, mdoel=0)
    with pytest.raises(ValueError, match=r"unknown hybrid parallel axis 'tensor'"):
        topo.get_comm_list("tensor")
    with pytest.raises(ValueError, match=r"mp_degree must be an int >= 1, got 0"):
        Topology(mp_degree=0)


def test_the_accessors_of_one_rank():
    hcg = HybridCommunicateGroup(Topology(dp_degree=2, mp_degree=2, pp_degree=2), 5)
    assert (hcg.get_global_rank(), hcg.get_data_parallel_rank(), hcg.get_stage_id()) == (5, 1, 0)
    assert (hcg.get_model_parallel_rank(), hcg.get_sharding_parallel_rank()) == (1, 0)
    assert hcg.get_data_parallel_world_size() == hcg.get_model_parallel_world_size() == 2
    assert hcg.get_pipe_parallel_world_size() == 2 and hcg.get_sharding_parallel_world_size() == 1
    assert hcg.group_ranks("model") == [4, 5] and hcg.get_model_parallel_group_src_rank() == 4
    assert hcg.group_ranks("data") == [1, 5] and hcg.get_data_parallel_group_src_rank() == 1
    assert hcg.group_ranks("pipe") == [5, 7] and hcg.get_rank_from_stage(1) == 7
    assert hcg.is_first_stage and not hcg.is_last_stage
    assert hcg.get_parallel_mode() == ParallelMode.PIPELINE_PARALLEL
    assert hcg.get_data_parallel_group() is None  # no process groups given (one process)
    assert hcg.topology() == Topology(dp_degree=2, mp_degree=2, pp_degree=2)
    assert "rank 5: dp_degree=2, mp_degree=2, pp_degree=2" in repr(hcg)
    assert (
        HybridCommunicateGroup(Topology(mp_degree=2), 0).get_parallel_mode() == ParallelMode.TENSOR_PARALLEL
    )
    assert HybridCommunicateGroup(Topology(dp_degree=2), 0).get_parallel_mode() == ParallelMode.DATA_PARALLEL


def test_the_printed_table():
    assert Topology(dp_degree=2, pp_degree=2).table() == (
        "rank     0 1 2 3\ndata     0 0 1 1\npipe     0 1 0 1"
    )


# --- degrees from hybrid_configs ---------------------------------------------------------------------


def _hybrid(**kw) -> dict:
    return {"dp_degree": -1, "mp_degree": 1, "pp_degree": 1, "sharding_degree": 1, **kw}


def test_dp_degree_minus_1_is_inferred_from_the_world_size():
    assert from_hybrid_configs(_hybrid(pp_degree=2), 8) == Topology(dp_degree=4, pp_degree=2)
    assert from_hybrid_configs(_hybrid(), 3) == Topology(dp_degree=3)
    with pytest.raises(
        ValueError, match=r"dp_degree=-1 \(inferred\) x mp_degree=2 x pp_degree=2: the world size 6"
    ):
        from_hybrid_configs(_hybrid(mp_degree=2, pp_degree=2), 6)


def test_a_wrong_world_size_is_refused_naming_the_three_degrees():
    with pytest.raises(ValueError) as e:
        from_hybrid_configs(_hybrid(dp_degree=2, mp_degree=2, pp_degree=2), 4)
    assert "dp_degree=2 x mp_degree=2 x pp_degree=2 = 8 workers, but the world size is 4 (WORLD_SIZE)" in str(
        e.value
    )


def test_expert_groups_overlap_the_data_side_ranks():
    """Paddle's ep_degree: runs of ep consecutive data-side ranks hold different experts; the
    ranks at one place of each run hold the same ones (moe_sharding)."""
    t = from_hybrid_configs(_hybrid(dp_degree=4, ep_degree=2), 4)
    assert t == Topology(dp_degree=4, ep_degree=2) and t.world_size() == 4  # no axis of its own
    assert t.get_comm_list("expert") == [[0, 1], [2, 3]]
    assert t.get_comm_list("expert_replica") == [[0, 2], [1, 3]]
    assert t.group_ranks("expert", 3) == [2, 3] and t.group_ranks("expert_replica", 3) == [1, 3]
    assert t.describe().endswith("ep_degree=2")
    hcg = HybridCommunicateGroup(t, 3)
    assert hcg.get_expert_parallel_world_size() == 2 and hcg.get_expert_parallel_rank() == 1
    assert hcg.get_moe_sharding_parallel_world_size() == 2
    # beside a pipeline: within each stage
    t = Topology(dp_degree=2, pp_degree=2, ep_degree=2)
    assert t.get_comm_list("expert") == [[0, 2], [1, 3]]
    # over sharding too
    assert Topology(dp_degree=1, sharding_degree=2, ep_degree=2).get_comm_list("expert") == [[0, 1]]


def test_expert_degrees_that_do_not_fit_are_refused():
    with pytest.raises(ValueError, match=r"ep_degree=3 must divide dp_degree=4 x sharding_degree=1"):
        from_hybrid_configs(_hybrid(dp_degree=4, ep_degree=3), 4)
    with pytest.raises(
        ValueError, match=r"moe_sharding_degree=1, but each expert's replicas are .* = 2 workers"
    ):
        from_hybrid_configs(_hybrid(dp_degree=4, ep_degree=2, moe_sharding_degree=1), 4)
    assert from_hybrid_configs(_hybrid(dp_degree=4, ep_degree=2, moe_sharding_degree=2), 4).ep_degree == 2
    with pytest.raises(NotImplementedError, match=r"ep_degree=2 beside mp_degree=2"):
        from_hybrid_configs(_hybrid(dp_degree=2, mp_degree=2, ep_degree=2), 4)
    with pytest.raises(ValueError, match=r"Topology: ep_degree=4 must divide"):
        Topology(dp_degree=2, ep_degree=4)


# --- segment parallel's axis (Paddle's sep_degree) --------------------------------------------------


def test_the_sep_axis_sits_between_sharding_and_model_as_in_paddles_order():
    """Paddle's hybrid_group_names ["data", "pipe", "sharding", "sep", "model"]: rank 5 of dp 2 x
    sep 2 x mp 2 is (data 1, sep 0, model 1); a sep group holds the ranks of one replica and one
    model place; Paddle's default order (with "sep") is the layout; an order without it places it
    right before "mp"."""
    t = from_hybrid_configs(_hybrid(dp_degree=2, sep_degree=2, mp_degree=2), 8)
    assert t == Topology(dp_degree=2, sep_degree=2, mp_degree=2) and t.world_size() == 8
    c = t.get_coord(5)
    assert (c.data, c.pipe, c.sharding, c.sep, c.model) == (1, 0, 0, 0, 1)
    for r in range(8):
        c = t.get_coord(r)
        assert r == ((c.data * 1 + c.pipe) * 1 + c.sharding) * 2 * 2 + c.sep * 2 + c.model
    assert t.get_comm_list("sep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert t.get_comm_list("model") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert t.get_comm_list("data") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert "sep_degree=2" in t.describe() and "sep " in t.table()
    hcg = HybridCommunicateGroup(t, 6)
    assert (hcg.get_sep_parallel_rank(), hcg.get_sep_parallel_world_size()) == (1, 2)
    assert hcg.group_ranks("sep") == [4, 6]
    old = from_hybrid_configs(
        _hybrid(dp_degree=2, sep_degree=2, mp_degree=2, order=["dp", "pp", "sharding", "mp"]), 8
    )
    assert old == t
    inner = from_hybrid_configs(
        _hybrid(dp_degree=2, sep_degree=2, order=["sep", "pp", "sharding", "mp", "dp"]), 4
    )
    assert inner.get_comm_list("sep") == [[0, 2], [1, 3]]
    # only a segment-parallel program names the sep group: none is made at degree 1
    assert "sep" in t.group_axes() and "sep" not in Topology(dp_degree=2).group_axes()
    with pytest.raises(
        ValueError, match=r"dp_degree=1 x mp_degree=1 x pp_degree=1 x sep_degree=2 = 2 workers"
    ):
        from_hybrid_configs(_hybrid(dp_degree=1, sep_degree=2), 4)


# --- Paddle's hybrid_configs["order"] ----------------------------------------------------------------


def test_order_places_the_axes_outermost_first():
    # model outermost, data innermost: model-parallel peers 2 ranks apart, replicas adjacent
    t = from_hybrid_configs(_hybrid(dp_degree=2, mp_degree=2, order=["mp", "pp", "sharding", "dp"]), 4)
    assert t.order == ("sep", "model", "pipe", "sharding", "data")  # sep (degree 1): Paddle's place
    assert t.get_comm_list("model") == [[0, 2], [1, 3]] and t.get_comm_list("data") == [[0, 1], [2, 3]]
    assert [t.get_coord(r).model for r in range(4)] == [0, 0, 1, 1]
    assert "order=['mp', 'pp', 'sharding', 'dp']" in t.describe()
    # Paddle's default (with 'sep', degree 1 here) is the layout without an order
    assert from_hybrid_configs(_hybrid(dp_degree=2, mp_degree=2), 4) == Topology(dp_degree=2, mp_degree=2)
    assert from_hybrid_configs(
        _hybrid(dp_degree=2, mp_degree=2, order=["dp", "sep", "pp", "sharding", "mp"]), 4
    ) == (Topology(dp_degree=2, mp_degree=2))


@pytest.mark.parametrize("order", list(itertools.permutations(AXES)))
def test_every_order_is_a_bijection_and_every_group_holds_one_rank_per_coordinate(order):
    t = Topology(dp_degree=2, pp_degree=3, sharding_degree=1, mp_degree=2, order=order)
    coords = [t.get_coord(r) for r in range(t.world_size())]
    assert len(set(coords)) == t.world_size()
    assert all(t.get_rank(**c._asdict()) == r for r, c in enumerate(coords))
    fastest = order[-1]  # the innermost axis: its groups are runs of adjacent ranks
    assert all(g == list(range(g[0], g[0] + len(g))) for g in t.get_comm_list(fastest))
    for axis in AXES:
        assert sorted(r for g in t.get_comm_list(axis) for r in g) == list(range(t.world_size()))


def test_a_bad_order_is_refused_naming_the_name():
    with pytest.raises(ValueError, match=r"unknown axis 'shardng' \(did you mean 'sharding'\?\)"):
        from_hybrid_configs(_hybrid(order=["dp", "pp", "shardng", "mp"]), 4)
    with pytest.raises(ValueError, match=r"names \['mp'\] more than once"):
        from_hybrid_configs(_hybrid(order=["dp", "mp", "pp", "sharding", "mp"]), 4)
    with pytest.raises(ValueError, match=r"names no \['pp'\]"):
        from_hybrid_configs(_hybrid(order=["dp", "sharding", "mp"]), 4)
    paddle3 = ["sharding", "moe_sharding", "pp", "sep", "cp", "dp", "ep", "mp"]  # docs/moe.md's Paddle code
    with pytest.raises(
        NotImplementedError, match=r"placing \['moe_sharding', 'ep'\] by the order is not built"
    ):
        from_hybrid_configs(_hybrid(dp_degree=2, mp_degree=2, order=paddle3), 4)
    s = fleet.DistributedStrategy()
    with pytest.raises(
        ValueError, match=r"hybrid_configs\['order'\]: must list each of dp, pp, sharding, mp"
    ):
        s.hybrid_configs = {"order": ["dp", "pp", "mp"]}


def test_an_order_moving_only_axes_of_degree_1_is_the_default_layout():
    # pp=1 and sharding=1 change no rank wherever they sit; Paddle 2.x's default has no "sep"
    moved = from_hybrid_configs(_hybrid(dp_degree=2, mp_degree=2, order=["pp", "dp", "mp", "sharding"]), 4)
    assert moved == Topology(dp_degree=2, mp_degree=2) and moved.order == AXES
    from metaopt.fleet.topology import hybrid_is_set

    assert not hybrid_is_set({"order": ["dp", "pp", "sharding", "mp"]})
    assert hybrid_is_set({"order": ["mp", "pp", "sharding", "dp"]})


def test_fleet_inits_order_must_agree_with_the_optimizers():
    init = Topology(dp_degree=2, mp_degree=2)
    with pytest.raises(
        ValueError, match=r"order=\['mp', 'pp', 'sharding', 'dp'\]\) differ from the layout fleet.init"
    ):
        job_topology(_S({"dp_degree": 2, "mp_degree": 2, "order": ["mp", "pp", "sharding", "dp"]}), 4, init)


class _S:
    """The strategy fields job_topology reads."""

    def __init__(self, hybrid=None, pipeline=False, **pipeline_configs):
        self.hybrid_configs = _hybrid(**(hybrid or {}))
        self.pipeline = pipeline
        self.pipeline_configs = {"dp_degree": 1, "num_stages": None, **pipeline_configs}


def test_hybrid_degrees_drive_the_pipeline_and_pipeline_configs_fold_in():
    assert job_topology(_S({"dp_degree": 2, "pp_degree": 2}, True), 4) == Topology(dp_degree=2, pp_degree=2)
    same = _S({"dp_degree": 2, "pp_degree": 2}, True, dp_degree=2, num_stages=2)
    assert job_topology(same, 4) == Topology(dp_degree=2, pp_degree=2)
    # no hybrid degrees: the pipeline's own (rank = replica x stages + stage), else data parallel
    assert job_topology(_S(None, True, dp_degree=2), 8) == Topology(dp_degree=2, pp_degree=4)
    assert job_topology(_S(), 4) == Topology(dp_degree=4)
    assert job_topology(_S({"dp_degree": 4}), 4) == Topology(dp_degree=4)


@pytest.mark.parametrize(
    "s, match",
    [
        (
            _S({"dp_degree": 2, "pp_degree": 2}, True, dp_degree=4),
            r"pipeline_configs\['dp_degree'\]=4 conflicts with strategy\.hybrid_configs dp_degree=2",
        ),
        (
            _S({"dp_degree": 1, "pp_degree": 4}, True, num_stages=2),
            r"pipeline_configs\['num_stages'\]=2 conflicts with strategy\.hybrid_configs pp_degree=4",
        ),
        (_S({"pp_degree": 2}), r"hybrid_configs pp_degree=2 needs strategy\.pipeline=True"),
        (
            _S({"dp_degree": 3}),
            r"dp_degree=3 x mp_degree=1 x pp_degree=1 = 3 workers, but the world size is 4",
        ),
        (_S(None, True, dp_degree=3), r"pipeline_configs\['dp_degree'\]=3 does not divide the 4 workers"),
    ],
)
def test_conflicting_layouts_are_refused_naming_both(s, match):
    with pytest.raises(ValueError, match=match):
        job_topology(s, 4)


def test_fleet_inits_layout_is_used_and_must_agree():
    init = Topology(dp_degree=2, pp_degree=2)
    assert job_topology(_S(None, True), 4, init) == init  # the optimizer's strategy at the defaults
    with pytest.raises(
        ValueError, match=r"strategy\.hybrid_configs \(dp_degree=4.*differ from the layout fleet.init"
    ):
        job_topology(_S({"dp_degree": 4}), 4, init)
    with pytest.raises(
        ValueError, match=r"fleet.init's strategy.hybrid_configs pp_degree=2 needs strategy.pipeline"
    ):
        job_topology(_S(), 4, init)


# --- fleet.init and minimize ------------------------------------------------------------------------


def _strategy(**hybrid) -> fleet.DistributedStrategy:
    s = fleet.DistributedStrategy()
    s.hybrid_configs = hybrid
    return s


def test_init_refuses_a_wrong_world_size_before_joining_any_group(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "0")  # no MASTER_ADDR: joining would fail with another error
    with pytest.raises(ValueError) as e:
        fleet.init(is_collective=True, strategy=_strategy(dp_degree=2, mp_degree=2, pp_degree=1))
    assert str(e.value) == (
        "fleet.init: strategy.hybrid_configs: dp_degree=2 x mp_degree=2 x pp_degree=1 = 4 workers, but the "
        "world size is 8 (WORLD_SIZE): the degrees' product must equal it (each worker holds one coordinate)"
    )
    assert not fleet.is_initialized() and not torch.distributed.is_initialized()


def test_one_worker_gets_a_group_without_process_groups():
    fleet.init(is_collective=True, strategy=_strategy(dp_degree=1))
    hcg = fleet.get_hybrid_communicate_group()
    assert hcg.get_data_parallel_world_size() == hcg.get_model_parallel_world_size() == 1
    assert hcg.get_stage_id() == 0 and hcg.get_pipe_parallel_group() is None
    assert env.hybrid_topology() == Topology()


def test_without_hybrid_configs_there_is_no_group_and_the_error_says_how():
    fleet.init(is_collective=True, strategy=fleet.DistributedStrategy())  # at Fleet's defaults
    with pytest.raises(
        RuntimeError, match=r"fleet.init was given no hybrid_configs; set strategy.hybrid_configs"
    ):
        fleet.get_hybrid_communicate_group()
    env.reset()
    with pytest.raises(RuntimeError, match=r"call fleet\.init"):
        fleet.get_hybrid_communicate_group()


def _program() -> Program:
    p = Program("tiny")
    p.add_var(Var("x", "float32", ("batch", 4), "input"))
    p.add_var(Var("w", "float32", (4, 3), "param", trainable=True), torch.randn(4, 3))
    p.add_var(Var("h", "float32", ("batch", 3)))
    p.add_var(Var("a", "float32", ("batch", 3)))
    p.add_var(Var("loss", "float32", ()))
    p.inputs, p.outputs, p.loss_name = ["x"], ["loss"], "loss"
    p.ops = [
        Op("MatMul", ["x", "w"], ["h"]),
        Op("Relu", ["h"], ["a"]),
        Op("ReduceMean", ["a"], ["loss"], {"keepdims": 0}, role="loss"),
    ]
    return p


def _fake_world(monkeypatch, rank: int, world: int) -> None:
    """A single process that plans as worker `rank` of `world` (no collective runs at minimize)."""
    monkeypatch.setattr(env._STATE, "env", env.WorkerEnv(rank=rank, world_size=world))


def _minimize(s: fleet.DistributedStrategy | None) -> Program:
    p = _program()
    fleet.distributed_optimizer(metaopt.optimizer.SGD(learning_rate=0.1), s).minimize(p.loss)
    return p


@pytest.mark.parametrize("rank", range(4))
def test_hybrid_dp_and_pp_degrees_drive_the_pipeline(monkeypatch, rank):
    fleet.init()
    _fake_world(monkeypatch, rank, 4)
    s = _strategy(dp_degree=2, pp_degree=2)
    s.pipeline = True
    s.pipeline_configs = {"cuts": ["a"], "accumulate_steps": 2}
    info = _minimize(s).pipeline
    assert (info.num_stages, info.dp_degree, info.stage) == (2, 2, rank % 2)  # rank = replica x 2 + stage


def test_mp_degree_without_tensor_parallel_is_refused_before_rewriting(monkeypatch):
    fleet.init()
    _fake_world(monkeypatch, 0, 4)
    p = _program()
    before = str(p)
    opt = fleet.distributed_optimizer(
        metaopt.optimizer.SGD(learning_rate=0.1), _strategy(dp_degree=2, mp_degree=2)
    )
    with pytest.raises(ValueError, match=r"mp_degree=2 needs strategy\.tensor_parallel=True"):
        opt.minimize(p.loss)
    assert str(p) == before
    assert "refused: hybrid_configs mp_degree=2 needs strategy.tensor_parallel=True" in str(opt.plan())


def test_mp_degree_from_fleet_inits_strategy_is_refused_without_tensor_parallel_too(monkeypatch):
    fleet.init()
    _fake_world(monkeypatch, 0, 4)
    init_strategy = _strategy(dp_degree=2, mp_degree=2)  # as fleet.init would have kept it on 4 workers
    monkeypatch.setattr(env._STATE, "strategy", init_strategy)
    monkeypatch.setattr(env._STATE, "hcg", HybridCommunicateGroup(Topology(dp_degree=2, mp_degree=2), 0))
    with pytest.raises(ValueError, match=r"^hybrid_configs mp_degree=2 needs strategy\.tensor_parallel=True"):
        _minimize(fleet.DistributedStrategy())


@pytest.mark.parametrize(
    "hybrid, pipeline_configs, match",
    [
        (
            {"dp_degree": 3},
            None,
            r"dp_degree=3 x mp_degree=1 x pp_degree=1 = 3 workers, but the world size is 4",
        ),
        ({"pp_degree": 2}, None, r"pp_degree=2 needs strategy\.pipeline=True"),
        (
            {"dp_degree": 2, "pp_degree": 2},
            {"dp_degree": 4, "cuts": ["a"]},
            r"pipeline_configs\['dp_degree'\]=4 conflicts with strategy\.hybrid_configs dp_degree=2",
        ),
    ],
)
def test_layout_errors_are_refused_at_minimize(monkeypatch, hybrid, pipeline_configs, match):
    fleet.init()
    _fake_world(monkeypatch, 0, 4)
    s = _strategy(**hybrid)
    if pipeline_configs is not None:
        s.pipeline = True
        s.pipeline_configs = pipeline_configs
    with pytest.raises(ValueError, match=match):
        _minimize(s)
