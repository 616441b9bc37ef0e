"""THE training rewrite: one literal list of steps, run in this order by one driver.

``fleet.distributed_optimizer(opt, strategy).minimize(loss)`` runs `STEPS` with
`metaopt.passes.driver.run_steps`; each step that the strategy (and the worker count)
enables plans once, rewrites with a pure pass from ``metaopt/passes`` given that plan, and
is verified, dumped (``METAOPT_DUMP``) and logged before the next one runs. The order is
written once, in `STEPS` below; ``print(opt.plan())`` shows every row with why it runs or not
(docs/architecture.md's drawing is checked against it: tests/fleet/test_steps_order.py).

Why this order: the LM-head fusion first, on the exported forward (it replaces ops amp would
cast, and the backward emits the fused op's chunked grad); tensor parallel next, also on the
forward (it slices params and inserts TPCopy / TPReduce, whose grad rules give the backward its
model-parallel all-reduces), so every later step works on this rank's program alone; amp
before the backward so the grad ops inherit the forward's precisions; the backward and the
optimizer before everything that rewrites a training program;
gradient merge before data parallel so the all-reduce runs on the merged grads, once per
k runs; recompute after data parallel (its re-emitted forward ops land before their grad
ops, whatever collectives are there; beside tensor parallel they re-run TPReduce, which every
MP rank reaches in the same order, as every rank runs the same program); the partition after
recompute (it slices recompute's checkpoints) and offload after both (it moves the
checkpoints, or their slices where partitioned); the pipeline splits the finished
single-process program, so every recompute and offload op follows the forward var it stems
from to its stage; sharding after them all (stage 3 gathers a param again before its first
backward read, a recompute segment's included; data parallel, or beside a pipeline the split,
has already reduce-scattered the grads it updates; after a split it shards each stage
program's own updates); unscaling
comes late so it checks the grads the updates read (after any all-reduce, on every
stage) and master weights rewire those updates; updates move into the backward last, so
they follow every op that reads a param (recomputed forward ops included), every
all-reduce and every op another step added to the update phase; data parallel's all-reduces are
left in flight after that (overlap_comm), when every reader of a reduced grad is where it stays,
so each wait goes right before the first; the pipeline's stage programs
are cut into the schedule's phases at the very end, when nothing changes them any more.

A step's ``enabled`` says why it runs or not (``opt.plan()`` prints every row); its
``check`` refuses a configuration before any step rewrites anything. Adding a feature
is one pass file under ``metaopt/passes`` and one row here.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from functools import partial
from typing import Any

import torch

from metaopt.fleet import env
from metaopt.fleet.topology import Topology, hybrid_is_set, job_topology
from metaopt.ir import Program
from metaopt.ir.program import (
    PADDLE_SCHEDULES,
    SPLIT_BACKWARD_SCHEDULES,
    UNBUILT_SCHEDULES,
    V_SHAPED_SCHEDULES,
)
from metaopt.passes.driver import Context, PartPlans, Step, check_declarations
from metaopt.passes.minimize import APPEND_BACKWARD, APPLY_OPTIMIZER

logger = logging.getLogger("metaopt.fleet")


# --- fused LM head + cross-entropy -----------------------------------------------------------


def _lce_on(ctx: Context) -> tuple[bool, str]:
    on = bool(ctx.strategy.fuse_linear_cross_entropy)
    if on and not _is_metaopt_optimizer(ctx.optimizer):
        # another optimizer's minimize gets the program as exported (Fleet hands it everything)
        return False, "the optimizer is not metaopt's: its own minimize runs"
    return on, f"strategy.fuse_linear_cross_entropy={on}"


def _is_metaopt_optimizer(opt: Any) -> bool:
    from metaopt.optimizer import Optimizer

    return isinstance(opt, Optimizer)


def _lce_plan(p: Program, ctx: Context) -> Any:
    from metaopt.passes.fuse_linear_cross_entropy import plan_fuse_linear_cross_entropy

    # A vocab-split head runs only fused (VocabParallelLinearCrossEntropy): fuse it whatever its size.
    s = ctx.strategy
    vocab = s.tensor_parallel and s.tensor_parallel_configs["vocab"] and _mp_degree(ctx) > 1
    return plan_fuse_linear_cross_entropy(p, **({"min_classes": 1} if vocab else {}))


def _fuse_linear_ce(p: Program, plan: Any, ctx: Context) -> Program:
    from metaopt.passes.fuse_linear_cross_entropy import apply_fuse_linear_cross_entropy

    return apply_fuse_linear_cross_entropy(p, plan)  # the loss keeps its name: ctx.loss holds


# --- tensor parallel ------------------------------------------------------------------------


def _mp_degree(ctx: Context) -> int:
    """The job's mp_degree (1 where the layout itself is refused: ``hybrid_errors`` says why)."""
    try:
        return _layout(ctx).mp_degree
    except ValueError:
        return 1


def _tp_on(ctx: Context) -> tuple[bool, str]:
    if not ctx.strategy.tensor_parallel:
        return False, "strategy.tensor_parallel=False"
    mp = _mp_degree(ctx)
    if mp == 1:
        return False, "strategy.tensor_parallel=True but mp_degree=1: nothing to split"
    return True, f"strategy.tensor_parallel=True (mp_degree={mp})"


def _tp_check(ctx: Context) -> None:
    """Refuse, by name, what does not run with split params yet."""
    why: list[str] = []
    # strategy.pipeline runs: each stage's TP collectives over its MP group, sends between the
    # same MP rank of neighbouring stages (runtime/pipeline.py), cuts outside split regions
    # (`_pp_plan`)
    # strategy.recompute runs: its re-emitted TPReduce (and recompute partition's gathers) meet
    # their peers' in the same order on every MP rank, as every rank runs the same program
    # (minimize compares them), so the MP group recomputes in lockstep
    clip = getattr(ctx.optimizer, "grad_clip", None)
    if clip is not None and type(clip).__name__ == "ClipGradByGlobalNorm":
        why.append(
            "grad_clip=ClipGradByGlobalNorm (the norm of split grads needs an all-reduce over the MP group)"
        )
    s = ctx.strategy
    if (
        s.tensor_parallel_configs["sequence_parallel"]
        and s.recompute
        and s.recompute_configs["enable_partition"]
    ):
        why.append(
            "tensor_parallel_configs['sequence_parallel'] beside recompute_configs['enable_partition'] (a "
            "checkpoint on the local sequence differs per rank: slicing it as a replicated one is not built)"
        )
    if why:
        raise NotImplementedError(
            f"strategy.tensor_parallel=True with mp_degree={_mp_degree(ctx)} cannot be combined yet with: "
            + "; ".join(why)
        )


def _tp_plan(p: Program, ctx: Context) -> Any:
    from metaopt.passes.tensor_parallel import plan_tensor_parallel

    topo, cfg = _layout(ctx), ctx.strategy.tensor_parallel_configs
    mp, rank = topo.mp_degree, topo.get_coord(ctx.rank).model
    column, row, found = list(cfg["column"]), list(cfg["row"]), None
    if column == ["auto"]:
        from metaopt.passes.tensor_parallel_auto import auto_layers

        found = auto_layers(p, mp_degree=mp, mp_rank=rank)
        if not found.column:
            raise ValueError(
                "tensor_parallel_configs['column']='auto' found no transformer block to split in "
                f"{p.name!r}:\n{found}\nname the layers in ['column'] and ['row'] instead"
            )
        column, row = found.column, found.row
    group = topo.group_ranks("model", ctx.rank)
    plan = plan_tensor_parallel(
        p, mp_degree=mp, mp_rank=rank, column=column, row=row, group=group, vocab=list(cfg["vocab"]),
        one_process_dropout=cfg["one_process_dropout"],
    )  # fmt: skip
    if found is not None:  # why each Linear 'auto' left replicated, in place of "not named"
        rest = [s for s in plan.skipped if not s.endswith("a Linear not named in column or row (replicated)")]
        plan.skipped[:] = [*(f"auto: {s}" for s in found.skipped), *rest]
    return plan


