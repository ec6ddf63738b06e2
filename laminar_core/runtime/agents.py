"""An agent run's gateway, put together from ``agent.*``: ``attach_agents``.

The gateway runs in the driver process, in the event loop of the rollout manager it sends
its calls through (beside the controller): an agent's HTTP calls reach it on
``agent.host:agent.port``, and each call is a ``generate`` on a replica (a Ray actor or a
local engine) chosen by the manager. Entrypoint agents run in that loop too; command agents
are subprocesses of the driver. See ``docs/agents.md`` for how this scales past one process.
"""

from __future__ import annotations

from typing import Any

from laminar_core.config.schema import LaminarConfig
from laminar_core.gateway import Gateway, GatewaySettings, SessionBudget
from laminar_core.gateway.runners import make_runner
from laminar_core.loop.agent_backend import ManagerTurnBackend
from laminar_core.loop.agent_sessions import AgentOptions, AgentRollouts
from laminar_core.loop.manager import RolloutManager

__all__ = ["agents_enabled", "attach_agents"]


def agents_enabled(cfg: LaminarConfig) -> bool:
    return bool(cfg.agent.entrypoint or cfg.agent.command)


def _tokenizer(cfg: LaminarConfig) -> Any:
    from transformers import AutoTokenizer

    from laminar_core.models import model_dir

    return AutoTokenizer.from_pretrained(str(model_dir(cfg.model.path, "agent")))


def attach_agents(manager: RolloutManager, cfg: LaminarConfig, tokenizer: Any = None) -> None:
    """Make ``manager``'s rollouts agent episodes served by a gateway (``agent.*``); its
    server starts with the manager. Raises ``ValueError`` naming the key when the agent
    cannot be loaded."""
    a, r = cfg.agent, cfg.rollout
    runner = make_runner(
        a.entrypoint, a.command, a.reward_prefix, a.sandbox, dict(a.sandbox_options)
    )
    budget = SessionBudget(
        max_calls=a.max_calls,
        max_total_tokens=a.max_total_tokens,
        max_context_tokens=a.max_context_tokens,
        max_wall_s=a.timeout_s,
        max_samples=a.max_samples,
    )
    settings = GatewaySettings(
        model=a.model,
        temperature=r.temperature,
        top_p=r.top_p,
        max_tokens=r.max_tokens,
        on_sampling_mismatch=a.on_sampling_mismatch,
        parser=a.parser,
        parser_options=dict(a.parser_options),
        budget=budget,
    )
    backend = ManagerTurnBackend(manager, a.version_policy, a.call_retries)
    gateway = Gateway(backend, tokenizer if tokenizer is not None else _tokenizer(cfg), settings)
    manager.agent_backend = backend
    manager.agents = AgentRollouts(
        gateway,
        runner,
        AgentOptions(a.max_sessions, a.timeout_s, a.max_attempts, a.forks, budget),
        manager.buffer,
        manager.tasks,
        manager.events,
        reward_fn=manager.reward_fn,
        on_done=manager.placement.kick,
        version=lambda: max((s.version for s in manager.slots), default=0),
        host=a.host,
        port=a.port,
    )
