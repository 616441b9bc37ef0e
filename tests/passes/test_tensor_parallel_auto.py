"""tensor_parallel_configs {"column": "auto"}: the column / row layers of transformer blocks are
found (passes/tensor_parallel_auto.py) and equal the ones a user names by hand; what stays
replicated is listed with the op that stops it; fleet's plan and program are the same as with
hand-named layers."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import metaopt
from metaopt import fleet
from metaopt.fleet import env, steps
from metaopt.layout.topology import HybridCommunicateGroup, Topology
from metaopt.passes.driver import Context
from metaopt.passes.recompute import resolve_checkpoints
from metaopt.passes.tensor_parallel_auto import auto_layers

TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS / "training"))
sys.path.insert(0, str(TESTS))
import tp_worker  # noqa: E402

pytestmark = pytest.mark.usefixtures("clean_env")  # tests/conftest.py


@functools.cache
def _export(name: str) -> metaopt.Program:
    return tp_worker.export(name)


@pytest.mark.parametrize("name", ["gpt", "bert"])
def test_auto_finds_the_layers_a_user_names_by_hand(name):
    p = _export(name)
    found = auto_layers(p, mp_degree=2)
    # bert's pooler (a 2-D Linear, exported as Gemm) -> Tanh -> next-sentence head is a block too
    extra = {"column": ["bert.pooler.dense"], "row": ["cls.seq_relationship"]} if name == "bert" else {}
    for kind, named in (("column", tp_worker.COLUMN), ("row", tp_worker.ROW)):
        want = resolve_checkpoints(p, named[name]) + extra.get(kind, [])
        assert sorted(getattr(found, kind)) == sorted(want), kind


def test_what_stays_replicated_is_listed_with_the_op_that_stops_it():
    found = auto_layers(_export("bert"), mp_degree=2)
    text = str(found)
    assert "9 column and 5 row layers" in text  # 2 x (q, k, v, intermediate), the pooler; their ends
    # bert's MLM head: its transform Linear feeds a LayerNorm, its decoder feeds the loss
    skipped = found.skipped
    transform = "cls.predictions.transform.dense: "
    assert any(s.startswith(transform) and "LayerNormalization(" in s for s in skipped)
    assert any(s.startswith("cls.predictions: ") and "SoftmaxCrossEntropyLoss(" in s for s in skipped)


def test_a_block_the_planner_refuses_stays_replicated_with_its_reason():
    # 3 heads of width 8 (24 features) over mp_degree 2: the heads do not divide
    found = auto_layers(_export("gpt"), mp_degree=5)
    assert not found.column and not found.row
    assert any("not divisible by mp_degree 5" in s for s in found.skipped), found.skipped


def _fake_job(monkeypatch, rank: int, mp: int) -> None:
    """Worker `rank` of an MP job as fleet.init leaves it (nothing here runs a collective)."""
    fleet.init()
    topo = Topology(dp_degree=1, mp_degree=mp, pp_degree=1)
    monkeypatch.setattr(env._STATE, "env", env.WorkerEnv(rank=rank, world_size=mp))
    init = fleet.DistributedStrategy()
    init.hybrid_configs = {"mp_degree": mp}
    monkeypatch.setattr(env._STATE, "strategy", init)
    monkeypatch.setattr(env._STATE, "hcg", HybridCommunicateGroup(topo, rank))


def _minimized(configs: dict) -> None:
    p = _export("gpt").clone()
    s = fleet.DistributedStrategy()
    s.tensor_parallel = True
    s.tensor_parallel_configs = configs
    fleet.distributed_optimizer(metaopt.optimizer.SGD(learning_rate=0.1), s).minimize(p.loss)


def _after_tensor_parallel(rank: int, configs: dict, program: metaopt.Program | None = None) -> str:
    """The program as fleet's tensor_parallel step leaves it on worker `rank` (the step's own plan
    and rewrite; the whole minimize would need the job's collectives for broadcast_init)."""
    s = fleet.DistributedStrategy()
    s.tensor_parallel = True
    s.tensor_parallel_configs = configs
    ctx = Context(strategy=s, optimizer=metaopt.optimizer.SGD(learning_rate=0.1), world_size=2, rank=rank)
    step = next(st for st in steps.STEPS if st.name == "tensor_parallel")
    p = (program or _export("gpt")).clone()
    return str(step.rewrite(p, step.plan(p, ctx), ctx))


@pytest.mark.parametrize("rank", [0, 1])
def test_fleet_auto_rewrites_exactly_as_the_hand_named_layers(monkeypatch, rank):
    _fake_job(monkeypatch, rank, mp=2)
    auto = _after_tensor_parallel(rank, {"column": "auto"})
    hand = _after_tensor_parallel(rank, {"column": tp_worker.COLUMN["gpt"], "row": tp_worker.ROW["gpt"]})
    assert auto == hand
    assert auto.count("= TPReduce(") == 4  # 2 blocks x (attention, MLP)


