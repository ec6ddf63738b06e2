"""The simulated agent workload: episodes of tens of short model calls with long-tailed gaps.

An agent that owns its loop (a coding, browser or research agent behind the gateway,
``docs/agents.md``) makes tens of model calls per episode. Each call is a short generation
(a thought and a tool call, a few hundred tokens) on a context that grows by the call's own
tokens and the tool's result; between two calls the session is on no replica while the tool
runs and the agent's own code works (parses, edits files, drives a browser). The gateway
places each call at the call boundary by ``loop.placement.choose_call_replica``
(``agent.version_policy: latest``: the newest open version with room, then the session's
replica, then the least loaded), so a replica may pull new weights and a session may be
repacked between its calls, never inside one.

The workload runs through the same path as ``sim_tool`` (``sim.tools``): ``sim_agent`` is an
``env`` plugin whose episode sleeps on the virtual clock for each gap and reports the tool
result's token count; the loop appends it (loss mask 0) and places the next call with
``Placement.place_turn``, by the rule the gateway places its sessions' calls with. What differs
is the plan, a pure function of ``(options.seed, sample_key)``:

* **calls per episode** (model calls; the tool calls between them are one fewer): lognormal,
  median ``calls_median``, tail ``calls_p99_over_p50``, clipped to ``[calls_min,
  env.max_turns + 1]`` (``env.max_turns`` bounds the tool calls, as for ``sim_tool``).
  Multiplicative effects (task difficulty times agent persistence) give a right-skewed
  count; the clip is the harness's turn cap, which real agents hit.
* **tokens per call**: lognormal (``call_tokens_*``), each call its own draw: a call is a
  short generation whatever the episode's length (``rollout.sim.lengths`` is not used).
* **tool time**: lognormal (``latency_*``, as ``sim_tool``): a tool call's duration is a
  product of independent factors (sandbox start, I/O, the command's own work), which gives a
  lognormal body with a tail the median does not predict (the Laminar paper's Fig. 2 shape).
* **think time**: Pareto, scale ``think_min_s``, shape ``think_alpha``: the agent's own time
  between a result and its next call. It has a hard floor (the framework's per-step
  overhead) and a power-law tail: it includes arbitrary programs the agent runs locally, and
  program run times are Pareto-tailed (Harchol-Balter & Downey, "Exploiting process lifetime
  distributions for dynamic load balancing", 1997). ``think_alpha > 1`` keeps the mean
  finite; 1.5 is assumed. Each part is capped at ``env.timeout_s``.
* **tool result tokens**: lognormal (``observation_tokens_*``), as ``sim_tool``.

Every default is assumed, not fit to a trace: they are shaped like the SWE-style agents the
gateway targets (tens of calls, short calls, results of a few hundred tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from laminar_core.interfaces.environment import EnvContext
from laminar_core.sim.lengths import uniform
from laminar_core.sim.tools import SimToolEnvironment, ToolPlan, _lognormal, _stream

# independent streams of uniforms per sample (sim.tools uses 1-4)
_CALLS, _TOKENS, _THINK = 11, 12, 13


@dataclass
class SimAgentOptions:
    """``env.options`` of ``sim_agent`` (see module docstring for each distribution)."""

    calls_median: float = 20.0  # model calls per episode, lognormal
    calls_p99_over_p50: float = 2.0
    calls_min: int = 10  # fewest model calls (the most: env.max_turns + 1)
    call_tokens_median: float = 150.0  # tokens one call generates, lognormal
    call_tokens_p99_over_p50: float = 6.0
    call_tokens_max: int = 2048
    latency_median_s: float = 2.0  # a tool call's time, lognormal, capped at env.timeout_s
    latency_p99_over_p50: float = 20.0
    think_min_s: float = 0.5  # the agent's own time between calls: Pareto scale (its floor)
    think_alpha: float = 1.5  # Pareto shape (> 1: a finite mean), capped at env.timeout_s
    observation_tokens_median: float = 300.0  # a tool result's tokens (loss mask 0), lognormal
    observation_tokens_p99_over_p50: float = 8.0
    observation_tokens_max: int = 4096
    seed: int = 0  # the plan's seed (the same for the environment and the replicas)

    def __post_init__(self) -> None:
        positive = ("calls_median", "call_tokens_median", "latency_median_s")
        at_least_one = (
            *("calls_p99_over_p50", "call_tokens_p99_over_p50", "latency_p99_over_p50"),
            *("observation_tokens_p99_over_p50", "calls_min", "call_tokens_max"),
            "observation_tokens_max",
        )
        checks = [(n, "> 0", getattr(self, n) > 0) for n in positive]
        checks.append(("observation_tokens_median", "> 0", self.observation_tokens_median > 0))
        checks += [(n, ">= 1", getattr(self, n) >= 1) for n in at_least_one]
        checks.append(("think_min_s", ">= 0", self.think_min_s >= 0))
        checks.append(("think_alpha", "> 1 (a finite mean think time)", self.think_alpha > 1))
        for name, rule, ok in checks:
            if not ok:
                raise ValueError(f"{name} must be {rule} (got {getattr(self, name)})")


@dataclass(frozen=True)
class AgentPlan(ToolPlan):
    """Per-sample facts of the agent workload (pure functions of ``(seed, key)``).

    ``calls`` is the number of *tool* calls (gaps between model calls), one fewer than the
    model calls, as ``ToolPlan`` counts them."""

    options: SimAgentOptions  # type: ignore[assignment]

    def model_calls(self, key: int) -> int:
        o = self.options
        u = uniform(_stream(o.seed, _CALLS), key)
        n = round(_lognormal(u, o.calls_median, o.calls_p99_over_p50))
        cap = self.max_turns + 1  # env.max_turns bounds the tool calls between them
        return max(min(o.calls_min, cap), min(n, cap))

    def calls(self, key: int) -> int:
        return self.model_calls(key) - 1

    def call_tokens(self, key: int, call: int) -> int:
        o = self.options
        u = uniform(_stream(o.seed, _TOKENS, call), key)
        n = _lognormal(u, o.call_tokens_median, o.call_tokens_p99_over_p50)
        return max(1, min(o.call_tokens_max, int(n)))

    def think(self, key: int, call: int) -> float:
        """The agent's own time after call ``call``'s tool result (s): Pareto."""
        o = self.options
        u = uniform(_stream(o.seed, _THINK, call), key)
        return o.think_min_s * (1.0 - u) ** (-1.0 / o.think_alpha)

    def turn_ends(self, key: int, model_tokens: int) -> list[int]:
        """Turn ends from each call's own length (``model_tokens`` is not used: an agent's
        calls are short whatever its episode's length)."""
        return self._ends(key, [self.call_tokens(key, j) for j in range(self.model_calls(key))])


class SimAgentEnvironment(SimToolEnvironment):
    """The ``sim_agent`` environment: ``sim_tool``'s episode on the agent plan."""

    Options = SimAgentOptions  # type: ignore[assignment]

    def make_plan(self, ctx: EnvContext) -> ToolPlan:
        return AgentPlan(ctx.options or SimAgentOptions(), ctx.max_turns, ctx.timeout_s)


def turn_plan(cfg: Any) -> ToolPlan | None:
    """The turn plan of a run's simulated multi-turn workload: ``sim_agent``'s, ``sim_tool``'s,
    or ``None`` (single-turn)."""
    env = cfg.env
    if env.name == "sim_agent":
        opts = SimAgentOptions(**dict(env.options))
        return AgentPlan(opts, int(env.max_turns), float(env.timeout_s))
    return ToolPlan.from_config(cfg)
