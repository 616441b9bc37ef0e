"""Property tests of the pipeline schedules, run through the process-free simulator.

Sweeps p in 1..8 and m in 1..32 (interleaved: v in {2, 3}, m a multiple of p), plus
hand-made broken schedules and the argument errors.
"""

from __future__ import annotations

import functools
from collections import Counter

import pytest

from metaopt.ir.program import StagePlacement
from metaopt.runtime.schedules import (
    SCHEDULES,
    ZERO_BUBBLE,
    Action,
    ScheduleError,
    SimResult,
    in_flight_limit,
    schedule,
    simulate,
    simulate_actions,
)

STAGES = range(1, 9)
MICRO_BATCHES = range(1, 33)
COSTS = ((1.0, 1.0), (1.0, 2.0))


def shapes(mode: str, p: int) -> list[tuple[int, int]]:
    """(micro_batches, chunks) of the sweep for one mode and stage count."""
    if mode == "interleaved":
        return [(m, v) for v in (2, 3) for m in MICRO_BATCHES if m % p == 0]
    if mode == "ZBV":
        return [(m, 2) for m in MICRO_BATCHES if m % p == 0]
    return [(m, 1) for m in MICRO_BATCHES]


@functools.cache
def sim(mode: str, p: int, m: int, v: int = 1, f: float = 1.0, b: float = 2.0) -> SimResult:
    return simulate(mode, num_stages=p, micro_batches=m, chunks=v, f_cost=f, b_cost=b)


def known_bubble(p: int, m: int, v: int) -> float:
    # Narayanan et al. 2021: bubble time (p-1)(f+b)/v against ideal m(f+b), whatever f and b.
    return (p - 1) / (v * m + p - 1)


# ---------------------------------------------------------------- every schedule


@pytest.mark.parametrize("p", STAGES)
@pytest.mark.parametrize("mode", SCHEDULES)
def test_each_action_once_and_forward_before_backward(mode: str, p: int) -> None:
    kinds = "FBW" if mode in ZERO_BUBBLE else "FB"
    for m, v in shapes(mode, p):
        expected = Counter(Action(k, i, c) for k in kinds for i in range(m) for c in range(v))
        for s in range(p):
            acts = schedule(mode, num_stages=p, stage=s, micro_batches=m, chunks=v)
            assert Counter(acts) == expected, (mode, p, m, v, s)
            position = {a: n for n, a in enumerate(acts)}
            forward_of = {a: Action("F", a.micro_batch, a.chunk) for a in acts if a.kind == "B"}
            late = [b for b, f in forward_of.items() if position[f] > position[b]]
            assert late == [], (mode, p, m, v, s)
            backward_of = {a: Action("B", a.micro_batch, a.chunk) for a in acts if a.kind == "W"}
            assert [w for w, b in backward_of.items() if position[b] > position[w]] == []


@pytest.mark.parametrize("p", STAGES)
@pytest.mark.parametrize("mode", SCHEDULES)
def test_simulation_completes_with_known_bubble_and_exact_memory_bound(mode: str, p: int) -> None:
    for m, v in shapes(mode, p):
        for f, b in COSTS:
            r = sim(mode, p, m, v, f, b)  # raises ScheduleError on deadlock or unmatched send/recv
            if mode == "ZBV":  # its list is made for F = B = W (test_zbv_*); at F = 2B = 2W it
                # can lose to 1F1B (p=2, m=8: 0.123 against 0.111), so only the bound it is built for
                if (f, b) == (1.0, 2.0):
                    assert r.bubble_fraction == pytest.approx((p - 1) / (6 * m + p - 1), abs=1e-9)
            elif mode in ZERO_BUBBLE:  # below 1F1B's (test_zero_bubble_h1_*)
                assert r.bubble_fraction <= known_bubble(p, m, v) + 1e-9, (mode, p, m, f, b)
            else:
                assert r.bubble_fraction == pytest.approx(known_bubble(p, m, v), abs=1e-9), (
                    mode,
                    p,
                    m,
                    v,
                    f,
                    b,
                )
            assert r.compute_time == pytest.approx(p * m * (f + b))
            limits = tuple(in_flight_limit(mode, p, s, m, v) for s in range(p))
            assert r.max_in_flight == limits, (mode, p, m, v)
            # Every link delivers in send order, so order-matched P2P (NCCL) needs no tags.
            assert r.out_of_order == (), (mode, p, m, v)


