"""Zero-bubble pipelines (issue 34): ZB-H1 and ZB-V on 2 gloo workers, the zoo's Hugging Face GPT-2
(its embedding tied to the LM head: held by both stages with ZB-H1; with ZB-V, whose V puts the
first and the last of the 4 chunks on worker 0, held by two chunks of worker 0).

The ZB-H1 stage programs are 1F1B's with each backward cut into B and W (passes/pipeline_phases.py):
the same ops, and each param's grad accumulated over the micro-batches in the same order, so a
ZB-H1 run equals 1F1B's BIT FOR BIT (losses and params, every worker), dropout included; with
recompute it equals the same schedule without recompute bit for bit. Against one process (whose
float sums run in another order) the bar is DESIGN's for pipelines: rtol 1e-5, atol 4e-5, on SGD
params and Adam losses.

ZB-V runs other stage programs (4 virtual stages, the hand-off between chunks 1 and 2 inside
worker 1, the tied grad accumulated per chunk and summed once per step), so it is held to one
process by the pipeline bar, and bit for bit only to itself: with recompute and dropout against
the same schedule without recompute.

Memory: a micro-batch's values that W reads stay alive from its B to its W; ZB-H1 defers W on
the last stage by one micro-batch (p - 1), so its peak is at most 1F1B's plus one micro-batch's
W-held values (the W phase's carried inputs, counted from the program) plus the part of them
the next B makes before that W runs.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch
from workers import start_workers, wait_workers

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

CASES = [
    "hf-gpt2:1F1B:sgd",
    "hf-gpt2:ZBH1:sgd",
    "hf-gpt2:ZBH1:adam",
    "hf-gpt2:1F1B:sgd:drop",
    "hf-gpt2:ZBH1:sgd:drop",
    "hf-gpt2:ZBH1:sgd:drop:recompute",
    "hf-gpt2:ZBV:sgd",
    "hf-gpt2:ZBV:adam",
    "hf-gpt2:ZBV:sgd:drop",
    "hf-gpt2:ZBV:sgd:drop:recompute",
]
TOL = {"rtol": 1e-5, "atol": 4e-5}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("zero_bubble")
    wait_workers(start_workers(2, [str(HERE / "zb_worker.py"), str(out), *CASES]), "zero bubble", 400)
    return out


def _ranks(out: Path, case: str) -> list[dict]:
    return [torch.load(out / f"{case}.rank{r}.pt", weights_only=True) for r in range(2)]


def _bitwise(out: Path, a: str, b: str) -> None:
    for r, (x, y) in enumerate(zip(_ranks(out, a), _ranks(out, b), strict=True)):
        assert x["losses"] == y["losses"], (a, b, r)
        differ = [k for k in x["params"] if not torch.equal(x["params"][k], y["params"][k])]
        assert x["params"].keys() == y["params"].keys() and not differ, (a, b, r, differ[:5])


@pytest.mark.parametrize(("mode", "chunks"), [("ZBH1", 1), ("ZBV", 2)])
def test_zero_bubble_runs_b_and_w_as_the_schedule_says(runs, mode, chunks):
    from metaopt.runtime.schedules import schedule

    for r, got in enumerate(_ranks(runs, f"hf-gpt2:{mode}:sgd")):
        want = schedule(mode, num_stages=2, stage=r, micro_batches=4, chunks=chunks)
        assert got["actions"] == [str(a) for a in want]


@pytest.mark.parametrize("extra", ["", ":drop"])
def test_zbh1_equals_1f1b_bit_for_bit(runs, extra):
    _bitwise(runs, f"hf-gpt2:1F1B:sgd{extra}", f"hf-gpt2:ZBH1:sgd{extra}")


@pytest.mark.parametrize("mode", ["ZBH1", "ZBV"])
def test_zero_bubble_with_recompute_and_dropout_equals_it_without_recompute(runs, mode):
    _bitwise(runs, f"hf-gpt2:{mode}:sgd:drop", f"hf-gpt2:{mode}:sgd:drop:recompute")


@functools.cache
def _one_process(opt: str) -> dict:
    import zb_worker
    from training_cases import STEPS, batch, export

    import metaopt

    main = export("hf-gpt2")
    zb_worker.make_optimizer(opt).minimize(main.loss)
    exe = metaopt.Executor("cpu")
    losses = [float(exe.run(main, feed=batch("hf-gpt2", s), fetch_list=[main.loss])[0]) for s in range(STEPS)]
    return {"losses": losses, "params": {v.name: exe.scope[v.name].clone() for v in main.params()}}


@pytest.mark.parametrize("opt", ["sgd", "adam"])
@pytest.mark.parametrize("mode", ["ZBH1", "ZBV"])
def test_zero_bubble_equals_one_process(runs, mode, opt):
    ref = _one_process(opt)
    first, last = _ranks(runs, f"hf-gpt2:{mode}:{opt}")
    if mode == "ZBV":  # the V: the loss (the last chunk) lives on worker 0
        first, last = last, first
    assert all(x is None for x in first["losses"])  # the loss lives on the last stage's worker
    torch.testing.assert_close(torch.tensor(last["losses"]), torch.tensor(ref["losses"]), **TOL)
    if opt == "adam":
        return  # Adam: losses only (DESIGN.md's bar)
    seen = set()
    for got in (first, last):
        for k, t in got["params"].items():
            torch.testing.assert_close(t, ref["params"][k], **TOL, msg=lambda m, k=k: f"{k}: {m}")
            seen.add(k)
    assert seen == set(ref["params"])


def test_the_tied_embedding_stays_one_value_on_both_stages(runs):
    first, last = _ranks(runs, "hf-gpt2:ZBH1:sgd")
    tied = set(first["params"]) & set(last["params"])
    assert tied, "GPT-2's embedding is read by the first stage and the LM head by the last"
    assert all(torch.equal(first["params"][k], last["params"][k]) for k in tied)


def test_zbv_holds_the_tied_embedding_once_on_worker_0_and_hands_off_inside_worker_1(runs):
    """The V puts chunks 0 and 3 (embedding, LM head) on worker 0: the tied param is one value
    there, its grad made per chunk and summed before the update, no all-reduce between workers;
    chunks 1 and 2 are both worker 1's, so nothing crosses between them by Send/Recv."""
    from metaopt.ir import parse_program

    w0, w1 = (parse_program(r["program"]) for r in _ranks(runs, "hf-gpt2:ZBV:sgd"))
    assert w0.pipeline.placement.vstages(0) == (0, 3) and w1.pipeline.placement.vstages(1) == (1, 2)
    wte = "m.transformer.wte.weight"  # the zoo wraps the model as `m`
    assert wte in w0.vars and wte not in w1.vars and w0.pipeline.groups == ()
    assert not [op for op in w0.ops if op.type == "AllReduce"]
    sums = [op for op in w0.ops if op.type == "GradSum" and op.origin == wte and op.role == "optimize"]
    assert len(sums) == 1 and len(sums[0].inputs) == 2  # the two chunks' accumulated parts
    peers = {(op.stage, op.attrs["peer"]) for op in w1.ops if "peer" in op.attrs}
    assert peers and not peers & {(1, 2), (2, 1)}


