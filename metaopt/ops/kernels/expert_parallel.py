"""Expert parallel: token rows travel to the workers holding their experts, and back.

Each of the ``ep`` workers of an expert-parallel group holds ``E/ep`` consecutive experts of an
MoE layer (worker ``q``: experts ``q*El .. (q+1)*El - 1``, ``El = E/ep``). Its tokens, sorted by
expert (what HF's grouped experts run ``GroupedMatMul`` on), are therefore sorted by owner too:
the rows for worker ``q`` are one contiguous block.

``layout, local_offsets = ExpertRoute(offsets, x)``: the counts per (owner, local expert) this
worker sends, from its global ``offsets`` [E], traded with the group by one small all-to-all for
the counts it receives. ``layout`` (int64, on the host) is ``[n, ep, El, send (ep*El), recv
(ep*El)]``: ``n`` the rows of ``x``, ``send[q, e]`` rows this worker sends to worker ``q``'s
local expert ``e``, ``recv[p, e]`` rows worker ``p`` sends to this worker's local expert ``e``.
``local_offsets`` [El] are the cumulative row counts of the received rows, grouped by local
expert: what the local ``GroupedMatMul`` reads.

``y = ExpertExchange(x, layout)`` (dispatch): the rows to their owners by one all-to-all, then
regrouped from (source worker, expert) order to (expert, source worker) order, so each local
expert's rows are contiguous. ``reverse=1`` (combine) is its exact inverse: the regrouping
undone and the rows sent back, rows past the routed ones zero. Each is the other's gradient
(a permutation's transpose): the backward trades grads by the same layout, no new counts.

The received row count is data (the routing): on the meta device the dispatch returns its
bound, every row of every worker of the group (`ep * n`), and issues no collective; where the
offsets are known there and give every expert the same rows (expert capacity's slots: host
values), every worker sends the same counts, so each receives what it sends: exactly `n` rows.
"""

from __future__ import annotations

import torch

from metaopt.ops.kernels.moe import offset_counts
from metaopt.ops.registry import register_collective


def group_ranks(group: list[int] | str, op: str) -> list[int]:
    """The global ranks of the expert-parallel group ("expert_parallel": this worker's, from
    fleet.init's layout)."""
    if not isinstance(group, str):
        return list(group)
    if group != "expert_parallel":
        raise ValueError(f"{op}: group must be a list of ranks or 'expert_parallel', got {group!r}")
    from metaopt.ops.kernels.comm import hybrid_ranks

    return hybrid_ranks("expert", op)


@register_collective(
    "ExpertRoute",
    fresh_outputs=True,
    host_outputs=True,
    # held from the forward: a recomputed layer reuses its routing's layout (bitwise) without a
    # second exchange of counts
    recomputable=False,
    notes="expert parallel: counts of rows per (worker, local expert) traded; layout and local offsets",
)
def expert_route(
    offsets: torch.Tensor, x: torch.Tensor, *, group: list[int] | str, _rt, _key: str
) -> tuple[torch.Tensor, torch.Tensor]:
    ranks = group_ranks(group, "ExpertRoute")
    ep, experts, n = len(ranks), offsets.shape[0], x.shape[0]
    if experts % ep:
        raise ValueError(f"ExpertRoute: {experts} experts do not split over an expert-parallel group of {ep}")
    local = experts // ep
    head = torch.tensor([n, ep, local], dtype=torch.int64)
    if x.device.type == "meta" or offsets.device.type == "meta":  # shapes only: no routing to trade
        return _route_on_meta(offsets, n, head, ep, local)
    counts = offset_counts(offsets, n, "ExpertRoute")
    send = counts.reshape(ep, local)
    if ep == 1:
        recv = send.clone()
    else:
        recv = _rt.comm.all_to_all(send, [1] * ep, [1] * ep, f"row counts of {_key}", ranks)
    local_offsets = torch.cumsum(recv.sum(0), 0).to(offsets.dtype)
    return torch.cat([head, send.reshape(-1), recv.reshape(-1)]), local_offsets


