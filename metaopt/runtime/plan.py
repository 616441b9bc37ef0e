"""Make a Program runnable (once per program version): generated straight-line Python, or
for a program too large to compile at once, an interpreter of the same steps until it has run
often enough to pay for compiling (`Plan`).

Like torch.fx's codegen: each var is a local, each op one call of its bound
kernel, and a non-persistable var is dropped (``del``) right after its last
use, so the interpreter frees it exactly when torch.fx's Interpreter would.
Memory accounting calls are emitted next to allocations and frees.

Errors name the op. The generated source is registered with `linecache` under a
unique filename (``<metaopt plan NAME #N>``), so a traceback through a plan shows its
generated lines, and `Plan.run` turns an exception escaping the plan into one whose
message starts ``while running op I: <the op's printed line>``, with the original as
``__cause__``. The op is found from the traceback's line in the generated source
(`Plan.op_of_line`, kept while generating), or the interpreter frame's op index: the hot
path has no per-op try/except.
Tracebacks formatted by the `traceback` module (pytest, logging, ``traceback.print_exc``,
the default hook from Python 3.13) show the generated lines; the interpreter's own printer
of an uncaught error before 3.13 reads real files only, and shows the frame without it.
"""

from __future__ import annotations

import functools
import itertools
import linecache
import math
import os
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from metaopt.ir import Op, Program, did_you_mean, torch_dtype, verify
from metaopt.ir.gc_pause import without_gc
from metaopt.ir.liveness import liveness
from metaopt.ir.printer import fmt_op
from metaopt.ops import registry
from metaopt.ops.in_flight import check_in_flight
from metaopt.ops.placement import host_placement
from metaopt.ops.reuse import plan_reuse
from metaopt.runtime.hostsync import guarded

# Programs with more ops than this start interpreted (see `Plan`). Python compiles the generated
# source at ~30-50 µs per op: 3-5 s for 100k ops, more than such a program's first runs take.
COMPILE_AT_ONCE_OPS = 5000
# An interpreted plan compiles itself on its run after this many. Compiling costs 25-55 µs per
# op, the interpreter 0-0.3 µs per op per run more than compiled code (2-core CPU, chains of
# 10k-100k tiny ops, benchmarks/load_100k.py): both grow with the op count, so from about this
# many runs on, whatever the size, the interpreter's accumulated extra cost would exceed the
# cost of compiling. A program run fewer times never pays for compiling; one run more often
# pays at most about twice the least possible overhead (the ski-rental bound).
COMPILE_AFTER_RUNS = 200


