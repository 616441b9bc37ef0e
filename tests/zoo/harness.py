"""The zoo's checks, one function each, shared by the tests and the table (`python -m tests.zoo`).

Each check exports the entry's module with metaopt and compares with torch on the same
module:

* grads: two checks at a batch size other than the export's (the symbolic batch dim at work):
  the module exported in float64 gives torch's float64 gradients to 1e-7 (`check_grads_float64`:
  the program's math, every pass and kernel choice on, free of float32 rounding), and the float32
  program's gradients are as close to float64 torch as float32 torch is (`judge_grads`, DESIGN.md's
  bar, against torch's float32 floor over its layouts and thread counts: `torch_floor`);
* sgd: 3 steps of metaopt's SGD against `torch.optim.SGD`, losses and params (judged like grads);
* recompute / offload: with dropout on, the recomputed (and offloaded) program is bit-identical
  to the plain one (loss, every grad, every param after 2 steps);
* merge: gradient merge over 2 runs with SGD: params untouched after the first run, then equal
  to one torch SGD step on the mean of both batches' grads (judged like grads);
* fused_ce: the LM head + cross-entropy fused into one chunked op (min_classes=0, a chunk size
  that divides no token count here): grads judged against float64 torch again, and recompute
  of the fused program bit-identical to the fused program.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from dataclasses import dataclass

import export_cache
import torch

import metaopt
import programs
from metaopt.passes.backward import append_backward
from metaopt.passes.offload import offload
from metaopt.passes.recompute import recompute, resolve_checkpoints

EXPORT_BATCH = 4
CHECK_BATCH = 3  # a second batch size: the program's batch dim is symbolic
DROPOUT = 0.2
SGD_LR = 0.05
SGD_STEPS = 3


class ZooFailure(AssertionError):
    pass


def feed_names(module: torch.nn.Module, n: int) -> list[str]:
    return list(inspect.signature(module.forward).parameters)[:n]


def export(entry, dropout: float) -> tuple[torch.nn.Module, metaopt.Program]:
    module = entry.build(dropout)
    kwargs = dict(entry.export_kwargs)
    program = export_cache.export(module, entry.inputs(EXPORT_BATCH, 0), name=entry.name, **kwargs)
    return module, program


def torch_refuses(entry, batch: int) -> str | None:
    """Why float32 torch cannot train `entry` at `batch`, or None (BatchNorm over one value per
    channel at batch 1: "Expected more than 1 value per channel when training")."""
    module = entry.build(0.0)
    try:
        module(*entry.inputs(batch, 1)).backward()
    except (ValueError, RuntimeError) as e:
        return str(e).splitlines()[0][:120]
    return None


def check_batch(entry) -> int:
    return EXPORT_BATCH if entry.export_kwargs.get("dynamic_batch") is False else CHECK_BATCH


def _feed(module, inputs) -> dict[str, torch.Tensor]:
    return dict(zip(feed_names(module, len(inputs)), inputs, strict=True))


def _double(x: torch.Tensor) -> torch.Tensor:
    return x.double() if x.is_floating_point() else x


def _reference(inputs, *, double: bool, channels_last: bool = False) -> tuple:
    """Inputs for a torch reference: float64 (the truth, in torch's default layout), or float32 in
    the given layout (one of the configurations of `torch_floor`)."""
    if double:
        return tuple(_double(x) for x in inputs)
    return programs.channels_last(inputs) if channels_last else tuple(inputs)


# ---- torch's float32 floor: every configuration float32 torch runs in --------------------------------

THREADS = (1, 2)


@contextlib.contextmanager
def threads(n: int):
    """Run torch's CPU kernels on `n` threads inside the block (the caller's count after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _has_conv2d(module: torch.nn.Module) -> bool:
    return any(isinstance(m, torch.nn.Conv2d) for m in module.modules())


def torch_configs(module: torch.nn.Module) -> list[tuple[bool, int]]:
    """(channels_last, threads) for each way float32 torch runs `module` here: both thread counts,
    and both memory formats where the module has 2-D convolutions."""
    layouts = (False, True) if _has_conv2d(module) else (False,)
    return [(cl, n) for cl in layouts for n in THREADS]


def torch_floor(module: torch.nn.Module, run) -> list:
    """`run(channels_last)` under each of `torch_configs(module)`: float32 torch's own spread.

    Why a spread and not one run: a float32 result is judged against float64 torch, and where a
    ReLU's input (or a max's margin) lies within float32 rounding of its threshold, float32 takes
    either side of the kink depending on summation order, that is on layout and thread count
    (tv-shufflenet at 64x64 on 2 threads channels-last: one ReLU of `m.conv5.2` whose float64
    input is 1.6e-5 of its max flips, and `m.conv5.0.weight`'s grad moves 36%; float64 torch moves
    as much when the image is perturbed by 1e-5). Either side is float32 torch's own answer; the
    float64 check (`check_grads_float64`) is what holds the program's math exact."""
    out = []
    for cl, n in torch_configs(module):
        with threads(n):
            out.append(run(cl))
    return out


# ---- the gradient metric (DESIGN.md, "Correctness bars") -------------------------------------------


@dataclass(frozen=True)
class GradVerdict:
    param: str
    ratio: float  # max|ours - g64| / max|torch32 - g64|: ~1 is float noise
    rel: float  # max|ours - g64| / max|g64|

    @property
    def wrong(self) -> bool:
        return self.ratio > 100 and self.rel > 1e-4


def judge_grads(
    ours: dict[str, torch.Tensor],
    torch32: dict[str, torch.Tensor] | list[dict[str, torch.Tensor]],
    torch64: dict[str, torch.Tensor],
) -> list[GradVerdict]:
    """Per param: how far our float32 grad is from float64 truth, relative to torch's float32 one
    (the farthest of several float32 runs when given a list: `torch_floor`).

    A missing grad counts as zeros (a param the loss does not reach). The floor on the
    denominator keeps a param torch gets exactly right (zero noise) from dividing by zero: then
    `rel` decides.
    """
    floors = torch32 if isinstance(torch32, list) else [torch32]
    out = []
    for name, g64 in torch64.items():
        ref = g64.double()
        mine = ours.get(name)
        mine = torch.zeros_like(ref) if mine is None else mine.double()
        err = (mine - ref).abs().max().item() if ref.numel() else 0.0
        noise = 0.0
        for floor in floors:
            t32 = floor.get(name)
            t32 = torch.zeros_like(ref) if t32 is None else t32.double()
            noise = max(noise, (t32 - ref).abs().max().item() if ref.numel() else 0.0)
        scale = ref.abs().max().item() if ref.numel() else 0.0
        ratio = err / max(noise, 1e-30) if err else 0.0
        rel = err / scale if scale else (float("inf") if err else 0.0)
        out.append(GradVerdict(name, ratio, rel))
    return out


def torch_grads(
    module: torch.nn.Module, inputs, *, double: bool, device: str = "cpu", channels_last: bool = False
) -> dict[str, torch.Tensor]:
    m = copy.deepcopy(module).to(device)
    inputs = _reference(inputs, double=double, channels_last=channels_last)
    inputs = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in inputs)
    if double:
        m = m.double()
    m.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    m(*inputs).backward()
    return {n: p.grad.detach().cpu().clone() for n, p in m.named_parameters() if p.grad is not None}


