"""The partial-response pool: what every in-flight trajectory has produced so far.

The rollout manager records each request when it is dispatched and refreshes its partial
output on every heartbeat; repack and failure recovery resume trajectories from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from laminar_core.types import GenerationRequest, PartialTrajectory


@dataclass(slots=True)
class InFlight:
    request: GenerationRequest  # as first dispatched (no resume prefix)
    replica: str
    version: int
    partial: PartialTrajectory | None = None
    attempt: int = 0  # bumped on every re-dispatch; stale completions are ignored
    replicas: tuple[str, ...] = ()  # replica history
    episode: Any = None  # multi-turn: its environment episode and turns (loop.episodes)


class PartialPool:
    def __init__(self) -> None:
        self._items: dict[str, InFlight] = {}

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, traj_id: str) -> bool:
        return traj_id in self._items

    def add(self, item: InFlight) -> None:
        tid = item.request.traj_id
        if tid in self._items:
            raise ValueError(f"trajectory {tid} is already in flight")
        self._items[tid] = item

    def get(self, traj_id: str) -> InFlight | None:
        return self._items.get(traj_id)

    def pop(self, traj_id: str) -> InFlight | None:
        return self._items.pop(traj_id, None)

    def update(self, partial: PartialTrajectory) -> None:
        item = self._items.get(partial.traj_id)
        if item is not None:
            item.partial = partial

    def ids(self) -> list[str]:
        return list(self._items)

    def oldest_version(self) -> int | None:
        """The oldest weight version any in-flight trajectory runs on (None: none)."""
        return min((item.version for item in self._items.values()), default=None)
