"""Random-number streams: which generator a random op draws from (MP-aware RNG, Megatron's and
Paddle's model-parallel RNG tracker).

Two streams:

* **shared** (`SHARED`): torch's default generator of the device. An op without an ``rng`` attr
  draws from it, and so does one the tensor-parallel pass marked ``rng="shared"`` (a random op on
  a value replicated over the MP group): seeded alike on every rank, it draws the same numbers
  there, so replicated values stay identical across the MP ranks.
* **model parallel** (`MODEL_PARALLEL`): one generator per (device, MP rank), for a random op on
  a value split over the MP group (``rng="model_parallel", group=[0, 1]``, set by the
  tensor-parallel pass): each rank drops its own slice with its own mask, as one process would
  drop the whole. ``group`` is the MP group as the TP collectives name it (global ranks, or
  ``"model_parallel"``: this worker's group of fleet.init's layout, as fleet writes it so that
  every worker's program prints the same); the MP rank is this worker's place in it, found when
  the op runs (0 in a group of one). Seeded ``seed + MP_SEED_OFFSET + mp_rank`` (Megatron's
  ``model_parallel_cuda_manual_seed``: ``seed + 2718 + tp_rank``). The kernel swaps the stream's
  state into the default generator around the draw (Megatron's ``tracker.fork()``), so every
  kernel draws as it always does.

Where the state lives: here, per process, beside torch's default generator (which the shared
stream is). Both are process state, not an executor's: one `metaopt.seed` call covers every
executor of the process, as ``torch.manual_seed`` does, and a pipeline runner, a startup
executor or a new executor keep drawing where the last one stopped. Passes only read the attr
vocabulary below (they never touch a generator).

Seeding (`seed`, what ``metaopt.seed(n)`` calls): the shared stream with ``torch.manual_seed(n)``
(every device), the model-parallel streams with ``n + 2718 + mp_rank`` (made on first use).
A process nobody seeded: torch seeds its default generator from the OS at start-up, differently
in every worker, so replicated dropout would differ across MP ranks. So the first draw of a
marked op (a tensor-parallel program's) in such a process seeds both streams as
``metaopt.seed(DEFAULT_SEED)`` would, with a warning: deterministic, the same shared stream on
every rank, a different model-parallel stream per rank. "Seeded" means `seed` ran, or torch's
seed changed since metaopt was imported (``torch.manual_seed``, or a checkpoint's generator state
restored): then the shared stream is left as it is and the model-parallel streams start from
``torch.initial_seed() + 2718 + mp_rank``. (``torch.manual_seed`` called before ``import
metaopt`` is not seen.) Once made, a model-parallel stream goes on drawing across a later
``torch.manual_seed``, which reseeds the shared stream only: to reproduce a run in the same
process, call `metaopt.seed`, which resets both.

Checkpoints: `state_dict` / `load_state_dict` hold every stream's state (the shared ones as
torch's generators, and each model-parallel one), to save beside the params.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

logger = logging.getLogger(__name__)

STREAM_ATTR = "rng"  # the op attr naming the stream: SHARED or MODEL_PARALLEL
GROUP_ATTR = "group"  # with MODEL_PARALLEL: the MP group (ranks, or "model_parallel")
SHARED = "shared"
MODEL_PARALLEL = "model_parallel"
STREAMS = (SHARED, MODEL_PARALLEL)
MP_SEED_OFFSET = 2718  # Megatron's: the model-parallel seed is seed + 2718 + tp_rank
DEFAULT_SEED = 0  # what an unseeded process is seeded with at its first tensor-parallel draw
_SEED_MOD = 2**64  # torch seeds are unsigned 64-bit

_base: int | None = None  # the seed both streams derive from; None: nobody seeded yet
_startup_seed = torch.initial_seed()  # torch's own start-up seed (from the OS), to see a reseed
_mp: dict[tuple[str, int | None, int], torch.Generator] = {}  # (device type, index, rank) -> stream


# --- the attr vocabulary (what passes read and write) ------------------------------------------


def shared_attrs() -> dict[str, Any]:
    """Attrs of a random op on a value replicated over the MP group."""
    return {STREAM_ATTR: SHARED}


def model_parallel_attrs(group: Sequence[int] | str) -> dict[str, Any]:
    """Attrs of a random op on a value split over the MP group `group` (as the TP collectives
    name it): it draws from the stream of this worker's MP rank."""
    return {STREAM_ATTR: MODEL_PARALLEL, GROUP_ATTR: group if isinstance(group, str) else list(group)}


