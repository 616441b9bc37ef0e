"""Bigger than one process (issue 43): a LLaMA-shaped model of 1.26B parameters (5.05 GB in float32)
trained by 4 gloo workers, each built on the meta device and filled by `fleet.load_pretrained`
with only its share of a Hugging Face folder, against torch eager on the whole model.

    python benchmarks/bigger_model.py [--layers 22] [--layouts zero3,tp2-sh2,pp2-sh2] [--json out.json]

1. reference, a fresh process: the model built on the CPU (seed 0), saved with HF's
   `save_pretrained` (its initial values), then STEPS SGD steps of torch eager on the batch: its
   losses and peak RSS.
2. each layout, 4 fresh gloo workers (every worker fed the whole batch: the sharding group's mean
   of equal grads is exact): built on meta, exported, minimized, filled by load_pretrained,
   STEPS steps. Each reports its losses, its peak RSS (getrusage) and what the executor holds
   (persistable bytes) beside `estimate_memory`'s host account.
   - zero3: sharding_degree 4, stage 3;
   - tp2-sh2: mp_degree 2 x sharding_degree 2, stage 3 (Megatron column/row split of q/k/v/gate/up
     and o/down, the embedding and the head split by vocab rows);
   - pp2-sh2: pp_degree 2 x sharding_degree 2, stage 1 (a 1F1B pipeline of 2 micro-batches; a
     pipeline refuses stages 2 and 3): each stage's params whole are half the model already, and
     its 4 workers were killed by this 24 GiB machine's OOM killer (2026-12-06), so it is not
     among the defaults;
   - "-uib": with strategy.optimizer_in_backward (each grad slice freed at its update);
   - "-rc" (after "-uib"): with recompute per decoder layer.

The table: per layout, the largest relative loss difference from eager and the largest worker
peak RSS as a fraction of the model's bytes (the bar: below 0.5).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
STEPS = 2
BATCH, SEQ = 2, 32
LR = 0.05
LAYOUTS = ("zero3-uib-rc", "tp2-sh2-uib-rc")  # the README's table; pp2-sh2 by --layouts (see its doc)
GLIBC = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")  # reported: they change the RSS
COLUMN = [f"m.model.layers.*.self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj")] + [
    "m.model.layers.*.mlp.gate_proj",
    "m.model.layers.*.mlp.up_proj",
]
ROW = ["m.model.layers.*.self_attn.o_proj", "m.model.layers.*.mlp.down_proj"]
VOCAB = ["m.model.embed_tokens", "m.lm_head"]  # Megatron's vocab-parallel embedding and head + loss


def config(layers: int):
    """TinyLlama's widths, full attention heads, untied head; `layers` 22: 1.26B params. A
    negative `layers` is a smoke test of the same code at widths 256 (-layers layers)."""
    transformers = _transformers()
    small = layers < 0
    return transformers.LlamaConfig(
        hidden_size=256 if small else 2048,
        intermediate_size=688 if small else 5632,
        num_hidden_layers=abs(layers),
        num_attention_heads=4 if small else 16,
        num_key_value_heads=4 if small else 16,
        vocab_size=1000 if small else 32000,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )


def _transformers():
    import metaopt  # noqa: F401 - before transformers: it makes a mismatched torchvision importable

    return __import__("transformers")


def _lm(model):
    import torch

    class LM(torch.nn.Module):  # the loss-returning wrapper metaopt exports ("m." before HF's names)
        def __init__(self, m: torch.nn.Module) -> None:
            super().__init__()
            self.m = m

        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return self.m(input_ids=input_ids, labels=labels).loss

    return LM(model).train()


def batch(step: int, vocab: int):
    import torch

    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids}


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reference(folder: str, layers: int) -> dict:
    """The eager side, in this (fresh) process."""
    import torch

    transformers = _transformers()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config(layers))
    model.save_pretrained(folder, max_shard_size="2GB")
    params = sum(p.numel() for p in model.parameters())
    lm = _lm(model)
    opt = torch.optim.SGD(lm.parameters(), lr=LR)
    losses = []
    t0 = time.perf_counter()
    for step in range(STEPS):
        feed = batch(step, model.config.vocab_size)
        loss = lm(**feed)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return {"losses": losses, "params": params, "peak_rss": peak_rss(), "seconds": time.perf_counter() - t0}


def strategy(layout: str):
    from metaopt import fleet

    s = fleet.DistributedStrategy()
    if layout.endswith("-rc"):  # recompute per layer: each keeps its input, not its activations
        s.recompute = True
        s.recompute_configs = {"checkpoints": ["m.model.layers.*"]}
    layout = layout.removesuffix("-rc")
    s.optimizer_in_backward = layout.endswith("-uib")  # each grad slice freed at its update
    layout = layout.removesuffix("-uib")
    if layout == "zero3":
        s.hybrid_configs = {"sharding_degree": 4}
        s.sharding_configs = {"sharding_degree": 4, "stage": 3}
    elif layout == "tp2-sh2":
        s.hybrid_configs = {"mp_degree": 2, "sharding_degree": 2}
        s.tensor_parallel = True
        s.tensor_parallel_configs = {"column": COLUMN, "row": ROW, "vocab": VOCAB}
        s.sharding_configs = {"stage": 3}
    else:
        s.hybrid_configs = {"pp_degree": 2, "sharding_degree": 2}
        s.sharding_configs = {"stage": 1}
        s.pipeline = True
        s.pipeline_configs = {"accumulate_steps": 2, "schedule_mode": "1F1B"}
    s.sharding = True
    return s


def worker(out: str, folder: str, layout: str, layers: int) -> None:
    """One of the 4 workers: its share only, from the meta build to the last step."""
    import torch

    import metaopt
    from metaopt import fleet
    from metaopt.passes.memory_estimate import estimate_memory

    transformers = _transformers()
    torch.set_num_threads(1)
    s = strategy(layout)
    fleet.init(is_collective=True, strategy=s)
    rank = fleet.worker_index()
    marks = {"start": peak_rss()}
    t0 = time.perf_counter()
    cfg = config(layers)
    with torch.device("meta"):
        lm = _lm(transformers.LlamaForCausalLM(cfg))
    feed = batch(0, cfg.vocab_size)
    main = metaopt.export(lm, (feed["input_ids"], feed["labels"]))
    marks["export"] = peak_rss()
    loss_name = main.loss.name
    fleet.distributed_optimizer(metaopt.optimizer.SGD(learning_rate=LR), s).minimize(main.loss)
    marks["minimize"] = peak_rss()
    exe = metaopt.Executor("cpu")
    fleet.load_pretrained(exe, main, folder, prefix="m.")
    marks["load"] = peak_rss()
    held = sum(t.numel() * t.element_size() for t in exe.scope.values())
    losses = []
    for step in range(STEPS):
        (loss,) = exe.run(main, feed=batch(step, cfg.vocab_size), fetch_list=[loss_name])
        losses.append(None if loss is None else float(loss))
    marks["train"] = peak_rss()
    stats = exe.memory_stats()
    if main.pipeline is None:
        host = dict(estimate_memory(main, dims={"batch": BATCH}).host)
    else:
        host = {}
    result = {
        "rank": rank,
        "losses": losses,
        "peak_rss": peak_rss(),
        "marks": marks,
        "held_after_load": held,
        "persistable_bytes": stats["persistable_bytes"],
        "peak_bytes": stats["peak_bytes"],
        "host_estimate": host,
        "seconds": time.perf_counter() - t0,
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    fleet.barrier_worker()


def _run(args: list[str], env: dict | None = None, world: int = 1, timeout: int = 3600) -> None:
    procs = []
    for rank in range(world):
        e = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")]),
            **(env or {}),
        }
        if world > 1:
            e.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT="29731",
                OMP_NUM_THREADS="1",
            )
        procs.append(subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *args], env=e))
    for p in procs:
        if p.wait(timeout=timeout) != 0:
            for q in procs:
                q.kill()
            raise SystemExit(f"{args[0]} failed")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=22, help="22: 1.26B params; -N: a smoke test")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--folder", default=None, help="the HF folder (kept: made once)")
    ap.add_argument("--json", default=os.path.join(HERE, "results", "bigger_model.json"))
    ap.add_argument("--reference", nargs=2, metavar=("OUT", "FOLDER"))
    ap.add_argument("--worker", nargs=3, metavar=("OUT", "FOLDER", "LAYOUT"))
    a = ap.parse_args()
    if a.reference:
        Path(a.reference[0]).write_text(json.dumps(reference(a.reference[1], a.layers)))
        return
    if a.worker:
        worker(*a.worker, a.layers)
        return
    work = Path(tempfile.mkdtemp(prefix="bigger_model_"))
    folder = a.folder or str(work / "hf")
    ref_file = Path(folder) / "reference.json"
    if not ref_file.exists():
        _run(["--reference", str(ref_file), folder, "--layers", str(a.layers)])
    ref = json.loads(ref_file.read_text())
    model_bytes = ref["params"] * 4
    rows = {}
    for layout in a.layouts.split(","):
        out = work / layout
        out.mkdir()
        _run(["--worker", str(out), folder, layout, "--layers", str(a.layers)], world=4)
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
        got = [x for r in ranks for x in r["losses"] if x is not None]
        per_step = [[r["losses"][i] for r in ranks if r["losses"][i] is not None] for i in range(STEPS)]
        rel = max(
            abs(x - ref["losses"][i]) / abs(ref["losses"][i]) for i in range(STEPS) for x in per_step[i]
        )
        rows[layout] = {
            "loss_max_rel_diff": rel,
            "losses": got,
            "peak_rss_max": max(r["peak_rss"] for r in ranks),
            "peak_rss_over_model": max(r["peak_rss"] for r in ranks) / model_bytes,
            "ranks": ranks,
        }
    size = f"{ref['params'] / 1e9:.3f}B params ({model_bytes / 1e9:.2f} GB float32)"
    glibc = {k: os.environ[k] for k in GLIBC if k in os.environ}
    print(f"\nLLaMA-shaped, {size}, 4 gloo workers; glibc: {glibc or 'defaults'}")
    print(f"eager reference: losses {ref['losses']}, peak RSS {ref['peak_rss'] / 1e9:.2f} GB")
    print(
        f"{'layout':10} {'max rel loss diff':>18} {'worker peak RSS':>16} {'/ model bytes':>14} {'< 0.5':>6}"
    )
    for layout, r in rows.items():
        ok = "yes" if r["peak_rss_over_model"] < 0.5 else "no"
        print(
            f"{layout:10} {r['loss_max_rel_diff']:18.2e} {r['peak_rss_max'] / 1e9:14.2f} GB "
            f"{r['peak_rss_over_model']:8.3f} {ok:>6}"
        )
    import torch
    from common import machine

    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(
        json.dumps(
            {"machine": machine(torch.device("cpu")), "glibc": glibc, "reference": ref, "layouts": rows},
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
