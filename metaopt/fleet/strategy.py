"""fleet.DistributedStrategy: what the user wants, with Fleet's field names and defaults.

The fields mirror PaddlePaddle Fleet's ``DistributedStrategy`` (its proto,
``distributed_strategy.proto``, and ``distributed_strategy.py``). Every field and
config key is a row in the tables below (name, default, type, doc); a row marked
``extra=True`` is metaopt's own, not Fleet's.

Differences from Fleet, on purpose:

- Assigning a config dict REPLACES the whole config: the result is the defaults plus
  the keys given. Fleet merges the given keys into the current config, so a key set
  earlier silently survives; here ``strategy.recompute_configs = {"checkpoints": [...]}``
  always means exactly that dict (missing keys at their defaults).
- Unknown config keys, values of the wrong type, and unknown attributes
  (``strategy.recompue = True``) raise, with a did-you-mean. Ints are accepted where
  floats are expected (and stored as floats); a bool is never accepted as an int.
- Configs read back (``strategy.amp_configs``) are read-only views: item assignment
  (``strategy.amp_configs["incr_ratio"] = 3.0``), which in Fleet mutates a copy and is
  silently lost, raises and says to assign the whole dict.
- ``a_sync`` defaults to False (Fleet: True, where it only matters in parameter-server
  mode, which metaopt refuses at ``fleet.init``). Here every feature flag metaopt does not
  implement (``UNSUPPORTED_FEATURES``) is accepted but refused at ``minimize`` when True,
  so a default of True would refuse every program.
- Fleet reads some fields metaopt has no code for. Those are never silently ignored: a
  value other than the default of a field or config key in ``UNIMPLEMENTED`` is refused
  at ``minimize``, naming the field (``unimplemented(strategy)`` lists the errors; a config
  key only while its feature flag is on: otherwise the whole config is unused). Refused
  there, not at assignment, like ``UNSUPPORTED_FEATURES``: a Fleet script or a saved
  strategy still loads, and the optimizer's plan lists every refusal at once.
  ``NO_EFFECT`` fields are accepted with either value: metaopt's behaviour is fixed, and
  it is what the non-default value asks for (the reason says what metaopt does).
- ``save_to_json`` / ``load_from_json`` replace Fleet's prototxt files (``save_to_prototxt`` /
  ``load_from_prototxt`` raise and name them).
- Every other documented Fleet 2.x field is here too (issue 32): the cuDNN and all-reduce tuning
  fields, ``gradient_scale_configs``, the configs of refused features and of parameter servers
  (``REFUSED_CONFIGS``: Fleet's keys, refused when set), and ``build_strategy`` /
  ``execution_strategy`` (``OBJECT_TABLES``: Paddle's objects' fields, read back as a
  ``StrategyObject`` whose attribute assignments are kept, where Fleet's copy drops them). Each
  works, is ``NO_EFFECT`` (listed in the overview) or is refused at ``minimize``.
- ``hybrid_configs`` has Fleet 2.x's keys (dp_degree, mp_degree, pp_degree, sharding_degree,
  with its defaults), Paddle's expert-parallel ep_degree and moe_sharding_degree, and Paddle's
  ``order`` (the axes outermost first); later Fleet keys (sep_degree, cp_degree, mp_configs,
  pp_configs) are unknown
  keys here, refused with the known ones listed. Its layout: ``metaopt/layout/topology.py``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from metaopt.atomic import atomic_write
from metaopt.ir import did_you_mean
from metaopt.layout.topology import NOT_BUILT_AXES, PADDLE_ORDER, axes_order

Check = tuple[Callable[[Any], bool], str]  # (predicate, "must be ...")


@dataclass(frozen=True)
class Key:
    """One strategy field or config key."""

    default: Any
    type: str  # "bool", "int", "float", "str", "list[X]", "X|None", "str|list[str]"
    doc: str
    extra: bool = False  # metaopt's own, not in Fleet
    choices: tuple | None = None
    # (predicate, "must be ...") pairs, checked in order: the first that fails is the error
    check: tuple[Check, ...] = ()


# Ranges. Every numeric key is checked here, at assignment, so a value that would stall or
# silently misdrive training never reaches minimize (issue 17). Fleet's proto declares its
# counts int32 and its AMP numbers float (float32): values outside those types are refused as
# Fleet would. metaopt keeps the loss scale and its counters in float32 / int32 tensors too, and
# there a count above int32 compares wrongly (int32 0 >= 2**40 is True in torch) and a ratio that
# rounds to 1.0 in float32 never moves the scale (decr_ratio=0.99999999: skipped forever).
INT32_MAX = 2**31 - 1
FLOAT32_MAX = float(torch.finfo(torch.float32).max)
FLOAT32_TINY = float(torch.finfo(torch.float32).tiny)  # smallest normal: its reciprocal is finite


def _f32(v: float) -> float:
    """`v` rounded to float32 (what the loss-scaling kernels compute with)."""
    return float(torch.tensor(v, dtype=torch.float64).float())


_POSITIVE: tuple[Check, ...] = ((lambda v: v > 0, "must be > 0"),)
_NON_NEGATIVE: tuple[Check, ...] = ((lambda v: v >= 0, "must be >= 0"),)
_INT32: Check = (lambda v: v <= INT32_MAX, f"must be <= {INT32_MAX} (an int32, as in Fleet's proto)")
_AT_LEAST_1: tuple[Check, ...] = ((lambda v: v >= 1, "must be >= 1"),)
# the layer-wise updates compute in the params' float32: a larger factor overflows (1e300 was a raw
# overflow at the first run, lars_coeff=1e300 NaN params)
_FLOAT32_FACTOR: tuple[Check, ...] = (
    *_NON_NEGATIVE,
    (lambda v: v <= FLOAT32_MAX, f"must be <= {FLOAT32_MAX:.4g} (a float32: the update computes in float32)"),
)
_COUNT: tuple[Check, ...] = (*_AT_LEAST_1, _INT32)  # Fleet's int32 counts: steps, sizes, degrees
_SIZE: tuple[Check, ...] = (*_POSITIVE, _INT32)
# A step's run count (gradient merge) or averaging interval (local SGD): 10**9 was accepted and
# the params never updated or synced in any real run (issue 47); 65536 runs per update is far
# past any schedule in use.
MAX_K_STEPS = 1 << 16
_K_STEPS: tuple[Check, ...] = (
    *_AT_LEAST_1,
    (lambda v: v <= MAX_K_STEPS, f"must be <= {MAX_K_STEPS}: an update (or average) that rare never happens"),
)
_SCALE: tuple[Check, ...] = (
    *_POSITIVE,
    (
        lambda v: FLOAT32_TINY <= v <= FLOAT32_MAX,
        f"must be a normal float32 (the loss scale's dtype), {FLOAT32_TINY:.4g} .. {FLOAT32_MAX:.4g}: "
        "beyond it the scale or its reciprocal is inf or 0 and every step is skipped",
    ),
)
_INCR_RATIO: tuple[Check, ...] = (
    (lambda v: v > 1, "must be > 1"),
    (
        lambda v: _f32(v) > 1,
        "must be > 1 in float32 (the loss scale's dtype): it rounds to 1.0, the scale never grows",
    ),
    (
        lambda v: v <= FLOAT32_MAX,
        f"must be <= {FLOAT32_MAX:.4g} (a float32): the grown scale is inf, never kept",
    ),
)
_DECR_RATIO: tuple[Check, ...] = (
    (lambda v: 0 < v < 1, "must be in (0, 1)"),
    (
        lambda v: _f32(v) < 1,
        "must be < 1 in float32 (the loss scale's dtype): it rounds to 1.0, so the scale never shrinks "
        "and an overflowing model skips every step",
    ),
    (lambda v: _f32(v) > 0, "must be > 0 in float32 (the loss scale's dtype): it rounds to 0.0"),
)
_DIMS: tuple[Check, ...] = (
    (lambda v: all(d >= 1 or d == -1 for d in v), "every dim must be >= 1 (or -1, an unknown batch dim)"),
    (
        lambda v: all(d <= INT32_MAX for d in v),
        f"every dim must be <= {INT32_MAX} (an int32, as in Fleet's proto)",
    ),
)

# --- config tables (key order is the printed / saved order) ---------------------------

RECOMPUTE_CONFIGS: dict[str, Key] = {
    "checkpoints": Key(
        [],
        "list[str]",
        "vars after which the forward is kept; the segments between consecutive checkpoints "
        "are recomputed in backward. Names, module paths, patterns (`encoder.layer.*`) or "
        "'auto'. Vars are accepted and stored by name; the string 'auto' means ['auto'].",
    ),
    "enable_offload": Key(False, "bool", "copy checkpoints to pinned host memory, prefetch them back"),
    "enable_partition": Key(
        False,
        "bool",
        "hold each checkpoint replicated over the model-parallel group as this rank's 1/mp slice, "
        "all-gathered before its segment is recomputed (Paddle's recompute partition; with "
        "enable_offload only the slice goes to host). Needs tensor_parallel with mp_degree > 1",
        extra=True,
    ),
    "checkpoint_shape": Key(
        [],
        "list[int]",
        "Fleet needs it for offload; metaopt infers shapes and only validates it",
        check=_DIMS,
    ),
    "policy": Key(
        "full",
        "str",
        "'full': recompute every op of a segment; 'selective': keep matmul-class outputs "
        "(MatMul, Gemm, Conv, Linear) and recompute the cheap ops around them",
        extra=True,
        choices=("full", "selective"),
    ),
    "keep_op_types": Key([], "list[str]", "op types whose outputs are kept, not recomputed", extra=True),
    "memory_budget": Key(
        None,
        "int|None",
        "bytes of activations to aim for when checkpoints are 'auto'",
        extra=True,
        check=_POSITIVE,  # bytes: a Python int, no upper bound
    ),
    "budget_batch_size": Key(
        8,
        "int",
        "the batch size memory_budget and the logged memory report refer to",
        extra=True,
        check=_AT_LEAST_1,
    ),
    "offload_checkpoints": Key(
        None, "list[str]|None", "which checkpoints to offload (None: all, when enable_offload)", extra=True
    ),
    "recompute_head": Key(
        True,
        "bool",
        "also recompute the ops before the first checkpoint (Fleet's segments); False holds them, "
        "as torch.utils.checkpoint around each block does (a CNN's stem: costly to re-run, small "
        "to keep)",
        extra=True,
    ),
    "seed_random_ops": Key(
        True,
        "bool",
        "random ops take a seed held from forward, so recomputed masks are identical",
        extra=True,
    ),
}

AMP_CONFIGS: dict[str, Key] = {
    "init_loss_scaling": Key(32768.0, "float", "initial loss scale", check=_SCALE),
    "incr_every_n_steps": Key(1000, "int", "grow the scale after this many finite steps", check=_COUNT),
    "decr_every_n_nan_or_inf": Key(
        2, "int", "shrink the scale after this many steps with inf/nan grads", check=_COUNT
    ),
    "incr_ratio": Key(2.0, "float", "growth factor of the loss scale", check=_INCR_RATIO),
    "decr_ratio": Key(0.8, "float", "shrink factor of the loss scale", check=_DECR_RATIO),
    "use_dynamic_loss_scaling": Key(True, "bool", "adjust the loss scale (else keep init_loss_scaling)"),
    "custom_white_list": Key([], "list[str]", "op types always run in low precision"),
    "custom_black_list": Key([], "list[str]", "op types always run in float32"),
    "custom_black_varnames": Key([], "list[str]", "vars whose ops always run in float32"),
    "use_pure_fp16": Key(False, "bool", "O2: params and every op in low precision, float32 master weights"),
    "use_fp16_guard": Key(True, "bool", "with use_pure_fp16: only ops inside fp16_guard go low precision"),
    "dtype": Key("float16", "str", "low-precision dtype", choices=("float16", "bfloat16")),
}

PIPELINE_CONFIGS: dict[str, Key] = {
    "micro_batch_size": Key(
        None,
        "int|None",
        "samples per micro-batch: the fed batch must be micro_batch_size x accumulate_steps, checked "
        "at the first run; None (metaopt's default; Fleet's is 1): the fed batch / accumulate_steps",
        check=_COUNT,
    ),
    "accumulate_steps": Key(1, "int", "micro-batches per step (gradients accumulated)", check=_COUNT),
    "schedule_mode": Key(
        "1F1B",
        "str",
        "micro-batch schedule (Paddle's FThenB, VPP and ZBVPP are F-then-B, interleaved and ZBV)",
        choices=("1F1B", "F-then-B", "interleaved", "ZBH1", "FThenB", "VPP", "ZBV", "ZBVPP"),
    ),
    "chunks": Key(
        1,
        "int",
        "virtual stages per worker (the interleaved schedule; ZBV runs 2, its value when left at 1)",
        extra=True,
        check=_AT_LEAST_1,
    ),
    "p2p_cache_shape": Key(
        True,
        "bool",
        "Fleet: send/recv reuse the shapes of the first micro-batch; metaopt sends the shape "
        "with every message, as False does (NO_EFFECT)",
    ),
    "cuts": Key(
        [],
        "list[str]",
        "module paths or var names where a new stage begins; [] = balanced by estimated cost",
        extra=True,
    ),
    "num_stages": Key(
        None,
        "int|None",
        "number of stages (None: len(cuts) + 1, or the worker count)",
        extra=True,
        check=_AT_LEAST_1,
    ),
    "dp_degree": Key(1, "int", "data-parallel replicas of the whole pipeline", extra=True, check=_AT_LEAST_1),
    "shared": Key(
        [],
        "list[str|list[str]]",
        "params tied across stages (each entry: a name, or a group of names); "
        "their grads are all-reduced among the owning stages",
        extra=True,
    ),
}

GRADIENT_MERGE_CONFIGS: dict[str, Key] = {
    "k_steps": Key(1, "int", "apply the optimizer every k steps, gradients accumulated", check=_K_STEPS),
    "avg": Key(True, "bool", "average (else sum) the k accumulated gradients"),
}

# Fleet's hybrid_configs (its HybridConfig proto): how the workers are laid out, read by
# fleet.init (the process groups, fleet.get_hybrid_communicate_group()) and minimize (the
# pipeline's stages and replicas). metaopt/layout/topology.py has the rank layout.
_DP_DEGREE: tuple[Check, ...] = (
    (
        lambda v: v == -1 or v >= 1,
        "must be >= 1, or -1 (the default: the world size / (mp_degree x pp_degree x sharding_degree))",
    ),
    _INT32,
)
def _order_ok(v: Any) -> bool:
    try:
        axes_order(v)
    except NotImplementedError:
        return True  # a layout metaopt cannot build: refused by name at fleet.init / minimize
    except ValueError:
        return False
    return True


HYBRID_CONFIGS: dict[str, Key] = {
    "dp_degree": Key(
        -1,
        "int",
        "data-parallel replicas (of the whole pipeline, if any); -1: inferred from the world size",
        check=_DP_DEGREE,
    ),
    "mp_degree": Key(
        1,
        "int",
        "model (tensor) parallel workers per layer; > 1 needs strategy.tensor_parallel=True",
        check=_COUNT,
    ),
    "pp_degree": Key(1, "int", "pipeline stages (needs strategy.pipeline=True when > 1)", check=_COUNT),
    "sharding_degree": Key(
        1, "int", "ZeRO sharding workers (needs strategy.sharding=True when > 1)", check=_COUNT
    ),
    "ep_degree": Key(
        1,
        "int",
        "expert-parallel workers: each holds 1/ep_degree of every MoE layer's experts; they overlap "
        "dp_degree x sharding_degree (Paddle's ep_degree), whose workers' tokens go to the experts' "
        "owners by all-to-all",
        check=_COUNT,
    ),
    "order": Key(
        list(PADDLE_ORDER),
        "list[str]",
        "the axes outermost first (Paddle's names): ranks enumerate the coordinates in this order, "
        "the last varying fastest (adjacent ranks: a node's); 'sep' (left out: right before 'mp') and "
        "'cp' may sit anywhere (cp_degree lays its groups where 'sep' sits); Paddle 3's 'ep' / "
        "'moe_sharding' are refused (expert groups are laid over consecutive data-side ranks)",
        check=((_order_ok, "must list each of dp, pp, sharding, mp once (sep, cp: at most once)"),),
    ),
    "sep_degree": Key(
        1,
        "int",
        "segment-parallel workers (Paddle's sep_degree; DeepSpeed-Ulysses): each holds 1/sep_degree of "
        "every sequence from the embeddings to the loss, q/k/v exchanged by all-to-all around attention "
        "(whole sequences over 1/sep_degree of the heads), the loss and every param's grad summed over "
        "the group; every sep rank is fed the same batch (passes/segment_parallel.py)",
        check=_COUNT,
    ),
    "cp_degree": Key(
        1,
        "int",
        "context-parallel workers (ring attention): each holds 1/cp_degree of every sequence, two "
        "zig-zag runs of it (causal balance), from the embeddings to the loss; k/v blocks go round the "
        "group in attention (any head count), the loss and every param's grad summed over the group; "
        "every cp rank is fed the same batch; its groups lie on the sequence axis, where 'sep' sits in "
        "the order, so sep_degree stays 1 beside it (passes/context_parallel.py)",
        check=_COUNT,
    ),
    "moe_sharding_degree": Key(
        -1,
        "int",
        "workers holding the same experts: dp_degree x sharding_degree / ep_degree (-1: inferred; "
        "Paddle's default is 1, which equals it when ep_degree spans the data-side workers)",
        check=(
            (lambda v: v == -1 or v >= 1, "must be >= 1, or -1 (inferred: dp x sharding / ep_degree)"),
            _INT32,
        ),
    ),
}

# Fleet's tensor_parallel_configs (its TensorParallelConfig proto: tensor_parallel_degree,
# tensor_init_seed) plus metaopt's column / row, which name the layers to split (Fleet's static
# TensorParallelOptimizer takes a model built of hand-written parallel layers; metaopt rewrites
# the exported program by module path: passes/tensor_parallel.py).
TENSOR_PARALLEL_CONFIGS: dict[str, Key] = {
    "tensor_parallel_degree": Key(
        1,
        "int",
        "model-parallel workers per layer; must equal hybrid_configs['mp_degree'] (1: take that)",
        check=_COUNT,
    ),
    "tensor_init_seed": Key(
        -1,
        "int",
        "seed of the split params' init; metaopt slices the exported params (UNIMPLEMENTED)",
        check=((lambda v: v >= -1, "must be >= 0, or -1 (the default: none)"), _INT32),
    ),
    "column": Key(
        [],
        "list[str]",
        "column-parallel Linear layers (module paths or patterns as recompute's checkpoints; "
        "'*' is one path component): each rank keeps its rows of the weight; 'auto': the column "
        "and row layers of every transformer block found (passes/tensor_parallel_auto.py)",
        extra=True,
    ),
    "row": Key(
        [],
        "list[str]",
        "row-parallel Linear layers, each ending a column layer's split region: each rank keeps its "
        "columns of the weight, the partial products are all-reduced ('auto' or empty when column "
        "is 'auto')",
        extra=True,
    ),
    "vocab": Key(
        [],
        "list[str]",
        "tables split by vocab rows (Megatron's VocabParallelEmbedding): embedding modules (a head "
        "tied to one follows), LM-head modules (their '<module>.weight') or param names; each rank "
        "looks up its rows and the fused LM head + cross-entropy runs over its vocab slice",
        extra=True,
    ),
    "sequence_parallel": Key(
        False,
        "bool",
        "Megatron's sequence parallel: the norm / dropout / residual regions between the row and the "
        "next column layers hold 1/mp of the sequence; all-reduces become reduce-scatter + all-gather "
        "(passes/sequence_parallel.py; PaddleNLP's sequence_parallel model flag)",
        extra=True,
    ),
    "one_process_dropout": Key(
        False,
        "bool",
        "dropout on split values (attention over a rank's heads) draws one process's mask: the whole "
        "mask from the shared stream, each rank keeping its slice (a whole-size draw per rank; CPU "
        "only), so a tensor-parallel run drops what one process drops; False: each rank its own "
        "stream (Megatron's model-parallel RNG)",
        extra=True,
    ),
}

# feature flag -> its config table; the order is the printed order (and that of META_OPTIMIZERS).
# Fleet's sharding_configs (its ShardingConfig proto; the keys a static-graph sharding script
# sets): ZeRO stages 1, 2 and 3 as a rewrite (passes/sharding.py, the fleet step "sharding").
SHARDING_CONFIGS: dict[str, Key] = {
    "sharding_segment_strategy": Key(
        "segment_broadcast_MB",
        "str",
        "how the params' all-gather is bucketed (segment_anchors: UNIMPLEMENTED)",
        choices=("segment_broadcast_MB", "segment_anchors"),
    ),
    "segment_broadcast_MB": Key(
        32.0,
        "float",
        "bucket size of the updated params' all-gather, MB",
        check=(*_POSITIVE, (lambda v: v <= 2**31, "must be <= 2**31 (MB)")),
    ),
    "sharding_degree": Key(
        8,
        "int",
        "workers each param's optimizer state is split over (Fleet's default 8); it must equal the "
        "world size / dp_degree: the sharding axis of the hybrid layout",
        check=_COUNT,
    ),
    "stage": Key(
        1,
        "int",
        "1: optimizer state sharded; 2: grads too (reduce-scattered as they are made); "
        "3: params too (gathered before their reads in the forward and again in the backward)",
        check=((lambda v: v in (1, 2, 3), "must be 1, 2 or 3"),),
    ),
    "optimize_offload": Key(
        False, "bool", "optimizer state in host memory, brought to the device per bucket for its updates"
    ),
    "hybrid_dp": Key(
        False,
        "bool",
        "data parallel beside sharding; metaopt takes it from hybrid_configs' dp_degree (UNIMPLEMENTED)",
    ),
    "gradient_merge_acc_step": Key(
        1,
        "int",
        "steps merged inside sharding; metaopt: strategy.gradient_merge (UNIMPLEMENTED)",
        check=_COUNT,
    ),
    "optimize_cast": Key(False, "bool", "keep the fp32 master params' cast in the optimizer (UNIMPLEMENTED)"),
    **{
        f"{axis}_degree": Key(
            1,
            "int",
            f"Fleet 2.0's {axis} degree beside sharding; metaopt: hybrid_configs' (UNIMPLEMENTED)",
            check=_COUNT,
        )
        for axis in ("mp", "dp", "pp")
    },
}

# Fleet's lamb_configs and lars_configs: the layer-wise adaptive updates that replace Adam's
# (LAMB) or Momentum's (LARS) updates (passes/layerwise.py; ops/kernels/layerwise.py).
_EXCLUDE = Key(
    [],
    "list[str]",
    "params whose name contains one of these strings get no weight decay (e.g. 'bias', 'norm')",
)
LAMB_CONFIGS: dict[str, Key] = {
    "lamb_weight_decay": Key(
        0.01, "float", "decoupled weight decay inside the trust ratio", check=_FLOAT32_FACTOR
    ),
    "exclude_from_weight_decay": _EXCLUDE,
}
LARS_CONFIGS: dict[str, Key] = {
    "lars_coeff": Key(0.001, "float", "trust coefficient of the local learning rate", check=_FLOAT32_FACTOR),
    "lars_weight_decay": Key(0.0005, "float", "weight decay added to the grad", check=_FLOAT32_FACTOR),
    "epsilon": Key(0.0, "float", "added to the local learning rate's denominator", check=_FLOAT32_FACTOR),
    "exclude_from_weight_decay": _EXCLUDE,
}

LOCALSGD_CONFIGS: dict[str, Key] = {
    "k_steps": Key(1, "int", "average the params every k steps (after begin_step)", check=_K_STEPS),
    "begin_step": Key(1, "int", "average every step up to this one (then every k_steps)", check=_COUNT),
}

# Fleet's gradient_scale_configs (its GradientScaleConfig proto, no feature flag): how data
# parallel scales the summed grads. metaopt averages them over the workers, Fleet's default.
GRADIENT_SCALE_CONFIGS: dict[str, Key] = {
    "scale_strategy": Key(
        "avg",
        "str",
        "'avg': the grads summed over the workers are divided by the worker count (metaopt's data "
        "parallel); 'sum', 'customized': UNIMPLEMENTED",
        choices=("avg", "sum", "customized"),
    ),
    "scale_gradient": Key(
        False, "bool", "divide after gradient merge instead of before it; metaopt: False (UNIMPLEMENTED)"
    ),
}


def _refused_table(keys: dict[str, tuple[Any, str]], what: str) -> dict[str, Key]:
    """A config table of a feature metaopt refuses: Fleet's keys, types and defaults, so a Fleet
    script's dict is checked (did-you-mean) and reads back; any non-default key is refused."""
    return {
        k: Key(
            default,
            type_,
            f"{what}: Fleet's {k} (refused at minimize)",
            check=_ANY_INT32 if type_ == "int" else (),
        )
        for k, (default, type_) in keys.items()
    }


