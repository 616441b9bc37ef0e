"""Training on CUDA held to the CPU's bars where CUDA allows (skipped without a GPU; run on a lent
GPU machine by benchmarks/gpu.sh): gradients judged against float64, recompute and offload
bit-identical with dropout on, AMP against autocast and float32, optimizer steps against
torch.optim. Every test name says cuda, which is how gpu.sh selects them."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from conftest import exported
from zoo import harness, models

import metaopt
import programs
from metaopt.passes.amp import amp
from metaopt.passes.backward import append_backward
from metaopt.passes.offload import offload
from metaopt.passes.recompute import plan_recompute, recompute

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# The zoo's transformers and CNNs, on the GPU's kernels (cuBLAS, cuDNN, the SDPA kernels).
ZOO = ["hf-gpt2", "hf-bert", "hf-llama", "hf-t5", "hf-vit", "hf-resnet", "tv-resnet18", "tv-mobilenet-v2"]


@pytest.fixture(autouse=True)
def strict_float32():
    """Float32 as float32: torch lets cuDNN convolutions use TF32 by default (10-bit mantissas
    inside the products), and channels-last picks other cuDNN algorithms than NCHW, so TF32's
    rounding would differ between the program and its reference by far more than float32's
    (measured: ResNet BN grads 0.3 off, 5 momentum steps 24% apart). The bars here are float32's."""
    before = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before


@pytest.fixture
def deterministic():
    """Bit-identity on CUDA needs kernels that give the same bits for the same inputs: some
    (cuDNN's backward-weight algorithms, atomics in scatter-adds) sum in a run-dependent order.
    torch's deterministic mode picks the ones that don't (and raises where none exists, which
    then names the op). cuBLAS needs CUBLAS_WORKSPACE_CONFIG before its first call: gpu.sh
    exports it; set here too for a direct pytest run that has not yet touched cuBLAS."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    before = torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    yield
    torch.use_deterministic_algorithms(before[0])
    torch.backends.cudnn.benchmark = before[1]


def _wrong(verdicts: list[harness.GradVerdict]) -> list[harness.GradVerdict]:
    return [v for v in verdicts if v.wrong]


@pytest.mark.parametrize("name", ["mlp", "bert", "gpt", "resnet"])
def test_cuda_grads_of_reference_programs_judged_against_float64(name):
    """DESIGN.md's bar, with the float32 noise floor taken from torch on the same GPU."""
    module, inputs, program = exported(name)
    verdicts = harness.program_verdicts(program, module, inputs, "cuda")
    assert verdicts and not _wrong(verdicts), _wrong(verdicts)


@pytest.mark.parametrize("entry", ZOO)
def test_cuda_grads_of_zoo_models_judged_against_float64(entry):
    verdicts = harness.check_grads(models.get(entry), "cuda")  # raises ZooFailure naming the param
    assert verdicts


@pytest.mark.parametrize("entry", ["hf-gpt2", "hf-bert", "hf-llama", "tv-resnet18"])
def test_cuda_recompute_and_offload_with_dropout_are_bit_identical(entry, deterministic):
    """RngReplay restores the CUDA generator (philox seed and offset): the recomputed dropout
    masks, SDPA's included, are the forward's; offload's side-stream copies change no bit."""
    out = harness.check_recompute(models.get(entry), device="cuda")  # raises ZooFailure if not
    assert out["recompute_act_peak"] <= out["act_peak"]


def _train_cuda(program: metaopt.Program, name: str, seed: int, steps: int = 3):
    mod = programs.get(name)
    exe = metaopt.Executor("cuda")
    metaopt.seed(seed)
    trace = []
    grads = [f"{v.name}@GRAD" for v in program.params()]
    for s in range(steps):
        feed = dict(zip(mod.INPUT_NAMES, mod.example_inputs("tiny", 4, seed=100 * seed + s), strict=True))
        trace.append(exe.run(program, feed=feed, fetch_list=[program.loss, *grads], return_numpy=False))
    return trace, {k: v.clone() for k, v in exe.scope.items()}


def _same(a, b) -> bool:
    (ta, sa), (tb, sb) = a, b
    return all(
        torch.equal(x, y) for xs, ys in zip(ta, tb, strict=True) for x, y in zip(xs, ys, strict=True)
    ) and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("name", ["bert", "gpt"])
def test_cuda_recompute_replays_dropout_and_fresh_draws_do_not(name, deterministic):
    """The reference programs at dropout 0.5 (the fused attention's dropout included): recompute
    and recompute + offload equal the plain program bit for bit; the negative control (no replay)
    does not, so the comparison can fail."""
    _, _, program = exported(name, dropout=0.5)
    base = program.clone()
    metaopt.optimizer.SGD(learning_rate=0.1).minimize(base.loss)
    ck = {"bert": ["bert.encoder.layer.*"], "gpt": ["transformer.h.*"]}[name]
    rc = recompute(base, checkpoints=ck)
    of = offload(rc, checkpoints=plan_recompute(base, checkpoints=ck).checkpoints)
    plain = recompute(base, checkpoints=ck, seed_random_ops=False)
    ref = _train_cuda(base, name, 0)
    assert _same(ref, _train_cuda(rc, name, 0))
    assert _same(ref, _train_cuda(of, name, 0))
    assert not _same(ref, _train_cuda(plain, name, 0))


