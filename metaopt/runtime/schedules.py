"""Pipeline schedules (F-then-B, 1F1B, interleaved 1F1B, zero-bubble ZB-H1 and ZB-V) and a
process-free simulator.

Pure Python: the pipeline runtime asks `schedule()` for one worker's ordered actions
per step and sizes its activation buffers with `in_flight_limit()`; `simulate()` runs
every worker's list together, without processes or torch, so a schedule's deadlock
freedom, send/recv matching, memory and bubble can be checked in milliseconds.

Model. `num_stages` workers (p) run `micro_batches` (m) micro-batches per step. The
interleaved schedule splits the model into p*v virtual stages (v = `chunks`); virtual
stage k lives on worker k % p as its chunk k // p, as in Megatron-LM. ZB-V splits it into 2p
virtual stages placed in a V: worker w runs virtual stages w and 2p-1-w (`StagePlacement`, the
one rule the pipeline pass and the runtime place stages by). The other schedules have
chunks=1, so a virtual stage is a worker.

Communication, as the runtime does it and the simulator models it:

- F of micro-batch i on virtual stage k receives k-1's output activation for i
  (unless k == 0), computes, then sends its output to k+1 (unless k is last).
- B of i on k receives the grad from k+1 (unless k is last), computes, then sends
  its input grad to k-1 (unless k == 0). B(i) on k needs F(i) on k done before it.
- Sends never block (isend); a receive blocks until its matching send was issued.
  Each worker runs its list strictly in order.
- Two neighbouring virtual stages on one worker (ZB-V's p-1 and p) hand the value over in
  the worker's memory: a dependency, no message.

Activations "in flight" are counted per micro-batch x chunk: F done minus B done.
With chunks > 1 one unit is a chunk's activations, about 1/v of a worker's share.

Zero-bubble schedules (Qi et al., ICLR 2024) split each backward in two: B, the grads of the
stage's inputs (what the previous stage waits for), and W, the grads of its weights (what
nothing waits for). W of i on k needs B of i on k done and talks to nobody; between its B and
its W a micro-batch holds the values W reads ("held": F done minus W done).
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Sequence
from dataclasses import dataclass

from metaopt.ir.program import PADDLE_SCHEDULES, SPLIT_BACKWARD_SCHEDULES, UNBUILT_SCHEDULES, StagePlacement

Cost = float | Sequence[float]  # one cost for every worker, or one per worker

__all__ = [
    "SCHEDULES",
    "Action",
    "ScheduleError",
    "SimResult",
    "in_flight_limit",
    "schedule",
    "simulate",
    "simulate_actions",
]

SCHEDULES = ("F-then-B", "1F1B", "interleaved", "ZBH1", "ZBV")
ZERO_BUBBLE = SPLIT_BACKWARD_SCHEDULES  # the schedules whose backward is split into B and W actions
PADDLE_NAMES = PADDLE_SCHEDULES  # Paddle's own spellings, accepted as these
NOT_BUILT = UNBUILT_SCHEDULES  # named by Paddle and the zero-bubble paper, refused by name

# Names users bring from other frameworks; only used to suggest, never accepted silently,
# so a config always says exactly which schedule it runs.
_ALIASES = {
    "gpipe": "F-then-B",
    "fthenb": "F-then-B",
    "pipedream": "1F1B",
    "pipedream-flush": "1F1B",
    "interleaved-1f1b": "interleaved",
    "virtual": "interleaved",
    "zb-h1": "ZBH1",
    "zero-bubble": "ZBH1",
    "zb-v": "ZBV",
    "zbv-zero-bubble": "ZBV",
}
V_CHUNKS = 2  # ZB-V's chunks per worker


class ScheduleError(RuntimeError):
    """A schedule that cannot run: deadlock, unmatched send/recv, B before its F, bad action list."""


@dataclass(frozen=True, repr=False)
class Action:
    """One compute step of a worker: forward ("F"), backward ("B"; with a zero-bubble schedule
    only the grads of the inputs) or weight grads ("W") of a micro-batch on a chunk."""

    kind: str
    micro_batch: int
    chunk: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("F", "B", "W"):
            raise ValueError(f"Action kind must be 'F', 'B' or 'W', got {self.kind!r}")
        _check_int("micro_batch", self.micro_batch, minimum=0)
        _check_int("chunk", self.chunk, minimum=0)

    def __str__(self) -> str:
        # Chunk 0 is left out so non-interleaved schedules read like the papers ("F3", "B3").
        suffix = f".c{self.chunk}" if self.chunk else ""
        return f"{self.kind}{self.micro_batch}{suffix}"

    __repr__ = __str__  # lists of actions print as readable schedules in errors and test output


@dataclass(frozen=True)
class SimResult:
    """What `simulate` measured. Times are in the units of f_cost / b_cost.

    timeline[w] is worker w's [(start, end, action)] in execution order;
    max_in_flight[w] the peak of F done minus B done on worker w (per micro-batch x chunk);
    max_held[w] the peak of F done minus W done (micro-batches holding any values: with no W
    actions, max_in_flight);
    bubble_fraction = 1 - compute_time / (num_stages * makespan).
    out_of_order lists "src->dst" worker pairs whose receives are posted in another order
    than the sends were issued: harmless with tagged point-to-point messages (gloo), a
    mismatch for transports that pair messages by order only (NCCL send/recv).
    """

    num_stages: int
    micro_batches: int
    chunks: int
    timeline: tuple[tuple[tuple[float, float, Action], ...], ...]
    max_in_flight: tuple[int, ...]
    max_held: tuple[int, ...]
    makespan: float
    compute_time: float
    bubble_fraction: float
    out_of_order: tuple[str, ...]


# ---------------------------------------------------------------- argument checks


def _check_int(name: str, value: object, *, minimum: int) -> None:
    # bool is an int subclass; `stage=True` is a bug, not stage 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def canonical(mode: object) -> str:
    """`mode` as one of SCHEDULES (Paddle's spellings accepted); a ValueError naming the
    choices, or NotImplementedError for a named schedule not built yet."""
    return _check_mode(mode)


def _check_mode(mode: object) -> str:
    if mode in SCHEDULES:
        return mode  # type: ignore[return-value]
    if mode in PADDLE_NAMES:
        return PADDLE_NAMES[mode]  # type: ignore[index]
    if mode in NOT_BUILT:
        raise NotImplementedError(f"pipeline schedule {mode!r}: {NOT_BUILT[mode]}")  # type: ignore[index]
    word = str(mode)
    by_lower = {s.lower(): s for s in SCHEDULES}
    close = [by_lower[word.lower()]] if word.lower() in by_lower else []
    if word.lower() in _ALIASES and _ALIASES[word.lower()] not in close:
        close.append(_ALIASES[word.lower()])
    close += [
        by_lower[c]
        for c in difflib.get_close_matches(word.lower(), list(by_lower), n=3, cutoff=0.6)
        if by_lower[c] not in close
    ]
    hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
    raise ValueError(f"unknown pipeline schedule {mode!r}{hint}; choose one of {', '.join(SCHEDULES)}")


def _check_shape(mode: str, num_stages: int, micro_batches: int, chunks: int) -> None:
    _check_int("num_stages", num_stages, minimum=1)
    _check_int("micro_batches", micro_batches, minimum=1)
    _check_int("chunks", chunks, minimum=1)
    if mode == "ZBV":
        _check_v_shape(num_stages, micro_batches, chunks)
        return
    if mode != "interleaved" and chunks != 1:
        raise ValueError(
            f"chunks={chunks} only applies to the 'interleaved' schedule; {mode!r} runs one chunk per stage"
        )
    if mode == "interleaved" and chunks == 1:
        raise ValueError("the 'interleaved' schedule needs chunks >= 2; with chunks=1 it is plain '1F1B'")
    if mode == "interleaved" and micro_batches % num_stages:
        # Megatron-LM's rule: micro-batches run in groups of num_stages per chunk.
        lower = micro_batches // num_stages * num_stages
        options = [n for n in (lower, lower + num_stages) if n >= 1]
        raise ValueError(
            f"the 'interleaved' schedule needs micro_batches ({micro_batches}) to be a multiple of "
            f"num_stages ({num_stages}), as in Megatron-LM; use {' or '.join(map(str, options))} "
            f"micro-batches, or the '1F1B' schedule"
        )


def _check_v_shape(num_stages: int, micro_batches: int, chunks: int) -> None:
    if chunks != V_CHUNKS:
        raise ValueError(f"the 'ZBV' schedule runs {V_CHUNKS} chunks per worker (a V), got chunks={chunks}")
    if micro_batches % num_stages:
        # `_zero_bubble_v` keeps its bound and every link first-in first-out for such m only
        lower = micro_batches // num_stages * num_stages
        options = [n for n in (lower, lower + num_stages) if n >= 1]
        raise ValueError(
            f"the 'ZBV' schedule needs micro_batches ({micro_batches}) to be a multiple of num_stages "
            f"({num_stages}); use {' or '.join(map(str, options))} micro-batches, or the 'ZBH1' schedule"
        )


def _check_stage(stage: int, num_stages: int) -> None:
    if isinstance(stage, bool) or not isinstance(stage, int):
        raise ValueError(f"stage must be an int, got {stage!r}")
    if not 0 <= stage < num_stages:
        raise ValueError(
            f"stage {stage} out of range for num_stages={num_stages} (valid: 0..{num_stages - 1})"
        )


# ---------------------------------------------------------------- schedules


def schedule(mode: str, *, num_stages: int, stage: int, micro_batches: int, chunks: int = 1) -> list[Action]:
    """Worker `stage`'s ordered actions for one step under `mode` (one of SCHEDULES).

    - "F-then-B" (GPipe): F0..F(m-1), then B0..B(m-1). Backwards go in ascending order so
      every link carries its grads in the order it carried the activations (FIFO), and
      micro-batch 0, whose grad reaches a stage first, is processed first.
    - "1F1B" (PipeDream-flush, Megatron-LM non-interleaved): min(p - stage - 1, m) warm-up
      forwards, then alternate one F and one B, then the cool-down backwards.
    - "interleaved" (Megatron-LM interleaved 1F1B): the same shape over m*v chunk-steps;
      see `_interleaved`.
    - "ZBH1" (zero-bubble H1): F, B and W actions; see `_zero_bubble_h1`.
    - "ZBV" (zero-bubble V): F, B and W actions of two chunks placed in a V; see `_zero_bubble_v`.

    Every (F, i, c) and (B, i, c) appears exactly once, and with a zero-bubble schedule every
    (W, i, c) too.
    """
    mode = _check_mode(mode)
    _check_shape(mode, num_stages, micro_batches, chunks)
    _check_stage(stage, num_stages)
    if mode == "F-then-B":
        return _f_then_b(micro_batches)
    if mode == "1F1B":
        return _one_f_one_b(num_stages, stage, micro_batches)
    if mode == "ZBH1":
        return list(_zero_bubble_h1(num_stages, micro_batches)[stage])
    if mode == "ZBV":
        return list(_zero_bubble_v(num_stages, micro_batches)[stage])
    return _interleaved(num_stages, stage, micro_batches, chunks)


def _f_then_b(m: int) -> list[Action]:
    return [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]


def _one_f_one_b(p: int, s: int, m: int) -> list[Action]:
    # Stage s must run p - s - 1 forwards before the first grad can come back from the last stage.
    warmup = min(p - s - 1, m)
    actions = [Action("F", i) for i in range(warmup)]
    for j in range(m - warmup):
        actions += [Action("F", warmup + j), Action("B", j)]
    actions += [Action("B", j) for j in range(m - warmup, m)]
    return actions


@functools.cache
def _zero_bubble_h1(p: int, m: int) -> tuple[tuple[Action, ...], ...]:
    """Every worker's ZB-H1 list: the zero-bubble paper's H1 shape, made by a list scheduler
    run on unit costs (F = B = W = 1, the paper's assumption), deterministic in (p, m).

    Each worker, when free, takes the first of these that can start soonest: a B whose grad has
    come (the critical path), an F whose activation has come, the oldest W; on a tie an F goes
    before a B, and a W only fills time nothing else can use. Two limits keep 1F1B's memory:
    worker s holds at most p - s micro-batches' activations for their B (1F1B's count) and at
    most p micro-batches' values of any kind (F done, W not done), 1F1B's peak, on stage 0.
    So stage 0 runs each W right after its B, and the later stages defer theirs into the bubble
    1F1B leaves at the end of a step: the bubble falls from 1F1B's (p-1)/(m+p-1) to about a
    third of it (p=4, m=8: 0.273 -> 0.111), at 1F1B's peak memory plus what W holds past B.
    """
    free = [0.0] * p  # when each worker is next free
    acts: list[list[Action]] = [[] for _ in range(p)]
    made = {}  # ("act"|"grad", i, stage) -> time the message was sent
    nxt_f, nxt_b = [0] * p, [0] * p
    waiting_w: list[list[int]] = [[] for _ in range(p)]
    done_w = [0] * p
    while any(len(a) < 3 * m for a in acts):
        best = None
        for s in range(p):
            for cand in _zb_candidates(s, p, m, free[s], made, nxt_f[s], nxt_b[s], waiting_w[s], done_w[s]):
                key = (cand[0], cand[1], s)
                if best is None or key < best[0]:
                    best = (key, cand[2], s)
        if best is None:  # unreachable: some worker always has an action
            raise ScheduleError(f"ZBH1: no worker can move (p={p}, m={m})")
        (start, _, s), a = best[0], best[1]
        free[s] = start + 1.0
        acts[s].append(a)
        if a.kind == "F":
            nxt_f[s] += 1
            made[("act", a.micro_batch, s)] = free[s]
        elif a.kind == "B":
            nxt_b[s] += 1
            waiting_w[s].append(a.micro_batch)
            made[("grad", a.micro_batch, s)] = free[s]
        else:
            waiting_w[s].pop(0)
            done_w[s] += 1
    return tuple(tuple(a) for a in acts)


def _zb_candidates(
    s: int,
    p: int,
    m: int,
    free: float,
    made: dict[tuple[str, int, int], float],
    nxt_f: int,
    nxt_b: int,
    waiting_w: list[int],
    done_w: int,
) -> list[tuple[float, int, Action]]:
    """(start, rank, action) of what worker s could run next (rank: F 0, B 1, W 2 on a tie)."""
    out = []
    if nxt_b < nxt_f:  # its forward is done
        ready = made.get(("grad", nxt_b, s + 1)) if s < p - 1 else made[("act", nxt_b, s)]
        if ready is not None:
            out.append((max(free, ready), 1, Action("B", nxt_b)))
    if nxt_f < m and nxt_f - nxt_b < p - s and nxt_f - done_w < p:
        ready = made.get(("act", nxt_f, s - 1)) if s > 0 else 0.0
        if ready is not None:
            out.append((max(free, ready), 0, Action("F", nxt_f)))
    if waiting_w:
        out.append((free, 2, Action("W", waiting_w[0])))
    return out


@functools.cache
def _zero_bubble_v(p: int, m: int) -> tuple[tuple[Action, ...], ...]:
    """Every worker's ZB-V list (Qi et al.'s V schedule): two chunks per worker placed in a V
    (`StagePlacement`: worker w runs virtual stages w and 2p-1-w), each backward split into B and
    W, made by a list scheduler on unit costs (F = B = W per chunk), deterministic in (p, m).

    Each worker, when free, takes what can start soonest: on a tie an F before a B before a W
    (W only fills time nothing else can use), chunk 1 before chunk 0 (the micro-batch nearer
    the loss: its B comes back sooner). Two limits bound the memory: a worker holds at most 2p
    chunk-units of values (F done, W not done), 1F1B's peak of p whole micro-batches, and at
    most p of them for chunk 0. The chunk-0 limit keeps the schedule periodic, so with m a
    multiple of p every link carries its messages first in, first out (what NCCL's pairing by
    order and the header stream of `runtime.comm` need) and the only idle time is the first
    forward's trip down the V: a bubble of (p-1)/(6m+p-1), ZB-H1's (p-1)/(3m+p-1) halved
    (p=4, m=8: 0.059 against 0.111), at 1F1B's peak memory.
    """
    place = StagePlacement(p, V_CHUNKS, v_shape=True)
    free = [0.0] * p
    acts: list[list[Action]] = [[] for _ in range(p)]
    made: dict[_Msg, float] = {}  # ("act"|"grad", micro-batch, virtual stage) -> when it is ready
    nxt_f = [[0] * V_CHUNKS for _ in range(p)]
    nxt_b = [[0] * V_CHUNKS for _ in range(p)]
    held = [[0] * V_CHUNKS for _ in range(p)]  # F done, W not done, per chunk
    waiting_w: list[list[Action]] = [[] for _ in range(p)]  # B done, W not: oldest first
    while any(len(a) < 3 * V_CHUNKS * m for a in acts):
        best = None
        for w in range(p):
            state = (free[w], nxt_f[w], nxt_b[w], held[w], waiting_w[w])
            for start, rank, a in _zbv_candidates(place, w, m, state, made):
                if best is None or (start, rank, w) < best[0]:
                    best = ((start, rank, w), a)
        if best is None:  # unreachable for m a multiple of p (the tests sweep it)
            raise ScheduleError(f"ZBV: no worker can move (p={p}, m={m})")
        (start, _, w), a = best
        free[w] = start + 1.0
        acts[w].append(a)
        k, c, i = place.vstage(w, a.chunk), a.chunk, a.micro_batch
        if a.kind == "F":
            nxt_f[w][c] += 1
            held[w][c] += 1
            made[("act", i, k)] = free[w]
        elif a.kind == "B":
            nxt_b[w][c] += 1
            waiting_w[w].append(Action("W", i, c))
            made[("grad", i, k)] = free[w]
        else:
            waiting_w[w].pop(0)
            held[w][c] -= 1
    return tuple(tuple(a) for a in acts)


def _zbv_candidates(
    place: StagePlacement, w: int, m: int, state: tuple, made: dict[_Msg, float]
) -> list[tuple[float, tuple[int, int], Action]]:
    """(start, rank, action) of what worker w could run next under ZB-V's rules."""
    free, nxt_f, nxt_b, held, waiting_w = state
    p, last = place.num_stages, place.virtual_stages - 1
    out = []
    for c in (1, 0):
        k = place.vstage(w, c)
        if nxt_b[c] < nxt_f[c]:  # its forward is done
            i = nxt_b[c]
            ready = made.get(("grad", i, k + 1)) if k < last else made[("act", i, k)]
            if ready is not None:
                out.append((max(free, ready), (1, -c), Action("B", i, c)))
        room = sum(held) < 2 * p and (c == 1 or held[0] < p)
        if nxt_f[c] < m and room:
            i = nxt_f[c]
            ready = made.get(("act", i, k - 1)) if k > 0 else 0.0
            if ready is not None:
                out.append((max(free, ready), (0, -c), Action("F", i, c)))
    if waiting_w:
        out.append((free, (2, 0), waiting_w[0]))
    return out


