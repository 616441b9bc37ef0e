"""Context parallel's ring attention kernels (ops/kernels/context_parallel.py) against torch.

The `degree` ranks of a cp group run as threads of this process, their ring hops through a board
standing in for the communicator (each rank's send read by its next rank): the kernels' arithmetic
is what is tested here; the gloo workers of tests/passes/test_context_parallel.py test the same
kernels over real process groups.

In float64 (DESIGN's judge of gradients): y and the grads of q, k and v, reassembled from every
rank's local rows, against torch.autograd on one process's softmax attention at rtol 1e-12. The
ring adds the same terms in another order (blockwise online softmax), which in float64 moves the
last bits only (measured: ~1e-15).
"""

from __future__ import annotations

import threading

import pytest
import torch

from metaopt.ops.kernels import context_parallel as cp
from metaopt.ops.kernels.sequence_parallel import assemble, positions, runs, take

SCALE = 0.3


class _Board:
    """The communicator of `n` thread ranks: `all_to_all` as the ring uses it (one peer each way)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.barrier = threading.Barrier(n, timeout=30)
        self.slots: dict[int, tuple[torch.Tensor, list[int]]] = {}

    def runtime(self, rank: int):  # noqa: ANN201
        board = self

        class Comm:
            def all_to_all(self, t, send, recv, what, ranks):  # noqa: ANN001, ANN202
                me = ranks.index(rank)
                board.slots[me] = (t, list(send))
                board.barrier.wait()
                rows = []
                for j in range(board.n):
                    if recv[j]:
                        tj, sj = board.slots[j]
                        start = sum(sj[:me])
                        rows.append(tj[start : start + sj[me]])
                out = torch.cat(rows).clone()
                board.barrier.wait()
                return out

        comm = Comm()
        comm.rank = rank

        class Runtime:
            pass

        rt = Runtime()
        rt.comm = comm
        return rt


def _causal(s: int) -> torch.Tensor:
    allowed = torch.ones(s, s, dtype=torch.bool).tril()
    return torch.where(allowed, 0.0, -torch.inf).double().view(1, 1, s, s)


def _reference(q, k, v, mask, dy, keep, p):  # noqa: ANN001, ANN202
    """One process: softmax(scale q k^T + mask) v, dropout by `keep`; dead rows give zeros."""
    s = torch.matmul(q, k.transpose(2, 3)) * SCALE + (mask if mask is not None else 0)
    dead = torch.isneginf(s).all(-1, keepdim=True)
    probs = torch.where(dead, 0.0, torch.softmax(torch.where(dead, 0.0, s), -1))
    if keep is not None:
        probs = probs * keep / (1 - p)
    y = probs @ v
    return (y, *torch.autograd.grad(y, (q, k, v), dy))


def _ring(n, q, k, v, mask, dy, layout, p, monkeypatch, keep):  # noqa: ANN001, ANN202
    """y, dq, dk, dv of the ring on `n` thread ranks, reassembled whole."""
    if keep is not None:  # one process's mask, as every rank draws it whole
        monkeypatch.setattr(cp, "keep_mask", lambda shape, p_, device: keep.clone())
    board, got, errors = _Board(n), [None] * n, []
    group = list(range(n))

    def rank(r: int) -> None:
        try:
            rt = board.runtime(r)
            ql, kl, vl, dyl = (take(t.detach(), 2, n, r, layout) for t in (q, k, v, dy))
            ml = None if mask is None else take(mask, 2, n, r, layout)
            attrs = {"scale": SCALE, "dropout_p": p, "group": group, "layout": layout, "_rt": rt, "_key": "t"}
            y, lse, *kept = cp.ring_attention(ql, kl, vl, ml, **attrs, _nout=3 if p else 2)
            grads = cp.ring_attention_grad(dyl, ql, kl, vl, y, ml, lse, *kept, **attrs)
            got[r] = (y, *grads)
        except Exception as e:  # noqa: BLE001 - reported below, with the others' barrier broken
            errors.append(e)
            board.barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [assemble([got[r][i] for r in range(n)], 2, layout) for i in range(4)]


CASES = [
    (1, "zigzag", "causal", 0.0),
    (2, "zigzag", "none", 0.0),
    (2, "zigzag", "causal", 0.0),
    (2, "contiguous", "causal", 0.0),
    (4, "zigzag", "causal", 0.0),
    (2, "zigzag", "dead rows", 0.0),
    (2, "zigzag", "causal", 0.3),
    (4, "zigzag", "causal", 0.3),
]


@pytest.mark.parametrize(("n", "layout", "masking", "p"), CASES)
def test_ring_attention_and_its_grads_equal_one_processs_in_float64(n, layout, masking, p, monkeypatch):
    b, h, s, d = 2, 3, 16, 5
    gen = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(b, h, s, d, dtype=torch.float64, generator=gen).requires_grad_() for _ in range(3))
    dy = torch.randn(b, h, s, d, dtype=torch.float64, generator=gen)
    mask = None if masking == "none" else _causal(s)
    if masking == "dead rows":  # batch 1's first three queries see no key: zeros, as attention gives
        mask = mask.expand(b, 1, s, s).clone()
        mask[1, :, :3, :] = -torch.inf
    keep = (torch.rand(b, h, s, s, generator=gen) > p) if p else None
    want = _reference(q, k, v, mask, dy, keep, p)
    got = _ring(n, q, k, v, mask, dy, layout, p, monkeypatch, keep)
    for name, a, e in zip(("y", "dq", "dk", "dv"), got, want, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-13, msg=name)
    if masking == "dead rows":
        assert torch.equal(got[0][1, :, :3], torch.zeros_like(got[0][1, :, :3]))


def test_zigzag_gives_every_rank_the_same_causal_work_and_contiguous_does_not():
    """Under a causal mask, the (query, key) pairs each rank computes (the blocks not masked out
    everywhere, `_blocks`): equal over the ranks with the zig-zag layout, rank 0 the least with
    contiguous chunks (the imbalance zig-zag exists to remove)."""
    s, n = 32, 4
    mask = _causal(s)

    def work(layout: str) -> list[int]:
        out = []
        for r in range(n):
            rows = take(mask, 2, n, r, layout)
            pairs = 0
            for src in range(n):
                for _, qn, _, kn, _, _ in cp._blocks(rows, runs(s, n, r, layout), runs(s, n, src, layout)):
                    pairs += qn * kn
            out.append(pairs)
        return out

    zigzag, contiguous = work("zigzag"), work("contiguous")
    assert len(set(zigzag)) == 1, zigzag
    assert contiguous == sorted(contiguous) and contiguous[0] < contiguous[-1], contiguous


def test_layouts_place_every_position_once():
    for layout in ("contiguous", "zigzag"):
        held = torch.cat([positions(24, 3, r, layout) for r in range(3)])
        assert sorted(held.tolist()) == list(range(24)), layout
    assert positions(8, 2, 0, "zigzag").tolist() == [0, 1, 6, 7]
    assert positions(8, 2, 1, "zigzag").tolist() == [2, 3, 4, 5]
    with pytest.raises(ValueError, match="not divisible into 4 runs"):
        runs(6, 2, 0, "zigzag")


def test_everything_dropped_gives_zeros_and_draws_nothing(monkeypatch):
    """dropout_p = 1: zeros, as one process's attention gives, and no draw from the generator
    (one process's draws none either, so the streams stay in step)."""
    monkeypatch.setattr(cp, "keep_mask", lambda *a: pytest.fail("a mask was drawn at dropout_p = 1"))
    q = torch.randn(1, 2, 8, 4, dtype=torch.float64)
    y, lse, keep = cp.ring_attention(q, q, q, None, dropout_p=1.0, group=[0], _rt=None, _key="t", _nout=3)
    assert torch.equal(y, torch.zeros_like(y)) and not keep.any()
    attrs = {"dropout_p": 1.0, "group": [0], "_rt": None, "_key": "t"}
    dq, dk, dv = cp.ring_attention_grad(torch.ones_like(q), q, q, q, y, None, lse, keep, **attrs)
    assert torch.equal(dv, torch.zeros_like(dv))


def test_a_mask_that_is_not_the_local_queries_rows_is_refused():
    """A whole [s, s] mask read with local row offsets would apply other queries' rows: named."""
    q = torch.randn(1, 2, 8, 4)
    whole = torch.zeros(1, 1, 16, 16)  # the whole sequence's rows, on a rank holding 8 of 16
    board = _Board(2)
    with pytest.raises(ValueError, match=r"mask of shape \[1, 1, 16, 16\] is not the rows of the 8 local"):
        cp.ring_attention(q, q, q, whole, group=[0, 1], _rt=board.runtime(0), _key="t")
