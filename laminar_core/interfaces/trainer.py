"""The trainer engine interface."""

from __future__ import annotations

import abc
import asyncio
import os
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from laminar_core.types import TrainBatch


class TrainerFailure(RuntimeError):
    """A trainer rank is gone, or a collective timed out: the group cannot go on as it is.

    Raised by a trainer group (``loop.trainer_group``) or by an engine whose collective
    timed out; the controller restarts the group from the latest checkpoint (up to
    ``trainer.max_restarts`` times) while the rollouts keep generating.
    """


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

    def cuda_device(self) -> int:
        """The CUDA device index this rank computes on: ``LOCAL_RANK`` where a launcher set
        it (torchrun), else the rank modulo the visible devices. Under Ray each rank sees the
        one GPU it was given (index 0); ranks spawned on one multi-GPU host (the testing
        harness) get one each. NCCL refuses two ranks of one group on one GPU."""
        local = os.environ.get("LOCAL_RANK")
        return int(local) if local is not None else self.rank % max(1, torch.cuda.device_count())


class TrainerEngine(abc.ABC):
    """One rank of an SPMD trainer group (guide: ``docs/plugins.md``).

    Every method is a coroutine and must not block the event loop (the runtime's actor
    serves its calls from it): run blocking work with ``asyncio.to_thread``.

    Lifecycle, driven by the controller on every rank in lock-step:

    1. ``await setup(ctx)`` once.
    2. Per step: ``await compute_logprobs(batch)`` when the algorithm needs the current
       policy's (or proximal) log-probs, then ``await train_step(batch)`` which returns a
       metrics dict. An engine on a real model subclasses ``laminar_core.ModelTrainerEngine``,
       which implements both from model-specific hooks (``forward``, ``forward_backward``,
       ``optimizer_step``): core does the batching, the loss and the metrics once.
    3. After a step: ``async for name, tensor in export_weights()`` -- full tensors in the
       *rollout's* naming and layout, produced piece by piece so peak memory stays bounded.
       Collective: every rank iterates it in lock-step (gathers need them all); the runtime
       publishes rank 0's tensors and drops the others'. A tensor may be reused by the
       engine once the consumer asked for the next one.
    4. Any time between steps: ``await save_checkpoint(dir)`` / ``await load_checkpoint(dir)``.
    5. ``await close()`` once.
    """

    #: True when the engine trains ``trainer.lora`` adapters (only those in the optimiser)
    #: and ``export_weights`` then yields the adapter tensors alone, under PEFT's names
    #: (``laminar_core.training.lora``); the config is refused otherwise.
    trains_lora: bool = False
    #: Modules a rank's process imports (e.g. ``("torch", "transformers")``). Declared, a
    #: rank's process may be forked from a zygote that imported them once
    #: (``runtime.zygote``; the same rules as ``RolloutEngine.preload``). Empty: every rank
    #: starts in a fresh process.
    preload: tuple[str, ...] = ()

    @abc.abstractmethod
    async def setup(self, ctx: TrainerContext) -> None:
        """Join the group (``ctx.rank`` of ``ctx.world_size``; ``ctx.options`` holds the
        rendezvous ``init_method`` under a real runtime) and load ``model.path``."""

    @abc.abstractmethod
    async def compute_logprobs(self, batch: TrainBatch) -> list[list[float]]:
        """Log-probs of each trajectory's response tokens under the current weights:
        ``log_softmax(logits / rollout.temperature)`` of each token, as the rollout
        engines report them (the end-of-sequence token included)."""

    @abc.abstractmethod
    async def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimiser update (all mini-batches of the batch); returns scalar metrics."""

    @abc.abstractmethod
    def export_weights(self) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Full tensors in the rollout's naming, piece by piece (an async generator).

        Blocking work (all-gathers, device copies) must not block the event loop: run it
        off the loop (``asyncio.to_thread``), e.g. with ``iterate_in_thread``."""

    @abc.abstractmethod
    async def save_checkpoint(self, directory: str) -> None:
        """Write this rank's state (weights, optimiser, scheduler, version) under
        ``directory`` (collective: every rank calls it)."""

    @abc.abstractmethod
    async def load_checkpoint(self, directory: str) -> None:
        """Restore what ``save_checkpoint`` wrote (collective)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Leave the group and release what ``setup`` took."""


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without making the host wait for the GPU.

    A copy from pageable host memory to CUDA blocks until it is done, so a trainer that
    moves each micro-batch's inputs that way stops queueing kernels ahead of the GPU at
    every one (on an H100, such copies and per-micro-batch metric reads made 155 waits in one
    FSDP step of a 0.5B model, the GPU idle ~40% of it). From pinned memory the copy is
    queued on the stream like a kernel (torch's pinned-memory cache keeps the buffer until
    the copy has run). Elsewhere: ``t.to(device)``.
    """
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


async def iterate_in_thread(
    items: Iterable[tuple[str, torch.Tensor]],
) -> AsyncIterator[tuple[str, torch.Tensor]]:
    """An async iterator over ``items`` whose every step runs on a worker thread: the
    simplest ``export_weights`` for an engine with a blocking (e.g. collective) generator.
    Steps run one at a time, in order, so a generator that runs collectives stays in step."""
    it = iter(items)

    def step() -> tuple[str, torch.Tensor] | None:
        return next(it, None)

    while (item := await asyncio.to_thread(step)) is not None:
        yield item
