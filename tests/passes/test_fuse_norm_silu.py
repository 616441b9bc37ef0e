"""passes/fuse.py with the RMSNorm and SiLU rows: the chains torch exports for HF's RMSNorm
(LLaMA, Mistral, Qwen, Gemma, T5) and for nn.SiLU / the SiLU-gated MLP (SwiGLU) become one op
each, whose gradient rule reads only the op's inputs.

ReduceMean's `fuse` rule folds ``w * (x * 1/sqrt(mean(x**2, -1) + eps))`` into `RMSNorm`;
Sigmoid's folds ``x * sigmoid(x)`` into `Silu`, ``silu(a) * b`` into `SiluMul`, and CLIP's
QuickGELU ``x * sigmoid(1.702 * x)`` into `QuickGelu`.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import nn
from zoo import harness

import metaopt
from metaopt.frontend import onnx_save
from metaopt.ir import parse_program
from metaopt.ops import registry
from metaopt.passes.backward import append_backward


class LlamaRMSNorm(nn.Module):  # transformers' LlamaRMSNorm, float32 model
    def __init__(self, h: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(h))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


class SpelledNorm(nn.Module):
    """Other spellings: x * x, x / sqrt, the weight on the right, Gemma's (1 + w)."""

    def __init__(self, h: int, gemma: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(0.1 * torch.randn(h))
        self.gemma = gemma

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5)
        w = 1.0 + self.weight if self.gemma else self.weight
        return n * w


class GatedMLP(nn.Module):  # LlamaMLP: down(silu(gate(x)) * up(x))
    def __init__(self, h: int, f: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(h, f, bias=bias)
        self.up_proj = nn.Linear(h, f, bias=bias)
        self.down_proj = nn.Linear(f, h, bias=bias)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """RMSNorm -> gated MLP -> residual, then RMSNorm -> Linear -> plain SiLU -> sum."""

    def __init__(self, norm: nn.Module | None = None, h: int = 8) -> None:
        super().__init__()
        self.norm = norm if norm is not None else LlamaRMSNorm(h)
        self.mlp = GatedMLP(h, 12)
        self.final_norm = LlamaRMSNorm(h)
        self.fc = nn.Linear(h, h)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mlp(self.norm(x))
        return self.act(self.fc(self.final_norm(x))).sum()


def _export(module: nn.Module, name: str = "block") -> metaopt.Program:
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0))
    return metaopt.export(module, (x,), name=name)


def _types(p: metaopt.Program) -> list[str]:
    return [op.type for op in p.ops]


def _module(norm=None) -> nn.Module:
    torch.manual_seed(0)
    return Block(norm)


def test_rms_norm_and_silu_chains_fuse_golden(golden):
    p = _export(_module())
    types = _types(p)
    assert types.count("RMSNorm") == 2 and types.count("SiluMul") == 1 and types.count("Silu") == 1
    # nothing of the chains is left
    assert not {"Sigmoid", "ReduceMean", "Pow", "Sqrt", "Reciprocal", "Div"} & set(types)
    (gate,) = [op for op in p.ops if op.type == "SiluMul"]
    assert gate.inputs == ["mlp.gate_proj", "mlp.up_proj"]
    norms = [op for op in p.ops if op.type == "RMSNorm"]
    assert [op.inputs for op in norms] == [["x", "norm.weight"], ["add", "final_norm.weight"]]
    assert all(op.attrs["epsilon"] == pytest.approx(1e-6) for op in norms)
    text = str(p)
    golden("fuse/rms_norm_silu", text)
    assert str(parse_program(text)) == text


