"""metaopt's IR: Var, Op, Program.

One block, SSA (one producer per name), ops in semantic order. Meaning lives in
fields (kind, role, stage, scope, origin), never in names. Persistable values
(params, buffers, optimizer state, constants) have their initial tensors in
`Program.values`; the executor copies them into its scope on first use.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import difflib
import hashlib
import itertools
import math
import operator
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch

from metaopt.ir import roles as _roles
from metaopt.ir.gc_pause import without_gc

Dim = int | str  # a str is a symbolic dim such as "batch"
Shape = tuple[Dim, ...]

VAR_KINDS = ("input", "param", "buffer", "activation", "grad", "opt_state", "constant")
# The kinds of device a var may be made on alone (`Var.device`): "cpu", or "cuda" for every
# accelerator (the meta device of `Executor("meta")` stands in for one, and takes its kernels).
DEVICE_FORMS = ("cpu", "cuda")


# The form a kernel takes on the meta device: CUDA's (meta stands in for a GPU: the meta executor,
# torch's shape propagation), or the CPU's while memory_layout replays a CPU program's layouts.
_META_FORM: ContextVar[str] = ContextVar("metaopt_meta_form", default="cuda")


def device_form(device: torch.device | str) -> str:
    """The `DEVICE_FORMS` entry a device runs: "cpu" on the CPU, else "cuda" (the meta device:
    the form `meta_stands_for` sets, CUDA's by default)."""
    kind = device if isinstance(device, str) else device.type
    if kind == "meta":
        return _META_FORM.get()
    return "cpu" if kind == "cpu" else "cuda"


@contextlib.contextmanager
def meta_stands_for(form: str) -> Iterator[None]:
    """Kernels run on the meta device take `form`'s path ("cpu" or "cuda") inside the block."""
    if form not in DEVICE_FORMS:
        raise ValueError(f"meta_stands_for: {form!r} is not one of DEVICE_FORMS {DEVICE_FORMS}")
    token = _META_FORM.set(form)
    try:
        yield
    finally:
        _META_FORM.reset(token)


_KIND_ORDER = {"input": 0, "param": 1, "buffer": 2, "opt_state": 3, "constant": 4}
PERSISTABLE_KINDS = frozenset({"param", "buffer", "opt_state", "constant"})
# The role table (and when each role runs in a pipelined step) is metaopt.ir.roles; these two
# names stay importable from here.
ROLES = _roles.ROLES
PHASE_OF_ROLE = _roles.PHASE_OF_ROLE

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "uint16": torch.uint16,
    "int32": torch.int32,
    "uint32": torch.uint32,
    "int64": torch.int64,
    "uint64": torch.uint64,
    "bool": torch.bool,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES[dtype]


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(_DTYPES)}") from None


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """' (did you mean 'x'?)' or '' — appended to errors about unknown names."""
    # The word itself is never a suggestion: when it is among the choices, the caller refused
    # it for another reason and must say so (suggesting it back reads as nonsense).
    choices = list(dict.fromkeys(c for c in choices if c != word))  # a var and a module may share a name
    close = [c for c in choices if c.lower() == word.lower()]
    close += [c for c in difflib.get_close_matches(word, choices, n=3, cutoff=0.6) if c not in close]
    if not close:
        return ""
    return " (did you mean " + " or ".join(repr(c) for c in close) + "?)"


_UIDS = itertools.count()

_DIM_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Div: operator.floordiv,
    ast.Mod: operator.mod,
}


def eval_dim(dim: Dim, dims: dict[str, int]) -> int | None:
    """A dim's value: an int, a symbol bound in `dims`, or an expression the
    exporter wrote ("4*batch", "batch - 1"); None when it cannot be known."""
    if isinstance(dim, int):
        return dim
    if dim in dims:
        return dims[dim]
    try:
        tree = ast.parse(dim, mode="eval").body
    except SyntaxError:
        return None
    return _eval_node(tree, dims)