def metaopt_grads(program: metaopt.Program, module, inputs, device: str = "cpu") -> dict[str, torch.Tensor]:
    q, params_grads = append_backward(program, loss=program.loss_name)
    names = [p for p, _ in params_grads]
    got = metaopt.Executor(device).run(
        q, feed=_feed(module, inputs), fetch_list=[g for _, g in params_grads], return_numpy=False
    )
    return dict(zip(names, (g.cpu() for g in got), strict=True))


def torch32_floor(module, inputs, device: str = "cpu") -> list[dict[str, torch.Tensor]]:
    """float32 torch's grads in each configuration it runs in on the CPU (`torch_floor`), or on
    `device` alone (a GPU's kernels round otherwise)."""
    if device != "cpu":
        return [torch_grads(module, inputs, double=False, device=device)]
    return torch_floor(module, lambda cl: torch_grads(module, inputs, double=False, channels_last=cl))


def program_verdicts(program: metaopt.Program, module, inputs, device: str = "cpu") -> list[GradVerdict]:
    """`program`'s param grads on `inputs` judged against torch on `module`: float64 truth on the
    CPU, and float32 torch's floor (`torch32_floor`)."""
    return judge_grads(
        metaopt_grads(program, module, inputs, device),
        torch32_floor(module, inputs, device),
        torch_grads(module, inputs, double=True),
    )


