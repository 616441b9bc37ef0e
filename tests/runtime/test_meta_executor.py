"""``Executor("meta")``: a training step that reads no device value on the host, proven on the CPU.

On the meta device tensors have shapes and dtypes but no values: a kernel that reads a value
on the host (what would wait for a GPU and break CUDA-graph capture) raises HostSyncError
naming the op, its printed line and the var. The reference programs and the zoo's CI subset
run 4 steps on meta with every feature that used to read the host at once: AMP float16 with
dynamic loss scaling, recompute + offload, dropout, gradient merge, global-norm clipping,
AdamW and a warm-up schedule.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from zoo import harness, models

import metaopt
import programs
from metaopt import fleet
from metaopt.ir import Op, Program, Var
from metaopt.ir.printer import fmt_op
from metaopt.ops import registry
from metaopt.optimizer import AdamW, ClipGradByGlobalNorm
from metaopt.optimizer.lr import LinearWarmupDecay

STEPS = 4  # gradient merge k=2: accumulate, update, accumulate, update


def _strategy(checkpoints: list[str]) -> fleet.DistributedStrategy:
    s = fleet.DistributedStrategy()
    s.amp = True
    s.amp_configs = {"dtype": "float16", "use_dynamic_loss_scaling": True}
    s.recompute = True
    s.recompute_configs = {"checkpoints": checkpoints, "enable_offload": True}
    s.gradient_merge = True
    s.gradient_merge_configs = {"k_steps": 2, "avg": True}
    return s


def _optimizer() -> AdamW:
    schedule = LinearWarmupDecay(peak_lr=1e-3, warmup_steps=2, total_steps=10)
    return AdamW(learning_rate=schedule, weight_decay=0.01, grad_clip=ClipGradByGlobalNorm(1.0))


def _minimized(program: Program, checkpoints: list[str]) -> Program:
    fleet.init(is_collective=True)
    fleet.distributed_optimizer(_optimizer(), _strategy(checkpoints)).minimize(program.loss)
    return program


def _run_on_meta(program: Program, feed: dict) -> metaopt.Executor:
    exe = metaopt.Executor("meta")
    held = None
    for _ in range(STEPS):
        (loss,) = exe.run(program, feed=feed, fetch_list=[program.loss])
        assert loss.is_meta and loss.shape == ()
        # after the first run every persistable keeps its tensor (what a CUDA graph replays into):
        # updates made into new tensors (step counter, lr, loss scale) are copied into it
        if held is not None:
            moved = [k for k, t in exe.scope.items() if k in held and held[k] is not t]
            assert not moved, f"persistables given new tensors by a step: {moved}"
        held = dict(exe.scope)
    for v in program.params():
        t = exe.scope[v.name]
        assert t.is_meta, v.name
    return exe


def _kinds(program: Program) -> set[str]:
    return {op.type for op in program.ops} | {op.role for op in program.ops}


@pytest.mark.parametrize("name", ["mlp", "bert", "gpt", "resnet"])
def test_reference_programs_take_steps_on_meta_with_every_feature_on(name):
    mod = programs.get(name)
    main = _minimized(programs.export(name, dropout=0.1) if name != "resnet" else programs.export(name),
                      list(mod.DEFAULT_CHECKPOINTS))  # fmt: skip
    kinds = _kinds(main)
    # the features are really there (a strategy that silently dropped one would pass trivially)
    assert {"CheckFiniteAndUnscale", "UpdateLossScaling", "AdamWUpdate", "ClipByGlobalNorm"} <= kinds
    assert {"LinearWarmupDecayLR", "recompute"} <= kinds
    if name != "mlp":  # two checkpoints: the last one is never offloaded, so the mlp has none
        assert {"offload", "prefetch"} <= kinds
    assert main.gradient_merge is not None
    if name != "resnet":
        assert "RngReplay" in kinds  # dropout, replayed in recompute
    feed = dict(zip(mod.INPUT_NAMES, mod.example_inputs("tiny", 4, seed=1), strict=True))
    _run_on_meta(main, feed)


@pytest.mark.parametrize("name", [e.name for e in models.entries() if e.fast])
def test_the_zoo_ci_subset_takes_steps_on_meta(name):
    entry = models.get(name)
    module, program = harness.export(entry, harness.DROPOUT)
    main = _minimized(program.clone(), list(entry.checkpoints))
    inputs = entry.inputs(harness.EXPORT_BATCH, 0)
    _run_on_meta(main, harness._feed(module, inputs))


def test_feeds_may_be_meta_tensors_or_arrays_and_only_shapes_count():
    mod = programs.get("mlp")
    main = _minimized(programs.export("mlp"), list(mod.DEFAULT_CHECKPOINTS))
    real = dict(zip(mod.INPUT_NAMES, mod.example_inputs("tiny", 4, seed=1), strict=True))
    exe = metaopt.Executor("meta")
    as_meta = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in real.items()}
    as_arrays = {k: np.asarray(v) for k, v in real.items()}
    for feed in (as_meta, as_arrays):
        (loss,) = exe.run(main, feed=feed, fetch_list=[main.loss])
        assert loss.is_meta
    wrong = {k: torch.empty((5, *v.shape[1:]), dtype=v.dtype, device="meta") for k, v in real.items()}
    wrong[mod.INPUT_NAMES[0]] = torch.empty((4, 3), dtype=real[mod.INPUT_NAMES[0]].dtype, device="meta")
    with pytest.raises(ValueError, match="has shape"):  # shapes are still checked
        exe.run(main, feed=wrong, fetch_list=[main.loss])


# --- a kernel that reads the host is named -------------------------------------------------------

_TEST_OP = "TestHostRead"


def _host_reading_kernel(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    scale = float(x[0, 0])  # reads x's value on the host: a view of an input
    return y * scale


if registry.get(_TEST_OP) is None:  # the test process may import this module once per collection
    registry.register(_TEST_OP, domain="metaopt_test")(_host_reading_kernel)


def _host_reading_program() -> Program:
    p = Program("reads")
    p.add_var(Var("x", "float32", ("batch", 3), kind="input"))
    p.add_var(Var("w", "float32", (3,), kind="param", trainable=True), torch.ones(3))
    p.add_var(Var("h", "float32", ("batch", 3)))
    p.add_var(Var("y", "float32", ("batch", 3)))
    p.add_var(Var("loss", "float32", ()))
    p.ops.append(Op("Mul", ["x", "w"], ["h"], scope="scale"))
    p.ops.append(Op(_TEST_OP, ["h", "x"], ["y"], scope="reader"))
    p.ops.append(Op("ReduceSum", ["y"], ["loss"], {"keepdims": 0}, role="loss"))
    p.inputs, p.outputs, p.loss_name = ["x"], ["loss"], "loss"
    metaopt.verify(p)
    return p


def test_a_kernel_reading_a_value_on_the_host_is_named():
    p = _host_reading_program()
    x = np.ones((2, 3), dtype=np.float32)
    (loss,) = metaopt.Executor("cpu").run(p, feed={"x": x}, fetch_list=["loss"])  # fine on the CPU
    assert float(loss) == 6.0
    with pytest.raises(metaopt.HostSyncError) as e:
        metaopt.Executor("meta").run(p, feed={"x": x}, fetch_list=["loss"])
    msg = str(e.value)
    assert msg.startswith(f"while running op 1: {fmt_op(p.ops[1])}\n"), msg
    assert "TestHostRead reads var 'h' on the host (_local_scalar_dense)" in msg


def test_a_fetch_on_meta_is_a_meta_tensor_whatever_return_numpy_says():
    p = _host_reading_program()
    p.ops[1] = Op("Mul", ["h", "x"], ["y"], scope="reader")
    (loss,) = metaopt.Executor("meta").run(p, feed={"x": np.ones((2, 3), np.float32)}, fetch_list=["loss"])
    assert isinstance(loss, torch.Tensor) and loss.is_meta


# --- the same property on CUDA (skipped without a GPU; benchmarks/gpu.sh runs it) -----------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["bert", "gpt"])
def test_cuda_steps_after_warm_up_never_sync_the_host(name):
    """torch's sync debug mode raises on any host-device synchronisation (``.item()``, a
    blocking copy): after one warm-up step (first-step allocations, the plan's constants), each
    step runs under it. Fetching nothing: a fetch is a read the user asked for."""
    mod = programs.get(name)
    main = _minimized(programs.export(name, dropout=0.1), list(mod.DEFAULT_CHECKPOINTS))
    feed = {k: v.cuda() for k, v in zip(mod.INPUT_NAMES, mod.example_inputs("tiny", 4, seed=1), strict=True)}
    exe = metaopt.Executor("cuda")
    exe.run(main, feed=feed, fetch_list=[])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(STEPS):
            exe.run(main, feed=feed, fetch_list=[])
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_state_updates_copied_into_the_scope_train_as_updates_rebound(monkeypatch):
    """The static form of state updates (off the CPU) against the CPU's rebinding form, both run
    here on the CPU: the same params bit for bit and the same memory accounting, every
    persistable keeping its tensor in the static form."""
    from metaopt.runtime import plan as plan_module

    mod = programs.get("bert")
    feed = dict(zip(mod.INPUT_NAMES, mod.example_inputs("tiny", 4, seed=1), strict=True))

    def train(static: bool):
        monkeypatch.setattr(plan_module, "static_scope_updates", lambda device: static)
        main = programs.export("bert", dropout=0.0)
        s = fleet.DistributedStrategy()
        s.amp = True
        s.amp_configs = {"dtype": "bfloat16"}
        fleet.init(is_collective=True)
        fleet.distributed_optimizer(_optimizer(), s).minimize(main.loss)
        exe = metaopt.Executor("cpu")
        exe.run(main, feed=feed, fetch_list=[])
        first = dict(exe.scope)
        counter = next(op.outputs[0] for op in main.ops if op.type == "StepCounter")
        (fetched,) = exe.run(main, feed=feed, fetch_list=[counter], return_numpy=False)
        for _ in range(2):
            exe.run(main, feed=feed, fetch_list=[])
        assert int(fetched) == 2  # a fetched new value is the user's: later runs leave it alone
        kept = all(first[k] is t for k, t in exe.scope.items())
        return {k: t.clone() for k, t in exe.scope.items()}, exe.memory_stats()["peak_bytes"], kept

    rebound, peak_rebound, kept_rebound = train(False)
    static, peak_static, kept_static = train(True)
    assert rebound.keys() == static.keys()
    assert all(torch.equal(rebound[k], static[k]) for k in rebound)
    assert peak_static == peak_rebound
    assert kept_static and not kept_rebound  # the step counter and lr are new tensors when rebound


@pytest.mark.parametrize("read", ["item", "bool", "tolist", "cpu"])
def test_every_kind_of_host_read_is_refused_and_host_values_are_not(read):
    from metaopt.runtime.hostsync import HostReadGuard

    op = Op("Relu", ["x"], ["y"])
    x = torch.empty(2, 3, device="meta")
    reads = {
        "item": lambda t: t[0, 0].item(),
        "bool": lambda t: bool(t[0, 0]),
        "tolist": lambda t: t.tolist(),
        "cpu": lambda t: t.cpu(),
    }
    with pytest.raises(metaopt.HostSyncError, match=r"Relu reads var 'x' on the host"):
        with HostReadGuard([op], {id(x): "x"}):
            reads[read](x)
    with HostReadGuard([op], {}):  # a host value (a CPU tensor) is free to read, and a meta copy is no read
        assert reads[read](torch.ones(2, 3)) is not None
        assert x.to("meta").is_meta