@pytest.mark.parametrize("mode", SCHEDULES)
def test_timeline_is_serial_per_worker_and_receives_wait_for_sends(mode: str) -> None:
    p, v = 4, (2 if mode in ("interleaved", "ZBV") else 1)
    place = StagePlacement.of(mode, p, v)
    r = sim(mode, p, 8, v)
    finish: dict[tuple[str, int, int], float] = {}  # (kind, micro-batch, virtual stage) -> end
    for w, line in enumerate(r.timeline):
        assert [a for _, _, a in line] == schedule(mode, num_stages=p, stage=w, micro_batches=8, chunks=v)
        for (_, prev_end, _), (start, _, _) in zip(line, line[1:]):
            assert start >= prev_end
        for _, end, a in line:
            finish[(a.kind, a.micro_batch, place.vstage(w, a.chunk))] = end
    for w, line in enumerate(r.timeline):
        for start, _, a in line:
            k = place.vstage(w, a.chunk)
            upstream = ("F", a.micro_batch, k - 1) if a.kind == "F" else ("B", a.micro_batch, k + 1)
            if upstream in finish:
                assert start >= finish[upstream], (w, a)
    assert r.makespan == max(end for line in r.timeline for _, end, _ in line)


# ---------------------------------------------------------------- 1F1B against F-then-B


@pytest.mark.parametrize("p", STAGES)
def test_1f1b_holds_at_most_p_minus_stage_activations(p: int) -> None:
    for m in MICRO_BATCHES:
        r = sim("1F1B", p, m)
        assert r.max_in_flight == tuple(min(p - s, m) for s in range(p)), (p, m)
        assert all(peak <= p - s for s, peak in enumerate(r.max_in_flight))


@pytest.mark.parametrize("p", STAGES)
def test_f_then_b_holds_every_micro_batch(p: int) -> None:
    for m in MICRO_BATCHES:
        assert sim("F-then-B", p, m).max_in_flight == (m,) * p


@pytest.mark.parametrize("p", STAGES)
def test_1f1b_same_bubble_as_f_then_b_with_less_memory(p: int) -> None:
    for m in MICRO_BATCHES:
        for f, b in COSTS:
            one_f_one_b, gpipe = sim("1F1B", p, m, 1, f, b), sim("F-then-B", p, m, 1, f, b)
            assert one_f_one_b.bubble_fraction == pytest.approx(gpipe.bubble_fraction), (p, m, f, b)
            assert one_f_one_b.makespan == pytest.approx(gpipe.makespan)
        if m >= p:
            stage0_1f1b, stage0_gpipe = (
                sim("1F1B", p, m).max_in_flight[0],
                sim("F-then-B", p, m).max_in_flight[0],
            )
            assert stage0_1f1b <= (p / m + 0.1) * stage0_gpipe, (p, m)


def test_1f1b_order_warmup_steady_cooldown() -> None:
    got = schedule("1F1B", num_stages=4, stage=1, micro_batches=6)
    assert " ".join(map(str, got)) == "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5"
    # Fewer micro-batches than the warm-up wants: all forwards, then all backwards.
    assert " ".join(map(str, schedule("1F1B", num_stages=8, stage=0, micro_batches=2))) == "F0 F1 B0 B1"


def test_f_then_b_order() -> None:
    got = schedule("F-then-B", num_stages=3, stage=2, micro_batches=3)
    assert " ".join(map(str, got)) == "F0 F1 F2 B0 B1 B2"


# ---------------------------------------------------------------- interleaved


@pytest.mark.parametrize("p", STAGES)
def test_interleaved_bubble_smaller_than_1f1b(p: int) -> None:
    for m, v in shapes("interleaved", p):
        for f, b in COSTS:
            inter, plain = sim("interleaved", p, m, v, f, b), sim("1F1B", p, m, 1, f, b)
            if p == 1:  # one worker never idles, whatever the schedule
                assert inter.bubble_fraction == pytest.approx(0.0, abs=1e-12)
                assert plain.bubble_fraction == pytest.approx(0.0, abs=1e-12)
            else:
                assert inter.bubble_fraction < plain.bubble_fraction, (p, m, v, f, b)
                assert inter.makespan < plain.makespan, (p, m, v, f, b)


