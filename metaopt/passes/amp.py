"""Automatic mixed precision (Fleet's AMP meta optimizer; Paddle's ``fp16_utils``, torch's autocast).

Three pure passes, each ``Program -> Program`` with keyword-only configuration:

``amp(program, *, dtype, custom_white_list, custom_black_list, ...)`` rewrites the FORWARD
(run it before ``append_backward``) so white-listed ops run in `dtype` (``"float16"`` or
``"bfloat16"``), black-listed ops in float32, and gray ops follow their inputs
(`plan_amp` says which op runs in what and why; ``print(plan)``):

Each op's class is its op-table row's ``amp`` field (ops/registry.py; ``WHITE_LIST`` and
``BLACK_LIST`` here are the types the table classes white and black), overridden by the
user's ``custom_white_list`` / ``custom_black_list``:

* white (MatMul, Gemm, Linear, Conv, ConvTranspose, Einsum, Attention — the matmul-class
  work): float32 inputs are cast to `dtype`, float outputs become `dtype`;
* black (softmax-with-loss and other losses, Softmax/LogSoftmax, reductions,
  exp/log/pow and friends, cumulative sums, the norms that have no mixed kernels), the
  loss op (role ``loss``: the loss stays float32; a white loss op whose row keeps its outputs
  float32, LinearCrossEntropy, runs its matmul low) and any op reading or writing a var of
  ``custom_black_varnames``: low-precision inputs are cast back to float32;
* gray (every other op), Paddle's rule: an input made by a float32-forced op (black, or
  gray made float32 by one) makes it float32; else an input made by a low-precision op
  makes it low precision; else it keeps its dtypes. Params, constants and feeds do not
  vote (a gray op reading only them, like an embedding lookup, stays float32).
  With ``use_pure_fp16`` (O2) every gray op runs in `dtype` and trainable params are
  stored in `dtype` (their float32 master copies live in the optimizer:
  passes/master_weights.py).
* LayerNormalization and BatchNormTraining are gray with their statistics in float32 (their
  rows' ``amp_float32_inputs`` / ``amp_float32_outputs``): x and y follow the rule, the
  scale, bias and running statistics (and the saved mean and inverse std) stay float32 —
  Paddle keeps those inputs float32, and torch's kernels accumulate the statistics in
  float32 for half inputs.
* Ops that set their output dtype themselves (rows with ``sets_dtype``: Cast, CastLike)
  and inputs read for their value on the host (Dropout's ratio, shapes) or for their
  dtype are left alone; an op writing persistable state (BatchNormalization's running
  stats in ONNX training mode) or an op with float64 tensors keeps float32.

Casts are ONNX ``Cast`` ops (role ``forward``, the consumer's scope, origin = the var
cast), named ``x@CAST_FP16`` / ``x@CAST_BF16`` / ``x@CAST_FP32`` (metaopt.ir.names),
emitted right before the first op that needs them and SHARED by every later consumer:
each var is cast at most once per dtype. A param (the float32 master weight) is thus
cast once per step, inside the recompute segment of its first use (recompute re-emits
the cast with the segment). Constants are converted once, at rewrite time (a new
constant ``c@CAST_FP16``, no op). A low-precision op keeps its output names, so module
outputs (recompute checkpoints) keep their names and are held, offloaded and fetched
in the low dtype: half the bytes. Program outputs other than the loss that a
low-precision op makes are cast back to their float32 under their own name.

``scale_loss(program, *, init_loss_scaling)`` adds the persistable float32 scalar
``loss_scaling`` (kind ``opt_state``) and ``loss@SCALED = Mul(loss, loss_scaling)``
(role ``loss``); the backward starts from ``loss@SCALED``, the fetched ``loss`` stays
unscaled.

``unscale_grads(program, *, use_dynamic_loss_scaling, incr_every_n_steps, ...)`` runs
on the training program (after the backward and the optimizer ops were appended): it
inserts, after every role ``comm`` op (data-parallel all-reduces: every rank then
checks the same reduced grads and skips the same steps) and before the first
``optimize`` / ``lr-sched`` op::

    g1@UNSCALED, ..., found_inf = CheckFiniteAndUnscale(g1, ..., loss_scaling)      # role=optimize
    loss_scaling@NEW, num_good_steps@NEW, num_bad_steps@NEW =
        UpdateLossScaling(found_inf, loss_scaling, num_good_steps, num_bad_steps, ...)

(the second only with ``use_dynamic_loss_scaling``; Fleet's rule, ops/kernels/amp.py),
(on a pipeline stage, ``across_workers``: then ``found_inf@REDUCED = AllReduce(found_inf)``
so that every stage skips the same steps), rewires every optimizer op to read the
unscaled grads, and gives ``StepCounter`` and
every update op the trailing ``found_inf`` input (at their rows' ``skip_input``): on
a step with an inf or a nan in any grad the params, the optimizer state and the step
counter are all left as they were (torch's ``GradScaler.step`` skips
``optimizer.step()``), and the scale shrinks by Fleet's rule. The counters are
persistable int32 scalars; like the scale they are saved by ``fleet.save_persistables``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from metaopt.ir import TORCH_TO_ONNX, Op, Program, Var, did_you_mean, names, roles, torch_dtype
from metaopt.ops import registry
from metaopt.passes.one_call import one_call

LOW_DTYPES = ("float16", "bfloat16")

LOW, FP32, KEEP = "low", "float32", "keep"


def __getattr__(name: str):
    # The op table holds each op's AMP class (rows' `amp`, `amp_float32_inputs/outputs`,
    # `sets_dtype`); these names are views of it, kept for older callers.
    if name == "WHITE_LIST":  # matmul-class work: what mixed precision speeds up
        return registry.amp_types("white")
    if name == "BLACK_LIST":  # numerically sensitive ops, kept in float32
        return registry.amp_types("black")
    if name == "FLOAT32_SLOTS":  # op type -> (inputs, outputs) kept float32 in a low-precision op
        return {
            t: (row.amp_float32_inputs, row.amp_float32_outputs)
            for t, row in registry.table().items()
            if row.amp_float32_inputs or row.amp_float32_outputs
        }
    if name == "DTYPE_SETTING":  # ops that set their output dtype themselves
        return frozenset(t for t, row in registry.table().items() if row.sets_dtype)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class AmpError(ValueError):
    pass


@dataclass(frozen=True)
class OpPrecision:
    index: int  # op index in the program
    op: str  # "out = Type" of the op, for reading the plan
    precision: str  # LOW, FP32 or KEEP (dtype-setting ops and ops without float32 tensors)
    reason: str


@dataclass
class AmpPlan:
    """Which forward op runs in which precision and why (`plan_amp`)."""

    dtype: str
    white_list: frozenset[str]
    black_list: frozenset[str]
    pure: bool
    ops: list[OpPrecision] = field(default_factory=list)

    def precision_of(self, index: int) -> str:
        return self._by_index[index].precision

    @property
    def _by_index(self) -> dict[int, OpPrecision]:
        return {d.index: d for d in self.ops}

    def counts(self) -> dict[str, int]:
        out = {LOW: 0, FP32: 0, KEEP: 0}
        for d in self.ops:
            out[d.precision] += 1
        return out

    def __str__(self) -> str:
        c = self.counts()
        lines = [
            f"amp plan ({self.dtype}{', pure' if self.pure else ''}): {c[LOW]} ops in {self.dtype}, "
            f"{c[FP32]} in float32, {c[KEEP]} unchanged"
        ]
        width = max((len(d.op) for d in self.ops), default=0)
        for d in self.ops:
            shown = self.dtype if d.precision == LOW else d.precision
            lines.append(f"  {d.op:<{width}}  {shown:<9} {d.reason}")
        return "\n".join(lines)


def _forward_end(p: Program) -> int:
    """Index one past the last forward/loss op; refuses a program that has a backward."""
    if any(not roles.is_forward(op.role) for op in p.ops):
        bad = next(op for op in p.ops if not roles.is_forward(op.role))
        raise AmpError(
            f"amp rewrites the forward of program {p.name!r}, but it already has a {bad.role} op "
            f"({bad.type}): apply amp before append_backward / minimize"
        )
    return len(p.ops)


def check_op_types(what: str, types: Iterable[str]) -> tuple[str, ...]:
    """Op types of a custom list, each a row of the op table (else an error with a did-you-mean)."""
    if isinstance(types, str):
        raise AmpError(f"{what} must be a list of op types, got the string {types!r}")
    known = registry.table()
    out = []
    for t in types:
        if not isinstance(t, str):
            raise AmpError(f"{what}: op types are strings, got {t!r}")
        if t not in known:
            raise AmpError(f"{what}: unknown op type {t!r}{did_you_mean(t, known)}")
        out.append(t)
    return tuple(out)


def _custom_classes(custom_white_list, custom_black_list) -> dict[str, str]:
    """op type -> "white" / "black" for the user's lists (they override the rows' `amp`)."""
    white = check_op_types("amp custom_white_list", custom_white_list)
    black = check_op_types("amp custom_black_list", custom_black_list)
    both = sorted(set(white) & set(black))
    if both:
        raise AmpError(f"op type {both[0]!r} is in both amp custom_white_list and custom_black_list")
    return {**dict.fromkeys(white, "white"), **dict.fromkeys(black, "black")}


def _amp_class(op_type: str, custom: dict[str, str]) -> str:
    """white, black or gray: the user's lists, else the op's row (gray without one)."""
    if op_type in custom:
        return custom[op_type]
    row = registry.get(op_type)
    return row.amp if row is not None else "gray"


def _float32_slots(op: Op) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Inputs and outputs of `op` that stay float32 when it runs in low precision."""
    row = registry.get(op.type)
    return (row.amp_float32_inputs, row.amp_float32_outputs) if row is not None else ((), ())