def _tensor_parallel(p: Program, plan: Any, ctx: Context) -> Program:
    from metaopt.passes.tensor_parallel import tensor_parallel

    q = tensor_parallel(p, plan=plan)
    ctx.tp_plan = plan
    if ctx.strategy.tensor_parallel_configs["sequence_parallel"]:
        from metaopt.passes.sequence_parallel import plan_sequence_parallel, sequence_parallel

        sp_plan = plan_sequence_parallel(q, degree=plan.mp_degree, group=plan.group)
        q = sequence_parallel(q, plan=sp_plan)
        ctx.sp_plan = sp_plan
    # The workers' programs are compared line by line at minimize, and the MP groups of two
    # replicas differ ([0, 1] and [2, 3]): name the group by its axis; the kernels look this
    # worker's up in the groups fleet.init made on every worker (layout/groups.py).
    ranks = list(plan.group)
    for op in q.ops:
        for attr in ("group", "slice_group"):  # the collectives the passes added (fields, not types),
            if op.attrs.get(attr) == ranks:  # and sequence parallel's dropout drawing a chunk
                op.attrs[attr] = "model_parallel"
    return q


def split_params(ctx: Context) -> list[str]:
    """The params tensor parallel sliced: each model-parallel rank holds its own part."""
    plan = ctx.tp_plan
    return [] if plan is None else [sp.name for sp in plan.params]


def _layers_named(cfg: dict) -> bool:
    """Column and row layers together, or none of them beside a vocab-parallel table."""
    if cfg["column"] or cfg["row"]:
        return bool(cfg["column"] and cfg["row"])
    return bool(cfg["vocab"])


def tensor_parallel_errors(strategy: Any, topo: Topology, init: Topology | None) -> list[Exception]:
    """What minimize refuses of tensor parallel's layout: an mp axis nothing splits for, a
    tensor_parallel_degree other than the hybrid mp_degree, model-parallel groups that
    fleet.init did not make, layers not named."""
    mp, cfg = topo.mp_degree, strategy.tensor_parallel_configs
    degree = cfg["tensor_parallel_degree"]
    if not strategy.tensor_parallel:
        if mp == 1:
            return []
        return [
            ValueError(
                f"hybrid_configs mp_degree={mp} needs strategy.tensor_parallel=True with "
                "tensor_parallel_configs['column'] and ['row'] naming the layers to split: without it "
                "nothing would run on the model axis"
            )
        ]
    errors: list[Exception] = []
    if degree not in (1, mp):
        errors.append(
            ValueError(
                f"tensor_parallel_configs['tensor_parallel_degree']={degree} conflicts with hybrid_configs "
                f"mp_degree={mp}: the hybrid degrees lay the workers out; leave tensor_parallel_degree at 1 "
                f"or set it equal (and give fleet.init's strategy hybrid_configs {{'mp_degree': {degree}}})"
            )
        )
    elif mp > 1 and init is None:
        errors.append(
            ValueError(
                f"mp_degree={mp}: tensor parallel's groups are fleet.init's; give fleet.init a strategy with "
                f"hybrid_configs {{'mp_degree': {mp}}} (fleet.init(is_collective=True, strategy=strategy))"
            )
        )
    auto = cfg["column"] == ["auto"]
    if auto and cfg["row"] not in ([], ["auto"]):
        errors.append(
            ValueError(
                f"tensor_parallel_configs['column']='auto' finds the row layers too; ['row']={cfg['row']} "
                "would be ignored: leave it empty (or 'auto'), or name both"
            )
        )
    elif cfg["row"] == ["auto"] and not auto:
        errors.append(
            ValueError(
                "tensor_parallel_configs['row']='auto' needs ['column']='auto' too: 'auto' finds the "
                "column and row layers of a block together"
            )
        )
    elif mp > 1 and not auto and not _layers_named(cfg):
        errors.append(
            ValueError(
                "strategy.tensor_parallel=True needs tensor_parallel_configs['column'] and ['row']: the "
                "Linear layers to split (module paths or patterns, e.g. 'transformer.h.*.mlp.c_fc'), or "
                "'column': 'auto', or only ['vocab'] (the embedding / LM head to split)"
            )
        )
    return errors


# --- segment parallel -------------------------------------------------------------------------


def _hybrid_degree(ctx: Context, key: str) -> int:
    """The job's hybrid `key` degree (1 where the layout itself is refused: ``hybrid_errors`` says why)."""
    try:
        return getattr(_layout(ctx), key)
    except ValueError:
        return 1


def _axis_on(ctx: Context, key: str) -> tuple[bool, str]:
    degree = _hybrid_degree(ctx, key)
    return degree > 1, f"hybrid_configs {key}={degree}"


def _refuse_beside(
    ctx: Context, key: str, what: str, flags: dict[str, str], clip: str, more: list[str]
) -> None:
    """A hybrid axis's check: its groups must be fleet.init's, and what does not run beside it yet
    (strategy `flags`, global-norm clipping for the reason `clip`, `more`) is refused by name."""
    degree = _hybrid_degree(ctx, key)
    if env.hybrid_topology() is None:
        raise ValueError(
            f"{key}={degree}: {what}'s groups are fleet.init's; give fleet.init the strategy with "
            "hybrid_configs (fleet.init(is_collective=True, strategy=strategy))"
        )
    why = [f"strategy.{f}=True ({reason})" for f, reason in flags.items() if getattr(ctx.strategy, f)]
    why += more
    grad_clip = getattr(ctx.optimizer, "grad_clip", None)
    if grad_clip is not None and type(grad_clip).__name__ == "ClipGradByGlobalNorm":
        why.append(f"grad_clip=ClipGradByGlobalNorm ({clip})")
    if why:
        raise NotImplementedError(
            f"hybrid_configs {key}={degree} cannot be combined yet with: " + "; ".join(why)
        )


def _sep_on(ctx: Context) -> tuple[bool, str]:
    degree = _hybrid_degree(ctx, "exchange_degree")
    return degree > 1, f"hybrid_configs sep_degree={degree}"


_cp_on = partial(_axis_on, key="cp_degree")


def _sep_check(ctx: Context, key: str = "sep_degree", what: str = "segment parallel") -> None:
    """Refuse, by name, what does not run on the local sequence yet (context parallel: beside
    tensor parallel too, but not its sequence parallel, which would split the sequence again)."""
    ring = key == "cp_degree"
    flags = {
        **({} if ring else {"tensor_parallel": "split layers beside the local sequence"}),
        **({} if ring else {"pipeline": "pipeline stages on the local sequence"}),
        **({} if ring else {"sharding": "ZeRO beside the local sequence"}),
        "localsgd": "local SGD averages params over the data-parallel group only",
    }
    ep = _hybrid_degree(ctx, "ep_degree")
    more = [f"hybrid_configs ep_degree={ep} (experts on the local sequence)"] if ep > 1 else []
    s = ctx.strategy
    if ring and s.tensor_parallel and s.tensor_parallel_configs["sequence_parallel"]:
        more.append("tensor_parallel_configs['sequence_parallel'] (it would split the local sequence again)")
    clip = "the grads are summed over the sep group in the backward"
    _refuse_beside(ctx, key, what, flags, clip, more)


def _sep_plan(p: Program, ctx: Context) -> Any:
    from metaopt.passes.segment_parallel import plan_segment_parallel

    topo = _layout(ctx)
    return plan_segment_parallel(p, degree=topo.sep_degree, group=topo.group_ranks("sep", ctx.rank))


def _cp_plan(p: Program, ctx: Context) -> Any:
    from metaopt.passes.context_parallel import plan_context_parallel

    topo = _layout(ctx)
    return plan_context_parallel(p, degree=topo.sep_degree, group=topo.group_ranks("sep", ctx.rank))


def _segment_parallel(p: Program, plan: Any, ctx: Context) -> Program:
    from metaopt.passes.segment_parallel import GROUP, segment_parallel

    q = segment_parallel(p, plan=plan)
    ctx.sep_plan = plan
    # every worker's program reads the same (they are compared at minimize): the group by its axis
    ranks = list(plan.group)
    for op in q.ops:
        for attr in ("group", "slice_group"):
            if op.attrs.get(attr) == ranks:
                op.attrs[attr] = GROUP
    return q


# --- expert parallel ---------------------------------------------------------------------------


def _cap_on(ctx: Context) -> tuple[bool, str]:
    cf = ctx.strategy.moe_configs["capacity_factor"]
    return cf is not None, f"moe_configs['capacity_factor']={cf}"


def _cap_plan(p: Program, ctx: Context) -> Any:
    from metaopt.passes.expert_capacity import plan_expert_capacity

    cf = ctx.strategy.moe_configs["capacity_factor"]
    plan = plan_expert_capacity(p, capacity_factor=cf)
    if not plan.routes:
        raise ValueError(
            f"moe_configs['capacity_factor']={cf}, but {p.name!r} has no expert layers (no GroupedMatMul: "
            "Hugging Face MoE models export them); leave it None"
        )
    return plan


