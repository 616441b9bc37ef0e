"""ONNX backend node-test conformance of the torch kernel table.

The onnx wheel generates ~1,900 node test cases in memory (a small model, inputs and the
expected outputs). Every case whose graph uses only op types in our table is imported
(`import_model`: folding, dead code, verify) and run by the Executor, as users' programs
are, and compared at the case's own rtol/atol, dtype and shape included. Cases using an
op type outside the table are not collected (the report counts
them). Cases our kernels refuse on principle are listed in KNOWN_UNSUPPORTED and run as
strict xfails, so a fix shows up as an XPASS failure and the entry must then go.

Summary for docs/architecture.md:  python -m tests.ops.test_onnx_conformance
"""

from __future__ import annotations

import collections
import functools
import re
import warnings
from collections.abc import Sequence

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from onnx.backend.test.case.test_case import TestCase

import metaopt
from metaopt.frontend.attrs import ONNX_TO_TORCH, tensor_value
from metaopt.frontend.importer import import_model
from metaopt.ops import registry

# Cases our kernels cannot pass on principle, by reason. Each name is listed explicitly: when
# one starts passing, its strict xfail fails and the entry must be removed.
_NARROW_TYPE = (
    "float8/float4/int4/uint4/int2/uint2 element types are not supported "
    "(not in metaopt.frontend.attrs.ONNX_TO_TORCH; torch has no kernels for most of them)"
)
_RANDOM = (
    "expected values were drawn from numpy's RNG; our random ops draw from torch's by design "
    "(test_random_case_properties checks them)"
)
_STRING = "string tensors are not supported"
_LOW_PRECISION = (
    "bf16/fp16 attention: torch accumulates in fp32 and lands closer to the float64 result than the "
    "reference, which rounds every intermediate; the 1-ulp differences exceed the case's rtol=1e-3, "
    "which is below the type's epsilon"
)

