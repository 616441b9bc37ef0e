"""verify(program): each invariant, its error naming the var and the printed op line."""

from __future__ import annotations

import re

import pytest
import torch

from metaopt.ir import Op, Program, Var, VerifyError, parse_program, print_program, verify
from metaopt.ir.printer import fmt_op


def _train() -> Program:
    """A valid training step: forward, loss, offload + prefetch, recompute, backward, lr-sched, Adam."""
    p = Program("train")
    p.add_var(Var("x", "float32", ("batch", 4), "input"))
    p.add_var(Var("y", "float32", ("batch", 3), "input"))
    p.add_var(Var("w", "float32", (4, 3), "param", trainable=True), torch.zeros(4, 3))
    p.add_var(Var("m", "float32", (4, 3), "opt_state"), torch.zeros(4, 3))
    p.add_var(Var("step", "int64", (), "buffer"), torch.tensor(0))
    p.add_var(Var("base_lr", "float32", (), "constant"), torch.tensor(0.01))
    for name, shape in [
        ("h", ("batch", 3)),
        ("a", ("batch", 3)),
        ("a@PINNED", ("batch", 3)),
        ("a@FETCH", ("batch", 3)),
        ("h@RECOMPUTE", ("batch", 3)),
        ("loss", ()),
        ("loss@GRAD", ()),
        ("a@GRAD", ("batch", 3)),
        ("lr", ()),
        ("step@NEW", ()),
    ]:
        p.add_var(Var(name, "int64" if name == "step@NEW" else "float32", shape))
    p.add_var(Var("w@GRAD", "float32", (4, 3), "grad"))
    p.add_var(Var("w@NEW", "float32", (4, 3)))
    p.add_var(Var("m@NEW", "float32", (4, 3)))
    p.inputs = ["x", "y"]
    p.outputs = ["loss"]
    p.loss_name = "loss"
    p.ops = [
        Op("MatMul", ["x", "w"], ["h"], scope="fc1"),  # 0
        Op("Relu", ["h"], ["a"], scope="act"),  # 1
        Op("Memcpy", ["a"], ["a@PINNED"], {"dst": "pinned"}, role="offload", origin="a"),  # 2
        Op("MseLoss", ["a", "y"], ["loss"], role="loss"),  # 3
        Op("OnesLike", ["loss"], ["loss@GRAD"], role="backward", origin="loss"),  # 4
        Op("Memcpy", ["a@PINNED"], ["a@FETCH"], {"dst": "device"}, role="prefetch", origin="a"),  # 5
        Op("MatMul", ["x", "w"], ["h@RECOMPUTE"], role="recompute", origin="h"),  # 6
        Op("MseLossGrad", ["a@FETCH", "y", "loss@GRAD"], ["a@GRAD"], role="backward", origin="a"),  # 7
        Op("MatMulGrad", ["x", "h@RECOMPUTE", "a@GRAD"], ["w@GRAD"], role="backward", origin="w"),  # 8
        Op("LrSched", ["base_lr", "step"], ["lr", "step@NEW"], role="lr-sched"),  # 9
        Op("Adam", ["w", "w@GRAD", "m", "lr", ""], ["w@NEW", "m@NEW"], role="optimize"),  # 10
    ]
    p.modules = {"fc1": ["h"], "act": ["a"]}
    p.updates = {"w": "w@NEW", "m": "m@NEW", "step": "step@NEW"}
    return p


def _pipeline() -> Program:
    """Two stages; h crosses from stage 0 to stage 1 through Send/Recv."""
    p = Program("pipe")
    p.add_var(Var("x", "float32", ("batch", 4), "input"))
    for n in ("h", "h@RECV", "out"):
        p.add_var(Var(n, "float32", ("batch", 4)))
    p.inputs = ["x"]
    p.outputs = ["out"]
    p.ops = [
        Op("Relu", ["x"], ["h"], stage=0),  # 0
        Op("Send", ["h"], [], {"peer": 1}, role="comm", stage=0),  # 1
        Op("Recv", [], ["h@RECV"], {"peer": 0}, role="comm", stage=1),  # 2
        Op("Neg", ["h@RECV"], ["out"], stage=1),  # 3
    ]
    return p


