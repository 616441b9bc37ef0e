"""fleet.init / worker queries and fleet.distributed_optimizer (meta optimizer order, refusals)."""

from __future__ import annotations

import importlib
import logging
import re

import pytest
import torch
from conftest import tiny_program

import metaopt
from metaopt import fleet
from metaopt.fleet import env
from metaopt.fleet.strategy import UNSUPPORTED_FEATURES
from metaopt.ir import Op, Var

# the module (`fleet.distributed_optimizer` is the function, as in Fleet)
dopt = importlib.import_module("metaopt.fleet.distributed_optimizer")


pytestmark = pytest.mark.usefixtures("clean_env")  # tests/conftest.py


class FakeOptimizer:
    """Stands in for metaopt.optimizer.*: records minimize calls."""

    def __init__(self, tag: str = "inner") -> None:
        self.tag = tag
        self.calls: list[tuple] = []

    def minimize(self, loss, startup_program=None, parameter_list=None, no_grad_set=None):
        self.calls.append((loss, startup_program, parameter_list, no_grad_set))
        return ["optimize-op"], [("w", "w@GRAD")]


# --- init and worker queries --------------------------------------------------------------


def test_single_worker_by_default():
    fleet.init(is_collective=True)
    assert (fleet.worker_index(), fleet.worker_num(), fleet.local_rank()) == (0, 1, 0)
    assert fleet.is_first_worker()
    assert fleet.worker_endpoints() == ["127.0.0.1:6170"]
    fleet.barrier_worker()  # a no-op
    assert not torch.distributed.is_initialized()


def test_queries_before_init_raise():
    with pytest.raises(RuntimeError, match=r"call fleet\.init"):
        fleet.worker_index()


def test_torch_env_vars(monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    w = env.read_env()
    assert (w.rank, w.world_size, w.local_rank) == (2, 4, 0)
    assert (w.master_addr, w.master_port) == ("10.0.0.1", 29500)
    assert w.endpoints is None  # torchrun sets no endpoints


def test_fleet_env_vars(monkeypatch):
    monkeypatch.setenv("PADDLE_TRAINER_ID", "1")
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "2")
    monkeypatch.setenv("PADDLE_TRAINER_ENDPOINTS", "10.0.0.1:6170,10.0.0.2:6171")
    w = env.read_env()
    assert (w.rank, w.world_size, w.local_rank) == (1, 2, 1)
    assert w.endpoints == ("10.0.0.1:6170", "10.0.0.2:6171")
    assert w.current_endpoint == "10.0.0.2:6171"
    assert (w.master_addr, w.master_port) == ("10.0.0.1", 6170)  # the first endpoint


def test_init_reads_the_env_with_one_worker(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("PADDLE_TRAINER_ENDPOINTS", "10.1.1.1:7000")
    fleet.init()
    assert fleet.worker_num() == 1 and fleet.worker_index() == 0
    assert fleet.worker_endpoints(to_string=True) == "10.1.1.1:7000"
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize(
    "values, match",
    [
        ({"RANK": "1", "PADDLE_TRAINER_ID": "0", "WORLD_SIZE": "2"}, "RANK=1 but PADDLE_TRAINER_ID=0"),
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
        ({"RANK": "3", "WORLD_SIZE": "2"}, r"rank 3 .* outside 0\.\.1"),
        ({"WORLD_SIZE": "2"}, "rank is not set"),
        (
            {"PADDLE_TRAINERS_NUM": "3", "PADDLE_TRAINER_ID": "0", "PADDLE_TRAINER_ENDPOINTS": "a:1,b:2"},
            "lists 2 endpoints but the world size is 3",
        ),
    ],
)
def test_bad_env_names_the_variable(monkeypatch, values, match):
    for k, v in values.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=match):
        fleet.init()
    assert not fleet.is_initialized()


