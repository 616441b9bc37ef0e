"""The model zoo (see models.py); `python tests/zoo/table.py` runs all of it and prints a table."""

from metaopt.compat import make_torchvision_importable

make_torchvision_importable()  # before transformers, which imports torchvision when present