@dataclass
class Plan:
    """A program made runnable once per program version: `run(S, F, T)` -> fetched tensors.

    Two ways to run the same `_Layout` (one step per op, values in numbered slots): generated
    straight-line Python (`compile`, torch.fx-style: no per-op interpretation cost), or a
    loop over the steps (`_interpret`: nothing to compile). A program of at most
    `COMPILE_AT_ONCE_OPS` ops is compiled when the plan is built; a larger one is
    interpreted for its first `COMPILE_AFTER_RUNS` runs, then compiled. Both free, count
    memory, update state, snapshot and copy fetches at the same points, and name the failing
    op the same way.
    """

    persistables: list[str]  # scope names the program reads or updates
    constants: dict[str, torch.Tensor]  # the program's constants on the device, held by the plan
    feeds: list[str]
    fetches: list[str]
    ops: list[Op]  # the program's ops when planned, by index
    layout: _Layout | None = field(default=None, repr=False)  # None once compiled
    fn: object = None  # the compiled fn(S, F, T) -> tuple of fetched tensors; None: interpreted
    filename: str = ""  # the generated source's name in tracebacks (registered with linecache)
    op_of_line: dict[int, int] = field(default_factory=dict)  # source line (1-based) -> op index
    runs: int = 0  # interpreted runs so far
    _source: str | None = field(default=None, repr=False)
    # op index -> the input its output 0 is written over (ops/reuse.py): relu and residual adds
    # in place where their input dies, as eager code writes them by hand
    reused: dict[int, int] = field(default_factory=dict)
    # scope name -> a weak reference to the tensor the executor last found fitting this program's
    # var (checked once, not on every run: Executor._materialise)
    checked: dict = field(default_factory=dict, repr=False)

    @property
    def source(self) -> str:
        """The generated Python (made on demand for a plan not compiled yet)."""
        if self._source is None:
            self._source, self.op_of_line = _source(self.layout, self.ops)
        return self._source

    def compile(self) -> object:
        """Compile the generated source (once); returns the compiled fn."""
        if self.fn is None:
            source = self.source
            self.fn, self.filename = _register_source(source, self.layout.name, _globals(self.layout))
            self.layout = None  # what the interpreter ran: not needed any more
        return self.fn

    def run(self, S, F, T) -> tuple:
        """Run the plan once, naming the op in an error that escapes it.

        An `Exception` raised while running op ``i`` (its kernel, or the bookkeeping done
        with it) is re-raised as ``while running op i: <fmt_op line>``, followed on
        the next line by the original message, ``from`` the original (its traceback, through
        the generated source, is the cause's). The new error keeps the original's type where
        that is exact: ``type(e)(message)`` must build an exception whose ``args`` and
        ``str`` are the message (so ``except ValueError`` and ``pytest.raises(CommError,
        match=...)`` still catch it; the original's instance attributes are copied over).
        Otherwise (a constructor taking other arguments, a KeyError's quoting ``str``) it is
        a `RuntimeError` whose second line names the original type. An error outside any
        op (reading the scope or feeds, returning fetches) and a `BaseException` that is not
        an `Exception` (KeyboardInterrupt, SystemExit) pass through untouched.
        """
        fn = self.fn
        if fn is None:
            self.runs += 1
            if self.runs > COMPILE_AFTER_RUNS:
                fn = self.compile()
            else:
                fn = functools.partial(_interpret, self.layout)
        try:
            return fn(S, F, T)
        except Exception as e:
            err = self.op_error(e)
            if err is None:
                raise
            raise err from e

    def failed_op(self, e: BaseException) -> int | None:
        """The index of the op whose run raised `e`, or None (raised outside any op)."""
        code = getattr(self.fn, "__code__", None)
        tb = e.__traceback__
        while tb is not None:  # the plan is one frame: the first match is the op's
            frame = tb.tb_frame
            if frame.f_code is code:
                return self.op_of_line.get(tb.tb_lineno)
            if frame.f_code is _INTERPRET_CODE and frame.f_locals.get("t") is self.layout:
                return frame.f_locals.get("i")
            tb = tb.tb_next
        return None

    def op_error(self, e: BaseException) -> BaseException | None:
        """The error naming the op that raised `e` (see `run`); None if no op did."""
        i = self.failed_op(e)
        if i is None:
            return None
        head = f"while running op {i}: {fmt_op(self.ops[i])}"
        msg = f"{head}\n{e}" if str(e) else head
        try:
            err = type(e)(msg)
            exact = err.args == (msg,) and str(err) == msg
        except Exception:  # noqa: BLE001 - a constructor that takes other arguments
            exact = False
        if not exact:
            return RuntimeError(f"{head}\n{type(e).__name__}: {e}")
        extra = {k: v for k, v in vars(e).items() if k != "__notes__"}
        err.__dict__.update(extra)
        return err


_PLAN_IDS = itertools.count()


def _register_source(source: str, name: str, g: dict) -> tuple[object, str]:
    """Compile `source` under a unique filename whose lines `linecache` holds (for tracebacks)
    while the generated code lives; exec it into `g`. Returns (g["run"], filename)."""
    filename = f"<metaopt plan {name} #{next(_PLAN_IDS)}>"
    exec(compile(source, filename, "exec"), g)
    fn = g["run"]
    # mtime None: `linecache.checkcache` keeps the entry (there is no file to re-read).
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    # Dropped with the code object (held by the plan's function and any traceback's frames).
    weakref.finalize(fn.__code__, linecache.cache.pop, filename, None)
    return fn, filename


def _uploading(kernel, positions: tuple[int, ...], device: torch.device):
    """`kernel` reading its host-computed inputs at `positions` as copies on `device`."""

    def run(*args):
        args = list(args)
        for j in positions:
            if isinstance(args[j], torch.Tensor):
                args[j] = args[j].to(device, non_blocking=True)
        return kernel(*args)

    return run


def _bind(
    op, row: registry.OpDef | None, device: torch.device, runtime, check: bool, into: int | None = None
):
    """The op's kernel with its attrs bound; `into`: the row's in-place form writing output 0
    into that input (ops/reuse.py chose it)."""
    if row is None:
        raise NotImplementedError(f"no kernel for op type {op.type!r}: {fmt_op(op)}")
    fn = row.kernel if into is None else row.reuse[1](into)
    if not (op.attrs or check or row.needs_outputs or row.needs_device or row.needs_runtime):
        return fn  # nothing to bind (most ops of a long elementwise chain)
    kw = dict(op.attrs)
    if row.needs_outputs:
        kw["_nout"] = len(op.outputs)
    if row.needs_device:
        kw["_device"] = device
    if row.needs_runtime:
        if runtime is None:
            raise ValueError(f"op needs an executor's runtime (copies, collectives): {fmt_op(op)}")
        kw["_rt"] = runtime
        kw["_key"] = next((o for o in op.outputs if o), None) or next((x for x in op.inputs if x), "")
    kernel = functools.partial(fn, **kw) if kw else fn
    return _alias_checked(kernel, op, row, into) if check else kernel


CHECK_ALIASES = "METAOPT_CHECK_ALIASES"