def _eval_node(node: ast.AST, dims: dict[str, int]) -> int | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.Name):
        return dims.get(node.id)
    if isinstance(node, ast.BinOp) and type(node.op) in _DIM_OPS:
        a, b = _eval_node(node.left, dims), _eval_node(node.right, dims)
        if a is None or b is None or (b == 0 and not isinstance(node.op, (ast.Add, ast.Sub, ast.Mult))):
            return None
        return _DIM_OPS[type(node.op)](a, b)
    return None


SPLIT_GROUPS = ("model", "expert")


@dataclass(frozen=True)
class Split:
    """A var that holds one worker's part of a larger tensor (tensor parallel's split params
    and the optimizer state made from them): along `axis`, each of the `parts` workers of the
    model-parallel group holds 1/parts of every block of `blocks` (the blocks' FULL sizes, in
    order; they sum to the full dim), the pieces concatenated in block order.

    One block is a plain contiguous slice (a column-parallel c_fc's rows); several are a fused
    projection (GPT-2's c_attn [3H, H] cut as q, k, v: a worker holds its 1/parts of each, which
    is no contiguous chunk of the full tensor). The var's own shape is the local one; the full
    shape is `full_shape(var.shape)`. Which part a worker holds is its index in its
    model-parallel group: deliberately not recorded here, so that every worker's printed
    program reads the same (they are compared at minimize)."""

    axis: int
    parts: int
    blocks: tuple[int, ...]
    # The hybrid axis whose index says which part a worker holds: "model" (tensor parallel) or
    # "expert" (expert parallel's experts, passes/expert_parallel.py).
    group: str = "model"

    def full_shape(self, local: Shape) -> Shape:
        return tuple(d * self.parts if i == self.axis else d for i, d in enumerate(local))

    def local_shape(self, full: Shape) -> Shape:
        return tuple(d // self.parts if i == self.axis else d for i, d in enumerate(full))

    def require_model(self) -> None:
        """Checkpoints and pretrained files place a part by the worker's index in its
        model-parallel group: a split over another group (expert parallel's experts) is refused
        until they learn that group's index."""
        if self.group != "model":
            raise NotImplementedError(
                f"a param split over the {self.group!r} group (expert parallel) in a checkpoint or "
                "pretrained file: not saved, loaded or read yet"
            )

    def pieces(self, index: int) -> list[tuple[int, int, int]]:
        """(offset in the full tensor, offset in the local one, length) along `axis` of each
        block's piece that part `index` holds, in block order."""
        out, full_at, local_at = [], 0, 0
        for b in self.blocks:
            n = b // self.parts
            out.append((full_at + index * n, local_at, n))
            full_at += b
            local_at += n
        return out

    def check(self, var: str, shape: Shape | None) -> None:
        """Raise naming `var` unless this layout fits its (local) `shape`."""
        ok = (
            isinstance(self.axis, int)
            and isinstance(self.parts, int)
            and self.parts >= 1
            and bool(self.blocks)
            and all(isinstance(b, int) and b > 0 and b % self.parts == 0 for b in self.blocks)
            and self.group in SPLIT_GROUPS
            and shape is not None
            and 0 <= self.axis < len(shape)
            and shape[self.axis] == sum(self.blocks) // self.parts
        )
        if not ok:
            where = list(shape) if shape is not None else "?"
            raise ValueError(
                f"var {var!r}: its layout {self} does not fit its shape {where} "
                "(the axis must be one of its dims, and the blocks, each divisible by parts, must sum to "
                "parts x that dim)"
            )

    def __str__(self) -> str:
        group = "" if self.group == "model" else f', group="{self.group}"'
        return f"split(axis={self.axis}, parts={self.parts}, blocks={list(self.blocks)}{group})"


@dataclass(frozen=True)
class ZeroShard:
    """A var that holds one worker's 1/`parts` of a tensor of shape `full`, flattened (ZeRO's
    sharded optimizer state, grads and params: passes/sharding.py): the flat tensor is padded
    with zeros to `parts` x `local_numel` elements and part i is elements [i*k, (i+1)*k). The
    var's own shape is ``[local_numel]``. As for `Split`, which part a worker holds is its index
    in its sharding group, not recorded here, so every worker's program reads the same."""

    parts: int
    full: tuple[int, ...]

    @property
    def full_numel(self) -> int:
        return math.prod(self.full)

    @property
    def local_numel(self) -> int:
        return -(-self.full_numel // self.parts)

    def piece(self, index: int) -> tuple[int, int]:
        """(offset, length) in the flattened full tensor of the elements part `index` holds,
        the padding left out (the last parts may hold fewer, or none)."""
        start = min(index * self.local_numel, self.full_numel)
        return start, min(self.local_numel, self.full_numel - start)

    def check(self, var: str, shape: Shape | None) -> None:
        ok = (
            isinstance(self.parts, int)
            and self.parts >= 1
            and all(isinstance(d, int) and d >= 0 for d in self.full)
            and shape is not None
            and tuple(shape) == (self.local_numel,)
        )
        if not ok:
            where = list(shape) if shape is not None else "?"
            raise ValueError(
                f"var {var!r}: its layout {self} does not fit its shape {where} (a ZeRO shard is "
                "one dim of ceil(numel / parts) elements)"
            )

    def __str__(self) -> str:
        return f"zero_shard(parts={self.parts}, full={list(self.full)})"


@dataclass
class Var:
    name: str
    dtype: str
    shape: Shape | None
    kind: str = "activation"
    trainable: bool = False
    # The program this var belongs to (Fleet's `var.block.program`): lets
    # `optimizer.minimize(loss)` find the program from the loss alone.
    program: Program | None = field(default=None, repr=False, compare=False)
    # Set when the var holds one worker's part of a larger tensor (tensor parallel): `Split`.
    split: Split | None = None
    # Set when only kernels on that kind of device make the var (a `DEVICE_FORMS` entry): a
    # fused op's saved outputs differ per device (attention keeps its probabilities on the CPU,
    # its logsumexp and philox seed and offset on CUDA); elsewhere its producer leaves it None,
    # it holds no bytes, and `estimate_memory` for that device does not count it.
    device: str | None = None
    # Set when the var holds one worker's flat 1/parts of a larger tensor (ZeRO sharding):
    # `ZeroShard`. With `split` too (sharding beside tensor parallel), the flat 1/parts is of this
    # worker's tensor-parallel part: `zero.full` is the local shape `split` describes.
    zero: ZeroShard | None = None
    # A persistable held in host memory (pinned on CUDA) between steps: ZeRO-Offload's optimizer
    # state. The executor materialises it there and counts it as host bytes; an op that reads it
    # on the device reads a copy (`Memcpy(dst=device)`, passes/state_offload.py).
    host: bool = False

    def __post_init__(self) -> None:
        if self.kind not in VAR_KINDS:
            raise ValueError(
                f"var {self.name!r}: unknown kind {self.kind!r}{did_you_mean(self.kind, VAR_KINDS)}"
            )
        torch_dtype(self.dtype)
        if self.device is not None and self.device not in DEVICE_FORMS:
            raise ValueError(
                f"var {self.name!r}: unknown device {self.device!r} (one of {', '.join(DEVICE_FORMS)})"
                f"{did_you_mean(self.device, DEVICE_FORMS)}"
            )
        if self.zero is not None:
            self.zero.check(self.name, self.shape)
        if self.split is not None:  # with `zero`: the layout of the tensor the flat slice is cut from
            self.split.check(self.name, self.zero.full if self.zero is not None else self.shape)
        if self.host and not self.persistable:
            raise ValueError(
                f"var {self.name!r}: only a persistable is held in host memory, not a {self.kind}"
            )

    def copy(self, **changes: Any) -> Var:
        """This var with `changes` (field=value), every other field kept, in no program yet."""
        return dataclasses.replace(self, program=None, **changes)

    @property
    def full_shape(self) -> Shape | None:
        """The whole tensor's shape: the var's own, or, for a split var, all parts together (of
        a ZeRO slice: the tensor it is cut from, whole)."""
        local = self.zero.full if self.zero is not None else self.shape
        if self.split is None or local is None:
            return local
        return self.split.full_shape(local)

    @property
    def persistable(self) -> bool:
        return self.kind in PERSISTABLE_KINDS

    def nbytes(self, dims: dict[str, int] | None = None) -> int | None:
        """Bytes of this var with symbolic dims bound by `dims`; None if unknown."""
        if self.shape is None:
            return None
        n = torch_dtype(self.dtype).itemsize
        for d in self.shape:
            v = eval_dim(d, dims or {})
            if v is None:
                return None
            n *= v
        return n


@dataclass
class Op:
    type: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, Any] = field(default_factory=dict)
    role: str = "forward"
    stage: int | None = None
    scope: str = ""
    origin: str | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"op {self.type}: unknown role {self.role!r}{did_you_mean(self.role, ROLES)}")


