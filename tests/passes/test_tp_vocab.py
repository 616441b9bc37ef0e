"""Vocab parallel (passes/tensor_parallel.py's `vocab`, ops/kernels/vocab_parallel.py): the
kernels against torch with the model-parallel ranks simulated in one process, the plan and the
printed rewrite, the refusals, and MP=2 on 2 gloo workers equal to single-process training of
the gpt reference program with its tied LM head (and of a small LM with an untied head + bias)."""

from __future__ import annotations

import functools
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import exported

import metaopt
from metaopt import fleet
from metaopt.ir import verify
from metaopt.ir.printer import fmt_op
from metaopt.ops.kernels.vocab_parallel import (
    vocab_parallel_embedding,
    vocab_parallel_embedding_grad,
    vocab_parallel_linear_cross_entropy,
    vocab_parallel_linear_cross_entropy_grad,
)
from metaopt.passes.fuse_linear_cross_entropy import fuse_linear_cross_entropy
from metaopt.passes.tensor_parallel import TensorParallelError, plan_tensor_parallel, tensor_parallel, unshard

TRAINING = Path(__file__).resolve().parent.parent / "training"
sys.path.insert(0, str(TRAINING))
import tp_vocab_worker  # noqa: E402  (beside the other workers, started as a script there)
import tp_worker  # noqa: E402
from workers import start_workers, wait_workers  # noqa: E402

VOCAB = tp_vocab_worker.VOCAB


# --- the kernels, the mp ranks simulated as threads of this process ----------------------------


class _Group:
    """`mp` model-parallel ranks as threads: the communicator's all_reduce sums their buffers in
    rank order (what gloo's does for 2 ranks), a barrier before and after."""

    def __init__(self, mp: int) -> None:
        self.mp, self.bufs, self.barrier = mp, {}, threading.Barrier(mp, timeout=60)

    def runtime(self, rank: int) -> SimpleNamespace:
        def all_reduce(xs, reduce, what, ranks):
            assert reduce == "sum" and list(ranks) == list(range(self.mp)), (reduce, ranks)
            self.bufs[rank] = xs[0].clone()
            self.barrier.wait()
            total = sum(self.bufs[r] for r in range(self.mp))
            self.barrier.wait()
            return [total]

        return SimpleNamespace(comm=SimpleNamespace(rank=rank, all_reduce=all_reduce))

    def run(self, fn):
        """fn(rank, runtime) on every rank at once; the results in rank order."""
        out, errors = [None] * self.mp, []

        def body(r):
            try:
                out[r] = fn(r, self.runtime(r))
            except BaseException as e:  # re-raised below, in the test's thread
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.mp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return out


def _lm(dtype, vocab=12, hidden=5, tokens=(3, 7), bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*tokens, hidden, generator=g, dtype=dtype)
    w = torch.randn(vocab, hidden, generator=g, dtype=dtype)
    b = torch.randn(vocab, generator=g, dtype=dtype) if bias else None
    labels = torch.randint(0, vocab, tokens, generator=g)
    labels[0, :2] = -100  # ignored: left out of the mean
    return x, w, b, labels


def _split_ce(x, w, b, labels, mp, chunk_size):
    """Every rank's (loss, lse, dx, dW_r, db_r) of VocabParallelLinearCrossEntropy, dloss = 1."""
    vl = w.shape[0] // mp

    def rank(r, rt):
        wr, br = w[r * vl : (r + 1) * vl], None if b is None else b[r * vl : (r + 1) * vl]
        attrs = {"chunk_size": chunk_size, "vocab_size": w.shape[0], "group": list(range(mp)), "_rt": rt}
        loss, lse = vocab_parallel_linear_cross_entropy(x, wr, labels, br, _nout=2, _key="loss", **attrs)
        grads = vocab_parallel_linear_cross_entropy_grad(
            torch.ones((), dtype=x.dtype), x, wr, labels, lse, br, **attrs
        )
        return loss, lse, *grads

    return _Group(mp).run(rank)


def _torch_ce(x, w, b, labels):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    b = None if b is None else b.clone().requires_grad_()
    logits = F.linear(x, w, b).flatten(0, 1)
    loss = F.cross_entropy(logits, labels.flatten(), ignore_index=-100)
    loss.backward()
    return loss.detach(), torch.logsumexp(logits.detach(), 1), x.grad, w.grad, None if b is None else b.grad


