"""Issue 17: workers that build different programs fail at minimize, every one of them, within
seconds, naming the first var or op that differs; never gloo's C++ abort at the first collective.
A peer that never reaches minimize fails the others within METAOPT_COMM_TIMEOUT."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from workers import start_workers

from metaopt.fleet import env

HERE = Path(__file__).parent
HINT = "Every worker must build the same program"
ERROR = "WorkersDisagreeError: fleet minimize: the workers' training programs differ:"


def _run(mode: str, timeout_s: str) -> list[str]:
    procs = start_workers(2, [str(HERE / "agree_worker.py"), mode], {"METAOPT_COMM_TIMEOUT": timeout_s})
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=120)[0])
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for r, (p, out) in enumerate(zip(procs, outs, strict=True)):
        # a Python error (exit 1), not SIGABRT from gloo ("terminate called ... EnforceNotMet")
        assert p.returncode == 1, f"worker {r} exited {p.returncode}:\n{out[-3000:]}"
        assert "EnforceNotMet" not in out and "terminate called" not in out, out[-3000:]
        assert f"rank {r} ran a step" not in out
    return outs


def _minimize_seconds(out: str, rank: int) -> float:
    return float(re.search(rf"rank {rank} minimize ended after ([0-9.]+)s", out).group(1))


@pytest.mark.parametrize(
    "mode, first",
    [
        ("hidden", "var 'fc1.weight': rank 0 has `fc1.weight: float32[32,16] param`, "
                   "rank 1 has `fc1.weight: float32[48,16] param`"),
        ("pipeline", "stage 0's var 'fc1.weight': rank 0 has `fc1.weight: float32[32,16] param`, "
                     "rank 1 has `fc1.weight: float32[48,16] param`"),
    ],
)  # fmt: skip
def test_workers_with_different_programs_fail_at_minimize_naming_what_differs(mode, first):
    # The timeout is long, so a failure within it proves the mismatch was seen, not waited out.
    outs = _run(mode, timeout_s="60")
    for r, out in enumerate(outs):
        assert f"{ERROR} rank 1 differs from rank 0 first at {first}" in out, out[-3000:]
        assert HINT in out
        assert _minimize_seconds(out, r) < 30, out[-3000:]


@pytest.mark.parametrize(
    "mode, first",
    [
        ("stages", "the strategy's line 'stage': rank 0 has `|"),  # stage 2 against 3 (issue 47: hung)
        ("bucket", "the strategy's line 'Environment'"),  # fuse_all_reduce_ops only on rank 1
    ],
)
def test_workers_with_different_strategies_fail_at_minimize_before_any_collective(mode, first):
    """Compared before the rewrite's steps run: stage 3's initial broadcast is a collective the
    stage-2 worker never joined, and both waited out METAOPT_COMM_TIMEOUT (300 s) before."""
    outs = _run(mode, timeout_s="60")
    for r, out in enumerate(outs):
        assert (
            "WorkersDisagreeError: fleet minimize: the workers' strategies differ: rank 1 differs from "
            f"rank 0 first at {first}" in out
        ), out[-3000:]
        assert "Every worker must minimize with the same DistributedStrategy" in out
        assert _minimize_seconds(out, r) < 30, out[-3000:]


def test_a_peer_that_never_reaches_minimize_fails_the_others_within_the_timeout():
    procs = start_workers(2, [str(HERE / "agree_worker.py"), "hang"], {"METAOPT_COMM_TIMEOUT": "5"})
    try:
        out0, _ = procs[0].communicate(timeout=90)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert procs[0].returncode == 1, out0[-3000:]
    assert "CommError: the exchange of fleet minimize: the workers' strategies" in out0, out0[-3000:]
    assert "failed on rank 0 of 2" in out0 and "METAOPT_COMM_TIMEOUT" in out0
    assert 4 < _minimize_seconds(out0, 0) < 30


# --- the comparison itself, without processes ----------------------------------------------------


def _two_workers(monkeypatch) -> None:
    monkeypatch.setattr(env._STATE, "initialized", True)
    monkeypatch.setattr(env._STATE, "env", env.WorkerEnv(rank=0, world_size=2))


def test_the_first_difference_is_found_and_named(monkeypatch):
    """check_workers_agree's exchange replaced by two fixed workers: rank 1 has one var wider and
    one more op; the message names the var with both printed lines."""
    ref = [
        ("var 'x'", "x: f32[4]"),
        ("var 'w'", "w: f32[4,4] param"),
        ("op 0 (MatMul -> 'h')", "h = MatMul(x, w)"),
    ]
    other = [ref[0], ("var 'w'", "w: f32[4,8] param"), *ref[2:], ("op 1 (Relu -> 'y')", "y = Relu(h)")]
    calls = []

    def fake_gather(obj, what):  # what rank 0 and rank 1 would send, in the same three rounds
        calls.append(what)
        if len(calls) == 1:
            return [obj, ["other digest", len(other)]]
        if len(calls) == 2:
            return [obj, [env._line_hash(t) for _, t in other]]
        return [obj, {k: list(other[int(k)]) for k in obj}]

    monkeypatch.setattr(env, "_gather", fake_gather)
    _two_workers(monkeypatch)
    with pytest.raises(env.WorkersDisagreeError) as e:
        env.check_workers_agree(ref, "the programs", ". hint")
    assert str(e.value) == (
        "the programs differ: rank 1 differs from rank 0 first at var 'w': rank 0 has "
        "`w: f32[4,4] param`, rank 1 has `w: f32[4,8] param`. hint"
    )
    assert len(calls) == 3


def test_agreeing_workers_exchange_one_digest_only(monkeypatch):
    lines = [("var 'x'", "x: f32[4]")]
    calls = []
    monkeypatch.setattr(env, "_gather", lambda obj, what: calls.append(what) or [obj, obj])
    _two_workers(monkeypatch)
    env.check_workers_agree(lines, "the programs")
    assert calls == ["the exchange of the programs"]


def test_a_shorter_program_is_named_where_it_ends():
    firsts = {1: env._first_difference(["a", "b"], ["a", "b", "c"])}
    text = env._disagreement(
        "the programs", firsts, [{"2": None}, {"2": ["op 1 (Relu -> 'y')", "y = Relu(h)"]}]
    )
    assert text == (
        "the programs differ: rank 1 differs from rank 0 first at op 1 (Relu -> 'y'): rank 0 has "
        "nothing (its list ends before), rank 1 has `y = Relu(h)`"
    )