# Copies field by field: no __init__ (the fields were validated when the original was made),
# and no __dict__ or copy-protocol round trip (either makes a dict per object, which the
# garbage collector then tracks). A 100k-op program is cloned several times while it loads.
# tests/ir/test_clone.py checks that every dataclass field is copied.
_new = object.__new__


def _copy_var(v: Var, program: Program) -> Var:
    new = _new(Var)
    new.name = v.name
    new.dtype = v.dtype
    new.shape = v.shape  # a tuple
    new.kind = v.kind
    new.trainable = v.trainable
    new.program = program
    new.split = v.split  # frozen
    new.zero = v.zero  # frozen
    new.device = v.device
    new.host = v.host
    return new


def _copy_op(op: Op) -> Op:
    """`op` with its own inputs, outputs and attrs: passes edit these in place (``op.inputs[j]
    = ...``, ``op.outputs.append``, ``op.attrs.update``), so a clone must not share them. The
    other fields are immutable values (str, int, None) and are shared."""
    new = _new(Op)
    new.type = op.type
    new.inputs = list(op.inputs)
    new.outputs = list(op.outputs)
    attrs = op.attrs
    new.attrs = {k: _copy_attr(x) for k, x in attrs.items()} if attrs else {}
    new.role = op.role
    new.stage = op.stage
    new.scope = op.scope
    new.origin = op.origin
    return new


