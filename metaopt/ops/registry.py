"""The op table: one row per op type holds everything metaopt knows about that op.

A row carries the forward kernel (torch), and the slots later capabilities fill in
(gradient rule, cost, whether a recompute may re-run it). Adding an op means adding
one `OpDef` via `register`; nothing else in metaopt switches on op types.

Kernel calling convention (what the executor does once per op, not per run):

    kernel(*inputs, **attrs) -> Tensor | tuple[Tensor | None, ...]

* ``inputs`` are torch tensors in ONNX input order; an omitted optional input
  (ONNX's empty name) arrives as ``None``.
* ``attrs`` are the op's attributes as plain Python values (int, float, str,
  lists, or a torch tensor for tensor attributes); kernels supply ONNX defaults.
* ``needs_outputs=True`` rows also get ``_nout`` (how many outputs the op
  declares), for variadic or optional outputs (Split, Dropout's mask, ...).
* kernels never write their inputs, except the pairs a row lists in ``inplace``.
* ``needs_device=True`` rows also get ``_device`` (the executor's torch.device),
  for ops that create tensors from nothing (ConstantOfShape, Range, random ops).
* ``needs_runtime=True`` rows also get ``_rt`` (the executor's `runtime.context.Runtime`:
  its copy engine and communicator, state that outlives one run) and ``_key`` (the op's
  first output name, else its first input: a name stable across runs, e.g. to reuse a
  buffer). Memcpy, CopyWait and the collectives are such rows.

Shape-like int64 tensors (what Shape, Concat of dims, ... produce) may be on the
CPU while data is on the device; kernels that read such a tensor call
``.tolist()`` on it rather than assuming a device.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

Kernel = Callable[..., Any]


@dataclass(frozen=True)
class OpDef:
    """One row of the op table."""

    type: str
    kernel: Kernel
    needs_outputs: bool = False
    needs_device: bool = False
    needs_runtime: bool = False
    random: bool = False  # consumes the RNG: recompute must replay its seed
    recomputable: bool = True
    # Inputs read only for their dtype (CastLike's target): constant folding
    # may evaluate the op while such an input is still a run-time value.
    meta_inputs: tuple[int, ...] = ()
    # Inputs read as host values (shapes, axes, ratios: `.tolist()` / `float()`), and
    # whether the outputs are host values (Shape, Size). On CUDA the executor keeps
    # such values on the CPU so reading them never synchronises the device.
    # A callable (op, program) -> positions says it per op (a scalar index read as a Python int,
    # a replayed random op's own host inputs): see `host_inputs`.
    host_inputs: tuple[int, ...] | Callable[[Any, Any], tuple[int, ...]] = ()
    host_outputs: bool = False
    # Our own ops saved to ONNX: the model-local function with their standard-ops body (a builder
    # returning one FunctionProto, or overloads), and which overload a node's inputs call
    # (ops/onnx_bodies.py); None: saved without one, runnable on our executor only.
    onnx_function: Callable[[], Any] | None = None
    onnx_overload: Callable[[list[str]], str] | None = None
    # ONNX ops whose semantics changed at an opset our kernel implements only the later side of
    min_opset: int = 0
    # Tensor parallel: how a value split along an axis passes through the op (an
    # ops/sharding.ShardRule, set beside its family's rules there); None: a split value cannot
    shard: Any = None
    # Sequence parallel's part for the op (passes/sequence_parallel.py; set in ops/sharding.py):
    # "reduce" (a row-parallel layer's all-reduce sum: it becomes a reduce-scatter), "copy" (a
    # column layer's TPCopy: a gather with a reduce-scatter backward replaces it), "bias" (an Add
    # after the sum: added to the chunk after the reduce-scatter), "sliced_draw" (a random op that
    # draws one process's mask for a sequence chunk: Dropout's slice_axis), "gather" (SPGather: the
    # backward gathers again instead of holding its output, passes/sequence_regather.py), "remake"
    # (Cast: cheap enough that the backward re-makes it from a re-gathered value too, as AMP casts a
    # column layer's gathered input). None: none.
    sequence: str | None = None
    # Segment parallel (passes/segment_parallel.py; set in ops/sharding.py): how a value split along
    # its tokens passes through the op where the `shard` rule does not say (a Linear's rows, an
    # embedding lookup, attention exchanged around); None: the `shard` rule is asked.
    tokens: Any = None
    # (output index, input index) pairs: the kernel writes that output into that
    # input's storage and returns it (optimizer updates, like torch.optim's in-place
    # steps: a fresh copy of a large param costs page faults every step). The plan
    # refuses such an op unless that input, and everything sharing its storage, is
    # read by nothing afterwards and is neither a feed nor a constant (see
    # runtime/plan.py); every other kernel must leave its inputs untouched.
    inplace: tuple[tuple[int, int], ...] = ()
    # The op can leave its collective in flight (attr ``overlap=1``): its outputs hold their values
    # only after an op of this type reads them all (passes/overlap_comm.py puts it before their first
    # reader, so the ops in between overlap the communication). That op finishes them in place (the
    # average's division): the one kernel that writes inputs, which nothing has read yet.
    wait_op: str | None = None
    # Left in flight, the op holds what it sends until the wait (a reduce-scatter's rows of the
    # bucket's grads): given (op, the program's vars), that buffer's shape. ``overlap=1`` makes the
    # kernel return it as one more output, which the pass declares and the wait frees (so the
    # executor and the memory estimate count it), and the pass waits for the op before the next
    # collective starts (one in flight). None: the op holds nothing beyond its outputs.
    staged_shape: Callable[[Any, Any], tuple[int, ...]] | None = field(default=None, compare=False)
    # The op writes its inputs in place and has no outputs: startup ops only (Broadcast of the
    # initial params), which the executor runs once, before the program's first run (ir/roles.py).
    writes_inputs: bool = False
    # Floating-point operations of one run of the op, given (program, op, dims binding symbolic
    # dims): set for the matmul-class ops (ops/costs.py), whose time a roofline takes from them;
    # None: the op's time is the bytes it moves.
    flops: Callable[[Any, Any, dict], float] | None = field(default=None, compare=False)
    # A collective whose largest tensor is not what it sends (ops/costs.py sets it): (op, nbytes:
    # name -> bytes) -> the bytes it sends, for `comm_bytes`; None: its largest input or output.
    sends: Callable[[Any, Any], float] | None = field(default=None, compare=False)
    # An additive bias input that may be dropped when it is a constant of zeros (torch
    # exports bias-free convs with a zero bias: adding it, and its grad, is wasted work).
    zero_bias_input: int | None = None
    # Every output is new storage (never a view of an input): a grad made by such an
    # op may be accumulated into in place (GradAccumulate) once nothing else reads it.
    fresh_outputs: bool = False
    # Which outputs may share storage with which inputs: (output, input) index pairs where
    # the output may be that input or a view of it (Reshape, Transpose, Identity, Dropout
    # when off, Cast to the same dtype ...); output index ALL stands for every output
    # (Split). A callable gets the op and returns the pairs, for rows whose aliasing depends
    # on attrs (Vjp: its grads may be the incoming output grads, never its forward inputs).
    # The executor's in-place check follows exactly these links (a false one refuses a
    # valid program, a missing one lets an update corrupt a value still to be read), and
    # METAOPT_CHECK_ALIASES=1 makes every run check them against the storage kernels return.
    aliases: tuple[tuple[int, int], ...] | Callable[[Any], Iterable[tuple[int, int]]] = ()
    # An in-place form for when an input dies at the op (ops/reuse.py decides, once per plan):
    # (the inputs output 0 may be written into, kernel(j) -> the kernel that writes output 0 into
    # input j's storage and returns it). Same values bit for bit, fewer allocations: relu's and the
    # residual add's, which eager code writes in place by hand.
    reuse: tuple[tuple[int, ...], Callable[[int], Kernel]] | None = field(default=None, compare=False)
    # The op another op runs, given this one (RngReplay: the random op it replays, with its own
    # inputs and attrs): memory estimates learn its outputs' layouts from that op's kernel.
    inner: Callable[[Any], Any] | None = field(default=None, compare=False)
    # Outputs are views of input 0 (no new storage): memory estimates count them as free.
    view: bool = False
    # Outputs are views of input 0 only when this holds, given (op, its input shapes): Gather
    # with a scalar index (a `select` on the CPU). Memory estimates ask it where `view` is False.
    view_if: Callable[[Any, list], bool] | None = field(default=None, compare=False)
    # Bytes the kernel holds while it runs besides its inputs and outputs, given (attrs, input
    # shapes with dims bound, input dtypes): the chunk of a chunked op (LinearCrossEntropy's
    # logits). Memory estimates add it at the op; None: nothing worth counting.
    workspace: Callable[[dict, list, list], int] | None = field(default=None, compare=False)
    # Whether the op's outputs live in host memory, given its attrs (Memcpy to pinned
    # memory): the executor counts them in the host account, not the device's.
    host_memory: Callable[[dict], bool] | None = field(default=None, compare=False)
    # Outputs recompute holds from the forward instead of re-running the op for them: statistics
    # a few bytes per channel (BatchNorm's saved mean and inverse std). When the backward needs
    # only those of an op (a residual block's last BatchNorm: its output feeds the add, whose
    # grad reads nothing), the op is not re-run at all; the values are the forward's own bits.
    recompute_holds: tuple[int, ...] = ()
    # Matmul-class work (MatMul, Gemm, Conv, Linear ...): the selective recompute policy
    # keeps these outputs and recomputes only the cheap ops around them (Megatron-style).
    expensive: bool = False
    # The op takes ``memory_format="channels_last"`` (passes/channels_last.py marks it) when its
    # input at this index has 4 dims: Conv, by its weight (a 2-D convolution). None: it does not.
    channels_last: int | None = None
    # Automatic mixed precision (passes/amp.py): "white" runs in the low dtype (matmul-class
    # work), "black" in float32 (numerically sensitive), "gray" follows its inputs. The user's
    # custom_white_list / custom_black_list override this per run.
    amp: str = "gray"
    # Inputs and outputs that stay float32 when the op runs in low precision (norm statistics:
    # scale, bias, running stats, saved mean and inverse std).
    amp_float32_inputs: tuple[int, ...] = ()
    amp_float32_outputs: tuple[int, ...] = ()
    # The op sets its output dtype itself (Cast, CastLike): its inputs may be of any dtype, and
    # AMP leaves it alone.
    sets_dtype: bool = False
    # A param update op (SGDUpdate, AdamUpdate ...): inputs (param, grad, lr, ...), outputs
    # (new param, *new state); `origin` names the param.
    update: bool = False
    # An update whose every output element depends only on the same element of its param, grad
    # and state inputs (and on scalars): ZeRO sharding (passes/sharding.py) may run it on flat
    # slices. False for updates that read a whole tensor (LAMB's and LARS's trust ratios).
    sliceable: bool = False
    # The op's `mask` attr says which of its outputs it computes, each the same whatever else
    # is computed: a zero-bubble pipeline splits it into the input grads (B) and the weight
    # grads (W), passes/split_weight_grads.py.
    masks_outputs: bool = False
    # An update-phase op that reads every grad whole (global-norm clipping), named by the op type
    # that does the same on each worker's 1/N slices plus one all-reduce over the sharding group:
    # ZeRO swaps it in where the grads are slices (passes/sharding.py). None: refused there.
    sharded_form: str | None = None
    # An optimize op whose persistable outputs are made only from update ops' outputs (ZeRO's
    # ShardGather of the updated slices): on a step AMP skips, those updates keep their old values,
    # so this op writes them back unchanged and needs no found_inf input of its own.
    state_from_updates: bool = False
    # The input index of the optional ``found_inf`` scalar that makes the op skip its step
    # (AMP's dynamic loss scaling): every update op and the step counter have one.
    skip_input: int | None = None
    # A collective over workers (runtime's communicator); its attr ``ranks``, when set, names
    # the workers taking part (pipeline workers holding copies of the tied param `origin`).
    collective: bool = False
    # Shape-value propagation (passes/fold_constants.py): the op's output as a shape value
    # (dims, is_scalar), dims ints or symbols such as "batch", from a `ShapeArgs`; None when
    # not known. Lets the exporter's Shape -> Gather/Slice/Concat chains fold once the dims they
    # pick are static.
    shape_value: Callable[[ShapeArgs], tuple[list, bool] | None] | None = field(default=None, compare=False)
    # The op's shape input (input 1: Reshape's shape, Expand's) as a constant, given the op's
    # attrs, its inferred output shape and input 0's shape: (target, attrs to set) or None.
    # fold_constants puts it in place of a run-time computed target.
    static_target: Callable[[dict, tuple, tuple | None], tuple[list[int], dict] | None] | None = field(
        default=None, compare=False
    )
    # Fold this op and neighbours into one op (passes/fuse.py applies every row's rule; MatMul:
    # torch's exported Linear; Tanh / Erf: the GELU chains): (program, op index, producers,
    # consumers) -> (indices of the other ops it absorbs, the op replacing this one) or None.
    fuse: Callable[..., tuple[list[int], Any] | None] | None = field(default=None, compare=False)
    # The import-time repair the op needs when its module is exported in train mode (torch's
    # exporter loses training semantics; frontend/repair.py): "training_mode_input" (Dropout:
    # its training_mode input set true) or "batch_norm_training" (-> BatchNormTraining).
    train_repair: str | None = None
    # The op's inference form (Program.clone(for_test=True), passes/for_test.py): op -> the op that
    # replaces it in an eval program (Dropout: Identity; batch norm on its running stats), or None
    # to drop it. None here: the op runs in an eval program as it is.
    for_test: Callable[[Any], Any] | None = field(default=None, compare=False)
    # The output's size in bytes from (attrs, input values) before the kernel runs, for kernels
    # whose allocations torch's meta device cannot see (numpy tables): constant folding sizes an
    # untrusted file's ops with it (passes/fold_constants.py). None: sized on the meta device.
    output_bytes: Callable[[dict, list], int | None] | None = field(default=None, compare=False)
    # (rows, expert weight [E, ...], offsets [E]) input positions of an op running each expert's
    # weight on its run of rows sorted by expert (GroupedMatMul): expert parallel cuts the weight
    # to a worker's experts and sends the rows to their owners (passes/expert_parallel.py).
    expert_inputs: tuple[int, int, int] | None = None
    # The output (by index) that is offsets [E] of equal runs, every expert the same rows
    # (CapacityRoute's slots: C each): an expert-parallel worker then receives exactly the rows it
    # sends, so its shapes are exact where routed rows otherwise take their bound.
    equal_runs: int | None = None
    # The gradient rule (ops/grads.py attaches it); None: torch.autograd's vjp of the kernel.
    grad: Callable[..., Any] | None = None
    # Estimated forward work of one op, (program, op) -> float in byte-equivalents (`op_cost`
    # gives the default), what the pipeline balancer sums per stage; None: the default.
    cost: Callable[..., Any] | None = field(default=None, compare=False)
    # The row's multi-tensor form (torch.optim's foreach): a run of consecutive ops of this type
    # with equal attrs and the same inputs at `host_inputs` (the learning rate, the step,
    # found_inf) is run as one call, ``multi(list of per-op input tuples, **attrs) -> list of
    # per-op output tuples``, with the per-op kernel's results (runtime/plan.py groups them).
    multi: Callable[..., list] | None = field(default=None, compare=False)
    domain: str = ""  # "" = the ONNX default domain; ours use "metaopt"
    notes: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.amp not in AMP_CLASSES:
            raise ValueError(f"op {self.type}: amp must be one of {AMP_CLASSES}, got {self.amp!r}")
        if self.update and self.skip_input is None:
            raise ValueError(f"op {self.type}: an update op needs a skip_input (its found_inf input)")
        if self.writes_inputs and self.inplace:
            raise ValueError(f"op {self.type}: writes_inputs (no outputs) excludes inplace pairs")
        if self.train_repair not in TRAIN_REPAIRS:
            raise ValueError(f"op {self.type}: train_repair must be one of {TRAIN_REPAIRS}")


AMP_CLASSES = ("white", "black", "gray")
TRAIN_REPAIRS = (None, "training_mode_input", "batch_norm_training")


@dataclass(frozen=True)
class ShapeArgs:
    """What a row's `shape_value` rule sees of its op (passes/fold_constants.py makes it)."""

    attrs: dict
    # Per input: its value as a shape value (dims, is_scalar) when known (tracked so far, or an
    # int64 constant of rank <= 1), else None.
    values: list
    # Per input: the shape value tracked so far (it has symbolic dims: not a constant), else None.
    tracked: list
    # Per input: its var's inferred shape (None: unknown or an omitted input).
    shapes: list