# an int field of Fleet's proto with no range of its own (refused anyway): an int32, as in Fleet
_ANY_INT32: tuple[Check, ...] = (
    (
        lambda v: -(2**31) <= v <= INT32_MAX,
        f"must be an int32 (as in Fleet's proto), {-(2**31)} .. {INT32_MAX}",
    ),
)


# Configs of Fleet features metaopt refuses (UNSUPPORTED_FEATURES, parameter servers, Paddle's
# trainer): Fleet 2.x's keys and defaults (its proto), accepted at assignment so a Fleet script
# runs, and refused at minimize, each key not at its default, whether its flag is on or not
# (nothing in metaopt reads them). "dgc" -> strategy.dgc_configs; the why is REFUSED_CONFIGS'.
REFUSED_CONFIG_TABLES: dict[str, dict[str, Key]] = {
    "dgc": _refused_table(
        {"rampup_begin_step": (0, "int"), "rampup_step": (1, "int"), "sparsity": ([], "list[float]")},
        "deep gradient compression",
    ),
    "adaptive_localsgd": _refused_table(
        {"init_k_steps": (1, "int"), "begin_step": (1, "int")}, "adaptive local SGD"
    ),
    "a_sync": _refused_table(
        {
            "k_steps": (-1, "int"),
            "max_merge_var_num": (1, "int"),
            "send_queue_size": (16, "int"),
            "independent_recv_thread": (False, "bool"),
            "min_send_grad_num_before_recv": (1, "int"),
            "thread_pool_size": (1, "int"),
            "send_wait_times": (1, "int"),
            "runtime_split_send_recv": (False, "bool"),
            "launch_barrier": (True, "bool"),
            "heter_worker_device_guard": ("cpu", "str"),
            "lr_decay_steps": (10, "int"),
            "use_ps_gpu": (0, "int"),
            "use_gpu_graph": (0, "int"),
        },
        "asynchronous parameter-server training",
    ),
    "qat": _refused_table(
        {
            "channel_wise_abs_max": (True, "bool"),
            "weight_bits": (8, "int"),
            "activation_bits": (8, "int"),
            "not_quant_pattern": ([], "list[str]"),
            "algo": ("", "str"),
        },
        "quantization-aware training",
    ),
    "trainer_desc": _refused_table(
        {
            "dump_fields_path": ("", "str"),
            "dump_fields": ([], "list[str]"),
            "dump_param": ([], "list[str]"),
            "stat_var_names": ([], "list[str]"),
            "trainer": ("", "str"),
            "device_worker": ("", "str"),
            "local_sparse": ([], "list[str]"),
            "remote_sparse": ([], "list[str]"),
        },
        "Paddle's dataset trainer",
    ),
}

