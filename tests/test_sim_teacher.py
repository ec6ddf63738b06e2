"""On-policy distillation's teacher on the simulator's virtual clock (issue 35: "in the
simulator where it changes timing ... teacher scoring adds work"): simulated teacher replicas
score every trajectory with a modelled prefill, on the real controller, manager and buffers,
under every schedule; a slow teacher pool makes the steps wait, more teacher replicas make
them wait less. Virtual seconds (deterministic), not wall time."""

from __future__ import annotations

import asyncio

import pytest

from laminar_core import load_config
from laminar_core.runtime import build_local_run
from laminar_core.sim.clock import run_virtual

SCHEDULES = ["sync", "one_step", "stale:2", "laminar"]
# scoring costs 1 ms per token (a teacher far slower than the 10 ms decode step)
SLOW = ["rollout.sim.prefill_s_per_token=1e-3", "run.steps=4"]


def teacher(replicas: int) -> list[str]:
    return [
        "algorithm.teacher.model=sim-teacher",
        "algorithm.teacher.engine=sim",
        f"algorithm.teacher.replicas={replicas}",
        "algorithm.distill_coef=1.0",
    ]


def run(overrides: list[str], schedule: str = "laminar"):
    resolved = load_config(None, [*overrides, f"schedule={schedule}"])

    async def main():
        r = build_local_run(resolved)
        r.controller.keep_batches = True
        await asyncio.wait_for(r.controller.run(resolved.cfg.run.steps), 3600.0)
        return r

    return run_virtual(main())


def seconds(r) -> float:
    """Virtual seconds from the first step's start to the last step's end."""
    recs = r.controller.records
    return recs[-1].end - recs[0].start


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_trained_trajectory_is_scored_and_its_tokens_prefilled(schedule, small_overrides):
    r = run([*small_overrides, *SLOW, *teacher(2)], schedule)
    trained = [t for b in r.controller.batches for t in b.trajectories]
    assert trained
    for t in trained:
        assert len(t.teacher_logprobs) == len(t.response_ids) == t.num_response_tokens > 0
        assert t.metadata["teacher_score_s"] > 0
    engines = r.manager.teacher.engines
    assert len(engines) == 2 and all(e.scored_tokens > 0 for e in engines)
    # each trained trajectory's prompt + response was prefilled once (more: scored, then not
    # trained in the run's steps)
    assert sum(e.scored_tokens for e in engines) >= sum(t.num_tokens for t in trained)
    assert all(rec.rollout["teacher_tokens"] > 0 for rec in r.controller.records)


def test_scoring_adds_work_that_more_teachers_share(small_overrides):
    base = [*small_overrides, *SLOW]
    none, one, four = run(base), run([*base, *teacher(1)]), run([*base, *teacher(4)])
    assert seconds(one) > 1.5 * seconds(none), "one slow teacher should hold the steps back"
    assert seconds(four) < seconds(one), "four teachers should score the same work sooner"
    mean = [
        sum(rec.rollout["teacher_score_s_mean"] for rec in x.controller.records)
        for x in (one, four)
    ]
    assert mean[1] < mean[0]
    # without a teacher a simulated trajectory carries no token ids (nothing to score)
    assert all(not t.response_ids for b in none.controller.batches for t in b.trajectories)
