"""Laminar plugin system: engines discovered through pluggy (project ``"laminar"``).

Plugins implement hooks returning ``{name: factory}``, e.g.::

    from laminar_core.plugins import hookimpl

    @hookimpl
    def laminar_rollout_engines():
        return {"vllm": "laminar_vllm.engine:VLLMEngine"}

and are exposed through the ``"laminar"`` entry-point group.
"""

from laminar_core.plugins.hookspecs import KINDS, hookimpl
from laminar_core.plugins.manager import (
    PluginInfo,
    PluginLoadError,
    PluginManager,
    PluginResolveError,
    UnknownPluginError,
    default_manager,
    reset_default_manager,
)

__all__ = [
    "KINDS",
    "PluginInfo",
    "PluginLoadError",
    "PluginManager",
    "PluginResolveError",
    "UnknownPluginError",
    "default_manager",
    "hookimpl",
    "reset_default_manager",
]
