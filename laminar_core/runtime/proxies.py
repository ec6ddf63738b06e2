"""Driver-side proxies that make Ray actors look like engines to the loop.

``RayRolloutEngine`` is a ``RolloutEngine`` whose every method awaits the replica's actor; a
dead actor surfaces as ``ReplicaFailure``, which the rollout manager already handles
(redirect in-flight trajectories, carry on). ``RayTrainerGroup`` is one ``TrainerEngine``
standing for all ranks of an SPMD group: each call runs on every rank at once (FSDP's
collectives need them all) and answers with rank 0's result.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from typing import Any

import ray
import torch
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError

from laminar_core.interfaces import ReplicaFailure, RolloutEngine, TrainerContext, TrainerEngine
from laminar_core.types import (
    EngineStats,
    GenerationRequest,
    PartialTrajectory,
    TrainBatch,
    Trajectory,
)

_GONE = (ActorDiedError, ActorUnavailableError, RayActorError)


class RayRolloutEngine(RolloutEngine):
    def __init__(self, replica_id: str, handle: Any) -> None:
        self.replica_id = replica_id
        self.handle = handle

    async def _call(self, method: str, *args: Any) -> Any:
        try:
            return await self.handle.call.remote(method, *args)
        except _GONE as e:
            raise ReplicaFailure(f"replica {self.replica_id}: actor gone ({e})") from e
        except RayTaskError as e:
            raise _cause(e) from None

    async def start(self) -> None:
        await self._call("start")

    async def generate(self, request: GenerationRequest) -> Trajectory:
        return await self._call("generate", request)

    async def abort(self, traj_ids: list[str]) -> list[PartialTrajectory]:
        return await self._call("abort", list(traj_ids))

    async def partials(self, traj_ids: list[str] | None = None) -> list[PartialTrajectory]:
        return await self._call("partials", traj_ids)

    async def update_weights(
        self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]] | None
    ) -> None:
        if getattr(named_tensors, "node_local", False):
            # a reference to the replica's node relay's shared memory (``SharedWeights``):
            # a few bytes here, the replica maps the weights on its own node
            await self._call("update_weights", version, named_tensors)
            return
        # Driver-side relays: one object in Ray's shared-memory store per version and
        # replica; the actor maps it.
        tensors = None if named_tensors is None else ray.put(list(named_tensors))
        await self._call("update_weights", version, tensors)

    async def stats(self) -> EngineStats:
        return await self._call("stats")

    async def stop(self) -> None:
        with contextlib.suppress(ReplicaFailure):
            await self._call("stop")


class RayTrainerGroup(TrainerEngine):
    """All ranks of one trainer group behind a single engine."""

    def __init__(self, handles: list[Any], init_method: str, options: dict) -> None:
        self.handles = handles
        self.init_method = init_method
        self.options = options

    async def _all(self, method: str, *args: Any) -> list[Any]:
        try:
            return await asyncio.gather(*(h.call.remote(method, *args) for h in self.handles))
        except RayTaskError as e:
            raise _cause(e) from None

    async def setup(self, ctx: TrainerContext | None = None) -> None:
        try:
            await asyncio.gather(
                *(h.setup.remote(self.init_method, self.options) for h in self.handles)
            )
        except RayTaskError as e:
            raise _cause(e) from None

    async def compute_logprobs(self, batch: TrainBatch) -> list[list[float]]:
        ref = ray.put(batch)
        per_rank = await self._all("compute_logprobs", ref)
        # each rank fills the trajectories it owns; the rest are empty lists
        return [next((r[i] for r in per_rank if r[i]), []) for i in range(len(per_rank[0]))]

    async def train_step(self, batch: TrainBatch) -> dict[str, float]:
        ref = ray.put(batch)  # one copy in the object store, read by every rank
        return (await self._all("train_step", ref))[0]

    async def export_weights(self) -> list[tuple[str, torch.Tensor]]:  # type: ignore[override]
        results = await asyncio.gather(*(h.export.remote() for h in self.handles))
        return results[0]

    async def save_checkpoint(self, directory: str) -> None:
        await self._all("save_checkpoint", directory)

    async def load_checkpoint(self, directory: str) -> None:
        await self._all("load_checkpoint", directory)

    async def close(self) -> None:
        await self._all("close")


def _cause(e: RayTaskError) -> BaseException:
    """The engine's own exception, so messages name the cause, not Ray's wrapper."""
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, BaseException) else e