def _sets_dtype(op: Op) -> bool:
    row = registry.get(op.type)
    return row is not None and row.sets_dtype


def _check_dtype(dtype: str) -> None:
    if dtype not in LOW_DTYPES:
        hint = did_you_mean(str(dtype), LOW_DTYPES)
        raise AmpError(f"amp dtype must be one of {LOW_DTYPES}, got {dtype!r}{hint}")


def _skipped_inputs(op: Op, program: Program) -> set[int]:
    row = registry.get(op.type)
    if row is None:
        return set()
    return set(row.meta_inputs) | set(registry.host_inputs(op, program))


def plan_amp(
    program: Program,
    *,
    dtype: str = "float16",
    custom_white_list: Sequence[str] = (),
    custom_black_list: Sequence[str] = (),
    custom_black_varnames: Sequence[str] = (),
    use_pure_fp16: bool = False,
) -> AmpPlan:
    """The precision of every forward op of `program` (see the module doc for the rules)."""
    _check_dtype(dtype)
    custom = _custom_classes(custom_white_list, custom_black_list)
    table = registry.table()
    white = frozenset(t for t in table if _amp_class(t, custom) == "white")
    black = frozenset(t for t in table if _amp_class(t, custom) == "black")
    for v in custom_black_varnames:
        if v not in program.vars:
            raise AmpError(
                f"amp custom_black_varnames: program {program.name!r} has no var {v!r}"
                f"{did_you_mean(v, program.vars)}"
            )
    ctx = _Rules(
        dtype=dtype,
        custom=custom,
        black_vars=set(custom_black_varnames),
        new_state=set(program.updates.values()),
        pure=bool(use_pure_fp16),
    )
    end = _forward_end(program)
    plan = AmpPlan(dtype, white, black, bool(use_pure_fp16))
    vote: dict[str, str] = {}  # activation -> LOW (made by a low op) or FP32 (by a float32-forced op)
    for i, op in enumerate(program.ops[:end]):
        precision, reason = ctx.decide(program, op, vote)
        label = f"{op.outputs[0] if op.outputs else ''} = {op.type}"
        plan.ops.append(OpPrecision(i, label, precision, reason))
        if precision != KEEP:
            keep_out = _float32_slots(op)[1]
            for k, o in enumerate(op.outputs):
                if o and k not in keep_out and _is_float(program, o):
                    vote[o] = precision
    return plan


