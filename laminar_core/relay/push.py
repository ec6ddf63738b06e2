"""The trainer's side of the relay tier: its endpoint, chunking, staging, and the push.

``TrainerPush`` owns the trainer's ``WeightTransport`` endpoint (chain rank 0). Per version it
turns the trainer's export into an ``Outgoing`` stream of buckets for the master relay:

* **staged** (``stage=True``, real tensors): ``stage`` copies the whole export into one
  recycled host buffer and returns; the buckets are slices of it, checksummed as they go
  out. The trainer's stall is that copy, and the copy can be replayed to a new master.
* **streamed**: buckets are cut while the export is walked, so the trainer never holds the
  model as bytes; the last bucket is held back until the export is exhausted, so an export
  of the wrong size never completes a version anywhere.

A version's bucket count must be known before its first bucket leaves (every relay is told
how many to receive), and it follows from the model's size: the size of the previous version
(weights keep their size), or, for the first version, the export walked once to measure it.

Chunking: ``chunks`` (> 0) fixes the chunk count; else a link model ``(t_byte, t_start)``
(configured, the transport's ``link_model()``, or measured by ``calibrate``) gives the
latency model's ``k*``; with none of them ``bucket_bytes`` fixes the chunk size.
"""

from __future__ import annotations

import abc
import asyncio
import math
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from typing import Any

import torch

from laminar_core.interfaces import WeightTransport
from laminar_core.relay.latency import optimal_chunks
from laminar_core.relay.packing import UNSUMMED, BucketPacker, WeightIntegrityError, checksum
from laminar_core.relay.protocol import ABORT, PROBE, TRAINER_RANK
from laminar_core.types import Bucket, WeightManifest

Export = Iterable[tuple[str, torch.Tensor]] | AsyncIterable[tuple[str, torch.Tensor]]

_PAGE = 4096
_THREADED_COPY = 1 << 20  # staging copies of tensors this large run on a worker thread


async def _aiter(export: Export) -> AsyncIterator[tuple[str, torch.Tensor]]:
    if isinstance(export, AsyncIterable):
        async for item in export:
            yield item
    else:
        for item in export:
            yield item


async def peek(export: Export) -> tuple[torch.Tensor | None, Export]:
    """The export's first tensor (``None`` if empty) and the export, intact: whether a
    version is phantom (meta tensors, the simulator's) or on a GPU shows on the first."""
    if isinstance(export, list | tuple):
        return (export[0][1] if export else None), export
    it = _aiter(export)
    first = await anext(it, None)
    if first is None:
        return None, []

    async def rest() -> AsyncIterator[tuple[str, torch.Tensor]]:
        yield first
        async for item in it:
            yield item

    return first[1], rest()


async def materialise(export: Export) -> list[tuple[str, torch.Tensor]]:
    if isinstance(export, list):
        return export
    return [item async for item in _aiter(export)]


