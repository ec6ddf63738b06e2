"""The simulated agent workload (``sim.agent``): episodes of tens of short calls with
long-tailed tool and think times, through the real episode path, on the virtual clock."""

from __future__ import annotations

import pytest
from test_sim_tool_calling import FixedLengths, check_deterministic, episode, request
from test_study import EXACT

from laminar_core import load_config
from laminar_core.config.schema import EnvConfig
from laminar_core.envs.build import make_environment
from laminar_core.loop.episodes import Episodes
from laminar_core.sim.agent import AgentPlan, SimAgentOptions, turn_plan
from laminar_core.sim.clock import run_virtual
from laminar_core.sim.config import SimRolloutConfig
from laminar_core.sim.rollout import SimLedger, SimRolloutEngine
from laminar_core.sim.study import simulate_schedule

D = 0.01  # decode step seconds


def agent_env(max_turns: int = 39, timeout_s: float = 120.0, **opts) -> EnvConfig:
    return EnvConfig(name="sim_agent", max_turns=max_turns, timeout_s=timeout_s, options=opts)


def test_plan_calls_tokens_and_gaps_are_long_tailed_and_bounded() -> None:
    plan = AgentPlan(SimAgentOptions(), max_turns=39, timeout_s=120.0)
    keys = range(400)
    calls = [plan.model_calls(k) for k in keys]
    assert min(calls) >= 10 and max(calls) <= 40  # [calls_min, max_turns + 1]
    assert max(calls) == 40 and len(set(calls)) > 15  # the cap is hit; the count varies
    assert all(plan.calls(k) == plan.model_calls(k) - 1 for k in keys)
    think = [plan.think(k, i) for k in keys for i in range(5)]
    assert min(think) >= 0.5  # Pareto: a floor (think_min_s), no upper bound but the cap
    assert max(think) > 10 * sorted(think)[len(think) // 2]
    # a call's turn ends: its own short generation, then its tool result
    ends = plan.turn_ends(7, 10**6)  # the episode's length is not used
    assert len(ends) == plan.model_calls(7)
    at = 0
    for j, e in enumerate(ends):
        at += plan.call_tokens(7, j)
        assert e == at
        at += plan.observation_tokens(7, j)
    # a pure function of (seed, key): the same plan whoever asks
    again = AgentPlan(SimAgentOptions(), max_turns=39, timeout_s=120.0)
    assert [again.think(3, i) for i in range(5)] == [plan.think(3, i) for i in range(5)]
    other = AgentPlan(SimAgentOptions(seed=1), max_turns=39, timeout_s=120.0)
    assert [other.model_calls(k) for k in keys] != calls


def test_an_episode_pays_each_calls_tool_and_think_time_off_the_replica() -> None:
    env = agent_env(
        calls_median=12,
        calls_p99_over_p50=1,
        calls_min=12,
        latency_median_s=3.0,
        latency_p99_over_p50=1,
        think_min_s=0.5,
        think_alpha=1.5,
    )
    plan = AgentPlan(SimAgentOptions(**env.options), env.max_turns, env.timeout_s)
    eng = SimRolloutEngine(
        "r0",
        SimRolloutConfig(decode_step_s=D, roofline_batch=8, prefill_s_per_token=0.0),
        FixedLengths(10**6),  # not used: each call draws its own length
        ledger=SimLedger(),
        tools=plan,
    )
    episodes = Episodes(make_environment(env), None, 100_000)

    async def main():
        await eng.start()
        return await episode(eng, episodes, request(5))

    traj, turns = run_virtual(main())
    assert turns == 12 == plan.model_calls(5)
    model = sum(plan.call_tokens(5, j) for j in range(12))
    obs = sum(plan.observation_tokens(5, j) for j in range(11))
    assert traj.num_response_tokens == model + obs
    gaps = [3.0 + min(plan.think(5, j), 120.0) for j in range(11)]
    assert traj.metadata["env"]["tool_seconds"] == pytest.approx([3.0] * 11)
    # exact virtual time: every generated token one decode step, plus each gap
    assert traj.finish_time == pytest.approx(model * D + sum(gaps), abs=1e-6)
    assert [c[3] for c in episodes.env.calls] == pytest.approx(gaps)


def test_turn_plan_picks_the_workload() -> None:
    agent = load_config(None, [*EXACT, "env.name=sim_agent", "env.max_turns=20"]).cfg
    assert isinstance(turn_plan(agent), AgentPlan)
    assert turn_plan(load_config(None, EXACT).cfg) is None


def test_bad_options_name_the_field() -> None:
    with pytest.raises(ValueError, match="think_alpha must be > 1"):
        SimAgentOptions(think_alpha=1.0)
    with pytest.raises(ValueError, match="calls_min must be >= 1"):
        SimAgentOptions(calls_min=0)


SMALL = [
    *EXACT,
    "run.steps=4",
    "data.prompts_per_step=2",
    "data.samples_per_prompt=4",
    "rollout.max_tokens=30000",
    "rollout.sim.tool_kv=keep",
    "env.name=sim_agent",
    "env.max_turns=19",
    "env.timeout_s=60",
    "env.options.calls_median=12",
]


def test_study_runs_the_agent_workload_against_the_baselines() -> None:
    rows = {s: simulate_schedule(load_config(None, SMALL), s) for s in ("sync", "laminar")}
    for row in rows.values():
        assert row["steps"] == 4 and row["trajectories_per_s"] > 0
        assert 9 <= row["tool_calls_per_trajectory"] <= 19  # tens of calls per episode
        assert 0.5 < row["call_gap_p50_s"] <= row["call_gap_p99_s"] <= 120
        assert row["tool_kv_hit_share"] > 0  # a session's next call found its KV
    assert rows["sync"]["versions_per_trajectory_mean"] == 1
    # calls are placed at call boundaries: replicas pull between a session's calls, so
    # laminar's sessions span weight versions (sync's never do)
    assert rows["laminar"]["versions_per_trajectory_mean"] > 1
    assert rows["laminar"]["trajectories_per_s"] > rows["sync"]["trajectories_per_s"]


def test_agent_workload_is_deterministic_on_the_virtual_clock() -> None:
    check_deterministic(SMALL, "repack.policy=best_fit")
