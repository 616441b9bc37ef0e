"""Expert capacity (passes/expert_capacity.py; CapacityRoute / CapacityPack / CapacityUnpack in
ops/kernels/moe.py): fixed slots of ceil(capacity_factor x rows / experts) per expert, rows past
it dropped and counted. Float64 throughout: without drops the program's grads are torch's; with
drops, the grads of the experts' weights are the program's own central differences (the routing
does not depend on them, so the loss is smooth in them), and the count is what the routing
implies."""

from __future__ import annotations

import functools

import pytest
import torch
from zoo import harness, models

import metaopt
from metaopt.ir import Op, Var, eval_dim, names, verify
from metaopt.ops.kernels.moe import capacity_of, capacity_pack, capacity_unpack
from metaopt.passes.backward import append_backward
from metaopt.passes.expert_capacity import ExpertCapacityError, expert_capacity, plan_expert_capacity

NAME = "hf-mixtral"  # 4 experts, top-2
BATCH = 3


@functools.cache
def _exported():
    return harness.export64(models.get(NAME))


def _capacity(cf: float) -> metaopt.Program:
    program = _exported()[1]
    return expert_capacity(program, plan=plan_expert_capacity(program, capacity_factor=cf))


def _feed(seed: int = 1) -> dict:
    module = _exported()[0]
    return harness._feed(module, tuple(harness._double(x) for x in models.get(NAME).inputs(BATCH, seed)))


def test_plan_text(golden):
    program = _exported()[1]
    golden("expert_capacity/hf-mixtral", str(plan_expert_capacity(program, capacity_factor=1.25)) + "\n")


def test_pack_and_unpack_keep_each_experts_first_rows_and_zero_the_rest():
    counts = torch.tensor([3, 0, 1])  # expert 0 has 3 rows, capacity 2: its third is dropped
    layout = torch.cat([torch.tensor([4, 3, 2, 1]), counts])
    x = torch.arange(1.0, 5.0).reshape(4, 1)
    packed = capacity_pack(x, layout)
    assert packed.flatten().tolist() == [1.0, 2.0, 0.0, 0.0, 4.0, 0.0]
    assert capacity_unpack(packed, layout).flatten().tolist() == [1.0, 2.0, 0.0, 4.0]
    assert capacity_of(1.25, 24, 4) == 8 and capacity_of(0.5, 24, 4) == 3


def test_without_drops_the_grads_are_torchs():
    """capacity_factor = experts: a slot for every row; float64 grads against float64 torch's at
    the zoo's float32-island bar (the router computes in float32 itself)."""
    module, program = _exported()
    q = _capacity(4.0)
    verify(q)
    check = tuple(harness._double(x) for x in models.get(NAME).inputs(BATCH, 1))
    ours, ref = harness.metaopt_grads(q, module, check), harness.torch_grads(module, check, double=True)
    assert (
        harness.float64_worst(models.get(NAME), ours, ref, "grads", island=True) <= harness.FLOAT32_ISLAND_REL
    )
    (dropped,) = metaopt.Executor("cpu").run(q, feed=_feed(), fetch_list=[names.moe_dropped_tokens()])
    assert int(dropped) == 0


def test_the_slots_shape_is_static():
    q = _capacity(1.25)
    packed = next(v for v in q.vars.values() if v.name.endswith("@CAP_PACK") and len(v.shape) == 2)
    rows = packed.shape[0]
    assert isinstance(rows, str) and eval_dim(rows, {"batch": BATCH}) == 4 * capacity_of(
        1.25, 12 * BATCH * 2, 4
    )


def test_drops_are_counted_as_the_routing_implies():
    q = _capacity(0.5)
    offsets = [o for o in q.vars if o.endswith("/cumsum") and "experts" in o]
    got = metaopt.Executor("cpu").run(q, feed=_feed(), fetch_list=[names.moe_dropped_tokens(), *offsets])
    dropped, ends = int(got[0]), got[1:]
    cap = capacity_of(0.5, 12 * BATCH * 2, 4)
    want = 0
    for e in ends:
        counts = torch.diff(torch.as_tensor(e), prepend=torch.zeros(1, dtype=torch.as_tensor(e).dtype))
        want += int((counts - cap).clamp(min=0).sum())
    assert dropped == want > 0


def _squared_norm_of(q: metaopt.Program, h: str) -> metaopt.Program:
    """`q` with its loss replaced by sum(h * h): a float64 function of the experts' output (HF's
    loss takes the logits to float32, too coarse for central differences)."""
    q = q.clone()
    q.add_var(Var("h_sq", "float64", q.vars[h].shape))
    q.add_var(Var("phi", "float64", ()))
    q.ops.append(Op("Mul", [h, h], ["h_sq"], role="forward"))
    q.ops.append(Op("ReduceSum", ["h_sq"], ["phi"], {"keepdims": 0}, role="loss"))
    q.loss_name = "phi"
    q.outputs = [*q.outputs, "phi"]
    return q


def test_with_drops_the_expert_weights_grads_are_central_differences(caplog):
    """Rows dropped (capacity_factor 0.5): d phi / d w of the last layer's experts, phi the squared
    norm of that layer's output (float64 end to end: `_squared_norm_of`), against phi's central
    differences. The routing does not depend on w, so phi is smooth in it; float64 central
    differences at eps 1e-5 are good to ~1e-8 relative here (eps^2 x the third derivative)."""
    q = _squared_norm_of(_capacity(0.5), "m.model.layers.1/add_1")
    assert q.vars["m.model.layers.1/add_1"].dtype == "float64"
    train, params_grads = append_backward(q, loss="phi")
    grads = dict(params_grads)
    w = next(p for p in grads if p.endswith("layers.1.mlp.experts.down_proj"))
    with caplog.at_level("WARNING", logger="metaopt.moe"):
        (g,) = metaopt.Executor("cpu").run(train, feed=_feed(), fetch_list=[grads[w]], return_numpy=False)
    assert "dropped" in caplog.text  # never silent
    base, eps = q.values[w].clone(), 1e-5
    flat = g.abs().flatten()
    picks = [int(i) for i in flat.topk(3).indices] + [int(flat.argmin())]  # large grads, and a zero one
    for k in picks:
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(k), g.shape))
        phis = []
        for sign in (1, -1):
            q.values[w] = base.clone()
            q.values[w][index] += sign * eps
            (phi,) = metaopt.Executor("cpu").run(q, feed=_feed(), fetch_list=["phi"])
            phis.append(float(phi))
        q.values[w] = base
        fd = (phis[0] - phis[1]) / (2 * eps)
        assert fd == pytest.approx(float(g[index]), rel=1e-6, abs=1e-9 * float(flat.max())), index


def test_bad_capacity_factors_are_refused():
    program = _exported()[1]
    for bad in (0, -1.0, float("nan"), "2", True):
        with pytest.raises(ExpertCapacityError, match=r"capacity_factor must be a number > 0"):
            plan_expert_capacity(program, capacity_factor=bad)
