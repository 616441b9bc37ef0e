"""The model zoo's fast subset (CI); `python tests/zoo/table.py` runs every entry and prints a table.

Every kernel runs with METAOPT_CHECK_ALIASES=1: its storage sharing must be what its row declares.
"""

from __future__ import annotations

import re

import pytest
import torch

import metaopt
from metaopt.frontend.capture import ExportError
from metaopt.passes.backward import append_backward
from metaopt.passes.recompute import recompute, resolve_checkpoints
from zoo import harness, models

FAST = [e.name for e in models.entries() if e.fast]


@pytest.fixture(autouse=True)
def _check_aliases(monkeypatch):
    monkeypatch.setenv("METAOPT_CHECK_ALIASES", "1")


@pytest.mark.parametrize("name", FAST)
def test_grads_match_float64_torch(name):
    verdicts = harness.check_grads(models.get(name))
    assert verdicts and not [v for v in verdicts if v.wrong]


@pytest.mark.parametrize("name", FAST)
def test_float64_program_grads_equal_float64_torch(name):
    """To 1e-7, or 1e-5 where the model computes in float32 itself (LLaMA's RMSNorm upcasts to
    float32 and back: in a float64 model that rounds to float32): `harness.float64_worst`."""
    assert harness.check_grads_float64(models.get(name)) <= harness.FLOAT32_ISLAND_REL


# Ops whose grad still takes the generic Vjp (autograd on the op's kernel in the backward, which
# re-runs its forward): indexed writes (x[idx] = v, scatter) and InstanceNorm, in the zoo only
# in edge-inplace and edge-norms. Every other op the zoo's programs hold has a rule.
VJP_STILL = {"ScatterND", "ScatterElements", "InstanceNormalization"}


@pytest.mark.parametrize("name", FAST)
def test_no_common_op_takes_the_generic_vjp(name):
    _, program = harness.export(models.get(name), 0.0)
    q, _ = append_backward(program, loss=program.loss_name)
    generic = {op.attrs["op"] for op in q.ops if op.type == "Vjp"}
    assert generic <= VJP_STILL, generic - VJP_STILL


@pytest.mark.parametrize("name", FAST)
def test_sgd_matches_torch_optim(name):
    harness.check_sgd(models.get(name))


@pytest.mark.parametrize("name", ["hf-bert", "hf-gpt2", "tv-resnet18", "edge-tied-padding"])
def test_updates_in_the_backward_match_torch_optim(name):
    """optimizer_in_backward: the same SGD steps as torch.optim (float64 bar), tied embeddings
    (bert, gpt2, tied padding) accumulated in place, BatchNorm buffers (resnet) updated alike."""
    harness.check_sgd(models.get(name), early_updates=True)


@pytest.mark.parametrize("name", ["hf-bert", "tv-resnet18", "edge-tied-padding"])
def test_gradient_merge_equals_one_torch_step_on_the_merged_batches(name):
    """Transformer, BatchNorm (per-micro-batch statistics) and a tied param, not every FAST entry:
    the merge is model-independent once grads are right, which the other tests check."""
    harness.check_gradient_merge(models.get(name))


@pytest.mark.parametrize("name", FAST)
def test_the_eval_program_equals_torch_in_eval_mode(name):
    """Program.clone(for_test=True) of the train-mode export, dropout on (issue 49): torch's
    model.eval() loss (harness.EVAL_TOL), the same bits twice, no buffer changed."""
    harness.check_eval(models.get(name))


@pytest.mark.parametrize("name", FAST)
def test_recompute_and_offload_are_bit_identical(name):
    harness.check_recompute(models.get(name))


def test_the_metric_flags_a_wrong_grad_and_passes_noise():
    g64 = {"w": torch.linspace(-1, 1, 50, dtype=torch.float64)}
    t32 = {"w": g64["w"].float()}
    noisy = {"w": (g64["w"] * (1 + 3e-7)).float()}
    wrong = {"w": g64["w"].float().clone()}
    wrong["w"][7] = 0.0  # a dropped contribution (a pad row)
    assert not harness.judge_grads(noisy, t32, g64)[0].wrong
    assert harness.judge_grads(wrong, t32, g64)[0].wrong


SHARED = {"edge-shared-layer": ("layer", 3), "hf-albert": ("m.albert.encoder.albert_layer_groups.0", 4)}


@pytest.mark.parametrize("name", SHARED)
def test_shared_layer_has_a_checkpoint_per_call_and_saves_memory(name):
    """A module called k times: its path resolves to k outputs, and checkpointing each call
    holds fewer activation bytes than one segment over the whole model."""
    path, calls = SHARED[name]
    entry = models.get(name)
    module, program = harness.export(entry, 0.0)
    want = [path, *(f"{path}@{k}" for k in range(1, calls))]
    assert [m for m in program.modules if re.sub(r"@\d+$", "", m) == path] == want
    main = program.clone()
    metaopt.optimizer.SGD(learning_rate=0.1).minimize(main.loss)
    per_call = resolve_checkpoints(main, [path])
    assert len(per_call) == calls
    feed = harness._feed(module, entry.inputs(16, 0))

    def activation_peak(p):
        exe = metaopt.Executor()
        exe.run(p, feed=feed, fetch_list=[p.loss])
        stats = exe.memory_stats()
        return stats["peak_bytes"] - stats["persistable_bytes"]

    whole = activation_peak(recompute(main, checkpoints=per_call[-1:]))
    each = activation_peak(recompute(main, checkpoints=per_call))
    assert each < whole, (each, whole)


def test_a_batch_the_code_fixes_is_reported_at_export():
    class Contrastive(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(6, 6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            logits = self.fc(x) @ x.t()
            labels = torch.arange(4)  # the example's batch, as a constant: specializes the batch
            return torch.nn.functional.cross_entropy(logits, labels.expand(x.shape[0] // 4, 4).flatten())

    module, x = Contrastive(), torch.randn(4, 6)
    with pytest.raises(ExportError, match=r"'x' does not survive export.*requires Eq.*dynamic_batch=False"):
        metaopt.export(module, (x,))
    program = metaopt.export(module, (x,), dynamic_batch=False)  # fixed on purpose
    assert program.vars["x"].shape == (4, 6)