def _median_rel_err(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, list[float]]:
    errs = sorted(
        ((got[n].float() - w.float()).norm() / w.float().norm()).item()
        for n, w in want.items()
        if w is not None and w.float().norm() > 1e-3
    )
    assert errs, "no grad to compare"
    return errs[len(errs) // 2], errs


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", ["mlp", "resnet", "bert", "gpt"])
def test_cuda_amp_grads_close_to_autocast_or_float32(name, dtype):
    """AMP on the GPU's half kernels, as the CPU's AMP tests judge it: mlp and resnet against
    torch.autocast("cuda") on the same module (the same low/float32 choices; resnet's BatchNorm
    at batch 4 is too ill-conditioned to compare with float32), bert and gpt against float32 (they
    keep LayerNorm low, Paddle's rule, which autocast does not). The median param grad within 2%
    (float16: 11-bit, bfloat16: 8-bit mantissas), and the float32 grads really differ (> 0)."""
    module, inputs, p = exported(name)
    mod = programs.get(name)
    feed = dict(zip(mod.INPUT_NAMES, inputs, strict=True))
    q, pg = append_backward(amp(p, dtype=dtype), loss="loss")
    names = [n for n, _ in pg]
    out = metaopt.Executor("cuda").run(q, feed=feed, fetch_list=[g for _, g in pg], return_numpy=False)
    got = dict(zip(names, out, strict=True))
    assert all(g.dtype == torch.float32 and g.is_cuda for g in out)
    ref32, pg32 = append_backward(p, loss="loss")
    out32 = metaopt.Executor("cuda").run(
        ref32, feed=feed, fetch_list=[g for _, g in pg32], return_numpy=False
    )
    want32 = dict(zip([n for n, _ in pg32], out32, strict=True))
    assert max(_median_rel_err(got, want32)[1]) > 0  # really computed in low precision
    if name in ("mlp", "resnet"):
        m = copy.deepcopy(module).cuda()
        with torch.autocast("cuda", dtype=getattr(torch, dtype)):
            loss = m(*[x.cuda() for x in programs.channels_last(inputs)])
        loss.backward()
        want = {n: p.grad for n, p in m.named_parameters() if n in got}
    else:
        want = want32
    median, errs = _median_rel_err(got, want)
    assert median < 2e-2, (dtype, errs)


def _torch_momentum(name: str, batches, device: str, double: bool):
    """Five torch.optim.SGD(momentum) steps on the reference module: (losses, params)."""
    mod = programs.get(name)
    module = mod.build("tiny", seed=0, dropout=0.0).to(device)
    if double:
        module = module.double()
    opt = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for b in batches:
        x = [
            t.double() if double and t.is_floating_point() else t
            for t in (b if double else programs.channels_last(b))
        ]
        opt.zero_grad()
        loss = module(*[t.to(device) for t in x])
        loss.backward()
        opt.step()
        losses.append(loss.detach().cpu())
    return losses, {n: p.detach().cpu() for n, p in module.named_parameters()}


@pytest.mark.parametrize("name", ["mlp", "gpt", "resnet"])
def test_cuda_five_momentum_steps_match_torch_optim(name):
    """Five steps of metaopt's Momentum on the GPU against torch.optim.SGD(momentum) on the same
    module on the same GPU (float32, TF32 off). mlp, gpt: rtol 1e-4 / atol 1e-5, ten times the
    CPU test's: both sides call the same kernels, but cuBLAS picks algorithms per call, whose
    sums round in other orders. resnet: BatchNorm at batch 4 amplifies that rounding (the first
    H200 run: losses 1.1% apart at step 4, either side as near to float64 as the other can't be
    told by a tolerance), so it is judged as the zoo judges SGD: every loss and param against
    float64 torch, the float32 noise floor from torch on the GPU (DESIGN.md's bar)."""
    mod = programs.get(name)
    batches = [mod.example_inputs("tiny", 4, seed=100 + s) for s in range(5)]
    _, _, program = exported(name)
    main = program.clone()
    metaopt.optimizer.Momentum(learning_rate=0.05, momentum=0.9).minimize(main.loss)
    exe = metaopt.Executor("cuda")
    ours = [
        exe.run(
            main, feed=dict(zip(mod.INPUT_NAMES, b, strict=True)), fetch_list=[main.loss], return_numpy=False
        )[0]
        for b in batches
    ]
    ours = [x.reshape(()).cpu() for x in ours]
    ref, params = _torch_momentum(name, batches, "cuda", double=False)
    if name != "resnet":
        torch.testing.assert_close(torch.stack(ours), torch.stack(ref), rtol=1e-4, atol=1e-5)
        for n, p in params.items():
            torch.testing.assert_close(exe.scope[n].cpu(), p, rtol=1e-4, atol=1e-5, msg=n)
        return
    ref64, params64 = _torch_momentum(name, batches, "cpu", double=True)
    steps = [f"loss of step {i}" for i in range(len(batches))]
    verdicts = harness.judge_grads(
        {**dict(zip(steps, ours)), **{n: exe.scope[n].cpu() for n in params64}},
        {**dict(zip(steps, ref)), **params},
        {**dict(zip(steps, ref64)), **params64},
    )
    assert verdicts and not _wrong(verdicts), _wrong(verdicts)
