"""The simulated transport: a link with a bandwidth and a per-bucket start-up time.

It moves bucket descriptors (and bytes, if any, without copying) after the modelled delay
on the virtual clock. Each sender's link carries one bucket at a time, which is what makes a
pipelined chain behave as the latency model says.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any

from laminar_core.interfaces import Alloc, BuildContext, WeightTransport
from laminar_core.relay.protocol import TRAINER_RANK
from laminar_core.sim.config import SimTransportConfig
from laminar_core.types import Bucket


class SimFabric:
    def __init__(self) -> None:
        self.queues: dict[tuple[int, int], asyncio.Queue[Bucket]] = defaultdict(asyncio.Queue)


class SimTransport(WeightTransport):
    Options = SimTransportConfig

    @classmethod
    def from_config(cls, ctx: BuildContext) -> SimTransport:
        return cls(ctx.options, ctx.shared.setdefault("sim_fabric", SimFabric()))

    def __init__(self, config: SimTransportConfig, fabric: SimFabric) -> None:
        self.cfg = config
        self.fabric = fabric
        self.rank = -1
        self._link = asyncio.Lock()

    def link_model(self) -> tuple[float, float]:
        """``(t_byte, t_start)`` of a relay-to-relay link, for the chunk-count model."""
        return 8.0 / (self.cfg.link_gbps * 1e9), self.cfg.start_s

    async def open(self, role: str, rank: int, peers: dict[int, Any]) -> None:
        self.rank = rank

    def endpoint(self) -> Any:
        return self.rank

    async def send(self, bucket: Bucket, peer: int) -> None:
        gbps = self.cfg.push_gbps if self.rank == TRAINER_RANK else self.cfg.link_gbps
        async with self._link:
            await asyncio.sleep(self.cfg.start_s + bucket.nbytes * 8.0 / (gbps * 1e9))
        if bucket.data is not None:  # the sender recycles its buffers once send returns
            bucket = Bucket(
                bucket.version, bucket.index, bucket.nbytes, bucket.checksum, bytes(bucket.data)
            )
        self.fabric.queues[(self.rank, peer)].put_nowait(bucket)

    async def recv(self, peer: int, alloc: Alloc | None = None) -> Bucket:
        return await self.fabric.queues[(peer, self.rank)].get()

    async def close(self) -> None:
        return None