def _relus(program: metaopt.Program) -> list:
    return [op for op in program.ops if op.type == "Relu" and op.role == "forward"]


def branch_matched_float64(
    program32: metaopt.Program, program64: metaopt.Program, module, inputs
) -> dict[str, torch.Tensor]:
    """float64 grads of `program64` on the branch float32 took: each forward `Relu(x)` becomes
    `Mul(x, mask)` with the mask `x > 0` of `program32`'s float32 run (the k-th Relu of one program
    is the k-th of the other: both come from one module). Where a ReLU's input lies within
    float32 rounding of zero, float32 and float64 take different sides of the kink and no
    float32 result can be judged against plain float64; against this, a float32 program whose
    kernels round like torch's is within float32 torch's noise (tests/zoo/test_kinks.py).

    Only ReLU kinks are matched: they are what flips in the zoo's CNNs (max-pool ties, clips and
    other kinks are not, and still judge against plain float64)."""
    r32, r64 = _relus(program32), _relus(program64)
    if [op.scope for op in r32] != [op.scope for op in r64]:
        raise ZooFailure("the float32 and float64 programs' ReLUs differ: cannot match branches")
    feed32 = _feed(module, inputs)
    xs = (
        metaopt.Executor("cpu").run(
            program32, feed=feed32, fetch_list=[op.inputs[0] for op in r32], return_numpy=False
        )
        if r32
        else []
    )
    q = program64.clone()
    for k, (op, x32) in enumerate(zip(_relus(q), xs, strict=True)):
        mask = f"relu_mask_{k}"  # a test-only constant
        q.add_var(metaopt.ir.Var(mask, "float64", tuple(x32.shape), kind="constant"), (x32 > 0).double())
        op.type, op.inputs = "Mul", [op.inputs[0], mask]
    feed64 = {k: _double(v) for k, v in feed32.items()}
    q, params_grads = append_backward(q, loss=q.loss_name)
    fetch = [g for _, g in params_grads]
    got = metaopt.Executor("cpu").run(q, feed=feed64, fetch_list=fetch, return_numpy=False)
    return dict(zip([p for p, _ in params_grads], got, strict=True))


FLOAT64_REL = 1e-7  # float64 rounding (1e-16) amplified even a million-fold stays far below this


def export64(entry) -> tuple[torch.nn.Module, metaopt.Program]:
    """The entry's module in float64 and its export (every pass and kernel choice as in float32,
    channels-last convolutions included)."""
    module = entry.build(0.0).double()
    inputs = tuple(_double(x) for x in entry.inputs(EXPORT_BATCH, 0))
    return module, export_cache.export(module, inputs, name=entry.name, **dict(entry.export_kwargs))


FLOAT32_ISLAND_REL = 1e-5  # a model that computes part of itself in float32 on purpose