CONFIGS: dict[str, dict[str, Key]] = {
    "amp": AMP_CONFIGS,
    "localsgd": LOCALSGD_CONFIGS,
    "lamb": LAMB_CONFIGS,
    "lars": LARS_CONFIGS,
    "sharding": SHARDING_CONFIGS,
    "recompute": RECOMPUTE_CONFIGS,
    "pipeline": PIPELINE_CONFIGS,
    "gradient_merge": GRADIENT_MERGE_CONFIGS,
    "tensor_parallel": TENSOR_PARALLEL_CONFIGS,
}
# Configs with no feature flag (Fleet has none for them): always in effect, printed when they
# differ from their defaults. "hybrid" -> strategy.hybrid_configs.
# metaopt's moe_configs (no Fleet proto: Paddle sets the capacity on its MoE layer): the
# experts of every MoE layer the exported program has (passes/expert_capacity.py).
MOE_CONFIGS: dict[str, Key] = {
    "capacity_factor": Key(
        None,
        "float|None",
        "each expert serves at most ceil(capacity_factor x token-expert rows / experts) rows per step, "
        "in fixed zero-padded slots (static shapes); rows past it are dropped and counted in the program "
        "output 'moe_dropped_tokens'; None: no capacity, no row dropped",
        extra=True,
        check=(
            (
                lambda v: v is None or (math.isfinite(v) and 0 < v <= FLOAT32_MAX),
                "must be None or a finite number > 0",
            ),
        ),
    ),
}
FLAGLESS_CONFIGS: dict[str, dict[str, Key]] = {
    "hybrid": HYBRID_CONFIGS,
    "gradient_scale": GRADIENT_SCALE_CONFIGS,
    "moe": MOE_CONFIGS,
}
ALL_CONFIGS: dict[str, dict[str, Key]] = {**CONFIGS, **FLAGLESS_CONFIGS, **REFUSED_CONFIG_TABLES}

