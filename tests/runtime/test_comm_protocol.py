"""The pipeline P2P protocol's process-free parts (runtime/comm.py): which receive buffers
may be reused, message tags, the step signature and the debug switch. The protocol itself
runs in tests/training/test_pipeline.py (gloo workers: headers on first use only, shape
changes verified again, mismatches named on both sides)."""

from __future__ import annotations

import pytest
import torch

from metaopt.runtime import comm


def test_a_buffer_anything_else_references_is_never_reused():
    pool = [torch.empty(2, 3)]
    assert comm._free_buffer(pool, (2, 3), torch.float32) is pool[0]  # only the pool holds it
    held = pool[0]  # an executor var, an activation kept for the backward
    assert comm._free_buffer(pool, (2, 3), torch.float32) is None
    del held
    view = pool[0][1:]  # a view shares the storage
    assert comm._free_buffer(pool, (2, 3), torch.float32) is None
    del view
    posted = {("peer", "x"): (None, pool[0], 1)}  # a receive posted into it
    assert comm._free_buffer(pool, (2, 3), torch.float32) is None
    del posted
    assert comm._free_buffer(pool, (2, 3), torch.float32) is pool[0]
    assert comm._free_buffer(pool, (3, 2), torch.float32) is None  # another shape
    assert comm._free_buffer(pool, (2, 3), torch.float64) is None  # another dtype


def test_data_tags_are_odd_and_tell_var_shape_and_dtype_apart():
    tags = {
        comm._data_tag(var, shape, dtype)
        for var in ("h", "h@GRAD")
        for shape in ((4, 32), (3, 32))
        for dtype in (torch.float32, torch.float16)
    }
    assert len(tags) == 8
    assert all(t % 2 == 1 and 0 < t < 2**31 for t in tags)  # even tags are the control streams
    assert comm._data_tag("h", (4, 32), torch.float32) == comm._data_tag("h", (4, 32), torch.float32)


def test_step_signature_holds_the_dims_and_the_switch(monkeypatch):
    sig = comm._signature(False, {"batch": 4})
    assert len(sig) == comm._SIG_LEN and sig[0] == 0 and sig[2:4] == [1, 4]
    assert comm._signature(True, {"batch": 4}) != sig
    assert comm._signature(False, {"batch": 3}) != sig
    assert comm._dims_text(sig, ["batch"]) == "batch=4"
    assert comm._dims_text(sig, ["seq"]) == "dims [4]"  # the names' hash differs
    for value, on in (("1", True), ("0", False), ("", False), ("yes", True)):
        monkeypatch.setenv(comm.CHECK_ENV, value)
        assert comm.check_every_message() is on
    monkeypatch.delenv(comm.CHECK_ENV)
    assert comm.check_every_message() is False
    with pytest.raises(comm.PipelineCommError, match="at most 8"):
        comm._signature(False, {f"d{i}": i for i in range(9)})
