"""Hook specifications for Laminar plugins (pluggy project ``"laminar"``).

Every plugin kind is one hook that takes no arguments and returns a ``dict[str, object]``
mapping a plugin name to a *factory*: either a callable (usually a class) or a lazy import
string ``"package.module:Attr"`` that is imported only when that name is actually used.

The kinds live in the single table :data:`KINDS`; the hookspec functions on
:class:`LaminarHookSpecs` are generated from it, so adding a kind (rewards, tasks, ...) is one
line in that table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pluggy

PROJECT_NAME = "laminar"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@dataclass(frozen=True)
class KindSpec:
    """One plugin kind: its short ``kind`` key, the ``hook`` name and a human ``label``."""

    kind: str
    hook: str
    label: str


_KIND_TABLE: tuple[KindSpec, ...] = (
    KindSpec("trainer", "laminar_trainer_engines", "trainer engine"),
    KindSpec("rollout", "laminar_rollout_engines", "rollout engine"),
    KindSpec("transport", "laminar_transports", "transport"),
    KindSpec("repack", "laminar_repack_policies", "repack policy"),
    KindSpec("schedule", "laminar_schedules", "schedule"),
    # Prompt sources: factory(**data.task_options) -> Sequence[dict] of rows with "prompt".
    KindSpec("task", "laminar_tasks", "task"),
    # Reward functions: fn(response: str, row: dict, **reward.options) -> float.
    KindSpec("reward", "laminar_rewards", "reward"),
    # Multi-turn environments: Environment subclasses built with an EnvContext
    # (laminar_core.interfaces.environment); their ``Options`` validate ``env.options``.
    KindSpec("env", "laminar_environments", "environment"),
    # Tool-call parsers: ToolCallParser classes built with ``env.parser_options``.
    KindSpec("parser", "laminar_tool_parsers", "tool-call parser"),
)

#: Plugin kinds in declaration order, keyed by kind (``"rollout"`` -> its :class:`KindSpec`).
KINDS: dict[str, KindSpec] = {spec.kind: spec for spec in _KIND_TABLE}


class LaminarHookSpecs:
    """Namespace holding one generated hookspec per entry in :data:`KINDS`."""


def _make_hookspec(spec: KindSpec) -> Callable[[], dict[str, object]]:
    def hook() -> dict[str, object]:
        raise NotImplementedError  # pragma: no cover - specs are never called

    hook.__name__ = hook.__qualname__ = spec.hook
    hook.__doc__ = (
        f"Return ``{{name: factory}}`` of {spec.label} plugins (kind ``{spec.kind!r}``).\n\n"
        "A factory is a callable, or a lazy ``'package.module:Attr'`` import string that is\n"
        "resolved only when the name is used."
    )
    return hookspec(hook)


for _spec in _KIND_TABLE:
    setattr(LaminarHookSpecs, _spec.hook, _make_hookspec(_spec))
del _spec
