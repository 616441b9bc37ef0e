"""Hybrid parallel's rank layout: each worker's (data, pipe, sharding, sep, model) coordinate.

Pure functions of the degrees: nothing here needs torch.distributed, so the layout can be
computed, printed and tested in one process. ``fleet.init`` builds the process groups from it
(``layout/groups.py``, called by ``fleet/env.py``); ``minimize`` reads the degrees from it
(``fleet/steps.py``); the pipeline runtime places stages by it. It sits below fleet, passes and
runtime, which all import it; it imports none of them (the strategy's degrees are read in
``fleet/topology.py``).

The layout is Paddle's ``CommunicateTopology`` with ``hybrid_group_names`` ["data", "pipe",
"sharding", "sep", "model"] (Fleet's order, outermost first; Megatron orders tensor, pipeline and
data parallel ranks the same way): ranks enumerate the coordinates in row-major order, so the
model axis is innermost and model-parallel peers get adjacent ranks, which a launcher places on
one node, where their per-layer collectives are cheapest; the data axis is outermost::

    rank = (((data * pp_degree + pipe) * sharding_degree + sharding) * sep_degree + sep) * mp_degree
           + model

dp_degree=2, pp_degree=2, mp_degree=2 on 8 workers::

    rank      0  1  2  3  4  5  6  7
    data      0  0  0  0  1  1  1  1
    pipe      0  0  1  1  0  0  1  1
    model     0  1  0  1  0  1  0  1
    model groups [0, 1] [2, 3] [4, 5] [6, 7]; pipe groups [0, 2] [1, 3] [4, 6] [5, 7];
    data groups [0, 4] [1, 5] [2, 6] [3, 7]

With mp_degree = sharding_degree = 1 this is ``rank = replica * num_stages + stage``, the placement
of a pipeline laid out by pipeline_configs alone. The pipeline runtime (``runtime/pipeline.py``)
places stages and replicas by this topology whatever the degrees: stage s's neighbours are the
ranks of its pipe group (same data and model coordinate), its replicas those of its data group.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from metaopt.ir import did_you_mean

AXES: tuple[str, ...] = ("data", "pipe", "sharding", "sep", "model")  # outermost first
# Expert parallel's groups overlap the data-side axes rather than adding one (Paddle's
# ``ep_degree``): among the ranks sharing a pipe and model coordinate, in rank order, each run of
# `ep_degree` consecutive ranks is an "expert" group (they hold different experts of every MoE
# layer), and the ranks at the same place of each run are an "expert_replica" group (Paddle's
# moe_sharding: they hold the same experts). dp=4, ep=2: expert groups [0, 1] [2, 3], replica
# groups [0, 2] [1, 3].
EXPERT_AXES: tuple[str, ...] = ("expert", "expert_replica")
# Paddle's hybrid_configs["order"] names -> our axes ("cp": context parallel lays its groups on the
# sequence axis, where "sep" sits: its own place changes no rank)
ORDER_NAMES: dict[str, str | None] = {
    "dp": "data",
    "pp": "pipe",
    "sharding": "sharding",
    "sep": "sep",
    "cp": None,
    "mp": "model",
}
# Order names a user's order may leave out (Paddle 2.x's had no "sep"): placed as Paddle's default
# order places them, right before "mp"
OPTIONAL_ORDER_NAMES = ("sep",)
OPTIONAL_AXES = ("sep",)  # the same, as `Topology.order` names it
# Paddle 3's expert axes: metaopt lays the expert groups over runs of consecutive data-side ranks
# (EXPERT_AXES), not by their place in the order
EXPERT_ORDER_NAMES = ("ep", "moe_sharding")
PADDLE_ORDER: tuple[str, ...] = ("dp", "pp", "sharding", "sep", "mp")  # Paddle's default, outermost first
# Paddle's hybrid degrees of axes metaopt does not lay out (yet): refused above 1 by name
NOT_BUILT_AXES: dict[str, str] = {}
DEGREE_KEYS: dict[str, str] = {  # axis -> its strategy.hybrid_configs key
    "data": "dp_degree",
    "pipe": "pp_degree",
    "sharding": "sharding_degree",
    "sep": "sep_degree",
    "model": "mp_degree",
}


class Coordinate(NamedTuple):
    """A rank's place on every axis (Paddle's ``Coordinate`` namedtuple, same field names)."""

    data: int
    pipe: int
    sharding: int
    sep: int
    model: int


class ParallelMode:
    """Fleet's ``ParallelMode`` values (``HybridCommunicateGroup.get_parallel_mode()``)."""

    DATA_PARALLEL = 0
    TENSOR_PARALLEL = 1
    PIPELINE_PARALLEL = 2
    SHARDING_PARALLEL = 3


