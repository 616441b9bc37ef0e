"""fleet.plan at scale (issue 45): Llama-3-70B's shape on 1024 devices of 80 GiB, exported on meta.

    python benchmarks/plan_at_scale.py [--model llama-3-70b | deepseek-v3] [--devices 1024] [--memory 80GiB]
                                       [--seq 4096] [--global-batch 1024] [--top 10] [--workers N]
                                       [--json results/plan_at_scale.json]

The export (on the meta device: no value is made) is timed apart from the plan, as the issue
bounds the plan "once the program is exported". The plan runs over the whole grid with a declared
roofline (an H100-like device: `--flops`, `--bytes-per-s`; links `--link-bytes-per-s`,
`--link-latency`). Printed: the export's and the plan's seconds, how many layouts were
rewritten at 2 and 3 blocks per stage and how many whole, the ranked plans, and the best plan's
activations per layer beside Korthikanti et al. 2022's formula.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from common import RESULTS, LMLoss, machine

MODELS = {
    # Llama-3-70B (Meta's config.json): 80 layers, width 8192, GQA 64 heads / 8 KV heads
    "llama-3-70b": (
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(
            vocab_size=128256,
            hidden_size=8192,
            intermediate_size=28672,
            num_hidden_layers=80,
            num_attention_heads=64,
            num_key_value_heads=8,
            max_position_embeddings=8192,
            rope_theta=500000.0,
        ),
    ),
    # DeepSeek-V3 (transformers' DeepseekV3Config defaults are its config.json's): 61 layers, the
    # first 3 dense, 256 routed experts (8 a token) + 1 shared, MLA; 671B params
    "deepseek-v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", {}),
}


def export(name: str, seq: int):
    import metaopt

    transformers = __import__("transformers")
    model_class, config_class, config = MODELS[name]
    config = getattr(transformers, config_class)(**config)
    with torch.device("meta"):
        model = LMLoss(getattr(transformers, model_class)(config)).train()
    ids = torch.zeros(2, seq, dtype=torch.long, device="meta")
    return metaopt.export(model, (ids, ids))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3-70b", choices=sorted(MODELS))
    ap.add_argument("--devices", type=int, default=1024)
    ap.add_argument("--memory", default="80GiB")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--global-batch", type=int, default=1024)
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--workers", type=int, default=None, help="planner processes (default: fleet.plan's)")
    ap.add_argument("--flops", type=float, default=4e14, help="declared FLOP/s per device")
    ap.add_argument("--bytes-per-s", type=float, default=3e12, help="declared memory bytes/s per device")
    ap.add_argument("--link-bytes-per-s", type=float, default=5e10)
    ap.add_argument("--link-latency", type=float, default=1e-5)
    ap.add_argument(
        "--capacity-factors",
        default="",
        help="expert capacities the MoE layouts may also take, e.g. 1.25,2 (default: none)",
    )
    ap.add_argument("--amp", choices=("bfloat16", "float16"), default=None, help="every layout's precision")
    ap.add_argument("--json", default=str(os.path.join(RESULTS, "plan_at_scale.json")))
    args = ap.parse_args()

    import metaopt  # noqa: F401 - before transformers: it makes a mismatched torchvision importable
    from metaopt import fleet

    t0 = time.perf_counter()
    program = export(args.model, args.seq)
    exported = time.perf_counter() - t0
    t0 = time.perf_counter()
    plans = fleet.plan(
        program,
        devices=args.devices,
        memory_per_device=args.memory,
        global_batch=args.global_batch,
        device_flops=args.flops,
        device_bytes_per_s=args.bytes_per_s,
        link_bytes_per_s=args.link_bytes_per_s,
        link_latency_s=args.link_latency,
        top=args.top,
        workers=args.workers,
        capacity_factors=[float(f) for f in args.capacity_factors.split(",") if f],
        amp=args.amp,
    )
    planned = time.perf_counter() - t0
    print(plans)
    best = plans[0] if plans else None
    print(f"\nexport on meta: {exported:.1f} s; plan: {planned:.1f} s ({len(program.ops)} forward ops)")
    result = {
        "machine": machine(torch.device("cpu")),
        "args": vars(args),
        "export_s": exported,
        "plan_s": planned,
        "plans": [
            {"layout": p.layout.describe(), "peak_bytes": p.peak_bytes, "step_s": p.step_seconds}
            for p in plans
        ],
        "pruned": len(plans.pruned),
        "header": plans.header,
    }
    if best is not None and best.layers is not None:
        result["layers"] = {"ours": best.layers.bytes_per_layer, "korthikanti": best.layers.korthikanti()}
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
