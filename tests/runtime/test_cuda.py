"""The executor on CUDA (skipped where no GPU is present; run on a lent GPU machine)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import exported

import metaopt
import programs
from metaopt.runtime.plan import build_plan

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True)
def strict_float32():
    """cuDNN convolutions use TF32 by default (torch's choice): compared with the CPU at float32's
    tolerance, the GPU must compute in float32 (measured with TF32: ResNet's loss 2e-4 apart)."""
    before = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = before


@pytest.mark.parametrize("name", ["mlp", "bert", "gpt", "resnet"])
def test_reference_forward_on_cuda_matches_cpu(name):
    _, _, program = exported(name)
    mod = programs.get(name)
    feed = dict(zip(mod.INPUT_NAMES, mod.example_inputs("tiny", 6, seed=4), strict=True))
    (cpu,) = metaopt.Executor("cpu").run(program, feed=feed, fetch_list=[program.loss])
    exe = metaopt.Executor("cuda")
    (gpu,) = exe.run(program, feed=feed, fetch_list=[program.loss])
    # cuBLAS/cuDNN reduce in other orders than the CPU kernels (TF32 off, see strict_float32):
    # float32 rounding differences only.
    np.testing.assert_allclose(gpu, cpu, rtol=1e-4, atol=1e-5)
    stats = exe.memory_stats()
    assert stats["cuda_max_allocated"] > 0
    assert 0 < stats["persistable_bytes"] <= stats["peak_bytes"]
    assert all(t.is_cuda for t in exe.scope.values())


def test_shape_values_stay_on_the_host():
    _, _, program = exported("bert")
    plan = build_plan(program, [program.loss_name], torch.device("cuda"), track=True)
    # Reshape targets are read from host copies: no device sync per Reshape.
    assert "h_" in plan.source
    reshapes = [line for line in plan.source.splitlines() if line.endswith("# Reshape")]
    assert reshapes and all("h_" in line for line in reshapes)


def test_batchnorm_running_stats_on_cuda_match_torch():
    _, _, program = exported("resnet")
    mod = programs.get("resnet")
    inputs = mod.example_inputs("tiny", 4, seed=5)
    exe = metaopt.Executor("cuda:0")
    exe.run(program, feed=dict(zip(mod.INPUT_NAMES, inputs, strict=True)), fetch_list=[program.loss])
    ref = mod.build("tiny", seed=0, dropout=0.0).cuda()
    ref(*[x.cuda() for x in inputs])
    for n, b in ref.named_buffers():
        if n in program.updates:
            torch.testing.assert_close(exe.scope[n], b, rtol=1e-5, atol=1e-6)


def test_offload_on_cuda_matches_recompute_only_and_reuses_pinned_buffers():
    """Copies on side streams with event waits must not change a single bit (dropout off:
    CUDA's Philox masks differ from the CPU's, not between these two programs), the
    pinned buffers are made once, and both copy counters are read from CUDA events."""
    from metaopt.passes.offload import offload
    from metaopt.passes.recompute import plan_recompute, recompute

    _, _, program = exported("bert", dropout=0.0)
    base = program.clone()
    metaopt.optimizer.SGD(learning_rate=0.1).minimize(base.loss)
    ck = ["bert.encoder.layer.*"]
    rc = recompute(base, checkpoints=ck)
    of = offload(rc, checkpoints=plan_recompute(base, checkpoints=ck).checkpoints)
    mod = programs.get("bert")
    results = []
    for program in (rc, of):
        exe = metaopt.Executor("cuda")
        metaopt.seed(0)
        losses, pinned = [], []
        for s in range(4):
            feed = dict(zip(mod.INPUT_NAMES, mod.example_inputs("tiny", 4, seed=s), strict=True))
            (loss,) = exe.run(program, feed=feed, fetch_list=[program.loss], return_numpy=False)
            losses.append(loss)
            pinned.append(exe.memory_stats()["pinned_buffer_bytes"])
        results.append((losses, {k: v.clone() for k, v in exe.scope.items()}, exe.memory_stats(), pinned))
    (l_rc, s_rc, _, _), (l_of, s_of, stats, pinned) = results
    assert all(torch.equal(a, b) for a, b in zip(l_rc, l_of, strict=True))
    assert all(torch.equal(s_rc[k], s_of[k]) for k in s_rc)
    assert stats["offloaded_bytes"] > 0 and stats["offloaded_bytes"] == stats["fetched_bytes"]
    assert pinned[0] > 0 and len(set(pinned)) == 1  # allocated in step 1, reused after
    assert stats["copy_seconds"] > 0 and stats["copy_wait_seconds"] >= 0
