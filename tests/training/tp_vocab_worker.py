"""One vocab-parallel worker (started by tests/passes/test_tp_vocab.py with RANK/WORLD_SIZE/MASTER_*):
``python tp_vocab_worker.py OUT``.

The gpt reference program (tiny, dropout 0) with its LM head tied to ``transformer.wte``: the
head + loss fused (min_classes=1: the tiny vocab of 100 is under the default threshold), then the
tensor-parallel pass with tp_worker's column/row layers and ``vocab=["transformer.wte"]``; the same
full batch on every rank (tp_worker.batch). Three runs, each written to ``OUT/<run>.rank<r>.pt``:

* ``sgd``: 3 SGD steps (losses, final local params) and the grads of the first step;
* ``adam``: 3 Adam steps (losses);
* ``untied``: a small LM whose head has its own weight and a bias (`Untied`), both split by
  vocab rows (``vocab=["emb", "head"]``), 3 SGD steps;
* ``fleet``: the same through fleet (``tensor_parallel_configs["vocab"]``), 3 SGD steps: the
  fleet steps fuse the head whatever its size when a vocab is split.
"""

from __future__ import annotations

import os
import sys

import export_cache
import torch
import tp_worker

import metaopt
from metaopt import fleet
from metaopt.ir import names
from metaopt.passes.fuse_linear_cross_entropy import fuse_linear_cross_entropy
from metaopt.passes.tensor_parallel import plan_tensor_parallel, tensor_parallel

NAME = "gpt"
VOCAB = ["transformer.wte"]
ADAM_LR = 1e-3


class Untied(torch.nn.Module):
    """An LM head with its own weight and bias (not tied to the embedding)."""

    VOCAB, WIDTH, SEQ = 64, 16, 8

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(self.VOCAB, self.WIDTH)
        self.mix = torch.nn.Linear(self.WIDTH, self.WIDTH)
        self.head = torch.nn.Linear(self.WIDTH, self.VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mix(self.emb(ids)))
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def untied_batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, Untied.VOCAB, (tp_worker.BATCH, Untied.SEQ), generator=g)
    labels = torch.randint(0, Untied.VOCAB, (tp_worker.BATCH, Untied.SEQ), generator=g)
    labels[0, :3] = -100  # ignored tokens: the mean is over the others, on every rank alike
    return {"ids": ids, "labels": labels}


def untied_export() -> metaopt.Program:
    torch.manual_seed(0)
    return export_cache.export(Untied().train(), tuple(untied_batch(0).values()), name="untied")


def untied_split(program: metaopt.Program, rank: int, mp: int) -> metaopt.Program:
    fused = fuse_linear_cross_entropy(program, min_classes=1)
    plan = plan_tensor_parallel(
        fused, mp_degree=mp, mp_rank=rank, group=list(range(mp)), column=[], row=[], vocab=["emb", "head"]
    )
    return tensor_parallel(fused, plan=plan)


def optimizer(kind: str):
    if kind == "adam":
        return metaopt.optimizer.Adam(learning_rate=ADAM_LR)
    return metaopt.optimizer.SGD(learning_rate=tp_worker.LR)


def split(program: metaopt.Program, rank: int, mp: int) -> metaopt.Program:
    """The program as MP rank `rank` of `mp` runs it (mp=1: the fused single-process program)."""
    fused = fuse_linear_cross_entropy(program, min_classes=1)
    plan = plan_tensor_parallel(
        fused,
        mp_degree=mp,
        mp_rank=rank,
        group=list(range(mp)),
        column=tp_worker.COLUMN[NAME],
        row=tp_worker.ROW[NAME],
        vocab=VOCAB,
    )
    return tensor_parallel(fused, plan=plan)


def train(program: metaopt.Program, kind: str, opt=None, batch=None) -> dict:
    """3 steps from `program` (minimized here unless `opt` did it): losses, final params and the
    grads of the first step (before any update), as this process holds them."""
    if opt is None:
        optimizer(kind).minimize(program.loss)
    exe = metaopt.Executor("cpu")
    params = [v.name for v in program.params()]
    grads = [names.grad(p) for p in params]
    losses, first = [], {}
    for step in range(tp_worker.STEPS):
        fetch = [program.loss, *grads] if step == 0 else [program.loss]
        feed = batch(step) if batch is not None else tp_worker.batch(NAME, step)
        out = exe.run(program, feed=feed, fetch_list=fetch, return_numpy=False)
        losses.append(float(out[0]))
        if step == 0:
            first = {p: g.clone() for p, g in zip(params, out[1:], strict=True)}
    return {
        "losses": losses,
        "params": {p: exe.scope[p].clone() for p in params},
        "grads": first,
    }


def fleet_run(rank: int, mp: int) -> dict:
    s = fleet.DistributedStrategy()
    s.hybrid_configs = {"mp_degree": mp}
    s.tensor_parallel = True
    s.tensor_parallel_configs = {"column": tp_worker.COLUMN[NAME], "row": tp_worker.ROW[NAME], "vocab": VOCAB}
    program = tp_worker.export(NAME)
    opt = fleet.distributed_optimizer(optimizer("sgd"), s)
    opt.minimize(program.loss)
    result = train(program, "sgd", opt=opt)
    result["plan"] = str(opt.plan())
    result["ops"] = [op.type for op in program.ops]
    return result


def main() -> None:
    out = sys.argv[1]
    s = fleet.DistributedStrategy()
    s.hybrid_configs = {"mp_degree": int(os.environ["WORLD_SIZE"])}
    fleet.init(is_collective=True, strategy=s)
    rank, world = fleet.worker_index(), fleet.worker_num()
    for kind in ("sgd", "adam"):
        torch.save(train(split(tp_worker.export(NAME), rank, world), kind), f"{out}/{kind}.rank{rank}.pt")
    untied = train(untied_split(untied_export(), rank, world), "sgd", batch=untied_batch)
    torch.save(untied, f"{out}/untied.rank{rank}.pt")
    torch.save(fleet_run(rank, world), f"{out}/fleet.rank{rank}.pt")
    fleet.barrier_worker()


if __name__ == "__main__":
    main()