@pytest.mark.parametrize(
    "make_norm",
    [lambda: None, lambda: SpelledNorm(8, gemma=False), lambda: SpelledNorm(8, gemma=True)],
    ids=["llama", "spelled", "gemma"],
)
def test_fused_grads_match_float64_torch(make_norm):
    """Grads of the fused program against float64 torch on the unfused module (DESIGN.md's bar:
    wrong when ratio > 100 and rel > 1e-4), and the loss to float32 rounding."""
    torch.manual_seed(2)  # the norm's weights: made here, not at collection
    module = _module(make_norm())
    x = torch.randn(4, 5, 8, generator=torch.Generator().manual_seed(1))
    p = _export(module)
    assert _types(p).count("RMSNorm") == 2 and "SiluMul" in _types(p)
    verdicts = harness.program_verdicts(p, module, (x,))
    assert {v.param for v in verdicts} == {n for n, _ in module.named_parameters()}
    assert not [v for v in verdicts if v.wrong], verdicts
    (loss,) = metaopt.Executor().run(p, feed={p.inputs[0]: x}, fetch_list=[p.loss_name], return_numpy=False)
    torch.testing.assert_close(loss, module(x).detach(), rtol=1e-5, atol=1e-6)


def test_fused_rms_norm_forward_is_bit_for_bit_the_eager_module():
    """RMSNorm runs torch's rms_norm, which computes LlamaRMSNorm's rsqrt form exactly (with the
    exported float32 epsilon): equal, not close, over inputs of different scales."""
    torch.manual_seed(0)
    norm = LlamaRMSNorm(64)
    p = metaopt.export(norm, (torch.randn(2, 7, 64),), name="norm")
    assert [op.type for op in p.ops] == ["RMSNorm"]
    for scale in (1e-3, 1.0, 1e3):
        x = scale * torch.randn(3, 7, 64, generator=torch.Generator().manual_seed(int(scale * 1000)))
        (y,) = metaopt.Executor().run(p, feed={p.inputs[0]: x}, fetch_list=[p.outputs[0]], return_numpy=False)
        assert torch.equal(y, norm(x).detach())


def test_fused_backward_holds_fewer_values():
    """The point of the fusion besides speed: the backward reads the ops' inputs only, so the
    chain's x / rms, sigmoid(a) and silu(a) are no longer held from the forward."""
    p = _export(_module())
    q, _ = append_backward(p, loss=p.loss_name)
    read_by_backward = {x for op in q.ops if op.role == "backward" for x in op.inputs}
    forward_made = {o for op in q.ops if op.role == "forward" for o in op.outputs}
    held = read_by_backward & forward_made
    assert "mlp.gate_proj" in held and "mlp.up_proj" in held  # SiluMulGrad's inputs
    assert not any(name.startswith("norm/") or name.startswith("final_norm/") for name in held), held


class SharedIntermediate(nn.Module):
    def __init__(self, where: str) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.up = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.ones(8))
        self.where = where

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        var = h.pow(2).mean(-1, keepdim=True)
        n = self.w * (h * torch.rsqrt(var + 1e-6))
        s = torch.sigmoid(n)
        g = n * s
        y = g * self.up(x)
        extra = {"var": var, "sigmoid": s, "silu": g, "none": 0.0}[self.where]
        return (y + extra).sum()


@pytest.mark.parametrize(
    "where, kept, gone",
    [
        ("var", {"ReduceMean", "SiluMul"}, {"RMSNorm"}),  # the variance is read again
        ("sigmoid", {"RMSNorm", "Sigmoid"}, {"Silu", "SiluMul"}),  # sigmoid(a) read again
        ("silu", {"RMSNorm", "Silu", "Mul"}, {"SiluMul", "Sigmoid"}),  # silu(a) read again: no gate
        ("none", {"RMSNorm", "SiluMul"}, {"Sigmoid", "ReduceMean"}),
    ],
)
def test_no_fusion_of_a_value_read_elsewhere(where, kept, gone):
    torch.manual_seed(0)
    p = _export(SharedIntermediate(where), name="shared")
    types = set(_types(p))
    assert kept <= types and not gone & types, types


class NotAnRMSNorm(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(5))
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "axis":  # the mean over dim 1, not the last one
            return (x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-6)).sum()
        if self.how == "cube":  # x**3, not x**2
            return (x * torch.rsqrt(x.pow(3).mean(-1, keepdim=True) + 1e-6)).sum()
        if self.how == "no_scale":  # no weight: nothing to fuse into
            return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).sum()
        # a scale broadcast along another dim than the normalized one
        return (self.w.view(1, 5, 1) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))).sum()


