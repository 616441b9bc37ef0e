"""Identical layers solved once (metaopt/planner/blocks.py, issue 45): a model's repeated blocks
found and compared, the program cut to fewer of them computing what the shallower model computes,
and the planner's figures from 2 and 3 blocks per stage: the time exact, the peak a lower bound
(another place in the step can overtake deeper down), and the plans it returns the same as with
every layout rewritten whole."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import metaopt
from metaopt import fleet
from metaopt.planner import search
from metaopt.planner.blocks import find_blocks, with_blocks
from metaopt.planner.search import Layout

pytestmark = pytest.mark.usefixtures("clean_env")  # tests/conftest.py

SMALL = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def _llama(layers: int, meta: bool = True, **wider: int) -> torch.nn.Module:
    import transformers
    from zoo.hf import LMLoss

    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        config = transformers.LlamaConfig(num_hidden_layers=layers, **{**SMALL, **wider})
        return LMLoss(transformers.LlamaForCausalLM(config)).train()


def _export(model: torch.nn.Module, seq: int = 16) -> metaopt.Program:
    device = next(model.parameters()).device
    ids = torch.arange(2 * seq, device=device).reshape(2, seq) % SMALL["vocab_size"]
    return metaopt.export(model, (ids, ids))


class _Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, width), torch.nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class _Blocks(torch.nn.Module):
    """Three blocks of the given widths, the residual inside each (or, `outside`, between them)."""

    def __init__(self, widths: tuple[int, ...], outside: bool = False) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block(w) for w in widths)
        self.outside = outside

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x) * 0.5 if self.outside else b(x)
        return x.square().mean()


class _Tapped(_Blocks):
    def __init__(self) -> None:
        super().__init__((16, 16, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        taps = []
        for b in self.blocks:
            x = b(x)
            taps.append(x)
        return x.square().mean() + sum(t.mean() for t in taps)  # after the blocks: read from the tail


@pytest.fixture(scope="module")
def twelve() -> metaopt.Program:
    wider = dict(hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=4)
    return _export(_llama(12, **wider))


def test_the_cut_program_computes_what_the_shallower_model_computes():
    """3 blocks cut to 2: the loss, in float64, is the 2-block module's (the same module with its
    last block dropped), to float64 rounding (1e-12: the same ops); the program itself unchanged."""
    torch.manual_seed(0)
    model = _Blocks((16, 16, 16)).double()
    x = torch.randn(4, 8, dtype=torch.float64)
    p = metaopt.export(model, (x,))
    blocks = find_blocks(p)
    assert blocks.modules == ("blocks.0", "blocks.1", "blocks.2") and blocks.pattern == "blocks.*"
    before = str(p)
    q = with_blocks(p, blocks, 2)
    assert not any(op.scope and op.scope.startswith("blocks.2") for op in q.ops)
    assert not any(n.startswith("blocks.2.") for n in q.vars) and "blocks.2" not in q.modules
    assert str(p) == before
    (got,) = metaopt.Executor("cpu").run(q, feed={p.inputs[0]: x}, fetch_list=[q.loss])
    model.blocks = model.blocks[:2]
    want = model(x).item()
    assert math.isclose(float(got), want, rel_tol=1e-12), (float(got), want)


def test_a_llamas_blocks_are_its_layers(twelve):
    blocks = find_blocks(twelve)
    assert blocks.modules == tuple(f"m.model.layers.{k}" for k in range(12)) and blocks.why_not is None
    assert blocks.pattern == "m.model.layers.*"
    q = with_blocks(twelve, blocks, 3)
    assert {m for m in q.modules if m.startswith("m.model.layers.")} >= {"m.model.layers.2"}
    assert not any(m.startswith("m.model.layers.3") for m in q.modules)
    assert len(twelve.ops) - len(q.ops) == 9 * (blocks.spans[1][1] - blocks.spans[1][0])


def test_blocks_that_differ_or_leave_ops_between_them_are_named_and_rewritten_whole():
    same = find_blocks(metaopt.export(_Blocks((16, 16, 16)), (torch.randn(4, 8),)))
    assert same.modules == ("blocks.0", "blocks.1", "blocks.2") and same.why_not is None
    p = metaopt.export(_Blocks((16, 16, 24)), (torch.randn(4, 8),))
    blocks = find_blocks(p)
    assert blocks.why_not is not None and "block 'blocks.2' differs from 'blocks.1' at `" in blocks.why_not
    plans = fleet.plan(p, devices=1, memory_per_device="1GiB", global_batch=4)
    assert "3 blocks of 'blocks.*', not identical" in plans.header and "rewritten whole" in plans.header
    between = find_blocks(metaopt.export(_Blocks((16, 16, 16), outside=True), (torch.randn(4, 8),)))
    assert between.why_not is not None and "lies between two blocks, in neither" in between.why_not
    # a frozen block is another computation (no grads, no optimizer state)
    frozen = _Blocks((16, 16, 16))
    frozen.blocks[2].requires_grad_(False)
    why = find_blocks(metaopt.export(frozen, (torch.randn(4, 8),))).why_not
    assert why is not None and "block 'blocks.2' differs from 'blocks.1'" in why
    # every block's output read by the loss too (an auxiliary loss over the layers): not a chain
    why = find_blocks(metaopt.export(_Tapped(), (torch.randn(4, 8),))).why_not
    assert why is not None and "made inside block 'blocks.0'" in why


def test_identical_blocks_after_others_are_solved_once_too():
    """2 wider blocks, then 6 identical ones (DeepSeek-V3's 3 dense layers before 58 MoE ones):
    the run is found where it begins; without a pipeline a layout is rewritten at the 2 others and
    1 and 2 of the run, its time extended exactly (1e-9), its peak a lower bound (exact where the
    peak's place stays), the bound before rewrites below the exact peak; a pipeline is rewritten
    whole."""
    p = metaopt.export(_Blocks((32, 32, 16, 16, 16, 16, 16, 16)), (torch.randn(4, 8),))
    blocks = find_blocks(p)
    assert blocks.why_not is None and blocks.first == 2 and blocks.count == 8
    job = search._Job(p, blocks, 2, 8, None, search.Rates(1e12, 1e11, 1e-5, 1e10, 1e-5), None)
    for lay in (Layout(2, 1, 1, 0, "none", 1, "blocks.*"), Layout(2, 1, 1, 3, "full", 1, "blocks.*")):
        assert job._points(lay) == (3, 4)
        ext, whole = job.evaluate(lay), job.evaluate(lay, whole=True)
        assert not ext.exact and whole.exact
        assert ext.peaks[0] <= whole.peaks[0] and math.isclose(ext.seconds, whole.seconds, rel_tol=1e-9)
        assert job.floor(lay) <= job.held(lay) <= whole.peaks[0], lay.describe()
    none = Layout(2, 1, 1, 0, "none", 1, "blocks.*")
    assert job.evaluate(none).peaks == job.evaluate(none, whole=True).peaks
    pipe = Layout(1, 1, 2, 0, "none", 2, "blocks.*", ("blocks.4",))
    assert job._points(pipe) is None and job.evaluate(pipe).exact
    plans = fleet.plan(p, devices=2, memory_per_device="1GiB", global_batch=8)
    assert "6 identical blocks of 'blocks.*' after 2 others solved once" in plans.header, plans.header
    assert plans


def test_extended_figures_time_exact_peak_a_lower_bound_where_another_place_overtakes(twelve):
    """ZeRO-3 over 4 workers, every block recomputed, a batch of 2 per worker: at 2 and 3 blocks the
    peak is in the backward of the last block, from 7 blocks on it is at the last reduce-scatter,
    which grows faster per block (measured, 2026-12-07). The extension's peak is below the whole
    program's, its time the same (float sums in another order: 1e-9)."""
    blocks = find_blocks(twelve)
    job = search._Job(twelve, blocks, 4, 8, None, search.Rates(1e12, 1e11, 1e-5, 1e10, 1e-5), None)
    lay = search.Layout(4, 1, 1, 3, "full", 1, blocks.pattern)
    ext, whole = job.evaluate(lay), job.evaluate(lay, whole=True)
    assert not ext.exact and whole.exact
    assert ext.peaks[0] < whole.peaks[0]
    assert math.isclose(ext.seconds, whole.seconds, rel_tol=1e-9)
    assert ext.layers.bytes_per_layer == whole.layers.bytes_per_layer
    # the floor before any rewrite: 12 blocks' params / 4 (ZeRO-3) + Adam's 2 moments / 4, below both
    params = sum(v.nbytes({}) for v in twelve.params())
    assert job.floor(lay) == params // 4 + 2 * params // 4 <= ext.peaks[0]
    # where the place of the peak stays (data parallel, no recompute), the extension is exact
    lay = search.Layout(4, 1, 1, 0, "none", 1, blocks.pattern)
    assert job.evaluate(lay).peaks == job.evaluate(lay, whole=True).peaks


def test_a_budget_below_every_floor_prunes_every_layout_before_any_rewrite(twelve, monkeypatch):
    def rewrite(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("a layout was rewritten although its params and state exceed the budget")

    monkeypatch.setattr(search._Job, "evaluate", rewrite)
    plans = fleet.plan(twelve, devices=4, memory_per_device="100KiB", global_batch=8)
    reasons = [why for _, why in plans.pruned]
    assert not plans and sum(w.startswith("params and optimizer state alone at least") for w in reasons) > 40


def test_a_pipeline_rewritten_once_serves_its_other_micro_batch_count(twelve, monkeypatch):
    """pp=4 at 8 micro-batches from the stage programs made for 4 (they differ only in the loss
    grad's 1/M, a value): every stage's peak and the time as its own rewrite's (1e-12)."""
    blocks = find_blocks(twelve)
    rates = search.Rates(1e12, 1e11, 1e-5, 1e10, 1e-5)
    four = Layout(2, 1, 4, 1, "selective", 4, blocks.pattern)
    eight = dataclasses.replace(four, micro_batches=8)
    shared = search._Job(twelve, blocks, 8, 32, None, rates, None)
    shared.evaluate(four, whole=True)
    rewrites = []
    monkeypatch.setattr(search._Job, "_minimized", lambda *a: rewrites.append(a) or None)
    got = shared.evaluate(eight, whole=True)
    monkeypatch.undo()
    want = search._Job(twelve, blocks, 8, 32, None, rates, None).evaluate(eight, whole=True)
    assert not rewrites and got.peaks == want.peaks and len(set(got.peaks)) == 4
    assert math.isclose(got.seconds, want.seconds, rel_tol=1e-12)


LAYOUTS = [  # one of each kind: pipelines (in flight: as many micro-batches as stages), ZeRO, tp
    Layout(1, 1, 4, 0, "none", 4),
    Layout(2, 1, 2, 1, "selective", 4),
    Layout(4, 1, 1, 2, "none", 1),
    Layout(4, 1, 1, 3, "full", 1),
    Layout(2, 2, 1, 0, "full", 1),
    Layout(1, 2, 2, 0, "selective", 2),
]


def test_the_bound_before_a_rewrite_is_below_each_layouts_exact_peak(twelve):
    """`_Job.held` (stage 0's blocks' params, state and kept activations, from one worker's rewrite
    per recompute form) prunes before any layout's rewrite: it must never exceed the exact peak
    (measured on the whole 4-device grid, 2026-12-07: 0.41-0.96 of it, the floor alone 0.37-0.48)."""
    blocks = find_blocks(twelve)
    job = search._Job(twelve, blocks, 4, 16, None, search.Rates(1e12, 1e11, 1e-5, 1e10, 1e-5), None)
    above_floor = 0
    for lay in LAYOUTS:
        lay = dataclasses.replace(lay, blocks=blocks.pattern)
        held, peak = job.held(lay), max(job.evaluate(lay, whole=True).peaks)
        assert job.floor(lay) <= held <= peak, (lay.describe(), held, peak)
        above_floor += held > job.floor(lay)
    assert above_floor == len(LAYOUTS)


def test_a_layout_over_the_budget_at_two_blocks_a_stage_is_not_rewritten_at_three(twelve, monkeypatch):
    """Above `budget` at 2 blocks a stage, a layout's screen stops there (more blocks never lower a
    peak): its peaks and time are then below the whole program's, a pipeline's stage by stage."""
    blocks = find_blocks(twelve)
    job = search._Job(twelve, blocks, 4, 16, None, search.Rates(1e12, 1e11, 1e-5, 1e10, 1e-5), None)
    figures, per_stage = search._Job._figures, []

    def counted(j: search._Job, lay: Layout, k: int) -> search._Stages:
        per_stage.append(k)
        return figures(j, lay, k)

    for lay in (LAYOUTS[1], LAYOUTS[3]):  # a ZeRO-1 pipeline; ZeRO-3, where another place overtakes
        lay = dataclasses.replace(lay, blocks=blocks.pattern, cuts=search._cuts(blocks.modules, lay.pipe, 6))
        whole = job.evaluate(lay, whole=True)
        job.budget = max(job._figures(lay, 2).peaks) - 1
        per_stage.clear()
        monkeypatch.setattr(search._Job, "_figures", counted)
        two = job.evaluate(lay)
        monkeypatch.undo()
        assert per_stage == [2], lay.describe()
        assert max(two.peaks) > job.budget and not two.exact and two.layers is None
        assert all(a <= b for a, b in zip(two.peaks, whole.peaks, strict=True)), lay.describe()
        assert two.seconds < whole.seconds
        job.budget += 1  # at the 2-block peak: screened at 2 and 3 blocks a stage, as without a budget
        assert job.evaluate(lay).peaks == dataclasses.replace(job, budget=None).evaluate(lay).peaks


def test_a_pipelines_stages_extended_as_their_whole_programs(twelve):
    """pp=2 of 6 blocks a stage, full recompute, 4 micro-batches: each stage's peak from 2 and 3
    blocks a stage is its whole program's here, the time the same (1e-9)."""
    blocks = find_blocks(twelve)
    job = search._Job(twelve, blocks, 2, 8, None, search.Rates(1e12, 1e11, 1e-5, 1e10, 1e-5), None)
    lay = search.Layout(1, 1, 2, 0, "full", 4, blocks.pattern, ("m.model.layers.6",))
    ext, whole = job.evaluate(lay), job.evaluate(lay, whole=True)
    assert not ext.exact and len(ext.peaks) == 2 and ext.peaks == whole.peaks
    assert math.isclose(ext.seconds, whole.seconds, rel_tol=1e-9)


@pytest.mark.parametrize(
    "devices, lay",
    [
        (8, search.Layout(1, 2, 4, 0, "full", 8)),  # tensor parallel in each stage
        (12, search.Layout(2, 1, 6, 1, "selective", 4)),  # ZeRO-1 beside, fewer micro-batches than stages
    ],
    ids=["mp2-pp4", "zero1-pp6"],
)
def test_a_deep_pipeline_stood_in_for_by_three_stages_has_its_own_figures(twelve, devices, lay):
    """A pipeline of 4 or 6 stages over the 12 identical blocks, rewritten as 3 stages (the first,
    one middle one standing for each at its place in the schedule, the last) on 3 stages' blocks:
    every stage's peak equal to the deep pipeline's own rewrite's, its time the same (the same ops:
    1e-12)."""
    blocks = find_blocks(twelve)
    lay = dataclasses.replace(lay, blocks=blocks.pattern)
    rates = search.Rates(1e12, 1e11, 1e-5, 1e10, 1e-5)
    stand_in = search._Job(twelve, blocks, devices, 48, None, rates, None)
    deep = search._Job(twelve, blocks, devices, 48, None, rates, None, blocks_once=False)
    got, want = stand_in.evaluate(lay, whole=True), deep.evaluate(lay, whole=True)
    assert set(stand_in.fewer) == {3 * 12 // lay.pipe} and not deep.fewer  # 3 stages' blocks, not 12
    assert got.peaks == want.peaks and len(got.peaks) == lay.pipe and got.exact
    assert len(set(got.peaks)) > 2  # the middle stages differ by their place in the schedule
    assert math.isclose(got.seconds, want.seconds, rel_tol=1e-12)


def test_worker_processes_make_the_same_plans_as_one_process(twelve):
    """`workers=2` (layouts rewritten in 2 worker processes, the fastest made exact 2 at a time)
    and `workers=1`: the same plans, figures and pruned layouts with their reasons, in order."""
    kw = dict(devices=2, memory_per_device=5_500_000, global_batch=8, top=3)
    one, two = fleet.plan(twelve, workers=1, **kw), fleet.plan(twelve, workers=2, **kw)
    assert len(one) == 3 and any(why.startswith("slower than the 3 fastest") for _, why in one.pruned)
    assert any(why.startswith("peak ") for _, why in one.pruned)
    assert [(p.layout, p.peak_bytes, p.stage_peaks, p.step_seconds) for p in one] == [
        (p.layout, p.peak_bytes, p.stage_peaks, p.step_seconds) for p in two
    ]
    assert one.pruned == two.pruned


@pytest.mark.slow
def test_the_plans_are_those_of_every_layout_rewritten_whole(twelve):
    """2 devices, a budget that some layouts exceed: the same plans, peaks (each the whole
    program's), per-stage peaks and times (1e-9) as with blocks_once=False; pipelines of 2 stages
    of 6 blocks extended too. 35 s: --slow (the layouts' kinds are checked one each above)."""
    budget = 6_000_000
    fast = fleet.plan(twelve, devices=2, memory_per_device=budget, global_batch=8)
    slow = fleet.plan(twelve, devices=2, memory_per_device=budget, global_batch=8, blocks_once=False)
    assert "12 identical blocks of 'm.model.layers.*' solved once" in fast.header
    assert [p.layout for p in fast] == [p.layout for p in slow] and len(fast) >= 3
    assert any(p.layout.pipe == 2 for p in fast) and fast.pruned
    for a, b in zip(fast, slow, strict=True):
        assert (a.peak_bytes, a.stage_peaks) == (b.peak_bytes, b.stage_peaks), a.layout
        assert math.isclose(a.step_seconds, b.step_seconds, rel_tol=1e-9), a.layout
    assert {lay for lay, _ in fast.pruned} == {lay for lay, _ in slow.pruned}


@pytest.mark.slow  # 13 s of export (torch's tracing of MLA and the MoE layers)
def test_deepseek_v3s_moe_layers_after_its_dense_ones_are_one_run():
    """A 6-layer DeepSeek-V3 (the zoo's shape, a dense first layer) exported on meta: the exporter
    makes the tokens x top-k shape expression once, in the first MoE layer, and every later one
    reads it, and each layer has its own router bias (a buffer): neither breaks the run, which
    begins after the first MoE layer (it makes that expression)."""
    import transformers
    from zoo.hf import LLAMAISH, LMLoss

    cfg = transformers.DeepseekV3Config(
        **dict(LLAMAISH, attention_dropout=0.0, num_hidden_layers=6, num_key_value_heads=4),
        num_experts_per_tok=2,
        n_routed_experts=8, moe_intermediate_size=16, n_group=2, topk_group=1, n_shared_experts=1,
        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4,
        qk_nope_head_dim=8, v_head_dim=8,
    )  # fmt: skip
    with torch.device("meta"):
        module = LMLoss(transformers.DeepseekV3ForCausalLM(cfg)).train()
    ids = torch.zeros(2, 12, dtype=torch.long, device="meta")
    blocks = find_blocks(metaopt.export(module, (ids, ids)))
    assert blocks.count == 6 and blocks.why_not is None and blocks.first == 2, blocks.why_not
