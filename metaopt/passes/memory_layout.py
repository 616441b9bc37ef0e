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
from metaopt.ops import registry


class Layouts:
    def __init__(self, p: Program, shape_of: Callable[[str], tuple | None]) -> None:
        self.p, self.shape_of = p, shape_of
        self.strides: dict[str, tuple[int, ...]] = {}  # values not laid out contiguously

    def step(self, op: Op, row: Any, view: bool) -> dict[int, int] | None:
        """Record the layouts of `op`'s outputs. Where `op` is a view row (`view`), one that may
        return an input (`aliases`) or one reading a value laid out otherwise, its kernel runs on
        meta tensors: then {output: the input whose storage it is} (a view row's copy is new
        storage); None where nothing ran (the row's own word stands)."""
        odd = any(x in self.strides for x in op.inputs if x)
        ran = self._run(op, row) if (view or odd or (row is not None and row.aliases)) else None
        for o in op.outputs:
            self.strides.pop(o, None)
        if ran is None:
            return None
        args, outs = ran
        shares = {}
        for k, (o, t) in enumerate(zip(op.outputs, outs, strict=False)):
            if not (o and isinstance(t, torch.Tensor)):
                continue
            if not t.is_contiguous():
                self.strides[o] = tuple(t.stride())
            # the input itself (Identity, a Cast to its own dtype) or a view of it
            x = next((x for x, a in args if a is not None and (t is a or t._base is a)), None)
            if x is not None:
                shares[k] = op.inputs.index(x)
        return shares

    def _run(self, op: Op, row: Any) -> tuple[list[tuple[str, Any]], tuple] | None:
        """((each input's name, the tensor the kernel got), the kernel's outputs), or None where
        it cannot run."""
        while row is not None and row.inner is not None:  # an op running another (RngReplay)
            op = row.inner(op)
            row = registry.get(op.type)
        if row is None or row.needs_runtime or row.needs_device:
            return None
        host = set(registry.host_inputs(op, self.p))
        args: list[tuple[str, Any]] = []
        for j, x in enumerate(op.inputs):
            arg = self._arg(x, j in host) if x else None
            if x and arg is None:
                return None
            args.append((x, arg))
        kw = dict(op.attrs)
        if row.needs_outputs:
            kw["_nout"] = len(op.outputs)
        try:
            out = row.kernel(*[a for _, a in args], **kw)
        except Exception:  # noqa: BLE001 - a kernel the meta device cannot run: taken as before
            return None
        return args, tuple(out) if isinstance(out, (tuple, list)) else (out,)

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


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, n = [], 1
    for d in reversed(shape):
        out.append(n)
        n *= max(d, 1)
    return tuple(reversed(out))
