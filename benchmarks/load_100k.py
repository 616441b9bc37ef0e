"""Load and first-run time of a 100k-node ONNX model (issue 17, item 7).

    python benchmarks/load_100k.py [--nodes 100000] [--kind chain|matmul] [--repeat 3]
                                   [--profile N] [--json out.json]

Builds the model with onnx.helper and serializes it (not timed), then in a fresh process
per repetition (first-time costs happen once per process) times: `metaopt.load(bytes)`,
the first `Executor("cpu").run` (plan built, then run), `Program.clone()` of the loaded
program, a second run, and building the plan compiled at once (what a run pays when an
interpreted plan compiles itself, runtime/plan.py); "cpu s" is the process's CPU time for
load + first run (wall time above it: other jobs had the cores). Prints one row per process
and the median; `--profile N` prints cProfile's top N functions of load + first run instead
(one process; slower).

Models: `chain` is Relu -> Mul(w) -> Add(x) repeated on a [4, 8] tensor (one param, one
op per node, one activation per op); `matmul` is MatMul(W_i) -> Relu layers of 8x8, each
layer its own param (as many ops, and 50k params to import and copy into the scope).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import time

import numpy as np
import onnx
import torch
from common import RESULTS, machine
from onnx import TensorProto, helper, numpy_helper

import metaopt
from metaopt.runtime.plan import build_plan

WIDTH = 8
BATCH = 4
COLUMNS = (
    "load_s",
    "first_run_s",
    "load_plus_first_run_s",
    "cpu_s",
    "clone_s",
    "second_run_s",
    "compiled_plan_s",
)


def chain_model(nodes: int) -> onnx.ModelProto:
    """Relu, Mul(w), Add(x) repeated: values stay in [0, 2|x|] however long the chain."""
    w = numpy_helper.from_array(np.full((WIDTH,), 0.5, np.float32), "w")
    out, ops = "x", []
    for i in range(nodes):
        kind = ("Relu", "Mul", "Add")[i % 3]
        extra = {"Relu": [], "Mul": ["w"], "Add": ["x"]}[kind]
        ops.append(helper.make_node(kind, [out, *extra], [f"h{i}"], name=f"n{i}"))
        out = f"h{i}"
    return _model(ops, [w], out)


def matmul_model(nodes: int) -> onnx.ModelProto:
    """MatMul(W_i) then Relu per layer: nodes // 2 layers, each with its own 8x8 weight."""
    rng = np.random.default_rng(0)
    inits, ops, out = [], [], "x"
    for i in range(nodes // 2):
        w = (rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"W{i}"))
        ops.append(helper.make_node("MatMul", [out, f"W{i}"], [f"m{i}"], name=f"mm{i}"))
        ops.append(helper.make_node("Relu", [f"m{i}"], [f"h{i}"], name=f"r{i}"))
        out = f"h{i}"
    return _model(ops, inits, out)


def _model(ops: list, inits: list, out: str) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [BATCH, WIDTH])
    y = helper.make_tensor_value_info(out, TensorProto.FLOAT, [BATCH, WIDTH])
    graph = helper.make_graph(ops, "load_100k", [x], [y], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def measure(data: bytes) -> dict:
    """One process's seconds: load, first run, clone, second run, a compiled plan; and the
    CPU seconds of load + first run (well under the wall time: other jobs took the cores)."""
    cpu0 = time.process_time()
    prog, load_s = _timed(lambda: metaopt.load(data))
    exe = metaopt.Executor("cpu")
    feed = {"x": torch.rand(BATCH, WIDTH)}
    fetch = [prog.outputs[0]]
    _, first_s = _timed(lambda: exe.run(prog, feed=feed, fetch_list=fetch))
    cpu_s = time.process_time() - cpu0
    _, clone_s = _timed(prog.clone)
    _, second_s = _timed(lambda: exe.run(prog, feed=feed, fetch_list=fetch))
    cpu = torch.device("cpu")
    _, compiled_s = _timed(lambda: build_plan(prog, fetch, cpu, True, exe.runtime, compile_now=True))
    return {
        "ops": len(prog.ops),
        "vars": len(prog.vars),
        "load_s": load_s,
        "first_run_s": first_s,
        "load_plus_first_run_s": load_s + first_s,
        "cpu_s": cpu_s,
        "clone_s": clone_s,
        "second_run_s": second_s,
        "compiled_plan_s": compiled_s,
    }


def profile(data: bytes, top: int) -> str:
    """cProfile's top `top` functions (cumulative) of load + first run."""
    prof = cProfile.Profile()
    prof.enable()
    prog = metaopt.load(data)
    metaopt.Executor("cpu").run(prog, feed={"x": torch.rand(BATCH, WIDTH)}, fetch_list=[prog.outputs[0]])
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(top)
    return buf.getvalue()


def _model_bytes(kind: str, nodes: int) -> bytes:
    return (chain_model if kind == "chain" else matmul_model)(nodes).SerializeToString()


def _child(args: argparse.Namespace) -> None:
    print(json.dumps(measure(_model_bytes(args.kind, args.nodes))))


def _fresh_process(args: argparse.Namespace) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--kind", args.kind]
    cmd += ["--nodes", str(args.nodes)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _print_table(rows: list[dict], median: dict) -> None:
    head = ("ops", "vars", "load s", "1st run s", "total s", "cpu s", "clone s", "2nd run s", "compiled s")
    print(f"{'process':>8} " + " ".join(f"{h:>10}" for h in head))
    for label, r in [*((str(i), r) for i, r in enumerate(rows)), ("median", median)]:
        cells = [f"{int(r['ops']):>10d}", f"{int(r['vars']):>10d}", *(f"{r[c]:>10.2f}" for c in COLUMNS)]
        print(f"{label:>8} " + " ".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=100_000)
    ap.add_argument("--kind", choices=("chain", "matmul"), default="chain")
    ap.add_argument("--repeat", type=int, default=3, help="fresh processes measured")
    ap.add_argument("--profile", type=int, default=0, help="print cProfile's top N instead (one process)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", default=os.path.join(RESULTS, "load_100k.json"))
    args = ap.parse_args()
    if args.child:
        return _child(args)
    if args.profile:
        return print(profile(_model_bytes(args.kind, args.nodes), args.profile))
    rows = [_fresh_process(args) for _ in range(args.repeat)]
    median = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    info = machine(torch.device("cpu"))
    where = f"{info['device']}, {info['threads']} threads"
    print(f"{args.nodes}-node {args.kind} model: load + first run ({where})")
    _print_table(rows, median)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        result = {"machine": info, "kind": args.kind, "nodes": args.nodes, "rows": rows, "median": median}
        json.dump(result, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
