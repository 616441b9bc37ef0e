"""HF mixture-of-experts models export with every expert, whatever the example input routes."""

from __future__ import annotations

import torch
from zoo import harness, models
from zoo.hf import MOEISH, LMLoss, _clm

import metaopt
from metaopt.passes.backward import append_backward


def _mixtral() -> LMLoss:
    import transformers

    cfg = transformers.MixtralConfig(**dict(MOEISH, attention_dropout=0.0), num_local_experts=4)
    torch.manual_seed(0)
    return LMLoss(transformers.MixtralForCausalLM(cfg)).train().double()


def test_experts_the_example_did_not_route_to_are_kept_and_trained():
    module = _mixtral()
    gates = {n: m for n, m in module.named_modules() if n.endswith("mlp.gate")}
    trained = {n: m.weight for n, m in gates.items()}
    for m in gates.values():  # a zero router sends every example token to experts 0 and 1 (ties)
        m.weight = torch.nn.Parameter(torch.zeros_like(m.weight))
    example = tuple(harness._double(x) for x in _clm(0)(2, 0))
    program = metaopt.export(module, example)
    assert module.m.config._experts_implementation == "eager"  # the user's module as it was
    for n, w in trained.items():  # now the routers route everywhere, in the module and the program
        gates[n].weight = w
        program.values[f"{n}.weight"] = w.detach()
    check = tuple(harness._double(x) for x in _clm(0)(3, 1))
    ours = harness.metaopt_grads(program, module, check)
    ref = harness.torch_grads(module, check, double=True)
    for name in (n for n in ref if "experts" in n):
        per_expert = ref[name].flatten(1).abs().amax(1)
        assert (per_expert > 0).all(), name  # the check batch reaches every expert
    # HF's router computes in float32 on purpose (`.float()`), in torch's float64 run too: the
    # zoo's float32-island bar, 1e-5 of each grad's largest entry
    assert harness.float64_worst(models.get("hf-mixtral"), ours, ref, "grads", island=True) < 1e-5


def test_routing_ops_have_their_own_grad_rules():
    module = _mixtral()
    program = metaopt.export(module, tuple(harness._double(x) for x in _clm(0)(2, 0)))
    types = [op.type for op in program.ops]
    assert types.count("GroupedMatMul") == 2 * 2  # two layers x (gate_up, down)
    experts = [n for n, v in program.vars.items() if v.kind == "param" and ".experts." in n]
    assert len(experts) == 4 and all(program.vars[n].shape[0] == 4 for n in experts)  # every expert
    q, _ = append_backward(program, loss=program.loss_name)
    assert [op.attrs["op"] for op in q.ops if op.type == "Vjp"] == []
    grad_types = {op.type for op in q.ops}
    assert {"GroupedMatMulGrad", "TopKGrad", "ReduceGrad", "GatherNDGrad"} <= grad_types