def _fails(p: Program, *fragments: str, op: int | None = None) -> str:
    """verify(p) must fail; the message holds every fragment and, for op errors, the op's
    printed line and the right line number of print_program(p)."""
    with pytest.raises(VerifyError) as e:
        verify(p)
    msg = str(e.value)
    for f in fragments:
        assert f in msg, (f, msg)
    assert msg.startswith(f"{p.name}: "), msg
    if op is not None:
        line = fmt_op(p.ops[op])
        assert line in msg, msg
        assert f"(op {op})" in msg, msg
        m = re.search(r"line (\d+) ", msg)
        assert m, msg
        printed = print_program(p).splitlines()
        assert printed[int(m.group(1)) - 1] == "  " + line, (m.group(1), msg)
    return msg


# --- positive cases --------------------------------------------------------------------


def test_valid_training_program_passes():
    verify(_train())


def test_valid_pipeline_with_send_recv_passes():
    verify(_pipeline())


def test_valid_program_survives_print_parse():
    p = _train()
    q = parse_program(print_program(p))
    for name, t in p.values.items():  # weights are not part of the text
        q.values.setdefault(name, t)
    verify(q)


def test_empty_program_passes():
    verify(Program("empty"))


def test_loss_with_unknown_shape_passes():
    p = _train()
    p.vars["loss"].shape = None
    verify(p)


def test_any_phase_roles_may_follow_optimize():
    p = _train()
    p.add_var(Var("lr2", "float32", ()))
    p.add_var(Var("w@PINNED", "float32", (4, 3)))
    p.add_var(Var("w@FETCH", "float32", (4, 3)))
    p.ops += [
        Op("LrSched", ["base_lr"], ["lr2"], role="lr-sched"),
        Op("AllReduce", ["w@NEW"], [], role="comm"),
        Op("Memcpy", ["w@NEW"], ["w@PINNED"], role="offload"),
        Op("Memcpy", ["w@PINNED"], ["w@FETCH"], role="prefetch"),  # prefetch is backward-phase...
    ]
    # ...so the trailing prefetch is out of order, but lr-sched / comm / offload are not.
    _fails(p, "role prefetch", "roles out of order", op=len(p.ops) - 1)
    p.ops.pop()
    p.ops.pop()
    verify(p)


def test_loss_role_may_interleave_with_forward():
    p = _train()
    p.add_var(Var("extra", "float32", ("batch", 3)))
    p.ops.insert(4, Op("Relu", ["a"], ["extra"], role="forward"))  # after the loss op
    verify(p)


def test_unstaged_ops_may_read_any_stage():
    p = _pipeline()
    p.add_var(Var("dbg", "float32", ("batch", 4)))
    p.ops.append(Op("Identity", ["h"], ["dbg"]))  # stage None
    verify(p)


def test_same_stage_reads_pass():
    p = _pipeline()
    p.add_var(Var("h2", "float32", ("batch", 4)))
    p.ops.insert(1, Op("Neg", ["h"], ["h2"], stage=0))
    verify(p)


# --- defined before use / declared ------------------------------------------------------


def test_use_before_define():
    p = _train()
    p.ops[0], p.ops[1] = p.ops[1], p.ops[0]  # Relu(h) now precedes h = MatMul(...)
    msg = _fails(p, "'h'", "used before it is defined", op=0)
    assert "Relu" in msg


def test_use_of_never_produced_activation():
    p = _train()
    p.add_var(Var("orphan", "float32", ("batch", 3)))
    p.ops[7].inputs.append("orphan")
    _fails(p, "'orphan'", "used before it is defined", op=7)


