"""The experience buffer: finished trajectories in, whole groups out.

Writers add finished trajectories; a group becomes visible to the sampler only when all its
samples have finished (GRPO needs the whole group). Samplers are pluggable:

* ``fifo`` -- groups in completion order (the ``laminar`` schedule's default);
* ``by_batch`` -- step ``s`` takes exactly the groups admitted for step ``s`` (tag
  ``batch_tag``), which is what bounds staleness for ``sync``, ``one_step`` and ``stale:K``.

Every trajectory id is accepted once and consumed once; a second write or a second
consumption raises, so loss or duplication cannot go unnoticed.

Dynamic sampling (``group_filter``): a group the filter drops when it completes never reaches
the sampler; its trajectories are counted as filtered (accepted once, never consumed) and
``on_group`` tells the rollout manager, which hands the slot to a new prompt.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence

from laminar_core.types import FinishReason, Group, TrainBatch, Trajectory


class DuplicateTrajectoryError(RuntimeError):
    pass


class _Sampler:
    def add(self, group: Group) -> None:
        raise NotImplementedError

    def ready(self, step: int, n: int) -> bool:
        raise NotImplementedError

    def take(self, step: int, n: int) -> list[Group]:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def groups(self) -> list[Group]:
        raise NotImplementedError


class FifoSampler(_Sampler):
    def __init__(self) -> None:
        self._q: deque[Group] = deque()

    def add(self, group: Group) -> None:
        self._q.append(group)

    def ready(self, step: int, n: int) -> bool:
        return len(self._q) >= n

    def take(self, step: int, n: int) -> list[Group]:
        return [self._q.popleft() for _ in range(n)]

    def __len__(self) -> int:
        return len(self._q)

    def groups(self) -> list[Group]:
        return list(self._q)


class ByBatchSampler(_Sampler):
    def __init__(self) -> None:
        self._by_tag: dict[int, list[Group]] = {}

    def add(self, group: Group) -> None:
        self._by_tag.setdefault(group.batch_tag, []).append(group)

    def ready(self, step: int, n: int) -> bool:
        return len(self._by_tag.get(step, ())) >= n

    def take(self, step: int, n: int) -> list[Group]:
        groups = self._by_tag.pop(step)
        groups.sort(key=lambda g: g.prompt_index)
        return groups

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_tag.values())

    def groups(self) -> list[Group]:
        return [g for v in self._by_tag.values() for g in v]


SAMPLERS = {"fifo": FifoSampler, "by_batch": ByBatchSampler}


def group_rewards(group: Group) -> list[float]:
    """The rewards of a group's scored trajectories (failed ones have none to compare)."""
    return [
        float(t.reward)
        for t in group.trajectories
        if t.reward is not None and t.finish_reason is not FinishReason.FAILED
    ]


class ExperienceBuffer:
    """Whole groups for the trainer (module docstring). ``group_filter``: dynamic sampling's
    predicate on a finished group's rewards (True: drop it); ``on_group(group, dropped)`` is
    called once per finished group."""

    def __init__(
        self,
        sampler: str = "fifo",
        group_filter: Callable[[Sequence[float]], bool] | None = None,
    ) -> None:
        if sampler not in SAMPLERS:
            raise ValueError(f"unknown sampler {sampler!r}; known: {', '.join(sorted(SAMPLERS))}")
        self.group_filter = group_filter
        self.on_group: Callable[[Group, bool], None] | None = None
        self.groups_filtered = 0
        self._filtered: list[Group] = []  # dropped since the last take_filtered()
        self._filtered_ids: set[str] = set()
        self.sampler_name = sampler
        self._sampler: _Sampler = SAMPLERS[sampler]()
        self._open: dict[str, tuple[Group, int]] = {}  # group id -> (group, samples expected)
        self._seen: set[str] = set()
        self._consumed: set[str] = set()
        self._changed = asyncio.Event()
        self.groups_released = 0

    def expect(self, group_id: str, prompt_index: int, samples: int, batch_tag: int = -1) -> None:
        """Announce a group before its first trajectory is written."""
        if group_id in self._open:
            raise DuplicateTrajectoryError(f"group {group_id} is already expected")
        self._open[group_id] = (Group(group_id, prompt_index, [], batch_tag), samples)

    def expect_more(self, group_id: str, more: int) -> None:
        """Raise an open group's expected count by ``more`` (an agent session that forked
        gives several samples for one episode), before they are written."""
        group, samples = self._open[group_id]
        self._open[group_id] = (group, samples + more)

    def write(self, traj: Trajectory) -> None:
        if traj.traj_id in self._seen:
            raise DuplicateTrajectoryError(f"trajectory {traj.traj_id} written twice")
        entry = self._open.get(traj.group_id)
        if entry is None:
            raise KeyError(f"trajectory {traj.traj_id}: group {traj.group_id} was not expected")
        self._seen.add(traj.traj_id)
        group, samples = entry
        group.trajectories.append(traj)
        if len(group.trajectories) == samples:
            del self._open[traj.group_id]
            group.trajectories.sort(key=lambda t: t.traj_id)
            dropped = self._drops(group)
            if dropped:
                self.groups_filtered += 1
                self._filtered.append(group)
                self._filtered_ids.update(t.traj_id for t in group.trajectories)
            else:
                self._sampler.add(group)
                self.groups_released += 1
                self._changed.set()
            if self.on_group is not None:
                self.on_group(group, dropped)

    def _drops(self, group: Group) -> bool:
        if self.group_filter is None:
            return False
        rewards = group_rewards(group)
        # a group with no scored trajectory is the failed-steps check's to count, not ours
        return bool(rewards) and bool(self.group_filter(rewards))

    def take_filtered(self) -> list[Group]:
        """The groups dropped since the last call (for ``rollouts.jsonl``)."""
        out, self._filtered = self._filtered, []
        return out

    def filtered_trajectory_ids(self) -> list[str]:
        """Every trajectory of a dropped group: accepted once, never consumed."""
        return sorted(self._filtered_ids)

    def ready(self, step: int, n: int) -> bool:
        return self._sampler.ready(step, n)

    async def sample(self, step: int, n: int) -> TrainBatch:
        """Wait until the sampler can give ``n`` whole groups for ``step``, then take them."""
        while not self._sampler.ready(step, n):
            self._changed.clear()
            await self._changed.wait()
        groups = self._sampler.take(step, n)
        for g in groups:
            for t in g.trajectories:
                if t.traj_id in self._consumed:
                    raise DuplicateTrajectoryError(f"trajectory {t.traj_id} consumed twice")
                self._consumed.add(t.traj_id)
        return TrainBatch(step, groups)

    @property
    def consumed(self) -> int:
        return len(self._consumed)

    @property
    def buffered_groups(self) -> int:
        return len(self._sampler)

    def buffered_trajectory_ids(self) -> list[str]:
        return [t.traj_id for g in self._sampler.groups() for t in g.trajectories]

    def open_trajectory_ids(self) -> list[str]:
        return [t.traj_id for g, _ in self._open.values() for t in g.trajectories]

    def state_dict(self) -> dict:
        return {"consumed": sorted(self._consumed), "seen": sorted(self._seen)}
