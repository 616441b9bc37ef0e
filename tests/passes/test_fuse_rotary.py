"""passes/fuse.py with Concat's rotary row (ops/kernels/rotary.py): Hugging Face's
``q * cos + rotate_half(q) * sin`` (LLaMA, Mistral, Qwen, Gemma, GPT-NeoX, Phi) becomes one
`Rotary` op, bit for bit the chain's forward, whose gradient reads cos and sin only."""

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
from metaopt.ops.sharding import Shard, ShardArgs, ShardRefused, rule


def rotate_half(x: torch.Tensor) -> torch.Tensor:  # transformers' rotate_half
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class Rope(nn.Module):
    """Projections of q and k, transformers' apply_rotary_pos_emb (cos/sin from inv_freq and the
    positions, unsqueezed over heads), then a loss reading both. `spell` changes the formula:
    "swapped" writes the terms and factors the other way round (still a rotation), "sum" adds
    the halves the wrong way (cat(x2, x1): not rotate_half), "third" slices at d/3."""

    def __init__(self, spell: str = "hf", heads: int = 2, dim: int = 8) -> None:
        super().__init__()
        self.q = nn.Linear(heads * dim, heads * dim, bias=False)
        self.k = nn.Linear(heads * dim, heads * dim, bias=False)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)))
        self.heads, self.dim, self.spell = heads, dim, spell

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        if self.spell == "sum":
            h = x.shape[-1] // 2
            return torch.cat((x[..., h:], x[..., :h]), dim=-1)
        if self.spell == "third":
            h = x.shape[-1] // 3
            return torch.cat((-x[..., h:], x[..., :h]), dim=-1)
        return rotate_half(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        pos = torch.arange(s, dtype=torch.float32)[None, :].expand(b, -1)
        freqs = pos[..., None] * self.inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[:, None], emb.sin()[:, None]
        q = self.q(x).view(b, s, self.heads, self.dim).transpose(1, 2)
        k = self.k(x).view(b, s, self.heads, self.dim).transpose(1, 2)
        if self.spell == "swapped":
            q, k = sin * self._rotate(q) + cos * q, sin * self._rotate(k) + cos * k
        else:
            q, k = q * cos + self._rotate(q) * sin, k * cos + self._rotate(k) * sin
        return (q @ k.transpose(-1, -2)).tanh().sum()


def _export(module: nn.Module) -> tuple[metaopt.Program, torch.Tensor]:
    x = torch.randn(2, 5, module.heads * module.dim, generator=torch.Generator().manual_seed(0))
    return metaopt.export(module, (x,), name="rope"), x


def _types(p: metaopt.Program) -> list[str]:
    return [op.type for op in p.ops]


def test_rotary_chain_fuses_golden(golden):
    torch.manual_seed(0)
    p, _ = _export(Rope())
    types = _types(p)
    assert types.count("Rotary") == 2
    # nothing of rotate_half is left; the two Slices left are cos[:, None] and sin[:, None]
    assert not {"Neg", "Add"} & set(types) and types.count("Slice") == 2
    for op in (op for op in p.ops if op.type == "Rotary"):
        x, cos, sin = op.inputs
        assert p.vars[x].shape == ("batch", 2, 5, 8)
        assert p.vars[cos].shape == p.vars[sin].shape == ("batch", 1, 5, 8)
    text = str(p)
    golden("fuse/rotary", text)
    assert str(parse_program(text)) == text


@pytest.mark.parametrize("spell", ["hf", "swapped"])
def test_fused_forward_is_bit_for_bit_the_module_and_grads_match_float64(spell):
    """The same ops in the same order as the module: the loss is equal, not close; the grads
    against float64 torch on the unfused module (DESIGN.md's bar)."""
    torch.manual_seed(1)
    module = Rope(spell)
    p, x = _export(module)
    assert _types(p).count("Rotary") == 2
    (loss,) = metaopt.Executor().run(p, feed={p.inputs[0]: x}, fetch_list=[p.loss_name], return_numpy=False)
    assert torch.equal(loss, module(x).detach())
    verdicts = harness.program_verdicts(p, module, (x,))
    assert {v.param for v in verdicts} == {"q.weight", "k.weight"}
    assert not [v for v in verdicts if v.wrong], verdicts


@pytest.mark.parametrize("spell", ["sum", "third"])
def test_what_is_not_a_rotation_is_left_alone(spell):
    torch.manual_seed(0)
    p, _ = _export(Rope(spell))
    assert "Rotary" not in _types(p)


def test_backward_reads_cos_and_sin_only():
    """RotaryGrad reads the incoming grad, cos and sin: q and k themselves are not held for it
    (before, the generic rule re-ran each rotation's two Slices from q under autograd)."""
    torch.manual_seed(0)
    p, _ = _export(Rope())
    metaopt.fleet.init(is_collective=True)
    opt = metaopt.fleet.distributed_optimizer(metaopt.optimizer.SGD(learning_rate=0.1))
    opt.minimize(p.loss)
    fwd = {op.outputs[0]: op for op in p.ops if op.type == "Rotary"}
    grads = [op for op in p.ops if op.type == "RotaryGrad"]
    assert len(grads) == 2
    # the loss's sum over a symbolic batch has its own rule too (ReduceGrad): nothing is generic
    assert [op.attrs["op"] for op in p.ops if op.type == "Vjp"] == []
    assert [op.type for op in p.ops if op.type == "ReduceGrad"] == ["ReduceGrad"]
    for g in grads:
        rot = fwd[g.origin]
        assert g.inputs[1:] == rot.inputs[1:] and rot.inputs[0] not in g.inputs


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_grad_kernel_matches_autograd(dtype, tol):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 4, 6, dtype=dtype, generator=g, requires_grad=True)
    cos, sin = (
        torch.randn(2, 1, 4, 6, dtype=dtype, generator=g),
        torch.randn(2, 1, 4, 6, dtype=dtype, generator=g),
    )
    dy = torch.randn(2, 3, 4, 6, dtype=dtype, generator=g)
    y = x * cos + rotate_half(x) * sin
    (want,) = torch.autograd.grad(y, x, dy)
    assert torch.equal(registry.get("Rotary").kernel(x.detach(), cos, sin), y.detach())
    torch.testing.assert_close(registry.get("RotaryGrad").kernel(dy, cos, sin), want, rtol=tol, atol=tol)


