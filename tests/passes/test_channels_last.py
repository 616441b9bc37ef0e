"""passes/channels_last.py: every 2-D convolution marked channels-last at import, the layout
kept through BatchNorm, ReLU, residual adds and the backward, and the numbers those of torch
running the same layout."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from zoo import harness

import metaopt
from metaopt.frontend import onnx_save
from metaopt.ir import parse_program
from metaopt.ops import registry
from metaopt.passes.backward import append_backward
from metaopt.passes.channels_last import apply_channels_last, channels_last, plan_channels_last


class SmallCNN(nn.Module):
    """conv-bn-relu, a residual conv block, then a 1-D convolution (not 2-D: left alone)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.conv1d = nn.Conv1d(8, 4, 3, padding=1)
        self.fc = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.bn2(self.conv2(h)) + h)  # h's grad is a sum of two contributions
        h = self.conv1d(h.mean(3))
        return F.cross_entropy(self.fc(h.mean(2)), y)


def _module() -> SmallCNN:
    torch.manual_seed(0)
    return SmallCNN()


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 3, 12, 12, generator=g), torch.randint(0, 5, (4,), generator=g)


def _export(module: nn.Module) -> metaopt.Program:
    return metaopt.export(module, _inputs(), dynamic_batch=False)


def _marked(p: metaopt.Program) -> list[str]:
    return [op.outputs[0] for op in p.ops if op.attrs.get("memory_format") == "channels_last"]


def test_plan_marks_the_2d_convolutions_and_says_why_not_the_1d_one():
    p = _export(_module())
    assert _marked(p) == ["conv1", "conv2"]
    plan = plan_channels_last(p)  # on the imported program: both already carry the attr
    assert plan.convs == ()
    assert [out for out, _ in plan.skipped] == ["conv1", "conv2", "conv1d"]
    assert "already set" in dict(plan.skipped)["conv1"]
    assert dict(plan.skipped)["conv1d"] == "a 1-D convolution (channels-last is for 2-D)"


def test_plan_on_an_unmarked_program_and_the_pass_is_pure():
    p = _export(_module())
    for op in p.ops:
        op.attrs.pop("memory_format", None)
    before = str(p)
    plan = plan_channels_last(p)
    assert plan.convs == ("conv1", "conv2")
    assert "channels_last: 2 convolution(s) channels-last" in str(plan)
    assert "skipped conv1d: a 1-D convolution" in str(plan)
    q = apply_channels_last(p, plan)
    assert str(p) == before and _marked(q) == ["conv1", "conv2"]
    assert channels_last(q) is q  # nothing left to mark


def test_only_rows_that_say_so_are_planned():
    rows = [r.type for r in registry.table().values() if r.channels_last is not None]
    assert rows == ["Conv"]


def test_backward_golden(golden):
    p = _export(_module())
    q, _ = append_backward(p, loss=p.loss_name)
    grads = {op.origin: op.attrs.get("memory_format") for op in q.ops if op.type == "ConvGrad"}
    assert grads == {"conv1d": None, "conv2": "channels_last", "conv1": "channels_last"}
    text = str(q)
    golden("channels_last/small_cnn", text)
    assert str(parse_program(text)) == text


def _run_grads(module: nn.Module) -> tuple[list[str], dict[str, torch.Tensor], metaopt.Program]:
    p = _export(module)
    q, params_grads = append_backward(p, loss=p.loss_name)
    fetch = [g for _, g in params_grads]
    x, y = _inputs()
    got = metaopt.Executor().run(q, feed=dict(zip(q.inputs, (x, y))), fetch_list=fetch, return_numpy=False)
    return [pn for pn, _ in params_grads], dict(zip(fetch, got)), q


def test_grads_are_bitwise_torch_on_a_channels_last_input():
    """Ours run the same aten kernels as eager torch given a channels-last image (weights as they
    are): grads equal bit for bit; and within DESIGN.md's float64 bar of the NCHW module."""
    module = _module()
    names, got, q = _run_grads(copy.deepcopy(module))
    x, y = _inputs()
    ref = copy.deepcopy(module)
    ref(x.contiguous(memory_format=torch.channels_last), y).backward()
    ref_grads = dict(ref.named_parameters())
    grads = dict(zip(names, got.values()))
    assert set(grads) == set(ref_grads)
    for name, g in grads.items():
        assert torch.equal(g, ref_grads[name].grad), name
        assert g.is_contiguous(), f"{name}: a param's grad comes back in the param's layout"
    verdicts = harness.program_verdicts(_export(module), module, _inputs())
    assert {v.param for v in verdicts} == set(ref_grads)
    assert not [v for v in verdicts if v.wrong], verdicts


def test_activations_and_their_grads_are_channels_last_at_run_time():
    p = _export(_module())
    q, _ = append_backward(p, loss=p.loss_name)
    x, y = _inputs()
    wanted = ["conv1", "bn1", "conv2", "add", "relu_1"]
    wanted += [f"{n}@GRAD" for n in ("conv2", "relu")]  # relu@GRAD: the residual's GradSum
    missing = [n for n in wanted if n not in q.vars]
    assert not missing, (missing, sorted(q.vars))
    got = metaopt.Executor().run(q, feed=dict(zip(q.inputs, (x, y))), fetch_list=wanted, return_numpy=False)
    for name, t in zip(wanted, got):
        assert t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last), (name, t.stride())
        assert not t.is_contiguous(), name


def test_saved_program_keeps_the_layout():
    p = _export(_module())
    back = metaopt.load(onnx_save.to_model_proto(p))
    assert _marked(back) == ["conv1", "conv2"]


def test_a_bad_memory_format_is_named():
    conv = registry.get("Conv").kernel
    with pytest.raises(ValueError, match="memory_format='nhwc'"):
        conv(torch.randn(1, 2, 4, 4), torch.randn(3, 2, 1, 1), memory_format="nhwc")


def test_grad_sum_keeps_a_channels_last_grad_channels_last():
    grad_sum = registry.get("GradSum").kernel
    a = torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)
    b = torch.randn(2, 3, 4, 5)
    out = grad_sum(a, b)
    assert out.is_contiguous(memory_format=torch.channels_last) and torch.equal(out, a + b)
    assert grad_sum(b, a).is_contiguous()  # the first part's layout decides


def test_export_and_load_can_leave_the_layout_alone():
    p = metaopt.export(_module(), _inputs(), dynamic_batch=False, channels_last=False)
    assert _marked(p) == [] and "memory_format" not in str(p)
    assert _marked(metaopt.load(onnx_save.to_model_proto(p), channels_last=False)) == []
    assert _marked(metaopt.load(onnx_save.to_model_proto(p))) == ["conv1", "conv2"]
