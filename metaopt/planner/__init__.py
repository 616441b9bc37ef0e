"""The planner (issue 45): which layout of a job fits and is fastest, found before anything runs.

Above fleet (it rewrites simulated workers' programs with fleet's minimize and reads
`estimate_memory`), below the command line. `search`: the grid, each layout's figures, the ranked
plans; `calibrate`: the time model's rates, measured on the device; `blocks`: identical layers
solved once. ``fleet.plan`` is `search.plan` (Fleet's namespace, where users look for it).
"""

from metaopt.planner.calibrate import Rates
from metaopt.planner.search import Layout, Plan, PlanError, Plans, parse_bytes, plan

__all__ = ["Layout", "Plan", "PlanError", "Plans", "Rates", "parse_bytes", "plan"]
