"""The reports of issue 29: torchvision's ShuffleNet and MnasNet "wrong" at some image size and
thread count. Root cause: no kernel is wrong (neither torch's nor ours). The inputs put a ReLU's
input within float32 rounding of zero; float32 then takes either side of the kink depending on
summation order (layout, thread count), and the float64 reference sits on one side. A flipped
ReLU ahead of a BatchNorm over few values moves whole grads (ShuffleNet at 64x64, 2 threads,
channels-last: one ReLU of `m.conv5.2`, float64 input 1.6e-5 of its max, moves
`m.conv5.0.weight` 36%; float64 torch moves as much for an image perturbed by 1e-5).

So the checks here are the ones that hold at such points:
* float64: the program's grads equal float64 torch's to 1e-7 (no ReLU flips at float64's
  rounding), at each image size and thread count, channels-last on;
* float32: our grads are as close to the float64 program's on float32's side of every ReLU
  (`harness.branch_matched_float64`) as float32 torch is to float64 torch;
* the diagnosis itself: at the reported input, float32 torch in one of its configurations is as
  far from float64 as our program is, and float64 torch's own grad jumps under a 1e-5 input
  perturbation, which no kernel defect could cause.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import metaopt
from metaopt.passes.backward import append_backward
from zoo import harness
from zoo.harness import judge_grads, threads
from zoo.tv import import_torchvision


class _Loss(torch.nn.Module):
    def __init__(self, m: torch.nn.Module) -> None:
        super().__init__()
        self.m = m

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.m(x), y)


def _case(which: str, size: int):
    """The issue's module and inputs, verbatim."""
    tv = import_torchvision()
    torch.manual_seed(0)
    if which == "shufflenet":
        module = _Loss(tv.models.shufflenet_v2_x0_5(num_classes=10)).train()
        x, y = torch.randn(4, 3, size, size), torch.randint(0, 10, (4,))
    else:
        module = _Loss(tv.models.mnasnet0_5(num_classes=10, dropout=0.0)).train()
        x = torch.randn(8, 3, size, size, generator=torch.Generator().manual_seed(2))
        y = torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(3))
    return module, x, y