def _is_float(p: Program, x: str) -> bool:
    return torch_dtype(p.vars[x].dtype).is_floating_point


@dataclass
class _Rules:
    dtype: str
    custom: dict[str, str]  # op type -> its class in the user's lists
    black_vars: set[str]
    new_state: set[str]
    pure: bool

    def decide(self, p: Program, op: Op, vote: dict[str, str]) -> tuple[str, str]:
        keep_out = _float32_slots(op)[1]
        skipped = _skipped_inputs(op, p)
        f_in = [x for j, x in enumerate(op.inputs) if x and j not in skipped and _is_float(p, x)]
        f_out = [o for o in op.outputs if o and _is_float(p, o)]
        cls = _amp_class(op.type, self.custom)
        custom = " (custom)" if self.custom.get(op.type) else ""
        if _sets_dtype(op):
            return KEEP, "sets its own output dtype"
        if not f_in and not f_out:
            return KEEP, "no float tensors"
        if any(p.vars[x].dtype != "float32" for x in (*f_in, *f_out)):
            return FP32, "has tensors that are not float32: left as exported"
        # The loss stays float32; an op whose row keeps every float output float32 anyway
        # (LinearCrossEntropy: low-precision matmul, float32 loss) may still run in low precision.
        if op.role == "loss" and any(k not in keep_out for k, o in enumerate(op.outputs) if o in f_out):
            return FP32, "the loss op stays float32"
        changed = [o for k, o in enumerate(op.outputs) if o in f_out and k not in keep_out]
        state = [o for o in changed if o in self.new_state]
        if state:
            return FP32, f"writes persistable state through {state[0]!r}"
        hit = [x for x in (*op.inputs, *op.outputs) if x in self.black_vars]
        if hit:
            return FP32, f"reads or writes {hit[0]!r} (custom_black_varnames)"
        if cls == "white":
            return LOW, "white list" + custom
        if cls == "black":
            return FP32, "black list" + custom
        # gray: follow the inputs (Paddle's rule: a float32-forced input wins)
        fp32_in = next((x for x in f_in if vote.get(x) == FP32), None)
        if fp32_in is not None:
            return FP32, f"input {fp32_in!r} comes from a float32 op"
        low_in = next((x for x in f_in if vote.get(x) == LOW), None)
        if low_in is not None:
            return LOW, f"input {low_in!r} is {self.dtype}"
        if self.pure:
            return LOW, "pure low precision (use_pure_fp16)"
        return KEEP, "no low-precision input"


