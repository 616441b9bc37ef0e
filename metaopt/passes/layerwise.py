"""LAMB and LARS: the updates of Adam (LAMB) or Momentum (LARS) made layer-wise adaptive.

    plan = plan_layerwise(program, kind="lamb", source="AdamUpdate",
                          attrs={"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-6},
                          weight_decay=0.01, exclude=["bias", "norm"])
    program = apply_layerwise(program, plan)

Fleet's ``LambOptimizer`` and ``LarsOptimizer`` meta optimizers wrap the user's Adam or
Momentum; here the optimizer's update ops are rewritten by type and attrs
(ops/kernels/layerwise.py: ``LambUpdate`` keeps Adam's inputs and state, ``LarsMomentumUpdate``
Momentum's), one per param::

    w@NEW, w@MOMENT1@NEW, w@MOMENT2@NEW = LambUpdate(w, w@GRAD, learning_rate, global_step@NEW,
                                                     w@MOMENT1, w@MOMENT2, weight_decay=0.01, ...)

`exclude` (Fleet's ``exclude_from_weight_decay``): a param whose name contains one of these
strings gets weight decay 0, said in the plan. Pure.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from metaopt.ir import Program
from metaopt.ops import registry

KINDS = {"lamb": ("LambUpdate", "weight_decay"), "lars": ("LarsMomentumUpdate", "lars_weight_decay")}


class LayerwiseError(ValueError):
    pass


@dataclass
class LayerwisePlan:
    kind: str
    op_type: str
    attrs: dict[int, dict[str, Any]] = field(default_factory=dict)  # update op index -> its attrs
    params: dict[int, str] = field(default_factory=dict)  # update op index -> its param
    excluded: list[str] = field(default_factory=list)  # params updated without weight decay

    def __str__(self) -> str:
        lines = [f"{self.kind}: {len(self.attrs)} updates become {self.op_type}"]
        if self.excluded:
            lines.append(f"  without weight decay (exclude_from_weight_decay): {', '.join(self.excluded)}")
        return "\n".join(lines)


def plan_layerwise(
    p: Program,
    *,
    kind: str,
    source: str,
    attrs: dict[str, Any],
    weight_decay: float,
    exclude: list[str] = (),  # type: ignore[assignment]
) -> LayerwisePlan:
    """Which update ops (those of type `source`, the optimizer's) become `kind`'s, with what attrs."""
    if kind not in KINDS:
        raise LayerwiseError(f"layer-wise update: kind must be one of {sorted(KINDS)}, got {kind!r}")
    op_type, decay_key = KINDS[kind]
    target = registry.get(op_type)
    plan = LayerwisePlan(kind, op_type)
    for i, op in enumerate(p.ops):
        row = registry.get(op.type)
        if row is None or not row.update:
            continue
        if op.type != source:
            raise LayerwiseError(
                f"{kind}: update op {op.type} (param {op.origin!r}) is not the optimizer's {source}: "
                f"{kind} replaces {source} only"
            )
        if len(op.inputs) != target.skip_input:  # param, grad, lr, step, state: the same inputs
            raise LayerwiseError(
                f"{kind}: `{op.type}` of {op.origin!r} has {len(op.inputs)} inputs, {op_type} takes "
                f"{target.skip_input} (extra state such as amsgrad's, or AMP's skip input already there)"
            )
        param = op.inputs[0]
        decay = 0.0 if any(x in param for x in exclude) else weight_decay
        if decay == 0.0 and weight_decay != 0.0:
            plan.excluded.append(param)
        plan.attrs[i] = {**attrs, decay_key: decay}
        plan.params[i] = param
    if not plan.attrs:
        raise LayerwiseError(f"{kind}: program {p.name!r} has no {source} ops to replace")
    return plan


def apply_layerwise(p: Program, plan: LayerwisePlan) -> Program:
    """A clone of `p` whose planned update ops are `plan.op_type` with their planned attrs."""
    q = p.clone()
    q.ops = [
        dataclasses.replace(op, type=plan.op_type, attrs=dict(plan.attrs[i])) if i in plan.attrs else op
        for i, op in enumerate(q.ops)
    ]
    return q
