"""The one place derived var names are made.

Derived names follow Fleet's spelling so goldens read like Fleet's logs, but no
code ever reads meaning back out of a name: an op's role and origin fields say
what it is. Passes call these functions and `fresh` instead of formatting names.
"""

from __future__ import annotations

from collections.abc import Container


def grad(name: str) -> str:
    """Gradient of `name` (Fleet: ``x@GRAD``)."""
    return f"{name}@GRAD"


def grad_part(name: str, k: int) -> str:
    """The k-th gradient contribution to `name`, before they are summed into `grad(name)`."""
    return f"{name}@GRAD@{k}"


def grad_temp(name: str) -> str:
    """An intermediate of the gradient computed for forward var `name` (fresh() numbers it)."""
    return f"{name}@GRAD@TMP"


def grad_const() -> str:
    """A constant the backward needs (1.0 for the loss grad, reduction axes ...)."""
    return "grad_const"


def saved(name: str, what: str) -> str:
    """An extra forward output the backward reads (``drop@MASK``, ``ln@RSTD``)."""
    return f"{name}@{what}"


def recompute(name: str) -> str:
    """The recomputed copy of activation `name`."""
    return f"{name}@RECOMPUTE"


def pinned(name: str) -> str:
    """Host (pinned memory) copy of an offloaded checkpoint."""
    return f"{name}@PINNED"


def fetch(name: str) -> str:
    """Device copy fetched back from the host for the backward."""
    return f"{name}@FETCH"


def merged(name: str) -> str:
    """Accumulator of `name` across micro-batches."""
    return f"{name}@MERGED"


def new_state(name: str) -> str:
    """The value that replaces persistable `name` after a step (Program.updates)."""
    return f"{name}@NEW"


def moment(name: str, k: int) -> str:
    """The k-th moment accumulator of param `name` (Adam's exp_avg k=1, exp_avg_sq k=2;
    Paddle: ``fc1.weight_moment1_0``)."""
    return f"{name}@MOMENT{k}"


def max_moment(name: str, k: int) -> str:
    """The running maximum of the k-th moment of param `name` (AMSGrad's max_exp_avg_sq, k=2)."""
    return f"{name}@MAX_MOMENT{k}"


def velocity(name: str) -> str:
    """The momentum buffer of param `name` (Paddle: ``fc1.weight_velocity_0``)."""
    return f"{name}@VELOCITY"


def clipped(name: str) -> str:
    """Gradient `name` after clipping (e.g. by the global norm)."""
    return f"{name}@CLIP"


def reduced(name: str) -> str:
    """Gradient `name` after the data-parallel all-reduce (averaged over the workers)."""
    return f"{name}@REDUCED"


def fresh(base: str, taken: Container[str]) -> str:
    """`base`, or `base_1`, `base_2`, ... : the first not in `taken`."""
    if base not in taken:
        return base
    k = 1
    while f"{base}_{k}" in taken:
        k += 1
    return f"{base}_{k}"


# --- automatic mixed precision (passes/amp.py, fleet/steps.py) --------------------

_CAST_TAGS = {"float16": "FP16", "bfloat16": "BF16", "float32": "FP32", "float64": "FP64"}


def cast(name: str, dtype: str) -> str:
    """`name` cast to `dtype` by the AMP pass (Paddle: ``x.cast_fp16``): ``x@CAST_FP16``,
    ``x@CAST_BF16``, ``x@CAST_FP32``. One such var per (var, dtype): casts are shared."""
    return f"{name}@CAST_{_CAST_TAGS.get(dtype, dtype.upper())}"


def scaled(name: str) -> str:
    """The loss multiplied by the loss scale (the var the backward starts from)."""
    return f"{name}@SCALED"


def unscaled(name: str) -> str:
    """Gradient `name` divided by the loss scale (what the optimizer reads under AMP)."""
    return f"{name}@UNSCALED"


def master(name: str) -> str:
    """The float32 master copy of a low-precision param (AMP O2, ``use_pure_fp16``)."""
    return f"{name}@MASTER"


def loss_scaling() -> str:
    """The persistable loss scale (Fleet: ``loss_scaling_0``)."""
    return "loss_scaling"


def good_steps() -> str:
    """Persistable count of consecutive steps with finite grads (Fleet: ``num_good_steps_0``)."""
    return "num_good_steps"


def bad_steps() -> str:
    """Persistable count of consecutive steps with inf/nan grads (Fleet: ``num_bad_steps_0``)."""
    return "num_bad_steps"


def found_inf() -> str:
    """Whether any grad of this step is inf/nan (Fleet: ``find_infinite_scale``)."""
    return "found_inf"


def amp_device_ok() -> str:
    """What the AMP device check yields (an ONNX node needs an output): true, or it raised."""
    return "amp_device_ok"


# --- pipeline (passes/pipeline.py) -------------------------------------------------------


def stage_part(name: str, stage: int) -> str:
    """The part of grad `name` made in pipeline (virtual) stage `stage` (a tied param's)."""
    return f"{name}@STAGE{stage}"


def divided(const: str, m: int) -> str:
    """Constant `const` divided by `m` (the loss grad's seed of a mean over m micro-batches)."""
    return f"{const}@DIV{m}"


def micro_batch() -> str:
    """The int64 input the pipeline runtime feeds: which micro-batch of the step runs."""
    return "micro_batch@PIPELINE"


# --- gradient merge (passes/gradient_merge.py) ---------------------------------------------


def merge_step() -> str:
    """The persistable int64 run index within a gradient-merge window (0 .. k-1)."""
    return "gradient_merge_step"


# --- tensor parallel (passes/tensor_parallel.py) -------------------------------------------


def tp_copy(name: str) -> str:
    """Replicated `name` entering column-parallel layers through TPCopy (Megatron's f)."""
    return f"{name}@TP_COPY"


def tp_partial(name: str) -> str:
    """A row-parallel layer's partial product for its output `name`, before the all-reduce."""
    return f"{name}@TP_PARTIAL"


def tp_reduced(name: str) -> str:
    """A row-parallel layer's product summed over the model-parallel group (before its bias)."""
    return f"{name}@TP_REDUCED"


def tp_local(name: str) -> str:
    """Shape constant `name` rewritten for this model-parallel rank's slice (heads per rank)."""
    return f"{name}@TP_LOCAL"


# --- recompute partition (passes/recompute_partition.py) -------------------------------------


def mp_slice(name: str) -> str:
    """This model-parallel rank's 1/mp slice of replicated checkpoint `name`, held from the
    forward to its gather (Paddle's recompute partition)."""
    return f"{name}@MP_SLICE"


def mp_gathered(name: str) -> str:
    """Checkpoint `name` put back together from every model-parallel rank's slice, before its
    segment is recomputed."""
    return f"{name}@MP_GATHERED"


# --- ZeRO sharding (passes/sharding.py) -------------------------------------------------------


def zero_shard(name: str) -> str:
    """This worker's flat 1/N of param or grad `name` over the sharding group (what its
    sharded update reads)."""
    return f"{name}@SHARD"