# fmt: off
_NARROW_TYPE_CASES = (
    "test_cast_FLOAT_to_FLOAT8E4M3FN", "test_cast_FLOAT16_to_FLOAT8E4M3FN",
    "test_cast_FLOAT_to_FLOAT8E4M3FNUZ", "test_cast_FLOAT16_to_FLOAT8E4M3FNUZ",
    "test_cast_FLOAT8E4M3FN_to_FLOAT", "test_cast_FLOAT8E4M3FN_to_FLOAT16",
    "test_cast_FLOAT8E4M3FNUZ_to_FLOAT", "test_cast_FLOAT8E4M3FNUZ_to_FLOAT16",
    "test_cast_FLOAT_to_FLOAT8E5M2", "test_cast_FLOAT16_to_FLOAT8E5M2", "test_cast_FLOAT_to_FLOAT8E5M2FNUZ",
    "test_cast_FLOAT16_to_FLOAT8E5M2FNUZ", "test_cast_FLOAT8E5M2_to_FLOAT",
    "test_cast_FLOAT8E5M2_to_FLOAT16", "test_cast_FLOAT8E5M2FNUZ_to_FLOAT",
    "test_cast_FLOAT8E5M2FNUZ_to_FLOAT16", "test_cast_FLOAT_to_UINT4", "test_cast_FLOAT16_to_UINT4",
    "test_cast_FLOAT_to_INT4", "test_cast_FLOAT16_to_INT4", "test_cast_UINT4_to_FLOAT",
    "test_cast_UINT4_to_FLOAT16", "test_cast_UINT4_to_UINT8", "test_cast_INT4_to_FLOAT",
    "test_cast_INT4_to_FLOAT16", "test_cast_INT4_to_INT8", "test_cast_FLOAT4E2M1_to_FLOAT",
    "test_cast_FLOAT4E2M1_to_FLOAT16", "test_cast_FLOAT_to_FLOAT4E2M1", "test_cast_FLOAT16_to_FLOAT4E2M1",
    "test_cast_FLOAT_to_UINT2", "test_cast_FLOAT16_to_UINT2", "test_cast_FLOAT_to_INT2",
    "test_cast_FLOAT16_to_INT2", "test_cast_UINT2_to_FLOAT", "test_cast_UINT2_to_FLOAT16",
    "test_cast_UINT2_to_UINT8", "test_cast_INT2_to_FLOAT", "test_cast_INT2_to_FLOAT16",
    "test_cast_INT2_to_INT8", "test_cast_no_saturate_FLOAT_to_FLOAT8E4M3FN",
    "test_cast_no_saturate_FLOAT_to_FLOAT8E4M3FNUZ", "test_cast_no_saturate_FLOAT_to_FLOAT8E5M2",
    "test_cast_no_saturate_FLOAT_to_FLOAT8E5M2FNUZ", "test_cast_no_saturate_FLOAT16_to_FLOAT8E4M3FN",
    "test_cast_no_saturate_FLOAT16_to_FLOAT8E4M3FNUZ", "test_cast_no_saturate_FLOAT16_to_FLOAT8E5M2",
    "test_cast_no_saturate_FLOAT16_to_FLOAT8E5M2FNUZ", "test_cast_e8m0_FLOAT_to_FLOAT8E8M0",
    "test_cast_e8m0_FLOAT16_to_FLOAT8E8M0", "test_cast_e8m0_FLOAT8E8M0_to_FLOAT",
    "test_cast_e8m0_FLOAT8E8M0_to_FLOAT16", "test_castlike_FLOAT_to_FLOAT8E4M3FN",
    "test_castlike_FLOAT_to_FLOAT8E4M3FN_expanded", "test_castlike_FLOAT16_to_FLOAT8E4M3FN",
    "test_castlike_FLOAT16_to_FLOAT8E4M3FN_expanded", "test_castlike_FLOAT_to_FLOAT8E4M3FNUZ",
    "test_castlike_FLOAT_to_FLOAT8E4M3FNUZ_expanded", "test_castlike_FLOAT16_to_FLOAT8E4M3FNUZ",
    "test_castlike_FLOAT16_to_FLOAT8E4M3FNUZ_expanded", "test_castlike_FLOAT8E4M3FN_to_FLOAT",
    "test_castlike_FLOAT8E4M3FN_to_FLOAT_expanded", "test_castlike_FLOAT8E4M3FN_to_FLOAT16",
    "test_castlike_FLOAT8E4M3FN_to_FLOAT16_expanded", "test_castlike_FLOAT8E4M3FNUZ_to_FLOAT",
    "test_castlike_FLOAT8E4M3FNUZ_to_FLOAT_expanded", "test_castlike_FLOAT8E4M3FNUZ_to_FLOAT16",
    "test_castlike_FLOAT8E4M3FNUZ_to_FLOAT16_expanded", "test_castlike_FLOAT_to_FLOAT8E5M2",
    "test_castlike_FLOAT_to_FLOAT8E5M2_expanded", "test_castlike_FLOAT16_to_FLOAT8E5M2",
    "test_castlike_FLOAT16_to_FLOAT8E5M2_expanded", "test_castlike_FLOAT_to_FLOAT8E5M2FNUZ",
    "test_castlike_FLOAT_to_FLOAT8E5M2FNUZ_expanded", "test_castlike_FLOAT16_to_FLOAT8E5M2FNUZ",
    "test_castlike_FLOAT16_to_FLOAT8E5M2FNUZ_expanded", "test_castlike_FLOAT8E5M2_to_FLOAT",
    "test_castlike_FLOAT8E5M2_to_FLOAT_expanded", "test_castlike_FLOAT8E5M2_to_FLOAT16",
    "test_castlike_FLOAT8E5M2_to_FLOAT16_expanded", "test_castlike_FLOAT8E5M2FNUZ_to_FLOAT",
    "test_castlike_FLOAT8E5M2FNUZ_to_FLOAT_expanded", "test_castlike_FLOAT8E5M2FNUZ_to_FLOAT16",
    "test_castlike_FLOAT8E5M2FNUZ_to_FLOAT16_expanded", "test_castlike_FLOAT_to_UINT4",
    "test_castlike_FLOAT_to_UINT4_expanded", "test_castlike_FLOAT16_to_UINT4",
    "test_castlike_FLOAT16_to_UINT4_expanded", "test_castlike_FLOAT_to_INT4",
    "test_castlike_FLOAT_to_INT4_expanded", "test_castlike_FLOAT16_to_INT4",
    "test_castlike_FLOAT16_to_INT4_expanded", "test_castlike_UINT4_to_FLOAT",
    "test_castlike_UINT4_to_FLOAT_expanded", "test_castlike_UINT4_to_FLOAT16",
    "test_castlike_UINT4_to_FLOAT16_expanded", "test_castlike_UINT4_to_UINT8",
    "test_castlike_UINT4_to_UINT8_expanded", "test_castlike_INT4_to_FLOAT",
    "test_castlike_INT4_to_FLOAT_expanded", "test_castlike_INT4_to_FLOAT16",
    "test_castlike_INT4_to_FLOAT16_expanded", "test_castlike_INT4_to_INT8",
    "test_castlike_INT4_to_INT8_expanded", "test_castlike_FLOAT4E2M1_to_FLOAT",
    "test_castlike_FLOAT4E2M1_to_FLOAT_expanded", "test_castlike_FLOAT4E2M1_to_FLOAT16",
    "test_castlike_FLOAT4E2M1_to_FLOAT16_expanded", "test_castlike_FLOAT_to_FLOAT4E2M1",
    "test_castlike_FLOAT_to_FLOAT4E2M1_expanded", "test_castlike_FLOAT16_to_FLOAT4E2M1",
    "test_castlike_FLOAT16_to_FLOAT4E2M1_expanded", "test_castlike_FLOAT_to_UINT2",
    "test_castlike_FLOAT_to_UINT2_expanded", "test_castlike_FLOAT16_to_UINT2",
    "test_castlike_FLOAT16_to_UINT2_expanded", "test_castlike_FLOAT_to_INT2",
    "test_castlike_FLOAT_to_INT2_expanded", "test_castlike_FLOAT16_to_INT2",
    "test_castlike_FLOAT16_to_INT2_expanded", "test_castlike_UINT2_to_FLOAT",
    "test_castlike_UINT2_to_FLOAT_expanded", "test_castlike_UINT2_to_FLOAT16",
    "test_castlike_UINT2_to_FLOAT16_expanded", "test_castlike_UINT2_to_UINT8",
    "test_castlike_UINT2_to_UINT8_expanded", "test_castlike_INT2_to_FLOAT",
    "test_castlike_INT2_to_FLOAT_expanded", "test_castlike_INT2_to_FLOAT16",
    "test_castlike_INT2_to_FLOAT16_expanded", "test_castlike_INT2_to_INT8",
    "test_castlike_INT2_to_INT8_expanded", "test_castlike_no_saturate_FLOAT_to_FLOAT8E4M3FN",
    "test_castlike_no_saturate_FLOAT_to_FLOAT8E4M3FN_expanded",
    "test_castlike_no_saturate_FLOAT_to_FLOAT8E4M3FNUZ",
    "test_castlike_no_saturate_FLOAT_to_FLOAT8E4M3FNUZ_expanded",
    "test_castlike_no_saturate_FLOAT_to_FLOAT8E5M2",
    "test_castlike_no_saturate_FLOAT_to_FLOAT8E5M2_expanded",
    "test_castlike_no_saturate_FLOAT_to_FLOAT8E5M2FNUZ",
    "test_castlike_no_saturate_FLOAT_to_FLOAT8E5M2FNUZ_expanded",
    "test_castlike_no_saturate_FLOAT16_to_FLOAT8E4M3FN",
    "test_castlike_no_saturate_FLOAT16_to_FLOAT8E4M3FN_expanded",
    "test_castlike_no_saturate_FLOAT16_to_FLOAT8E4M3FNUZ",
    "test_castlike_no_saturate_FLOAT16_to_FLOAT8E4M3FNUZ_expanded",
    "test_castlike_no_saturate_FLOAT16_to_FLOAT8E5M2",
    "test_castlike_no_saturate_FLOAT16_to_FLOAT8E5M2_expanded",
    "test_castlike_no_saturate_FLOAT16_to_FLOAT8E5M2FNUZ",
    "test_castlike_no_saturate_FLOAT16_to_FLOAT8E5M2FNUZ_expanded",
)

