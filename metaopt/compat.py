"""Making a torchvision built for another torch importable, so transformers imports.

torchvision's wheel on PyPI is built against PyPI's (CUDA) torch. Beside a CPU torch
(``torch==2.13.0+cpu``) its C extension (the detection ops: nms, roi_align ...) does not load,
and ``import torchvision`` then fails with ``operator torchvision::nms does not exist``: its
Python code registers fake kernels for ``nms`` and ``qnms``, whose schemas the extension would
have defined. transformers imports torchvision whenever it is installed, so even
``from transformers import GPT2LMHeadModel`` fails. ``import metaopt`` runs
``make_torchvision_importable`` before anything imports torchvision: the two schemas are
declared, the import succeeds and the pure-Python models (every classification model) work.
Calling a detection op still fails loudly in torch ("no kernel"): nothing is faked beyond
the schema. With a torchvision that matches torch (its extension loads) nothing changes.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import torch

_SCHEMAS: torch.library.Library | None = None  # kept alive: it owns the declared schemas


@functools.cache
def make_torchvision_importable() -> bool:
    """Load torchvision's C extension, or declare the op schemas its import needs.

    False when torchvision is not installed; True when it is importable afterwards (or was
    already imported). Cheap (under a millisecond): one ``find_spec`` and one failed dlopen.
    """
    if "torchvision" in sys.modules:  # imported already: its extension loaded, or it failed as is
        return True
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return False
    for lib in sorted(Path(spec.origin).parent.glob("_C*.so")):
        try:
            torch.ops.load_library(str(lib))
            return True
        except OSError:  # built against another torch (a CUDA build beside a CPU torch)
            continue
    global _SCHEMAS
    _SCHEMAS = torch.library.Library("torchvision", "FRAGMENT")
    _SCHEMAS.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _SCHEMAS.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    return True
