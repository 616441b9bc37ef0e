"""Train a reference program on synthetic data with metaopt's static graph, Fleet style.

    python examples/train_static.py --program bert --steps 50 --batch 16
    python examples/train_static.py --program resnet --optimizer momentum --lr 0.05

Export -> fleet.distributed_optimizer(...).minimize(loss) -> Executor.run per step,
with a tqdm progress bar and a loss / throughput / peak-memory line every
--log-every steps; --save DIR writes a checkpoint (fleet.save_persistables) at the end
and --resume DIR continues from one: its params, optimizer state, step and RNG state, the
data from that step on, up to --steps in all (so 4 steps, then --resume to 8, trains as 8).
--eval-every N evaluates a held-out batch every N steps, Fleet's way: an eval program cloned
before minimize (``main.clone(for_test=True)``: dropout off, batch norm on its running stats,
nothing updated) run on the same executor, so it reads the trained values.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from tqdm import tqdm

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import metaopt  # noqa: E402
import programs  # noqa: E402
from metaopt import fleet  # noqa: E402

OPTIMIZERS = {
    "sgd": lambda lr: metaopt.optimizer.SGD(learning_rate=lr),
    "momentum": lambda lr: metaopt.optimizer.Momentum(learning_rate=lr, momentum=0.9),
    "adam": lambda lr: metaopt.optimizer.Adam(learning_rate=lr),
    "adamw": lambda lr: metaopt.optimizer.AdamW(learning_rate=lr, weight_decay=0.01),
}


def _at_least(low: int):
    """An argparse type: an int >= `low` (a bad flag is argparse's one-line error, exit 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is not >= {low}")
        return value

    parse.__name__ = f"int >= {low}"
    return parse


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--program", default="bert", choices=sorted(programs.REGISTRY))
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--steps", type=_at_least(1), default=30)
    ap.add_argument("--batch", type=_at_least(1), default=16)
    ap.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZERS))
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument(
        "--warmup", type=_at_least(0), default=0, help="linear warmup steps, then linear decay to 0"
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--log-every", type=_at_least(1), default=10)
    ap.add_argument("--save", metavar="DIR")
    ap.add_argument("--resume", metavar="DIR")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--eval-every",
        type=_at_least(0),
        default=0,
        help="evaluate a held-out batch every N steps (0: never)",
    )
    args = ap.parse_args()

    fleet.init(is_collective=True)
    mod = programs.get(args.program)
    model = mod.build(args.config, seed=args.seed)  # train mode, the config's dropout
    main_program = metaopt.export(model, mod.example_inputs(args.config, 2), name=args.program)

    lr = args.lr
    if args.warmup:
        lr = metaopt.optimizer.lr.LinearWarmupDecay(args.lr, warmup_steps=args.warmup, total_steps=args.steps)
    # Fleet's idiom: the eval program before minimize rewrites main (with a layout that rewrites the
    # params, ZeRO-3, tensor or pipeline parallel, clone it after minimize instead)
    test_program = main_program.clone(for_test=True)
    held_out = dict(zip(mod.INPUT_NAMES, mod.example_inputs(args.config, args.batch, seed=999), strict=True))
    strategy = fleet.DistributedStrategy()
    opt = fleet.distributed_optimizer(OPTIMIZERS[args.optimizer](lr), strategy)
    opt.minimize(main_program.loss)
    n_params = sum(main_program.values[v.name].numel() for v in main_program.params())
    print(f"{args.program}/{args.config}: {n_params:,} params, {len(main_program.ops)} ops after minimize")

    exe = metaopt.Executor(args.device)
    metaopt.seed(args.seed)  # before a resume: the checkpoint's RNG state replaces it
    start = 0
    if args.resume:
        fleet.load_persistables(exe, args.resume, main_program)
        start = int(exe.scope["global_step"])  # the optimizer's step counter, saved with the rest
        print(f"resumed from {args.resume} at step {start}")
    samples, t0 = 0, time.perf_counter()
    bar = tqdm(range(start, args.steps), desc="train", unit="step", initial=start, total=args.steps)
    for step in bar:
        batch = mod.example_inputs(args.config, args.batch, seed=1000 + step)
        feed = dict(zip(mod.INPUT_NAMES, batch, strict=True))
        (loss,) = exe.run(main_program, feed=feed, fetch_list=[main_program.loss])
        samples += args.batch
        bar.set_postfix(loss=f"{float(loss):.4f}")
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            elapsed = time.perf_counter() - t0
            stats = exe.memory_stats()
            tqdm.write(
                f"step {step + 1}: loss {float(loss):.4f}, {samples / elapsed:.1f} samples/s, "
                f"peak {_mib(stats['peak_bytes'])} (persistables {_mib(stats['persistable_bytes'])})"
            )
        if args.eval_every and ((step + 1) % args.eval_every == 0 or step + 1 == args.steps):
            (eval_loss,) = exe.run(test_program, feed=held_out, fetch_list=[test_program.loss])
            tqdm.write(f"step {step + 1}: train loss {float(loss):.4f}, eval loss {float(eval_loss):.4f}")
    if args.save:
        path = fleet.save_persistables(exe, args.save, main_program)
        print(f"saved {path}")


if __name__ == "__main__":
    main()