def test_undeclared_input_var():
    p = _train()
    p.ops[1].inputs = ["hh"]
    _fails(p, "'hh'", "not a declared var", op=1)


def test_undeclared_output_var():
    p = _train()
    p.ops[1].outputs = ["ghost"]
    _fails(p, "'ghost'", "not a declared var", op=1)


def test_omitted_optional_io_is_not_checked():
    p = _train()
    p.ops[1].inputs.append("")
    p.ops[1].outputs.append("")
    verify(p)


def test_program_input_not_declared():
    p = _train()
    p.inputs.append("z")
    _fails(p, "'z'", "not a declared var")


def test_program_output_not_declared():
    p = _train()
    p.outputs.append("nope")
    _fails(p, "'nope'", "not a declared var")


def test_program_input_with_wrong_kind():
    p = _train()
    p.inputs.append("h")
    _fails(p, "'h'", "'activation'", "not 'input'")


def test_program_output_never_produced():
    p = _train()
    p.add_var(Var("unused", "float32", ("batch", 3)))
    p.outputs.append("unused")
    _fails(p, "'unused'", "never produced")


# --- SSA and writes -------------------------------------------------------------------


def test_two_producers():
    p = _train()
    p.ops.insert(2, Op("Identity", ["a"], ["h"]))
    _fails(p, "'h'", "already produced by op 0", "one producer", op=2)


def test_two_outputs_of_one_op_with_same_name():
    p = _train()
    p.ops[9].outputs = ["lr", "lr"]
    _fails(p, "'lr'", "already produced by op 9", op=9)


@pytest.mark.parametrize("target", ["w", "m", "step", "base_lr"])
def test_persistable_written_by_an_op(target):
    p = _train()
    kind = p.vars[target].kind
    p.ops[1].outputs = ["a", target]
    _fails(p, f"'{target}'", f"persistable ({kind})", "program.updates", op=1)


def test_program_input_written():
    p = _train()
    p.ops[1].outputs = ["a", "y"]
    _fails(p, "'y'", "is a program input", op=1)


# --- role order -------------------------------------------------------------------------


def test_forward_after_backward():
    p = _train()
    p.add_var(Var("late", "float32", ("batch", 3)))
    p.ops.insert(8, Op("Relu", ["a"], ["late"], role="forward", scope="late_act"))
    _fails(p, "role forward", "roles out of order", "late", op=8)


def test_loss_after_backward():
    p = _train()
    p.add_var(Var("loss2", "float32", ()))
    p.ops.insert(5, Op("ReduceSum", ["a"], ["loss2"], role="loss"))
    _fails(p, "role loss", "roles out of order", "loss2", op=5)


def test_backward_after_optimize():
    p = _train()
    p.add_var(Var("late@GRAD", "float32", (4, 3), "grad"))
    p.ops.append(Op("Neg", ["w@GRAD"], ["late@GRAD"], role="backward"))
    _fails(p, "role backward", "roles out of order", "late@GRAD", op=11)


def test_recompute_after_optimize():
    p = _train()
    p.add_var(Var("r", "float32", ("batch", 3)))
    p.ops.append(Op("MatMul", ["x", "w"], ["r"], role="recompute", origin="h"))
    _fails(p, "role recompute", "roles out of order", op=11)


def test_forward_after_optimize():
    p = _train()
    p.add_var(Var("f", "float32", ("batch", 3)))
    p.ops.append(Op("Relu", ["h"], ["f"]))
    _fails(p, "role forward", op=11)


# --- offload / prefetch -------------------------------------------------------------------


def test_offload_never_fetched_back():
    p = _train()
    p.add_var(Var("h@PINNED", "float32", ("batch", 3)))
    p.ops.insert(2, Op("Memcpy", ["h"], ["h@PINNED"], {"dst": "pinned"}, role="offload", origin="h"))
    _fails(p, "'h@PINNED'", "never fetched back", op=2)


