"""Config values that only the job can judge (a micro-batch count against the fed batch) are
checked before anything is allocated for them (issue 35: `accumulate_steps = 10**7` built a
10**7-step schedule and a 10**7-entry micro-batch list, > 3 GB, before the batch check)."""

from __future__ import annotations

import tracemalloc

import pytest
import torch

import metaopt
from metaopt import fleet


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.fc(x), y)


def _piped(accumulate_steps: int) -> metaopt.Program:
    torch.manual_seed(0)
    p = metaopt.export(_Net(), (torch.randn(4, 4), torch.randint(0, 3, (4,))))
    fleet.init(is_collective=True)
    s = fleet.DistributedStrategy()
    s.pipeline = True
    s.pipeline_configs = {"accumulate_steps": accumulate_steps}
    fleet.distributed_optimizer(metaopt.optimizer.SGD(learning_rate=0.1), s).minimize(p.loss)
    return p


def _feed(batch: int) -> dict[str, torch.Tensor]:
    return {"x": torch.randn(batch, 4), "y": torch.randint(0, 3, (batch,))}


def test_a_huge_micro_batch_count_is_refused_before_its_schedule_is_built():
    p = _piped(10**7)
    exe = metaopt.Executor("cpu")
    tracemalloc.start()  # Python objects: what a schedule and a micro-batch list are made of
    try:
        with pytest.raises(ValueError, match=r"batch 4 .* does not split into 10000000 equal"):
            exe.run(p, feed=_feed(4), fetch_list=[p.loss])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 50 * 2**20, peak  # before: > 3 GB


def test_an_empty_batch_is_refused():
    p = _piped(2)
    with pytest.raises(ValueError, match=r"batch 0 .* non-empty micro-batches"):
        metaopt.Executor("cpu").run(p, feed=_feed(0), fetch_list=[p.loss])


def test_a_batch_that_splits_still_trains():
    p = _piped(2)
    (loss,) = metaopt.Executor("cpu").run(p, feed=_feed(4), fetch_list=[p.loss])
    assert loss.shape == () and float(loss) > 0


def test_an_empty_batch_is_refused_by_a_training_step_and_nothing_changes():
    torch.manual_seed(0)
    p = metaopt.export(_Net(), (torch.randn(4, 4), torch.randint(0, 3, (4,))))
    metaopt.optimizer.Adam(learning_rate=0.1).minimize(p.loss)
    exe = metaopt.Executor("cpu")
    exe.run(p, feed=_feed(4), fetch_list=[p.loss])
    before = {k: v.clone() for k, v in exe.scope.items()}
    with pytest.raises(ValueError, match=r"feed 'x' binds 'batch' to 0: .* updates its state"):
        exe.run(p, feed=_feed(0), fetch_list=[p.loss])
    assert all(torch.equal(before[k], exe.scope[k]) for k in before)


def test_an_empty_batch_still_runs_a_forward_only_program():
    torch.manual_seed(0)
    p = metaopt.export(_Net(), (torch.randn(4, 4), torch.randint(0, 3, (4,))))
    (loss,) = metaopt.Executor("cpu").run(p, feed=_feed(0), fetch_list=[p.loss])
    assert torch.isnan(torch.as_tensor(loss))  # the mean of nothing, as in torch


def test_a_nan_loss_is_warned_about_at_the_1st_and_10th_run(caplog):
    import logging

    torch.manual_seed(0)
    p = metaopt.export(_Net(), (torch.randn(4, 4), torch.randint(0, 3, (4,))))
    metaopt.optimizer.SGD(learning_rate=0.1).minimize(p.loss)
    exe = metaopt.Executor("cpu")
    bad = _feed(4)
    bad["x"][0, 0] = float("nan")
    with caplog.at_level(logging.WARNING, logger="metaopt.runtime"):
        exe.run(p, feed=_feed(4), fetch_list=[p.loss])
        assert "the loss is" not in caplog.text
        for _ in range(10):
            exe.run(p, feed=bad, fetch_list=[p.loss])
    warned = [r.getMessage() for r in caplog.records if "the loss is nan" in r.getMessage()]
    assert len(warned) == 2 and "(1 run(s) so far)" in warned[0] and "(10 run(s)" in warned[1], warned