@pytest.mark.parametrize("p", STAGES)
def test_interleaved_memory_is_megatrons_bound(p: int) -> None:
    for m, v in shapes("interleaved", p):
        r = sim("interleaved", p, m, v)
        expected = tuple(min(2 * (p - s - 1) + (v - 1) * p + 1, m * v) for s in range(p))
        assert r.max_in_flight == expected, (p, m, v)
        if m > p:  # stage 0 holds p + (p-1)/v workers' worth: a bit more than 1F1B's p
            assert r.max_in_flight[0] / v == pytest.approx(p + (p - 1) / v)


def test_interleaved_order_is_megatrons() -> None:
    # Hand-derived from Megatron-LM's get_model_chunk_id: groups of p micro-batches per chunk,
    # warm-up 2*(p-s-1) + (v-1)*p, backwards visit chunks last-first.
    got = schedule("interleaved", num_stages=2, stage=0, micro_batches=4, chunks=2)
    assert " ".join(map(str, got)) == (
        "F0 F1 F0.c1 F1.c1 F2 B0.c1 F3 B1.c1 F2.c1 B0 F3.c1 B1 B2.c1 B3.c1 B2 B3"
    )


# ---------------------------------------------------------------- broken schedules


def test_cyclic_wait_raises_naming_each_blocked_worker() -> None:
    # Worker 1 wants micro-batch 1 first; worker 0 sends it only after B0, which needs worker 1.
    lists = [
        [Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)],
        [Action("F", 1), Action("F", 0), Action("B", 0), Action("B", 1)],
    ]
    with pytest.raises(ScheduleError) as info:
        simulate_actions(lists, micro_batches=2)
    msg = str(info.value)
    assert msg.startswith("deadlock")
    assert (
        "worker 0 blocked at B0 (action 1) waiting for the grad of micro-batch 0 from virtual stage 1" in msg
    )
    assert "worker 1 blocked at F1 (action 0) waiting for the activation of micro-batch 1" in msg


def test_interleaved_cycle_through_the_wraparound_link_is_reported() -> None:
    # Worker 0 runs chunk 1 of micro-batch 0 before chunk 0: it waits on worker 1, which waits on it.
    lists = [
        [Action("F", 0, 1), Action("F", 0, 0), Action("B", 0, 1), Action("B", 0, 0)],
        [Action("F", 0, 0), Action("F", 0, 1), Action("B", 0, 1), Action("B", 0, 0)],
    ]
    with pytest.raises(ScheduleError, match=r"worker 0 blocked at F0\.c1.*worker 1 blocked at F0 "):
        simulate_actions(lists, micro_batches=1, chunks=2)


def test_backward_before_its_forward_is_refused() -> None:
    lists = [[Action("F", 0), Action("B", 0)], [Action("B", 0), Action("F", 0)]]
    with pytest.raises(ScheduleError, match="worker 1 runs B0 before F0"):
        simulate_actions(lists, micro_batches=1)


