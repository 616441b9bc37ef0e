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
@pytest.mark.parametrize("dmask", [True, False])
def test_kernels_against_autograd_on_sdpa(dropout_p, dmask):
    """Forward and fused backward against torch autograd on SDPA's math (float64, same mask);
    without the mask's grad torch's flash CPU backward runs, with it our torch-ops one."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.randn(3, 5, 5, generator=g, dtype=torch.float64)
    mask[1, 2, :] = -math.inf  # a dead row: zeros, no NaN
    dy = torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64)
    forms = attn_kernels.saved_forms(q.shape, k.shape, "float64", v.shape, dropout_p)
    outs = attn_kernels.scaled_dot_product_attention(
        q, k, v, mask, scale=0.7, dropout_p=dropout_p, _nout=1 + len(forms)
    )
    y, saved = outs[0], outs[1:]
    assert [t is None for t in saved] == [f[3] == "cuda" for f in forms]  # the CUDA form's: None here
    grads = attn_kernels.scaled_dot_product_attention_grad(
        dy, q, k, v, y, mask, *saved, scale=0.7, dropout_p=dropout_p, mask=[1, 1, 1, int(dmask)]
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
        if x is xs[3] and not dmask:
            assert got is None
            continue
        torch.testing.assert_close(got, x.grad)


CUDA_FORM_DEVICES = [
    "meta",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
]


@pytest.mark.parametrize("device", CUDA_FORM_DEVICES)
@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_cuda_form_makes_what_the_program_declares(device, dropout_p, dtype):
    """On CUDA, and on the meta device that stands in for it in CI, the op runs torch's
    memory-efficient kernel: each saved output has the shape and dtype `saved_forms` declares
    for CUDA (logsumexp rows padded to 32, philox seed and offset), the CPU's are None, and the
    backward gives grads of the inputs' shapes; a mask of 77 keys (not 16-aligned) is padded
    for the kernel (benchmarks/gpu.sh runs the cuda case)."""
    b, h, sq, sk, d = 2, 3, 77, 77, 16
    q, k, v = (torch.randn(b, h, n, d, device=device).to(dtype) for n in (sq, sk, sk))
    mask = torch.zeros(b, 1, sq, sk, dtype=dtype, device=device)
    forms = attn_kernels.saved_forms(q.shape, k.shape, str(dtype).removeprefix("torch."), v.shape, dropout_p)
    outs = attn_kernels.scaled_dot_product_attention(
        q, k, v, mask, scale=0.25, dropout_p=dropout_p, _nout=1 + len(forms)
    )
    y, saved = outs[0], outs[1:]
    assert y.shape == q.shape[:3] + (d,) and y.dtype == dtype
    for (tag, shape, dt, device), t in zip(forms, saved, strict=True):
        if device == "cpu":
            assert t is None, tag
            continue
        assert tuple(t.shape) == tuple(shape) and str(t.dtype) == f"torch.{dt}", (tag, t.shape, t.dtype)
    assert forms[-3][1] == (b, h, 96)  # 77 rows padded to 96
    grads = attn_kernels.scaled_dot_product_attention_grad(
        torch.empty_like(y), q, k, v, y, mask, *saved, scale=0.25, dropout_p=dropout_p, mask=[1, 1, 1, 1]
    )
    assert [tuple(g.shape) for g in grads] == [tuple(x.shape) for x in (q, k, v, mask)]


def test_the_cuda_form_refuses_a_program_that_saved_only_the_cpus_outputs():
    q = torch.empty(1, 2, 8, 4, device="meta")
    with pytest.raises(NotImplementedError, match="minimize the forward program again"):
        attn_kernels.scaled_dot_product_attention_grad(q, q, q, q, q, None, q, scale=0.5)


def test_the_training_program_declares_both_devices_saved_outputs_and_keeps_them_in_onnx(tmp_path):
    """The minimized program holds the CPU's and the CUDA form's saved outputs, each marked with
    its device; saved to ONNX and loaded back they stay marked, and the memory estimate for
    each device counts only its own (the CPU's probabilities, the CUDA's logsumexp)."""
    from metaopt.frontend.onnx_save import save
    from metaopt.passes.memory_estimate import estimate_memory

    _, program = _export("sdpa", 0.1)
    metaopt.optimizer.SGD(learning_rate=0.1).minimize(program.loss)
    (op,) = [op for op in program.ops if op.type == SDPA]
    devices = [program.vars[o].device for o in op.outputs[1:]]
    assert devices == [
        "cpu",
        "cpu",
        "cuda",
        "cuda",
        "cuda",
        "cuda",
    ]  # PROBS, DROPPED; OUT, LSE32, SEED, OFFSET
    save(program, tmp_path / "train.onnx")
    loaded = metaopt.load(tmp_path / "train.onnx")
    assert [loaded.vars[o].device for o in op.outputs[1:]] == devices
    at = program.ops.index(op)
    on = {d: estimate_memory(program, dims={"batch": 2}, device=d).timeline for d in ("cpu", "cuda")}
    saved = {
        d: sum(program.vars[o].nbytes({"batch": 2}) for o in op.outputs[1:] if program.vars[o].device == d)
        for d in on
    }
    assert on["cpu"][at] - on["cuda"][at] == saved["cpu"] - saved["cuda"] > 0
