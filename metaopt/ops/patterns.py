"""Reading a chain of elementwise ops as a polynomial: what the op table's `fuse` rules match on.

torch's exporter writes a formula such as the tanh GELU as one op per arithmetic step, with its
constants folded in any association order (``0.5 * x * (1 + t)``, ``x * 0.5 * (1 + t)`` ...). A
rule that compares the *value* of a chain, as a polynomial in the chain's leaves with constant
coefficients, matches every such spelling at once, and compares constants by value.

The walk back from a var descends into the producer of a value only when that value has exactly
one reader (the op the walk came from) and is made by an arithmetic op (Add, Sub, Mul, Div by a
constant, Neg, Pow to a small integer constant): every op it reads into the polynomial may
therefore be absorbed by a fusion, nothing else reads its result. Anything else is a leaf (an
atom of the polynomial, named by its var).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

Monomial = tuple[tuple[str, int], ...]  # sorted (atom, power) pairs; () is the constant term
Poly = dict[Monomial, float]

ARITHMETIC = frozenset({"Add", "Sub", "Mul", "Div", "Neg", "Pow"})
FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})
# Constants are float32 (or rounded from a decimal literal such as BLOOM's 0.79788456): a few
# float32 ulps of relative error, never a different formula.
RTOL = 1e-6
_MAX_OPS = 24  # a fusion pattern is a handful of ops: stop long walks early
_MAX_POWER = 4


@dataclass
class Chain:
    """A value as a polynomial of its leaves, and the ops that computed it."""

    poly: Poly
    ops: set[int] = field(default_factory=set)

    def atoms(self) -> set[str]:
        return {a for m in self.poly for a, _ in m}


def term(*atoms: tuple[str, int]) -> Monomial:
    """The monomial of (atom name, power) pairs (atom names are var names, not keywords)."""
    return tuple(sorted(atoms))


def polynomial(
    q: Any, name: str, reader: int | None, producer: dict[str, int], consumers: dict[str, list[int]]
) -> Chain | None:
    """`name`'s value as a polynomial in program `q`, read by op `reader` (None: the root of a
    match, whose readers do not matter); None when the walk meets more than a pattern's size."""
    chain = Chain({})
    poly = _walk(q, name, reader, producer, consumers, chain.ops, [_MAX_OPS])
    if poly is None:
        return None
    chain.poly = poly
    return chain


def close(poly: Poly, want: Poly, rtol: float = RTOL) -> bool:
    """Do `poly` and `want` have the same monomials with coefficients equal within `rtol`?"""
    return poly.keys() == want.keys() and all(
        math.isclose(poly[m], want[m], rel_tol=rtol, abs_tol=0.0) for m in want
    )


def one_reader(consumers: dict[str, list[int]], name: str) -> int | None:
    """The index of the only op reading `name`, else None (a fusion may absorb only values that
    nothing else reads)."""
    readers = consumers.get(name, [])
    return readers[0] if len(readers) == 1 else None


def scalar_constant(q: Any, name: str) -> float | None:
    """The value of a one-element constant var, else None."""
    v = q.vars.get(name)
    t = q.values.get(name)
    if v is None or v.kind != "constant" or t is None or t.numel() != 1 or t.dtype.is_complex:
        return None
    return float(t.reshape(()).item())


def int_constant(q: Any, name: str) -> list[int] | None:
    """The values of an integer constant var (a Slice's bounds, axes), flattened, else None."""
    v = q.vars.get(name)
    t = q.values.get(name)
    if v is None or v.kind != "constant" or t is None or t.dtype.is_floating_point or t.dtype.is_complex:
        return None
    return [int(x) for x in t.reshape(-1).tolist()]


def _walk(q, name, reader, producer, consumers, ops: set[int], budget: list[int]) -> Poly | None:
    c = scalar_constant(q, name)
    if c is not None:
        return {(): c}
    j = producer.get(name)
    single = reader is None or consumers.get(name) == [reader]
    if j is None or not single or q.ops[j].type not in ARITHMETIC or len(q.ops[j].outputs) != 1:
        return {((name, 1),): 1.0}
    budget[0] -= 1
    if budget[0] < 0:
        return None
    mine = {j}
    args = []
    for x in q.ops[j].inputs:
        a = _walk(q, x, j, producer, consumers, mine, budget)
        if a is None:
            return None
        args.append(a)
    poly = _combine(q.ops[j].type, args)
    if poly is None:  # not a polynomial: a leaf, and none of its ops is part of the chain
        return {((name, 1),): 1.0}
    ops |= mine
    return poly


def _combine(kind: str, args: list[Poly]) -> Poly | None:
    """The polynomial of one arithmetic op over its inputs' polynomials; None for what the
    algebra cannot express (division by a non-constant, a fractional or large power)."""
    if kind == "Neg":
        return _scale(args[0], -1.0)
    a, b = args
    if kind == "Add":
        return _add(a, b)
    if kind == "Sub":
        return _add(a, _scale(b, -1.0))
    if kind == "Mul":
        return _mul(a, b)
    k = b.get(()) if b.keys() == {()} else None
    if kind == "Div":
        return _scale(a, 1.0 / k) if k else None
    if k is None or k != int(k) or not 0 <= k <= _MAX_POWER:  # Pow
        return None
    out: Poly = {(): 1.0}
    for _ in range(int(k)):
        out = _mul(out, a)
    return out


def _scale(a: Poly, k: float) -> Poly:
    return {m: c * k for m, c in a.items()}


def _add(a: Poly, b: Poly) -> Poly:
    out = dict(a)
    for m, c in b.items():
        out[m] = out.get(m, 0.0) + c
    return out


def _mul(a: Poly, b: Poly) -> Poly:
    out: Poly = {}
    for ma, ca in a.items():
        for mb, cb in b.items():
            powers: dict[str, int] = dict(ma)
            for atom, n in mb:
                powers[atom] = powers.get(atom, 0) + n
            m = tuple(sorted(powers.items()))
            out[m] = out.get(m, 0.0) + ca * cb
    return out
