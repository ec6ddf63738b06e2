"""The runtime's entry points: a run config -> prompts for the pool, and the reward callable.

``build_prompts`` turns ``data.*`` into ``Prompt`` objects (token ids + the row as metadata);
``build_reward`` turns ``reward.*`` into the async callable the rollout manager awaits. Task
and reward names resolve through the plugin registry (kinds ``task`` and ``reward``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, cast

from laminar_core.buffers.prompts import Prompt, SyntheticPrompts
from laminar_core.config.loader import ConfigError, ResolvedConfig
from laminar_core.plugins import PluginManager, UnknownPluginError, default_manager
from laminar_core.tasks.datasets import DataReport, iter_task_rows, read_jsonl, read_parquet
from laminar_core.tasks.rewards import (
    RewardCallable,
    check_reward_signature,
    import_reward,
    wrap_reward,
)
from laminar_core.types import Trajectory

log = logging.getLogger("laminar.tasks")


class Tokenizer(Protocol):
    """What Laminar needs of a tokenizer (any Hugging Face tokenizer has it)."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def task_factory(name: str, pm: PluginManager | None = None) -> Callable[..., Sequence[dict]]:
    """The registered task ``name``; ``ConfigError`` naming the known ones otherwise."""
    try:
        return (pm or default_manager()).get("task", name)
    except UnknownPluginError as e:
        raise ConfigError(f"data.task: {e}") from None


def make_task(name: str, options: dict[str, Any], pm: PluginManager | None = None):
    """Instantiate task ``name`` with ``options`` (``data.task_options``)."""
    factory = task_factory(name, pm)
    try:
        return factory(**options)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"data.task_options for task {name!r}: {e}") from None


def tokenize_rows(
    rows: Sequence[dict[str, Any]],
    tokenizer: Tokenizer | None,
    prompt_key: str = "prompt",
    max_prompt_tokens: int | None = None,
    report: DataReport | None = None,
) -> list[Prompt]:
    """Rows -> ``Prompt(ids, num_tokens, metadata={**row, "prompt": text})``.

    Ids come from ``tokenizer.encode(text, add_special_tokens=False)``. With no tokenizer
    (simulated engines) ``ids`` stay empty and ``num_tokens`` is the prompt's length in
    characters. Prompts longer than ``max_prompt_tokens`` -- or that encode to nothing -- are
    skipped and counted in ``report``.
    """
    report = report if report is not None else DataReport()
    prompts: list[Prompt] = []
    for row in rows:
        text = row[prompt_key]
        ids = list(tokenizer.encode(text, add_special_tokens=False)) if tokenizer else []
        n = len(ids) if tokenizer else len(text)
        if n == 0:
            report.skip("prompt encodes to no tokens")
            continue
        if max_prompt_tokens is not None and n > max_prompt_tokens:
            report.skip(f"prompt longer than data.max_prompt_tokens={max_prompt_tokens}")
            continue
        prompts.append(Prompt(ids=ids, num_tokens=n, metadata={**row, "prompt": text}))
    report.rows = len(prompts)
    return prompts


def build_prompts(
    resolved: ResolvedConfig, tokenizer: Tokenizer | None, pm: PluginManager | None = None
) -> tuple[Sequence[Prompt], DataReport]:
    """The prompt dataset of ``data.source``: ``synthetic``, ``jsonl``, ``parquet`` or ``task``.

    ``synthetic`` ignores the tokenizer (lengths only). The others read or generate rows,
    skip and count bad rows and over-long prompts, and raise ``DataError``/``ConfigError``
    when nothing usable is left or the source is misconfigured.
    """
    d = resolved.cfg.data
    if d.source == "synthetic":
        ds = SyntheticPrompts(
            d.size, d.min_prompt_tokens, d.max_prompt_tokens, resolved.cfg.run.seed
        )
        # SyntheticPrompts has len() and [] (all the stream reads), not the whole Sequence API
        return cast("Sequence[Prompt]", ds), DataReport("synthetic", rows=len(ds))
    if d.source == "jsonl":
        rows, report = read_jsonl(d.path, d.prompt_key)
    elif d.source == "parquet":
        rows, report = read_parquet(d.path, d.prompt_key)
    elif d.source == "task":
        task = make_task(d.task, dict(d.task_options), pm)
        rows, report = iter_task_rows(task, d.prompt_key, f"task {d.task!r}")
    else:
        raise ConfigError(f"data.source: unknown '{d.source}'")  # the config check names them
    prompts = tokenize_rows(rows, tokenizer, d.prompt_key, d.max_prompt_tokens, report)
    if not prompts:
        raise ConfigError(
            f"data: no prompt of {report.source} fits data.max_prompt_tokens="
            f"{d.max_prompt_tokens} ({report.summary()}); raise data.max_prompt_tokens"
        )
    if report.skipped:
        log.warning("%s", report.summary())
    return prompts, report


def resolve_reward(
    resolved: ResolvedConfig, pm: PluginManager | None = None
) -> tuple[str, RewardCallable] | None:
    """``(name, fn)`` of the configured reward, or ``None`` when the run has none.

    ``reward.fn`` empty: the task's own reward (the reward registered under the task's name,
    else the task factory's ``reward`` attribute) when ``data.source=task``; else none.
    """
    pm = pm or default_manager()
    cfg = resolved.cfg
    spec = cfg.reward.fn
    if not spec:
        if cfg.data.source != "task":
            return None
        if cfg.data.task in pm.names("reward"):
            return cfg.data.task, pm.get("reward", cfg.data.task)
        own = getattr(task_factory(cfg.data.task, pm), "reward", None)
        return (cfg.data.task, own) if callable(own) else None
    if ":" in spec:
        try:
            return spec, import_reward(spec)
        except ValueError as e:
            raise ConfigError(f"reward.fn: {e}") from None
    try:
        return spec, pm.get("reward", spec)
    except UnknownPluginError as e:
        raise ConfigError(
            f"reward.fn: {e}; or give a function as 'package.module:function'"
        ) from None


def build_reward(
    resolved: ResolvedConfig, tokenizer: Tokenizer | None, pm: PluginManager | None = None
) -> Callable[[Trajectory], Awaitable[float]] | None:
    """The async reward the manager awaits (see ``wrap_reward``), or ``None`` for no reward.

    Responses are split along the loss mask into the model's turns and the observations,
    each decoded with ``tokenizer.decode(ids, skip_special_tokens=True)`` (a ``Response``);
    the row is ``traj.metadata``; ``reward.options`` are keyword arguments; each call is
    bounded by ``reward.timeout_s``. A function that cannot take ``(response, row,
    **options)`` is a ``ConfigError`` naming the contract.
    """
    found = resolve_reward(resolved, pm)
    if found is None:
        if resolved.cfg.data.source == "task":
            log.warning(
                "task %r has no reward of its own and reward.fn is unset", resolved.cfg.data.task
            )
        return None
    name, fn = found
    r = resolved.cfg.reward
    try:
        check_reward_signature(fn, name, dict(r.options))
    except ValueError as e:
        raise ConfigError(f"reward.fn: {e}") from None

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)  # type: ignore[union-attr]

    return wrap_reward(
        fn,
        name,
        decode if tokenizer is not None else None,
        r.timeout_s,
        dict(r.options),
        r.workers,
    )
