"""Which outputs of a `view` row really are views: the layouts (strides) of values, replayed on
torch's meta device for `memory_estimate`.

A view row (Reshape, Flatten, Slice, Transpose ...) makes its outputs from input 0's storage
where torch can: ``reshape`` of a transposed or sliced value cannot be a view, so torch copies it
and the executor counts the copy as new bytes (HF attention's ``transpose(1, 2).reshape(...)``,
GPT-2's shifted labels). And a value's layout travels: an elementwise op keeps a permuted input's
strides (TensorIterator's rule), so a reshape two ops later may copy too.

`Layouts` keeps the strides of every value whose layout is not contiguous and, at a view row or
at an op reading such a value, runs the op's own kernel on meta tensors of those strides (shapes
and strides, no data: microseconds) to learn its outputs' layouts and whether a view row's
outputs are views of its input. It also learns which outputs are an input itself (a Cast to the
dtype it has, Identity): no new bytes. Anything it cannot run (a computed shape read on the
host, a kernel needing the runtime, a kernel the meta device refuses) is taken as the row says:
a view row's outputs views, every output contiguous.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from metaopt.ir import Op, Program, torch_dtype
from metaopt.ir.program import meta_stands_for
from metaopt.ops import registry


class Layouts:
    def __init__(self, p: Program, shape_of: Callable[[str], tuple | None], device: str = "cpu") -> None:
        # `device`: the DEVICE_FORMS entry the program runs on; a kernel with a form per device
        # (attention's backward) takes that one on the meta device (`meta_stands_for`)
        self.p, self.shape_of, self.device = p, shape_of, device
        self.strides: dict[str, tuple[int, ...]] = {}  # values not laid out contiguously

    def step(self, op: Op, row: Any, view: bool) -> dict[int, int] | None:
        """Record the layouts of `op`'s outputs. Where `op` is a view row (`view`), one that may
        return an input (`aliases`) or one reading a value laid out otherwise, its kernel runs on
        meta tensors: then {output: the input whose storage it is} (a view row's copy is new
        storage); None where nothing ran (the row's own word stands)."""
        odd = any(x in self.strides for x in op.inputs if x)
        ran = self._outcome(op, row) if (view or odd or (row is not None and row.aliases)) else None
        for o in op.outputs:
            self.strides.pop(o, None)
        if ran is None:
            return None
        names, outcome = ran
        shares = {}
        for k, (o, (strides, j)) in enumerate(zip(op.outputs, outcome, strict=False)):
            if not o:
                continue
            if strides is not None:
                self.strides[o] = strides
            if j is not None:  # the input itself (Identity, a Cast to its dtype) or a view of it
                shares[k] = op.inputs.index(names[j])
        return shares

    def _outcome(self, op: Op, row: Any) -> tuple[list[str], tuple] | None:
        """(the kernel's input names, per output (its strides where not contiguous, the input
        position it is, or is a view of)), or None where the kernel cannot run. Cached by all the
        meta run depends on (type, attrs, input layouts, host values): a transformer's layers
        repeat the same ops, and the recompute search estimates many programs alike."""
        while row is not None and row.inner is not None:  # an op running another (RngReplay)
            op = row.inner(op)
            row = registry.get(op.type)
        if row is None or row.needs_runtime or row.needs_device:
            return None
        host = set(registry.host_inputs(op, self.p))
        args: list[torch.Tensor | None] = []
        for j, x in enumerate(op.inputs):
            arg = self._arg(x, j in host) if x else None
            if x and arg is None:
                return None
            args.append(arg)
        key = (self.device, op.type, repr(sorted(op.attrs.items())), len(op.outputs), *map(_key, args))
        if key not in _OUTCOMES:
            if len(_OUTCOMES) >= _CACHE_SIZE:
                _OUTCOMES.clear()
            with meta_stands_for(self.device):
                _OUTCOMES[key] = _run(row, op, args)
        outcome = _OUTCOMES[key]
        return (list(op.inputs), outcome) if outcome is not None else None

    def _arg(self, x: str, host: bool) -> torch.Tensor | None:
        """Input `x` as the kernel would get it, on the meta device (a host input: its value)."""
        v = self.p.vars[x]
        value = self.p.values.get(x)
        if host:
            return value  # None when computed at run time: unknown here
        shape = self.shape_of(x)
        if shape is None:
            return None
        dtype = torch_dtype(v.dtype)
        if value is not None and x not in self.strides:
            return value.to("meta")
        return torch.empty_strided(
            shape, self.strides.get(x) or _contiguous(shape), dtype=dtype, device="meta"
        )


_CACHE_SIZE = 4096
_OUTCOMES: dict[tuple, tuple | None] = {}


def _key(t: torch.Tensor | None) -> tuple:
    if t is None:
        return ()
    if t.device.type != "meta":  # a host value: the kernel reads its numbers
        return ("host", t.dtype, tuple(t.shape), tuple(t.reshape(-1).tolist()))
    return (t.dtype, tuple(t.shape), t.stride())


def _run(row: Any, op: Any, args: list) -> tuple | None:
    kw = dict(op.attrs)
    if row.needs_outputs:
        kw["_nout"] = len(op.outputs)
    try:
        out = row.kernel(*args, **kw)
    except Exception:  # noqa: BLE001 - a kernel the meta device cannot run: taken as the row says
        return None
    outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    result = []
    for t in outs:
        if not isinstance(t, torch.Tensor):
            result.append((None, None))
            continue
        j = next((j for j, a in enumerate(args) if a is not None and (t is a or t._base is a)), None)
        result.append((None if t.is_contiguous() else tuple(t.stride()), j))
    return tuple(result)


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, n = [], 1
    for d in reversed(shape):
        out.append(n)
        n *= max(d, 1)
    return tuple(reversed(out))
