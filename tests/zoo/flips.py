"""Which ReLU decisions float32 torch takes otherwise than float64, per layout and thread count:
`python tests/zoo/flips.py ENTRY[@SHAPE] [--batch N]`.

The diagnosis behind tests/zoo/test_kinks.py: when a gradient check fails at one shape or
thread count only, a ReLU whose input lies within float32 rounding of zero is the usual cause
(float32 takes either side of the kink, float64 one). This prints, for each configuration of
`harness.torch_configs`, every `nn.ReLU` module whose input sign differs from float64 and the
largest such input's distance from zero relative to the module's largest input. Functional
ReLUs (`F.relu` inside a forward) are not hooked.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (for `zoo`)
sys.path.insert(1, str(Path(__file__).resolve().parents[2]))  # the repo (for `programs`)

import torch  # noqa: E402

from zoo import harness, models  # noqa: E402


def relu_inputs(module: torch.nn.Module, inputs: tuple, *, double: bool, channels_last: bool) -> dict:
    """Every nn.ReLU module's input of one forward, by module path."""
    m = copy.deepcopy(module)
    xs = tuple(harness._double(x) for x in inputs) if double else tuple(inputs)
    if double:
        m = m.double()
    if channels_last:
        m = m.to(memory_format=torch.channels_last)
        xs = tuple(x.contiguous(memory_format=torch.channels_last) if x.dim() == 4 else x for x in xs)
    seen: dict[str, torch.Tensor] = {}

    def keep(name: str):
        return lambda _module, args: seen.__setitem__(name, args[0].detach().clone())

    for name, sub in m.named_modules():
        if isinstance(sub, torch.nn.ReLU):
            sub.register_forward_pre_hook(keep(name))
    with torch.no_grad():
        m(*xs)
    return seen


def flips(module: torch.nn.Module, inputs: tuple) -> list[tuple[bool, int, str, int, float]]:
    """(channels_last, threads, module, flipped count, largest float64 |input| / max) rows."""
    truth = relu_inputs(module, inputs, double=True, channels_last=False)
    rows = []
    for cl, n in harness.torch_configs(module):
        with harness.threads(n):
            got = relu_inputs(module, inputs, double=False, channels_last=cl)
        for name, ref in truth.items():
            flipped = (got[name] > 0) != (ref > 0)
            if flipped.any():
                margin = (ref[flipped].abs().max() / ref.abs().max()).item()
                rows.append((cl, n, name, int(flipped.sum()), margin))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("entry", help="a zoo entry, NAME or NAME@SHAPE")
    ap.add_argument("--batch", type=int, default=harness.CHECK_BATCH, help="batch size (default 3)")
    args = ap.parse_args()
    entry = models.get(args.entry)
    rows = flips(entry.build(0.0), entry.inputs(args.batch, 1))
    for cl, n, name, count, margin in rows:
        layout = "channels-last" if cl else "NCHW"
        print(f"{layout:13} {n} thread(s)  {name}: {count} flipped, float64 input {margin:.1e} of its max")
    if not rows:
        print("no ReLU decision differs from float64")
    return 0


if __name__ == "__main__":
    sys.exit(main())
