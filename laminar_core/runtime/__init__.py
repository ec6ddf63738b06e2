"""Runtimes that wire components together: local objects now (simulator, tests)."""

from laminar_core.runtime.local import LocalRun, build_local_run
from laminar_core.runtime.placement import Placement, plan_placement

__all__ = ["LocalRun", "Placement", "build_local_run", "plan_placement"]
