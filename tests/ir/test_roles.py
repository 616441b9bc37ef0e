"""The role table (metaopt.ir.roles): one place says what each op role means."""

from __future__ import annotations

import pytest

from metaopt.ir import Op, roles
from metaopt.ir.program import PHASE_OF_ROLE, ROLES


def test_table_names_every_role_once_and_the_old_names_are_views():
    assert ROLES == roles.ROLES == tuple(r.name for r in roles.ROLE_TABLE)
    assert len(set(ROLES)) == len(ROLES)
    assert PHASE_OF_ROLE is roles.PHASE_OF_ROLE
    # what the pipeline cuts by: every role but comm has a phase
    assert PHASE_OF_ROLE == {
        "forward": "forward",
        "loss": "forward",
        "offload": "forward",
        "partition": "forward",
        "backward": "backward",
        "recompute": "backward",
        "prefetch": "backward",
        "backward-update": "backward",
        "optimize": "optimize",
        "lr-sched": "optimize",
    }
    for r in ROLES:
        Op("Relu", ["x"], ["y"], role=r)  # every role of the table is a valid op role


@pytest.mark.parametrize(
    ("role", "phase", "forward", "backward", "update", "after", "copy", "rank"),
    [
        ("forward", "forward", True, False, False, False, False, 0),
        ("loss", "forward", True, False, False, False, False, 0),
        ("offload", "forward", False, False, False, False, True, None),
        # recompute partition's slice: made in the forward, right after its checkpoint, unordered
        ("partition", "forward", False, False, False, False, False, None),
        ("backward", "backward", False, True, False, True, False, 1),
        ("recompute", "backward", False, False, False, True, False, 1),
        ("prefetch", "backward", False, False, False, True, True, 1),
        ("backward-update", "backward", False, False, False, True, False, 1),
        ("optimize", "optimize", False, False, True, True, False, 2),
        ("lr-sched", "optimize", False, False, True, True, False, None),
        ("comm", None, False, False, False, False, False, None),
    ],
)
def test_helpers(role, phase, forward, backward, update, after, copy, rank):
    assert roles.phase(role) == phase
    assert roles.is_forward(role) is forward
    assert roles.is_backward(role) is backward
    assert roles.is_update(role) is update
    assert roles.after_forward(role) is after
    assert roles.is_host_copy(role) is copy
    assert roles.phase_rank(role) == rank
    assert roles.role(role).name == role


def test_unknown_role():
    assert roles.phase("nope") is None and roles.phase_rank("nope") is None
    assert not (roles.is_forward("nope") or roles.is_update("nope") or roles.is_host_copy("nope"))
    with pytest.raises(KeyError):
        roles.role("nope")