def float64_worst(
    entry, ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], what: str, *, island: bool = False
) -> float:
    """The largest relative difference of float64 values `ours` from float64 torch's `ref`, each
    relative to its largest entry (or to a floor: a value that is zero in exact arithmetic, such
    as the grad of a BatchNorm bias before another BatchNorm, is rounding on both sides); a
    `ZooFailure` past `FLOAT64_REL`, floor 1e-6 of the largest value of all. `island`: the model
    casts part of its work to float32 itself (HF Funnel's attention scores: `.float()`), so torch's
    float64 run is float32-precise there too and only float32's bar applies
    (`FLOAT32_ISLAND_REL`, floor 1e-3 of the largest)."""
    tol, floor = (FLOAT32_ISLAND_REL, 1e-3) if island else (FLOAT64_REL, 1e-6)
    top = max((g.abs().max().item() for g in ref.values() if g.numel()), default=0.0)
    worst, where = 0.0, ""
    for name, g in ref.items():
        mine = ours.get(name)
        mine = torch.zeros_like(g) if mine is None else mine.double()
        scale = max(g.abs().max().item() if g.numel() else 0.0, floor * top, 1e-300)
        rel = (mine - g).abs().max().item() / scale if g.numel() else 0.0
        if rel > worst:
            worst, where = rel, name
    if worst > tol:
        raise ZooFailure(f"{entry.name}: float64 {what} differ from torch's: {where} rel {worst:.3g}")
    return worst


def has_float32_island(program: metaopt.Program) -> bool:
    """Does a float64 program compute some values in a lower float precision (the model's own
    casts)?"""
    return any(v.dtype in ("float32", "float16", "bfloat16") for v in program.vars.values())


def check_grads_float64(entry) -> float:
    """The program's math, free of float32 rounding: the module exported in float64 gives each
    param's grad as float64 torch does, to `FLOAT64_REL` (`float64_worst`). At this precision no
    ReLU or max flips, so a difference is a grad rule, a pass, a kernel or a buffer reused too
    early. Returns the worst relative error."""
    module, program = export64(entry)
    check = tuple(_double(x) for x in entry.inputs(check_batch(entry), 1))
    ours, ref = metaopt_grads(program, module, check), torch_grads(module, check, double=True)
    return float64_worst(entry, ours, ref, "grads", island=has_float32_island(program))


def check_grads(entry, device: str = "cpu", batch: int | None = None) -> list[GradVerdict]:
    """float32, at each of `THREADS` on the CPU: every param's grad judged against float64
    (`judge_grads`) over float32 torch's floor (`torch32_floor`). On the CPU the float64 truth is
    the float64 program's on float32's side of every ReLU (`branch_matched_float64`;
    `check_grads_float64` holds that program to torch); elsewhere float64 torch's. `batch`:
    another than `check_batch`'s (batch 1). Returns the verdicts of the last thread count."""
    module, program = export(entry, 0.0)
    inputs = entry.inputs(batch or check_batch(entry), 1)
    if device != "cpu":
        verdicts = program_verdicts(program, module, inputs, device)
        _fail_if_wrong(entry, verdicts, "wrong grads")
        return verdicts
    floor, plain = torch32_floor(module, inputs), torch_grads(module, inputs, double=True)
    program64 = export64(entry)[1] if _relus(program) else None
    for n in THREADS:
        with threads(n):
            truth = plain if program64 is None else branch_matched_float64(program, program64, module, inputs)
            verdicts = judge_grads(metaopt_grads(program, module, inputs), floor, truth)
        _fail_if_wrong(entry, verdicts, f"wrong grads on {n} thread(s)")
    return verdicts


def _fail_if_wrong(entry, verdicts: list[GradVerdict], what: str) -> None:
    wrong = [v for v in verdicts if v.wrong]
    if wrong:
        worst = max(wrong, key=lambda v: v.rel)
        raise ZooFailure(
            f"{entry.name}: {len(wrong)} {what}, worst {worst.param} "
            f"ratio {worst.ratio:.3g} rel {worst.rel:.3g}"
        )


# ---- SGD against torch.optim.SGD ---------------------------------------------------------------------