def _alias_checked(kernel, op, row, into: int | None = None):
    """`kernel`, checking after every call that an output shares storage with an input only
    where the row declares it (`aliases`, `inplace`, the chosen `reuse`): a debugging mode (the
    zoo runs with it), since an undeclared alias lets an in-place update corrupt a value still
    to be read."""
    declared = set(registry.alias_pairs(op) or ()) | set(row.inplace)
    if into is not None:
        # The same var read twice (Mul(y, y)) is one storage: writing into it covers both reads,
        # which an elementwise in-place form reads at the position it writes.
        declared |= {(0, j) for j, x in enumerate(op.inputs) if x == op.inputs[into]}

    def checked(*args):
        out = kernel(*args)
        outs = out if isinstance(out, tuple) else (out,)
        for k, o in enumerate(outs):
            if not isinstance(o, torch.Tensor) or not o.numel():
                continue
            ptr = o.untyped_storage().data_ptr()
            for j, x in enumerate(args):
                if (
                    isinstance(x, torch.Tensor)
                    and x.numel()
                    and (k, j) not in declared
                    and x.untyped_storage().data_ptr() == ptr
                ):
                    raise AssertionError(
                        f"{op.type}'s output {k} shares storage with its input {j}, which its row's "
                        f"`aliases` does not declare: {fmt_op(op)}"
                    )
        return out

    return checked


class _Aliases:
    """Union-find of vars that may share storage, grown op by op.

    Storage is shared along the pairs a row declares in `aliases` (views, pass-throughs; only
    inputs of the output's dtype: a same-dtype Cast may return its input, another may not)
    and along in-place pairs. An op without a row may alias anything.
    """

    def __init__(self) -> None:
        self.parent: dict[str, str] = {}
        self.classes: dict[str, list[str]] = {}  # a root -> its class (a var never linked: none)

    def find(self, x: str) -> str:
        while self.parent.get(x, x) != x:
            x = self.parent[x]
        return x

    def add(self, p: Program, op: Op) -> None:
        row = registry.get(op.type)
        links: set[tuple[str, str]] = set()
        for k, j in row.inplace if row is not None else ():
            if k < len(op.outputs) and op.outputs[k] and j < len(op.inputs) and op.inputs[j]:
                links.add((op.outputs[k], op.inputs[j]))
        pairs = registry.alias_pairs(op)
        if pairs is None:
            pairs = [(k, j) for k in range(len(op.outputs)) for j in range(len(op.inputs))]
        for k, j in pairs:
            o = op.outputs[k] if k < len(op.outputs) else ""
            x = op.inputs[j] if j < len(op.inputs) else ""
            if o and x and p.vars[x].dtype == p.vars[o].dtype:
                links.add((o, x))
        for a, b in links:
            ra, rb = self.find(a), self.find(b)
            if ra != rb:
                self.parent[ra] = rb
                self.classes.setdefault(rb, [rb]).extend(self.classes.pop(ra, [ra]))

    def members(self, x: str, among: set[str]) -> list[str]:
        """The vars of `among` sharing storage with `x` (`x` too, if among): from its class, not
        by searching `among` (every var defined so far, for each in-place write)."""
        r = self.find(x)
        return [m for m in self.classes.get(r, [r]) if m in among]


def check_inplace(p: Program, fetches: set[str]) -> tuple[_Aliases, set[str]]:
    """An op that writes an input in place (its row's `inplace`) must own that storage:
    nothing sharing it *when it is written* (the input, its views, what it was viewed
    from) may be read by a later op, be a feed (the caller's tensor) or a constant (the
    plan's); a persistable written in place must be updated to exactly that output
    (`program.updates`), or to what later in-place writes of that output make (local SGD averages
    the updated param in place). Fetched vars sharing it are returned, to be copied when they
    are computed (a persistable's own fetch reads its updated value). Returns the alias
    classes of the whole program and those fetches."""
    snapshots: set[str] = set()
    last = {x: i for i, op in enumerate(p.ops) for x in op.inputs if x}
    aliases = _Aliases()
    defined = set(p.inputs) | {v.name for v in p.vars.values() if v.persistable}
    rows: dict[str, registry.OpDef | None] = {}  # one lookup per op type
    written_into = _written_into(p, rows)
    for i, op in enumerate(p.ops):
        row = rows[op.type] if op.type in rows else rows.setdefault(op.type, registry.get(op.type))
        if row is not None and not row.inplace and not row.aliases:
            defined.update(o for o in op.outputs if o)  # writes nothing in place, shares nothing
            continue
        for k, j in row.inplace if row is not None else ():
            if k >= len(op.outputs) or not op.outputs[k]:
                continue  # an optional output (and input) this op does not have
            x = op.inputs[j] if j < len(op.inputs) else ""
            if not x:
                raise ValueError(f"{op.type} writes input {j} in place, which is omitted: {fmt_op(op)}")
            v = p.vars[x]
            if v.persistable and not _becomes(op.outputs[k], p.updates.get(x), written_into):
                raise ValueError(
                    f"{op.type} writes {x!r} in place, but program.updates does not update {x!r} to "
                    f"{op.outputs[k]!r}: {fmt_op(op)}"
                )
            for m in aliases.members(x, defined) if x in defined else [x]:
                kind = p.vars[m].kind
                if (
                    m != x
                    and p.vars[m].persistable
                    and not _becomes(op.outputs[k], p.updates.get(m), written_into)
                ):
                    raise ValueError(
                        f"{op.type} writes {x!r} in place, which shares storage with {kind} {m!r}, but "
                        f"program.updates does not update {m!r} to {op.outputs[k]!r}: {fmt_op(op)}"
                    )
                if kind == "constant" or (kind == "input" and m not in p.donated):
                    raise ValueError(
                        f"{op.type} writes {x!r} in place, which shares storage with {kind} {m!r}: "
                        f"{fmt_op(op)}"
                    )
                if last.get(m, -1) > i:
                    share = "" if m == x else f" (through {m!r}, which shares its storage)"
                    raise ValueError(
                        f"{op.type} writes {x!r} in place but op {last[m]} reads it later{share}: "
                        f"{fmt_op(op)}"
                    )
                if m in fetches and not (m == x and v.persistable):
                    snapshots.add(m)
        aliases.add(p, op)
        defined.update(o for o in op.outputs if o)
    return aliases, snapshots