def _interleaved_warmup(p: int, s: int, m: int, v: int) -> int:
    """Megatron-LM's warm-up length (in chunk-forwards) of worker s.

    (v-1)*p forwards fill every chunk but the last; 2*(p-s-1) more cover the round trip
    to the last worker. Megatron-LM also runs all m*v forwards first when m == p; we do not:
    under our communication model (isend, blocking recv) the formula below is deadlock-free
    there too, with the same bubble and fewer activations in flight on the later stages
    (the simulator checks both).
    """
    return min(2 * (p - s - 1) + (v - 1) * p, m * v)


def _interleaved_step(k: int, p: int, v: int, forward: bool) -> Action:
    """The k-th forward (or backward) of a worker, as Megatron-LM orders them.

    Micro-batches go in groups of p: chunk 0 runs a group, then chunk 1 the same group, ...
    Backwards visit the chunks in reverse (the last chunk's grads come first).
    """
    group, within = divmod(k, p * v)
    chunk = within // p
    micro_batch = group * p + k % p
    return Action("F" if forward else "B", micro_batch, chunk if forward else v - 1 - chunk)


def _interleaved(p: int, s: int, m: int, v: int) -> list[Action]:
    total = m * v
    warmup = _interleaved_warmup(p, s, m, v)
    actions = [_interleaved_step(k, p, v, True) for k in range(warmup)]
    for j in range(total - warmup):
        actions += [_interleaved_step(warmup + j, p, v, True), _interleaved_step(j, p, v, False)]
    actions += [_interleaved_step(j, p, v, False) for j in range(total - warmup, total)]
    return actions


