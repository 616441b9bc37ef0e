"""The AMP passes: precision rules, shared casts, torch.autocast equality, scaling ops, errors."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from conftest import exported
from torch import nn

import metaopt
import programs
from metaopt.ir import Op, parse_program, verify
from metaopt.ops import registry
from metaopt.ops.kernels import amp as amp_kernels
from metaopt.ops.kernels.amp import AmpDeviceError, check_amp_device
from metaopt.passes.amp import (
    BLACK_LIST,
    FLOAT32_SLOTS,
    WHITE_LIST,
    AmpError,
    amp,
    plan_amp,
    scale_loss,
    unscale_grads,
)
from metaopt.passes.backward import append_backward

LOW = ("float16", "bfloat16")


def _forward(name: str, dropout: float = 0.0) -> metaopt.Program:
    return exported(name, dropout=dropout)[2]


def _precision(plan, op_type: str) -> set[str]:
    return {d.precision for d in plan.ops if d.op.endswith(f"= {op_type}")}


class _PlainAttention(nn.Module):
    """Softmax attention written out (Q K^T / sqrt(d), softmax, dropout, P V) whose probabilities
    the loss also reads: a second reader, so the importer's attention fusion leaves it decomposed
    (MatMul, Softmax, Dropout, MatMul), as bert/gpt's attention was before the fusion."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.out = nn.Linear(16, 16)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.reshape(b, s, 2, 8).transpose(1, 2) for t in self.qkv(x).split(16, -1))
        probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(8), -1)
        y = self.out((self.drop(probs) @ v).transpose(1, 2).reshape(b, s, 16))
        return y.square().mean() + probs.square().mean()


@functools.cache
def _decomposed_attention(dropout: float = 0.1) -> metaopt.Program:
    torch.manual_seed(0)
    module = _PlainAttention(dropout).train()
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0))
    p = metaopt.export(module, (x,), name="plain_attention")
    types = {op.type for op in p.ops}
    assert {"MatMul", "Softmax", "Dropout"} <= types and "ScaledDotProductAttention" not in types
    return p


def test_lists_name_rows_of_the_op_table():
    table = registry.table()
    for t in [*WHITE_LIST, *BLACK_LIST, *FLOAT32_SLOTS]:
        assert t in table, t
    assert not WHITE_LIST & BLACK_LIST
    # every matmul-class row (the selective recompute policy's `expensive`) is white
    assert {t for t, row in table.items() if row.expensive} <= WHITE_LIST


@pytest.mark.parametrize("dtype", LOW)
def test_bert_plan_white_black_gray(dtype):
    p = _forward("bert", dropout=0.1)
    plan = plan_amp(p, dtype=dtype)
    by_out = {d.op.split(" = ")[0]: d for d in plan.ops}
    # the importer fused bert's attention: Linear and ScaledDotProductAttention are the white ops
    assert _precision(plan, "Linear") == _precision(plan, "ScaledDotProductAttention") == {"low"}
    assert _precision(plan, "SoftmaxCrossEntropyLoss") == {"float32"}
    sdpa = "bert.encoder.layer.0.attention.self/scaleddotproductattention"
    assert by_out[sdpa].reason == "white list"
    # gelu follows its Linear
    assert by_out["bert.encoder.layer.0.intermediate"].precision == "low"
    # embedding lookups read only params and feeds: no vote, unchanged; the layers' LayerNorms
    # follow their low-precision inputs (statistics in float32)
    assert by_out["bert.embeddings.word_embeddings"].precision == "keep"
    assert by_out["bert.encoder.layer.0"].precision == "low"
    assert by_out["loss"].precision == "float32"
    q = amp(p, dtype=dtype)
    verify(q)
    assert q.vars["bert.encoder.layer.0"].dtype == dtype  # a checkpoint candidate, in low precision
    assert q.vars["loss"].dtype == "float32"
    ln = next(op for op in q.ops if op.outputs[:1] == ["bert.encoder.layer.0"])
    assert [q.vars[x].dtype for x in ln.inputs] == [dtype, "float32", "float32"]  # scale, bias float32
    # the fused attention reads Q, K, V and the (cast) padding mask in low precision and keeps its
    # attention-probability dropout
    fused = next(op for op in q.ops if op.outputs[:1] == [sdpa])
    assert [q.vars[x].dtype for x in [*fused.inputs, *fused.outputs]] == [dtype] * 5
    assert fused.attrs["dropout_p"] == pytest.approx(0.1)
    assert all(q.vars[v.name].dtype == "float32" for v in p.params())  # master weights stay float32
    assert "white list" in str(plan) and f"ops in {dtype}" in str(plan)
    # attention the fusion leaves decomposed: the matmuls low, the black-listed Softmax float32
    # even on low-precision scores, and the attention-probability dropout follows it in float32
    d = _decomposed_attention()
    plan = plan_amp(d, dtype=dtype)
    by_out = {x.op.split(" = ")[0]: x for x in plan.ops}
    assert _precision(plan, "MatMul") == {"low"} and _precision(plan, "Softmax") == {"float32"}
    softmax = next(op for op in d.ops if op.type == "Softmax")
    assert by_out[d.ops[d.producers()[softmax.inputs[0]]].outputs[0]].precision == "low"  # scores
    (drop,) = [op for op in d.ops if op.type == "Dropout" and op.inputs[0] == softmax.outputs[0]]
    assert by_out[drop.outputs[0]].precision == "float32"
    q = amp(d, dtype=dtype)
    verify(q)
    assert q.vars[softmax.outputs[0]].dtype == "float32"


