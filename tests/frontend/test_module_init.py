"""Seeded init from a module's own initializers (metaopt.frontend.module_init, fleet.init_from_module)
in one process. Bitwise everywhere: the same initializers, the same generator seeds, the same
kernels; nothing is rounded otherwise. The layouts (ZeRO-3 on 4 workers, tensor parallel beside
sharding, a pipeline): tests/training/test_sharding_workers.py and
tests/fleet/test_fleet_tensor_parallel.py."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import metaopt
from metaopt import fleet
from metaopt.fleet import env
from metaopt.fleet.pretrained import PretrainedError
from metaopt.frontend.module_init import ModuleInitError, module_seed, module_values

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "training"))
from training_cases import _module, batch  # noqa: E402

pytestmark = pytest.mark.usefixtures("clean_env")  # tests/conftest.py
SEED = 3


def _eager_reference(module: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """What the per-module seeds give when a CPU build of the module runs its Hugging Face init
    (`_init_weights(module)`) module by module in named_modules order, each module above it after
    it: written out here directly on the eager module, without shells, meta tensors or slicing."""
    hf = module.m
    modules = dict(module.named_modules())
    seen: set[int] = set()
    with torch.no_grad():
        for path, sub in module.named_modules():
            own = [t for t in sub._parameters.values() if t is not None and id(t) not in seen]
            if not own:
                continue
            seen.update(id(t) for t in own)
            torch.manual_seed(module_seed(seed, path))
            hf._init_weights(sub)
            parts = path.split(".")
            for i in range(len(parts) - 1, -1, -1):
                above = ".".join(parts[:i])
                torch.manual_seed(module_seed(seed, f"{above}|{path}"))
                if above.startswith("m"):  # the loss wrapper ("") has no init of its own
                    hf._init_weights(modules[above])
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def _filled(name: str, **kwargs) -> tuple[metaopt.Program, metaopt.Executor, list[str], nn.Module]:
    env.reset()
    fleet.init()
    module, inputs, export_kwargs = _module(name, meta=True)
    main = metaopt.export(module, inputs, **export_kwargs)
    fleet.distributed_optimizer(
        metaopt.optimizer.SGD(learning_rate=0.05), fleet.DistributedStrategy()
    ).minimize(main.loss)
    exe = metaopt.Executor("cpu")
    return main, exe, fleet.init_from_module(exe, main, module, seed=SEED, **kwargs), module


@pytest.mark.parametrize("name", ["hf-llama", "hf-gpt2"])
def test_a_meta_program_gets_hugging_face_init_per_module_and_trains(name):
    """Every param of the meta program is made by the model's own `_init_weights`, GPT-2's
    residual projections rescaled by their parent (GPT2Attention/GPT2MLP) as in an eager build."""
    main, exe, filled, module = _filled(name)
    assert set(filled) == {
        v.name for v in main.vars.values() if v.kind in ("param", "buffer") and main.is_meta(v.name)
    }
    assert all(p.is_meta for p in module.parameters())  # the caller's module is not changed
    want = _eager_reference(_module(name)[0], SEED)
    differ = [n for n in filled if not torch.equal(exe.scope[n], want[n].detach())]
    assert not differ, differ
    std = module.m.config.initializer_range
    if name == "hf-gpt2":
        c_proj = exe.scope["m.transformer.h.0.attn.c_proj.weight"]
        scale = 1 / math.sqrt(2 * module.m.config.n_layer)
        assert abs(c_proj.std().item() / (std * scale) - 1) < 0.1  # ~4k samples of N(0, std*scale)
    losses = [float(exe.run(main, feed=batch(name, s), fetch_list=[main.loss])[0]) for s in range(2)]
    assert all(math.isfinite(x) for x in losses) and losses[1] < losses[0] + 0.5


def test_the_values_do_not_depend_on_which_submodules_a_process_makes():
    """A pipeline stage makes only its own submodules: each value equals the whole walk's."""
    module = _module("hf-llama", meta=True)[0]
    whole = {m.names[0]: m.value for m in module_values(module, seed=SEED)}
    some = {m.names[0]: m.value for m in module_values(module, seed=SEED, wanted=lambda n: ".layers.1." in n)}
    assert some and all(".layers.1." in n for n in some)
    assert all(torch.equal(t, whole[n]) for n, t in some.items())
    other_seed = {
        m.names[0]: m.value for m in module_values(module, seed=SEED + 1, wanted=lambda n: ".layers.1." in n)
    }
    assert not any(torch.equal(t, other_seed[n]) for n, t in some.items() if t.std() > 0)


class _Net(nn.Module):
    """torch's own layers (reset_parameters, BatchNorm's running stats) and one raw parameter."""

    def __init__(self, scale_init: bool = True) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.bn = nn.BatchNorm1d(6)
        self.attn = nn.MultiheadAttention(6, 2, batch_first=True)
        self.scale = nn.Parameter(torch.empty(6))
        if scale_init:
            self.init_weights()

    def init_weights(self) -> None:  # torchtitan's convention: the root's own
        nn.init.constant_(self.scale, 0.5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.fc(x)) * self.scale
        a, _ = self.attn(h[:, None], h[:, None], h[:, None])
        return ((a[:, 0] - y) ** 2).mean()