def test_comm_timeout():
    assert env.comm_timeout({}).total_seconds() == 300
    assert env.comm_timeout({"METAOPT_COMM_TIMEOUT": "12.5"}).total_seconds() == 12.5
    with pytest.raises(ValueError, match="METAOPT_COMM_TIMEOUT='0'"):
        env.comm_timeout({"METAOPT_COMM_TIMEOUT": "0"})


def test_parameter_server_mode_is_refused():
    with pytest.raises(NotImplementedError, match="parameter-server mode"):
        fleet.init(is_collective=False)
    with pytest.raises(TypeError, match="is_collective must be a bool"):
        fleet.init(object())
    assert not fleet.is_initialized()


# --- distributed_optimizer ----------------------------------------------------------------


STEP_ORDER = [
    "fuse_linear_ce",
    "tensor_parallel",
    "sep_parallel",
    "cp_parallel",
    "expert_capacity",
    "expert_parallel",
    "amp_casts",
    "scale_loss",
    "tie_params",
    "append_backward",
    "apply_optimizer",
    "lamb",
    "lars",
    "gradient_merge",
    "data_parallel",
    "localsgd",
    "fp16_allreduce",
    "broadcast_init",
    "recompute",
    "partition",
    "sp_regather",
    "offload",
    "pipeline_split",
    "sharding",
    "state_offload",
    "unscale_grads",
    "master_weights",
    "early_updates",
    "split_w_grads",
    "overlap_comm",
    "pipeline_phases",
]


def test_steps_are_the_documented_literal():
    """A change of order is deliberate: this literal changes with it (docs/architecture.md's drawing is
    checked against STEPS in test_steps_order.py; the module doc no longer repeats the list)."""
    assert [s.name for s in fleet.STEPS] == STEP_ORDER


def test_plain_path_delegates_to_the_inner_optimizer(caplog):
    fleet.init(is_collective=True)
    p = tiny_program()
    inner = FakeOptimizer()
    opt = fleet.distributed_optimizer(inner, fleet.DistributedStrategy())
    with caplog.at_level(logging.INFO, logger="metaopt.fleet"):
        result = opt.minimize(p.loss, "startup", ["w"], {"x"})
    assert result == (["optimize-op"], [("w", "w@GRAD")])
    assert len(inner.calls) == 1
    loss, *rest = inner.calls[0]
    assert loss.name == "loss" and loss.program is p
    assert rest == ["startup", ["w"], {"x"}]
    assert opt.applied_meta_list == []
    assert "applied meta optimizers: []" in caplog.text


def test_default_strategy_comes_from_init():
    s = fleet.DistributedStrategy()
    s.recompute = True
    fleet.init(strategy=s)
    s.recompute = False  # init keeps a copy
    opt = fleet.distributed_optimizer(FakeOptimizer())
    assert opt.user_defined_strategy.recompute
    assert not fleet.distributed_optimizer(
        FakeOptimizer(), fleet.DistributedStrategy()
    ).user_defined_strategy.recompute


def test_a_rewriting_step_needs_a_metaopt_optimizer():
    fleet.init()
    s = fleet.DistributedStrategy()
    s.gradient_merge = True
    inner = FakeOptimizer()
    p = tiny_program()
    before = str(p)
    with pytest.raises(TypeError, match=r"steps \['gradient_merge'\] rewrite .* need a metaopt.optimizer"):
        fleet.distributed_optimizer(inner, s).minimize(p.loss)
    assert inner.calls == [] and str(p) == before  # refused before anything was touched


def test_data_parallel_without_a_process_group_is_refused_before_rewriting(monkeypatch):
    fleet.init()
    monkeypatch.setattr(env._STATE, "env", env.WorkerEnv(rank=0, world_size=2))
    inner = FakeOptimizer()
    p = tiny_program()
    before = str(p)
    with pytest.raises(RuntimeError, match=r"needs torch.distributed: call fleet.init\(is_collective=True\)"):
        fleet.distributed_optimizer(inner).minimize(p.loss)
    assert inner.calls == [] and str(p) == before