_RANDOM_CASES = (
    "test_bernoulli", "test_bernoulli_expanded", "test_bernoulli_double", "test_bernoulli_double_expanded",
    "test_bernoulli_seed", "test_bernoulli_seed_expanded", "test_training_dropout_default",
    "test_training_dropout_default_mask", "test_training_dropout", "test_training_dropout_mask",
)

_STRING_CASES = (
    "test_equal_string", "test_equal_string_broadcast",
)

_LOW_PRECISION_CASES = (
    "test_attention_4d_causal_bf16", "test_attention_4d_causal_bf16_expanded",
    "test_attention_4d_causal_fp16", "test_attention_4d_causal_fp16_expanded",
    "test_attention_4d_padded_kv_bf16", "test_attention_4d_padded_kv_bf16_expanded",
    "test_attention_4d_causal_padded_kv_bf16", "test_attention_4d_causal_padded_kv_bf16_expanded",
    "test_attention_4d_attn_mask_causal_bf16", "test_attention_4d_attn_mask_causal_bf16_expanded",
    "test_attention_3d_causal_bf16", "test_attention_3d_causal_bf16_expanded",
)
# fmt: on

# Identity also passes sequences and optionals through; the IR holds tensors only.
_NON_TENSOR = "sequence/optional-typed graph inputs are not tensors: the importer refuses them"
_NON_TENSOR_CASES = ("test_identity_sequence", "test_identity_opt")
KNOWN_UNSUPPORTED: dict[str, str] = {
    **dict.fromkeys(_NARROW_TYPE_CASES, _NARROW_TYPE),
    **dict.fromkeys(_RANDOM_CASES, _RANDOM),
    **dict.fromkeys(_STRING_CASES, _STRING),
    **dict.fromkeys(_LOW_PRECISION_CASES, _LOW_PRECISION),
    **dict.fromkeys(_NON_TENSOR_CASES, _NON_TENSOR),
}


