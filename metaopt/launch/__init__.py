"""metaoptrun: start a training job's workers under torch's elastic agent (``torchrun``'s),
with fleetrun's flags, environment (PADDLE_*) and logs (``log/workerlog.N``).

``metaoptrun --nproc_per_node=2 train.py --lr 0.1`` is ``python -m metaopt.launch ...``.
See docs/launcher.md.
"""

from __future__ import annotations

from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """The ``metaoptrun`` console script; returns the exit code."""
    from metaopt.launch.cli import main as cli_main  # torch's agent loads only when launching

    return cli_main(argv)


__all__ = ["main"]
