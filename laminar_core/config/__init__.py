"""The run config: the schema (``schema``), parsing (``loader``) and schema-level checks
(``checks``). Resolving a config against the installed plugins (``load_config``) is
``laminar_core.runtime.resolve``; ``laminar_core.load_config`` is the public entry point."""

from laminar_core.config.loader import ConfigError, ResolvedConfig, apply_overrides
from laminar_core.config.schema import LaminarConfig

__all__ = ["ConfigError", "LaminarConfig", "ResolvedConfig", "apply_overrides"]
