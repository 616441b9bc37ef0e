"""The zoo's checks, one function each, shared by the tests and the table (`python -m tests.zoo`).

Each check exports the entry's module with metaopt and compares with torch on the same
module:

* grads: every param's gradient judged against float64 torch (`judge_grads`, DESIGN.md's bar),
  at a batch size other than the export's (the symbolic batch dim at work);
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


def check_batch(entry) -> int:
    return EXPORT_BATCH if entry.export_kwargs.get("dynamic_batch") is False else CHECK_BATCH


def _feed(module, inputs) -> dict[str, torch.Tensor]:
    return dict(zip(feed_names(module, len(inputs)), inputs, strict=True))


def _double(x: torch.Tensor) -> torch.Tensor:
    return x.double() if x.is_floating_point() else x


def _channels_last(program: metaopt.Program) -> bool:
    """Does `program` run 2-D convolutions channels-last (passes/channels_last.py)?"""
    return any(op.attrs.get("memory_format") == "channels_last" for op in program.ops)


def _reference(inputs, *, double: bool, channels_last: bool) -> tuple:
    """Inputs for a torch reference: float64 (the truth, in torch's default layout), or float32
    laid out as the program runs its convolutions, so that torch's float32 noise floor comes from
    the same kernels. Channels-last convolutions round differently from NCHW ones, and small
    CNNs with BatchNorm at batch 3 amplify rounding ~1e6-fold (tv-shufflenet: NCHW float32 torch
    is 5e-3 from float64 on one conv weight, channels-last torch 0.68, float64 in the two layouts
    1.7e-10 apart): judged against the NCHW floor, torch's own channels-last run would fail."""
    if double:
        return tuple(_double(x) for x in inputs)
    return programs.channels_last(inputs) if channels_last else tuple(inputs)


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
    ours: dict[str, torch.Tensor], torch32: dict[str, torch.Tensor], torch64: dict[str, torch.Tensor]
) -> list[GradVerdict]:
    """Per param: how far our float32 grad is from float64 truth, relative to torch's float32 one.

    A missing grad counts as zeros (a param the loss does not reach). The floor on the
    denominator keeps a param torch gets exactly right (zero noise) from dividing by zero: then
    `rel` decides.
    """
    out = []
    for name, g64 in torch64.items():
        ref = g64.double()
        mine = ours.get(name)
        mine = torch.zeros_like(ref) if mine is None else mine.double()
        t32 = torch32.get(name)
        t32 = torch.zeros_like(ref) if t32 is None else t32.double()
        err = (mine - ref).abs().max().item() if ref.numel() else 0.0
        noise = (t32 - ref).abs().max().item() if ref.numel() else 0.0
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


def program_verdicts(program: metaopt.Program, module, inputs, device: str = "cpu") -> list[GradVerdict]:
    """`program`'s param grads on `inputs` judged against torch on `module`: float64 truth on the
    CPU, and float32 torch on `device` for the noise floor (a GPU's kernels round otherwise)."""
    return judge_grads(
        metaopt_grads(program, module, inputs, device),
        torch_grads(module, inputs, double=False, device=device, channels_last=_channels_last(program)),
        torch_grads(module, inputs, double=True),
    )


def check_grads(entry, device: str = "cpu") -> list[GradVerdict]:
    module, program = export(entry, 0.0)
    verdicts = program_verdicts(program, module, entry.inputs(check_batch(entry), 1), device)
    _fail_if_wrong(entry, verdicts, "wrong grads")
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
    l32, p32 = _torch_sgd(module, entry, double=False, channels_last=_channels_last(program))
    l64, p64 = _torch_sgd(module, entry, double=True)
    names = [f"loss of step {i}" for i in range(SGD_STEPS)]
    verdicts = judge_grads(
        {**dict(zip(names, ours)), **{n: exe.scope[n] for n in p64}},
        {**dict(zip(names, l32)), **p32},
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
            moved = [n for n in trainable if not torch.equal(exe.scope[n], main.values[n])]
            if moved:
                raise ZooFailure(f"{entry.name}: gradient merge updated {moved[0]!r} before the k-th run")
    p32 = _torch_merged_sgd(module, entry, double=False, channels_last=_channels_last(program))
    p64 = _torch_merged_sgd(module, entry, double=True)
    verdicts = judge_grads({n: exe.scope[n] for n in p64}, p32, p64)
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


# ---- the fused LM head + cross-entropy (passes/fuse_linear_cross_entropy.py) ---------------------------

FUSED_CHUNK = 5  # tokens per chunk: divides none of the zoo's token counts, so the last chunk is short


def check_fused_cross_entropy(entry) -> dict:
    """The zoo entry with every softmax cross-entropy and its linear head fused (whatever the vocab
    size): grads against float64 torch, and recompute bit-identical (dropout on). Entries without
    such a loss report 0 fused and pass."""
    from metaopt.passes.fuse_linear_cross_entropy import (
        fuse_linear_cross_entropy,
        plan_fuse_linear_cross_entropy,
    )

    def fused(program):
        plan = plan_fuse_linear_cross_entropy(program, min_classes=0, chunk_size=FUSED_CHUNK)
        return fuse_linear_cross_entropy(program, plan=plan), plan

    module, program = export(entry, 0.0)
    q, plan = fused(program)
    out = {"fused": len(plan.fused)}
    if not plan.fused:
        return out
    inputs = entry.inputs(check_batch(entry), 1)
    verdicts = judge_grads(
        metaopt_grads(q, module, inputs),
        torch_grads(module, inputs, double=False, channels_last=_channels_last(q)),
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