def _written_into(p: Program, rows: dict) -> dict[str, str]:
    """value -> the output a later op writes into its storage in place (rows' `inplace`)."""
    out: dict[str, str] = {}
    for op in p.ops:
        row = rows[op.type] if op.type in rows else rows.setdefault(op.type, registry.get(op.type))
        for k, j in row.inplace if row is not None else ():
            if k < len(op.outputs) and op.outputs[k] and j < len(op.inputs) and op.inputs[j]:
                out[op.inputs[j]] = op.outputs[k]
    return out


def _becomes(value: str, target: str | None, written_into: dict[str, str]) -> bool:
    """Whether `value`'s storage ends as `target`: it is, or in-place writes lead from it there."""
    seen = set()
    while value != target and value in written_into and value not in seen:
        seen.add(value)
        value = written_into[value]
    return value == target


@dataclass
class _Layout:
    """A program as numbered slots and one step per op, what both ways of running it read.

    Slot s holds ``v<s>`` of the generated source; in the interpreter's list of values, the
    host copy ``h_v<s>`` of a constant is at n + s, the snapshot ``f_v<s>`` of a fetch at
    2n + s, and the last entry (index -1, an omitted input) is always None. A step is a tuple
    (op index, arg indices, lone output's slot or None, (output position, slot) pairs or None,
    snapshot slots, slots counted, counted as host memory, (state, new slot, old slot) updates,
    slots freed) of ints, strs and tuples of them, the empty tuple where there is nothing; the
    bound kernels are a list beside the steps. The garbage collector stops tracking such
    tuples after one look: a 100k-op plan adds no 100k objects to every later collection.
    """

    name: str
    track: bool
    n: int
    env: list  # what each run's values start as: constants (and host copies) in place, else None
    consts: list[int]  # the slots of constants
    loads: list[tuple[str, int]]  # persistables read from the scope S
    feeds: list[tuple[str, int]]  # inputs read from the feeds F
    steps: list[tuple]
    kernels: list  # per step, its op's bound kernel
    releases: list[int]  # fetched slots whose bytes stop counting before the return
    returns: list[tuple[str, object, bool]]  # ("slot" | "snap" | "scope", slot or name, copy it)
    reused: dict[int, int] = field(default_factory=dict)  # op -> the input its output is written over
    grouped: dict[int, int] = field(default_factory=dict)  # first op of a multi-tensor call -> its op count
    # Off the CPU: an update made into a new tensor (a step counter, a loss scale, new running
    # stats) is copied into the scope's tensor, which stays put: every persistable keeps its
    # storage from the first run on, as a CUDA graph's replay needs (`static_scope_updates`).
    static: bool = False


@without_gc  # a bulk build: see metaopt.ir.gc_pause
def build_plan(
    p: Program,
    fetches: list[str],
    device: torch.device,
    track: bool,
    runtime=None,
    *,
    compile_now: bool | None = None,
    multi: bool = True,
    shared_constants: SharedConstants | None = None,
) -> Plan:
    """Plan `p`; `runtime` (a `runtime.context.Runtime`) is what `needs_runtime` rows get.
    `compile_now`: compile now (True), interpret first (False), or by the op count (None).
    `multi`: run consecutive updates as one multi-tensor call (`_group_multi`); off, every op
    is its own step (a memory timeline records one entry per op). `shared_constants`: the
    device copies of constants other plans of the same executor made (`SharedConstants`)."""
    verify(p)  # once per program version: a broken program fails here, naming its line
    check_in_flight(p)
    layout, consts, persist = _plan_layout(p, fetches, device, track, runtime, multi, shared_constants)
    feeds = [name for name, _ in layout.feeds]
    plan = Plan(persist, consts, feeds, list(fetches), list(p.ops), layout, reused=layout.reused)
    if compile_now or (compile_now is None and len(p.ops) <= COMPILE_AT_ONCE_OPS):
        plan.compile()
    return plan


