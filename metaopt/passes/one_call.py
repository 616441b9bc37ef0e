"""The one-call form of a plan/apply pass: ``apply(p, plan(p, **config))``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from metaopt.ir import Program

Plan = TypeVar("Plan")
Out = TypeVar("Out")


def one_call(plan: Callable[..., Plan], apply: Callable[[Program, Plan], Out]) -> Callable[..., Out]:
    """The pass as one function of a program and `plan`'s keywords, for callers that do not
    look at the plan; made here so every pass's one-call form is the same composition."""
    name = plan.__name__.removeprefix("plan_")

    def run(p: Program, **config: Any) -> Out:
        return apply(p, plan(p, **config))

    run.__name__ = run.__qualname__ = name
    run.__module__ = plan.__module__
    run.__doc__ = (
        f"The one-call form: ``{apply.__name__}(p, {plan.__name__}(p, **config))``, the config being "
        f"`{plan.__name__}`'s keywords."
    )
    return run
