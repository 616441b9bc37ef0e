"""Offload recompute checkpoints to host memory and fetch them back for the backward.

    program = offload(program, checkpoints=plan.checkpoints)     # after `recompute`

* Right after the op producing each offloaded checkpoint ``x``:
  ``x@PINNED = Memcpy(x, dst=pinned)`` (role ``offload``, origin ``x``).
* In the backward, ``x@FETCH = Memcpy(x@PINNED, dst=device)`` (role ``prefetch``) is
  placed one segment ahead of the first backward-phase use of ``x`` (right before the
  first use of the checkpoint the backward needs just before ``x``), and
  ``CopyWait(x@FETCH)`` right before that first use says where the copy must be done;
  every backward, recompute and optimizer op then reads ``x@FETCH``. So after the
  forward, device memory holds no offloaded checkpoint until its prefetch.
* The last checkpoint (the backward needs it at once) is not offloaded, nor is one the
  executor computes on the host (shape arithmetic, ops/placement.py);
  `offload_checkpoints` may restrict the set further. `checkpoint_shape` (Fleet makes
  users give it) is only validated: every checkpoint's shape is inferred.
* `moved` maps a checkpoint to the var that holds it after the forward when that is
  another var: recompute partition's 1/mp slice (passes/recompute_partition.py). That var
  is what goes to host memory and back (only the slice), and its first reader after the
  forward (the gather) reads the copy fetched back. Checkpoints are still named, checked
  and chosen (`offload_checkpoints`, `checkpoint_shape`) by their own names.

The pass is pure.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from metaopt.ir import Op, Program, Var, did_you_mean, eval_dim, names, roles
from metaopt.ops.placement import host_placement
from metaopt.passes.driver import plan_text
from metaopt.passes.one_call import one_call


class OffloadError(ValueError):
    pass


def check_checkpoint_shape(p: Program, checkpoints: list[str], checkpoint_shape: list[int]) -> None:
    """Fleet's `checkpoint_shape` (one shape, batch dim first, -1 or any value for it): every
    checkpoint must match it, the batch dim symbolic."""
    if not checkpoint_shape:
        return
    for c in checkpoints:
        shape = p.vars[c].shape or ()
        ok = len(shape) == len(checkpoint_shape) and all(
            isinstance(d, str) or d == want for d, want in zip(shape, checkpoint_shape)
        )
        if not ok:
            raise OffloadError(
                f"recompute_configs['checkpoint_shape'] = {list(checkpoint_shape)} does not match checkpoint "
                f"{c!r}, whose inferred shape is {list(shape)} (metaopt infers every checkpoint's shape: "
                "leave checkpoint_shape empty)"
            )


@dataclass
class OffloadPlan:
    """Which checkpoints wait in host memory, and where each copy goes (`plan_offload`)."""

    offloaded: list[str]  # the vars copied out and back (a checkpoint, or its slice), forward order
    first_use: dict[str, int]  # var -> index of its first backward-phase reader
    fetch_at: dict[str, int]  # var -> index of the op its prefetch goes before (one segment ahead)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (checkpoint, why it stays)

    def __str__(self) -> str:
        return plan_text(
            f"offload plan: {len(self.offloaded)} checkpoints to host memory and back",
            [
                f"{c}: prefetched before op {self.fetch_at[c]}, first read by op {self.first_use[c]}"
                for c in self.offloaded
            ],
            self.skipped,
        )


def plan_offload(
    p: Program,
    *,
    checkpoints: list[str],
    offload_checkpoints: list[str] | None = None,
    checkpoint_shape: list[int] | None = None,
    moved: dict[str, str] | None = None,
) -> OffloadPlan:
    """Which checkpoints go to host memory and where their copies go (`moved`: checkpoint -> the
    var holding it after the forward, where that is another: module doc); nothing is rewritten."""
    if not checkpoints:
        raise OffloadError(
            f"offload needs recompute checkpoints; program {p.name!r} has none (enable recompute)"
        )
    for c in checkpoints:
        if c not in p.vars:
            raise OffloadError(f"checkpoint {c!r} is not a var of {p.name!r}{did_you_mean(c, p.vars)}")
    check_checkpoint_shape(p, checkpoints, list(checkpoint_shape or ()))
    moved = dict(moved or {})
    for c, held in moved.items():
        if c not in checkpoints or held not in p.vars:
            raise OffloadError(f"moved: {c!r} -> {held!r} is not a checkpoint and a var of {p.name!r}")
    first_after = next((i for i, op in enumerate(p.ops) if roles.after_forward(op.role)), None)
    if first_after is None:
        raise OffloadError(f"program {p.name!r} has no backward: offload rewrites a training program")
    prod = {o: i for i, op in enumerate(p.ops[:first_after]) for o in op.outputs if o}
    picked, skipped = _chosen(p, checkpoints, offload_checkpoints, prod, first_after, moved)
    chosen = [moved.get(c, c) for c in picked]
    # First backward-phase reader of each offloaded checkpoint, in program order.
    first_use = {c: next(i for i in range(first_after, len(p.ops)) if c in p.ops[i].inputs) for c in chosen}
    order = sorted(chosen, key=lambda c: first_use[c])
    # Prefetch one segment ahead: where the previous checkpoint in backward order is first used.
    fetch_at = {c: (first_use[order[k - 1]] if k else first_after) for k, c in enumerate(order)}
    return OffloadPlan(chosen, first_use, fetch_at, skipped)


def apply_offload(p: Program, plan: OffloadPlan) -> Program:
    """A copy of `p` with `plan`'s copies to host memory and back (module doc)."""
    q = p.clone()
    if not plan.offloaded:
        return q
    first_use, fetch_at = plan.first_use, plan.fetch_at
    order = sorted(plan.offloaded, key=lambda c: first_use[c])  # backward order
    first_after = min(fetch_at.values())
    pinned = {c: _new_var(q, names.pinned(c), c) for c in plan.offloaded}
    fetched = {c: _new_var(q, names.fetch(c), c) for c in plan.offloaded}
    ops: list[Op] = []
    for i, op in enumerate(q.ops):
        # Copies start before waits at the same point, so the next copy overlaps the wait.
        for c in order:
            if fetch_at[c] == i:
                ops.append(
                    Op("Memcpy", [pinned[c]], [fetched[c]], {"dst": "device"}, role="prefetch", origin=c)
                )
        for c in order:
            if first_use[c] == i:
                ops.append(Op("CopyWait", [fetched[c]], [], role="prefetch", origin=c))
        if i >= first_after:
            op.inputs = [fetched.get(x, x) for x in op.inputs]
        ops.append(op)
        for o in op.outputs:
            if o in pinned:
                ops.append(
                    Op(
                        "Memcpy",
                        [o],
                        [pinned[o]],
                        {"dst": "pinned"},
                        role="offload",
                        scope=op.scope,
                        origin=o,
                    )
                )
    q.ops = ops
    return q


