"""The simulated tool-calling workload (``sim.tools``): multi-turn trajectories through the
real episode path, slots freed while a tool runs, kept vs released KV, and the study."""

from __future__ import annotations

import asyncio

import pytest
from test_study import EXACT

from laminar_core import load_config
from laminar_core.config.schema import EnvConfig
from laminar_core.envs.build import make_environment
from laminar_core.loop.dispatch import load
from laminar_core.loop.episodes import Episodes
from laminar_core.loop.manager import ReplicaSlot
from laminar_core.sim.clock import run_virtual
from laminar_core.sim.config import SimRolloutConfig
from laminar_core.sim.rollout import SimLedger, SimRolloutEngine
from laminar_core.sim.study import format_table, simulate_schedule
from laminar_core.sim.tools import SimToolOptions, ToolPlan
from laminar_core.types import GenerationRequest, SamplingParams

D = 0.01  # decode step seconds
LAT = 5.0  # every tool call takes this long (p99/p50 = 1: constant)
OBS = 50  # every observation is this many tokens
TURNS = 2  # calls_mean = max_turns: every trajectory makes exactly this many calls


class FixedLengths:
    def __init__(self, n: int) -> None:
        self.n = n

    def sample(self, key: int) -> int:
        return self.n


def env_cfg(**opts) -> EnvConfig:
    base = dict(
        calls_mean=TURNS,
        latency_median_s=LAT,
        latency_p99_over_p50=1.0,
        observation_tokens_median=OBS,
        observation_tokens_p99_over_p50=1.0,
    )
    base.update(opts)
    return EnvConfig(name="sim_tool", max_turns=TURNS, timeout_s=60.0, options=base)


def make_engine(env: EnvConfig, length: int, **kw) -> SimRolloutEngine:
    opts = dict(decode_step_s=D, roofline_batch=8, prefill_s_per_token=0.0, weight_load_s=0.0)
    opts.update(kw)
    plan = ToolPlan(SimToolOptions(**env.options), env.max_turns, env.timeout_s)
    return SimRolloutEngine(
        "r0", SimRolloutConfig(**opts), FixedLengths(length), ledger=SimLedger(), tools=plan
    )


def request(key: int, prompt: int = 0) -> GenerationRequest:
    return GenerationRequest(
        traj_id=f"t{key}",
        group_id=f"g{key}",
        num_prompt_tokens=prompt,
        sampling=SamplingParams(max_tokens=100_000),
        metadata={"sample_key": key},
    )


async def episode(eng: SimRolloutEngine, episodes: Episodes, req: GenerationRequest, seen=None):
    """What the manager's ``_run`` / ``_next_turn`` do for one trajectory: a turn on the
    replica, the tool in the episode, the next turn resumed on the same replica."""
    state, resume, turns = None, None, 0
    while True:
        r = req if resume is None else GenerationRequest(**{**_fields(req), "resume": resume})
        traj = await eng.generate(r)
        turns += 1
        state, resume = await episodes.after_turn(state, dict(req.metadata), traj)
        if seen is not None:
            seen.append((asyncio.get_running_loop().time(), await eng.stats()))
        if resume is None:
            return traj, turns


def _fields(req: GenerationRequest) -> dict:
    return {k: getattr(req, k) for k in req.__slots__}


def test_multi_turn_trajectory_turns_and_masked_observations() -> None:
    env = env_cfg()
    eng = make_engine(env, 300)
    episodes = Episodes(make_environment(env), None, 100_000)
    plan = eng.tools
    ends = plan.turn_ends(7, 300)
    assert len(ends) == TURNS + 1

    async def main():
        await eng.start()
        return await episode(eng, episodes, request(7))

    traj, turns = run_virtual(main())
    assert turns == TURNS + 1
    meta = traj.metadata["env"]
    assert meta["turns"] == TURNS + 1 and meta["tool_calls"] == TURNS
    assert meta["observation_tokens"] == TURNS * OBS  # appended with loss mask 0
    assert meta["tool_seconds"] == [LAT] * TURNS
    assert traj.num_response_tokens == 300 + TURNS * OBS == ends[-1]
    # exact virtual time: 300 decode steps (free prefill) plus the tool calls
    assert traj.finish_time == pytest.approx(300 * D + TURNS * LAT, abs=1e-6)
    assert eng.tool_turns == TURNS and eng.tool_resumes == TURNS and eng.resumes == 0
    assert [d.tokens for d in eng.ledger.done] == [300]  # one finished trajectory, model tokens


def test_a_trajectory_waiting_on_its_tool_frees_its_slot() -> None:
    env = env_cfg()
    eng = make_engine(env, 300, max_num_seqs=1)  # one batch slot
    episodes = Episodes(make_environment(env), None, 100_000)
    first_end = eng.tools.turn_ends(1, 300)[0]
    other_turn = eng.tools.turn_ends(2, 300)[0]

    async def main():
        await eng.start()
        a = asyncio.ensure_future(episode(eng, episodes, request(1)))
        # the second trajectory arrives while the first one's tool runs
        await asyncio.sleep(first_end * D + 1.0)
        stats = await eng.stats()
        b = await eng.generate(request(2))  # its first turn
        return stats, b, await a

    stats, b, (a, _) = run_virtual(main())
    assert stats.running == 0 and stats.waiting == 0  # the waiting trajectory holds no slot
    # the other trajectory ran at once in the freed slot, while the tool still ran
    t_b = first_end * D + 1.0
    assert b.start_time == pytest.approx(t_b)
    assert b.finish_time == pytest.approx(t_b + other_turn * D)
    assert b.finish_time < first_end * D + LAT
    assert a.num_response_tokens == 300 + TURNS * OBS


