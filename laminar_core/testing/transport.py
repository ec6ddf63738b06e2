"""The ``WeightTransport`` contract."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable

from laminar_core.interfaces import WeightTransport
from laminar_core.relay.packing import checksum
from laminar_core.testing.report import require
from laminar_core.types import Bucket


async def check_transport(
    make_transport: Callable[[int], WeightTransport | Awaitable],
    sizes: tuple[int, ...] = (1, 1000, 1 << 20),
    timeout_s: float = 120.0,
) -> None:
    """Three endpoints (ranks 0, 1, 2): 0 sends to 1 while 1 forwards to 2, overlapped.

    Checks that bytes arrive exactly (checksums), in order per sender, that sends and
    receives to different peers can be in flight at once, and that ``endpoint`` is stable;
    that a phantom bucket (no bytes), an empty one and a truncated one (fewer bytes than it
    announces) arrive as sent, so the receiver's checks see what the sender sent; and that
    after ``connect`` drops a member the others still talk (a rebuilt chain: 0 -> 2).

    The memory contract too: the sender overwrites each bucket's buffer as soon as ``send``
    returned (senders recycle their buffers), and the middle endpoint receives with an
    ``alloc`` (relays hand out recycled buffers) and forwards straight from what it got.
    """
    eps: list[WeightTransport] = []
    for rank in range(3):
        made = make_transport(rank)
        eps.append(await made if isinstance(made, Awaitable) else made)
    peers = {}
    for rank, t in enumerate(eps):
        await t.open("trainer" if rank == 0 else "relay", rank, {})
        peers[rank] = t.endpoint()
        again = t.endpoint()
        require(
            again == peers[rank],
            f"endpoint() of rank {rank} returned {peers[rank]!r}, then {again!r}: it must "
            "return the same address on every call once open (peers connect to it)",
        )
    await asyncio.gather(*(t.connect(dict(peers)) for t in eps))
    buckets = []
    for i, n in enumerate(sizes):
        data = os.urandom(n)
        buckets.append(Bucket(1, i, n, checksum(data), data))
    odd = [
        Bucket(1, len(sizes), 4096, -1, None),  # phantom: a size, no bytes
        Bucket(1, len(sizes) + 1, 0, checksum(b""), b""),
        Bucket(1, len(sizes) + 2, 100, 7, os.urandom(60)),  # truncated on purpose
    ]
    buckets += odd

    async def sender() -> None:
        for b in buckets:
            if not b.data:
                await eps[0].send(b, 1)
                continue
            scratch = bytearray(b.data)
            await eps[0].send(Bucket(b.version, b.index, b.nbytes, b.checksum, scratch), 1)
            scratch[:] = b"\xee" * len(scratch)  # recycled the moment send returned

    handed: list[memoryview] = []

    def alloc(nbytes: int) -> memoryview:
        handed.append(memoryview(bytearray(nbytes)))
        return handed[-1]

    async def relay() -> list[Bucket]:
        got = []
        for _ in buckets:
            b = await eps[1].recv(0, alloc)
            got.append(
                Bucket(
                    b.version,
                    b.index,
                    b.nbytes,
                    b.checksum,
                    None if b.data is None else bytes(b.data),
                )
            )
            await eps[1].send(b, 2)
        return got

    async def tail() -> list[Bucket]:
        return [await eps[2].recv(1) for _ in buckets]

    _, mid, end = await asyncio.wait_for(asyncio.gather(sender(), relay(), tail()), timeout_s)
    for hop, got in (("0 -> 1", mid), ("1 -> 2", end)):
        order = [b.index for b in got]
        require(
            order == [b.index for b in buckets],
            f"{hop}: buckets arrived in the order {order}: recv(peer) returns one sender's "
            "buckets in the order it sent them",
        )
        for b, want in zip(got, buckets):
            head, sent = (
                (b.version, b.nbytes, b.checksum),
                (want.version, want.nbytes, want.checksum),
            )
            require(
                head == sent,
                f"{hop}: bucket {want.index} arrived as (version, nbytes, checksum) {head}, "
                f"sent as {sent}: carry the header as sent (the receiver checks it)",
            )
            if want.data is None:
                require(
                    b.data is None,
                    f"{hop}: a phantom bucket (data None: a size, no bytes) arrived with bytes: "
                    "send and deliver it as a header alone",
                )
                continue
            require(
                b.data is not None and bytes(b.data) == bytes(want.data),
                f"{hop}: bucket {want.index} ({want.nbytes} bytes, {len(want.data)} sent) "
                "arrived with other bytes: deliver exactly the bytes sent, also a truncated "
                "bucket (fewer than nbytes: the receiver's check rejects it), and finish with "
                "the sender's buffer before send returns (senders recycle it at once)",
            )

    # rank 1 leaves; the survivors link up directly, both ways
    rest = {0: peers[0], 2: peers[2]}
    await asyncio.gather(eps[0].connect(rest), eps[2].connect(rest))
    data = os.urandom(5000)
    fwd, back = Bucket(2, 0, 5000, checksum(data), data), Bucket(2, 1, 3, checksum(b"abc"), b"abc")
    _, got_fwd, _, got_back = await asyncio.wait_for(
        asyncio.gather(eps[0].send(fwd, 2), eps[2].recv(0), eps[2].send(back, 0), eps[0].recv(2)),
        timeout_s,
    )
    require(
        bytes(got_fwd.data or b"") == data and bytes(got_back.data or b"") == b"abc",
        "after connect() without rank 1, ranks 0 and 2 exchanged other bytes than they sent: "
        "connect(peers) links the endpoint to exactly the peers given, again on every call",
    )
    for t in eps:
        await t.close()