@pytest.mark.parametrize(
    ("acts", "message"),
    [
        ([Action("F", 0)], "worker 0 never runs B0"),
        ([Action("F", 0), Action("B", 0), Action("B", 0)], "worker 0 runs B0 twice"),
        ([Action("F", 0), Action("B", 0), Action("F", 1)], r"F1 is out of range \(micro_batches=1"),
        ([Action("F", 0), Action("B", 0), "F1"], "'F1' is not an Action"),
    ],
)
def test_malformed_action_lists(acts: list, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        simulate_actions([acts], micro_batches=1)


# ---------------------------------------------------------------- argument errors


@pytest.mark.parametrize(
    ("mode", "suggestion"),
    [
        ("1f1b", "'1F1B'"),
        ("gpipe", "'F-then-B'"),
        ("fthenb", "'F-then-B'"),
        ("interleave", "'interleaved'"),
        ("zb-h1", "'ZBH1'"),
    ],
)
def test_unknown_mode_suggests(mode: str, suggestion: str) -> None:
    with pytest.raises(ValueError, match=f"unknown pipeline schedule '{mode}' \\(did you mean {suggestion}"):
        schedule(mode, num_stages=2, stage=0, micro_batches=2)


def test_unknown_mode_without_close_match_lists_choices() -> None:
    with pytest.raises(ValueError, match="choose one of F-then-B, 1F1B, interleaved") as info:
        simulate("zigzag", num_stages=2, micro_batches=2)
    assert "did you mean" not in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stage": 4}, r"stage 4 out of range for num_stages=4 \(valid: 0\.\.3\)"),
        ({"stage": -1}, "stage -1 out of range"),
        ({"stage": True}, "stage must be an int, got True"),
        ({"micro_batches": 0}, "micro_batches must be >= 1, got 0"),
        ({"num_stages": 0}, "num_stages must be >= 1, got 0"),
        ({"micro_batches": 2.0}, "micro_batches must be an int, got 2.0"),
        ({"chunks": 2}, "chunks=2 only applies to the 'interleaved' schedule"),
    ],
)
def test_bad_arguments_name_the_value(kwargs: dict, message: str) -> None:
    args = {"num_stages": 4, "stage": 0, "micro_batches": 8} | kwargs
    with pytest.raises(ValueError, match=message):
        schedule("1F1B", **args)


def test_interleaved_argument_rules() -> None:
    with pytest.raises(ValueError, match="needs chunks >= 2; with chunks=1 it is plain '1F1B'"):
        schedule("interleaved", num_stages=2, stage=0, micro_batches=4)
    with pytest.raises(
        ValueError, match=r"micro_batches \(6\) to be a multiple of num_stages \(4\).*use 4 or 8"
    ):
        schedule("interleaved", num_stages=4, stage=0, micro_batches=6, chunks=2)
    with pytest.raises(ValueError, match=r"micro_batches \(3\) .* num_stages \(4\).*use 4 micro-batches"):
        in_flight_limit("interleaved", 4, 0, 3, 2)


@pytest.mark.parametrize(("name", "value"), [("f_cost", 0), ("b_cost", -1.0), ("f_cost", True)])
def test_costs_must_be_positive(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"{name} must be a positive number, got {value!r}"):
        simulate("1F1B", num_stages=2, micro_batches=2, **{name: value})


def test_action_prints_short_and_validates() -> None:
    assert [str(a) for a in (Action("F", 3), Action("B", 3), Action("F", 3, 1))] == ["F3", "B3", "F3.c1"]
    assert repr([Action("B", 0, 2)]) == "[B0.c2]"
    with pytest.raises(ValueError, match="Action kind must be 'F', 'B' or 'W', got 'X'"):
        Action("X", 0)
    with pytest.raises(ValueError, match="micro_batch must be >= 0, got -1"):
        Action("F", -1)


# ---------------------------------------------------------------- per-worker costs (ideal step time)


@pytest.mark.parametrize("mode", SCHEDULES)
def test_one_cost_per_worker_equal_costs_give_the_scalar_result(mode: str) -> None:
    p, m, v = 4, 8, (2 if mode in ("interleaved", "ZBV") else 1)
    scalar = sim(mode, p, m, v, 1.0, 2.0)
    listed = simulate(mode, num_stages=p, micro_batches=m, chunks=v, f_cost=[1.0] * p, b_cost=(2.0,) * p)
    assert listed == scalar


@pytest.mark.parametrize("m", [1, 2, 8])
def test_the_slowest_stage_sets_the_pace(m: int) -> None:
    """Two stages, the second three times the first's cost: after the first forward, the
    second stage works without pause (f1 + b1 per micro-batch), then the first stage's last
    backward: f0 + m (f1 + b1) + b0, as a timeline by hand for m = 2 also shows."""
    f, b = [1.0, 3.0], [2.0, 6.0]
    for mode in ("1F1B", "F-then-B"):
        r = simulate(mode, num_stages=2, micro_batches=m, f_cost=f, b_cost=b)
        assert r.makespan == pytest.approx(f[0] + m * (f[1] + b[1]) + b[0]), (mode, m)
        assert r.compute_time == pytest.approx(m * (sum(f) + sum(b)))
    if m == 2:
        r = simulate("1F1B", num_stages=2, micro_batches=2, f_cost=f, b_cost=b)
        spans = [[(s, e, str(a)) for s, e, a in tl] for tl in r.timeline]
        assert spans[0] == [(0, 1, "F0"), (1, 2, "F1"), (10, 12, "B0"), (19, 21, "B1")]
        assert spans[1] == [(1, 4, "F0"), (4, 10, "B0"), (10, 13, "F1"), (13, 19, "B1")]


