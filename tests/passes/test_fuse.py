"""passes/fuse.py with the GELU rows: the exported tanh / erf GELU chains become one Gelu op.

torch exports HF's python GELUs (gelu_new, gelu_fast, BLOOM's bias GELU, gelu_python) as chains
of elementwise ops; the Tanh and Erf rows' `fuse` rules fold each chain into ONNX's Gelu, whose
gradient is torch's own gelu_backward. Linear's fusion is covered in test_import_passes.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from zoo import harness

import metaopt
from metaopt.ir import Op, Program, Var, parse_program
from metaopt.passes.fuse import fuse

_C = math.sqrt(2.0 / math.pi)


def new_gelu(x):  # HF NewGELUActivation (GPT-2's gelu_new)
    return 0.5 * x * (1.0 + torch.tanh(_C * (x + 0.044715 * torch.pow(x, 3.0))))


def fast_gelu(x):  # HF FastGELUActivation
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def bloom_gelu(x):  # transformers' bloom_gelu_forward
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


def erf_gelu(x):  # HF gelu_python
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


class Act(nn.Module):
    """Linear -> activation(s) -> mean: the activation's input is a computed value, as in an MLP."""

    def __init__(self, *acts) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.acts = acts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        y = self.acts[0](h)
        for act in self.acts[1:]:
            y = y + act(h)
        return y.pow(2).mean()


def _export(module: nn.Module) -> metaopt.Program:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8)
    return metaopt.export(module, (x,), name="act")


def _types(p: Program) -> list[str]:
    return [op.type for op in p.ops]


def _module(*acts) -> nn.Module:
    torch.manual_seed(0)
    return Act(*acts)


@pytest.mark.parametrize(
    "case, acts, approximate",
    [("gelu_tanh", (new_gelu, fast_gelu, bloom_gelu), "tanh"), ("gelu_erf", (erf_gelu,), "none")],
)
def test_gelu_chains_fuse_golden(case, acts, approximate, golden):
    p = _export(_module(*acts))
    gelus = [op for op in p.ops if op.type == "Gelu"]
    # One Gelu per spelling, reading the Linear's output; no op of any chain is left.
    assert len(gelus) == len(acts) and {op.attrs["approximate"] for op in gelus} == {approximate}
    assert {op.inputs[0] for op in gelus} == {"fc"}
    assert not {"Tanh", "Erf", "Div"} & set(_types(p))
    text = str(p)
    golden(f"fuse/{case}", text)
    assert str(parse_program(text)) == text


@pytest.mark.parametrize(
    "acts", [(new_gelu,), (fast_gelu,), (bloom_gelu,), (erf_gelu,)], ids=lambda a: a[0].__name__
)
def test_fused_gelu_grads_match_torch(acts):
    """Grads of the fused program against float64 torch on the unfused formula (DESIGN.md bar),
    and the loss to float32 rounding."""
    module = _module(*acts)
    x = torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(1))
    p = _export(module)
    assert "Gelu" in _types(p)
    verdicts = harness.program_verdicts(p, module, (x,))
    assert {v.param for v in verdicts} == {"fc.weight", "fc.bias"}
    assert not [v for v in verdicts if v.wrong], verdicts
    (loss,) = metaopt.Executor().run(p, feed={p.inputs[0]: x}, fetch_list=[p.loss_name], return_numpy=False)
    torch.testing.assert_close(loss, module(x).detach(), rtol=1e-5, atol=1e-6)


class TwoReaders(nn.Module):
    """The tanh-GELU chain with one of its intermediates read again outside it."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.where = where

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        cube = torch.pow(h, 3.0)
        t = torch.tanh(_C * (h + 0.044715 * cube))
        y = 0.5 * h * (1.0 + t)
        extra = {"cube": cube, "tanh": t}[self.where]
        return (y + extra).sum()


@pytest.mark.parametrize("where", ["cube", "tanh"])
def test_no_fusion_when_an_intermediate_has_another_reader(where):
    # Fusing would drop a value something else still reads: the chain stays as exported.
    p = _export(TwoReaders(where))
    assert "Gelu" not in _types(p) and "Tanh" in _types(p)


def test_no_fusion_when_a_constant_differs():
    # 0.0447 is not GELU's 0.044715: a different function, left alone (constants match by value
    # within float32 rounding, not by shape of the chain).
    p = _export(_module(lambda x: 0.5 * x * (1.0 + torch.tanh(_C * (x + 0.0447 * x * x * x)))))
    assert "Gelu" not in _types(p) and "Tanh" in _types(p)


def test_torch_gelu_exports_as_gelu_already():
    # nn.GELU / F.gelu (HF "gelu", "gelu_pytorch_tanh") need no fusion: the exporter writes Gelu.
    p = _export(_module(nn.GELU(approximate="tanh"), nn.GELU()))
    assert sorted(op.attrs["approximate"] for op in p.ops if op.type == "Gelu") == ["none", "tanh"]


def test_fuse_is_pure_and_keeps_program_outputs():
    """A chain whose intermediate is a program output is not fused (the driver's check), and the
    input program is never changed."""
    p = Program("t")
    p.add_var(Var("x", "float32", ("batch", 4), kind="input"))
    consts = {"half": 0.5, "one": 1.0, "rsqrt2": 1.0 / math.sqrt(2.0)}
    for n, v in consts.items():
        p.add_var(Var(n, "float32", (), kind="constant"), torch.tensor(v))
    for n in ("u", "e", "e1", "hx", "y"):
        p.add_var(Var(n, "float32", ("batch", 4)))
    p.inputs = ["x"]
    p.ops = [
        Op("Mul", ["x", "rsqrt2"], ["u"]),
        Op("Erf", ["u"], ["e"]),
        Op("Add", ["e", "one"], ["e1"]),
        Op("Mul", ["x", "half"], ["hx"]),
        Op("Mul", ["hx", "e1"], ["y"], scope="act"),
    ]
    p.outputs = ["y"]
    before = str(p)
    q = fuse(p)
    assert str(p) == before
    assert [(op.type, op.inputs, op.outputs, op.scope) for op in q.ops] == [("Gelu", ["x"], ["y"], "act")]
    assert set(q.vars) == {"x", "y"}  # the chain's values and constants went with it
    p.outputs = ["y", "e1"]
    assert _types(fuse(p)) == ["Mul", "Erf", "Add", "Mul", "Mul"]
