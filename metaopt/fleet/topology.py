"""The hybrid layout a strategy asks for: `job_topology` reads ``hybrid_configs`` (or a pipeline's
own configs) into a ``metaopt.layout.topology.Topology``. The layout itself, its coordinates and
groups, lives in ``metaopt/layout``; its names are re-exported here for fleet's users."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from metaopt.layout.topology import (
    AXES,
    NOT_BUILT_AXES,
    PADDLE_ORDER,
    Coordinate,
    HybridCommunicateGroup,
    ParallelMode,
    Topology,
    axes_order,
)

__all__ = [
    "AXES",
    "Coordinate",
    "HybridCommunicateGroup",
    "ParallelMode",
    "Topology",
    "from_hybrid_configs",
    "hybrid_is_set",
    "job_topology",
]


# --- from the strategy ------------------------------------------------------------------------


def hybrid_is_set(hybrid_configs: Mapping[str, Any]) -> bool:
    """Whether `hybrid_configs` differ from Fleet's defaults (dp_degree -1, the others 1): only
    then do they lay the workers out (else the pipeline's own configs, or plain data parallel)."""
    from metaopt.fleet.strategy import HYBRID_CONFIGS

    def default(k: str, key: Any) -> bool:
        v = hybrid_configs.get(k, key.default)
        if k == "order":  # Paddle 2.x's default (no "sep") places the axes as 3.x's does
            try:
                return axes_order(v) == AXES
            except (ValueError, NotImplementedError):
                return False
        return v == key.default

    return not all(default(k, key) for k, key in HYBRID_CONFIGS.items())


def from_hybrid_configs(
    hybrid_configs: Mapping[str, Any], world_size: int, where: str = "strategy.hybrid_configs"
) -> Topology:
    """The topology `hybrid_configs` give `world_size` workers; dp_degree=-1 is inferred (the
    workers left over by the other degrees, as Fleet does). A product other than the world size
    is a ValueError naming the degrees and the world size; an axis metaopt does not lay out
    (`NOT_BUILT_AXES`: none at present) above 1 a NotImplementedError naming it. cp_degree lays its
    groups on the sequence axis (`Topology.ring`), so sep_degree and cp_degree are not both above 1."""
    for key, what in NOT_BUILT_AXES.items():
        if hybrid_configs.get(key, 1) != 1:
            raise NotImplementedError(
                f"{where}['{key}']={hybrid_configs[key]}: {what} is not built in metaopt; leave it at 1 "
                "(for long sequences: hybrid_configs['sep_degree'], or "
                "tensor_parallel_configs['sequence_parallel'] beside mp_degree)"
            )
    mp, pp, sh = (hybrid_configs[k] for k in ("mp_degree", "pp_degree", "sharding_degree"))
    dp, ep = hybrid_configs["dp_degree"], hybrid_configs.get("ep_degree", 1)
    sep, cp = hybrid_configs.get("sep_degree", 1), hybrid_configs.get("cp_degree", 1)
    if sep > 1 and cp > 1:
        raise NotImplementedError(
            f"{where}: sep_degree={sep} and cp_degree={cp}: both split every sequence (the exchange and "
            "the ring share the layout's sequence axis); set one of them"
        )
    seq_key, seq = ("cp_degree", cp) if cp > 1 else ("sep_degree", sep)
    others = mp * pp * sh * seq
    shard = (f" x sharding_degree={sh}" if sh != 1 else "") + (f" x {seq_key}={seq}" if seq != 1 else "")
    if dp == -1:
        if world_size % others:
            raise ValueError(
                f"{where}: dp_degree=-1 (inferred) x mp_degree={mp} x pp_degree={pp}{shard}: the world size "
                f"{world_size} (WORLD_SIZE) is not a multiple of {others}, so no dp_degree fits"
            )
        dp = world_size // others
    elif dp * others != world_size:
        raise ValueError(
            f"{where}: dp_degree={dp} x mp_degree={mp} x pp_degree={pp}{shard} = {dp * others} workers, "
            f"but the world size is {world_size} (WORLD_SIZE): the degrees' product must equal it "
            "(each worker holds one coordinate)"
        )
    if (dp * sh) % ep:
        raise ValueError(
            f"{where}: ep_degree={ep} must divide dp_degree={dp} x sharding_degree={sh}: expert parallel "
            "splits each MoE layer's experts over data-side workers (Paddle's ep_degree), which hold "
            "different batches"
        )
    if ep > 1 and mp > 1:
        raise NotImplementedError(
            f"{where}: ep_degree={ep} beside mp_degree={mp} (experts over the model-parallel ranks, or "
            "beside them): not yet; expert parallel runs over dp_degree x sharding_degree"
        )
    moe = hybrid_configs.get("moe_sharding_degree", -1)
    if moe not in (-1, dp * sh // ep):
        raise ValueError(
            f"{where}: moe_sharding_degree={moe}, but each expert's replicas are dp_degree={dp} x "
            f"sharding_degree={sh} / ep_degree={ep} = {dp * sh // ep} workers: leave it at -1 (inferred) "
            "or set it equal"
        )
    order = axes_order(hybrid_configs.get("order", PADDLE_ORDER), f"{where}['order']")
    return Topology(
        dp_degree=dp, pp_degree=pp, sharding_degree=sh, mp_degree=mp, ep_degree=ep, order=order,
        sep_degree=seq, ring=cp > 1,
    )  # fmt: skip


def job_topology(strategy: Any, world_size: int, init: Topology | None = None) -> Topology:
    """The layout ``minimize`` trains `strategy` with on `world_size` workers.

    * ``strategy.hybrid_configs`` set: those degrees; they must equal `init` (the topology
      ``fleet.init`` built from its own strategy's hybrid_configs), if any.
    * else `init`, if ``fleet.init`` built one.
    * else the pipeline's own configs (``pipeline_configs['num_stages']`` and ``['dp_degree']``)
      with ``strategy.pipeline``, or plain data parallel over every worker.

    With hybrid degrees, ``pipeline_configs['dp_degree']`` and ``['num_stages']`` fold into them:
    left at their defaults or equal, else refused naming both; pp_degree > 1 needs
    ``strategy.pipeline`` (the pipe axis is never silently unused). Errors are ValueErrors.
    """
    hybrid = strategy.hybrid_configs
    if hybrid_is_set(hybrid):
        where = "strategy.hybrid_configs"
        topo = from_hybrid_configs(hybrid, world_size, where)
        if init is not None and init != topo:
            raise ValueError(
                f"strategy.hybrid_configs ({topo.describe()}) differ from the layout fleet.init built from "
                f"its strategy's hybrid_configs ({init.describe()}): the process groups are fleet.init's; "
                "give both the same hybrid_configs, or leave the optimizer's strategy at the defaults"
            )
    elif init is not None:
        where, topo = "fleet.init's strategy.hybrid_configs", init
    else:
        return _pipeline_topology(strategy, world_size)
    if strategy.pipeline:
        cfg = strategy.pipeline_configs
        if cfg["dp_degree"] not in (1, topo.dp_degree):
            raise ValueError(
                f"strategy.pipeline_configs['dp_degree']={cfg['dp_degree']} conflicts with {where} "
                f"dp_degree={topo.dp_degree}: the hybrid degrees lay the workers out; leave "
                "pipeline_configs['dp_degree'] at 1 or set it equal"
            )
        if cfg["num_stages"] is not None and cfg["num_stages"] != topo.pp_degree:
            raise ValueError(
                f"strategy.pipeline_configs['num_stages']={cfg['num_stages']} conflicts with {where} "
                f"pp_degree={topo.pp_degree}: one stage per pipe rank; leave num_stages at None "
                "or set it equal"
            )
    elif topo.pp_degree > 1:
        raise ValueError(
            f"{where} pp_degree={topo.pp_degree} needs strategy.pipeline=True (with pipeline_configs: "
            "accumulate_steps, cuts): without it nothing would run on the pipe axis"
        )
    return topo


def _pipeline_topology(strategy: Any, world_size: int) -> Topology:
    """No hybrid degrees: pipeline_configs' replicas x stages, or data parallel over all."""
    if not strategy.pipeline:
        return Topology(dp_degree=world_size)
    cfg = strategy.pipeline_configs
    dp = cfg["dp_degree"]
    if world_size % dp:
        raise ValueError(f"pipeline_configs['dp_degree']={dp} does not divide the {world_size} workers")
    stages = cfg["num_stages"] or world_size // dp
    if stages * dp != world_size:
        raise ValueError(
            f"pipeline_configs['num_stages']={stages} x dp_degree={dp} but the job "
            f"has {world_size} workers: each worker runs one stage of one replica"
        )
    return Topology(dp_degree=dp, pp_degree=stages)


# --- Fleet's accessors ------------------------------------------------------------------------