def in_flight_limit(mode: str, num_stages: int, stage: int, micro_batches: int, chunks: int = 1) -> int:
    """Most activations (micro-batch x chunk units) worker `stage` holds at once under `mode`.

    - F-then-B: m (every forward runs before the first backward).
    - 1F1B: min(p - stage, m): the warm-up's p - stage - 1 forwards plus the steady state's one.
    - ZBH1: min(p - stage, m), as 1F1B (the values W still reads past B: `simulate`'s max_held).
    - ZBV: counted from the worker's list (F done minus B done, in chunk units; at most 2p,
      1F1B's p whole micro-batches).
    - interleaved: Megatron-LM's bound, min(2*(p - stage - 1) + (v - 1)*p + 1, m*v) (Megatron
      itself holds all m*v when m == p, see `_interleaved_warmup`). In units of a whole worker's
      activations that is about p + (p - 1)/v on stage 0 (m > p): a little more than 1F1B's p,
      the memory price Megatron-LM reports for the smaller bubble.

    The bound is exact: `simulate` reaches it on every stage.
    """
    mode = _check_mode(mode)
    _check_shape(mode, num_stages, micro_batches, chunks)
    _check_stage(stage, num_stages)
    if mode == "F-then-B":
        return micro_batches
    if mode in ("1F1B", "ZBH1"):
        return min(num_stages - stage, micro_batches)
    if mode == "ZBV":
        return _peak_in_flight(_zero_bubble_v(num_stages, micro_batches)[stage])
    warmup = _interleaved_warmup(num_stages, stage, micro_batches, chunks)
    # The steady state runs one more F before each B; with no steady state the peak is the warm-up.
    return min(warmup + 1, micro_batches * chunks)


