"""The refusal of a malicious checkpoint keeps torch's reason, whole."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

import metaopt
from metaopt import fleet
from metaopt.ir import Program, Var


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def _program() -> Program:
    p = Program("main")
    p.add_var(Var("w", "float32", (2,), kind="param", trainable=True), torch.zeros(2))
    return p


def test_malicious_global_refusal_names_the_global(tmp_path):
    torch.save({"meta": {}, "tensors": {}, "rng": _Evil()}, tmp_path / "persistables.pt")
    with pytest.raises(ValueError) as info:
        fleet.load_persistables(metaopt.Executor("cpu"), tmp_path, _program())
    message = str(info.value)
    assert "not a readable metaopt checkpoint" in message
    # torch's own reason, not its "In PyTorch 2.6, we changed the default ..." preamble.
    assert "unsupported GLOBAL posix.system" in message or "unsupported GLOBAL nt.system" in message
    assert "In PyTorch 2.6" not in message and "Check the documentation" not in message
    assert message.endswith(".)")  # the sentence is whole (closing our parenthesis)


def test_raw_pickle_refusal_keeps_the_reason(tmp_path):
    # A plain pickle (not torch's zip format): torch puts its reason after
    # "WeightsUnpickler error:" on the following lines.
    with open(tmp_path / "persistables.pt", "wb") as f:
        pickle.dump({"rng": _Evil()}, f, protocol=2)
    with pytest.raises(ValueError) as info:
        fleet.load_persistables(metaopt.Executor("cpu"), tmp_path, _program())
    message = str(info.value)
    assert "refused by torch.load(weights_only=True): " in message
    reason = message.split("refused by torch.load(weights_only=True): ", 1)[1]
    assert len(reason) > len(")"), message
