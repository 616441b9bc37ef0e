"""Ops that draw from the RNG.

They draw from torch's default generator (of the executor's device), never from their ONNX
`seed` attribute: `torch.manual_seed(n)` then fixes every mask, and recompute replays a mask by
restoring the generator state it recorded (rows are ``random=True``). In a tensor-parallel
program the pass marks each with the stream it draws from (``rng="shared"`` on a replicated
value, ``rng="model_parallel", group=[...]`` on a split one): `rng_streams.drawn` takes those attrs
and swaps that stream into the default generator around the kernel (metaopt/ops/rng_streams.py).
"""

from __future__ import annotations

import dataclasses

import torch

from metaopt.ir.dtypes import torch_dtype_from_onnx
from metaopt.ops.kernels.partition import group_ranks
from metaopt.ops.kernels.sequence_parallel import place, take
from metaopt.ops.registry import SAME, register
from metaopt.ops.rng_streams import drawn, mp_rank

_FLOAT = 1  # ONNX TensorProto.FLOAT, the default dtype of the random generators
_INT32 = 6  # ONNX TensorProto.INT32, Multinomial's default output dtype


def _ratio(ratio) -> float:
    if ratio is None:
        return 0.5
    return ratio if isinstance(ratio, float) else float(ratio)


def _dropout_for_test(op):  # noqa: ANN001, ANN202
    """Evaluation: the identity, and no mask (nothing reads one without a backward)."""
    return dataclasses.replace(op, type="Identity", inputs=op.inputs[:1], outputs=op.outputs[:1], attrs={})


@register(
    "Dropout",
    needs_outputs=True,
    random=True,
    host_inputs=(1, 2),
    aliases=SAME,
    train_repair="training_mode_input",
    for_test=_dropout_for_test,
)
@drawn
def dropout(
    data: torch.Tensor,
    ratio: torch.Tensor | float | None = None,
    training_mode: torch.Tensor | None = None,
    seed: int | None = None,
    is_test: int | None = None,
    slice_axis: int | None = None,
    slice_group: list[int] | str | None = None,
    slice_layout: str = "contiguous",
    _nout: int = 1,
):
    """ONNX Dropout: identity (mask all true) unless `training_mode` is given and true.

    `ratio` is an input since opset 12 and an attribute before; both arrive here.

    `slice_axis` / `slice_group` (sequence parallel, passes/sequence_parallel.py): `data` is this
    model-parallel rank's chunk along `slice_axis` of a value one process holds whole. The mask
    is drawn for the whole value, as one process draws it, from the stream every rank of the
    group shares, and this rank keeps its chunk: the masks of all ranks together are one
    process's mask, bit for bit. It costs a whole-size draw on every rank (transients: the whole
    value's input, output and mask); a counter-based generator could skip to the chunk (not built).
    `slice_layout` says which positions the rank holds (context parallel's "zigzag": two runs;
    kernels/sequence_parallel.py `runs`).
    """
    if training_mode is not None and bool(training_mode):
        p = _ratio(ratio)
        if p > 0.0:
            if slice_axis is not None:
                out, mask = _sliced_dropout(data, p, slice_axis, slice_group, slice_layout)
            else:
                out, mask = torch.native_dropout(data, p, True)
            return (out, mask) if _nout > 1 else out
    if _nout > 1:
        return data, torch.ones_like(data, dtype=torch.bool)
    return data


def _sliced_dropout(
    data: torch.Tensor, p: float, axis: int, group: list[int] | str | None, layout: str = "contiguous"
) -> tuple[torch.Tensor, torch.Tensor]:
    """native_dropout of the whole value, `data` in this rank's positions and zeros elsewhere; this
    rank's positions of its output and mask (elementwise: the chunk's bits are one process's)."""
    if group is None:
        raise ValueError("Dropout: slice_axis needs slice_group (the model-parallel group it is split over)")
    parts = len(group_ranks(group, "Dropout"))
    rank = mp_rank(group if isinstance(group, str) else sorted(group))  # chunks go by ascending rank
    shape = list(data.shape)
    shape[axis] *= parts
    whole = data.new_zeros(shape)
    place(whole, axis, data, parts, rank, layout)
    out, mask = torch.native_dropout(whole, p, True)
    return (
        take(out, axis, parts, rank, layout).contiguous(),
        take(mask, axis, parts, rank, layout).contiguous(),
    )


@register("RandomNormal", needs_device=True, random=True)
@drawn
def random_normal(
    dtype: int = _FLOAT,
    mean: float = 0.0,
    scale: float = 1.0,
    seed: float | None = None,
    shape: list[int] | None = None,
    _device: torch.device | None = None,
) -> torch.Tensor:
    return torch.normal(
        mean, scale, shape, dtype=torch_dtype_from_onnx(dtype, what="random op"), device=_device
    )


@register("RandomNormalLike", random=True)
@drawn
def random_normal_like(
    input: torch.Tensor,
    dtype: int | None = None,
    mean: float = 0.0,
    scale: float = 1.0,
    seed: float | None = None,
) -> torch.Tensor:
    out_dtype = torch_dtype_from_onnx(dtype, what="random op") if dtype is not None else input.dtype
    return torch.normal(mean, scale, input.shape, dtype=out_dtype, device=input.device)


@register("RandomUniform", needs_device=True, random=True)
@drawn
def random_uniform(
    dtype: int = _FLOAT,
    high: float = 1.0,
    low: float = 0.0,
    seed: float | None = None,
    shape: list[int] | None = None,
    _device: torch.device | None = None,
) -> torch.Tensor:
    return torch.empty(shape, dtype=torch_dtype_from_onnx(dtype, what="random op"), device=_device).uniform_(
        low, high
    )


@register("RandomUniformLike", random=True)
@drawn
def random_uniform_like(
    input: torch.Tensor,
    dtype: int | None = None,
    high: float = 1.0,
    low: float = 0.0,
    seed: float | None = None,
) -> torch.Tensor:
    out_dtype = torch_dtype_from_onnx(dtype, what="random op") if dtype is not None else input.dtype
    return torch.empty(input.shape, dtype=out_dtype, device=input.device).uniform_(low, high)


@register("Bernoulli", random=True)
@drawn
def bernoulli(input: torch.Tensor, dtype: int | None = None, seed: float | None = None) -> torch.Tensor:
    out = torch.bernoulli(input)
    return out.to(torch_dtype_from_onnx(dtype, what="random op")) if dtype is not None else out


@register("Multinomial", random=True)
@drawn
def multinomial(
    input: torch.Tensor,
    dtype: int = _INT32,
    sample_size: int = 1,
    seed: float | None = None,
) -> torch.Tensor:
    # ONNX's input holds unnormalized log-probabilities; torch samples from probabilities.
    probs = torch.softmax(input.float(), -1)
    return torch.multinomial(probs, sample_size, replacement=True).to(
        torch_dtype_from_onnx(dtype, what="random op")
    )