@pytest.mark.parametrize("flag", ["dgc", "adaptive_localsgd", "a_sync", "heter_ccl_mode", "asp", "elastic"])
def test_unsupported_fleet_features_are_refused(flag):
    fleet.init()
    s = fleet.DistributedStrategy()
    setattr(s, flag, True)
    inner = FakeOptimizer()
    why = UNSUPPORTED_FEATURES[flag]
    match = rf"strategy\.{flag}=True: Fleet's {flag} is not implemented in metaopt \({re.escape(why)}\)"
    with pytest.raises(NotImplementedError, match=match):
        fleet.distributed_optimizer(inner, s).minimize(tiny_program().loss)
    assert inner.calls == []


def test_pipeline_with_gradient_merge_is_refused_naming_both():
    fleet.init()
    s = fleet.DistributedStrategy()
    s.pipeline = s.gradient_merge = True
    with pytest.raises(ValueError, match=r"strategy\.pipeline=True and strategy\.gradient_merge=True cannot"):
        fleet.distributed_optimizer(FakeOptimizer(), s).minimize(tiny_program().loss)


def test_steps_run_in_list_order_and_report_fleet_names():
    fleet.init()
    s = fleet.DistributedStrategy()
    s.recompute = True
    s.recompute_configs = {"checkpoints": ["h"]}
    p = tiny_program()
    opt = fleet.distributed_optimizer(metaopt.optimizer.SGD(0.1), s)
    # the LM-head fusion is on by default (it finds no cross-entropy here and changes nothing)
    assert opt.plan().steps == ["fuse_linear_ce", "append_backward", "apply_optimizer", "recompute"]
    with pytest.warns(UserWarning, match="does not lower the predicted activation peak"):
        opt.minimize(p.loss)
    assert opt.applied_meta_list == ["recompute"]
    assert list(opt.context.plans) == ["fuse_linear_ce", "recompute"]  # the steps that plan, once each


def test_a_step_that_breaks_an_invariant_is_named(monkeypatch):
    from metaopt.fleet import steps
    from metaopt.passes.driver import Step, StepError

    def dangle(p, plan, ctx):
        q = p.clone()
        q.ops.append(Op("Relu", ["nowhere"], ["h2"], role="optimize"))
        q.add_var(Var("h2", "float32", ("batch", 3)))
        return q

    bad = Step("dangling_read", lambda ctx: (True, "test"), dangle)
    monkeypatch.setattr(dopt, "STEPS", (*steps.STEPS, bad))
    fleet.init()
    p = tiny_program()
    before = str(p)
    with pytest.raises(StepError, match=r"step 'dangling_read' broke an invariant of 'tiny'.*nowhere") as e:
        fleet.distributed_optimizer(metaopt.optimizer.SGD(0.1)).minimize(p.loss)
    assert "Relu" in str(e.value.__cause__)
    assert str(p) == before  # the user's program is replaced only at the end


def test_plan_is_printable_with_reasons():
    fleet.init()
    s = fleet.DistributedStrategy()
    s.recompute = True
    s.recompute_configs = {"checkpoints": ["h"], "enable_offload": True}
    s.amp_configs = {"incr_ratio": 4.0}  # set but amp is off
    s.dgc = True
    text = str(fleet.distributed_optimizer(FakeOptimizer(), s).plan())
    assert "  recompute        run   strategy.recompute=True" in text
    assert "  offload          run   recompute_configs['enable_offload']=True" in text
    assert "  amp_casts        skip  strategy.amp=False" in text
    assert "  data_parallel    skip  fleet.worker_num()=1" in text
    assert "optimizer FakeOptimizer" in text
    assert "refused: strategy.dgc=True" in text
    assert "note: strategy.amp_configs is set but strategy.amp=False" in text