def _copy_attr(x: Any) -> Any:
    # Lists are copied, nested ones too (a caller may append to a copied op's "dims"); the
    # leaves (int, float, str, bool, None, tensor) are immutable or, for tensors, read-only by
    # contract (the executor binds them to kernels as they are).
    if type(x) is list:
        return [_copy_attr(y) for y in x]
    if type(x) is tuple:
        return tuple(_copy_attr(y) for y in x)
    return x


# The pipeline schedules whose backward runs as two actions per micro-batch: B (the grads the
# previous stage waits for) and W (the weight grads; Qi et al.'s zero-bubble schedules). The
# schedules themselves are metaopt.runtime.schedules'; the cut into phases is the IR's.
SPLIT_BACKWARD_SCHEDULES = ("ZBH1", "ZBV")
# The schedules that place a worker's chunks in a V (`StagePlacement`), not in a loop.
V_SHAPED_SCHEDULES = ("ZBV",)
# Paddle's spellings of pipeline_configs["schedule_mode"] -> the schedule's name here.
PADDLE_SCHEDULES = {"FThenB": "F-then-B", "VPP": "interleaved", "ZBVPP": "ZBV"}
# Schedules Paddle or the zero-bubble paper name that are not built yet: refused by name.
UNBUILT_SCHEDULES: dict[str, str] = {}
WEIGHT_PHASE = "weight"  # the W half of a split backward (a phase of Phase, not an op role)


