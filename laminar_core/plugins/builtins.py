"""Core's own engines, registered through the same hooks as any plugin.

Targets are lazy import strings, so ``laminar plugins`` lists them without importing them.
"""

from __future__ import annotations

from laminar_core.plugins.hookspecs import hookimpl


@hookimpl
def laminar_trainer_engines() -> dict[str, object]:
    return {"sim": "laminar_core.sim.trainer:SimTrainerEngine"}


@hookimpl
def laminar_rollout_engines() -> dict[str, object]:
    return {"sim": "laminar_core.sim.rollout:SimRolloutEngine"}


@hookimpl
def laminar_transports() -> dict[str, object]:
    return {
        "inprocess": "laminar_core.relay.inprocess:InProcessTransport",
        "sim": "laminar_core.sim.transport:SimTransport",
    }


@hookimpl
def laminar_repack_policies() -> dict[str, object]:
    return {
        "best_fit": "laminar_core.repack.best_fit:BestFitPolicy",
        "none": "laminar_core.repack.none:NoRepack",
    }


@hookimpl
def laminar_schedules() -> dict[str, object]:
    return {
        "sync": "laminar_core.loop.schedules:make_sync",
        "one_step": "laminar_core.loop.schedules:make_one_step",
        "stale": "laminar_core.loop.schedules:make_stale",
        "laminar": "laminar_core.loop.schedules:make_laminar",
    }


@hookimpl
def laminar_tasks() -> dict[str, object]:
    return {
        "repeat": "laminar_core.tasks.repeat:RepeatTask",
        "longtail": "laminar_core.tasks.longtail:LongTailTask",
        "tool_calling": "laminar_core.tasks.tool_calling:ToolCallingTask",
        "retool_math": "laminar_core.tasks.retool_math:RetoolMathTask",
    }


@hookimpl
def laminar_rewards() -> dict[str, object]:
    return {
        "repeat": "laminar_core.tasks.repeat:repeat_reward",
        "exact_match": "laminar_core.tasks.rewards:exact_match",
        "contains": "laminar_core.tasks.rewards:contains",
        "tool_calling": "laminar_core.tasks.tool_calling:tool_calling_reward",
        "boxed_integer": "laminar_core.tasks.retool_math:boxed_integer",
    }


@hookimpl
def laminar_tool_parsers() -> dict[str, object]:
    return {
        "code": "laminar_core.envs.parsers:CodeBlockParser",
        "tool_call": "laminar_core.envs.parsers:JsonToolCallParser",
    }


@hookimpl
def laminar_environments() -> dict[str, object]:
    # the simulated sandbox and agent (studies): long-tailed tool latency on the virtual clock
    return {
        "sim_tool": "laminar_core.sim.tools:SimToolEnvironment",
        "sim_agent": "laminar_core.sim.agent:SimAgentEnvironment",
    }
