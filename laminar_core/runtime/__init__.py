"""Runtimes: what starts a run's parts, where, and wires the loop around them.

``resolve`` resolves a config against the installed plugins (``load_config``); ``run`` holds
the seam (``Runtime``, ``Run``); ``wiring`` what every runtime shares (``RunSpec``,
``assemble``, ``attach_evaluation``); ``local`` runs everything in this process (simulator,
tests); ``ray_run`` places trainer ranks, replicas and node relays as Ray actors (``hosts`` are
the actors' code, ``proxies`` and ``relay_actor`` the driver's handles on them; ``zygote``
forks the actors' engine processes from one that imported their modules once); ``train`` is
``laminar train``.

The names below load on first use (PEP 562, as ``laminar_core``'s): a process that imports
one submodule (a thin host actor: ``runtime.hosts``) does not import the others (and torch
with them).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from laminar_core.runtime.local import LocalRuntime, build_local_run
    from laminar_core.runtime.placement import Placement, plan_placement
    from laminar_core.runtime.run import Run, Runtime, Started
    from laminar_core.runtime.wiring import RunSpec, assemble

_LAZY = {
    "LocalRuntime": "laminar_core.runtime.local",
    "build_local_run": "laminar_core.runtime.local",
    "Placement": "laminar_core.runtime.placement",
    "plan_placement": "laminar_core.runtime.placement",
    "Run": "laminar_core.runtime.run",
    "Runtime": "laminar_core.runtime.run",
    "Started": "laminar_core.runtime.run",
    "RunSpec": "laminar_core.runtime.wiring",
    "assemble": "laminar_core.runtime.wiring",
}

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


def __getattr__(name: str) -> Any:
    """Import a public name on first use and keep it in this module."""
    try:
        module = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'laminar_core.runtime' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