def stream_attrs(attrs: Mapping[str, Any]) -> dict[str, Any]:
    """The stream attrs among a random op's `attrs` (what `RngState` needs to read the right state)."""
    if STREAM_ATTR not in attrs:
        return {}
    keys = (STREAM_ATTR, GROUP_ATTR) if attrs[STREAM_ATTR] == MODEL_PARALLEL else (STREAM_ATTR,)
    return {k: attrs[k] for k in keys if k in attrs}


def without_stream(attrs: Mapping[str, Any]) -> dict[str, Any]:
    """`attrs` less the stream attrs: a replay (RngReplay) draws from the state it recorded,
    restored into the default generator, not from the stream's current state."""
    mine = stream_attrs(attrs)
    return {k: v for k, v in attrs.items() if k not in mine}


def _check(stream: Any, group: Any) -> None:
    if stream is not None and stream not in STREAMS:
        raise ValueError(f"{STREAM_ATTR}={stream!r} is not an RNG stream; known: {list(STREAMS)}")
    if stream == MODEL_PARALLEL and not (
        group == "model_parallel"
        or (isinstance(group, (list, tuple)) and group and all(isinstance(r, int) for r in group))
    ):
        raise ValueError(
            f'{STREAM_ATTR}="{MODEL_PARALLEL}" needs {GROUP_ATTR}=<the MP group: its global ranks, or '
            f'"model_parallel">, got {group!r}'
        )


def _global_rank() -> int:
    """This worker's global rank (0 without torch.distributed)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def mp_rank(group: Sequence[int] | str) -> int:
    """This worker's place in MP group `group` (ranks, or "model_parallel": fleet.init's layout; a
    sliced draw's group may be another named one, "sep_parallel": `comm.NAMED_GROUPS`)."""
    if isinstance(group, str):
        from metaopt.ops.kernels.comm import named_group_ranks

        ranks = named_group_ranks(group, f'{STREAM_ATTR}="{MODEL_PARALLEL}"')
    else:
        ranks = list(group)
    if len(ranks) == 1:
        return 0
    me = _global_rank()
    if me not in ranks:
        raise RuntimeError(
            f'{STREAM_ATTR}="{MODEL_PARALLEL}" over MP group {ranks}, but this worker is rank {me} '
            "(torch.distributed not initialized, or the program was rewritten for another worker)"
        )
    return ranks.index(me)


# --- seeding -----------------------------------------------------------------------------------


def seed(n: int) -> None:
    """Seed both streams: the shared one (torch's default generators, every device) with `n`, the
    model-parallel one of MP rank r with ``n + MP_SEED_OFFSET + r`` (on its first use)."""
    global _base
    n = int(n)
    torch.manual_seed(n)
    _base = n % _SEED_MOD
    _mp.clear()


def _ensure_seeded() -> None:
    """Before a marked op's first draw: seed an unseeded process (module doc)."""
    global _base
    if _base is not None:
        return
    now = torch.initial_seed()
    if now != _startup_seed:  # torch.manual_seed (or a restored state) since import: the user's
        _base = now
        return
    logger.warning(
        "metaopt: a tensor-parallel program draws random numbers but no seed was set; seeding as "
        "metaopt.seed(%d) so replicated values agree across model-parallel ranks (call metaopt.seed(n) "
        "on every worker to choose)",
        DEFAULT_SEED,
    )
    seed(DEFAULT_SEED)


def _key(device: torch.device, rank: int) -> tuple[str, int | None, int]:
    index = device.index
    if device.type == "cuda" and index is None:
        index = torch.cuda.current_device()
    return device.type, index, rank


def _mp_generator(device: torch.device, rank: int) -> torch.Generator:
    """MP rank `rank`'s stream on `device` (made and seeded on first use)."""
    key = _key(device, rank)
    gen = _mp.get(key)
    if gen is None:
        assert _base is not None  # _ensure_seeded ran
        gen = torch.Generator(device=key[0] if key[1] is None else f"{key[0]}:{key[1]}")
        gen.manual_seed((_base + MP_SEED_OFFSET + rank) % _SEED_MOD)
        _mp[key] = gen
    return gen


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        torch.cuda.init()  # default_generators is empty until CUDA is initialised (no-op after)
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return torch.default_generator


# --- drawing -----------------------------------------------------------------------------------


