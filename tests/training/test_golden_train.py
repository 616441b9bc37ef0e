"""Golden text of training programs: backward + Adam on the tiny mlp and bert programs.

Regenerate only on purpose: pytest --update-golden, with the reason in the commit.
"""

from __future__ import annotations

import pytest
from conftest import exported

import metaopt
from metaopt.ir import parse_program


@pytest.mark.parametrize("name", ["mlp", "bert"])
def test_backward_adam_golden(name, golden):
    _, _, program = exported(name, dropout=0.1)
    main = program.clone()
    metaopt.optimizer.Adam(learning_rate=1e-3).minimize(main.loss)
    metaopt.verify(main)
    text = str(main)
    golden(f"train/{name}_adam", text)
    assert str(parse_program(text)) == text


def test_plain_fleet_minimize_matches_the_inner_optimizer():
    """fleet.distributed_optimizer with nothing enabled = the inner optimizer's rewrite."""
    from metaopt import fleet

    fleet.init(is_collective=True)
    _, _, program = exported("mlp", dropout=0.1)
    a, b = program.clone(), program.clone()
    strategy = fleet.DistributedStrategy()
    opt = fleet.distributed_optimizer(metaopt.optimizer.Adam(learning_rate=1e-3), strategy)
    ops, pg = opt.minimize(a.loss)
    metaopt.optimizer.Adam(learning_rate=1e-3).minimize(b.loss)
    assert str(a) == str(b)
    assert opt.applied_meta_list == []
    assert len(pg) == 6 and ops


def test_training_program_survives_onnx_save_and_load(tmp_path):
    from metaopt.frontend import onnx_save

    _, _, program = exported("bert", dropout=0.1)
    main = program.clone()
    metaopt.optimizer.Adam(
        learning_rate=1e-3, grad_clip=metaopt.optimizer.ClipGradByGlobalNorm(1.0)
    ).minimize(main.loss)
    onnx_save.save(main, tmp_path / "train.onnx")
    back = metaopt.load(tmp_path / "train.onnx")

    def fields(p):  # everything but the order vars are listed in
        vars_ = {n: (v.dtype, v.shape, v.kind, v.trainable) for n, v in p.vars.items()}
        ops = str(p)[str(p).index("ops:") :]
        return vars_, ops, p.updates, p.modules, p.inputs, p.outputs, p.loss_name

    assert fields(back) == fields(main)
