"""The rollout manager's tasks: started with it, stopped with it, fatal when they break."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable

log = logging.getLogger(__name__)


class ManagerTasks:
    """Every task the rollout manager and its parts start (a trajectory's ``generate``, a
    replica's driver, a restart, the heartbeat and repack loops) and the run's ``fatal``
    future: a bug in one of them stops the run through it (the controller raises it at its
    next wait for data) instead of vanishing inside a task and silently losing trajectories.
    """

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.fatal: asyncio.Future | None = None  # set if the manager itself breaks
        self.stopping = False
        self._tasks: set[asyncio.Task] = set()
        self._loops: list[asyncio.Task] = []  # the background loops, cancelled first

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.fatal = self.loop.create_future()

    def now(self) -> float:
        assert self.loop is not None, "the rollout manager has not started"
        return self.loop.time()

    def spawn(self, coro: Awaitable[None]) -> asyncio.Task:
        """Run ``coro`` until it ends or the manager stops."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def background(self, coro: Awaitable[None]) -> None:
        """Run the loop ``coro`` for as long as the manager runs."""
        task = asyncio.ensure_future(coro)
        self._loops.append(task)
        task.add_done_callback(self._done)

    def fail(self, error: BaseException) -> None:
        """Stop the run: the controller raises ``error`` at its next wait for data."""
        if self.fatal is not None and not self.fatal.done():
            self.fatal.set_exception(error)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        log.error("rollout manager task failed", exc_info=task.exception())
        self.fail(task.exception())  # type: ignore[arg-type]

    async def stop(self) -> None:
        """Cancel every task (the loops first) and wait for them to end."""
        self.stopping = True
        for t in self._loops:
            t.cancel()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._loops, *self._tasks, return_exceptions=True)