def _run(program: metaopt.Program, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every param's grad from `program` with its backward appended."""
    q, pairs = append_backward(program, loss=program.loss_name)
    got = metaopt.Executor("cpu").run(
        q, feed={"x": x, "y": y}, fetch_list=[g for _, g in pairs], return_numpy=False
    )
    return dict(zip([p for p, _ in pairs], got, strict=True))


# 64 px is the point and runs in the suite for ShuffleNet (whose kink the module doc
# describes); 32 px (52 s of it), 96 px (the third size, 90 s) and MNASNet at 64 px (27 s)
# run with --slow, to keep the suite under ten minutes.
SIZES = [
    pytest.param(which, size, marks=[pytest.mark.slow] if size != 64 or which == "mnasnet" else [])
    for which in ("shufflenet", "mnasnet")
    for size in (32, 64, 96)
]
SGD_STEPS, LR = 3, 0.05


def _float64_rel(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest difference relative to each value's largest entry, floored at 1e-6 of the
    largest of all (`harness.float64_worst`'s measure)."""
    top = max(g.abs().max().item() for g in ref.values())
    return max(
        ((ours[n] - g).abs().max().item() / max(g.abs().max().item(), 1e-6 * top), n) for n, g in ref.items()
    )


# After 3 SGD steps, against float64 torch in the program's layout. ShuffleNet at 32 px: its last
# stages' BatchNorms normalise 4 values, which turns float64's last bits into 1.5e-7 after 3
# steps (deterministically so under `pytest -n 2`, at e4d86c5 as now; under 1e-7 run alone): a float64
# rounding, 6.8e-5 being the gap between torch's own two layouts there.
AFTER_SGD_REL = {("shufflenet", 32): 1e-6}


def _torch64_sgd(module, x, y, *, channels_last: bool) -> dict[str, torch.Tensor]:
    m, xx = copy.deepcopy(module).double(), x.double()
    if channels_last:
        m, xx = m.to(memory_format=torch.channels_last), xx.contiguous(memory_format=torch.channels_last)
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    for _ in range(SGD_STEPS):
        opt.zero_grad()
        m(xx, y).backward()
        opt.step()
    return {n: p.detach() for n, p in m.named_parameters()}


@pytest.mark.parametrize("which,size", SIZES)
def test_float64_program_equals_float64_torch_grads_and_sgd_at_both_thread_counts(which, size):
    """Every grad to 1e-7 on 1 and 2 threads; then every param after 3 SGD steps to 1e-7 of
    float64 torch, NCHW or channels-last: at 32 px ShuffleNet's last stages are 1x1 and their
    BatchNorms normalise 4 values, so float64 torch itself, NCHW against channels-last, ends
    6.8e-5 apart after 3 steps (the program runs channels-last)."""
    module, x, y = _case(which, size)
    m64 = copy.deepcopy(module).double()
    program = metaopt.export(copy.deepcopy(m64), (x.double(), y))
    assert any(op.attrs.get("memory_format") == "channels_last" for op in program.ops)
    ref = harness.torch_grads(m64, (x, y), double=True)
    for n in harness.THREADS:
        with threads(n):
            rel, name = _float64_rel(_run(program, x.double(), y), ref)
        assert rel <= harness.FLOAT64_REL, (n, name, rel)
    trained = program.clone()
    metaopt.optimizer.SGD(learning_rate=LR).minimize(trained.loss)
    exe = metaopt.Executor("cpu")
    for _ in range(SGD_STEPS):
        exe.run(trained, feed={"x": x.double(), "y": y}, fetch_list=[trained.loss])
    want = _torch64_sgd(module, x, y, channels_last=False)
    top = max(w.abs().max().item() for w in want.values())

    def rel(k: str, ref: dict[str, torch.Tensor]) -> float:  # `_float64_rel`'s measure, one param
        return (exe.scope[k] - ref[k]).abs().max().item() / max(ref[k].abs().max().item(), 1e-6 * top)

    off = [k for k in want if rel(k, want) > harness.FLOAT64_REL]
    if off:  # float64 torch in the program's layout, only where needed (float64 convs are slow)
        cl = _torch64_sgd(module, x, y, channels_last=True)
        worst = max((rel(k, cl), k) for k in off)
        assert worst[0] <= AFTER_SGD_REL.get((which, size), harness.FLOAT64_REL), worst


@pytest.mark.parametrize("which,size", SIZES)
def test_float32_grads_are_float32_precise_on_their_side_of_each_relu(which, size):
    """At both thread counts: judged against the float64 program on float32's side of every ReLU
    (`branch_matched_float64`), over float32 torch's floor. The float64 test above holds that
    program to torch."""
    module, x, y = _case(which, size)
    program = metaopt.export(copy.deepcopy(module), (x, y))
    program64 = metaopt.export(copy.deepcopy(module).double(), (x.double(), y))
    floor = harness.torch32_floor(module, (x, y))
    for n in harness.THREADS:
        with threads(n):
            truth = harness.branch_matched_float64(program, program64, module, (x, y))
            verdicts = judge_grads(_run(program, x, y), floor, truth)
        assert not [v for v in verdicts if v.wrong], (n, max(verdicts, key=lambda v: v.ratio))


def test_the_reported_shufflenet_point_is_a_kink_of_the_loss_not_a_kernel_defect():
    """At 64x64 on 2 threads, channels-last float32 (ours and torch's alike) lands on the other
    side of one ReLU than float64: float32 torch channels-last is as far from float64 as the
    issue measured for us, and float64 torch moves as far when the image moves by 1e-5."""
    module, x, y = _case("shufflenet", 64)
    g64 = harness.torch_grads(module, (x, y), double=True)
    nchw32 = harness.torch_grads(module, (x, y), double=False)
    cl = copy.deepcopy(module).to(memory_format=torch.channels_last)  # eager torch, channels-last
    with threads(2):
        cl(x.contiguous(memory_format=torch.channels_last), y).backward()
    cl32 = {n: p.grad for n, p in cl.named_parameters()}
    (verdict,) = [v for v in judge_grads(cl32, nchw32, g64) if v.param == "m.conv5.0.weight"]
    assert verdict.wrong and verdict.rel > 0.3, verdict  # the 36% for us: torch's own
    gen = torch.Generator().manual_seed(5)
    nudged = x.double() * (1 + 1e-5 * torch.randn(x.shape, generator=gen, dtype=torch.float64))
    g64b = harness.torch_grads(module, (nudged, y), double=True)
    jump = max(
        (g64b[n] - g).abs().max().item() / g.abs().max().item()
        for n, g in g64.items()
        if g.abs().max() > 1e-6
    )
    assert jump > 0.05, jump
