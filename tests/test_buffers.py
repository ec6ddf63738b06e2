"""Tests for laminar_core.buffers: experience buffer, prompt pool, partial-response pool."""

from __future__ import annotations

import asyncio

import pytest

from laminar_core.buffers import (
    SAMPLERS,
    DuplicateTrajectoryError,
    ExperienceBuffer,
    InFlight,
    PartialPool,
    Prompt,
    PromptPool,
    SyntheticPrompts,
)
from laminar_core.sim.clock import run_virtual
from laminar_core.types import GenerationRequest, PartialTrajectory, Trajectory


def traj(group: str, i: int, version: int = 0) -> Trajectory:
    return Trajectory(traj_id=f"{group}-{i}", group_id=group, version=version)


def fill(buf: ExperienceBuffer, group: str, samples: int, order=None) -> None:
    for i in order if order is not None else range(samples):
        buf.write(traj(group, i))


# --- experience buffer ---------------------------------------------------------------------


def test_samplers_registry() -> None:
    assert set(SAMPLERS) == {"fifo", "by_batch"}


def test_group_released_only_when_complete() -> None:
    buf = ExperienceBuffer("fifo")
    buf.expect("g0", 0, samples=3)
    buf.write(traj("g0", 2))
    buf.write(traj("g0", 0))
    assert not buf.ready(0, 1)
    assert buf.buffered_groups == 0 and buf.groups_released == 0
    assert sorted(buf.open_trajectory_ids()) == ["g0-0", "g0-2"]
    buf.write(traj("g0", 1))
    assert buf.ready(0, 1)
    assert buf.buffered_groups == 1 and buf.groups_released == 1
    assert buf.open_trajectory_ids() == []
    assert buf.buffered_trajectory_ids() == ["g0-0", "g0-1", "g0-2"]  # sorted by id

    batch = run_virtual(buf.sample(0, 1))
    assert [t.traj_id for t in batch.trajectories] == ["g0-0", "g0-1", "g0-2"]
    assert batch.step == 0
    assert buf.consumed == 3 and buf.buffered_groups == 0


def test_fifo_gives_completion_order() -> None:
    buf = ExperienceBuffer("fifo")
    for g, idx in [("a", 0), ("b", 1), ("c", 2)]:
        buf.expect(g, idx, samples=2)
    buf.write(traj("a", 0))
    fill(buf, "c", 2)  # c completes first
    buf.write(traj("b", 0))
    buf.write(traj("a", 1))  # then a
    buf.write(traj("b", 1))  # then b

    async def main():
        first = await buf.sample(0, 2)
        second = await buf.sample(1, 1)
        return first, second

    first, second = run_virtual(main())
    assert [g.group_id for g in first.groups] == ["c", "a"]
    assert [g.group_id for g in second.groups] == ["b"]


def test_by_batch_gives_exactly_the_tagged_groups() -> None:
    buf = ExperienceBuffer("by_batch")
    tags = {"a": 1, "b": 0, "c": 1, "d": 2, "e": 0}
    for i, (g, tag) in enumerate(tags.items()):
        buf.expect(g, prompt_index=10 - i, samples=1, batch_tag=tag)
    for g in ["a", "d", "c", "e", "b"]:
        fill(buf, g, 1)
    assert buf.ready(0, 2) and buf.ready(1, 2) and buf.ready(2, 1)
    assert not buf.ready(2, 2) and not buf.ready(3, 1)

    async def main():
        return [await buf.sample(s, n) for s, n in [(1, 2), (0, 2), (2, 1)]]

    b1, b0, b2 = run_virtual(main())
    # only the step's own groups, in prompt order (c has the lower prompt index)
    assert [g.group_id for g in b1.groups] == ["c", "a"]
    assert [g.group_id for g in b0.groups] == ["e", "b"]
    assert [g.group_id for g in b2.groups] == ["d"]
    assert all(g.batch_tag == 1 for g in b1.groups)
    assert buf.consumed == 5 and buf.buffered_groups == 0


def test_by_batch_does_not_take_other_steps_groups() -> None:
    buf = ExperienceBuffer("by_batch")
    buf.expect("late", 0, samples=1, batch_tag=5)
    fill(buf, "late", 1)
    assert not buf.ready(0, 1)

    async def main():
        task = asyncio.ensure_future(buf.sample(0, 1))
        await asyncio.sleep(10)
        assert not task.done()  # a group tagged for step 5 does not satisfy step 0
        buf.expect("now", 1, samples=1, batch_tag=0)
        fill(buf, "now", 1)
        return await task

    batch = run_virtual(main())
    assert [g.group_id for g in batch.groups] == ["now"]
    assert buf.buffered_groups == 1


def test_write_twice_raises() -> None:
    buf = ExperienceBuffer()
    buf.expect("g", 0, samples=2)
    buf.write(traj("g", 0))
    with pytest.raises(DuplicateTrajectoryError, match="g-0"):
        buf.write(traj("g", 0))
    fill(buf, "g", 2, order=[1])
    with pytest.raises(DuplicateTrajectoryError):
        buf.write(traj("g", 1))  # also once the group is complete
    assert buf.buffered_groups == 1
    assert len(buf.buffered_trajectory_ids()) == 2


def test_write_to_unexpected_group_raises() -> None:
    buf = ExperienceBuffer()
    with pytest.raises(KeyError, match="not expected"):
        buf.write(traj("ghost", 0))


def test_unknown_sampler() -> None:
    with pytest.raises(ValueError, match="lifo") as info:
        ExperienceBuffer("lifo")
    assert "by_batch" in str(info.value) and "fifo" in str(info.value)


