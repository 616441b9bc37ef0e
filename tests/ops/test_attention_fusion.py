"""Fused attention: the exporter's decomposed attention and ONNX `Attention` become one
`ScaledDotProductAttention` op (ops/kernels/attention.py, the Softmax row's `fuse` rule).

Checked here: the fused program's golden text, grads against float64 torch (DESIGN.md's bar),
recompute with dropout bit-identical to no recompute, the dropout live at its ratio and seeded,
the negative case (an intermediate with another reader: nothing fused), ONNX Attention,
and the kernel's non-CPU code path (run on the CPU) against autograd on SDPA.
"""

from __future__ import annotations

import math

import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper
from torch import nn

import metaopt
from metaopt.ops.kernels import attention as attn_kernels
from metaopt.passes.recompute import recompute, resolve_checkpoints

SDPA = "ScaledDotProductAttention"
WIDTH, HEADS, SEQ = 32, 4, 8


class Block(nn.Module):
    """Self-attention over (batch, seq, width); `style` picks how attention is written:
    "sdpa" (F.scaled_dot_product_attention, causal bool mask: what HF's sdpa path exports),
    "eager" (matmul / sqrt(d) + a learned additive bias, softmax, nn.Dropout, matmul: HF eager
    and T5-style position bias, whose grad the fused op must return), "leak" (like eager but the
    probabilities are also read by the loss: must not fuse)."""

    def __init__(self, style: str, dropout: float) -> None:
        super().__init__()
        self.style, self.p = style, dropout
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)
        self.bias = nn.Parameter(0.1 * torch.randn(HEADS, SEQ, SEQ))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.reshape(b, s, HEADS, -1).transpose(1, 2) for t in self.qkv(x).split(WIDTH, -1))
        extra = 0.0
        if self.style == "sdpa":
            causal = torch.ones(s, s, dtype=torch.bool).tril()
            p = self.p if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=causal, dropout_p=p)
        else:
            scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + self.bias
            probs = torch.softmax(scores, -1)
            y = self.drop(probs) @ v
            if self.style == "leak":
                extra = probs.square().mean()
        y = self.out(y.transpose(1, 2).reshape(b, s, WIDTH))
        return y.square().mean() + extra


def _build(style: str, dropout: float) -> nn.Module:
    torch.manual_seed(0)
    return Block(style, dropout).train()


def _x(batch: int, seed: int) -> torch.Tensor:
    return torch.randn(batch, SEQ, WIDTH, generator=torch.Generator().manual_seed(seed))


def _export(style: str, dropout: float) -> tuple[nn.Module, metaopt.Program]:
    module = _build(style, dropout)
    return module, metaopt.export(module, (_x(2, 0),), name=f"attention_{style}")


def _types(p: metaopt.Program) -> list[str]:
    return [op.type for op in p.ops]