# Fleet's object-valued fields (Paddle's BuildStrategy and ExecutionStrategy, their proto's keys
# and defaults): read back as an object whose attributes write through to the strategy
# (``strategy.execution_strategy.num_threads = 4``), assigned as such an object, a dict (replace:
# defaults plus the keys given), None (the defaults) or any object with those attributes.
BUILD_STRATEGY: dict[str, Key] = {
    **{
        name: Key(default, "bool", f"Paddle's graph pass or scheduling switch {name}")
        for name, default in (
            ("enable_sequential_execution", False),
            ("fuse_elewise_add_act_ops", False),
            ("fuse_bn_act_ops", False),
            ("fuse_relu_depthwise_conv", False),
            ("fuse_broadcast_ops", False),
            ("fuse_all_optimizer_ops", False),
            ("enable_inplace", False),
            ("enable_backward_optimizer_op_deps", True),
            ("cache_runtime_context", False),
            ("fuse_bn_add_act_ops", True),
            ("enable_auto_fusion", False),
            ("enable_addto", False),
            ("fix_op_run_order", False),
            ("allow_cuda_graph_capture", False),
            ("fuse_gemm_epilogue", False),
        )
    },
    "reduce_strategy": Key(
        0,
        "int",
        "0: grads all-reduced (AllReduce); 1: Reduce, 2: none (UNIMPLEMENTED)",
        check=((lambda v: v in (0, 1, 2), "must be 0 (AllReduce), 1 (Reduce) or 2 (_NoReduce)"),),
    ),
    "debug_graphviz_path": Key("", "str", "where Paddle writes the graph as graphviz (UNIMPLEMENTED)"),
}
EXECUTION_STRATEGY: dict[str, Key] = {
    "num_threads": Key(1, "int", "Paddle's op-scheduling threads (UNIMPLEMENTED)", check=_COUNT),
    "num_iteration_per_drop_scope": Key(
        10, "int", "steps between drops of Paddle's local scope (NO_EFFECT)", check=_COUNT
    ),
    "num_iteration_per_run": Key(1, "int", "steps per Executor.run call (UNIMPLEMENTED)", check=_COUNT),
    "use_thread_barrier": Key(False, "bool", "parameter-server worker barrier (UNIMPLEMENTED)"),
}
OBJECT_TABLES: dict[str, dict[str, Key]] = {
    "build_strategy": BUILD_STRATEGY,
    "execution_strategy": EXECUTION_STRATEGY,
}
# Fleet's fs_client_param (its FsClientParameter: the parameter servers' HDFS/AFS client)
FS_CLIENT_PARAM: dict[str, Key] = {
    k: Key("", "str", f"parameter-server file-system client's {k} (refused at minimize)")
    for k in ("uri", "user", "passwd", "hadoop_bin")
}
# Every dict- or object-valued attribute -> its table ("amp_configs" -> AMP_CONFIGS).
TABLES: dict[str, dict[str, Key]] = {
    **{f"{flag}_configs": table for flag, table in ALL_CONFIGS.items()},
    **OBJECT_TABLES,
    "fs_client_param": FS_CLIENT_PARAM,
}
# Why each table no code of metaopt reads is refused (each key not at its default, at minimize).
REFUSED_CONFIGS: dict[str, str] = {
    "dgc_configs": "a config of deep gradient compression, strategy.dgc, which is refused",
    "adaptive_localsgd_configs": "a config of strategy.adaptive_localsgd, which is refused",
    "a_sync_configs": "a config of parameter-server training, strategy.a_sync, which is refused",
    "qat_configs": "a config of quantization-aware training, strategy.qat, which is refused",
    "trainer_desc_configs": (
        "Paddle's dataset trainer (dumps, device workers, sparse tables); metaopt's Executor.run "
        "runs one step on the batch it is fed"
    ),
    "fs_client_param": "the parameter servers' HDFS/AFS client; metaopt trains collectively",
}

