"""broadcast_init: data parallel's initial broadcast as a startup op the executor runs once.

The real collective over two gloo workers (ranks built with different seeds end equal) is
tests/training/test_data_parallel.py; here a fake communicator stands in for worker 0, so the
run-once contract and where the values land are checked in one process."""

from __future__ import annotations

import pytest
import torch
from conftest import exported

import metaopt
from metaopt.ir import Op, VerifyError, parse_program, verify
from metaopt.passes.backward import append_backward
from metaopt.passes.broadcast_init import BroadcastInitError, broadcast_init, startup_vars
from metaopt.passes.optimize import apply_optimizer


def _train_program():
    _, inputs, p = exported("mlp")
    q, pairs = append_backward(p, loss=p.loss_name)
    return apply_optimizer(q, optimizer=metaopt.optimizer.SGD(0.1), params_grads=pairs)[0], inputs


class FakeComm:
    """Worker 0 as seen from another worker: the k-th broadcast of a run writes worker 0's
    value of the k-th var in place (the Broadcast op sends its inputs in order)."""

    def __init__(self, rank0: dict[str, torch.Tensor]):
        self.rank0 = list(rank0.values())
        self.calls = 0

    def broadcast(self, t: torch.Tensor, src: int, what: str, ranks=None) -> None:
        assert src == 0 and ranks is None
        t.copy_(self.rank0[self.calls % len(self.rank0)])
        self.calls += 1

    def start_run(self) -> None:
        pass


def test_golden(golden):
    p, _ = _train_program()
    q = broadcast_init(p)
    verify(q)
    golden("data_parallel/broadcast_init_mlp", str(q))
    assert str(parse_program(str(q))) == str(q)
    startup = [op for op in q.ops if op.role == "startup"]
    assert len(startup) == 1 and q.ops[0] is startup[0]
    assert startup[0].inputs == startup_vars(p) and startup[0].outputs == []
    assert set(startup_vars(p)) == {v.name for v in p.params()}  # the mlp has no buffers
    assert str(p) != str(q) and not any(op.role == "startup" for op in p.ops)  # pure


def test_executor_runs_the_startup_op_once_into_its_scope():
    p, inputs = _train_program()
    q = broadcast_init(p)
    rank0 = {n: torch.full_like(q.values[n], 0.5) for n in startup_vars(q)}
    before = {n: t.clone() for n, t in q.values.items()}
    exe = metaopt.Executor("cpu")
    comm = exe.runtime._comm = FakeComm(rank0)
    feed = dict(zip(q.inputs, inputs))
    exe.run(q, feed=feed, fetch_list=[q.loss])
    assert comm.calls == len(startup_vars(q))
    # The first step started from worker 0's values: one SGD step from 0.5 everywhere.
    ref = metaopt.Executor("cpu")
    ref.scope.update({n: t.clone() for n, t in rank0.items()})
    ref.run(p, feed=feed, fetch_list=[p.loss])
    for n in startup_vars(q):
        assert torch.equal(exe.scope[n], ref.scope[n]), n
    exe.run(q, feed=feed, fetch_list=[q.loss])
    assert comm.calls == len(startup_vars(q))  # not again on the second run
    for n, t in before.items():  # the program's own values were never written
        assert torch.equal(q.values[n], t), n


def test_a_new_version_of_the_program_broadcasts_again():
    p, inputs = _train_program()
    q = broadcast_init(p)
    exe = metaopt.Executor("cpu")
    comm = exe.runtime._comm = FakeComm({n: q.values[n].clone() for n in startup_vars(q)})
    feed = dict(zip(q.inputs, inputs))
    exe.run(q, feed=feed)
    q.replace_with(q.clone())  # what minimize does to the user's program
    exe.run(q, feed=feed)
    assert comm.calls == 2 * len(startup_vars(q))


def test_twice_is_refused():
    p, _ = _train_program()
    with pytest.raises(BroadcastInitError, match="already has a startup op setting 'fc1.weight'"):
        broadcast_init(broadcast_init(p))
    with pytest.raises(BroadcastInitError, match="src must be a worker rank"):
        broadcast_init(p, src=-1)


def test_nothing_to_broadcast_leaves_the_program_alone():
    p, _ = _train_program()
    frozen = p.clone()
    for v in frozen.vars.values():
        if v.kind == "param":
            v.kind = "opt_state"  # persistable, not a param: workers start it equal
    assert str(broadcast_init(frozen)) == str(frozen)


@pytest.mark.parametrize(
    "where, why",
    [
        ("after", "must come before every other op"),
        ("output", "has no outputs"),
        ("activation", "reads persistables only"),
    ],
)
def test_verify_refuses_misplaced_startup_ops(where, why):
    p, _ = _train_program()
    q = broadcast_init(p)
    op = q.ops[0]
    if where == "after":
        q.ops = [q.ops[1], op, *q.ops[2:]]
    elif where == "output":
        q.ops[0] = Op(op.type, op.inputs, ["fc1"], op.attrs, role="startup")
    else:
        q.ops[0] = Op(op.type, ["x"], [], op.attrs, role="startup")
    with pytest.raises(VerifyError, match=why):
        verify(q)


def test_saved_and_loaded_with_its_startup_op(tmp_path):
    from metaopt.frontend.onnx_save import save

    p, _ = _train_program()
    q = broadcast_init(p)
    save(q, tmp_path / "dp.onnx")
    back = metaopt.load(tmp_path / "dp.onnx")
    assert back.ops[0].role == "startup" and back.ops[0].inputs == q.ops[0].inputs
    assert back.ops[0].attrs == {"src": 0}
