"""Expert parallel (passes/expert_parallel.py, ops/kernels/expert_parallel.py, hybrid_configs'
ep_degree): the plan, the printed rewrite, the refusals; ep=2 on 2 gloo workers whose float64
grads equal torch's on the same batches; and fleet's dp x ep (2 x 2 on 2 workers, 4 x 2 on 4:
two workers per expert) training as one process of torch.optim.SGD on every worker's batch
(tests/training/ep_worker.py)."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch
from zoo import harness, models

from metaopt.ir import Op, Var, eval_dim, verify
from metaopt.ir.printer import fmt_op
from metaopt.passes.expert_parallel import ExpertParallelError, expert_parallel, plan_expert_parallel

TRAINING = Path(__file__).resolve().parent.parent / "training"
sys.path.insert(0, str(TRAINING))
import ep_worker  # noqa: E402  (beside the other workers, started as a script there)
from workers import start_workers, wait_workers  # noqa: E402

NAMES = ["hf-mixtral", "hf-deepseek-v3"]  # softmax top-2; sigmoid group-limited routing + shared experts
# + a shared expert (Qwen2-MoE), softmax without renormalising (OLMoE), experts with biases (gpt-oss:
# gathered by expert id from the whole [E, N] param, which stays replicated)
EVERY_MOE = [*NAMES, "hf-qwen2-moe", "hf-olmoe", "hf-gpt-oss"]


@functools.cache
def _exported(name: str):
    return harness.export64(models.get(name))[1]


def _plan(name: str, rank: int = 0, ep: int = 2):
    return plan_expert_parallel(_exported(name), ep_degree=ep, ep_rank=rank, group=list(range(ep)))


def test_plan_text(golden):
    golden("expert_parallel/hf-mixtral", str(_plan("hf-mixtral", rank=1)) + "\n")


def test_rewritten_moe_layer(golden):
    """The first MoE layer's experts after the rewrite, as print(program) shows them: the route,
    the rows and routing weights dispatched, the matmuls on this worker's experts with their local
    offsets, the combine."""
    q = expert_parallel(_exported("hf-mixtral"), plan=_plan("hf-mixtral"))
    scope = "m.model.layers.0.mlp.experts"
    lines = [fmt_op(op) for op in q.ops if op.scope == scope]
    params = [f"{v.name}: {list(v.shape)} {v.split}" for v in q.params() if v.name.startswith(scope)]
    golden("expert_parallel/hf-mixtral_layer0", "\n".join([*params, *lines]) + "\n")


def test_rewritten_program_holds_its_experts_and_moves_rows_once_each_way():
    program = _exported("hf-mixtral")
    for rank in range(2):
        plan = _plan("hf-mixtral", rank)
        q = expert_parallel(program, plan=plan)
        verify(q)
        for w, experts in plan.params.items():
            half = experts // 2
            assert torch.equal(q.values[w], program.values[w][rank * half : (rank + 1) * half]), w
            assert q.vars[w].split is not None and q.vars[w].split.group == "expert"
            assert 'group="expert"' in str(q.vars[w].split)
        layers = len(plan.routes)
        kinds = [(op.type, op.attrs.get("reverse")) for op in q.ops]
        assert kinds.count(("ExpertRoute", None)) == layers == 2
        # tokens out before the first matmul, the routing weights beside them, back once
        assert kinds.count(("ExpertExchange", 0)) == 2 * layers
        assert kinds.count(("ExpertExchange", 1)) == layers
    assert program.vars[w].split is None and program.values[w].shape[0] == experts  # the pass is pure


def test_local_rows_are_written_at_their_bound():
    """Every row of every worker may route to one worker's experts: estimate_memory's worst case."""
    program = _exported("hf-mixtral")
    q = expert_parallel(program, plan=_plan("hf-mixtral"))
    mm = next(op for op in q.ops if op.type == "GroupedMatMul")
    rows = program.vars[next(op for op in program.ops if op.type == "GroupedMatMul").inputs[0]].shape[0]
    assert q.vars[mm.outputs[0]].shape[0] == f"2*({rows})"


def test_refusals_name_what_is_at_fault():
    program = _exported("hf-mixtral")
    with pytest.raises(ExpertParallelError, match=r"4 experts do not split over ep_degree=3"):
        plan_expert_parallel(program, ep_degree=3, ep_rank=0, group=[0, 1, 2])
    with pytest.raises(ExpertParallelError, match=r"ep_rank 2 must be in \[0, ep_degree=2\)"):
        plan_expert_parallel(program, ep_degree=2, ep_rank=2, group=[0, 1])
    # an expert param read elsewhere (a norm of it, say) cannot be cut to this worker's experts
    p = program.clone()
    w = next(op for op in p.ops if op.type == "GroupedMatMul")
    weight = next(op for op in p.ops if op.outputs[0] == w.inputs[1]).inputs[0]
    p.add_var(Var("peek", p.vars[weight].dtype, p.vars[weight].shape))
    p.ops.insert(0, Op("Identity", [weight], ["peek"]))
    at_fault = rf"expert param '{weight}' is read outside .* by `peek = Identity"
    with pytest.raises(ExpertParallelError, match=at_fault):
        plan_expert_parallel(p, ep_degree=2, ep_rank=0, group=[0, 1])


def test_a_program_without_experts_says_so():
    from conftest import exported

    plan = plan_expert_parallel(exported("gpt")[2], ep_degree=2, ep_rank=0, group=[0, 1])
    assert not plan.params and "no expert layer (GroupedMatMul)" in str(plan)


# --- ep=2 on 2 gloo workers ------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    """One launch, several layouts (fleet.init again with each): the pass alone on every MoE
    model; dp2 x ep2, with recompute and with AMP too; sharding2 x ep2 at ZeRO stages 1-3."""
    out = tmp_path_factory.mktemp("ep")
    jobs = [f"pass={','.join(EVERY_MOE)}", f"dp:2x2={','.join(NAMES)}", "dp-rc:2x2=hf-mixtral"]
    jobs += ["dp-amp:2x2=hf-mixtral", "dp-cap:2x2=hf-mixtral"]
    jobs += [f"zero{stage}:2x2={','.join(NAMES)}" for stage in (1, 2, 3)]
    procs = start_workers(2, [str(TRAINING / "ep_worker.py"), str(out), *jobs])
    wait_workers(procs, "expert-parallel", 400)
    return out


@pytest.fixture(scope="module")
def four_workers(tmp_path_factory):
    out = tmp_path_factory.mktemp("ep4")
    procs = start_workers(4, [str(TRAINING / "ep_worker.py"), str(out), "dp:4x2=hf-mixtral"])
    wait_workers(procs, "expert-parallel", 400)
    return out


@pytest.mark.parametrize("name", EVERY_MOE)
def test_two_ep_workers_grads_equal_float64_torch(two_workers, name):
    """Each worker its own batch and half the experts; its grads, reduced as data parallel does,
    equal float64 torch's averaged over the two batches. The bar is the zoo's float32-island one
    (1e-5): these routers compute in float32 themselves (`.float()`), in torch's run as well."""
    got = [torch.load(two_workers / f"{name}.rank{r}.pt", weights_only=True) for r in range(2)]
    for r in got:
        assert r["worst"] <= harness.FLOAT32_ISLAND_REL
        assert r["shapes"] and all(s[0] == _plan(name).params[k] // 2 for k, s in r["shapes"].items())
    assert got[0]["program"] == got[1]["program"]  # every worker runs the same printed program


@functools.cache
def _torch_sgd(name: str, dp: int) -> tuple[list[list[float]], dict[str, torch.Tensor], float]:
    """One process of float64 torch: each step the grads of every worker's batch averaged (data
    parallel's step), then torch.optim.SGD. Each worker's losses, and the params after."""
    entry = models.get(name)
    module = entry.build(0.0).double()
    params = dict(module.named_parameters())
    opt = torch.optim.SGD(list(params.values()), lr=ep_worker.LR)
    losses: list[list[float]] = [[] for _ in range(dp)]
    for step in range(ep_worker.STEPS):
        total = {k: torch.zeros_like(v) for k, v in params.items()}
        for r in range(dp):
            module.zero_grad(set_to_none=True)
            loss = module(*ep_worker.fleet_batch(entry, step, r, dp))
            loss.backward()
            losses[r].append(loss.item())
            for k, v in params.items():
                if v.grad is not None:
                    total[k] += v.grad
        for k, v in params.items():
            v.grad = total[k] / dp
        opt.step()
    with torch.no_grad():  # issue 49: the trained module in eval mode on the held-out batch
        evaluated = module.eval()(*ep_worker.fleet_batch(entry, ep_worker.HELD_OUT, 0, 1)).item()
    return losses, {k: v.detach().clone() for k, v in params.items()}, evaluated


def _check_fleet(out: Path, name: str, dp: int, ep: int, kind: str = "dp") -> None:
    got = [torch.load(out / f"{name}.{kind}.rank{r}.pt", weights_only=True) for r in range(dp)]
    losses, want, evaluated = _torch_sgd(name, dp)
    # float64 on both sides; the routers compute in float32 themselves (`.float()`), so the
    # float32-island bar of the zoo
    tol = {"rtol": harness.FLOAT32_ISLAND_REL, "atol": 1e-7}
    for r, g in enumerate(got):
        assert "expert_parallel" in g["applied"] and "data_parallel" in g["applied"]
        assert g["losses"] == pytest.approx(losses[r], rel=harness.FLOAT32_ISLAND_REL)
        # clone(for_test=True) of the expert-parallel program: torch's model.eval(), twice the same bits
        assert g["eval"][0] == g["eval"][1] == pytest.approx(evaluated, rel=harness.FLOAT32_ISLAND_REL)
        assert g["experts"], "no expert param was split"
        assert "split over the 'expert' group (expert parallel)" in g["save_refused"]
        index = r % ep  # place in its expert group: runs of ep consecutive ranks
        for k, v in g["params"].items():
            if k in g["experts"]:
                n = want[k].shape[0] // ep
                torch.testing.assert_close(v, want[k][index * n : (index + 1) * n], **tol)
            else:
                torch.testing.assert_close(v, want[k], **tol)
        # each worker holds its own experts and the dense params, as estimate_memory says
        assert g["measured_persistable"] == g["predicted_persistable"]
        if kind == "dp-cap":  # fixed slots: each worker receives the rows it sends, so all exact
            assert g["measured_peak"] == g["predicted_peak"]
            assert g["all_to_all_bytes"] == g["all_to_all_bound"]
        else:  # the rows an expert layer receives are data: the estimate takes their bound
            assert 0 < g["all_to_all_bytes"] <= g["all_to_all_bound"]
            assert g["measured_peak"] <= g["predicted_peak"]
    expert_bytes = sum(v.numel() * v.element_size() for k, v in want.items() if k in got[0]["experts"])
    dense_bytes = sum(v.numel() * v.element_size() for k, v in want.items() if k not in got[0]["experts"])
    held = sum(v.numel() * v.element_size() for v in got[0]["params"].values())
    assert held == dense_bytes + expert_bytes // ep
    return got


@pytest.mark.parametrize("name", NAMES)
def test_fleet_dp2_x_ep2_trains_as_one_process(two_workers, name):
    _check_fleet(two_workers, name, dp=2, ep=2)


def test_recompute_beside_expert_parallel_is_bitwise(two_workers):
    """A recomputed MoE layer re-runs its exchanges with the routing held from the forward:
    losses and params bit for bit those without recompute."""
    plain = [torch.load(two_workers / f"hf-mixtral.dp.rank{r}.pt", weights_only=True) for r in range(2)]
    rc = _check_fleet(two_workers, "hf-mixtral", dp=2, ep=2, kind="dp-rc")
    for a, b in zip(plain, rc, strict=True):
        assert "recompute" in b["applied"]
        assert a["losses"] == b["losses"]
        assert all(torch.equal(a["params"][k], v) for k, v in b["params"].items())


def test_amp_beside_expert_parallel_skips_alike_and_trains(two_workers):
    """Each worker checks its own experts' grads for overflow: the checks are summed over the
    workers, so every worker keeps the same loss scale and skips the same steps. Against float64
    torch at float16's precision: the white ops' inputs round to 11 bits (rel 5e-4 each); this
    two-layer model's losses over 3 steps stay inside 2e-3 of torch's (measured: ~1e-5)."""
    got = [torch.load(two_workers / f"hf-mixtral.dp-amp.rank{r}.pt", weights_only=True) for r in range(2)]
    losses, _, _ = _torch_sgd("hf-mixtral", 2)
    assert all(g["found_inf_reduced"] for g in got)
    assert got[0]["loss_scales"] == got[1]["loss_scales"] and len(got[0]["loss_scales"]) == ep_worker.STEPS
    for r, g in enumerate(got):
        assert "amp" in g["applied"] and "expert_parallel" in g["applied"]
        assert g["losses"] == pytest.approx(losses[r], rel=2e-3)


def test_expert_capacity_beside_expert_parallel_trains_as_one_process(two_workers):
    """moe_configs capacity_factor = experts: each expert's fixed slots hold all its rows, so the
    job is exact; the exchanges then move whole slots (static splits)."""
    got = _check_fleet(two_workers, "hf-mixtral", dp=2, ep=2, kind="dp-cap")
    assert all(g["applied"][:2] == ["expert_capacity", "expert_parallel"] for g in got)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_sharding2_x_ep2_trains_as_one_process(two_workers, stage, name):
    """The dense params' optimizer state (grads at 2, params at 3) sharded over the two workers,
    each holding its own experts whole (Paddle's moe_sharding_degree 1)."""
    got = _check_fleet(two_workers, name, dp=2, ep=2, kind=f"zero{stage}")
    assert all("sharding" in g["applied"] for g in got)


def test_fleet_dp4_x_ep2_trains_as_one_process(four_workers):
    """Two workers hold each expert: their grads are summed over that pair."""
    _check_fleet(four_workers, "hf-mixtral", dp=4, ep=2)


def test_a_workers_program_runs_on_meta_at_its_bound():
    """Without a group to talk to: on the meta device the exchanges issue no collective and give
    their bound rows (every row of the group), the shapes `estimate_memory` counts, so one process
    can take a step of any worker of an expert-parallel job (what a planner needs)."""
    import metaopt

    entry = models.get("hf-mixtral")
    module, program = harness.export(entry, 0.0)
    q = expert_parallel(program, plan=plan_expert_parallel(program, ep_degree=2, ep_rank=1, group=[0, 1]))
    metaopt.optimizer.SGD(learning_rate=0.1).minimize(q.loss)
    real = harness._feed(module, entry.inputs(3, 0))
    feed = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in real.items()}
    mm = next(op for op in q.ops if op.type == "GroupedMatMul").outputs[0]
    loss, rows = metaopt.Executor("meta").run(q, feed=feed, fetch_list=[q.loss, mm])
    assert loss.is_meta and rows.is_meta
    n = program.vars[next(op for op in program.ops if op.type == "GroupedMatMul").inputs[0]].shape[0]
    assert rows.shape[0] == 2 * eval_dim(n, {"batch": 3})