# Fleet 2.x's feature flags metaopt accepts (a Fleet script still parses) but refuses at minimize
# when True, each with why (and what to use instead, where there is something).
UNSUPPORTED_FEATURES: dict[str, str] = {
    "dgc": "deep gradient compression sends top-k sparsified grads; metaopt's collectives are dense",
    "adaptive_localsgd": "its adaptive averaging interval; strategy.localsgd averages every k_steps",
    "a_sync": "asynchronous parameter-server training; metaopt trains collectively",
    "heter_ccl_mode": "heterogeneous parameter-server collectives; metaopt trains collectively",
    "sync_batch_norm": "BatchNorm statistics are each worker's own; synchronising them is not written",
    "asp": "automatic 2:4 structured sparsity (pruning masks on the weights) is not written",
    "qat": "quantization-aware training (fake-quant ops) is not written",
    "elastic": "elastic jobs; metaoptrun --max_restarts restarts a job from its latest checkpoint",
    "auto": "the automatic strategy search; set the features yourself",
    "semi_auto": "auto-parallel by annotation; tensor_parallel_configs names the layers to split instead",
    "use_hierarchical_allreduce": "two-level (inside / across nodes) all-reduce; metaopt's is flat",
    "fuse_grad_merge": "gradient merge's fused buffers; gradient_merge merges each grad in its own",
    "auto_search": "the automatic parallel-strategy search; set the features yourself",
    "is_fl_ps_mode": "federated-learning parameter servers; metaopt trains collectively",
    "is_with_coordinator": "federated-learning parameter servers' coordinator; metaopt trains collectively",
    "adam_d2sum": "parameter-server Adam's d2sum; metaopt trains collectively",
}

FIELDS: dict[str, Key] = {
    "amp": Key(False, "bool", "automatic mixed precision (amp_configs)"),
    "recompute": Key(False, "bool", "recompute, optionally with offload (recompute_configs)"),
    "pipeline": Key(False, "bool", "pipeline parallelism (pipeline_configs)"),
    "gradient_merge": Key(False, "bool", "gradient accumulation over k steps (gradient_merge_configs)"),
    "fp16_allreduce": Key(
        False,
        "bool",
        "data parallel's float32 grads sent in float16 (half the bytes): divided by the worker count, "
        "cast, summed, cast back",
    ),
    "localsgd": Key(
        False,
        "bool",
        "local SGD: no grad all-reduce; the params averaged every step up to begin_step, then every "
        "k_steps (localsgd_configs)",
    ),
    "lamb": Key(False, "bool", "LAMB: the Adam optimizer's updates made layer-wise adaptive (lamb_configs)"),
    "lars": Key(
        False, "bool", "LARS: the Momentum optimizer's updates made layer-wise adaptive (lars_configs)"
    ),
    "sharding": Key(
        False, "bool", "ZeRO: optimizer state (2: grads, 3: params) split over workers (sharding_configs)"
    ),
    "tensor_parallel": Key(False, "bool", "tensor (model) parallel layers (tensor_parallel_configs)"),
    # communication flags of data parallel
    "fuse_all_reduce_ops": Key(True, "bool", "all-reduce gradients in fused buckets"),
    "fuse_grad_size_in_MB": Key(32, "int", "bucket size of fused all-reduce, MB", check=_SIZE),
    "nccl_comm_num": Key(
        1, "int", "communicators used for all-reduce; metaopt: 1 (UNIMPLEMENTED)", check=_COUNT
    ),
    "sync_nccl_allreduce": Key(
        True, "bool", "wait for each all-reduce before going on; metaopt: True (UNIMPLEMENTED)"
    ),
    "find_unused_parameters": Key(
        False,
        "bool",
        "DDP's flag for params that get no gradient; metaopt leaves them out on every worker "
        "alike, as True asks (NO_EFFECT)",
    ),
    "fuse_linear_cross_entropy": Key(
        True,
        "bool",
        "fuse the LM head's matmul and its softmax cross-entropy into one op that works in chunks "
        "of tokens, never holding the tokens x vocab logits (exact; heads of >= 1024 classes whose "
        "logits nothing else reads; passes/fuse_linear_cross_entropy.py); False keeps them unfused",
        extra=True,
    ),
    "optimizer_in_backward": Key(
        False,
        "bool",
        "apply each param's update inside the backward, as soon as its grad is final and the "
        "param is read no more, so the grad is freed there (PyTorch's optimizer-in-backward; "
        "passes/update_in_backward.py; at sharding stage 3, as soon as its grad slice is "
        "reduce-scattered). Refused with global-norm clipping, gradient merge, pipeline and AMP "
        "loss scaling, which need every grad before any update, and at sharding stages 1 and 2",
        extra=True,
    ),
    "fuse_grad_size_in_num": Key(
        8, "int", "grads per fused all-reduce (Fleet's raw program optimizer; UNIMPLEMENTED)", check=_COUNT
    ),
    "last_comm_group_size_MB": Key(
        1.0, "float", "size of the last fused all-reduce bucket, MB (UNIMPLEMENTED)", check=_POSITIVE
    ),
    "calc_comm_same_stream": Key(
        False,
        "bool",
        "fused all-reduces on the compute stream (Fleet's _calc_comm_same_stream; UNIMPLEMENTED)",
    ),
    "hierarchical_allreduce_inter_nranks": Key(
        1, "int", "ranks per node of the hierarchical all-reduce (UNIMPLEMENTED)", check=_COUNT
    ),
    "cudnn_exhaustive_search": Key(
        False,
        "bool",
        "Paddle's FLAGS_cudnn_exhaustive_search (UNIMPLEMENTED: torch.backends.cudnn.benchmark)",
    ),
    "conv_workspace_size_limit": Key(
        512, "int", "Paddle's FLAGS_conv_workspace_size_limit, MB (UNIMPLEMENTED)", check=_SIZE
    ),
    "cudnn_batchnorm_spatial_persistent": Key(
        False, "bool", "Paddle's FLAGS_cudnn_batchnorm_spatial_persistent (UNIMPLEMENTED)"
    ),
    "split_data": Key(True, "bool", "auto-parallel's split of the fed batch (UNIMPLEMENTED)"),
    "sparse_table_configs": Key(
        [], "json", "the parameter servers' sparse tables (Fleet's downpour_table_param; UNIMPLEMENTED)"
    ),
    "without_graph_optimization": Key(
        True,
        "bool",
        "run the rewritten program as is (Fleet 2.x default); metaopt: True (UNIMPLEMENTED)",
    ),
    "cuda_graph": Key(
        False,
        "bool",
        "capture the whole training step in a CUDA graph per feed shape and replay it (Paddle's "
        "BuildStrategy.allow_cuda_graph_capture); metaopt: False (UNIMPLEMENTED: steps are proven "
        "free of host reads on the meta device, the capture itself waits for a GPU to test it on)",
        extra=True,
    ),
    **{
        name: Key(False, "bool", f"Fleet's {name}: not implemented in metaopt (refused at minimize: {why})")
        for name, why in UNSUPPORTED_FEATURES.items()
    },
}

