"""tie_params: make several params one (ColossalAI's module shared across pipeline stages).

Every read of a param in a group reads the group's first param instead; the others are
dropped with their initial values, so the kept param's grad sums every use, as one shared
module's would. Pure: returns a rewritten copy.
"""

from __future__ import annotations

from collections.abc import Sequence

from metaopt.ir import Program, did_you_mean


class TieError(ValueError):
    pass


def tie_params(p: Program, *, groups: Sequence[Sequence[str]], what: str = "tie_params") -> Program:
    """A copy of `p` where each group's params are read as its first one.

    `what` names the config the groups came from, in errors.
    """
    q = p.clone()
    params = {v.name for v in q.params(trainable_only=False)}
    for group in groups:
        for name in group:
            if name not in params:
                raise TieError(f"{what}: {name!r} is not a param of {q.name!r}{did_you_mean(name, params)}")
        keep = q.vars[group[0]]
        for name in group[1:]:
            v = q.vars[name]
            if (v.dtype, v.shape) != (keep.dtype, keep.shape):
                raise TieError(
                    f"{what}: {name!r} is {v.dtype}{list(v.shape)} but {keep.name!r} is "
                    f"{keep.dtype}{list(keep.shape)}: tied params must agree"
                )
        drop = set(group[1:])
        for op in q.ops:
            op.inputs = [group[0] if x in drop else x for x in op.inputs]
        for name in drop:
            del q.vars[name]
            q.values.pop(name, None)
    return q
