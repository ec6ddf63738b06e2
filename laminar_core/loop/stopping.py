"""Stopping a run cleanly: SIGTERM or Ctrl-C ask the controller to stop after its step."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger(__name__)


class StopRequested(Exception):
    """A stop was asked for (SIGTERM, Ctrl-C): the run ends cleanly after a checkpoint."""


class Stoppable(Protocol):
    @property
    def stop_requested(self) -> bool: ...

    def request_stop(self) -> None: ...


def install_stop_handlers(controller: Stoppable) -> Callable[[], None]:
    """SIGTERM and SIGINT ask ``controller`` to stop cleanly (a second SIGINT interrupts at
    once); returns a function that restores the previous handlers."""
    loop = asyncio.get_running_loop()
    installed = []

    def on_signal(sig: signal.Signals) -> None:
        if controller.stop_requested and sig == signal.SIGINT:
            raise KeyboardInterrupt
        log.warning("%s: stopping after this step (Ctrl-C again to interrupt)", sig.name)
        controller.request_stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, on_signal, sig)
            installed.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
            pass

    def restore() -> None:
        for sig in installed:
            loop.remove_signal_handler(sig)

    return restore
