"""The fused LM head + softmax cross-entropy (passes/fuse_linear_cross_entropy.py,
ops/kernels/loss.py LinearCrossEntropy): kernel against torch, the pass on the reference GPT
(bias-free tied head, causal shift slices) and BERT (Linear head with bias, tied, two losses),
exactness by the float64 metric, ignore_index, uneven chunks, AMP, recompute and offload
bit-identity, memory, ONNX, Fleet wiring and the cases it must leave alone."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from conftest import exported
from zoo.harness import judge_grads, torch_grads

import metaopt
import programs
from metaopt.ir import parse_program, verify
from metaopt.ops import registry
from metaopt.passes.amp import amp
from metaopt.passes.backward import append_backward
from metaopt.passes.fuse_linear_cross_entropy import (
    FuseLinearCrossEntropyError,
    apply_fuse_linear_cross_entropy,
    plan_fuse_linear_cross_entropy,
)
from metaopt.passes.memory_estimate import estimate_memory
from metaopt.passes.offload import offload
from metaopt.passes.recompute import recompute, resolve_checkpoints

CHUNK = 7  # divides neither GPT's 4 x 15 shifted tokens nor BERT's 4 x 16 tokens


def _fused(p, **kw):
    plan = plan_fuse_linear_cross_entropy(p, min_classes=0, chunk_size=kw.pop("chunk_size", CHUNK), **kw)
    return apply_fuse_linear_cross_entropy(p, plan), plan


def _grads(program, feed) -> dict[str, torch.Tensor]:
    q, pairs = append_backward(program, loss=program.loss_name)
    got = metaopt.Executor("cpu").run(
        q, feed=feed, fetch_list=[q.loss_name, *(g for _, g in pairs)], return_numpy=False
    )
    return {"loss": got[0].reshape(()), **dict(zip([p for p, _ in pairs], got[1:], strict=True))}


def _feed(name, inputs):
    return dict(zip(programs.get(name).INPUT_NAMES, inputs, strict=True))


@functools.cache
def _gpt(vocab: int, dropout: float = 0.0, batch: int = 4):
    mod = programs.get("gpt")
    module = mod.build("tiny", seed=0, dropout=dropout, vocab_size=vocab)
    inputs = mod.example_inputs("tiny", batch, seed=1, vocab_size=vocab)
    return module, inputs, metaopt.export(module, inputs, name="gpt")


# --- the kernel ------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 3, 10, 64])
@pytest.mark.parametrize("trans_b", [1, 0])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_kernel_matches_torch_cross_entropy_in_float64(chunk, trans_b, with_bias, reduction):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 8, dtype=torch.float64, generator=g)
    w = torch.randn(11, 8, dtype=torch.float64, generator=g)
    b = torch.randn(11, dtype=torch.float64, generator=g) if with_bias else None
    y = torch.randint(0, 11, (2, 5), generator=g)
    y[0, 1] = y[1, 4] = -100  # ignored tokens: out of the sum and of the mean's count
    row = registry.get("LinearCrossEntropy")
    attrs = {"ignore_index": -100, "reduction": reduction, "chunk_size": chunk, "transB": trans_b}
    weight = w if trans_b else w.t().contiguous()
    loss = row.kernel(x, weight, y, b, **attrs)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    bs = b.clone().requires_grad_() if with_bias else None
    ref = F.cross_entropy(F.linear(xs, ws, bs).flatten(0, 1), y.flatten(), reduction=reduction)
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-12, atol=1e-12)
    dloss = torch.tensor(0.7, dtype=torch.float64)
    ref.backward(dloss)
    dx, dw, db = registry.get("LinearCrossEntropyGrad").kernel(dloss, x, weight, y, b, **attrs)
    torch.testing.assert_close(dx, xs.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dw, ws.grad if trans_b else ws.grad.t(), rtol=1e-12, atol=1e-12)
    if with_bias:
        torch.testing.assert_close(db, bs.grad, rtol=1e-12, atol=1e-12)
    else:
        assert db is None
    # The forward with the grads for d loss = 1 (what the float32 / float64 backward asks for),
    # scaled by ScaleGrads: the same loss bit for bit, the same grads (float64 rounding, 1e-12).
    loss2, *units = row.kernel(x, weight, y, b, **attrs, _nout=4 if with_bias else 3)
    assert torch.equal(loss2, loss)
    scaled = registry.get("ScaleGrads").kernel(dloss, *units, _nout=len(units))
    want = [xs.grad, ws.grad if trans_b else ws.grad.t()] + ([bs.grad] if with_bias else [])
    for got, ref_grad in zip(scaled, want, strict=True):
        torch.testing.assert_close(got, ref_grad, rtol=1e-12, atol=1e-12)


def test_kernel_unit_grads_of_no_token_are_zero():
    """Every token ignored: the mean loss is NaN (as torch), its unit grads zeros (as nll_loss's
    backward gives), not NaN."""
    x, w = torch.randn(4, 3), torch.randn(5, 3)
    y = torch.full((4,), -100)
    loss, dx, dw = registry.get("LinearCrossEntropy").kernel(x, w, y, chunk_size=3, _nout=3)
    assert torch.isnan(loss)
    assert torch.equal(dx, torch.zeros_like(x)) and torch.equal(dw, torch.zeros_like(w))


def test_kernel_unit_grads_refuse_half_precision():
    x, w = torch.randn(4, 3, dtype=torch.bfloat16), torch.randn(5, 3, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="grads in the forward.*bfloat16"):
        registry.get("LinearCrossEntropy").kernel(x, w, torch.zeros(4, dtype=torch.int64), _nout=3)


def test_kernel_every_token_ignored_is_nan_as_torch():
    x, w = torch.randn(4, 3), torch.randn(5, 3)
    y = torch.full((4,), -100)
    loss = registry.get("LinearCrossEntropy").kernel(x, w, y, chunk_size=3)
    assert torch.isnan(loss) and torch.isnan(F.cross_entropy(x @ w.t(), y))


# --- the pass on the reference programs --------------------------------------------------------------


def test_gpt_plan_moves_the_shift_onto_the_hidden_states_and_ties_the_embedding():
    _, _, p = exported("gpt")
    q, plan = _fused(p)
    (f,) = plan.fused
    assert (f.x, f.weight, f.bias, f.trans_b, f.classes) == (
        "transformer",
        "transformer.wte.weight",
        "",
        1,
        100,
    )
    assert len(f.moved) == 2  # logits[:, :-1] is two Slices: now on the hidden states
    verify(q)
    (op,) = [op for op in q.ops if op.type == "LinearCrossEntropy"]
    assert op.outputs == ["loss"] and op.role == "loss" and op.inputs[1] == "transformer.wte.weight"
    assert not [o for o in q.ops if o.type in ("MatMul", "SoftmaxCrossEntropyLoss") and o.scope == "lm_head"]
    # no var of the vocab size is left: the logits are gone
    assert not [v for v in q.vars.values() if v.shape and v.shape[-1] == 100 and v.kind == "activation"]


@pytest.mark.parametrize("name", ["gpt", "bert"])
def test_fused_program_is_exact_against_float64_torch(name):
    """Loss and every grad (the tied word embedding's included) by DESIGN.md's bar, with a chunk
    size that leaves a short last chunk; and equal to the unfused program to float noise."""
    module, inputs, p = exported(name)
    q, plan = _fused(p)
    assert plan.fused
    feed = _feed(name, inputs)
    ours, unfused = _grads(q, feed), _grads(p, feed)
    verdicts = judge_grads(
        {k: v for k, v in ours.items() if k != "loss"},
        torch_grads(module, inputs, double=False),
        torch_grads(module, inputs, double=True),
    )
    assert not [v for v in verdicts if v.wrong], [v for v in verdicts if v.wrong]
    tied = {"gpt": "transformer.wte.weight", "bert": "bert.embeddings.word_embeddings.weight"}[name]
    assert tied in ours and {v.param for v in verdicts} >= {tied}
    torch.testing.assert_close(ours["loss"], unfused["loss"], rtol=1e-6, atol=1e-6)
    for k in unfused:
        torch.testing.assert_close(ours[k], unfused[k], rtol=1e-4, atol=1e-6, msg=k)


def test_ignore_index_tokens_are_left_out_of_the_mean():
    module, inputs, p = exported("gpt")
    ids, labels = inputs
    labels = labels.clone()
    labels[:, :5] = -100  # a prompt that is not trained on
    labels[1] = -100
    q, _ = _fused(p)
    ours = _grads(q, {"input_ids": ids, "labels": labels})
    torch.testing.assert_close(ours["loss"], module(ids, labels).detach(), rtol=1e-6, atol=1e-6)
    verdicts = judge_grads(
        {k: v for k, v in ours.items() if k != "loss"},
        torch_grads(module, (ids, labels), double=False),
        torch_grads(module, (ids, labels), double=True),
    )
    assert not [v for v in verdicts if v.wrong]


def test_golden_fused_forward(golden):
    _, _, p = exported("gpt")
    q, plan = _fused(p)
    text = str(q)
    golden("fuse_linear_cross_entropy/gpt", f"{plan}\n\n{text}")
    assert str(parse_program(text)) == text


# --- what it must leave alone --------------------------------------------------------------------------


def test_fetched_logits_are_not_fused_and_the_plan_says_why():
    _, _, p = exported("gpt")
    plan = plan_fuse_linear_cross_entropy(p, min_classes=0, fetches=["lm_head"])
    assert not plan.fused
    (s,) = plan.skipped
    assert "'lm_head' is a program output or fetched" in s.reason and "lm_head" in str(plan)
    assert str(apply_fuse_linear_cross_entropy(p, plan)) == str(p)
    # a logits var with a second reader is kept too
    q = p.clone()
    q.outputs.append("lm_head")
    assert "program output" in plan_fuse_linear_cross_entropy(q, min_classes=0).skipped[0].reason


def test_small_vocab_is_skipped_by_default_with_the_reason():
    _, _, p = exported("bert")
    plan = plan_fuse_linear_cross_entropy(p)
    assert not plan.fused and len(plan.skipped) == 2
    assert "2 classes < min_classes=1024" in str(plan) and "100 classes < min_classes=1024" in str(plan)


def test_a_program_with_a_backward_is_refused():
    _, _, p = exported("gpt")
    q, _ = append_backward(p, loss=p.loss_name)
    with pytest.raises(FuseLinearCrossEntropyError, match="before append_backward"):
        plan_fuse_linear_cross_entropy(q)


# --- composition -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_amp_low_precision_matmul_float32_loss_and_exact(dtype):
    """Under AMP the fused op reads low-precision x and W (as the unfused MatMul did), its loss is
    float32, and its grads are as close to float64 torch as the unfused AMP program's."""
    module, inputs, p = exported("gpt")
    q, _ = _fused(p)
    fused_amp, plain_amp = amp(q, dtype=dtype), amp(p, dtype=dtype)
    (op,) = [op for op in fused_amp.ops if op.type == "LinearCrossEntropy"]
    assert [fused_amp.vars[x].dtype for x in op.inputs[:2]] == [dtype, dtype]
    assert fused_amp.vars[op.outputs[0]].dtype == "float32"
    # no float32 (nor any) tokens x vocab tensor in the fused program
    assert not [
        v for v in fused_amp.vars.values() if v.shape and v.shape[-1] == 100 and v.kind == "activation"
    ]
    feed = _feed("gpt", inputs)
    ours, ref = _grads(fused_amp, feed), _grads(plain_amp, feed)
    t64 = torch_grads(module, inputs, double=True)
    for verdict in judge_grads({k: v for k, v in ours.items() if k != "loss"}, ref, t64):
        # against the unfused AMP program's error: same order (the metric's bar)
        assert not verdict.wrong, verdict
    torch.testing.assert_close(ours["loss"], ref["loss"], rtol=1e-2, atol=1e-2)


def _train(program, feeds, grads):
    exe = metaopt.Executor("cpu")
    metaopt.seed(1234)
    out = [exe.run(program, feed=f, fetch_list=[program.loss, *grads], return_numpy=False) for f in feeds]
    return out, {k: v.clone() for k, v in exe.scope.items()}, exe.memory_stats()


def test_recompute_and_offload_of_the_fused_program_are_bit_identical():
    module, _, p = _gpt(100, dropout=0.2)
    q, _ = _fused(p)
    base = q.clone()
    metaopt.optimizer.SGD(learning_rate=0.05).minimize(base.loss)
    cps = resolve_checkpoints(base, ["transformer.h.*"])
    rec = recompute(base, checkpoints=cps)
    off = offload(rec, checkpoints=cps)
    mod = programs.get("gpt")
    feeds = [_feed("gpt", mod.example_inputs("tiny", 3, seed=s)) for s in (20, 21)]
    grads = [n for n in (f"{v.name}@GRAD" for v in base.params()) if n in base.vars]
    ref = _train(base, feeds, grads)
    for other in (rec, off):
        got = _train(other, feeds, grads)
        assert all(torch.equal(a, b) for xs, ys in zip(ref[0], got[0]) for a, b in zip(xs, ys))
        assert all(torch.equal(ref[1][k], got[1][k]) for k in ref[1])


def test_memory_drops_measured_and_estimated_for_a_large_vocab():
    """GPT tiny with 8192 classes: the executor's measured activation peak and the estimate drop
    (the logits, their saved log-probabilities and their grad are gone; one chunk remains)."""
    _, inputs, p = _gpt(8192, batch=8)
    feed = _feed("gpt", inputs)
    q, _ = _fused(p, chunk_size=16)
    stats, est = [], []
    for prog in (p, q):
        train = prog.clone()
        metaopt.optimizer.SGD(learning_rate=0.05).minimize(train.loss)
        exe = metaopt.Executor("cpu")
        exe.run(train, feed=feed, fetch_list=[train.loss])
        s = exe.memory_stats()
        stats.append(s["peak_bytes"] - s["persistable_bytes"])
        e = estimate_memory(train, dims={"batch": 8})
        est.append(e.activation_peak_bytes)
        # the kernels' temporaries (the fused ops' chunk) only add to the var-level estimate
        assert estimate_memory(train, dims={"batch": 8}, workspace=False).peak_bytes <= e.peak_bytes
    logits = 8 * 15 * 8192 * 4
    # Gone: the logits' grad and the padded grad of the shift's Slice, alive together (the
    # unfused program no longer holds the logits themselves for that Slice's grad, a Pad)
    assert stats[0] - stats[1] >= 1.5 * logits, stats
    assert est[1] < est[0] - logits, est
    # the estimate counts the fused ops' chunk: 16 tokens of float32 logits, not 120
    ws = registry.get("LinearCrossEntropyGrad").workspace
    assert ws({"chunk_size": 16}, [(), (8, 15, 32), (8192, 32)], ["float32"] * 3) == 16 * 8192 * 4


class _Head(torch.nn.Module):
    """Only an LM head and its loss: every op of the fused program has an ONNX definition."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.lm_head = torch.nn.Linear(8, 40, bias=bias)

    def forward(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.lm_head(h)[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


@pytest.mark.parametrize("bias", [False, True])
def test_saved_to_onnx_with_a_function_body_that_onnxruntime_runs(tmp_path, bias):
    ort = pytest.importorskip("onnxruntime")
    from metaopt.frontend import onnx_save

    torch.manual_seed(0)
    module = _Head(bias)
    h, labels = torch.randn(3, 6, 8), torch.randint(0, 40, (3, 6))
    labels[0, 2] = -100
    p = metaopt.export(module, (h, labels), name="head")
    q, plan = _fused(p, chunk_size=4)
    assert len(plan.fused) == 1
    model = onnx_save.to_model_proto(q)
    assert "LinearCrossEntropy" in {f.name for f in model.functions}
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (got,) = sess.run([q.loss_name], {"h": h.numpy(), "labels": labels.numpy()})
    assert abs(float(got) - float(module(h, labels))) < 1e-5
    onnx_save.save(q, tmp_path / "head.onnx")
    back = metaopt.load(tmp_path / "head.onnx")
    assert [op.type for op in back.ops] == [op.type for op in q.ops]


# --- Fleet ------------------------------------------------------------------------------------------------


def _minimize(program, **fields):
    from metaopt import fleet

    fleet.init(is_collective=True)
    s = fleet.DistributedStrategy()
    for k, v in fields.items():
        setattr(s, k, v)
    opt = fleet.distributed_optimizer(metaopt.optimizer.SGD(learning_rate=0.05), s)
    opt.minimize(program.loss)
    return opt


def test_fleet_fuses_by_default_and_the_switch_turns_it_off():
    _, _, p = _gpt(2048)
    on, off = p.clone(), p.clone()
    opt = _minimize(on)
    assert [op.type for op in on.ops].count("LinearCrossEntropy") == 1
    # float32: the forward makes the grads for a unit loss grad, the backward scales them
    (head,) = [op for op in on.ops if op.type == "LinearCrossEntropy"]
    assert len(head.outputs) == 3  # the loss, then the grads of x and of the tied weight
    (scale,) = [op for op in on.ops if op.type == "ScaleGrads"]
    assert scale.inputs[1:] == head.outputs[1:] and "LinearCrossEntropyGrad" not in {op.type for op in on.ops}
    assert "1 fused" in str(opt.context.plans["fuse_linear_ce"])
    assert opt.applied_meta_list == []  # not one of Fleet's meta optimizers
    opt = _minimize(off, fuse_linear_cross_entropy=False)
    assert "LinearCrossEntropy" not in {op.type for op in off.ops}
    assert "SoftmaxCrossEntropyLoss" in {op.type for op in off.ops}
    assert "fuse_linear_ce   skip  strategy.fuse_linear_cross_entropy=False" in str(opt.plan())


def test_fleet_amp_recompute_with_the_fused_head_trains_like_unfused():
    """AMP (bfloat16: runs on CPU) + recompute through Fleet: the fused step's first losses equal
    the unfused ones to AMP noise."""
    _, inputs, p = _gpt(2048)
    feed = _feed("gpt", inputs)
    losses = []
    for fuse in (True, False):
        q = p.clone()
        _minimize(
            q,
            amp=True,
            amp_configs={"dtype": "bfloat16"},
            recompute=True,
            recompute_configs={"checkpoints": ["transformer.h.*"]},
            fuse_linear_cross_entropy=fuse,
        )
        assert ("LinearCrossEntropy" in {op.type for op in q.ops}) == fuse
        exe = metaopt.Executor("cpu")
        losses.append([float(exe.run(q, feed=feed, fetch_list=[q.loss])[0]) for _ in range(3)])
    torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(losses[1]), rtol=2e-2, atol=2e-2)
    assert losses[0][2] < losses[0][0]  # it trains


def test_pipeline_puts_the_fused_loss_on_the_last_stage_with_the_tied_weight():
    from conftest import pipeline_split

    _, _, p = _gpt(100)
    q, _ = _fused(p)
    train = q.clone()
    metaopt.optimizer.SGD(learning_rate=0.05).minimize(train.loss)
    stages = pipeline_split(train, num_stages=2, cuts=["transformer.h.1"], micro_batches=2)
    last = stages[-1]
    (op,) = [op for op in last.ops if op.type == "LinearCrossEntropy"]
    assert op.inputs[1] == "transformer.wte.weight"
    assert "transformer.wte.weight" in stages[0].vars  # the embedding reads it on stage 0 too
    for s in stages:
        verify(s)


def test_a_pipeline_stage_scales_the_carried_unit_grads_in_place_and_trains_like_one_program():
    """A pipeline runs a stage's forward and backward as two parts: the unit grads reach the
    backward as carried values, which the runner donates (Program.donated) so ScaleGrads may write
    them in place. One worker, one stage, 2 micro-batches = one program on the full batch (SGD:
    the loss grad of each micro-batch is 1/2, the grads summed in another order: rtol 1e-5)."""
    _, inputs, p = _gpt(2048, batch=4)
    feed = _feed("gpt", inputs)
    piped, whole = p.clone(), p.clone()
    _minimize(piped, pipeline=True, pipeline_configs={"accumulate_steps": 2})
    _minimize(whole)
    assert "ScaleGrads" in {op.type for op in piped.ops}
    got, want = metaopt.Executor("cpu"), metaopt.Executor("cpu")
    for _ in range(2):
        (a,) = got.run(piped, feed=feed, fetch_list=["loss"])
        (b,) = want.run(whole, feed=feed, fetch_list=["loss"])
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for v in whole.params():
        torch.testing.assert_close(got.scope[v.name], want.scope[v.name], rtol=1e-5, atol=1e-6)