def test_sample_waits_until_ready() -> None:
    buf = ExperienceBuffer("fifo")
    for g in ("a", "b"):
        buf.expect(g, 0, samples=2)

    async def main():
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(buf.sample(0, 2))

        async def writer():
            await asyncio.sleep(3)
            fill(buf, "a", 2)
            await asyncio.sleep(4)
            buf.write(traj("b", 0))
            await asyncio.sleep(5)
            buf.write(traj("b", 1))

        w = asyncio.ensure_future(writer())
        await asyncio.sleep(8)
        assert not task.done()  # one whole group and half of another is not enough
        batch = await task
        t = loop.time()
        await w
        return batch, t

    batch, t = run_virtual(main())
    assert t == pytest.approx(12.0)
    assert {g.group_id for g in batch.groups} == {"a", "b"}


def test_state_dict_lists_seen_and_consumed() -> None:
    buf = ExperienceBuffer()
    buf.expect("g", 0, samples=1)
    buf.expect("h", 1, samples=2)
    fill(buf, "g", 1)
    buf.write(traj("h", 0))
    run_virtual(buf.sample(0, 1))
    assert buf.state_dict() == {"consumed": ["g-0"], "seen": ["g-0", "h-0"]}


# --- prompt pool ---------------------------------------------------------------------------


def rows(n: int) -> list[Prompt]:
    return [Prompt(num_tokens=100 + i, metadata={"row": i}) for i in range(n)]


def take(pool: PromptPool, n: int) -> list[int]:
    return [pool.next_group().prompt.metadata["row"] for _ in range(n)]


def test_prompt_pool_deterministic_per_seed() -> None:
    data = rows(50)
    a = take(PromptPool(data, 4, seed=1), 120)
    assert a == take(PromptPool(data, 4, seed=1), 120)
    assert a != take(PromptPool(data, 4, seed=2), 120)
    assert take(PromptPool(data, 4, shuffle=False), 60) == [*range(50), *range(10)]


def test_prompt_pool_epochs_cover_every_row_once_and_reshuffle() -> None:
    n = 40
    pool = PromptPool(rows(n), 3, seed=9)
    epochs = [take(pool, n) for _ in range(3)]
    for e in epochs:
        assert sorted(e) == list(range(n))
    assert epochs[0] != epochs[1] != epochs[2]
    assert epochs[0] != list(range(n))  # actually shuffled
    assert pool.epoch == 3 and pool.position == 3 * n


def test_prompt_group_fields() -> None:
    pool = PromptPool(rows(5), 6, seed=0)
    groups = [pool.next_group() for _ in range(7)]
    assert [g.index for g in groups] == list(range(7))
    assert len({g.group_id for g in groups}) == 7
    assert all(g.samples == 6 for g in groups)


def test_prompt_pool_resume_gives_exact_next_prompt() -> None:
    data = rows(30)
    ref = PromptPool(data, 2, seed=5)
    ref_seq = [ref.next_group() for _ in range(100)]

    pool = PromptPool(data, 2, seed=5)
    for _ in range(47):  # mid second epoch
        pool.next_group()
    state = pool.state_dict()

    resumed = PromptPool(data, 2, seed=123)  # seed comes from the state
    resumed.load_state_dict(state)
    rest = [resumed.next_group() for _ in range(53)]
    assert [(g.index, g.group_id, g.prompt.metadata["row"]) for g in rest] == [
        (g.index, g.group_id, g.prompt.metadata["row"]) for g in ref_seq[47:]
    ]


def test_prompt_pool_state_survives_a_reused_pool() -> None:
    """Loading an earlier state into a pool that already moved on rewinds it exactly."""
    pool = PromptPool(rows(10), 1, seed=3)
    take(pool, 4)
    state = pool.state_dict()
    expected = take(pool, 25)  # crosses epoch boundaries (cached order changes)
    pool.load_state_dict(state)
    assert take(pool, 25) == expected


def test_prompt_pool_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="empty"):
        PromptPool([], 2)
    with pytest.raises(ValueError, match="samples_per_prompt"):
        PromptPool(rows(3), 0)


def test_synthetic_prompts_deterministic_in_range() -> None:
    a = SyntheticPrompts(100, 16, 64, seed=1)
    b = SyntheticPrompts(100, 16, 64, seed=1)
    lens = [a[i].num_tokens for i in range(100)]
    assert lens == [b[i].num_tokens for i in range(100)]
    assert all(16 <= n <= 64 for n in lens) and len(set(lens)) > 10
    assert len(a) == 100
    with pytest.raises(ValueError):
        SyntheticPrompts(10, 64, 16)


# --- partial pool --------------------------------------------------------------------------


def inflight(tid: str) -> InFlight:
    return InFlight(GenerationRequest(traj_id=tid, group_id="g"), replica="r0", version=0)


def test_partial_pool_add_twice_raises() -> None:
    pool = PartialPool()
    pool.add(inflight("t1"))
    with pytest.raises(ValueError, match="t1"):
        pool.add(inflight("t1"))
    assert len(pool) == 1


def test_partial_pool_update_get_pop() -> None:
    pool = PartialPool()
    pool.add(inflight("t1"))
    pool.add(inflight("t2"))
    assert "t1" in pool and pool.ids() == ["t1", "t2"]
    part = PartialTrajectory("t1", version=0, num_response_tokens=12, versions=[0])
    pool.update(part)
    pool.update(PartialTrajectory("zz", version=0))  # unknown: ignored
    assert pool.get("t1").partial is part
    assert pool.get("t2").partial is None
    assert pool.pop("t1").partial.num_response_tokens == 12
    assert "t1" not in pool and pool.pop("t1") is None and pool.get("t1") is None
    pool.add(inflight("t1"))  # may be re-added once gone
    assert len(pool) == 2
