"""The pipeline meta optimizer: Fleet's PipelineOptimizer on `metaopt.passes.pipeline`.

``minimize`` lets the inner chain (recompute / offload, the optimizer) build the whole
single-process training program on a copy, splits it into one stage program per worker
(``pipeline_configs``: ``cuts`` or balanced automatically, ``accumulate_steps``
micro-batches, ``schedule_mode``, ``chunks`` virtual stages per worker for the
interleaved schedule) and replaces the user's program with this worker's stage
(``fleet.worker_index()``), as Fleet does. Every worker runs the same script; the
executor then runs a step as micro-batches through the schedule, the loss coming back
on the last stage (None elsewhere). The plan is kept in ``pipeline_plan`` and every
worker's program in ``stage_programs`` (printable, verifiable, savable as ONNX).
"""

from __future__ import annotations

import logging
from typing import Any

from metaopt.dump import dump
from metaopt.fleet import env
from metaopt.ir import Program, Var
from metaopt.passes.pipeline import PipelinePlan, pipeline, plan_pipeline

logger = logging.getLogger("metaopt.fleet")


class PipelineOptimizer:
    def __init__(self, inner: Any, strategy: Any) -> None:
        cfg = strategy.pipeline_configs
        if cfg["dp_degree"] > 1:
            raise NotImplementedError(
                f"pipeline_configs['dp_degree']={cfg['dp_degree']}: data parallel over pipeline replicas "
                "is not implemented yet; use dp_degree=1 (one pipeline over all workers)"
            )
        if cfg["shared"]:
            raise NotImplementedError(
                "pipeline_configs['shared']: declaring ties between different params is not implemented "
                "yet; a param read in several stages (one var, as torch.onnx exports tied weights) is "
                "detected and shared automatically"
            )
        world = env.worker_num()
        self.num_stages = cfg["num_stages"] or world
        if self.num_stages != world:
            raise ValueError(
                f"pipeline_configs['num_stages']={self.num_stages} but the job has {world} workers: "
                "each worker runs one stage"
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
        _, params_grads = self.inner.minimize(
            work.var(loss.name), startup_program, parameter_list, no_grad_set
        )
        self.pipeline_plan = plan_pipeline(work, **self.how)
        self.stage_programs = pipeline(work, **self.how)
        mine = self.stage_programs[env.worker_index()]
        dump(mine, f"pipeline_stage{env.worker_index()}")
        logger.info("%s", self.pipeline_plan)
        program.replace_with(mine)
        optimize_ops = [op for op in program.ops if op.role == "optimize"]
        return optimize_ops, params_grads