def test_per_worker_costs_are_checked() -> None:
    with pytest.raises(ValueError, match=r"f_cost must be one number or one per worker \(2\), got 3"):
        simulate("1F1B", num_stages=2, micro_batches=2, f_cost=[1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="b_cost must be a positive number, got 0"):
        simulate("1F1B", num_stages=2, micro_batches=2, b_cost=[1.0, 0])


# ---------------------------------------------------------------- zero bubble (ZB-H1)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_zero_bubble_h1_cuts_1f1bs_bubble_to_a_third_at_its_memory(p: int) -> None:
    """Qi et al.'s ZB-H1 with F = B = W (the backward's cost split evenly): the bubble falls from
    1F1B's (p-1)/(m+p-1) (in units of a whole step's work) to (p-1)/(3m+p-1) once m >= p: the
    warm-up's idle time is 1F1B's, the cool-down's is filled by the W actions stage s defers.
    No stage holds more micro-batches' activations for their B than 1F1B (p - s), nor more
    micro-batches' values of any kind than 1F1B's stage 0 (p)."""
    for m in (p, 2 * p, 4 * p, 16):
        zb, one = sim("ZBH1", p, m), sim("1F1B", p, m)
        assert zb.compute_time == pytest.approx(one.compute_time)
        assert zb.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-9), (p, m)
        assert zb.max_in_flight == one.max_in_flight
        assert max(zb.max_held) <= max(one.max_held) == min(p, m)
        assert zb.out_of_order == ()


def test_zero_bubble_h1_order_is_the_papers() -> None:
    """p = 4, m = 8 (the paper's figure 3): stage 0 runs each W right after its B, the last
    stage defers its W by p - 1 micro-batches into the cool-down."""
    first = schedule("ZBH1", num_stages=4, stage=0, micro_batches=8)
    last = schedule("ZBH1", num_stages=4, stage=3, micro_batches=8)
    assert (
        " ".join(map(str, first)) == "F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7"
    )
    assert (
        " ".join(map(str, last)) == "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7"
    )


def test_w_costs_split_the_backward_and_a_w_before_its_b_is_refused() -> None:
    r = simulate("ZBH1", num_stages=2, micro_batches=4, f_cost=1.0, b_cost=2.0, w_cost=0.5)
    assert r.compute_time == pytest.approx(2 * 4 * 3.0)  # the same work as 1F1B's
    with pytest.raises(ValueError, match="w_cost .* must be below b_cost"):
        simulate("ZBH1", num_stages=2, micro_batches=2, b_cost=1.0, w_cost=1.0)
    acts = [Action("F", 0), Action("W", 0), Action("B", 0)]
    with pytest.raises(ScheduleError, match="worker 0 runs W0 before B0"):
        simulate_actions([acts], micro_batches=1)
    with pytest.raises(ScheduleError, match="worker 0 never runs W1"):
        simulate_actions([[*acts[:1], acts[2], acts[1], Action("F", 1), Action("B", 1)]], micro_batches=2)


def test_paddles_names_are_these_schedules() -> None:
    assert schedule("FThenB", num_stages=2, stage=0, micro_batches=2) == schedule(
        "F-then-B", num_stages=2, stage=0, micro_batches=2
    )
    assert schedule("VPP", num_stages=2, stage=0, micro_batches=2, chunks=2) == schedule(
        "interleaved", num_stages=2, stage=0, micro_batches=2, chunks=2
    )
    assert schedule("ZBVPP", num_stages=2, stage=1, micro_batches=4, chunks=2) == schedule(
        "ZBV", num_stages=2, stage=1, micro_batches=4, chunks=2
    )


