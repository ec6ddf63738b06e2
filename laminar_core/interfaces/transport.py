"""The weight transport interface."""

from __future__ import annotations

import abc
from typing import Any

from laminar_core.types import Bucket


class WeightTransport(abc.ABC):
    """Moves one bucket of bytes from one endpoint to another.

    Lifecycle: ``await open(role, rank, peers)`` → ``endpoint()`` (the address others use to
    reach this one) → any number of ``await send(bucket, peer)`` / ``await recv(peer)``; sends
    and receives to different peers may be overlapped (pipelining is core's job) → ``await
    close()``. A transport knows nothing of versions, chains or models: the relay tier does.
    """

    @abc.abstractmethod
    async def open(self, role: str, rank: int, peers: dict[int, Any]) -> None: ...

    @abc.abstractmethod
    def endpoint(self) -> Any: ...

    @abc.abstractmethod
    async def send(self, bucket: Bucket, peer: int) -> None: ...

    @abc.abstractmethod
    async def recv(self, peer: int) -> Bucket: ...

    @abc.abstractmethod
    async def close(self) -> None: ...
