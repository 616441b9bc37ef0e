"""metaopt.ir.names: the one place derived var names are spelled (Fleet's spelling)."""

from __future__ import annotations

import pytest

from metaopt.ir import names


@pytest.mark.parametrize(
    ("fn", "want"),
    [
        (names.grad, "fc1.weight@GRAD"),
        (names.recompute, "fc1.weight@RECOMPUTE"),
        (names.pinned, "fc1.weight@PINNED"),
        (names.fetch, "fc1.weight@FETCH"),
        (names.merged, "fc1.weight@MERGED"),
        (names.new_state, "fc1.weight@NEW"),
    ],
)
def test_derived_spellings(fn, want):
    assert fn("fc1.weight") == want


def test_derived_names_compose():
    # The grad of a recomputed copy, the accumulator of a grad: suffixes stack in call order.
    assert names.grad(names.recompute("h")) == "h@RECOMPUTE@GRAD"
    assert names.merged(names.grad("w")) == "w@GRAD@MERGED"
    assert names.fetch(names.pinned("a")) == "a@PINNED@FETCH"


def test_derived_names_are_distinct():
    made = {
        f("x")
        for f in (names.grad, names.recompute, names.pinned, names.fetch, names.merged, names.new_state)
    }
    assert len(made) == 6
    assert "x" not in made


def test_fresh_returns_base_when_free():
    assert names.fresh("h", set()) == "h"
    assert names.fresh("h", {"h_1", "g"}) == "h"


def test_fresh_skips_taken_names():
    assert names.fresh("h", {"h"}) == "h_1"
    assert names.fresh("h", {"h", "h_1", "h_2"}) == "h_3"
    # A gap is reused: the first free suffix wins.
    assert names.fresh("h", {"h", "h_2"}) == "h_1"


def test_fresh_accepts_any_container():
    taken = {"x@GRAD": 1, "x@GRAD_1": 2}  # a dict (e.g. program.vars) is a Container
    got = names.fresh(names.grad("x"), taken)
    assert got == "x@GRAD_2"
    assert got not in taken


def test_fresh_many_in_a_row_are_unique():
    taken: set[str] = set()
    for _ in range(20):
        taken.add(names.fresh("t", taken))
    assert taken == {"t"} | {f"t_{k}" for k in range(1, 20)}
