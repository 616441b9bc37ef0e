"""Channels-last convolutions: a memory-format decision per 2-D `Conv` (an import step).

oneDNN (torch's CPU convolutions) and cuDNN (tensor cores) run 2-D convolutions faster on
channels-last (NHWC) data than on NCHW. torch keeps that layout through what a conv net puts
between its convolutions (BatchNorm, ReLU, residual adds, pooling) and their backward kernels,
so marking every convolution is enough: the first one lays its input out channels-last once,
each later one finds its input already so (no copy), and each `ConvGrad` runs in its forward's
layout. This is what ``model.to(memory_format=torch.channels_last)`` does by hand in eager torch,
decided here from the program: its convolutions, their ranks and their inputs.

The decision is an attribute, printed with the op: ``Conv(x, W, memory_format="channels_last")``.
It changes no value's meaning, only how torch lays the same tensor out: shapes in the program
stay NCHW, and so does every value the program hands back as a param or its grad (``ConvGrad``
returns the weight's grad in the weight's layout). Convolutions run on the same layout in the
forward, in a recompute segment and after an offload round trip, so recompute and offload stay
bit-identical to the program without them.

Which ops: those whose op-table row says so (`OpDef.channels_last`: Conv, ranked by its weight).
Skipped, with the reason in the plan: convolutions that are not 2-D (1-D, 3-D: their weights
have 3 or 5 dims) or whose weight's rank is unknown, and ones that already carry a
`memory_format` (the author's choice stands).
"""

from __future__ import annotations

from dataclasses import dataclass

from metaopt.ir import Op, Program
from metaopt.ops import registry
from metaopt.passes.driver import plan_text

CHANNELS_LAST = "channels_last"


@dataclass(frozen=True)
class ChannelsLastPlan:
    """The 2-D convolutions to run channels-last (by their output) and the skipped, with why."""

    convs: tuple[str, ...]
    skipped: tuple[tuple[str, str], ...]

    def __str__(self) -> str:
        head = f"channels_last: {len(self.convs)} convolution(s) channels-last"
        return plan_text(head, self.convs, self.skipped)


def plan_channels_last(p: Program) -> ChannelsLastPlan:
    """Which of `p`'s forward `Conv` ops run channels-last, and why the others do not."""
    convs: list[str] = []
    skipped: list[tuple[str, str]] = []
    for op in p.ops:
        row = registry.get(op.type)
        if row is None or row.channels_last is None or op.role != "forward":
            continue
        out = op.outputs[0]
        why = _why_not(p, op, row.channels_last)
        if why:
            skipped.append((out, why))
        else:
            convs.append(out)
    return ChannelsLastPlan(tuple(convs), tuple(skipped))


def channels_last(p: Program) -> Program:
    """`apply_channels_last` of the `plan_channels_last` of `p`."""
    return apply_channels_last(p, plan_channels_last(p))


def apply_channels_last(p: Program, plan: ChannelsLastPlan) -> Program:
    """`p` with the plan's convolutions marked ``memory_format="channels_last"`` (pure: `p` is
    left as it was; returned itself when there is nothing to mark)."""
    if not plan.convs:
        return p
    chosen = set(plan.convs)
    q = p.clone()
    for op in q.ops:
        if op.role == "forward" and op.outputs and op.outputs[0] in chosen:
            op.attrs["memory_format"] = CHANNELS_LAST
    return q


def _why_not(p: Program, op: Op, rank_input: int) -> str:
    if "memory_format" in op.attrs:
        return f"memory_format={op.attrs['memory_format']!r} already set"
    name = op.inputs[rank_input] if len(op.inputs) > rank_input else ""
    w = p.vars.get(name)
    if w is None or w.shape is None:
        return f"the rank of {name!r} is unknown"
    if len(w.shape) != 4:
        return f"a {len(w.shape) - 2}-D convolution (channels-last is for 2-D)"
    return ""