def export_bytes(export: list[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in export)


def check_bucket_size(version: int, index: int, nbytes: int, chunk: int, model_bytes: int) -> None:
    """Bucket ``index`` of a ``model_bytes`` version cut in ``chunk``-byte buckets must hold
    exactly its share (``index == count`` with ``nbytes == 0`` checks the count itself)."""
    count = math.ceil(model_bytes / chunk) if model_bytes else 0
    want = min(chunk, model_bytes - index * chunk)
    if index >= count or nbytes != want:
        raise WeightIntegrityError(
            f"version {version}: the export is not the announced {model_bytes} bytes "
            f"(bucket {index} has {nbytes}, expected {max(want, 0)}); weights must keep "
            "their names, shapes and dtypes between versions"
        )


class Outgoing:
    """One version's buckets on their way to the master relay (see module docstring).

    ``count`` buckets of at most ``chunk`` bytes, ``nbytes`` in all. ``send(master)`` sends
    them, checking each size against the announced model; ``manifest`` is complete once the
    export has been walked (``manifest_ready`` is set then: the relays need it to commit).
    """

    def __init__(
        self,
        version: int,
        nbytes: int,
        chunk: int,
        transport: WeightTransport | None,
        *,
        staged: list[Bucket] | None = None,
        packer: BucketPacker | None = None,
        export: Export | None = None,
        manifest: WeightManifest | None = None,
    ) -> None:
        self.version = version
        self.nbytes = nbytes
        self.chunk = chunk
        self.count = math.ceil(nbytes / chunk) if nbytes else 0
        self._transport = transport
        self._staged = staged
        self._packer = packer
        self._export = export
        self._manifest = manifest
        # set once every bucket is cut and summed (just before the last one leaves): the
        # manifest is complete and the relays may commit with it
        self.manifest_ready = asyncio.Event()

    @property
    def staged(self) -> bool:
        return self._staged is not None

    @property
    def manifest(self) -> WeightManifest:
        if self._staged is not None:
            assert self._manifest is not None
            m = self._manifest
            sizes = [b.nbytes for b in self._staged]
            return WeightManifest(m.version, m.tensors, sizes, [b.checksum for b in self._staged])
        assert self._packer is not None
        return self._packer.manifest

    def check_size(self, index: int, nbytes: int) -> None:
        check_bucket_size(self.version, index, nbytes, self.chunk, self.nbytes)

    async def _buckets(self) -> AsyncIterator[Bucket]:
        if self._staged is not None:
            for b in self._staged:
                if b.checksum == UNSUMMED and b.data is not None:
                    b.checksum = checksum(b.data)  # taken as it goes out, not in the stall
                yield b
            return
        assert self._packer is not None and self._export is not None
        async for name, t in _aiter(self._export):
            for b in self._packer.add(name, t):
                yield b
        for b in self._packer.finish():
            yield b
        self._export = None  # walked: a replay needs a fresh export or the staged copy

    def _wire(self) -> WeightTransport:
        if self._transport is None:
            raise RuntimeError(f"version {self.version}: this stream has no transport to send on")
        return self._transport

    async def send(self, master_rank: int) -> None:
        """Send every bucket to ``master_rank``: each is checked before it leaves, and the
        last is held back until the export is exhausted, so a wrong-sized export never
        completes a version. ``manifest_ready`` is set just before the last bucket goes."""
        wire = self._wire()
        held: Bucket | None = None
        sent = 0
        async for b in self._buckets():
            self.check_size(b.index, b.nbytes)
            if held is not None:
                await wire.send(held, master_rank)
            held = b
            sent += 1
        if sent != self.count:
            self.check_size(sent, 0)
        self.manifest_ready.set()
        if held is not None:
            await wire.send(held, master_rank)

    async def abort(self, master_rank: int) -> None:
        """The abort marker: it travels the chain like data, so every link is left empty."""
        await self._wire().send(Bucket(self.version, ABORT, 0), master_rank)


class Push(abc.ABC):
    """The trainer's side of the tier (rank 0), as the ``RelayTier`` drives it: here
    (``TrainerPush``) or where the trainer's rank 0 is (the Ray runtime's ``RemotePush``).
    Holds the chunking and staging settings; ``prepare`` turns one version into an
    ``Outgoing`` stream for the master."""

    def __init__(
        self,
        *,
        bucket_bytes: int = 64 << 20,
        chunks: int = 0,
        link: tuple[float, float] | None = None,
        max_chunks: int = 4096,
        stage: bool = False,
    ) -> None:
        self.configure(bucket_bytes, chunks, link, max_chunks, stage)
        self.model_bytes: int | None = None  # the size of the last version published

    def configure(
        self,
        bucket_bytes: int,
        chunks: int,
        link: tuple[float, float] | None,
        max_chunks: int,
        stage: bool,
    ) -> None:
        """The chunking and staging settings (see module docstring)."""
        self.bucket_bytes, self.chunks, self.link = bucket_bytes, chunks, link
        self.max_chunks, self.stage = max_chunks, stage

    @abc.abstractmethod
    async def open(self) -> Any:
        """Open the trainer's endpoint (rank 0); returns the address relays reach it at."""

    @abc.abstractmethod
    async def connect(self, peers: dict[int, Any]) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    @abc.abstractmethod
    async def send_probe(self, rank: int, size: int, reps: int) -> None:
        """``reps`` calibration buckets of ``size`` bytes to ``rank`` (dropped there)."""

    @abc.abstractmethod
    async def prepare(
        self,
        version: int,
        export: Export | None,
        endpoints: int,
        model_bytes: int | None = None,
        stage: bool | None = None,
    ) -> Outgoing:
        """The version's outgoing stream (see ``TrainerPush.prepare``)."""


class TrainerPush(Push):
    """The trainer's endpoint of the relay chain (rank 0), in this process."""

    def __init__(self, transport: WeightTransport, **settings: Any) -> None:
        super().__init__(**settings)
        self.transport = transport
        self._ring: list[memoryview] = []  # streamed bucket buffers, recycled
        self._arena: list[memoryview] = []  # the staged version's buffer, recycled

    # --- the endpoint ----------------------------------------------------------------------

    async def open(self) -> Any:
        await self.transport.open("trainer", TRAINER_RANK, {})
        return self.transport.endpoint()

    async def connect(self, peers: dict[int, Any]) -> None:
        await self.transport.connect(peers)

    async def close(self) -> None:
        await self.transport.close()

    # --- chunking --------------------------------------------------------------------------

    def chunk_bytes(self, model_bytes: int, endpoints: int, align: bool = False) -> int:
        """Bucket size for a model of ``model_bytes`` sent down a chain of ``endpoints``
        (trainer included). ``align`` (real bytes) rounds a size from ``k`` up to whole
        pages, so every bucket of a version starts page-aligned in the sender's and the
        receivers' buffers (typed views and DMA want that); phantom versions keep the
        model's exact sizes."""
        k = self.chunks
        link = self.link or self.transport.link_model()
        if k <= 0 and link is not None:
            t_byte, t_start = link
            k = optimal_chunks(endpoints, model_bytes, t_byte, t_start, self.max_chunks)
        if k > 0:
            chunk = max(1, math.ceil(model_bytes / k))
            if align and chunk > _PAGE:
                chunk = math.ceil(chunk / _PAGE) * _PAGE
            return chunk
        return self.bucket_bytes

    async def send_probe(self, rank: int, size: int, reps: int) -> None:
        b = Bucket(PROBE, 0, size, 0, bytes(size))
        for _ in range(reps):
            await self.transport.send(b, rank)

    # --- one version -------------------------------------------------------------------------

    async def prepare(
        self,
        version: int,
        export: Export | None,
        endpoints: int,
        model_bytes: int | None = None,
        stage: bool | None = None,
    ) -> Outgoing:
        """The version's outgoing stream: with staging (``stage``, default ``self.stage``)
        and real tensors it is copied to host memory now (this is the trainer's stall);
        otherwise it is streamed as the master takes it (``Outgoing.staged`` tells which)."""
        if export is None:
            raise ValueError("a push in this process needs the export to send")
        first, export = await peek(export)
        real = first is not None and first.device.type != "meta"
        if model_bytes is None:
            model_bytes = self.model_bytes
        if model_bytes is None:
            export = await materialise(export)  # the first version: walk it to size it
            model_bytes = export_bytes(export)
        chunk = self.chunk_bytes(model_bytes, endpoints, align=real)
        if (self.stage if stage is None else stage) and first is not None and real:
            return await self._stage(version, export, model_bytes, chunk, first)
        packer = BucketPacker(version=version, bucket_bytes=chunk, reuse=True, ring=self._ring)
        return Outgoing(version, model_bytes, chunk, self.transport, packer=packer, export=export)

    async def _stage(
        self, version: int, export: Export, model_bytes: int, chunk: int, first: torch.Tensor
    ) -> Outgoing:
        """Copy ``export`` into the recycled arena (large tensors on a worker thread, so the
        event loop keeps serving) and cut its buckets; checksums are left for the push."""
        packer = BucketPacker(
            version=version,
            bucket_bytes=chunk,
            ring=self._arena,
            pin=first.device.type == "cuda",
            checksums=False,  # taken as the buckets go out: the trainer waits for the copy only
            arena_bytes=model_bytes,
        )
        buckets: list[Bucket] = []
        async for name, t in _aiter(export):
            cut = packer.add(name, t)
            big = t.numel() * t.element_size() >= _THREADED_COPY
            buckets += await asyncio.to_thread(list, cut) if big else list(cut)
        buckets += packer.finish()
        for b in buckets:
            check_bucket_size(version, b.index, b.nbytes, chunk, model_bytes)
        if len(buckets) != math.ceil(model_bytes / chunk):
            check_bucket_size(version, len(buckets), 0, chunk, model_bytes)
        return Outgoing(
            version,
            model_bytes,
            chunk,
            self.transport,
            staged=buckets,
            manifest=packer.manifest,
        )
