"""ONNX backend node-test conformance of the torch kernel table.

The onnx wheel generates ~1,900 node test cases in memory (a small model, inputs and the
expected outputs). Every case whose graph uses only op types in our table is run node by
node through the kernels and compared at the case's own rtol/atol, dtype and shape
included. Cases using an op type outside the table are not collected (the report counts
them). Cases our kernels refuse on principle are listed in KNOWN_UNSUPPORTED and run as
strict xfails, so a fix shows up as an XPASS failure and the entry must then go.

`run_graph` is the only piece that knows how a graph is executed; swapping it for the
importer + executor later leaves the rest unchanged.

Summary for the README:  python -m tests.ops.test_onnx_conformance
"""

from __future__ import annotations

import collections
import functools
import warnings
from collections.abc import Sequence

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from onnx.backend.test.case.test_case import TestCase

from metaopt.frontend.attrs import ONNX_TO_TORCH, attr_value, tensor_value
from metaopt.ops import registry

_RANDOM = "draws from numpy's RNG; our random ops use torch's generator by design"
_FLOAT8 = "float8/float4/int4/uint4 element types are not supported"
_STRING = "string tensors are not supported"

KNOWN_UNSUPPORTED: dict[str, str] = {}


# --------------------------------------------------------------------------- cases


@functools.cache
def node_cases() -> tuple[TestCase, ...]:
    """Every ONNX node test case, generated once per session (takes a few seconds)."""
    from onnx.backend.test.loader import load_model_tests

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the generators overflow casts on purpose
        return tuple(load_model_tests(kind="node"))


def _model(case: TestCase) -> onnx.ModelProto:
    return case.model if isinstance(case.model, onnx.ModelProto) else onnx.load(case.model)


def op_types(case: TestCase) -> set[tuple[str, str]]:
    """(domain, op type) of every node; the ONNX domain is spelled ""."""
    return {(_domain(n.domain), n.op_type) for n in _model(case).graph.node}


def _domain(d: str) -> str:
    return "" if d == "ai.onnx" else d


def _row(domain: str, op_type: str) -> registry.OpDef | None:
    row = registry.get(op_type)
    return row if row is not None and row.domain == domain else None


def in_table(case: TestCase) -> bool:
    return all(_row(d, t) is not None for d, t in op_types(case))


@functools.cache
def table_cases() -> tuple[TestCase, ...]:
    return tuple(c for c in node_cases() if in_table(c))


# --------------------------------------------------------------------------- runner


def run_graph(model: onnx.ModelProto, inputs: Sequence[np.ndarray]) -> list[torch.Tensor]:
    """Run `model`'s graph node by node through the kernel table on the CPU."""
    graph = model.graph
    env: dict[str, torch.Tensor | None] = {"": None}
    for init in graph.initializer:
        env[init.name] = tensor_value(init)
    feeds = [i.name for i in graph.input if i.name not in env]
    for name, value in zip(feeds, inputs):
        # Special element types (bfloat16, float8, int4, ...) come as TensorProtos.
        proto = value if isinstance(value, onnx.TensorProto) else numpy_helper.from_array(np.asarray(value), name)
        env[name] = tensor_value(proto)
    device = torch.device("cpu")
    for node in graph.node:
        row = _row(_domain(node.domain), node.op_type)
        args = [env[name] for name in node.input]
        attrs = {a.name: attr_value(a) for a in node.attribute}
        if row.needs_outputs:
            attrs["_nout"] = len(node.output)
        if row.needs_device:
            attrs["_device"] = device
        out = row.kernel(*args, **attrs)
        outs = out if isinstance(out, tuple) else (out,)
        for name, value in zip(node.output, outs):
            if name:
                env[name] = value
    return [env[o.name] for o in graph.output]


def check_case(case: TestCase) -> None:
    model = _model(case)
    for inputs, expected in case.data_sets:
        got = run_graph(model, inputs)
        assert len(got) == len(expected)
        for i, (g, e) in enumerate(zip(got, expected)):
            _compare(g, e, case, i)


def _compare(got: torch.Tensor, want, case: TestCase, i: int) -> None:
    what = f"{case.name} output {i}"
    if isinstance(want, onnx.TensorProto):
        want_dtype = tensor_value(want).dtype
        want = numpy_helper.to_array(want)
    else:
        want = np.asarray(want)
        want_dtype = ONNX_TO_TORCH.get(onnx.helper.np_dtype_to_tensor_dtype(want.dtype))
    assert got.dtype == want_dtype, f"{what}: dtype {got.dtype}, expected {want_dtype}"
    assert tuple(got.shape) == want.shape, f"{what}: shape {tuple(got.shape)}, expected {want.shape}"
    if got.dtype == torch.bfloat16:
        got, want = got.float(), want.astype(np.float32)
    got_np = got.detach().cpu().numpy()
    if got.is_floating_point() or got.is_complex():
        np.testing.assert_allclose(got_np, want, rtol=case.rtol, atol=case.atol, err_msg=what)
    else:
        np.testing.assert_array_equal(got_np, want, err_msg=what)


# --------------------------------------------------------------------------- pytest


def _params():
    for case in table_cases():
        marks = ()
        if case.name in KNOWN_UNSUPPORTED:
            marks = pytest.mark.xfail(strict=True, reason=KNOWN_UNSUPPORTED[case.name])
        yield pytest.param(case, id=case.name, marks=marks)


@pytest.mark.parametrize("case", list(_params()))
def test_node_case(case: TestCase) -> None:
    check_case(case)


def test_known_unsupported_are_real_cases() -> None:
    names = {c.name for c in table_cases()}
    stale = sorted(set(KNOWN_UNSUPPORTED) - names)
    assert not stale, f"KNOWN_UNSUPPORTED names cases that are not collected: {stale}"


# --------------------------------------------------------------------------- report


def conformance_report() -> dict:
    """Run every in-table case outside pytest and print the summary the README quotes."""
    cases = node_cases()
    ours = table_cases()
    passed, xfailed, failed = 0, [], []
    for case in ours:
        try:
            check_case(case)
            ok = True
        except Exception as exc:  # noqa: BLE001 - any failure counts as not passing
            ok, err = False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if ok:
            passed += 1
        elif case.name in KNOWN_UNSUPPORTED:
            xfailed.append(case.name)
        else:
            failed.append((case.name, err))
    covered = sorted({t for c in ours for _, t in op_types(c)})
    reasons = collections.Counter(KNOWN_UNSUPPORTED[n] for n in xfailed)
    print(f"ONNX node test cases:            {len(cases)}")
    print(f"  not collected (op not in table): {len(cases) - len(ours)}")
    print(f"  cases for ops in our table:      {len(ours)}")
    print(f"    passed:                        {passed}")
    print(f"    xfailed (known unsupported):   {len(xfailed)}")
    for reason, n in reasons.most_common():
        print(f"      {n:4d}  {reason}")
    print(f"    failed:                        {len(failed)}")
    for name, err in failed:
        print(f"      {name}: {err[:160]}")
    print(f"op types exercised ({len(covered)}): {', '.join(covered)}")
    return {"total": len(cases), "in_table": len(ours), "passed": passed,
            "xfailed": len(xfailed), "failed": failed, "covered": covered}


if __name__ == "__main__":
    conformance_report()
