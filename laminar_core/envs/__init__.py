"""Environments for multi-turn rollouts: tool-call parsers and building from config.

The interface lives in :mod:`laminar_core.interfaces.environment`; environments are plugins
(kind ``env``), parsers too (kind ``parser``: core ships ``code`` and ``tool_call``).
"""

from laminar_core.envs.build import (
    EnvConfig,
    environment_class,
    environment_options,
    make_environment,
    make_parser,
)
from laminar_core.envs.parsers import CodeBlockParser, JsonToolCallParser

__all__ = [
    "CodeBlockParser",
    "EnvConfig",
    "JsonToolCallParser",
    "environment_class",
    "environment_options",
    "make_environment",
    "make_parser",
]