@dataclass(frozen=True)
class Topology:
    """The degrees of a job; every method is a pure function of them (Paddle's names)."""

    dp_degree: int = 1
    pp_degree: int = 1
    sharding_degree: int = 1
    mp_degree: int = 1
    ep_degree: int = 1  # experts split over runs of this many data-side ranks (EXPERT_AXES)
    # the axes outermost first (Paddle's hybrid_configs["order"], read by `axes_order`): the rank
    # enumerates the coordinates in this order, the last axis varying fastest
    order: tuple[str, ...] = AXES
    # segment parallel (Paddle's sep_degree): each rank of a sep group holds 1/sep_degree of every
    # sequence (passes/segment_parallel.py); after `order` so the fields above keep their places
    sep_degree: int = 1
    # context parallel (cp_degree) lays its groups on the same sequence axis: `sep_degree` is then
    # the cp degree, and the axis runs ring attention (passes/context_parallel.py), not the exchange
    ring: bool = False

    @property
    def cp_degree(self) -> int:
        return self.sep_degree if self.ring else 1

    @property
    def exchange_degree(self) -> int:
        """Segment parallel's degree (the sequence axis's, unless it runs context parallel)."""
        return 1 if self.ring else self.sep_degree

    def __post_init__(self) -> None:
        for name in OPTIONAL_AXES:  # an order written before the axis existed: Paddle's default place
            if name not in self.order and "model" in self.order:
                order = list(self.order)
                order.insert(order.index("model"), name)
                object.__setattr__(self, "order", tuple(order))
        if sorted(self.order) != sorted(AXES):
            raise ValueError(f"Topology: order must hold each of {list(AXES)} once, got {list(self.order)}")
        # Axes of degree 1 change no rank wherever they sit: an order placing the others as the
        # default does is the default (so equal layouts compare equal)
        placed = [a for a in self.order if self.get_dim(a) > 1]
        if placed == [a for a in AXES if self.get_dim(a) > 1]:
            object.__setattr__(self, "order", AXES)
        for axis in AXES:
            d = self.get_dim(axis)
            if isinstance(d, bool) or not isinstance(d, int) or d < 1:
                raise ValueError(f"Topology: {DEGREE_KEYS[axis]} must be an int >= 1, got {d!r}")
        ep, data_side = self.ep_degree, self.dp_degree * self.sharding_degree
        if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
            raise ValueError(f"Topology: ep_degree must be an int >= 1, got {ep!r}")
        if data_side % ep:
            raise ValueError(
                f"Topology: ep_degree={ep} must divide dp_degree x sharding_degree = {data_side} (expert "
                "parallel splits the experts over data-side ranks, which hold different batches)"
            )

    def group_axes(self) -> tuple[str, ...]:
        """The axes whose process groups fleet.init makes, in `AXES` order: every one but "sep" at
        degree 1 (only a segment-parallel program names the sep group; not making a group of one
        per rank spares every other job the new_group calls)."""
        return tuple(a for a in AXES if a != "sep" or self.sep_degree > 1)

    def expert_axes(self) -> tuple[str, ...]:
        """The expert groups' axes when experts are split (ep_degree > 1), else none."""
        return EXPERT_AXES if self.ep_degree > 1 else ()

    def _expert_groups(self, axis: str) -> list[list[int]]:
        groups: list[list[int]] = []
        ep = self.ep_degree
        places: dict[tuple[int, int, int], list[int]] = {}  # (pipe, sep, model) -> its data-side ranks
        for r in range(self.world_size()):
            c = self.get_coord(r)
            places.setdefault((c.pipe, c.sep, c.model), []).append(r)
        for _, ranks in sorted(places.items()):
            runs = [ranks[i : i + ep] for i in range(0, len(ranks), ep)]
            groups += runs if axis == "expert" else [list(g) for g in zip(*runs, strict=True)]
        return groups

    # --- sizes ---------------------------------------------------------------------------
    @property
    def dims(self) -> tuple[int, ...]:
        """The degrees in `AXES` order."""
        return tuple(self.get_dim(axis) for axis in AXES)

    def get_hybrid_group_names(self) -> list[str]:
        return list(AXES)

    def get_dim(self, axis_name: str) -> int:
        """The degree of `axis_name` ("data", "pipe", "sharding" or "model")."""
        return getattr(self, DEGREE_KEYS[_axis(axis_name)])

    get_dim_size = get_dim  # Paddle has both names

    def world_size(self) -> int:
        return self.dp_degree * self.pp_degree * self.sharding_degree * self.sep_degree * self.mp_degree

    # --- ranks and coordinates ---------------------------------------------------------------
    def get_coord(self, rank: int) -> Coordinate:
        """`rank`'s coordinate: the last axis of `order` (the model axis, by default) varies fastest."""
        _check_rank(rank, self.world_size())
        coord = {}
        for axis in reversed(self.order):
            rank, coord[axis] = divmod(rank, self.get_dim(axis))
        return Coordinate(**coord)

    def get_rank(self, **coord: int) -> int:
        """The rank at a full coordinate, e.g. ``get_rank(data=1, pipe=0, sharding=0, model=1)``."""
        unknown = [k for k in coord if k not in AXES]
        if unknown:
            raise ValueError(
                f"Topology.get_rank: unknown axis {unknown[0]!r}{did_you_mean(unknown[0], AXES)}"
            )
        # an axis of degree 1 has one coordinate, 0: a coordinate may leave it out (the sep axis of
        # a job without segment parallel, as every caller written before it had)
        coord = {**{a: 0 for a in AXES if self.get_dim(a) == 1}, **coord}
        missing = [a for a in AXES if a not in coord]
        if missing:
            raise ValueError(
                f"Topology.get_rank: the coordinate needs every axis of degree > 1 of {list(AXES)}; "
                f"missing {missing}"
            )
        rank = 0
        for axis in self.order:
            c, d = coord[axis], self.get_dim(axis)
            if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < d:
                raise ValueError(
                    f"Topology.get_rank: {axis}={c!r} is outside 0..{d - 1} ({DEGREE_KEYS[axis]}={d})"
                )
            rank = rank * d + c
        return rank

    def get_rank_from_stage(self, global_rank: int, **kwargs: int) -> int:
        """The rank with `global_rank`'s coordinate but for the axes given (e.g. ``pipe=3``)."""
        coord = self.get_coord(global_rank)._asdict()
        unknown = [k for k in kwargs if k not in AXES]
        if unknown:
            raise ValueError(
                f"Topology.get_rank_from_stage: unknown axis {unknown[0]!r}{did_you_mean(unknown[0], AXES)}"
            )
        return self.get_rank(**{**coord, **kwargs})

    def get_axis_list(self, axis_name: str, index: int) -> list[int]:
        """Every rank whose coordinate on `axis_name` is `index`, ascending."""
        axis = _axis(axis_name)
        return [r for r in range(self.world_size()) if getattr(self.get_coord(r), axis) == index]

    def get_comm_list(self, axis_name: str) -> list[list[int]]:
        """The groups of `axis_name`: for each coordinate of the other axes (row-major), the
        ranks along `axis_name`. Every rank is in exactly one group of each axis (the
        `EXPERT_AXES` too)."""
        if axis_name in EXPERT_AXES:
            return self._expert_groups(axis_name)
        axis = _axis(axis_name)
        groups: dict[tuple[int, ...], list[int]] = {}
        for r in range(self.world_size()):
            c = self.get_coord(r)
            groups.setdefault(tuple(v for a, v in zip(AXES, c, strict=True) if a != axis), []).append(r)
        return list(groups.values())  # in rank order of their first member

    def group_ranks(self, axis_name: str, rank: int) -> list[int]:
        """The ranks of `rank`'s group on `axis_name` (itself included)."""
        if axis_name in EXPERT_AXES:
            _check_rank(rank, self.world_size())
            return next(g for g in self._expert_groups(axis_name) if rank in g)
        coord = self.get_coord(rank)._asdict()
        axis = _axis(axis_name)
        return [self.get_rank(**{**coord, axis: i}) for i in range(self.get_dim(axis))]

    # --- text ---------------------------------------------------------------------------------
    def describe(self) -> str:
        """'dp_degree=2, mp_degree=1, pp_degree=2' (and sharding_degree when it is not 1)."""
        parts = [f"dp_degree={self.dp_degree}", f"mp_degree={self.mp_degree}", f"pp_degree={self.pp_degree}"]
        if self.sharding_degree != 1:
            parts.append(f"sharding_degree={self.sharding_degree}")
        if self.sep_degree != 1:
            parts.append(f"{'cp' if self.ring else 'sep'}_degree={self.sep_degree}")
        if self.ep_degree != 1:
            parts.append(f"ep_degree={self.ep_degree}")
        if self.order != AXES:
            names = {a: n for n, a in ORDER_NAMES.items() if a is not None}
            shown = [a for a in self.order if a not in OPTIONAL_AXES or self.get_dim(a) > 1]
            parts.append(f"order={[names[a] for a in shown]}")
        return ", ".join(parts)

    def table(self) -> str:
        """Each rank's coordinate, one row per axis of degree > 1 (all axes if none)."""
        world = self.world_size()
        axes = [a for a in AXES if self.get_dim(a) > 1] or list(AXES)
        width = max(len(str(world - 1)), 1) + 1
        rows = ["rank    " + "".join(f"{r:>{width}}" for r in range(world))]
        for a in axes:
            cells = (getattr(self.get_coord(r), a) for r in range(world))
            rows.append(f"{a:<8}" + "".join(f"{c:>{width}}" for c in cells))
        return "\n".join(rows)