def test_torch_layers_get_reset_parameters_and_the_root_its_init_weights():
    with torch.device("meta"):
        net = _Net()
    got = {m.names[0]: m.value for m in module_values(net, seed=SEED)}
    assert torch.equal(got["scale"], torch.full((6,), 0.5))
    assert torch.equal(got["bn.running_mean"], torch.zeros(6)) and torch.equal(
        got["bn.running_var"], torch.ones(6)
    )
    assert torch.equal(got["bn.num_batches_tracked"], torch.tensor(0))
    ref = nn.Linear(4, 6)
    torch.manual_seed(module_seed(SEED, "fc"))
    ref.reset_parameters()
    assert torch.equal(got["fc.weight"], ref.weight.detach()) and torch.equal(
        got["fc.bias"], ref.bias.detach()
    )
    # MultiheadAttention's _reset_parameters sets its child out_proj's bias to zero, after the
    # child's own reset_parameters (as its __init__ does)
    assert torch.equal(got["attn.out_proj.bias"], torch.zeros(6)) and got["attn.in_proj_weight"].std() > 0


def test_a_parameter_no_initializer_sets_is_named_and_init_fills_it():
    class Bare(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)
            self.gate = nn.Parameter(torch.empty(3))

    with torch.device("meta"):
        bare = Bare()
    with pytest.raises(
        ModuleInitError, match=r"'gate' of submodule '<root>' \(Bare\) is not set by any initializer"
    ):
        list(module_values(bare, seed=0))

    def gate_ones(m: nn.Module) -> None:
        if isinstance(m, Bare):
            nn.init.ones_(m.gate)

    got = {m.names[0]: m.value for m in module_values(bare, seed=0, init=gate_ones)}
    assert torch.equal(got["gate"], torch.ones(3)) and got["fc.weight"].std() > 0


def test_a_module_other_than_the_programs_is_refused_naming_the_param():
    main, exe, _, _ = _filled("hf-gpt2")
    with torch.device("meta"):
        other = _Net()
    with pytest.raises(
        PretrainedError, match=r"param 'm\.transformer\..*' of program .* is not in the module"
    ):
        fleet.init_from_module(exe, main, other, seed=0)
    module = _module("hf-gpt2", meta=True)[0]
    with pytest.raises(PretrainedError, match=r"not in the module \(prefix 'x\.'\)"):
        fleet.init_from_module(exe, main, module, seed=0, prefix="x.")


def _amp_offload_strategy() -> fleet.DistributedStrategy:
    s = fleet.DistributedStrategy()
    s.amp = True
    s.amp_configs = {"dtype": "bfloat16", "use_pure_fp16": True, "use_fp16_guard": False}
    s.recompute = True
    s.recompute_configs = {"checkpoints": ["transformer.h.*"], "enable_offload": True}
    return s


def _trained(main: metaopt.Program, exe: metaopt.Executor) -> tuple[list[float], dict]:
    losses = [float(exe.run(main, feed=batch("gpt", s), fetch_list=[main.loss])[0]) for s in range(2)]
    return losses, {
        v.name: exe.scope[v.name].clone()
        for v in main.vars.values()
        if v.kind in ("param", "buffer", "opt_state") and v.shape
    }


def test_a_meta_program_under_pure_bf16_with_offload_trains_as_one_exported_with_the_values():
    """Issue 43: AMP O2 (bfloat16 params, float32 master weights made from the same values) and
    recompute with offload on a program exported on meta and filled by init_from_module: bit for
    bit the run of the same module exported with those values (the same program, the same bits)."""
    env.reset()
    fleet.init()
    module, inputs, kwargs = _module("gpt", meta=True)
    meta = metaopt.export(module, inputs, **kwargs)
    fleet.distributed_optimizer(metaopt.optimizer.Adam(learning_rate=1e-3), _amp_offload_strategy()).minimize(
        meta.loss
    )
    exe = metaopt.Executor("cpu")
    filled = fleet.init_from_module(exe, meta, module, seed=SEED)
    assert any(n.endswith("@MASTER") for n in filled)  # the master copies filled beside the params
    got = _trained(meta, exe)

    values = {m.names[0]: m.value for m in module_values(module, seed=SEED)}
    valued, inputs, kwargs = _module("gpt")
    assert valued.load_state_dict(values, strict=False).missing_keys == ["lm_head.weight"]  # tied to wte
    ref = metaopt.export(valued, inputs, **kwargs)
    fleet.distributed_optimizer(metaopt.optimizer.Adam(learning_rate=1e-3), _amp_offload_strategy()).minimize(
        ref.loss
    )
    want = _trained(ref, metaopt.Executor("cpu"))
    assert got[0] == want[0]
    assert got[1].keys() == want[1].keys()
    assert not [k for k, t in want[1].items() if not torch.equal(got[1][k], t)]
