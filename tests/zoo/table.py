"""Run the whole zoo and print one table: `python tests/zoo/table.py [NAME ...] [--json FILE]`.

Every entry is exported and checked at its default input shape (float64 grads against float64
torch, float32 grads on 1 and 2 threads at batch 3 and at batch 1 ("torch" where float32
torch itself cannot train it at batch 1: BatchNorm over one value), SGD against torch.optim,
the same SGD with the updates inside the backward (optimizer_in_backward), gradient merge
against one torch step on the merged batches, recompute and offload bit-identity, a second
batch size, the fused LM-head cross-entropy, the eval program against torch's model.eval());
a failing check prints its reason and the table
says which check failed. Then each entry at its other input shapes (`Entry.shapes`: images of
64 and 72, 16 and 7 tokens; a row `NAME@SHAPE`) runs the shape-dependent checks (`SHAPED`).
`--no-shapes` skips them. Exit code 1 when any row fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (for `zoo`)
sys.path.insert(1, str(Path(__file__).resolve().parents[2]))  # the repo (for `programs`)

from zoo import harness, models  # noqa: E402

CHECKS = ("export", "f64", "grads", "batch1", "sgd", "early", "merge", "recompute", "fused_ce", "eval")
SHAPED = ("export", "f64", "grads", "batch1", "sgd")  # what an entry at another input shape runs


def run_entry(entry) -> dict:
    row: dict = {"name": entry.name, "family": entry.family, "why": entry.why}
    t0 = time.perf_counter()
    for check in CHECKS if entry.shape is None else SHAPED:
        try:
            if check == "export":
                _, program = harness.export(entry, 0.0)
                row["ops"] = len(program.ops)
                row["params"] = sum(1 for v in program.params())
            elif check == "f64":
                row["f64_rel"] = harness.check_grads_float64(entry)
            elif check == "grads":
                verdicts = harness.check_grads(entry)
                row["worst_ratio"] = max((v.ratio for v in verdicts), default=0.0)
            elif check == "batch1":  # a dynamic batch run at 1 (exported at 4)
                if entry.export_kwargs.get("dynamic_batch") is False:
                    row[check] = "fixed"
                    continue
                refused = harness.torch_refuses(entry, 1)
                if refused:  # torch cannot train it at batch 1 either
                    row[check], row["batch1_skipped"] = "torch", refused
                    continue
                harness.check_grads(entry, batch=1)
            elif check == "sgd":
                row["sgd_rel"] = harness.check_sgd(entry)
            elif check == "early":  # SGD with optimizer_in_backward (updates inside the backward)
                row["early_ratio"] = harness.check_sgd(entry, early_updates=True)
            elif check == "merge":
                row["merge_ratio"] = harness.check_gradient_merge(entry)
            elif check == "recompute":
                row.update(harness.check_recompute(entry))
            elif check == "fused_ce":  # the LM head + cross-entropy fused (0 fused: nothing to fuse)
                row.update(harness.check_fused_cross_entropy(entry))
            elif check == "eval":  # clone(for_test=True) against torch's model.eval()
                row["eval_rel"] = harness.check_eval(entry)
            row[check] = "ok"
        except Exception as e:  # the table reports every failure, the process goes on
            row[check] = "FAIL"
            row["error"] = f"{check}: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            row["traceback"] = traceback.format_exc()
            break
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def main() -> int:
    import export_cache

    # One export per model for the whole table (each check asks for it again).
    os.environ.setdefault(export_cache.ENV, tempfile.mkdtemp(prefix="metaopt-zoo-exports-"))
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("names", nargs="*", help="entries to run (default: all)")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("-v", action="store_true", help="print tracebacks of failures")
    ap.add_argument("--no-shapes", action="store_true", help="only each entry's default input shape")
    args = ap.parse_args()
    chosen = [e for e in models.entries() if not args.names or e.name in args.names]
    if not args.no_shapes:
        chosen = [v for e in chosen for v in e.variants()]
    rows = []
    print(f"{'model':20} {'family':16} " + " ".join(f"{c:9}" for c in CHECKS) + "  act ratio    s  error")
    for entry in chosen:
        row = run_entry(entry)
        rows.append(row)
        ratio = f"{row['recompute_act_peak'] / row['act_peak']:.2f}" if row.get("act_peak") else "-"
        print(
            f"{row['name']:20} {row['family']:16} "
            + " ".join(f"{row.get(c, '-'):9}" for c in CHECKS)
            + f"  {ratio:>10} {row['seconds']:5.1f}  {row.get('error', '')}",
            flush=True,
        )
        if args.v and "traceback" in row:
            print(row["traceback"])
    bad = [r for r in rows if "error" in r]
    print(f"{len(rows) - len(bad)} passed, {len(bad)} failed")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
