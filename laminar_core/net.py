"""Network helpers shared by the runtime, the conformance kits and plugins."""

from __future__ import annotations

import asyncio
import socket
from typing import Any


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (the OS picks it): for a
    rendezvous such as torch.distributed's ``tcp://host:port``. ``""`` binds every
    interface (a port other nodes reach). Another process may take it before it is used,
    so use it at once."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def settle(fut: asyncio.Future, ok: bool, value: Any) -> None:
    """Give a caller waiting on ``fut`` its peer's answer: ``value`` as the result (``ok``)
    or raised; nothing if the caller stopped waiting. Call it on ``fut``'s loop (a reader
    thread: ``loop.call_soon_threadsafe(settle, fut, ok, value)``)."""
    if fut.done():
        return
    if ok:
        fut.set_result(value)
    else:
        fut.set_exception(value)