def apply_amp(program: Program, plan: AmpPlan) -> Program:
    """A copy of `program` rewritten as `plan` (made by `plan_amp` for it) says."""
    use_pure_fp16 = plan.pure
    q = program.clone()
    end = _forward_end(q)
    low = plan.dtype
    orig = {n: v.dtype for n, v in q.vars.items()}
    casts: dict[tuple[str, str], str] = {}  # (var, dtype) -> the var holding it in that dtype
    out_ops: list[Op] = []

    if use_pure_fp16:  # params stored in low precision; master copies: the optimizer's
        for v in q.params():
            if v.dtype == "float32":
                v.dtype = low
                if v.name in q.values:
                    q.values[v.name] = q.values[v.name].to(torch_dtype(low))

    def cast(x: str, to: str, consumer: Op) -> str:
        if q.vars[x].dtype == to:
            return x
        key = (x, to)
        if key in casts:
            return casts[key]
        name = names.fresh(names.cast(x, to), q.vars)
        v = q.vars[x]
        if v.kind == "constant":
            q.add_var(Var(name, to, v.shape, "constant"), q.values[x].to(torch_dtype(to)))
        else:
            q.add_var(Var(name, to, v.shape))
            attrs = {"to": TORCH_TO_ONNX[torch_dtype(to)]}
            out_ops.append(Op("Cast", [x], [name], attrs, role="forward", scope=consumer.scope, origin=x))
        casts[key] = name
        return name

    outputs = set(q.outputs) - {q.loss_name}
    for i, op in enumerate(q.ops[:end]):
        precision = plan.precision_of(i)
        keep_in, keep_out = _float32_slots(op)
        skipped = _skipped_inputs(op, q)
        after: list[Op] = []
        if precision == LOW:
            for j, x in enumerate(op.inputs):
                if not x or j in skipped:
                    continue
                want = "float32" if j in keep_in else low
                if torch_dtype(q.vars[x].dtype).is_floating_point:
                    op.inputs[j] = cast(x, want, op)
            for k, o in enumerate(op.outputs):
                if not o or k in keep_out or q.vars[o].dtype != "float32":
                    continue
                if o in outputs:  # a program output keeps its dtype: low value under a cast name
                    lo = names.fresh(names.cast(o, low), q.vars)
                    q.add_var(Var(lo, low, q.vars[o].shape))
                    op.outputs[k] = lo
                    casts[(o, low)] = lo
                    attrs = {"to": TORCH_TO_ONNX[torch.float32]}
                    after.append(Op("Cast", [lo], [o], attrs, role=op.role, scope=op.scope, origin=o))
                else:
                    q.vars[o].dtype = low
        elif precision == FP32:
            for j, x in enumerate(op.inputs):
                if x and j not in skipped and q.vars[x].dtype != orig[x]:
                    op.inputs[j] = cast(x, orig[x], op)
        out_ops.append(op)
        out_ops.extend(after)
    # The executor's device is known only when the program runs: refuse one without `dtype`
    # kernels there, before the first low-precision op (ops/kernels/amp.py). (Nothing reads
    # its output: loading a saved program back drops it with the other dead forward ops;
    # fleet's minimize also checks the worker's device.)
    ok = names.fresh(names.amp_device_ok(), q.vars)
    q.add_var(Var(ok, "bool", ()))
    guard = Op("CheckAmpDevice", [], [ok], {"dtype": low}, role="forward")
    q.ops = [guard, *out_ops, *q.ops[end:]]
    return q