def _peak_in_flight(actions: Sequence[Action]) -> int:
    count = peak = 0
    for a in actions:
        count += {"F": 1, "B": -1}.get(a.kind, 0)
        peak = max(peak, count)
    return peak


# ---------------------------------------------------------------- simulator

# A message: (payload, micro_batch, sending virtual stage). "act" goes k -> k+1, "grad" k -> k-1.
_Msg = tuple[str, int, int]


def simulate(
    mode: str,
    *,
    num_stages: int,
    micro_batches: int,
    chunks: int = 1,
    f_cost: Cost = 1.0,
    b_cost: Cost = 2.0,
    w_cost: Cost | None = None,
) -> SimResult:
    """Run every worker's `schedule(mode, ...)` together; see `simulate_actions`."""
    mode = _check_mode(mode)
    _check_shape(mode, num_stages, micro_batches, chunks)
    lists = [
        schedule(mode, num_stages=num_stages, stage=s, micro_batches=micro_batches, chunks=chunks)
        for s in range(num_stages)
    ]
    return simulate_actions(
        lists,
        micro_batches=micro_batches,
        chunks=chunks,
        f_cost=f_cost,
        b_cost=b_cost,
        w_cost=w_cost,
        placement=StagePlacement.of(mode, num_stages, chunks),
    )


