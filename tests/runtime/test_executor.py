"""Executor: places, feeds and fetches, scope, liveness and the memory accounting."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import metaopt
from metaopt.ir import Op, Program, Var


def chain(n_ops: int = 4, width: int = 256) -> Program:
    """x -> Relu -> Relu ... -> ReduceSum: each intermediate is width*width float32."""
    p = Program("chain")
    p.add_var(Var("x", "float32", ("batch", width), kind="input"))
    p.add_var(Var("w", "float32", (width, width), kind="param", trainable=True), torch.eye(width))
    prev = "x"
    for i in range(n_ops):
        out = f"h{i}"
        p.add_var(Var(out, "float32", ("batch", width)))
        if i == 0:
            p.ops.append(Op("MatMul", [prev, "w"], [out]))
        else:
            p.ops.append(Op("Relu", [prev], [out]))
        prev = out
    p.add_var(Var("loss", "float32", ()))
    p.ops.append(Op("ReduceSum", [prev], ["loss"], {"keepdims": 0}, role="loss"))
    p.inputs, p.outputs, p.loss_name = ["x"], ["loss"], "loss"
    metaopt.verify(p)
    return p


def test_places():
    assert metaopt.Executor("cpu").device == torch.device("cpu")
    assert metaopt.Executor(metaopt.CPUPlace()).device == torch.device("cpu")
    if not torch.cuda.is_available():
        for place in ("cuda", "cuda:1", metaopt.CUDAPlace(0)):
            with pytest.raises(RuntimeError, match="CUDA is not available"):
                metaopt.Executor(place)
    with pytest.raises(ValueError, match="unknown place 'gpu0'"):
        metaopt.Executor("gpu0")


def test_fetch_by_name_or_var_and_numpy_or_tensor():
    p = chain()
    exe = metaopt.Executor()
    x = np.ones((2, 256), np.float32)
    (a,) = exe.run(p, feed={"x": x}, fetch_list=["loss"])
    b, h = exe.run(p, feed={"x": x}, fetch_list=[p.loss, "h1"], return_numpy=False)
    assert isinstance(a, np.ndarray) and isinstance(b, torch.Tensor)
    assert float(a) == float(b) == 512.0
    assert h.shape == (2, 256)


def test_scope_persists_and_is_the_live_tensor():
    p = chain()
    exe = metaopt.Executor()
    exe.run(p, feed={"x": np.ones((2, 256), np.float32)}, fetch_list=["loss"])
    exe.scope["w"].mul_(2.0)  # a user (or an optimizer) changing the scope changes the next run
    (loss,) = exe.run(p, feed={"x": np.ones((2, 256), np.float32)}, fetch_list=["loss"])
    assert float(loss) == 1024.0


def test_intermediates_are_freed_after_last_use():
    p = chain(n_ops=6)
    exe = metaopt.Executor()
    batch = 64
    exe.run(p, feed={"x": np.ones((batch, 256), np.float32)}, fetch_list=["loss"])
    stats = exe.memory_stats()
    act = batch * 256 * 4
    assert stats["persistable_bytes"] == 256 * 256 * 4
    # With free-after-last-use only one op's input and output are alive at once
    # (the feed dies after the MatMul); without it all seven values would be.
    assert stats["peak_bytes"] - stats["persistable_bytes"] == 2 * act


def test_views_share_their_storage_in_the_accounting():
    p = Program("views")
    p.add_var(Var("x", "float32", ("batch", 1024), kind="input"))
    p.add_var(Var("shape", "int64", (2,), kind="constant"), torch.tensor([-1, 32]))
    for name in ("a", "b", "c"):
        p.add_var(Var(name, "float32", ("batch", 1024) if name != "b" else ("32*batch", 32)))
    p.add_var(Var("loss", "float32", ()))
    p.ops = [
        Op("Relu", ["x"], ["a"]),
        Op("Reshape", ["a", "shape"], ["b"]),  # a view of a
        Op("Add", ["a", "a"], ["c"]),
        Op("ReduceSum", ["b"], ["loss"], {"keepdims": 0}, role="loss"),
    ]
    p.ops[3].inputs = ["b"]
    p.inputs, p.outputs, p.loss_name = ["x"], ["loss"], "loss"
    exe = metaopt.Executor()
    exe.run(p, feed={"x": np.ones((8, 1024), np.float32)}, fetch_list=["loss", "c"])
    nbytes = 8 * 1024 * 4
    # x dies after the Relu; then a (= b's storage), c and the 4-byte loss. Counting
    # the view b as its own buffer would give 3 * nbytes at the Add.
    assert exe.memory_stats()["peak_bytes"] - exe.memory_stats()["persistable_bytes"] == 2 * nbytes + 4


def test_feed_errors_name_the_feed():
    p = chain()
    exe = metaopt.Executor()
    with pytest.raises(KeyError, match=r"feed 'X' is not an input.*did you mean 'x'"):
        exe.run(p, feed={"X": np.ones((2, 256), np.float32)})
    with pytest.raises(KeyError, match="needs feed 'x'"):
        exe.run(p, feed={}, fetch_list=["loss"])
    with pytest.raises(TypeError, match="feed 'x' has dtype torch.float64"):
        exe.run(p, feed={"x": np.ones((2, 256))}, fetch_list=["loss"])
    with pytest.raises(ValueError, match=r"feed 'x' has shape \[2, 255\]"):
        exe.run(p, feed={"x": np.ones((2, 255), np.float32)}, fetch_list=["loss"])
    with pytest.raises(KeyError, match=r"fetch 'los' is not a var.*did you mean 'loss'"):
        exe.run(p, feed={"x": np.ones((2, 256), np.float32)}, fetch_list=["los"])


def test_inconsistent_symbolic_dim_across_feeds():
    p = Program("two")
    p.add_var(Var("a", "float32", ("batch", 2), kind="input"))
    p.add_var(Var("b", "float32", ("batch", 2), kind="input"))
    p.add_var(Var("c", "float32", ("batch", 2)))
    p.ops = [Op("Add", ["a", "b"], ["c"])]
    p.inputs, p.outputs = ["a", "b"], ["c"]
    with pytest.raises(ValueError, match="feed 'b' has batch=3 but feed 'a' has batch=2"):
        metaopt.Executor().run(
            p, feed={"a": np.ones((2, 2), np.float32), "b": np.ones((3, 2), np.float32)}, fetch_list=["c"]
        )


def test_missing_kernel_names_the_op_line():
    p = chain()
    p.ops[1].type = "NoSuchOp"
    with pytest.raises(NotImplementedError, match=r"NoSuchOp.*h1 = NoSuchOp\(h0\)"):
        metaopt.Executor().run(p, feed={"x": np.ones((2, 256), np.float32)}, fetch_list=["loss"])


def test_plan_is_cached_per_program_version():
    p = chain()
    exe = metaopt.Executor()
    feed = {"x": np.ones((2, 256), np.float32)}
    exe.run(p, feed=feed, fetch_list=["loss"])
    exe.run(p, feed=feed, fetch_list=["loss"])
    assert len(exe._plans) == 1
    q = p.clone()
    q.ops[1].type = "Sigmoid"
    p.replace_with(q)
    (loss,) = exe.run(p, feed=feed, fetch_list=["loss"])
    assert len(exe._plans) == 2
    assert float(loss) != 512.0


def test_seed_fixes_dropout_masks():
    p = Program("drop")
    p.add_var(Var("x", "float32", ("batch", 64), kind="input"))
    p.add_var(Var("ratio", "float32", (), kind="constant"), torch.tensor(0.5))
    p.add_var(Var("train", "bool", (), kind="constant"), torch.tensor(True))
    p.add_var(Var("y", "float32", ("batch", 64)))
    p.ops = [Op("Dropout", ["x", "ratio", "train"], ["y"])]
    p.inputs, p.outputs = ["x"], ["y"]
    exe = metaopt.Executor()
    feed = {"x": np.ones((4, 64), np.float32)}
    metaopt.seed(3)
    (a,) = exe.run(p, feed=feed, fetch_list=["y"])
    metaopt.seed(3)
    (b,) = exe.run(p, feed=feed, fetch_list=["y"])
    (c,) = exe.run(p, feed=feed, fetch_list=["y"])
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert set(np.unique(a)) == {0.0, 2.0}


def test_two_programs_with_same_constant_names_share_one_executor():
    def program(value: float) -> Program:
        p = Program("c")
        p.add_var(Var("x", "float32", (2,), kind="input"))
        p.add_var(Var("const", "float32", (), kind="constant"), torch.tensor(value))
        p.add_var(Var("y", "float32", (2,)))
        p.ops = [Op("Mul", ["x", "const"], ["y"])]
        p.inputs, p.outputs = ["x"], ["y"]
        return p

    exe = metaopt.Executor()
    x = np.ones(2, np.float32)
    (a,) = exe.run(program(2.0), feed={"x": x}, fetch_list=["y"])
    (b,) = exe.run(
        program(3.0),
        feed={"x": x},
        fetch_list=[
            "y",
        ],
    )
    assert a.tolist() == [2.0, 2.0] and b.tolist() == [3.0, 3.0]
    assert "const" not in exe.scope  # constants belong to their program, not the scope
    (c,) = exe.run(program(5.0), feed={"x": x}, fetch_list=["const"])
    assert float(c) == 5.0


def test_clones_share_one_device_copy_of_each_constant_and_a_new_value_gets_its_own():
    """A pipeline stage's phases are clones sharing value tensors: their plans hold one device
    copy of each constant (as estimate_memory counts it), not one each. A program whose
    constant is another tensor, or the same tensor changed in place, gets its own copy."""
    p = Program("c")
    p.add_var(Var("x", "float32", (256,), kind="input"))
    p.add_var(Var("const", "float32", (256,), kind="constant"), torch.full((256,), 2.0))
    p.add_var(Var("y", "float32", (256,)))
    p.ops = [Op("Mul", ["x", "const"], ["y"])]
    p.inputs, p.outputs = ["x"], ["y"]
    exe = metaopt.Executor()
    x = np.ones(256, np.float32)
    exe.run(p, feed={"x": x}, fetch_list=["y"])
    one = exe.memory_stats()["persistable_bytes"]
    assert one == 1024
    q = p.clone()
    (b,) = exe.run(q, feed={"x": x}, fetch_list=["y"])
    assert exe.memory_stats()["persistable_bytes"] == one and b.tolist() == [2.0] * 256
    r = p.clone()
    r.values["const"] = torch.full((256,), 3.0)
    (c,) = exe.run(r, feed={"x": x}, fetch_list=["y"])
    assert exe.memory_stats()["persistable_bytes"] == 2 * one and c.tolist() == [3.0] * 256
    p.values["const"].mul_(2.0)  # values are read-only; were one changed, a new plan copies it anew
    (d,) = exe.run(p.clone(), feed={"x": x}, fetch_list=["y"])
    assert d.tolist() == [4.0] * 256


def test_in_place_update_of_a_value_read_later_is_refused():
    p = Program("inplace")
    p.add_var(Var("w", "float32", (3,), kind="param", trainable=True), torch.ones(3))
    p.add_var(Var("g", "float32", (3,), kind="input"))
    p.add_var(Var("lr", "float64", (), kind="opt_state"), torch.tensor(0.1, dtype=torch.float64))
    p.add_var(Var("w_new", "float32", (3,)))
    p.add_var(Var("y", "float32", (3,)))
    p.ops = [
        Op("SGDUpdate", ["w", "g", "lr"], ["w_new"], role="optimize"),
        Op("Relu", ["w"], ["y"], role="optimize"),  # reads the param the update overwrote
    ]
    p.inputs, p.outputs, p.updates = ["g"], ["y"], {"w": "w_new"}
    with pytest.raises(ValueError, match=r"SGDUpdate writes 'w' in place but op 1 reads it later"):
        metaopt.Executor().run(p, feed={"g": np.ones(3, np.float32)}, fetch_list=["y"])
    p.ops[0].inputs[0] = "g"  # a feed is the caller's tensor: never written
    p.updates = {}
    with pytest.raises(ValueError, match=r"writes 'g' in place, which shares storage with input 'g'"):
        metaopt.Executor().run(p, feed={"g": np.ones(3, np.float32)}, fetch_list=["y"])


def _sgd_program() -> Program:
    """w (param) -> wt = Transpose(w) (a view) -> y = MatMul(x, wt); then SGD on w from feed g."""
    p = Program("sgd")
    p.add_var(Var("w", "float32", (2, 2), kind="param", trainable=True), torch.ones(2, 2))
    p.add_var(Var("x", "float32", (1, 2), kind="input"))
    p.add_var(Var("g", "float32", (2, 2), kind="input"))
    p.add_var(Var("lr", "float64", (), kind="opt_state"), torch.tensor(1.0, dtype=torch.float64))
    for n, s in (("wt", (2, 2)), ("y", (1, 2)), ("w_new", (2, 2))):
        p.add_var(Var(n, "float32", s))
    p.ops = [
        Op("Transpose", ["w"], ["wt"], {"perm": [1, 0]}),
        Op("MatMul", ["x", "wt"], ["y"]),
        Op("SGDUpdate", ["w", "g", "lr"], ["w_new"], role="optimize"),
    ]
    p.inputs, p.outputs, p.updates = ["x", "g"], ["y"], {"w": "w_new"}
    return p


def test_fetched_view_of_an_updated_param_keeps_its_forward_value():
    p = _sgd_program()
    exe = metaopt.Executor()
    feed = {"x": np.ones((1, 2), np.float32), "g": np.full((2, 2), 2.0, np.float32)}
    wt, w = exe.run(p, feed=feed, fetch_list=["wt", "w"])
    assert wt.tolist() == [[1.0, 1.0], [1.0, 1.0]]  # the value the forward used
    assert w.tolist() == [[-1.0, -1.0], [-1.0, -1.0]]  # a persistable: its value after the step
    exe.run(p, feed=feed, fetch_list=["y"])
    assert w.tolist() == [[-1.0, -1.0], [-1.0, -1.0]]  # returned arrays are not the live state


def test_reading_a_view_of_an_in_place_target_afterwards_is_refused():
    p = _sgd_program()
    p.add_var(Var("late", "float32", (2, 2)))
    p.ops.append(Op("Relu", ["wt"], ["late"], role="optimize"))
    with pytest.raises(
        ValueError, match=r"SGDUpdate writes 'w' in place but op 3 reads it later \(through 'wt'"
    ):
        metaopt.Executor().run(
            p, feed={"x": np.ones((1, 2), np.float32), "g": np.ones((2, 2), np.float32)}, fetch_list=["late"]
        )


def test_plans_of_different_programs_never_mix():
    # ids of collected programs are reused; plans are keyed on a per-program uid.
    exe = metaopt.Executor()
    x = np.array([-2.0, 3.0], np.float32)
    want = {"Relu": [0.0, 3.0], "Neg": [2.0, -3.0], "Abs": [2.0, 3.0]}
    for k in range(30):
        kind = list(want)[k % 3]
        p = Program("one")
        p.add_var(Var("x", "float32", (2,), kind="input"))
        p.add_var(Var("y", "float32", (2,)))
        p.ops = [Op(kind, ["x"], ["y"])]
        p.inputs, p.outputs = ["x"], ["y"]
        (y,) = exe.run(p, feed={"x": x}, fetch_list=["y"])
        assert y.tolist() == want[kind], (k, kind)
    assert len(exe._plans) <= 32


def test_fetching_a_name_twice():
    p = chain()
    exe = metaopt.Executor()
    a, b = exe.run(p, feed={"x": np.ones((2, 256), np.float32)}, fetch_list=["h1", "h1"])
    np.testing.assert_array_equal(a, b)
    exe.run(p, feed={"x": np.ones((2, 256), np.float32)}, fetch_list=["loss"])
    assert exe.memory_stats()["peak_bytes"] > 0


def test_scope_entry_that_disagrees_with_a_program_is_an_error():
    exe = metaopt.Executor()
    exe.run(chain(), feed={"x": np.ones((2, 256), np.float32)}, fetch_list=["loss"])
    other = chain(width=128)
    with pytest.raises(ValueError, match=r"scope holds 'w' as torch.float32 \[256, 256\].*\[128, 128\]"):
        exe.run(other, feed={"x": np.ones((2, 128), np.float32)}, fetch_list=["loss"])


def test_scope_entries_are_checked_once_until_replaced(monkeypatch):
    """The per-run check of the scope against the program (above) runs once per tensor: a run
    finding the very tensors it checked before skips it (per-run host cost), a replaced one is
    checked again."""
    from metaopt.runtime import executor as executor_mod

    calls = []
    real = executor_mod._check_scope_entry
    monkeypatch.setattr(executor_mod, "_check_scope_entry", lambda p, n, t: (calls.append(n), real(p, n, t)))
    exe, p, feed = metaopt.Executor(), chain(), {"x": np.ones((2, 256), np.float32)}
    for _ in range(3):
        exe.run(p, feed=feed, fetch_list=["loss"])
    assert calls.count("w") == 1  # materialised by run 1, checked by run 2, then not again
    exe.scope["w"] = torch.zeros(128, 128)
    with pytest.raises(ValueError, match=r"scope holds 'w' as torch.float32 \[128, 128\]"):
        exe.run(p, feed=feed, fetch_list=["loss"])


def test_in_place_write_through_an_alias_of_a_param_needs_its_update():
    p = Program("alias")
    p.add_var(Var("w", "float32", (3,), kind="param", trainable=True), torch.ones(3))
    p.add_var(Var("g", "float32", (3,), kind="input"))
    p.add_var(Var("lr", "float64", (), kind="opt_state"), torch.tensor(0.1, dtype=torch.float64))
    p.add_var(Var("w_view", "float32", (3,)))
    p.add_var(Var("w_new", "float32", (3,)))
    p.ops = [
        Op("Identity", ["w"], ["w_view"]),
        Op("SGDUpdate", ["w_view", "g", "lr"], ["w_new"], role="optimize"),
    ]
    p.inputs, p.outputs = ["g"], ["w_new"]
    with pytest.raises(
        ValueError, match=r"shares storage with param 'w', but program.updates does not update 'w'"
    ):
        metaopt.Executor().run(p, feed={"g": np.ones(3, np.float32)}, fetch_list=["w_new"])
