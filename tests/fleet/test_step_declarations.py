"""Issue 33: each step declares the Context fields it reads and writes (`Step.reads`/`writes`),
the driver holds the declarations to the order of the steps at import (`check_declarations`),
and this test holds them to the code: every ``ctx.<field>`` a step's functions touch, through
the module's helpers they call, is declared, and nothing more."""

from __future__ import annotations

import ast
import functools
import inspect

import pytest

from metaopt.fleet import steps
from metaopt.passes import minimize
from metaopt.passes.driver import Context, Step, StepError, check_declarations

_MUTATORS = {"update", "append", "extend", "setdefault", "clear", "pop"}
_DRIVER = {"plans", "parts"}  # the driver's own record, never a hand-off between steps
_ALIASES = {"grads": "params_grads"}  # Context.grads is a view of params_grads


def _ctx_field(node: ast.AST) -> str | None:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "ctx":
        return _ALIASES.get(node.attr, node.attr)
    return None


def _touched(name: str, funcs: dict[str, ast.FunctionDef], seen: set[str]) -> tuple[set[str], set[str]]:
    """(fields read, fields written) by module function `name` and the module functions it names."""
    if name in seen or name not in funcs:
        return set(), set()
    seen.add(name)
    reads, writes = set(), set()
    for node in ast.walk(funcs[name]):
        field = _ctx_field(node)
        if field is not None:
            (writes if isinstance(node.ctx, ast.Store) else reads).add(field)
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):
            target = _ctx_field(node.value)
            if target is not None:
                writes.add(target)
        call = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        if call and node.func.attr in _MUTATORS:
            target = _ctx_field(node.func.value)
            if target is not None:
                writes.add(target)
        if isinstance(node, ast.Name) and node.id in funcs:
            r, w = _touched(node.id, funcs, seen)
            reads |= r
            writes |= w
    return reads - _DRIVER, writes - _DRIVER


FUNCS = {  # the rows' functions: fleet's, and the two steps Optimizer.minimize shares (unique names)
    n.name: n
    for module in (steps, minimize)
    for n in ast.parse(inspect.getsource(module)).body
    if isinstance(n, ast.FunctionDef)
}


@pytest.mark.parametrize("step", steps.STEPS, ids=lambda s: s.name)
def test_a_step_declares_exactly_the_context_fields_its_code_touches(step):
    reads, writes = set(), set()
    for fn in (step.enabled, step.rewrite, step.plan, step.check):
        fn = fn.func if isinstance(fn, functools.partial) else fn  # a shared function told its kind
        r, w = _touched(fn.__name__, FUNCS, set())
        reads |= r
        writes |= w
    assert (set(step.reads), set(step.writes)) == (reads, writes)


def _noop(*args):
    return None


def test_reading_what_no_earlier_step_writes_is_refused_by_name():
    early = Step("early", _noop, _noop, reads=("checkpoints",))
    late = Step("late", _noop, _noop, writes=("checkpoints",))
    check_declarations([late, early])
    unwritten = r"step 'early' reads \['checkpoints'\], which no earlier step writes"
    with pytest.raises(StepError, match=unwritten):
        check_declarations([early, late])


def test_declaring_a_field_the_context_lacks_or_the_driver_owns_is_refused():
    with pytest.raises(StepError, match=r"declares \['chekpoints'\], which the Context does not have"):
        check_declarations([Step("typo", _noop, _noop, writes=("chekpoints",))])
    with pytest.raises(StepError, match=r"writes \['plans'\], which the driver owns"):
        check_declarations([Step("grabby", _noop, _noop, writes=("plans",))])
    assert "plans" in {f for f in Context.__dataclass_fields__}
