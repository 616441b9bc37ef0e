"""Op roles: the one table of what each role means (Fleet's op roles, plus ours).

Every op has a role (`Op.role`). A role's row says

* ``phase``: when its ops run in a (pipelined) training step: ``forward`` (once per
  micro-batch, before its backward), ``backward`` (once per micro-batch), ``optimize`` (once
  per step, after every micro-batch), or None (``comm``: data parallel's all-reduces, which a
  pipeline places itself; ``startup``: see below);
* ``model``: the op computes the training step itself (the model's forward and loss, its
  backward, the optimizer and its learning rate), as opposed to ops a memory or communication
  pass adds around it (recomputed copies, host copies, collectives);
* ``host_copy``: a copy to host memory or back (``offload``, ``prefetch``: the offload pass);
* ``startup``: the op runs once, on an executor's first run of the program, before anything
  else (data parallel's broadcast of rank 0's initial values, as Paddle's startup program
  does); the executor leaves it out of every later run. Startup ops come first in the program,
  read only persistables and write them in place (they have no outputs);
* ``ordered``: `verify` keeps it in its phase's place in program order (once an op of a later
  phase ran, none of an earlier phase may follow). Roles that are not ordered may appear
  anywhere: ``lr-sched`` ops read only the step counter, ``offload`` copies follow the op that
  made their checkpoint, ``comm`` has no phase.

Passes and the runtime ask these helpers instead of keeping their own role sets.
"""

from __future__ import annotations

from dataclasses import dataclass

FORWARD, BACKWARD, OPTIMIZE = "forward", "backward", "optimize"
PHASES = (FORWARD, BACKWARD, OPTIMIZE)  # in the order they run


@dataclass(frozen=True)
class Role:
    name: str
    phase: str | None
    model: bool = False
    ordered: bool = True
    host_copy: bool = False  # a copy to host memory or back (offload), or its wait
    startup: bool = False  # runs once, on the program's first run (module doc)
    doc: str = ""


ROLE_TABLE: tuple[Role, ...] = (
    Role("forward", FORWARD, model=True, doc="the model's forward"),
    Role("loss", FORWARD, model=True, doc="the op computing the loss (a forward op)"),
    Role("backward", BACKWARD, model=True, doc="gradient ops (append_backward)"),
    Role("optimize", OPTIMIZE, model=True, doc="param updates, grad clipping, loss-scale checks"),
    Role("lr-sched", OPTIMIZE, model=True, ordered=False, doc="step counter, learning-rate schedule"),
    Role(
        "backward-update",
        BACKWARD,
        model=True,
        doc="an optimizer op moved into the backward, after its grad's last use (optimizer_in_backward)",
    ),
    Role("recompute", BACKWARD, doc="forward ops re-run before their grads (recompute)"),
    Role("offload", FORWARD, ordered=False, host_copy=True, doc="a checkpoint's copy to host memory"),
    Role("prefetch", BACKWARD, host_copy=True, doc="an offloaded checkpoint's copy back, its wait"),
    Role(
        "partition",
        FORWARD,
        ordered=False,
        doc="a replicated checkpoint's 1/mp slice kept after the forward (recompute partition)",
    ),
    Role("comm", None, ordered=False, doc="data parallel's collectives"),
    Role("startup", None, ordered=False, startup=True, doc="once, before the first run (initial broadcast)"),
)
ROLES: tuple[str, ...] = tuple(r.name for r in ROLE_TABLE)
_BY_NAME: dict[str, Role] = {r.name: r for r in ROLE_TABLE}
# role -> phase, for the roles that have one (the runtime's pipeline cuts a program by it).
PHASE_OF_ROLE: dict[str, str] = {r.name: r.phase for r in ROLE_TABLE if r.phase is not None}


def role(name: str) -> Role:
    """The row of role `name` (KeyError for an unknown role; `Op` refuses those on creation)."""
    return _BY_NAME[name]


def phase(name: str) -> str | None:
    """FORWARD, BACKWARD or OPTIMIZE: when ops of this role run; None for ``comm``."""
    r = _BY_NAME.get(name)
    return r.phase if r is not None else None


def is_forward(name: str) -> bool:
    """The model's own forward: ``forward`` and ``loss`` (not the offload copies made in it)."""
    r = _BY_NAME.get(name)
    return r is not None and r.model and r.phase == FORWARD


def is_backward(name: str) -> bool:
    """The model's own backward: ``backward`` (not recompute or prefetch ops placed among it,
    nor optimizer ops moved into it)."""
    return name == "backward"


def is_update(name: str) -> bool:
    """Once-per-step optimizer work: ``optimize`` and ``lr-sched``."""
    r = _BY_NAME.get(name)
    return r is not None and r.model and r.phase == OPTIMIZE


def after_forward(name: str) -> bool:
    """Runs in the backward or optimize phase (any role, the passes' included)."""
    return phase(name) in (BACKWARD, OPTIMIZE)


def is_startup(name: str) -> bool:
    """Runs once, on an executor's first run of the program (``startup``)."""
    r = _BY_NAME.get(name)
    return r is not None and r.startup


def is_host_copy(name: str) -> bool:
    """A copy to host memory or back, and its wait: ``offload`` and ``prefetch``."""
    r = _BY_NAME.get(name)
    return r is not None and r.host_copy


def phase_rank(name: str) -> int | None:
    """Position of the role's phase in PHASES for the roles `verify` orders; None: any place."""
    r = _BY_NAME.get(name)
    return PHASES.index(r.phase) if r is not None and r.ordered and r.phase is not None else None
