"""metaopt.Executor: runs a Program with torch kernels on one device.

Persistables (params, buffers, optimizer state, constants) live in `scope`
across runs; every other var is freed right after its last use (see `plan`).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from metaopt.ir import Program, Var, did_you_mean, roles, torch_dtype
from metaopt.ops.kernels.amp import watch_loss_scale
from metaopt.runtime.context import Runtime
from metaopt.runtime.memory import MemoryTracker, TimelineTracker, TimingTracker
from metaopt.runtime.place import Place, resolve
from metaopt.runtime.plan import Plan, SharedConstants, build_plan

logger = logging.getLogger("metaopt.runtime")

MAX_PLANS = 32  # compiled plans kept per executor (each holds its program's constants)


class Scope(dict):
    """name -> tensor of every persistable the executor has materialised."""


# A gradient-merge window this long without an update is worth a word (then 10x, 100x ...):
# k_steps beyond it is far past any accumulation in practice and looks like a slip.
MERGE_WARN_RUNS = 1000


class Executor:
    def __init__(
        self,
        place: Place = "cpu",
        *,
        track_memory: bool = True,
        record_timeline: bool = False,
        record_op_times: bool = False,
        cuda_graph: bool = False,
    ) -> None:
        """`record_timeline`: also keep the live bytes after each op of the last run
        (`memory_timeline`); off, the executor pays nothing for it (runtime/memory.py).
        `record_op_times`: that and each op's seconds (`op_seconds`), ops run one at a time.
        `cuda_graph=True` (whole-step CUDA graphs) is not implemented yet: refused by name."""
        if cuda_graph:
            raise NotImplementedError(
                "Executor(cuda_graph=True): whole-step CUDA-graph capture is not implemented yet; steps "
                "are capture-safe (Executor('meta') proves it) and run op by op"
            )
        record_timeline = record_timeline or record_op_times
        if record_timeline and not track_memory:
            raise ValueError(
                "Executor(record_timeline=True) needs track_memory=True (it records that count; "
                "record_op_times=True records it too)"
            )
        self.device = resolve(place)
        self.scope = Scope()
        self.track_memory = track_memory
        self._tracker = (
            TimingTracker() if record_op_times else TimelineTracker() if record_timeline else MemoryTracker()
        )
        self._constants = SharedConstants()  # one device copy of a constant for all its plans
        # a timeline has one entry per op: updates then run op by op, not as multi-tensor calls
        self._multi = not record_timeline
        self.runtime = Runtime(self.device)  # copy streams, pinned buffers, communicator
        self._plans: dict[tuple, Plan] = {}
        self._runners: dict[tuple, Any] = {}  # pipeline stage programs' runners
        self._bad_losses = 0  # runs whose fetched loss was NaN or inf (`_watch_loss`)

    # --- running ---------------------------------------------------------------
    def run(
        self,
        program: Program,
        feed: Mapping[str, Any] | None = None,
        fetch_list: Iterable[str | Var] | None = None,
        return_numpy: bool = True,
    ) -> list[Any]:
        """Run `program` once; returns the fetched values in `fetch_list` order (on the meta
        device: meta tensors, whatever `return_numpy` says; there are no values to copy)."""
        fetches = [f.name if isinstance(f, Var) else f for f in (fetch_list or [])]
        return_numpy = return_numpy and self.device.type != "meta"
        if program.pipeline is not None:
            self._start_step()  # one step of counters for all the micro-batches' parts
            out = self._pipeline_runner(program).run(feed or {}, fetches)
            watch_loss_scale(self.runtime, program)
            return [_to_numpy(t) if return_numpy and t is not None else t for t in out]
        self._start_step()
        program = self._after_startup(program)
        if program.gradient_merge is not None:
            out = self._run_merging(program, feed or {}, fetches)
        else:
            out = self._run_part(program, feed or {}, fetches)
        watch_loss_scale(self.runtime, program)  # AMP: warns on stalled steps; once per step, not per op
        if return_numpy:
            values = [_to_numpy(t) for t in out]
            if program.loss_name in fetches:  # on the host already: checking it costs no sync
                self._watch_loss(program, values[fetches.index(program.loss_name)])
            return values
        return list(out)

    def _watch_loss(self, program: Program, loss: Any) -> None:
        """Warn when a fetched loss is NaN or inf: the update that followed it has likely made
        params NaN, silently otherwise. Rate-limited: the 1st, 10th, 100th ... such run."""
        if np.all(np.isfinite(loss)):
            return
        self._bad_losses += 1
        n = self._bad_losses
        if str(n).rstrip("0") == "1":  # 1, 10, 100, ...
            logger.warning(
                "program %r: the loss is %s (%d run(s) so far): the step's update may have made "
                "params NaN; check the feed for NaN/inf and the learning rate",
                program.name,
                np.asarray(loss).ravel()[0] if np.asarray(loss).size else loss,
                n,
            )

    def _start_step(self) -> None:
        self._tracker.start_run()
        self.runtime.start_run()

    def _run_part(
        self,
        program: Program,
        feed: Mapping[str, Any],
        fetches: list[str],
        carried: Mapping[str, torch.Tensor] | None = None,
    ) -> tuple:
        """Run `program` within the current step. `carried`: values a pipeline part made for
        a later one, passed as they are (a pinned host copy stays on the host)."""
        key = (program.uid, program.version, tuple(fetches))
        plan = self._plans.pop(key, None)
        if plan is None:
            plan = build_plan(
                program,
                fetches,
                self.device,
                self.track_memory,
                self.runtime,
                multi=self._multi,
                shared_constants=self._constants,
            )
            if self.track_memory:
                for t in plan.constants.values():
                    self._tracker.acquire(t)
            while len(self._plans) >= MAX_PLANS:  # least recently used goes, with its constants
                old = self._plans.pop(next(iter(self._plans)))
                if self.track_memory:
                    for t in old.constants.values():
                        self._tracker.release(t)
        self._plans[key] = plan  # most recently used last
        self._materialise(program, plan.persistables, plan.checked)
        carried = carried or {}
        feeds = self._feeds(program, feed, [x for x in plan.feeds if x not in carried])
        feeds.update(carried)
        try:  # an error inside the plan is re-raised naming its op (see `Plan.run`)
            return plan.run(self.scope, feeds, self._tracker)
        except BaseException:
            self.runtime.abandon_collectives()
            raise
        finally:
            self._tracker.end_run()

    def _after_startup(self, program: Program) -> Program:
        """Run `program`'s startup ops if this is the executor's first run of this version of
        it; returns what every run runs (the program without its startup ops)."""
        if not program.ops or not roles.is_startup(program.ops[0].role):
            return program
        key = ("body", program.uid, program.version)
        body = self._runners.get(key)
        if body is None:
            startup = program.clone()
            n = next(i for i, op in enumerate(startup.ops) if not roles.is_startup(op.role))
            startup.ops, startup.updates, startup.outputs = startup.ops[:n], {}, []
            startup.gradient_merge, startup.loss_name = None, None
            try:
                self._run_part(startup, {}, [])
            finally:
                self._plans = {k: v for k, v in self._plans.items() if k[0] != startup.uid}
            body = program.clone()
            body.ops = body.ops[n:]
            self._runners = {k: v for k, v in self._runners.items() if k[:2] != ("body", program.uid)}
            self._runners[key] = body
        return body

    def _run_merging(self, program: Program, feed: Mapping[str, Any], fetches: list[str]) -> tuple:
        """One run of a gradient-merge program: forward, backward and the merge every run;
        the update phase (and the all-reduce placed with it) on the k-th run of a window.

        The window's run index is the persistable ``gm.step``, kept on the host (reading it
        never synchronises a device) and advanced here after each run."""
        gm = program.gradient_merge
        step_t = self.scope.get(gm.step)
        if step_t is None or step_t.device.type != "cpu":
            self._materialise(program, [gm.step])
            step_t = self.scope[gm.step]
            # once (a fresh scope, a loaded checkpoint); on meta the window starts at 0
            self.scope[gm.step] = torch.zeros_like(step_t, device="cpu") if step_t.is_meta else step_t.cpu()
        step = int(self.scope[gm.step])
        if not 0 <= step < gm.k_steps:
            raise ValueError(f"scope holds {gm.step}={step}, outside 0..{gm.k_steps - 1} (k_steps)")
        part = program if step == gm.k_steps - 1 else self._accumulate_part(program)
        if part is not program:
            made = {o for op in part.ops for o in op.outputs if o} | set(part.inputs)
            for f in fetches:
                if f not in made and f in program.vars and not program.vars[f].persistable:
                    raise ValueError(
                        f"fetch {f!r} is made by the update phase, which runs on every "
                        f"{gm.k_steps}-th run under gradient merge (this is run {step + 1} of the window)"
                    )
        out = self._run_part(part, feed, fetches)
        self.scope[gm.step].fill_((step + 1) % gm.k_steps)
        if step + 1 >= MERGE_WARN_RUNS and str(step + 1).rstrip("0") == "1":  # 1000, 10000, ...
            logger.warning(
                "program %r: %d runs under gradient merge without an update (k_steps=%d: params "
                "change once every %d runs); is k_steps the number of runs per update you meant?",
                program.name,
                step + 1,
                gm.k_steps,
                gm.k_steps,
            )
        return out

    def _accumulate_part(self, program: Program) -> Program:
        """`program` without its update phase: what a gradient-merge run that does not
        update runs (cached per program version)."""
        key = ("accumulate", program.uid, program.version)
        part = self._runners.get(key)
        if part is None:
            part = program.clone()
            part.ops = [op for op in part.ops if not _once_per_update(op.role)]
            made = {o for op in part.ops for o in op.outputs if o}
            part.updates = {t: n for t, n in part.updates.items() if n in made}
            part.outputs = [x for x in part.outputs if x in made or x in part.inputs]
            part.gradient_merge = None
            self._runners = {k: v for k, v in self._runners.items() if k[:2] != ("accumulate", program.uid)}
            self._runners[key] = part
        return part

    def _pipeline_runner(self, program: Program):
        """The runner of a pipeline stage program (micro-batches through its schedule)."""
        from metaopt.runtime.pipeline import PipelineRunner

        key = (program.uid, program.version)
        runner = self._runners.get(key)
        if runner is None:
            runner = self._runners[key] = PipelineRunner(self, program)
        return runner

    def _materialise(self, p: Program, names: Sequence[str], checked: dict | None = None) -> None:
        """Put `names` in the scope from `p`'s values where missing; check those already there
        against `p`'s vars. `checked`: the tensors found fitting on an earlier run of the same
        plan, not checked again while the scope holds the very same tensor (an in-place update
        keeps it; a user's or another program's new value is checked). Held by weak reference:
        a replaced value is not kept alive by the check."""
        for name in names:
            t = self.scope.get(name)
            if t is not None:
                seen = checked.get(name) if checked is not None else None
                if seen is None or seen() is not t:
                    _check_scope_entry(p, name, t)
                    if checked is not None:
                        checked[name] = weakref.ref(t)
                continue
            value = p.values.get(name)
            if value is None:
                raise ValueError(f"persistable var {name!r} has no value in program {p.name!r} or the scope")
            host = p.vars[name].host  # ZeRO-Offload's state: in (pinned) host memory between steps
            where = "cpu" if host and self.device.type == "cuda" else self.device
            if value.is_meta and name in p.fills and self.device.type != "meta":
                # a placeholder (an export on meta): made here, at this worker's shape, once
                t = torch.full(value.shape, p.fills[name], dtype=value.dtype, device=where)
                t = t.pin_memory() if where == "cpu" and self.device.type == "cuda" else t
            else:
                _check_initial_value(p, name, value, self.device)
                t = (
                    _on_host(value)
                    if where == "cpu" and self.device.type == "cuda"
                    else value.detach().to(self.device, copy=True)
                )
            self.scope[name] = t
            if self.track_memory:
                self._tracker.acquire(t, host)

    def _feeds(self, p: Program, feed: Mapping[str, Any], needed: list[str]) -> dict[str, torch.Tensor]:
        unknown = [k for k in feed if k not in p.vars or p.vars[k].kind != "input"]
        if unknown:
            k = unknown[0]
            hint = did_you_mean(k, p.inputs)
            raise KeyError(f"feed {k!r} is not an input of program {p.name!r} (inputs: {p.inputs}){hint}")
        out: dict[str, torch.Tensor] = {}
        bound: dict[str, tuple[int, str]] = {}
        for name in needed:
            if name not in feed:
                raise KeyError(f"program {p.name!r} needs feed {name!r} (inputs: {p.inputs})")
            var = p.vars[name]
            t = torch.as_tensor(feed[name])
            want = torch_dtype(var.dtype)
            if t.dtype != want:
                raise TypeError(f"feed {name!r} has dtype {t.dtype}, the program expects {want}")
            _check_shape(name, tuple(t.shape), var.shape, bound)
            out[name] = t.to(self.device, non_blocking=True)
        empty = [(dim, who) for dim, (n, who) in bound.items() if n == 0]
        if empty and p.updates:  # a step that updates state from no samples (Adam would step)
            dim, who = empty[0]
            raise ValueError(
                f"feed {who!r} binds {dim!r} to 0: program {p.name!r} updates its state every run, "
                "and an empty batch has nothing to learn from (skip the step instead)"
            )
        return out

    # --- inspection ------------------------------------------------------------
    def memory_stats(self) -> dict[str, float]:
        """Peak live bytes counted by the executor (persistables included), and more."""
        t = self._tracker
        on_host = {k for k, r in self._tracker.refs.items() if r[2]}  # counted as host bytes
        held = [*self.scope.values(), *(t for plan in self._plans.values() for t in plan.constants.values())]
        stores = _unique_storages(held)
        persist = sum(_storage_bytes(x) for x in stores if _storage_key(x) not in on_host)
        host_persist = sum(_storage_bytes(x) for x in stores if _storage_key(x) in on_host)
        stats = {
            "peak_bytes": max(t.peak, t.live),
            "last_run_peak_bytes": t.run_peak,
            "persistable_bytes": persist,
            "host_persistable_bytes": host_persist,  # ZeRO-Offload's state (Var.host)
            "host_peak_bytes": t.host_peak,
            # copied to host memory and back in the last run (a pipeline's: its last step)
            "offloaded_bytes": self.runtime.copies.offloaded_bytes,
            "fetched_bytes": self.runtime.copies.fetched_bytes,
            # sent to other workers by the last run's all-to-alls (expert parallel's rows)
            "all_to_all_bytes": self.runtime.all_to_all_bytes(),
        }
        # Offload copies of the last run: their own time, and how long compute waited on them
        # (on CUDA, read from events: this synchronises the device).
        stats["copy_seconds"], stats["copy_wait_seconds"] = self.runtime.copies.seconds()
        stats["pinned_buffer_bytes"] = self.runtime.copies.pinned_bytes
        if self.device.type == "cuda":
            stats["cuda_max_allocated"] = torch.cuda.max_memory_allocated(self.device)
        return stats

    def memory_timeline(self) -> list[int]:
        """Live bytes (as `memory_stats` counts them) after each op run in the last step, in
        run order; needs ``Executor(record_timeline=True)``."""
        return self._tracker.timeline()

    def op_seconds(self) -> list[float]:
        """Each op's seconds in the last step, in run order (`memory_timeline`'s); needs
        ``Executor(record_op_times=True)``."""
        if not isinstance(self._tracker, TimingTracker):
            raise ValueError(
                "this executor does not time its ops: create it with Executor(..., record_op_times=True)"
            )
        return self._tracker.op_seconds()

    def reset_memory_stats(self) -> None:
        self._tracker.peak = self._tracker.live
        self._tracker.host_peak = self._tracker.host_live
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def plan_source(self, program: Program, fetch_list: Iterable[str | Var] = ()) -> str:
        """The generated Python of `program` (for debugging what the executor does)."""
        fetches = [f.name if isinstance(f, Var) else f for f in fetch_list]
        return build_plan(
            program, fetches, self.device, self.track_memory, self.runtime, multi=self._multi
        ).source


def _once_per_update(role: str) -> bool:
    """The update phase (optimizer, lr schedule) and the collectives placed with it."""
    return roles.is_update(role) or roles.phase(role) is None


def _check_scope_entry(p: Program, name: str, t: torch.Tensor) -> None:
    """A scope tensor another program made must fit this program's var of that name."""
    var = p.vars[name]
    want_shape = tuple(var.shape) if var.shape is not None else None
    static = want_shape is not None and all(isinstance(d, int) for d in want_shape)
    if t.dtype != torch_dtype(var.dtype) or (static and tuple(t.shape) != want_shape):
        raise ValueError(
            f"scope holds {name!r} as {t.dtype} {list(t.shape)}, but program {p.name!r} declares "
            f"{var.dtype} {list(var.shape or [])}: two programs disagree about this persistable (an "
            "evaluation program cloned before a minimize that splits params, ZeRO-3 or tensor or pipeline "
            "parallel, does not know their layout: take main.clone(for_test=True) after minimize)"
        )