_TABLE: dict[str, OpDef] = {}

ALL = -1  # in `aliases`: every output
SAME = ((0, 0),)  # output 0 may be input 0 or a view of it


def LONE_INPUT(op: Any) -> tuple[tuple[int, int], ...]:  # noqa: N802 (a constant-like row value)
    """Variadic Sum/Max/Min/Mean: with one input, torch hands that input back. Einsum too: with
    one operand it may return a view ("ij->ji"); with several it computes a product into a fresh
    tensor. Declare no more than a kernel can do: alias analysis joins every input an output
    may alias into one class, so "output 0 may alias input 0 or 1" would make the two inputs
    (say two layers' params fed one shared tensor) one storage, and refuse updating either."""
    return ((0, 0),) if len(op.inputs) == 1 else ()


def alias_pairs(op: Any) -> list[tuple[int, int]] | None:
    """(output, input) index pairs of `op` that may share storage, ALL expanded; None when the
    op type has no row (then anything may alias anything)."""
    row = get(op.type)
    if row is None:
        return None
    pairs = row.aliases(op) if callable(row.aliases) else row.aliases
    out: list[tuple[int, int]] = []
    for k, j in pairs:
        out += [(kk, j) for kk in range(len(op.outputs))] if k == ALL else [(k, j)]
    return out