def test_casts_are_shared_and_placed_before_their_first_use():
    p = _forward("bert")
    q = amp(p, dtype="float16")
    casts = [op for op in q.ops if op.type == "Cast" and op.origin is not None]
    keys = [(op.origin, op.attrs["to"]) for op in casts]
    assert len(keys) == len(set(keys))  # one cast per (var, dtype)
    # the padding mask feeds both layers' fused attention ops through one cast
    mask_cast = [op for op in casts if op.origin == "bert/mul"]
    assert len(mask_cast) == 1
    readers = [op for op in q.ops if mask_cast[0].outputs[0] in op.inputs]
    assert [op.type for op in readers] == ["ScaledDotProductAttention"] * 2
    consumers = q.consumers()
    for i, op in enumerate(q.ops):
        if op in casts:
            assert consumers[op.outputs[0]][0] > i
            # right before the first reader: nothing but other casts in between
            assert all(o.type == "Cast" for o in q.ops[i + 1 : consumers[op.outputs[0]][0]])
    # constants are converted once at rewrite time, not by an op per step (bert's fused
    # attention reads no float constant; gpt's reads its causal mask, a constant per layer)
    assert not [op for op in casts if q.vars[op.inputs[0]].kind == "constant"]
    g = _forward("gpt")
    gq = amp(g, dtype="float16")
    verify(gq)
    assert not [op for op in gq.ops if op.type == "Cast" and gq.vars[op.inputs[0]].kind == "constant"]
    masks = [op.inputs[3] for op in gq.ops if op.type == "ScaledDotProductAttention"]
    assert len(masks) == 2
    for m in masks:
        (orig,) = [x for x in g.vars if m == f"{x}@CAST_FP16"]
        assert g.vars[orig].kind == gq.vars[m].kind == "constant" and gq.vars[m].dtype == "float16"
        assert torch.equal(gq.values[m], g.values[orig].to(torch.float16))
    # the tied word embedding: looked up in float32, cast once for the MLM decoder
    word = "bert.embeddings.word_embeddings.weight"
    assert [op.outputs[0] for op in casts if op.origin == word] == [f"{word}@CAST_FP16"]


@pytest.mark.parametrize("name", ["mlp", "resnet"])
@pytest.mark.parametrize("dtype", LOW)
def test_loss_and_grads_bitwise_equal_to_torch_autocast_on_cpu(name, dtype):
    """On these programs our lists make the same choices as torch.autocast on CPU (matmuls and
    convs low; BatchNorm on low inputs with float32 stats; the loss float32): equal bit for bit."""
    module, _, p = exported(name, dropout=0.0)
    inputs = programs.get(name).example_inputs("tiny", 4, seed=3)
    module.zero_grad()
    with torch.autocast("cpu", dtype=getattr(torch, dtype)):
        loss = module(*programs.channels_last(inputs))  # the program's conv layout: same kernels
    loss.backward()
    q, params_grads = append_backward(amp(p, dtype=dtype), loss="loss")
    feed = dict(zip(programs.get(name).INPUT_NAMES, inputs, strict=True))
    out = metaopt.Executor().run(
        q, feed=feed, fetch_list=["loss", *(g for _, g in params_grads)], return_numpy=False
    )
    assert torch.equal(out[0], loss.detach())
    grads = dict(module.named_parameters())
    for (param, _), g in zip(params_grads, out[1:], strict=True):
        assert g.dtype == torch.float32  # the grad of a float32 master weight (Cast's grad casts back)
        assert torch.equal(g, grads[param].grad), param


