"""In-place and feature dropouts export as ONNX Dropout (frontend/translations.py `dropout_forms`):
``nn.Dropout(inplace=True)`` and ``nn.Dropout2d`` used to reach the program as Bernoulli draws and
arithmetic, which an eval program (``clone(for_test=True)``) cannot tell from a model's own
randomness. Their training semantics stay torch's: one draw per channel, scaled by 1/(1-p), and a
later reader of a value dropped in place reads the dropped value."""

from __future__ import annotations

import torch
from torch import nn

import metaopt


class InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5, inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        z = self.drop(y)  # y itself is dropped too (in place)
        return (z + y).sum()


class Channels(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 1)
        self.drop = nn.Dropout2d(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.conv(x)).sum()


def _random_ops(p: metaopt.Program) -> list[str]:
    return [op.type for op in p.ops if op.type.startswith("Random") or op.type == "Bernoulli"]


def test_an_in_place_dropout_is_a_dropout_op_and_later_readers_see_its_result():
    x = torch.randn(4, 8)
    p = metaopt.export(InPlace(), (x,))
    assert [op.type for op in p.ops].count("Dropout") == 1 and not _random_ops(p)
    (z,) = p.modules["drop"]
    loss, dropped = metaopt.Executor("cpu").run(p, feed={"x": x}, fetch_list=[p.loss, z], return_numpy=False)
    torch.testing.assert_close(loss, 2 * dropped.sum())  # z + y where y was dropped in place: 2z
    assert 0 < int((dropped == 0).sum()) < dropped.numel()


def test_a_feature_dropout_draws_one_mask_per_channel_scaled_as_torch_does():
    x = torch.rand(4, 3, 5, 5) + 0.5
    module = Channels()
    p = metaopt.export(module, (x,))
    assert [op.type for op in p.ops].count("Dropout") == 1 and not _random_ops(p)
    (out,) = p.modules["drop"]
    (y,) = metaopt.Executor("cpu").run(p, feed={"x": x}, fetch_list=[out], return_numpy=False)
    with torch.no_grad():
        whole = module.conv(x)
    kept = (y != 0).flatten(2)
    assert bool((kept.all(-1) | ~kept.any(-1)).all())  # each channel all kept or all dropped
    assert 0 < int(kept.all(-1).sum()) < kept.shape[0] * kept.shape[1]
    keep = kept.all(-1)[..., None, None]
    torch.testing.assert_close(y, torch.where(keep, whole * 2.0, torch.zeros_like(whole)))
