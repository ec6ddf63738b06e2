"""Eval rounds (``run.eval_every``, ``data.eval_*``; ``laminar_core.loop.evaluation``).

The rounds run on the real controller, rollout manager and relay tier against simulated
engines on a virtual clock (the real-engine path is the same code: only the engines
differ). The reward here is the weight version that generated the trajectory, so an eval
reward equal to the trainer's version proves the round ran on exactly that version.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from laminar_core import ConfigError, load_config
from laminar_core.buffers.prompts import Prompt
from laminar_core.loop.evaluation import Evaluation, build_eval_prompts
from laminar_core.runtime import Run, build_local_run
from laminar_core.runtime.wiring import attach_evaluation
from laminar_core.sim.clock import run_virtual
from laminar_core.tasks import LongTailTask, build_prompts

EVAL = ["run.eval_every=2", "data.eval_size=12", "rollout.max_tokens=800"]


def _version_reward(traj) -> float:
    return float(traj.version)


def _run(overrides: list[str], schedule: str, hook=None) -> tuple[Run, Evaluation]:
    resolved = load_config(None, [*overrides, f"schedule={schedule}"])
    holder: list = []

    async def main() -> Run:
        run = build_local_run(resolved, reward_fn=_version_reward)
        run.controller.keep_batches = True
        ev = attach_evaluation(run)
        assert ev is not None
        holder.append(ev)
        if hook is not None:
            hook(run, ev)
        await asyncio.wait_for(run.controller.run(resolved.cfg.run.steps), 3600.0)
        return run

    run = run_virtual(main())
    return run, holder[0]


@pytest.mark.parametrize("schedule", ["laminar", "sync", "stale:2+partial"])
def test_rounds_run_on_the_current_version_and_are_never_trained_on(small_overrides, schedule):
    run, ev = _run([*small_overrides, *EVAL], schedule)
    rows = run.controller.metrics.rows
    # after steps 2 and 4 (versions 2, 4) and after the last (5)
    evaluated = [r["step"] for r in rows if "eval_seconds" in r]
    assert evaluated == [1, 3, 4]
    for r in rows:
        if "eval_seconds" in r:
            assert r["eval_version"] == r["weight_version"]
            assert r["eval_reward"] == r["weight_version"]  # every sample of exactly that version
            assert r["eval_samples"] == 12
        else:
            assert "eval_reward" not in r
    assert [x.version for x in ev.results] == [2, 4, 5]
    # not trained on, not admitted, not in the partial pool
    trained = [t.traj_id for b in run.controller.batches for t in b.trajectories]
    assert not [t for t in trained if t.startswith("eval")]
    assert not [t for t in run.manager.inflight_ids() if t.startswith("eval")]
    assert run.manager.admitted_groups >= 5 * 8  # training went on; eval added no groups
    assert all(s.pinned == 0 for s in run.manager.slots)
    # eval rounds are kept out of the loop clock
    recs = run.controller.records
    assert run.controller.eval_seconds == pytest.approx(sum(r.eval_seconds for r in recs))
    assert rows[-1]["wall_seconds"] == pytest.approx(
        recs[-1].end - run.controller.t_start - sum(r.eval_seconds for r in recs[:-1])
    )
    assert [r.eval_reward for r in recs if r.eval_reward is not None] == [2.0, 4.0, 5.0]


def test_a_replica_failure_mid_round_does_not_lose_the_round(small_overrides):
    killed: list[str] = []
    killers: set[asyncio.Future] = set()

    def hook(run: Run, ev: Evaluation) -> None:
        inner = ev.run

        async def run_and_kill(version: int):
            async def killer() -> None:
                # wait until a replica holds eval work (it is pinned for it), then kill it
                while not (busy := [s for s in run.manager.slots if s.pinned and s.alive]):
                    await asyncio.sleep(0.001)
                killed.append(busy[0].replica_id)
                busy[0].engine.kill()

            if version == 2:
                killers.add(asyncio.ensure_future(killer()))
            return await inner(version)

        ev.run = run_and_kill

    run, ev = _run([*small_overrides, *EVAL, "rollout.partial_sync_s=0"], "laminar", hook)
    assert killed and killed[0] in run.manager.failed_replicas
    first = ev.results[0]
    assert first.version == 2 and first.samples == 12 and first.reward == 2.0
    assert first.reissued >= 1
    assert [x.samples for x in ev.results] == [12, 12, 12]
    assert len(run.controller.records) == 5  # the run went on without that replica


def test_eval_prompts_are_held_out_from_training(tmp_path: Path):
    resolved = load_config(
        None,
        [
            "data.source=task",
            "data.task=longtail",
            "data.task_options={size: 4000}",
            "data.eval_task_options={split: eval}",
            "data.eval_size=64",
        ],
    )
    train, _ = build_prompts(resolved, None)
    held = build_eval_prompts(resolved, None, train)
    assert len(held) == 64
    texts = {p.metadata["prompt"] for p in train}
    assert not texts & {p.metadata["prompt"] for p in held}
    # the eval rows are the task's with another seed, restricted to held-out pairs
    assert all(p.metadata["task"] == "longtail" for p in held)
    assert held[0].metadata == LongTailTask(seed=1, split="eval")[0]


def test_a_task_without_a_held_out_split_is_a_clear_error():
    # repeat has 144 prompts: another seed draws the same ones
    resolved = load_config(None, ["data.source=task", "data.task=repeat", "data.eval_size=8"])
    train, _ = build_prompts(resolved, None)
    with pytest.raises(ConfigError, match="holdout"):
        build_eval_prompts(resolved, None, train)


def test_eval_from_a_file_skips_a_few_training_prompts_and_refuses_many(tmp_path: Path):
    path = tmp_path / "eval.jsonl"
    rows = ["a*3=", *(f"z*{n}=" for n in range(10))]
    path.write_text("".join(f'{{"prompt": "{r}"}}\n' for r in rows))
    resolved = load_config(
        None, ["data.eval_source=jsonl", f"data.eval_path={path}", "data.eval_size=10"]
    )
    train = [Prompt(num_tokens=4, metadata={"prompt": "a*3="})]
    held = build_eval_prompts(resolved, None, train)
    assert [p.metadata["prompt"] for p in held] == rows[1:]
    # a file that is mostly training prompts is no held-out set
    train += [Prompt(num_tokens=4, metadata={"prompt": f"z*{n}="}) for n in range(5)]
    with pytest.raises(ConfigError, match="training"):
        build_eval_prompts(resolved, None, train)


@pytest.mark.parametrize(
    "override, words",
    [
        ("run.eval_every=-2", "run.eval_every"),
        ("data.eval_size=0", "data.eval_size"),
        ("data.eval_temperature=-1", "data.eval_temperature"),
        ("data.eval_source=jsonll", "data.eval_source"),
        ("data.eval_source=jsonl", "data.eval_path"),
    ],
)
def test_bad_eval_settings_are_one_line_errors(override, words):
    with pytest.raises(ConfigError, match=words.replace(".", r"\.")):
        load_config(None, [override])


def test_no_eval_rounds_unless_asked(small_overrides):
    resolved = load_config(None, small_overrides)

    async def main():
        run = build_local_run(resolved)
        return attach_evaluation(run)

    assert run_virtual(main()) is None


def test_sampled_rounds_seed_each_request_the_same_every_round():
    from laminar_core.types import SamplingParams

    prompts = [Prompt(ids=[1, 2], num_tokens=2, metadata={"prompt": f"p{i}"}) for i in range(3)]
    sampled = Evaluation(None, prompts, SamplingParams(temperature=1.0, max_tokens=8), 1)
    assert [r.sampling.seed for r in sampled._requests(3)] == [0, 1, 2]
    assert [r.sampling.seed for r in sampled._requests(4)] == [0, 1, 2]
    # another run seed draws differently, the same in each of its rounds
    other = Evaluation(None, prompts, SamplingParams(temperature=1.0, max_tokens=8), 1, 3)
    assert [r.sampling.seed for r in other._requests(3)] == [3 << 20, (3 << 20) + 1, (3 << 20) + 2]
    assert [r.sampling.seed for r in other._requests(5)] == [
        r.sampling.seed for r in other._requests(3)
    ]
    greedy = Evaluation(None, prompts, SamplingParams(temperature=0.0, max_tokens=8), 1)
    assert {r.sampling.seed for r in greedy._requests(3)} == {None}
    assert [r.traj_id for r in greedy._requests(3)] == ["eval3-0", "eval3-1", "eval3-2"]