def _expert_capacity(p: Program, plan: Any, ctx: Context) -> Program:
    from metaopt.passes.expert_capacity import expert_capacity

    return expert_capacity(p, plan=plan)


def _ep_degree(ctx: Context) -> int:
    return _hybrid_degree(ctx, "ep_degree")


_ep_on = partial(_axis_on, key="ep_degree")


def _ep_check(ctx: Context) -> None:
    """Refuse, by name, what does not run with experts split yet."""
    flags = {
        "pipeline": "MoE layers in pipeline stages",
        "localsgd": "local SGD averages params: the experts are split",
        "fp16_allreduce": "the expert grads' own reduction in float16",
        "tensor_parallel": "experts beside split dense layers",
    }
    clip = "the norm of split expert grads: a sum over the group"
    _refuse_beside(ctx, "ep_degree", "expert parallel", flags, clip, [])


def _ep_plan(p: Program, ctx: Context) -> Any:
    from metaopt.passes.expert_parallel import plan_expert_parallel

    topo = _layout(ctx)
    group = topo.group_ranks("expert", ctx.rank)
    plan = plan_expert_parallel(p, ep_degree=topo.ep_degree, ep_rank=group.index(ctx.rank), group=group)
    if not plan.params:
        raise ValueError(
            f"hybrid_configs ep_degree={topo.ep_degree}, but {p.name!r} has no expert layers to split "
            "(no GroupedMatMul: Hugging Face MoE models export them); leave ep_degree at 1"
        )
    return plan


def _expert_parallel(p: Program, plan: Any, ctx: Context) -> Program:
    from metaopt.passes.expert_parallel import expert_parallel

    q = expert_parallel(p, plan=plan)
    ctx.ep_plan = plan
    # as tensor parallel's: the group by its axis, so every worker's program prints the same
    for op in q.ops:
        if op.attrs.get("group") == plan.group:  # the ops the pass added (fields, not types)
            op.attrs["group"] = "expert_parallel"
    return q


def expert_params(ctx: Context) -> list[str]:
    """The params expert parallel cut to this worker's experts."""
    return [] if ctx.ep_plan is None else list(ctx.ep_plan.params)


# --- amp -----------------------------------------------------------------------------------


def _amp_on(ctx: Context) -> tuple[bool, str]:
    return bool(ctx.strategy.amp), f"strategy.amp={bool(ctx.strategy.amp)}"


def _amp_how(ctx: Context) -> dict:
    from metaopt.passes.amp import check_op_types

    cfg = ctx.strategy.amp_configs
    return {
        "dtype": cfg["dtype"],
        "custom_white_list": check_op_types("amp_configs['custom_white_list']", cfg["custom_white_list"]),
        "custom_black_list": check_op_types("amp_configs['custom_black_list']", cfg["custom_black_list"]),
        "custom_black_varnames": list(cfg["custom_black_varnames"]),
        "use_pure_fp16": bool(cfg["use_pure_fp16"]),
    }


def _amp_check(ctx: Context) -> None:
    from metaopt.ops.kernels.amp import check_amp_device
    from metaopt.passes.amp import AmpError

    cfg = ctx.strategy.amp_configs
    how = _amp_how(ctx)
    both = sorted(set(how["custom_white_list"]) & set(how["custom_black_list"]))
    if both:
        raise AmpError(
            f"op type {both[0]!r} is in both amp_configs['custom_white_list'] and ['custom_black_list']"
        )
    if how["use_pure_fp16"] and cfg["use_fp16_guard"]:
        raise AmpError(
            "amp_configs['use_pure_fp16']=True with use_fp16_guard=True runs only the ops inside "
            "fp16_guard regions in low precision, and an exported program has none: set "
            "amp_configs['use_fp16_guard'] = False (every op but the black list in low precision)"
        )
    # The device this worker trains on, by fleet's convention: refused here, before anything
    # is rewritten; the program's first op checks the executor's actual device again.
    cuda = torch.cuda.is_available()
    check_amp_device(cfg["dtype"], torch.device("cuda", env.local_rank()) if cuda else torch.device("cpu"))


def _amp_plan(p: Program, ctx: Context) -> Any:
    from metaopt.passes.amp import plan_amp

    return plan_amp(p, **_amp_how(ctx))


def _amp_casts(p: Program, plan: Any, ctx: Context) -> Program:
    from metaopt.passes.amp import apply_amp

    return apply_amp(p, plan)


def _loss_scaling(ctx: Context) -> tuple[bool, str]:
    if not ctx.strategy.amp:
        return False, "strategy.amp=False"
    if ctx.loss_scaling:
        return True, f"amp_configs['dtype']={ctx.strategy.amp_configs['dtype']!r} scales the loss"
    return False, f"amp_configs['dtype']={ctx.strategy.amp_configs['dtype']!r}: no loss scaling"


def _scale_loss(p: Program, plan: Any, ctx: Context) -> Program:
    from metaopt.passes.amp import scale_loss, scaled_loss

    q = scale_loss(p, init_loss_scaling=ctx.strategy.amp_configs["init_loss_scaling"])
    ctx.loss = scaled_loss(q)  # the var scale_loss made: the backward starts there
    return q


def _unscale_grads(p: Program, plan: Any, ctx: Context) -> Program:
    from metaopt.passes.amp import unscale_grads

    cfg = ctx.strategy.amp_configs
    return unscale_grads(
        p,
        use_dynamic_loss_scaling=bool(cfg["use_dynamic_loss_scaling"]),
        incr_every_n_steps=cfg["incr_every_n_steps"],
        decr_every_n_nan_or_inf=cfg["decr_every_n_nan_or_inf"],
        incr_ratio=cfg["incr_ratio"],
        decr_ratio=cfg["decr_ratio"],
        master_dtype="float32" if cfg["use_pure_fp16"] else None,
        # a pipeline stage, ZeRO's reduce-scattered grads (each worker checks its slices), or
        # expert parallel's (each worker checks its own experts'): the workers must agree on
        # which steps they skip
        across_workers=p.pipeline is not None or _zero_scatter(ctx) is not None or ctx.ep_plan is not None,
        init_loss_scaling=cfg["init_loss_scaling"],
    )


def _pure_fp16(ctx: Context) -> tuple[bool, str]:
    if not ctx.strategy.amp:
        return False, "strategy.amp=False"
    on = bool(ctx.strategy.amp_configs["use_pure_fp16"])
    return on, f"amp_configs['use_pure_fp16']={on}"


def _master_weights(p: Program, plan: Any, ctx: Context) -> Program:
    from metaopt.passes.master_weights import master_weights

    return master_weights(p)


# --- backward and optimizer -------------------------------------------------------------------


# --- LAMB and LARS: layer-wise adaptive updates ----------------------------------------------------

# strategy flag -> (the optimizer class it wraps, as Fleet's LambOptimizer / LarsOptimizer do)
_LAYERWISE = {"lamb": "Adam", "lars": "Momentum"}


def _layerwise_on(ctx: Context, kind: str) -> tuple[bool, str]:
    flag = bool(getattr(ctx.strategy, kind))
    return flag, f"strategy.{kind}={flag}"


def _layerwise_check(ctx: Context, kind: str) -> None:
    """Refuse an inner optimizer the meta optimizer cannot wrap (Fleet disables it silently)."""
    import metaopt.optimizer as optimizers

    opt, want = ctx.optimizer, _LAYERWISE[kind]
    why = None
    if type(opt) is not getattr(optimizers, want):  # AdamW's decoupled decay is not LAMB's
        why = f"it wraps a metaopt.optimizer.{want}, got {type(opt).__name__}"
    elif opt.weight_decay != 0:
        why = (
            f"its weight decay is {kind}_configs' (the {want}'s weight_decay={opt.weight_decay} "
            "would be lost)"
        )
    elif kind == "lamb" and (opt.amsgrad or opt.fused):
        why = "amsgrad and fused have no LAMB form"
    elif kind == "lars" and (opt.momentum == 0 or opt.nesterov or opt.dampening != 0):
        why = "LARS is plain momentum: momentum > 0, no nesterov, no dampening"
    if why:
        raise ValueError(f"strategy.{kind}=True: {why}")


