"""The controller's view of the trainer: every rank of one SPMD group behind one handle.

A ``TrainerEngine`` is one rank; the controller talks to the whole group at once through a
``TrainerGroup``: each call runs on every rank (collectives need them all) and answers with
rank 0's result. ``publish`` hands the group's new weights to the relay tier: where rank 0
lives, its export is pushed from there. ``LocalTrainerGroup`` is a group of one engine in
this process (the simulator, tests); the Ray runtime's group drives rank actors
(``runtime.proxies.RayTrainerGroup``).
"""

from __future__ import annotations

from typing import Protocol

from laminar_core.interfaces import TrainerContext, TrainerEngine
from laminar_core.relay.tier import PublishResult, RelayTier
from laminar_core.types import TrainBatch


class TrainerGroup(Protocol):
    """All ranks of the trainer (see module docstring). Lifecycle: ``setup`` once; per step
    ``compute_logprobs`` (when the algorithm needs them) and ``train_step``, then
    ``publish``; ``save_checkpoint`` / ``load_checkpoint`` between steps; ``close``."""

    async def setup(self) -> None: ...
    async def compute_logprobs(self, batch: TrainBatch) -> list[list[float]]: ...
    async def train_step(self, batch: TrainBatch) -> dict[str, float]: ...
    async def publish(self, version: int, tier: RelayTier) -> PublishResult:
        """Push the current weights to ``tier`` as ``version`` (the trainer's stall)."""

    async def save_checkpoint(self, directory: str) -> None: ...
    async def load_checkpoint(self, directory: str) -> None: ...
    async def close(self) -> None: ...


class LocalTrainerGroup:
    """A trainer of one rank, in this process."""

    def __init__(self, engine: TrainerEngine, ctx: TrainerContext) -> None:
        self.engine = engine
        self.ctx = ctx

    async def setup(self) -> None:
        await self.engine.setup(self.ctx)

    async def compute_logprobs(self, batch: TrainBatch) -> list[list[float]]:
        return await self.engine.compute_logprobs(batch)

    async def train_step(self, batch: TrainBatch) -> dict[str, float]:
        return await self.engine.train_step(batch)

    async def publish(self, version: int, tier: RelayTier) -> PublishResult:
        # a callable: the weights do not change until the next step, so a master relay
        # that dies mid-push is replaced and the export replayed to the new one
        return await tier.publish(version, self.engine.export_weights)

    async def save_checkpoint(self, directory: str) -> None:
        await self.engine.save_checkpoint(directory)

    async def load_checkpoint(self, directory: str) -> None:
        await self.engine.load_checkpoint(directory)

    async def close(self) -> None:
        await self.engine.close()