def simulate_actions(
    actions: Sequence[Sequence[Action]],
    *,
    micro_batches: int,
    chunks: int = 1,
    f_cost: Cost = 1.0,
    b_cost: Cost = 2.0,
    w_cost: Cost | None = None,
    placement: StagePlacement | None = None,
) -> SimResult:
    """Discrete-event run of per-worker action lists (actions[w] is worker w's list).

    `placement`: which worker runs each virtual stage (default: the loop, virtual stage k on
    worker k % p; ZB-V's lists need its V).

    f_cost / b_cost are one micro-batch's forward / backward through a worker's whole share
    of the model, so with chunks > 1 a chunk's action costs f_cost / chunks: makespans of
    different schedules compare directly. b_cost is the whole backward: where the lists hold W
    actions it splits into B (b_cost - w_cost) and W (w_cost, default half of b_cost), so a
    zero-bubble schedule does the same work as the others. Either one number for every worker
    or one per worker (stages of unequal cost: the runtime's measured compute times, which give a
    step's ideal time, `makespan`, to compare a real step with). Communication is free; a
    worker waits only on receives. Raises ScheduleError on a malformed list, a B before its
    F, a deadlock (naming every blocked worker and the message it waits for) or an
    unmatched send/recv.
    """
    _check_int("micro_batches", micro_batches, minimum=1)
    _check_int("chunks", chunks, minimum=1)
    if not actions:
        raise ValueError("actions must hold one list per worker, got none")
    f = _per_worker("f_cost", f_cost, len(actions))
    b = _per_worker("b_cost", b_cost, len(actions))
    for k, acts in enumerate(actions):
        _check_list(k, acts, micro_batches, chunks)
    split = any(a.kind == "W" for acts in actions for a in acts)
    w = [x / 2 for x in b] if w_cost is None or not split else _per_worker("w_cost", w_cost, len(actions))
    if split and any(wi >= bi for wi, bi in zip(w, b, strict=True)):
        raise ValueError(f"w_cost {w} must be below b_cost {b}: b_cost is the whole backward, B and W")
    costs = [
        {"F": fi / chunks, "B": (bi - wi if split else bi) / chunks, "W": wi / chunks}
        for fi, bi, wi in zip(f, b, w, strict=True)
    ]
    place = placement or StagePlacement(len(actions), chunks)
    if (place.num_stages, place.chunks) != (len(actions), chunks):
        raise ValueError(
            f"placement {place} does not fit {len(actions)} workers' lists of {chunks} chunk(s) each"
        )
    return _Sim(actions, micro_batches, place, costs).run()


