"""fleet.save_persistables / load_persistables: bitwise resume, RNG, atomicity, validation."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import metaopt
from metaopt import fleet
from metaopt.fleet import io as fio
from metaopt.ir import Op, Program, Var


def _program(w_shape=(4, 3), extra_param: str | None = None, with_m: bool = True) -> Program:
    """x @ w -> Dropout -> mean; plus a buffer, optimizer state and constants."""
    p = Program("tiny")
    p.add_var(Var("x", "float32", ("batch", 4), "input"))
    p.add_var(Var("w", "float32", w_shape, "param", trainable=True), torch.randn(*w_shape))
    p.add_var(Var("step", "int64", (), "buffer"), torch.tensor(0))
    if with_m:
        p.add_var(
            Var("w@MOMENT", "float64", w_shape, "opt_state"), torch.zeros(*w_shape, dtype=torch.float64)
        )
    if extra_param:
        p.add_var(Var(extra_param, "float32", (3,), "param", trainable=True), torch.zeros(3))
    p.add_var(Var("ratio", "float32", (), "constant"), torch.tensor(0.5))
    p.add_var(Var("training", "bool", (), "constant"), torch.tensor(True))
    p.add_var(Var("h", "float32", ("batch", 3)))
    p.add_var(Var("d", "float32", ("batch", 3)))
    p.add_var(Var("loss", "float32", ()))
    p.inputs, p.outputs, p.loss_name = ["x"], ["d", "loss"], "loss"
    p.ops = [
        Op("MatMul", ["x", "w"], ["h"]),
        Op("Dropout", ["h", "ratio", "training"], ["d"]),
        Op("ReduceMean", ["d"], ["loss"], {"keepdims": 0}, role="loss"),
    ]
    return p


FEED = {"x": torch.ones(8, 4)}


def _trained_executor(p: Program) -> metaopt.Executor:
    exe = metaopt.Executor("cpu")
    exe.run(p, feed=FEED, fetch_list=["loss"])  # materialises the scope
    # as if training had changed every persistable (odd bit patterns included)
    exe.scope["w"].copy_(torch.randn(exe.scope["w"].shape))
    exe.scope["w"][0, 0] = float("nan")
    exe.scope["w"][0, 1] = -0.0
    # state the forward does not read (an optimizer step would have written it)
    exe.scope["step"] = torch.tensor(7)
    if "w@MOMENT" in p.vars:
        exe.scope["w@MOMENT"] = torch.randn(p.vars["w@MOMENT"].shape, dtype=torch.float64)
    return exe


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().numpy().tobytes()


def test_save_then_load_restores_every_tensor_bitwise_and_the_rng(tmp_path):
    p = _program()
    exe = _trained_executor(p)
    metaopt.seed(3)
    torch.rand(5)  # move the generator somewhere
    path = fleet.save_persistables(exe, tmp_path / "ckpt", p)
    assert os.path.basename(path) == "persistables.pt"
    after_save = torch.rand(5)
    (d_after_save,) = exe.run(p, feed=FEED, fetch_list=["d"])

    fresh = metaopt.Executor("cpu")
    assert fresh.scope == {}
    loaded = fleet.load_persistables(fresh, tmp_path / "ckpt", p)
    assert sorted(loaded) == ["step", "w", "w@MOMENT"]  # constants are not saved
    for name in loaded:
        a, b = exe.scope[name], fresh.scope[name]
        assert a.dtype == b.dtype and a.shape == b.shape and b.device == fresh.device
        assert _bits(a) == _bits(b), name
    assert torch.equal(torch.rand(5), after_save)  # the RNG is back where it was at save
    (d_resumed,) = fresh.run(p, feed=FEED, fetch_list=["d"])  # same dropout mask (same NaN column too)
    np.testing.assert_array_equal(d_resumed, d_after_save)


def test_load_into_a_used_executor_copies_in_place(tmp_path):
    p = _program()
    exe = _trained_executor(p)
    fleet.save_persistables(exe, tmp_path, p)
    other = metaopt.Executor("cpu")
    other.run(p, feed=FEED, fetch_list=["loss"])
    w = other.scope["w"]
    before = other.memory_stats()["persistable_bytes"]
    fleet.load_persistables(other, tmp_path, p)
    assert other.scope["w"] is w and _bits(w) == _bits(exe.scope["w"])
    # w was copied in place; step and w@MOMENT (never materialised by the forward) were added
    assert other.memory_stats()["persistable_bytes"] == before + 8 + 4 * 3 * 8
    assert other.memory_stats()["peak_bytes"] >= before + 8 + 4 * 3 * 8  # and counted by the executor


def test_unmaterialised_vars_come_from_the_program(tmp_path):
    p = _program()
    exe = metaopt.Executor("cpu")  # never ran: nothing in the scope
    fleet.save_persistables(exe, tmp_path, p)
    fresh = metaopt.Executor("cpu")
    fleet.load_persistables(fresh, tmp_path, p)
    assert _bits(fresh.scope["w"]) == _bits(p.values["w"])


def test_a_failed_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    p = _program()
    exe = _trained_executor(p)
    fleet.save_persistables(exe, tmp_path, p)
    good = exe.scope["w"].clone()
    exe.scope["w"].add_(1.0)

    real_save = torch.save

    def crash(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        f.seek(100)
        f.truncate()  # a partial file on disk ...
        raise OSError("disk full")  # ... then the process dies

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        fleet.save_persistables(exe, tmp_path, p)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["persistables.pt"]  # no temp file left behind
    fresh = metaopt.Executor("cpu")
    fleet.load_persistables(fresh, tmp_path, p)
    assert _bits(fresh.scope["w"]) == _bits(good)


def test_shape_mismatch_names_the_var_and_both_shapes(tmp_path):
    p = _program()
    fleet.save_persistables(_trained_executor(p), tmp_path, p)
    other = _program(w_shape=(4, 5))
    exe = metaopt.Executor("cpu")
    with pytest.raises(
        ValueError, match=r"var 'w' is float32 \[4, 3\] in .* but float32 \[4, 5\] in program"
    ):
        fleet.load_persistables(exe, tmp_path, other)
    assert exe.scope == {}  # nothing loaded


def test_dtype_mismatch_names_the_var(tmp_path):
    p = _program()
    fleet.save_persistables(_trained_executor(p), tmp_path, p)
    other = _program()
    other.vars["step"].dtype = "int32"
    with pytest.raises(ValueError, match=r"var 'step' is int64 \[\] in .* but int32 \[\]"):
        fleet.load_persistables(metaopt.Executor("cpu"), tmp_path, other)


def test_missing_var_names_it(tmp_path):
    p = _program()
    fleet.save_persistables(_trained_executor(p), tmp_path, p)
    other = _program(extra_param="fc2.bias")
    with pytest.raises(ValueError, match=r"has no var 'fc2\.bias'"):
        fleet.load_persistables(metaopt.Executor("cpu"), tmp_path, other)


def test_extra_vars_need_strict_false(tmp_path):
    p = _program()
    exe = _trained_executor(p)
    fleet.save_persistables(exe, tmp_path, p)
    other = _program(with_m=False)
    with pytest.raises(ValueError, match=r"does not have: \['w@MOMENT'\]; pass strict=False"):
        fleet.load_persistables(metaopt.Executor("cpu"), tmp_path, other)
    fresh = metaopt.Executor("cpu")
    assert sorted(fleet.load_persistables(fresh, tmp_path, other, strict=False)) == ["step", "w"]
    assert "w@MOMENT" not in fresh.scope


def test_files_that_are_not_checkpoints(tmp_path):
    p = _program()
    with pytest.raises(FileNotFoundError, match="no checkpoint file"):
        fleet.load_persistables(metaopt.Executor("cpu"), tmp_path, p)
    (tmp_path / "persistables.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="not a readable metaopt checkpoint"):
        fleet.load_persistables(metaopt.Executor("cpu"), tmp_path, p)
    torch.save({"w": torch.zeros(4, 3)}, tmp_path / "persistables.pt")  # a plain state dict
    with pytest.raises(ValueError, match="is not a metaopt checkpoint"):
        fleet.load_persistables(metaopt.Executor("cpu"), tmp_path, p)


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_loading_never_runs_code(tmp_path):
    torch.save(
        {"meta": {"format": fio.FORMAT, "version": 1}, "tensors": {}, "rng": _Evil()},
        tmp_path / "persistables.pt",
    )
    with pytest.raises(ValueError, match="not a readable metaopt checkpoint"):
        fleet.load_persistables(metaopt.Executor("cpu"), tmp_path, _program())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_round_trip(tmp_path):
    p = _program()
    exe = metaopt.Executor("cuda")
    exe.run(p, feed=FEED, fetch_list=["loss"])
    torch.cuda.manual_seed_all(5)
    fleet.save_persistables(exe, tmp_path, p)
    want = torch.rand(4, device="cuda")
    fresh = metaopt.Executor("cuda")
    fleet.load_persistables(fresh, tmp_path, p)
    assert all(t.is_cuda for t in fresh.scope.values())
    assert _bits(fresh.scope["w"]) == _bits(exe.scope["w"])
    assert torch.equal(torch.rand(4, device="cuda"), want)


def test_a_stream_the_program_never_draws_from_is_not_warned_about(tmp_path, caplog):
    """A one-process save has no model-parallel RNG state (nothing drew from it); loading it
    into the same program says nothing. A program that does draw from that stream is told."""
    import logging

    from metaopt.ops import rng_streams

    p = _program()
    exe = _trained_executor(p)
    fleet.save_persistables(exe, str(tmp_path), p)
    state = torch.load(tmp_path / "persistables.pt", weights_only=True)
    state["rng"]["streams"].pop(rng_streams.MODEL_PARALLEL, None)  # as a save that never drew from it
    torch.save(state, tmp_path / "persistables.pt")
    with caplog.at_level(logging.WARNING, logger="metaopt.fleet"):
        fleet.load_persistables(metaopt.Executor("cpu"), str(tmp_path), p)
    assert "RNG stream" not in caplog.text
    mp = _program()
    mp.ops[1].attrs.update(rng_streams.model_parallel_attrs([0]))
    with caplog.at_level(logging.WARNING, logger="metaopt.fleet"):
        fleet.load_persistables(metaopt.Executor("cpu"), str(tmp_path), mp)
    assert f"no state of RNG stream '{rng_streams.MODEL_PARALLEL}'" in caplog.text
