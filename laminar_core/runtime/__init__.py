"""Runtimes: what starts a run's parts, where, and wires the loop around them.

``resolve`` resolves a config against the installed plugins (``load_config``); ``run`` holds
the seam (``Runtime``, ``Run``); ``wiring`` what every runtime shares (``RunSpec``,
``assemble``, ``attach_evaluation``); ``local`` runs everything in this process (simulator,
tests); ``ray_run`` places trainer ranks, replicas and node relays as Ray actors (``hosts`` are
the actors' code, ``proxies`` and ``relay_actor`` the driver's handles on them); ``train`` is
``laminar train``.
"""

from laminar_core.runtime.local import LocalRuntime, build_local_run
from laminar_core.runtime.placement import Placement, plan_placement
from laminar_core.runtime.run import Run, Runtime, Started
from laminar_core.runtime.wiring import RunSpec, assemble

__all__ = [
    "LocalRuntime",
    "Placement",
    "Run",
    "RunSpec",
    "Runtime",
    "Started",
    "assemble",
    "build_local_run",
    "plan_placement",
]