def _layerwise_plan(p: Program, ctx: Context, kind: str) -> Any:
    from metaopt.passes.layerwise import plan_layerwise

    opt, cfg = ctx.optimizer, getattr(ctx.strategy, f"{kind}_configs")
    if kind == "lamb":
        attrs = {"beta1": opt.beta1, "beta2": opt.beta2, "epsilon": opt.epsilon}
        decay = cfg["lamb_weight_decay"]
    else:
        attrs = {"momentum": opt.momentum, "lars_coeff": cfg["lars_coeff"], "epsilon": cfg["epsilon"]}
        decay = cfg["lars_weight_decay"]
    exclude = list(cfg["exclude_from_weight_decay"])
    return plan_layerwise(
        p, kind=kind, source=opt.update_op_type(), attrs=attrs, weight_decay=decay, exclude=exclude
    )


def _layerwise(p: Program, plan: Any, ctx: Context) -> Program:
    from metaopt.passes.layerwise import apply_layerwise

    return apply_layerwise(p, plan)


# --- gradient merge ---------------------------------------------------------------------------


def _gm_on(ctx: Context) -> tuple[bool, str]:
    on = bool(ctx.strategy.gradient_merge)
    if on:
        cfg = ctx.strategy.gradient_merge_configs
        return True, f"strategy.gradient_merge=True (k_steps={cfg['k_steps']}, avg={cfg['avg']})"
    return False, "strategy.gradient_merge=False"


def _gradient_merge(p: Program, plan: Any, ctx: Context) -> Program:
    from metaopt.passes.gradient_merge import gradient_merge

    cfg = ctx.strategy.gradient_merge_configs
    return gradient_merge(p, k_steps=cfg["k_steps"], avg=cfg["avg"], loss_grad=ctx.loss_grad)


# --- data parallel ------------------------------------------------------------------------------


def _init_on(ctx: Context) -> tuple[bool, str]:
    if ctx.world_size == 1:
        return False, "fleet.worker_num()=1"
    if ctx.strategy.pipeline:
        return False, "strategy.pipeline=True replicates over hybrid_configs' or pipeline_configs' dp_degree"
    return True, f"fleet.worker_num()={ctx.world_size}"


def _dp_on(ctx: Context) -> tuple[bool, str]:
    on, why = _init_on(ctx)
    if on and ctx.strategy.localsgd:
        return False, "strategy.localsgd=True averages the params instead of the grads"
    width, axes = _replica_width(ctx) if on else (1, "")
    if width == 1:
        # without a pipeline, tensor or segment parallel the data axis is every worker (pp_degree
        # > 1 needs strategy.pipeline, mp_degree > 1 strategy.tensor_parallel)
        return on, why
    dp = ctx.world_size // width
    if dp == 1:
        return False, f"{axes} spans every worker: no data-parallel replicas"
    return True, f"dp_degree={dp} x {axes}: over each data-parallel group"


def _replica_width(ctx: Context) -> tuple[int, str]:
    """How many workers one data-parallel replica spans beside the data axis (tensor parallel's
    mp_degree, segment parallel's sep_degree: their grads are theirs to sum), and their names."""
    mp = _mp_degree(ctx) if ctx.strategy.tensor_parallel else 1
    sep, cp = _hybrid_degree(ctx, "exchange_degree"), _hybrid_degree(ctx, "cp_degree")
    axes = [f"{k}={d}" for k, d in (("mp_degree", mp), ("sep_degree", sep), ("cp_degree", cp)) if d > 1]
    return mp * sep * cp, " x ".join(axes)


def _dp_check(ctx: Context) -> None:
    env.require_process_group("data parallel")


def _dp_how(p: Program, ctx: Context) -> dict:
    from metaopt.passes.optimize import update_grads

    s = ctx.strategy
    width, _ = _replica_width(ctx)
    scatter = _zero_scatter(ctx)
    return {
        "grads": update_grads(p),
        "world_size": ctx.world_size // width,
        "bucket_bytes": int(s.fuse_grad_size_in_MB) * 2**20 if s.fuse_all_reduce_ops else 0,
        # grads final only at the window's end; ZeRO stage 1 reduces them after the backward
        "at_update": p.gradient_merge is not None
        or (scatter is not None and s.sharding_configs["stage"] == 1),
        # beside tensor (segment) parallel the replicas holding the same slices (chunks) are one
        # dp group, not all
        "group": "data_parallel" if width > 1 else None,
        "scatter_parts": scatter,
        # this worker's experts' grads hold every token of its expert group already: summed over
        # the workers holding the same experts, divided by the data-parallel world
        "experts": [ctx.grads[w] for w in expert_params(ctx) if w in ctx.grads],
        "expert_replicas": ctx.world_size // _ep_degree(ctx) if ctx.ep_plan is not None else 1,
    }


def _zero_scatter(ctx: Context) -> int | None:
    """ZeRO's reduce-scatter: each worker keeps its 1/N of the averaged grads (data parallel's
    volume; beside dp_degree > 1 the slices are then all-reduced over the data axis). The
    sharding degree, or None where there is nothing to shard over."""
    s = ctx.strategy
    degree = _sharding_degree(ctx)
    if not s.sharding or degree == 1 or ctx.world_size % degree:
        return None
    return degree


def _dp_plan(p: Program, ctx: Context) -> Any:
    from metaopt.passes.data_parallel import plan_data_parallel

    return plan_data_parallel(p, **_dp_how(p, ctx))


def _data_parallel(p: Program, plan: Any, ctx: Context) -> Program:
    from metaopt.passes.data_parallel import apply_data_parallel

    ctx.dp_plan = plan
    return apply_data_parallel(p, plan)


def _lsgd_on(ctx: Context) -> tuple[bool, str]:
    if not ctx.strategy.localsgd:
        return False, "strategy.localsgd=False"
    if ctx.world_size == 1:
        return False, "strategy.localsgd=True but fleet.worker_num()=1: nothing to average"
    cfg = ctx.strategy.localsgd_configs
    return True, f"strategy.localsgd=True (k_steps={cfg['k_steps']}, begin_step={cfg['begin_step']})"


def _lsgd_check(ctx: Context) -> None:
    s = ctx.strategy
    env.require_process_group("local SGD")
    clash = [
        f"strategy.{f}=True"
        for f in ("pipeline", "tensor_parallel", "sharding", "optimizer_in_backward")
        if getattr(s, f)
    ]
    if clash:
        raise NotImplementedError(
            "strategy.localsgd=True averages every param over every worker after the updates: not "
            "implemented with " + ", ".join(clash)
        )


def _local_sgd(p: Program, plan: Any, ctx: Context) -> Program:
    from metaopt.passes.local_sgd import local_sgd

    cfg = ctx.strategy.localsgd_configs
    return local_sgd(p, k_steps=cfg["k_steps"], begin_step=cfg["begin_step"])


def _fp16_ar_on(ctx: Context) -> tuple[bool, str]:
    if not ctx.strategy.fp16_allreduce:
        return False, "strategy.fp16_allreduce=False"
    dp, why = _dp_on(ctx)
    if not dp:
        return False, f"strategy.fp16_allreduce=True but no data parallel ({why})"
    return True, "strategy.fp16_allreduce=True"


def _fp16_ar_check(ctx: Context) -> None:
    if _zero_scatter(ctx) is not None:
        raise NotImplementedError(
            "strategy.fp16_allreduce=True with strategy.sharding: its reduce-scatter sends float32 "
            "(float16 reduce-scatter is not implemented)"
        )


def _fp16_ar_plan(p: Program, ctx: Context) -> Any:
    from metaopt.ir import names
    from metaopt.passes.fp16_allreduce import plan_fp16_allreduce

    return plan_fp16_allreduce(p, reduced=[names.reduced(g) for b in ctx.dp_plan.buckets for g in b.grads])


def _fp16_allreduce(p: Program, plan: Any, ctx: Context) -> Program:
    from metaopt.passes.fp16_allreduce import apply_fp16_allreduce

    return apply_fp16_allreduce(p, plan)


def _broadcast_init(p: Program, plan: Any, ctx: Context) -> Program:
    from metaopt.passes.broadcast_init import broadcast_init

    # split params: within the data-parallel group (each MP rank holds its own slice), and beside
    # sharding within the sharding group too (its workers are replicas as well)
    groups = ("data_parallel", "sharding") if _zero_scatter(ctx) is not None else ("data_parallel",)
    # expert params: within the workers holding the same experts
    return broadcast_init(p, src=0, split=split_params(ctx), split_groups=groups, experts=expert_params(ctx))


