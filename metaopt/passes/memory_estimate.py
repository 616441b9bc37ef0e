"""Predicted peak of live bytes, from the program alone (no run), for a given batch.

It replays what the executor does: persistables, constants and feeds are live from
the start; each op's outputs become live when it runs (a `view` row's outputs share
their input's storage and add nothing, unless its kernel copies a value it cannot view:
`memory_layout.Layouts`; as do outputs written in place into an
input); a value dies after its last reader, and its
storage when the last value holding it dies. The executor's own accounting is the
measurement this predicts (`exe.memory_stats()["peak_bytes"]`).

An op whose row declares a `workspace` (a chunked kernel: LinearCrossEntropy holds one chunk
of logits while it runs) adds those bytes at that op. The executor counts vars, not a kernel's
temporaries, so with ``workspace=False`` the estimate is what it measures; the default counts
them, as the device (``torch.cuda.max_memory_allocated``) does.

Besides the peak, the replay keeps the live bytes at every op (`MemoryEstimate.timeline`,
the series the memory picture plots) and what is alive at the peak op
(`MemoryEstimate.where`, printable): both come from the same single pass, so asking for
them costs a list append per op and a record per storage, not a second replay.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from metaopt.ir import Op, Program, Var, eval_dim
from metaopt.ir.liveness import liveness
from metaopt.ir.printer import fmt_op
from metaopt.ops import registry
from metaopt.ops.reuse import plan_reuse
from metaopt.passes.memory_layout import Layouts

_FOREVER = 1 << 62  # the death of a storage alive at the end of the step


@dataclass(frozen=True)
class LiveVar:
    """One storage alive at an op: the var that made it, its bytes, and who made it."""

    name: str  # the var that made the storage (it may be dead while a view still holds it)
    nbytes: int
    kind: str  # the var's kind: param, opt_state, activation, grad, input ...
    role: str  # the producing op's role; values alive before the first op: their kind
    op: int  # the producing op's index; -1: alive before the first op (state, feeds)
    views: tuple[str, ...] = ()  # other vars alive there sharing this storage (views, in place)


@dataclass(frozen=True)
class MemoryWhere:
    """What is alive at one op (the peak, by default): storages by size, largest first.

    ``str()`` prints the op, the bytes by role and a table of the largest storages; the
    ``by_role`` sums are device bytes (host copies are listed in ``host_bytes`` only)."""

    op: int  # -1: before the first op
    op_text: str  # the op's printed line ("" for -1)
    total_bytes: int  # device bytes alive there (workspace included)
    vars: tuple[LiveVar, ...]
    workspace_bytes: int = 0  # the op's kernel temporaries, counted in total_bytes
    host_bytes: int = 0  # offloaded copies in host memory there (not device bytes)

    def by_role(self) -> dict[str, int]:
        """Device bytes alive there per role (a var made by no op: its kind), largest first."""
        sums: dict[str, int] = defaultdict(int)
        for v in self.vars:
            sums[v.role] += v.nbytes
        if self.workspace_bytes:
            sums["workspace"] += self.workspace_bytes
        return dict(sorted(sums.items(), key=lambda kv: -kv[1]))

    def largest(self, n: int = 10) -> tuple[LiveVar, ...]:
        return self.vars[:n]

    def format(self, n: int = 15) -> str:
        """The printable view with the `n` largest storages (``str()`` is ``format(15)``)."""
        head = f"op {self.op}: {self.op_text.strip()}" if self.op >= 0 else "before the first op"
        lines = [f"{human_bytes(self.total_bytes)} alive at {head}"]
        roles = ", ".join(f"{r} {human_bytes(b)}" for r, b in self.by_role().items())
        lines.append(f"  by role: {roles}")
        if self.host_bytes:
            lines.append(f"  host memory (offloaded copies, not counted): {human_bytes(self.host_bytes)}")
        lines.append(f"  {'bytes':>10}  {'kind':<10}  {'role':<10}  {'made at':>7}  var")
        for v in self.vars[:n]:
            made = "start" if v.op < 0 else str(v.op)
            also = f"  (also {', '.join(v.views)})" if v.views else ""
            size = human_bytes(v.nbytes)
            lines.append(f"  {size:>10}  {v.kind:<10}  {v.role:<10}  {made:>7}  {v.name}{also}")
        if len(self.vars) > n:
            rest = sum(v.nbytes for v in self.vars[n:])
            lines.append(f"  ... {len(self.vars) - n} more storages, {human_bytes(rest)}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


@dataclass
class MemoryEstimate:
    peak_bytes: int
    persistable_bytes: int
    peak_op: int  # index of the op at which the peak is reached
    # live device bytes at each op: its outputs made (and its workspace), its dead inputs not
    # yet freed; the executor's measured timeline counts at the same point
    timeline: list[int] = field(default_factory=list, repr=False)
    where: MemoryWhere | None = field(default=None, repr=False)  # what is alive at peak_op
    # each fetched var -> the var whose storage it is on at the end (itself, an input it is a
    # view of ...; None: a persistable's, whose bytes are counted already)
    storage_of: dict[str, str | None] = field(default_factory=dict, repr=False)
    # this worker's host memory beside the device's (`host_memory`): by what holds it
    host: dict[str, int] = field(default_factory=dict, repr=False)

    @property
    def activation_peak_bytes(self) -> int:
        return self.peak_bytes - self.persistable_bytes

    @property
    def host_bytes(self) -> int:
        return sum(self.host.values())


def estimate_memory(
    p: Program,
    *,
    dims: dict[str, int],
    fetches: tuple[str, ...] = (),
    workspace: bool = True,
    device: str = "cpu",
    at: int | None = None,
) -> MemoryEstimate:
    """The peak of live bytes when `p` runs with symbolic dims bound by `dims` on `device` (a
    `DEVICE_FORMS` entry: vars only another kind of device makes count nothing); `workspace`:
    add the temporaries of ops whose rows declare them (module doc). The result also holds
    the live bytes at every op (`timeline`) and what is alive at op `at` (`where`; default the
    peak's)."""
    replay = _Replay(p, dims, fetches, workspace, device)
    replay.run()
    peak_op = replay.peak_op
    where = replay.where(peak_op if at is None else at)
    storage_of = {}
    for f in fetches:
        owner = replay.storage.get(f, f)
        storage_of[f] = None if owner in replay.persistent else owner
    est = MemoryEstimate(replay.peak, replay.persistable, peak_op, replay.timeline, where, storage_of)
    est.host = host_memory(p, dims, replay)
    return est


def persistable_bytes(p: Program, *, dims: dict[str, int], device: str = "cpu") -> int:
    """`estimate_memory(...).persistable_bytes` without the replay: the device bytes of the
    persistables (state in host memory, ZeRO-Offload's, left out), alive all step."""
    return sum(_nbytes(v, dims, device) for v in p.vars.values() if v.persistable and not v.host)


def _nbytes(v: Var, dims: dict[str, int], device: str) -> int:
    if v.device is not None and v.device != device:  # another device's saved output: None here
        return 0
    return v.nbytes(dims) or 0


def host_memory(p: Program, dims: dict[str, int], replay: _Replay | None = None) -> dict[str, int]:
    """What this worker holds in host memory, beside the device's bytes, by what holds it:

    * ``state``: persistables kept in host memory between steps (ZeRO-Offload's ``Var.host``);
    * ``offloaded``: the peak of offload's host copies during a step;
    * ``program values``: the program's own initial values (`Program.values`, every storage once;
      a program exported on the meta device holds none of its params or state);
    * ``load transient``: the largest persistable this worker holds, which filling it
      (`fleet.load_pretrained`, a checkpoint load) reads into host memory before the device.

    On a CPU executor the device is the host: the executor's scope is host memory too."""
    replay = replay or _Replay(p, dims, (), True, "cpu")
    if replay.timeline == [] and p.ops:
        replay.run()
    seen: dict[tuple[int, int], int] = {}
    for t in p.values.values():
        if t is None or t.is_meta:
            continue
        st = t.untyped_storage()
        seen[(st.data_ptr(), st.nbytes())] = st.nbytes()
    persistent = [x for x in replay.persistent if p.vars[x].kind in ("param", "buffer", "opt_state")]
    return {
        "state": sum(replay.nbytes(x) for x in replay.on_host),
        "offloaded": replay.host_peak(),
        "program values": sum(seen.values()),
        "load transient": max((replay.nbytes(x) for x in persistent), default=0),
    }


def where_alive(p: Program, at: int, **options: Any) -> MemoryWhere:
    """What is alive at op `at` (any op, not only the peak's): the `where` view there; `options`
    are `estimate_memory`'s keywords."""
    if not -1 <= at < len(p.ops):
        raise IndexError(f"op index {at} is outside program {p.name!r} (ops 0..{len(p.ops) - 1})")
    where = estimate_memory(p, at=at, **options).where
    assert where is not None  # estimate_memory always fills it
    return where


@dataclass
class _Storage:
    nbytes: int
    born: int
    died: int = _FOREVER
    host: bool = False


class _Replay:
    """One pass over the ops counting live device bytes the executor's way (module doc)."""

    def __init__(
        self, p: Program, dims: dict[str, int], fetches: tuple[str, ...], workspace: bool, device: str
    ) -> None:
        self.p, self.dims, self.workspace, self.device = p, dims, workspace, device
        kept = [f for f in (*fetches, p.loss_name) if f]
        self.last, self.update_at = liveness(p, kept)
        self.reused = plan_reuse(p, kept)  # outputs the executor writes over a dying input
        self.persistent = {v.name for v in p.vars.values() if v.persistable}
        self.storage: dict[str, str] = {}  # live var -> the var whose storage it uses
        self.refs: dict[str, int] = dict.fromkeys(self.persistent, 1)  # state never dies
        self.storages: dict[str, _Storage] = {}  # every non-persistent storage made, by its var
        self.spans: dict[str, tuple[int, int]] = {}  # var -> (made at, freed after)
        self.made_at: dict[str, int] = {}
        self.state_freed: dict[str, int] = {}  # state whose storage an update released -> op
        self.holders: dict[str, list[str]] = defaultdict(list)  # storage -> the other vars on it
        # state held in host memory (ZeRO-Offload: Var.host) is the executor's host account
        self.on_host = {x for x in self.persistent if p.vars[x].host}
        self.live = self.persistable = persistable_bytes(p, dims=dims, device=device)
        for x in p.inputs:
            if x in self.last:
                self._new_storage(x, -1, host=False)
                self.storage[x], self.refs[x] = x, 1
        self.peak, self.peak_op = self.live, -1
        self.timeline: list[int] = []
        self.workspaces: dict[int, int] = {}  # op -> its kernel temporaries (nonzero only)
        self.layouts = Layouts(p, self._shape, device)  # which view rows' kernels copy instead

    def nbytes(self, name: str) -> int:
        return _nbytes(self.p.vars[name], self.dims, self.device)

    def _shape(self, name: str) -> tuple | None:
        v = self.p.vars.get(name) if name else None
        if v is None or v.shape is None:
            return None
        bound = tuple(eval_dim(d, self.dims) for d in v.shape)
        return None if None in bound else bound

    def _op_workspace(self, op: Op, row) -> int:  # noqa: ANN001 - a registry row
        if not self.workspace or row is None or row.workspace is None:
            return 0
        dtypes = [self.p.vars[x].dtype if x else "" for x in op.inputs]
        return row.workspace(op.attrs, [self._shape(x) for x in op.inputs], dtypes)

    def _new_storage(self, name: str, at: int, host: bool) -> None:
        self.storages[name] = _Storage(self.nbytes(name), at, host=host)
        if not host:
            self.live += self.storages[name].nbytes

    def run(self) -> None:
        for i, op in enumerate(self.p.ops):
            self._step(i, op)

    def _shapes(self, op: Op) -> list:
        return [self.p.vars[x].shape if x else None for x in op.inputs]

    def _step(self, i: int, op: Op) -> None:
        row = registry.get(op.type)
        # Which input's storage each output reuses: a view's input 0; an in-place pair's input.
        shares = {k: j for k, j in (row.inplace if row is not None else ())}
        if i in self.reused:
            shares[0] = self.reused[i]
        view = row is not None and (
            row.view or (row.view_if is not None and row.view_if(op, self._shapes(op)))
        )
        # which outputs are an input's storage, as its kernel ran on meta tensors (a view row's
        # copy, reshape of a transposed value, is new storage), else as the row says
        found = self.layouts.step(op, row, view)
        if found is not None:
            shares.update(found)
        elif view:
            shares.update({k: 0 for k in range(len(op.outputs))})
        # Outputs in host memory (offload's copies) are not device bytes: the executor
        # counts them in its host account.
        on_host = row is not None and row.host_memory is not None and bool(row.host_memory(op.attrs))
        for k, o in enumerate(op.outputs):
            if not o:
                continue
            src = op.inputs[shares[k]] if k in shares and shares[k] < len(op.inputs) else ""
            s = self.storage.get(src, src) if src in self.storage or src in self.persistent else o
            self.storage[o] = s
            self.made_at[o] = i
            if s == o:
                self._new_storage(o, i, on_host)
            else:
                self.holders[s].append(o)
            self.refs[s] = self.refs.get(s, 0) + 1
        transient = self._op_workspace(op, row)
        if transient:
            self.workspaces[i] = transient
        self.timeline.append(self.live + transient)
        if self.live + transient > self.peak:
            self.peak, self.peak_op = self.live + transient, i
        for target, new in self.update_at.get(i, ()):
            self._update(i, target, new)
        for x in {*op.inputs, *op.outputs}:
            if x and x in self.storage and x not in self.persistent and self.last.get(x) == i:
                s = self.storage.pop(x)
                self.spans[x] = (self.made_at.get(x, -1), i)
                self.refs[s] -= 1
                if self.refs[s] == 0:
                    st = self.storages.get(s)
                    if st is not None:
                        st.died = i
                        if not st.host:
                            self.live -= st.nbytes

    def _update(self, i: int, target: str, new: str) -> None:
        """State `target` takes `new`'s value after op `i` (as the executor does, after the op's
        count): an update written in place changes nothing; otherwise `new`'s storage becomes
        the state's (it never dies) and the old value's goes once nothing else holds it."""
        s = self.storage.get(new)
        if s is None or s in self.persistent:
            return  # written in place into the state (or into other state: its bytes stay)
        self.refs[s] += 1
        self.refs[target] -= 1
        if self.refs[target] == 0:
            if target not in self.on_host:
                self.live -= self.nbytes(target)
            self.state_freed[target] = i

    def _views(self, storage: str, at: int) -> tuple[str, ...]:
        """The other vars holding `storage` alive at op `at` (views, outputs written in place)."""
        out = []
        for name in self.holders.get(storage, ()):
            start, end = self.spans.get(name, (self.made_at.get(name, -1), _FOREVER))
            if start <= at <= end:
                out.append(name)
        return tuple(out)

    def host_peak(self) -> int:
        """The most bytes of offload's host copies alive at once (a sweep over their lives)."""
        events = sorted(
            (t, d)
            for st in self.storages.values()
            if st.host
            for t, d in ((st.born, st.nbytes), (st.died + 1, -st.nbytes))
        )
        live = peak = 0
        for _, d in events:  # at one op, frees (negative) sort before births
            live += d
            peak = max(peak, live)
        return peak

    def where(self, at: int) -> MemoryWhere:
        """What is alive after op `at`'s outputs are made, before its dead inputs are freed."""
        out: list[LiveVar] = []
        host = 0
        for name in self.persistent:
            v = self.p.vars[name]
            if name in self.on_host:
                host += self.nbytes(name) if at <= self.state_freed.get(name, _FOREVER) else 0
            elif self.nbytes(name) and at <= self.state_freed.get(name, _FOREVER):
                out.append(LiveVar(name, self.nbytes(name), v.kind, v.kind, -1, self._views(name, at)))
        for name, st in self.storages.items():
            if not st.born <= at <= st.died:
                continue
            if st.host:
                host += st.nbytes
                continue
            v = self.p.vars[name]
            role = self.p.ops[st.born].role if st.born >= 0 else v.kind
            out.append(LiveVar(name, st.nbytes, v.kind, role, st.born, self._views(name, at)))
        out.sort(key=lambda v: (-v.nbytes, v.name))
        ws = self.workspaces.get(at, 0)
        total = sum(v.nbytes for v in out) + ws
        text = fmt_op(self.p.ops[at]) if at >= 0 else ""
        return MemoryWhere(at, text, total, tuple(out), ws, host)


def human_bytes(n: float) -> str:
    """ "512 B", "3.1 KiB" ... "12.5 GiB" (GiB the largest unit)."""
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