def _check_fetches(p: Program, fetches: list[str], persist: set[str], consts: set[str]) -> None:
    for f in fetches:
        if f not in p.vars:
            raise KeyError(f"fetch {f!r} is not a var of program {p.name!r}{did_you_mean(f, p.vars)}")
    produced = {o for op in p.ops for o in op.outputs if o}
    inputs = set(p.inputs)
    for f in fetches:
        if f not in produced and f not in persist and f not in consts and f not in inputs:
            raise ValueError(f"fetch {f!r} is never computed by program {p.name!r}")


class _Slots(dict):
    """var name -> slot number, numbered in order of first use."""

    def __missing__(self, name: str) -> int:
        n = self[name] = len(self)
        return n


def _plan_layout(
    p: Program,
    fetches: list[str],
    device: torch.device,
    track: bool,
    runtime,
    multi: bool = True,
    shared: SharedConstants | None = None,
) -> tuple[_Layout, dict[str, torch.Tensor], list[str]]:
    """(layout, the constants on the device, the persistables used)."""
    # Constants belong to their program, not to the shared scope (two programs may
    # both have a "const_1"): the plan holds them, on the device and, where read as
    # host values, on the CPU.
    persist = [v.name for v in p.vars.values() if v.persistable and v.kind != "constant"]
    consts = {v.name for v in p.vars.values() if v.kind == "constant"}
    pset = set(persist)
    _check_fetches(p, fetches, pset, consts)
    # Last use of every var: fetches and update sources live to their sink.
    last, update_at = liveness(p, fetches)
    aliases, snapshots = check_inplace(p, set(fetches))
    frees: dict[int, list[str]] = {}
    fetched = set(fetches)
    for name, i in last.items():
        if name not in pset and name not in consts and name not in fetched:
            frees.setdefault(i, []).append(name)
    # host and device are the same memory on the CPU: nothing is read from a host copy there
    host_reads, uploads = host_placement(p)[1:] if device.type != "cpu" else (set(), {})
    slot = _Slots()
    values = _constants(
        p, sorted(consts & set(last)), {p.ops[i].inputs[j] for i, j in host_reads}, device, slot, shared
    )
    used_persist = [x for x in persist if x in last or x in p.updates]
    loads = [(name, slot[name]) for name in used_persist]
    feeds = [(name, slot[name]) for name in p.inputs if name in last]
    check = os.environ.get(CHECK_ALIASES) == "1"
    rows = {t: registry.get(t) for t in {op.type for op in p.ops}}  # one lookup per op type
    reused = plan_reuse(p, fetches)
    steps, kernels = [], []
    for i, op in enumerate(p.ops):
        row = rows[op.type]
        kernel = _bind(op, row, device, runtime, check, reused.get(i))
        kernels.append(_uploading(kernel, uploads[i], device) if i in uploads else kernel)
        to_host = track and row is not None and row.host_memory is not None and _to_host(op, row)
        steps.append(_op_step(i, op, slot, snapshots, track, to_host, update_at.get(i, ()), frees.get(i, ())))
    grouped: dict[int, int] = {}
    if multi and not check:  # the alias check wraps each op's kernel: a debugging run keeps them apart
        steps, kernels, grouped = _group_multi(p, rows, steps, kernels, set(uploads) | set(reused))
    if device.type == "meta":  # every kernel, multi-tensor groups too, under the host-read guard
        group = [p.ops[st[0] : st[0] + grouped.get(st[0], 1)] for st in steps]
        kernels = [guarded(k, ops) for k, ops in zip(kernels, group, strict=True)]
    releases, returns = _epilogue(fetches, slot, snapshots, pset, consts, aliases)
    n = len(slot)
    _read_host_copies(steps, host_reads, n)
    env: list = [None] * (3 * n + 1)
    for name, (dev, host) in values.items():
        env[slot[name]], env[n + slot[name]] = dev, host
    const_slots = [slot[c] for c in values]
    layout = _Layout(
        p.name,
        track,
        n,
        env,
        const_slots,
        loads,
        feeds,
        steps,
        kernels,
        releases,
        returns,
        reused,
        grouped,
        static=static_scope_updates(device),
    )
    return layout, {name: dev for name, (dev, _) in values.items()}, used_persist


def static_scope_updates(device: torch.device) -> bool:
    """Whether state updates on `device` are copied into the scope's tensors (`_Layout.static`):
    off the CPU, where a captured CUDA graph replays into fixed addresses; on the CPU a new value
    simply replaces the old one (no copy)."""
    return device.type != "cpu"