@pytest.mark.parametrize("how", ["axis", "cube", "no_scale", "scale_shape"])
def test_other_formulas_are_left_alone(how):
    p = metaopt.export(NotAnRMSNorm(how), (torch.randn(2, 5, 8),), name="other")
    assert "RMSNorm" not in _types(p) and "ReduceMean" in _types(p)


def test_silu_times_a_broadcast_value_is_silu_then_mul():
    # SiluMul's inputs have one shape (ONNX's SwiGLU too): a gate broadcast from [8] is not one.
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.g = nn.Parameter(torch.ones(8))

        def forward(self, x):
            return (nn.functional.silu(self.fc(x)) * self.g).sum()

    p = metaopt.export(M(), (torch.randn(2, 3, 8),), name="bcast")
    assert "Silu" in _types(p) and "SiluMul" not in _types(p) and "Sigmoid" not in _types(p)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_grad_kernels_match_autograd(dtype, tol):
    """RMSNormGrad, SiluGrad and SiluMulGrad against autograd on the unfused formulas (float64:
    to rounding; float32: the kernels' different reduction order, rtol 1e-5), every mask."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 4, 16, generator=g, dtype=dtype, requires_grad=True)
    w = (1.0 + 0.1 * torch.randn(16, generator=g, dtype=dtype)).requires_grad_()
    dy = torch.randn(3, 4, 16, generator=g, dtype=dtype)
    y = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    kernel = registry.get("RMSNormGrad").kernel
    got_dx, got_dw = kernel(dy, x.detach(), w.detach(), epsilon=1e-6)
    torch.testing.assert_close(got_dx, dx, rtol=tol, atol=tol)
    torch.testing.assert_close(got_dw, dw, rtol=tol, atol=tol)
    only_dw = kernel(dy, x.detach(), w.detach(), epsilon=1e-6, mask=[0, 1])
    assert only_dw[0] is None and torch.equal(only_dw[1], got_dw)

    a = torch.randn(3, 4, 16, generator=g, dtype=dtype, requires_grad=True)
    b = torch.randn(3, 4, 16, generator=g, dtype=dtype, requires_grad=True)
    da, db = torch.autograd.grad(a * torch.sigmoid(a) * b, (a, b), dy)
    got_da, got_db = registry.get("SiluMulGrad").kernel(dy, a.detach(), b.detach())
    torch.testing.assert_close(got_da, da, rtol=tol, atol=tol)
    torch.testing.assert_close(got_db, db, rtol=tol, atol=tol)
    (da_silu,) = torch.autograd.grad(a * torch.sigmoid(a), (a,), dy)
    torch.testing.assert_close(registry.get("SiluGrad").kernel(dy, a.detach()), da_silu, rtol=tol, atol=tol)


def test_rms_norm_grad_in_bfloat16_is_computed_in_float32():
    # Half inputs: statistics and sums in float32, one rounding at the end (as torch's norms).
    g = torch.Generator().manual_seed(4)
    x, dy = torch.randn(2, 8, 64, generator=g), torch.randn(2, 8, 64, generator=g)
    w = 1.0 + 0.1 * torch.randn(64, generator=g)
    kernel = registry.get("RMSNormGrad").kernel
    want_dx, want_dw = kernel(dy, x, w, epsilon=1e-6)
    dx, dw = kernel(dy.bfloat16(), x.bfloat16(), w.bfloat16(), epsilon=1e-6)
    assert dx.dtype == dw.dtype == torch.bfloat16
    # the inputs' own bf16 rounding (2**-8 relative) dominates: well inside a few bf16 ulps
    torch.testing.assert_close(dx.float(), want_dx, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(dw.float(), want_dw, rtol=3e-2, atol=3e-2)


def test_saved_program_runs_in_onnxruntime(tmp_path):
    """RMSNorm, Silu and SiluMul are saved with standard-ops function bodies (opset 20), so
    ONNX Runtime runs the fused program; its loss equals ours to float32 rounding."""
    _assert_onnxruntime_agrees(_export(_module()), tmp_path / "block.onnx", seed=5)


def _assert_onnxruntime_agrees(p: metaopt.Program, path, seed: int) -> None:
    """Saved to `path`, `p` runs in ONNX Runtime (graph optimizations off: the function bodies
    as written) with our loss to float32 rounding, and loads back as the same program."""
    onnx_save.save(p, path)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(seed).standard_normal((3, 5, 8)).astype(np.float32)
    (theirs,) = sess.run([p.loss_name], {p.inputs[0]: x})
    (ours,) = metaopt.Executor("cpu").run(p, feed={p.inputs[0]: x}, fetch_list=[p.loss_name])
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    assert str(metaopt.load(path)) == str(p)


class QuickGELU(nn.Module):  # transformers' QuickGELUActivation (CLIP, OWL-ViT, X-CLIP)
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


class ClipMLP(nn.Module):
    def __init__(self, act: nn.Module | None = None) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = act or QuickGELU()
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x))).square().sum()


def test_quick_gelu_fuses_golden(golden):
    torch.manual_seed(0)
    p = _export(ClipMLP(), name="clip_mlp")
    assert _types(p) == ["Linear", "QuickGelu", "Linear", "Pow", "ReduceSum"]
    (op,) = [op for op in p.ops if op.type == "QuickGelu"]
    assert op.inputs == ["fc1"] and op.attrs["alpha"] == pytest.approx(1.702, rel=1e-7)
    text = str(p)
    golden("fuse/quick_gelu", text)
    assert str(parse_program(text)) == text


def test_quick_gelu_grads_match_float64_torch_and_forward_is_the_eager_module():
    """Grads against float64 torch on the unfused module (DESIGN.md's bar); the forward is the
    module's own arithmetic in the same order: equal, not close."""
    torch.manual_seed(2)
    module = ClipMLP()
    x = torch.randn(4, 5, 8, generator=torch.Generator().manual_seed(1))
    p = _export(module, name="clip_mlp")
    assert "QuickGelu" in _types(p)
    verdicts = harness.program_verdicts(p, module, (x,))
    assert {v.param for v in verdicts} == {n for n, _ in module.named_parameters()}
    assert not [v for v in verdicts if v.wrong], verdicts
    h = module.fc1(x).detach()
    (got,) = metaopt.Executor().run(p, feed={p.inputs[0]: x}, fetch_list=["act"], return_numpy=False)
    assert torch.equal(got, module.act(h))


def test_quick_gelu_backward_reads_only_its_input():
    p = _export(ClipMLP(), name="clip_mlp")
    q, _ = append_backward(p, loss=p.loss_name)
    (grad,) = [op for op in q.ops if op.type == "QuickGeluGrad"]
    assert grad.inputs[1:] == ["fc1"] and grad.attrs["alpha"] == pytest.approx(1.702, rel=1e-7)


class ScaledSigmoidElsewhere(nn.Module):
    def __init__(self, where: str) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.where = where

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.where == "tensor_scale":  # a per-feature scale is not QuickGELU's scalar
            return (h * torch.sigmoid(h * torch.linspace(1.0, 2.0, 8))).sum()
        if self.where == "other_input":  # sigmoid of a scaled other value
            return (h * torch.sigmoid(1.702 * x)).sum()
        ax = 1.702 * h
        return (h * torch.sigmoid(ax) + ax).sum()  # the scaled value read again


@pytest.mark.parametrize("where", ["tensor_scale", "other_input", "scaled_read_again"])
def test_quick_gelu_left_alone_when_it_is_not_one(where):
    torch.manual_seed(0)
    p = _export(ScaledSigmoidElsewhere(where), name="not_quick")
    assert "QuickGelu" not in _types(p) and "Sigmoid" in _types(p)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_quick_gelu_grad_kernel_matches_autograd(dtype, tol):
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 4, 16, generator=g, dtype=dtype, requires_grad=True)
    dy = torch.randn(3, 4, 16, generator=g, dtype=dtype)
    (want,) = torch.autograd.grad(x * torch.sigmoid(1.702 * x), (x,), dy)
    got = registry.get("QuickGeluGrad").kernel(dy, x.detach(), alpha=1.702)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_quick_gelu_saved_program_runs_in_onnxruntime(tmp_path):
    _assert_onnxruntime_agrees(_export(ClipMLP(), name="clip_mlp"), tmp_path / "clip_mlp.onnx", seed=7)
