"""Compile a Program into a straight-line Python function (once per program version).

Like torch.fx's codegen: each var is a local, each op one call of its bound
kernel, and a non-persistable var is dropped (``del``) right after its last
use, so the interpreter frees it exactly when torch.fx's Interpreter would.
Memory accounting calls are emitted next to allocations and frees.

Errors name the op. The generated source is registered with `linecache` under a
unique filename (``<metaopt plan NAME #N>``), so a traceback through a plan shows its
generated lines, and `Plan.run` turns an exception escaping the plan into one whose
message starts ``while running op I: <the op's printed line>``, with the original as
``__cause__``. The op is found from the traceback's line in the generated source
(`Plan.op_of_line`, kept while generating): the hot path has no per-op try/except.
Tracebacks formatted by the `traceback` module (pytest, logging, ``traceback.print_exc``,
the default hook from Python 3.13) show the generated lines; the interpreter's own printer
of an uncaught error before 3.13 reads real files only, and shows the frame without it.
"""

from __future__ import annotations

import functools
import itertools
import linecache
import os
import weakref
from dataclasses import dataclass, field

import torch

from metaopt.ir import Op, Program, did_you_mean, verify
from metaopt.ir.liveness import liveness
from metaopt.ir.printer import fmt_op
from metaopt.ops import registry


