"""A mixture-of-experts training step: metaopt against torch eager on the same HF Mixtral.

    python benchmarks/moe.py [--width 256] [--layers 4] [--experts 8] [--seq 128] [--batch 4]
                             [--steps 5] [--rounds 3] [--json out.json]

The model: HF MixtralForCausalLM from a config (vocab 8192, GQA 8/4 heads, top-2 of `--experts`
experts, the load-balancing aux loss on), wrapped to return the loss, float32 on the CPU. One
training step is forward + backward + SGD (lr 1e-3), the same batch every step. Sides, timed
round by round in this one process (each round: one untimed step, then `--steps` timed):
  eager-grouped  torch eager, HF's default experts: torch.nn.functional.grouped_mm (torch's CPU
                 kernel), torch.optim.SGD
  eager-loop     torch eager, HF's "eager" experts (a Python loop over the experts hit)
  metaopt        metaopt.export + fleet minimize (SGD), metaopt.Executor: one GroupedMatMul per
                 projection over every expert
The table gives each side's median step and its ratio to eager-grouped. All-to-all bytes need
expert parallel, which metaopt does not have yet (issue 44): this script has no such column.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time

import common  # noqa: F401  (puts the repo on sys.path)
import torch

import metaopt  # before transformers (DESIGN: import order)


class LMLoss(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.m(input_ids=input_ids, labels=labels).loss


def build(a, impl: str) -> torch.nn.Module:
    import transformers

    cfg = transformers.MixtralConfig(
        vocab_size=8192,
        hidden_size=a.width,
        intermediate_size=2 * a.width,
        num_hidden_layers=a.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_local_experts=a.experts,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=0.02,
        max_position_embeddings=a.seq,
        experts_implementation=impl,
    )
    torch.manual_seed(0)
    return LMLoss(transformers.MixtralForCausalLM(cfg)).train()


def eager_step(module):
    opt = torch.optim.SGD(module.parameters(), lr=1e-3)

    def step(ids, labels):
        opt.zero_grad(set_to_none=True)
        loss = module(ids, labels)
        loss.backward()
        opt.step()
        return loss.item()

    return step


def metaopt_step(module, ids, labels):
    program = metaopt.export(copy.deepcopy(module), (ids, labels))
    metaopt.fleet.init(is_collective=True)
    opt = metaopt.fleet.distributed_optimizer(metaopt.optimizer.SGD(learning_rate=1e-3))
    opt.minimize(program.loss)
    exe = metaopt.Executor("cpu")

    def step(ids_, labels_):
        feed = {"input_ids": ids_, "labels": labels_}
        (loss,) = exe.run(program, feed=feed, fetch_list=[program.loss_name])
        return float(loss)

    return step


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 8192, (a.batch, a.seq), generator=g)
    base = build(a, "grouped_mm")
    sides = {
        "eager-grouped": eager_step(base),
        "eager-loop": eager_step(build(a, "eager")),
        "metaopt": metaopt_step(build(a, "grouped_mm"), ids, ids),
    }
    params = sum(p.numel() for p in base.parameters())
    times: dict[str, list[float]] = {k: [] for k in sides}
    first: dict[str, float] = {}
    for _ in range(a.rounds):
        for name, step in sides.items():
            loss = step(ids, ids)
            first.setdefault(name, loss)
            for _ in range(a.steps):
                t = time.perf_counter()
                step(ids, ids)
                times[name].append(time.perf_counter() - t)
    ref = statistics.median(times["eager-grouped"])
    print(
        f"HF Mixtral {a.layers} layers, width {a.width}, {a.experts} experts top-2, "
        f"{params / 1e6:.1f}M params, "
        f"batch {a.batch} x {a.seq}, torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(f"{'side':<14} {'median step s':>14} {'x eager-grouped':>16} {'first loss':>11}")
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        rows.append({"side": name, "median_s": med, "ratio": med / ref, "first_loss": first[name]})
        print(f"{name:<14} {med:>14.4f} {med / ref:>16.2f} {first[name]:>11.5f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "params": params, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
