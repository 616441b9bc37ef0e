"""Evaluation (issue 49; metaopt/passes/for_test.py): ``Program.clone(for_test=True)``, Paddle's
``main.clone(for_test=True)``, before and after minimize.

One process here: the eval program is the forward `metaopt.export(model.eval())` gives (golden),
its loss after 3 Adam steps equals torch's ``model.eval()`` loss with the trained weights (rtol
1e-6: float32 torch and our kernels on the same values; no float64 oracle is needed, both sides
run the same forward), it changes no state (two runs: the same bits, every running stat bitwise
as it was), any forward var can be fetched, and its memory is as predicted. The layouts evaluate
in their own launches, against one process: ZeRO 1-3 on 2 and 4 workers and a 1F1B pipeline of 2
stages beside ZeRO (test_sharding_workers.py), tensor parallel 2 and dp 2 x mp 2
(test_fleet_tensor_parallel.py), every pipeline schedule (test_pipeline.py, the logits too),
sequence and segment parallel (test_sequence_parallel.py, test_segment_parallel.py) and expert
parallel (test_expert_parallel.py, against torch's model.eval()); the zoo holds every model's
eval program against torch's (zoo/harness.py check_eval).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import export_cache
import pytest
import torch

import metaopt
import programs
from metaopt import fleet
from metaopt.ir import verify
from metaopt.passes.for_test import plan_for_test
from metaopt.passes.memory_estimate import estimate_memory

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from zoo import harness, models  # noqa: E402

STEPS = 3
BATCH = 4
HF_DROPOUT = 0.1


def _model(name: str, *, train: bool = True) -> tuple[torch.nn.Module, metaopt.Program, object]:
    """(module in train mode, its exported program, batch(seed) -> forward args)."""
    if name.startswith("hf-"):
        entry = models.get(name)
        module = entry.build(HF_DROPOUT)
        if not train:
            module.eval()
        program = export_cache.export(
            module, entry.inputs(harness.EXPORT_BATCH, 0), name=entry.name, **entry.export_kwargs
        )
        return module, program, lambda seed: entry.inputs(BATCH, seed)
    mod = programs.get(name)
    module = mod.build("tiny", seed=0, **({"dropout": 0.1} if name == "mlp" else {}))
    if not train:
        module.eval()
    inputs = mod.example_inputs("tiny", BATCH, seed=1)
    program = export_cache.export(module, inputs, name=name)
    return module, program, lambda seed: programs.channels_last(mod.example_inputs("tiny", BATCH, seed=seed))


def _feed(module: torch.nn.Module, inputs: tuple) -> dict:
    return dict(zip(harness.feed_names(module, len(inputs)), inputs, strict=True))


# --- the program -----------------------------------------------------------------------------------


def test_before_minimize_it_is_the_export_of_the_module_in_eval_mode(golden):
    """Dropout becomes Identity, torch's training batch norm ONNX's inference form, the running-stat
    updates go: op for op the program `metaopt.export(model.eval())` gives (the constants compared by
    value: the train-mode export numbered two more before them)."""
    for name in ("mlp", "resnet"):
        module, program, _ = _model(name)
        test = program.clone(for_test=True)
        verify(test)
        assert not test.updates and program.updates if name == "resnet" else not test.updates
        _, evaluated, _ = _model(name, train=False)
        _assert_same_program(test, evaluated)
        if name == "mlp":  # both: the clone, and the eval-mode export it equals
            golden("for_test/mlp.plan", str(plan_for_test(program)) + "\n")
            golden("for_test/mlp", str(test))
            golden("for_test/mlp_eval_export", str(evaluated))


def _assert_same_program(a: metaopt.Program, b: metaopt.Program) -> None:
    assert len(a.ops) == len(b.ops)
    for x, y in zip(a.ops, b.ops, strict=True):
        assert (x.type, x.attrs, x.outputs, x.role, x.scope) == (
            y.type,
            y.attrs,
            y.outputs,
            y.role,
            y.scope,
        ), x
        for i, j in zip(x.inputs, y.inputs, strict=True):
            if a.vars[i].kind == "constant":
                assert b.vars[j].kind == "constant" and torch.equal(a.values[i], b.values[j]), (x, i, j)
            else:
                assert i == j, x
    shown = {n: (v.dtype, v.shape, v.kind) for n, v in a.vars.items() if v.kind != "constant"}
    assert shown == {n: (v.dtype, v.shape, v.kind) for n, v in b.vars.items() if v.kind != "constant"}


def test_after_minimize_it_is_the_forward_of_the_rewritten_program(golden):
    """Recompute, offload and AMP's loss scaling go with the backward, AMP's casts stay (the golden
    shows the program; the plan says why each op went); the original program is untouched."""
    _, program, _ = _model("mlp")
    main = program.clone()
    strategy = fleet.DistributedStrategy()
    strategy.recompute = True
    strategy.recompute_configs = {"checkpoints": ["relu1", "relu2"], "enable_offload": True}
    strategy.amp = True
    strategy.amp_configs = {"dtype": "bfloat16"}
    fleet.init(is_collective=True)
    fleet.distributed_optimizer(metaopt.optimizer.Adam(learning_rate=1e-3), strategy).minimize(main.loss)
    before = str(main)
    test = main.clone(for_test=True)
    assert str(main) == before
    verify(test)
    roles = {op.role for op in test.ops}
    assert roles == {"forward", "loss"}, roles
    types = {op.type for op in test.ops}
    assert "Cast" in types and not types & {"Dropout", "RngState", "Memcpy", "AdamUpdate"}, types
    assert not any(v.kind in ("grad", "opt_state") for v in test.vars.values())
    golden("for_test/mlp_amp_recompute_offload.plan", str(plan_for_test(main)) + "\n")
    golden("for_test/mlp_amp_recompute_offload", str(test))


# --- against torch's model.eval() ------------------------------------------------------------------


def _trained(name: str) -> tuple[torch.nn.Module, metaopt.Program, metaopt.Program, metaopt.Executor, object]:
    """3 Adam steps of `name`; its eval programs cloned before and after minimize."""
    module, program, batch = _model(name)
    main = program.clone()
    before = main.clone(for_test=True)
    metaopt.optimizer.Adam(learning_rate=1e-3).minimize(main.loss)
    after = main.clone(for_test=True)
    exe = metaopt.Executor("cpu")
    torch.manual_seed(0)
    for step in range(STEPS):
        exe.run(main, feed=_feed(module, batch(10 + step)), fetch_list=[main.loss])
    return module, before, after, exe, batch


def _torch_eval(module: torch.nn.Module, exe: metaopt.Executor, program: metaopt.Program) -> torch.nn.Module:
    """`module` with the executor's trained params and buffers, in eval mode."""
    ref = copy.deepcopy(module)
    state = ref.state_dict()
    trained = {n: exe.scope[n] if n in exe.scope else program.values.get(n, t) for n, t in state.items()}
    ref.load_state_dict(trained)
    return ref.eval()


