"""Loading, overriding and validating a run config -- before anything starts.

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

import torch
import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from laminar_core.algorithms.config import validate_algorithm
from laminar_core.buffers.experience import SAMPLERS
from laminar_core.config.schema import ENGINE_SECTIONS, LaminarConfig
from laminar_core.loop.schedules import (
    Schedule,
    ScheduleError,
    schedule_flags,
    split_schedule_name,
)
from laminar_core.plugins import PluginManager, UnknownPluginError, default_manager

# synthetic: lengths only (simulator); jsonl/parquet: data.path; task: a registered generator
DATA_SOURCES = ("synthetic", "jsonl", "parquet", "task")


class ConfigError(ValueError):
    """A config that cannot run; the message says what and where."""


@dataclass
class ResolvedConfig:
    """A validated config: the dataclass tree plus the chosen engines' validated options."""

    cfg: LaminarConfig
    engine_options: dict[str, Any] = field(default_factory=dict)  # section -> Options | None
    source: str = ""

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self.cfg)
        for section, opts in self.engine_options.items():
            if opts is not None:
                key = getattr(self.cfg, section)
                out[section][getattr(key, ENGINE_SECTIONS[section][0])] = dataclasses.asdict(opts)
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def schedule(self, spec: str | None = None, pm: PluginManager | None = None) -> Schedule:
        return make_schedule(spec or self.cfg.schedule, self.cfg, pm or default_manager())


def _close(word: str, options: typing.Iterable[str], prefix: str = "") -> str:
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