def test_bad_arguments():
    fleet.init()
    with pytest.raises(TypeError, match="expected an optimizer with minimize"):
        fleet.distributed_optimizer(object())
    with pytest.raises(TypeError, match="strategy must be a DistributedStrategy"):
        fleet.distributed_optimizer(FakeOptimizer(), {"recompute": True})
    with pytest.raises(TypeError, match="loss must be a Var"):
        fleet.distributed_optimizer(FakeOptimizer()).minimize("loss")


def test_minimize_before_init_raises():
    with pytest.raises(RuntimeError, match=r"fleet\.init"):
        fleet.distributed_optimizer(FakeOptimizer()).minimize(tiny_program().loss)


def test_the_step_order_is_pinned_by_a_golden_plan(monkeypatch, golden):
    """Every step enabled that can be at once (pipeline and gradient merge exclude each
    other): the printed plan lists all steps in the one documented order."""
    fleet.init()
    monkeypatch.setattr(env._STATE, "env", env.WorkerEnv(rank=0, world_size=2))
    monkeypatch.setattr(env, "require_process_group", lambda what: None)  # as if fleet.init made one
    s = fleet.DistributedStrategy()
    s.amp = s.recompute = s.gradient_merge = True
    s.amp_configs = {"use_pure_fp16": True, "use_fp16_guard": False}
    s.recompute_configs = {"checkpoints": ["h"], "enable_offload": True}
    s.gradient_merge_configs = {"k_steps": 4}
    text = str(fleet.distributed_optimizer(metaopt.optimizer.Adam(), s).plan())
    golden("train/steps_plan", text)
    assert [line.split()[0] for line in text.splitlines()[1:]] == STEP_ORDER


def test_minimize_twice_says_the_program_is_already_minimized():
    """Issue 32: a second minimize named an internal step (FuseLinearCrossEntropyError ...
    already has a backward op); it names the cause, for fleet's minimize and the optimizer's,
    and changes nothing."""
    from metaopt.passes.minimize import AlreadyMinimized

    fleet.init(is_collective=True)
    p = tiny_program()
    metaopt.optimizer.SGD(learning_rate=0.1).minimize(p.loss)
    before = str(p)
    with pytest.raises(
        AlreadyMinimized, match=r"SGD.minimize: program 'tiny' is already minimized .*role=backward"
    ):
        metaopt.optimizer.SGD(learning_rate=0.1).minimize(p.loss)
    with pytest.raises(AlreadyMinimized, match=r"fleet minimize: program 'tiny' is already minimized"):
        fleet.distributed_optimizer(metaopt.optimizer.SGD(learning_rate=0.1)).minimize(p.loss)
    assert str(p) == before


def test_simulate_stands_in_for_one_worker_of_a_larger_job_without_a_group():
    """fleet.simulate (issue 45): worker 5 of 8 laid out by hybrid_configs, in this process; the
    steps that need a process group to run (data parallel) still rewrite, nothing waits for a peer,
    and fleet.init leaves the simulation. (Its program equals the real worker's:
    tests/passes/test_context_parallel.py.)"""
    from metaopt.fleet import env

    s = fleet.DistributedStrategy()
    s.hybrid_configs = {"dp_degree": 2, "mp_degree": 2, "pp_degree": 2}
    fleet.simulate(8, 5, s)
    assert env.is_simulated() and (fleet.worker_index(), fleet.worker_num()) == (5, 8)
    hcg = fleet.get_hybrid_communicate_group()
    assert (hcg.get_data_parallel_rank(), hcg.get_stage_id(), hcg.get_model_parallel_rank()) == (1, 0, 1)
    env.require_process_group("data parallel")  # rewriting only: no group needed
    fleet.barrier_worker()  # no peers to wait for
    with pytest.raises(ValueError, match=r"rank must be one of 0\.\.3, got 4"):
        fleet.simulate(4, 4)
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        fleet.simulate(0)
    with pytest.raises(ValueError, match="dp_degree=2 x mp_degree=2 x pp_degree=2 = 8 workers"):
        fleet.simulate(4, 0, s)
    fleet.init(is_collective=True)
    assert not env.is_simulated() and fleet.worker_num() == 1