@pytest.mark.parametrize("name", ["mlp", "resnet", "hf-bert", "hf-gpt2"])
def test_the_eval_loss_after_training_equals_torch_in_eval_mode_and_changes_nothing(name):
    module, before, after, exe, batch = _trained(name)
    held = batch(99)
    feed = _feed(module, held)
    state = {n: t.clone() for n, t in exe.scope.items()}
    runs = [
        exe.run(p, feed=feed, fetch_list=[p.loss], return_numpy=False)[0] for p in (before, after, before)
    ]
    # before and after minimize: the same forward, the same bits, run after run
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])
    changed = [n for n, t in state.items() if not torch.equal(exe.scope[n], t)]
    assert not changed, changed  # running stats included (resnet)
    ref = _torch_eval(module, exe, before)
    with torch.no_grad():
        want = ref(*held)
    torch.testing.assert_close(runs[0].reshape(()), want, rtol=1e-6, atol=0)


def test_any_forward_var_is_fetched_by_name():
    """HF GPT-2's logits (its LM head's output, by module path) after training: torch's in eval
    mode (rtol 1e-5, atol 1e-6: a [b, s, vocab] float32 matmul against torch's)."""
    module, before, _, exe, batch = _trained("hf-gpt2")
    held = batch(99)
    (logits_name,) = before.modules["m.lm_head"]
    (logits,) = exe.run(before, feed=_feed(module, held), fetch_list=[logits_name], return_numpy=False)
    ref = _torch_eval(module, exe, before)
    seen = []
    ref.m.lm_head.register_forward_hook(lambda _m, _i, out: seen.append(out))
    with torch.no_grad():
        ref(*held)
    torch.testing.assert_close(logits, seen[0], rtol=1e-5, atol=1e-6)


# --- memory ----------------------------------------------------------------------------------------


def test_the_eval_program_holds_nothing_for_a_backward_measured_as_predicted():
    """HF GPT-2: a fresh executor's measured peak of the eval program equals `estimate_memory`'s,
    and its activation peak is at most half the training step's (measured = predicted too)."""
    module, program, batch = _model("hf-gpt2")
    main = program.clone()
    metaopt.optimizer.Adam(learning_rate=1e-3).minimize(main.loss)
    test = main.clone(for_test=True)
    feed = _feed(module, batch(99))
    n = next(iter(feed.values())).shape[0]
    peaks = {}
    for what, p in (("train", main), ("eval", test)):
        exe = metaopt.Executor("cpu")
        exe.run(p, feed=feed, fetch_list=[p.loss])
        stats = exe.memory_stats()
        predicted = estimate_memory(p, dims={"batch": n}, fetches=(p.loss_name,))
        assert stats["peak_bytes"] == predicted.peak_bytes, what
        assert stats["persistable_bytes"] == predicted.persistable_bytes, what
        peaks[what] = predicted.activation_peak_bytes
    assert 0 < peaks["eval"] <= peaks["train"] / 2, peaks


def test_an_eval_program_cloned_before_a_layout_change_is_refused_naming_the_param():
    """A clone taken before a minimize that splits params (ZeRO-3 holds 1/N of each) reads the
    whole param; the scope holds the slice: the first run says which param and what to do."""
    module, program, batch = _model("mlp")
    test = program.clone(for_test=True)
    exe = metaopt.Executor("cpu")
    exe.scope["fc1.weight"] = program.values["fc1.weight"].flatten()[:256].clone()  # a ZeRO-3 slice
    with pytest.raises(ValueError, match=r"'fc1.weight'.*after minimize"):
        exe.run(test, feed=_feed(module, batch(99)), fetch_list=[test.loss])
