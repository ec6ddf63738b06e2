"""A virtual clock for asyncio: time jumps to the next timer instead of sleeping.

``VirtualClockLoop`` is a normal selector event loop whose ``time()`` is a counter. When the
loop has nothing ready and would block until its next timer, the selector advances the
counter by that timeout and returns at once, so ``await asyncio.sleep(3600)`` costs no wall
time. Real I/O still works (the selector is polled without blocking), which keeps
``call_soon_threadsafe`` and executors usable. With nothing scheduled at all the simulation
can never make progress, so that raises ``SimulationDeadlock`` rather than hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class SimulationDeadlock(RuntimeError):
    """Every coroutine waits on something that no timer or I/O will ever deliver."""


class _VirtualSelector(selectors.DefaultSelector):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def select(self, timeout: float | None = None):
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:
            raise SimulationDeadlock(
                "simulation deadlocked: every task is waiting and no timer is scheduled"
            )
        self.now += timeout
        return ready


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop on virtual time, starting at 0.0."""

    def __init__(self) -> None:
        self._virtual = _VirtualSelector()
        super().__init__(selector=self._virtual)

    def time(self) -> float:
        return self._virtual.now


def run_virtual(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to completion on a fresh ``VirtualClockLoop`` and close the loop."""
    loop = VirtualClockLoop()
    try:
        return loop.run_until_complete(main)
    finally:
        try:
            _cancel_all_tasks(loop)
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()


def _cancel_all_tasks(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel and reap tasks still pending when ``main`` returned (as ``asyncio.run`` does),
    so they are not destroyed pending with a "Task was destroyed" warning on stderr."""
    pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
    if not pending:
        return
    for task in pending:
        task.cancel()
    # A task that swallows its cancellation and waits forever is left as it is.
    with contextlib.suppress(SimulationDeadlock):
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