@pytest.fixture(autouse=True)
def _check_aliases(monkeypatch):
    # Every kernel's storage sharing must be what its row declares (`aliases`): a missed alias
    # lets an in-place update corrupt a value still to be read, a false one refuses a program.
    monkeypatch.setenv("METAOPT_CHECK_ALIASES", "1")


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


def run_graph(model: onnx.ModelProto, feeds: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Run `model` the way users run programs: `import_model` (raw import, folding,
    dead code, verify) then the Executor on the CPU, with memory accounting on.

    `feeds` are the graph's non-initializer inputs, in order.
    """
    program = import_model(model, name="case")
    inits = {t.name for t in model.graph.initializer}
    names = [i.name for i in model.graph.input if i.name not in inits]
    feed = {k: v for k, v in zip(names, feeds, strict=True) if k in program.inputs}
    outputs = [o.name for o in model.graph.output]
    return metaopt.Executor("cpu").run(program, feed=feed, fetch_list=outputs, return_numpy=False)


def _to_tensor(value) -> torch.Tensor:
    # Special element types (bfloat16, float8, int4, ...) come as TensorProtos.
    proto = value if isinstance(value, onnx.TensorProto) else numpy_helper.from_array(np.asarray(value))
    return tensor_value(proto)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, so that NaNs compare equal to themselves."""
    if t.dtype == torch.bool or t.numel() == 0:
        return t
    return t.contiguous().reshape(-1).view(torch.uint8)


def check_case(case: TestCase) -> None:
    model = _model(case)
    for inputs, expected in case.data_sets:
        feeds = [_to_tensor(v) for v in inputs]
        before = [f.clone() for f in feeds]
        got = run_graph(model, feeds)
        for f, b in zip(feeds, before):  # kernels must not write into their inputs
            assert torch.equal(_bits(f), _bits(b)), f"{case.name}: a kernel mutated a graph input"
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


@functools.cache
def _primary_ops() -> dict[str, str]:
    """Case name -> the op type it tests (an `_expanded` case tests its unexpanded op)."""
    single = {c.name: _model(c).graph.node[0].op_type for c in node_cases() if len(_model(c).graph.node) == 1}
    out = {}
    for c in node_cases():
        base = re.sub(r"_expanded(_ver\d+)?$", "", c.name)
        out[c.name] = single.get(c.name) or single.get(base) or "Graph"
    return out


def _params():
    # One param per case, id "<OpType>-<case>", so `-k "Conv-"` selects an op's cases.
    primary = _primary_ops()
    for case in table_cases():
        marks = ()
        if case.name in KNOWN_UNSUPPORTED:
            # A random case's numpy-drawn expected values can equal our draws by chance (seen:
            # bernoulli_double, 10 draws at probabilities in [0, 1): ~2% of runs), so its xfail is
            # not strict: a chance pass is not a fix, and must not fail the suite.
            strict = case.name not in _RANDOM_CASES
            marks = pytest.mark.xfail(strict=strict, reason=KNOWN_UNSUPPORTED[case.name])
        yield pytest.param(case, id=f"{primary[case.name]}-{case.name}", marks=marks)


@pytest.mark.parametrize("case", list(_params()))
def test_node_case(case: TestCase) -> None:
    check_case(case)


DRAWS = 400  # runs of each random case: its outputs' statistics are judged, not its values


def _draws(case: TestCase) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """(the case's inputs, DRAWS runs' outputs), the model imported once."""
    model = _model(case)
    inputs, expected = case.data_sets[0]
    feeds = [_to_tensor(v) for v in inputs]
    program = import_model(model, name="case")
    inits = {t.name for t in model.graph.initializer}
    names = [i.name for i in model.graph.input if i.name not in inits]
    feed = {k: v for k, v in zip(names, feeds, strict=True) if k in program.inputs}
    fetch = [o.name for o in model.graph.output]
    exe = metaopt.Executor("cpu")
    runs = [exe.run(program, feed=feed, fetch_list=fetch, return_numpy=False) for _ in range(DRAWS)]
    for i, e in enumerate(expected):  # dtype and shape as the reference's
        want = _to_tensor(e)
        assert all(r[i].dtype == want.dtype and r[i].shape == want.shape for r in runs), (case.name, i)
    return feeds, runs


def _binomial_ok(kept: float, n: int, p: float) -> bool:
    """`kept` successes of `n` draws at probability `p`, within 6 standard deviations (a
    false alarm about once in 5e8 runs)."""
    return abs(kept - n * p) <= 6 * (n * p * (1 - p)) ** 0.5 + 1e-9


@pytest.mark.parametrize("name", _RANDOM_CASES)
def test_random_case_properties(name: str) -> None:
    """What the random cases' numpy-drawn values cannot check (their xfails above): Bernoulli
    draws are 0 or 1 at each element's probability; Dropout keeps x * 1/(1 - ratio) where its
    mask is set and 0 elsewhere, at a kept fraction of 1 - ratio; and draws differ run to run."""
    (case,) = [c for c in table_cases() if c.name == name]
    feeds, runs = _draws(case)
    outs = torch.stack([r[0] for r in runs]).double()
    assert not all(torch.equal(outs[0], o) for o in outs[1:])  # fresh draws each run
    if name.startswith("test_bernoulli"):
        p = feeds[0].double()
        if name.endswith("_expanded"):
            # ONNX's function body for Bernoulli is Cast(Greater(RandomUniformLike(x), x)): one
            # with probability 1 - x, as that graph says (and as we run it), not x.
            p = 1.0 - p
        assert bool(((outs == 0) | (outs == 1)).all())
        for j, pj in enumerate(p.reshape(-1).tolist()):
            assert _binomial_ok(outs.reshape(DRAWS, -1)[:, j].sum().item(), DRAWS, pj), (j, pj)
        return
    x, ratio = feeds[0], float(feeds[1])
    assert bool(feeds[2])  # training mode: these cases drop
    scale = 1.0 / (1.0 - ratio)
    kept = outs != 0
    torch.testing.assert_close(outs, torch.where(kept, x.double() * scale, 0.0), rtol=1e-6, atol=0)
    if len(runs[0]) > 1:  # the mask output: exactly where the value was kept
        masks = torch.stack([r[1] for r in runs])
        assert masks.dtype == torch.bool and torch.equal(masks, kept)
    assert _binomial_ok(kept.sum().item(), kept.numel(), 1.0 - ratio), (kept.float().mean().item(), ratio)


def test_known_unsupported_are_real_cases() -> None:
    names = {c.name for c in table_cases()}
    stale = sorted(set(KNOWN_UNSUPPORTED) - names)
    assert not stale, f"KNOWN_UNSUPPORTED names cases that are not collected: {stale}"


# --------------------------------------------------------------------------- report


def conformance_report() -> dict:
    """Run every in-table case outside pytest and print the summary docs/architecture.md quotes."""
    cases = node_cases()
    ours = table_cases()
    passed, xfailed, xpassed, failed = 0, [], [], []
    for case in ours:
        try:
            check_case(case)
            err = None
        except Exception as exc:  # any failure counts as not passing
            err = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        known = case.name in KNOWN_UNSUPPORTED
        if err is None:
            passed += not known
            if known:
                xpassed.append(case.name)
        elif known:
            xfailed.append(case.name)
        else:
            failed.append((case.name, err))
    covered = sorted({t for c in ours for _, t in op_types(c)})
    table = registry.table()
    unexercised = sorted(set(table) - set(covered))
    missing = collections.Counter(
        t for c in cases if not in_table(c) for d, t in op_types(c) if _row(d, t) is None
    )
    reasons = collections.Counter(KNOWN_UNSUPPORTED[n] for n in xfailed)
    print(f"ONNX node test cases:              {len(cases)}")
    print(f"  not collected (op not in table): {len(cases) - len(ours)}")
    print(f"  cases for ops in our table:      {len(ours)}")
    print(f"    passed:                        {passed}")
    print(f"    xfailed (known unsupported):   {len(xfailed)}")
    for reason, n in reasons.most_common():
        print(f"      {n:4d}  {reason}")
    print(f"    xpassed (remove from KNOWN_UNSUPPORTED): {len(xpassed)} {xpassed if xpassed else ''}")
    print(f"    failed:                        {len(failed)}")
    for name, err in failed:
        print(f"      {name}: {err[:160]}")
    print(f"op table rows: {len(table)}")
    print(f"op types exercised by the cases ({len(covered)}): {', '.join(covered)}")
    print(f"rows no case exercises ({len(unexercised)}): {', '.join(unexercised)}")
    print(
        "op types of the uncollected cases (cases): "
        + ", ".join(f"{t} ({n})" for t, n in missing.most_common())
    )
    return {
        "total": len(cases),
        "in_table": len(ours),
        "passed": passed,
        "xfailed": len(xfailed),
        "xpassed": xpassed,
        "failed": failed,
        "covered": covered,
    }


if __name__ == "__main__":
    conformance_report()
