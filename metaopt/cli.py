"""`python -m metaopt show SOURCE`: print a program so a user can pick checkpoint names.
`python -m metaopt memory SOURCE --batch N --out DIR`: the memory picture of one step
(`metaopt.report`): live bytes over the ops, measured and predicted, and what is alive at
the peak; a PNG and an HTML page (hover for each op) under DIR.
`python -m metaopt plan SOURCE --devices N --memory 80GiB --global-batch B`: `fleet.plan`'s
ranked layouts of a job that fit (docs/planning.md), and what pruned the others.

SOURCE is an ONNX file, or ``module:function`` / ``module:function(args)`` (literal
arguments only) returning a Program or a ``(torch.nn.Module, inputs)`` pair.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import os
import sys
from collections import Counter

from metaopt.ir import Program
from metaopt.passes.memory_estimate import human_bytes


def resolve_source(source: str, *, training: bool) -> Program:
    """The Program a SOURCE names (see module docstring)."""
    import metaopt

    if os.path.exists(source) or source.endswith(".onnx"):
        return metaopt.load(source, training=training)
    target, _, call = source.partition(":")
    if not call:
        raise SystemExit(f"error: {source!r} is neither an ONNX file nor module:function")
    name, args, kwargs = call, (), {}
    if "(" in call:
        tree = ast.parse(call, mode="eval").body
        if not isinstance(tree, ast.Call) or not isinstance(tree.func, ast.Name):
            raise SystemExit(f"error: cannot read the call {call!r}")
        name = tree.func.id
        args = tuple(ast.literal_eval(a) for a in tree.args)
        kwargs = {k.arg: ast.literal_eval(k.value) for k in tree.keywords}
    sys.path.insert(0, os.getcwd())
    fn = getattr(importlib.import_module(target), name)
    result = fn(*args, **kwargs)
    if isinstance(result, Program):
        return result
    module, inputs = result
    return metaopt.export(module, inputs)


def summary(p: Program, batch: int) -> str:
    dims = {"batch": batch}
    roles = Counter(op.role for op in p.ops)
    params = p.params(trainable_only=False)
    n_params = sum(p.values[v.name].numel() for v in params if v.name in p.values)
    pbytes = sum(v.nbytes() or 0 for v in params)
    acts = [v for v in p.vars.values() if v.kind == "activation"]
    abytes = sum(v.nbytes(dims) or 0 for v in acts)
    lines = [
        f"# {p.name}: {len(p.ops)} ops ({', '.join(f'{r} {n}' for r, n in roles.items())}), "
        f"{len(p.vars)} vars",
        f"# params: {len(params)} tensors, {n_params:,} values, {human_bytes(pbytes)}",
        f"# activations at batch={batch}: {len(acts)} vars, {human_bytes(abytes)} if all were alive",
    ]
    if p.modules:
        lines.append("# module outputs (checkpoint candidates), bytes at this batch:")
        width = max(len(m) for m in p.modules)
        for m, outs in p.modules.items():
            size = sum(p.vars[o].nbytes(dims) or 0 for o in outs)
            lines.append(f"#   {m.ljust(width)}  {', '.join(outs)}  {human_bytes(size)}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """The command line; a refusal or a bad file is one line on stderr (exit 2), its traceback
    only with ``--debug``."""
    ap = argparse.ArgumentParser(prog="python -m metaopt")
    ap.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = ap.add_subparsers(dest="cmd", required=True)
    show = sub.add_parser("show", help="print a program in the golden text format, with a summary")
    show.add_argument("source", help="model.onnx, or module:function[(literal args)]")
    show.add_argument("--batch", type=int, default=8, help="batch size for the byte figures (default 8)")
    show.add_argument(
        "--onnx", metavar="OUT", help="also write the program as an ONNX file (Netron-readable)"
    )
    show.add_argument("--training", action="store_true", help="import an ONNX file with train-mode repairs")
    show.add_argument("--summary-only", action="store_true", help="print only the summary")
    _add_memory_parser(sub)
    _add_schedule_parser(sub)
    _add_plan_parser(sub)
    args = ap.parse_args(argv)
    try:
        return {"memory": _memory, "schedule": _schedule, "plan": _plan}.get(args.cmd, _show)(args)
    except Exception as e:  # noqa: BLE001 - the CLI's one line; --debug shows the rest
        if args.debug:
            raise
        text = " ".join(str(e).split()) or type(e).__name__
        sys.stderr.write(f"error: {type(e).__name__}: {text} (--debug for the traceback)\n")
        return 2


def _show(args: argparse.Namespace) -> int:
    program = resolve_source(args.source, training=args.training)
    if not args.summary_only:
        sys.stdout.write(str(program))
    sys.stdout.write(summary(program, args.batch))
    if args.onnx:
        from metaopt.frontend import onnx_save

        onnx_save.save(program, args.onnx)
        sys.stdout.write(f"# wrote {args.onnx}\n")
    return 0


def _add_schedule_parser(sub) -> None:  # noqa: ANN001 - argparse's subparsers action
    sch = sub.add_parser(
        "schedule",
        help="draw a pipeline schedule: a run's (the JSON metaopt.schedule_picture wrote) or a simulated one",
    )
    sch.add_argument(
        "source", nargs="?", help="a schedule picture's JSON (metaopt.schedule_picture(out=...))"
    )
    sch.add_argument(
        "--simulate", metavar="SCHEDULE", help="draw the simulator's run of this schedule instead"
    )
    sch.add_argument("--stages", type=int, default=4, help="with --simulate: workers (default 4)")
    sch.add_argument("--micro-batches", type=int, default=8, help="with --simulate: per step (default 8)")
    sch.add_argument(
        "--out", default="schedule_picture", help="folder for the files (default schedule_picture/)"
    )


def _schedule(args: argparse.Namespace) -> int:
    import json

    from metaopt.report.schedule_picture import SchedulePicture, simulated, write

    if (args.source is None) == (args.simulate is None):
        raise ValueError("schedule: give a schedule picture's JSON file or --simulate SCHEDULE (one of them)")
    if args.simulate is not None:
        pic = simulated(args.simulate, num_stages=args.stages, micro_batches=args.micro_batches)
    else:
        with open(args.source) as f:
            pic = SchedulePicture.from_json(json.load(f))
    print(pic.summary())
    for path in write(pic, args.out):
        print(f"wrote {path}")
    return 0


def _add_memory_parser(sub) -> None:  # noqa: ANN001 - argparse's subparsers action
    mem = sub.add_parser(
        "memory",
        help="plot live bytes over the ops of one step, measured and predicted (PNG + HTML page)",
    )
    mem.add_argument("source", help="model.onnx (a saved training program), or module:function[(args)]")
    mem.add_argument("--batch", type=int, default=8, help="binds the dim 'batch' (default 8)")
    mem.add_argument(
        "--dim", action="append", default=[], metavar="NAME=N", help="bind another symbolic dim (repeatable)"
    )
    mem.add_argument("--out", default="memory_picture", help="folder for the files (default memory_picture/)")
    mem.add_argument("--device", default="cpu", help="where to measure: cpu, cuda, cuda:1 (default cpu)")
    mem.add_argument("--no-measure", action="store_true", help="predicted only: do not run the program")
    mem.add_argument(
        "--max-bytes",
        type=int,
        default=None,
        help="refuse to measure a step predicted to peak above this (default 4 GiB: "
        "metaopt.limits.LoadLimits.max_run_bytes)",
    )
    mem.add_argument("--top", type=int, default=15, help="storages listed at the peak (default 15)")
    mem.add_argument("--training", action="store_true", help="import an ONNX file with train-mode repairs")


def _memory(args: argparse.Namespace) -> int:
    from metaopt.report import memory_picture

    dims = {"batch": args.batch}
    for item in args.dim:
        name, sep, value = item.partition("=")
        if not sep or not name or not value.strip().isdigit():
            raise SystemExit(f"error: --dim {item!r} is not NAME=N (N a whole number)")
        dims[name.strip()] = int(value)
    program = resolve_source(args.source, training=args.training)
    pic = memory_picture(
        program, dims=dims, device=args.device, measure=not args.no_measure, max_bytes=args.max_bytes
    )
    sys.stdout.write(pic.summary(n=args.top))
    try:
        files = pic.write(args.out)
    except ImportError as e:  # matplotlib missing: the summary above is still the answer
        sys.stderr.write(f"error: {e}\n")
        return 1
    sys.stdout.write("".join(f"# wrote {f}\n" for f in files))
    return 0


_OPTIMIZERS = ("adam", "adamw", "sgd", "momentum")


def _add_plan_parser(sub) -> None:  # noqa: ANN001 - argparse's subparsers action
    pl = sub.add_parser(
        "plan",
        help="the layouts of a job that fit each device's memory, fastest first (fleet.plan)",
    )
    pl.add_argument("source", help="model.onnx (a forward program with its loss), or module:function[(args)]")
    pl.add_argument("--devices", type=int, required=True, help="workers of the job")
    pl.add_argument("--memory", required=True, help="each device's memory: bytes, or 80GiB, 16GB, 512MiB")
    pl.add_argument("--global-batch", type=int, required=True, help="samples per step over the whole job")
    pl.add_argument(
        "--optimizer", default="adam", choices=_OPTIMIZERS, help="what minimize applies (default adam)"
    )
    pl.add_argument("--top", type=int, default=None, help="only the best N plans (default: all that fit)")
    pl.add_argument(
        "--capacity-factors",
        type=_factors,
        default=(),
        help="on a MoE model, expert capacities its expert-parallel layouts may also take, e.g. 1.25,2 "
        "(rows past an expert's capacity are dropped; default: none)",
    )
    pl.add_argument(
        "--amp",
        choices=("bfloat16", "float16"),
        default=None,
        help="the training's precision on every layout (strategy.amp; default: float32 throughout)",
    )


def _factors(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(f) for f in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of numbers, got {text!r}") from None


def _plan(args: argparse.Namespace) -> int:
    import metaopt
    from metaopt import fleet

    program = resolve_source(args.source, training=True)
    optimizer = {
        "adam": metaopt.optimizer.Adam,
        "adamw": metaopt.optimizer.AdamW,
        "sgd": metaopt.optimizer.SGD,
        "momentum": metaopt.optimizer.Momentum,
    }[args.optimizer](learning_rate=1e-3)
    plans = fleet.plan(
        program,
        devices=args.devices,
        memory_per_device=args.memory,
        global_batch=args.global_batch,
        optimizer=optimizer,
        top=args.top,
        capacity_factors=args.capacity_factors,
        amp=args.amp,
    )
    sys.stdout.write(f"{plans}\n")
    if plans:
        sys.stdout.write(f"# best: {plans[0].describe()}\n")
    return 0 if plans else 1
