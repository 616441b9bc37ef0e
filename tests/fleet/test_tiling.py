"""metaopt.fleet.tiling against brute force: a count per element of a small tensor, for random
piece sets (exact tilings cut at random, then pieces dropped, added or moved)."""

from __future__ import annotations

import random

import pytest
from ckpt_tamper import expected_fault

from metaopt.fleet.tiling import tiling_fault


def _cut(size: list[int], rng: random.Random) -> list[tuple[list[int], list[int]]]:
    """An exact tiling of `size`: cut along a random axis at random places, recursively."""
    boxes = [([0] * len(size), list(size))]
    for _ in range(rng.randint(0, 6)):
        i = rng.randrange(len(boxes))
        off, sz = boxes[i]
        axis = rng.randrange(len(size))
        if sz[axis] < 2:
            continue
        at = rng.randint(1, sz[axis] - 1)
        a_sz, b_off, b_sz = list(sz), list(off), list(sz)
        a_sz[axis], b_off[axis], b_sz[axis] = at, off[axis] + at, sz[axis] - at
        boxes[i : i + 1] = [(off, a_sz), (b_off, b_sz)]
    return boxes


def _random_box(size: list[int], rng: random.Random) -> tuple[list[int], list[int]]:
    off = [rng.randrange(d) for d in size]
    return off, [rng.randint(1, d - o) for o, d in zip(off, size, strict=True)]


@pytest.mark.parametrize("seed", range(400))
def test_the_first_fault_is_the_brute_force_one(seed):
    rng = random.Random(seed)
    size = [rng.randint(1, 6) for _ in range(rng.randint(1, 3))]
    boxes = _cut(size, rng)
    assert tiling_fault(size, boxes) is None  # an exact tiling, whatever the cuts
    change = rng.choice(["drop", "add", "move", "none"])
    if change == "drop" and len(boxes) > 1:
        boxes.pop(rng.randrange(len(boxes)))
    elif change == "add":
        boxes.append(_random_box(size, rng))
    elif change == "move":
        i = rng.randrange(len(boxes))
        off, sz = boxes[i]
        axis = rng.randrange(len(size))
        room = size[axis] - off[axis] - sz[axis]
        if room:
            off = list(off)
            off[axis] += rng.randint(1, room)
            boxes[i] = (off, sz)
    fault = tiling_fault(size, boxes)
    what, index = expected_fault(size, boxes)
    if what is None:
        assert fault is None
    else:
        assert fault is not None, (size, boxes)
        assert (fault.what, list(fault.index)) == (what, index), (size, boxes)


def test_scalars_and_empty_tensors():
    assert tiling_fault([], [((), ())]) is None
    assert str(tiling_fault([], [])) == "element [] is uncovered"
    assert str(tiling_fault([], [((), ()), ((), ())])) == "element [] is covered twice"
    assert tiling_fault([0, 3], []) is None
    assert tiling_fault([4], [((0,), (0,)), ((0,), (4,))]) is None  # an empty piece covers nothing


def test_the_flat_pieces_of_many_workers():
    """ZeRO's flat slices of 4096 workers (the sweep compares sorted neighbours only)."""
    boxes = [((i * 10,), (10,)) for i in range(4096)]
    assert tiling_fault([40960], boxes) is None
    shifted = [*boxes[:100], ((1005,), (10,)), *boxes[101:]]  # 1000..1004 uncovered, named second
    assert str(tiling_fault([40960], shifted)) == "element [1010] is covered twice"
    assert str(tiling_fault([40960], boxes[:100] + boxes[101:])) == "element [1000] is uncovered"