offload = one_call(plan_offload, apply_offload)


def _chosen(
    q: Program,
    checkpoints: list[str],
    restrict: list[str] | None,
    prod: dict,
    first_after: int,
    moved: dict[str, str],
) -> tuple[list[str], list[tuple[str, str]]]:
    """The checkpoints to offload (by their own names; `moved`: the var each is held in), and
    those left with why."""

    def held(c: str) -> str:
        return moved.get(c, c)

    skipped = []
    usable = []
    on_host = host_placement(q)[0]
    for c in checkpoints:
        if held(c) in on_host:
            # Shape arithmetic (a module's output S*k of an MoE layer): never on the device, and
            # fetched back there a reader wanting it on the host would wait for the device.
            skipped.append((c, "a host value (shape arithmetic): not on the device"))
        elif held(c) not in prod:
            skipped.append((c, "not made in the forward"))
        elif not any(held(c) in op.inputs for op in q.ops[first_after:]):
            skipped.append((c, "the backward does not read it"))
        else:
            usable.append(c)
    # The checkpoint the backward reaches first is needed at once: copying it out and back gains nothing.
    last = max(usable, key=lambda c: prod[held(c)], default=None)
    if last is not None:
        skipped.append((last, "the last checkpoint: the backward needs it at once"))
    chosen = [c for c in usable if c != last]
    if restrict is not None:
        for c in restrict:
            if c not in checkpoints:
                hint = did_you_mean(c, checkpoints)
                raise OffloadError(f"offload_checkpoints entry {c!r} is not a recompute checkpoint{hint}")
        skipped += [(c, "not in offload_checkpoints") for c in chosen if c not in restrict]
        chosen = [c for c in chosen if c in restrict]
    return chosen, skipped


def _new_var(q: Program, name: str, like: str) -> str:
    v = q.vars[like]
    name = names.fresh(name, q.vars)
    q.add_var(Var(name, v.dtype, v.shape, device=v.device))
    return name


def offloaded_bytes(p: Program, *, batch: int) -> int:
    """Bytes the program's offload ops (role ``offload``: the copies to host) copy per run, at `batch`."""
    return sum(eval_dim_bytes(p, op.inputs[0], batch) for op in p.ops if op.role == "offload")


def eval_dim_bytes(p: Program, name: str, batch: int) -> int:
    v = p.vars[name]
    if v.shape is None or any(eval_dim(d, {"batch": batch}) is None for d in v.shape):
        raise OffloadError(f"the size of {name!r} ({v.shape}) is not known at batch {batch}")
    return v.nbytes({"batch": batch}) or 0