def test_golden_fused_sdpa(golden):
    _, program = _export("sdpa", 0.1)
    golden("fuse/attention_sdpa", str(program))
    (op,) = [op for op in program.ops if op.type == SDPA]
    # The repaired train-mode Dropout was folded in (not lost): its ratio is the op's dropout_p.
    assert op.attrs["dropout_p"] == pytest.approx(0.1)
    assert op.attrs["scale"] == pytest.approx(1 / math.sqrt(WIDTH // HEADS))
    assert not {"Softmax", "Dropout", "IsNaN"} & set(_types(program))
    metaopt.verify(program)


@pytest.mark.parametrize("style", ["sdpa", "eager"])
def test_grads_match_torch_float64(style):
    from zoo.harness import program_verdicts

    module, program = _export(style, 0.0)
    assert SDPA in _types(program) and "Softmax" not in _types(program)
    inputs = (_x(3, 1),)  # another batch size than the export's: the batch dim is symbolic
    verdicts = program_verdicts(program, module, inputs)
    assert {v.param for v in verdicts} >= {"qkv.weight", "out.weight"}
    if style == "eager":  # the learned additive bias gets its grad through the fused op
        assert "bias" in {v.param for v in verdicts}
    wrong = [v for v in verdicts if v.wrong]
    assert not wrong, wrong


def _train(program: metaopt.Program, steps: int = 2) -> list[list[torch.Tensor]]:
    exe = metaopt.Executor("cpu")
    metaopt.seed(1234)
    grads = [f"{v.name}@GRAD" for v in program.params() if f"{v.name}@GRAD" in program.vars]
    return [
        exe.run(program, feed={"x": _x(3, 20 + i)}, fetch_list=[program.loss, *grads], return_numpy=False)
        for i in range(steps)
    ]


@pytest.mark.parametrize("style", ["sdpa", "eager"])
def test_recompute_with_dropout_is_bit_identical(style):
    _, program = _export(style, 0.3)
    base = program.clone()
    metaopt.optimizer.SGD(learning_rate=0.05).minimize(base.loss)
    rec = recompute(base, checkpoints=resolve_checkpoints(base, ["qkv", "out"]))
    replays = [op for op in rec.ops if op.type == "RngReplay" and op.attrs["op"] == SDPA]
    assert len(replays) == 1  # the fused op is re-run from its recorded generator state
    ref, got = _train(base), _train(rec)
    for a, b in zip(ref, got, strict=True):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)


def test_dropout_is_live_at_its_ratio_and_seeded():
    """The fused op's dropout is on in the training program, drops about its ratio of the
    probabilities and scales the rest by 1 / (1 - p) exactly, draws the same masks again under the
    same seed and others under another. (Its masks are not the unfused Dropout's: it draws 32 bits
    per entry, not native_dropout's bernoulli; see ops/kernels/attention.py.)"""
    _, fused = _export("eager", 0.3)
    base = fused.clone()
    metaopt.optimizer.SGD(learning_rate=0.05).minimize(base.loss)
    (op,) = [op for op in base.ops if op.type == SDPA]  # the backward made it keep P and P'
    probs_name, dropped_name = op.outputs[1], op.outputs[2]

    def draw(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        metaopt.seed(seed)
        exe = metaopt.Executor("cpu")
        return tuple(
            exe.run(base, feed={"x": _x(64, 0)}, fetch_list=[probs_name, dropped_name], return_numpy=False)
        )

    probs, dropped = draw(7)
    keep = dropped != 0
    # 64 x 4 x 8 x 8 = 16384 draws at p = 0.3: the kept share's standard deviation is 0.0036, so
    # 0.03 either side is over 8 sigma (a wrong ratio or a dead dropout fails, chance does not)
    assert abs(keep.double().mean().item() - 0.7) < 0.03
    # the kept entries are the probabilities times 1 / (1 - p), computed as native_dropout does
    torch.testing.assert_close(dropped, probs * keep * (1 / (1 - 0.3)), rtol=0, atol=0)
    again, other = draw(7)[1], draw(8)[1]
    assert torch.equal(again, dropped)
    assert not torch.equal(other, dropped)


def test_intermediate_with_another_reader_is_not_fused():
    module, program = _export("leak", 0.0)
    assert SDPA not in _types(program)
    assert "Softmax" in _types(program) and _types(program).count("MatMul") == 2


def test_onnx_attention_is_fused_and_exact():
    b, h, s, d = 2, HEADS, SEQ, 8
    shape = [b, h, s, d]
    node = helper.make_node("Attention", ["Q", "K", "V", "M"], ["Y"], scale=0.3)
    graph = helper.make_graph(
        [node],
        "attn",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in "QKV"]
        + [helper.make_tensor_value_info("M", TensorProto.FLOAT, [1, 1, s, s])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, shape)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    onnx.checker.check_model(model)
    program = metaopt.load(model.SerializeToString())
    assert _types(program) == [SDPA]
    g = torch.Generator().manual_seed(0)
    feed = {n: torch.randn(shape, generator=g) for n in "QKV"}
    feed["M"] = torch.randn(1, 1, s, s, generator=g)
    feed["M"][..., 0, :] = -math.inf  # a fully masked row: ONNX (and SDPA's safe softmax) give 0
    (y,) = metaopt.Executor("cpu").run(program, feed=feed, fetch_list=["Y"], return_numpy=False)
    want = attn_kernels.attention(feed["Q"], feed["K"], feed["V"], feed["M"], scale=0.3)
    torch.testing.assert_close(y, want)


@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
@pytest.mark.parametrize("flash_cpu", [True, False])
def test_kernels_against_autograd_on_sdpa(monkeypatch, dropout_p, flash_cpu):
    """Forward and fused backward against torch autograd on SDPA's math (float64, same mask);
    flash_cpu=False runs the code path other devices take."""
    monkeypatch.setattr(attn_kernels, "_flash_cpu", lambda q: flash_cpu)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.randn(3, 5, 5, generator=g, dtype=torch.float64)
    mask[1, 2, :] = -math.inf  # a dead row: zeros, no NaN
    dy = torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64)
    nout = 3 if dropout_p else 2
    outs = attn_kernels.scaled_dot_product_attention(
        q, k, v, mask, scale=0.7, dropout_p=dropout_p, _nout=nout
    )
    y, saved = outs[0], outs[1:]
    grads = attn_kernels.scaled_dot_product_attention_grad(
        dy, q, k, v, y, mask, *saved, scale=0.7, dropout_p=dropout_p, mask=[1, 1, 1, 1]
    )
    xs = [t.clone().requires_grad_(True) for t in (q, k, v, mask)]
    scores = xs[0] @ xs[1].transpose(-1, -2) * 0.7 + xs[3]
    dead = torch.isneginf(mask).all(-1, keepdim=True)  # SDPA's safe softmax, without NaN in autograd
    probs = torch.softmax(scores.masked_fill(dead, 0.0), -1).masked_fill(dead, 0.0)
    if dropout_p:  # the kernel's own mask (kept where its dropped probabilities are not 0), so
        # both sides drop the same entries; where a probability is 0 the mask does not matter
        keep = saved[1] != 0
        assert 0.4 < keep.double().mean() < 1.0  # some dropped, most kept at p=0.25
        # native_dropout scales by 1 / (1 - p): exactly the kept probabilities times that
        torch.testing.assert_close(saved[1], saved[0] * keep * (1 / (1 - dropout_p)), rtol=0, atol=0)
        probs = probs * keep / (1 - dropout_p)
    want = probs @ xs[2]
    want.backward(dy)
    torch.testing.assert_close(y, want.detach())
    for got, x in zip(grads, xs, strict=True):
        torch.testing.assert_close(got, x.grad)