# --- sharding (ZeRO) --------------------------------------------------------------------------------


def _sharding_degree(ctx: Context) -> int:
    """The sharding group's size: hybrid_configs' sharding_degree where the layout has that axis,
    else sharding_configs' (which must then span every worker: `sharding_errors`)."""
    try:
        topo = _layout(ctx)
    except ValueError:
        return 1
    return (
        topo.sharding_degree if topo.sharding_degree > 1 else ctx.strategy.sharding_configs["sharding_degree"]
    )


def _sh_on(ctx: Context) -> tuple[bool, str]:
    if not ctx.strategy.sharding:
        return False, "strategy.sharding=False"
    cfg = ctx.strategy.sharding_configs
    return True, f"strategy.sharding=True (stage {cfg['stage']}, sharding_degree={_sharding_degree(ctx)})"


def _sh_check(ctx: Context) -> None:
    """Refuse, by name, what does not run with sharded optimizer state yet."""
    s, stage = ctx.strategy, ctx.strategy.sharding_configs["stage"]
    if _sharding_degree(ctx) > 1:
        env.require_process_group("sharding")
    why = []
    if s.pipeline and stage > 1:
        why.append(
            f"strategy.pipeline=True at stage {stage} (a pipeline sums each grad over its micro-batches "
            "whole before the update; stage 1 shards the optimizer state beside it)"
        )
    if s.optimizer_in_backward and stage < 3:
        why.append(
            f"strategy.optimizer_in_backward=True at stage {stage} (each worker's updated slices are "
            "all-gathered into the whole params after the backward: measured, the moved updates raise "
            "the peak there; stage 3 frees each grad slice at its update)"
        )
    if s.amp and s.amp_configs["use_pure_fp16"]:
        why.append("amp_configs['use_pure_fp16']=True (sharded float32 master weights)")
    if why:
        raise NotImplementedError(
            f"strategy.sharding=True (stage {stage}) cannot be combined yet with: " + "; ".join(why)
        )


def _sh_plan(p: Program, ctx: Context) -> PartPlans:
    """Each part's own plan: after a pipeline's split, each stage program shards its updates
    (its grads reduce-scattered by the split), before it the one program."""
    from metaopt.passes.sharding import plan_sharding

    cfg = ctx.strategy.sharding_configs
    how = {
        "degree": _sharding_degree(ctx),
        "stage": cfg["stage"],
        "bucket_bytes": int(cfg["segment_broadcast_MB"] * 2**20),
        "index": _sharding_index(ctx),
        "keep": expert_params(ctx),  # each worker of a sharding group holds other experts
    }
    return PartPlans.of(partial(plan_sharding, **how), ctx.parts)


def _sharding_index(ctx: Context) -> int:
    """This worker's chunk: its place in its sharding group, ascending (as the kernels find it)."""
    if _sharding_degree(ctx) == 1:
        return 0
    topo = _layout(ctx)
    if topo.sharding_degree > 1:
        return topo.group_ranks("sharding", ctx.rank).index(ctx.rank)
    return ctx.rank  # sharding over every worker


def _sharding(p: Program, plans: PartPlans, ctx: Context) -> Program:
    from metaopt.passes.sharding import apply_sharding

    plan = plans.of_part(p, ctx.parts)
    if plan.stage == 3 and ctx.world_size > 1:
        # Stage 3 keeps only this worker's slice of each param: it is cut from worker 0's initial
        # value, as data parallel's startup broadcast would give every worker (ZeRO-3's init);
        # beside tensor parallel, from the first replica holding this worker's part
        p = p.clone()
        held = [sp.param for sp in plan.params]
        axes = ("sharding", "data") if any(p.vars[x].split is not None for x in held) else ()
        # (an export on the meta device has no values: fleet.load_pretrained gives each worker
        # its slice of the same file, equal on every replica)
        values = {x: p.values[x] for x in held if not p.is_meta(x)}
        if values:
            p.values.update(env.broadcast_from_first(values, "stage 3's initial params", axes))
    return apply_sharding(p, plan)


def _offload_state_on(ctx: Context) -> tuple[bool, str]:
    s = ctx.strategy
    if not s.sharding:
        return False, "strategy.sharding=False"
    on = bool(s.sharding_configs["optimize_offload"])
    return on, f"sharding_configs['optimize_offload']={on}"


def _offload_state_plan(p: Program, ctx: Context) -> PartPlans:
    from metaopt.passes.state_offload import plan_state_offload

    bucket = int(ctx.strategy.sharding_configs["segment_broadcast_MB"] * 2**20)
    return PartPlans.of(partial(plan_state_offload, bucket_bytes=bucket), ctx.parts)


def _offload_state(p: Program, plans: PartPlans, ctx: Context) -> Program:
    from metaopt.passes.state_offload import apply_state_offload

    return apply_state_offload(p, plans.of_part(p, ctx.parts))


def sharding_errors(strategy: Any, topo: Topology, world_size: int) -> list[Exception]:
    """A sharding axis nothing shards over, or a sharding degree that is not the layout's."""
    if not strategy.sharding:
        if topo.sharding_degree == 1:
            return []
        return [
            ValueError(
                f"hybrid_configs sharding_degree={topo.sharding_degree} needs strategy.sharding=True (with "
                "sharding_configs): without it nothing would run on the sharding axis"
            )
        ]
    degree = strategy.sharding_configs["sharding_degree"]
    default = 8  # Fleet's default: taken as "the layout's" when hybrid_configs set the axis
    if topo.sharding_degree > 1:
        if degree not in (default, topo.sharding_degree):
            return [
                ValueError(
                    f"sharding_configs['sharding_degree']={degree} conflicts with hybrid_configs "
                    f"sharding_degree={topo.sharding_degree}: leave it at {default} or set it equal"
                )
            ]
        return []
    beside = [f"strategy.{f}=True" for f in ("pipeline", "tensor_parallel") if getattr(strategy, f)]
    if beside and degree > 1:
        return [
            ValueError(
                f"sharding_configs['sharding_degree']={degree} with {' and '.join(beside)}: the sharding "
                "group must be the workers holding the same stage and model-parallel part; give "
                "fleet.init and the optimizer hybrid_configs with a sharding_degree axis"
            )
        ]
    if degree != world_size:
        return [
            ValueError(
                f"sharding_configs['sharding_degree']={degree} but the job has {world_size} workers: without "
                "hybrid_configs the sharding group is every worker; set sharding_degree to the world size, "
                "or "
                "give fleet.init and the optimizer hybrid_configs {'sharding_degree': n, 'dp_degree': m}"
            )
        ]
    return []


# --- recompute and offload ----------------------------------------------------------------------


def _rc_on(ctx: Context) -> tuple[bool, str]:
    on = bool(ctx.strategy.recompute)
    return on, f"strategy.recompute={on}"


def _rc_how(ctx: Context) -> dict:
    cfg = ctx.strategy.recompute_configs
    return {
        "checkpoints": list(cfg["checkpoints"]),
        "policy": cfg["policy"],
        "keep_op_types": tuple(cfg["keep_op_types"]),
        "memory_budget": cfg["memory_budget"],
        "batch": cfg["budget_batch_size"],
        "recompute_head": cfg["recompute_head"],
        "seed_random_ops": bool(cfg["seed_random_ops"]),
    }


def _rc_check(ctx: Context) -> None:
    how = _rc_how(ctx)
    if not how["checkpoints"]:
        raise ValueError("strategy.recompute=True needs recompute_configs['checkpoints'] (names or patterns)")
    if how["memory_budget"] is not None and "auto" not in how["checkpoints"]:
        raise ValueError(
            "recompute_configs['memory_budget'] chooses checkpoints: it needs checkpoints=['auto'] "
            f"(got {how['checkpoints']})"
        )


def _rc_plan(p: Program, ctx: Context) -> Any:
    from metaopt.passes.recompute import plan_recompute

    return plan_recompute(p, **_rc_how(ctx))


def _recompute(p: Program, plan: Any, ctx: Context) -> Program:
    from metaopt.passes.recompute import apply_recompute, memory_report

    ctx.checkpoints = list(plan.checkpoints)
    q = apply_recompute(p, plan)
    if ctx.reports:  # two estimates of the whole program: the planner, which makes its own, skips them
        batch = ctx.strategy.recompute_configs["budget_batch_size"]
        ctx.memory_report = memory_report(p, plan, q, batch=batch)
        logger.info("%s", ctx.memory_report)
    return q