def _check_keys(raw: Any, schema: type, path: str, extra: dict[str, set[str]]) -> None:
    """Reject keys the dataclass ``schema`` does not have (recursively), with a close match.

    ``extra`` maps a section path to additional allowed keys (engine option sections).
    """
    if not isinstance(raw, dict):
        return
    hints = typing.get_type_hints(schema)
    allowed = set(hints) | extra.get(path, set())
    for key, value in raw.items():
        full = f"{path}.{key}" if path else str(key)
        if key not in allowed:
            raise ConfigError(
                f"unknown config key '{full}'"
                f"{_close(str(key), allowed, f'{path}.' if path else '')}; "
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
            _check_keys(value, hint, full, extra)
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
                    _check_keys(item, item_type, f"{full}[{i}]", extra)


def _structured(schema: type, raw: dict[str, Any], path: str) -> Any:
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


def _engine_options(
    section: str, engine: str, raw: dict[str, Any] | None, pm: PluginManager
) -> Any:
    kind = ENGINE_SECTIONS[section][1]
    try:
        factory = pm.get(kind, engine)
    except UnknownPluginError as e:
        raise ConfigError(f"{section}.{ENGINE_SECTIONS[section][0]}: {e}") from None
    options_cls = getattr(factory, "Options", None)
    if raw is not None and not isinstance(raw, dict):
        raise ConfigError(
            f"config key '{section}.{engine}' must be a mapping of {kind} '{engine}' "
            f"options; got {raw!r}"
        )
    if options_cls is None:
        if raw:
            raise ConfigError(
                f"config key '{section}.{engine}': {kind} '{engine}' takes no options"
            )
        return None
    _check_keys(raw or {}, options_cls, f"{section}.{engine}", {})
    return _structured(options_cls, raw or {}, f"{section}.{engine}")


def make_schedule(spec: str, cfg: LaminarConfig, pm: PluginManager) -> Schedule:
    name, arg = split_schedule_name(spec)
    try:
        factory = pm.get("schedule", name)
    except UnknownPluginError as e:
        raise ConfigError(f"schedule: {e}") from None
    try:
        partial = "partial" in schedule_flags(spec)
        if partial and name != "stale":
            raise ScheduleError(f"'+partial' applies only to stale:K (got '{spec}')")
        return factory(
            arg,
            partial_rollout=cfg.rollout.partial_rollout or partial,
            max_ahead_batches=cfg.buffer.max_ahead_batches,
        )
    except ScheduleError as e:
        raise ConfigError(f"schedule: {e}") from None


def _positive(cfg: LaminarConfig) -> None:
    rules = [
        ("run.steps", cfg.run.steps, 0),
        ("data.prompts_per_step", cfg.data.prompts_per_step, 1),
        ("data.samples_per_prompt", cfg.data.samples_per_prompt, 1),
        ("data.size", cfg.data.size, 1),
        ("data.prompt_min_tokens", cfg.data.prompt_min_tokens, 1),
        ("cluster.gpus", cfg.cluster.gpus, 1),
        ("cluster.gpus_per_node", cfg.cluster.gpus_per_node, 1),
        ("cluster.gpus_per_replica", cfg.cluster.gpus_per_replica, 1),
        ("cluster.trainer_gpus", cfg.cluster.trainer_gpus, 1),
        ("rollout.max_tokens", cfg.rollout.max_tokens, 1),
        ("trainer.mini_batches", cfg.trainer.mini_batches, 1),
        ("repack.batch_limit", cfg.repack.batch_limit, 1),
        ("study.warmup_steps", cfg.study.warmup_steps, 0),
    ]
    for key, value, low in rules:
        if value < low:
            raise ConfigError(f"{key} must be >= {low} (got {value})")
    for key, value in [
        ("rollout.heartbeat_s", cfg.rollout.heartbeat_s),
        ("rollout.heartbeat_timeout_s", cfg.rollout.heartbeat_timeout_s),
        ("model.params_b", cfg.model.params_b),
        ("buffer.max_ahead_batches", cfg.buffer.max_ahead_batches),
    ]:
        if not value > 0:
            raise ConfigError(f"{key} must be > 0 (got {value})")
    for key, value in [
        ("repack.interval_s", cfg.repack.interval_s),
        ("rollout.partial_sync_s", cfg.rollout.partial_sync_s),
        ("relay.chunks", cfg.relay.chunks),
        ("relay.bucket_mb", cfg.relay.bucket_mb),
    ]:
        if value < 0:
            raise ConfigError(f"{key} must be >= 0 (got {value})")
    if cfg.data.prompt_max_tokens < cfg.data.prompt_min_tokens:
        raise ConfigError(
            f"data.prompt_max_tokens ({cfg.data.prompt_max_tokens}) must be >= "
            f"data.prompt_min_tokens ({cfg.data.prompt_min_tokens})"
        )
    if not 0 < cfg.repack.kv_limit <= 1:
        raise ConfigError(f"repack.kv_limit must be in (0, 1] (got {cfg.repack.kv_limit})")
    if cfg.rollout.max_concurrent < cfg.data.samples_per_prompt:
        raise ConfigError(
            f"rollout.max_concurrent ({cfg.rollout.max_concurrent}) must be >= "
            f"data.samples_per_prompt ({cfg.data.samples_per_prompt}): a group "
            "is placed on one replica"
        )
    c = cfg.cluster
    if c.trainer_gpus >= c.gpus:
        raise ConfigError(
            f"cluster.trainer_gpus ({c.trainer_gpus}) must be < cluster.gpus "
            f"({c.gpus}): the rest run rollout replicas"
        )
    if (c.gpus - c.trainer_gpus) < c.gpus_per_replica:
        raise ConfigError(
            f"cluster: {c.gpus - c.trainer_gpus} rollout GPUs cannot hold one "
            f"replica of cluster.gpus_per_replica={c.gpus_per_replica}"
        )


RUNTIME_KINDS = ("local", "ray")


def _validate_runtime(cfg: LaminarConfig) -> None:
    rt = cfg.runtime
    if rt.kind not in RUNTIME_KINDS:
        hint = difflib.get_close_matches(rt.kind, RUNTIME_KINDS, n=1)
        extra = f" (did you mean '{hint[0]}'?)" if hint else ""
        raise ConfigError(
            f"runtime.kind: unknown '{rt.kind}'{extra}; known: {', '.join(RUNTIME_KINDS)}"
        )
    for key, value in [
        ("runtime.cpus_per_trainer", rt.cpus_per_trainer),
        ("runtime.cpus_per_replica", rt.cpus_per_replica),
        ("runtime.gpus_per_trainer", rt.gpus_per_trainer),
        ("runtime.gpus_per_replica", rt.gpus_per_replica),
        ("runtime.num_cpus", rt.num_cpus),
    ]:
        if value < 0:
            raise ConfigError(f"{key} must be >= 0 (got {value})")
    if not rt.start_timeout_s > 0:
        raise ConfigError(f"runtime.start_timeout_s must be > 0 (got {rt.start_timeout_s})")


def _validate_data_reward(cfg: LaminarConfig, pm: PluginManager) -> None:
    """``data.*`` / ``reward.*``: the source's own settings, task and reward names, options.

    Files are not opened here (a cluster reads them where the run starts); names and
    options are, so a typo fails before anything starts.
    """
    d, r = cfg.data, cfg.reward
    if d.max_prompt_tokens < 1:
        raise ConfigError(f"data.max_prompt_tokens must be >= 1 (got {d.max_prompt_tokens})")
    if not d.prompt_key:
        raise ConfigError("data.prompt_key must name the prompt column (e.g. prompt)")
    if d.source in ("jsonl", "parquet") and not d.path:
        raise ConfigError(
            f"data.source={d.source} needs a file: set data.path=/path/to/data.{d.source}"
        )
    if d.source == "task":
        try:
            factory = pm.get("task", d.task)
        except UnknownPluginError as e:
            raise ConfigError(f"data.task: {e}") from None
        options_cls = getattr(factory, "Options", None)
        if options_cls is not None and dataclasses.is_dataclass(options_cls):
            _check_keys(dict(d.task_options), options_cls, "data.task_options", {})
            _structured(options_cls, dict(d.task_options), "data.task_options")
    if not r.timeout_s > 0:
        raise ConfigError(f"reward.timeout_s must be > 0 (got {r.timeout_s})")
    if r.workers < 1:
        raise ConfigError(f"reward.workers must be >= 1 (got {r.workers})")
    if r.fn and ":" not in r.fn:
        try:
            pm.get("reward", r.fn)
        except UnknownPluginError as e:
            raise ConfigError(
                f"reward.fn: {e}; or give a function as 'package.module:function'"
            ) from None
    elif r.fn:
        from laminar_core.tasks.rewards import import_reward  # imports the user's module

        try:
            import_reward(r.fn)
        except ValueError as e:
            raise ConfigError(f"reward.fn: {e}") from None


def validate(cfg: LaminarConfig, pm: PluginManager) -> None:
    """Semantic checks across sections (types were checked by OmegaConf)."""
    _positive(cfg)
    if cfg.data.source not in DATA_SOURCES:
        raise ConfigError(
            f"data.source: unknown '{cfg.data.source}'; known: {', '.join(DATA_SOURCES)}"
            f"{_close(cfg.data.source, DATA_SOURCES)}"
        )
    _validate_data_reward(cfg, pm)
    _validate_runtime(cfg)
    if not isinstance(getattr(torch, cfg.model.dtype, None), torch.dtype):
        raise ConfigError(
            f"model.dtype: '{cfg.model.dtype}' is not a torch dtype; e.g. bfloat16, float16, "
            f"float32{_close(cfg.model.dtype, ('bfloat16', 'float16', 'float32'))}"
        )
    try:
        validate_algorithm(cfg.algorithm)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    for spec in [cfg.schedule, *cfg.study.schedules]:
        sched = make_schedule(spec, cfg, pm)
        if cfg.buffer.sampler not in ("auto", *SAMPLERS):
            raise ConfigError(
                f"buffer.sampler: unknown '{cfg.buffer.sampler}'; known: auto, "
                f"{', '.join(sorted(SAMPLERS))}{_close(cfg.buffer.sampler, SAMPLERS)}"
            )
        if sched.max_lag is not None and cfg.buffer.sampler == "fifo":
            raise ConfigError(
                f"buffer.sampler=fifo cannot bound staleness for schedule "
                f"'{spec}'; use auto or by_batch"
            )
    if cfg.rollout.partial_rollout and not any(
        split_schedule_name(s)[0] == "stale" for s in [cfg.schedule, *cfg.study.schedules]
    ):
        raise ConfigError(
            "rollout.partial_rollout applies only to the stale:K schedule "
            f"(schedule is '{cfg.schedule}')"
        )
    try:
        pm.get("repack", cfg.repack.policy)
    except UnknownPluginError as e:
        raise ConfigError(f"repack.policy: {e}") from None


def resolve(
    raw: dict[str, Any],
    overrides: typing.Iterable[str] = (),
    pm: PluginManager | None = None,
    source: str = "",
) -> ResolvedConfig:
    """Validate ``raw`` (a parsed YAML mapping) plus ``overrides`` into a ``ResolvedConfig``."""
    pm = pm or default_manager()
    raw = apply_overrides(dict(raw), overrides)
    extra = {section: set(pm.names(kind)) for section, (_, kind) in ENGINE_SECTIONS.items()}
    _check_keys(raw, LaminarConfig, "", extra)
    engine_raw: dict[str, dict[str, Any]] = {}
    plain = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    for section in ENGINE_SECTIONS:
        sec = plain.get(section)
        if isinstance(sec, dict):
            for name in list(sec):
                if name in extra[section]:
                    engine_raw.setdefault(section, {})[name] = sec.pop(name)
    cfg: LaminarConfig = _structured(LaminarConfig, plain, "")
    options = {}
    for section, (key, _) in ENGINE_SECTIONS.items():
        engine = getattr(getattr(cfg, section), key)
        options[section] = _engine_options(
            section, engine, engine_raw.get(section, {}).get(engine), pm
        )
    validate(cfg, pm)
    return ResolvedConfig(cfg, options, source)


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


def load_config(
    path: str | Path | None, overrides: typing.Iterable[str] = (), pm: PluginManager | None = None
) -> ResolvedConfig:
    """Read ``path`` (or start from defaults when ``None``), apply overrides, validate."""
    raw = read_config_file(path) if path is not None else {}
    return resolve(raw, overrides, pm, source=str(path or ""))