def _torch_sgd(module, entry, *, double: bool, channels_last: bool = False):
    """SGD_STEPS steps of torch.optim.SGD: (losses, params)."""
    ref = copy.deepcopy(module)
    if double:
        ref = ref.double()
    opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=SGD_LR)
    losses = []
    for step in range(SGD_STEPS):
        inputs = _reference(
            entry.inputs(check_batch(entry), 10 + step), double=double, channels_last=channels_last
        )
        opt.zero_grad(set_to_none=True)
        loss = ref(*inputs)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses, {n: p.detach() for n, p in ref.named_parameters()}


def _param(exe, program: metaopt.Program, name: str) -> torch.Tensor:
    """A param's value after training: the executor's, or the program's own for a param that no
    op reads (an unused pooler: the executor never loads it, and SGD leaves it as it was)."""
    return exe.scope[name] if name in exe.scope else program.values[name]


def check_sgd(entry, *, early_updates: bool = False) -> float:
    """SGD_STEPS steps of metaopt's SGD against torch.optim.SGD: every step's loss and every
    param after the last step, judged against float64 torch by the gradient bar (`judge_grads`):
    small CNNs with BatchNorm at batch 3 are ill-conditioned enough that float32 torch itself
    is ~1e-3 away from float64 (tv-efficientnet's first loss: 8.8270 vs 8.8485), so a fixed
    rtol would fail on noise. `early_updates`: through fleet with optimizer_in_backward (each
    update inside the backward, a tied lookup grad accumulated in place). Returns the worst ratio."""
    module, program = export(entry, 0.0)
    main = program.clone()
    if early_updates:
        from metaopt import fleet

        fleet.init(is_collective=True)
        strategy = fleet.DistributedStrategy()
        strategy.optimizer_in_backward = True
        opt = fleet.distributed_optimizer(metaopt.optimizer.SGD(learning_rate=SGD_LR), strategy)
        opt.minimize(main.loss)
        if not any(op.role == "backward-update" for op in main.ops):
            raise ZooFailure(f"{entry.name}: optimizer_in_backward moved no update into the backward")
    else:
        metaopt.optimizer.SGD(learning_rate=SGD_LR).minimize(main.loss)
    exe = metaopt.Executor("cpu")
    ours = []
    for step in range(SGD_STEPS):
        inputs = entry.inputs(check_batch(entry), 10 + step)
        (loss,) = exe.run(main, feed=_feed(module, inputs), fetch_list=[main.loss], return_numpy=False)
        ours.append(loss.reshape(()))
    names = [f"loss of step {i}" for i in range(SGD_STEPS)]
    floor = [
        {**dict(zip(names, losses)), **params}
        for losses, params in torch_floor(
            module, lambda cl: _torch_sgd(module, entry, double=False, channels_last=cl)
        )
    ]
    l64, p64 = _torch_sgd(module, entry, double=True)
    verdicts = judge_grads(
        {**dict(zip(names, ours)), **{n: _param(exe, main, n) for n in p64}},
        floor,
        {**dict(zip(names, l64)), **p64},
    )
    _fail_if_wrong(entry, verdicts, f"values differ from torch after {SGD_STEPS} SGD steps")
    return max(v.ratio for v in verdicts)


# ---- gradient merge against one torch step on the merged batches --------------------------------

MERGE_K = 2


def _torch_merged_sgd(module, entry, *, double: bool, channels_last: bool = False) -> dict[str, torch.Tensor]:
    """One torch.optim.SGD step on the mean of MERGE_K batches' grads, each batch its own forward
    (as gradient merge runs them: BatchNorm sees each micro-batch's statistics)."""
    ref = copy.deepcopy(module)
    if double:
        ref = ref.double()
    opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=SGD_LR)
    opt.zero_grad(set_to_none=True)
    for k in range(MERGE_K):
        inputs = _reference(
            entry.inputs(check_batch(entry), 30 + k), double=double, channels_last=channels_last
        )
        (ref(*inputs) / MERGE_K).backward()
    opt.step()
    return {n: p.detach() for n, p in ref.named_parameters()}