# The most param bytes one multi-tensor call updates: foreach Adam holds a temporary per param
# of the call at once (its denominators), so a call over every param of a large model would add a
# model-sized transient the per-op form never has; chunks of this size bound it.
MULTI_MAX_BYTES = 64 << 20


def _group_multi(
    p: Program, rows: dict, steps: list, kernels: list, apart: set[int]
) -> tuple[list, list, dict]:
    """Steps and kernels with each run of consecutive ops a row's `multi` form can run together
    (same type and attrs, the same inputs at its `host_inputs`: the learning rate, the step,
    found_inf) merged into one step calling it, chunked at `MULTI_MAX_BYTES` of params; and
    first op index -> the number of ops of each merged step. Ops in `apart` (reading uploaded host
    values, or written over an input) keep their own kernels."""
    runs: list[list[int]] = []
    held = 0  # param bytes of the last run
    for i, op in enumerate(p.ops):
        row = rows[op.type]
        size = (
            _bytes(p, op.inputs[0]) if row is not None and row.multi is not None and i not in apart else None
        )
        if size is None:
            continue
        if (
            runs
            and runs[-1][-1] == i - 1
            and held + size <= MULTI_MAX_BYTES
            and _joins(row, p.ops[runs[-1][0]], op)
        ):
            runs[-1].append(i)
            held += size
        else:
            runs.append([i])
            held = size
    runs = [r for r in runs if len(r) > 1]
    if not runs:
        return steps, kernels, {}
    first = {r[0]: r for r in runs}
    inside = {i for r in runs for i in r[1:]}
    out_steps, out_kernels, grouped = [], [], {}
    for step, kernel in zip(steps, kernels, strict=True):
        i = step[0]
        if i in inside:
            continue
        if i in first:
            ops = [p.ops[j] for j in first[i]]
            out_steps.append(_merged_step([steps[j] for j in first[i]], ops))
            out_kernels.append(_multi_kernel(rows[ops[0].type], ops))
            grouped[i] = len(ops)
        else:
            out_steps.append(step)
            out_kernels.append(kernel)
    return out_steps, out_kernels, grouped


def _bytes(p: Program, name: str) -> int | None:
    """A var's static size in bytes, None when a dim is symbolic or unknown."""
    v = p.vars.get(name)
    if v is None or v.shape is None or not all(isinstance(d, int) for d in v.shape):
        return None
    return math.prod(v.shape) * torch_dtype(v.dtype).itemsize


def _joins(row, a: Op, b: Op) -> bool:
    """May `b` join the run that `a` starts (same type and attrs, the same host inputs)?"""
    if a.type != b.type or a.attrs != b.attrs or len(a.inputs) != len(b.inputs):
        return False
    # a row deciding per op: every input must agree
    host = row.host_inputs if not callable(row.host_inputs) else range(len(a.inputs))
    return all(a.inputs[j] == b.inputs[j] for j in host if j < len(a.inputs))


def _merged_step(parts: list[tuple], ops: list[Op]) -> tuple:
    """One step running `parts` (steps of consecutive ops) as one call whose flat result holds
    each op's outputs in turn."""
    args, outs, snaps, counted, ups, frees, at = [], [], [], [], [], [], 0
    for (_, a, out, o, sn, c, _to_host, u, f), op in zip(parts, ops, strict=True):
        args += a
        outs += [(at, out)] if o is None else [(at + j, s) for j, s in o]
        at += len(op.outputs)
        snaps += sn
        counted += c
        ups += u
        frees += f
    return (
        parts[0][0],
        tuple(args),
        None,
        tuple(outs),
        tuple(snaps),
        tuple(counted),
        False,
        tuple(ups),
        tuple(frees),
    )


def _multi_kernel(row: registry.OpDef, ops: list[Op]):
    """The kernel of a merged step: the flat args split per op, `row.multi` over them, the
    per-op outputs flattened."""
    sizes = [len(op.inputs) for op in ops]
    nout = len(ops[0].outputs)
    kw = dict(ops[0].attrs)
    if row.needs_outputs:
        kw["_nout"] = nout
    multi = row.multi

    def run(*flat):
        groups, at = [], 0
        for n in sizes:
            groups.append(flat[at : at + n])
            at += n
        return tuple(x for r in multi(groups, **kw) for x in r)

    return run


class SharedConstants:
    """One executor's device copies of program constants, by the value tensor they copy: the
    programs a pipeline stage is cut into (its phases) share their value tensors (Program.clone
    shares `values`, which are read-only), so their plans share one device copy of each
    constant, as `estimate_memory` counts it, instead of one per plan. An entry is found only
    while its value tensor lives and is unchanged (a weak reference and its version counter),
    and while a plan holds its copy (held weakly here: a copy no plan holds is freed)."""

    def __init__(self) -> None:
        self._copies: dict[tuple[int, str], tuple[weakref.ref, int, weakref.ref]] = {}

    def get(self, value: torch.Tensor, device: torch.device) -> torch.Tensor:
        key = (id(value), str(device))
        hit = self._copies.get(key)
        copy = hit[2]() if hit is not None and hit[0]() is value and hit[1] == value._version else None
        if copy is not None:
            return copy
        copy = value.detach().to(device, copy=True)
        self._copies = {k: e for k, e in self._copies.items() if e[0]() is not None and e[2]() is not None}
        self._copies[key] = (weakref.ref(value), value._version, weakref.ref(copy))
        return copy