# Fields and config keys ("<flag>_configs.<key>") that metaopt has no code for, with what it
# does instead: a value other than the default is refused at minimize (``unimplemented``).
# An issue that implements one reads it where it is used and deletes its row here.
UNIMPLEMENTED: dict[str, str] = {
    "nccl_comm_num": "all-reduces run on one communicator",
    "sync_nccl_allreduce": "each all-reduce is waited for before the ops after it run",
    "without_graph_optimization": "the rewritten program runs as is, with no graph optimization passes",
    "cuda_graph": "each step runs op by op; CUDA-graph capture is not written yet",
    "fuse_grad_size_in_num": "the fused all-reduce buckets are sized by fuse_grad_size_in_MB",
    "last_comm_group_size_MB": "every fused all-reduce bucket is sized by fuse_grad_size_in_MB",
    "calc_comm_same_stream": "metaopt's executor decides where the all-reduces run",
    "hierarchical_allreduce_inter_nranks": "the all-reduce is flat (use_hierarchical_allreduce is refused)",
    "cudnn_exhaustive_search": (
        "torch picks the cuDNN algorithms: set torch.backends.cudnn.benchmark = True yourself"
    ),
    "conv_workspace_size_limit": "torch sizes the cuDNN convolution workspace itself",
    "cudnn_batchnorm_spatial_persistent": "torch picks the cuDNN BatchNorm kernel itself",
    "split_data": "the fed batch is each worker's own (auto-parallel, semi_auto, is refused)",
    **{
        f"hybrid_configs.{key}": (
            f"{what} is not built; for long sequences hybrid_configs['sep_degree'] splits every sequence "
            "(Ulysses), and tensor_parallel_configs['sequence_parallel'] the norm / dropout regions "
            "beside mp_degree"
        )
        for key, what in NOT_BUILT_AXES.items()
    },
    "sparse_table_configs": "parameter-server sparse tables; metaopt trains collectively",
    "gradient_scale_configs.scale_strategy": (
        "data parallel divides the summed grads by the worker count ('avg'); for 'sum' scale the loss"
    ),
    "gradient_scale_configs.scale_gradient": "grads are averaged over the workers before gradient merge",
    **{
        f"build_strategy.{name}": (
            f"Paddle's graph pass {name}; metaopt rewrites with its own passes (print(optimizer.plan()))"
        )
        for name in (
            "fuse_elewise_add_act_ops",
            "fuse_bn_act_ops",
            "fuse_relu_depthwise_conv",
            "fuse_broadcast_ops",
            "fuse_all_optimizer_ops",
            "enable_inplace",
            "cache_runtime_context",
            "fuse_bn_add_act_ops",
            "enable_auto_fusion",
            "enable_addto",
            "fuse_gemm_epilogue",
        )
    },
    "build_strategy.enable_backward_optimizer_op_deps": "the program's op order fixes when updates run",
    "build_strategy.allow_cuda_graph_capture": "CUDA-graph capture is not written yet (strategy.cuda_graph)",
    "build_strategy.reduce_strategy": (
        "grads are all-reduced (0); Reduce's one owner per param is what strategy.sharding does"
    ),
    "build_strategy.debug_graphviz_path": "print(program) or `python -m metaopt dump` shows the program",
    "execution_strategy.num_threads": (
        "ops run one at a time in program order; torch.set_num_threads sets the threads inside each op"
    ),
    "execution_strategy.num_iteration_per_run": "Executor.run runs one step per call",
    "execution_strategy.use_thread_barrier": "a parameter-server barrier; metaopt trains collectively",
    "tensor_parallel_configs.tensor_init_seed": (
        "each worker slices its params from the exported model; data parallel's start broadcasts "
        "them (replicated ones from rank 0, split ones within the data-parallel group)"
    ),
    "sharding_configs.sharding_segment_strategy": "the all-gather is bucketed by segment_broadcast_MB",
    "sharding_configs.hybrid_dp": "data parallel beside sharding comes from hybrid_configs' dp_degree",
    "sharding_configs.gradient_merge_acc_step": "gradients are merged by strategy.gradient_merge",
    "sharding_configs.optimize_cast": "master weights are amp_configs['use_pure_fp16']'s",
    **{
        f"sharding_configs.{a}_degree": f"the layout is hybrid_configs' (set its {a}_degree there)"
        for a in ("mp", "dp", "pp")
    },
}

# Fields and config keys accepted with either value: metaopt's behaviour is fixed and is what
# the non-default value asks for, so there is nothing to refuse (the reason says what it does).
NO_EFFECT: dict[str, str] = {
    "find_unused_parameters": (
        "a param off the loss's path gets no gradient and no update, on every worker alike "
        "(a static program knows them, so nothing waits for their all-reduce): what True asks"
    ),
    "pipeline_configs.p2p_cache_shape": (
        "every Send carries the shape and the Recv checks it, so shapes may change from one "
        "step to the next: what False asks"
    ),
    "build_strategy.enable_sequential_execution": "ops run one at a time in program order: what True asks",
    "build_strategy.fix_op_run_order": "ops run in program order, the same every step: what True asks",
    "execution_strategy.num_iteration_per_drop_scope": (
        "no scope of temporaries outlives a step (each is freed after its last read): nothing to drop"
    ),
}


def _entry(path: str) -> tuple[str | None, str, Key]:
    """A row of UNIMPLEMENTED / NO_EFFECT: (config name or None, field or key, its Key)."""
    config, _, name = path.rpartition(".")
    if not config:
        return None, name, FIELDS[name]
    return config, name, TABLES[config][name]


for _path in (*UNIMPLEMENTED, *NO_EFFECT):  # a typo in the tables above fails at import
    _entry(_path)
del _path


def unimplemented(strategy: DistributedStrategy, config: str | None = None) -> list[NotImplementedError]:
    """One NotImplementedError per ``UNIMPLEMENTED`` field or config key of `strategy` that is
    not at its default (a config key only while its feature flag is on), in table order; only
    those of `config` (e.g. "hybrid_configs") when it is given.

    ``minimize`` refuses them before the program is touched; each message names the field,
    its value, what metaopt does instead and the default to go back to::

        strategy.nccl_comm_num=2: not implemented in metaopt (all-reduces run on one
        communicator); leave it at its default 1
    """
    return [
        NotImplementedError(
            f"{where}={value!r}: not implemented in metaopt ({_reason(path)}); "
            f"leave it at its default {default!r}"
        )
        for path, where, value, default in _unimplemented_set(strategy)
        if config is None or path.startswith(f"{config}.")
    ]


def _reason(path: str) -> str:
    """Why `path` (a field, or "<table>.<key>") is refused: its UNIMPLEMENTED row, else its table's."""
    return UNIMPLEMENTED.get(path) or REFUSED_CONFIGS[path.rpartition(".")[0]]


def _in_effect(table: str, values: dict[str, Any]) -> bool:
    """Whether a table's keys are read: a feature's config only while its flag is on (otherwise
    the whole config is unused: the plan warns); every other table always."""
    flag = table[: -len("_configs")]
    return flag not in CONFIGS or values[flag]


def _where(config: str, name: str) -> str:
    if config in OBJECT_TABLES:
        return f"strategy.{config}.{name}"
    return f"strategy.{config}[{name!r}]"


def _unimplemented_set(strategy: DistributedStrategy) -> list[tuple[str, str, Any, Any]]:
    """(path, 'strategy.<field>' or "strategy.<config>['<key>']", value, default) of each
    UNIMPLEMENTED row not at its default."""
    values = strategy._values
    paths = [*UNIMPLEMENTED, *(f"{t}.{k}" for t in REFUSED_CONFIGS for k in TABLES[t])]
    out = []
    for path in paths:
        config, name, key = _entry(path)
        if config is None:
            value, where = values[name], f"strategy.{name}"
        elif config in REFUSED_CONFIGS or _in_effect(config, values):
            value, where = values[config][name], _where(config, name)
        else:  # the feature is off: its config is unused (the plan warns if it is set)
            continue
        if value != key.default:
            out.append((path, where, value, key.default))
    return out


def _no_effect_set(strategy: DistributedStrategy) -> list[tuple[str, Any, Any]]:
    """(name as printed, value, default) of each NO_EFFECT row not at its default."""
    out = []
    for path in NO_EFFECT:
        config, name, key = _entry(path)
        value = strategy._values[name] if config is None else strategy._values[config][name]
        if value != key.default:
            label = name if config is None else _where(config, name)[len("strategy.") :]
            out.append((label, value, key.default))
    return out


# --- values ---------------------------------------------------------------------------------


class _ReadOnlyList(list):
    """A config's list as read back: equal to a list, but mutating it raises."""

    _config = ""
    _key = ""

    def _refuse(self, *args: Any, **kwargs: Any):
        c = self._config
        raise TypeError(
            f"strategy.{c}[{self._key!r}] is read-only: assign the whole config again, e.g. "
            f"strategy.{c} = {{**strategy.{c}, {self._key!r}: [...]}}"
        )

    append = extend = insert = remove = pop = clear = sort = reverse = _refuse
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse

    def __reduce__(self):
        return (list, (list(self),))


class ConfigView(dict):
    """A config as read back (``strategy.recompute_configs``): a read-only dict.

    Fleet returns a copy, so ``strategy.amp_configs["incr_ratio"] = 3.0`` is silently
    lost there; here it raises. Assign a whole dict instead:
    ``strategy.amp_configs = {**strategy.amp_configs, "incr_ratio": 3.0}``.
    """

    _name = ""

    def _refuse(self, *args: Any, **kwargs: Any):
        raise TypeError(
            f"strategy.{self._name} is read-only: assign a whole dict, e.g. "
            f"strategy.{self._name} = {{**strategy.{self._name}, 'key': value}}"
        )

    __setitem__ = __delitem__ = __ior__ = update = pop = popitem = clear = setdefault = _refuse

    def __reduce__(self):
        return (dict, (_plain(self),))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _view(name: str, config: dict[str, Any]) -> ConfigView:
    out = ConfigView()
    for k, v in config.items():
        if isinstance(v, list):
            v = _frozen([_frozen(x, name, k) if isinstance(x, list) else x for x in v], name, k)
        dict.__setitem__(out, k, v)
    out._name = name
    return out