@dataclass
class Plan:
    fn: object  # fn(S, F, T) -> tuple of fetched tensors
    source: str
    persistables: list[str]  # scope names the program reads or updates
    constants: dict[str, torch.Tensor]  # the program's constants on the device, held by the plan
    feeds: list[str]
    fetches: list[str]
    filename: str = ""  # the generated source's name in tracebacks (registered with linecache)
    ops: list[Op] = field(default_factory=list)  # the program's ops when compiled, by index
    op_of_line: dict[int, int] = field(default_factory=dict)  # source line (1-based) -> op index

    def run(self, S, F, T) -> tuple:
        """`fn(S, F, T)`, naming the op in an error that escapes it.

        An `Exception` raised while running op ``i`` (its kernel, or the bookkeeping lines
        emitted with it) is re-raised as ``while running op i: <fmt_op line>``, followed on
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
        try:
            return self.fn(S, F, T)
        except Exception as e:
            err = self.op_error(e)
            if err is None:
                raise
            raise err from e

    def op_error(self, e: BaseException) -> BaseException | None:
        """The error naming the op that raised `e` (see `run`); None if no op did."""
        code = getattr(self.fn, "__code__", None)
        line = None
        tb = e.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code is code:
                line = tb.tb_lineno  # the plan is one frame: the first match is the op's line
                break
            tb = tb.tb_next
        i = self.op_of_line.get(line) if line is not None else None
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


def host_placement(p: Program) -> tuple[set[str], set[tuple[int, int]]]:
    """(vars computed on the host, (op index, input index) pairs that read a host copy).

    Shape arithmetic stays on the CPU: Shape/Size outputs are host values, an op
    whose run-time inputs are all host values computes on the host, and a
    constant read by such an op or at a row's `host_inputs` position is read from
    the host mirror. Everything else lives on the executor's device.
    """
    consts = {v.name for v in p.vars.values() if v.kind == "constant"}
    host: set[str] = set()
    reads: set[tuple[int, int]] = set()
    for i, op in enumerate(p.ops):
        row = registry.get(op.type)
        runtime = [x for x in op.inputs if x and x not in consts]
        # Ops that create tensors on the executor's device (`needs_device`, copies and
        # collectives) never compute on the host, whatever their inputs.
        on_device = row is not None and (row.needs_device or row.needs_runtime)
        on_host = row is not None and (
            row.host_outputs or (not on_device and runtime and all(x in host for x in runtime))
        )
        if on_host:
            host.update(o for o in op.outputs if o)
        for j, x in enumerate(op.inputs):
            if x in consts and (on_host or (row is not None and j in row.host_inputs)):
                reads.add((i, j))
    return host, reads


def _bind(op, device: torch.device, runtime):
    row = registry.get(op.type)
    if row is None:
        raise NotImplementedError(f"no kernel for op type {op.type!r}: {fmt_op(op)}")
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
    kernel = functools.partial(row.kernel, **kw) if kw else row.kernel
    return _alias_checked(kernel, op, row) if os.environ.get(CHECK_ALIASES) == "1" else kernel


CHECK_ALIASES = "METAOPT_CHECK_ALIASES"


def _alias_checked(kernel, op, row):
    """`kernel`, checking after every call that an output shares storage with an input only
    where the row declares it (`aliases`, `inplace`): a debugging mode (the zoo runs with it),
    since an undeclared alias lets an in-place update corrupt a value still to be read."""
    declared = set(registry.alias_pairs(op) or ()) | set(row.inplace)

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

    def members(self, x: str, among: set[str]) -> list[str]:
        r = self.find(x)
        return [m for m in among if self.find(m) == r]


def check_inplace(p: Program, fetches: set[str]) -> tuple[_Aliases, set[str]]:
    """An op that writes an input in place (its row's `inplace`) must own that storage:
    nothing sharing it *when it is written* (the input, its views, what it was viewed
    from) may be read by a later op, be a feed (the caller's tensor) or a constant (the
    plan's); a persistable written in place must be updated to exactly that output
    (`program.updates`). Fetched vars sharing it are returned, to be copied when they
    are computed (a persistable's own fetch reads its updated value). Returns the alias
    classes of the whole program and those fetches."""
    snapshots: set[str] = set()
    last = {x: i for i, op in enumerate(p.ops) for x in op.inputs if x}
    aliases = _Aliases()
    defined = set(p.inputs) | {v.name for v in p.vars.values() if v.persistable}
    for i, op in enumerate(p.ops):
        row = registry.get(op.type)
        for k, j in row.inplace if row is not None else ():
            if k >= len(op.outputs) or not op.outputs[k]:
                continue  # an optional output (and input) this op does not have
            x = op.inputs[j] if j < len(op.inputs) else ""
            if not x:
                raise ValueError(f"{op.type} writes input {j} in place, which is omitted: {fmt_op(op)}")
            v = p.vars[x]
            if v.persistable and p.updates.get(x) != op.outputs[k]:
                raise ValueError(
                    f"{op.type} writes {x!r} in place, but program.updates does not update {x!r} to "
                    f"{op.outputs[k]!r}: {fmt_op(op)}"
                )
            for m in aliases.members(x, defined) if x in defined else [x]:
                kind = p.vars[m].kind
                if m != x and p.vars[m].persistable and p.updates.get(m) != op.outputs[k]:
                    raise ValueError(
                        f"{op.type} writes {x!r} in place, which shares storage with {kind} {m!r}, but "
                        f"program.updates does not update {m!r} to {op.outputs[k]!r}: {fmt_op(op)}"
                    )
                if kind in ("input", "constant"):
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


def build_plan(p: Program, fetches: list[str], device: torch.device, track: bool, runtime=None) -> Plan:
    """Compile `p`; `runtime` (a `runtime.context.Runtime`) is what `needs_runtime` rows get."""
    verify(p)  # once per program version: a broken program fails here, naming its line
    for f in fetches:
        if f not in p.vars:
            raise KeyError(f"fetch {f!r} is not a var of program {p.name!r}{did_you_mean(f, p.vars)}")
    produced = {o for op in p.ops for o in op.outputs if o}
    # Constants belong to their program, not to the shared scope (two programs may
    # both have a "const_1"): the plan holds them, on the device and, where read as
    # host values, on the CPU.
    persist = [v.name for v in p.vars.values() if v.persistable and v.kind != "constant"]
    consts = {v.name for v in p.vars.values() if v.kind == "constant"}
    pset = set(persist)
    for f in fetches:
        if f not in produced and f not in pset and f not in consts and f not in p.inputs:
            raise ValueError(f"fetch {f!r} is never computed by program {p.name!r}")

    slot: dict[str, str] = {}

    def local(name: str) -> str:
        if name not in slot:
            slot[name] = f"v{len(slot)}"
        return slot[name]

    # Last use of every var: fetches and update sources live to their sink.
    last, update_at = liveness(p, fetches)
    aliases, snapshots = check_inplace(p, set(fetches))
    frees: dict[int, list[str]] = {}
    for name, i in last.items():
        if name not in pset and name not in consts:
            frees.setdefault(i, []).append(name)

    g: dict[str, object] = {}
    lines = ["def run(S, F, T):"]
    if device.type == "cpu":
        host_reads: set[tuple[int, int]] = set()  # host and device are the same memory
    else:
        _, host_reads = host_placement(p)
    dev_consts: dict[str, torch.Tensor] = {}
    for name in sorted(consts & set(last)):
        value = p.values[name].detach()
        if any(name == p.ops[i].inputs[j] for i, j in host_reads):
            g["h_" + local(name)] = value.cpu()
        dev_consts[name] = g[local(name)] = value.to(device, copy=True)
    used_persist = [x for x in persist if x in last or x in p.updates]
    for name in used_persist:
        lines.append(f"    {local(name)} = S[{name!r}]")
    for name in p.inputs:
        if name in last:
            lines.append(f"    {local(name)} = F[{name!r}]")
            if track:
                lines.append(f"    T.acquire({local(name)})")
    op_of_line: dict[int, int] = {}
    for i, op in enumerate(p.ops):
        first = len(lines) + 1  # the 1-based line number of this op's first generated line
        k = f"k{i}"
        g[k] = _bind(op, device, runtime)
        args = ", ".join(
            ("h_" + local(x) if (i, j) in host_reads else local(x)) if x else "None"
            for j, x in enumerate(op.inputs)
        )
        outs = list(op.outputs)
        if len(outs) == 1:
            o = local(outs[0])
            lines.append(f"    {o} = {k}({args})  # {op.type}")
            lines.append(f"    if type({o}) is tuple: {o} = {o}[0]")
        else:
            tmp = "_t"
            lines.append(f"    {tmp} = {k}({args})  # {op.type}")
            for j, o in enumerate(outs):
                if o:
                    lines.append(f"    {local(o)} = {tmp}[{j}]")
            lines.append(f"    del {tmp}")
        for o in outs:
            if o in snapshots:  # fetched, and an in-place op later writes its storage: keep a copy
                lines.append(f"    f_{local(o)} = {local(o)}.clone()")
        if track:
            row = registry.get(op.type)
            to_host = row is not None and row.host_memory is not None and row.host_memory(op.attrs)
            for o in outs:
                if o:
                    lines.append(f"    T.acquire({local(o)}{', True' if to_host else ''})")
            lines.append("    T.mark()")
        for target, new in update_at.get(i, []):
            lines.append(f"    S[{target!r}] = {local(new)}")
            if track:
                lines.append(f"    T.acquire({local(new)}); T.release({local(target)})")
            # Nothing reads the old value after this point: drop it now, so a step
            # holds one copy of each param, not two, by its end.
            lines.append(f"    del {local(target)}")
        for name in frees.get(i, []):
            if name in fetches:
                continue
            if track:
                lines.append(f"    T.release({local(name)})")
            lines.append(f"    del {local(name)}")
        op_of_line.update(dict.fromkeys(range(first, len(lines) + 1), i))
    # A fetched persistable is its value after the run (updated, as Fleet's in-place ops
    # leave it). Whatever may share storage with state or constants is returned as a
    # copy: the next run updates state in place, and constants are the plan's.
    held = {aliases.find(x) for x in (*pset, *consts)}

    def fetched(f: str) -> str:
        if f in snapshots:
            return f"f_{local(f)}"
        expr = f"S[{f!r}]" if f in pset else local(f)
        return f"{expr}.clone()" if aliases.find(f) in held else expr

    out = ", ".join(fetched(f) for f in fetches)
    lines.append(f"    return ({out}{',' if len(fetches) == 1 else ''})")
    if track:
        for f in dict.fromkeys(fetches):  # a name fetched twice is released once
            if f not in pset and f not in consts:
                lines.insert(-1, f"    T.release({local(f)})")
    source = "\n".join(lines) + "\n"
    fn, filename = _register_source(source, p.name, g)
    feeds = [x for x in p.inputs if x in last]
    return Plan(fn, source, used_persist, dev_consts, feeds, list(fetches), filename, list(p.ops), op_of_line)