def _constants(
    p: Program,
    names: list[str],
    host: set[str],
    device: torch.device,
    slot: _Slots,
    shared: SharedConstants | None = None,
) -> dict:
    """name -> (the constant on the device, its host copy where an op reads one, else None)."""
    out = {}
    for name in names:
        value = p.values[name].detach()
        slot[name]  # numbered in this order (the generated names follow it)
        on_device = shared.get(p.values[name], device) if shared is not None else value.to(device, copy=True)
        out[name] = (on_device, value.cpu() if name in host else None)
    return out


def _to_host(op: Op, row: registry.OpDef | None) -> bool:
    """Are the op's outputs in host memory (counted in the host account)?"""
    return row is not None and row.host_memory is not None and bool(row.host_memory(op.attrs))


def _op_step(
    i: int,
    op: Op,
    slot: _Slots,
    snapshots: set[str],
    track: bool,
    to_host: bool,
    updates: Iterable[tuple[str, str]],
    frees: Iterable[str],
) -> tuple:
    """Op `i`'s step (see `_Layout`); slots are numbered in the order the source names them."""
    # Lists made into tuples, and () where empty (most snapshots, updates): a 100k-op plan is
    # built once per program version, and this is its per-op cost.
    args = tuple([slot[x] if x else -1 for x in op.inputs])
    outputs = op.outputs
    if len(outputs) == 1:
        out, outs = slot[outputs[0]], None
        counted = (out,) if track and outputs[0] else ()
    else:
        out, outs = None, tuple([(j, slot[o]) for j, o in enumerate(outputs) if o])
        counted = tuple([slot[o] for o in outputs if o]) if track else ()
    snaps = tuple([slot[o] for o in outputs if o in snapshots]) if snapshots else ()
    ups = tuple([(target, slot[new], slot[target]) for target, new in updates]) if updates else ()
    return i, args, out, outs, snaps, counted, to_host, ups, tuple([slot[x] for x in frees])


def _read_host_copies(steps: list[tuple], host_reads: set[tuple[int, int]], n: int) -> None:
    """Point the args that read a constant's host copy (CUDA) at it: slot + n."""
    for i in {i for i, _ in host_reads}:
        step = steps[i]
        args = tuple(a + n if (i, j) in host_reads else a for j, a in enumerate(step[1]))
        steps[i] = (step[0], args, *step[2:])


def _epilogue(fetches, slot, snapshots, pset, consts, aliases):  # noqa: ANN001, ANN202
    """(slots released before returning, what each fetch returns).

    A fetched persistable is its value after the run (updated, as Fleet's in-place ops
    leave it). Whatever may share storage with state or constants is returned as a
    copy: the next run updates state in place, and constants are the plan's."""
    held = {aliases.find(x) for x in (*pset, *consts)}
    returns = []
    for f in fetches:
        if f in snapshots:
            returns.append(("snap", slot[f], False))
        else:
            where = ("scope", f) if f in pset else ("slot", slot[f])
            returns.append((*where, aliases.find(f) in held))
    # a name fetched twice is released once
    releases = [slot[f] for f in dict.fromkeys(fetches) if f not in pset and f not in consts]
    return releases, returns


def _source(layout: _Layout, ops: list[Op]) -> tuple[str, dict[int, int]]:
    """The generated straight-line function, and source line (1-based) -> op index.

    Like torch.fx's codegen: each var is a local, each op one call of its bound kernel, and
    a non-persistable var is dropped (``del``) right after its last use, so the interpreter
    frees it exactly when torch.fx's Interpreter would. Memory accounting calls are emitted
    next to allocations and frees."""
    track = layout.track
    lines = ["def run(S, F, T):"]
    for name, s in layout.loads:
        lines.append(f"    v{s} = S[{name!r}]")
    for name, s in layout.feeds:
        lines.append(f"    v{s} = F[{name!r}]")
        if track:
            lines.append(f"    T.acquire(v{s})")
    op_of_line: dict[int, int] = {}
    for step in layout.steps:
        first = len(lines) + 1  # the 1-based line number of this op's first generated line
        into = layout.reused.get(step[0])
        what = ops[step[0]].type + ("" if into is None else f", written over input {into}")
        k = layout.grouped.get(step[0])
        if k:
            what += f" x {k} (ops {step[0]}-{step[0] + k - 1}): one multi-tensor call"
        _step_lines(step, what, layout.n, track, lines, layout.static)
        op_of_line.update(dict.fromkeys(range(first, len(lines) + 1), step[0]))
    if track:
        lines += [f"    T.release(v{s})" for s in layout.releases]
    out = ", ".join(_return_text(kind, key, copy) for kind, key, copy in layout.returns)
    lines.append(f"    return ({out}{',' if len(layout.returns) == 1 else ''})")
    return "\n".join(lines) + "\n", op_of_line


