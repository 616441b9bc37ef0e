"""HF mixture-of-experts models export with every expert, whatever the example input routes."""

from __future__ import annotations

import collections

import pytest
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


class _Counts(torch.nn.Module):
    """Each expert's weight times how many ids chose it: histc of int ids, as HF's experts count."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 3))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.w.sum(1) * torch.histc(ids.int(), bins=4, min=0, max=3).float()).sum()


def test_histc_of_int_ids_exports_on_meta_and_counts_as_torch_does():
    """torch's CPU histc takes floats only, so a module counting int ids exports on meta (as on a
    GPU) only: there the program counts each bin as torch.histc of the same ids as floats does,
    values outside [min, max] dropped, max in the last bin (exact: small integer counts)."""
    with torch.device("meta"):
        program = metaopt.export(_Counts(), (torch.zeros(6, dtype=torch.long, device="meta"),))
    w = torch.randn(4, 3)
    program.values[next(v.name for v in program.params())] = w
    ids = torch.tensor([0, 1, 1, 3, 3, 3, 2, 7, -1])
    exe = metaopt.Executor("cpu")
    (loss,) = exe.run(program, feed={program.inputs[0]: ids}, fetch_list=[program.loss_name])
    assert float(loss) == float((w.sum(1) * torch.histc(ids.float(), bins=4, min=0, max=3)).sum())


@pytest.mark.slow  # two exports of the Mixtral: 14 s
def test_a_mixtral_exported_on_meta_computes_what_its_export_with_values_does():
    """On the meta device (as on a GPU) HF's experts count each expert's tokens with histc of int
    ids (floats only on a CPU), which torch's ONNX translation refused: DeepSeek-V3 did not export
    on meta. Exported on meta and given the values of the same module built on the CPU, the
    program's loss is the program exported with values' (bit for bit: the counts are exact)."""
    import transformers

    cfg = transformers.MixtralConfig(**dict(MOEISH, attention_dropout=0.0), num_local_experts=4)
    torch.manual_seed(0)
    module = LMLoss(transformers.MixtralForCausalLM(cfg)).train()
    ids = _clm(0)(2, 0)
    valued = metaopt.export(module, ids)
    with torch.device("meta"):
        meta_module = LMLoss(transformers.MixtralForCausalLM(cfg)).train()
    meta = metaopt.export(meta_module, tuple(torch.zeros_like(x, device="meta") for x in ids))
    # the int route: the same ops but for casts of the ids around the count (4 grouped matmuls)
    types = [collections.Counter(op.type for op in p.ops) for p in (meta, valued)]
    extra = types[0] - types[1]
    assert set(extra) == {"Cast"} and sum(op.type == "GroupedMatMul" for op in meta.ops) == 4
    for v in meta.params():
        meta.values[v.name] = valued.values[v.name]
    losses = []
    for p in (valued, meta):
        exe = metaopt.Executor("cpu")
        (loss,) = exe.run(p, feed=dict(zip(p.inputs, ids, strict=True)), fetch_list=[p.loss_name])
        losses.append(float(loss))
    assert losses[0] == losses[1], losses
