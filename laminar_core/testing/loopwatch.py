"""Finding code that holds the event loop, for the kits of interfaces that share it (an
environment's episodes, a rollout engine's generation: the rollout manager, the heartbeats
and every other replica run on that loop).

A ticker coroutine notes the time of each tick; a watchdog thread looks, every few
milliseconds, at what the loop's thread is running. A stall is a stretch without a tick
while the loop runs a callback (a task's step): its code, not the loop, holds the thread. A
loop that waits in ``select`` past its tick is slow (a loaded machine), not blocked, and is
not counted.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Stall:
    """The longest stretch a callback held the loop: ``held_s`` seconds, in the callback
    whose outermost frame is ``task`` (the coroutine the loop resumed), at ``where`` (its
    innermost frame outside asyncio, when last seen). Frames read ``file:line (function)``."""

    held_s: float = 0.0
    task: str | None = None
    where: str | None = None

    def at(self) -> str:
        """Where, in words: ``in <task>, at <where>`` (one of them when they are the same)."""
        if self.task is None or self.task == self.where:
            return f"at {self.where}"
        return f"in {self.task}, at {self.where}"


class LoopWatch:
    """``start()`` on the loop, ``arm()`` / ``disarm()`` around what is watched (disarm
    returns the longest ``Stall`` since arm), ``stop()`` at the end."""

    TICK_S = 0.005
    SAMPLE_S = 0.005

    def __init__(self) -> None:
        self._task: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self._loop_thread = 0
        self._armed = False
        self._last = 0.0  # the last tick (monotonic)
        self._worst = Stall()

    def start(self) -> None:
        self._loop_thread = threading.get_ident()
        self._last = time.monotonic()
        self._task = asyncio.ensure_future(self._tick())
        self._thread = threading.Thread(target=self._watch, name="loop-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._task is not None:
            self._task.cancel()

    def arm(self) -> None:
        self._worst = Stall()
        self._last = time.monotonic()
        self._armed = True

    def disarm(self) -> Stall:
        """The longest stall since ``arm()`` (``held_s`` 0: none)."""
        self._armed = False
        return self._worst

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.TICK_S)
            self._last = time.monotonic()

    def _watch(self) -> None:
        while not self._stopped.wait(self.SAMPLE_S):
            if not self._armed:
                continue
            held = time.monotonic() - self._last
            if held <= self.TICK_S + self.SAMPLE_S or held <= self._worst.held_s:
                continue
            task, where = _callback_frames(sys._current_frames().get(self._loop_thread))
            if where is not None and self._armed:
                self._worst = Stall(held, task, where)


def _callback_frames(frame: Any) -> tuple[str | None, str | None]:
    """The outermost and the innermost non-asyncio frames (``file:line (function)``) of the
    callback the loop runs; ``(None, None)`` when it runs none (it waits for events)."""
    inner = outer = None
    while frame is not None:
        path = frame.f_code.co_filename
        in_asyncio = f"{os.sep}asyncio{os.sep}" in path
        if in_asyncio and frame.f_code.co_name == "_run" and path.endswith("events.py"):
            return outer, inner  # Handle._run: a callback (a task's step) is running
        if not in_asyncio:
            outer = f"{path}:{frame.f_lineno} ({frame.f_code.co_name})"
            inner = inner or outer
        frame = frame.f_back
    return None, None