def _shard_args(op_type: str, axis: int) -> ShardArgs:
    op = metaopt.ir.Op(op_type, ["x", "cos", "sin"], ["y"])
    x, cs = (2, 4, 5, 8), (2, 1, 5, 8)
    return ShardArgs(op, [Shard(axis, (x[axis],)), None, None], [x, cs, cs], [x], 2, lambda _: None)


@pytest.mark.parametrize("op_type", ["Rotary", "RotaryGrad"])
def test_split_over_heads_passes_and_over_the_rotated_axis_is_refused(op_type):
    res = rule(op_type).propagate(_shard_args(op_type, 1))
    assert res.outputs == [Shard(1, (4,))]
    with pytest.raises(ShardRefused, match="rotated"):
        rule(op_type).propagate(_shard_args(op_type, 3))


def test_saved_program_runs_in_onnxruntime(tmp_path):
    """Rotary is saved with a standard-ops function body (opset 20): ONNX Runtime runs the fused
    program with our loss to float32 rounding, and it loads back as the same program."""
    torch.manual_seed(0)
    p, _ = _export(Rope())
    path = tmp_path / "rope.onnx"
    onnx_save.save(p, path)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(4).standard_normal((3, 5, 16)).astype(np.float32)
    (theirs,) = sess.run([p.loss_name], {p.inputs[0]: x})
    (ours,) = metaopt.Executor("cpu").run(p, feed={p.inputs[0]: x}, fetch_list=[p.loss_name])
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)
    assert str(metaopt.load(path)) == str(p)
