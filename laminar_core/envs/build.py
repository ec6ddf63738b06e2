"""From the run's ``env:`` section to a ready-to-start environment.

The section (``EnvConfig``) names the environment plugin (kind ``env``), the settings every
environment shares (``max_turns``, ``timeout_s``), the tool-call parser (kind ``parser``) and
its options, and the plugin's own ``options``, validated against the plugin class's
``Options`` dataclass so a typo fails before anything starts, naming the key path.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

from laminar_core.config.loader import ConfigError, check_keys, structured
from laminar_core.config.schema import EnvConfig
from laminar_core.interfaces.environment import EnvContext, Environment, ToolCallParser
from laminar_core.plugins import PluginManager, UnknownPluginError, default_manager

__all__ = [
    "EnvConfig",
    "environment_class",
    "environment_options",
    "make_environment",
    "make_parser",
]


def make_parser(
    name: str, options: dict[str, Any] | None = None, pm: PluginManager | None = None
) -> ToolCallParser:
    """The registered parser ``name`` built with ``options``; ``ConfigError`` otherwise."""
    try:
        factory = (pm or default_manager()).get("parser", name)
    except UnknownPluginError as e:
        raise ConfigError(f"env.parser: {e}") from None
    try:
        parser = factory(**(options or {}))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"env.parser_options for parser {name!r}: {e}") from None
    if not isinstance(parser, ToolCallParser):
        raise ConfigError(f"env.parser: {name!r} did not build a ToolCallParser")
    return parser


def environment_class(name: str, pm: PluginManager | None = None) -> type[Environment]:
    """The registered environment ``name``; ``ConfigError`` naming the known ones otherwise."""
    try:
        return cast("type[Environment]", (pm or default_manager()).get("env", name))
    except UnknownPluginError as e:
        raise ConfigError(f"env.name: {e}") from None


def environment_options(
    name: str, raw: dict[str, Any] | None, pm: PluginManager | None = None
) -> Any:
    """``raw`` (``env.options``) validated against environment ``name``'s ``Options``."""
    cls = environment_class(name, pm)
    options_cls = getattr(cls, "Options", None)
    if raw is not None and not isinstance(raw, dict):
        raise ConfigError(f"config key 'env.options' must be a mapping; got {raw!r}")
    if options_cls is None or not dataclasses.is_dataclass(options_cls):
        if raw:
            raise ConfigError(f"config key 'env.options': environment {name!r} takes no options")
        return None
    check_keys(raw or {}, options_cls, "env.options", {})
    return structured(options_cls, raw or {}, "env.options")


def make_environment(cfg: EnvConfig, pm: PluginManager | None = None) -> Environment:
    """Build (not start) the environment ``cfg`` names. Raises ``ConfigError`` on bad input."""
    if not cfg.name:
        raise ConfigError("env.name: no environment configured")
    if cfg.max_turns < 1:
        raise ConfigError(f"env.max_turns must be >= 1, got {cfg.max_turns}")
    if not cfg.timeout_s > 0:
        raise ConfigError(f"env.timeout_s must be > 0, got {cfg.timeout_s}")
    pm = pm or default_manager()
    cls = environment_class(cfg.name, pm)
    ctx = EnvContext(
        max_turns=cfg.max_turns,
        timeout_s=float(cfg.timeout_s),
        parser=make_parser(cfg.parser, dict(cfg.parser_options), pm),
        options=environment_options(cfg.name, dict(cfg.options), pm),
    )
    env = cls(ctx)
    if not isinstance(env, Environment):
        raise ConfigError(f"env.name: {cfg.name!r} did not build an Environment")
    return env