def check_gradient_merge(entry) -> float:
    """fleet's gradient_merge (k_steps=MERGE_K, avg) with SGD: params untouched until the k-th run,
    then equal to one torch SGD step on the mean of the k batches' grads (judged against float64
    torch like grads). Returns the worst ratio."""
    from metaopt import fleet

    module, program = export(entry, 0.0)
    main = program.clone()
    fleet.init(is_collective=True)
    strategy = fleet.DistributedStrategy()
    strategy.gradient_merge = True
    strategy.gradient_merge_configs = {"k_steps": MERGE_K, "avg": True}
    fleet.distributed_optimizer(metaopt.optimizer.SGD(learning_rate=SGD_LR), strategy).minimize(main.loss)
    exe = metaopt.Executor("cpu")
    trainable = [v.name for v in main.params() if v.trainable]
    for k in range(MERGE_K):
        exe.run(main, feed=_feed(module, entry.inputs(check_batch(entry), 30 + k)))
        if k < MERGE_K - 1:
            moved = [n for n in trainable if not torch.equal(_param(exe, main, n), main.values[n])]
            if moved:
                raise ZooFailure(f"{entry.name}: gradient merge updated {moved[0]!r} before the k-th run")
    floor = torch_floor(module, lambda cl: _torch_merged_sgd(module, entry, double=False, channels_last=cl))
    p64 = _torch_merged_sgd(module, entry, double=True)
    verdicts = judge_grads({n: _param(exe, main, n) for n in p64}, floor, p64)
    _fail_if_wrong(entry, verdicts, f"params differ from torch after one step merged over {MERGE_K} runs")
    return max(v.ratio for v in verdicts)


# ---- recompute and offload bit-identity ------------------------------------------------------------


def _train(program: metaopt.Program, module, entry, steps: int = 2, device: str = "cpu"):
    exe = metaopt.Executor(device)
    metaopt.seed(1234)
    grads = [f"{v.name}@GRAD" for v in program.params() if v.trainable]
    grads = [g for g in grads if g in program.vars]
    trace = []
    for step in range(steps):
        inputs = entry.inputs(check_batch(entry), 20 + step)
        trace.append(
            exe.run(
                program, feed=_feed(module, inputs), fetch_list=[program.loss, *grads], return_numpy=False
            )
        )
    return trace, {k: v.clone() for k, v in exe.scope.items()}, exe.memory_stats()


def _identical(a, b) -> bool:
    (ta, sa, _), (tb, sb, _) = a, b
    return (
        all(torch.equal(x, y) for xs, ys in zip(ta, tb, strict=True) for x, y in zip(xs, ys, strict=True))
        and sa.keys() == sb.keys()
        and all(torch.equal(sa[k], sb[k]) for k in sa)
    )


def check_recompute(entry, *, with_offload: bool = True, device: str = "cpu") -> dict:
    """Recompute (and offload) with dropout on: bit-identical to no recompute. Returns the memory
    figures: activation peaks (live bytes less persistables) of the plain, recomputed and
    offloaded programs at the check batch (tiny models: params and grads dominate, so these
    say that checkpoints resolve and segments form, not what a real batch saves)."""
    module, program = export(entry, DROPOUT)
    base = program.clone()
    metaopt.optimizer.SGD(learning_rate=SGD_LR).minimize(base.loss)
    checkpoints = resolve_checkpoints(base, list(entry.checkpoints))
    rec = recompute(base, checkpoints=checkpoints)
    if not any(op.role == "recompute" for op in rec.ops):
        raise ZooFailure(f"{entry.name}: checkpoints {entry.checkpoints} recompute nothing")
    ref = _train(base, module, entry, device=device)
    got = _train(rec, module, entry, device=device)
    if not _identical(ref, got):
        raise ZooFailure(f"{entry.name}: recompute is not bit-identical to no recompute")

    def act(stats) -> int:  # the activation peak: what recompute and offload lower
        return stats["peak_bytes"] - stats["persistable_bytes"]

    out = {"checkpoints": len(checkpoints), "act_peak": act(ref[2]), "recompute_act_peak": act(got[2])}
    if with_offload:
        off = offload(rec, checkpoints=checkpoints)
        got = _train(off, module, entry, device=device)
        if not _identical(ref, got):
            raise ZooFailure(f"{entry.name}: recompute + offload is not bit-identical to no recompute")
        out["offload_act_peak"] = act(got[2])
    return out


