"""The simulated tool-calling workload: a sandbox whose calls take long-tailed time.

ReTool's recipe (DAPO-Math-17k, code interpreter): a trajectory alternates model turns and
tool calls. Each model turn generates a segment and ends at a tool call; the tool runs; its
output (the *observation*) is appended to the context with loss mask 0 and generation
continues, up to ``env.max_turns`` calls; the last turn answers.

The workload runs through the real loop (``loop.episodes``, the manager's ``_next_turn``):
``SimToolEnvironment`` is an ``env`` plugin (``sim_tool``) that sleeps on the (virtual) clock
for a sampled latency and returns an observation of a sampled token length -- without a
tokenizer the loop counts observation tokens (``info["observation_tokens"]``) instead of
encoding text -- and ends the episode after the trajectory's sampled number of calls.

``ToolPlan`` is the one source of the per-sample facts both halves of the model need: the
number of calls, each observation's length and each call's latency, all pure functions of
``(options.seed, sample_key)`` (like the output lengths, ``sim.lengths``), so a trajectory
moved between replicas keeps its plan. The simulated replica (``sim.rollout``) reads the same
plan to stop each model turn at its segment's end: the model's output length (``rollout.sim
.lengths``) is split into ``calls + 1`` segments.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from functools import lru_cache
from statistics import NormalDist
from typing import Any

from laminar_core.interfaces.environment import (
    EnvContext,
    Environment,
    Episode,
    StepResult,
)
from laminar_core.sim.lengths import uniform

_Z99 = NormalDist().inv_cdf(0.99)
_ND = NormalDist()

# independent streams of uniforms per sample
_CALLS, _OBS, _LAT, _SEG = 1, 2, 3, 4


@dataclass
class SimToolOptions:
    """``env.options`` of ``sim_tool`` (see module docstring).

    ``calls_mean``: mean tool calls per trajectory (binomial over ``env.max_turns``);
    ``latency_median_s`` / ``latency_p99_over_p50``: a call's latency, lognormal, capped at
    ``env.timeout_s`` (a capped call is a timeout observation);
    ``observation_tokens_median`` / ``_p99_over_p50`` / ``_max``: an observation's length,
    lognormal; ``seed``: the plan's seed (the same for the environment and the replicas).
    """

    calls_mean: float = 3.0
    latency_median_s: float = 1.5
    latency_p99_over_p50: float = 20.0
    observation_tokens_median: float = 150.0
    observation_tokens_p99_over_p50: float = 8.0
    observation_tokens_max: int = 2048
    seed: int = 0

    def __post_init__(self) -> None:
        if self.calls_mean < 0:
            raise ValueError(f"calls_mean must be >= 0 (got {self.calls_mean})")
        for name in ("latency_median_s", "observation_tokens_median"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 (got {getattr(self, name)})")
        for name in ("latency_p99_over_p50", "observation_tokens_p99_over_p50"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.observation_tokens_max < 1:
            raise ValueError(
                f"observation_tokens_max must be >= 1 (got {self.observation_tokens_max})"
            )


def _stream(seed: int, stream: int, i: int = 0) -> int:
    return seed * 1_000_003 + stream * 7_919 + i * 104_729


def _lognormal(u: float, median: float, p99_over_p50: float) -> float:
    return median * math.exp(math.log(p99_over_p50) / _Z99 * _ND.inv_cdf(u))


@dataclass(frozen=True)
class ToolPlan:
    """Per-sample facts of the tool workload (pure functions of ``(seed, key)``)."""

    options: SimToolOptions
    max_turns: int = 8
    timeout_s: float = 30.0

    @classmethod
    def from_config(cls, cfg: Any) -> ToolPlan | None:
        """The plan of a run whose ``env`` is ``sim_tool`` (``None`` otherwise)."""
        env = cfg.env
        if env.name != "sim_tool":
            return None
        return cls(SimToolOptions(**dict(env.options)), int(env.max_turns), float(env.timeout_s))

    def calls(self, key: int) -> int:
        """Tool calls sample ``key`` makes: Binomial(max_turns, calls_mean / max_turns)."""
        n = self.max_turns
        p = min(1.0, self.options.calls_mean / n) if n > 0 else 0.0
        u = uniform(_stream(self.options.seed, _CALLS), key)
        return _binomial_quantile(n, p, u)

    def observation_tokens(self, key: int, call: int) -> int:
        o = self.options
        u = uniform(_stream(o.seed, _OBS, call), key)
        n = _lognormal(u, o.observation_tokens_median, o.observation_tokens_p99_over_p50)
        return max(1, min(o.observation_tokens_max, int(n)))

    def latency(self, key: int, call: int) -> float:
        """Call ``call``'s latency (s), uncapped (the environment caps it at ``timeout_s``)."""
        o = self.options
        u = uniform(_stream(o.seed, _LAT, call), key)
        return _lognormal(u, o.latency_median_s, o.latency_p99_over_p50)

    def turn_ends(self, key: int, model_tokens: int) -> list[int]:
        """Where each model turn ends, in response tokens (observations included): the
        model's ``model_tokens`` split into ``calls + 1`` segments (each at least one token),
        observation ``i`` after turn ``i``."""
        n = self.calls(key)
        w = [uniform(_stream(self.options.seed, _SEG, j), key) + 0.25 for j in range(n + 1)]
        total = sum(w)
        segs = [max(1, int(model_tokens * x / total)) for x in w]
        segs[-1] = max(1, model_tokens - sum(segs[:-1])) if model_tokens > n else segs[-1]
        return self._ends(key, segs)

    def think(self, key: int, call: int) -> float:
        """Time between call ``call``'s result and the next model turn besides the tool (s):
        none here; the agent workload (``sim.agent``) adds its own."""
        return 0.0

    def _ends(self, key: int, segs: list[int]) -> list[int]:
        """Turn ends of model segments ``segs``, observation ``j`` after segment ``j``."""
        ends, at = [], 0
        for j, s in enumerate(segs):
            at += s
            ends.append(at)
            if j < len(segs) - 1:
                at += self.observation_tokens(key, j)
        return ends


