"""The relay tier: trainer → master relay → pipelined chain → node relays → replicas.

The trainer pushes a version to the master relay only and resumes (its stall does not grow
with the number of relays). The master then forwards it down a chain bucket by bucket:
relay ``i`` forwards bucket ``j`` while it receives bucket ``j + 1``. Each relay commits
the version only once every bucket arrived and passed its checksum. Broadcasts run one after
the other in version order; a newer publish waits for the previous broadcast.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from laminar_core.interfaces import WeightTransport
from laminar_core.relay.latency import optimal_chunks
from laminar_core.relay.node import NodeRelay
from laminar_core.relay.packing import BucketPacker, WeightIntegrityError
from laminar_core.types import Bucket

log = logging.getLogger(__name__)

TRAINER_RANK = 0  # relays are ranks 1..p in chain order; relay rank 1 is the master
ABORT = -1  # bucket index of the marker that abandons a version down the chain


@dataclass
class PublishResult:
    version: int
    bytes: int
    buckets: int
    stall_seconds: float  # trainer-side: until the master holds every bucket


class RelayTier:
    """Relays ``relays[0]`` (master) .. ``relays[-1]`` chained in that order.

    ``transport_factory(rank)`` returns an unopened ``WeightTransport`` per endpoint.
    ``bucket_bytes`` fixes the chunk size; ``chunks`` (> 0) fixes the chunk count instead;
    with neither, the count comes from the latency model using the transport's
    ``link_model()`` (``(t_byte, t_start)``) when it has one.
    """

    def __init__(
        self,
        relays: list[NodeRelay],
        transport_factory: Callable[[int], WeightTransport],
        bucket_bytes: int = 64 << 20,
        chunks: int = 0,
    ) -> None:
        if not relays:
            raise ValueError("the relay tier needs at least one relay")
        self.relays = relays
        self._factory = transport_factory
        self.bucket_bytes = bucket_bytes
        self.chunks = chunks
        self._transports: dict[int, WeightTransport] = {}
        self._previous: asyncio.Task | None = None
        self._model_bytes: int | None = None  # size of the last version published
        self.history: list[PublishResult] = []

    async def open(self) -> None:
        ranks = [TRAINER_RANK, *range(1, len(self.relays) + 1)]
        for r in ranks:
            t = self._factory(r)
            await t.open("trainer" if r == TRAINER_RANK else "relay", r, {})
            self._transports[r] = t

    async def close(self) -> None:
        if self._previous is not None:
            await asyncio.gather(self._previous, return_exceptions=True)
        for t in self._transports.values():
            await t.close()

    def chunk_bytes(self, model_bytes: int) -> int:
        """Bucket size for a model of ``model_bytes`` (see class docstring)."""
        k = self.chunks
        link = getattr(self._transports.get(1), "link_model", None)
        if k <= 0 and link is not None:
            t_byte, t_start = link()
            k = optimal_chunks(len(self.relays) + 1, model_bytes, t_byte, t_start)
        if k > 0:
            return max(1, math.ceil(model_bytes / k))
        return self.bucket_bytes

    async def publish(
        self,
        version: int,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        model_bytes: int | None = None,
    ) -> PublishResult:
        """Push ``version`` to the master; return once the master holds it (the trainer's
        stall). The chain broadcast continues in the background.

        The export is streamed bucket by bucket, so the trainer holds one bucket at a time.
        The chunk size needs the model's size up front: ``model_bytes`` if given, else the
        previous version's (weights keep their size); only the very first publish walks the
        export once to measure it.
        """
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        if self._previous is not None:
            await asyncio.gather(self._previous, return_exceptions=True)
        if model_bytes is None:
            model_bytes = self._model_bytes
        if model_bytes is None:
            named_tensors = list(named_tensors)
            model_bytes = sum(t.numel() * t.element_size() for _, t in named_tensors)
        chunk = self.chunk_bytes(model_bytes)
        count = math.ceil(model_bytes / chunk)
        packer = BucketPacker(named_tensors, version, chunk)
        chain = [(rank, r) for rank, r in enumerate(self.relays, start=1) if r.alive]
        for _, r in chain:
            r.begin(version, count)
        master_done = loop.create_future()

        def check(index: int, nbytes: int) -> None:
            want = min(chunk, model_bytes - index * chunk)
            if index >= count or nbytes != want:
                raise WeightIntegrityError(
                    f"version {version}: the export is not the announced {model_bytes} bytes "
                    f"(bucket {index} has {nbytes}, expected {max(want, 0)}); weights must keep "
                    "their names, shapes and dtypes between versions"
                )

        async def trainer_send() -> None:
            # Each bucket is checked before it leaves, and the last one is held back until
            # the export is exhausted, so a wrong-sized export never completes a version.
            tr, dst, held = self._transports[TRAINER_RANK], chain[0][0], None
            for b in packer.buckets():
                check(b.index, b.nbytes)
                if held is not None:
                    await tr.send(held, dst)
                held = b
            if len(packer.sizes) != count:
                check(len(packer.sizes), 0)
            if held is not None:
                await tr.send(held, dst)

        async def abort_chain() -> None:
            # Travels the chain like data, so every link is left empty for the next publish.
            await self._transports[TRAINER_RANK].send(Bucket(version, ABORT, 0), chain[0][0])
            await asyncio.gather(*pipes, return_exceptions=True)

        async def relay_pipe(i: int) -> None:
            """Receive every bucket from the predecessor, forwarding each as it lands.

            A bucket that fails its checks (or an abort marker from upstream) turns the
            rest of this version into a drain: the relay keeps its last good version,
            forwards one abort marker, and still reads what upstream sends so every link
            is empty for the next publish.
            """
            rank, relay = chain[i]
            tr = self._transports[rank]
            pred = TRAINER_RANK if i == 0 else chain[i - 1][0]
            nxt = chain[i + 1][0] if i + 1 < len(chain) else None
            fwd: asyncio.Queue[Bucket | None] = asyncio.Queue()

            async def forward() -> None:
                while (b := await fwd.get()) is not None:
                    await tr.send(b, nxt)  # type: ignore[arg-type]

            fwd_task = asyncio.ensure_future(forward()) if nxt is not None else None
            failure: BaseException | None = None
            try:
                for _ in range(count):
                    b = await tr.recv(pred)
                    if b.index == ABORT:  # upstream gave up: it sends nothing after this
                        if failure is None:
                            failure = WeightIntegrityError(f"version {version} abandoned upstream")
                            if fwd_task is not None:
                                fwd.put_nowait(b)
                        break
                    if failure is not None:
                        continue  # draining what upstream still sends
                    try:
                        relay.put(b)
                    except WeightIntegrityError as e:
                        failure, b = e, Bucket(version, ABORT, 0)
                    if fwd_task is not None:
                        fwd.put_nowait(b)
            finally:
                if fwd_task is not None:
                    fwd.put_nowait(None)
            try:
                if failure is not None:
                    relay.abandon(version)
                    raise failure
                if i == 0 and not master_done.done():
                    master_done.set_result(loop.time())
                relay.commit(packer.manifest)  # serve it as soon as it is complete here
            finally:
                if fwd_task is not None:
                    await fwd_task

        pipes = [asyncio.ensure_future(relay_pipe(i)) for i in range(len(chain))]
        try:
            await trainer_send()
        except WeightIntegrityError:
            await abort_chain()
            raise
        await asyncio.wait([master_done, pipes[0]], return_when=asyncio.FIRST_COMPLETED)
        if pipes[0].done() and pipes[0].exception() is not None:
            raise pipes[0].exception()  # type: ignore[misc]
        self._model_bytes = model_bytes
        result = PublishResult(version, model_bytes, count, loop.time() - t0)
        self.history.append(result)

        async def finish() -> None:
            outcomes = await asyncio.gather(*pipes, return_exceptions=True)
            for (_, relay), out in zip(chain, outcomes):
                if isinstance(out, BaseException):
                    relay.abandon(version)
                    log.error(
                        "relay %s failed to take version %s: %s", relay.relay_id, version, out
                    )

        self._previous = asyncio.ensure_future(finish())
        return result

    def relay_for_node(self, node: int) -> NodeRelay:
        for r in self.relays:
            if r.node == node:
                return r
        raise LookupError(f"no relay on node {node}")
