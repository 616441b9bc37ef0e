"""padding_idx survives export (our Embedding op) and its grad rule leaves the pad row as torch does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import metaopt
from metaopt.frontend import onnx_save
from metaopt.passes.backward import append_backward


class Lookup(nn.Module):
    def __init__(
        self, padding_idx, *, tied: bool = False, functional: bool = False, freq: bool = False
    ) -> None:
        super().__init__()
        self.emb = nn.Embedding(12, 6, padding_idx=padding_idx, scale_grad_by_freq=freq)
        self.head = nn.Linear(6, 12, bias=False)
        if tied:
            self.head.weight = self.emb.weight
        self.functional = functional
        self.padding_idx = padding_idx

    def forward(self, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.functional:
            h = F.embedding(ids, self.emb.weight, padding_idx=self.padding_idx)
        else:
            h = self.emb(ids)
        return F.cross_entropy(self.head(torch.tanh(h)).flatten(0, 1), target.flatten())


def _inputs(batch: int, seed: int, pad: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 12, (batch, 5), generator=g)
    ids[:, :2] = pad % 12
    return ids, torch.randint(0, 12, (batch, 5), generator=g)


CASES = {
    "padding_idx=3": dict(padding_idx=3),
    "padding_idx=-1 (the last row)": dict(padding_idx=-1),
    "tied to the head": dict(padding_idx=3, tied=True),
    "F.embedding": dict(padding_idx=3, functional=True),
    "scale_grad_by_freq": dict(padding_idx=None, freq=True),
}


@pytest.mark.parametrize("case", CASES)
def test_pad_row_grad_matches_torch(case):
    kw = CASES[case]
    torch.manual_seed(0)
    module = Lookup(**kw)
    pad = kw["padding_idx"] if kw["padding_idx"] is not None else 0
    program = metaopt.export(module, _inputs(4, 0, pad))
    ops = [op for op in program.ops if op.type == "Embedding"]
    assert len(ops) == 1, case
    q, params_grads = append_backward(program, loss=program.loss_name)
    inputs = _inputs(3, 1, pad)
    got = metaopt.Executor().run(
        q,
        feed=dict(zip(("ids", "target"), inputs)),
        fetch_list=[g for _, g in params_grads],
        return_numpy=False,
    )
    module(*inputs).backward()
    named = dict(module.named_parameters())
    for (p, _), g in zip(params_grads, got):
        # The same aten kernels on both sides; sums in the same order: float32 noise at most.
        torch.testing.assert_close(g, named[p].grad, rtol=1e-5, atol=1e-6, msg=f"{case}: {p}")
    if kw["padding_idx"] is not None and not kw.get("tied"):
        assert not got[0][kw["padding_idx"]].any(), "the pad row's grad is exactly zero"


def test_lookup_without_padding_stays_a_gather():
    torch.manual_seed(0)
    program = metaopt.export(Lookup(None), _inputs(4, 0, 0))
    assert {op.type for op in program.ops} >= {"Gather"}
    assert not any(op.type == "Embedding" for op in program.ops)


def test_embedding_prints_and_round_trips_through_onnx(tmp_path):
    torch.manual_seed(0)
    program = metaopt.export(Lookup(3, tied=True), _inputs(4, 0, 3))
    text = str(program)
    assert "Embedding(" in text and "padding_idx=3" in text
    path = tmp_path / "m.onnx"
    onnx_save.save(program, path)
    assert str(metaopt.load(path)) == text