def generator(attrs: Mapping[str, Any], device: torch.device) -> torch.Generator:
    """The generator a random op with `attrs` draws from on `device` (seeding the process first
    if it is a marked op's first draw)."""
    stream = attrs.get(STREAM_ATTR)
    group = attrs.get(GROUP_ATTR) if stream == MODEL_PARALLEL else None
    _check(stream, group)
    if stream is not None:
        _ensure_seeded()
    if stream == MODEL_PARALLEL:
        return _mp_generator(device, mp_rank(group))
    return _default_generator(device)


@contextmanager
def drawing_from(attrs: Mapping[str, Any], device: torch.device) -> Iterator[None]:
    """Inside, torch's default generator of `device` draws from the stream `attrs` name; after,
    the stream has advanced by what was drawn and the default generator is as it was."""
    gen = generator(attrs, device)
    default = _default_generator(device)
    if gen is default:
        yield
        return
    saved = default.get_state()
    default.set_state(gen.get_state())
    try:
        yield
    finally:
        gen.set_state(default.get_state())
        default.set_state(saved)


def drawn(kernel: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator of a random op's kernel: takes the op's stream attrs (``rng``, ``group``) and
    runs the kernel drawing from that stream. The device is the executor's (``_device``, for ops
    that make tensors from nothing) else the first tensor input's."""

    @functools.wraps(kernel)
    def run(*args: Any, **kw: Any) -> Any:
        stream = kw.pop(STREAM_ATTR, None)
        if stream is None:
            return kernel(*args, **kw)
        attrs = {STREAM_ATTR: stream}
        if stream == MODEL_PARALLEL:
            attrs[GROUP_ATTR] = kw.pop(GROUP_ATTR, None)
        device = kw.get("_device") or next(
            (a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu")
        )
        with drawing_from(attrs, device):
            return kernel(*args, **kw)

    return run


# --- checkpoints -------------------------------------------------------------------------------


def state_dict() -> dict[str, torch.Tensor]:
    """Every stream's state, as CPU uint8 tensors (``weights_only``-loadable): ``"cpu"`` and
    ``"cuda<i>"`` (torch's default generators: the shared stream), and ``"model_parallel.rank<r>.cpu"``
    / ``"model_parallel.rank<r>.cuda<i>"`` for each model-parallel stream this process has used."""
    out = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"cuda{i}"] = s
    for (dtype, index, rank), gen in sorted(_mp.items(), key=lambda kv: (kv[0][2], kv[0][0], kv[0][1] or 0)):
        dev = "cpu" if dtype == "cpu" else f"{dtype}{index}"
        out[f"{MODEL_PARALLEL}.rank{rank}.{dev}"] = gen.get_state()
    return out


def load_state_dict(states: Mapping[str, torch.Tensor]) -> None:
    """Restore what `state_dict` returned (the process counts as seeded afterwards). Model-parallel
    streams not in `states` restart from the seed; a CUDA state for a GPU not visible is skipped."""
    global _base
    bad = [k for k in states if not _is_state_key(k)]
    if bad:
        raise ValueError(f"RNG state {bad[0]!r} is not a stream of rng_streams.state_dict()")
    if "cpu" not in states:
        raise ValueError("RNG states lack 'cpu' (the shared stream's CPU generator)")
    torch.set_rng_state(states["cpu"])
    n_cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for i in range(n_cuda):
        if f"cuda{i}" in states:
            torch.cuda.set_rng_state(states[f"cuda{i}"], i)
    if _base is None:
        _base = torch.initial_seed()
    for k, t in states.items():
        if not k.startswith(MODEL_PARALLEL + "."):
            continue
        _, rank_text, dev = k.split(".")
        device = torch.device("cpu") if dev == "cpu" else torch.device("cuda", int(dev.removeprefix("cuda")))
        if device.type == "cuda" and (device.index or 0) >= n_cuda:
            continue
        _mp_generator(device, int(rank_text.removeprefix("rank"))).set_state(t)


def _is_state_key(k: str) -> bool:
    if k == "cpu" or (k.startswith("cuda") and k[4:].isdigit()):
        return True
    parts = k.split(".")
    return (
        len(parts) == 3
        and parts[0] == MODEL_PARALLEL
        and parts[1].startswith("rank")
        and parts[1][4:].isdigit()
        and (parts[2] == "cpu" or (parts[2].startswith("cuda") and parts[2][4:].isdigit()))
    )