@lru_cache(maxsize=256)
def _binomial_cdf(n: int, p: float) -> tuple[float, ...]:
    acc, out = 0.0, []
    for k in range(n + 1):
        acc += math.comb(n, k) * p**k * (1 - p) ** (n - k)
        out.append(acc)
    return tuple(out)


def _binomial_quantile(n: int, p: float, u: float) -> int:
    for k, c in enumerate(_binomial_cdf(n, p)):
        if u <= c:
            return k
    return n


class SimToolEpisode(Episode):
    """One trajectory's calls: ``plan.calls(key)`` of them, then the answer turn."""

    def __init__(self, env: SimToolEnvironment, key: int) -> None:
        self.env = env
        self.key = key
        self.calls = env.plan.calls(key)
        self.turns = 0
        self.closed = False

    async def step(self, turn_text: str) -> StepResult:
        if self.closed:
            raise RuntimeError("sim_tool: step after the episode ended")
        plan = self.env.plan
        i = self.turns
        if i >= self.calls:  # the answer turn (no tool call)
            self.closed = True
            return StepResult("", done=True, info={"finish": "answer", "tool_calls": 0})
        latency = plan.latency(self.key, i)
        took = min(latency, plan.timeout_s)
        think = min(plan.think(self.key, i), plan.timeout_s)
        await asyncio.sleep(took + think)
        self.turns += 1
        obs = plan.observation_tokens(self.key, i)
        info: dict[str, Any] = {"tool_calls": 1, "tool_seconds": took, "observation_tokens": obs}
        if latency > plan.timeout_s:
            info["error"] = "timeout"
        self.env.record(took, obs, took + think)
        return StepResult("", done=False, info=info)

    async def close(self) -> None:
        self.closed = True


class SimToolEnvironment(Environment):
    """The ``sim_tool`` environment (see module docstring). ``calls`` records every call as
    ``(end time, tool latency, observation tokens, gap)`` on the loop's clock, the gap being
    the time the trajectory spent off the replicas (tool plus think time; ``sim.study``
    reads it)."""

    Options = SimToolOptions

    def __init__(self, ctx: EnvContext) -> None:
        super().__init__(ctx)
        self.plan = self.make_plan(ctx)
        self.calls: list[tuple[float, float, int, float]] = []

    def make_plan(self, ctx: EnvContext) -> ToolPlan:
        return ToolPlan(ctx.options or SimToolOptions(), ctx.max_turns, ctx.timeout_s)

    async def start(self) -> None:
        pass

    async def reset(self, row: dict[str, Any]) -> Episode:
        return SimToolEpisode(self, int(row.get("sample_key", 0)))

    def record(self, latency: float, obs: int, gap: float) -> None:
        self.calls.append((asyncio.get_running_loop().time(), latency, obs, gap))

    async def close(self) -> None:
        pass
