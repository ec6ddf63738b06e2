"""The trainer's next batch: taken from the experience buffer once it holds one, fresh enough.

The wait for data is where the trainer idles, so it is also where the run notices that it
must stop: the rollout manager broke (its ``fatal`` future: raise) or a stop was asked for
(``StopRequested``). With the FIFO sampler, groups older than ``buffer.max_staleness``
versions are dropped and their prompts handed out again (``stale_policy: drop``), or the
trainer first waits until no rollout that old is in flight (``wait``); the by-batch sampler's
schedules bound staleness themselves.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any

from laminar_core.buffers import ExperienceBuffer
from laminar_core.loop.filtering import DynamicSamplingStop
from laminar_core.loop.manager import RolloutManager
from laminar_core.loop.stopping import StopRequested
from laminar_core.types import Group, TrainBatch

log = logging.getLogger(__name__)


class BatchSource:
    """The controller's batches (module docstring); ``stop`` is its stop request."""

    def __init__(
        self,
        buffer: ExperienceBuffer,
        manager: RolloutManager,
        stop: asyncio.Event,
        groups_per_step: int,
        max_staleness: int | None,
        stale_policy: str,
    ) -> None:
        self.buffer = buffer
        self.manager = manager
        self.stop = stop
        self.groups_per_step = groups_per_step
        self.max_staleness = max_staleness
        self.stale_policy = stale_policy
        self.taken = 0  # batches taken from the buffer (lost ones too): the next tag
        self.stale_dropped = 0  # groups not trained on: older than buffer.max_staleness

    async def next(self, held_version: int) -> TrainBatch:
        """The next batch for a trainer holding ``held_version`` (module docstring)."""
        n, tag = self.groups_per_step, self.taken
        bound = self.max_staleness
        if bound is not None and self.stale_policy == "wait":
            # the next publish must not leave a running trajectory more than the bound behind
            await self.until(self.manager.wait_inflight_from(held_version + 1 - bound))
        groups: list[Group] = []
        while len(groups) < n:
            got = (await self.until(self.buffer.sample(tag, n - len(groups)))).groups
            groups += self._fresh(got, held_version) if self.buffer.sampler_name == "fifo" else got
        self.taken += 1
        return TrainBatch(tag, groups, version=held_version)

    async def until(self, aw: Awaitable[Any]) -> Any:
        """``await aw``, unless the rollout manager breaks first (then raise) or a stop is
        requested (``StopRequested``)."""
        sample = asyncio.ensure_future(aw)
        stop = asyncio.ensure_future(self.stop.wait())
        waits: set[asyncio.Future[Any]] = {sample, stop}
        fatal = self.manager.fatal
        if fatal is not None:
            waits.add(fatal)
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if fatal is not None and fatal.done():
            sample.cancel()
            error = fatal.exception()
            if isinstance(error, DynamicSamplingStop):
                raise error  # a cause of its own, not a broken manager
            raise RuntimeError(f"rollout manager failed: {error}") from error
        if not sample.done():
            sample.cancel()
            raise StopRequested()
        return sample.result()

    def _fresh(self, groups: list[Group], held_version: int) -> list[Group]:
        """``groups`` within ``buffer.max_staleness`` versions of the trainer's; the others
        are dropped and their prompts handed out again."""
        bound = self.max_staleness
        if bound is None:
            return groups
        fresh: list[Group] = []
        stale: list[Group] = []
        for g in groups:
            oldest = min((t.version for t in g.trajectories), default=held_version)
            (stale if held_version - oldest > bound else fresh).append(g)
        if stale:
            self.stale_dropped += len(stale)
            self.manager.reissue([g.prompt_index for g in stale])
            log.warning(
                "dropped %d group(s) older than buffer.max_staleness=%d; their prompts are "
                "handed out again",
                len(stale),
                bound,
            )
        return fresh
