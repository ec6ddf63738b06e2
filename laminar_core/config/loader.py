"""Reading, merging and checking a run config against the schema -- before anything starts.

Parsing only: YAML files (with ``include:``), ``key=value`` overrides, unknown and renamed
keys, types (OmegaConf) and value checks that need nothing but the schema
(``config.checks``). Resolving engine names and their options against the installed
plugins is ``runtime.resolve``, which produces the ``ResolvedConfig`` defined here.

Every error is a ``ConfigError`` whose one-line message names the full key path, the bad
value and, where there is one, a close match or the list of known alternatives.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from laminar_core.config.schema import ENGINE_SECTIONS, RENAMED, LaminarConfig


class ConfigError(ValueError):
    """A config that cannot run; the message says what and where."""


@dataclass
class ResolvedConfig:
    """A validated config: the dataclass tree plus the chosen engines' validated options
    (``runtime.resolve.resolve`` makes one)."""

    cfg: LaminarConfig
    engine_options: dict[str, Any] = field(default_factory=dict)  # section -> Options | None
    source: str = ""
    # algorithm.teacher's own config: the run's with the teacher's model and engine (its
    # replicas are built from it; ``runtime.resolve.resolve_teacher``); None: no teacher
    teacher: ResolvedConfig | None = None

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self.cfg)
        for section, opts in self.engine_options.items():
            if opts is not None:
                key = getattr(self.cfg, section)
                out[section][getattr(key, ENGINE_SECTIONS[section][0])] = dataclasses.asdict(opts)
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def close_match(word: str, options: typing.Iterable[str], prefix: str = "") -> str:
    """`` (did you mean 'x'?)`` for the closest of ``options``, or ``""``."""
    m = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f" (did you mean '{prefix}{m[0]}'?)" if m else ""


def read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file {p} not found") from None
    except OSError as e:
        raise ConfigError(f"config file {p}: cannot read ({e.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"config file {p}: malformed YAML{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {p}: the top level must be a mapping of sections, "
            f"got {type(data).__name__}"
        )
    return data


def apply_overrides(raw: dict[str, Any], overrides: typing.Iterable[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides (values parsed as YAML) to a nested dict, in place."""
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        try:
            parsed = yaml.safe_load(value) if value.strip() else ""
        except yaml.YAMLError:
            parsed = value
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {}
            node = child
        node[parts[-1]] = parsed
    return raw


def check_keys(raw: Any, schema: Any, path: str, extra: dict[str, set[str]]) -> None:
    """Reject keys the dataclass ``schema`` does not have (recursively), with a close match.

    ``extra`` maps a section path to additional allowed keys (engine option sections).
    """
    if not isinstance(raw, dict):
        return
    hints = typing.get_type_hints(schema)
    allowed = set(hints) | extra.get(path, set())
    for key, value in raw.items():
        full = f"{path}.{key}" if path else str(key)
        if key not in allowed and full in RENAMED:
            raise ConfigError(f"config key '{full}' was renamed: use {RENAMED[full]}")
        if key not in allowed:
            raise ConfigError(
                f"unknown config key '{full}'"
                f"{close_match(str(key), allowed, f'{path}.' if path else '')}; "
                f"known keys here: {', '.join(sorted(allowed))}"
            )
        hint = hints.get(key)
        if hint is not None and dataclasses.is_dataclass(hint):
            if value is not None and not isinstance(value, dict):
                raise ConfigError(
                    f"config key '{full}' must be a mapping of "
                    f"{', '.join(sorted(typing.get_type_hints(hint)))}; "
                    f"got {value!r}"
                )
            check_keys(value, hint, full, extra)
        elif hint is not None and typing.get_origin(hint) is list and isinstance(value, list):
            item_type = next(iter(typing.get_args(hint)), None)
            if item_type is not None and dataclasses.is_dataclass(item_type):
                for i, item in enumerate(value):
                    if item is not None and not isinstance(item, dict):
                        raise ConfigError(
                            f"config key '{full}[{i}]' must be a mapping of "
                            f"{', '.join(sorted(typing.get_type_hints(item_type)))}; "
                            f"got {item!r}"
                        )
                    check_keys(item, item_type, f"{full}[{i}]", extra)


def structured(schema: Any, raw: dict[str, Any], path: str) -> Any:
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), raw)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", "") or ""
        full = ".".join(x for x in (path, str(key)) if x)
        msg = str(e).splitlines()[0]
        raise ConfigError(f"config key '{full}': {msg}") from None
    except ValueError as e:  # an options dataclass's own ``__post_init__`` checks
        raise ConfigError(f"config key '{path}': {e}") from None


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        out[k] = (
            _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        )
    return out


def read_config_file(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a config file; a top-level ``include: other.yaml`` (relative to this file) is
    read first and this file's keys are merged over it."""
    p = Path(path).resolve()
    if p in _seen:
        raise ConfigError(f"config file {path}: include cycle through {p.name}")
    raw = read_yaml(path)
    inc = raw.pop("include", None)
    if inc is None:
        return raw
    if not isinstance(inc, str):
        raise ConfigError(f"config file {path}: 'include' must be a file name, got {inc!r}")
    return _deep_merge(read_config_file(Path(path).parent / inc, (*_seen, p)), raw)
