"""The pipeline meta optimizer: Fleet's PipelineOptimizer on `metaopt.passes.pipeline`.

``minimize`` lets the inner chain (recompute / offload, the optimizer) build the whole
single-process training program on a copy, splits it into one stage program per worker
(``pipeline_configs``: ``cuts`` or balanced automatically, ``accumulate_steps``
micro-batches, ``schedule_mode``, ``chunks`` virtual stages per worker for the
interleaved schedule) and replaces the user's program with this worker's stage
(``fleet.worker_index() % num_stages``; with ``dp_degree`` > 1 the workers form
``dp_degree`` replicas of the pipeline, rank = replica x num_stages + stage, each fed its
own share of the data, a stage's grads averaged over its replicas), as Fleet does. Every
worker runs the same script; the executor then runs a step as micro-batches through
the schedule, the loss coming back on the last stage (None elsewhere). The plan is kept
in ``pipeline_plan`` and every stage's program in ``stage_programs`` (printable,
verifiable, savable as ONNX).
"""

from __future__ import annotations

import logging
from typing import Any

from metaopt.dump import dump
from metaopt.fleet import env
from metaopt.ir import Program, Var, did_you_mean
from metaopt.passes.pipeline import PipelinePlan, pipeline, plan_pipeline

logger = logging.getLogger("metaopt.fleet")


class PipelineOptimizer:
    def __init__(self, inner: Any, strategy: Any) -> None:
        cfg = strategy.pipeline_configs
        self.dp_degree = cfg["dp_degree"]
        # each entry: a param name (must be read in several stages: checked after the split)
        # or a group of names tied to the first (ColossalAI's shared module across stages)
        self.shared = [[e] if isinstance(e, str) else list(e) for e in cfg["shared"]]
        world = env.worker_num()
        if world % self.dp_degree:
            raise ValueError(
                f"pipeline_configs['dp_degree']={self.dp_degree} does not divide the {world} workers"
            )
        self.num_stages = cfg["num_stages"] or world // self.dp_degree
        if self.num_stages * self.dp_degree != world:
            raise ValueError(
                f"pipeline_configs['num_stages']={self.num_stages} x dp_degree={self.dp_degree} but the job "
                f"has {world} workers: each worker runs one stage of one replica"
            )
        self.inner = inner
        self.how = {
            "num_stages": self.num_stages,
            "cuts": list(cfg["cuts"]) or "auto",
            "micro_batches": cfg["accumulate_steps"],
            "schedule": cfg["schedule_mode"],
            "chunks": cfg["chunks"],
        }
        self.pipeline_plan: PipelinePlan | None = None
        self.stage_programs: list[Program] = []

    def minimize(
        self, loss: Var, startup_program: Any = None, parameter_list: Any = None, no_grad_set: Any = None
    ) -> tuple[list, list]:
        program = loss.program
        work = program.clone()
        for group in self.shared:
            _tie(work, group)
        _, params_grads = self.inner.minimize(
            work.var(loss.name), startup_program, parameter_list, no_grad_set
        )
        self.pipeline_plan = plan_pipeline(work, **self.how)
        for group in self.shared:
            if group[0] not in self.pipeline_plan.shared:
                stages = self.pipeline_plan.holders.get(group[0], ())
                raise ValueError(
                    f"pipeline_configs['shared']: {group[0]!r} is read by stage(s) {list(stages)} only: "
                    "nothing to share between workers"
                )
        self.stage_programs = pipeline(work, **self.how, dp_degree=self.dp_degree)
        stage = env.worker_index() % self.num_stages  # rank = replica * num_stages + stage
        mine = self.stage_programs[stage]
        dump(mine, f"pipeline_stage{stage}")
        logger.info("%s", self.pipeline_plan)
        program.replace_with(mine)
        optimize_ops = [op for op in program.ops if op.role == "optimize"]
        return optimize_ops, params_grads


def _tie(p: Program, group: list[str]) -> None:
    """Make every param of `group` the first one: reads of the others read it (their own
    initial values are dropped), so its grad sums every use, as one shared module's."""
    params = {v.name for v in p.params(trainable_only=False)}
    for name in group:
        if name not in params:
            raise ValueError(
                f"pipeline_configs['shared']: {name!r} is not a param of {p.name!r}"
                f"{did_you_mean(name, params)}"
            )
    keep = p.vars[group[0]]
    for name in group[1:]:
        v = p.vars[name]
        if (v.dtype, v.shape) != (keep.dtype, keep.shape):
            raise ValueError(
                f"pipeline_configs['shared']: {name!r} is {v.dtype}{list(v.shape)} but {keep.name!r} is "
                f"{keep.dtype}{list(keep.shape)}: tied params must agree"
            )
        for op in p.ops:
            op.inputs = [group[0] if x == name else x for x in op.inputs]
        del p.vars[name]
        p.values.pop(name, None)
