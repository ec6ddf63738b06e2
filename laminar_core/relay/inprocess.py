"""The in-process transport: real bytes between endpoints of one process, over asyncio queues.

Every send copies the bucket's bytes, as a wire would, so the relay logic above it is
exercised for real (checksums included); it is also the transport of the unit tests.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any

from laminar_core.interfaces import Alloc, BuildContext, WeightTransport
from laminar_core.types import Bucket


class InProcessFabric:
    """The shared medium: one FIFO per ordered (sender, receiver) pair."""

    def __init__(self) -> None:
        self.queues: dict[tuple[int, int], asyncio.Queue[Bucket]] = defaultdict(asyncio.Queue)


class InProcessTransport(WeightTransport):
    @classmethod
    def from_config(cls, ctx: BuildContext) -> InProcessTransport:
        return cls(ctx.shared.setdefault("inprocess_fabric", InProcessFabric()))

    def __init__(self, fabric: InProcessFabric | None = None) -> None:
        self.fabric = fabric or InProcessFabric()
        self.rank = -1

    async def open(self, role: str, rank: int, peers: dict[int, Any]) -> None:
        self.rank = rank

    def endpoint(self) -> Any:
        return self.rank

    async def send(self, bucket: Bucket, peer: int) -> None:
        data = None if bucket.data is None else bytes(bucket.data)
        await self.fabric.queues[(self.rank, peer)].put(
            Bucket(bucket.version, bucket.index, bucket.nbytes, bucket.checksum, data)
        )

    async def recv(self, peer: int, alloc: Alloc | None = None) -> Bucket:
        return await self.fabric.queues[(peer, self.rank)].get()

    async def close(self) -> None:
        return None