def host_inputs(op: Any, program: Any) -> tuple[int, ...]:
    """The positions where `op` reads its inputs as host values (its row's `host_inputs`,
    resolved for this op of `program`); () when the op type has no row."""
    row = get(op.type)
    if row is None:
        return ()
    return tuple(row.host_inputs(op, program)) if callable(row.host_inputs) else row.host_inputs


def skip_input(op_type: str) -> int | None:
    """The index of the op's optional ``found_inf`` input (skip the step when true), or None."""
    row = get(op_type)
    return row.skip_input if row is not None else None


def is_update(op_type: str) -> bool:
    """Is `op_type` a param update op (its row's `update`)?"""
    row = get(op_type)
    return row is not None and row.update


def amp_types(amp_class: str) -> frozenset[str]:
    """The op types whose row has AMP class `amp_class` ("white", "black" or "gray")."""
    if amp_class not in AMP_CLASSES:
        raise ValueError(f"amp class must be one of {AMP_CLASSES}, got {amp_class!r}")
    return frozenset(t for t, row in table().items() if row.amp == amp_class)


def op_cost(program: Any, op: Any) -> float:
    """Estimated forward work of `op` for balancing pipeline stages (batch dims bound to 1):
    the row's `cost` rule where it has one; else twice the bytes of the params it reads (a
    matmul-class op's work grows with its weights) plus the bytes it produces (elementwise work
    grows with its output), and nothing for a view (it moves no bytes)."""
    row = get(op.type)
    if row is not None and row.cost is not None:
        return float(row.cost(program, op))
    if row is not None and row.view:
        return 0.0
    one = {"batch": 1}
    params = sum(program.vars[x].nbytes(one) or 0 for x in op.inputs if x and program.vars[x].kind == "param")
    out = sum(program.vars[o].nbytes(one) or 0 for o in op.outputs if o and o in program.vars)
    return 2.0 * params + out


