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


@pytest.mark.parametrize("name", ["mlp", "bert", "gpt", "resnet"])
def test_reference_forward_on_cuda_matches_cpu(name):
    _, _, program = exported(name)
    mod = programs.get(name)
    feed = dict(zip(mod.INPUT_NAMES, mod.example_inputs("tiny", 6, seed=4), strict=True))
    (cpu,) = metaopt.Executor("cpu").run(program, feed=feed, fetch_list=[program.loss])
    exe = metaopt.Executor("cuda")
    (gpu,) = exe.run(program, feed=feed, fetch_list=[program.loss])
    # cuBLAS/cuDNN reduce in other orders than the CPU kernels (TF32 is off by default
    # for matmul in torch): float32 rounding differences only.
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
