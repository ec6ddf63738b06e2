"""Resolving a parsed config against the installed plugins: the step where engine names
become classes and each engine's section is validated by its own ``Options``.

``load_config(path, overrides)`` reads a file (``config.loader``), applies the overrides,
checks keys, types and values against the schema (``config.checks``), then here: the chosen
trainer, rollout engine and transport exist, implement their interface and their options
are valid, the schedule, repack policy, task and reward names exist, and the schedule fits
the sampler. The result is a ``ResolvedConfig``. Nothing starts before all of this passed.
Only the chosen engines' modules are imported (the plugins' lazy factories of the others
stay strings).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import typing
from pathlib import Path
from typing import Any

from laminar_core.algorithms.config import dynamic_sampling, validate_algorithm
from laminar_core.algorithms.filters import group_filter
from laminar_core.buffers.experience import SAMPLERS
from laminar_core.config.checks import check_values
from laminar_core.config.loader import (
    ConfigError,
    ResolvedConfig,
    apply_overrides,
    check_keys,
    close_match,
    read_config_file,
    structured,
)
from laminar_core.config.schema import ENGINE_SECTIONS, LaminarConfig
from laminar_core.interfaces import RepackPolicy, RolloutEngine, TrainerEngine, WeightTransport
from laminar_core.loop.schedules import (
    Schedule,
    ScheduleError,
    schedule_flags,
    split_schedule_name,
)
from laminar_core.plugins.hookspecs import KINDS
from laminar_core.plugins.manager import PluginManager, UnknownPluginError, default_manager

#: The interface a class registered for each kind implements.
INTERFACES: dict[str, type] = {
    "trainer": TrainerEngine,
    "rollout": RolloutEngine,
    "transport": WeightTransport,
    "repack": RepackPolicy,
}


def missing_methods(cls: type, interface: type) -> list[str]:
    """The abstract methods of ``interface`` that ``cls`` does not implement (sorted).

    A subclass must leave none abstract; a class that does not subclass the interface
    (duck typing) must at least have each of them."""
    if issubclass(cls, interface):
        return sorted(getattr(cls, "__abstractmethods__", ()))
    abstract = getattr(interface, "__abstractmethods__", ())
    return sorted(m for m in abstract if not callable(getattr(cls, m, None)))


def check_interface(kind: str, name: str, factory: Any, key: str) -> None:
    """``ConfigError`` (one line) when the class chosen at ``key`` does not implement its
    kind's interface, so a run fails here instead of with a traceback once its processes
    started. A factory that is not a class (a function) is checked when it is built."""
    interface = INTERFACES.get(kind)
    if interface is None or not isinstance(factory, type):
        return
    missing = missing_methods(factory, interface)
    if missing:
        where = f"{factory.__module__}:{factory.__qualname__}"
        raise ConfigError(
            f"{key}: {KINDS[kind].label} '{name}' ({where}) does not implement "
            f"{interface.__name__}: missing {', '.join(missing)} (see docs/plugins.md)"
        )


def _engine_options(
    section: str, engine: str, raw: dict[str, Any] | None, pm: PluginManager
) -> Any:
    kind = ENGINE_SECTIONS[section][1]
    try:
        factory = pm.get(kind, engine)
    except UnknownPluginError as e:
        raise ConfigError(f"{section}.{ENGINE_SECTIONS[section][0]}: {e}") from None
    check_interface(kind, engine, factory, f"{section}.{ENGINE_SECTIONS[section][0]}")
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
    check_keys(raw or {}, options_cls, f"{section}.{engine}", {})
    return structured(options_cls, raw or {}, f"{section}.{engine}")


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


def schedule_of(
    resolved: ResolvedConfig, spec: str | None = None, pm: PluginManager | None = None
) -> Schedule:
    """The ``Schedule`` of ``spec`` (default: the config's ``schedule``)."""
    return make_schedule(spec or resolved.cfg.schedule, resolved.cfg, pm or default_manager())


def validate(cfg: LaminarConfig, pm: PluginManager) -> None:
    """The checks that need the plugins (names of tasks, rewards, schedules, policies)."""
    d, r = cfg.data, cfg.reward
    if d.source == "task":
        try:
            factory = pm.get("task", d.task)
        except UnknownPluginError as e:
            raise ConfigError(f"data.task: {e}") from None
        options_cls = getattr(factory, "Options", None)
        if options_cls is not None and dataclasses.is_dataclass(options_cls):
            check_keys(dict(d.task_options), options_cls, "data.task_options", {})
            structured(options_cls, dict(d.task_options), "data.task_options")
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
    if cfg.agent.sandbox and cfg.agent.command:
        from laminar_core.gateway.runners import command_sandbox

        try:  # the plugin, bubblewrap and root, checked before anything starts
            command_sandbox(dict(cfg.agent.sandbox_options))
        except ValueError as e:
            raise ConfigError(str(e)) from None
    try:
        validate_algorithm(cfg.algorithm)
        sampling = dynamic_sampling(cfg.algorithm)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if sampling is not None:
        try:
            group_filter(sampling.filter)
        except ValueError as e:
            raise ConfigError(f"algorithm.dynamic_sampling.filter: {e}") from None
    for spec in [cfg.schedule, *cfg.study.schedules]:
        sched = make_schedule(spec, cfg, pm)
        if cfg.buffer.sampler not in ("auto", *SAMPLERS):
            raise ConfigError(
                f"buffer.sampler: unknown '{cfg.buffer.sampler}'; known: auto, "
                f"{', '.join(sorted(SAMPLERS))}{close_match(cfg.buffer.sampler, SAMPLERS)}"
            )
        if sched.max_lag is not None and cfg.buffer.sampler == "fifo":
            raise ConfigError(
                f"buffer.sampler=fifo cannot bound staleness for schedule "
                f"'{spec}'; use auto or by_batch"
            )
        bound = cfg.buffer.max_staleness
        if sched.max_lag is not None and bound is not None and sched.max_lag > bound:
            raise ConfigError(
                f"schedule '{spec}' allows staleness {sched.max_lag}, above "
                f"buffer.max_staleness={bound}: raise buffer.max_staleness (or null)"
            )
    if cfg.rollout.partial_rollout and not any(
        split_schedule_name(s)[0] == "stale" for s in [cfg.schedule, *cfg.study.schedules]
    ):
        raise ConfigError(
            "rollout.partial_rollout applies only to the stale:K schedule "
            f"(schedule is '{cfg.schedule}')"
        )
    try:
        policy = pm.get("repack", cfg.repack.policy)
    except UnknownPluginError as e:
        raise ConfigError(f"repack.policy: {e}") from None
    check_interface("repack", cfg.repack.policy, policy, "repack.policy")
    if cfg.env.name:
        from laminar_core.envs.build import environment_options, make_parser

        environment_options(cfg.env.name, dict(cfg.env.options), pm)
        make_parser(cfg.env.parser, dict(cfg.env.parser_options), pm)
        if cfg.env.max_turns < 1 or not cfg.env.timeout_s > 0:
            raise ConfigError(
                f"env.max_turns must be >= 1 and env.timeout_s > 0 (got {cfg.env.max_turns}, "
                f"{cfg.env.timeout_s})"
            )


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
    check_keys(raw, LaminarConfig, "", extra)
    engine_raw: dict[str, dict[str, Any]] = {}
    plain = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    for section in ENGINE_SECTIONS:
        sec = plain.get(section)
        if isinstance(sec, dict):
            for name in list(sec):
                if name in extra[section]:
                    engine_raw.setdefault(section, {})[name] = sec.pop(name)
    cfg: LaminarConfig = structured(LaminarConfig, plain, "")
    options = {}
    for section, (key, _) in ENGINE_SECTIONS.items():
        engine = getattr(getattr(cfg, section), key)
        options[section] = _engine_options(
            section, engine, engine_raw.get(section, {}).get(engine), pm
        )
    check_values(cfg)
    validate(cfg, pm)
    check_lora_engines(cfg, pm)
    return ResolvedConfig(cfg, options, source, resolve_teacher(raw, cfg, pm, source))


def resolve_teacher(
    raw: dict[str, Any], cfg: LaminarConfig, pm: PluginManager, source: str = ""
) -> ResolvedConfig | None:
    """``algorithm.teacher``'s config (None: no teacher): the run's, serving the teacher's
    model with the teacher's engine (its ``rollout.<engine>`` options), no LoRA and no
    teacher of its own. Refused (``ConfigError``, one line) when the engine is unknown or
    cannot score tokens (``RolloutEngine.scores_tokens``), or the teacher's tokenizer is not
    the student's (its log-probs would be of other tokens)."""
    t = cfg.algorithm.teacher
    if not t.model:
        return None
    engine = t.engine or cfg.rollout.engine
    try:
        factory = pm.get("rollout", engine)
    except UnknownPluginError as e:
        raise ConfigError(f"algorithm.teacher.engine: {e}") from None
    if not getattr(factory, "scores_tokens", False):
        raise ConfigError(
            f"algorithm.teacher.engine: rollout engine '{engine}' cannot score tokens "
            f"(RolloutEngine.score): use one that can "
            f"({_capable(pm, 'rollout', 'scores_tokens')})"
        )
    if getattr(factory, "loads_model", True):
        check_same_vocabulary(cfg.model.path, t.model)
    elif getattr(pm.get("rollout", cfg.rollout.engine), "loads_model", True):
        raise ConfigError(
            f"algorithm.teacher.engine: '{engine}' only models scoring time (its log-probs are "
            f"0), for a simulated student (rollout.engine={engine}): serve the teacher with "
            f"one that can score ({_capable(pm, 'rollout', 'scores_tokens')})"
        )
    own = copy.deepcopy(raw)
    apply_overrides(
        own,
        [
            f"model.path={t.model}",
            f"rollout.engine={engine}",
            "trainer.lora.rank=0",
            "algorithm.teacher={}",
            "algorithm.distill_coef=0",
            "algorithm.advantage=grpo",
        ],
    )
    return resolve(own, (), pm, source)


def _vocabulary(path: str) -> tuple[str, Any]:
    """What fixes a model directory's token ids: its ``tokenizer.json`` vocabulary and added
    tokens (else ``vocab.json``); ``("", None)`` when it has neither."""
    p = Path(path).expanduser()
    tj = p / "tokenizer.json"
    if tj.is_file():
        data = json.loads(tj.read_text())
        added = sorted((a["id"], a["content"]) for a in data.get("added_tokens", []))
        return "tokenizer.json", (data.get("model", {}).get("vocab"), added)
    vj = p / "vocab.json"
    if vj.is_file():
        return "vocab.json", json.loads(vj.read_text())
    return "", None


def check_same_vocabulary(student: str, teacher: str) -> None:
    """``ConfigError`` when ``algorithm.teacher.model``'s tokenizer maps ids to other tokens
    than the student's (``model.path``), or the teacher directory is not a model."""
    if not (Path(teacher).expanduser() / "config.json").is_file():
        raise ConfigError(
            f"algorithm.teacher.model: {teacher!r} is not a Hugging Face model directory (no "
            "config.json): point it at the teacher's local directory"
        )
    if not student or not (Path(student).expanduser() / "config.json").is_file():
        return  # model.path's own check names that
    (skind, svocab), (tkind, tvocab) = _vocabulary(student), _vocabulary(teacher)
    if skind and tkind and svocab != tvocab:
        raise ConfigError(
            f"algorithm.teacher.model: {teacher!r} has another tokenizer than the student "
            f"({student!r}: their {tkind} vocabularies differ), so its log-probs are of other "
            "tokens; distill from a teacher of the same tokenizer family"
        )


def check_lora_engines(cfg: LaminarConfig, pm: PluginManager) -> None:
    """With ``trainer.lora`` the trainer must train adapters (``TrainerEngine.trains_lora``)
    and the rollout engine hot-load them (``RolloutEngine.hot_loads_lora``); the refusal
    names the installed engines that can."""
    if cfg.trainer.lora.rank <= 0:
        return
    trainer = pm.get("trainer", cfg.trainer.engine)
    if not getattr(trainer, "trains_lora", False):
        raise ConfigError(
            f"trainer.lora: trainer.engine={cfg.trainer.engine} cannot train LoRA adapters; "
            f"set trainer.engine to one that can ({_capable(pm, 'trainer', 'trains_lora')}), "
            "or trainer.lora.rank=0 for full fine-tuning"
        )
    rollout = pm.get("rollout", cfg.rollout.engine)
    if not getattr(rollout, "hot_loads_lora", False):
        raise ConfigError(
            f"trainer.lora: rollout.engine={cfg.rollout.engine} cannot hot-load LoRA adapters; "
            f"set rollout.engine to one that can ({_capable(pm, 'rollout', 'hot_loads_lora')}), "
            "or trainer.lora.rank=0 for full fine-tuning"
        )


def _capable(pm: PluginManager, kind: str, flag: str) -> str:
    """The installed ``kind`` engines whose class sets ``flag``, for a refusal's fix (the
    simulator's, which load no model, are not named: they fix no real run)."""
    names = []
    for name in pm.names(kind):
        with contextlib.suppress(Exception):  # a plugin that fails to load is not one
            factory = pm.get(kind, name)
            if getattr(factory, flag, False) and getattr(factory, "loads_model", True):
                names.append(name)
    return ", ".join(names) or "none installed"


def load_config(
    path: str | Path | None, overrides: typing.Iterable[str] = (), pm: PluginManager | None = None
) -> ResolvedConfig:
    """Read ``path`` (or start from defaults when ``None``), apply overrides, validate."""
    raw = read_config_file(path) if path is not None else {}
    return resolve(raw, overrides, pm, source=str(path or ""))