@pytest.mark.parametrize("mode", ["release", "keep"])
def test_keep_vs_release_kv_and_reprefill(mode: str) -> None:
    env = env_cfg()
    prompt = 100
    eng = make_engine(env, 300, tool_kv=mode, prefill_s_per_token=1e-4, kv_capacity_tokens=10_000)
    episodes = Episodes(make_environment(env), None, 100_000)
    ends = eng.tools.turn_ends(3, 300)
    seen: list = []

    async def main():
        await eng.start()
        return await episode(eng, episodes, request(3, prompt=prompt), seen)

    traj, _ = run_virtual(main())
    assert traj.num_response_tokens == ends[-1]
    # while each tool ran (stats right after the turn): no slot held either way
    during = [s for _, s in seen[:-1]]
    assert all(s.running == 0 for s in during)
    if mode == "release":
        assert all(s.kv_use == 0 for s in during)
        # each turn after a call re-prefills the prompt and everything so far
        resumes = [ends[i] + OBS for i in range(TURNS)]
        assert eng.tool_prefill_tokens == sum(prompt + p for p in resumes)
        assert eng.tool_kv_hits == 0
    else:
        # the KV stays resident (prompt + response so far) and counts against capacity
        assert [s.kv_use for s in during] == pytest.approx(
            [(prompt + ends[i]) / 10_000 for i in range(TURNS)]
        )
        assert eng.tool_prefill_tokens == TURNS * OBS  # only the observations
        assert eng.tool_kv_hits == TURNS


def test_kept_kv_gives_way_and_is_dropped_on_new_weights() -> None:
    env = env_cfg()
    eng = make_engine(env, 300, tool_kv="keep", kv_capacity_tokens=10_000)
    episodes = Episodes(make_environment(env), None, 100_000)
    first_end = eng.tools.turn_ends(1, 300)[0]

    async def main():
        await eng.start()
        traj = await eng.generate(request(1, prompt=100))
        await episodes.after_turn(None, {"sample_key": 1}, traj)  # its tool ran
        kept = (await eng.stats()).kv_use
        from laminar_core.interfaces import ModelOnly

        await eng.update_weights(ModelOnly(1))
        return kept, (await eng.stats()).kv_use

    kept, after = run_virtual(main())
    assert kept == pytest.approx((100 + first_end) / 10_000) and after == 0
    assert eng.tool_kv_drops == 1


SMALL = [
    *EXACT,
    "run.steps=4",
    "data.prompts_per_step=2",
    "data.samples_per_prompt=4",
    "rollout.sim.lengths.p99_over_p50=10",
    "env.name=sim_tool",
    "env.max_turns=8",
    "env.timeout_s=60",
    "env.options.calls_mean=3",
    "env.options.latency_median_s=1.5",
    "env.options.latency_p99_over_p50=20",
]


@pytest.mark.parametrize("kv", ["release", "keep"])
def test_study_runs_every_schedule_on_tool_calling(kv: str) -> None:
    rows = {}
    for spec, repack in [
        ("sync", "none"),
        ("one_step", "none"),
        ("stale:2", "none"),
        ("laminar", "best_fit"),
        ("laminar", "none"),
    ]:
        cfg = load_config(None, [*SMALL, f"rollout.sim.tool_kv={kv}", f"repack.policy={repack}"])
        rows[(spec, repack)] = row = simulate_schedule(cfg, spec)
        assert row["steps"] == 4 and row["throughput_tokens_per_s"] > 0
        assert 0 < row["tool_calls_per_trajectory"] <= 8
        assert 0 < row["tool_latency_p50_s"] <= row["tool_latency_p99_s"] <= 60
        assert row["tool_observation_tokens_mean"] > 0 and row["tool_prefill_tokens"] > 0
        if kv == "release":
            assert row["tool_kv_hit_share"] == 0
    assert rows[("sync", "none")]["staleness_max"] == 0
    assert rows[("one_step", "none")]["staleness_max"] <= 1


def test_dispatch_counts_trajectories_waiting_on_their_tool() -> None:
    slot = ReplicaSlot("r0", 0, None, None)  # type: ignore[arg-type]
    slot.inflight = {"a"}
    slot.tooling = {"b", "c"}  # their tools run: no batch slot, but they come back here
    assert load(slot) == 3


def test_study_table_shows_tool_columns() -> None:
    row = simulate_schedule(load_config(None, SMALL), "one_step")
    assert "tools/traj" in format_table([row])
    plain = simulate_schedule(load_config(None, EXACT), "one_step")
    assert "tools/traj" not in format_table([plain]) and plain["tool_calls_per_trajectory"] == 0


def check_deterministic(small: list[str], *over: str) -> None:
    """Laminar on ``small + over`` gives the same row twice (but wall time), and another
    ``env.options.seed`` another run."""
    cfg = load_config(None, [*small, *over])
    a = simulate_schedule(cfg, "laminar")
    b = simulate_schedule(cfg, "laminar")
    a.pop("wall_seconds")
    b.pop("wall_seconds")
    assert a == b
    other = simulate_schedule(load_config(None, [*small, "env.options.seed=5"]), "laminar")
    assert other["sim_seconds"] != a["sim_seconds"]


def test_tool_calling_is_deterministic_per_seed() -> None:
    check_deterministic(SMALL, "rollout.sim.tool_kv=keep", "repack.policy=best_fit")
