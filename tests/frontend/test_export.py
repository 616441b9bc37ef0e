"""metaopt.export on the reference programs: params, buffers, names, numerics vs torch and ORT."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from conftest import exported

import metaopt
import programs
from metaopt.frontend import onnx_save
from metaopt.ir import eval_dim

PROGRAMS = ["mlp", "bert", "gpt", "resnet"]


def _feed(name: str, inputs) -> dict[str, torch.Tensor]:
    return dict(zip(programs.get(name).INPUT_NAMES, inputs, strict=True))


@pytest.mark.parametrize("name", PROGRAMS)
def test_forward_matches_torch_at_another_batch(name):
    module, _, program = exported(name)
    inputs = programs.get(name).example_inputs("tiny", 3, seed=7)
    exe = metaopt.Executor("cpu")
    (ours,) = exe.run(program, feed=_feed(name, inputs), fetch_list=[program.loss])
    with torch.random.fork_rng():
        ref = module(*inputs).item()
    # float32 CPU, same kernels family: the bar (rtol 1e-5, atol 1e-6).
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", PROGRAMS)
def test_forward_matches_onnxruntime_on_saved_file(name, tmp_path):
    _, _, program = exported(name)
    inputs = programs.get(name).example_inputs("tiny", 5, seed=3)
    path = tmp_path / f"{name}.onnx"
    onnx_save.save(program, path)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    assert sess.get_providers() == ["CPUExecutionProvider"]
    feed = {k: v.numpy() for k, v in _feed(name, inputs).items()}
    ort_loss = sess.run([program.loss_name], feed)[0]
    (ours,) = metaopt.Executor("cpu").run(program, feed=feed, fetch_list=[program.loss])
    # Different kernels (ORT vs torch) reduce in different orders: float32 rounding only.
    np.testing.assert_allclose(ours, ort_loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", PROGRAMS)
def test_every_named_parameter_is_a_trainable_param_var(name):
    module, _, program = exported(name)
    params = {v.name: v for v in program.params(trainable_only=False)}
    named = dict(module.named_parameters())
    assert set(params) == set(named)  # tied params appear once, under named_parameters' name
    for n, p in named.items():
        v = params[n]
        assert v.trainable and v.kind == "param"
        assert (v.dtype, v.shape) == ("float32", tuple(p.shape))
        assert torch.equal(program.values[n], p.detach())


def test_tied_weights_appear_once():
    module, _, program = exported("gpt")
    assert "transformer.wte.weight" in program.vars
    assert "lm_head.weight" not in program.vars
    readers = [op for op in program.ops if "transformer.wte.weight" in op.inputs]
    assert len(readers) >= 2  # the embedding lookup and the LM head


def test_batchnorm_buffers_are_persistable_and_updated_like_torch():
    module, _, program = exported("resnet")
    buffers = {n for n, _ in module.named_buffers() if not n.endswith("num_batches_tracked")}
    assert buffers <= {v.name for v in program.vars.values() if v.kind == "buffer"}
    assert all(not program.vars[b].trainable and program.vars[b].persistable for b in buffers)
    assert set(program.updates) == buffers
    fresh = programs.get("resnet").build("tiny", seed=0, dropout=0.0)
    inputs = programs.get("resnet").example_inputs("tiny", 4, seed=5)
    exe = metaopt.Executor("cpu")
    exe.run(program, feed=_feed("resnet", inputs), fetch_list=[program.loss])
    fresh(*programs.channels_last(inputs))
    for n, b in fresh.named_buffers():
        if n in buffers:
            # Same formula, same reduction kernels (torch batch_norm on the program's
            # channels-last conv outputs): bitwise on CPU.
            assert torch.equal(exe.scope[n], b), n


def test_dropout_stays_random_and_seeded():
    _, _, program = exported("bert", dropout=0.5)
    drops = [op for op in program.ops if op.type == "Dropout"]
    # embeddings + per layer (attention output, FFN output); the attention probabilities'
    # dropout lives inside each layer's fused ScaledDotProductAttention
    assert len(drops) == 1 + 2 * 2
    fused = [op for op in program.ops if op.type == "ScaledDotProductAttention"]
    assert len(fused) == 2 and all(abs(op.attrs["dropout_p"] - 0.5) < 1e-7 for op in fused)
    assert all(
        program.vars[op.inputs[2]].kind == "constant" and bool(program.values[op.inputs[2]]) for op in drops
    )
    feed = _feed("bert", programs.get("bert").example_inputs("tiny", 3, seed=2))
    exe = metaopt.Executor("cpu")
    runs = []
    for seed in (1, 1, 2):
        metaopt.seed(seed)
        runs.append(exe.run(program, feed=feed, fetch_list=[program.loss])[0])
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_one_program_runs_any_batch_size():
    _, _, program = exported("gpt")
    exe = metaopt.Executor("cpu")
    for b in (2, 5, 9):
        inputs = programs.get("gpt").example_inputs("tiny", b, seed=b)
        (loss,) = exe.run(program, feed=_feed("gpt", inputs), fetch_list=[program.loss])
        assert np.isfinite(loss)


@pytest.mark.parametrize("name", PROGRAMS)
def test_every_var_has_dtype_and_a_shape_in_the_batch(name):
    _, _, program = exported(name)
    for v in program.vars.values():
        assert v.shape is not None, v.name
        for d in v.shape:
            assert eval_dim(d, {"batch": 3}) is not None, (v.name, v.shape)


def test_names_are_deterministic_and_modules_addressable():
    bert = programs.get("bert")
    a = metaopt.export(bert.build("tiny", dropout=0.0), bert.example_inputs("tiny", 4), name="bert")
    _, _, b = exported("bert")
    assert str(a) == str(b)
    assert b.modules["bert.encoder.layer.0"] == ["bert.encoder.layer.0"]
    # Modules sharing one output: the var is named after the outermost of them,
    # and every one of them still resolves to it.
    assert b.modules["bert.encoder.layer.0.output"] == ["bert.encoder.layer.0"]
    assert b.modules["bert.encoder.layer.1"] == b.modules["bert.encoder"] == ["bert.encoder"]
    _, _, r = exported("resnet")
    assert all(f"res{k}a" in r.vars for k in range(2, 6))


def test_frozen_parameter_is_not_trainable():
    m = programs.get("mlp").build("tiny", dropout=0.0)
    m.fc1.weight.requires_grad_(False)
    p = metaopt.export(m, programs.get("mlp").example_inputs("tiny", 4))
    assert not p.vars["fc1.weight"].trainable
    assert p.vars["fc1.bias"].trainable
    assert "frozen" in str(p)


def test_unused_parameter_still_a_param():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.used = torch.nn.Linear(4, 2)
            self.unused = torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.used(x).sum()

    p = metaopt.export(M(), (torch.randn(3, 4),))
    assert {"unused.weight", "unused.bias"} <= {v.name for v in p.params()}


def test_eval_mode_export_keeps_inference_semantics():
    m = programs.get("resnet").build("tiny", dropout=0.0).eval()
    inputs = programs.get("resnet").example_inputs("tiny", 4)
    p = metaopt.export(m, inputs)
    assert not any(op.type == "BatchNormTraining" for op in p.ops)
    assert not p.updates
    (ours,) = metaopt.Executor("cpu").run(p, feed=_feed("resnet", inputs), fetch_list=[p.loss])
    np.testing.assert_allclose(ours, m(*inputs).item(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", PROGRAMS)
def test_save_then_load_gives_the_same_program(name, tmp_path):
    _, _, program = exported(name, dropout=0.1)
    onnx_save.save(program, tmp_path / "p.onnx")
    again = metaopt.load(tmp_path / "p.onnx")
    assert str(again) == str(program)
    for n, t in program.values.items():
        assert torch.equal(again.values[n], t), n