def _refresh_report(after: Program, ctx: Context) -> None:
    """Recompute's predicted effect with partition and offload on top: the activation peak of
    `after`, a partitioned checkpoint held as its slice (1/mp of the bytes)."""
    from metaopt.passes.memory_estimate import estimate_memory

    report = ctx.memory_report
    if report is None:  # none made (Context.reports)
        return
    dims = {"batch": report.batch}
    held = {c: after.vars[s].nbytes(dims) or 0 for c, s in ctx.partition_slices.items()}
    ctx.memory_report = dataclasses.replace(
        report,
        peak_after=estimate_memory(after, dims=dims).activation_peak_bytes,
        checkpoint_bytes={c: held.get(c, b) for c, b in report.checkpoint_bytes.items()},
    )
    logger.info("%s", ctx.memory_report)


def warn_if_nothing_saved(ctx: Context) -> None:
    report = ctx.memory_report
    if report is not None and not report.saves_memory:
        warnings.warn(
            f"recompute with checkpoints {list(ctx.strategy.recompute_configs['checkpoints'])} does not "
            f"lower the predicted activation peak ({report.peak_before:,} -> {report.peak_after:,} bytes "
            f"at batch {report.batch}): choose checkpoints inside the model, one per block",
            stacklevel=3,  # the user's minimize call
        )


def _part_on(ctx: Context) -> tuple[bool, str]:
    on = bool(ctx.strategy.recompute and ctx.strategy.recompute_configs["enable_partition"])
    why = f"recompute_configs['enable_partition']={on}"
    if on and not _tp_on(ctx)[0]:  # refused before any step runs (requirement / partition errors)
        return False, f"{why} but {_tp_on(ctx)[1]}"
    return on, why + (f" (mp_degree={_mp_degree(ctx)})" if on else "")


def _part_plan(p: Program, ctx: Context) -> Any:
    """With strategy.pipeline the plan is the same: it runs on the whole program, before the
    split, and the pipeline step places each checkpoint's slice and gather in the stage(s) whose
    backward reads it (passes/pipeline.py `_place_partition`): a checkpoint at a cut is sliced
    by the stage that receives it, so the cuts (named or "auto") need not be known here."""
    from metaopt.passes.recompute_partition import plan_recompute_partition

    tp = ctx.tp_plan
    # the group by its axis, as the tensor_parallel step names TP's (workers' programs agree)
    return plan_recompute_partition(
        p, checkpoints=ctx.checkpoints, mp_degree=tp.mp_degree, group="model_parallel", split=tp.sharded
    )


def _partition(p: Program, plan: Any, ctx: Context) -> Program:
    from metaopt.passes.recompute_partition import recompute_partition

    q = recompute_partition(p, plan=plan)
    ctx.partition_slices = dict(plan.slices)
    _refresh_report(q, ctx)
    return q


def _regather_on(ctx: Context) -> tuple[bool, str]:
    on, why = _tp_on(ctx)
    sp = bool(ctx.strategy.tensor_parallel_configs["sequence_parallel"])
    return on and sp, f"tensor_parallel_configs['sequence_parallel']={sp}" + ("" if on else f"; {why}")


def _regather_plan(p: Program, ctx: Context) -> Any:
    from metaopt.passes.sequence_regather import plan_regather

    return plan_regather(p)


def _regather(p: Program, plan: Any, ctx: Context) -> Program:
    from metaopt.passes.sequence_regather import regather

    return regather(p, plan=plan)


def _offload_on(ctx: Context) -> tuple[bool, str]:
    on = bool(ctx.strategy.recompute and ctx.strategy.recompute_configs["enable_offload"])
    return on, f"recompute_configs['enable_offload']={bool(ctx.strategy.recompute_configs['enable_offload'])}"


def _offload_plan(p: Program, ctx: Context) -> Any:
    from metaopt.passes.offload import plan_offload

    cfg = ctx.strategy.recompute_configs
    return plan_offload(
        p,
        checkpoints=ctx.checkpoints,
        offload_checkpoints=cfg["offload_checkpoints"],
        checkpoint_shape=list(cfg["checkpoint_shape"]),
        # a partitioned checkpoint waits as its slice: only the slice goes to host and back
        moved=ctx.partition_slices or None,
    )


def _offload(p: Program, plan: Any, ctx: Context) -> Program:
    from metaopt.passes.offload import apply_offload

    q = apply_offload(p, plan)
    _refresh_report(q, ctx)
    return q


# --- optimizer in backward ------------------------------------------------------------------


def _uib_on(ctx: Context) -> tuple[bool, str]:
    on = bool(ctx.strategy.optimizer_in_backward)
    return on, f"strategy.optimizer_in_backward={on}"


def _uib_check(ctx: Context) -> None:
    """Refuse what needs every grad before any update may run (named, never dropped)."""
    s, why = ctx.strategy, []
    clip = getattr(ctx.optimizer, "grad_clip", None)
    if clip is not None:
        why.append(f"grad_clip={type(clip).__name__} reads every grad before any update")
    if s.gradient_merge:
        why.append("strategy.gradient_merge=True updates every k-th run, after the whole backward")
    if s.pipeline:
        why.append("strategy.pipeline=True updates once per step, after every micro-batch's backward")
    if s.amp and ctx.loss_scaling:
        why.append(
            "AMP loss scaling checks every grad for inf/nan before any update may run "
            "(use amp_configs['dtype']='bfloat16', which needs no scaling)"
        )
    if why:
        raise ValueError("strategy.optimizer_in_backward=True cannot be combined: " + "; ".join(why))


def _uib_plan(p: Program, ctx: Context) -> Any:
    from metaopt.passes.update_in_backward import plan_update_in_backward

    return plan_update_in_backward(p)


def _update_in_backward(p: Program, plan: Any, ctx: Context) -> Program:
    from metaopt.passes.update_in_backward import update_in_backward

    return update_in_backward(p, plan=plan)


# --- pipeline -------------------------------------------------------------------------------------


def _pp_on(ctx: Context) -> tuple[bool, str]:
    on = bool(ctx.strategy.pipeline)
    return on, f"strategy.pipeline={on}"


def _layout(ctx: Context) -> Topology:
    """The job's dp x pp (x mp) layout: hybrid_configs (this strategy's or fleet.init's), else
    pipeline_configs' replicas x stages (``topology.job_topology`` says which wins and refuses
    conflicts naming both)."""
    return job_topology(ctx.strategy, ctx.world_size, env.hybrid_topology())


def _pp_layout(ctx: Context) -> tuple[int, int]:
    """(num_stages, dp_degree) of the job: each worker runs one stage of one replica."""
    topo = _layout(ctx)
    return topo.pp_degree, topo.dp_degree


def _pp_check(ctx: Context) -> None:
    _pp_layout(ctx)
    mode = ctx.strategy.pipeline_configs["schedule_mode"]
    if mode in UNBUILT_SCHEDULES:
        raise NotImplementedError(f"pipeline_configs['schedule_mode']={mode!r}: {UNBUILT_SCHEDULES[mode]}")


def _pp_schedule(ctx: Context) -> str:
    """pipeline_configs["schedule_mode"] as the schedule's own name (Paddle's spellings mapped)."""
    mode = ctx.strategy.pipeline_configs["schedule_mode"]
    return PADDLE_SCHEDULES.get(mode, mode)


def _pp_how(ctx: Context) -> dict:
    cfg = ctx.strategy.pipeline_configs
    schedule = _pp_schedule(ctx)
    chunks = cfg["chunks"]
    if schedule in V_SHAPED_SCHEDULES and chunks == 1:
        chunks = 2  # ZB-V is two chunks per worker: chunks' default (1) means "the schedule's own"
    return {
        "num_stages": _pp_layout(ctx)[0],
        "cuts": list(cfg["cuts"]) or "auto",
        "micro_batches": cfg["accumulate_steps"],
        "micro_batch_size": cfg["micro_batch_size"],
        "schedule": schedule,
        "chunks": chunks,
    }


def _shared(ctx: Context) -> list[list[str]]:
    # each entry: a param name (must be read by several stages: checked after the split) or a
    # group of names tied to the first (ColossalAI's shared module across stages)
    return [[e] if isinstance(e, str) else list(e) for e in ctx.strategy.pipeline_configs["shared"]]


