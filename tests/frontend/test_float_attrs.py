"""frontend/attrs.py: ONNX float attributes (float32 on file) read back as the decimal their
author wrote, so torch's double-precision uses (BatchNorm's and LayerNorm's eps) match."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import metaopt
from metaopt.frontend import onnx_save
from metaopt.frontend.attrs import float32_literal


@pytest.mark.parametrize("written", [1e-5, 1e-12, 0.1, 0.9, 1.702, 1e-6, 3.4e38, 0.0, -2.5])
def test_a_short_literal_comes_back_as_written(written):
    assert float32_literal(float(np.float32(written))) == written


def test_any_float32_rounds_back_to_itself():
    rng = np.random.default_rng(0)
    xs = (rng.standard_normal(2000) * 10.0 ** rng.integers(-30, 30, 2000)).astype(np.float32)
    for x in xs:
        assert np.float32(float32_literal(float(x))) == x
    assert float32_literal(float("inf")) == float("inf") and np.isnan(float32_literal(float("nan")))


def test_exported_norm_eps_is_the_modules_and_the_output_bitwise():
    """LayerNorm adds eps to the variance in double: the float32-rounded eps changed its output
    by an ulp; with the module's eps the program's forward is torch's bit for bit."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8, eps=1e-5), nn.BatchNorm1d(4, eps=1e-3))
    x = torch.randn(2, 4, 8) * 1e-3  # small: eps matters
    p = metaopt.export(module.eval(), (x,), dynamic_batch=False)
    eps = sorted(op.attrs["epsilon"] for op in p.ops if "epsilon" in op.attrs)
    assert eps == [1e-5, 1e-3]
    (y,) = metaopt.Executor().run(p, feed={p.inputs[0]: x}, fetch_list=p.outputs, return_numpy=False)
    assert torch.equal(y, module(x).detach())


def test_an_exact_value_that_is_not_its_short_literal_survives_a_save():
    """Our own saves keep a float attr exactly where the import's reading would differ."""
    torch.manual_seed(0)
    p = metaopt.export(nn.Sequential(nn.Linear(4, 4), nn.LeakyReLU(0.2)), (torch.randn(2, 4),))
    (op,) = [op for op in p.ops if op.type == "LeakyRelu"]
    op.attrs["alpha"] = float(np.float32(0.2))  # 0.20000000298...: a float32, not 0.2
    back = metaopt.load(onnx_save.to_model_proto(p))
    (op2,) = [op for op in back.ops if op.type == "LeakyRelu"]
    assert op2.attrs["alpha"] == float(np.float32(0.2))