def _step_lines(
    step: tuple, op_type: str, n: int, track: bool, lines: list[str], static: bool = False
) -> None:
    i, args, out, outs, snaps, counted, to_host, updates, frees = step
    call = f"k{i}(" + ", ".join("None" if a < 0 else f"h_v{a - n}" if a >= n else f"v{a}" for a in args) + ")"
    if outs is None:
        lines.append(f"    v{out} = {call}  # {op_type}")
        lines.append(f"    if type(v{out}) is tuple: v{out} = v{out}[0]")
    else:
        lines.append(f"    _t = {call}  # {op_type}")
        lines += [f"    v{s} = _t[{j}]" for j, s in outs]
        lines.append("    del _t")
    # fetched, and an in-place op later writes its storage: keep a copy
    lines += [f"    f_v{s} = v{s}.clone()" for s in snaps]
    if track:
        lines += [f"    T.acquire(v{s}{', True' if to_host else ''})" for s in counted]
        lines.append("    T.mark()")
    for target, new, old in updates:
        if static:  # the scope's tensor stays put; a new value is copied into it (`_Layout.static`)
            # `new` stays its own tensor (a fetch of it must not change with the next run), freed
            # and uncounted at its last use like any value; the scope's tensor stays counted
            lines.append(f"    if v{new} is not v{old}: v{old}.copy_(v{new})")
            lines.append(f"    del v{old}")
            continue
        lines.append(f"    S[{target!r}] = v{new}")
        if track:
            lines.append(f"    T.acquire(v{new}); T.release(v{old})")
        # Nothing reads the old value after this point: drop it now, so a step
        # holds one copy of each param, not two, by its end.
        lines.append(f"    del v{old}")
    for s in frees:
        if track:
            lines.append(f"    T.release(v{s})")
        lines.append(f"    del v{s}")


def _return_text(kind: str, key, copy: bool) -> str:  # noqa: ANN001
    if kind == "snap":
        return f"f_v{key}"
    expr = f"S[{key!r}]" if kind == "scope" else f"v{key}"
    return f"{expr}.clone()" if copy else expr


def _globals(layout: _Layout) -> dict[str, object]:
    """The generated function's globals: bound kernels ``k<op>``, constants ``v<slot>`` and
    their host copies ``h_v<slot>``."""
    g: dict[str, object] = {f"k{step[0]}": k for step, k in zip(layout.steps, layout.kernels, strict=True)}
    for s in layout.consts:
        g[f"v{s}"] = layout.env[s]
        if layout.env[layout.n + s] is not None:
            g[f"h_v{s}"] = layout.env[layout.n + s]
    return g


def _interpret(t: _Layout, S, F, T) -> tuple:
    """Run the steps in order, doing what the generated source does line by line."""
    R = t.env[:]
    get = R.__getitem__
    track = t.track
    snap = 2 * t.n
    for name, s in t.loads:
        R[s] = S[name]
    for name, s in t.feeds:
        R[s] = F[name]
        if track:
            T.acquire(R[s])
    i = None  # the op running: Plan.failed_op reads it from this frame
    steps = zip(t.kernels, t.steps, strict=True)
    for kernel, (i, args, out, outs, snaps, counted, to_host, updates, frees) in steps:  # noqa: B007
        r = kernel(*map(get, args))
        if outs is None:
            R[out] = r[0] if type(r) is tuple else r
        else:
            for j, s in outs:
                R[s] = r[j]
        r = None  # held no longer than the generated source holds it
        for s in snaps:
            R[snap + s] = R[s].clone()
        if track:
            for s in counted:
                T.acquire(R[s], to_host)
            T.mark()
        for target, new, old in updates:
            if t.static:  # the scope's tensor stays put (`_Layout.static`; as compiled)
                if R[new] is not R[old]:
                    R[old].copy_(R[new])
            else:
                S[target] = R[new]
                if track:
                    T.acquire(R[new])
                    T.release(R[old])
            R[old] = None
        for s in frees:
            if track:
                T.release(R[s])
            R[s] = None
    i = None  # noqa: F841 - past the ops: an error from here on is no op's (Plan.failed_op)
    if track:
        for s in t.releases:
            T.release(R[s])
    out = []
    for kind, key, copy in t.returns:
        x = S[key] if kind == "scope" else R[snap + key] if kind == "snap" else R[key]
        out.append(x.clone() if copy else x)
    return tuple(out)


_INTERPRET_CODE = _interpret.__code__