def register(type: str, **row: Any) -> Callable[[Kernel], Kernel]:
    """Decorator: ``@register("Relu")`` above the kernel adds the op's row."""

    def deco(fn: Kernel) -> Kernel:
        if type in _TABLE:
            raise ValueError(f"op type {type!r} is registered twice")
        _TABLE[type] = OpDef(type=type, kernel=fn, **row)
        return fn

    return deco


def register_collective(type: str, **row: Any) -> Callable[[Kernel], Kernel]:
    """`register` for a collective over workers: every one is our own op, run through the
    runtime's communicator, so those three fields are set here once rather than per row."""
    return register(type, domain="metaopt", needs_runtime=True, collective=True, **row)


def extend(type: str, **fields: Any) -> OpDef:
    """Set `fields` of `type`'s existing row: knowledge written beside its own family rather than
    beside the kernel (ops/grads.py's gradient rules). A field the row already holds a value for
    is refused: two places must never both decide it."""
    _ensure_loaded()  # the kernels' rows first, whichever module is imported first
    row = _TABLE.get(type)
    if row is None:
        raise ValueError(f"no row for op type {type!r} to extend with {sorted(fields)}")
    default = OpDef(type=type, kernel=row.kernel)
    taken = [k for k in fields if getattr(row, k) != getattr(default, k)]
    if taken:
        raise ValueError(f"op type {type!r}: its row already sets {taken}")
    _TABLE[type] = dataclasses.replace(row, **fields)
    return _TABLE[type]


def get(type: str) -> OpDef | None:
    _ensure_loaded()
    return _TABLE.get(type)


def table() -> dict[str, OpDef]:
    """All rows, keyed by op type (read-only use)."""
    _ensure_loaded()
    return dict(_TABLE)


_loaded = False


def _ensure_loaded() -> None:
    # Kernel modules register on import; importing them lazily keeps
    # `metaopt.ops.registry` importable from anywhere without cycles.
    global _loaded
    if not _loaded:
        _loaded = True
        # kernels first: grads attaches its rules to the rows the kernels made.
        importlib.import_module("metaopt.ops.kernels")
        importlib.import_module("metaopt.ops.grads")
        importlib.import_module("metaopt.ops.sharding")
        importlib.import_module("metaopt.ops.costs")
