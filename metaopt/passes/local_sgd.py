"""Local SGD (Fleet's ``strategy.localsgd``): each worker updates its own params from its own
grads (no all-reduce of the grads), and the params are averaged over the workers every step up
to ``begin_step`` and then every ``k_steps`` steps (Lin et al., "Don't use large mini-batches,
use local SGD"; Fleet's LocalSGDOptimizer).

    program = local_sgd(program, k_steps=4, begin_step=30)

After the updates, one op per param averages its new value in place (the update wrote the
param's own storage, and the average writes it again: ``program.updates`` takes the param to
the averaged value, runtime/plan.py follows the chain of in-place writes), then one op
moves the persistable ``localsgd_last_step`` (the step of the last average)::

    w@LOCALSGD = LocalSGDAverage(w@NEW, global_step@NEW, localsgd_last_step, k_steps=4, begin_step=30)
    localsgd_last_step@NEW = LocalSGDStep(global_step@NEW, localsgd_last_step, k_steps=4, begin_step=30)

One all-reduce per param on an averaging step (no buckets yet). Fleet averages the workers'
differences from a shared snapshot (``param = snapshot - avg(snapshot - param)``); this averages
the params themselves: the same value in exact arithmetic, one snapshot less. Pure.
"""

from __future__ import annotations

import torch

from metaopt.ir import Op, Program, Var, names
from metaopt.passes.optimize import STEP


class LocalSGDError(ValueError):
    pass


def local_sgd(p: Program, *, k_steps: int, begin_step: int) -> Program:
    """A clone of `p` whose params are averaged on Fleet's local SGD schedule (module doc)."""
    if k_steps < 1 or begin_step < 1:
        raise LocalSGDError(f"local SGD: k_steps and begin_step must be >= 1, got {k_steps}, {begin_step}")
    step = names.new_state(STEP)
    if step not in p.vars:
        raise LocalSGDError(f"local SGD: program {p.name!r} has no {step!r}: apply the optimizer first")
    params = [v.name for v in p.params() if v.trainable and v.name in p.updates]
    if not params:
        raise LocalSGDError(f"local SGD: program {p.name!r} updates no param")
    q = p.clone()
    last = names.localsgd_last_step()
    q.add_var(Var(last, "int64", (), "opt_state"), torch.zeros((), dtype=torch.int64))
    q.add_var(Var(names.new_state(last), "int64", ()))
    attrs = {"k_steps": int(k_steps), "begin_step": int(begin_step)}
    for w in params:
        new = q.updates[w]
        avg = names.localsgd(w)
        v = q.vars[new]
        q.add_var(Var(avg, v.dtype, v.shape))
        q.ops.append(Op("LocalSGDAverage", [new, step, last], [avg], dict(attrs), role="optimize", origin=w))
        q.updates[w] = avg  # the same storage: the update wrote the param's, the average writes it again
    q.ops.append(Op("LocalSGDStep", [step, last], [names.new_state(last)], dict(attrs), role="optimize"))
    q.updates[last] = names.new_state(last)
    return q
