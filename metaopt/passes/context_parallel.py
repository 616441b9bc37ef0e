"""Context parallel (``hybrid_configs["cp_degree"]``; ring attention, Liu et al. 2023, with the
zig-zag layout of Megatron-Core's and torch's context parallel) as a rewrite of a forward program.

    plan = plan_context_parallel(program, degree=2, group=[0, 1])
    print(plan)                     # what runs on the local sequence, which attentions ring
    program = context_parallel(program, plan=plan)   # then minimize(): the backward follows

Each of the `degree` ranks of a cp group is fed the same whole batch and holds 1/degree of every
sequence from the embeddings to the loss, as segment parallel's ranks do (passes/segment_parallel.py:
the same plan of token-wise ops, scatters, losses summed over the group, params read through TPCopy,
one process's dropout masks), with two differences:

* **The positions a rank holds** are two runs, zig-zag: the sequence is cut into 2 x degree equal
  runs and rank r holds runs r and 2 x degree - 1 - r (``layout="zigzag"`` on every op placing
  positions: SPScatter, SPGather, Dropout's slice). Under a causal mask each rank then has the same
  number of (query, key) pairs to compute; token-wise ops do not care which tokens they hold, and
  everything that depends on the position (the position table, rotary's cos and sin, the causal
  mask's rows) is scattered the same way.
* **Attention is a ring** (``RingAttention``, ops/kernels/context_parallel.py) instead of the
  exchange: the local queries attend over the whole sequence while the key and value blocks go round
  the group, an online softmax merging them; no head split, so any head count works. The mask's
  rows of the local queries are scattered once per mask; its columns stay whole (global keys).
  Attention dropout draws one process's mask (drawn whole, this rank's rows kept).

Requires: a forward program whose sequence length is divisible by 2 x degree. Ensures: one
process's loss on every rank and every param's grad summed over the group.

What is not built, refused by the plan or the fleet step: the mask is made whole on every rank
before its rows are scattered (b x s x s per layer, not 1/degree of it); a learned attention bias
(the mask's grad); cp beside tensor parallel, pipelines, ZeRO, expert parallel or sep.
"""

from __future__ import annotations

from collections.abc import Sequence

from metaopt.ir import Program
from metaopt.passes.segment_parallel import SegmentPlan, plan_segment_parallel, segment_parallel

GROUP = "sep_parallel"  # cp shares the layout's sequence axis with sep (one of them is above 1)


def plan_context_parallel(
    p: Program, *, degree: int, group: Sequence[int] | str, axis: int = 1, layout: str = "zigzag"
) -> SegmentPlan:
    """Where forward `p` runs on the local sequence and which attentions ring (module doc).
    `group`: the cp group's global ranks, ascending, or ``"sep_parallel"`` (fleet.init's layout:
    the sequence axis). `layout`: "zigzag" (causal balance), or "contiguous"."""
    return plan_segment_parallel(p, degree=degree, group=group, axis=axis, ring=True, layout=layout)


def context_parallel(p: Program, *, plan: SegmentPlan) -> Program:
    """A copy of `p` rewritten for `plan` (module doc), in one sweep."""
    if not plan.ring:
        raise ValueError("context_parallel: the plan is segment parallel's (plan_segment_parallel); "
                         "make it with plan_context_parallel")  # fmt: skip
    return segment_parallel(p, plan=plan)
