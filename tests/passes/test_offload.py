"""Offload: checkpoints to host memory after the forward, fetched back for the backward."""

from __future__ import annotations

import functools

import export_cache
import pytest
from test_recompute import SETS, _bert24, _identical, _measured_activation_peak, _run, _train_program

import metaopt
import programs
from metaopt import fleet
from metaopt.ir import parse_program, verify
from metaopt.passes.memory_estimate import estimate_memory
from metaopt.passes.offload import OffloadError, offload, offloaded_bytes
from metaopt.passes.recompute import plan_recompute, recompute


@functools.cache
def _recomputed(name: str, dropout: float = 0.5):
    base = _train_program(name, dropout)
    ck = SETS[name][0]
    return recompute(base, checkpoints=ck), plan_recompute(base, checkpoints=ck).checkpoints


@pytest.mark.parametrize("name", ["bert", "gpt"])
def test_offload_is_bit_identical_to_recompute_only(name):
    """3 seeds x 10 SGD steps, dropout 0.5: loss, every grad, params."""
    rc, ckpts = _recomputed(name)
    of = offload(rc, checkpoints=ckpts)
    verify(of)
    offloaded = [op for op in of.ops if op.role == "offload"]
    assert offloaded and sum(op.type == "Memcpy" for op in of.ops) == 2 * len(offloaded)
    for seed in range(3):
        assert _identical(_run(rc, name, seed), _run(of, name, seed)), (name, seed)


def test_mlp_offload_has_nothing_to_move():
    # mlp's first checkpoint is the one the backward reaches first (fc2 is not read
    # after the forward): the last checkpoint is never offloaded.
    rc, ckpts = _recomputed("mlp")
    assert not any(op.type == "Memcpy" for op in offload(rc, checkpoints=ckpts).ops)


def test_bytes_offloaded_per_step_are_the_checkpoints():
    rc, ckpts = _recomputed("bert")
    of = offload(rc, checkpoints=ckpts)
    moved = [op.inputs[0] for op in of.ops if op.role == "offload"]
    assert moved == ckpts[:-1]  # every checkpoint but the last
    mod = programs.get("bert")
    feed = dict(zip(mod.INPUT_NAMES, mod.example_inputs("tiny", 6, seed=1), strict=True))
    exe = metaopt.Executor("cpu")
    exe.run(of, feed=feed, fetch_list=[of.loss])
    stats = exe.memory_stats()
    want = sum(of.vars[c].nbytes({"batch": 6}) for c in moved)
    assert stats["offloaded_bytes"] == stats["fetched_bytes"] == want == offloaded_bytes(of, batch=6)
    assert stats["host_peak_bytes"] == want
    # Per-run copy counters: on CPU the copies are timed clones and nothing waits on them.
    assert stats["copy_seconds"] > 0 and stats["copy_wait_seconds"] == 0.0
    exe.run(rc, feed=feed, fetch_list=[rc.loss])
    stats = exe.memory_stats()
    assert stats["offloaded_bytes"] == stats["fetched_bytes"] == 0 and stats["copy_seconds"] == 0.0


def test_prefetch_goes_one_segment_ahead_and_readers_use_the_fetched_copy():
    bert = programs.get("bert")
    program = export_cache.export(
        bert.build("tiny", seed=0, num_layers=4), bert.example_inputs("tiny", 4, num_layers=4)
    )
    metaopt.optimizer.SGD(learning_rate=0.1).minimize(program.loss)
    ck = plan_recompute(program, checkpoints=["bert.encoder.layer.*"]).checkpoints
    of = offload(recompute(program, checkpoints=ck), checkpoints=ck)
    fetch = {op.origin: i for i, op in enumerate(of.ops) if op.role == "prefetch" and op.type == "Memcpy"}
    wait = {op.origin: i for i, op in enumerate(of.ops) if op.type == "CopyWait"}
    assert list(fetch) == list(wait) and len(fetch) == 3  # 4 checkpoints, the last not offloaded
    order = sorted(fetch, key=wait.get)  # the order the backward needs them
    for prev, c in zip(order, order[1:]):
        # c's copy starts where the previous checkpoint is first needed: a segment ahead
        assert fetch[c] < wait[prev] < wait[c]
        assert any(op.role == "recompute" for op in of.ops[fetch[c] : wait[c]])
    fwd_end = next(i for i, op in enumerate(of.ops) if op.role == "backward")
    for c in fetch:  # after the forward, only the fetched copy is read
        assert not any(c in op.inputs for op in of.ops[fwd_end:])