amp = one_call(plan_amp, apply_amp)


# --- loss scaling ---------------------------------------------------------------------------


def scale_loss(program: Program, *, init_loss_scaling: float = 32768.0) -> Program:
    """Add ``loss_scaling`` (persistable) and ``loss@SCALED = Mul(loss, loss_scaling)`` (module doc)."""
    _check_scale(init_loss_scaling)
    q = program.clone()
    loss = q.loss
    if loss.dtype != "float32":
        raise AmpError(f"loss {loss.name!r} is {loss.dtype}; loss scaling needs a float32 loss")
    scale = names.loss_scaling()
    for name in (scale, names.scaled(loss.name)):
        if name in q.vars:
            raise AmpError(f"program {q.name!r} already has a var {name!r} (loss scaling was applied)")
    q.add_var(Var(scale, "float32", (), "opt_state"), torch.tensor(float(init_loss_scaling)))
    scaled = q.add_var(Var(names.scaled(loss.name), "float32", loss.shape))
    at = q.producers()[loss.name]
    op = Op("Mul", [loss.name, scale], [scaled.name], role="loss", scope=q.ops[at].scope, origin=loss.name)
    q.ops.insert(at + 1, op)
    return q


def _check_scale(init_loss_scaling: float) -> None:
    """The scale is a float32 var: inf, nan, 0, or what rounds to them, skips every step (fleet's
    strategy refuses these at assignment; the pass refuses them for direct callers)."""
    f32 = torch.tensor(float(init_loss_scaling)).float()
    if not (init_loss_scaling > 0 and torch.isfinite(f32) and torch.isfinite(f32.reciprocal())):
        raise AmpError(
            f"init_loss_scaling must be a finite float32 > 0 whose reciprocal is finite, got "
            f"{init_loss_scaling!r}: with it every step would be skipped"
        )


