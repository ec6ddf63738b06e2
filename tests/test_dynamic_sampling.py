"""Dynamic sampling (``algorithm.dynamic_sampling``) in the loop, under every schedule, on
the real controller, manager and buffers against simulated engines on a virtual clock (the
simulator's ``rollout.sim.uniform_groups`` gives a share of prompts the same reward on every
sample): dropped groups never train, their slots go to new prompts for the same step, every
trajectory is accounted for once, the metrics count them, and a run whose groups keep being
dropped stops with one line naming the cause."""

from __future__ import annotations

import asyncio
import json

import pytest

from laminar_core import load_config
from laminar_core.buffers.experience import group_rewards
from laminar_core.loop.filtering import DynamicSamplingStop
from laminar_core.runtime import build_local_run
from laminar_core.sim.clock import run_virtual
from laminar_core.testing.audit import audit_run

SCHEDULES = ["sync", "one_step", "stale:2", "laminar"]
BOUNDS = {"sync": 0, "one_step": 1, "stale:2": 2}
ON = ["rollout.sim.uniform_groups=0.4", "algorithm.dynamic_sampling=true", "run.steps=4"]


def run(overrides, schedule="laminar", run_dir=None):
    resolved = load_config(None, [*overrides, f"schedule={schedule}"])

    async def main():
        r = build_local_run(resolved, run_dir=run_dir)
        r.controller.keep_batches = True
        await asyncio.wait_for(r.controller.run(resolved.cfg.run.steps), 3600.0)
        return r

    return run_virtual(main())


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_dropped_groups_never_train_and_nothing_is_lost(schedule, small_overrides):
    r = run([*small_overrides, *ON], schedule)
    cfg = r.resolved.cfg
    g, n = cfg.data.prompts_per_step, cfg.data.samples_per_prompt
    assert len(r.controller.records) == cfg.run.steps
    batches = r.controller.batches
    for b in batches:
        assert len(b.groups) == g  # every step still gets G groups
        assert all(len(set(group_rewards(grp))) > 1 for grp in b.groups)
    staleness = [s for rec in r.controller.records for s in rec.staleness]
    if schedule in BOUNDS:
        assert max(staleness) <= BOUNDS[schedule]
    # the filter dropped some, and their prompts are the filtered ones, never trained
    filtered = r.manager.filtered_prompts
    assert r.buffer.groups_filtered == len(filtered) > 0
    trained = [grp.prompt_index for b in batches for grp in b.groups]
    assert len(trained) == len(set(trained))
    assert not filtered & set(trained)
    # exactly once: every trajectory of every group handed out is in one place
    handed = r.manager.prompts.position
    admitted = {f"g{i}-{j}" for i in range(handed) for j in range(n)}
    consumed = [t.traj_id for b in batches for t in b.trajectories]
    parts = [
        set(consumed),
        set(r.buffer.filtered_trajectory_ids()),
        set(r.buffer.buffered_trajectory_ids() + r.buffer.open_trajectory_ids()),
        set(r.manager.inflight_ids()),
    ]
    assert len(consumed) == len(set(consumed)) == cfg.run.steps * g * n
    assert sum(map(len, parts)) == len(set().union(*parts)), "a trajectory is in two places"
    assert set().union(*parts) == admitted, "a trajectory was lost"
    # the steps counted what they dropped (the last step's drops may come after it)
    rows = [rec.rollout for rec in r.controller.records]
    assert sum(x["groups_filtered"] for x in rows) <= r.buffer.groups_filtered
    assert sum(x["groups_filtered"] for x in rows) > 0
    for x in rows:
        assert x["filter_rate"] == x["groups_filtered"] / (x["groups_filtered"] + g)
        assert x["sampled_trajectories"] == (x["groups_filtered"] + g) * n


def test_without_dynamic_sampling_uniform_groups_train(small_overrides):
    r = run([*small_overrides, "rollout.sim.uniform_groups=0.4", "run.steps=2"])
    groups = [grp for b in r.controller.batches for grp in b.groups]
    assert any(len(set(group_rewards(grp))) == 1 for grp in groups)
    assert r.buffer.groups_filtered == 0
    assert "filter_rate" not in r.controller.records[0].rollout


def test_a_run_whose_groups_are_all_dropped_stops_with_the_cause(small_overrides):
    overrides = [
        *small_overrides,
        "rollout.sim.uniform_groups=1.0",
        "algorithm.dynamic_sampling={max_rate: 0.9, patience: 2}",
    ]
    with pytest.raises(DynamicSamplingStop) as err:
        run(overrides)
    msg = str(err.value)
    assert "\n" not in msg
    assert "dropped more than 0.9" in msg and "for 2 steps' worth" in msg
    assert "algorithm.dynamic_sampling.max_rate" in msg


def test_audit_and_rollouts_say_what_was_dropped(small_overrides, tmp_path):
    r = run(
        [*small_overrides, *ON, "run.dump_rollouts=true", "telemetry.events=true"], run_dir=tmp_path
    )
    r.events.write_jsonl(tmp_path / "events.jsonl")
    report = audit_run(tmp_path)
    assert report.ok, report.problems
    assert report.filtered_prompts == len(r.manager.filtered_prompts) > 0
    lines = [json.loads(x) for x in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    dropped = {x["prompt_index"] for x in lines if x.get("filtered")}
    trained = {x["prompt_index"] for x in lines if not x.get("filtered")}
    assert dropped and not dropped & trained
    assert dropped <= r.manager.filtered_prompts
    # a prompt the filter dropped shows up as trained: the audit says so
    events = (tmp_path / "events.jsonl").read_text().splitlines()
    step = next(i for i, x in enumerate(events) if '"kind": "train_step"' in x)
    row = json.loads(events[step])
    row["prompts"][0] = next(iter(dropped))
    events[step] = json.dumps(row)
    (tmp_path / "events.jsonl").write_text("\n".join(events) + "\n")
    assert any("dropped were trained" in p for p in audit_run(tmp_path).problems)
