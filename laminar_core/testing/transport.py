"""The ``WeightTransport`` contract."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable

from laminar_core.interfaces import WeightTransport
from laminar_core.relay.packing import checksum
from laminar_core.types import Bucket


async def check_transport(
    make_transport: Callable[[int], WeightTransport | Awaitable],
    sizes: tuple[int, ...] = (1, 1000, 1 << 20),
) -> None:
    """Three endpoints (ranks 0, 1, 2): 0 sends to 1 while 1 forwards to 2, overlapped.

    Checks that bytes arrive exactly (checksums), in order per sender, that sends and
    receives to different peers can be in flight at once, and that ``endpoint`` is stable.
    """
    eps = []
    for rank in range(3):
        t = make_transport(rank)
        if asyncio.iscoroutine(t):
            t = await t
        eps.append(t)
    peers = {}
    for rank, t in enumerate(eps):
        await t.open("relay", rank, peers)
        peers[rank] = t.endpoint()
        assert t.endpoint() == peers[rank], "endpoint() changed between calls"
    buckets = []
    for i, n in enumerate(sizes):
        data = os.urandom(n)
        buckets.append(Bucket(1, i, n, checksum(data), data))

    async def sender() -> None:
        for b in buckets:
            await eps[0].send(b, 1)

    async def relay() -> list[Bucket]:
        got = []
        for _ in buckets:
            b = await eps[1].recv(0)
            got.append(b)
            await eps[1].send(b, 2)
        return got

    async def tail() -> list[Bucket]:
        return [await eps[2].recv(1) for _ in buckets]

    _, mid, end = await asyncio.wait_for(asyncio.gather(sender(), relay(), tail()), 60)
    for got in (mid, end):
        assert [b.index for b in got] == [b.index for b in buckets], "buckets reordered"
        for b, want in zip(got, buckets):
            assert b.nbytes == want.nbytes and bytes(b.data) == want.data, "bytes changed"
            assert checksum(b.data) == want.checksum
    for t in eps:
        await t.close()