def _per_worker(name: str, cost: Cost, workers: int) -> list[float]:
    """`cost` as one positive number per worker."""
    costs = list(cost) if isinstance(cost, Sequence) and not isinstance(cost, str) else [cost] * workers
    if len(costs) != workers:
        raise ValueError(f"{name} must be one number or one per worker ({workers}), got {len(costs)}")
    for c in costs:
        if not isinstance(c, (int, float)) or isinstance(c, bool) or not c > 0:
            raise ValueError(f"{name} must be a positive number, got {c!r}")
    return [float(c) for c in costs]


def _check_list(worker: int, acts: Sequence[Action], m: int, v: int) -> None:
    """Each (F, i, c) and (B, i, c) exactly once, with W actions each (W, i, c) once too,
    nothing out of range."""
    seen: set[Action] = set()
    for a in acts:
        if not isinstance(a, Action):
            raise ScheduleError(f"worker {worker}: {a!r} is not an Action")
        if a.micro_batch >= m or a.chunk >= v:
            raise ScheduleError(f"worker {worker}: {a} is out of range (micro_batches={m}, chunks={v})")
        if a in seen:
            raise ScheduleError(f"worker {worker} runs {a} twice")
        seen.add(a)
    kinds = "FBW" if any(a.kind == "W" for a in acts) else "FB"
    missing = [Action(k, i, c) for c in range(v) for i in range(m) for k in kinds]
    missing = [a for a in missing if a not in seen]
    if missing:
        raise ScheduleError(
            f"worker {worker} never runs {', '.join(map(str, missing[:8]))}"
            + (f" (and {len(missing) - 8} more)" if len(missing) > 8 else "")
        )