@dataclass(frozen=True)
class StagePlacement:
    """Which worker runs each virtual stage of a pipeline of `num_stages` workers x `chunks`
    chunks, and as which of its chunks: the one rule the pipeline pass, the runtime, the
    schedules and their simulator all read.

    - A loop (Megatron-LM's interleaved schedule, and every schedule with one chunk): virtual
      stage k runs on worker k % p as its chunk k // p.
    - A V (``v_shape``, the ZB-V schedule): the chunks zig-zag, so worker w runs virtual stages
      w and 2p-1-w (with two chunks): worker 0 holds the first and the last, and the hand-off
      between virtual stages p-1 and p stays on worker p-1, with no message. Chunk c of worker w
      is virtual stage c*p + w for an even c, c*p + (p-1-w) for an odd one.
    """

    num_stages: int
    chunks: int = 1
    v_shape: bool = False

    @classmethod
    def of(cls, schedule: str, num_stages: int, chunks: int = 1) -> StagePlacement:
        """The placement `schedule` runs its virtual stages in."""
        return cls(num_stages, chunks, schedule in V_SHAPED_SCHEDULES)

    @property
    def virtual_stages(self) -> int:
        return self.num_stages * self.chunks

    def worker(self, k: int) -> int:
        """The worker running virtual stage `k`."""
        chunk, r = divmod(k, self.num_stages)
        return self.num_stages - 1 - r if self.v_shape and chunk % 2 else r

    def chunk(self, k: int) -> int:
        """Which of its worker's chunks virtual stage `k` is."""
        return k // self.num_stages

    def vstage(self, worker: int, chunk: int) -> int:
        """The virtual stage that is chunk `chunk` of worker `worker`."""
        r = self.num_stages - 1 - worker if self.v_shape and chunk % 2 else worker
        return chunk * self.num_stages + r

    def vstages(self, worker: int) -> tuple[int, ...]:
        """The virtual stages worker `worker` runs, by chunk."""
        return tuple(self.vstage(worker, c) for c in range(self.chunks))


@dataclass(frozen=True)
class PipelineInfo:
    """Set on a pipeline stage program (passes/pipeline.py): which worker of the pipeline
    runs it and how the executor drives it. Ops carry their virtual stage in ``Op.stage``;
    with ``chunks`` > 1 the schedule's `placement` says which virtual stages worker w holds."""

    stage: int  # this worker's place in the pipeline, 0 .. num_stages-1
    num_stages: int
    micro_batches: int
    schedule: str  # one of metaopt.runtime.schedules.SCHEDULES
    chunks: int = 1  # virtual stages per worker
    groups: tuple[tuple[int, ...], ...] = ()  # every tied-param group of the pipeline (same on all)
    # replicas of the whole pipeline (data parallel over pipelines): worker rank =
    # replica * num_stages + stage; a stage's grads are averaged over its replicas
    dp_degree: int = 1
    # the whole program's loss: fetched on the last stage, None on the others (any other
    # name a stage does not hold is an error, not a silent None)
    loss: str | None = None
    # Fleet's pipeline_configs["micro_batch_size"]: the fed batch must be this x micro_batches
    # (None: any batch micro_batches divides)
    micro_batch_size: int | None = None
    # An evaluation program's (Program.clone(for_test=True)): the schedule's forwards only, in its
    # order (no backward waits on them, so no order of the forwards alone can deadlock)
    forward_only: bool = False

    @property
    def splits_backward(self) -> bool:
        """Whether the schedule runs each backward as B and W (`SPLIT_BACKWARD_SCHEDULES`)."""
        return self.schedule in SPLIT_BACKWARD_SCHEDULES

    @property
    def placement(self) -> StagePlacement:
        """Which worker runs each virtual stage (a loop, or ZB-V's V)."""
        return StagePlacement.of(self.schedule, self.num_stages, self.chunks)

    def __str__(self) -> str:
        text = (
            f"stage={self.stage} num_stages={self.num_stages} micro_batches={self.micro_batches} "
            f"schedule={self.schedule} chunks={self.chunks}"
        )
        if self.micro_batch_size is not None:
            text += f" micro_batch_size={self.micro_batch_size}"
        if self.dp_degree > 1:
            text += f" dp_degree={self.dp_degree}"
        if self.loss is not None:
            text += f" loss={self.loss}"
        if self.groups:
            text += " groups=" + ";".join(",".join(str(r) for r in g) for g in self.groups)
        if self.forward_only:
            text += " forward_only=1"
        return text

    @classmethod
    def parse(cls, text: str) -> PipelineInfo:
        kv = dict(item.split("=", 1) for item in text.split())
        groups = tuple(tuple(int(r) for r in g.split(",")) for g in kv.pop("groups", "").split(";") if g)
        ints = {k: int(kv[k]) for k in ("stage", "num_stages", "micro_batches", "chunks")}
        ints["dp_degree"] = int(kv.get("dp_degree", 1))
        ints["loss"] = kv.get("loss")
        ints["micro_batch_size"] = int(kv["micro_batch_size"]) if "micro_batch_size" in kv else None
        ints["forward_only"] = kv.get("forward_only") == "1"
        return cls(schedule=kv["schedule"], groups=groups, **ints)


