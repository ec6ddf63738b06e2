"""Structured run config: schema, loading, overrides, validation."""

from laminar_core.config.loader import (
    ConfigError,
    ResolvedConfig,
    apply_overrides,
    load_config,
    make_schedule,
    resolve,
)
from laminar_core.config.schema import LaminarConfig

__all__ = [
    "ConfigError",
    "LaminarConfig",
    "ResolvedConfig",
    "apply_overrides",
    "load_config",
    "make_schedule",
    "resolve",
]
