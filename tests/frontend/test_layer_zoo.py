"""Common nn layers beyond the reference programs: export, forward and grads against torch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import metaopt
from metaopt.passes.backward import append_backward


class Zoo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.conv1d = nn.Conv1d(8, 12, 3, padding=1)
        self.gn = nn.GroupNorm(3, 12)
        self.pool1d = nn.MaxPool1d(2)
        self.mha = nn.MultiheadAttention(12, 3, batch_first=True)
        self.conv2d = nn.Conv2d(1, 4, 3, stride=2, padding=1)
        self.bn2d = nn.BatchNorm2d(4)
        self.avg = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(12 + 4, 5)

    def forward(self, ids: torch.Tensor, image: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids).transpose(1, 2)  # [B, 8, S]
        h = nn.functional.silu(self.gn(self.conv1d(h)))
        h = self.pool1d(h).transpose(1, 2)  # [B, S/2, 12]
        a, _ = self.mha(h, h, h, need_weights=False)
        seq = torch.sigmoid(a).mean(1)  # [B, 12]
        img = self.avg(torch.relu(self.bn2d(self.conv2d(image)))).flatten(1)  # [B, 4]
        logits = torch.log_softmax(self.head(torch.cat([seq, img], 1)), -1)
        return nn.functional.mse_loss(logits, target) + nn.functional.nll_loss(logits, target.argmax(1))


def _inputs(batch: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, 20, (batch, 8), generator=g),
        torch.randn(batch, 1, 8, 8, generator=g),
        torch.randn(batch, 5, generator=g),
    )


@pytest.fixture(scope="module")
def zoo():
    torch.manual_seed(0)
    module = Zoo().train()
    return module, metaopt.export(module, _inputs(4, 0), name="zoo")


def test_zoo_forward_matches_torch(zoo):
    module, program = zoo
    kinds = {op.type for op in program.ops}
    assert {"Conv", "MaxPool", "BatchNormTraining", "Gather", "Sigmoid", "LogSoftmax"} <= kinds
    inputs = _inputs(3, 1)
    feed = dict(zip(("ids", "image", "target"), inputs, strict=True))
    (ours,) = metaopt.Executor().run(program, feed=feed, fetch_list=[program.loss])
    ref = Zoo().train()
    ref.load_state_dict(module.state_dict())
    with torch.no_grad():
        theirs = ref(*inputs).item()
    # float32 CPU, the bar.
    torch.testing.assert_close(torch.tensor(float(ours)), torch.tensor(theirs), rtol=1e-5, atol=1e-6)


def test_zoo_grads_match_torch_autograd(zoo):
    module, program = zoo
    q, params_grads = append_backward(program, loss=program.loss_name)
    inputs = _inputs(3, 2)
    got = metaopt.Executor().run(
        q,
        feed=dict(zip(("ids", "image", "target"), inputs, strict=True)),
        fetch_list=[g for _, g in params_grads],
        return_numpy=False,
    )
    ref = Zoo().train()
    ref.load_state_dict(module.state_dict())
    ref(*inputs).backward()
    named = dict(ref.named_parameters())
    assert {p for p, _ in params_grads} == set(named)
    for (p, _), g in zip(params_grads, got):
        torch.testing.assert_close(g, named[p].grad, rtol=1e-5, atol=1e-6, msg=p)
