"""Issue 14 item 3: the same models on both sides, one training step, time and peak memory.

    python benchmarks/hf_models_step.py [--models gpt2,bert,llama,resnet50] [--rounds 3] [--steps 6]
                                        [--warm 2] [--quick] [--device cpu|cuda] [--json out.json]

Models (built from configs, random weights, no downloads), each wrapped so forward returns the loss:
  gpt2      Hugging Face GPT2LMHeadModel: width 256, 4 layers, 4 heads, causal-LM loss
  bert      Hugging Face BertForMaskedLM: width 256, 4 layers, 4 heads, FFN 1024, MLM loss on ~15%
            of the tokens (the rest labelled -100)
  llama     Hugging Face LlamaForCausalLM from a tiny config: width 256, 4 layers, 4 heads (2 KV
            heads: grouped-query attention), SwiGLU FFN 704, RMSNorm, rotary embeddings
  resnet50  torchvision resnet50 (1000 classes), cross-entropy, 224x224 images
The three transformers: seq 512, batch 4, vocab 8192, SDPA attention, every dropout 0.1 the model
has (LLaMA has attention dropout only), no KV cache. ResNet-50: batch 8 (it has no dropout;
BatchNorm in training mode). `--quick` shrinks everything (seq 64, width 64, 2 layers, batch 2,
vocab 512, images 64x64) so a dry run of every model takes a few minutes.

Configurations, each in a fresh process (a worker mode of this script), interleaved round by round:
  eager              torch eager + torch.optim.Adam (lr 1e-4)
  metaopt            metaopt.export + fleet.distributed_optimizer(Adam(1e-4), strategy).minimize,
                     run by metaopt.Executor
  torch_ckpt         eager with torch.utils.checkpoint(use_reentrant=False) around every block
  metaopt_recompute  fleet recompute with one checkpoint at every block's output (the same blocks:
                     "m.transformer.h.*", "m.bert.encoder.layer.*", "m.model.layers.*",
                     "m.layer1.*" ... "m.layer4.*") and at the head's ("m.transformer.drop",
                     "m.bert.embeddings", "m.model.embed_tokens", "m.maxpool"), with
                     recompute_head=False: the head is held and each block re-run, as torch does
Each process: `--warm` untimed steps, then `--steps` timed ones; it reports their median. The table
gives the median over rounds and the ratios metaopt / eager and metaopt_recompute / torch_ckpt.

Memory, measured the same way on both sides:
  CPU   peak RSS of the process while it trains, minus its RSS just before the first step (after
        imports and building: for metaopt after export + minimize, with the torch module deleted).
        The kernel's high-water mark is reset at that point (writing 5 to /proc/self/clear_refs,
        which resets both VmHWM and getrusage's ru_maxrss), so the one-off peak of the ONNX export
        does not count; where the reset is refused the row says so and the raw ru_maxrss is used.
  CUDA  torch.cuda.max_memory_allocated over the training steps (peak stats reset after building:
        params, grads, optimizer state and activations all count, on both sides).
Beside it, for metaopt, the executor's own accounting (exe.memory_stats(): peak live bytes, and
that minus the persistables). Note the executor copies each param into its scope on the first run
while the program keeps its values, so metaopt's RSS increase holds one more copy of the params
than torch's (the `param MiB` column gives their size).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "tests"))  # the zoo's torchvision workaround

MODELS = ("gpt2", "bert", "llama", "resnet50")
CONFIGS = ("eager", "metaopt", "torch_ckpt", "metaopt_recompute")
RECOMPUTE = {"torch_ckpt", "metaopt_recompute"}


@dataclass(frozen=True)
class Shape:
    seq: int
    width: int
    layers: int
    heads: int
    batch: int
    vocab: int
    image: int
    image_batch: int
    dropout: float = 0.1


FULL = Shape(seq=512, width=256, layers=4, heads=4, batch=4, vocab=8192, image=224, image_batch=8)
QUICK = Shape(seq=64, width=64, layers=2, heads=4, batch=2, vocab=512, image=64, image_batch=2)


# ---------------------------------------------------------------- models (same on both sides)


class _LMLoss(torch.nn.Module):
    """input_ids, labels -> the loss HF computes (the attribute `m` prefixes every name)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.m(input_ids=input_ids, labels=labels, use_cache=False).loss


