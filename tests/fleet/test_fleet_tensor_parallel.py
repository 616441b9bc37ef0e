"""Tensor parallel through fleet (the ``tensor_parallel`` step of STEPS): MP=2 on 2 gloo workers
and DP=2 x MP=2 on 4 equal single-process training of gpt tiny (dropout 0, 3 SGD steps), and the
combinations minimize refuses, by name, in one process."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

import metaopt
from metaopt import fleet
from metaopt.fleet import env
from metaopt.layout.topology import HybridCommunicateGroup, Topology
from metaopt.passes.tensor_parallel import plan_tensor_parallel, unshard

TRAINING = Path(__file__).resolve().parent.parent / "training"
sys.path.insert(0, str(TRAINING))
import fleet_tp_worker  # noqa: E402  (beside the other workers, started as a script there)
import tp_worker  # noqa: E402
from workers import start_workers, wait_workers  # noqa: E402

NAME = fleet_tp_worker.NAME
# The all-reduces sum partial products in another order than one matmul: a few ulps per step.
TOL = {"rtol": 1e-5, "atol": 4e-5}


pytestmark = pytest.mark.usefixtures("clean_env")  # tests/conftest.py


# --- on gloo workers ---------------------------------------------------------------------------


def _run_workers(out: Path, dp: int, mp: int) -> list[dict]:
    """Start dp x mp workers, wait (bounded: a hang is a failure, never a stuck suite), load results."""
    world = dp * mp
    args = [str(TRAINING / "fleet_tp_worker.py"), str(out), str(dp), str(mp)]
    procs = start_workers(world, args, {"METAOPT_COMM_TIMEOUT": "60"})
    wait_workers(procs, "tensor-parallel", 240)
    return [torch.load(out / f"{NAME}.rank{r}.pt", weights_only=False) for r in range(world)]


@functools.cache
def _single_process() -> dict:
    """The reference: one process, the full batch, the same export and SGD steps."""
    return tp_worker.train(tp_worker.export(NAME), NAME)


@functools.cache
def _split() -> dict:
    program = tp_worker.export(NAME)
    plan = plan_tensor_parallel(
        program, mp_degree=2, mp_rank=0, group=[0, 1], column=tp_worker.COLUMN[NAME], row=tp_worker.ROW[NAME]
    )
    return {sp.name: sp for sp in plan.params}


def _check_params(mp_ranks: list[dict]) -> None:
    """The MP ranks' params, split ones put back together, equal the single process's."""
    split = _split()
    assert split, "nothing was split"
    for k, want in _single_process()["params"].items():
        got = [r["params"][k] for r in mp_ranks]
        if k in split:
            sp = split[k]
            assert got[0].shape == sp.local_shape, k
            torch.testing.assert_close(unshard(got, sp.axis, sp.blocks), want, **TOL)
        else:  # replicated: the same update on every MP rank, from the same all-reduced values
            assert torch.equal(got[0], got[1]), k
            torch.testing.assert_close(got[0], want, **TOL)


def _check_eval(ranks: list[dict], ref: dict) -> None:
    """Issue 49: each worker's `clone(for_test=True)` of its tensor-parallel program, on the whole
    held-out batch: one process's evaluation (TOL), the same bits on both runs."""
    for r in ranks:
        assert r["eval"][0] == r["eval"][1]
        assert r["eval"][0] == pytest.approx(ref["eval"][0], rel=1e-5, abs=4e-5)


def test_mp2_through_fleet_equals_one_process(tmp_path):
    ranks = _run_workers(tmp_path, dp=1, mp=2)
    ref = _single_process()
    _check_eval(ranks, ref)
    for r in ranks:
        assert r["losses"] == pytest.approx(ref["losses"], rel=1e-5, abs=4e-5)
        assert "tensor_parallel  run   strategy.tensor_parallel=True (mp_degree=2)" in r["plan"]
        assert "data_parallel    skip  mp_degree=2 spans every worker" in r["plan"]
    _check_params(ranks)


