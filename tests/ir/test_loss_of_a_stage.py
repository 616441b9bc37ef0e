"""`prog.loss` on a pipeline stage that does not compute it says which stage does."""

from __future__ import annotations

import pytest

from metaopt.ir import PipelineInfo, Program


def _stage(stage: int) -> Program:
    p = Program("main")
    p.pipeline = PipelineInfo(stage=stage, num_stages=3, micro_batches=2, schedule="1F1B", loss="loss")
    return p


def test_loss_on_a_stage_before_the_last_names_the_last_stage():
    with pytest.raises(
        ValueError,
        match=r"program 'main' is stage 0 of a 3-stage pipeline and has no loss: the loss 'loss' is "
        r"computed on the last stage \(stage 2\)",
    ):
        _ = _stage(0).loss


def test_program_without_pipeline_or_loss_keeps_the_short_message():
    with pytest.raises(ValueError, match=r"^program 'main' has no loss$"):
        _ = Program("main").loss