@pytest.mark.parametrize("mp", [1, 2, 4])
@pytest.mark.parametrize("bias", [True, False])
def test_parallel_cross_entropy_in_float64_is_torchs(mp, bias):
    """Float64, so the only differences are rounding of another summation order (the per-rank
    logsumexps combined, dx summed over ranks): 1e-12 relative is ~1e4 ulps of headroom."""
    x, w, b, labels = _lm(torch.float64, bias=bias)
    ranks = _split_ce(x, w, b, labels, mp, chunk_size=4)  # 21 tokens: chunks of 4, the last of 1
    loss, lse, dx, dw, db = _torch_ce(x, w, b, labels)
    tol = {"rtol": 1e-12, "atol": 1e-14}
    for r in ranks:  # the loss and the logsumexp are replicated: every rank holds them whole
        torch.testing.assert_close(r[0], loss, **tol)
        torch.testing.assert_close(r[1], lse.reshape(labels.shape), **tol)
    torch.testing.assert_close(sum(r[2] for r in ranks), dx, **tol)  # TPCopy's grad sums the parts
    torch.testing.assert_close(torch.cat([r[3] for r in ranks]), dw, **tol)
    if bias:
        torch.testing.assert_close(torch.cat([r[4] for r in ranks]), db, **tol)
    else:
        assert all(r[4] is None for r in ranks)


def test_parallel_cross_entropy_in_float32_against_float64():
    """DESIGN's gradient bar: ours vs float64 no worse than torch's float32 is (ratio <= 100) or
    within 1e-4 relative; the loss within 1e-6 relative of float64 (float32 rounding of a mean)."""
    x, w, b, labels = _lm(torch.float32, vocab=64, hidden=16, tokens=(4, 9), seed=1)
    ranks = _split_ce(x, w, b, labels, 2, chunk_size=5)
    ref32 = _torch_ce(x, w, b, labels)
    ref64 = _torch_ce(x.double(), w.double(), b.double(), labels)
    torch.testing.assert_close(ranks[0][0].double(), ref64[0], rtol=1e-6, atol=0)
    ours = {
        "dx": sum(r[2] for r in ranks),
        "dw": torch.cat([r[3] for r in ranks]),
        "db": torch.cat([r[4] for r in ranks]),
    }
    for k, (mine, t32, t64) in enumerate(zip(ours.values(), ref32[2:], ref64[2:], strict=True)):
        err = (mine.double() - t64).abs().max()
        ratio = err / max((t32.double() - t64).abs().max(), 1e-30)
        rel = err / t64.abs().max()
        assert not (ratio > 100 and rel > 1e-4), (list(ours)[k], float(ratio), float(rel))


def test_no_rank_holds_the_full_vocab_logits(monkeypatch):
    """Each rank's chunks are [chunk, V/mp]: a chunk of 4 tokens over 6 of 12 classes. The matmul
    is the only op making logits, so wrapping F.linear shows every logits tensor made."""
    x, w, b, labels = _lm(torch.float32)
    shapes = []
    real = F.linear

    def spy(*args):
        out = real(*args)
        shapes.append(tuple(out.shape))
        return out

    monkeypatch.setattr(F, "linear", spy)
    _split_ce(x, w, b, labels, 2, chunk_size=4)
    # 21 tokens in chunks of 4, forward and backward, on each of the 2 ranks
    assert len(shapes) == 2 * 2 * 6 and all(s[1] == 6 and s[0] <= 4 for s in shapes), shapes


def test_labels_outside_the_vocab_are_refused_as_torch_does():
    x, w, b, labels = _lm(torch.float32)
    labels[1, 1] = 12  # vocab 12: owned by no rank; torch raises, so must we (not a silent 0)
    with pytest.raises(IndexError, match="label: id 12 is out of range"):
        _split_ce(x, w, b, labels, 2, chunk_size=4)


def test_parallel_embedding_ranks_sum_to_the_lookup_and_each_grads_its_rows():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(10, 4, generator=g)
    ids = torch.tensor([[0, 4, 5, 9, 5], [1, 1, 7, 3, 0]])
    dy = torch.randn(2, 5, 4, generator=g)
    full = F.embedding(ids, w)
    wt = w.clone().requires_grad_()
    F.embedding(ids, wt, padding_idx=1).backward(dy)
    parts, grads = [], []
    for r in range(2):
        rt = SimpleNamespace(comm=SimpleNamespace(rank=r))  # the kernels read this worker's rank only
        attrs = {"vocab_size": 10, "group": [0, 1], "padding_idx": 1, "_rt": rt}
        parts.append(vocab_parallel_embedding(w[5 * r : 5 * r + 5], ids, **attrs))
        grads.append(vocab_parallel_embedding_grad(dy, ids, w[5 * r : 5 * r + 5], **attrs))
    # exact: each token's row comes from one rank, the others add zeros (x + 0 == x)
    assert torch.equal(parts[0] + parts[1], full)
    # id 5 twice and 0 twice: the same two addends as torch's backward, so exact too
    assert torch.equal(torch.cat(grads), wt.grad)