@pytest.mark.parametrize("name", ["bert", "gpt"])
def test_bert_gpt_grads_close_to_float32(name):
    """bert/gpt keep LayerNorm and the residual stream in low precision (Paddle's rule), which
    torch's autocast does not: compared with float32 instead. Tolerance: the median param grad
    within 2% (float16: 11-bit, bfloat16: 8-bit mantissas; measured 0.08% / 0.6%)."""
    _, _, p = exported(name, dropout=0.0)
    mod = programs.get(name)
    feed = dict(zip(mod.INPUT_NAMES, mod.example_inputs("tiny", 4, seed=3), strict=True))
    ref, pg = append_backward(p, loss="loss")
    want = metaopt.Executor().run(ref, feed=feed, fetch_list=[g for _, g in pg], return_numpy=False)
    for dtype in LOW:
        q, pg2 = append_backward(amp(p, dtype=dtype), loss="loss")
        assert pg2 == pg
        got = metaopt.Executor().run(q, feed=feed, fetch_list=[g for _, g in pg], return_numpy=False)
        errs = sorted(((a - b).norm() / b.norm()).item() for a, b in zip(got, want) if b.norm() > 1e-3)
        assert errs[len(errs) // 2] < 2e-2, (dtype, errs)
        assert errs[-1] > 0  # really computed in low precision


def test_custom_lists_and_black_varnames():
    p = _forward("bert")
    # a white op (bert's fused attention) moved to the black list; the other white ops stay low
    plan = plan_amp(p, dtype="bfloat16", custom_black_list=["ScaledDotProductAttention"])
    assert _precision(plan, "ScaledDotProductAttention") == {"float32"}
    assert _precision(plan, "Linear") == {"low"}
    assert {d.reason for d in plan.ops if d.op.endswith("= ScaledDotProductAttention")} == {
        "black list (custom)"
    }
    # both lists on attention the fusion leaves decomposed: MatMul black, Softmax white
    d = _decomposed_attention()
    plan = plan_amp(d, dtype="bfloat16", custom_black_list=["MatMul"], custom_white_list=["Softmax"])
    assert _precision(plan, "MatMul") == {"float32"}
    assert _precision(plan, "Softmax") == {"low"}
    assert {x.reason for x in plan.ops if x.op.endswith("= Softmax")} == {"white list (custom)"}
    assert any(x.reason == "black list (custom)" for x in plan.ops)
    name = "bert.encoder.layer.0.intermediate.dense"
    plan = plan_amp(p, custom_black_varnames=[name])
    by_out = {d.op.split(" = ")[0]: d for d in plan.ops}
    assert by_out[name].precision == "float32" and "custom_black_varnames" in by_out[name].reason


def test_nothing_to_do_without_white_ops():
    p = _forward("mlp")
    plan = plan_amp(p, custom_black_list=["Gemm"])
    assert plan.counts()["low"] == 0
    q = amp(p, custom_black_list=["Gemm"])
    assert not [op for op in q.ops if op.type == "Cast"]
    assert all(q.vars[n].dtype == v.dtype for n, v in p.vars.items())
    assert [op.type for op in q.ops[1:]] == [op.type for op in p.ops]


def test_program_outputs_keep_their_dtype():
    p = _forward("mlp").clone()
    p.outputs.append("fc3")  # a fetched low-precision value comes back in float32
    q = amp(p, dtype="bfloat16")
    verify(q)
    assert q.vars["fc3"].dtype == "float32"
    gemm = next(op for op in q.ops if op.type == "Gemm" and op.scope == "fc3")
    assert gemm.outputs == ["fc3@CAST_BF16"] and q.vars["fc3@CAST_BF16"].dtype == "bfloat16"


def test_pure_fp16_stores_params_in_low_precision():
    p = _forward("bert")
    q = amp(p, dtype="float16", use_pure_fp16=True)
    verify(q)
    assert {v.dtype for v in q.params()} == {"float16"}
    assert q.values["bert.pooler.dense.weight"].dtype == torch.float16
    ln = next(op for op in q.ops if op.outputs[:1] == ["bert.encoder.layer.0"])
    assert [q.vars[x].dtype for x in ln.inputs][1:] == ["float32", "float32"]  # cast up for the stats
    assert plan_amp(p, use_pure_fp16=True).counts()["keep"] < plan_amp(p).counts()["keep"]


def test_loss_scaling_ops():
    p = scale_loss(_forward("mlp"), init_loss_scaling=1024.0)
    assert p.loss_name == "loss" and p.vars["loss_scaling"].kind == "opt_state"
    assert p.values["loss_scaling"].item() == 1024.0
    mul = p.ops[p.producers()["loss@SCALED"]]
    assert (mul.type, mul.inputs, mul.role) == ("Mul", ["loss", "loss_scaling"], "loss")
    main = p.clone()
    metaopt.optimizer.Adam(learning_rate=1e-3).minimize(main.var("loss@SCALED"))
    q = unscale_grads(main, incr_every_n_steps=3)
    verify(q)
    check = next(op for op in q.ops if op.type == "CheckFiniteAndUnscale")
    i = q.ops.index(check)
    assert q.ops[i + 1].type == "UpdateLossScaling" and q.ops[i + 1].attrs["incr_every_n_steps"] == 3
    assert q.ops[i + 2].type == "StepCounter" and q.ops[i + 2].inputs == ["global_step", "found_inf"]
    updates = [op for op in q.ops if op.type == "AdamUpdate"]
    assert len(updates) == 6 and all(op.inputs[7] == "found_inf" and op.inputs[6] == "" for op in updates)
    assert all(op.inputs[1] == f"{op.origin}@GRAD@UNSCALED" for op in updates)
    assert {"loss_scaling", "num_good_steps", "num_bad_steps"} <= set(q.updates)
    static = unscale_grads(main, use_dynamic_loss_scaling=False)
    assert (
        not any(op.type == "UpdateLossScaling" for op in static.ops) and "num_good_steps" not in static.vars
    )


def test_check_comes_after_the_all_reduce():
    """Data parallel's all-reduces (role comm) run on the scaled grads first: every rank then
    checks the same reduced values and skips the same steps."""
    p = scale_loss(_forward("mlp"))
    metaopt.optimizer.SGD(learning_rate=0.1).minimize(p.var("loss@SCALED"))
    first = next(i for i, op in enumerate(p.ops) if op.role in ("optimize", "lr-sched"))
    w = "fc1.weight@GRAD"
    p.add_var(metaopt.Var("fc1.weight@GRAD@REDUCED", "float32", (32, 16), "grad"))
    p.ops.insert(first, Op("Identity", [w], ["fc1.weight@GRAD@REDUCED"], role="comm", origin=w))
    for op in p.ops[first + 1 :]:
        op.inputs = ["fc1.weight@GRAD@REDUCED" if x == w else x for x in op.inputs]
    q = unscale_grads(p)
    verify(q)
    i = next(i for i, op in enumerate(q.ops) if op.type == "CheckFiniteAndUnscale")
    assert q.ops[i - 1].role == "comm" and "fc1.weight@GRAD@REDUCED" in q.ops[i].inputs
    assert w not in q.ops[i].inputs


def test_pipeline_stages_sum_their_overflow_flags():
    """A pipeline stage's grads are its own: the flag is summed over the workers before any
    update reads it, and a stage without the loss (no scale_loss op) gets the scale var."""
    stage = _forward("mlp").clone()  # stands for a stage without the loss-scaling op
    metaopt.optimizer.SGD(learning_rate=0.1).minimize(stage.loss)
    q = unscale_grads(stage, across_workers=True, init_loss_scaling=64.0)
    verify(q)
    assert q.values["loss_scaling"].item() == 64.0 and q.vars["loss_scaling"].kind == "opt_state"
    reduce = next(op for op in q.ops if op.type == "AllReduce")
    assert (reduce.inputs, reduce.outputs, reduce.attrs) == (
        ["found_inf"],
        ["found_inf@REDUCED"],
        {"reduce": "sum"},
    )
    assert reduce.role == "optimize"  # the pipeline runs it once per step, with the updates
    readers = [op for op in q.ops if "found_inf" in op.inputs]
    assert readers == [reduce]
    skippers = [op for op in q.ops if "found_inf@REDUCED" in op.inputs]
    assert {op.type for op in skippers} == {"UpdateLossScaling", "StepCounter", "SGDUpdate"}
    assert all(q.ops.index(op) > q.ops.index(reduce) for op in skippers)


def test_amp_golden_parses_back(golden):
    """Pass-level view of the forward rewrite on mlp (the fleet golden adds backward and scaling)."""
    q = amp(_forward("mlp", dropout=0.1), dtype="bfloat16")
    text = str(q)
    golden("amp/mlp_forward_bf16", text)
    assert str(parse_program(text)) == text


# --- errors ---------------------------------------------------------------------------------


def test_config_errors_name_the_thing_at_fault():
    p = _forward("mlp")
    with pytest.raises(
        AmpError, match=r"custom_white_list: unknown op type 'Matmul' \(did you mean 'MatMul'"
    ):
        amp(p, custom_white_list=["Matmul"])
    with pytest.raises(AmpError, match=r"custom_black_list: unknown op type 'Softmx'.*'Softmax'"):
        amp(p, custom_black_list=["Softmx"])
    with pytest.raises(AmpError, match=r"'Gemm' is in both"):
        amp(p, custom_white_list=["Gemm"], custom_black_list=["Gemm"])
    with pytest.raises(AmpError, match=r"got 'float61'.*did you mean 'float16'"):
        amp(p, dtype="float61")
    with pytest.raises(AmpError, match=r"custom_black_varnames: program 'mlp' has no var 'fc_1'.*'fc1'"):
        amp(p, custom_black_varnames=["fc_1"])
    trained = p.clone()
    metaopt.optimizer.SGD(learning_rate=0.1).minimize(trained.loss)
    with pytest.raises(AmpError, match=r"apply amp before append_backward"):
        amp(trained)
    with pytest.raises(AmpError, match=r"has no 'loss_scaling': apply scale_loss"):
        unscale_grads(trained)


@pytest.fixture
def fresh_device_cache(monkeypatch):
    monkeypatch.setattr(amp_kernels, "_SUPPORTED", set())


def test_gpu_without_fp16_or_bf16_support_is_refused(monkeypatch, fresh_device_cache):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (5, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Tesla M60")
    with pytest.raises(AmpDeviceError, match=r"'float16': cuda:0 \(Tesla M60, compute capability 5.0\) "
                       r"has no float16 support \(needs 5.3 or newer\); turn strategy.amp off"):  # fmt: skip
        check_amp_device("float16", torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (7, 0))
    with pytest.raises(
        AmpDeviceError, match=r"has no bfloat16 support \(needs 8.0.*use amp_configs\['dtype'\]='float16'"
    ):
        check_amp_device("bfloat16", torch.device("cuda", 0))
    check_amp_device("float16", torch.device("cuda", 0))  # a V100 runs float16


def test_a_device_without_kernels_is_refused_when_the_program_runs(monkeypatch, fresh_device_cache):
    def no_half(*args, **kwargs):
        raise RuntimeError("\"addmm_impl_cpu_\" not implemented for 'Half'")

    monkeypatch.setattr(torch.nn.functional, "linear", no_half)
    q = amp(_forward("mlp"), dtype="float16")
    assert q.ops[0].type == "CheckAmpDevice"
    mod = programs.get("mlp")
    feed = dict(zip(mod.INPUT_NAMES, mod.example_inputs("tiny", 2), strict=True))
    with pytest.raises(AmpDeviceError, match=r"this torch build has no float16 kernels on cpu \(.*addmm"):
        metaopt.Executor("cpu").run(q, feed=feed, fetch_list=["loss"])
