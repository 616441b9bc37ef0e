"""A plan run by the interpreter behaves as the compiled plan does (runtime/plan.py).

Programs over COMPILE_AT_ONCE_OPS ops start interpreted (compiling 100k ops costs seconds)
and compile themselves after COMPILE_AFTER_RUNS runs. Here the thresholds are patched so
the same programs run both ways: fetched values, scope, memory counts and errors must agree.
No timed asserts: benchmarks/load_100k.py measures.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import exported
from test_executor import _sgd_program
from test_plan_errors import _TwoArgError, matmul_program

import metaopt
import programs
from metaopt import fleet
from metaopt.ir import Op, Program, Var
from metaopt.ir.printer import fmt_op
from metaopt.runtime import plan as plan_mod
from metaopt.runtime.plan import build_plan

CPU = torch.device("cpu")


@pytest.fixture
def interpreted(monkeypatch):
    """Every plan the executor builds is interpreted, and stays so."""
    monkeypatch.setattr(plan_mod, "COMPILE_AT_ONCE_OPS", -1)
    monkeypatch.setattr(plan_mod, "COMPILE_AFTER_RUNS", 10**9)


def _train(exe: metaopt.Executor, program: Program, steps: int = 3) -> list:
    mod = programs.get("bert")
    params = [v.name for v in program.params()][:2]
    out = []
    metaopt.seed(7)
    for s in range(steps):
        feed = dict(zip(mod.INPUT_NAMES, mod.example_inputs("tiny", 4, seed=s), strict=True))
        out.append(exe.run(program, feed=feed, fetch_list=[program.loss, *params], return_numpy=False))
    return out


def _bert_offload() -> Program:
    """Dropout (RNG), recompute, offload (host-memory copies), in-place Adam updates."""
    _, _, program = exported("bert", dropout=0.1)
    main = program.clone()
    fleet.init(is_collective=True)
    s = fleet.DistributedStrategy()
    s.recompute = True
    s.recompute_configs = {"checkpoints": ["bert.encoder.layer.*"], "enable_offload": True}
    fleet.distributed_optimizer(metaopt.optimizer.Adam(learning_rate=1e-3), s).minimize(main.loss)
    return main


def _run_both(program: Program, monkeypatch) -> tuple:
    compiled = metaopt.Executor("cpu")
    want = _train(compiled, program)
    monkeypatch.setattr(plan_mod, "COMPILE_AT_ONCE_OPS", -1)
    monkeypatch.setattr(plan_mod, "COMPILE_AFTER_RUNS", 10**9)
    interp = metaopt.Executor("cpu")
    got = _train(interp, program)
    assert all(p.fn is None for p in interp._plans.values())  # it really interpreted
    return (compiled, want), (interp, got)


def test_a_training_step_is_bit_identical_and_counts_the_same_bytes(monkeypatch):
    program = _bert_offload()
    (compiled, want), (interp, got) = _run_both(program, monkeypatch)
    for a, b in zip(want, got, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert compiled.scope.keys() == interp.scope.keys()
    assert all(torch.equal(compiled.scope[k], interp.scope[k]) for k in compiled.scope)
    stats = compiled.memory_stats(), interp.memory_stats()
    keys = ("peak_bytes", "host_peak_bytes", "persistable_bytes", "offloaded_bytes", "fetched_bytes")
    assert {k: stats[0][k] for k in keys} == {k: stats[1][k] for k in keys}
    assert stats[0]["host_peak_bytes"] > 0  # the offload copies were counted as host memory


def test_fetched_view_of_an_updated_param_is_snapshotted(interpreted):
    exe = metaopt.Executor()
    feed = {"x": np.ones((1, 2), np.float32), "g": np.full((2, 2), 2.0, np.float32)}
    wt, w = exe.run(_sgd_program(), feed=feed, fetch_list=["wt", "w"])
    assert wt.tolist() == [[1.0, 1.0], [1.0, 1.0]]  # the value the forward used
    assert w.tolist() == [[-1.0, -1.0], [-1.0, -1.0]]  # a persistable: its value after the step


def test_a_failing_kernel_names_its_op(interpreted):
    p = matmul_program()
    with pytest.raises(RuntimeError) as info:
        metaopt.Executor("cpu").run(p, feed={"x": np.ones((2, 5), np.float32)}, fetch_list=["loss"])
    first, _, rest = str(info.value).partition("\n")
    assert first == f"while running op 1: {fmt_op(p.ops[1])}"
    cause = info.value.__cause__
    assert type(cause) is RuntimeError and str(cause) in rest and "while running op" not in str(cause)


def _interpreted_plan_with_kernel(kernel):
    plan = build_plan(matmul_program(), ["loss"], CPU, track=False, compile_now=False)
    assert plan.fn is None
    plan.layout.kernels[1] = kernel  # op 1's bound kernel, swapped for one that raises
    return plan


def test_error_types_and_what_passes_through(interpreted):
    def two_args(*_):
        raise _TwoArgError("link down", 7)

    plan = _interpreted_plan_with_kernel(two_args)
    with pytest.raises(RuntimeError, match=r"^while running op 1: .*\n_TwoArgError: link down \(code 7\)$"):
        plan.run({"w": torch.ones(4, 3)}, {"x": torch.ones(2, 4)}, None)

    def interrupted(*_):
        raise KeyboardInterrupt

    plan = _interpreted_plan_with_kernel(interrupted)
    with pytest.raises(KeyboardInterrupt) as info:
        plan.run({"w": torch.ones(4, 3)}, {"x": torch.ones(2, 4)}, None)
    assert info.value.__cause__ is None

    # A missing scope entry fails before any op: untouched.
    plan = build_plan(matmul_program(), ["loss"], CPU, track=False, compile_now=False)
    with pytest.raises(KeyError) as info:
        plan.run({}, {"x": torch.ones(2, 4)}, None)
    assert info.value.args == ("w",) and info.value.__cause__ is None


def test_compiles_itself_after_enough_runs_with_the_same_source(monkeypatch):
    monkeypatch.setattr(plan_mod, "COMPILE_AFTER_RUNS", 2)
    p = matmul_program()
    plan = build_plan(p, ["loss"], CPU, track=True, compile_now=False)
    source = plan.source  # made without compiling
    assert plan.fn is None and source == build_plan(p, ["loss"], CPU, track=True).source
    tracker = metaopt.runtime.memory.MemoryTracker()
    outs = []
    for _ in range(3):
        tracker.start_run()
        outs.append(plan.run({"w": torch.ones(4, 3)}, {"x": torch.ones(2, 4)}, tracker))
        tracker.end_run()
        outs.append(plan.fn is not None)
    assert outs[1::2] == [False, False, True]  # runs 1 and 2 interpreted, run 3 compiled
    assert all(o == (torch.tensor(24.0),) for o in outs[::2])
    assert plan.source == source and plan.layout is None


def _neg_chain(n: int) -> Program:
    p = Program("chain")
    p.add_var(Var("x", "float32", (3,), kind="input"))
    prev = "x"
    for i in range(n):
        p.add_var(Var(f"h{i}", "float32", (3,)))
        p.ops.append(Op("Neg", [prev], [f"h{i}"]))
        prev = f"h{i}"
    p.inputs, p.outputs = ["x"], [prev]
    return p


def test_a_program_over_the_size_limit_starts_interpreted():
    n = plan_mod.COMPILE_AT_ONCE_OPS + 1
    p = _neg_chain(n)
    exe = metaopt.Executor("cpu")
    (y,) = exe.run(p, feed={"x": np.array([1.0, -2.0, 3.0], np.float32)}, fetch_list=[p.outputs[0]])
    assert y.tolist() == [-1.0, 2.0, -3.0]  # an odd number of negations
    (plan,) = exe._plans.values()
    assert plan.fn is None and plan.runs == 1
    assert exe.memory_stats()["peak_bytes"] == 2 * 12  # each value freed after its one reader
    assert build_plan(_neg_chain(3), ["h2"], CPU, track=True).fn is not None  # small: compiled
