"""MP-aware RNG (issue 16 item 3; metaopt/ops/rng_streams.py): with dropout 0.1 on gpt tiny at
MP=2 on 2 gloo workers, replicated values stay bitwise identical across the MP ranks while the
attention dropout over each rank's heads draws its own mask; the same seed reproduces; recompute
replays both streams bit-identically; an unseeded process is seeded deterministically. Plus the
streams at the kernel level in one process, their checkpoint state, and the golden of the
rewritten program showing each random op's stream.

Every comparison here is bitwise (torch.equal): the runs compared execute the same ops on the same
bits in the same order (the same program, or the same program recomputed, which re-runs the same
kernels on the same inputs), and replicated values are computed alike on every MP rank from
all-reduced sums that gloo hands every rank identically. Any difference is a wrong mask.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import exported

from metaopt.ir import parse_program, verify
from metaopt.ops import registry, rng_streams
from metaopt.ops.kernels.random import dropout
from metaopt.ops.kernels.rng import rng_replay, rng_state
from metaopt.passes.tensor_parallel import plan_tensor_parallel, tensor_parallel

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
import tp_rng_worker  # noqa: E402  (beside the other workers, started as a script there)
import tp_worker  # noqa: E402
from workers import start_workers, wait_workers  # noqa: E402

CPU = torch.device("cpu")
MP = rng_streams.MODEL_PARALLEL


@pytest.fixture
def restore_rng():
    """Tests here reseed the process: give the next test the streams as they were."""
    saved = rng_streams.state_dict()
    base, mp = rng_streams._base, dict(rng_streams._mp)
    yield
    rng_streams._base = base
    rng_streams._mp.clear()
    rng_streams._mp.update(mp)
    rng_streams.load_state_dict(saved)


# --- MP=2 on 2 gloo workers --------------------------------------------------------------------


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("tp_rng")
    procs = start_workers(2, [str(HERE / "tp_rng_worker.py"), str(out)], {"METAOPT_COMM_TIMEOUT": "60"})
    logs = wait_workers(procs, "tensor-parallel RNG", 400)
    # the first run, before any seed, logged the fallback seeding on each worker
    assert all("no seed was set; seeding as metaopt.seed(0)" in log for log in logs)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


def _split_params() -> set[str]:
    plan = plan_tensor_parallel(
        exported("gpt", dropout=0.1)[2],
        mp_degree=2,
        mp_rank=0,
        group=[0, 1],
        column=tp_worker.COLUMN["gpt"],
        row=tp_worker.ROW["gpt"],
    )
    return {sp.name for sp in plan.params}


def _same_run(a: dict, b: dict) -> bool:
    """Bitwise the same losses, recorded activations, masks and final params."""
    steps = all(torch.equal(x[k], y[k]) for x, y in zip(a["steps"], b["steps"], strict=True) for k in x)
    return steps and all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])


@pytest.mark.parametrize("run", ["main", "unseeded", "recompute"])
def test_replicated_values_and_params_identical_across_mp_ranks(ranks, run):
    a, b = (r["runs"][run] for r in ranks)
    assert len(a["steps"]) == tp_rng_worker.STEPS == 10
    for step, (x, y) in enumerate(zip(a["steps"], b["steps"], strict=True)):
        for name in [next(iter(x)), *tp_rng_worker.REPLICATED]:  # the loss, then the activations
            assert torch.equal(x[name], y[name]), (run, step, name)
    split = _split_params()
    replicated = [k for k in a["params"] if k not in split]
    assert split and len(replicated) > 10
    for k in replicated:
        assert torch.equal(a["params"][k], b["params"][k]), (run, k)
    # the replicated dropouts do draw: another seed changes their outputs (so equality is no accident)
    other = ranks[0]["runs"]["other_seed"]["steps"][0]
    assert not torch.equal(a["steps"][0]["transformer.drop"], other["transformer.drop"])


def test_split_region_masks_differ_between_mp_ranks(ranks):
    masks = ranks[0]["masks"]
    assert masks == ranks[1]["masks"] and len(masks) == 2  # one attention op per block
    for step in range(tp_rng_worker.STEPS):
        for name in masks:
            drop = [r["runs"]["main"]["steps"][step][name] for r in ranks]
            live = [r["runs"]["main"]["steps"][step][f"{name}:live"] for r in ranks]
            assert drop[0].shape == drop[1].shape == (tp_worker.BATCH, 1, 16, 16)  # 1 head per rank
            assert torch.equal(live[0], live[1])  # the causal positions
            assert not torch.equal(drop[0], drop[1]), (step, name)
            for d, lv in zip(drop, live, strict=True):
                # about p = 0.1 of 1088 live probabilities (binomial sd ~0.009): it really drops
                assert 0.05 < d.sum().item() / lv.sum().item() < 0.15


def test_each_rank_draws_from_seed_plus_2718_plus_its_rank(ranks, restore_rng):
    """The documented seeding: rank r's first attention mask is what the attention kernel draws
    first from a generator seeded SEED + 2718 + r (the mask does not depend on the values)."""
    first = ranks[0]["masks"][0]
    sdpa = registry.get("ScaledDotProductAttention").kernel
    p = float(torch.tensor(tp_rng_worker.DROPOUT, dtype=torch.float32))  # the exported attr
    ones = torch.ones(tp_worker.BATCH, 1, 16, 16)
    for r, res in enumerate(ranks):
        step0 = res["runs"]["main"]["steps"][0]
        torch.manual_seed(tp_rng_worker.SEED + rng_streams.MP_SEED_OFFSET + r)
        _, probs, dropped = sdpa(ones, ones, ones, None, scale=0.25, dropout_p=p, _nout=3)
        assert bool((probs != 0).all())
        assert torch.equal(step0[first], (dropped == 0) & step0[f"{first}:live"]), r


def test_same_seed_reproduces_in_the_same_process(ranks):
    for r in ranks:
        assert _same_run(r["runs"]["again"], r["runs"]["main"])
        assert not _same_run(r["runs"]["other_seed"], r["runs"]["main"])


def test_unseeded_process_is_seeded_as_seed_0(ranks):
    for r in ranks:
        assert _same_run(r["runs"]["unseeded"], r["runs"]["seeded"])
        assert not _same_run(r["runs"]["unseeded"], r["runs"]["main"])


def test_recompute_replays_both_streams_bit_identically(ranks):
    for r, res in enumerate(ranks):
        assert _same_run(res["runs"]["recompute"], res["runs"]["main"]), r
        # RngState records the stream its op draws from: recording the shared one instead for the
        # attention dropout replays another mask (the check above can fail)
        assert not _same_run(res["runs"]["recompute_wrong_stream"], res["runs"]["main"]), r
        ops = res["rng_ops"]
        # the same program text on both ranks: the MP rank is found from the group at run time
        assert "RngState [('group', [0, 1]), ('rng', 'model_parallel')]" in ops
        assert "RngState [('rng', 'shared')]" in ops
        replay = "('f_group', [0, 1]), ('f_rng', 'model_parallel')"
        assert any(replay in o for o in ops if o.startswith("RngReplay"))
        assert ops == ranks[0]["rng_ops"]


def test_through_fleet_the_same_and_recompute_bit_identical(ranks):
    """The user's path: fleet's tensor_parallel step writes group="model_parallel" (every worker's
    program prints the same: minimize compares them), and draws exactly what the pass run did."""
    for r, res in enumerate(ranks):
        for name in ("fleet", "fleet_recompute"):
            assert "refused" not in res["runs"][name], res["runs"][name].get("refused")
            assert _same_run(res["runs"][name], res["runs"]["main"]), (r, name)
        ops = res["runs"]["fleet_recompute"]["rng_ops"]
        assert "RngState [('group', 'model_parallel'), ('rng', 'model_parallel')]" in ops


# --- one process -------------------------------------------------------------------------------


def _gpt_rank1():
    program = exported("gpt", dropout=0.1)[2]
    plan = plan_tensor_parallel(
        program,
        mp_degree=2,
        mp_rank=1,
        group=[0, 1],
        column=tp_worker.COLUMN["gpt"],
        row=tp_worker.ROW["gpt"],
    )
    return plan, tensor_parallel(program, plan=plan)


def test_golden_streams_in_the_rewritten_program(golden):
    """The attention dropout over split heads draws from rank 1's model-parallel stream; the
    embedding and residual dropouts (replicated) from the shared one: in the plan and the program."""
    plan, q = _gpt_rank1()
    verify(q)
    text = str(q)
    assert str(parse_program(text)) == text  # the stream attrs read back
    golden("tensor_parallel/gpt_dropout_rank1", f"{plan}\n\n{text}")
    streams = [op.attrs.get("rng") for op in q.ops if op.type in ("Dropout", "ScaledDotProductAttention")]
    assert streams.count(MP) == 2 and streams.count("shared") == 5


def test_the_rewritten_program_saves_and_loads_back_as_onnx(tmp_path):
    """The stream attrs on standard ops (Dropout's rng, group: not in its ONNX schema) travel as
    node metadata, and the split params' layout (Var.split) as value metadata: the loaded program
    prints exactly as the saved one."""
    import metaopt
    from metaopt.frontend.onnx_save import save

    _, q = _gpt_rank1()
    save(q, tmp_path / "p.onnx")
    again = metaopt.load(tmp_path / "p.onnx")
    assert str(again) == str(q)
    assert any(v.split is not None for v in again.vars.values())


def _as_rank(monkeypatch, r: int) -> None:
    """This process as global rank `r` (the MP rank is its place in the op's group)."""
    monkeypatch.setattr(rng_streams, "_global_rank", lambda: r)


GROUP = {"rng": MP, "group": [0, 1]}  # what the pass writes at MP=2 on workers 0 and 1


def test_dropout_draws_from_its_stream_and_leaves_the_other_alone(restore_rng, monkeypatch):
    x = torch.ones(4096)
    _as_rank(monkeypatch, 1)
    rng_streams.seed(5)
    shared_before = torch.get_rng_state()
    out = dropout(x, 0.5, torch.tensor(True), **GROUP)
    assert torch.equal(torch.get_rng_state(), shared_before)  # the shared stream did not move
    torch.manual_seed(5 + 2718 + 1)
    assert torch.equal(out, torch.native_dropout(x, 0.5, True)[0])
    rng_streams.seed(5)
    a = dropout(x, 0.5, torch.tensor(True), rng="shared")
    rng_streams.seed(5)
    assert torch.equal(a, dropout(x, 0.5, torch.tensor(True)))  # shared = no attr = default generator
    _as_rank(monkeypatch, 0)
    rng_streams.seed(5)
    r0 = dropout(x, 0.5, torch.tensor(True), **GROUP)
    assert not torch.equal(r0, out) and not torch.equal(r0, a)  # three different streams


def test_bad_stream_attrs_are_refused_by_name():
    x = torch.ones(8)
    with pytest.raises(ValueError, match="'model-parallel' is not an RNG stream"):
        dropout(x, 0.5, torch.tensor(True), rng="model-parallel")
    with pytest.raises(ValueError, match="needs group=<the MP group"):
        dropout(x, 0.5, torch.tensor(True), rng=MP)
    with pytest.raises(RuntimeError, match=r"over MP group \[1, 2\], but this worker is rank 0"):
        dropout(x, 0.5, torch.tensor(True), rng=MP, group=[1, 2])


def test_replay_restores_the_recorded_stream_state_and_consumes_nothing(restore_rng, monkeypatch):
    """RngState / RngReplay as the recompute pass emits them for a model-parallel dropout."""
    x = torch.ones(4096)
    _as_rank(monkeypatch, 1)
    rng_streams.seed(9)
    state = rng_state(CPU, **GROUP)
    fwd = dropout(x, 0.3, torch.tensor(True), **GROUP)
    after = rng_streams.state_dict()
    again = rng_replay(
        state,
        x,
        torch.tensor(0.3),
        torch.tensor(True),
        op="Dropout",
        n_out=1,
        _nout=1,
        _device=CPU,
        f_rng=MP,
        f_group=[0, 1],
    )
    assert torch.equal(again, fwd)
    now = rng_streams.state_dict()
    assert now.keys() == after.keys() and all(torch.equal(now[k], after[k]) for k in now)


def test_state_dict_round_trips_every_stream(tmp_path, restore_rng, monkeypatch):
    x = torch.ones(4096)
    _as_rank(monkeypatch, 1)
    rng_streams.seed(3)
    dropout(x, 0.5, torch.tensor(True), **GROUP)  # make rank 1's stream and move it
    torch.save(rng_streams.state_dict(), tmp_path / "rng.pt")
    want = [dropout(x, 0.5, torch.tensor(True), **s) for s in (GROUP, {"rng": "shared"})]
    assert "model_parallel.rank1.cpu" in rng_streams.state_dict()
    rng_streams.seed(4)  # everything elsewhere
    rng_streams.load_state_dict(torch.load(tmp_path / "rng.pt", weights_only=True))
    got = [dropout(x, 0.5, torch.tensor(True), **s) for s in (GROUP, {"rng": "shared"})]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    with pytest.raises(ValueError, match="'gpu0' is not a stream"):
        rng_streams.load_state_dict({"cpu": torch.get_rng_state(), "gpu0": torch.get_rng_state()})


_FRESH = """
import json, torch, metaopt
from metaopt.ops import registry, rng_streams
from metaopt.ops.kernels.random import dropout
x = torch.ones(256)
outs = [dropout(x, 0.5, torch.tensor(True), rng="shared")]
for rank in (0, 1):  # this process as each worker of MP group [0, 1]
    rng_streams._global_rank = lambda: rank
    outs.append(dropout(x, 0.5, torch.tensor(True), rng="model_parallel", group=[0, 1]))
print(json.dumps([o.nonzero().flatten().tolist() for o in outs]))
"""


def test_fresh_process_without_a_seed_is_deterministic_and_differs_per_rank(restore_rng, monkeypatch):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    runs = [
        subprocess.run([sys.executable, "-c", _FRESH], capture_output=True, text=True, timeout=120, env=env)
        for _ in range(2)
    ]
    for p in runs:
        assert p.returncode == 0, p.stderr[-2000:]
        assert "no seed was set; seeding as metaopt.seed(0)" in p.stderr
    assert runs[0].stdout == runs[1].stdout  # deterministic across processes (torch's own seed is not)
    shared, rank0, rank1 = json.loads(runs[0].stdout)
    assert rank0 != rank1 and shared not in (rank0, rank1)
    rng_streams.seed(0)  # what the fallback stands for
    x = torch.ones(256)
    assert shared == dropout(x, 0.5, torch.tensor(True), rng="shared").nonzero().flatten().tolist()
    _as_rank(monkeypatch, 0)
    assert rank0 == dropout(x, 0.5, torch.tensor(True), **GROUP).nonzero().flatten().tolist()
