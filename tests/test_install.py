"""Issue 32: after the README's install, a user's own `from transformers import ...` works.

PyPI's torchvision is a CUDA build whose C extension does not load beside a CPU torch, and
transformers imports torchvision whenever it is installed. So torchvision is not in the `test`
extra (the `zoo` extra has it, CI installs both), and `import metaopt` makes a mismatched one
importable (metaopt/compat.py).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _extras() -> dict[str, list[str]]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["optional-dependencies"]


def _names(requirements: list[str]) -> set[str]:
    return {r.split("=")[0].split(">")[0].split("[")[0].strip() for r in requirements}


def test_the_test_extra_leaves_torchvision_to_the_zoo_extra_that_ci_installs():
    extras = _extras()
    assert "torchvision" not in _names(extras["test"])  # else `.[test]` can break transformers
    assert "transformers" in _names(extras["test"])
    assert "torchvision" in _names(extras["zoo"])
    install = [line for line in (ROOT / ".ci/run").read_text().splitlines() if "pip install" in line]
    assert any("zoo" in line and "test" in line for line in install), install  # CI runs the tv zoo rows


def _python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT
    )


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers not installed")
def test_transformers_imports_after_metaopt():
    # With the zoo extra's torchvision beside a CPU torch this failed with
    # "operator torchvision::nms does not exist"; without torchvision it must work too.
    out = _python("import metaopt; from transformers import GPT2LMHeadModel; print(GPT2LMHeadModel.__name__)")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "GPT2LMHeadModel"


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is None, reason="torchvision not installed")
def test_torchvision_models_import_after_metaopt_and_detection_ops_fail_loudly():
    code = (
        "import metaopt, torch, torchvision\n"
        "m = torchvision.models.resnet18(num_classes=3)\n"
        "print(m(torch.randn(2, 3, 32, 32)).shape[-1])\n"
        "try:\n"
        "    torchvision.ops.nms(torch.rand(2, 4), torch.rand(2), 0.5)\n"
        "    print('nms ran')\n"  # a torchvision whose extension loads
        "except (RuntimeError, NotImplementedError) as e:\n"
        "    print('refused', type(e).__name__)\n"
    )
    out = _python(code)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.split()
    assert lines[0] == "3"
    assert lines[1] in ("nms", "refused")  # never a made-up result: a real kernel or an error
