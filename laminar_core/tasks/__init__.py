"""Tasks and rewards: where prompts come from and how responses are scored.

Entry points for a runtime: :func:`build_prompts` (``data.*`` -> prompts + a report of what
was skipped) and :func:`build_reward` (``reward.*`` -> the async reward the manager awaits).
Tasks and rewards are plugins (kinds ``task`` and ``reward``); core ships the procedural
``repeat`` and ``longtail`` tasks and the ``repeat``, ``exact_match`` and ``contains`` rewards.
"""

from laminar_core.tasks.build import (
    build_prompts,
    build_reward,
    make_task,
    resolve_reward,
    tokenize_rows,
)
from laminar_core.tasks.datasets import DataError, DataReport, read_jsonl, read_parquet
from laminar_core.tasks.longtail import LongTailTask
from laminar_core.tasks.repeat import RepeatTask, held_out, repeat_reward
from laminar_core.tasks.response import Response, Segment, model_turns, response_of
from laminar_core.tasks.rewards import RewardError, contains, exact_match, wrap_reward

__all__ = [
    "DataError",
    "DataReport",
    "LongTailTask",
    "RepeatTask",
    "Response",
    "RewardError",
    "Segment",
    "build_prompts",
    "build_reward",
    "contains",
    "exact_match",
    "held_out",
    "make_task",
    "model_turns",
    "read_jsonl",
    "read_parquet",
    "repeat_reward",
    "resolve_reward",
    "response_of",
    "tokenize_rows",
    "wrap_reward",
]