# ---- evaluation: Program.clone(for_test=True) against torch's model.eval() (issue 49) ----------------

EVAL_TOL = {"rtol": 1e-5, "atol": 1e-6}  # float32 forwards of the same values, other kernels


def check_eval(entry) -> float:
    """The module exported in train mode with dropout on, its `clone(for_test=True)` run twice on a
    batch: its loss equals torch's `model.eval()` loss on the same values (EVAL_TOL; both sides run
    float32 forwards, no backward amplifies a difference), the two runs are the same bits and no
    buffer changes (running stats). Returns the relative difference."""
    module, program = export(entry, DROPOUT)
    test = program.clone(for_test=True)
    inputs = entry.inputs(check_batch(entry), 30)
    exe = metaopt.Executor("cpu")
    first, second = (
        exe.run(test, feed=_feed(module, inputs), fetch_list=[test.loss], return_numpy=False)[0]
        for _ in range(2)
    )
    if not torch.equal(first, second):
        raise ZooFailure(f"{entry.name}: two runs of the eval program differ")
    changed = [n for n in exe.scope if n in test.values and not torch.equal(exe.scope[n], test.values[n])]
    if changed:
        raise ZooFailure(f"{entry.name}: the eval program changed {changed[:3]}")
    ref = copy.deepcopy(module).eval()
    with torch.no_grad():
        want = ref(*inputs)
    got = first.reshape(()).to(want.dtype)
    if not torch.allclose(got, want, **EVAL_TOL):
        raise ZooFailure(f"{entry.name}: eval loss {float(got)} != torch's model.eval() {float(want)}")
    return float((got - want).abs() / want.abs().clamp_min(1e-30))


# ---- the fused LM head + cross-entropy (passes/fuse_linear_cross_entropy.py) ---------------------------

FUSED_CHUNK = 5  # tokens per chunk: divides none of the zoo's token counts, so the last chunk is short


def check_fused_cross_entropy(entry) -> dict:
    """The zoo entry with every softmax cross-entropy and its linear head fused (whatever the vocab
    size): grads against float64 torch, and recompute bit-identical (dropout on). Entries without
    such a loss report 0 fused and pass."""
    from metaopt.passes.fuse_linear_cross_entropy import (
        apply_fuse_linear_cross_entropy,
        plan_fuse_linear_cross_entropy,
    )

    def fused(program):
        plan = plan_fuse_linear_cross_entropy(program, min_classes=0, chunk_size=FUSED_CHUNK)
        return apply_fuse_linear_cross_entropy(program, plan), plan

    module, program = export(entry, 0.0)
    q, plan = fused(program)
    out = {"fused": len(plan.fused)}
    if not plan.fused:
        return out
    inputs = entry.inputs(check_batch(entry), 1)
    verdicts = judge_grads(
        metaopt_grads(q, module, inputs),
        torch32_floor(module, inputs),
        torch_grads(module, inputs, double=True),
    )
    _fail_if_wrong(entry, verdicts, "wrong grads with the fused cross-entropy")
    out["fused_worst_ratio"] = max((v.ratio for v in verdicts), default=0.0)
    module, program = export(entry, DROPOUT)
    base, _ = fused(program)
    metaopt.optimizer.SGD(learning_rate=SGD_LR).minimize(base.loss)
    rec = recompute(base, checkpoints=resolve_checkpoints(base, list(entry.checkpoints)))
    if not _identical(_train(base, module, entry), _train(rec, module, entry)):
        raise ZooFailure(f"{entry.name}: recompute of the fused cross-entropy is not bit-identical")
    return out