class _ClassifyLoss(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.m(images), labels)


def _importable() -> None:
    # transformers imports torchvision when installed; its C extension (a CUDA build here) does
    # not load with this torch: the zoo's workaround declares the op schemas its import needs.
    from zoo.tv import make_torchvision_importable

    make_torchvision_importable()


def _hf(name: str, s: Shape) -> torch.nn.Module:
    import transformers

    common = {"vocab_size": s.vocab, "attn_implementation": "sdpa", "use_cache": False}
    if name == "gpt2":
        cfg = transformers.GPT2Config(
            n_embd=s.width, n_layer=s.layers, n_head=s.heads, n_positions=s.seq,
            resid_pdrop=s.dropout, embd_pdrop=s.dropout, attn_pdrop=s.dropout,
            bos_token_id=s.vocab - 1, eos_token_id=s.vocab - 1, **common,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(cfg)
    if name == "bert":
        cfg = transformers.BertConfig(
            hidden_size=s.width, num_hidden_layers=s.layers, num_attention_heads=s.heads,
            intermediate_size=4 * s.width, max_position_embeddings=s.seq, pad_token_id=0,
            hidden_dropout_prob=s.dropout, attention_probs_dropout_prob=s.dropout, **common,
        )  # fmt: skip
        return transformers.BertForMaskedLM(cfg)
    # LLaMA: FFN width 8/3 of the model's, rounded up to a multiple of 64 (LLaMA's own rule)
    ffn = -(-8 * s.width // 3 // 64) * 64
    cfg = transformers.LlamaConfig(
        hidden_size=s.width, intermediate_size=ffn, num_hidden_layers=s.layers,
        num_attention_heads=s.heads, num_key_value_heads=max(1, s.heads // 2),
        max_position_embeddings=s.seq, attention_dropout=s.dropout, **common,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


def build(name: str, s: Shape) -> tuple[torch.nn.Module, dict[str, torch.Tensor], list[str], list]:
    """(module in train mode, feed by forward's argument names, checkpoint patterns, blocks).

    The patterns and the blocks name the same modules: metaopt checkpoints each block's output,
    and the head's (the stem's, the embeddings'), whose ops it holds (recompute_head=False),
    torch.utils.checkpoint wraps each block."""
    _importable()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "resnet50":
        import torchvision

        model = _ClassifyLoss(torchvision.models.resnet50()).train()
        images = torch.randn(s.image_batch, 3, s.image, s.image, generator=g)
        feed = {"images": images, "labels": torch.randint(0, 1000, (s.image_batch,), generator=g)}
        stages = [model.m.layer1, model.m.layer2, model.m.layer3, model.m.layer4]
        patterns = ["m.maxpool"] + [f"m.layer{i}.*" for i in range(1, 5)]
        return model, feed, patterns, [b for stage in stages for b in stage]
    model = _LMLoss(_hf(name, s)).train()
    ids = torch.randint(1, s.vocab, (s.batch, s.seq), generator=g)
    labels = ids.clone()
    if name == "bert":  # masked LM: a loss on ~15% of the positions, as BERT's pretraining
        labels[torch.rand(s.batch, s.seq, generator=g) >= 0.15] = -100
        labels[:, 0] = ids[:, 0]  # at least one target per row
    feed = {"input_ids": ids, "labels": labels}
    blocks = {"gpt2": "m.transformer.h", "bert": "m.bert.encoder.layer", "llama": "m.model.layers"}[name]
    head = {"gpt2": "m.transformer.drop", "bert": "m.bert.embeddings", "llama": "m.model.embed_tokens"}[name]
    return model, feed, [head, f"{blocks}.*"], list(model.get_submodule(blocks))


def _checkpoint_each(blocks: list[torch.nn.Module]) -> None:
    from torch.utils.checkpoint import checkpoint

    for block in blocks:
        forward = block.forward

        def run(*args, _forward=forward, **kwargs):
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        block.forward = run


# ---------------------------------------------------------------- worker: one configuration


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def _reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark (VmHWM and ru_maxrss) to the current RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def worker(
    model_name: str, config: str, s: Shape, steps: int, warm: int, device: str, fused: bool = False
) -> dict:
    """Run one configuration in this (fresh) process; its measurements as a dict."""
    dev = torch.device(device)
    model, feed, patterns, blocks = build(model_name, s)
    out: dict = {"model": model_name, "config": config, "param_bytes": _param_bytes(model)}
    feed = {k: v.to(dev) for k, v in feed.items()}
    t0 = time.perf_counter()
    if config.startswith("metaopt"):
        step, exe = _metaopt_step(model, feed, patterns, config == "metaopt_recompute", dev, out, fused)
        del model  # the program holds what training needs, as a user's script would after export
    else:
        if config == "torch_ckpt":
            _checkpoint_each(blocks)
        model.to(dev)
        step, exe = _eager_step(model, feed, fused), None
    out["build_s"] = time.perf_counter() - t0
    gc.collect()

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    out["rss_before_kib"] = _rss_kib()
    out["rss_reset"] = _reset_peak_rss()
    times, losses = [], []
    for _ in range(warm + steps):
        t = time.perf_counter()
        losses.append(step())  # the loss as a Python float: both sides wait for the step's end
        times.append(time.perf_counter() - t)
    out["rss_peak_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    out["rss_delta_kib"] = out["rss_peak_kib"] - out["rss_before_kib"]
    if dev.type == "cuda":
        out["cuda_max_allocated"] = torch.cuda.max_memory_allocated(dev)
    if exe is not None:
        stats = exe.memory_stats()
        out["exe_peak_bytes"] = stats["peak_bytes"]
        out["exe_activation_bytes"] = stats["peak_bytes"] - stats["persistable_bytes"]
    out.update(step_times=times[warm:], median_s=statistics.median(times[warm:]), losses=losses)
    return out


def _eager_step(model: torch.nn.Module, feed: dict, fused: bool = False):
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, fused=fused or None)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = model(**feed)
        loss.backward()
        opt.step()
        return loss.item()

    return step


def _metaopt_step(
    model, feed: dict, patterns: list[str], recompute: bool, dev, out: dict, fused: bool = False
):
    import metaopt
    from metaopt import fleet

    t = time.perf_counter()
    main = metaopt.export(model, tuple(feed[k].cpu() for k in feed))
    out["export_s"] = time.perf_counter() - t
    fleet.init(is_collective=True)
    strategy = fleet.DistributedStrategy()
    if recompute:
        strategy.recompute = True
        # torch.utils.checkpoint's placement: the head (stem, embeddings) held, each block re-run
        strategy.recompute_configs = {"checkpoints": patterns, "recompute_head": False}
    opt = fleet.distributed_optimizer(metaopt.optimizer.Adam(learning_rate=1e-4, fused=fused), strategy)
    opt.minimize(main.loss)
    out["ops"] = len(main.ops)
    out["applied"] = list(opt.applied_meta_list)
    if recompute:
        plan = opt.recompute_plan
        out["checkpoints"] = len(plan.checkpoints)
        out["recompute_plan"] = str(plan).splitlines()[0]
        out["recompute_skipped"] = [f"{n}: {why}" for n, why in plan.skipped]
    exe = metaopt.Executor(dev)
    loss = main.loss

    def step() -> float:
        (value,) = exe.run(main, feed=feed, fetch_list=[loss])
        return float(value)

    return step, exe


# ---------------------------------------------------------------- driver


def _run_worker(model: str, config: str, args) -> dict:
    return run_worker(__file__, {"model": model, "config": config}, args)


def run_worker(script: str, labels: dict[str, str], args) -> dict:
    """Run `script --worker a:b` (a, b: the labels' values) in a fresh process with `args`'
    steps, warm-up, device, threads and --quick; its JSON line, or the labels with the error
    (and the log's tail) when it fails or times out."""
    cmd = [sys.executable, script, "--worker", ":".join(labels.values()), "--steps", str(args.steps)]
    cmd += ["--warm", str(args.warm), "--device", args.device, "--threads", str(args.threads)]
    cmd += ["--quick"] if args.quick else []
    cmd += ["--fused-adam"] if getattr(args, "fused_adam", False) else []
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.worker_timeout)
    except subprocess.TimeoutExpired:
        return {**labels, "error": f"timed out after {args.worker_timeout} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-12:]
        return {**labels, "error": f"exit {proc.returncode}", "log_tail": tail}
    return json.loads(lines[-1])


def _median(runs: list[dict], key: str) -> float | None:
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _summary(results: dict[str, dict[str, list[dict]]], cuda: bool) -> dict[str, dict]:
    mem = "cuda_max_allocated" if cuda else "rss_delta_kib"
    scale = 2**20 if cuda else 2**10  # to MiB
    out = {}
    for model, by_config in results.items():
        row: dict = {}
        for config, runs in by_config.items():
            ok = [r for r in runs if "error" not in r]
            row[config] = {
                "median_s": _median(ok, "median_s"),
                "min_s": min((r["median_s"] for r in ok), default=None),
                "max_s": max((r["median_s"] for r in ok), default=None),
                "mem_mib": None if (m := _median(ok, mem)) is None else m / scale,
                "rss_before_mib": None if (b := _median(ok, "rss_before_kib")) is None else b / 2**10,
                "rss_peak_mib": None if (p := _median(ok, "rss_peak_kib")) is None else p / 2**10,
                "exe_peak_mib": None if (e := _median(ok, "exe_peak_bytes")) is None else e / 2**20,
                "exe_act_mib": None if (a := _median(ok, "exe_activation_bytes")) is None else a / 2**20,
                "failed": [r for r in runs if "error" in r],
            }
        c = row
        # Same model, same init, same data and (here) the same dropout stream: the first step's
        # loss should agree across configurations; its spread is shown as evidence, not asserted.
        first = [r["losses"][0] for runs in by_config.values() for r in runs if "error" not in r]
        row["first_loss_rel_spread"] = (max(first) - min(first)) / abs(min(first)) if first else None
        row["ratios"] = {
            "time_metaopt_vs_eager": _ratio(c["metaopt"]["median_s"], c["eager"]["median_s"]),
            "time_recompute_vs_ckpt": _ratio(c["metaopt_recompute"]["median_s"], c["torch_ckpt"]["median_s"]),
            "mem_metaopt_vs_eager": _ratio(c["metaopt"]["mem_mib"], c["eager"]["mem_mib"]),
            "mem_recompute_vs_ckpt": _ratio(c["metaopt_recompute"]["mem_mib"], c["torch_ckpt"]["mem_mib"]),
        }
        out[model] = row
    return out


def _f(x: float | None, fmt: str) -> str:
    """`x` formatted, or n/a padded to the same width."""
    return format("n/a", f">{fmt.split('.')[0]}") if x is None else format(x, fmt)


_DETAIL = [  # the detail table's cells after model and configuration: (summary key, format)
    ("median_s", "8.3f"), ("min_s", "7.3f"), ("max_s", "7.3f"), ("mem_mib", "18.1f"),
    ("rss_before_mib", "10.1f"), ("rss_peak_mib", "9.1f"), ("exe_peak_mib", "9.1f"), ("exe_act_mib", "9.1f"),
]  # fmt: skip


def _print(summary: dict, cuda: bool) -> None:
    mem = "CUDA max alloc MiB" if cuda else "RSS incr. MiB"
    print(f"\n{'model':9} {'configuration':18} {'step s':>8} {'min':>7} {'max':>7} {mem:>18} "
          f"{'RSS before':>10} {'RSS peak':>9} {'exe peak':>9} {'exe act.':>9}")  # fmt: skip
    for model, row in summary.items():
        for config in CONFIGS:
            r = row[config]
            if r["median_s"] is None:
                why = f"FAILED: {r['failed'][0].get('error')}" if r["failed"] else "not run"
                print(f"{model:9} {config:18} {why}")
                continue
            cells = [_f(r[key], fmt) for key, fmt in _DETAIL]
            print(f"{model:9} {config:18} " + " ".join(cells))
    print(f"\n{'model':9} {'metaopt/eager':>14} {'recompute/ckpt':>15} {'mem metaopt/eager':>18} "
          f"{'mem recompute/ckpt':>19} {'1st loss spread':>15}")  # fmt: skip
    for model, row in summary.items():
        q = row["ratios"]
        print(
            f"{model:9} {_f(q['time_metaopt_vs_eager'], '14.2f')} {_f(q['time_recompute_vs_ckpt'], '15.2f')} "
            f"{_f(q['mem_metaopt_vs_eager'], '18.2f')} {_f(q['mem_recompute_vs_ckpt'], '19.2f')} "
            f"{_f(row['first_loss_rel_spread'], '15.1e')}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {','.join(MODELS)}")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {','.join(CONFIGS)}")
    ap.add_argument("--rounds", type=int, help="fresh processes per configuration (default 3; --quick 1)")
    ap.add_argument("--steps", type=int, help="timed steps per process (default 6; --quick 3)")
    ap.add_argument("--warm", type=int, help="untimed steps first (default 2; --quick 1)")
    ap.add_argument("--quick", action="store_true", help="small shapes: a dry run")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads in every worker")
    ap.add_argument("--worker-timeout", type=int, default=1800, help="seconds per worker process")
    ap.add_argument("--fused-adam", action="store_true", help="Adam(fused=True) on both sides")
    ap.add_argument("--json", help="default benchmarks/results/hf_models_step[_quick][_cuda].json")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.steps = args.steps or (3 if args.quick else 6)
    args.warm = args.warm if args.warm is not None else (1 if args.quick else 2)
    shape = QUICK if args.quick else FULL
    if args.worker:
        torch.set_num_threads(args.threads)
        model, config = args.worker.split(":")
        print(json.dumps(worker(model, config, shape, args.steps, args.warm, args.device, args.fused_adam)))
        return

    models = _choose(args.models, MODELS, "--models")
    configs = _choose(args.configs, CONFIGS, "--configs")
    from common import machine

    results: dict[str, dict[str, list[dict]]] = {m: {c: [] for c in CONFIGS} for m in models}
    t0 = time.perf_counter()
    for rnd in range(args.rounds):
        for model in models:
            for config in configs:
                r = _run_worker(model, config, args)
                results[model][config].append(r)
                status = r.get("error") or f"{r['median_s']:.3f} s"
                print(f"round {rnd + 1}/{args.rounds} {model:9} {config:18} {status}", flush=True)
    cuda = args.device.startswith("cuda")
    summary = _summary(results, cuda)
    _print(summary, cuda)
    print(f"\n{shape}; {args.rounds} rounds x {args.steps} steps (+{args.warm} warm-up); "
          f"{time.perf_counter() - t0:.0f} s in all")  # fmt: skip
    for model, by_config in results.items():  # failures in full: a benchmark run is also a check
        for config, runs in by_config.items():
            for r in runs:
                if "error" in r:
                    tail = "\n  ".join(r.get("log_tail", []))
                    print(f"\n{model} {config} FAILED ({r['error']}):\n  {tail}")
    suffix = ("_quick" if args.quick else "") + ("_cuda" if cuda else "")
    path = Path(args.json or HERE / "results" / f"hf_models_step{suffix}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"shape": asdict(shape), "rounds": args.rounds, "steps": args.steps, "warm": args.warm,
            "fused_adam": args.fused_adam,
            "threads": args.threads, "date": time.strftime("%Y-%m-%d %H:%M"),
            "machine": machine(torch.device(args.device)), "load_average": os.getloadavg()}  # fmt: skip
    path.write_text(json.dumps({"meta": meta, "summary": summary, "runs": results}, indent=1))
    print(f"wrote {path}")


def _choose(given: str, known: tuple[str, ...], flag: str) -> list[str]:
    chosen = [x.strip() for x in given.split(",") if x.strip()]
    bad = [x for x in chosen if x not in known]
    if bad:
        import difflib

        close = difflib.get_close_matches(bad[0], known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise SystemExit(f"{flag}: unknown {bad[0]!r}{hint}; known: {', '.join(known)}")
    return chosen


if __name__ == "__main__":
    main()
