"""Targeted kernel tests beyond ONNX conformance: torch parity, RNG, mutation, shape operands."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from metaopt.ops import registry


def kernel(op_type: str):
    row = registry.get(op_type)
    assert row is not None, f"{op_type} is not in the op table"
    return row.kernel


def snapshot(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    return [t.clone() if t is not None else None for t in tensors]


def assert_unchanged(before: list, after: tuple) -> None:
    for b, a in zip(before, after):
        if b is not None:
            assert torch.equal(b, a) or (b.isnan() == a.isnan()).all(), "a kernel mutated its input"


# --------------------------------------------------------------------------- the table


def test_table_rows_flags() -> None:
    table = registry.table()
    for op in (
        "Dropout",
        "RandomNormal",
        "RandomNormalLike",
        "RandomUniform",
        "RandomUniformLike",
        "Bernoulli",
        "Multinomial",
    ):
        assert table[op].random, op
    assert not any(
        row.random
        for op, row in table.items()
        if op
        not in {
            "Dropout",
            "RandomNormal",
            "RandomNormalLike",
            "RandomUniform",
            "RandomUniformLike",
            "Bernoulli",
            "Multinomial",
            "ScaledDotProductAttention",  # dropout on the probabilities inside the fused op
            "RingAttention",  # context parallel's attention: the same dropout, its rows
        }
    )
    for op in (
        "Dropout",
        "Split",
        "BatchNormalization",
        "LayerNormalization",
        "MaxPool",
        "SoftmaxCrossEntropyLoss",
        "BatchNormTraining",
    ):
        assert table[op].needs_outputs, op
    for op in ("ConstantOfShape", "Range", "RandomNormal", "RandomUniform", "Constant"):
        assert table[op].needs_device, op
    assert table["BatchNormTraining"].domain == "metaopt"
    assert table["Add"].domain == ""
    # Shape arithmetic stays on the host: Shape/Size produce CPU values, shape operands read them.
    assert table["Shape"].host_outputs and table["Size"].host_outputs
    assert table["Reshape"].host_inputs == (1,) and table["Slice"].host_inputs == (1, 2, 3, 4)
    assert table["Dropout"].host_inputs == (1, 2)


# --------------------------------------------------------------------------- Dropout


def test_dropout_reproducible_under_manual_seed() -> None:
    x = torch.randn(64, 32)
    ratio, training = torch.tensor(0.3), torch.tensor(True)
    drop = kernel("Dropout")
    torch.manual_seed(7)
    y1, m1 = drop(x, ratio, training, _nout=2)
    torch.manual_seed(7)
    y2, m2 = drop(x, ratio, training, _nout=2)
    assert torch.equal(y1, y2) and torch.equal(m1, m2)
    torch.manual_seed(8)
    _, m3 = drop(x, ratio, training, _nout=2)
    assert not torch.equal(m1, m3)
    # The same mask and values as torch's own dropout under the same seed.
    torch.manual_seed(7)
    assert torch.equal(y1, F.dropout(x, 0.3, training=True))


def test_dropout_mask_and_scale() -> None:
    torch.manual_seed(0)
    x = torch.randn(200, 100)
    y, mask = kernel("Dropout")(x, torch.tensor(0.25), torch.tensor(True), _nout=2)
    assert mask.dtype == torch.bool and mask.shape == x.shape
    assert torch.allclose(y, x * mask / 0.75, rtol=1e-6, atol=0)
    assert torch.equal(y[~mask], torch.zeros_like(y[~mask]))
    assert abs(mask.float().mean().item() - 0.75) < 0.02
    # A single output (no mask requested) draws the same mask.
    torch.manual_seed(0)
    x2 = torch.randn(200, 100)
    y2 = kernel("Dropout")(x2, torch.tensor(0.25), torch.tensor(True), _nout=1)
    assert torch.equal(y, y2)


@pytest.mark.parametrize(
    "args",
    [
        (),
        (torch.tensor(0.5),),
        (torch.tensor(0.5), torch.tensor(False)),
        (None, torch.tensor(False)),
        (torch.tensor(0.0), torch.tensor(True)),
    ],
)
def test_dropout_identity_without_training_mode(args) -> None:
    x = torch.randn(4, 5)
    state = torch.get_rng_state()
    y, mask = kernel("Dropout")(x, *args, _nout=2)
    assert torch.equal(y, x)
    assert mask.dtype == torch.bool and bool(mask.all())
    assert torch.equal(torch.get_rng_state(), state), "identity dropout must not consume the RNG"
    assert kernel("Dropout")(x, *args) is x


def test_dropout_old_ratio_attribute() -> None:
    x = torch.randn(8, 8)
    assert kernel("Dropout")(x, ratio=0.2) is x  # opset < 12: ratio attribute, inference


# --------------------------------------------------------------------------- batch norm


@pytest.mark.parametrize("shape", [(8, 4), (6, 4, 5), (4, 4, 3, 3)])
@pytest.mark.parametrize("momentum,eps", [(0.1, 1e-5), (0.3, 1e-3)])
def test_batch_norm_training_is_torch_bitwise(shape, momentum, eps) -> None:
    torch.manual_seed(0)
    x = torch.randn(shape) * 3 + 1
    c = shape[1]
    w, b = torch.randn(c), torch.randn(c)
    rm, rv = torch.randn(c), torch.rand(c) + 0.5
    before = snapshot(x, w, b, rm, rv)
    y, new_rm, new_rv = kernel("BatchNormTraining")(x, w, b, rm, rv, epsilon=eps, momentum=momentum, _nout=3)
    assert_unchanged(before, (x, w, b, rm, rv))
    ref_rm, ref_rv = rm.clone(), rv.clone()
    ref_y = F.batch_norm(x, ref_rm, ref_rv, w, b, training=True, momentum=momentum, eps=eps)
    assert torch.equal(y, ref_y)
    assert torch.equal(new_rm, ref_rm)
    assert torch.equal(new_rv, ref_rv)
    assert not torch.equal(new_rv, rv)


def test_batch_norm_training_defaults_match_torch_module() -> None:
    torch.manual_seed(1)
    bn = torch.nn.BatchNorm2d(3).train()
    x = torch.randn(5, 3, 4, 4)
    rm, rv = bn.running_mean.clone(), bn.running_var.clone()
    y, new_rm, new_rv = kernel("BatchNormTraining")(x, bn.weight.detach(), bn.bias.detach(), rm, rv, _nout=3)
    with torch.no_grad():
        ref = bn(x)
    assert torch.equal(y, ref)
    assert torch.equal(new_rm, bn.running_mean) and torch.equal(new_rv, bn.running_var)


def test_onnx_batch_normalization_training_semantics() -> None:
    torch.manual_seed(2)
    x = torch.randn(6, 3, 4)
    w, b, rm, rv = torch.randn(3), torch.randn(3), torch.randn(3), torch.rand(3) + 0.5
    before = snapshot(x, w, b, rm, rv)
    y, new_rm, new_rv = kernel("BatchNormalization")(x, w, b, rm, rv, momentum=0.9, training_mode=1, _nout=3)
    assert_unchanged(before, (x, w, b, rm, rv))
    mean = x.mean((0, 2))
    var = x.var((0, 2), unbiased=False)  # ONNX blends in the population variance
    torch.testing.assert_close(new_rm, rm * 0.9 + mean * 0.1)
    torch.testing.assert_close(new_rv, rv * 0.9 + var * 0.1)
    ref = F.batch_norm(x, None, None, w, b, training=True, eps=1e-5)
    assert torch.equal(y, ref)


def test_onnx_batch_normalization_inference() -> None:
    x = torch.randn(2, 3, 4)
    w, b, rm, rv = torch.randn(3), torch.randn(3), torch.randn(3), torch.rand(3) + 0.5
    y = kernel("BatchNormalization")(x, w, b, rm, rv)
    assert torch.equal(y, F.batch_norm(x, rm, rv, w, b, training=False, eps=1e-5))


# --------------------------------------------------------------------------- layer norm


@pytest.mark.parametrize("axis", [-1, -2, 1])
def test_layer_norm_is_torch_bitwise(axis) -> None:
    torch.manual_seed(3)
    x = torch.randn(4, 6, 8) * 2 + 0.5
    shape = x.shape[axis:]
    w, b = torch.randn(shape), torch.randn(shape)
    before = snapshot(x, w, b)
    y = kernel("LayerNormalization")(x, w, b, axis=axis, epsilon=1e-5)
    assert_unchanged(before, (x, w, b))
    assert torch.equal(y, F.layer_norm(x, shape, w, b, 1e-5))
    y3, mean, inv_std = kernel("LayerNormalization")(x, w, b, axis=axis, epsilon=1e-5, _nout=3)
    assert torch.equal(y3, y)
    dims = tuple(range(x.dim() + axis if axis < 0 else axis, x.dim()))
    assert mean.shape == x.mean(dims, keepdim=True).shape
    torch.testing.assert_close(mean, x.mean(dims, keepdim=True))
    torch.testing.assert_close(inv_std, torch.rsqrt(x.var(dims, unbiased=False, keepdim=True) + 1e-5))


def test_layer_norm_without_bias() -> None:
    x = torch.randn(3, 5)
    w = torch.randn(5)
    assert torch.equal(kernel("LayerNormalization")(x, w), F.layer_norm(x, (5,), w, None, 1e-5))


# --------------------------------------------------------------------------- torch parity


def test_gemm_and_matmul_are_torch_bitwise() -> None:
    torch.manual_seed(4)
    x, w, b = torch.randn(7, 16), torch.randn(8, 16), torch.randn(8)
    assert torch.equal(kernel("Gemm")(x, w, b, transB=1), F.linear(x, w, b))
    a, c = torch.randn(2, 3, 4, 5), torch.randn(5, 6)
    assert torch.equal(kernel("MatMul")(a, c), torch.matmul(a, c))
    torch.testing.assert_close(kernel("Gemm")(x, w.t(), b, alpha=0.5, beta=2.0), 0.5 * x @ w.t() + 2 * b)


def test_softmax_cross_entropy_matches_torch() -> None:
    torch.manual_seed(5)
    logits, labels = (
        torch.randn(6, 4, 3),
        torch.tensor([[0, 1, 3], [2, 2, 1], [3, 0, 0], [1, 1, 1], [0, 3, 2], [2, 1, 0]]),
    )
    w = torch.rand(4)
    loss, log_prob = kernel("SoftmaxCrossEntropyLoss")(logits, labels, w, ignore_index=1, _nout=2)
    assert torch.equal(loss, F.cross_entropy(logits, labels, w, ignore_index=1))
    assert torch.equal(log_prob, torch.log_softmax(logits, 1))


def test_gelu_variants() -> None:
    x = torch.randn(100)
    assert torch.equal(kernel("Gelu")(x), F.gelu(x))
    assert torch.equal(kernel("Gelu")(x, approximate="tanh"), F.gelu(x, approximate="tanh"))


# --------------------------------------------------------------------------- no mutation


def _mutation_cases():
    x = torch.randn(3, 4, 5)
    idx = torch.tensor([[0, 1], [2, 0]])
    yield "ScatterND", (x, idx, torch.randn(2, 5)), {}
    yield "ScatterND", (x, idx, torch.randn(2, 5)), {"reduction": "mul"}
    yield "ScatterElements", (x, torch.zeros(3, 4, 5, dtype=torch.int64), torch.randn(3, 4, 5)), {"axis": 1}
    yield (
        "ScatterElements",
        (x, torch.zeros(1, 4, 5, dtype=torch.int64), torch.randn(1, 4, 5)),
        {"reduction": "add"},
    )
    yield "Hardmax", (x,), {}
    yield "EyeLike", (torch.randn(4, 4),), {"k": 1}
    yield "Pad", (x, torch.tensor([0, 1, 1, 0, 2, 1])), {"mode": "reflect"}
    yield "Pad", (x, torch.tensor([1, 0, 0, 1, 0, 1]), torch.tensor(2.0)), {}
    yield "CumSum", (x, torch.tensor(1)), {"exclusive": 1, "reverse": 1}
    yield "Clip", (x, torch.tensor(-0.5), torch.tensor(0.5)), {}
    yield "Slice", (x, torch.tensor([2]), torch.tensor([0]), torch.tensor([1]), torch.tensor([-1])), {}
    yield (
        "Slice",
        (x, torch.tensor([-9]), torch.tensor([-(2**63)]), torch.tensor([2]), torch.tensor([-1])),
        {},
    )
    yield "Split", (x, torch.tensor([1, 3])), {"axis": 1, "_nout": 2}
    yield "Dropout", (x, torch.tensor(0.5), torch.tensor(True)), {"_nout": 2}
    yield "BatchNormTraining", (x, torch.ones(4), torch.zeros(4), torch.zeros(4), torch.ones(4)), {"_nout": 3}
    yield (
        "BatchNormalization",
        (x, torch.ones(4), torch.zeros(4), torch.zeros(4), torch.ones(4)),
        {"training_mode": 1, "_nout": 3},
    )
    yield "MaxPool", (torch.randn(1, 2, 5, 5),), {"kernel_shape": [2, 2], "pads": [0, 0, 1, 1], "_nout": 2}
    yield "TopK", (x, torch.tensor([2])), {}
    yield "Max", (x, torch.randn(5), torch.randn(4, 1)), {}
    yield "Sum", (x, torch.randn(5), torch.randn(4, 1)), {}
    yield (
        "ConvTranspose",
        (torch.randn(1, 2, 3, 3), torch.randn(2, 3, 2, 2), torch.randn(3)),
        {"pads": [1, 0, 0, 1], "output_padding": [1, 1], "strides": [2, 2]},
    )
    yield "SoftmaxCrossEntropyLoss", (torch.randn(4, 3), torch.tensor([0, 2, 1, 0])), {"_nout": 2}


@pytest.mark.parametrize(
    "op,args,attrs", list(_mutation_cases()), ids=lambda v: v if isinstance(v, str) else ""
)
def test_kernels_do_not_mutate_inputs(op, args, attrs) -> None:
    before = snapshot(*args)
    kernel(op)(*args, **attrs)
    assert_unchanged(before, args)


@pytest.mark.parametrize(
    "op,args,attrs", list(_mutation_cases()), ids=lambda v: v if isinstance(v, str) else ""
)
def test_kernel_outputs_hold_no_more_storage_than_their_shapes_say(op, args, attrs) -> None:
    """The executor counts an output's whole storage; estimate_memory counts its shape's bytes.
    A view into a larger temporary (TopK's first k of a whole sort, a partial reversed Slice of a
    whole flipped copy) kept that temporary alive: measured above predicted."""
    out = kernel(op)(*args, **attrs)
    inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
    for o in out if isinstance(out, (tuple, list)) else (out,):
        if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in inputs:
            assert o.untyped_storage().nbytes() <= o.numel() * o.element_size(), tuple(o.shape)


# --------------------------------------------------------------------------- shape operands


def _devices() -> list[str]:
    # "meta" stands in for an accelerator: data there, shape-like operands on the CPU.
    return ["meta"] + (["cuda"] if torch.cuda.is_available() else [])


def _shape_cases():
    i64 = torch.int64
    yield "Reshape", (torch.randn(2, 3, 4), torch.tensor([0, -1], dtype=i64)), {}
    yield "Reshape", (torch.randn(0, 3), torch.tensor([3, 0], dtype=i64)), {"allowzero": 1}
    yield (
        "Slice",
        (
            torch.randn(5, 6),
            torch.tensor([1, -1]),
            torch.tensor([4, -6]),
            torch.tensor([0, 1]),
            torch.tensor([2, -2]),
        ),
        {},
    )
    yield "Expand", (torch.randn(3, 1), torch.tensor([2, 1, 4])), {}
    yield "Tile", (torch.randn(2, 3), torch.tensor([2, 1])), {}
    yield "Squeeze", (torch.randn(1, 3, 1), torch.tensor([0, -1])), {}
    yield "Unsqueeze", (torch.randn(3, 4), torch.tensor([0, -1])), {}
    yield "Split", (torch.randn(6, 2), torch.tensor([2, 4])), {"_nout": 2}
    yield "Pad", (torch.randn(2, 3), torch.tensor([1, 0, 0, 2]), torch.tensor(1.5)), {}
    yield "Pad", (torch.randn(2, 3, 4), torch.tensor([1, 2]), None, torch.tensor([-1])), {"mode": "edge"}
    yield "ReduceSum", (torch.randn(2, 3, 4), torch.tensor([0, 2])), {"keepdims": 0}
    yield "ReduceMean", (torch.randn(2, 3, 4), torch.tensor([1])), {}
    yield "ReduceMax", (torch.randn(2, 3, 4), torch.tensor([-1])), {}
    yield "TopK", (torch.randn(3, 5), torch.tensor([2])), {}
    yield "CumSum", (torch.randn(3, 5), torch.tensor(1)), {}
    yield "Trilu", (torch.randn(4, 4), torch.tensor(-1)), {"upper": 0}
    yield "ConstantOfShape", (torch.tensor([2, 3]),), {"value": torch.tensor([1.5])}
    yield "Range", (torch.tensor(1), torch.tensor(9), torch.tensor(3)), {}


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("op,args,attrs", list(_shape_cases()), ids=lambda v: v if isinstance(v, str) else "")
def test_shape_operands_may_stay_on_cpu(device, op, args, attrs) -> None:
    row = registry.get(op)
    extra = {"_device": torch.device(device)} if row.needs_device else {}
    cpu_extra = {"_device": torch.device("cpu")} if row.needs_device else {}
    want = row.kernel(*args, **attrs, **cpu_extra)
    # The data operand moves to `device`; every int64 shape-like operand stays on the CPU.
    moved = [
        a.to(device) if i == 0 and a is not None and a.is_floating_point() else a for i, a in enumerate(args)
    ]
    got = row.kernel(*moved, **attrs, **extra)
    wants = want if isinstance(want, tuple) else (want,)
    gots = got if isinstance(got, tuple) else (got,)
    for w, g in zip(wants, gots):
        assert g.device.type == device
        assert g.shape == w.shape and g.dtype == w.dtype
        if device != "meta":
            torch.testing.assert_close(g.cpu(), w)


def test_shape_and_size_produce_cpu_int64() -> None:
    x = torch.randn(2, 3, 4, device="meta")
    s = kernel("Shape")(x, start=1)
    assert s.device.type == "cpu" and s.dtype == torch.int64 and s.tolist() == [3, 4]
    n = kernel("Size")(x)
    assert n.device.type == "cpu" and n.dim() == 0 and int(n) == 24


def test_gather_scalar_index_on_cpu_with_data_elsewhere() -> None:
    x = torch.randn(4, 5, device="meta")
    assert kernel("Gather")(x, torch.tensor(-1), axis=1).shape == (4,)
    shape = torch.tensor([2, 3, 4])
    assert kernel("Gather")(shape, torch.tensor([0, 2])).tolist() == [2, 4]


# --------------------------------------------------------------------------- recurrent


def _onnx_rnn_weights(module: torch.nn.Module, order: tuple[int, ...], gates: int):
    """ONNX W, R, B (gate order `order` of torch's chunks) from a torch RNN module."""
    dirs = ["", "_reverse"] if module.bidirectional else [""]

    def reorder(t: torch.Tensor) -> torch.Tensor:
        chunks = t.detach().chunk(gates, 0)
        return torch.cat([chunks[i] for i in order], 0)

    W = torch.stack([reorder(getattr(module, f"weight_ih_l0{d}")) for d in dirs])
    R = torch.stack([reorder(getattr(module, f"weight_hh_l0{d}")) for d in dirs])
    B = torch.stack(
        [
            torch.cat(
                [reorder(getattr(module, f"bias_ih_l0{d}")), reorder(getattr(module, f"bias_hh_l0{d}"))]
            )
            for d in dirs
        ]
    )
    return W, R, B


# torch chunk index for each ONNX gate: LSTM i,o,f,c <- torch i,f,g,o ; GRU z,r,h <- torch r,z,n.
_LSTM_FROM_TORCH = (0, 3, 1, 2)
_GRU_FROM_TORCH = (1, 0, 2)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_lstm_matches_torch_module(bidirectional) -> None:
    torch.manual_seed(6)
    m = torch.nn.LSTM(5, 4, bidirectional=bidirectional)
    x = torch.randn(7, 3, 5)
    h0, c0 = torch.randn(2 if bidirectional else 1, 3, 4), torch.randn(2 if bidirectional else 1, 3, 4)
    W, R, B = _onnx_rnn_weights(m, _LSTM_FROM_TORCH, 4)
    direction = "bidirectional" if bidirectional else "forward"
    with torch.no_grad():
        ref, (ref_h, ref_c) = m(x, (h0, c0))
    y, y_h, y_c = kernel("LSTM")(x, W, R, B, None, h0, c0, direction=direction, hidden_size=4, _nout=3)
    # The fused path is torch's own kernel (which may pick a different CPU backend than the
    # module does, depending on requires_grad: equal to rounding, not always bitwise).
    torch.testing.assert_close(y.transpose(1, 2).reshape(ref.shape), ref)
    torch.testing.assert_close(y_h, ref_h)
    torch.testing.assert_close(y_c, ref_c)
    # The step loop (forced by a no-op clip) implements the same recurrence.
    y2, h2, c2 = kernel("LSTM")(x, W, R, B, None, h0, c0, direction=direction, clip=1e9, _nout=3)
    torch.testing.assert_close(y2, y)
    torch.testing.assert_close(h2, y_h)
    torch.testing.assert_close(c2, y_c)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_gru_matches_torch_module(bidirectional) -> None:
    torch.manual_seed(7)
    m = torch.nn.GRU(5, 4, bidirectional=bidirectional, batch_first=True)
    x = torch.randn(3, 6, 5)
    W, R, B = _onnx_rnn_weights(m, _GRU_FROM_TORCH, 3)
    direction = "bidirectional" if bidirectional else "forward"
    with torch.no_grad():
        ref, ref_h = m(x)
    y, y_h = kernel("GRU")(x, W, R, B, direction=direction, layout=1, linear_before_reset=1, _nout=2)
    torch.testing.assert_close(y.reshape(ref.shape), ref)  # layout=1: (batch, seq, dir, hidden)
    torch.testing.assert_close(y_h.transpose(0, 1), ref_h)
    y2, h2 = kernel("GRU")(
        x, W, R, B, direction=direction, layout=1, linear_before_reset=1, clip=1e9, _nout=2
    )
    torch.testing.assert_close(y2, y)
    torch.testing.assert_close(h2, y_h)


def test_lstm_sequence_lens_freeze_state_and_zero_output() -> None:
    torch.manual_seed(8)
    m = torch.nn.LSTM(3, 2, bidirectional=True)
    W, R, B = _onnx_rnn_weights(m, _LSTM_FROM_TORCH, 4)
    x = torch.randn(5, 2, 3)
    lens = torch.tensor([5, 3])
    y, y_h, _ = kernel("LSTM")(x, W, R, B, lens, direction="bidirectional", _nout=3)
    # Batch entry 1 alone, truncated to its length, is what the padded run computes for it.
    y1, h1, _ = kernel("LSTM")(x[:3, 1:], W, R, B, direction="bidirectional", _nout=3)
    torch.testing.assert_close(y[:3, :, 1:], y1)
    torch.testing.assert_close(y_h[:, 1:], h1)
    assert torch.equal(y[3:, :, 1], torch.zeros_like(y[3:, :, 1]))


# --------------------------------------------------------------------------- assorted


def test_unsigned_arithmetic_falls_back_exactly() -> None:
    a = torch.tensor([2**64 - 1, 5, 2**63], dtype=torch.uint64)
    b = torch.tensor([1, 7, 1], dtype=torch.uint64)
    assert kernel("Add")(a, b).tolist() == [0, 12, 2**63 + 1]
    assert kernel("Sub")(b, a).tolist() == [2, 2, 2**63 + 1]
    assert kernel("Greater")(a, b).tolist() == [True, False, True]
    assert kernel("Max")(a, b).tolist() == [2**64 - 1, 7, 2**63]
    c = torch.tensor([65535, 3], dtype=torch.uint16)
    assert kernel("Add")(c, torch.tensor([2, 4], dtype=torch.uint16)).tolist() == [1, 7]
    assert kernel("Div")(c, torch.tensor([2, 4], dtype=torch.uint16)).tolist() == [32767, 0]


def test_integer_div_truncates_toward_zero() -> None:
    a, b = torch.tensor([-7, 7, -7]), torch.tensor([2, -2, -2])
    assert kernel("Div")(a, b).tolist() == [-3, -3, 3]
    assert kernel("Mod")(a, b).tolist() == [1, -1, -1]
    assert kernel("Mod")(a, b, fmod=1).tolist() == [-1, 1, -1]


def test_resize_nearest_matches_torch_interpolate() -> None:
    x = torch.randn(2, 3, 5, 7)
    scales = torch.tensor([1.0, 1.0, 2.0, 3.0])
    y = kernel("Resize")(x, None, scales, mode="nearest", coordinate_transformation_mode="asymmetric",
                         nearest_mode="floor")  # fmt: skip
    assert torch.equal(y, F.interpolate(x, scale_factor=(2.0, 3.0), mode="nearest"))
    sizes = torch.tensor([2, 3, 9, 4])
    y = kernel("Resize")(
        x, None, None, sizes, mode="linear", coordinate_transformation_mode="pytorch_half_pixel"
    )
    torch.testing.assert_close(y, F.interpolate(x, size=(9, 4), mode="bilinear", align_corners=False))


def test_attention_matches_sdpa() -> None:
    torch.manual_seed(9)
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    y = kernel("Attention")(q, k, v, is_causal=1)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(y, ref)
    mask = torch.rand(5, 6) > 0.3
    mask[:, 0] = True
    y = kernel("Attention")(q, k, v, mask)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(y, ref)


@pytest.mark.parametrize(
    "start,end,step",
    [(-10, -100, -1), (4, -(2**63), -2), (10, 0, -1), (-1, -6, -1), (3, 1, -1), (2, 2, -1), (0, 2**63 - 1, 2),
     (-2, 100, 1), (-100, 3, 1)],
)  # fmt: skip
def test_slice_clamps_like_onnx(start, end, step) -> None:
    x = torch.arange(5)
    got = kernel("Slice")(x, torch.tensor([start]), torch.tensor([end]), None, torch.tensor([step]))
    # ONNX: negative bounds count from the end, then clamp to [0, n] (step > 0) or
    # start to [0, n - 1] and end to [-1, n - 1] (step < 0).
    n = 5
    s, e = (start + n if start < 0 else start), (end + n if end < 0 else end)
    if step > 0:
        s, e = min(max(s, 0), n), min(max(e, 0), n)
    else:
        s, e = min(max(s, 0), n - 1), min(max(e, -1), n - 1)
    assert got.tolist() == list(range(s, e, step))


@pytest.mark.parametrize(
    "op,args,attrs",
    [
        ("RandomNormal", (), {"shape": [3, 4], "mean": 1.0, "scale": 2.0}),
        ("RandomUniform", (), {"shape": [3, 4], "low": -1.0, "high": 3.0, "dtype": 11}),
        ("RandomNormalLike", (torch.zeros(2, 5, dtype=torch.float64),), {}),
        ("RandomUniformLike", (torch.zeros(2, 5),), {"dtype": 10}),
        ("Bernoulli", (torch.full((4, 6), 0.5),), {"dtype": 7}),
        ("Multinomial", (torch.randn(3, 5),), {"sample_size": 4}),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_random_ops_follow_torch_manual_seed(op, args, attrs) -> None:
    row = registry.get(op)
    extra = {"_device": torch.device("cpu")} if row.needs_device else {}
    torch.manual_seed(11)
    a = row.kernel(*args, **attrs, **extra)
    torch.manual_seed(11)
    b = row.kernel(*args, **attrs, **extra)
    assert torch.equal(a, b)
    expected_dtype = {
        "RandomNormal": torch.float32,
        "RandomUniform": torch.float64,
        "RandomNormalLike": torch.float64,
        "RandomUniformLike": torch.float16,
        "Bernoulli": torch.int64,
        "Multinomial": torch.int32,
    }[op]
    assert a.dtype == expected_dtype
    if op == "RandomUniform":
        assert a.shape == (3, 4) and bool((a >= -1).all()) and bool((a < 3).all())
    if op == "Multinomial":
        assert a.shape == (3, 4) and bool((a >= 0).all()) and bool((a < 5).all())


def test_global_lp_pool() -> None:
    x = torch.randn(2, 3, 4, 5)
    y = kernel("GlobalLpPool")(x, p=3)
    torch.testing.assert_close(y, x.abs().pow(3).sum((2, 3), keepdim=True).pow(1 / 3))