def _route_on_meta(
    offsets: torch.Tensor, n: int, head: torch.Tensor, ep: int, local: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The layout with no collective: received counts zero (unknown: the dispatch takes its bound),
    or, for offsets known here with equal runs, each worker's own counts (all send the same)."""
    send = recv = torch.zeros((ep, local), dtype=torch.int64)
    if offsets.device.type != "meta":
        counts = offset_counts(offsets, n, "ExpertRoute")
        if bool((counts == counts[0]).all()):
            send = recv = counts.reshape(ep, local)
    local_offsets = torch.cumsum(recv.sum(0), 0).to(offsets.dtype)
    return torch.cat([head, send.reshape(-1), recv.reshape(-1)]), local_offsets


def unpack(layout: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(n, send [ep, El], recv [ep, El]) of an `ExpertRoute` layout."""
    n, ep, local = (int(v) for v in layout[:3].tolist())
    body = layout[3:].reshape(2, ep, local)
    return n, body[0], body[1]


def regroup(recv: torch.Tensor) -> torch.Tensor:
    """Row indices taking received rows, in (source worker, expert) order, to (expert, source
    worker) order."""
    ep, local = recv.shape
    starts = (torch.cumsum(recv.reshape(-1), 0) - recv.reshape(-1)).reshape(ep, local)
    pieces = [
        torch.arange(int(starts[p, e]), int(starts[p, e] + recv[p, e]))
        for e in range(local)
        for p in range(ep)
    ]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)


def _exchange_grad(g, op, dy):
    # A permutation of rows across the group: its transpose is the exchange the other way.
    back = g.emit1(
        "ExpertExchange",
        [dy[0], op.inputs[1]],
        like=op.inputs[0],
        group=op.attrs["group"],
        reverse=1 - int(op.attrs.get("reverse", 0)),
    )
    return [back, None]


@register_collective(
    "ExpertExchange",
    fresh_outputs=True,
    # recompute re-runs it: every worker of the group runs the same program, so the re-emitted
    # exchange meets its peers' in the same order, and moves the same rows
    recomputable=True,
    host_inputs=(1,),  # the layout: ExpertRoute's host value, read with .tolist()
    grad=_exchange_grad,
    notes="expert parallel: rows to their experts' owners (dispatch) or back (reverse=1, combine)",
)
def expert_exchange(
    x: torch.Tensor, layout: torch.Tensor, *, group: list[int] | str, reverse: int = 0, _rt, _key: str
) -> torch.Tensor:
    ranks = group_ranks(group, "ExpertExchange")
    n, send, recv = unpack(layout)
    if x.device.type == "meta":  # its bound, or the rows received where the layout knows them
        rows = n if reverse else int(recv.sum()) or len(ranks) * n
        return torch.empty((rows, *x.shape[1:]), dtype=x.dtype, device=x.device)
    order = regroup(recv).to(x.device)
    what = f"{_key} over expert-parallel group {ranks}"
    if not reverse:
        if x.shape[0] != n:
            raise ValueError(f"ExpertExchange: {x.shape[0]} rows, but the layout was routed for {n}")
        mine = x[: int(send.sum())]
        got = (
            mine.clone()
            if len(ranks) == 1
            else _rt.comm.all_to_all(mine, send.sum(1).tolist(), recv.sum(1).tolist(), what, ranks)
        )
        return got[order]
    if x.shape[0] != order.shape[0]:
        raise ValueError(
            f"ExpertExchange(reverse=1): {x.shape[0]} rows, but the layout received {order.shape[0]}"
        )
    by_source = torch.empty_like(x)
    by_source[order] = x
    back = (
        by_source
        if len(ranks) == 1
        else _rt.comm.all_to_all(by_source, recv.sum(1).tolist(), send.sum(1).tolist(), what, ranks)
    )
    out = torch.zeros((n, *x.shape[1:]), dtype=x.dtype, device=x.device)
    out[: back.shape[0]] = back
    return out