class _Sim:
    """State of one simulation; `run` advances workers until all finish or none can move."""

    def __init__(
        self, actions: Sequence[Sequence[Action]], m: int, place: StagePlacement, costs: list[dict]
    ) -> None:
        self.actions = [list(a) for a in actions]
        self.place = place
        self.p, self.m, self.v = len(actions), m, place.chunks
        self.cost = costs  # per worker: {"F": ..., "B": ..., "W": ...}
        self.last_vstage = place.virtual_stages - 1
        self.sent: dict[_Msg, float] = {}  # message -> time its send was issued
        self.received: set[_Msg] = set()
        self.pos = [0] * self.p
        self.clock = [0.0] * self.p
        self.forwarded: list[set[tuple[int, int]]] = [set() for _ in range(self.p)]
        self.backwarded: list[set[tuple[int, int]]] = [set() for _ in range(self.p)]
        self.in_flight = [0] * self.p
        self.peak = [0] * self.p
        self.held = [0] * self.p  # F done, W (or, without W actions, B) not done
        self.held_peak = [0] * self.p
        self.split = [any(a.kind == "W" for a in acts) for acts in self.actions]
        self.timeline: list[list[tuple[float, float, Action]]] = [[] for _ in range(self.p)]
        # Per directed worker pair, message order at the sender and at the receiver.
        self.send_order: dict[tuple[int, int], list[_Msg]] = {}
        self.recv_order: dict[tuple[int, int], list[_Msg]] = {}

    def vstage(self, worker: int, a: Action) -> int:
        return self.place.vstage(worker, a.chunk)

    def recv_of(self, worker: int, a: Action) -> _Msg | None:
        k = self.vstage(worker, a)
        if a.kind == "W":
            return None
        if a.kind == "F":
            return ("act", a.micro_batch, k - 1) if k > 0 else None
        return ("grad", a.micro_batch, k + 1) if k < self.last_vstage else None

    def send_of(self, worker: int, a: Action) -> _Msg | None:
        k = self.vstage(worker, a)
        if a.kind == "W":
            return None
        if a.kind == "F":
            return ("act", a.micro_batch, k) if k < self.last_vstage else None
        return ("grad", a.micro_batch, k) if k > 0 else None

    def msg_link(self, msg: _Msg) -> tuple[int, int]:
        """(sending worker, receiving worker) of a message."""
        payload, _, k = msg
        return self.place.worker(k), self.place.worker(k + 1 if payload == "act" else k - 1)

    def run(self) -> SimResult:
        progressed = True
        while progressed:
            progressed = False
            for w in range(self.p):
                while self.pos[w] < len(self.actions[w]) and self.step(w):
                    progressed = True
        blocked = [w for w in range(self.p) if self.pos[w] < len(self.actions[w])]
        if blocked:
            raise ScheduleError("deadlock: " + "; ".join(self.describe_block(w) for w in blocked))
        unmatched = sorted(set(self.sent) - self.received)
        if unmatched:  # unreachable for complete lists, kept as the simulator's own invariant
            raise ScheduleError(f"sends never received: {unmatched}")
        return self.result()

    def step(self, w: int) -> bool:
        """Run worker w's next action if its receive is satisfied; False if it must wait."""
        a = self.actions[w][self.pos[w]]
        need = self.recv_of(w, a)
        if need is not None and need not in self.sent:
            return False
        if a.kind == "B" and (a.micro_batch, a.chunk) not in self.forwarded[w]:
            forward = Action("F", a.micro_batch, a.chunk)
            raise ScheduleError(
                f"worker {w} runs {a} before {forward}: a backward needs its forward's activations"
            )
        if a.kind == "W" and (a.micro_batch, a.chunk) not in self.backwarded[w]:
            raise ScheduleError(
                f"worker {w} runs {a} before {Action('B', a.micro_batch, a.chunk)}: the weight grads "
                "need the grads of the outputs B makes"
            )
        start = self.clock[w] if need is None else max(self.clock[w], self.sent[need])
        end = start + self.cost[w][a.kind]
        if need is not None:
            self.received.add(need)
            self.note_order(self.recv_order, need)
        out = self.send_of(w, a)
        if out is not None:
            self.sent[out] = end  # isend right after compute: never blocks
            self.note_order(self.send_order, out)
        self.track_memory(w, a)
        self.timeline[w].append((start, end, a))
        self.clock[w] = end
        self.pos[w] += 1
        return True

    def note_order(self, order: dict[tuple[int, int], list[_Msg]], msg: _Msg) -> None:
        """Record `msg` on its link; a hand-off within one worker is no message on any link."""
        src, dst = self.msg_link(msg)
        if src != dst:
            order.setdefault((src, dst), []).append(msg)

    def track_memory(self, w: int, a: Action) -> None:
        if a.kind == "F":
            self.forwarded[w].add((a.micro_batch, a.chunk))
            self.in_flight[w] += 1
            self.peak[w] = max(self.peak[w], self.in_flight[w])
            self.held[w] += 1
            self.held_peak[w] = max(self.held_peak[w], self.held[w])
        elif a.kind == "B":
            self.backwarded[w].add((a.micro_batch, a.chunk))
            self.in_flight[w] -= 1
            self.held[w] -= 0 if self.split[w] else 1
        else:
            self.held[w] -= 1

    def describe_block(self, w: int) -> str:
        a = self.actions[w][self.pos[w]]
        payload, i, k = self.recv_of(w, a)  # type: ignore[misc]  # blocked means it has a receive
        what = "activation" if payload == "act" else "grad"
        return (
            f"worker {w} blocked at {a} (action {self.pos[w]}) waiting for the {what} of "
            f"micro-batch {i} from virtual stage {k} (worker {self.place.worker(k)})"
        )

    def result(self) -> SimResult:
        makespan = max(self.clock)
        compute = sum(end - start for tl in self.timeline for start, end, _ in tl)
        out_of_order = tuple(
            f"{src}->{dst}"
            for (src, dst), order in sorted(self.send_order.items())
            if self.recv_order.get((src, dst)) != order
        )
        return SimResult(
            num_stages=self.p,
            micro_batches=self.m,
            chunks=self.v,
            timeline=tuple(tuple(tl) for tl in self.timeline),
            max_in_flight=tuple(self.peak),
            max_held=tuple(self.held_peak),
            makespan=makespan,
            compute_time=compute,
            bubble_fraction=1.0 - compute / (self.p * makespan),
            out_of_order=out_of_order,
        )