def test_an_embedding_id_outside_the_vocab_is_refused():
    with pytest.raises(IndexError, match="VocabParallelEmbedding: id 10 is out of range"):
        vocab_parallel_embedding(torch.zeros(10, 4), torch.tensor([3, 10]), vocab_size=10, group=[0])


# --- the plan, the printed rewrite, the refusals ------------------------------------------------


@functools.cache
def _fused(name: str = "gpt"):
    return fuse_linear_cross_entropy(exported(name)[2], min_classes=1)


def _plan(program=None, rank: int = 0, mp: int = 2, **kw):
    program = program if program is not None else _fused()
    args = {"column": tp_worker.COLUMN["gpt"], "row": tp_worker.ROW["gpt"], "vocab": VOCAB, **kw}
    return plan_tensor_parallel(program, mp_degree=mp, mp_rank=rank, group=list(range(mp)), **args)


def test_printed_rewrite_of_the_tied_gpt(golden):
    """Rank 1's plan and program: the tied table's rows [50, 100) read by the lookup and the loss."""
    plan = _plan(rank=1)
    q = tensor_parallel(_fused(), plan=plan)
    verify(q)
    golden("tensor_parallel/gpt_vocab", f"{plan}\n\n{q}")


def test_the_tied_table_is_one_split_param_read_by_both():
    program = _fused()
    plan = _plan(rank=1)
    sp = plan.param("transformer.wte.weight")
    assert (sp.axis, sp.full_shape, sp.local_shape) == (0, (100, 32), (50, 32))
    q = tensor_parallel(program, plan=plan)
    assert torch.equal(q.values["transformer.wte.weight"], program.values["transformer.wte.weight"][50:])
    readers = [op for op in q.ops if "transformer.wte.weight" in op.inputs]
    assert [op.type for op in readers] == ["VocabParallelEmbedding", "VocabParallelLinearCrossEntropy"]
    # the same attrs on every rank (fleet compares the programs): the kernel finds its rows [50, 100)
    assert all(op.attrs["vocab_size"] == 100 and op.attrs["group"] == [0, 1] for op in readers)
    metaopt.optimizer.SGD(learning_rate=0.1).minimize(q.loss)
    verify(q)
    # its grad: the head's and the lookup's contributions, both [50, 32], summed
    acc = next(op for op in q.ops if op.outputs == ["transformer.wte.weight@GRAD"])
    made = {o: op.type for op in q.ops for o in op.outputs}
    assert sorted(made[x] for x in acc.inputs) == [
        "VocabParallelEmbeddingGrad",
        "VocabParallelLinearCrossEntropyGrad",
    ]


def test_mp_one_trains_as_the_unsplit_program():
    """A group of one: no communication, the loss kernel's logsumexp of one rank's is the full
    one. Against the unfused program: 1e-6 relative is float32 rounding of another order."""
    ref = tp_vocab_worker.train(tp_worker.export("gpt"), "sgd")
    one = tp_vocab_worker.train(tp_vocab_worker.split(tp_worker.export("gpt"), 0, 1), "sgd")
    assert one["losses"] == pytest.approx(ref["losses"], rel=1e-6)
    for k, v in ref["params"].items():
        torch.testing.assert_close(one["params"][k], v, rtol=1e-5, atol=1e-6)


def test_an_unfused_head_reading_the_table_is_refused_naming_it():
    program = exported("gpt")[2]
    with pytest.raises(TensorParallelError) as e:
        _plan(program)
    head = next(op for op in program.ops if op.outputs == ["lm_head"])  # Linear(x, the table)
    assert fmt_op(head) in str(e.value) and "fuse it first" in str(e.value)


def test_a_vocab_not_divisible_by_mp_is_refused_naming_the_table_and_sizes():
    with pytest.raises(TensorParallelError, match=r"'transformer.wte.weight' has 100 rows .* mp_degree 3"):
        _plan(mp=3, column=[], row=[])


def test_an_unknown_vocab_layer_is_refused_with_a_suggestion():
    with pytest.raises(TensorParallelError, match="did you mean 'transformer.wte'"):
        _plan(vocab=["transformer.wtee"])