def _check_rule(
    incr_every_n_steps: int, decr_every_n_nan_or_inf: int, incr_ratio: float, decr_ratio: float
) -> None:
    """Fleet's rule must be able to move the float32 scale (a ratio that rounds to 1.0 never does)."""
    up, down = (float(torch.tensor(float(r)).float()) for r in (incr_ratio, decr_ratio))
    checks = [
        ("incr_every_n_steps", incr_every_n_steps, incr_every_n_steps >= 1, "must be >= 1"),
        ("decr_every_n_nan_or_inf", decr_every_n_nan_or_inf, decr_every_n_nan_or_inf >= 1, "must be >= 1"),
        ("incr_ratio", incr_ratio, 1 < up < float("inf"), "must be > 1 and finite in float32"),
        ("decr_ratio", decr_ratio, 0 < down < 1, "must be in (0, 1) in float32"),
    ]
    for name, value, ok, must in checks:
        if not ok:
            raise AmpError(f"{name} {must} (the loss scale is float32), got {value!r}")


def scaled_loss(program: Program) -> str:
    """The var `scale_loss` made, where the backward starts: the output of the loss-role op
    that multiplies the program's loss by the loss scaling."""
    for op in program.ops:
        if op.role == "loss" and op.origin == program.loss_name and names.loss_scaling() in op.inputs:
            return op.outputs[0]
    raise AmpError(f"program {program.name!r} does not scale its loss {program.loss_name!r} (scale_loss)")