@dataclass(frozen=True)
class Phase:
    """One sub-program a pipeline schedule runs (passes/pipeline_phases.py cuts them): the
    forward or the backward of one virtual stage, once per micro-batch, or the optimizer
    (`chunk` -1), once per step. What an earlier phase made for the same micro-batch comes in
    as `carried_in`; what a later one reads goes out as `carried_out`."""

    chunk: int  # the virtual stage (-1: the optimizer)
    phase: str  # roles.FORWARD, BACKWARD or OPTIMIZE, or WEIGHT_PHASE (a split backward's W)
    program: Program
    feeds: tuple[str, ...]  # inputs of the whole program (sliced per micro-batch)
    carried_in: tuple[str, ...]
    carried_out: tuple[str, ...]
    last_use: frozenset[str]  # carried_in values no later phase reads
    produced: frozenset[str]
    host_out: frozenset[str]  # carried_out values in host memory (offloaded copies)

    @property
    def key(self) -> tuple[int, str]:
        return (self.chunk, self.phase)


@dataclass(frozen=True)
class Phases:
    """A stage program's cut (``Program.phases``), with the signature of the ops it was cut
    from: a program changed after its cut no longer matches (`matches`), so a stale cut is
    found, never run."""

    parts: tuple[Phase, ...]
    signature: str

    def matches(self, p: Program) -> bool:
        return self.signature == ops_signature(p)

    def get(self, key: tuple[int, str]) -> Phase | None:
        return next((x for x in self.parts if x.key == key), None)


def ops_signature(p: Program) -> str:
    """What a pipeline cut depends on: each op's type, operands, role and stage, in order (a
    digest, the same in every process: a copy of the program elsewhere still matches its cut)."""
    h = hashlib.blake2b(digest_size=16)
    for op in p.ops:
        h.update(f"{op.type}({','.join(op.inputs)})->{','.join(op.outputs)}|{op.role}|{op.stage}\n".encode())
    return h.hexdigest()


@dataclass(frozen=True)
class GradientMergeInfo:
    """Set on a gradient-merge program (passes/gradient_merge.py): the executor runs the
    update phase on the `k_steps`-th run of each window only; `step` is the persistable
    holding the run index within the window (0 .. k_steps-1)."""

    k_steps: int
    avg: bool
    step: str

    def __str__(self) -> str:
        return f"k_steps={self.k_steps} avg={int(self.avg)} step={self.step}"

    @classmethod
    def parse(cls, text: str) -> GradientMergeInfo:
        kv = dict(item.split("=", 1) for item in text.split())
        return cls(k_steps=int(kv["k_steps"]), avg=bool(int(kv["avg"])), step=kv["step"])


# Program.clone(for_test=True)'s rewrite, passes/for_test.py: a pass (it reads the op rows, which
# ir/ never imports), registered here when metaopt is imported (`register_for_test`).
_FOR_TEST: list[Callable[[Program], Program]] = []


def register_for_test(rewrite: Callable[[Program], Program]) -> None:
    _FOR_TEST[:] = [rewrite]


