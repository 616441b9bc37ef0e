"""The reference programs as plain torch modules: determinism, gradients, names, sizes, export.

No ``__init__.py`` beside this file on purpose: with pytest's default import mode it would make
this folder a package called ``programs`` and shadow the real one.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import types

import pytest
import torch

import programs

NAMES = sorted(programs.REGISTRY)
FULL_CONFIG = {"mlp": "base", "bert": "large", "gpt": "gpt2", "resnet": "resnet50"}
BATCH = 3  # > 1 so BatchNorm has batch statistics; odd so nothing hides behind a power of two

# Paths users and later passes refer to by name, per program (tiny configs).
EXPECTED_MODULES = {
    "mlp": ["fc1", "relu1", "dropout1", "fc2", "relu2", "dropout2", "fc3"],
    "bert": [
        "bert.embeddings.word_embeddings",
        "bert.embeddings.position_embeddings",
        "bert.embeddings.token_type_embeddings",
        "bert.embeddings.LayerNorm",
        "bert.embeddings.dropout",
        "bert.encoder.layer.0",
        "bert.encoder.layer.1",
        "bert.encoder.layer.1.attention.self.query",
        "bert.encoder.layer.1.attention.self.key",
        "bert.encoder.layer.1.attention.self.value",
        "bert.encoder.layer.1.attention.output.dense",
        "bert.encoder.layer.1.attention.output.LayerNorm",
        "bert.encoder.layer.1.attention.output.dropout",
        "bert.encoder.layer.1.intermediate.dense",
        "bert.encoder.layer.1.output.dense",
        "bert.encoder.layer.1.output.LayerNorm",
        "bert.encoder.layer.1.output.dropout",
        "bert.pooler.dense",
        "cls.predictions.transform.dense",
        "cls.predictions.transform.LayerNorm",
        "cls.predictions.decoder",
        "cls.seq_relationship",
    ],
    "gpt": [
        "transformer.wte",
        "transformer.wpe",
        "transformer.drop",
        "transformer.h.0",
        "transformer.h.1",
        "transformer.h.1.ln_1",
        "transformer.h.1.attn.c_attn",
        "transformer.h.1.attn.c_proj",
        "transformer.h.1.attn.resid_dropout",
        "transformer.h.1.ln_2",
        "transformer.h.1.mlp.c_fc",
        "transformer.h.1.mlp.c_proj",
        "transformer.h.1.mlp.dropout",
        "transformer.ln_f",
        "lm_head",
    ],
    "resnet": [
        "conv1",
        "conv1.conv",
        "conv1.bn",
        "maxpool",
        "res2a",
        "res3a",
        "res4a",
        "res5a",
        "res2a.branch2a.conv",
        "res2a.branch2b.bn",
        "res2a.branch2c.conv",
        "res3a.branch1.conv",
        "avgpool",
        "fc",
    ],
}

# (canonical name kept by named_parameters(), the tied alias) per program with tied weights.
TIED = {
    "bert": ("bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight"),
    "gpt": ("transformer.wte.weight", "lm_head.weight"),
}


def expand(pattern: str, names: list[str]) -> list[str]:
    """Module paths matching ``pattern``, where ``*`` is exactly one path component."""
    regex = re.compile("[^.]+".join(re.escape(part) for part in pattern.split("*")))
    return [name for name in names if regex.fullmatch(name)]


@pytest.fixture(params=NAMES)
def program(request: pytest.FixtureRequest) -> types.ModuleType:
    return programs.get(request.param)


def test_registry_and_get() -> None:
    assert set(NAMES) == {"mlp", "bert", "gpt", "resnet"}
    assert programs.get("bert") is programs.bert
    with pytest.raises(KeyError, match="known"):
        programs.get("vgg")


def test_api_surface(program: types.ModuleType) -> None:
    name = program.__name__.rsplit(".", 1)[1]
    assert {"tiny", FULL_CONFIG[name]} <= set(program.CONFIGS)
    cfg = program.CONFIGS["tiny"]
    assert dataclasses.is_dataclass(cfg) and isinstance(cfg, program.Config)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.dropout = 0.5
    model = program.build()
    # INPUT_NAMES become feed names: they must be forward's parameters, in order.
    assert tuple(inspect.signature(model.forward).parameters) == program.INPUT_NAMES
    assert len(program.example_inputs("tiny", BATCH)) == len(program.INPUT_NAMES)
    assert program.DEFAULT_CHECKPOINTS and all(isinstance(p, str) for p in program.DEFAULT_CHECKPOINTS)


def test_config_lookup_and_overrides(program: types.ModuleType) -> None:
    with pytest.raises(KeyError, match="tiny"):
        program.build("no-such-config")
    with pytest.raises(TypeError, match="no_such_field"):
        program.build("tiny", no_such_field=1)
    model = program.build("tiny", dropout=0.0)
    assert model.config.dropout == 0.0
    # A Config object is accepted as well as a name.
    same = program.build(dataclasses.replace(program.CONFIGS["tiny"], dropout=0.0))
    assert same.config == model.config


def test_build_is_deterministic_and_leaves_global_rng_alone(program: types.ModuleType) -> None:
    rng_before = torch.get_rng_state()
    a, b, c = program.build(seed=0), program.build(seed=0), program.build(seed=1)
    program.example_inputs("tiny", BATCH, seed=5)
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert a.training and b.training
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys() == sc.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    # Every randomly initialised parameter differs between seeds (BatchNorm/LayerNorm/bias are constants).
    differing = [k for k in sa if not torch.equal(sa[k], sc[k])]
    assert any(k.endswith("weight") for k in differing)


def test_example_inputs_are_deterministic(program: types.ModuleType) -> None:
    x, y, z = (program.example_inputs("tiny", BATCH, seed=s) for s in (0, 0, 1))
    assert all(torch.equal(p, q) for p, q in zip(x, y, strict=True))
    assert not all(torch.equal(p, r) for p, r in zip(x, z, strict=True))
    assert all(t.shape[0] == BATCH and t.device.type == "cpu" for t in x)


def test_forward_returns_finite_scalar_and_backward_reaches_every_parameter(
    program: types.ModuleType,
) -> None:
    model = program.build()
    loss = model(*program.example_inputs("tiny", BATCH))
    assert loss.dim() == 0 and loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"no grad for {missing}"
    # Nonzero too: catches a head (e.g. BERT's pooler/NSP path) that is computed but not in the loss.
    zero = [
        n
        for n, p in model.named_parameters()
        if not (torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0)
    ]
    assert not zero, f"zero or non-finite grad for {zero}"


def test_dropout_override(program: types.ModuleType) -> None:
    inputs = program.example_inputs("tiny", BATCH)
    quiet = program.build(dropout=0.0)
    assert torch.equal(quiet(*inputs), quiet(*inputs))
    if program.CONFIGS["tiny"].dropout > 0:
        noisy = program.build()
        assert not torch.equal(noisy(*inputs), noisy(*inputs))


@pytest.mark.parametrize("name", sorted(TIED))
def test_tied_weights_are_one_parameter(name: str) -> None:
    model = programs.get(name).build()
    canonical, alias = TIED[name]
    params = dict(model.named_parameters())
    assert canonical in params and alias not in params
    assert model.get_parameter(alias) is model.get_parameter(canonical)
    assert len(list(model.parameters())) == len(params)
    if name == "bert":
        assert "cls.predictions.decoder.bias" in params  # the decoder keeps a bias of its own
    else:
        assert model.lm_head.bias is None


def test_module_paths_and_default_checkpoints(program: types.ModuleType) -> None:
    name = program.__name__.rsplit(".", 1)[1]
    model = program.build()
    modules = dict(model.named_modules())
    missing = [path for path in EXPECTED_MODULES[name] if path not in modules]
    assert not missing, f"missing module paths {missing}"
    # Each checkpoint pattern names modules whose output is a single tensor (an addressable var).
    matched = {path for pattern in program.DEFAULT_CHECKPOINTS for path in expand(pattern, list(modules))}
    assert matched, f"{program.DEFAULT_CHECKPOINTS} match nothing"
    outputs: dict[str, object] = {}
    hooks = [
        modules[p].register_forward_hook(lambda m, i, o, p=p: outputs.__setitem__(p, o)) for p in matched
    ]
    model(*program.example_inputs("tiny", BATCH))
    for hook in hooks:
        hook.remove()
    assert outputs.keys() == matched
    assert all(isinstance(o, torch.Tensor) for o in outputs.values())


def test_checkpoint_patterns_on_tiny_configs() -> None:
    def matched(name: str) -> list[str]:
        program = programs.get(name)
        names = [n for n, _ in program.build().named_modules()]
        return sorted(p for pattern in program.DEFAULT_CHECKPOINTS for p in expand(pattern, names))

    assert matched("bert") == ["bert.encoder.layer.0", "bert.encoder.layer.1"]
    assert matched("gpt") == ["transformer.h.0", "transformer.h.1"]
    assert matched("resnet") == ["res2a", "res3a", "res4a", "res5a"]
    assert matched("mlp") == ["fc1", "fc2"]


def test_layer_and_sequence_overrides() -> None:
    bert = programs.bert.build("tiny", num_layers=3, seq_len=8)
    assert len(bert.bert.encoder.layer) == 3
    inputs = programs.bert.example_inputs("tiny", BATCH, seq_len=8)
    assert all(t.shape == (BATCH, 8) for t in inputs[:4])
    assert torch.isfinite(bert(*inputs))
    with pytest.raises(ValueError, match="max_position"):
        programs.gpt.build("tiny", seq_len=17)
    gpt = programs.gpt.build("tiny", num_layers=1, seq_len=4)
    assert torch.isfinite(gpt(*programs.gpt.example_inputs("tiny", BATCH, seq_len=4)))


def test_bert_padding_is_masked_out() -> None:
    model = programs.bert.build(dropout=0.0)
    input_ids, token_type_ids, attention_mask, mlm_labels, nsp = programs.bert.example_inputs("tiny", BATCH)
    assert (attention_mask == 0).any() and (mlm_labels[attention_mask == 0] == -100).all()
    scrambled = torch.where(attention_mask.bool(), input_ids, (input_ids + 7) % 100)
    assert not torch.equal(scrambled, input_ids)
    loss = model(input_ids, token_type_ids, attention_mask, mlm_labels, nsp)
    torch.testing.assert_close(model(scrambled, token_type_ids, attention_mask, mlm_labels, nsp), loss)


def test_gpt_attention_is_causal() -> None:
    model = programs.gpt.build(dropout=0.0)
    input_ids, labels = programs.gpt.example_inputs("tiny", BATCH)
    changed = input_ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 100
    seen: list[torch.Tensor] = []
    model.transformer.h[1].register_forward_hook(lambda m, i, o: seen.append(o))
    model(input_ids, labels)
    model(changed, labels)
    torch.testing.assert_close(seen[0][:, :-1], seen[1][:, :-1], rtol=0, atol=0)
    assert not torch.equal(seen[0][:, -1], seen[1][:, -1])


def test_resnet_batchnorm_trains() -> None:
    model = programs.resnet.build()
    before = model.res2a.branch2a.bn.running_mean.clone()
    model(*programs.resnet.example_inputs("tiny", BATCH))
    assert not torch.equal(model.res2a.branch2a.bn.running_mean, before)
    assert int(model.res2a.branch2a.bn.num_batches_tracked) == 1


def _count_on_meta(name: str, config: str) -> tuple[torch.nn.Module, int]:
    # Meta tensors have shapes but no storage: full-size models cost no memory or init time.
    with torch.device("meta"):
        model = programs.get(name).build(config)
    return model, sum(p.numel() for p in model.parameters())


def test_full_config_parameter_counts() -> None:
    bert, n = _count_on_meta("bert", "large")
    assert len(bert.bert.encoder.layer) == 24
    assert n == pytest.approx(335e6, rel=0.01)  # BERT-large + pre-training heads: 336.2M
    assert _count_on_meta("bert", "base")[1] == pytest.approx(110e6, rel=0.01)
    assert _count_on_meta("gpt", "gpt2")[1] == 124_439_808  # GPT-2 "117M", as counted by HF
    resnet, n = _count_on_meta("resnet", "resnet50")
    assert n == 25_557_032  # torchvision's resnet50
    blocks = [name for name, _ in resnet.named_children() if name.startswith("res")]
    assert blocks == [f"res{s}{c}" for s, depth in zip("2345", (3, 4, 6, 3)) for c in "abcdef"[:depth]]
    assert _count_on_meta("mlp", "base")[1] == 784 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10


@pytest.mark.filterwarnings("ignore:Exporting a model while it is in training mode")
@pytest.mark.filterwarnings("ignore:.*isinstance\\(treespec, LeafSpec\\).*:FutureWarning")
@pytest.mark.filterwarnings("ignore:# The axis name. batch will not be used")
def test_onnx_export_with_symbolic_batch(program: types.ModuleType) -> None:
    """One dynamo export per program, in train mode, as metaopt.export will do it."""
    model = program.build()
    onnx_program = torch.onnx.export(
        model,
        program.example_inputs("tiny", BATCH),
        dynamo=True,
        optimize=False,  # keep parameters as named initializers (see DESIGN.md)
        dynamic_shapes=programs.batch_dynamic_shapes(program.INPUT_NAMES),
        verbose=False,
    )
    graph = onnx_program.model_proto.graph
    assert tuple(i.name for i in graph.input) == program.INPUT_NAMES
    for value in graph.input:
        first = value.type.tensor_type.shape.dim[0]
        assert first.dim_param and not first.HasField("dim_value"), f"{value.name} has a static batch dim"
    initializers = [i.name for i in graph.initializer]
    assert len(initializers) == len(set(initializers))
    name = program.__name__.rsplit(".", 1)[1]
    tied = set(TIED.get(name, ()))
    # Every parameter is an initializer under its state_dict name; a tied one appears once, under
    # either of its names (torch 2.13 picks the alias: lm_head.weight, cls.predictions.decoder.weight).
    untied = {n for n, _ in model.named_parameters()} - tied
    assert untied <= set(initializers), (
        f"parameters missing from the graph: {sorted(untied - set(initializers))}"
    )
    if tied:
        assert len(tied & set(initializers)) == 1