def test_offload_read_only_by_a_non_prefetch_op():
    p = _train()
    p.ops[5].role = "backward"  # the only reader of a@PINNED is no longer a prefetch
    _fails(p, "'a@PINNED'", "never fetched back", op=2)


def test_offload_fetched_by_one_of_several_readers_passes():
    p = _train()
    p.add_var(Var("peek", "float32", ("batch", 3)))
    p.ops.insert(5, Op("Identity", ["a@PINNED"], ["peek"], role="backward"))
    verify(p)


# --- stages -------------------------------------------------------------------------------


def test_cross_stage_read_without_send_recv():
    p = _pipeline()
    p.ops[3].inputs = ["h"]  # stage 1 reads stage 0's h directly
    _fails(p, "'h'", "stage 0", "Send/Recv", op=3)


def test_cross_stage_read_backwards_in_stage_numbers():
    p = _pipeline()
    p.add_var(Var("back", "float32", ("batch", 4)))
    p.ops.append(Op("Neg", ["out"], ["back"], stage=0))
    _fails(p, "'out'", "stage 1", "Send/Recv", op=4)


# --- constants, loss ------------------------------------------------------------------------


def test_constant_without_value():
    p = _train()
    del p.values["base_lr"]
    _fails(p, "'base_lr'", "has no value")


def test_loss_not_scalar():
    p = _train()
    p.vars["loss"].shape = ("batch",)
    _fails(p, "'loss'", "scalar", "['batch']")


def test_loss_shape_one_is_not_scalar():
    p = _train()
    p.vars["loss"].shape = (1,)
    _fails(p, "'loss'", "scalar", "[1]")


def test_loss_never_produced():
    p = _train()
    p.add_var(Var("other_loss", "float32", ()))
    p.loss_name = "other_loss"
    _fails(p, "'other_loss'", "not produced")


def test_loss_not_declared():
    p = _train()
    p.loss_name = "nope"
    _fails(p, "'nope'", "not produced")


# --- updates ----------------------------------------------------------------------------------


def test_update_target_not_persistable():
    p = _train()
    p.updates["a"] = "a@GRAD"
    _fails(p, "'a'", "update target", "not a persistable var")


def test_update_target_not_declared():
    p = _train()
    p.updates["ghost"] = "w@NEW"
    _fails(p, "'ghost'", "update target", "not a persistable var")


def test_update_source_not_produced():
    p = _train()
    p.add_var(Var("w@NEW2", "float32", (4, 3)))
    p.updates["w"] = "w@NEW2"
    _fails(p, "'w'", "'w@NEW2'", "not produced by an op")


def test_update_source_persistable():
    p = _train()
    p.updates["w"] = "m"  # declared, defined (persistable) but no op produces it
    _fails(p, "'w'", "'m'", "not produced by an op")


def test_update_source_not_declared():
    p = _train()
    p.updates["w"] = "w@NOPE"
    _fails(p, "'w@NOPE'", "not produced by an op")


def test_update_shape_mismatch():
    p = _train()
    p.updates["w"] = "a@GRAD"
    _fails(p, "'w'", "'a@GRAD'", "float32[4, 3]", "float32['batch', 3]")


def test_update_dtype_mismatch():
    p = _train()
    p.vars["w@NEW"].dtype = "bfloat16"
    _fails(p, "'w'", "'w@NEW'", "float32[4, 3]", "bfloat16[4, 3]")


# --- the reported line number -----------------------------------------------------------------


@pytest.mark.parametrize("with_loss", [True, False])
@pytest.mark.parametrize("with_modules", [True, False])
@pytest.mark.parametrize("with_updates", [True, False])
def test_line_number_matches_printed_program(with_loss, with_modules, with_updates):
    p = _train()
    if not with_loss:
        p.loss_name = None
    if not with_modules:
        p.modules = {}
    if not with_updates:
        p.updates = {}
    p.ops[6].inputs = ["x", "nothing"]
    _fails(p, "'nothing'", op=6)  # _fails checks the line number against print_program
