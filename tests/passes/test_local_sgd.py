"""Local SGD (strategy.localsgd, passes/local_sgd.py): the rewrite as text and its refusals. On
two gloo workers against a torch reference of two local SGD runs averaged on the same schedule:
tests/training/test_sharding_workers.py."""

from __future__ import annotations

import pytest
from conftest import exported

import metaopt
from metaopt.ir import parse_program, print_program, verify
from metaopt.passes.local_sgd import LocalSGDError, local_sgd


def _trained() -> metaopt.Program:
    p = exported("mlp")[2].clone()
    metaopt.optimizer.SGD(0.05).minimize(p.loss)
    return p


def test_the_rewrite_reads_as_its_golden_and_every_param_ends_averaged(golden):
    q = local_sgd(_trained(), k_steps=2, begin_step=1)
    verify(q)
    text = print_program(q)
    golden("local_sgd/mlp", text)
    assert print_program(parse_program(text)) == text
    averages = [op for op in q.ops if op.type == "LocalSGDAverage"]
    assert len(averages) == 6 and all(q.updates[op.origin] == op.outputs[0] for op in averages)


def test_refusals_name_what_is_at_fault():
    with pytest.raises(LocalSGDError, match="k_steps and begin_step must be >= 1"):
        local_sgd(_trained(), k_steps=0, begin_step=1)
    forward = exported("mlp")[2].clone()
    with pytest.raises(LocalSGDError, match="has no 'global_step@NEW': apply the optimizer first"):
        local_sgd(forward, k_steps=2, begin_step=1)
