"""Random-number state ops: what makes a recomputed random op replay its forward mask.

``RngState`` records the generator state right before a random op; ``RngReplay``
restores it around the op's own kernel (and puts the generator back afterwards), so
the recomputed mask is bit-identical to the forward's — torch.utils.checkpoint's
preserve_rng_state, one random op at a time.

Streams (MP-aware RNG, metaopt/ops/rng_streams.py): ``RngState`` carries its random op's stream
attrs (``rng``, ``group``: the recompute pass copies them) and records the state of the
generator that op draws from, the model-parallel stream of its rank included. ``RngReplay``
restores that state into the default generator and runs the kernel without the stream attrs, so
the copy draws exactly what the forward drew; every generator, the stream's too, is left as it
was (the replay consumes nothing).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from metaopt.ops import registry, rng_streams
from metaopt.ops.registry import register, register_collective


@register("RngState", domain="metaopt", needs_device=True, host_outputs=True, recomputable=False)
def rng_state(_device: torch.device, **stream: object) -> torch.Tensor:
    """The state of the generator the next random op draws from on `_device` (a CPU byte tensor):
    the stream its attrs `stream` name (rng_streams), torch's default generator when none."""
    return rng_streams.generator(stream, _device).get_state()


def _replayed(op) -> SimpleNamespace:  # noqa: ANN001
    """The random op an RngReplay runs: its type, its inputs (past the state), its own attrs."""
    attrs = {k.removeprefix("f_"): v for k, v in op.attrs.items() if k.startswith("f_")}
    return SimpleNamespace(type=op.attrs["op"], inputs=op.inputs[1:], outputs=op.outputs, attrs=attrs)


def _replay_aliases(op) -> list[tuple[int, int]]:
    # The replayed op's own pairs (its row, its attrs), its inputs shifted past the state input.
    pairs = registry.alias_pairs(_replayed(op))
    if pairs is None:  # no row: anything may alias anything
        return [(k, j) for k in range(len(op.outputs)) for j in range(1, len(op.inputs))]
    return [(k, j + 1) for k, j in pairs]


def _replay_host_inputs(op, program) -> tuple[int, ...]:  # noqa: ANN001
    """The state (a host value), and the replayed op's own host inputs (Dropout's ratio and
    training mode), shifted past the state."""
    inner = registry.get(op.attrs["op"])
    shifted = registry.host_inputs(SimpleNamespace(type=op.attrs["op"], inputs=op.inputs[1:]), program)
    return (0, *(j + 1 for j in shifted)) if inner is not None else (0,)


@register(
    "RngReplay",
    domain="metaopt",
    needs_outputs=True,
    needs_device=True,
    host_inputs=_replay_host_inputs,
    aliases=_replay_aliases,
    inner=_replayed,
)
def rng_replay(
    state: torch.Tensor,
    *inputs: torch.Tensor | None,
    op: str,
    n_out: int,
    _nout: int,
    _device: torch.device,
    **fwd_attrs,
):
    """Run random op `op` on `inputs` from generator state `state`, leaving the generator as it was."""
    return _replay(state, inputs, op, n_out, _nout, _device, {}, fwd_attrs)


@register_collective(
    "RngReplayCollective",
    needs_outputs=True,
    needs_device=True,
    host_inputs=_replay_host_inputs,
    aliases=_replay_aliases,
    inner=_replayed,
    # every rank of the group replays its own copy of the same program: the peers meet again
    recomputable=True,
    notes="RngReplay of a random op that communicates (context parallel's RingAttention)",
)
def rng_replay_collective(
    state: torch.Tensor,
    *inputs: torch.Tensor | None,
    op: str,
    n_out: int,
    _nout: int,
    _device: torch.device,
    _rt,
    _key: str,
    **fwd_attrs,
):
    """RngReplay of a random op whose row needs the executor's runtime (its communicator)."""
    return _replay(state, inputs, op, n_out, _nout, _device, {"_rt": _rt, "_key": _key}, fwd_attrs)


def _replay(state, inputs, op: str, n_out: int, _nout: int, _device, runtime: dict, fwd_attrs: dict):  # noqa: ANN001
    row = registry.get(op)
    # Without the stream attrs: the state restored below is the stream's, recorded in the forward.
    attrs = rng_streams.without_stream({k.removeprefix("f_"): v for k, v in fwd_attrs.items()})
    if row.needs_outputs:
        attrs["_nout"] = n_out
    device = _device  # the executor's: a random op may have no tensor input to tell
    if row.needs_device:
        attrs["_device"] = device
    if row.needs_runtime:
        attrs.update(runtime)
    if device.type == "cuda":
        with torch.random.fork_rng(devices=[device.index], device_type="cuda"):
            torch.cuda.set_rng_state(state, device)
            out = row.kernel(*inputs, **attrs)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(state)
            out = row.kernel(*inputs, **attrs)
    outs = out if isinstance(out, tuple) else (out,)
    outs = outs + (None,) * (_nout - len(outs))
    return outs[0] if _nout == 1 else outs[:_nout]