class Program:
    """A training or inference program: vars, ordered ops, inputs/outputs, loss."""

    def __init__(self, name: str = "main") -> None:
        self.name = name
        self.vars: dict[str, Var] = {}
        self.ops: list[Op] = []
        self.inputs: list[str] = []
        self.outputs: list[str] = []
        self.loss_name: str | None = None
        self.values: dict[str, torch.Tensor] = {}
        # name -> (its value, the value's torch version counter) for values held by reference to a
        # module's own tensors (metaopt.export): an in-place change of that tensor after the export
        # (an eager optimizer step on the module) is refused at the first run, not taken silently.
        self.referenced: dict[str, tuple[weakref.ref, int]] = {}
        # name -> the number every element of its value starts at, for a value that is a meta
        # placeholder (a program exported on the meta device: optimizer state, accumulators): the
        # executor makes it on its device, at the var's shape (this worker's share), at first use.
        self.fills: dict[str, float] = {}
        # Buffers no checkpoint of the module holds (its non-persistent buffers: rotary tables,
        # position ids): made from the module itself, left out of fleet.save_pretrained's files.
        self.derived: frozenset[str] = frozenset()
        # module path -> the var names that leave that module (its outputs).
        self.modules: dict[str, list[str]] = {}
        # persistable name -> the var whose value replaces it after the op producing
        # that var (SSA keeps one producer per name; state is updated through this
        # map, e.g. BatchNorm running stats, optimizer state, params).
        self.updates: dict[str, str] = {}
        # Set on a pipeline stage program: the executor then runs the pipeline schedule.
        self.pipeline: PipelineInfo | None = None
        # Set on a gradient-merge program: the executor updates every k-th run.
        self.gradient_merge: GradientMergeInfo | None = None
        # Set on a pipeline stage program by passes/pipeline_phases.py: the schedule's sub-programs.
        self.phases: Phases | None = None
        # Inputs whose tensors the caller gives up (a pipeline runner's values carried into their
        # last part): an op may write them in place, as any value at its last read.
        self.donated: frozenset[str] = frozenset()
        # Executors key their per-program plans (liveness, bound kernels) on (uid,
        # version): uid is unique per Program object for the life of the process (an
        # id() can be reused once a program is gone), version bumps on `replace_with`.
        self.uid = next(_UIDS)
        self.version = 0

    # --- lookup -------------------------------------------------------------
    def var(self, name: str) -> Var:
        try:
            v = self.vars[name]
        except KeyError:
            raise KeyError(
                f"program {self.name!r} has no var {name!r}{did_you_mean(name, self.vars)}"
            ) from None
        v.program = self
        return v

    @property
    def loss(self) -> Var:
        if self.loss_name is None:
            pl = self.pipeline
            if pl is not None and pl.loss is not None:
                # A pipeline stage other than the last: the loss exists, just elsewhere.
                last = pl.num_stages - 1
                raise ValueError(
                    f"program {self.name!r} is stage {pl.stage} of a {pl.num_stages}-stage pipeline and "
                    f"has no loss: the loss {pl.loss!r} is computed on the last stage (stage {last}); "
                    f"use that stage's program (the worker running stage {last} fetches it)"
                )
            raise ValueError(f"program {self.name!r} has no loss")
        return self.var(self.loss_name)

    def params(self, trainable_only: bool = True) -> list[Var]:
        return [v for v in self.vars.values() if v.kind == "param" and (v.trainable or not trainable_only)]

    def persistables(self) -> list[Var]:
        return [v for v in self.vars.values() if v.persistable]

    def producers(self) -> dict[str, int]:
        """var name -> index of the op producing it."""
        return {o: i for i, op in enumerate(self.ops) for o in op.outputs if o}

    def consumers(self) -> dict[str, list[int]]:
        """var name -> indices of the ops reading it, in order."""
        out: dict[str, list[int]] = {}
        for i, op in enumerate(self.ops):
            for x in op.inputs:
                if x:
                    out.setdefault(x, []).append(i)
        return out

    def ops_with_role(self, *roles: str) -> Iterator[Op]:
        return (op for op in self.ops if op.role in roles)

    # --- building -----------------------------------------------------------
    def add_var(self, var: Var, value: torch.Tensor | None = None, *, fill: float | None = None) -> Var:
        if var.name in self.vars:
            raise ValueError(f"program {self.name!r} already has a var {var.name!r}")
        var.program = self
        self.vars[var.name] = var
        if value is not None:
            self.values[var.name] = value
        if fill is not None:
            self.fills[var.name] = fill
        return var

    def is_meta(self, name: str) -> bool:
        """Is `name`'s value a meta placeholder (no value: a program exported on the meta device)?"""
        t = self.values.get(name)
        return t is not None and t.is_meta

    def set_filled(self, name: str, fill: float, *, meta: bool) -> None:
        """`name`'s initial value: `fill` everywhere, at its var's (static) shape; on the meta
        device, a placeholder the executor fills at first use (`fills`), so a program exported on
        meta never holds its optimizer state, and each worker makes only its share of it."""
        v = self.vars[name]
        shape, dtype = tuple(v.shape or ()), torch_dtype(v.dtype)
        if meta:
            self.values[name] = torch.empty(shape, dtype=dtype, device="meta")
            self.fills[name] = fill
        else:
            self.values[name] = torch.full(shape, fill, dtype=dtype)
            self.fills.pop(name, None)

    def sort_vars(self) -> None:
        """Inputs, params, buffers, optimizer state, constants, then the rest in program
        order: the printed program reads top-down (and a saved one loads back the same)."""
        first_use: dict[str, int] = {}
        for i, op in enumerate(self.ops):
            for o in op.outputs:
                first_use.setdefault(o, i)
        # A stable sort by (kind rank, first use of the rest), as buckets in dict order: one
        # key call per var of the rest, not a tuple per var (100k-var programs sort once per load).
        buckets: list[list[Var]] = [[] for _ in range(6)]
        for v in self.vars.values():
            buckets[_KIND_ORDER.get(v.kind, 5)].append(v)
        rest = buckets[5]
        keys = [first_use.get(v.name, -1) for v in rest]
        buckets[5] = [rest[i] for i in sorted(range(len(rest)), key=keys.__getitem__)]
        self.vars = {v.name: v for bucket in buckets for v in bucket}

    def clone(self, for_test: bool = False) -> Program:
        """A copy whose vars, ops and maps can be changed without touching this program.

        ``for_test=True`` (Paddle's ``main.clone(for_test=True)``): the evaluation program instead,
        before or after minimize: the forward only, dropout off, batch norm on its running stats,
        nothing updated; it shares the training scope by var name (passes/for_test.py).
        """
        if for_test:
            if not _FOR_TEST:
                raise RuntimeError("clone(for_test=True) needs `import metaopt` (its pass registers there)")
            return _FOR_TEST[0](self)
        return self._copy()

    @without_gc  # a bulk build: see metaopt.ir.gc_pause
    def _copy(self) -> Program:
        """`clone`'s copy.

        Initial value tensors (`values`) and tensor-valued op attributes are shared: both are
        read-only (the executor binds them to kernels as they are, so writing one would
        corrupt the program itself). Everything a pass edits is copied: each var, each op
        with its inputs, outputs and attrs (containers in attrs too), every list and map.
        """
        p = Program(self.name)
        p.vars = {k: _copy_var(v, p) for k, v in self.vars.items()}
        p.ops = [_copy_op(op) for op in self.ops]
        p.inputs, p.outputs = list(self.inputs), list(self.outputs)
        p.loss_name = self.loss_name
        p.values = dict(self.values)
        p.referenced = dict(self.referenced)
        p.fills = dict(self.fills)
        p.derived = self.derived
        p.modules = {k: list(v) for k, v in self.modules.items()}
        p.updates = dict(self.updates)
        p.pipeline = self.pipeline
        p.gradient_merge = self.gradient_merge
        p.phases = self.phases  # immutable; a clone changed later no longer matches it
        p.donated = self.donated
        return p

    def changed_since_export(self, name: str) -> bool:
        """Has the tensor `values[name]` (held by reference to a module's own) been changed in
        place since the export took it?"""
        held = self.referenced.get(name)
        value = self.values.get(name)
        return held is not None and held[0]() is value and value._version != held[1]

    def replace_with(self, other: Program) -> None:
        """Take `other`'s contents in place (Fleet's minimize rewrites the user's program)."""
        uid, version = self.uid, self.version
        self.__dict__.update(other._copy().__dict__)
        for v in self.vars.values():
            v.program = self
        self.uid, self.version = uid, version + 1

    def __str__(self) -> str:
        from metaopt.ir.printer import print_program

        return print_program(self)

    def __repr__(self) -> str:
        return f"<Program {self.name!r}: {len(self.ops)} ops, {len(self.vars)} vars>"
