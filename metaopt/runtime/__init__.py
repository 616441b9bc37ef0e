"""Running programs: executor, places, memory accounting."""

from metaopt.runtime.executor import Executor, Scope
from metaopt.runtime.place import CPUPlace, CUDAPlace

__all__ = ["CPUPlace", "CUDAPlace", "Executor", "Scope"]
