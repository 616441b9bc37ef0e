"""When each value of a program dies: the one rule the executor frees by and the memory
estimate predicts with."""

from __future__ import annotations

from collections.abc import Iterable

from metaopt.ir.program import Program


def liveness(
    p: Program, fetches: Iterable[str] = ()
) -> tuple[dict[str, int], dict[int, list[tuple[str, str]]]]:
    """(last use, update points).

    ``last[x]`` is the index of the last op that reads `x` (or produces it, if nothing
    reads it); a fetched value lives to the end (``len(p.ops)``). A state update
    ``target <- new`` happens at ``update_at[i]``: after the op producing `new` and the
    last reader of the old `target`, whichever comes later; `new` lives until then.
    """
    last: dict[str, int] = {}
    for i, op in enumerate(p.ops):
        for x in op.inputs:
            if x:
                last[x] = i
        for o in op.outputs:
            if o:
                last.setdefault(o, i)
    produced_at = {o: i for i, op in enumerate(p.ops) for o in op.outputs if o}
    update_at: dict[int, list[tuple[str, str]]] = {}
    for target, new in p.updates.items():
        at = max(produced_at[new], last.get(target, -1))
        update_at.setdefault(at, []).append((target, new))
        last[new] = max(last.get(new, -1), at)
    for f in fetches:
        last[f] = len(p.ops)
    return last, update_at