def test_fleet_auto_with_named_rows_is_refused(monkeypatch):
    _fake_job(monkeypatch, 0, mp=2)
    with pytest.raises(ValueError, match=r"\['column'\]='auto' finds the row layers too"):
        _minimized({"column": "auto", "row": ["transformer.h.0.mlp.c_proj"]})


def test_fleet_auto_rows_without_auto_columns_is_refused(monkeypatch):
    _fake_job(monkeypatch, 0, mp=2)
    with pytest.raises(ValueError, match=r"\['row'\]='auto' needs \['column'\]='auto'"):
        _minimized({"column": tp_worker.COLUMN["gpt"], "row": "auto"})


def test_a_single_layer_name_must_be_a_list():
    s = fleet.DistributedStrategy()
    with pytest.raises(TypeError, match=r"\['column'\].*a single layer must still be a list"):
        s.tensor_parallel_configs = {"column": "transformer.h.0.mlp.c_fc"}


class _Probe(nn.Module):
    """One Linear (on a 3-D input: torch exports a 2-D one as Gemm) straight into the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x).logsumexp(-1).mean()


def test_fleet_auto_with_nothing_to_split_is_refused_showing_why(monkeypatch):
    _fake_job(monkeypatch, 0, mp=2)
    torch.manual_seed(0)
    p = metaopt.export(_Probe(), (torch.randn(4, 3, 8),))
    with pytest.raises(ValueError, match=r"(?s)'auto' found no transformer block.*skipped  head: "):
        _after_tensor_parallel(0, {"column": "auto"}, p)


def test_auto_on_a_hugging_face_encoder():
    """HF BERT from the zoo (separate q, k, v; 2 layers): every block splits, the MLM head stays."""
    from zoo import harness, models

    _, p = harness.export(models.get("hf-bert"), 0.0)
    found = auto_layers(p, mp_degree=2)
    layer = "m.bert.encoder.layer.{}."
    assert sorted(found.column) == sorted(
        layer.format(i) + n
        for i in range(2)
        for n in ("attention.self.query", "attention.self.key", "attention.self.value", "intermediate.dense")
    )
    assert sorted(found.row) == sorted(
        layer.format(i) + n for i in range(2) for n in ("attention.output.dense", "output.dense")
    )


@pytest.mark.parametrize(
    ("name", "columns", "rows"),
    [
        # GPT-2's Conv1D: a Gemm with an [in, out] weight between Reshapes ([B, S, F] <-> [B*S, F])
        (
            "hf-gpt2",
            ["m.transformer.h.{}.attn.c_attn/gemm", "m.transformer.h.{}.mlp.c_fc/gemm"],
            ["m.transformer.h.{}.attn.c_proj/gemm", "m.transformer.h.{}.mlp.c_proj/gemm"],
        ),
        # OPT: q, k, v Linears, and fc1 / fc2 on 2-D rows (torch exports those as Gemm, transB=1);
        # out_proj's output is the attention module's
        (
            "hf-opt",
            [
                f"m.model.decoder.layers.{{}}.{n}"
                for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "fc1")
            ],
            ["m.model.decoder.layers.{}.self_attn", "m.model.decoder.layers.{}.fc2"],
        ),
    ],
)
def test_auto_on_hugging_face_decoders_with_gemm_layers(name, columns, rows):
    from zoo import harness, models

    _, p = harness.export(models.get(name), 0.0)
    found = auto_layers(p, mp_degree=2)
    assert sorted(found.column) == sorted(c.format(i) for i in range(2) for c in columns), str(found)
    assert sorted(found.row) == sorted(r.format(i) for i in range(2) for r in rows), str(found)


def test_auto_on_a_llama_splits_its_attention_and_mlp():
    """LLaMA's projections have no bias: exported as MatMul(x, Transpose(W)), fused into
    Linear(x, W) at import (before that, auto found no layer at all). The rotary embedding is one
    Rotary op (before, its Slice of the head dim stopped the split), the KV heads' repeat_kv
    (Slice, Unsqueeze, Expand, Reshape) carries the split: q, k, v, gate and up are column
    layers, o_proj (the attention module's output) and down row layers; the LM head stays whole
    (its loss cannot carry a split)."""
    from zoo import harness, models

    _, p = harness.export(models.get("hf-llama"), 0.0)
    found = auto_layers(p, mp_degree=2)
    layer = "m.model.layers.{}."
    columns = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
    assert sorted(found.column) == sorted((layer + n).format(i) for i in range(2) for n in columns)
    assert sorted(found.row) == sorted(
        (layer + n).format(i)[:-1] for i in range(2) for n in ("self_attn.", "mlp.")
    )
    assert [s.split(":")[0] for s in found.skipped] == ["m.lm_head"], found.skipped
