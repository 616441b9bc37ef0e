"""A kernel failing inside a plan names its op; the generated source shows in tracebacks."""

from __future__ import annotations

import gc
import linecache
import re
import traceback

import numpy as np
import pytest
import torch

import metaopt
from metaopt.ir import Op, Program, Var
from metaopt.ir.printer import fmt_op
from metaopt.runtime.plan import Plan, build_plan


def matmul_program() -> Program:
    """x[batch,k] -> Relu -> MatMul(w[4,3]) -> ReduceSum: k is unknown, so a feed with k != 4
    passes the executor's feed checks and fails in the MatMul kernel (op 1)."""
    p = Program("mm")
    p.add_var(Var("x", "float32", ("batch", "k"), kind="input"))
    p.add_var(Var("w", "float32", (4, 3), kind="param", trainable=True), torch.ones(4, 3))
    p.add_var(Var("h", "float32", ("batch", "k")))
    p.add_var(Var("y", "float32", ("batch", 3)))
    p.add_var(Var("loss", "float32", ()))
    p.ops.append(Op("Relu", ["x"], ["h"]))
    p.ops.append(Op("MatMul", ["h", "w"], ["y"], scope="fc"))
    p.ops.append(Op("ReduceSum", ["y"], ["loss"], {"keepdims": 0}, role="loss"))
    p.inputs, p.outputs, p.loss_name = ["x"], ["loss"], "loss"
    metaopt.verify(p)
    return p


def run_failing(p: Program, **feed) -> BaseException:
    exe = metaopt.Executor("cpu")
    with pytest.raises(Exception) as info:
        exe.run(p, feed=feed, fetch_list=["loss"])
    return info.value


def test_failing_kernel_names_its_op_with_the_original_as_cause():
    p = matmul_program()
    err = run_failing(p, x=np.ones((2, 5), np.float32))
    line = fmt_op(p.ops[1])
    assert "MatMul(h, w)" in line and "scope=fc" in line
    first, _, rest = str(err).partition("\n")
    assert first == f"while running op 1: {line}"
    cause = err.__cause__
    assert isinstance(cause, RuntimeError) and "while running op" not in str(cause)
    assert str(cause) in rest  # torch's own message follows the op line
    assert re.search(r"cannot be multiplied|shapes|size", str(cause))
    # torch raised a RuntimeError, whose constructor takes the message: the type is kept.
    assert type(err) is type(cause)


def test_traceback_shows_the_generated_source_line():
    p = matmul_program()
    err = run_failing(p, x=np.ones((2, 5), np.float32))
    text = "".join(traceback.format_exception(err))
    # The cause's frames run through the generated plan, whose failing line is shown.
    m = re.search(r'File "(<metaopt plan mm #\d+>)", line (\d+), in run\n +(.*)\n', text)
    assert m, text
    filename, lineno, shown = m.group(1), int(m.group(2)), m.group(3)
    assert shown.startswith("v") and "= k1(" in shown and shown.endswith("# MatMul"), shown
    assert linecache.getline(filename, lineno).strip() == shown
    assert "The above exception was the direct cause" in text
    assert "while running op 1: " in text.rsplit("The above exception", 1)[1]


def test_reshape_to_an_impossible_shape_names_the_reshape():
    p = Program("rs")
    p.add_var(Var("x", "float32", ("batch", 6), kind="input"))
    p.add_var(Var("s", "int64", (2,), kind="constant"), torch.tensor([5, -1]))
    p.add_var(Var("y", "float32", (5, "n")))
    p.add_var(Var("loss", "float32", ()))
    p.ops.append(Op("Reshape", ["x", "s"], ["y"]))
    p.ops.append(Op("ReduceSum", ["y"], ["loss"], {"keepdims": 0}, role="loss"))
    p.inputs, p.outputs, p.loss_name = ["x"], ["loss"], "loss"
    metaopt.verify(p)
    err = run_failing(p, x=np.ones((2, 6), np.float32))  # 12 elements do not fill [5, -1]
    assert str(err).startswith(f"while running op 0: {fmt_op(p.ops[0])}\n")
    assert "Reshape(x, s)" in str(err)
    assert err.__cause__ is not None and str(err.__cause__) in str(err)