def test_dp2_x_mp2_through_fleet_equals_one_process_on_the_full_batch(tmp_path):
    ranks = _run_workers(tmp_path, dp=2, mp=2)  # ranks 0, 1: replica 0's MP group; 2, 3: replica 1's
    ref = _single_process()
    assert [(r["dp_rank"], r["mp_rank"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    _check_eval(ranks, ref)
    # each replica's loss is its half batch's; their mean is the full batch's
    for step, want in enumerate(ref["losses"]):
        assert (ranks[0]["losses"][step] + ranks[2]["losses"][step]) / 2 == pytest.approx(
            want, rel=1e-5, abs=4e-5
        )
    assert "over the 2 workers of each data-parallel group" in ranks[0]["dp_plan"]
    # left in flight (passes/overlap_comm.py) and waited for before the updates read the grads
    assert "AllReduce [('group', 'data_parallel'), ('overlap', 1), ('reduce', 'avg')]" in ranks[0]["ops"]
    assert "CommWait []" in ranks[0]["ops"]  # each before the updates that read its grad
    assert "AllReduce [('group', 'data_parallel'), ('reduce', 'avg')]" in ranks[0]["ops"]  # the last
    _check_params(ranks[:2])
    for a, b in ((0, 2), (1, 3)):  # the two replicas of each MP rank: bitwise equal
        for k, t in ranks[a]["params"].items():
            assert torch.equal(t, ranks[b]["params"][k]), (a, b, k)


# --- refusals, in one process ------------------------------------------------------------------


def _fake_job(monkeypatch, rank: int, dp: int, mp: int, pp: int = 1) -> None:
    """Worker `rank` as fleet.init would leave it with these hybrid degrees (no collective runs:
    every refusal comes before the first rewrite)."""
    fleet.init()
    topo = Topology(dp_degree=dp, mp_degree=mp, pp_degree=pp)
    monkeypatch.setattr(env._STATE, "env", env.WorkerEnv(rank=rank, world_size=topo.world_size()))
    init = fleet.DistributedStrategy()
    init.hybrid_configs = {"dp_degree": dp, "mp_degree": mp, "pp_degree": pp}
    monkeypatch.setattr(env._STATE, "strategy", init)
    monkeypatch.setattr(env._STATE, "hcg", HybridCommunicateGroup(topo, rank))
    monkeypatch.setattr(env, "require_process_group", lambda what: None)  # fleet.init made one


def _tp_strategy(**configs) -> fleet.DistributedStrategy:
    s = fleet.DistributedStrategy()
    s.tensor_parallel = True
    s.tensor_parallel_configs = {"column": tp_worker.COLUMN[NAME], "row": tp_worker.ROW[NAME], **configs}
    return s


def _refused(s: fleet.DistributedStrategy, error: type, match: str, opt=None) -> None:
    program = tp_worker.export(NAME)
    before = str(program)
    opt = opt or metaopt.optimizer.SGD(learning_rate=0.1)
    with pytest.raises(error, match=match):
        fleet.distributed_optimizer(opt, s).minimize(program.loss)
    assert str(program) == before  # refused before anything was rewritten


def test_a_pipeline_cut_inside_a_split_region_is_refused_naming_the_var_and_op(monkeypatch):
    # a stage hands the next only values every MP rank holds whole (tests/training/
    # test_hybrid_pipeline.py trains the cut at transformer.h.1 on gloo workers)
    _fake_job(monkeypatch, 0, dp=1, mp=2, pp=2)
    s = _tp_strategy()
    s.pipeline = True
    s.pipeline_configs = {"cuts": ["transformer.h.0.mlp.c_proj"], "accumulate_steps": 2}
    _refused(
        s,
        ValueError,
        r"cut between virtual stages 0 and 1 falls inside a tensor-parallel split region: "
        r"'transformer\.h\.0\.mlp/gelu', made by `transformer\.h\.0\.mlp/gelu = Gelu\(",
    )


def test_a_split_param_tied_across_pipeline_stages_is_refused_naming_it(monkeypatch):
    _fake_job(monkeypatch, 0, dp=1, mp=2, pp=2)
    s = _tp_strategy()
    s.pipeline = True
    fc = [f"transformer.h.{i}.mlp.c_fc.weight" for i in (0, 1)]
    s.pipeline_configs = {"cuts": ["transformer.h.1"], "accumulate_steps": 2, "shared": [fc]}
    _refused(s, NotImplementedError, r"pipeline_configs\['shared'\] names 'transformer\.h\.0\.mlp\.c_fc\.w")


def test_global_norm_clipping_with_tensor_parallel_is_refused(monkeypatch):
    _fake_job(monkeypatch, 0, dp=1, mp=2)
    clip = metaopt.optimizer.ClipGradByGlobalNorm(1.0)
    opt = metaopt.optimizer.SGD(learning_rate=0.1, grad_clip=clip)
    _refused(_tp_strategy(), NotImplementedError, r"grad_clip=ClipGradByGlobalNorm", opt)


def test_sequence_parallel_beside_recompute_partition_is_refused(monkeypatch):
    # a checkpoint on the local sequence differs per rank: partition would slice it as replicated
    _fake_job(monkeypatch, 0, dp=1, mp=2)
    s = _tp_strategy(sequence_parallel=True)
    s.recompute = True
    s.recompute_configs = {"checkpoints": ["transformer.h.*"], "enable_partition": True}
    _refused(s, NotImplementedError, r"'sequence_parallel'\] beside recompute_configs\['enable_partition'\]")


def test_a_tensor_parallel_degree_other_than_mp_degree_is_refused_naming_both(monkeypatch):
    _fake_job(monkeypatch, 0, dp=2, mp=2)
    _refused(
        _tp_strategy(tensor_parallel_degree=4),
        ValueError,
        r"tensor_parallel_configs\['tensor_parallel_degree'\]=4 conflicts with hybrid_configs mp_degree=2",
    )


def test_mp_groups_not_made_by_fleet_init_are_refused(monkeypatch):
    fleet.init()
    monkeypatch.setattr(env._STATE, "env", env.WorkerEnv(rank=0, world_size=2))
    s = _tp_strategy()
    s.hybrid_configs = {"mp_degree": 2}  # the optimizer's strategy only: fleet.init made no groups
    _refused(s, ValueError, r"mp_degree=2: tensor parallel's groups are fleet\.init's")


def test_tensor_parallel_without_layers_is_refused(monkeypatch):
    _fake_job(monkeypatch, 0, dp=1, mp=2)
    s = _tp_strategy()
    s.tensor_parallel_configs = {}
    _refused(s, ValueError, r"needs tensor_parallel_configs\['column'\] and \['row'\]")


def test_the_plan_shows_the_step_and_the_grouped_data_parallel(monkeypatch):
    _fake_job(monkeypatch, 3, dp=2, mp=2)
    text = str(fleet.distributed_optimizer(metaopt.optimizer.SGD(learning_rate=0.1), _tp_strategy()).plan())
    assert "tensor_parallel  run   strategy.tensor_parallel=True (mp_degree=2)" in text
    assert "data_parallel    run   dp_degree=2 x mp_degree=2: over each data-parallel group" in text
    assert "refused" not in text


@pytest.fixture(scope="module")
def tp_sharding_runs(tmp_path_factory) -> Path:
    """One launch of mp 2 x sharding 2 on 4 gloo workers: stages 1 and 3, each with SGD, Adam
    (saved) and the load of that checkpoint."""
    from training_cases import save_pretrained_files

    out = tmp_path_factory.mktemp("tp_sharding")
    save_pretrained_files(out, [NAME])  # what "3:sgd-meta" reads
    tokens = [f"{stage}:{opt}" for stage in (1, 3) for opt in ("sgd", "adam-save", "adam-load")]
    args = [
        str(TRAINING / "fleet_tp_worker.py"),
        str(out),
        "1",
        "2",
        "2",
        *tokens,
        "3:sgd-meta",
        "3:sgd-init",
    ]
    env = {"METAOPT_COMM_TIMEOUT": "60", "PRETRAINED": str(out)}
    wait_workers(start_workers(4, args, env), "tensor-parallel x sharding", 300)
    return out


def test_mp2_x_sharding2_workers_built_on_meta_read_their_share_and_train_as_with_values(tp_sharding_runs):
    """Stage 3 beside tensor parallel, the module built on meta: each worker reads from the
    safetensors file only the ZeRO run of its tensor-parallel part of each param
    (fleet.load_pretrained), and trains as the workers exported with values, bit for bit."""
    for r in range(4):
        got = torch.load(tp_sharding_runs / f"{NAME}.3:sgd-meta.rank{r}.pt", weights_only=False)
        want = torch.load(tp_sharding_runs / f"{NAME}.3:sgd.rank{r}.pt", weights_only=False)
        assert got["losses"] == want["losses"], r
        assert got["layouts"] == want["layouts"]
        for k, t in want["params"].items():
            assert torch.equal(got["params"][k], t), (r, k)


def test_mp2_x_sharding2_workers_making_their_share_from_the_module_init_start_from_one_process_values(
    tp_sharding_runs,
):
    """Seeded init (fleet.init_from_module) beside tensor parallel and stage 3: each worker makes
    each submodule whole and keeps the ZeRO run of its tensor-parallel part; put together by
    save_pretrained, the values are one process's bit for bit; trained, the replicas' mean loss
    is one process's from those values (TOL: the data-parallel bar, as below)."""
    from safetensors.torch import load_file
    from training_cases import _module, seeded_values

    want = seeded_values(NAME)
    got = load_file(tp_sharding_runs / f"{NAME}.sgd-init.init" / "model.safetensors")
    assert got.keys() == want.keys()
    assert not [k for k, t in want.items() if not torch.equal(got[k], t)]
    module, inputs, kwargs = _module(NAME)
    # the same values, exported with them: one process's reference (lm_head's weight is wte's)
    assert module.load_state_dict(want, strict=False).missing_keys == ["lm_head.weight"]
    ref = tp_worker.train(metaopt.export(module, inputs, **kwargs), NAME)
    ranks = [
        torch.load(tp_sharding_runs / f"{NAME}.3:sgd-init.rank{r}.pt", weights_only=False) for r in range(4)
    ]
    mean = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[2]["losses"], strict=True)]
    assert mean == pytest.approx(ref["losses"], rel=1e-5, abs=4e-5)


@pytest.mark.parametrize("stage", [1, 3])
def test_mp2_x_sharding2_through_fleet_equals_one_process_and_each_worker_holds_half_its_state(
    tp_sharding_runs, stage
):
    """hybrid_configs mp_degree 2 x sharding_degree 2 (ZeRO beside tensor parallel): each MP
    rank's grads reduce-scattered over its sharding group (ranks (0, 2) and (1, 3)), its state
    (stage 3: and its params) the flat half of its tensor-parallel part (``split(...)
    zero_shard(...)``). Against one process on the full batch (each sharding replica fed half):
    the replicas' mean loss, and SGD params put back together, at TOL; Adam's losses at TOL. The
    Adam checkpoint the 4 workers save loads back into the same layout bit for bit and into one
    unsharded process, each worker's part there being its half of its tensor-parallel part of
    the whole value."""
    from metaopt.fleet.sharded_io import local_part
    from metaopt.ops.kernels.partition import take_slice

    runs = {
        opt: [
            torch.load(tp_sharding_runs / f"{NAME}.{stage}:{sfx}.rank{r}.pt", weights_only=False)
            for r in range(4)
        ]
        for opt, sfx in (("sgd", "sgd"), ("adam", "adam-save"), ("load", "adam-load"))
    }
    sgd, adam = runs["sgd"], runs["adam"]
    assert [(r["mp_rank"], r["sharding_rank"]) for r in sgd] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    for opt, ref in (
        ("sgd", _single_process()),
        ("adam", tp_worker.train(tp_worker.export(NAME), NAME, "adam")),
    ):
        mean = [(a + b) / 2 for a, b in zip(runs[opt][0]["losses"], runs[opt][2]["losses"], strict=True)]
        assert mean == pytest.approx(ref["losses"], rel=1e-5, abs=4e-5), opt
    _check_params(sgd[:2])
    for a, b in ((0, 2), (1, 3)):  # the two sharding replicas of each MP rank: bitwise equal params
        assert all(torch.equal(t, sgd[b]["params"][k]) for k, t in sgd[a]["params"].items())
    assert "ReduceScatter [('group', 'sharding'), ('parts', 2), ('reduce', 'avg')]" in sgd[0]["ops"]
    # the split params' replicas start equal: a startup broadcast over the sharding group too (stage
    # 3 holds every param as slices, cut at minimize from values broadcast over both axes)
    assert ("Broadcast [('group', 'sharding'), ('src', 0)]" in sgd[0]["ops"]) == (stage == 1)
    split = _split()
    for r, got in enumerate(adam):
        assert got["held"] and all(torch.equal(t, runs["load"][r]["held"][n]) for n, t in got["held"].items())
        assert all(torch.equal(t, runs["load"][r]["params"][n]) for n, t in got["params"].items())
        for n in got["held"]:
            layout_split, layout_zero = got["layouts"][n]
            assert layout_zero.startswith("zero_shard(parts=2"), n
            assert (layout_split != "None") == (n.split("@")[0] in split), n
    whole = _one_process_checkpoint(tp_sharding_runs / f"ckpt{stage}")

    def part(n: str, mp_rank: int) -> torch.Tensor:  # this MP rank's part of whole value `n`
        param = n.split("@")[0]  # a moment's param (test-side only: which split it follows)
        if param not in split:
            return whole[n]
        sp = split[param]
        return local_part(whole[n], metaopt.ir.Split(sp.axis, 2, tuple(sp.blocks)), mp_rank)

    for r, got in enumerate(adam):
        for n, t in got["held"].items():
            assert torch.equal(t, take_slice(part(n, got["mp_rank"]), 2, got["sharding_rank"])), (r, n)
        for n, t in got["params"].items():  # whole parts (stage 3's gathered by the worker)
            assert torch.equal(t, part(n, got["mp_rank"])), (r, n)
    if stage == 3:
        assert all(got["layouts"][n][1].startswith("zero_shard(") for got in adam for n in got["params"])


def _one_process_checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    env.reset()
    fleet.init()
    try:
        program = tp_worker.export(NAME)
        metaopt.optimizer.Adam(learning_rate=1e-2).minimize(program.loss)
        exe = metaopt.Executor("cpu")
        fleet.load_persistables(exe, folder, program)
        kept = [v.name for v in program.vars.values() if v.kind in ("opt_state", "param") and v.shape]
        return {n: exe.scope[n].clone() for n in kept}
    finally:
        env.reset()
