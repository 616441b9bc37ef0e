"""Golden text of each imported reference program (tiny config, train mode, dropout 0.1).

Regenerate only on purpose: pytest --update-golden, with the reason in the commit.
"""

from __future__ import annotations

import pytest
from conftest import exported

import metaopt
from metaopt.ir import parse_program


@pytest.mark.parametrize("name", ["mlp", "bert", "gpt", "resnet"])
def test_import_golden(name, golden):
    _, _, program = exported(name, dropout=0.1)
    text = str(program)
    golden(f"import/{name}", text)
    # The golden text is also a valid program description: it parses back exactly.
    again = parse_program(text)
    assert str(again) == text
    metaopt.verify(program)