def unscale_grads(
    program: Program,
    *,
    use_dynamic_loss_scaling: bool = True,
    incr_every_n_steps: int = 1000,
    decr_every_n_nan_or_inf: int = 2,
    incr_ratio: float = 2.0,
    decr_ratio: float = 0.8,
    master_dtype: str | None = None,
    across_workers: bool = False,
    init_loss_scaling: float = 32768.0,
) -> Program:
    """Check the grads for inf/nan, unscale them, skip overflowed steps (module doc).

    `master_dtype` (AMP O2): the dtype the unscaled grads are cast to (their master
    weights'), by the same fused op. `across_workers`: the program is one worker's part
    of a model split over workers (a pipeline stage), whose grads no all-reduce makes
    equal: ``found_inf@REDUCED = AllReduce(found_inf, reduce=sum)`` (role ``optimize``,
    over every worker) follows the check and the skip reads it, so every stage skips
    the steps any stage overflowed on and their scales stay equal; a stage without the
    loss gets its own ``loss_scaling`` (`init_loss_scaling`), updated by the same rule.
    """
    if use_dynamic_loss_scaling:
        _check_rule(incr_every_n_steps, decr_every_n_nan_or_inf, incr_ratio, decr_ratio)
    q = program.clone()
    scale = names.loss_scaling()
    if scale not in q.vars:
        if not across_workers:
            raise AmpError(f"program {q.name!r} has no {scale!r}: apply scale_loss before the backward")
        _check_scale(init_loss_scaling)
        q.add_var(Var(scale, "float32", (), "opt_state"), torch.tensor(float(init_loss_scaling)))
    found = names.found_inf()
    if found in q.vars:
        raise AmpError(f"program {q.name!r} already has {found!r}: unscale_grads runs once")
    first = next((i for i, op in enumerate(q.ops) if roles.is_update(op.role)), None)
    if first is None:
        raise AmpError(f"program {q.name!r} has no optimizer ops: unscale_grads runs after the optimizer")
    last_comm = max((i for i, op in enumerate(q.ops) if op.role == "comm"), default=-1)
    pos = max(first, last_comm + 1)
    # Optimizer ops placed before the last all-reduce (none are, today) move after the check.
    moved = [op for op in q.ops[first:pos] if roles.is_update(op.role)]
    head = [op for op in q.ops[:pos] if not roles.is_update(op.role)]
    for op in moved:
        reads = {x for h in q.ops[:pos] if not roles.is_update(h.role) for x in h.inputs}
        if reads & set(op.outputs):
            raise AmpError(f"op {op.type} ({op.role}) is read before the last all-reduce: cannot check grads")
    tail = moved + q.ops[pos:]
    made_before = {o for op in head for o in op.outputs if o}
    grads: list[str] = []
    for op in tail:
        for x in op.inputs:
            if x and x in made_before and q.vars[x].kind == "grad" and x not in grads:
                grads.append(x)
    if not grads:
        raise AmpError(f"program {q.name!r}: no optimizer op reads a grad; nothing to unscale")
    unscaled = {}
    for g in grads:
        v = q.vars[g]
        name = names.fresh(names.unscaled(g), q.vars)
        q.add_var(Var(name, master_dtype or v.dtype, v.shape, "grad"))
        unscaled[g] = name
    q.add_var(Var(found, "float32", ()))  # 1.0 on overflow (torch's convention: summable)
    attrs = {"to": TORCH_TO_ONNX[torch_dtype(master_dtype)]} if master_dtype else {}
    inserted = [
        Op("CheckFiniteAndUnscale", [*grads, scale], [*unscaled.values(), found], attrs, role="optimize")
    ]
    if across_workers:
        local, found = found, names.reduced(found)
        q.add_var(Var(found, "float32", ()))
        inserted.append(Op("AllReduce", [local], [found], {"reduce": "sum"}, role="optimize", origin=local))
    if use_dynamic_loss_scaling:
        state = [scale, names.good_steps(), names.bad_steps()]
        for s in state[1:]:
            if s in q.vars:
                raise AmpError(f"program {q.name!r} already has a var {s!r}")
            q.add_var(Var(s, "int32", (), "opt_state"), torch.zeros((), dtype=torch.int32))
        new = [names.new_state(s) for s in state]
        for s, n in zip(state, new, strict=True):
            q.add_var(Var(n, q.vars[s].dtype, ()))
            q.updates[s] = n
        attrs = {
            "incr_every_n_steps": int(incr_every_n_steps),
            "decr_every_n_nan_or_inf": int(decr_every_n_nan_or_inf),
            "incr_ratio": float(incr_ratio),
            "decr_ratio": float(decr_ratio),
        }
        inserted.append(Op("UpdateLossScaling", [found, *state], new, attrs, role="optimize", origin=scale))
    state_new = set(q.updates.values())
    for op in tail:
        op.inputs = [unscaled.get(x, x) for x in op.inputs]
        k = registry.skip_input(op.type)
        if k is not None:
            op.inputs = op.inputs[:k] + [""] * (k - len(op.inputs)) + [found] + op.inputs[k + 1 :]
        elif op.role == "optimize" and set(op.outputs) & state_new and not _from_updates(op):
            raise AmpError(
                f"optimizer op {op.type} updates state but cannot skip a step with inf/nan grads "
                f"(no found_inf input: its op-table row has no skip_input)"
            )
    q.ops = head + inserted + tail
    return q


def _from_updates(op: Op) -> bool:
    row = registry.get(op.type)
    return row is not None and row.state_from_updates