def _check_shape(name: str, got: tuple, want: tuple | None, bound: dict[str, tuple[int, str]]) -> None:
    if want is None:
        return
    if len(got) != len(want):
        raise ValueError(f"feed {name!r} has shape {list(got)}, the program expects {list(want)}")
    for g, w in zip(got, want, strict=True):
        if isinstance(w, str):
            if w in bound and bound[w][0] != g:
                raise ValueError(f"feed {name!r} has {w}={g} but feed {bound[w][1]!r} has {w}={bound[w][0]}")
            bound.setdefault(w, (g, name))
        elif g != w:
            raise ValueError(f"feed {name!r} has shape {list(got)}, the program expects {list(want)}")


def _unique_storages(ts: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    seen: dict[int, torch.UntypedStorage] = {}
    for t in ts:
        s = t.untyped_storage()
        seen.setdefault(s.data_ptr(), s)
    return list(seen.values())


def _storage_bytes(s: torch.UntypedStorage) -> int:
    return s.nbytes()


def _storage_key(s: torch.UntypedStorage) -> int:
    return s.data_ptr()  # the memory tracker's key of a storage


def _on_host(value: torch.Tensor) -> torch.Tensor:
    """A host-held persistable's tensor next to a CUDA device: in pinned memory, so its copies to
    the device and back run on the copy streams."""
    return value.detach().to("cpu", copy=True).pin_memory()


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.cpu().numpy()


def _check_initial_value(p: Program, name: str, value: torch.Tensor, device: torch.device) -> None:
    """A program's initial value must exist (not a meta placeholder, off the meta executor) and be
    the module's tensor as it was at the export (it is held by reference, not copied)."""
    if value.is_meta and device.type != "meta":
        raise ValueError(
            f"{p.vars[name].kind} var {name!r} of program {p.name!r} has no value: the program was "
            "exported from a module on the meta device. Give its persistables values before the "
            "first run: fleet.load_pretrained(exe, program, path) from a safetensors file or Hugging "
            "Face folder, or fleet.load_persistables(exe, dirname, program) from a checkpoint"
        )
    if p.changed_since_export(name):
        raise ValueError(
            f"var {name!r} of program {p.name!r} was changed in place after metaopt.export took it (an "
            "eager optimizer step or load on the module?): the program holds the module's tensors by "
            "reference, as torch.export does. Export after changing the module, or export a copy "
            "(metaopt.export(copy.deepcopy(module), ...)) to train both"
        )
