"""Fill in dims that static inference left unknown, by running the program twice.

ONNX shape inference cannot always name a dim (``unk__7`` behind a Reshape with
-1 inside an exporter decomposition). Every dim of a program exported with one
symbolic batch dim is affine in it, so running at two small batch sizes pins it
down: ``size = a * batch + c``. Inputs are zeros (valid ids, valid labels).
"""

from __future__ import annotations

from metaopt.ir import Program, torch_dtype
from metaopt.ir.program import eval_dim

PROBE_BATCHES = (2, 3)


def _unknown(p: Program, symbol: str) -> list[str]:
    out = []
    for v in p.vars.values():
        if v.shape is None or any(eval_dim(d, {symbol: 1}) is None for d in v.shape):
            out.append(v.name)
    return out


def _fmt(a: int, c: int, symbol: str) -> int | str:
    if a == 0:
        return c
    term = symbol if a == 1 else f"{a}*{symbol}"
    return term if c == 0 else f"{term}{c:+d}"


def probe_shapes(p: Program, symbol: str) -> None:
    """Bind unknown dims in place (import time only); raises if the program cannot run."""
    import torch

    from metaopt.runtime import Executor

    unknown = _unknown(p, symbol)
    if not unknown:
        return
    seen = []
    for b in PROBE_BATCHES:
        feed = {}
        for name in p.inputs:
            v = p.vars[name]
            dims = [eval_dim(d, {symbol: b}) for d in (v.shape or ())]
            if any(d is None for d in dims):
                return  # an input with other symbols: leave the dims unknown
            feed[name] = torch.zeros(dims, dtype=torch_dtype(v.dtype))
        # a program exported on the meta device has no values: its shapes come from a meta run
        meta = any(t.is_meta for t in p.values.values())
        exe = Executor("meta" if meta else "cpu", track_memory=False)
        # fork_rng: the probe's Dropout must not move the user's RNG stream.
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            vals = exe.run(p, feed=feed, fetch_list=unknown, return_numpy=False)
        seen.append([tuple(t.shape) for t in vals])
    (b2, b3) = PROBE_BATCHES
    for name, s2, s3 in zip(unknown, seen[0], seen[1], strict=True):
        if len(s2) != len(s3):
            continue
        dims = []
        for x2, x3 in zip(s2, s3, strict=True):
            a = (x3 - x2) // (b3 - b2)
            dims.append(_fmt(a, x2 - a * b2, symbol))
        p.vars[name].shape = tuple(dims)
