"""Issue 14's case: one training step of a Hugging Face GPT-2, ours vs torch eager, same model.

    python benchmarks/hf_gpt2_step.py [--rounds 3] [--steps 6] [--json out.json]

GPT2LMHeadModel from a config (n_embd 256, 4 layers, 4 heads, seq 512, batch 4, vocab 8192,
dropout 0.1, SDPA attention), Adam. Every configuration runs in a fresh process (a worker mode of
this script), configurations interleaved round by round; each process prints the median of its
timed steps after warm-up, and the table gives the median over rounds and the ratio to eager.
Configurations: torch eager; metaopt as imported (fusions on); metaopt with the attention fusion
off (the exporter's decomposed attention), to show what that fusion buys.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

B, S, VOCAB = 4, 512, 8192
MODES = ("eager", "metaopt", "metaopt_unfused_attention")


def _model():
    # transformers imports torchvision when it is installed, whose C extension (a CUDA build
    # here) does not load: the zoo's workaround declares the op schemas its import needs.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from zoo.tv import make_torchvision_importable

    make_torchvision_importable()
    from torch import nn
    from transformers import GPT2Config, GPT2LMHeadModel

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            cfg = GPT2Config(
                n_embd=256, n_layer=4, n_head=4, n_positions=S, vocab_size=VOCAB,
                resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, attn_implementation="sdpa",
            )
            self.m = GPT2LMHeadModel(cfg)

        def forward(self, input_ids, labels):
            return self.m(input_ids=input_ids, labels=labels).loss

    torch.manual_seed(0)
    return LM().train()


def worker(mode: str, steps: int, warm: int) -> float:
    """Median seconds per step of `mode` in this process."""
    torch.set_num_threads(2)
    model = _model()
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(1))
    times = []
    if mode == "eager":
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        for _ in range(steps + warm):
            t = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            model(ids, ids).backward()
            opt.step()
            times.append(time.perf_counter() - t)
    else:
        import metaopt
        from metaopt.ops import registry

        if mode == "metaopt_unfused_attention":  # the Softmax row's rule is the attention fusion
            registry._TABLE["Softmax"] = dataclasses.replace(registry.get("Softmax"), fuse=None)
        main = metaopt.export(model, (ids, ids))
        metaopt.optimizer.Adam(learning_rate=1e-4).minimize(main.loss)
        exe = metaopt.Executor("cpu")
        for _ in range(steps + warm):
            t = time.perf_counter()
            exe.run(main, feed={"input_ids": ids, "labels": ids}, fetch_list=[main.loss])
            times.append(time.perf_counter() - t)
    return statistics.median(times[warm:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warm", type=int, default=2)
    ap.add_argument("--json")
    ap.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(f"{worker(args.worker, args.steps, args.warm):.6f}")
        return
    runs: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            cmd = [sys.executable, __file__, "--worker", mode, "--steps", str(args.steps)]
            cmd += ["--warm", str(args.warm)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            runs[mode].append(float(out.strip().splitlines()[-1]))
    eager = statistics.median(runs["eager"])
    rows = []
    print(f"{'configuration':28} {'step s (median)':>16} {'min':>7} {'max':>7} {'vs eager':>9}")
    for mode in MODES:
        med = statistics.median(runs[mode])
        rows.append({"mode": mode, "median_s": med, "runs": runs[mode], "vs_eager": med / eager})
        print(f"{mode:28} {med:16.3f} {min(runs[mode]):7.3f} {max(runs[mode]):7.3f} {med / eager:9.2f}")
    if args.json:
        meta = {"batch": B, "seq": S, "vocab": VOCAB, "rounds": args.rounds, "steps": args.steps}
        Path(args.json).write_text(json.dumps({"config": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
