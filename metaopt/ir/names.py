"""The one place derived var names are made.

Derived names follow Fleet's spelling so goldens read like Fleet's logs, but no
code ever reads meaning back out of a name: an op's role and origin fields say
what it is. Passes call these functions and `fresh` instead of formatting names.
"""

from __future__ import annotations

from collections.abc import Callable, Container


# Most derived names are `name` with an ``@TAG`` after it: one maker per tag, so the spelling
# rule lives here once and each name below is a row (its tag, what the var is).
def _tagged(tag: str, doc: str) -> Callable[[str], str]:
    def derived(name: str) -> str:
        return f"{name}@{tag}"

    derived.__doc__ = doc
    return derived


def _numbered(tag: str, doc: str) -> Callable[[str, int], str]:
    """As `_tagged`, for the names that carry an index after the tag (``w@MOMENT1``)."""

    def derived(name: str, k: int) -> str:
        return f"{name}@{tag}{k}"

    derived.__doc__ = doc
    return derived


def _fixed(spelling: str, doc: str) -> Callable[[], str]:
    """A name that is one var per program (the loss scale, the step index): no `name` to derive from."""

    def fixed() -> str:
        return spelling

    fixed.__doc__ = doc
    return fixed


grad = _tagged("GRAD", "Gradient of `name` (Fleet: ``x@GRAD``).")
grad_part = _numbered(
    "GRAD@",
    "The k-th gradient contribution to `name`, before they are summed into `grad(name)`.",
)
grad_temp = _tagged(
    "GRAD@TMP",
    "An intermediate of the gradient computed for forward var `name` (fresh() numbers it).",
)
grad_const = _fixed(
    "grad_const",
    "A constant the backward needs (1.0 for the loss grad, reduction axes ...).",
)


def saved(name: str, what: str) -> str:
    """An extra forward output the backward reads (``drop@MASK``, ``ln@RSTD``)."""
    return f"{name}@{what}"


recompute = _tagged("RECOMPUTE", "The recomputed copy of activation `name`.")
pinned = _tagged("PINNED", "Host (pinned memory) copy of an offloaded checkpoint.")
fetch = _tagged("FETCH", "Device copy fetched back from the host for the backward.")
merged = _tagged("MERGED", "Accumulator of `name` across micro-batches.")
new_state = _tagged("NEW", "The value that replaces persistable `name` after a step (Program.updates).")
moment = _numbered(
    "MOMENT",
    """The k-th moment accumulator of param `name` (Adam's exp_avg k=1, exp_avg_sq k=2;
    Paddle: ``fc1.weight_moment1_0``).""",
)
max_moment = _numbered(
    "MAX_MOMENT",
    "The running maximum of the k-th moment of param `name` (AMSGrad's max_exp_avg_sq, k=2).",
)
velocity = _tagged("VELOCITY", "The momentum buffer of param `name` (Paddle: ``fc1.weight_velocity_0``).")
clipped = _tagged("CLIP", "Gradient `name` after clipping (e.g. by the global norm).")
reduced = _tagged(
    "REDUCED",
    "Gradient `name` after the data-parallel all-reduce (averaged over the workers).",
)


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


scaled = _tagged("SCALED", "The loss multiplied by the loss scale (the var the backward starts from).")
unscaled = _tagged(
    "UNSCALED",
    "Gradient `name` divided by the loss scale (what the optimizer reads under AMP).",
)
master = _tagged("MASTER", "The float32 master copy of a low-precision param (AMP O2, ``use_pure_fp16``).")
loss_scaling = _fixed("loss_scaling", "The persistable loss scale (Fleet: ``loss_scaling_0``).")
good_steps = _fixed(
    "num_good_steps",
    "Persistable count of consecutive steps with finite grads (Fleet: ``num_good_steps_0``).",
)
bad_steps = _fixed(
    "num_bad_steps",
    "Persistable count of consecutive steps with inf/nan grads (Fleet: ``num_bad_steps_0``).",
)
found_inf = _fixed("found_inf", "Whether any grad of this step is inf/nan (Fleet: ``find_infinite_scale``).")
amp_device_ok = _fixed(
    "amp_device_ok",
    "What the AMP device check yields (an ONNX node needs an output): true, or it raised.",
)


# --- pipeline (passes/pipeline.py) -------------------------------------------------------


stage_part = _numbered(
    "STAGE",
    "The part of grad `name` made in pipeline (virtual) stage `stage` (a tied param's).",
)


def divided(const: str, m: int) -> str:
    """Constant `const` divided by `m` (the loss grad's seed of a mean over m micro-batches)."""
    return f"{const}@DIV{m}"


micro_batch = _fixed(
    "micro_batch@PIPELINE",
    "The int64 input the pipeline runtime feeds: which micro-batch of the step runs.",
)


# --- gradient merge (passes/gradient_merge.py) ---------------------------------------------


merge_step = _fixed(
    "gradient_merge_step",
    "The persistable int64 run index within a gradient-merge window (0 .. k-1).",
)


# --- tensor parallel (passes/tensor_parallel.py) -------------------------------------------


tp_copy = _tagged(
    "TP_COPY",
    "Replicated `name` entering column-parallel layers through TPCopy (Megatron's f).",
)
tp_partial = _tagged(
    "TP_PARTIAL",
    "A row-parallel layer's partial product for its output `name`, before the all-reduce.",
)
tp_reduced = _tagged(
    "TP_REDUCED",
    "A row-parallel layer's product summed over the model-parallel group (before its bias).",
)
tp_local = _tagged(
    "TP_LOCAL",
    "Shape constant `name` rewritten for this model-parallel rank's slice (heads per rank).",
)