def test_bert_24_layers_offload_activation_peak_at_most_0_7_of_recompute():
    program = _bert24()
    ck = ["bert.encoder.layer.*"]
    rc = recompute(program, checkpoints=ck)
    of = offload(rc, checkpoints=plan_recompute(program, checkpoints=ck).checkpoints)
    # batch 64: activations, not the (tiny-width) model's gradients, set the peak
    peaks = [_measured_activation_peak(prog, 64) for prog in (rc, of)]
    assert peaks[1] <= 0.7 * peaks[0], peaks
    # the estimate predicts both: host copies are not device bytes
    for prog, measured in zip((rc, of), peaks, strict=True):
        est = estimate_memory(prog, dims={"batch": 64}, fetches=(prog.loss_name,))
        assert est.activation_peak_bytes == measured


def test_bad_input_errors():
    rc, ckpts = _recomputed("bert")
    with pytest.raises(OffloadError, match=r"checkpoint_shape'\] = \[4, 99, 32\] does not match checkpoint"):
        offload(rc, checkpoints=ckpts, checkpoint_shape=[4, 99, 32])
    offload(rc, checkpoints=ckpts, checkpoint_shape=[-1, 16, 32])  # batch dim: any value
    with pytest.raises(OffloadError, match="needs recompute checkpoints"):
        offload(rc, checkpoints=[])
    with pytest.raises(OffloadError, match=r"offload_checkpoints entry 'nope' is not a recompute checkpoint"):
        offload(rc, checkpoints=ckpts, offload_checkpoints=["nope"])
    fleet.init(is_collective=True)
    s = fleet.DistributedStrategy()
    s.recompute_configs = {"checkpoints": ["bert.encoder.layer.*"], "enable_offload": True}
    _, _, program = __import__("conftest").exported("bert", dropout=0.5)
    main = program.clone()
    with pytest.raises(ValueError, match=r"enable_offload'\]=True needs strategy.recompute=True"):
        fleet.distributed_optimizer(metaopt.optimizer.SGD(learning_rate=0.1), s).minimize(main.loss)


def test_fleet_offload_path():
    fleet.init(is_collective=True)
    _, _, program = __import__("conftest").exported("bert", dropout=0.5)
    main = program.clone()
    s = fleet.DistributedStrategy()
    s.recompute = True
    s.recompute_configs = {"checkpoints": ["bert.encoder.layer.*"], "enable_offload": True}
    fleet.distributed_optimizer(metaopt.optimizer.SGD(learning_rate=0.1), s).minimize(main.loss)
    assert any(op.role == "offload" for op in main.ops)
    rc, _ = _recomputed("bert")
    assert _identical(_run(rc, "bert", 4, steps=3), _run(main, "bert", 4, steps=3))


@pytest.mark.parametrize("name", ["mlp", "bert", "resnet"])
def test_offload_golden(name, golden):
    if name == "resnet":
        from test_recompute import FLEET_RESNET_NAMES

        resnet = programs.get("resnet")
        module = resnet.build("tiny", seed=0, depths=(3, 4, 6, 3))
        inputs = resnet.example_inputs("tiny", 4, depths=(3, 4, 6, 3))
        base = export_cache.export(module, inputs, name="resnet")
        metaopt.optimizer.SGD(learning_rate=0.1).minimize(base.loss)
        ck = FLEET_RESNET_NAMES  # varying shapes per stage: Fleet could not offload these
    else:
        base, ck = _train_program(name, dropout=0.1), SETS[name][0]
    plan = plan_recompute(base, checkpoints=ck)
    q = offload(recompute(base, checkpoints=ck), checkpoints=plan.checkpoints)
    verify(q)
    text = str(q)
    golden(f"offload/{name}", text)
    assert str(parse_program(text)) == text
    if name == "resnet":
        shapes = {q.vars[op.inputs[0]].shape for op in q.ops if op.role == "offload"}
        assert len(shapes) > 1