def axes_order(names: Any, where: str = "hybrid_configs['order']") -> tuple[str, ...]:
    """Our axes, outermost first, from Paddle's order names (``["dp", "pp", "sharding", "sep",
    "mp"]``): each of dp, pp, sharding and mp once; "sep" at most once (left out: right before
    "mp", as Paddle's default order places it) and "cp" (degree 1: context parallel is not built)
    at most once, anywhere. A ValueError names what is wrong; Paddle 3's "ep" and "moe_sharding"
    are a NotImplementedError (`EXPERT_ORDER_NAMES`)."""
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{where} must be a list of axis names, got {names!r}")
    names = list(names)
    placed = [n for n in names if n in EXPERT_ORDER_NAMES]
    if placed:
        raise NotImplementedError(
            f"{where}: placing {placed} by the order is not built: metaopt lays the expert groups over "
            "runs of ep_degree consecutive data-side ranks (the ranks sharing a pipe and model place); "
            f"leave {placed} out of the order"
        )
    for n in names:
        if n not in ORDER_NAMES:
            raise ValueError(
                f"{where}: unknown axis {n!r}{did_you_mean(n, list(ORDER_NAMES))}; Paddle's names: "
                f"{list(ORDER_NAMES)}"
            )
    twice = sorted({n for n in names if names.count(n) > 1})
    missing = [
        n for n, a in ORDER_NAMES.items() if a is not None and n not in [*names, *OPTIONAL_ORDER_NAMES]
    ]
    if twice or missing:
        what = f"{twice} more than once" if twice else f"no {missing}"
        raise ValueError(
            f"{where}={names} names {what}: list each of dp, pp, sharding, mp once, outermost first"
        )
    for n in OPTIONAL_ORDER_NAMES:
        if n not in names:
            names.insert(names.index("mp"), n)
    return tuple(ORDER_NAMES[n] for n in names if ORDER_NAMES[n] is not None)