def _frozen(values: list, config: str, key: str) -> _ReadOnlyList:
    out = _ReadOnlyList(values)
    out._config, out._key = config, key
    return out


class _Mismatch(Exception):
    pass


def _describe(value: Any) -> str:
    r = repr(value)
    if len(r) > 60:
        r = r[:57] + "..."
    return f"{type(value).__name__} ({r})"


def _conform(value: Any, spec: str) -> Any:
    """`value` checked against `spec` and normalised (ints -> floats, tuples -> lists)."""
    if spec.endswith("|None"):
        if value is None:
            return None
        return _conform(value, spec[: -len("|None")])
    if spec == "str|list[str]":
        if isinstance(value, str):
            return value
        return _conform(value, "list[str]")
    if spec.startswith("list[") and spec.endswith("]"):
        if not isinstance(value, (list, tuple)):
            raise _Mismatch(f"got {_describe(value)}")
        inner = spec[5:-1]
        out = []
        for i, v in enumerate(value):
            try:
                out.append(_conform(v, inner))
            except _Mismatch:
                raise _Mismatch(f"but item {i} is {_describe(v)}") from None
        return out
    if spec == "bool":
        if isinstance(value, bool):
            return value
    elif spec == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif spec == "float":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if isinstance(value, int) and abs(value) > FLOAT32_MAX:  # float(10**400) would raise
                raise _Mismatch(f"got {_describe(value)} (must be a finite float)")
            if not math.isfinite(value):
                # inf passes "> 0" and "> 1": init_loss_scaling=inf then skipped every step forever
                raise _Mismatch(f"got {value!r} (must be finite)")
            return float(value)
    elif spec == "str":
        if isinstance(value, str):
            return value
    elif spec == "json":  # Fleet's nested parameter-server messages: kept as given, JSON-able
        try:
            return json.loads(json.dumps(value, allow_nan=False))
        except (TypeError, ValueError):
            raise _Mismatch(f"got {_describe(value)} (must be JSON: dicts, lists, str, numbers)") from None
    else:  # pragma: no cover - a typo in the tables above
        raise AssertionError(f"unknown spec {spec!r}")
    raise _Mismatch(f"got {_describe(value)}")


def _coerce_checkpoints(value: Any) -> Any:
    """Fleet takes checkpoint Vars or names; 'auto' alone means ['auto']."""
    if isinstance(value, str):
        if value == "auto":
            return ["auto"]
        raise _Mismatch(f"got str ({value!r}); a single checkpoint must still be a list: [{value!r}]")
    if isinstance(value, (list, tuple)):
        return [getattr(v, "name", v) if not isinstance(v, str) and _is_var(v) else v for v in value]
    return value


def _coerce_layers(value: Any) -> Any:
    """Tensor parallel's column / row: 'auto' alone means ['auto']; one layer is still a list."""
    if isinstance(value, str):
        if value == "auto":
            return ["auto"]
        raise _Mismatch(f"got str ({value!r}); a single layer must still be a list: [{value!r}]")
    return value


def _is_var(v: Any) -> bool:
    from metaopt.ir import Var

    return isinstance(v, Var)


_COERCE: dict[tuple[str, str], Callable[[Any], Any]] = {
    ("recompute_configs", "checkpoints"): _coerce_checkpoints,
    ("recompute_configs", "offload_checkpoints"): lambda v: (
        v if v is None or isinstance(v, str) else _coerce_checkpoints(v)
    ),
    ("pipeline_configs", "cuts"): lambda v: _coerce_checkpoints(v) if isinstance(v, (list, tuple)) else v,
    ("tensor_parallel_configs", "column"): _coerce_layers,
    ("tensor_parallel_configs", "row"): _coerce_layers,
}


def _check_value(where: str, key: Key, value: Any, coerce: Callable[[Any], Any] | None = None) -> Any:
    try:
        if coerce is not None:
            value = coerce(value)
        value = _conform(value, key.type)
    except _Mismatch as e:
        raise TypeError(f"{where}: expected {key.type}, {e}") from None
    if key.choices is not None and value not in key.choices:
        raise ValueError(
            f"{where}: {value!r} is not one of {', '.join(map(repr, key.choices))}"
            f"{did_you_mean(value, key.choices) if isinstance(value, str) else ''}"
        )
    if value is not None:
        for ok, must in key.check:
            if not ok(value):
                raise ValueError(f"{where}: {must}, got {value!r}")
    return value


def _config_defaults(table: dict[str, Key]) -> dict[str, Any]:
    return {k: _plain(key.default) for k, key in table.items()}


def _fmt(value: Any) -> list[str]:
    """A value as table cells: one per list item (Fleet prints repeated fields that way)."""
    if isinstance(value, list):
        return [str(v) for v in value] if value else ["[]"]
    return [str(value)]


# Fleet's underscored spellings a Fleet script sets (its property is private there) -> the field
_ALIASES: dict[str, str] = {"_calc_comm_same_stream": "calc_comm_same_stream"}


class StrategyObject:
    """``strategy.build_strategy`` / ``strategy.execution_strategy`` as read back: Paddle's
    BuildStrategy / ExecutionStrategy, its attributes (the proto's fields) checked and written
    through to the strategy, so ``strategy.execution_strategy.num_threads = 4`` is kept (in Fleet
    the getter returns a copy and such an assignment is silently lost)."""

    __slots__ = ("_strategy", "_name")

    def __init__(self, strategy: DistributedStrategy, name: str) -> None:
        object.__setattr__(self, "_strategy", strategy)
        object.__setattr__(self, "_name", name)

    def _fields(self) -> dict[str, Any]:
        return self._strategy._values[self._name]

    def __getattr__(self, key: str) -> Any:
        if key.startswith("_"):
            raise AttributeError(key)
        if key not in self._fields():
            raise AttributeError(self._unknown(key))
        return _plain(self._fields()[key])

    def __setattr__(self, key: str, value: Any) -> None:
        table = OBJECT_TABLES[self._name]
        if key not in table:
            raise AttributeError(self._unknown(key))
        self._fields()[key] = _check_value(_where(self._name, key), table[key], value)

    def _unknown(self, key: str) -> str:
        table = OBJECT_TABLES[self._name]
        return (
            f"strategy.{self._name} has no attribute {key!r}{did_you_mean(key, table)}; "
            f"Fleet keeps these of it: {', '.join(table)}"
        )

    def to_dict(self) -> dict[str, Any]:
        return _plain(self._fields())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StrategyObject):
            return self.to_dict() == other.to_dict()
        if isinstance(other, Mapping):
            return self.to_dict() == dict(other)
        return NotImplemented

    __hash__ = None  # mutable

    def __dir__(self) -> list[str]:
        return sorted({*object.__dir__(self), *OBJECT_TABLES[self._name]})

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self._fields().items())
        return f"{self._name}({fields})"


def _object_fields(name: str, value: Any) -> Mapping[str, Any]:
    """What may be assigned to build_strategy / execution_strategy, as a dict: None (the
    defaults), a dict, another strategy's object, or any object with those attributes (as
    Fleet's setter reads Paddle's object: getattr of each proto field it has)."""
    if value is None:
        return {}
    if isinstance(value, StrategyObject):
        return value.to_dict()
    if isinstance(value, Mapping):
        return value
    if hasattr(value, "__dict__"):
        return {k: v for k, v in vars(value).items() if not k.startswith("_")}
    found = {k: getattr(value, k) for k in OBJECT_TABLES[name] if hasattr(value, k)}
    if not found:
        raise TypeError(
            f"strategy.{name}: expected a dict, None or an object with its attributes "
            f"({', '.join(OBJECT_TABLES[name])}), got {_describe(value)}"
        )
    return found


# --- the strategy ---------------------------------------------------------------------------


