"""The trainer engine interface."""

from __future__ import annotations

import abc
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from laminar_core.types import TrainBatch


@dataclass
class TrainerContext:
    """What a trainer rank is told at ``setup``.

    ``config`` is the engine's own validated options (its plugin dataclass); ``algorithm`` is
    core's ``AlgorithmConfig``; ``options`` carries run-level settings (seed, run dir).
    """

    rank: int
    world_size: int
    config: Any
    algorithm: Any
    options: dict[str, Any] = field(default_factory=dict)


class TrainerEngine(abc.ABC):
    """One rank of an SPMD trainer group.

    Lifecycle, driven by the controller on every rank in lock-step:

    1. ``await setup(ctx)`` once.
    2. Per step: ``await compute_logprobs(batch)`` when the algorithm needs the current
       policy's (or proximal) log-probs, then ``await train_step(batch)`` which returns a
       metrics dict. The objective comes from ``laminar_core.algorithms``: engines compute
       logits and log-probs, core defines the loss.
    3. After a step: ``export_weights()`` yields ``(name, tensor)`` in the *rollout's* naming
       and layout, in buckets of bounded size, so peak memory stays bounded.
    4. Any time between steps: ``await save_checkpoint(dir)`` / ``await load_checkpoint(dir)``.
    5. ``await close()`` once.
    """

    @abc.abstractmethod
    async def setup(self, ctx: TrainerContext) -> None: ...

    @abc.abstractmethod
    async def compute_logprobs(self, batch: TrainBatch) -> list[list[float]]:
        """Log-probs of each trajectory's response tokens under the current weights."""

    @abc.abstractmethod
    async def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimiser update (all mini-batches of the batch); returns scalar metrics."""

    @abc.abstractmethod
    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors in the rollout's naming, bucket by bucket."""

    @abc.abstractmethod
    async def save_checkpoint(self, directory: str) -> None: ...

    @abc.abstractmethod
    async def load_checkpoint(self, directory: str) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...