def test_beside_expert_capacity_a_workers_rows_are_exact_on_meta_too():
    """Capacity slots give every expert the same rows: each worker receives what it sends (E x C
    rows), which the program's shapes say (no bound) and a meta step gives."""
    import metaopt
    from metaopt.passes.expert_capacity import expert_capacity, plan_expert_capacity

    entry = models.get("hf-mixtral")
    module, program = harness.export(entry, 0.0)
    slotted = expert_capacity(program, plan=plan_expert_capacity(program, capacity_factor=1.5))
    plan = plan_expert_parallel(slotted, ep_degree=2, ep_rank=1, group=[0, 1])
    assert plan.equal == set(plan.routes) and "exact, their experts' fixed slots" in str(plan)
    q = expert_parallel(slotted, plan=plan)
    metaopt.optimizer.SGD(learning_rate=0.1).minimize(q.loss)
    first = next(op for op in slotted.ops if op.type == "GroupedMatMul")
    slots = slotted.vars[first.inputs[0]].shape[0]  # E x C: the rows each worker sends
    mm = next(op for op in q.ops if op.type == "GroupedMatMul")
    assert q.vars[mm.inputs[0]].shape[0] == q.vars[mm.outputs[0]].shape[0] == slots
    real = harness._feed(module, entry.inputs(3, 0))
    feed = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in real.items()}
    (rows,) = metaopt.Executor("meta").run(q, feed=feed, fetch_list=[mm.outputs[0]])
    assert rows.is_meta and rows.shape[0] == eval_dim(slots, {"batch": 3})
