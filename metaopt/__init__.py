"""metaopt: a static-graph program-rewrite optimizer for training (Fleet-style), on torch + ONNX."""

from __future__ import annotations

from metaopt import fleet, optimizer
from metaopt.compat import make_torchvision_importable
from metaopt.fleet.pretrained import load_into
from metaopt.frontend.importer import load
from metaopt.frontend.onnx_save import save
from metaopt.frontend.torch_export import export
from metaopt.ir import Op, Program, Var, verify
from metaopt.ops import rng_streams
from metaopt.passes import for_test as _for_test  # noqa: F401 - Program.clone(for_test=True)
from metaopt.report import memory_picture
from metaopt.report.schedule_picture import schedule_picture
from metaopt.runtime import CPUPlace, CUDAPlace, Executor
from metaopt.runtime.hostsync import HostSyncError

__version__ = "0.1.0"

# A user's `from transformers import ...` after `import metaopt` must not fail on a torchvision
# built for another torch (metaopt/compat.py; nothing above imports torchvision). A no-op
# without torchvision, and with one whose extension loads.
make_torchvision_importable()


def seed(n: int) -> None:
    """Fix every random op's mask: seeds both RNG streams (metaopt/ops/rng_streams.py).

    The shared stream is torch's default generator of every device: ``torch.manual_seed(n)``.
    The model-parallel stream of MP rank r (random ops on split values in a tensor-parallel
    program) is seeded ``n + 2718 + r`` (Megatron's offset). Call it with the same `n` on every
    worker of a tensor-parallel job, so replicated values stay identical across MP ranks. A process
    seeded neither so nor by ``torch.manual_seed`` is seeded as ``seed(0)`` (with a warning) at a
    tensor-parallel program's first draw: torch seeds itself from the OS, differently per worker.
    """
    rng_streams.seed(n)


__all__ = [
    "CPUPlace",
    "CUDAPlace",
    "Executor",
    "HostSyncError",
    "Op",
    "Program",
    "Var",
    "export",
    "fleet",
    "load",
    "load_into",
    "memory_picture",
    "schedule_picture",
    "optimizer",
    "save",
    "seed",
    "verify",
]