def _tie_on(ctx: Context) -> tuple[bool, str]:
    if not ctx.strategy.pipeline:
        return False, "strategy.pipeline=False"
    groups = _shared(ctx)
    if not groups:
        return False, "pipeline_configs['shared'] is empty"
    return True, f"pipeline_configs['shared'] names {len(groups)} param(s) or group(s)"


def _tie_params(p: Program, plan: Any, ctx: Context) -> Program:
    from metaopt.passes.tie import tie_params

    groups = _shared(ctx)  # a lone name is only checked to be a param
    split = sorted(set(split_params(ctx)).intersection(n for g in groups for n in g))
    if split:
        raise NotImplementedError(
            f"pipeline_configs['shared'] names {split[0]!r}, which tensor parallel splits over the "
            "model-parallel group: tying split params across stages is not implemented (params "
            "read whole by every MP rank, such as GPT's wte, can be shared)"
        )
    q = tie_params(p, groups=groups, what="pipeline_configs['shared']")
    ctx.tied.update({name: g[0] for g in groups for name in g[1:]})
    return q


def _pp_plan(p: Program, ctx: Context) -> Any:
    from metaopt.passes.pipeline import check_replicated_cuts, plan_pipeline

    topo = _layout(ctx)
    how = {
        **_pp_how(ctx),
        "grads": ctx.grads,
        "loss_grad": ctx.loss_grad,
        "dp_degree": topo.dp_degree,
        "scatter_parts": _zero_scatter(ctx),  # ZeRO stage 1 beside the pipeline
    }
    plan = plan_pipeline(p, **how)
    for group in _shared(ctx):
        if group[0] not in plan.shared:
            stages = plan.holders.get(group[0], ())
            raise ValueError(
                f"pipeline_configs['shared']: {group[0]!r} is read by stage(s) {list(stages)} only: "
                "nothing to share between workers"
            )
    # beside tensor parallel a stage hands the next only values replicated over the MP group
    check_replicated_cuts(p, plan, split_params=split_params(ctx))
    return plan


def _pipeline_split(p: Program, plan: Any, ctx: Context) -> list[Program]:
    from metaopt.passes.pipeline import apply_pipeline

    topo = _layout(ctx)
    parts = apply_pipeline(p, plan)
    # the topology's pipe coordinate; with mp_degree 1 it is the runtime's placement,
    # rank = replica * num_stages + stage (runtime/pipeline.py)
    ctx.part = topo.get_coord(ctx.rank).pipe
    return parts


def _zb_on(ctx: Context) -> tuple[bool, str]:
    if not ctx.strategy.pipeline:
        return False, "strategy.pipeline=False"
    mode = ctx.strategy.pipeline_configs["schedule_mode"]
    on = _pp_schedule(ctx) in SPLIT_BACKWARD_SCHEDULES
    return on, f"pipeline_configs['schedule_mode']={mode!r}" + (" splits the backward" if on else "")


# The two steps after the split whose plan is each stage program's own (`PartPlans`).


def _split_wg_plan(p: Program, ctx: Context) -> PartPlans:
    from metaopt.passes.split_weight_grads import plan_split_weight_grads

    return PartPlans.of(plan_split_weight_grads, ctx.parts)


def _split_wg(p: Program, plan: PartPlans, ctx: Context) -> Program:
    from metaopt.passes.split_weight_grads import apply_split_weight_grads

    return apply_split_weight_grads(p, plan.of_part(p, ctx.parts))


def _phases_plan(p: Program, ctx: Context) -> PartPlans:
    from metaopt.passes.pipeline_phases import plan_phases

    return PartPlans.of(plan_phases, ctx.parts)


def _pipeline_phases(p: Program, plan: PartPlans, ctx: Context) -> Program:
    from metaopt.passes.pipeline_phases import apply_phases

    return apply_phases(p, plan.of_part(p, ctx.parts))


def _overlap_on(ctx: Context) -> tuple[bool, str]:
    on, why = _dp_on(ctx)
    if not on:
        return False, why
    if ctx.strategy.pipeline:
        return False, "strategy.pipeline=True: a stage program's phases run as separate plans"
    return True, "data parallel: all-reduces run beside the rest of the backward where they can (as DDP)"


def _overlap_plan(p: Program, ctx: Context) -> PartPlans:
    from metaopt.passes.overlap_comm import plan_overlap_comm

    return PartPlans.of(plan_overlap_comm, ctx.parts)


def _overlap(p: Program, plan: PartPlans, ctx: Context) -> Program:
    from metaopt.passes.overlap_comm import apply_overlap_comm

    return apply_overlap_comm(p, plan.of_part(p, ctx.parts))


# --- THE list ---------------------------------------------------------------------------------------