class DistributedStrategy:
    """What ``fleet.distributed_optimizer`` should do; Fleet's fields and defaults.

    Feature flags (``amp``, ``recompute``, ``pipeline``, ``gradient_merge``) each have a
    ``<flag>_configs`` dict; communication flags (``fuse_all_reduce_ops`` ...) tune data
    parallel; ``hybrid_configs`` (no flag) lays the workers out as dp x mp x pp. See ``FIELDS``,
    ``CONFIGS`` and ``FLAGLESS_CONFIGS`` for every field, default and meaning, and the
    module docstring for where metaopt differs from Fleet (configs are replaced, not
    merged; mistakes raise).
    """

    def __init__(self) -> None:
        values: dict[str, Any] = {name: _plain(key.default) for name, key in FIELDS.items()}
        for name, table in TABLES.items():
            values[name] = _config_defaults(table)
        object.__setattr__(self, "_values", values)

    # --- attributes ---------------------------------------------------------------------
    @staticmethod
    def field_names() -> list[str]:
        """Every settable attribute: the flags, the ``<flag>_configs`` and the other tables
        (build_strategy, execution_strategy, fs_client_param)."""
        return [*FIELDS, *TABLES]

    def __getattr__(self, name: str) -> Any:
        name = _ALIASES.get(name, name)
        if name.startswith("_"):
            raise AttributeError(name)
        values = self.__dict__["_values"]
        if name in FIELDS:
            return _plain(values[name])  # a copy: a json field's lists are not the strategy's
        if name in OBJECT_TABLES:
            return StrategyObject(self, name)
        if name in values:
            return _view(name, values[name])
        raise AttributeError(self._unknown(name))

    def __setattr__(self, name: str, value: Any) -> None:
        name = _ALIASES.get(name, name)
        if name in FIELDS:
            self._values[name] = _check_value(f"strategy.{name}", FIELDS[name], value)
        elif name in OBJECT_TABLES:
            self._values[name] = self._check_config(name, _object_fields(name, value))
        elif name in TABLES:
            self._values[name] = self._check_config(name, value)
        else:
            raise AttributeError(self._unknown(name))

    def save_to_prototxt(self, output: str | os.PathLike) -> None:
        """Fleet's protobuf text file: refused (metaopt has no protobuf schema); save_to_json."""
        raise NotImplementedError(
            "strategy.save_to_prototxt: not implemented in metaopt (no protobuf schema); "
            "strategy.save_to_json(path) writes every field, strategy.load_from_json(path) reads it back"
        )

    def load_from_prototxt(self, pb_file: str | os.PathLike) -> None:
        """Fleet's protobuf text file: refused (metaopt has no protobuf schema); load_from_json."""
        raise NotImplementedError(
            "strategy.load_from_prototxt: not implemented in metaopt (no protobuf schema); "
            "strategy.load_from_json(path) reads a file written by strategy.save_to_json(path)"
        )

    def unimplemented(self) -> list[NotImplementedError]:
        """What ``minimize`` refuses of this strategy's ``UNIMPLEMENTED`` fields (see the
        module function ``unimplemented``); empty when every such field is at its default."""
        return unimplemented(self)

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"strategy.{name} cannot be deleted; assign its default instead")

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *self.field_names()})

    def _unknown(self, name: str) -> str:
        if name.endswith("_configs") and name[: -len("_configs")] in UNSUPPORTED_FEATURES:
            feature = name[: -len("_configs")]
            return (
                f"DistributedStrategy has no attribute {name!r}: metaopt does not implement "
                f"Fleet's {feature} meta optimizer (strategy.{feature} is accepted but refused at minimize)"
            )
        return f"DistributedStrategy has no attribute {name!r}{did_you_mean(name, self.field_names())}"

    @staticmethod
    def _check_config(name: str, config: Any) -> dict[str, Any]:
        """defaults + `config`, every key known and every value of its type (replace, not merge)."""
        if not isinstance(config, Mapping):
            raise TypeError(f"strategy.{name}: expected a dict, got {_describe(config)}")
        table = TABLES[name]
        out = _config_defaults(table)
        for k, v in config.items():
            if k not in table:
                raise ValueError(
                    f"strategy.{name}: unknown key {k!r}{did_you_mean(str(k), table)}; "
                    f"known keys: {', '.join(table)}"
                )
            out[k] = _check_value(_where(name, k), table[k], v, _COERCE.get((name, k)))
        return out

    # --- comparison, copies, dicts -------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DistributedStrategy):
            return NotImplemented
        return self._values == other._values

    __hash__ = None  # mutable

    def copy(self) -> DistributedStrategy:
        return DistributedStrategy.from_dict(self.to_dict())

    def __copy__(self) -> DistributedStrategy:
        return self.copy()

    def __deepcopy__(self, memo: dict) -> DistributedStrategy:
        return self.copy()

    def to_dict(self) -> dict[str, Any]:
        """Every field (and every config key) as plain JSON-able values."""
        return _plain(self._values)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "") -> DistributedStrategy:
        """A strategy from defaults + `data` (as written by ``to_dict``); every key checked."""
        if not isinstance(data, Mapping):
            raise TypeError(
                f"{where or 'DistributedStrategy.from_dict'}: expected a dict, got {_describe(data)}"
            )
        s = cls()
        prefix = f"{where}: " if where else ""
        for k, v in data.items():
            if k not in s._values:
                raise ValueError(f"{prefix}unknown field {k!r}{did_you_mean(str(k), s.field_names())}")
            try:
                setattr(s, k, v)
            except (TypeError, ValueError) as e:
                raise type(e)(f"{prefix}{e}") from None
        return s

    # --- files ----------------------------------------------------------------------------
    def save_to_json(self, path: str | os.PathLike) -> None:
        """Write every field to `path` as JSON, atomically (temp file + os.replace)."""
        path = os.fspath(path)
        text = json.dumps(self.to_dict(), indent=2) + "\n"
        atomic_write(path, lambda f: f.write(text), binary=False)

    def load_from_json(self, path: str | os.PathLike) -> None:
        """Set this strategy to the file's fields (others at their defaults); all or nothing."""
        path = os.fspath(path)
        with open(path, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: not a JSON strategy file ({e})") from None
        loaded = DistributedStrategy.from_dict(data, where=path)
        self._values.clear()
        self._values.update(loaded._values)

    # --- printing -------------------------------------------------------------------------
    def __str__(self) -> str:
        return self._table()

    __repr__ = __str__

    def _table(self) -> str:
        """Fleet's "DistributedStrategy Overview" box: enabled features with their configs,
        then the other fields that differ from their defaults."""
        sections: list[tuple[str, list[tuple[str, str]]]] = []
        for flag in CONFIGS:
            if not self._values[flag]:
                continue
            rows: list[tuple[str, str]] = []
            for k, v in self._values[f"{flag}_configs"].items():
                for i, cell in enumerate(_fmt(v)):
                    rows.append((k if i == 0 else "", cell))
            sections.append((f"{flag}=True <-> {flag}_configs", rows))
        for name, table in FLAGLESS_CONFIGS.items():  # shown once they differ from the defaults
            config = self._values[f"{name}_configs"]
            if config != _config_defaults(table):
                sections.append((f"{name}_configs", [(k, str(v)) for k, v in config.items()]))
        changed = [
            (name, str(self._values[name]))
            for name, key in FIELDS.items()
            if name not in CONFIGS and name not in NO_EFFECT and self._values[name] != key.default
        ]
        if changed:
            sections.append(("Environment Flags, Communication Flags", changed))
        no_effect = [(label, f"{value}, default {default}") for label, value, default in _no_effect_set(self)]
        if no_effect:  # accepted, and said so: metaopt already does what these ask (NO_EFFECT)
            sections.append(("No effect in metaopt: it already does what these ask", no_effect))
        refused = [(name, "True, default False") for name in UNSUPPORTED_FEATURES if self._values[name]]
        refused += [
            (where[len("strategy.") :], f"{value}, default {default}")
            for _, where, value, default in _unimplemented_set(self)
        ]
        if refused:
            sections.append(("Not implemented in metaopt: refused at minimize", refused))
        if not sections:
            sections.append(("no meta optimizer enabled, every field at its default", []))

        spacing = 2
        max_k = max([38, *(len(k) + 2 for _, rows in sections for k, _ in rows)])
        max_v = max([38, *(len(v) + 2 for _, rows in sections for _, v in rows)])
        width = max_k + spacing + max_v
        width = max(width, *(len(title) + 4 for title, _ in sections))
        max_v = width - max_k - spacing
        border = "    +" + "=" * width + "+"
        line = "    +" + "-" * width + "+"

        def h1(text: str) -> str:
            return "    |" + text.center(width) + "|"

        def h2(k: str, v: str) -> str:
            return "    |" + k.rjust(max_k) + " " * spacing + v.center(max_v) + "|"

        out = [border, h1(""), h1("DistributedStrategy Overview"), h1("")]
        for title, rows in sections:
            out += [border, h1(title)]
            if rows:
                out.append(line)
                out += [h2(k, v) for k, v in rows]
        out.append(border)
        return "\n".join(out)
