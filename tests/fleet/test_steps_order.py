"""Issue 33: the training rewrite's order is written once, in `fleet.steps.STEPS`; the drawing of
it in docs/architecture.md (the README's until the guides moved to docs/) must say the same (it
had lost a step before this test)."""

from __future__ import annotations

import re
from pathlib import Path

from metaopt.fleet.steps import STEPS

ARCHITECTURE = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
END = "(the list in code is the truth)"


def _drawn_order() -> list[str]:
    text = ARCHITECTURE.read_text()
    end = text.index(END)
    start = text.rindex("\n", 0, text.rindex(STEPS[0].name, 0, end)) + 1
    return [name for name in re.split(r"[\s→]+", text[start:end]) if name]


def test_the_architecture_page_draws_the_steps_in_the_order_of_steps():
    assert _drawn_order() == [s.name for s in STEPS]


def test_every_step_names_what_it_does():
    assert all(s.doc for s in STEPS), [s.name for s in STEPS if not s.doc]
