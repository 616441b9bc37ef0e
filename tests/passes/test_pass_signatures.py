"""Issue 33: a pass given its plan reads nothing else. Every function of metaopt/passes that
takes a ``plan`` takes the program and the plan only: its config went into the plan
(``plan_<pass>(program, **config)``), so a config argument cannot silently disagree with it."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import metaopt.passes


def _pass_functions():
    """Every public function of metaopt/passes that returns a program (or the stage programs)."""
    for info in pkgutil.iter_modules(metaopt.passes.__path__):
        module = importlib.import_module(f"metaopt.passes.{info.name}")
        for name, fn in vars(module).items():
            if inspect.isfunction(fn) and fn.__module__ == module.__name__ and not name.startswith("_"):
                if str(inspect.signature(fn).return_annotation) in ("Program", "list[Program]"):
                    yield f"{info.name}.{name}", fn


def test_a_pass_that_takes_a_plan_takes_nothing_else():
    both = []
    for where, fn in _pass_functions():
        params = list(inspect.signature(fn).parameters)
        if "plan" in params:
            others = [x for x in params[1:] if x != "plan"]
            if others:
                both.append(f"{where}({', '.join(params)})")
    assert not both, "passes taking a plan and config: " + "; ".join(both)


def test_the_check_sees_the_passes_with_plans():
    with_plan = {where for where, fn in _pass_functions() if "plan" in inspect.signature(fn).parameters}
    want = {"amp.apply_amp", "recompute.apply_recompute", "offload.apply_offload", "pipeline.apply_pipeline"}
    assert want <= with_plan, want - with_plan