STEPS: tuple[Step, ...] = (
    Step(
        "fuse_linear_ce",
        _lce_on,
        _fuse_linear_ce,
        plan=_lce_plan,
        doc="LM head + cross-entropy, chunked",
        reads=("optimizer", "strategy", "world_size"),
    ),
    Step(
        "tensor_parallel",
        _tp_on,
        _tensor_parallel,
        plan=_tp_plan,
        check=_tp_check,
        doc="column/row layers split over the model-parallel group",
        meta="tensor_parallel",
        reads=("optimizer", "rank", "strategy", "world_size"),
        writes=("sp_plan", "tp_plan"),
    ),
    Step(
        "sep_parallel",
        _sep_on,
        _segment_parallel,
        plan=_sep_plan,
        check=_sep_check,
        doc="1/sep of every sequence per rank, q/k/v exchanged around attention",
        meta="sep_parallel",
        reads=("optimizer", "rank", "strategy", "world_size"),
        writes=("sep_plan",),
    ),
    Step(
        "cp_parallel",
        _cp_on,
        _segment_parallel,
        plan=_cp_plan,
        check=partial(_sep_check, key="cp_degree", what="context parallel"),
        doc="1/cp of every sequence per rank (zig-zag), attention as a ring of k/v blocks",
        meta="context_parallel",
        reads=("optimizer", "rank", "strategy", "world_size"),
        writes=("sep_plan",),
    ),
    Step(
        "expert_capacity",
        _cap_on,
        _expert_capacity,
        plan=_cap_plan,
        doc="each expert's rows in fixed slots of its capacity, the rows past it dropped and counted",
        meta="expert_capacity",
        reads=("strategy",),
    ),
    Step(
        "expert_parallel",
        _ep_on,
        _expert_parallel,
        plan=_ep_plan,
        check=_ep_check,
        doc="experts split over the expert-parallel group, rows exchanged by all-to-all",
        meta="expert_parallel",
        reads=("optimizer", "rank", "strategy", "world_size"),
        writes=("ep_plan",),
    ),
    Step(
        "amp_casts",
        _amp_on,
        _amp_casts,
        plan=_amp_plan,
        check=_amp_check,
        doc="casts around white-listed ops",
        meta="amp",
        reads=("strategy",),
    ),
    Step(
        "scale_loss",
        _loss_scaling,
        _scale_loss,
        doc="loss@SCALED = loss x loss_scaling",
        meta="amp",
        reads=("loss_scaling", "strategy"),
        writes=("loss",),
    ),
    Step(
        "tie_params",
        _tie_on,
        _tie_params,
        doc="params tied across pipeline stages read as one",
        meta="pipeline",
        reads=("strategy", "tied", "tp_plan"),
        writes=("tied",),
    ),
    APPEND_BACKWARD,  # passes/minimize.py: Optimizer.minimize runs these two alone
    APPLY_OPTIMIZER,
    Step(
        "lamb",
        partial(_layerwise_on, kind="lamb"),
        _layerwise,
        plan=partial(_layerwise_plan, kind="lamb"),
        check=partial(_layerwise_check, kind="lamb"),
        doc="Adam's updates made layer-wise adaptive (LAMB)",
        meta="lamb",
        reads=("optimizer", "strategy"),
    ),
    Step(
        "lars",
        partial(_layerwise_on, kind="lars"),
        _layerwise,
        plan=partial(_layerwise_plan, kind="lars"),
        check=partial(_layerwise_check, kind="lars"),
        doc="Momentum's updates made layer-wise adaptive (LARS)",
        meta="lars",
        reads=("optimizer", "strategy"),
    ),
    Step(
        "gradient_merge",
        _gm_on,
        _gradient_merge,
        doc="grads merged over k runs, updates every k-th",
        meta="gradient_merge",
        reads=("loss_grad", "strategy"),
    ),
    Step(
        "data_parallel",
        _dp_on,
        _data_parallel,
        plan=_dp_plan,
        check=_dp_check,
        doc="AllReduce of the grads, in buckets",
        meta="data_parallel",
        reads=("ep_plan", "params_grads", "strategy", "world_size"),
        writes=("dp_plan",),
    ),
    Step(
        "localsgd",
        _lsgd_on,
        _local_sgd,
        check=_lsgd_check,
        doc="params averaged every k steps, no grad all-reduce",
        meta="localsgd",
        reads=("strategy", "world_size"),
    ),
    Step(
        "fp16_allreduce",
        _fp16_ar_on,
        _fp16_allreduce,
        plan=_fp16_ar_plan,
        check=_fp16_ar_check,
        doc="grads sent in float16 by data parallel's all-reduce",
        meta="fp16_allreduce",
        reads=("dp_plan", "strategy", "world_size"),
    ),
    Step(
        "broadcast_init",
        _init_on,
        _broadcast_init,
        check=_dp_check,
        doc="rank 0's initial params, buffers",
        meta="data_parallel",
        reads=("ep_plan", "strategy", "tp_plan", "world_size"),
    ),
    Step(
        "recompute",
        _rc_on,
        _recompute,
        plan=_rc_plan,
        check=_rc_check,
        doc="segments re-emitted before their grads",
        meta="recompute",
        reads=("memory_report", "reports", "strategy"),
        writes=("checkpoints", "memory_report"),
    ),
    Step(
        "partition",
        _part_on,
        _partition,
        plan=_part_plan,
        doc="checkpoints held as 1/mp slices",
        meta="recompute",
        reads=("checkpoints", "memory_report", "partition_slices", "strategy", "tp_plan", "world_size"),
        writes=("memory_report", "partition_slices"),
    ),
    Step(
        "sp_regather",
        _regather_on,
        _regather,
        plan=_regather_plan,
        doc="column layers' gathered inputs all-gathered again for the backward (not held)",
        meta="tensor_parallel",
        reads=("strategy", "world_size"),
    ),
    Step(
        "offload",
        _offload_on,
        _offload,
        plan=_offload_plan,
        doc="checkpoints to host and back",
        meta="recompute",
        reads=("checkpoints", "memory_report", "partition_slices", "strategy"),
        writes=("memory_report",),
    ),
    Step(
        "pipeline_split",
        _pp_on,
        _pipeline_split,
        plan=_pp_plan,
        check=_pp_check,
        doc="one program per stage",
        meta="pipeline",
        reads=("loss_grad", "params_grads", "rank", "strategy", "tp_plan", "world_size"),
        writes=("part",),
    ),
    Step(
        "sharding",
        _sh_on,
        _sharding,
        plan=_sh_plan,
        check=_sh_check,
        doc="updates on 1/N slices: optimizer state (stage 2: grads; stage 3: params) sharded",
        meta="sharding",
        reads=("ep_plan", "rank", "strategy", "world_size"),
    ),
    Step(
        "state_offload",
        _offload_state_on,
        _offload_state,
        plan=_offload_state_plan,
        doc="optimizer state held in host memory, brought to the device per bucket for its updates",
        meta="sharding",
        reads=("strategy",),
    ),
    Step(
        "unscale_grads",
        _loss_scaling,
        _unscale_grads,
        doc="check inf/nan, unscale, skip overflowed steps",
        meta="amp",
        reads=("ep_plan", "loss_scaling", "strategy", "world_size"),
    ),
    Step(
        "master_weights",
        _pure_fp16,
        _master_weights,
        doc="float32 master copies of low-precision params",
        meta="amp",
        reads=("strategy",),
    ),
    Step(
        "early_updates",
        _uib_on,
        _update_in_backward,
        plan=_uib_plan,
        check=_uib_check,
        doc="each update right after its grad's last use",
        reads=("loss_scaling", "optimizer", "strategy"),
    ),
    Step(
        "split_w_grads",
        _zb_on,
        _split_wg,
        plan=_split_wg_plan,
        doc="fused grad ops cut into input grads (B) and weight grads (W) for a zero-bubble schedule",
        meta="pipeline",
        reads=("strategy",),
    ),
    Step(
        "overlap_comm",
        _overlap_on,
        _overlap,
        plan=_overlap_plan,
        doc="each all-reduce waited for before its first reader, not where it starts",
        meta="data_parallel",
        reads=("strategy", "world_size"),
    ),
    Step(
        "pipeline_phases",
        _pp_on,
        _pipeline_phases,
        plan=_phases_plan,
        doc="each stage program cut into the schedule's forward, backward and optimizer programs",
        meta="pipeline",
        reads=("strategy",),
    ),
)
check_declarations(STEPS)  # a step reading what no earlier step writes fails at import
FLEET_META_OPTIMIZERS = (
    "amp",
    "expert_capacity",
    "expert_parallel",
    "localsgd",
    "fp16_allreduce",
    "lamb",
    "lars",
    "pipeline",
    "tensor_parallel",
    "recompute",
    "gradient_merge",
    "sharding",
    "data_parallel",
)


def hybrid_errors(strategy: Any) -> list[Exception]:
    """What ``minimize`` refuses of the job's layout (needs ``fleet.init``): a world size other
    than the degrees' product, hybrid degrees that conflict with fleet.init's or with
    pipeline_configs, pp_degree > 1 without a pipeline (``topology.job_topology``); tensor
    parallel's (`tensor_parallel_errors`); and, when the degrees come from fleet.init's strategy,
    its UNIMPLEMENTED ones. This strategy's own are in
    ``strategy.unimplemented()``."""
    from metaopt.fleet.strategy import unimplemented

    init = env.hybrid_topology()
    try:
        topo = job_topology(strategy, env.worker_num(), init)
    except ValueError as e:
        return [e]
    errors = tensor_parallel_errors(strategy, topo, init) + partition_errors(strategy, topo)
    errors += sharding_errors(strategy, topo, env.worker_num())
    init_strategy = env.user_strategy()
    if init is None or init_strategy is None or hybrid_is_set(strategy.hybrid_configs):
        return errors
    return errors + [
        NotImplementedError(f"fleet.init's {e}") for e in unimplemented(init_strategy, "hybrid_configs")
    ]


def requirement_errors(strategy: Any) -> list[Exception]:
    """Config keys that need a feature flag which is off (refused, not silently unused)."""
    cfg = strategy.recompute_configs
    if cfg["enable_offload"] and not strategy.recompute:
        return [
            ValueError(
                "recompute_configs['enable_offload']=True needs strategy.recompute=True: offload moves "
                "the recompute checkpoints to host memory"
            )
        ]
    if cfg["enable_partition"] and not (strategy.recompute and strategy.tensor_parallel):
        missing = " and ".join(
            f"strategy.{f}=True" for f in ("recompute", "tensor_parallel") if not getattr(strategy, f)
        )
        return [
            ValueError(
                f"recompute_configs['enable_partition']=True needs {missing}: it holds each recompute "
                "checkpoint replicated over the model-parallel group as this rank's 1/mp slice"
            )
        ]
    return []


def partition_errors(strategy: Any, topo: Topology) -> list[Exception]:
    """recompute_configs['enable_partition'] with no model-parallel group to slice over."""
    on = strategy.recompute and strategy.tensor_parallel and strategy.recompute_configs["enable_partition"]
    if on and topo.mp_degree == 1:
        return [
            ValueError(
                "recompute_configs['enable_partition']=True slices checkpoints over the model-parallel "
                "group, but mp_degree=1: set hybrid_configs {'mp_degree': m} with m > 1 (and fleet.init "
                "with it), or leave enable_partition False"
            )
        ]
    return []


# Combinations refused, with the reason (every flag named in a conflict appears in the error).
CONFLICTS: tuple[tuple[tuple[str, ...], str], ...] = (
    (
        ("localsgd", "gradient_merge"),
        "local SGD updates every step from local grads; merge them with k_steps",
    ),
    (("localsgd", "fp16_allreduce"), "local SGD all-reduces no grads"),
    (("lamb", "lars"), "each replaces the optimizer's updates: LAMB wraps Adam, LARS wraps Momentum"),
    (
        ("pipeline", "gradient_merge"),
        "a pipeline already accumulates gradients over pipeline_configs['accumulate_steps'] "
        "micro-batches; use that instead of gradient_merge",
    ),
)