def _axis(name: str) -> str:
    if name not in AXES:
        raise ValueError(
            f"unknown hybrid parallel axis {name!r}{did_you_mean(str(name), AXES)}; axes: {list(AXES)}"
        )
    return name


def _check_rank(rank: int, world: int) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"rank {rank!r} is outside 0..{world - 1} (the topology has {world} ranks)")


class HybridCommunicateGroup:
    """Fleet's ``fleet.get_hybrid_communicate_group()``: this rank's coordinate, the degrees and
    the process group of each axis it belongs to.

    `groups` maps each axis to this rank's ``torch.distributed`` process group on it (made by
    ``fleet.init``, see ``env.py``); with one worker there is no process group and every
    ``get_*_group()`` returns None. The ranks of a group: ``group_ranks(axis)``.
    """

    def __init__(self, topology: Topology, global_rank: int, groups: Mapping[str, Any] | None = None) -> None:
        _check_rank(global_rank, topology.world_size())
        self._topo = topology
        self.global_rank = global_rank
        self.nranks = topology.world_size()
        self._coord = topology.get_coord(global_rank)
        self._groups = dict(groups or {})
        self.stage_id = self._coord.pipe
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == topology.pp_degree - 1

    def topology(self) -> Topology:
        return self._topo

    def get_global_rank(self) -> int:
        return self.global_rank

    def get_parallel_mode(self) -> int:
        """A `ParallelMode` value, by Fleet's rule: pipeline if pp_degree > 1, else tensor
        parallel if mp_degree > 1, sharding if it alone is > 1, else data parallel."""
        t = self._topo
        if t.pp_degree > 1:
            return ParallelMode.PIPELINE_PARALLEL
        if t.mp_degree > 1:
            return ParallelMode.TENSOR_PARALLEL
        if t.sharding_degree > 1 and t.dp_degree == 1:
            return ParallelMode.SHARDING_PARALLEL
        return ParallelMode.DATA_PARALLEL

    def group_ranks(self, axis_name: str) -> list[int]:
        """The ranks of this rank's group on `axis_name` ("data", "pipe", "sharding", "model")."""
        return self._topo.group_ranks(axis_name, self.global_rank)

    def _group(self, axis: str) -> Any:
        return self._groups.get(axis)

    # data parallel
    def get_data_parallel_rank(self) -> int:
        return self._coord.data

    def get_data_parallel_world_size(self) -> int:
        return self._topo.dp_degree

    def get_data_parallel_group(self) -> Any:
        return self._group("data")

    def get_data_parallel_group_src_rank(self) -> int:
        return self.group_ranks("data")[0]

    # model (tensor) parallel
    def get_model_parallel_rank(self) -> int:
        return self._coord.model

    def get_model_parallel_world_size(self) -> int:
        return self._topo.mp_degree

    def get_model_parallel_group(self) -> Any:
        return self._group("model")

    def get_model_parallel_group_src_rank(self) -> int:
        return self.group_ranks("model")[0]

    # pipeline parallel
    def get_stage_id(self) -> int:
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        return self._topo.pp_degree

    def get_pipe_parallel_group(self) -> Any:
        return self._group("pipe")

    def get_rank_from_stage(self, stage_id: int, **kwargs: int) -> int:
        """The rank running pipeline stage `stage_id` with this rank's other coordinates."""
        return self._topo.get_rank_from_stage(self.global_rank, pipe=stage_id, **kwargs)

    # segment parallel (Paddle's names)
    def get_sep_parallel_rank(self) -> int:
        return self._coord.sep

    def get_sep_parallel_world_size(self) -> int:
        return self._topo.sep_degree

    def get_sep_parallel_group(self) -> Any:
        return self._group("sep")

    # sharding
    def get_sharding_parallel_rank(self) -> int:
        return self._coord.sharding

    def get_sharding_parallel_world_size(self) -> int:
        return self._topo.sharding_degree

    def get_sharding_parallel_group(self) -> Any:
        return self._group("sharding")

    def get_sharding_parallel_group_src_rank(self) -> int:
        return self.group_ranks("sharding")[0]

    # expert parallel (Paddle's names)
    def get_expert_parallel_world_size(self) -> int:
        return self._topo.ep_degree

    def get_expert_parallel_rank(self) -> int:
        return self.group_ranks("expert").index(self.global_rank)

    def get_expert_parallel_group(self) -> Any:
        return self._group("expert")

    def get_moe_sharding_parallel_world_size(self) -> int:
        return (self._topo.dp_degree * self._topo.sharding_degree) // self._topo.ep_degree

    def get_moe_sharding_parallel_group(self) -> Any:
        return self._group("expert_replica")

    def __repr__(self) -> str:
        groups = ", ".join(f"{a} group {self.group_ranks(a)}" for a in (*AXES, *self._topo.expert_axes()))
        return f"HybridCommunicateGroup(rank {self.global_rank}: {self._topo.describe()}; {groups})"
