"""Which values the executor computes on the host on an accelerator (ops/placement.py
`host_placement`): shape arithmetic only, and an op on the device reads a host value as a copy.

The first CUDA run (H200) failed on every Hugging Face transformer of the zoo: the attention mask,
built from the input's shape (Shape -> Range -> comparisons -> Where), was computed on the host
and SDPA read it beside device tensors. These tests hold the rule on the CPU, where host and
device are the same memory and the mistake cannot show at run time."""

from __future__ import annotations

import math

import pytest
from zoo import harness, models

from metaopt.ops import placement, registry


@pytest.fixture(scope="module")
def gpt2():
    return harness.export(models.get("hf-gpt2"), 0.0)[1]


def _sdpa_masks(p) -> list[tuple[int, str]]:
    return [(i, op.inputs[3]) for i, op in enumerate(p.ops) if op.type == "ScaledDotProductAttention"]


def test_only_small_values_are_computed_on_the_host(gpt2):
    host, _, uploads = placement.host_placement(gpt2)
    assert host  # the input's shape and what is computed from it
    for name in host:
        shape = gpt2.vars[name].shape
        assert all(isinstance(d, int) for d in shape) and math.prod(shape) <= placement.HOST_MAX_NUMEL, name
    masks = _sdpa_masks(gpt2)
    assert masks and all(m and m not in host for _, m in masks)  # built on the device
    assert not uploads


def test_a_device_op_reads_a_host_value_as_a_copy(gpt2, monkeypatch):
    """With no size limit the mask is computed on the host (the old rule): SDPA must then read
    it as an upload, as must every other device op reading a host value outside `host_inputs`."""
    monkeypatch.setattr(placement, "_small", lambda p, name: True)
    host, _, uploads = placement.host_placement(gpt2)
    for i, m in _sdpa_masks(gpt2):
        assert m in host and uploads[i] == (3,)
    for i, op in enumerate(gpt2.ops):
        row = registry.get(op.type)
        if row.host_outputs or i not in uploads and all(o in host for o in op.outputs if o):
            continue  # computed on the host
        wanted = tuple(j for j, x in enumerate(op.inputs) if x in host and j not in row.host_inputs)
        assert uploads.get(i, ()) == wanted, op.type