# ---------------------------------------------------------------- zero bubble V (ZB-V)


def test_the_v_placement_puts_the_first_and_last_chunk_on_worker_0() -> None:
    v = StagePlacement.of("ZBV", 4, 2)
    assert [v.worker(k) for k in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [v.vstages(w) for w in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert all(v.vstage(v.worker(k), v.chunk(k)) == k for k in range(8))
    loop = StagePlacement.of("interleaved", 4, 2)
    assert [loop.worker(k) for k in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]


@pytest.mark.parametrize("p", [2, 4])
def test_zbv_halves_zbh1s_bubble_at_1f1bs_memory(p: int) -> None:
    """Qi et al.'s ZB-V with F = B = W per chunk: the only idle time is the first forward's way
    down the V, (p-1) chunk-forwards of the 6m chunk-actions a worker runs: a bubble of
    (p-1)/(6m+p-1), below ZB-H1's (p-1)/(3m+p-1) (p=2, m=8: 0.0204 against 0.0400; p=4, m=8:
    0.0588 against 0.1111). Each worker holds at most 2p chunk-units of values (F done, W not
    done): 1F1B's peak of p whole micro-batches, on every worker; every link is first in, first
    out; the hand-off between virtual stages p-1 and p is no message."""
    for m in (p, 2 * p, 8, 16):
        zbv = simulate("ZBV", num_stages=p, micro_batches=m, chunks=2)
        zbh1, one = sim("ZBH1", p, m), sim("1F1B", p, m)
        assert zbv.compute_time == pytest.approx(one.compute_time)
        assert zbv.bubble_fraction == pytest.approx((p - 1) / (6 * m + p - 1), abs=1e-9), (p, m)
        assert zbv.bubble_fraction <= zbh1.bubble_fraction
        assert max(zbv.max_held) == 2 * max(one.max_held) == 2 * min(p, m)  # chunk units: halves
        assert zbv.out_of_order == ()
    # worker p-1 runs both sides of the hand-off between virtual stages p-1 and p
    v = StagePlacement.of("ZBV", p, 2)
    assert v.worker(p - 1) == v.worker(p) == p - 1
    r = simulate("ZBV", num_stages=p, micro_batches=8, chunks=2)
    assert all(len(line) == 3 * 2 * 8 for line in r.timeline)


def test_zbv_order_at_two_workers() -> None:
    """p = 2, m = 4: worker 0 (virtual stages 0 and 3) forwards two micro-batches down chunk 0,
    meets them coming back on chunk 1, and runs B of chunk 1 (the loss end) right after its F."""
    first = schedule("ZBV", num_stages=2, stage=0, micro_batches=4, chunks=2)
    assert " ".join(map(str, first)) == (
        "F0 F1 F0.c1 B0.c1 F1.c1 B1.c1 B0 W0.c1 B1 W1.c1 W0 F2 W1 F3 F2.c1 B2.c1 F3.c1 B3.c1 B2 W2.c1 "
        "B3 W3.c1 W2 W3"
    )


def test_zbv_shape_rules_name_the_value() -> None:
    with pytest.raises(ValueError, match="'ZBV' schedule runs 2 chunks per worker"):
        schedule("ZBV", num_stages=2, stage=0, micro_batches=4)
    with pytest.raises(ValueError, match=r"multiple of num_stages \(4\); use 4 or 8 micro-batches"):
        schedule("ZBV", num_stages=4, stage=0, micro_batches=6, chunks=2)


def test_a_v_list_simulated_as_a_loop_is_another_pipeline() -> None:
    """The placement is the simulator's input: ZB-V's lists run in a loop would send chunk 1's
    activations the wrong way round (and deadlock), so a placement that does not fit is refused."""
    acts = [schedule("ZBV", num_stages=2, stage=w, micro_batches=2, chunks=2) for w in range(2)]
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate_actions(acts, micro_batches=2, chunks=2)
    with pytest.raises(ValueError, match="does not fit 2 workers"):
        simulate_actions(acts, micro_batches=2, chunks=2, placement=StagePlacement.of("ZBV", 4, 2))