def test_a_vocab_layer_that_is_no_lookup_is_refused_naming_its_op():
    program = _fused()
    with pytest.raises(TensorParallelError) as e:
        _plan(vocab=["transformer.h.0.attn"])
    op = next(op for op in program.ops if op.outputs == ["transformer.h.0.attn"])
    assert fmt_op(op) in str(e.value) and "not an embedding lookup" in str(e.value)


def test_the_config_key_is_validated_with_a_suggestion():
    s = fleet.DistributedStrategy()
    with pytest.raises(ValueError, match=r"unknown key 'vocabs' \(did you mean 'vocab'\?\)"):
        s.tensor_parallel_configs = {"vocabs": VOCAB}
    with pytest.raises(TypeError, match=r"\['vocab'\]: expected list\[str\], got str"):
        s.tensor_parallel_configs = {"vocab": "transformer.wte"}
    s.tensor_parallel_configs = {"vocab": VOCAB}
    assert s.tensor_parallel_configs["vocab"] == VOCAB


# --- MP=2 on 2 gloo workers ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp_vocab")
    procs = start_workers(2, [str(TRAINING / "tp_vocab_worker.py"), str(out)])
    wait_workers(procs, "vocab-parallel", 300)
    return out


@functools.cache
def _reference(kind: str) -> dict:
    """Single-process training of the program as exported (the head unfused, nothing split)."""
    if kind == "untied":
        return tp_vocab_worker.train(
            tp_vocab_worker.untied_export(), "sgd", batch=tp_vocab_worker.untied_batch
        )
    return tp_vocab_worker.train(tp_worker.export("gpt"), kind)


def _split_params(kind: str) -> dict:
    if kind == "untied":
        program = fuse_linear_cross_entropy(tp_vocab_worker.untied_export(), min_classes=1)
        plan = plan_tensor_parallel(
            program, mp_degree=2, mp_rank=0, group=[0, 1], column=[], row=[], vocab=["emb", "head"]
        )
    else:
        plan = _plan()
    return {sp.name: sp for sp in plan.params}


# The all-reduces sum the ranks' partial products, logsumexps and the replicated inputs' grads in
# another order than one process does: float32 rounding differs by a few ulps per step, which the
# parallel bar of DESIGN.md (rtol 1e-5, atol 4e-5) covers.
TOL = {"rtol": 1e-5, "atol": 4e-5}


def _named(name: str, message: str) -> str:
    return f"{name}: {message}"


def _check(ranks: list[dict], ref: dict, split: dict, what: str) -> None:
    for k, want in ref[what].items():
        got = [r[what][k] for r in ranks]
        if k in split:  # each rank its rows (or columns), put back together
            sp = split[k]
            assert got[0].shape == sp.local_shape, k
            torch.testing.assert_close(
                unshard(got, sp.axis, sp.blocks), want, **TOL, msg=functools.partial(_named, k)
            )
        else:  # replicated: the same on every rank, from the same all-reduced values
            assert torch.equal(got[0], got[1]), k
            torch.testing.assert_close(got[0], want, **TOL, msg=functools.partial(_named, k))


@pytest.mark.parametrize("kind", ["sgd", "untied", "fleet"])
def test_two_mp_ranks_equal_one_process(two_workers, kind):
    ranks = [torch.load(two_workers / f"{kind}.rank{r}.pt", weights_only=True) for r in range(2)]
    ref = _reference("untied" if kind == "untied" else "sgd")
    split = _split_params(kind)
    assert "transformer.wte.weight" in split or "head.weight" in split
    for r in ranks:
        assert r["losses"] == pytest.approx(ref["losses"], rel=1e-5, abs=4e-5)
    _check(ranks, ref, split, "grads")  # the first step's, from the same params
    _check(ranks, ref, split, "params")  # after 3 SGD steps
    if kind == "fleet":
        # the fleet steps fused the 100-class head (under the default min_classes) to split it
        assert "fuse_linear_ce   run" in ranks[0]["plan"]
        for op in ("VocabParallelEmbedding", "VocabParallelLinearCrossEntropy"):
            assert op in ranks[0]["ops"], f"no {op}: the vocab was not split"


def test_two_mp_ranks_take_adam_steps_as_one_process(two_workers):
    """Losses only: Adam turns float noise of near-zero grads into lr-sized updates (DESIGN.md), so
    its params are no judge; 3 losses within 1e-5 of the single process's."""
    ranks = [torch.load(two_workers / f"adam.rank{r}.pt", weights_only=True) for r in range(2)]
    ref = _reference("adam")
    for r in ranks:
        assert r["losses"] == pytest.approx(ref["losses"], rel=1e-5, abs=1e-5)