def test_the_peak_is_1f1bs_plus_what_deferred_w_actions_hold(runs):
    """Each worker's measured peak: ZB-H1 at most 1F1B's plus one micro-batch's values carried
    into its W phase (from F and B: held while a deferred W waits), plus the part of them the
    next B makes (a B keeps what its W will read, where 1F1B's whole backward frees it at once),
    all counted from the stage program's cut at the micro-batch's size."""
    from training_cases import BATCH

    from metaopt.ir import parse_program, roles
    from metaopt.ir.program import WEIGHT_PHASE
    from metaopt.passes.pipeline_phases import plan_phases

    for one, zb in zip(_ranks(runs, "hf-gpt2:1F1B:sgd"), _ranks(runs, "hf-gpt2:ZBH1:sgd"), strict=True):
        stage = parse_program(zb["program"])
        plan = plan_phases(stage)
        k, dims = stage.pipeline.stage, {"batch": BATCH // 4}
        w_in = plan.carried_in[(k, WEIGHT_PHASE)]
        from_b = set(plan.carried_out[(k, roles.BACKWARD)])
        held = sum(stage.vars[x].nbytes(dims) for x in w_in)
        made_by_b = sum(stage.vars[x].nbytes(dims) for x in w_in if x in from_b)
        assert held > made_by_b > 0
        assert zb["peak"] <= one["peak"] + held + made_by_b, (one["peak"], zb["peak"], held, made_by_b)


@pytest.mark.parametrize("case", CASES)
def test_each_workers_peak_is_the_one_its_schedule_predicts(runs, case):
    """metaopt.report.estimate_pipeline_memory replays the worker's schedule over its phase
    programs (what each action adds, what stays held between actions): equal to the executor's
    measured peak on both workers, for 1F1B, ZB-H1 and ZB-V, with dropout and recompute."""
    for got in _ranks(runs, case):
        assert got["peak"] == got["predicted_peak"], (case, got["peak"], got["predicted_peak"])


def test_the_schedule_picture_of_the_run_shows_each_worker_and_the_ideal(runs):
    """metaopt.schedule_picture after a ZB-H1 step, on both workers: worker 0 wrote the PNG,
    HTML and JSON; each worker's bars are the schedule's actions; the bubble measured per worker
    is a fraction, the simulator's ideal from the measured per-action times beside it."""
    import json

    from metaopt.runtime.schedules import schedule

    got = _ranks(runs, "hf-gpt2:ZBH1:sgd")
    assert got[0]["picture"] == got[1]["picture"]  # every worker gets the same picture
    pic = got[0]["picture"]
    assert all(0 <= b < 1 for b in pic["bubble"]) and 0 <= pic["ideal_bubble"] < 1
    files = {p.suffix for p in (runs / "picture").iterdir()}
    assert files == {".png", ".html", ".json"}
    saved = json.loads((runs / "picture" / "ZBH1.json").read_text())
    for w, bars in enumerate(saved["workers"]):
        want = [str(a) for a in schedule("ZBH1", num_stages=2, stage=w, micro_batches=4)]
        assert [b[0] for b in bars] == want
        assert all(s <= e for _, s, e, _ in bars)