# --- sequence parallel (passes/sequence_parallel.py) -----------------------------------------


sp_scattered = _tagged(
    "SP_SCATTER",
    "This model-parallel rank's chunk of replicated `name` along the sequence (SPScatter).",
)
sp_gathered = _tagged(
    "SP_GATHER",
    "Sequence-split `name` all-gathered whole, for the ops that read all of it (SPGather).",
)


# --- segment parallel (passes/segment_parallel.py) -------------------------------------------


sep_heads = _tagged(
    "SEP_HEADS",
    "`name` exchanged by SepAllToAll: whole sequences over this sep rank's 1/degree of the heads.",
)
sep_summed = _tagged(
    "SEP_SUM",
    "The loss `name` as a sum over this sep rank's tokens (its cross-entropy's reduction, made sum).",
)
sep_partial = _tagged(
    "SEP_PARTIAL",
    "This sep rank's share of the loss `name`: its tokens' sum over the whole batch's count.",
)
sep_ignore_index = _tagged(
    "SEP_IGNORE_INDEX",
    "The ignore_index the whole labels `name` are compared with, to count the tokens the loss averages.",
)
sep_ignored = _tagged("SEP_IGNORED", "Whether each of the whole labels `name` is ignore_index.")
sep_counted = _tagged("SEP_COUNTED", "Whether each of the whole labels `name` counts in the loss's mean.")
sep_flags = _tagged("SEP_FLAGS", "The whole labels `name` that count in the loss's mean, as 1.0 and 0.0.")
sep_count = _tagged("SEP_COUNT", "How many of the whole labels `name` the loss's mean divides by.")
sep_feeds_checked = _fixed(
    "feeds@SEP_AGREE", "Set once every rank of the sep group was found fed the same batch (FeedsAgree)."
)


# --- expert parallel (passes/expert_parallel.py) ---------------------------------------------


ep_layout = _tagged(
    "EP_LAYOUT",
    "The row counts per (worker, local expert) of MoE layer `name` (its offsets), traded by ExpertRoute.",
)
ep_offsets = _tagged(
    "EP_OFFSETS",
    "This worker's experts' cumulative row counts of MoE layer `name` (its offsets), after ExpertRoute.",
)
ep_summed = _tagged(
    "EP_SUM",
    "Expert grad `name` summed over the workers holding the same experts, before its division.",
)
ep_grad_scale = _fixed(
    "ep_grad_scale",
    "1 / the data-parallel world size: what expert grads are multiplied by after their sum.",
)
ep_dispatched = _tagged(
    "EP_DISPATCH",
    "Rows of `name` sent to the workers holding their experts (ExpertExchange).",
)
ep_combined = _tagged(
    "EP_COMBINE",
    "Expert-local rows of `name` sent back to the workers that routed them (ExpertExchange reverse=1).",
)


# --- expert capacity (passes/expert_capacity.py) ---------------------------------------------


capacity_layout = _tagged(
    "CAP_LAYOUT", "Row counts and capacity of MoE layer `name` (its offsets), CapacityRoute's."
)
capacity_offsets = _tagged("CAP_OFFSETS", "The fixed slots' offsets of MoE layer `name` (its offsets).")
capacity_dropped = _tagged("CAP_DROPPED", "Rows MoE layer `name` (its offsets) dropped this step.")
capacity_packed = _tagged("CAP_PACK", "Rows of `name` in their experts' fixed slots (CapacityPack).")
capacity_unpacked = _tagged("CAP_UNPACK", "Slotted rows of `name` back in sorted order (CapacityUnpack).")
moe_dropped_tokens = _fixed(
    "moe_dropped_tokens",
    "Token-expert rows every MoE layer dropped this step at its capacity (a program output: fetch it).",
)


# --- recompute partition (passes/recompute_partition.py) -------------------------------------


mp_slice = _tagged(
    "MP_SLICE",
    """This model-parallel rank's 1/mp slice of replicated checkpoint `name`, held from the
    forward to its gather (Paddle's recompute partition).""",
)
mp_gathered = _tagged(
    "MP_GATHERED",
    """Checkpoint `name` put back together from every model-parallel rank's slice, before its
    segment is recomputed.""",
)


# --- ZeRO sharding (passes/sharding.py) -------------------------------------------------------


zero_shard = _tagged(
    "SHARD",
    "This worker's flat 1/N of param or grad `name` over the sharding group (what its sharded update reads).",
)
zero_staged = _tagged(
    "STAGED",
    "The rows a reduce-scatter left in flight sends, bucket grad `name` first (freed at its wait).",
)
zero_gathered = _tagged(
    "GATHERED",
    "ZeRO stage 3: param `name` all-gathered whole from every worker's slice for the forward's reads.",
)
zero_regathered = _tagged(
    "GATHERED@BWD",
    """ZeRO stage 3: param `name` all-gathered again for the backward's (and recompute's) reads, the
    forward's copy having been freed after its last forward read.""",
)


# --- local SGD (passes/local_sgd.py) -----------------------------------------------------------


localsgd = _tagged("LOCALSGD", "Param `name` after local SGD's average (or kept, off the averaging steps).")
localsgd_last_step = _fixed("localsgd_last_step", "The persistable step of local SGD's last average.")
