"""The weight transport interface."""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

from laminar_core.types import Bucket


class TransportError(ConnectionError):
    """A send or receive that failed on the wire (peer gone, timeout); the relay tier treats
    the peer as suspect and rebuilds the chain if its relay died."""


Alloc = Callable[[int], memoryview]
"""``alloc(nbytes)``: a writable buffer of ``nbytes`` for a received payload."""


class WeightTransport(abc.ABC):
    """Moves one bucket of bytes from one endpoint to another.

    Lifecycle: ``await open(role, rank, peers)`` → ``endpoint()`` (the address others use to
    reach this one) → ``await connect(peers)`` with every member's endpoint (again whenever
    the chain is rebuilt: peers no longer listed are forgotten) → any number of ``await
    send(bucket, peer)`` / ``await recv(peer)``; sends and receives to different peers may be
    overlapped (pipelining is core's job), while calls to one peer come one at a time in each
    direction → ``await close()``. Buckets from one sender arrive in the order sent. A
    transport knows nothing of versions, chains or models: the relay tier does.

    Errors on the wire raise ``TransportError`` (or any ``OSError``/``RuntimeError``);
    cancelling a pending ``recv`` must leave the transport usable for other peers.
    """

    @abc.abstractmethod
    async def open(self, role: str, rank: int, peers: dict[int, Any]) -> None: ...

    @abc.abstractmethod
    def endpoint(self) -> Any: ...

    async def connect(self, peers: dict[int, Any]) -> None:
        """Learn the endpoints of the current members (``rank -> endpoint()``).

        The default keeps them in ``self.peers``; transports that need no addresses (the
        in-process and simulated ones) can ignore it.
        """
        self.peers = dict(peers)

    def link_model(self) -> tuple[float, float] | None:
        """``(t_byte, t_start)`` of one link if the transport knows it, else ``None`` (the
        relay tier then measures it, or uses the configured values)."""
        return None

    @abc.abstractmethod
    async def send(self, bucket: Bucket, peer: int) -> None:
        """Send ``bucket`` to ``peer``; return once the caller may reuse the bucket's memory
        (the sender's buffers are recycled: a transport that still needs the bytes later
        copies them first)."""

    @abc.abstractmethod
    async def recv(self, peer: int, alloc: Alloc | None = None) -> Bucket:
        """The next bucket from ``peer``.

        ``alloc(nbytes)`` (optional) returns a writable buffer of exactly ``nbytes`` for the
        payload: a relay passes one that hands out its recycled, already-faulted (and, for
        RDMA, registered) memory, which is what keeps a hop at the link's speed. A transport
        should receive into it (the returned bucket's ``data`` is then that buffer); one
        that cannot may ignore it and return its own memory.
        """

    @abc.abstractmethod
    async def close(self) -> None: ...