class _TwoArgError(Exception):
    def __init__(self, what: str, code: int) -> None:
        super().__init__(f"{what} (code {code})")
        self.code = code


class _TaggedError(ValueError):
    pass


def _plan_with_kernel(kernel) -> tuple[Program, Plan]:
    p = matmul_program()
    plan = build_plan(p, ["loss"], torch.device("cpu"), track=False)
    plan.fn.__globals__["k1"] = kernel  # op 1's bound kernel, swapped for one that raises
    return p, plan


def _call(plan: Plan, x: torch.Tensor):
    return plan.run({"w": torch.ones(4, 3)}, {"x": x}, None)


def test_error_types_kept_when_exact_else_runtime_error():
    def tagged(*_):
        e = _TaggedError("bad value for 'h'")
        e.var = "h"
        raise e

    p, plan = _plan_with_kernel(tagged)
    want = r"(?s)^while running op 1: .*MatMul.*\nbad value for 'h'$"
    with pytest.raises(_TaggedError, match=want) as info:
        _call(plan, torch.ones(2, 4))
    assert info.value.var == "h" and type(info.value.__cause__) is _TaggedError  # attributes copied

    def two_args(*_):
        raise _TwoArgError("link down", 7)

    p, plan = _plan_with_kernel(two_args)
    with pytest.raises(RuntimeError) as info:
        _call(plan, torch.ones(2, 4))
    assert str(info.value) == f"while running op 1: {fmt_op(p.ops[1])}\n_TwoArgError: link down (code 7)"
    assert isinstance(info.value.__cause__, _TwoArgError) and info.value.__cause__.code == 7

    def key_error(*_):
        raise KeyError("h")

    p, plan = _plan_with_kernel(key_error)
    with pytest.raises(RuntimeError, match=r"\nKeyError: 'h'$") as info:  # KeyError's str quotes
        _call(plan, torch.ones(2, 4))
    assert type(info.value) is RuntimeError and type(info.value.__cause__) is KeyError


def test_keyboard_interrupt_and_errors_outside_ops_pass_through():
    def interrupted(*_):
        raise KeyboardInterrupt

    _, plan = _plan_with_kernel(interrupted)
    with pytest.raises(KeyboardInterrupt) as info:
        _call(plan, torch.ones(2, 4))
    assert info.value.__cause__ is None and info.value.args == ()

    # A missing scope entry fails in the plan's prologue, before any op: untouched.
    plan = build_plan(matmul_program(), ["loss"], torch.device("cpu"), track=False)
    with pytest.raises(KeyError) as info:
        plan.run({}, {"x": torch.ones(2, 4)}, None)
    assert info.value.args == ("w",) and info.value.__cause__ is None


def test_normal_path_unchanged_and_every_op_line_mapped():
    p = matmul_program()
    exe = metaopt.Executor("cpu")
    (loss,) = exe.run(p, feed={"x": np.ones((2, 4), np.float32)}, fetch_list=["loss"])
    assert float(loss) == 24.0  # relu(1)=1, [2,4]@ones[4,3] = 4 each, 6 of them
    plan = build_plan(p, ["loss"], torch.device("cpu"), track=True)
    src = plan.source.splitlines()
    for i in range(len(p.ops)):
        mapped = [src[n - 1] for n, j in plan.op_of_line.items() if j == i]
        assert sum(f"= k{i}(" in s for s in mapped) == 1, mapped  # its call, and only its own
    prologue = [n + 1 for n, s in enumerate(src) if "S[" in s or "F[" in s]  # scope and feed reads
    assert prologue and not any(n in plan.op_of_line for n in prologue)
    assert linecache.getlines(plan.filename) == plan.source.splitlines(True)


def test_source_registration_is_unique_and_dropped_with_the_plan():
    p = matmul_program()
    a = build_plan(p, ["loss"], torch.device("cpu"), track=False)
    b = build_plan(p, ["loss"], torch.device("cpu"), track=False)
    assert a.filename != b.filename and a.filename.startswith("<metaopt plan mm #")
    name = b.filename
    assert name in linecache.cache
    del b
    gc.collect()
    assert name not in linecache.cache
    assert a.filename in linecache.cache
