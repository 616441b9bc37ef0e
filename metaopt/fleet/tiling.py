"""Whether a checkpoint's pieces of one tensor tile it exactly: every element in exactly one
piece. A sharded checkpoint stores each var as pieces (boxes: offsets and sizes in the full
tensor) written by different workers; a piece dropped leaves elements that a load would fill
with whatever the target held (``torch.empty``'s garbage), a piece doubled or shifted makes the
last read win. Neither may load silently.

Pure Python on tuples, no tensor is touched: the pieces are disjoint and inside the tensor iff
no two intersect, and then they cover it iff their volumes sum to its element count. The fault
reported names one element: the first (row-major) that two pieces cover, or when no two
overlap, the first that none covers."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


@dataclass(frozen=True)
class TilingFault:
    what: str  # "uncovered" or "covered twice"
    index: tuple[int, ...]  # the first such element, row-major

    def __str__(self) -> str:
        return f"element {list(self.index)} is {self.what}"


def tiling_fault(size: Sequence[int], boxes: Sequence[Box]) -> TilingFault | None:
    """The first element of a tensor of `size` that two of `boxes` (each inside it: checked
    before) cover, else the first that none covers; None when they tile it exactly."""
    size = tuple(size)
    solid = [(tuple(o), tuple(s)) for o, s in boxes if all(n > 0 for n in s)]
    twice = _first_overlap(solid)
    if twice is not None:
        return TilingFault("covered twice", twice)
    if sum(math.prod(s) for _, s in solid) == math.prod(size):
        return None
    gap = _first_gap(size, solid)
    assert gap is not None  # disjoint boxes of a smaller total volume leave an element out
    return TilingFault("uncovered", gap)


def _first_overlap(boxes: list[Box]) -> tuple[int, ...] | None:
    """The row-major first element two of `boxes` share: the least low corner of any two's
    intersection. A sweep along the axis on which the boxes start at the most places, so the
    flat pieces of ZeRO and the row or column blocks of tensor parallel compare only neighbours."""
    if len(boxes) < 2:
        return None
    ndim = len(boxes[0][0])
    if ndim == 0:
        return ()  # two pieces of one scalar
    axis = max(range(ndim), key=lambda a: len({o[a] for o, _ in boxes}))
    first: tuple[int, ...] | None = None
    active: list[Box] = []
    for box in sorted(boxes, key=lambda b: b[0][axis]):
        start = box[0][axis]
        active = [b for b in active if b[0][axis] + b[1][axis] > start]
        for other in active:
            corner = _intersection_corner(box, other)
            if corner is not None and (first is None or corner < first):
                first = corner
        active.append(box)
    return first


def _intersection_corner(a: Box, b: Box) -> tuple[int, ...] | None:
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0], strict=True))
    hi = tuple(min(x + n, y + m) for x, n, y, m in zip(a[0], a[1], b[0], b[1], strict=True))
    return lo if all(low < high for low, high in zip(lo, hi, strict=True)) else None


def _first_gap(size: tuple[int, ...], boxes: list[Box]) -> tuple[int, ...] | None:
    """The row-major first element of `size` no box covers (`boxes` disjoint and inside it).
    Along the first axis coverage changes only where a box starts or ends, so the first
    uncovered row is one of those places (or 0); within it, the boxes crossing that row cut to
    the remaining axes are again disjoint."""
    if math.prod(size) == 0:
        return None
    if not size:
        return None if boxes else ()
    if sum(math.prod(s) for _, s in boxes) == math.prod(size):
        return None
    cuts = {0} | {o[0] for o, _ in boxes} | {o[0] + s[0] for o, s in boxes}
    for row in sorted(c for c in cuts if c < size[0]):
        crossing = [(o[1:], s[1:]) for o, s in boxes if o[0] <= row < o[0] + s[0]]
        rest = _first_gap(size[1:], crossing)
        if rest is not None:
            return (row, *rest)
    return None
